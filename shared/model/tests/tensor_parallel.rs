//! Tensor parallelism (D111): a model split over TP ranks computes exactly what one process
//! computes. Each rank's executor runs on its own thread with its own slice of the weights,
//! writing and reading its own KV heads of one cache the ranks share, gathering through the same shared-memory group the worker processes use;
//! rank 0's logits must equal the single process's bit for bit at every step, so the greedy
//! tokens are the same by construction (16 prompts, batched, prefill chunked, 32 new tokens).
//! Qwen2.5-0.5B over 2 ranks (one KV head each), SmolLM2 over 3 (its KV-head count), Gemma 3
//! over 2 (its one KV head replicated on both).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// the ranks' shared cache is a file each maps, as the worker processes do
#![allow(unsafe_code)]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::mpsc;

use pdmesh_model::tp::{Gather, ShmGroup, TpRank};
use pdmesh_model::{GgufExecutor, GgufTextCodec, ModelOptions};
use pdmesh_model_api::{Executor, KvCache, TextCodec};
use pdmesh_protocol::{SampledToken, ScheduledChunk};

const N_NEW: usize = 32;
const MAX_LEN: u32 = 512;
const CHUNK: usize = 24;

fn options() -> ModelOptions {
    ModelOptions { max_model_len: Some(MAX_LEN), threads: Some(1), ..Default::default() }
}

/// Sixteen prompts of different lengths and kinds.
fn prompts(codec: &GgufTextCodec) -> Vec<Vec<u32>> {
    let texts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "1, 2, 3, 5, 8, 13, 21,",
        "The three primary colours are",
        "SELECT name FROM users WHERE",
        "In 1969, the first humans",
        "A recipe for pancakes: first,",
        "The quick brown fox",
        "Photosynthesis is the process by which",
        "fn main() {\n    let v = vec![1, 2, 3];\n",
        "Dear hiring manager, I am writing to apply for",
        "The largest planet in the solar system is",
        "To be, or not to be, that is",
        "Water boils at",
        "Translate to French: good morning ->",
    ];
    texts.iter().map(|t| codec.encode_prompt(t).unwrap()).collect()
}

struct Req {
    id: String,
    prompt: Vec<u32>,
    blocks: Vec<u32>,
    generated: Vec<u32>,
    computed: usize,
}

/// The next step's chunks: each unfinished request's next prefill chunk or its decode token.
fn next_chunks(reqs: &[Req]) -> Vec<ScheduledChunk> {
    reqs.iter()
        .filter(|r| r.generated.len() < N_NEW)
        .map(|r| {
            let (tokens, sample) = if r.computed < r.prompt.len() {
                let end = (r.computed + CHUNK).min(r.prompt.len());
                (r.prompt[r.computed..end].to_vec(), end == r.prompt.len())
            } else {
                (vec![*r.generated.last().unwrap()], true)
            };
            ScheduledChunk {
                request_id: r.id.clone(),
                token_ids: tokens,
                start_pos: r.computed as u32,
                block_ids: r.blocks.clone(),
                sample,
                sampling: common::greedy(),
                output_index: r.generated.len() as u32,
                guided_output: Vec::new(),
                history: None,
            }
        })
        .collect()
}

fn apply(reqs: &mut [Req], chunks: &[ScheduledChunk], out: &[SampledToken]) {
    let by_id: HashMap<_, _> = out.iter().map(|s| (s.request_id.clone(), s.token_id)).collect();
    for c in chunks {
        let r = reqs.iter_mut().find(|r| r.id == c.request_id).unwrap();
        r.computed += c.token_ids.len();
        if c.sample {
            r.generated.push(by_id[&r.id]);
        }
    }
}

fn requests(prompts: &[Vec<u32>]) -> Vec<Req> {
    let per = (MAX_LEN / 16) as usize;
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Req {
            id: format!("r{i}"),
            prompt: p.clone(),
            blocks: ((i * per) as u32..((i + 1) * per) as u32).collect(),
            generated: Vec::new(),
            computed: 0,
        })
        .collect()
}

fn kv_for(exec: &GgufExecutor, n_prompts: usize) -> KvCache {
    common::kv_cache(exec, (n_prompts as u32) * (MAX_LEN / 16), 16)
}

/// One rank's mapping of the cache file the ranks share.
#[derive(Debug)]
struct SharedCache(memmap2::MmapMut);

impl pdmesh_model_api::kv_cache::KvBacking for SharedCache {
    fn as_slice(&self) -> &[f32] {
        // SAFETY: any bit pattern is an f32; the mapping is page-aligned (checked below).
        let (head, mid, _) = unsafe { self.0.align_to::<f32>() };
        assert!(head.is_empty());
        mid
    }
    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as above.
        let (head, mid, _) = unsafe { self.0.align_to_mut::<f32>() };
        assert!(head.is_empty());
        mid
    }
}

/// A cache over `file` (created at the right size by rank 0), mapped by this rank.
fn shared_kv(exec: &GgufExecutor, n_prompts: usize, file: &Path) -> KvCache {
    let spec = *kv_for(exec, 1).spec();
    let spec = pdmesh_model_api::KvCacheSpec { num_blocks: (n_prompts as u32) * (MAX_LEN / 16), ..spec };
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(file).unwrap();
    let bytes = (spec.total_floats() * 4) as u64;
    if f.metadata().unwrap().len() < bytes {
        f.set_len(bytes).unwrap();
    }
    // SAFETY: the file stays at its size while the test runs; ranks write disjoint heads.
    let map = unsafe { memmap2::MmapMut::map_mut(&f) }.unwrap();
    KvCache::with_backing(spec, Box::new(SharedCache(map))).unwrap()
}

