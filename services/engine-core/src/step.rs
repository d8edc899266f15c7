//! One engine step as a sans-IO state machine: vLLM's step sequence (inputs → connector
//! matches → schedule → connector allocation calls and metadata → execute → sampled tokens →
//! `request_finished` → the worker's connector output → outputs), with every call to another
//! process turned into a value the driver answers.
//!
//! The engine actor drives it over ZeroMQ ([`crate::engine`]); the lifecycle property test
//! (`connector-worker/tests/lifecycle.rs`) and the in-process benchmark (`pdmesh-load
//! overhead`) drive it with direct calls. All three therefore run this code, and a rule the
//! property test proves is a rule of the engine that serves requests.
//!
//! ```text
//! let (mut step, mut io) = EngineStep::start(&mut state);
//! loop {
//!     io = match io {
//!         StepIo::Connector(calls) => step.on_connector(&mut state, ask_connector(calls)),
//!         StepIo::Worker(output) => step.on_worker(&mut state, run_on_worker(output)),
//!         StepIo::Done(done) => break done,
//!     }
//! }
//! ```

use pdmesh_protocol::{
    ConnectorCall, ConnectorReply, EngineLoadReport, EngineOutput, EngineRequest, ErrorClass, KvConnectorMetadata,
    KvConnectorOutput, KvTransferParams, ModelRunnerOutput, RecvRequest, RejectionNotice, ScheduledChunk,
    SchedulerOutput, TraceContext,
};

use crate::scheduler::{AdmissionError, Scheduler};

/// Inputs that arrived between steps; applied at the start of the next step, as vLLM's
/// engine core drains its input queue (docs/DECISIONS.md D6).
#[derive(Debug, Default)]
pub struct Inbox {
    pub adds: Vec<EngineRequest>,
    pub aborts: Vec<String>,
    /// Rule R1: notify-only receives that could not be pushed to the worker at once: they go
    /// out with the next step's metadata instead.
    pub undelivered_recvs: Vec<RecvRequest>,
}

impl Inbox {
    pub fn is_empty(&self) -> bool {
        self.adds.is_empty() && self.aborts.is_empty() && self.undelivered_recvs.is_empty()
    }
}

/// Everything the step loop of one rank owns besides its sockets.
#[derive(Debug)]
pub struct EngineState {
    pub rank: u32,
    pub sched: Scheduler,
    pub inbox: Inbox,
    pub step_id: u64,
    /// Set by the driver from its own clock: the next step asks the connector for its
    /// metadata even when no call since the last (empty) one could have changed it. The
    /// connector's one time-driven part, D's heartbeats to P, needs such a round now and then;
    /// the state machine itself never reads a clock, so it stays deterministic (D64).
    pub force_meta: bool,
    /// Connector calls sent so far that can change what its next metadata carries (every call
    /// but `BuildConnectorMeta`, the calls of rejection notices included).
    connector_calls: u64,
    /// `connector_calls` when the last `BuildConnectorMeta` went out, if its answer was
    /// empty: while `connector_calls` has not moved since, the connector has nothing queued
    /// and a metadata round would only carry an empty answer back (D64).
    quiet_at: Option<u64>,
    /// Set when a step took in added or aborted requests: its load report goes out even if
    /// the counts came out as before (the dp-lb counts what it sent since the last report, D75).
    load_touched: bool,
    /// The (waiting, running) counts of the last load report sent.
    last_reported: Option<(u32, u32)>,
    /// The worker incarnation the scheduler's KV state describes (the last `WorkerInfo`'s).
    /// Every step names it, so a restarted worker refuses a step built for its predecessor.
    worker_incarnation: Option<String>,
    /// Whether that incarnation is confirmed since the worker's link last went down or came
    /// back; no step starts until it is ([`EngineState::can_step`]).
    worker_confirmed: bool,
}

