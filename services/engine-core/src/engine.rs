//! The engine-core actor and its step loop.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use pdmesh_config::NodeConfig;
use pdmesh_protocol::{
    ConnectorCall, ConnectorReply, EngineOutputBatch, Envelope, Hello, MeshStats, Message, RejectionNotice,
    SchedulerOutput, ServiceKind, WorkerInfo,
};
use pdmesh_service::{ServiceContext, Shutdown, Unfinished};
use pdmesh_transport::{connect_dealer, connect_push, LinkConfig, LinkEvent, LinkHandle, PushHandle, TransportError};
use thiserror::Error;

use crate::metrics as m;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::step::{self, EngineState, EngineStep, StepIo, StepNext, WorkerAnswer, WorkerChange};

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("config: {0}")]
    Config(#[from] pdmesh_config::ConfigError),
    #[error("engine.fault_injection: {0}")]
    Faults(String),
}

/// Time allowed for one connector-scheduler round trip.
const CONNECTOR_TIMEOUT: Duration = Duration::from_secs(10);
/// Tick interval when only connector work (held blocks) is pending.
const IDLE_CONNECTOR_TICK: Duration = Duration::from_millis(2);
/// The tick while the connector-scheduler is unreachable (it is being restarted).
const CONNECTOR_DOWN_TICK: Duration = Duration::from_millis(50);
/// The longest a running engine goes without a connector metadata round, however quiet the
/// connector is: D's heartbeats to P ride on those rounds (due every third of the hold), so a
/// round at least this often (or every sixth of a shorter hold) keeps them on time (D64).
const META_ROUND_AT_LEAST_EVERY: Duration = Duration::from_secs(1);

/// A busy rank reports its load at least this often even while it does not change (D75): a
/// dp-lb that restarted, or lost a report, routes by the right counts again within it.
const LOAD_REPORT_AT_LEAST_EVERY: Duration = Duration::from_secs(1);

/// Everything one step needs besides the scheduler.
#[derive(Clone)]
struct Peers {
    /// Connected only once the worker is ready, so the dp-lb never routes to a rank that
    /// cannot run a step yet.
    dplb: Option<LinkHandle>,
    outputs: PushHandle,
    connector: LinkHandle,
    worker: LinkHandle,
}

/// `engine.request` spans, open from AddRequest until the request's finishing output is sent;
/// steps and connector calls carry their contexts (`Envelope::traces`), see docs/TRACING.md.
static REQUEST_SPANS: pdmesh_telemetry::trace::RequestSpans = pdmesh_telemetry::trace::RequestSpans::new();

/// P's hand-offs leave with their finishing step (D65) and their holds register in the next
/// one: their spans stay open one step longer, so that step's worker call carries their trace
/// (the hold's `kv.hold` span and its events are children of the request's).
static HANDOFF_SPANS_CLOSING: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// The engine-core actor of one rank.
pub struct EngineCore {
    state: Rc<RefCell<EngineState>>,
    /// How long a worker step may take before its requests fail.
    step_timeout: Duration,
    /// The driver's clock for [`EngineState::force_meta`]: when the last metadata round went
    /// out, and how long steps may skip it.
    meta_clock: MetaClock,
    peers: Option<Peers>,
    stepping: bool,
    worker_info: Option<WorkerInfo>,
    health: pdmesh_telemetry::ops::Health,
    node: NodeConfig,
    run_dir: std::path::PathBuf,
}

#[derive(Message)]
#[rtype(result = "()")]
struct Tick;

impl Actor for EngineCore {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let rank = self.state.borrow().rank;
        let eps = self.node.endpoints(&self.run_dir);
        let me = ctx.address();
        let pid = std::process::id();
        let hello = |service| Envelope::new(Message::Hello(Hello { service, rank, pid }));
        let (Some(conn_ep), Some(worker_ep)) =
            (eps.connector_scheduler.get(rank as usize), eps.connector_worker.get(rank as usize))
        else {
            tracing::error!(rank, "no endpoints for this rank");
            System::current().stop_with_code(2);
            return;
        };
        let connector = connect_dealer(
            LinkConfig::new(&conn_ep.connect).identity(format!("engine-{rank}")).hello(hello(ServiceKind::EngineCore)),
            me.clone().recipient(),
        );
        let worker = connect_dealer(
            LinkConfig::new(&worker_ep.connect)
                .identity(format!("engine-{rank}"))
                .hello(hello(ServiceKind::EngineCore)),
            me.clone().recipient(),
        );
        // Outputs go straight to the frontend, as vLLM's engines send theirs to the API
        // server: no relay on each token's way (D75).
        let outputs = connect_push(&eps.frontend_outputs.connect);
        self.peers = Some(Peers { dplb: None, outputs, connector, worker });
    }
}

