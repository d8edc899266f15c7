//! Automatic prefix caching in the scheduler: hits, the last-token rule, sharing with blocks
//! held for a remote reader, LRU eviction and generations, the switch, and a worker restart.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use pdmesh_engine_core::scheduler::{Scheduler, SchedulerConfig};
use pdmesh_protocol::{
    ConnectorCall, EngineOutput, EngineRequest, KvConnectorOutput, KvTransferParams, ModelRunnerOutput, SampledToken,
    SamplingParams, ScheduledChunk,
};

const BS: u32 = 4;

fn cfg(num_blocks: u32) -> SchedulerConfig {
    SchedulerConfig { block_size: BS, num_blocks, max_num_seqs: 8, max_num_batched_tokens: 64, max_model_len: 256 }
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        request_id: id.into(),
        client_request_id: None,
        prompt_token_ids: prompt,
        sampling: SamplingParams { max_tokens, temperature: 0.0, ..Default::default() },
        eos_token_ids: vec![2],
        arrival_unix_ms: 0,
        kv_transfer_params: None,
        data_parallel_rank: None,
    }
}

fn prompt(len: u32, salt: u32) -> Vec<u32> {
    (0..len).map(|i| 10 + i + 1000 * salt).collect()
}

/// One engine step with the no-op connector; with `delay`, the blocks of finished
/// remote-decode requests are held for the connector (as P's `PdConnector` answers).
fn step(s: &mut Scheduler, delay: bool) -> Vec<ScheduledChunk> {
    for call in s.match_queries() {
        if let ConnectorCall::GetNumNewMatchedTokens { request_id, .. } = call {
            s.apply_match(&request_id, Some(0), false);
        }
    }
    let sched = s.schedule();
    let sampled = sched
        .chunks
        .iter()
        .filter(|c| c.sample)
        .map(|c| SampledToken { request_id: c.request_id.clone(), token_id: 7, logprobs: None })
        .collect();
    s.update_from_output(&sched.chunks, &ModelRunnerOutput { step_id: 0, sampled, ..Default::default() });
    for call in s.finishing_calls() {
        if let ConnectorCall::RequestFinished { request_id, kv_transfer_params, .. } = call {
            let remote_decode = kv_transfer_params.is_some_and(|p| p.wants_remote_decode());
            s.apply_finished(&request_id, delay && remote_decode, None);
        }
    }
    let kv = s.kv_usage();
    assert_eq!(kv.free_blocks + kv.used_blocks + kv.held_blocks, kv.total_blocks, "{kv:?}");
    assert_eq!(s.double_frees(), 0);
    sched.chunks
}

fn run_to_end(s: &mut Scheduler, delay: bool) -> (Vec<ScheduledChunk>, Vec<EngineOutput>) {
    let mut chunks = Vec::new();
    for _ in 0..100 {
        if !s.has_unfinished_requests() {
            break;
        }
        chunks.extend(step(s, delay));
    }
    assert!(!s.has_unfinished_requests());
    (chunks, s.take_outputs())
}

fn final_of<'a>(outs: &'a [EngineOutput], id: &str) -> &'a EngineOutput {
    outs.iter().find(|o| o.request_id == id && o.finish_reason.is_some()).unwrap()
}

#[test]
fn a_repeated_prefix_is_hit_and_only_the_rest_is_computed() {
    let mut s = Scheduler::new(cfg(32));
    s.add_request(req("a", prompt(10, 0), 2)).unwrap();
    let (a_chunks, outs) = run_to_end(&mut s, false);
    assert_eq!(final_of(&outs, "a").num_cached_tokens, 0);
    let a_blocks = a_chunks[0].block_ids.clone();
    // 10 prompt tokens + 1 output computed: blocks 0 and 1 are full and cached.
    assert_eq!(s.kv_usage().cached_blocks, 2);
    assert_eq!(s.kv_usage().free_blocks, 32, "cached blocks count as free");

    // Same first 9 tokens, then different ones.
    let mut p = prompt(9, 0);
    p.extend([500, 501, 502]);
    s.add_request(req("b", p, 1)).unwrap();
    let (b_chunks, outs) = run_to_end(&mut s, false);
    let first = &b_chunks[0];
    assert_eq!(first.start_pos, 8, "two cached blocks skipped");
    assert_eq!(first.token_ids, vec![18, 500, 501, 502]);
    assert_eq!(first.block_ids[..2], a_blocks[..2], "the cached blocks are shared");
    assert_eq!(final_of(&outs, "b").num_cached_tokens, 8);
    let c = s.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (10 + 12, 8));
}

