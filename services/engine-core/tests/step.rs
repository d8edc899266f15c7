//! The engine step driver without its peers: what a step does when the connector-scheduler
//! cannot be reached. A remote prefill's KV is held on P for it, so D must never compute it
//! locally behind the connector's back (that skips `kv_load_failure_policy` and leaves P
//! holding its blocks until the hold deadline); a request without remote KV has nothing to
//! load and runs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use pdmesh_engine_core::scheduler::{Scheduler, SchedulerConfig};
use pdmesh_engine_core::step::{EngineState, EngineStep, StepIo};
use pdmesh_protocol::{ConnectorCall, ConnectorReply, EngineRequest, KvTransferParams, SamplingParams};

fn state() -> EngineState {
    let cfg = SchedulerConfig {
        block_size: 4,
        num_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        max_model_len: 256,
    };
    EngineState::new(0, Scheduler::new(cfg))
}

fn request(id: &str, first_token: u32, remote: bool) -> EngineRequest {
    EngineRequest {
        request_id: id.into(),
        client_request_id: None,
        prompt_token_ids: (first_token..first_token + 9).collect(),
        sampling: SamplingParams { max_tokens: 2, temperature: 0.0, ..Default::default() },
        eos_token_ids: vec![2],
        arrival_unix_ms: 0,
        kv_transfer_params: remote.then(|| KvTransferParams {
            do_remote_prefill: Some(true),
            remote_engine_id: Some("p".into()),
            remote_request_id: Some(format!("{id}-p")),
            remote_host: Some("127.0.0.1".into()),
            remote_port: Some(5600),
            remote_block_ids: Some(vec![0, 1, 2]),
            ..Default::default()
        }),
        data_parallel_rank: None,
    }
}

/// The requests a step hands to the worker, driving every connector round with `answer`.
fn scheduled(st: &mut EngineState, answer: impl Fn(&[ConnectorCall]) -> Option<Vec<ConnectorReply>>) -> Vec<String> {
    let (mut step, mut io) = EngineStep::start(st, |_| Default::default());
    loop {
        io = match io {
            StepIo::Connector(calls) => step.on_connector(st, answer(&calls)),
            StepIo::Worker(out) => return out.chunks.iter().map(|c| c.request_id.clone()).collect(),
            StepIo::Done(_) => return Vec::new(),
        };
    }
}

/// The no-op connector's answers: nothing external, nothing held.
fn noop(calls: &[ConnectorCall]) -> Option<Vec<ConnectorReply>> {
    Some(
        calls
            .iter()
            .map(|c| match c {
                ConnectorCall::GetNumNewMatchedTokens { .. } => {
                    ConnectorReply::MatchedTokens { count: Some(0), load_async: false }
                }
                ConnectorCall::RequestFinished { .. } => {
                    ConnectorReply::Finished { delay_free: false, kv_transfer_params: None }
                }
                ConnectorCall::BuildConnectorMeta { .. } => ConnectorReply::Meta(Default::default()),
                _ => ConnectorReply::Ack,
            })
            .collect(),
    )
}

#[test]
fn a_remote_prefill_waits_for_an_unreachable_connector_and_a_local_request_runs() {
    let mut st = state();
    st.inbox.adds.push(request("remote", 100, true));
    st.inbox.adds.push(request("local", 200, false));
    // The connector cannot be reached: the local request runs, the remote prefill does not.
    let ran = scheduled(&mut st, |_| None);
    assert_eq!(ran, ["local"], "without its connector, only the request without remote KV runs");
    // The next step asks about the remote prefill again (and only about it).
    let (_, io) = EngineStep::start(&mut st, |_| Default::default());
    let StepIo::Connector(calls) = io else { panic!("the remote prefill must be asked about again") };
    let asked: Vec<_> = calls
        .iter()
        .filter_map(|c| match c {
            ConnectorCall::GetNumNewMatchedTokens { request_id, kv_transfer_params, .. } => {
                Some((request_id.as_str(), kv_transfer_params.is_some()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(asked, [("remote", true)]);
}

#[test]
fn a_remote_prefill_runs_once_the_connector_answers() {
    let mut st = state();
    st.inbox.adds.push(request("remote", 100, true));
    assert!(scheduled(&mut st, |_| None).is_empty());
    // The connector is back and decides (here: nothing to load): the request runs.
    assert_eq!(scheduled(&mut st, noop), ["remote"]);
}

/// P's side (D65): the answer carrying the params D needs leaves with the step whose
/// `request_finished` produced it, not one step later (D16's hold-back), and that step asks for
/// the next one at once, whose metadata registers the hold on P's worker.
#[test]
fn a_hand_off_leaves_with_the_step_that_finished_it() {
    use pdmesh_engine_core::step::{StepNext, WorkerAnswer};
    use pdmesh_protocol::{ModelRunnerOutput, SampledToken};
    let mut st = state();
    let mut req = request("p-req", 100, false);
    req.sampling.max_tokens = 1;
    req.kv_transfer_params = Some(KvTransferParams { do_remote_decode: Some(true), ..Default::default() });
    st.inbox.adds.push(req);
    let handoff = request("p-req", 100, true).kv_transfer_params;
    let answer = |calls: &[ConnectorCall]| {
        let replies = noop(calls)?;
        Some(
            calls
                .iter()
                .zip(replies)
                .map(|(c, r)| match c {
                    ConnectorCall::RequestFinished { .. } => {
                        ConnectorReply::Finished { delay_free: true, kv_transfer_params: handoff.clone() }
                    }
                    _ => r,
                })
                .collect(),
        )
    };
    let (mut step, mut io) = EngineStep::start(&mut st, |_| Default::default());
    let done = loop {
        io = match io {
            StepIo::Connector(calls) => step.on_connector(&mut st, answer(&calls)),
            StepIo::Worker(out) => {
                let sampled = out
                    .chunks
                    .iter()
                    .filter(|c| c.sample)
                    .map(|c| SampledToken { request_id: c.request_id.clone(), token_id: 7, logprobs: None })
                    .collect();
                let ran = ModelRunnerOutput { step_id: out.step_id, sampled, ..Default::default() };
                step.on_worker(&mut st, WorkerAnswer::Ran(ran))
            }
            StepIo::Done(done) => break done,
        };
    };
    let handed: Vec<_> = done
        .outputs
        .iter()
        .filter(|o| o.kv_transfer_params.as_ref().is_some_and(KvTransferParams::wants_remote_prefill))
        .map(|o| o.request_id.as_str())
        .collect();
    assert_eq!(handed, ["p-req"], "the hand-off goes out with the step that finished it");
    assert_eq!(done.next, StepNext::Now, "the step registering the hold runs at once");
    assert!(st.sched.holds("p-req"), "P keeps the blocks held for D");
}