/// What the driver learnt from the worker's `WorkerInfo` ([`EngineState::worker_seen`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerChange {
    /// The first worker this engine has seen.
    First,
    /// The same process as before (its link only reconnected).
    Same,
    /// A new process: the KV the old one held is gone; `lost` requests were failed.
    Restarted { lost: usize },
}

impl EngineState {
    pub fn new(rank: u32, sched: Scheduler) -> Self {
        Self {
            rank,
            sched,
            inbox: Inbox::default(),
            step_id: 0,
            force_meta: false,
            connector_calls: 0,
            quiet_at: None,
            load_touched: false,
            last_reported: None,
            worker_incarnation: None,
            worker_confirmed: false,
        }
    }

    /// Whether a step may go to the worker: only once the driver knows which worker
    /// incarnation it talks to. A step sent while a restarted worker is not yet recognised
    /// would run over block tables whose KV died with the old process.
    pub fn can_step(&self) -> bool {
        self.worker_confirmed
    }

    /// The worker's link went down or came back: until its `WorkerInfo` says which process
    /// answers, no step starts.
    pub fn worker_unconfirmed(&mut self) {
        self.worker_confirmed = false;
    }

    /// The worker's `WorkerInfo` named `incarnation`. Another one than the scheduler's state
    /// was built with means the worker restarted: everything whose KV lived there fails and
    /// its blocks are freed ([`Scheduler::worker_restarted`]) before any step reaches the new
    /// process.
    pub fn worker_seen(&mut self, incarnation: &str) -> WorkerChange {
        let change = match self.worker_incarnation.as_deref() {
            None => WorkerChange::First,
            Some(old) if old == incarnation => WorkerChange::Same,
            Some(_) => {
                WorkerChange::Restarted { lost: self.sched.worker_restarted("unavailable: connector-worker restarted") }
            }
        };
        self.worker_incarnation = Some(incarnation.to_string());
        self.worker_confirmed = true;
        change
    }

    /// Whether a metadata round could carry anything: a call since the last empty answer,
    /// a non-empty or lost last answer, or the driver's clock asking for one.
    pub fn needs_connector_meta(&self) -> bool {
        self.force_meta || self.quiet_at != Some(self.connector_calls)
    }

    /// Count connector calls about to go out (all but `BuildConnectorMeta` change what the
    /// connector may queue for the next metadata).
    fn note_calls(&mut self, calls: &[ConnectorCall]) {
        let n = calls.iter().filter(|c| !matches!(c, ConnectorCall::BuildConnectorMeta { .. })).count();
        self.connector_calls += n as u64;
    }

    /// The load report the dp-lb routes by.
    pub fn load(&self) -> EngineLoadReport {
        EngineLoadReport {
            engine_rank: self.rank,
            num_waiting: self.sched.num_waiting(),
            num_running: self.sched.num_running(),
            kv: self.sched.kv_usage(),
            finished_request_ids: Vec::new(),
        }
    }

    /// The load report owed after a step that sent `outputs`, if any is (D75): when a request
    /// finished (the report names it), was added or aborted, when the counts moved since the
    /// last report, or when the driver says one is `overdue` (its clock: a dp-lb that
    /// restarted learns the load within that time even while nothing changes). A steady
    /// decode step owes none, so it costs the dp-lb nothing.
    pub fn load_report(&mut self, outputs: &[EngineOutput], overdue: bool) -> Option<EngineLoadReport> {
        let finished: Vec<String> =
            outputs.iter().filter(|o| o.finish_reason.is_some()).map(|o| o.request_id.clone()).collect();
        let mut report = self.load();
        let counts = (report.num_waiting, report.num_running);
        if finished.is_empty() && !self.load_touched && !overdue && self.last_reported == Some(counts) {
            return None;
        }
        self.load_touched = false;
        self.last_reported = Some(counts);
        report.finished_request_ids = finished;
        Some(report)
    }
}

/// When the driver should run the next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepNext {
    /// Work is waiting: step again at once.
    Now,
    /// Only connector work (held blocks, loads in flight): poll again shortly.
    Soon,
    /// Nothing to do until an input arrives.
    Idle,
}