#[test]
fn the_last_prompt_token_is_always_recomputed() {
    let mut s = Scheduler::new(cfg(32));
    s.add_request(req("a", prompt(8, 0), 1)).unwrap();
    run_to_end(&mut s, false);
    s.add_request(req("b", prompt(8, 0), 1)).unwrap();
    let (chunks, outs) = run_to_end(&mut s, false);
    // Both blocks are cached, but a full hit would leave nothing to compute for the logits:
    // the last block is recomputed (into a block of b's own), as vLLM does.
    assert_eq!(chunks[0].start_pos, 4);
    assert_eq!(chunks[0].token_ids.len(), 4);
    assert_eq!(final_of(&outs, "b").num_cached_tokens, 4);
}

#[test]
fn the_switch_turns_caching_off() {
    let mut s = Scheduler::new(cfg(32));
    assert!(s.set_prefix_caching(false));
    s.add_request(req("a", prompt(10, 0), 1)).unwrap();
    run_to_end(&mut s, false);
    s.add_request(req("b", prompt(10, 0), 1)).unwrap();
    let (chunks, outs) = run_to_end(&mut s, false);
    assert_eq!(chunks[0].start_pos, 0);
    assert_eq!(final_of(&outs, "b").num_cached_tokens, 0);
    assert_eq!(s.kv_usage().cached_blocks, 0);
    assert_eq!(s.counters().prefix_cache_queries, 0);
}

#[test]
fn another_model_never_hits() {
    let mut s = Scheduler::new(cfg(32));
    s.set_cache_salt("model-a");
    s.add_request(req("a", prompt(10, 0), 1)).unwrap();
    run_to_end(&mut s, false);
    s.set_cache_salt("model-b");
    assert_eq!(s.kv_usage().cached_blocks, 0, "a new salt drops the cache");
    s.add_request(req("b", prompt(10, 0), 1)).unwrap();
    let (chunks, _) = run_to_end(&mut s, false);
    assert_eq!(chunks[0].start_pos, 0);
}

#[test]
fn blocks_held_for_a_reader_are_shared_but_never_evicted_or_rewritten() {
    // P: request a finishes with its blocks held for a remote reader (delay free).
    let mut s = Scheduler::new(cfg(8));
    let mut a = req("a", prompt(9, 0), 1);
    a.kv_transfer_params = Some(KvTransferParams { do_remote_decode: Some(true), ..Default::default() });
    s.add_request(a).unwrap();
    let (chunks, _) = run_to_end(&mut s, true);
    let held = chunks[0].block_ids.clone();
    assert!(s.holds("a"));
    let gens: Vec<_> = held.iter().map(|&b| s.block_state(b)).collect();

    // b shares the held prefix while a is held.
    s.add_request(req("b", prompt(9, 0), 1)).unwrap();
    let (b_chunks, _) = run_to_end(&mut s, true);
    assert_eq!(b_chunks[0].start_pos, 8);
    assert_eq!(b_chunks[0].block_ids[..2], held[..2]);

    // Pressure: requests that need every block that is not held. They run (preempting each
    // other if they must), and never get a held block.
    for i in 1..4 {
        s.add_request(req(&format!("x{i}"), prompt(15, i), 2)).unwrap();
    }
    let (x_chunks, _) = run_to_end(&mut s, true);
    for c in &x_chunks {
        assert!(c.block_ids.iter().all(|b| !held.contains(b)), "{} got a held block", c.request_id);
    }
    assert!(s.cache_counters().evictions > 0, "the pressure evicted cached blocks");
    for (b, g) in held.iter().zip(&gens) {
        assert_eq!(s.block_state(*b), *g, "held block {b} was rewritten");
    }
    // D read: P frees; the cached prefix stays for later requests, the partial block does not.
    s.update_from_kv_output(&KvConnectorOutput { finished_sending: vec!["a".into()], ..Default::default() });
    assert_eq!(s.kv_usage().held_blocks, 0);
    assert_eq!(s.kv_usage().free_blocks, 8);
    s.add_request(req("c", prompt(9, 0), 1)).unwrap();
    let (c_chunks, outs) = run_to_end(&mut s, false);
    assert_eq!(final_of(&outs, "c").num_cached_tokens, 8);
    assert_eq!(c_chunks[0].block_ids[..2], held[..2]);
}