impl EngineCore {
    fn query_worker_info(&mut self, ctx: &mut Context<Self>) {
        let Some(peers) = self.peers.clone() else { return };
        let fut =
            async move { peers.worker.call(Envelope::new(Message::WorkerInfoQuery), Duration::from_secs(30)).await };
        ctx.spawn(fut.into_actor(self).map(|res, act, ctx| match res {
            Ok(Envelope { body: Message::WorkerInfo(info), .. }) => {
                let cfg = act.state.borrow().sched.config().clone();
                if info.block_size != cfg.block_size || info.num_blocks != cfg.num_blocks {
                    tracing::error!(?info, "worker KV geometry differs from the engine's configuration");
                    System::current().stop_with_code(2);
                    return;
                }
                // Steps wait for this answer (`EngineState::can_step`): a restart is applied
                // before any step reaches the new process.
                let change = act.state.borrow_mut().worker_seen(&info.incarnation);
                if let WorkerChange::Restarted { lost } = change {
                    m::WORKER_RESTARTS.inc();
                    tracing::warn!(lost_requests = lost, "connector-worker restarted: its KV is gone; failed its requests and freed held blocks");
                }
                // Cached blocks are only valid for the model that computed them.
                act.state.borrow_mut().sched.set_cache_salt(&info.model_name);
                tracing::info!(model = %info.model_name, num_blocks = info.num_blocks, incarnation = %info.incarnation, "worker ready");
                act.worker_info = Some(info);
                act.connect_dplb(ctx);
                act.update_health();
                act.kick(ctx);
            }
            other => {
                tracing::warn!(?other, "worker info not available yet; retrying");
                ctx.run_later(Duration::from_millis(200), |act, ctx| act.query_worker_info(ctx));
            }
        }));
    }

    /// Connect to the dp-lb once the worker is ready and the connector-scheduler is
    /// connected: only then can a step run, and a remote prefill routed here earlier would
    /// meet an engine that cannot ask its connector how to load it.
    fn connect_dplb(&mut self, ctx: &mut Context<Self>) {
        let Some(peers) = self.peers.as_mut() else { return };
        if peers.dplb.is_some() || !peers.connector.is_up() {
            return;
        }
        let rank = self.state.borrow().rank;
        let eps = self.node.endpoints(&self.run_dir);
        let hello =
            Envelope::new(Message::Hello(Hello { service: ServiceKind::EngineCore, rank, pid: std::process::id() }));
        peers.dplb = Some(connect_dealer(
            LinkConfig::new(&eps.dplb_engines.connect).identity(format!("engine-{rank}")).hello(hello),
            ctx.address().recipient(),
        ));
    }

    fn update_health(&self) {
        let ready = self.state.borrow().can_step()
            && self.peers.as_ref().is_some_and(|p| {
                p.dplb.as_ref().is_some_and(LinkHandle::is_up) && p.connector.is_up() && p.worker.is_up()
            });
        self.health.set_ready(ready);
    }

    /// Rule R1: hand the notice to the connector at once, whether a step runs or not; the
    /// connector-scheduler passes the notify-only receive it makes straight to the worker (or
    /// answers it, and it is pushed from here). The connector still owns the decision
    /// (complete params or not); a notice never waits for a step.
    fn notice_now(&mut self, n: pdmesh_protocol::RejectionNotice, ctx: &mut Context<Self>) {
        let Some(peers) = self.peers.clone() else { return };
        let (id, at) = (n.params.remote_request_id.clone().unwrap_or_default(), n.rejected_at_unix_us);
        let hop = move |hop: &'static str| pdmesh_telemetry::trace::notice_hop(hop, &id, at);
        let calls = step::notice_calls(&mut self.state.borrow_mut(), n);
        let fut = async move {
            let replies = connector_call(&peers.connector, calls).await.ok()?;
            hop("engine.connector_replied");
            let (accepted, meta) = step::notice_receives(&replies);
            m::NOTICES.with_label_values(&[if accepted { "accepted" } else { "invalid" }]).inc();
            let meta = meta?;
            let push = Envelope::new(Message::ConnectorMetadata(meta.clone()));
            if let Err(e) = peers.worker.call(push, Duration::from_secs(5)).await {
                tracing::warn!(error = %e, "worker did not take the rejection notice; it goes out with the next step");
                return Some(meta.reqs_to_recv);
            }
            hop("engine.worker_took");
            None
        };
        ctx.spawn(fut.into_actor(self).map(|undelivered, act, ctx| {
            if let Some(recvs) = undelivered {
                act.state.borrow_mut().inbox.undelivered_recvs.extend(recvs);
                act.kick(ctx);
            }
        }));
    }