/// What the step needs from outside before it can go on.
// One value per step stage, handed straight to the driver: boxing a variant saves nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum StepIo {
    /// Ask the connector-scheduler these calls, in order, and answer with
    /// [`EngineStep::on_connector`] (`None`: it could not be reached).
    Connector(Vec<ConnectorCall>),
    /// Run this step on the worker and answer with [`EngineStep::on_worker`].
    Worker(SchedulerOutput),
    /// The step is over.
    Done(StepDone),
}

/// The worker's answer to a step.
#[derive(Debug)]
pub enum WorkerAnswer {
    /// The worker answered: a forward pass (ran or failed) and the step's connector output.
    Ran(ModelRunnerOutput),
    /// No usable answer (an error, an unexpected message, the worker unreachable): the
    /// step's requests fail with this reason and no connector output arrives.
    Failed(String),
}

/// What a finished step produced.
#[derive(Debug)]
pub struct StepDone {
    /// Outputs for the clients, in order.
    pub outputs: Vec<EngineOutput>,
    /// Rule R1 inside the engine: remote-prefill requests the scheduler refused at admission;
    /// the driver sends each one's notice so P frees at once.
    pub refused: Vec<RejectionNotice>,
    /// The requests refused at admission, and why.
    pub refusals: Vec<(String, AdmissionError)>,
    pub next: StepNext,
    /// Whether the worker ran a step, and how many tokens it was given.
    pub executed: bool,
    pub scheduled_tokens: u32,
    /// Whether the step asked the connector-scheduler for its metadata; `false` when it went
    /// straight to the worker because the connector had nothing to say (D64).
    pub meta_round: bool,
}

enum Phase {
    /// Waiting for the answers to `get_num_new_matched_tokens`.
    Matching {
        ids: Vec<String>,
    },
    /// Waiting for `update_state_after_alloc` + owed `request_finished` + `build_connector_meta`.
    Allocating {
        chunks: Vec<ScheduledChunk>,
        finished_request_ids: Vec<String>,
        allocs: usize,
        finishing: Vec<ConnectorCall>,
        scheduled_tokens: u32,
        /// `EngineState::connector_calls` when `build_connector_meta` went out.
        meta_at: u64,
    },
    /// Waiting for the worker.
    Executing {
        chunks: Vec<ScheduledChunk>,
    },
    /// Waiting for the `request_finished` calls of this step and `update_connector_output`.
    Finishing {
        finishing: Vec<ConnectorCall>,
        kv_output: KvConnectorOutput,
    },
    Over,
}

/// One engine step in progress. See the module docs for how it is driven.
pub struct EngineStep {
    phase: Phase,
    outputs: Vec<EngineOutput>,
    refused: Vec<RejectionNotice>,
    refusals: Vec<(String, AdmissionError)>,
    chunks_ran: bool,
    executed: bool,
    scheduled_tokens: u32,
    /// Whether a load (a remote prefill's read) settled in this step: its request can run now.
    loads_settled: bool,
    meta_round: bool,
    /// Whether this step answered a hand-off to D: its hold registers in the next step.
    handed_off: bool,
}

