//! The engine step driver without its peers: what a step does when the connector-scheduler
//! cannot be reached. A remote prefill's KV is held on P for it, so D must never compute it
//! locally behind the connector's back (that skips `kv_load_failure_policy` and leaves P
//! holding its blocks until the hold deadline); a request without remote KV has nothing to
//! load and runs.
//!
//! And when a step asks the connector nothing (D64): a steady decode step, with nothing to tell
//! the connector and nothing queued there, goes straight to the worker; an added, finished or
//! aborted request, a rejection notice, a non-empty or lost answer, or the driver's clock
//! (`force_meta`, for D's heartbeats) brings the metadata round back.
//!
//! And when a step reports the load to the dp-lb (D75): only after a change. And which worker
//! process a step is for (D113).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use pdmesh_engine_core::scheduler::{Scheduler, SchedulerConfig};
use pdmesh_engine_core::step::{notice_calls, EngineState, EngineStep, StepDone, StepIo, WorkerAnswer, WorkerChange};
use pdmesh_protocol::{
    ConnectorCall, ConnectorReply, EngineRequest, KvConnectorMetadata, KvTransferParams, ModelRunnerOutput,
    RejectionNotice, SampledToken, SamplingParams,
};

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

/// One step driven to its end: every connector batch it sent, and how it ended. The worker
/// samples token 7 for every chunk that samples.
struct Stepped {
    rounds: Vec<Vec<ConnectorCall>>,
    done: StepDone,
}

impl Stepped {
    /// Whether the step asked the connector-scheduler for its metadata.
    fn asked_meta(&self) -> bool {
        self.rounds.iter().flatten().any(|c| matches!(c, ConnectorCall::BuildConnectorMeta { .. }))
    }

    fn finished_calls(&self) -> Vec<&str> {
        self.rounds
            .iter()
            .flatten()
            .filter_map(|c| match c {
                ConnectorCall::RequestFinished { request_id, .. } => Some(request_id.as_str()),
                _ => None,
            })
            .collect()
    }
}

fn run(st: &mut EngineState, mut answer: impl FnMut(&[ConnectorCall]) -> Option<Vec<ConnectorReply>>) -> Stepped {
    let mut rounds = Vec::new();
    let (mut step, mut io) = EngineStep::start(st, |_| Default::default());
    let done = loop {
        io = match io {
            StepIo::Connector(calls) => {
                let replies = answer(&calls);
                rounds.push(calls);
                step.on_connector(st, replies)
            }
            StepIo::Worker(out) => {
                let sampled = out
                    .chunks
                    .iter()
                    .filter(|c| c.sample)
                    .map(|c| SampledToken { request_id: c.request_id.clone(), token_id: 7, logprobs: None })
                    .collect();
                let ran = ModelRunnerOutput { step_id: out.step_id, sampled, ..Default::default() };
                step.on_worker(st, WorkerAnswer::Ran(ran))
            }
            StepIo::Done(done) => break done,
        };
    };
    Stepped { rounds, done }
}

fn decoding(id: &str, first_token: u32, max_tokens: u32) -> EngineRequest {
    let mut r = request(id, first_token, false);
    r.sampling.max_tokens = max_tokens;
    r
}

/// A state with `long` decoding steadily: its prefill step and the step after it (which
/// settles the prefill's connector round) are behind it.
fn steady(long: &str) -> EngineState {
    let mut st = state();
    st.inbox.adds.push(decoding(long, 100, 50));
    let first = run(&mut st, noop);
    assert!(first.asked_meta(), "a new request's step asks the connector");
    assert!(first.done.executed);
    st
}

/// A steady decode step: it runs on the worker without a word to the connector.
fn assert_quiet(st: &mut EngineState, what: &str) {
    let s = run(st, |calls| panic!("{what}: a steady decode step asked the connector {calls:?}"));
    assert!(s.done.executed && !s.done.meta_round, "{what}: the step must run on the worker, without a meta round");
}

#[test]
fn a_steady_decode_step_asks_the_connector_nothing() {
    let mut st = steady("long");
    for i in 0..5 {
        assert_quiet(&mut st, &format!("decode step {i}"));
    }
    // The steps decoded: the worker's tokens reached the request.
    let out = run(&mut st, noop).done.outputs;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].new_token_ids, [7], "the skipped rounds must not cost the request its tokens");
}