    fn kick(&mut self, ctx: &mut Context<Self>) {
        // The worker's `WorkerInfo` re-kicks once it confirms which process answers.
        if self.stepping || !self.state.borrow().can_step() {
            return;
        }
        let Some(peers) = self.peers.clone() else { return };
        self.stepping = true;
        let state = self.state.clone();
        let clock = self.meta_clock.clone();
        ctx.spawn(run_step(state, peers, self.step_timeout, clock).into_actor(self).map(
            |(more, refused), act, ctx| {
                act.stepping = false;
                // Rule R1 holds inside the engine too: a remote-prefill request it refused (too
                // long, duplicate id...) after the dp-lb accepted it frees P at once.
                for notice in refused {
                    act.notice_now(notice, ctx);
                }
                match more {
                    StepNext::Now => ctx.notify(Tick),
                    StepNext::Soon => {
                        // Without the connector a step cannot decide anything: wait for it at a
                        // slower pace (its reconnect kicks a step at once).
                        let connector_up = act.peers.as_ref().is_some_and(|p| p.connector.is_up());
                        ctx.notify_later(Tick, if connector_up { IDLE_CONNECTOR_TICK } else { CONNECTOR_DOWN_TICK });
                    }
                    StepNext::Idle => {}
                }
            },
        ));
    }
}

impl Handler<Tick> for EngineCore {
    type Result = ();
    fn handle(&mut self, _: Tick, ctx: &mut Context<Self>) {
        self.kick(ctx);
    }
}

impl Handler<LinkEvent> for EngineCore {
    type Result = ();
    fn handle(&mut self, ev: LinkEvent, ctx: &mut Context<Self>) {
        match ev {
            LinkEvent::Up { endpoint } => {
                tracing::info!(%endpoint, "connected");
                let is_worker = self.peers.as_ref().is_some_and(|p| p.worker.endpoint() == endpoint);
                if is_worker {
                    // First connect, or a reconnect: the worker may have restarted (new
                    // incarnation), in which case its KV state is gone. No step until its
                    // `WorkerInfo` says which.
                    self.state.borrow_mut().worker_unconfirmed();
                    self.query_worker_info(ctx);
                }
                let is_connector = self.peers.as_ref().is_some_and(|p| p.connector.endpoint() == endpoint);
                if is_connector && self.worker_info.is_some() {
                    self.connect_dplb(ctx);
                }
                self.update_health();
                // A remote prefill asked again while the connector was away steps now.
                self.kick(ctx);
            }
            LinkEvent::Down { endpoint } => {
                tracing::warn!(%endpoint, "peer down");
                if self.peers.as_ref().is_some_and(|p| p.worker.endpoint() == endpoint) {
                    self.state.borrow_mut().worker_unconfirmed();
                }
                self.update_health();
            }
            LinkEvent::Message { envelope, .. } => self.on_message(envelope, ctx),
        }
    }
}

impl EngineCore {
    /// A new frontend process took over this node's output socket: send outputs to it from
    /// now on (the stream to its predecessor may look connected for tens of seconds, and what
    /// goes there is lost), and abort the requests the old process was waiting for — their
    /// clients went with it — which frees their blocks by the usual rules. Blocks held for
    /// remote readers are not requests anyone here waits for, and stay held.
    fn frontend_restarted(&mut self, pid: u32, ctx: &mut Context<Self>) {
        if let Some(peers) = &self.peers {
            peers.outputs.reconnect();
        }
        let orphans = self.state.borrow().sched.live_request_ids();
        tracing::info!(pid, orphans = orphans.len(), "new frontend process: output stream re-pointed");
        if !orphans.is_empty() {
            m::FRONTEND_ORPHANS_ABORTED.inc_by(orphans.len() as u64);
            self.state.borrow_mut().inbox.aborts.extend(orphans);
            self.kick(ctx);
        }
    }