impl EngineStep {
    /// Apply the inputs and start the step. `trace_of` gives a refused request's trace
    /// context, for its notice.
    pub fn start(st: &mut EngineState, trace_of: impl Fn(&str) -> TraceContext) -> (Self, StepIo) {
        let mut step = Self {
            phase: Phase::Over,
            outputs: Vec::new(),
            refused: Vec::new(),
            refusals: Vec::new(),
            chunks_ran: false,
            executed: false,
            scheduled_tokens: 0,
            loads_settled: false,
            meta_round: false,
            handed_off: false,
        };
        if !st.inbox.adds.is_empty() || !st.inbox.aborts.is_empty() {
            st.load_touched = true;
        }
        for req in std::mem::take(&mut st.inbox.adds) {
            let id = req.request_id.clone();
            let params = req.kv_transfer_params.clone();
            if let Err(e) = st.sched.add_request(req) {
                step.outputs.push(EngineOutput::failed(&id, e.output_message()));
                if let Some(params) = params.filter(KvTransferParams::wants_remote_prefill) {
                    step.refused.push(RejectionNotice {
                        params,
                        data_parallel_rank: Some(st.rank),
                        rejected_at_unix_us: Some(pdmesh_protocol::unix_micros()),
                        trace: trace_of(&id),
                    });
                }
                step.refusals.push((id, e));
            }
        }
        let aborts = std::mem::take(&mut st.inbox.aborts);
        if !aborts.is_empty() {
            st.sched.abort_requests(&aborts);
        }
        let queries = st.sched.match_queries();
        if queries.is_empty() {
            let io = step.schedule(st);
            return (step, io);
        }
        let ids = queries
            .iter()
            .filter_map(|c| match c {
                ConnectorCall::GetNumNewMatchedTokens { request_id, .. } => Some(request_id.clone()),
                _ => None,
            })
            .collect();
        st.note_calls(&queries);
        step.phase = Phase::Matching { ids };
        (step, StepIo::Connector(queries))
    }

    /// The connector-scheduler's answers to the last [`StepIo::Connector`]; `None` when it
    /// could not be reached (then: no external tokens, and every finished request frees now).
    pub fn on_connector(&mut self, st: &mut EngineState, replies: Option<Vec<ConnectorReply>>) -> StepIo {
        match std::mem::replace(&mut self.phase, Phase::Over) {
            Phase::Matching { ids } => {
                for (i, id) in ids.iter().enumerate() {
                    match replies.as_ref().and_then(|r| r.get(i)) {
                        Some(ConnectorReply::MatchedTokens { count, load_async }) => {
                            st.sched.apply_match(id, *count, *load_async)
                        }
                        // Connector unreachable. A remote prefill's KV is held on P for
                        // it: computing it here would skip the policy and leave P holding
                        // its blocks until the hold deadline, so it is asked again next
                        // step. Anything else has no external tokens: compute locally.
                        _ if st.sched.wants_remote_prefill(id) => st.sched.apply_match(id, None, false),
                        _ => st.sched.apply_match(id, Some(0), false),
                    }
                }
                self.schedule(st)
            }
            Phase::Allocating { chunks, finished_request_ids, allocs, finishing, scheduled_tokens, meta_at } => {
                apply_finished_replies(
                    &mut st.sched,
                    &finishing,
                    replies.as_deref().map(|r| r.get(allocs..).unwrap_or(&[])),
                );
                let (answered, mut meta) = match replies.as_ref().and_then(|r| r.last()) {
                    Some(ConnectorReply::Meta(meta)) => (true, meta.clone()),
                    _ => (false, KvConnectorMetadata::default()),
                };
                // Every field counts (heartbeats too, which `is_empty` leaves out): only an
                // answer with nothing in it lets the next steps skip the round. A lost or
                // malformed answer (connector unreachable) never does.
                let quiet = answered && meta == KvConnectorMetadata::default();
                st.quiet_at = quiet.then_some(meta_at);
                let stale = st.sched.retain_held_metadata(&mut meta);
                if stale > 0 {
                    tracing::warn!(
                        stale,
                        "dropped holds and saves of blocks this engine no longer holds (freed by a worker restart)"
                    );
                }
                self.execute(st, chunks, finished_request_ids, meta, scheduled_tokens)
            }
            Phase::Finishing { finishing, kv_output } => {
                apply_finished_replies(&mut st.sched, &finishing, replies.as_deref());
                self.complete(st, kv_output)
            }
            other => {
                self.phase = other;
                tracing::error!("connector answer outside a connector phase; the step ends");
                StepIo::Done(self.done(st))
            }
        }
    }

