//! Scheduler state machine: batching, chunked prefill, preemption, aborts (R2), accounting (R5).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use pdmesh_engine_core::scheduler::{AdmissionError, AdmissionLimits, EngineFaults, Scheduler, SchedulerConfig};
use pdmesh_protocol::{
    ConnectorCall, EngineRequest, FinishReason, KvConnectorOutput, KvTransferParams, ModelRunnerOutput, SampledToken,
    SamplingParams, ScheduledChunk,
};

fn cfg(num_blocks: u32, budget: u32) -> SchedulerConfig {
    SchedulerConfig { block_size: 4, num_blocks, max_num_seqs: 8, max_num_batched_tokens: budget, max_model_len: 256 }
}

/// A request whose prompt is its own (tokens salted by the id), so that no two requests share
/// a cached prefix by accident (tests/prefix_caching.rs tests sharing on purpose).
fn req(id: &str, prompt_len: usize, max_tokens: u32) -> EngineRequest {
    let salt = id.bytes().fold(0u32, |a, b| a.wrapping_mul(31).wrapping_add(u32::from(b))) % 1000;
    EngineRequest {
        request_id: id.into(),
        client_request_id: None,
        prompt_token_ids: (0..prompt_len as u32).map(|i| 10 + i + 1000 * salt).collect(),
        sampling: SamplingParams { max_tokens, temperature: 0.0, ..Default::default() },
        eos_token_ids: vec![2],
        arrival_unix_ms: 0,
        kv_transfer_params: None,
        data_parallel_rank: None,
    }
}

/// Answer every connector query like the no-op connector, run `schedule`, and apply the
/// `request_finished` answers (never delay).
fn step(s: &mut Scheduler, token: u32) -> Vec<ScheduledChunk> {
    for call in s.match_queries() {
        if let ConnectorCall::GetNumNewMatchedTokens { request_id, .. } = call {
            s.apply_match(&request_id, Some(0), false);
        }
    }
    let sched = s.schedule();
    finish_calls(s, false);
    let sampled = sched
        .chunks
        .iter()
        .filter(|c| c.sample)
        .map(|c| SampledToken { request_id: c.request_id.clone(), token_id: token, logprobs: None })
        .collect();
    s.update_from_output(&sched.chunks, &ModelRunnerOutput { step_id: 0, sampled, ..Default::default() });
    finish_calls(s, false);
    check_accounting(s);
    sched.chunks
}

fn finish_calls(s: &mut Scheduler, delay: bool) -> Vec<String> {
    let mut ids = Vec::new();
    for call in s.finishing_calls() {
        if let ConnectorCall::RequestFinished { request_id, .. } = call {
            s.apply_finished(&request_id, delay, None);
            ids.push(request_id);
        }
    }
    ids
}

fn check_accounting(s: &Scheduler) {
    let kv = s.kv_usage();
    assert_eq!(kv.free_blocks + kv.used_blocks + kv.held_blocks, kv.total_blocks, "every block has one owner: {kv:?}");
    assert_eq!(s.double_frees(), 0);
}

#[test]
fn requests_run_to_max_tokens_and_free_their_blocks() {
    let mut s = Scheduler::new(cfg(64, 64));
    s.add_request(req("a", 5, 3)).unwrap();
    s.add_request(req("b", 9, 2)).unwrap();
    let first = step(&mut s, 7);
    assert_eq!(first.len(), 2, "both prefills batched in one step");
    assert!(first.iter().all(|c| c.sample));
    step(&mut s, 7);
    let outs = s.take_outputs();
    let b_final = outs.iter().find(|o| o.request_id == "b" && o.finish_reason.is_some()).unwrap();
    assert_eq!(b_final.finish_reason, Some(FinishReason::Length));
    step(&mut s, 7);
    assert!(!s.has_requests());
    assert_eq!(s.kv_usage().free_blocks, 64);
    assert_eq!(s.counters().request_finished_calls, 2);
}