    fn on_message(&mut self, env: Envelope, ctx: &mut Context<Self>) {
        match env.body {
            Message::AddRequest(req) => {
                tracing::debug!(request_id = %req.request_id, trace_id = %pdmesh_telemetry::trace::trace_id(&env.trace), "add request");
                let rank = self.state.borrow().rank;
                let span = tracing::info_span!("engine.request", otel.kind = "server", request_id = %req.request_id,
                    rank, prompt_tokens = req.prompt_token_ids.len(), max_tokens = req.sampling.max_tokens,
                    prefix_cache.hit_tokens = tracing::field::Empty);
                REQUEST_SPANS.open(&req.request_id, span, &env.trace);
                self.state.borrow_mut().inbox.adds.push(req);
                self.kick(ctx);
            }
            Message::Abort(a) => {
                self.state.borrow_mut().inbox.aborts.extend(a.request_ids);
                self.kick(ctx);
            }
            Message::RejectionNotice(mut n) => {
                if n.trace.traceparent.is_none() {
                    n.trace = env.trace.clone();
                }
                let id = n.params.remote_request_id.as_deref().unwrap_or("");
                pdmesh_telemetry::trace::notice_hop("engine.received", id, n.rejected_at_unix_us);
                // A release addressed to the blocks' holder (P): the router gave up between
                // the legs. It is an abort after finish of P's own request.
                // Only with the request's capability token: knowing its id is not enough.
                let token = n.params.remote_capability.as_deref().unwrap_or("");
                let held_here = n
                    .params
                    .remote_request_id
                    .as_deref()
                    .filter(|id| self.state.borrow().sched.holds_with_capability(id, token));
                if held_here.is_none() && id_held(&self.state.borrow().sched, &n.params) {
                    // Held here, wrong token: refused like an unknown request, and counted.
                    pdmesh_mesh_auth::metrics::CAPABILITY_REFUSED.inc();
                    tracing::warn!(request_id = %id, "release refused: wrong capability token");
                    m::NOTICES.with_label_values(&["invalid"]).inc();
                    return;
                }
                if let Some(id) = held_here.map(str::to_string) {
                    tracing::info!(request_id = %id, "release of held blocks requested");
                    m::NOTICES.with_label_values(&["release"]).inc();
                    self.state.borrow_mut().inbox.aborts.push(id);
                    self.kick(ctx);
                    return;
                }
                // Never behind a step (on a busy D one always runs): P is waiting.
                self.notice_now(n, ctx);
            }
            Message::StatsQuery => {
                let st = self.state.borrow();
                let stats = st.sched.stats(st.rank);
                drop(st);
                if let Some(dplb) = self.peers.as_ref().and_then(|p| p.dplb.as_ref()) {
                    let _ = dplb.send(
                        env.reply(Message::StatsReply(MeshStats { engines: vec![stats], unreachable_ranks: vec![] })),
                    );
                }
            }
            Message::Ping => {
                if let Some(dplb) = self.peers.as_ref().and_then(|p| p.dplb.as_ref()) {
                    let _ = dplb.send(env.reply(Message::Pong));
                }
            }
            // D92: the dp-lb passes on the hello of a new frontend process.
            Message::Hello(h) if h.service == ServiceKind::Frontend => self.frontend_restarted(h.pid, ctx),
            other => {
                tracing::warn!(kind = other.kind(), "unexpected message");
            }
        }
    }
}

