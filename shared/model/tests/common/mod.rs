//! Shared helpers for the model tests: finding the model file and a tiny step scheduler.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers: fail loudly

pub mod gemma3_reference;

use std::collections::HashMap;
use std::path::PathBuf;

use pdmesh_model::{default_model_path, GgufExecutor, GgufTextCodec, ModelOptions};
use pdmesh_model_api::{Executor, KvCache, KvCacheSpec};
use pdmesh_protocol::{SamplingParams, ScheduledChunk};

/// The model file, or `None` when `PDMESH_SKIP_MODEL_TESTS=1`. A missing file fails the test:
/// CI fetches the model first, so absence is a setup error, not a reason to pass silently.
pub fn model_path() -> Option<PathBuf> {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping a test that needs the model");
        return None;
    }
    let p = default_model_path();
    assert!(
        p.is_file(),
        "model file {} not found: run scripts/fetch-model.sh (or set PDMESH_MODEL_PATH), \
         or set PDMESH_SKIP_MODEL_TESTS=1 to skip the model tests",
        p.display()
    );
    Some(p)
}

/// `file` in `$PDMESH_MODEL_DIR` (else the fetch cache), or `None` when
/// `PDMESH_SKIP_MODEL_TESTS=1`; a missing file fails the test, naming the fetch command.
pub fn model_file(name: &str, file: &str) -> Option<PathBuf> {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping a test that needs {file}");
        return None;
    }
    let dir = std::env::var_os("PDMESH_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/pdmesh/models"));
    let p = dir.join(file);
    assert!(
        p.is_file(),
        "{} not found: run scripts/fetch-model.sh {name} (or set PDMESH_SKIP_MODEL_TESTS=1)",
        p.display()
    );
    Some(p)
}

pub fn load() -> Option<(GgufExecutor, GgufTextCodec)> {
    let p = model_path()?;
    Some(pdmesh_model::load_gguf(&p, &ModelOptions::default()).expect("load model"))
}

pub fn kv_cache(exec: &impl Executor, num_blocks: u32, block_size: u32) -> KvCache {
    let f = exec.facts();
    KvCache::new_heap(KvCacheSpec {
        num_layers: f.num_layers,
        num_blocks,
        block_size,
        num_kv_heads: f.num_kv_heads,
        head_dim: f.head_dim,
    })
}

pub fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens: 1 << 20, ..SamplingParams::default() }
}

/// One request driven by [`run`].
#[derive(Debug, Clone)]
pub struct Req {
    pub id: String,
    pub prompt: Vec<u32>,
    pub blocks: Vec<u32>,
    pub generated: Vec<u32>,
    /// Tokens already in the KV cache.
    pub computed: usize,
}

impl Req {
    /// A request owning blocks `first_block..first_block + n_blocks`.
    pub fn new(id: &str, prompt: Vec<u32>, first_block: u32, n_blocks: u32) -> Self {
        Self {
            id: id.into(),
            prompt,
            blocks: (first_block..first_block + n_blocks).collect(),
            generated: vec![],
            computed: 0,
        }
    }
}

/// Run all requests together until each has `n_new` tokens: each step carries, for every
/// unfinished request, its next prefill chunk (at most `chunk` tokens) or its one decode token.
pub fn run<E: Executor>(exec: &mut E, kv: &mut KvCache, reqs: &mut [Req], n_new: usize, chunk: usize) {
    run_with(exec, kv, reqs, n_new, chunk, |_| {})
}

/// [`run`], calling `after_step` after every step that sampled.
pub fn run_with<E: Executor>(
    exec: &mut E,
    kv: &mut KvCache,
    reqs: &mut [Req],
    n_new: usize,
    chunk: usize,
    mut after_step: impl FnMut(&E),
) {
    loop {
        let mut chunks = Vec::new();
        for r in reqs.iter() {
            if r.generated.len() >= n_new {
                continue;
            }
            let (tokens, sample) = if r.computed < r.prompt.len() {
                let end = r.computed.saturating_add(chunk).min(r.prompt.len());
                (r.prompt[r.computed..end].to_vec(), end == r.prompt.len())
            } else {
                (vec![*r.generated.last().expect("decode after prefill")], true)
            };
            chunks.push(ScheduledChunk {
                request_id: r.id.clone(),
                token_ids: tokens,
                start_pos: r.computed as u32,
                block_ids: r.blocks.clone(),
                sample,
                sampling: greedy(),
                output_index: r.generated.len() as u32,
                guided_output: Vec::new(),
                history: None,
            });
        }
        if chunks.is_empty() {
            return;
        }
        let out = exec.execute(kv, &chunks).expect("execute");
        if !out.is_empty() {
            after_step(exec);
        }
        let by_id: HashMap<_, _> = out.into_iter().map(|s| (s.request_id.clone(), s.token_id)).collect();
        for (r, c) in reqs.iter_mut().filter(|r| r.generated.len() < n_new).zip(&chunks) {
            assert_eq!(r.id, c.request_id);
            r.computed += c.token_ids.len();
            if c.sample {
                r.generated.push(by_id[&r.id]);
            }
        }
    }
}

/// Greedy continuation with the reference, one token per forward call; also returns the logits
/// that chose each generated token.
pub fn reference_greedy(path: &std::path::Path, prompt: &[u32], n_new: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut f = std::fs::File::open(path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut model = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(
        content,
        &mut f,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let mut step = |tok: u32, pos: usize| {
        let input = candle_core::Tensor::new(&[tok], &candle_core::Device::Cpu).unwrap().unsqueeze(0).unwrap();
        model.forward(&input, pos).unwrap().squeeze(0).unwrap().to_vec1::<f32>().unwrap()
    };
    let mut logits = Vec::new();
    for (pos, &tok) in prompt.iter().enumerate() {
        logits = step(tok, pos);
    }
    let (mut out, mut all) = (Vec::new(), Vec::new());
    while out.len() < n_new {
        let next = pdmesh_model_api::sampling::argmax(&logits);
        out.push(next);
        all.push(logits);
        if out.len() == n_new {
            break;
        }
        logits = step(next, prompt.len() + out.len() - 1);
    }
    (out, all)
}

/// Eight chat prompts of different lengths (batching and chunking tests).
pub const EIGHT_PROMPTS: [&str; 8] = [
    "Tell me a short story about a robot who learns to paint.",
    "What is 17 times 23?",
    "List three colours.",
    "Explain photosynthesis in one sentence.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into French.",
    "Why is the sky blue?",
    "Give me a name for a cat.",
];