#[test]
fn an_added_request_brings_the_meta_round_back_and_the_steps_after_it_are_quiet_again() {
    let mut st = steady("long");
    assert_quiet(&mut st, "before the add");
    st.inbox.adds.push(decoding("new", 200, 50));
    let s = run(&mut st, noop);
    assert!(s.asked_meta(), "the add's step must ask the connector for its metadata");
    assert_quiet(&mut st, "after the add's round");
}

#[test]
fn a_finished_request_brings_the_meta_round_back() {
    let mut st = steady("long");
    st.inbox.adds.push(decoding("short", 200, 3));
    run(&mut st, noop);
    let mut finished_at = None;
    for i in 0..6 {
        let s = run(&mut st, noop);
        if s.finished_calls() == ["short"] {
            finished_at = Some(i);
            break;
        }
    }
    assert!(finished_at.is_some(), "the short request finished and its request_finished went out");
    // The connector was told: what it queued for the worker needs the next step's round.
    assert!(run(&mut st, noop).asked_meta(), "the step after a request_finished must ask for metadata");
    assert_quiet(&mut st, "after the finish's round");
}

#[test]
fn an_aborted_request_brings_the_meta_round_back() {
    let mut st = steady("long");
    st.inbox.adds.push(decoding("gone", 200, 50));
    run(&mut st, noop);
    assert_quiet(&mut st, "both decoding");
    st.inbox.aborts.push("gone".into());
    let s = run(&mut st, noop);
    assert_eq!(s.finished_calls(), ["gone"], "the abort's request_finished goes out with the step's round");
    assert!(s.asked_meta(), "the abort's step must ask for metadata");
    assert_quiet(&mut st, "after the abort's round");
}

#[test]
fn the_drivers_clock_forces_a_meta_round_for_heartbeats() {
    let mut st = steady("long");
    assert_quiet(&mut st, "before the clock");
    st.force_meta = true;
    let s = run(&mut st, noop);
    assert!(s.asked_meta() && s.done.meta_round, "force_meta must send a metadata round");
    assert!(!st.force_meta, "the forced round clears the flag");
    assert_quiet(&mut st, "after the forced round");
}

#[test]
fn a_non_empty_or_lost_meta_answer_keeps_the_round_going() {
    let mut st = steady("long");
    assert_quiet(&mut st, "before");
    // A forced round that brings heartbeats back: D's connector may have more, so ask again.
    st.force_meta = true;
    let heartbeats = |calls: &[ConnectorCall]| {
        let mut r = noop(calls)?;
        if let Some(ConnectorReply::Meta(m)) = r.last_mut() {
            *m = KvConnectorMetadata { reqs_to_heartbeat: vec![KvTransferParams::default()], ..Default::default() };
        }
        Some(r)
    };
    assert!(run(&mut st, heartbeats).asked_meta());
    assert!(run(&mut st, |_| None).asked_meta(), "after a non-empty answer the next step asks again");
    // That answer was lost: ask once more; an empty answer quiets the steps again.
    assert!(run(&mut st, noop).asked_meta(), "after a lost answer the next step asks again");
    assert_quiet(&mut st, "after an empty answer");
}

#[test]
fn a_rejection_notice_between_steps_brings_the_meta_round_back() {
    let mut st = steady("long");
    assert_quiet(&mut st, "before the notice");
    let params = request("refused", 300, true).kv_transfer_params.unwrap();
    let calls = notice_calls(
        &mut st,
        RejectionNotice { params, data_parallel_rank: None, rejected_at_unix_us: None, trace: Default::default() },
    );
    assert!(!calls.is_empty());
    assert!(run(&mut st, noop).asked_meta(), "the connector changed outside a step: the next step asks it");
    assert_quiet(&mut st, "after the notice's round");
}

/// P's side (D65): the answer carrying the params D needs leaves with the step whose
/// `request_finished` produced it, not one step later (D16's hold-back), and that step asks for
/// the next one at once, whose metadata registers the hold on P's worker.
#[test]
fn a_hand_off_leaves_with_the_step_that_finished_it() {
    use pdmesh_engine_core::step::StepNext;
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
    let done = run(&mut st, answer).done;
    let handed: Vec<_> = done
        .outputs
        .iter()
        .filter(|o| o.kv_transfer_params.as_ref().is_some_and(KvTransferParams::wants_remote_prefill))
        .map(|o| o.request_id.as_str())
        .collect();
    assert_eq!(handed, ["p-req"], "the hand-off goes out with the step that finished it");
    assert_eq!(done.next, StepNext::Now, "the step registering the hold runs at once");
    assert!(st.sched.holds("p-req"), "P keeps the blocks held for D");
    // The next step carries the hold to the worker: it must ask the connector for metadata.
    assert!(run(&mut st, noop).asked_meta(), "the hold registers through the next step's metadata round");
}