/// One engine step: the sans-IO [`EngineStep`] driven over the connector-scheduler and
/// worker links. The state is borrowed only between awaits. Returns what to do next and the
/// rejection notices owed for remote-prefill requests the scheduler refused.
async fn run_step(
    state: Rc<RefCell<EngineState>>,
    peers: Peers,
    step_timeout: Duration,
    clock: MetaClock,
) -> (StepNext, Vec<RejectionNotice>) {
    let started = Instant::now();
    if started.duration_since(clock.last.get()) >= clock.every {
        state.borrow_mut().force_meta = true;
    }
    let (unknown_before, stale_before) = {
        let st = state.borrow();
        (st.sched.counters().unknown_ids, st.sched.counters().stale_sends_dropped)
    };
    let trace_of = |id: &str| REQUEST_SPANS.contexts(std::iter::once(id)).remove(id).unwrap_or_default();
    let (mut step, mut io) = EngineStep::start(&mut state.borrow_mut(), trace_of);
    let done = loop {
        io = match io {
            StepIo::Connector(calls) => {
                let replies = connector_call(&peers.connector, calls).await.ok();
                step.on_connector(&mut state.borrow_mut(), replies)
            }
            StepIo::Worker(output) => {
                let answer = execute_on_worker(&peers.worker, output, step_timeout).await;
                step.on_worker(&mut state.borrow_mut(), answer)
            }
            StepIo::Done(done) => break done,
        };
    };
    for (id, e) in &done.refusals {
        m::note_refusal(id, e);
    }
    if done.executed {
        m::STEPS.inc();
        m::SCHEDULED_TOKENS.inc_by(u64::from(done.scheduled_tokens));
        if !done.meta_round {
            m::META_ROUNDS_SKIPPED.inc();
        }
    }
    if done.meta_round {
        clock.last.set(started);
    }
    let overdue = started.duration_since(clock.last_report.get()) >= LOAD_REPORT_AT_LEAST_EVERY;
    let (rank, load) = {
        let mut st = state.borrow_mut();
        publish_gauges(&st.sched);
        m::UNKNOWN_IDS.inc_by(st.sched.counters().unknown_ids.saturating_sub(unknown_before));
        m::STALE_SENDS_DROPPED.inc_by(st.sched.counters().stale_sends_dropped.saturating_sub(stale_before));
        (st.rank, st.load_report(&done.outputs, overdue))
    };
    // Hand-offs of the step before: this step's worker call registered their holds with
    // their traces, so their spans end now.
    for id in std::mem::take(&mut *HANDOFF_SPANS_CLOSING.lock().unwrap_or_else(|p| p.into_inner())) {
        REQUEST_SPANS.close(&id);
    }
    for o in &done.outputs {
        if let Some(r) = o.finish_reason {
            m::FINISHED.with_label_values(&[r.as_str()]).inc();
            let hands_off =
                o.kv_transfer_params.as_ref().is_some_and(pdmesh_protocol::KvTransferParams::wants_remote_prefill);
            let span = if hands_off {
                HANDOFF_SPANS_CLOSING.lock().unwrap_or_else(|p| p.into_inner()).push(o.request_id.clone());
                Some(REQUEST_SPANS.get(&o.request_id)).filter(|s| !s.is_disabled())
            } else {
                REQUEST_SPANS.close(&o.request_id)
            };
            if let Some(span) = span {
                // Prompt tokens taken from this engine's prefix cache (P and D alike).
                span.record("prefix_cache.hit_tokens", o.num_cached_tokens);
                tracing::info!(parent: &span, reason = r.as_str(), error = o.error.as_deref().unwrap_or(""),
                    kv_handoff = o.kv_transfer_params.is_some(), "request finished");
            }
        }
    }
    if !done.outputs.is_empty() {
        let batch =
            Envelope::new(Message::EngineOutputs(EngineOutputBatch { engine_rank: rank, outputs: done.outputs }));
        if let Err(e) = peers.outputs.send(batch) {
            tracing::warn!(error = %e, "outputs not delivered: frontend unavailable");
        }
    }
    if let (Some(dplb), Some(load)) = (&peers.dplb, load) {
        clock.last_report.set(started);
        let _ = dplb.send(Envelope::new(Message::LoadReport(load)));
    }
    m::STEP_SECONDS.observe(started.elapsed().as_secs_f64());
    (done.next, done.refused)
}

/// The driver's clocks: when the last connector metadata round went out and how long steps
/// may go without one; when the last load report went to the dp-lb.
#[derive(Clone)]
struct MetaClock {
    last: Rc<Cell<Instant>>,
    every: Duration,
    last_report: Rc<Cell<Instant>>,
}