#[test]
fn eos_and_stop_token_ids_stop() {
    let mut s = Scheduler::new(cfg(64, 64));
    s.add_request(req("a", 3, 10)).unwrap();
    step(&mut s, 2); // eos
    let outs = s.take_outputs();
    assert_eq!(outs.last().unwrap().finish_reason, Some(FinishReason::Stop));
    assert_eq!(outs.last().unwrap().stop_token_id, Some(2));
    let mut r = req("b", 3, 10);
    r.sampling.ignore_eos = true;
    r.sampling.stop_token_ids = vec![9];
    s.add_request(r).unwrap();
    step(&mut s, 2);
    assert!(s.take_outputs().iter().all(|o| o.finish_reason.is_none()), "eos ignored");
    step(&mut s, 9);
    assert_eq!(s.take_outputs().last().unwrap().finish_reason, Some(FinishReason::Stop));
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut s = Scheduler::new(cfg(64, 8));
    s.add_request(req("a", 20, 1)).unwrap();
    let c1 = step(&mut s, 5);
    assert_eq!(c1[0].token_ids.len(), 8);
    assert!(!c1[0].sample, "a partial prefill does not sample");
    let c2 = step(&mut s, 5);
    assert_eq!((c2[0].start_pos, c2[0].token_ids.len()), (8, 8));
    let c3 = step(&mut s, 5);
    assert_eq!((c3[0].start_pos, c3[0].token_ids.len(), c3[0].sample), (16, 4, true));
    assert_eq!(s.take_outputs().last().unwrap().finish_reason, Some(FinishReason::Length));
}

#[test]
fn decode_runs_alongside_new_prefills() {
    let mut s = Scheduler::new(cfg(64, 10));
    s.add_request(req("a", 4, 5)).unwrap();
    step(&mut s, 5);
    s.add_request(req("b", 12, 5)).unwrap();
    let c = step(&mut s, 5);
    // decode of a first (1 token), then b's prefill chunk fills the rest of the budget
    assert_eq!(c[0].request_id, "a");
    assert_eq!(c[0].token_ids, vec![5]);
    assert_eq!(c[1].request_id, "b");
    assert_eq!(c[1].token_ids.len(), 9);
}

#[test]
fn preemption_frees_blocks_and_recomputes() {
    // 4 blocks of 4 tokens: two requests of 7 prompt tokens each need 2 blocks, then grow.
    let mut s = Scheduler::new(cfg(4, 64));
    s.add_request(req("a", 7, 6)).unwrap();
    s.add_request(req("b", 7, 6)).unwrap();
    step(&mut s, 5); // both prefilled: 8 tokens -> 2 blocks each, pool empty
    step(&mut s, 5); // decode position 7: still 2 blocks each
    step(&mut s, 5); // both need a third block at position 8: b is preempted
    assert!(s.counters().preemptions >= 1);
    for _ in 0..30 {
        step(&mut s, 5);
        if !s.has_requests() {
            break;
        }
    }
    assert!(!s.has_requests(), "both complete despite preemption");
    assert_eq!(s.kv_usage().free_blocks, 4);
    let outs = s.take_outputs();
    for id in ["a", "b"] {
        let tokens: usize = outs.iter().filter(|o| o.request_id == id).map(|o| o.new_token_ids.len()).sum();
        assert_eq!(tokens, 6, "{id} produced exactly max_tokens tokens, none lost or duplicated by preemption");
    }
}

#[test]
fn a_request_stuck_at_the_head_does_not_starve_requests_whose_kv_arrived() {
    // 12 blocks of 4 tokens. c (local, 15 prompt tokens) runs; a and b (remote prefill, 16
    // tokens each) take 4 blocks each for their KV: the pool is full.
    let mut s = Scheduler::new(cfg(12, 64));
    s.add_request(req("c", 15, 8)).unwrap();
    step(&mut s, 5);
    for id in ["a", "b"] {
        let mut r = req(id, 16, 2);
        r.kv_transfer_params = Some(KvTransferParams { do_remote_prefill: Some(true), ..Default::default() });
        s.add_request(r).unwrap();
        s.apply_match(id, Some(16), true);
    }
    step(&mut s, 5);
    assert_eq!(s.kv_usage().free_blocks, 0);
    // c needs a fifth block: it preempts itself and, at the head of the queue, needs 5 blocks
    // while only its own 4 are free. Then a's and b's KV arrive.
    step(&mut s, 5);
    step(&mut s, 5);
    assert_eq!(s.counters().preemptions, 1);
    s.update_from_kv_output(&KvConnectorOutput {
        finished_recving: vec!["a".into(), "b".into()],
        ..Default::default()
    });
    // Loaded requests already own their prompt's blocks: they run first, finish, and their
    // blocks let c run again. Kept behind c, nobody would ever run.
    for _ in 0..40 {
        step(&mut s, 5);
        if !s.has_requests() {
            break;
        }
    }
    assert!(!s.has_requests(), "every request completes: {:?}", s.kv_usage());
    assert_eq!(s.kv_usage().free_blocks, 12);
    let outs = s.take_outputs();
    for (id, n) in [("a", 2), ("b", 2), ("c", 8)] {
        let tokens: usize = outs.iter().filter(|o| o.request_id == id).map(|o| o.new_token_ids.len()).sum();
        assert_eq!(tokens, n, "{id}");
    }
}