/// Every step's chunks and the logits rank 0 (or the single process) computed for it, and the
/// tokens generated.
type Trace = (Vec<Vec<f32>>, Vec<Vec<u32>>);

fn single(path: &Path, prompts: &[Vec<u32>]) -> Trace {
    let mut exec = GgufExecutor::load(path, &options()).unwrap();
    let mut kv = kv_for(&exec, prompts.len());
    let mut reqs = requests(prompts);
    let mut logits = Vec::new();
    loop {
        let chunks = next_chunks(&reqs);
        if chunks.is_empty() {
            break;
        }
        let out = exec.execute(&mut kv, &chunks).unwrap();
        if !out.is_empty() {
            logits.push(exec.last_logits().to_vec());
        }
        apply(&mut reqs, &chunks, &out);
    }
    (logits, reqs.into_iter().map(|r| r.generated).collect())
}

/// The same requests over `size` TP ranks on threads: rank 0 plans the steps and hands each to
/// the other ranks, as the node's rank-0 worker hands its peers the engine's step.
fn tensor_parallel(path: &Path, size: usize, prompts: &[Vec<u32>]) -> Trace {
    let stem = path.file_stem().unwrap().to_string_lossy();
    let file = std::env::temp_dir().join(format!("pdmesh-tp-model-test-{stem}-{size}-{}", std::process::id()));
    let cache_file = file.with_extension("kv");
    let _ = std::fs::remove_file(&cache_file);
    let leader_group = ShmGroup::create(&file, size, ShmGroup::section_bytes_for(1 << 18)).unwrap();
    let mut followers = Vec::new();
    for rank in 1..size {
        let (tx, rx) = mpsc::channel::<Option<Vec<ScheduledChunk>>>();
        let (done_tx, done_rx) = mpsc::channel::<usize>();
        let (path, file, cache_file) = (path.to_path_buf(), file.clone(), cache_file.clone());
        let n_prompts = prompts.len();
        let handle = std::thread::spawn(move || {
            let group: Box<dyn Gather> = Box::new(ShmGroup::open(&file, rank).unwrap());
            let mut exec = GgufExecutor::load_tp(&path, &options(), TpRank { rank, size }, Some(group)).unwrap();
            let mut kv = shared_kv(&exec, n_prompts, &cache_file);
            while let Ok(Some(chunks)) = rx.recv() {
                let out = exec.execute(&mut kv, &chunks).unwrap();
                // sampling happens once, on rank 0
                done_tx.send(out.len()).unwrap();
            }
        });
        followers.push((tx, done_rx, handle));
    }
    let tp = TpRank { rank: 0, size };
    let mut exec = GgufExecutor::load_tp(path, &options(), tp, Some(Box::new(leader_group))).unwrap();
    // the cache holds every KV head (the node's ranks share one); this rank writes its own
    assert_eq!(exec.facts().num_kv_heads as usize, exec.config().n_kv_heads);
    let mut kv = shared_kv(&exec, prompts.len(), &cache_file);
    let mut reqs = requests(prompts);
    let mut logits = Vec::new();
    loop {
        let chunks = next_chunks(&reqs);
        if chunks.is_empty() {
            break;
        }
        for (tx, _, _) in &followers {
            tx.send(Some(chunks.clone())).unwrap();
        }
        let out = exec.execute(&mut kv, &chunks).unwrap();
        for (_, done, _) in &followers {
            assert_eq!(done.recv().unwrap(), 0, "a rank other than 0 sampled");
        }
        if !out.is_empty() {
            logits.push(exec.last_logits().to_vec());
        }
        apply(&mut reqs, &chunks, &out);
    }
    for (tx, _, handle) in followers {
        tx.send(None).unwrap();
        handle.join().unwrap();
    }
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&cache_file);
    (logits, reqs.into_iter().map(|r| r.generated).collect())
}

fn check(path: &Path, size: usize) {
    let (_, codec) = pdmesh_model::load_gguf(path, &options()).unwrap();
    let prompts = prompts(&codec);
    let (want_logits, want) = single(path, &prompts);
    let (got_logits, got) = tensor_parallel(path, size, &prompts);
    assert_eq!(got, want, "greedy tokens over {size} TP ranks differ from one process's");
    assert_eq!(got_logits.len(), want_logits.len());
    for (step, (g, w)) in got_logits.iter().zip(&want_logits).enumerate() {
        let same = g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "step {step}: logits over {size} TP ranks are not bit-equal to one process's");
    }
    eprintln!("{}: {} prompts x {N_NEW} tokens over TP {size}: identical", path.display(), prompts.len());
}

#[test]
fn qwen2_over_two_ranks_equals_one_process_bit_for_bit() {
    let Some(path) = common::model_file("qwen2.5-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") else { return };
    check(&path, 2);
}

#[test]
fn smollm2_over_three_ranks_equals_one_process_bit_for_bit() {
    let Some(path) = common::model_path() else { return };
    check(&path, 3);
}

#[test]
fn gemma3_over_two_ranks_with_its_kv_head_replicated_equals_one_process() {
    let Some(path) = common::model_file("gemma3-270m", "gemma-3-270m-q4_k_m.gguf") else { return };
    check(&path, 2);
}

/// A split the model's shape does not allow is refused at load, naming the count.
#[test]
fn a_split_the_heads_do_not_allow_is_refused_by_name() {
    let Some(path) = common::model_path() else { return };
    // SmolLM2: 9 heads
    let err = GgufExecutor::load_tp(&path, &options(), TpRank { rank: 0, size: 2 }, None).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("9 attention heads") && msg.contains("tensor_parallel_size 2"), "{msg}");
}