#[test]
fn eviction_is_least_recently_used_and_bumps_the_generation() {
    let mut s = Scheduler::new(cfg(6));
    s.add_request(req("a", prompt(9, 0), 1)).unwrap();
    let (a, _) = run_to_end(&mut s, false);
    s.add_request(req("b", prompt(9, 1), 1)).unwrap();
    run_to_end(&mut s, false);
    let gen_a0 = s.block_state(a[0].block_ids[0]).1;
    // a again: touched, so b's blocks are now the least recently used.
    s.add_request(req("a2", prompt(9, 0), 1)).unwrap();
    run_to_end(&mut s, false);
    // A request needing 4 blocks: 2 plain free + b's 2 cached ones.
    s.add_request(req("c", prompt(15, 2), 1)).unwrap();
    run_to_end(&mut s, false);
    assert_eq!(s.cache_counters().evictions, 2);
    assert_eq!(s.block_state(a[0].block_ids[0]).1, gen_a0, "a's prefix survived");
    s.add_request(req("a3", prompt(9, 0), 1)).unwrap();
    let (_, outs) = run_to_end(&mut s, false);
    assert_eq!(final_of(&outs, "a3").num_cached_tokens, 8);
    s.add_request(req("b2", prompt(9, 1), 1)).unwrap();
    let (b2, outs) = run_to_end(&mut s, false);
    assert_eq!(final_of(&outs, "b2").num_cached_tokens, 0, "b's prefix was evicted");
    assert_eq!(b2[0].start_pos, 0);
}

#[test]
fn a_worker_restart_drops_the_cache() {
    let mut s = Scheduler::new(cfg(16));
    s.add_request(req("a", prompt(9, 0), 1)).unwrap();
    run_to_end(&mut s, false);
    assert!(s.kv_usage().cached_blocks > 0);
    s.worker_restarted("restart");
    assert_eq!(s.kv_usage().cached_blocks, 0);
    s.add_request(req("b", prompt(9, 0), 1)).unwrap();
    let (chunks, _) = run_to_end(&mut s, false);
    assert_eq!(chunks[0].start_pos, 0, "the KV behind the cache is gone");
}

#[test]
fn a_preempted_request_resumes_from_its_own_cached_blocks() {
    // 5 blocks: a and b (8-token prompts, 6 tokens out) cannot both reach 4 blocks.
    let mut s = Scheduler::new(SchedulerConfig { max_num_batched_tokens: 64, ..cfg(5) });
    s.add_request(req("a", prompt(8, 0), 6)).unwrap();
    s.add_request(req("b", prompt(8, 1), 6)).unwrap();
    let (_, outs) = run_to_end(&mut s, false);
    assert!(s.counters().preemptions > 0, "the pool was too small for both");
    // The two prompts share nothing: every hit is a preempted request finding its own blocks.
    assert!(s.counters().prefix_cache_hits >= u64::from(BS), "{:?}", s.counters());
    for id in ["a", "b"] {
        assert_eq!(final_of(&outs, id).finish_reason, Some(pdmesh_protocol::FinishReason::Length));
    }
}

/// A request whose prefix is cached but whose rest does not fit waits at the head of the queue
/// with the cached blocks let go (referenced before the allocation, so that it cannot evict
/// them, and released when it fails): nothing leaks, and once room is back it runs on the same
/// cached blocks.
#[test]
fn a_hit_whose_rest_does_not_fit_waits_and_lets_the_cached_blocks_go() {
    let mut s = Scheduler::new(cfg(8));
    s.add_request(req("a", prompt(10, 0), 2)).unwrap();
    let (a_chunks, _) = run_to_end(&mut s, false);
    let a_blocks = a_chunks[0].block_ids.clone();
    assert_eq!(s.kv_usage().cached_blocks, 2);

    // `big` takes most of the pool; `b` holds a's two cached blocks and needs four more.
    s.add_request(req("big", prompt(16, 1), 8)).unwrap();
    let mut p = prompt(9, 0);
    p.extend(500..512);
    s.add_request(req("b", p, 1)).unwrap();
    let first = step(&mut s, false);
    assert!(first.iter().all(|c| c.request_id != "b"), "b must wait for room: {first:?}");
    let kv = s.kv_usage();
    let big_blocks = first.iter().find(|c| c.request_id == "big").unwrap().block_ids.len() as u32;
    assert_eq!(kv.used_blocks, big_blocks, "b's cached prefix is not kept referenced while it waits: {kv:?}");
    assert_eq!(kv.cached_blocks, 2 + 16 / BS, "a's two and big's full blocks: none evicted: {kv:?}");

    let (chunks, outs) = run_to_end(&mut s, false);
    let b_first = chunks.iter().find(|c| c.request_id == "b").unwrap();
    assert_eq!(b_first.start_pos, 8, "b runs on the two cached blocks");
    assert_eq!(b_first.block_ids[..2], a_blocks[..2]);
    assert_eq!(final_of(&outs, "b").num_cached_tokens, 8);
    assert_eq!(s.kv_usage().used_blocks, 0);
}