/// D75: a rank tells the dp-lb its load after a step only when something in it changed; a
/// steady decode step reports nothing (the dp-lb is off each token's path). Fails if a
/// steady step reports, or if an add, an abort, a finish or the driver's clock goes unreported.
#[test]
fn a_load_report_goes_out_only_when_the_load_or_the_requests_changed() {
    let mut st = state();
    st.inbox.adds.push(decoding("long", 100, 50));
    let s = run(&mut st, noop);
    let first = st.load_report(&s.done.outputs, false).expect("the add's step reports");
    assert_eq!((first.num_waiting, first.num_running), (0, 1));
    for i in 0..3 {
        let s = run(&mut st, noop);
        assert_eq!(st.load_report(&s.done.outputs, false), None, "steady decode step {i} reports nothing");
    }
    let s = run(&mut st, noop);
    assert!(st.load_report(&s.done.outputs, true).is_some(), "the driver's clock brings a report");

    st.inbox.adds.push(decoding("short", 200, 2));
    let s = run(&mut st, noop);
    let added = st.load_report(&s.done.outputs, false).expect("the add's step reports");
    assert_eq!(added.num_running, 2);
    let mut named = Vec::new();
    for _ in 0..6 {
        let s = run(&mut st, noop);
        if let Some(r) = st.load_report(&s.done.outputs, false) {
            named.extend(r.finished_request_ids);
            break;
        }
    }
    assert_eq!(named, ["short"], "the report after the finish names the finished request");

    // An abort changes no count here (the id is unknown), yet its step reports: the dp-lb
    // resets what it counts as sent since the last report.
    st.inbox.aborts.push("nobody".into());
    let s = run(&mut st, noop);
    assert!(st.load_report(&s.done.outputs, false).is_some(), "an abort's step reports");
    let s = run(&mut st, noop);
    assert_eq!(st.load_report(&s.done.outputs, false), None, "and the steady steps after it do not");
}

/// D113: the step state knows which worker process its KV state describes. Every step names
/// it; a new one seen fails the requests whose KV lived in the old process and frees their
/// blocks before the next step, and a link that went down or came back holds steps until the
/// worker's `WorkerInfo` says which process answers.
#[test]
fn a_restarted_worker_is_recognised_before_any_step_reaches_it() {
    let mut st = state();
    assert!(!st.can_step(), "no step before the worker is known");
    assert_eq!(st.worker_seen("w-1"), WorkerChange::First);
    assert!(st.can_step());
    // The request's prefill: the step names the incarnation it was built for.
    st.inbox.adds.push(decoding("long", 100, 50));
    let (mut step, mut io) = EngineStep::start(&mut st, |_| Default::default());
    let mut named = None;
    loop {
        io = match io {
            StepIo::Connector(calls) => step.on_connector(&mut st, noop(&calls)),
            StepIo::Worker(out) => {
                named = out.worker_incarnation.clone();
                let sampled = vec![SampledToken { request_id: "long".into(), token_id: 7, logprobs: None }];
                let ran = ModelRunnerOutput { step_id: out.step_id, sampled, ..Default::default() };
                step.on_worker(&mut st, WorkerAnswer::Ran(ran))
            }
            StepIo::Done(_) => break,
        };
    }
    assert_eq!(named.as_deref(), Some("w-1"), "a step names the worker incarnation it was built for");
    assert!(st.sched.kv_usage().used_blocks > 0);
    // The link drops and comes back: no step until the worker says who it is.
    st.worker_unconfirmed();
    assert!(!st.can_step());
    assert_eq!(st.worker_seen("w-1"), WorkerChange::Same, "a reconnect of the same process loses nothing");
    assert!(st.sched.has_requests());
    // A new process: the running request's KV is gone with the old one.
    st.worker_unconfirmed();
    assert_eq!(st.worker_seen("w-2"), WorkerChange::Restarted { lost: 1 });
    assert!(st.can_step());
    let out = run(&mut st, noop).done.outputs;
    assert!(
        out.iter().any(|o| o.request_id == "long" && o.error.is_some()),
        "the lost request ends with an error: {out:?}"
    );
    assert_eq!(st.sched.kv_usage().used_blocks, 0, "its blocks are free");
}
