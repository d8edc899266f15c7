//! Prefix caching on the real model (PDMESH_MODEL_PATH): the KV of a cached block is
//! bit-identical to the same block computed from scratch, and a request that starts from a
//! cached prefix generates the same greedy tokens as one that computes everything.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use pdmesh_engine_core::scheduler::{Scheduler, SchedulerConfig};
use pdmesh_model::{default_model_path, GgufExecutor, ModelOptions};
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{ChatMessage, Executor, KvCache, KvCacheSpec, TextCodec};
use pdmesh_protocol::{ConnectorCall, EngineRequest, ModelRunnerOutput, SamplingParams, ScheduledChunk};

const BS: u32 = 16;
const N_NEW: u32 = 16;
const SYSTEM: &str = "You are a terse assistant for a logistics company. Answer in one sentence, \
    never use lists, and always mention the warehouse code when one is given. The warehouse codes \
    are NW-1 for Seattle, SW-2 for Phoenix, NE-3 for Boston and SE-4 for Miami.";

fn load() -> Option<GgufExecutor> {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping a test that needs the model");
        return None;
    }
    let p = default_model_path();
    assert!(p.is_file(), "model file {} not found: run scripts/fetch-model.sh", p.display());
    let (exec, codec) = pdmesh_model::load_gguf(&p, &ModelOptions::default()).expect("load model");
    PROMPTS.with(|cell| {
        let render = |q: &str| {
            let msgs = [ChatMessage::text("system", SYSTEM), ChatMessage::text("user", q)];
            codec.encode(&codec.render_chat(&msgs).unwrap()).unwrap()
        };
        *cell.borrow_mut() = vec![render("Where do parcels for Boston ship from?"), render("Which code is Miami?")];
    });
    Some(exec)
}

thread_local! {
    static PROMPTS: std::cell::RefCell<Vec<Vec<u32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn kv_cache(exec: &GgufExecutor, num_blocks: u32) -> KvCache {
    let f = exec.facts();
    KvCache::new_heap(KvCacheSpec {
        num_layers: f.num_layers,
        num_blocks,
        block_size: BS,
        num_kv_heads: f.num_kv_heads,
        head_dim: f.head_dim,
    })
}

fn scheduler(caching: bool, budget: u32) -> Scheduler {
    let mut s = Scheduler::new(SchedulerConfig {
        block_size: BS,
        num_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 1024,
    });
    assert!(s.set_prefix_caching(caching));
    s.set_cache_salt("SmolLM2-135M-Instruct");
    s
}

/// Run `prompt` to `N_NEW` greedy tokens through the scheduler and the model. Returns the
/// tokens, the cached-token count reported, and every chunk scheduled.
fn generate(
    s: &mut Scheduler,
    exec: &mut GgufExecutor,
    kv: &mut KvCache,
    id: &str,
    prompt: &[u32],
) -> (Vec<u32>, u32, Vec<ScheduledChunk>) {
    s.add_request(EngineRequest {
        request_id: id.into(),
        client_request_id: None,
        prompt_token_ids: prompt.to_vec(),
        sampling: SamplingParams { max_tokens: N_NEW, temperature: 0.0, ignore_eos: true, ..Default::default() },
        eos_token_ids: vec![],
        arrival_unix_ms: 0,
        kv_transfer_params: None,
        data_parallel_rank: None,
    })
    .unwrap();
    let (mut tokens, mut cached, mut all) = (Vec::new(), None, Vec::new());
    while s.has_unfinished_requests() {
        for call in s.match_queries() {
            if let ConnectorCall::GetNumNewMatchedTokens { request_id, .. } = call {
                s.apply_match(&request_id, Some(0), false);
            }
        }
        let sched = s.schedule();
        let sampled = exec.execute(kv, &sched.chunks).unwrap();
        s.update_from_output(&sched.chunks, &ModelRunnerOutput { step_id: 0, sampled, ..Default::default() });
        for call in s.finishing_calls() {
            if let ConnectorCall::RequestFinished { request_id, .. } = call {
                s.apply_finished(&request_id, false, None);
            }
        }
        for o in s.take_outputs() {
            tokens.extend(o.new_token_ids);
            if o.finish_reason.is_some() {
                cached = Some(o.num_cached_tokens);
            }
        }
        all.extend(sched.chunks);
    }
    (tokens, cached.unwrap(), all)
}

fn block_bits(kv: &KvCache, block: u32) -> Vec<u32> {
    let layers = kv.spec().num_layers as usize;
    let mut v = Vec::new();
    for layer in 0..layers {
        for side in [KvSide::Key, KvSide::Value] {
            v.extend(kv.block(layer, side, block).unwrap().iter().map(|f| f.to_bits()));
        }
    }
    v
}

#[test]
fn cached_blocks_are_bit_identical_and_greedy_output_does_not_change() {
    let Some(mut exec) = load() else { return };
    let prompts = PROMPTS.with(|c| c.borrow().clone());
    let (a, b) = (&prompts[0], &prompts[1]);
    let shared = a.iter().zip(b).take_while(|(x, y)| x == y).count() as u32;
    assert!(shared >= 2 * BS, "the prompts share {shared} tokens: too few for a cached block");

    // Cached: a, then b, which starts from a's cached blocks.
    let mut s = scheduler(true, 2048);
    let mut kv = kv_cache(&exec, 64);
    let (_, a_cached, a_chunks) = generate(&mut s, &mut exec, &mut kv, "a", a);
    assert_eq!(a_cached, 0);
    let (b_tokens, b_cached, b_chunks) = generate(&mut s, &mut exec, &mut kv, "b", b);
    assert_eq!(b_cached, shared / BS * BS, "every full block of the shared prefix was hit");
    assert_eq!(b_chunks[0].start_pos, b_cached, "b's prefill starts after the hit");

    // Uncached: b alone on a fresh cache, in chunks of 7 tokens so that no step matches the
    // cached run's shapes.
    let mut plain = scheduler(false, 7);
    let mut kv2 = kv_cache(&exec, 64);
    let (b_plain, plain_cached, plain_chunks) = generate(&mut plain, &mut exec, &mut kv2, "b", b);
    assert_eq!(plain_cached, 0);
    assert_eq!(b_tokens, b_plain, "greedy output with and without the cached prefix");

    // The cached blocks (computed for a) hold exactly the bits b computed for itself.
    let hit_blocks = (b_cached / BS) as usize;
    for i in 0..hit_blocks {
        let cached_block = a_chunks[0].block_ids[i];
        assert_eq!(b_chunks[0].block_ids[i], cached_block);
        // (The last chunk carries the request's whole block table.)
        let fresh_block = plain_chunks.last().unwrap().block_ids[i];
        assert!(
            block_bits(&kv, cached_block) == block_bits(&kv2, fresh_block),
            "block {i}: cached KV differs from recomputed KV"
        );
    }
}