    /// The worker's answer to [`StepIo::Worker`].
    pub fn on_worker(&mut self, st: &mut EngineState, answer: WorkerAnswer) -> StepIo {
        let Phase::Executing { chunks } = std::mem::replace(&mut self.phase, Phase::Over) else {
            tracing::error!("worker answer outside the execute phase; ignored");
            return StepIo::Done(self.done(st));
        };
        let mut kv_output = KvConnectorOutput::default();
        match answer {
            WorkerAnswer::Ran(out) => {
                match &out.failure {
                    None => st.sched.update_from_output(&chunks, &out),
                    Some(e) => {
                        let reason = match e.class {
                            ErrorClass::Unavailable => format!("unavailable: connector-worker: {}", e.message),
                            _ => format!("worker error: {}", e.message),
                        };
                        st.sched.fail_requests(&Scheduler::ids_of(&chunks), &reason);
                    }
                }
                // Applied whether or not the model ran: the holds and loads it reports ended.
                kv_output = out.kv_connector_output;
            }
            WorkerAnswer::Failed(reason) => st.sched.fail_requests(&Scheduler::ids_of(&chunks), &reason),
        }
        self.finish(st, kv_output)
    }

    /// Schedule, then ask the connector what it allocated and what finished. When there is
    /// nothing to tell it and it has nothing queued (no call since its last empty metadata, no
    /// heartbeat round asked for by the driver), the round is skipped: a steady decode step
    /// goes straight to the worker with the engine's own metadata parts (D64).
    fn schedule(&mut self, st: &mut EngineState) -> StepIo {
        st.step_id += 1;
        let schedule = st.sched.schedule();
        let finishing = st.sched.finishing_calls();
        let mut calls: Vec<ConnectorCall> = schedule.alloc_calls;
        if calls.is_empty() && finishing.is_empty() && !st.needs_connector_meta() {
            return self.execute(
                st,
                schedule.chunks,
                schedule.finished_request_ids,
                KvConnectorMetadata::default(),
                schedule.num_scheduled_tokens,
            );
        }
        let allocs = calls.len();
        calls.extend(finishing.iter().cloned());
        calls.push(ConnectorCall::BuildConnectorMeta { step_id: st.step_id });
        st.note_calls(&calls);
        st.force_meta = false;
        self.meta_round = true;
        self.phase = Phase::Allocating {
            chunks: schedule.chunks,
            finished_request_ids: schedule.finished_request_ids,
            allocs,
            finishing,
            scheduled_tokens: schedule.num_scheduled_tokens,
            meta_at: st.connector_calls,
        };
        StepIo::Connector(calls)
    }

    /// Hand the step to the worker with the connector's metadata plus the engine's own parts
    /// (receives not yet delivered, holds aborted after finish); a step with nothing to run or
    /// tell skips the worker too.
    fn execute(
        &mut self,
        st: &mut EngineState,
        chunks: Vec<ScheduledChunk>,
        finished_request_ids: Vec<String>,
        mut meta: KvConnectorMetadata,
        scheduled_tokens: u32,
    ) -> StepIo {
        meta.reqs_to_recv.extend(std::mem::take(&mut st.inbox.undelivered_recvs));
        meta.reqs_aborted_after_finish = st.sched.take_aborted_held();
        self.chunks_ran = !chunks.is_empty();
        if chunks.is_empty() && meta.is_empty() && !st.sched.has_requests() {
            return self.finish(st, KvConnectorOutput::default());
        }
        self.executed = true;
        self.scheduled_tokens = scheduled_tokens;
        let output = SchedulerOutput {
            step_id: st.step_id,
            chunks: chunks.clone(),
            finished_request_ids,
            kv_connector_metadata: meta,
            worker_incarnation: st.worker_incarnation.clone(),
        };
        self.phase = Phase::Executing { chunks };
        StepIo::Worker(output)
    }