/// Run one step on the worker; every way it can go wrong becomes the reason its requests fail.
async fn execute_on_worker(worker: &LinkHandle, output: SchedulerOutput, timeout: Duration) -> WorkerAnswer {
    let traces = REQUEST_SPANS.contexts(output.request_ids());
    let res = worker.call(Envelope::new(Message::ExecuteStep(output)).with_traces(traces), timeout).await;
    let failed = |reason: String| {
        m::STEP_FAILURES.with_label_values(&["connector-worker"]).inc();
        WorkerAnswer::Failed(reason)
    };
    match res {
        Ok(Envelope { body: Message::StepResult(out), .. }) => {
            if let Some(e) = &out.failure {
                m::STEP_FAILURES.with_label_values(&["connector-worker"]).inc();
                tracing::error!(error = %e.message, "worker failed the step");
            }
            WorkerAnswer::Ran(out)
        }
        Ok(Envelope { body: Message::Error(e), .. }) => {
            tracing::error!(error = %e.message, "worker failed the step");
            failed(format!("worker error: {}", e.message))
        }
        Ok(other) => {
            tracing::error!(kind = other.body.kind(), "unexpected worker answer");
            failed("internal: unexpected worker answer".into())
        }
        Err(e) => {
            tracing::error!(error = %e, "worker unreachable; failing the step's requests");
            failed(unavailable("connector-worker", &e))
        }
    }
}

fn publish_gauges(s: &Scheduler) {
    let kv = s.kv_usage();
    m::NUM_WAITING.set(i64::from(s.num_waiting()));
    m::NUM_RUNNING.set(i64::from(s.num_running()));
    m::KV_FREE.set(i64::from(kv.free_blocks));
    m::KV_USED.set(i64::from(kv.used_blocks));
    m::KV_HELD.set(i64::from(kv.held_blocks));
    m::KV_CACHED.set(i64::from(kv.cached_blocks));
    // Counters follow the scheduler's own counts by their increase (never reset: a scrape in
    // between would read a counter reset).
    let c = s.counters();
    m::REQUEST_FINISHED_CALLS.inc_by(c.request_finished_calls.saturating_sub(m::REQUEST_FINISHED_CALLS.get()));
    m::PREEMPTIONS.inc_by(c.preemptions.saturating_sub(m::PREEMPTIONS.get()));
    m::PREFIX_CACHE_QUERIES.inc_by(c.prefix_cache_queries.saturating_sub(m::PREFIX_CACHE_QUERIES.get()));
    m::PREFIX_CACHE_HITS.inc_by(c.prefix_cache_hits.saturating_sub(m::PREFIX_CACHE_HITS.get()));
    let evictions = s.cache_counters().evictions;
    m::PREFIX_CACHE_EVICTIONS.inc_by(evictions.saturating_sub(m::PREFIX_CACHE_EVICTIONS.get()));
    m::KV_LOADS_RECOMPUTED.inc_by(c.kv_loads_recomputed.saturating_sub(m::KV_LOADS_RECOMPUTED.get()));
    m::RECOMPUTED_TOKENS.inc_by(c.recomputed_tokens.saturating_sub(m::RECOMPUTED_TOKENS.get()));
    m::KV_LOADS_FAILED.inc_by(c.kv_loads_failed_by_policy.saturating_sub(m::KV_LOADS_FAILED.get()));
}

fn unavailable(peer: &str, e: &TransportError) -> String {
    format!("unavailable: {peer}: {e}")
}

/// One batched round trip to the connector-scheduler.
async fn connector_call(link: &LinkHandle, calls: Vec<ConnectorCall>) -> Result<Vec<ConnectorReply>, TransportError> {
    let n = calls.len();
    let traces = REQUEST_SPANS.contexts(calls.iter().filter_map(ConnectorCall::request_id));
    let res = link.call(Envelope::new(Message::ConnectorCalls(calls)).with_traces(traces), CONNECTOR_TIMEOUT).await;
    match res {
        Ok(Envelope { body: Message::ConnectorReplies(r), .. }) if r.len() == n => Ok(r),
        Ok(other) => {
            m::STEP_FAILURES.with_label_values(&["connector-scheduler"]).inc();
            tracing::error!(kind = other.body.kind(), "unexpected connector answer");
            Err(TransportError::Codec("unexpected connector answer".into()))
        }
        Err(e) => {
            m::STEP_FAILURES.with_label_values(&["connector-scheduler"]).inc();
            tracing::warn!(error = %e, "connector-scheduler call failed");
            Err(e)
        }
    }
}

/// A draining engine-core waits for the requests its scheduler still holds waiting or running.
impl Handler<Unfinished> for EngineCore {
    type Result = usize;
    fn handle(&mut self, _: Unfinished, _: &mut Context<Self>) -> usize {
        let state = self.state.borrow();
        state.sched.num_waiting() as usize + state.sched.num_running() as usize
    }
}