#[test]
fn abort_frees_blocks_and_calls_request_finished_once() {
    let mut s = Scheduler::new(cfg(16, 64));
    s.add_request(req("a", 9, 100)).unwrap();
    step(&mut s, 5);
    assert!(s.kv_usage().used_blocks > 0);
    assert_eq!(s.abort_requests(&["a".into()]), vec!["a".to_string()]);
    // a second abort, an abort of an unknown id: skipped and counted, nothing else
    assert!(s.abort_requests(&["a".into(), "zzz".into()]).is_empty());
    finish_calls(&mut s, false);
    assert_eq!(s.kv_usage().free_blocks, 16);
    assert_eq!(s.counters().request_finished_calls, 1);
    assert_eq!(s.counters().unknown_ids, 1);
    let outs = s.take_outputs();
    assert_eq!(outs.last().unwrap().finish_reason, Some(FinishReason::Abort));
    // the abort after it finished did not reach request_finished again
    assert!(s.finishing_calls().is_empty());
    check_accounting(&s);
}

#[test]
fn abort_after_finish_never_frees_held_blocks() {
    // P side: the connector holds the blocks (delay_free = true) for a remote reader.
    let mut s = Scheduler::new(cfg(16, 64));
    let mut r = req("p", 9, 1);
    r.kv_transfer_params = Some(KvTransferParams { do_remote_decode: Some(true), ..Default::default() });
    s.add_request(r).unwrap();
    for call in s.match_queries() {
        if let ConnectorCall::GetNumNewMatchedTokens { request_id, .. } = call {
            s.apply_match(&request_id, Some(0), false);
        }
    }
    let sched = s.schedule();
    let sampled = vec![SampledToken { request_id: "p".into(), token_id: 5, logprobs: None }];
    s.update_from_output(&sched.chunks, &ModelRunnerOutput { step_id: 1, sampled, ..Default::default() });
    finish_calls(&mut s, true);
    assert_eq!(s.kv_usage().held_blocks, 3);
    // the client's abort after the end of prefill: nothing is freed here, the connector is
    // told once (it frees at once without a lease, or when the lease ends)
    assert!(s.abort_requests(&["p".into()]).is_empty());
    assert!(s.abort_requests(&["p".into()]).is_empty());
    assert_eq!(s.take_aborted_held(), vec!["p".to_string()], "the connector hears of it once");
    assert!(s.take_aborted_held().is_empty());
    assert_eq!(s.counters().aborts_after_finish, 1);
    assert_eq!(s.counters().duplicate_aborts, 1);
    assert!(s.finishing_calls().is_empty(), "request_finished is not called a second time");
    assert_eq!(s.kv_usage().held_blocks, 3, "held blocks stay held until finished_sending");
    check_accounting(&s);
    assert!(s.has_requests(), "held blocks keep the engine ticking");
    // the connector released them: finished_sending frees; a duplicate is counted, not a double free
    let done = KvConnectorOutput { finished_sending: vec!["p".into()], ..Default::default() };
    s.update_from_kv_output(&done);
    s.update_from_kv_output(&done);
    assert_eq!(s.kv_usage().free_blocks, 16);
    // the duplicate finished_sending and an abort after the free are unknown ids
    assert!(s.abort_requests(&["p".into()]).is_empty());
    assert_eq!(s.counters().unknown_ids, 2);
    assert!(s.take_aborted_held().is_empty());
    assert_eq!(s.counters().request_finished_calls, 1);
    check_accounting(&s);
}