    /// `request_finished` for what finished in this step, and the worker's connector output.
    fn finish(&mut self, st: &mut EngineState, kv_output: KvConnectorOutput) -> StepIo {
        let finishing = st.sched.finishing_calls();
        let mut calls = finishing.clone();
        if !kv_output.is_empty() {
            calls.push(ConnectorCall::UpdateConnectorOutput(kv_output.clone()));
        }
        if calls.is_empty() {
            return self.complete(st, kv_output);
        }
        st.note_calls(&calls);
        self.phase = Phase::Finishing { finishing, kv_output };
        StepIo::Connector(calls)
    }

    fn complete(&mut self, st: &mut EngineState, kv_output: KvConnectorOutput) -> StepIo {
        self.loads_settled |= !kv_output.finished_recving.is_empty();
        st.sched.update_from_kv_output(&kv_output);
        // A hand-off (the params D needs) goes out now, with the step that ran
        // `request_finished`; its hold registers with the next step's metadata, and P's worker
        // parks a lease that comes before that (D65, replacing D16's hold-back).
        for o in st.sched.take_outputs() {
            self.handed_off |= o.kv_transfer_params.as_ref().is_some_and(KvTransferParams::wants_remote_prefill);
            self.outputs.push(o);
        }
        StepIo::Done(self.done(st))
    }

    fn done(&mut self, st: &EngineState) -> StepDone {
        // A settled load makes its request runnable: step at once rather than at the next
        // idle tick (D57). A hand-off's hold registers in the next step: at once, so a reader
        // that asks early waits as little as possible (D65).
        let next = if self.chunks_ran || self.loads_settled || self.handed_off || !st.inbox.is_empty() {
            StepNext::Now
        } else if st.sched.has_requests() {
            StepNext::Soon
        } else {
            StepNext::Idle
        };
        StepDone {
            outputs: std::mem::take(&mut self.outputs),
            refused: std::mem::take(&mut self.refused),
            refusals: std::mem::take(&mut self.refusals),
            next,
            executed: self.executed,
            scheduled_tokens: self.scheduled_tokens,
            meta_round: self.meta_round,
        }
    }
}

/// The connector calls that hand a rejection notice (rule R1) to the connector at once, outside
/// any step: the notice, then the notify-only receives it made. [`notice_receives`] reads the
/// answer. Counted in `st`: the connector changed outside a step, so the next step asks for
/// its metadata again.
pub fn notice_calls(st: &mut EngineState, notice: RejectionNotice) -> Vec<ConnectorCall> {
    st.connector_calls += 2;
    vec![
        ConnectorCall::RequestRejectedBeforeAdmission {
            params: notice.params,
            rejected_at_unix_us: notice.rejected_at_unix_us,
            trace: notice.trace,
        },
        ConnectorCall::TakeRejectionRecvs,
    ]
}

/// The answer to [`notice_calls`]: whether the connector accepted the notice, and the
/// metadata carrying its notify-only receives for the worker (when there are any).
pub fn notice_receives(replies: &[ConnectorReply]) -> (bool, Option<KvConnectorMetadata>) {
    let accepted = matches!(replies.first(), Some(ConnectorReply::Ack));
    let meta = match replies.get(1) {
        Some(ConnectorReply::Meta(meta)) if !meta.reqs_to_recv.is_empty() => Some(meta.clone()),
        _ => None,
    };
    (accepted, meta)
}

/// Apply `request_finished` answers; without answers (connector unreachable) free at once.
fn apply_finished_replies(sched: &mut Scheduler, calls: &[ConnectorCall], replies: Option<&[ConnectorReply]>) {
    for (i, call) in calls.iter().enumerate() {
        let ConnectorCall::RequestFinished { request_id, .. } = call else { continue };
        match replies.and_then(|r| r.get(i)) {
            Some(ConnectorReply::Finished { delay_free, kv_transfer_params }) => {
                sched.apply_finished(request_id, *delay_free, kv_transfer_params.clone())
            }
            _ => sched.apply_finished(request_id, false, None),
        }
    }
}