/// The pool's block counts now (asked once the drain has ended, for the stop's log line).
#[derive(Message)]
#[rtype(result = "pdmesh_protocol::KvUsage")]
struct KvUsageNow;

impl Handler<KvUsageNow> for EngineCore {
    type Result = MessageResult<KvUsageNow>;
    fn handle(&mut self, _: KvUsageNow, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.state.borrow().sched.kv_usage())
    }
}

/// Run the engine-core of `ctx`'s rank inside the current actix System until `shutdown`
/// begins, then stop gracefully: readiness goes 503 and the requests it has admitted run to
/// their end (or fail with their peers) before the ops server stops. Blocks it holds for D
/// are freed with the process; how many it still used, held for D or leased to D when the
/// drain ended is logged ("KV blocks at stop"), so an operator (and tests/shutdown.rs) can
/// see that a graceful stop left nothing behind. The shell holds the whole stop to the
/// shutdown deadline.
pub async fn run(mut ctx: ServiceContext, shutdown: Shutdown) -> Result<(), EngineError> {
    let actor = start(&ctx)?;
    ctx.drain_actor_on_shutdown(&shutdown, "admitted requests", &actor).await;
    if let Ok(kv) = actor.send(KvUsageNow).await {
        tracing::info!(
            rank = ctx.rank,
            used_blocks = kv.used_blocks,
            held_blocks = kv.held_blocks,
            leased_blocks = kv.leased_blocks,
            "KV blocks at stop"
        );
    }
    Ok(())
}

/// Start the engine-core of `ctx`'s rank inside the current actix System.
pub fn start(ctx: &ServiceContext) -> Result<Addr<EngineCore>, EngineError> {
    let (node, rank) = (ctx.node.clone(), ctx.rank);
    let e = &node.engine;
    // The engine does not load the model: without a configured length it allows the common
    // 4096, cut (like the frontend's) to what the pool holds, so nothing it admits is too big.
    let max_model_len = e.effective_max_model_len(if e.max_model_len == 0 { 4096 } else { e.max_model_len });
    let cfg = SchedulerConfig {
        block_size: e.block_size,
        num_blocks: e.num_blocks,
        max_num_seqs: e.max_num_seqs,
        max_num_batched_tokens: e.max_num_batched_tokens,
        max_model_len,
    };
    let faults = crate::scheduler::EngineFaults::parse(&e.fault_injection).map_err(EngineError::Faults)?;
    if faults != Default::default() {
        tracing::warn!(?faults, "engine fault injection is on");
    }
    let mut sched = Scheduler::new(cfg);
    sched.set_prefix_caching(e.enable_prefix_caching);
    sched.set_faults(faults);
    sched.set_reserve_next_block(node.steps_run_ahead());
    sched.set_admission_limits(crate::scheduler::AdmissionLimits {
        max_waiting: e.max_waiting,
        max_held_fraction: e.max_held_fraction,
    });
    if let Some(kv) = &node.kv_transfer {
        sched.set_recompute_load_failures(kv.kv_load_failure_policy == pdmesh_config::KvLoadFailurePolicy::Recompute);
    }
    let health = ctx.health.clone();
    let state = EngineState::new(rank, sched);
    let meta_every = node
        .kv_transfer
        .as_ref()
        .map_or(META_ROUND_AT_LEAST_EVERY, |kv| META_ROUND_AT_LEAST_EVERY.min(kv.hold_duration() / 6));
    let actor = EngineCore {
        state: Rc::new(RefCell::new(state)),
        step_timeout: Duration::from_millis(e.step_timeout_ms),
        meta_clock: MetaClock {
            last: Rc::new(Cell::new(Instant::now())),
            every: meta_every,
            last_report: Rc::new(Cell::new(Instant::now())),
        },
        peers: None,
        stepping: false,
        worker_info: None,
        health,
        node,
        run_dir: ctx.topology.run_dir.clone(),
    };
    Ok(actor.start())
}

/// Whether the scheduler holds the request `params` name (whatever token they carry).
fn id_held(sched: &crate::scheduler::Scheduler, params: &pdmesh_protocol::KvTransferParams) -> bool {
    params.remote_request_id.as_deref().is_some_and(|id| sched.holds(id))
}