#[test]
fn abort_at_finish_reaches_the_connector_once_the_blocks_are_held() {
    // The abort lands after the request finished but before request_finished was answered.
    let mut s = Scheduler::new(cfg(16, 64));
    let mut r = req("p", 9, 1);
    r.kv_transfer_params = Some(KvTransferParams { do_remote_decode: Some(true), ..Default::default() });
    s.add_request(r).unwrap();
    for call in s.match_queries() {
        if let ConnectorCall::GetNumNewMatchedTokens { request_id, .. } = call {
            s.apply_match(&request_id, Some(0), false);
        }
    }
    let sched = s.schedule();
    let sampled = vec![SampledToken { request_id: "p".into(), token_id: 5, logprobs: None }];
    s.update_from_output(&sched.chunks, &ModelRunnerOutput { step_id: 1, sampled, ..Default::default() });
    assert!(s.abort_requests(&["p".into()]).is_empty(), "already finished: not aborted again");
    assert!(s.take_aborted_held().is_empty(), "not held yet");
    assert_eq!(finish_calls(&mut s, true), vec!["p".to_string()], "request_finished once");
    assert_eq!(s.take_aborted_held(), vec!["p".to_string()], "passed on as soon as it is held");
    assert_eq!(s.kv_usage().held_blocks, 3);
    s.update_from_kv_output(&KvConnectorOutput { finished_sending: vec!["p".into()], ..Default::default() });
    assert_eq!(s.kv_usage().free_blocks, 16);
    assert_eq!(s.counters().request_finished_calls, 1);
    check_accounting(&s);
}

#[test]
fn admission_refuses_bad_requests() {
    let mut s = Scheduler::new(cfg(4, 64));
    assert!(s.add_request(req("a", 0, 1)).is_err());
    assert!(s.add_request(req("b", 300, 1)).is_err());
    assert!(s.add_request(req("c", 20, 1)).is_err(), "needs more blocks than exist");
    s.add_request(req("d", 3, 1)).unwrap();
    assert!(s.add_request(req("d", 3, 1)).is_err(), "duplicate id");
}

/// A finished request whose blocks P holds for a reader still owns its id: a second request
/// under it (a reused `X-Request-Id` that reached the engine unchanged) would overwrite the
/// held entry, and the first request's blocks would never be freed (they leaked for good
/// before the scheduler counted held ids as in use). It is refused instead, and the first
/// request's blocks free as usual.
#[test]
fn a_held_request_id_cannot_be_admitted_again() {
    let mut s = Scheduler::new(cfg(16, 64));
    let mut r = req("p", 9, 1);
    r.kv_transfer_params = Some(KvTransferParams { do_remote_decode: Some(true), ..Default::default() });
    s.add_request(r.clone()).unwrap();
    step_held(&mut s, "p");
    assert_eq!(s.kv_usage().held_blocks, 3);
    assert!(s.id_in_use("p"));
    let refused = s.add_request(r).unwrap_err();
    assert_eq!(refused, AdmissionError::DuplicateId("p".into()));
    assert_eq!(refused.label(), "duplicate_id");
    assert_eq!(s.kv_usage().held_blocks, 3, "the held request is untouched");
    s.update_from_kv_output(&KvConnectorOutput { finished_sending: vec!["p".into()], ..Default::default() });
    assert_eq!(s.kv_usage().free_blocks, 16, "and its blocks free once the reader is done");
    assert!(!s.id_in_use("p"));
    s.add_request(req("p", 3, 1)).unwrap();
    check_accounting(&s);
}

/// Prefill `id` (one step, one sampled token) and hold its blocks as P's connector would.
fn step_held(s: &mut Scheduler, id: &str) {
    for call in s.match_queries() {
        if let ConnectorCall::GetNumNewMatchedTokens { request_id, .. } = call {
            s.apply_match(&request_id, Some(0), false);
        }
    }
    let sched = s.schedule();
    let sampled = vec![SampledToken { request_id: id.into(), token_id: 5, logprobs: None }];
    s.update_from_output(&sched.chunks, &ModelRunnerOutput { step_id: 1, sampled, ..Default::default() });
    finish_calls(s, true);
}

#[test]
fn admission_fault_injection_refuses_every_nth_request() {
    assert_eq!(EngineFaults::parse("").unwrap(), EngineFaults::default());
    assert_eq!(EngineFaults::parse("refuse_admission_every=2").unwrap().refuse_admission_every, Some(2));
    assert!(EngineFaults::parse("refuse_admission_every=0").is_err());
    assert!(EngineFaults::parse("refuse_admision_every=2").is_err(), "a typo is an error, not silence");
    let mut s = Scheduler::new(cfg(16, 64));
    s.set_faults(EngineFaults::parse("refuse_admission_every=2").unwrap());
    let results: Vec<bool> = (0..4).map(|i| s.add_request(req(&format!("r{i}"), 3, 1)).is_ok()).collect();
    assert_eq!(results, vec![true, false, true, false]);
    assert!(matches!(s.add_request(req("r5", 3, 1)), Ok(())));
    assert_eq!(s.add_request(req("r6", 3, 1)).unwrap_err().label(), "injected");
    assert!(!s.id_in_use("r1"), "a refused request leaves nothing behind");
}

#[test]
fn the_waiting_queue_is_bounded() {
    let mut s = Scheduler::new(cfg(64, 64));
    s.set_admission_limits(AdmissionLimits { max_waiting: 2, ..Default::default() });
    s.add_request(req("a", 3, 2)).unwrap();
    s.add_request(req("b", 3, 2)).unwrap();
    let refused = s.add_request(req("c", 3, 2)).unwrap_err();
    assert!(matches!(refused, AdmissionError::WaitingQueueFull { waiting: 2, max: 2 }), "{refused:?}");
    assert!(refused.is_overload());
    assert!(refused.output_message().starts_with("overloaded"), "the frontend maps it to 503");
    assert!(!AdmissionError::EmptyPrompt.is_overload());
    assert!(AdmissionError::EmptyPrompt.output_message().starts_with("invalid request"));
    // a refused request left nothing behind; once scheduled, the queue has room again
    assert_eq!(s.num_waiting(), 2);
    step(&mut s, 5);
    assert_eq!(s.num_waiting(), 0);
    s.add_request(req("c", 3, 2)).unwrap();
    check_accounting(&s);
}

/// P side: prefill every waiting request and let the connector hold their blocks.
fn prefill_and_hold(s: &mut Scheduler) {
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
        .map(|c| SampledToken { request_id: c.request_id.clone(), token_id: 5, logprobs: None })
        .collect();
    s.update_from_output(&sched.chunks, &ModelRunnerOutput { step_id: 1, sampled, ..Default::default() });
    finish_calls(s, true);
    check_accounting(s);
}

fn to_decode_remotely(id: &str, prompt_len: usize) -> EngineRequest {
    let mut r = req(id, prompt_len, 1);
    r.kv_transfer_params = Some(KvTransferParams { do_remote_decode: Some(true), ..Default::default() });
    r
}

#[test]
fn held_and_promised_blocks_are_bounded_to_their_share_of_the_pool() {
    // 16 blocks of 4 tokens, holds may take half: 8 blocks. A 9-token prompt needs 3.
    let mut s = Scheduler::new(cfg(16, 64));
    s.set_admission_limits(AdmissionLimits { max_held_fraction: 0.5, ..Default::default() });
    s.add_request(to_decode_remotely("p1", 9)).unwrap();
    s.add_request(to_decode_remotely("p2", 9)).unwrap();
    // promised (waiting) blocks count already: 6 + 3 > 8
    let refused = s.add_request(to_decode_remotely("p3", 9)).unwrap_err();
    assert_eq!(refused, AdmissionError::HeldBlocksFull { committed: 6, needed: 3, cap: 8, total: 16 });
    assert!(refused.output_message().starts_with("overloaded"));
    // still refused once they are held for a reader that does not come
    prefill_and_hold(&mut s);
    assert_eq!(s.kv_usage().held_blocks, 6);
    assert!(matches!(s.add_request(to_decode_remotely("p3", 9)), Err(AdmissionError::HeldBlocksFull { .. })));
    // a request that will not be held is not limited by holds (2 blocks fit under the cap too)
    s.add_request(req("local", 9, 50)).unwrap(); // still running after the step
    s.add_request(to_decode_remotely("small", 3)).unwrap();
    prefill_and_hold(&mut s);
    assert_eq!(s.kv_usage().held_blocks, 7);
    // the reader took p1's blocks: room for p3 again
    s.update_from_kv_output(&KvConnectorOutput { finished_sending: vec!["p1".into()], ..Default::default() });
    s.add_request(to_decode_remotely("p3", 9)).unwrap();
    check_accounting(&s);
    // 1.0 bounds nothing
    let mut unbounded = Scheduler::new(cfg(16, 64));
    for i in 0..5 {
        unbounded.add_request(to_decode_remotely(&format!("u{i}"), 9)).unwrap();
    }
}

/// D side: a request whose prompt comes from a remote prefill.
fn remote(s: &mut Scheduler, id: &str, prompt_len: usize) -> Vec<u32> {
    let mut r = req(id, prompt_len, 4);
    r.kv_transfer_params = Some(KvTransferParams { do_remote_prefill: Some(true), ..Default::default() });
    s.add_request(r).unwrap();
    s.apply_match(id, Some(prompt_len as u32), true);
    let sched = s.schedule();
    assert!(sched.chunks.is_empty(), "nothing computes while the KV loads");
    let blocks = sched
        .alloc_calls
        .iter()
        .find_map(|c| match c {
            ConnectorCall::UpdateStateAfterAlloc { request_id, block_ids, num_external_tokens } if request_id == id => {
                assert_eq!(*num_external_tokens, prompt_len as u32);
                Some(block_ids.clone())
            }
            _ => None,
        })
        .unwrap();
    check_accounting(s);
    blocks
}

#[test]
fn loaded_kv_counts_as_computed_except_the_last_prompt_token() {
    let mut s = Scheduler::new(cfg(16, 64));
    let blocks = remote(&mut s, "d", 9);
    assert_eq!(blocks.len(), 3);
    assert!(s.schedule().chunks.is_empty(), "still waiting for the receive");
    s.update_from_kv_output(&KvConnectorOutput { finished_recving: vec!["d".into()], ..Default::default() });
    let chunks = s.schedule().chunks;
    assert_eq!(chunks.len(), 1);
    assert_eq!((chunks[0].start_pos, chunks[0].token_ids.len(), chunks[0].sample), (8, 1, true));
    check_accounting(&s);
}

#[test]
fn abort_while_receiving_keeps_blocks_until_the_read_settles() {
    let mut s = Scheduler::new(cfg(16, 64));
    remote(&mut s, "d", 9);
    assert_eq!(s.abort_requests(&["d".into()]), vec!["d".to_string()]);
    finish_calls(&mut s, false);
    assert_eq!(s.counters().request_finished_calls, 1);
    // A READ may still write into the blocks: they stay out of the free pool.
    let kv = s.kv_usage();
    assert_eq!((kv.held_blocks, kv.free_blocks), (3, 13), "{kv:?}");
    assert_eq!(s.held_requests()[0].state, "aborted_while_receiving");
    assert!(s.has_requests(), "the engine keeps ticking until the receive settles");
    check_accounting(&s);
    s.update_from_kv_output(&KvConnectorOutput { finished_recving: vec!["d".into()], ..Default::default() });
    assert_eq!(s.kv_usage().free_blocks, 16);
    assert!(!s.has_requests());
    assert_eq!(s.counters().request_finished_calls, 1, "request_finished once");
    check_accounting(&s);
}

#[test]
fn failed_load_is_recomputed_from_the_first_invalid_block() {
    let mut s = Scheduler::new(cfg(16, 64));
    s.set_recompute_load_failures(true);
    let blocks = remote(&mut s, "d", 9);
    // the second block failed: tokens 0..4 are valid, the rest is recomputed
    s.update_from_kv_output(&KvConnectorOutput {
        finished_recving: vec!["d".into()],
        invalid_block_ids: vec![blocks[1]],
        ..Default::default()
    });
    let chunks = s.schedule().chunks;
    assert_eq!((chunks[0].start_pos, chunks[0].token_ids.len()), (4, 5));
    check_accounting(&s);
}

#[test]
fn failed_load_fails_only_that_request_under_fail_policy() {
    let mut s = Scheduler::new(cfg(16, 64));
    let blocks = remote(&mut s, "d", 9);
    s.add_request(req("other", 5, 2)).unwrap();
    s.update_from_kv_output(&KvConnectorOutput {
        finished_recving: vec!["d".into()],
        invalid_block_ids: blocks.clone(),
        ..Default::default()
    });
    assert_eq!(s.counters().unknown_ids, 0, "the failed receive is not an unknown id");
    finish_calls(&mut s, false);
    let outs = s.take_outputs();
    let d = outs.iter().find(|o| o.request_id == "d").unwrap();
    assert_eq!(d.finish_reason, Some(FinishReason::Error));
    assert!(d.error.as_deref().is_some_and(|e| e.contains("kv load failed")));
    // the other request still runs to completion
    for _ in 0..4 {
        step(&mut s, 7);
    }
    assert!(!s.has_requests());
    assert_eq!(s.kv_usage().free_blocks, 16);
    check_accounting(&s);
}

/// D78: where the worker runs steps ahead, a request going on after a step gets the block of
/// its next position in that step's chunk, so the worker can run the next step ahead across a
/// block boundary; never for a request that ends there, a remote decoder's prefill, or at the
/// cost of a preemption; every block free at the end as before.
#[test]
fn the_block_of_the_next_position_comes_a_step_early_where_steps_run_ahead() {
    // 4-token blocks; a 4-token prompt and 6 tokens out: positions 0..=8 are written.
    let tables = |reserve: bool| {
        let mut s = Scheduler::new(cfg(64, 64));
        s.set_reserve_next_block(reserve);
        s.add_request(req("a", 4, 6)).unwrap();
        let mut seen = Vec::new();
        while s.has_requests() {
            for c in step(&mut s, 7) {
                seen.push((c.start_pos, c.block_ids));
            }
        }
        assert_eq!(s.kv_usage().free_blocks, 64, "reserve {reserve}: every block free at the end");
        seen
    };
    let (early, in_turn) = (tables(true), tables(false));
    let lens = |t: &[(u32, Vec<u32>)]| t.iter().map(|(pos, b)| (*pos, b.len())).collect::<Vec<_>>();
    // The prefill (positions 0..4) already holds block 1 for position 4; position 7's step
    // holds block 2 for position 8; position 8's step is the last and reserves nothing.
    assert_eq!(lens(&early), vec![(0, 2), (4, 2), (5, 2), (6, 2), (7, 3), (8, 3)]);
    assert_eq!(lens(&in_turn), vec![(0, 1), (4, 2), (5, 2), (6, 2), (7, 2), (8, 3)]);
    // Each step's table starts with the one before: the block given early is the one the
    // step at the next position uses.
    for pair in early.windows(2) {
        assert!(pair[1].1.starts_with(&pair[0].1[..pair[1].1.len().min(pair[0].1.len())]), "{pair:?}");
    }

    // A remote decoder's prefill (P) ends at its first token: it holds only its prompt's
    // blocks for the reader. A request at its length cap gets nothing either.
    let mut s = Scheduler::new(cfg(64, 64));
    s.set_reserve_next_block(true);
    s.add_request(to_decode_remotely("p", 8)).unwrap();
    s.add_request(req("one-token", 8, 1)).unwrap();
    for call in s.match_queries() {
        if let ConnectorCall::GetNumNewMatchedTokens { request_id, .. } = call {
            s.apply_match(&request_id, Some(0), false);
        }
    }
    let sched = s.schedule();
    let lens: Vec<(&str, usize)> = sched.chunks.iter().map(|c| (c.request_id.as_str(), c.block_ids.len())).collect();
    assert_eq!(lens, vec![("p", 2), ("one-token", 2)]);

    // A short pool: two requests run and no more than two blocks are free, so none is given
    // early (it could be the one the other request's next step needs); nobody is preempted.
    for free in [0, 1, 2] {
        let mut s = Scheduler::new(cfg(2 + free, 64));
        s.set_reserve_next_block(true);
        s.add_request(req("x", 4, 10)).unwrap();
        s.add_request(req("y", 4, 10)).unwrap();
        let first = step(&mut s, 7);
        assert_eq!(first.iter().map(|c| c.block_ids.len()).collect::<Vec<_>>(), vec![1, 1], "{free} free");
        assert_eq!(s.num_running(), 2, "both still running");
        assert_eq!(s.kv_usage().free_blocks, free);
    }
    // Three free for two running: the first gets its block early, then the watermark holds.
    let mut s = Scheduler::new(cfg(5, 64));
    s.set_reserve_next_block(true);
    s.add_request(req("x", 4, 10)).unwrap();
    s.add_request(req("y", 4, 10)).unwrap();
    let first = step(&mut s, 7);
    assert_eq!(first.iter().map(|c| c.block_ids.len()).collect::<Vec<_>>(), vec![2, 1]);
    assert_eq!(s.kv_usage().free_blocks, 2);
}
