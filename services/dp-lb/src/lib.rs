//! dp-lb: the data-parallel load balancer between a node's frontend and its engine ranks
//! (vLLM's `DPLBAsyncMPClient`, as its own process).
//!
//! - Requests go to the rank pinned by `X-data-parallel-rank`, else to the least-loaded live
//!   rank by vLLM's score `4 × waiting + running` ([`policy`]), using the load each rank
//!   reports after its steps plus what was sent since.
//! - Aborts go to the rank that owns the request; unknown ids are counted.
//! - Engine outputs go from each rank straight to the frontend; a rank's load reports, sent
//!   only when something changed, say which requests finished (D75).
//! - When a rank's connection drops, its in-flight requests end at once with an
//!   `unavailable` error sent to the frontend (PUSH) instead of hanging, and new requests
//!   avoid it.
//! - Overload control: a request is refused with an `overloaded` error (503 + `Retry-After`
//!   at the frontend, which also sends P its rejection notice, rule R1) when the in-flight
//!   table holds `limits.dp_lb_max_in_flight` requests, or when no rank's waiting queue —
//!   as reported in its last `LoadReport`, plus what was sent since — has room under
//!   `engine.max_waiting`.

pub mod metrics;
pub mod notices;
pub mod policy;

use std::collections::HashMap;
use std::time::Duration;

use actix::prelude::*;
use pdmesh_protocol::{
    EngineLoadReport, EngineOutput, EngineOutputBatch, Envelope, ErrorClass, MeshStats, Message, WireError,
};
use pdmesh_service::{ServiceContext, Shutdown, Unfinished};
use pdmesh_transport::{bind_router, connect_push, PeerId, PushHandle, RouterEvent, RouterHandle};
use thiserror::Error;

use crate::metrics as m;
use crate::policy::RankLoad;

#[derive(Debug, Error)]
pub enum DpLbError {
    #[error("config: {0}")]
    Config(#[from] pdmesh_config::ConfigError),
    #[error("transport: {0}")]
    Transport(#[from] pdmesh_transport::TransportError),
}

/// How long a stats fan-out waits for the ranks.
const STATS_TIMEOUT: Duration = Duration::from_millis(1000);

struct StatsGather {
    frontend_peer: PeerId,
    request: Envelope,
    waiting: Vec<u32>,
    collected: MeshStats,
}

/// A request the dp-lb sent to a rank and has not seen finish.
struct InFlight {
    rank: u32,
    /// P's params when the request reads its prompt's KV from a prefill node: if its rank is
    /// lost before it finished, P is told to free them (rule R1 after admission).
    remote_prefill: Option<pdmesh_protocol::KvTransferParams>,
    trace: pdmesh_protocol::TraceContext,
}

/// The dp-lb actor.
pub struct DpLb {
    dp_size: u32,
    ranks: Vec<RankLoad>,
    /// ZeroMQ identity of each connected rank.
    rank_peers: HashMap<PeerId, u32>,
    in_flight: HashMap<String, InFlight>,
    frontend: Option<RouterHandle>,
    engines: Option<RouterHandle>,
    outputs: Option<PushHandle>,
    stats: HashMap<u64, StatsGather>,
    /// What each rank's prefix cache holds, from its last stats answer (D59).
    prefix: Vec<policy::RankPrefix>,
    /// How a rank is chosen for a request no client pinned.
    policy: Box<dyn policy::RankPolicy>,
    next_corr: u64,
    health: pdmesh_telemetry::ops::Health,
    /// Rejection notices that arrived while no rank was connected (rule R1).
    pending_notices: notices::PendingNotices,
    limits: Limits,
    /// The pid of the frontend process last heard from (its hello), to tell a restart.
    frontend_pid: Option<u32>,
}

/// The dp-lb's bounds (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Requests in the in-flight table (0: no bound).
    pub max_in_flight: u32,
    /// Waiting requests per rank (the engine's `max_waiting`; 0: no bound).
    pub max_waiting: u32,
    /// The ranks cache prefixes (`engine.enable_prefix_caching`): choose ranks by what they
    /// hold too ([`policy::for_ranks`]).
    pub prefix_caching: bool,
}

/// One line a second about refusals, whatever their rate.
static REFUSAL_LOG: pdmesh_telemetry::log_limit::LogLimiter =
    pdmesh_telemetry::log_limit::LogLimiter::new(Duration::from_secs(1));

/// An `overloaded` refusal, counted under `reason` and logged (rate-limited).
fn overloaded(reason: &'static str, message: String) -> Message {
    m::ROUTED.with_label_values(&["overloaded"]).inc();
    m::OVERLOAD_REFUSALS.with_label_values(&[reason]).inc();
    if let Some(suppressed) = REFUSAL_LOG.check() {
        tracing::warn!(reason, suppressed, "{message}");
    }
    Message::Error(WireError::new(ErrorClass::Overloaded, message))
}

impl Actor for DpLb {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
struct Wire {
    frontend: RouterHandle,
    engines: RouterHandle,
    outputs: PushHandle,
}

impl Handler<Wire> for DpLb {
    type Result = ();
    fn handle(&mut self, w: Wire, _: &mut Context<Self>) {
        self.frontend = Some(w.frontend);
        self.engines = Some(w.engines);
        self.outputs = Some(w.outputs);
    }
}

/// Events from the frontend-facing ROUTER.
#[derive(Message)]
#[rtype(result = "()")]
struct FromFrontend(RouterEvent);

/// Events from the engine-facing ROUTER.
#[derive(Message)]
#[rtype(result = "()")]
struct FromEngines(RouterEvent);

impl Handler<FromFrontend> for DpLb {
    type Result = ();
    fn handle(&mut self, FromFrontend(ev): FromFrontend, ctx: &mut Context<Self>) {
        let RouterEvent::Message { peer, envelope } = ev else { return };
        match &envelope.body {
            Message::AddRequest(req) => {
                let span = pdmesh_telemetry::trace::child_of(
                    tracing::info_span!("dp_lb.route", otel.kind = "server", request_id = %req.request_id),
                    &envelope.trace,
                );
                let _entered = span.enter();
                let reply = self.route(req.clone(), &envelope);
                if let Some(f) = &self.frontend {
                    let _ = f.send(&peer, envelope.reply(reply));
                }
            }
            Message::Abort(a) => {
                for id in &a.request_ids {
                    match self.in_flight.get(id).map(|f| f.rank) {
                        Some(rank) => self.send_to_rank(
                            rank,
                            Envelope::new(Message::Abort(pdmesh_protocol::AbortRequests {
                                request_ids: vec![id.clone()],
                            }))
                            .with_request_id(id.clone())
                            .with_trace(envelope.trace.clone()),
                        ),
                        None => m::UNKNOWN_IDS.inc(),
                    }
                }
            }
            Message::StatsQuery => self.gather_stats(peer, envelope, ctx),
            Message::RejectionNotice(n) => {
                let id = n.params.remote_request_id.as_deref().unwrap_or("");
                pdmesh_telemetry::trace::notice_hop("dp_lb", id, n.rejected_at_unix_us);
                let pinned = n.data_parallel_rank;
                self.dispatch_notice(envelope.clone(), pinned);
            }
            Message::Ping => {
                if let Some(f) = &self.frontend {
                    let _ = f.send(&peer, envelope.reply(Message::Pong));
                }
            }
            Message::ReadinessQuery => {
                let readiness = pdmesh_protocol::NodeReadiness {
                    ranks: self.dp_size,
                    ranks_up: self.ranks.iter().filter(|l| l.connected).count() as u32,
                };
                if let Some(f) = &self.frontend {
                    let _ = f.send(&peer, envelope.reply(Message::Readiness(readiness)));
                }
            }
            Message::Hello(h) => self.frontend_hello(h, &envelope),
            other => tracing::warn!(kind = other.kind(), "unexpected message from frontend"),
        }
    }
}

impl DpLb {
    /// A dp-lb for `dp_size` ranks, none connected yet, not wired to its sockets.
    fn new(dp_size: u32, health: pdmesh_telemetry::ops::Health, limits: Limits) -> Self {
        DpLb {
            dp_size,
            ranks: vec![RankLoad::default(); dp_size as usize],
            rank_peers: HashMap::new(),
            in_flight: HashMap::new(),
            frontend: None,
            engines: None,
            outputs: None,
            stats: HashMap::new(),
            prefix: vec![policy::RankPrefix::default(); dp_size as usize],
            policy: policy::for_ranks(limits.prefix_caching),
            next_corr: 1,
            health,
            limits,
            pending_notices: notices::PendingNotices::default(),
            frontend_pid: None,
        }
    }

    fn route(&mut self, req: pdmesh_protocol::EngineRequest, env: &Envelope) -> Message {
        let rank = match req.data_parallel_rank {
            Some(r) if r >= self.dp_size => {
                m::ROUTED.with_label_values(&["bad_rank"]).inc();
                return Message::Error(WireError::new(
                    ErrorClass::InvalidRequest,
                    format!("data parallel rank {r} is out of range [0, {})", self.dp_size),
                ));
            }
            Some(r) => {
                let Some(load) = self.ranks.get(r as usize).filter(|l| l.connected) else {
                    m::ROUTED.with_label_values(&["unavailable"]).inc();
                    return Message::Error(WireError::new(
                        ErrorClass::Unavailable,
                        format!("unavailable: engine rank {r} is not connected"),
                    ));
                };
                if !load.has_room(self.limits.max_waiting) {
                    return overloaded(
                        "waiting",
                        format!(
                            "overloaded: engine rank {r} already has {} requests waiting (engine.max_waiting = {})",
                            load.waiting + load.pending,
                            self.limits.max_waiting
                        ),
                    );
                }
                r
            }
            None => match self.policy.choose(&self.ranks, self.limits.max_waiting, &self.overlaps(&req)) {
                Ok(r) => r,
                Err(policy::NoRank::Unavailable) => {
                    m::ROUTED.with_label_values(&["unavailable"]).inc();
                    return Message::Error(WireError::new(
                        ErrorClass::Unavailable,
                        "unavailable: no engine rank is connected (engine-core down or restarting)",
                    ));
                }
                Err(policy::NoRank::Full) => {
                    return overloaded(
                        "waiting",
                        format!(
                            "overloaded: every engine rank has engine.max_waiting = {} requests waiting",
                            self.limits.max_waiting
                        ),
                    );
                }
            },
        };
        let id = req.request_id.clone();
        if self.in_flight.contains_key(&id) {
            return Message::Error(WireError::new(
                ErrorClass::InvalidRequest,
                format!("request id {id:?} is already in flight"),
            ));
        }
        if self.limits.max_in_flight > 0 && self.in_flight.len() >= self.limits.max_in_flight as usize {
            return overloaded(
                "in_flight",
                format!(
                    "overloaded: the node already has {} requests in flight (limits.dp_lb_max_in_flight)",
                    self.in_flight.len()
                ),
            );
        }
        if let Some(l) = self.ranks.get_mut(rank as usize) {
            l.pending += 1;
        }
        let remote_prefill =
            req.kv_transfer_params.clone().filter(pdmesh_protocol::KvTransferParams::wants_remote_prefill);
        self.in_flight.insert(id.clone(), InFlight { rank, remote_prefill, trace: env.trace.clone() });
        m::IN_FLIGHT.set(self.in_flight.len() as i64);
        m::ROUTED.with_label_values(&[&rank.to_string()]).inc();
        tracing::info!(rank, "routed");
        let trace = pdmesh_telemetry::trace::outgoing(&tracing::Span::current(), &env.trace);
        self.send_to_rank(rank, Envelope::new(Message::AddRequest(req)).with_request_id(id).with_trace(trace));
        Message::Ack
    }

    /// Blocks of `req`'s prompt each rank holds (all zero with one rank: nothing to choose).
    fn overlaps(&self, req: &pdmesh_protocol::EngineRequest) -> Vec<usize> {
        if self.ranks.iter().filter(|l| l.connected).count() < 2 {
            return Vec::new();
        }
        self.prefix.iter().map(|p| p.overlap(&req.prompt_token_ids)).collect()
    }

    /// Rule R1: a notice goes to the pinned rank if it is up, else to every connected rank
    /// (any of them can free P); with none connected it waits for the first one.
    fn dispatch_notice(&mut self, envelope: Envelope, pinned: Option<u32>) {
        let connected: Vec<u32> = self.rank_peers.values().copied().collect();
        let targets = notices::targets(pinned, &connected);
        if targets.is_empty() {
            tracing::warn!("rejection notice while no engine rank is connected; it waits for one");
            m::NOTICES_FORWARDED.with_label_values(&["pending"]).inc();
            self.pending_notices.push(envelope, std::time::Instant::now());
            self.publish_pending();
            return;
        }
        let mode = if targets.len() == 1 && pinned.is_some() { "pinned" } else { "broadcast" };
        for rank in targets {
            m::NOTICES_FORWARDED.with_label_values(&[mode]).inc();
            self.send_to_rank(rank, envelope.clone());
        }
    }

    fn publish_pending(&self) {
        m::NOTICES_PENDING.set(self.pending_notices.len() as i64);
        m::NOTICES_DROPPED.inc_by(self.pending_notices.dropped.saturating_sub(m::NOTICES_DROPPED.get()));
    }

    /// A rank connected: the notices that waited for one go to it.
    fn flush_pending_notices(&mut self, rank: u32) {
        if self.pending_notices.is_empty() {
            return;
        }
        let pending = self.pending_notices.drain(std::time::Instant::now());
        tracing::info!(rank, notices = pending.len(), "sending the rejection notices that waited for a rank");
        for env in pending {
            m::NOTICES_FORWARDED.with_label_values(&["after_wait"]).inc();
            self.send_to_rank(rank, env);
        }
        self.publish_pending();
    }

    /// Take a rank's load report: its counts, and the requests that finished on it, which
    /// leave the in-flight table and free their place under its bound (their outputs went to
    /// the frontend, D75).
    fn take_load_report(&mut self, report: &EngineLoadReport) {
        if let Some(l) = self.ranks.get_mut(report.engine_rank as usize) {
            l.waiting = report.num_waiting;
            l.running = report.num_running;
            l.pending = 0;
        }
        for id in &report.finished_request_ids {
            self.in_flight.remove(id);
        }
        m::IN_FLIGHT.set(self.in_flight.len() as i64);
    }

    /// A frontend said hello (on every connect of its link). A new pid is a new frontend
    /// process (D92): the old one's output socket is gone, and a PUSH still connected to it
    /// loses what it sends for tens of seconds before it notices. So the dp-lb reconnects its
    /// own output stream and passes the hello to every rank, which reconnects its stream and
    /// aborts the requests the old process was waiting for (no one can read them now). The
    /// same process reconnecting (the dp-lb restarted, a transient loss) changes nothing.
    fn frontend_hello(&mut self, h: &pdmesh_protocol::Hello, envelope: &Envelope) {
        if self.frontend_pid == Some(h.pid) {
            tracing::info!(pid = h.pid, "frontend reconnected");
            return;
        }
        let previous = self.frontend_pid.replace(h.pid);
        tracing::info!(pid = h.pid, ?previous, "frontend connected; re-pointing the output streams");
        m::FRONTEND_RESTARTS.inc();
        if let Some(o) = &self.outputs {
            o.reconnect();
        }
        let ranks: Vec<u32> = self.rank_peers.values().copied().collect();
        for rank in ranks {
            self.send_to_rank(rank, envelope.clone());
        }
    }

    fn send_to_rank(&self, rank: u32, env: Envelope) {
        let Some(engines) = &self.engines else { return };
        if let Some((peer, _)) = self.rank_peers.iter().find(|(_, &r)| r == rank) {
            let _ = engines.send(peer, env);
        }
    }

    fn gather_stats(&mut self, peer: PeerId, request: Envelope, ctx: &mut Context<Self>) {
        let corr = self.next_corr;
        self.next_corr += 1;
        let live: Vec<u32> = self.rank_peers.values().copied().collect();
        let unreachable: Vec<u32> = (0..self.dp_size).filter(|r| !live.contains(r)).collect();
        for &rank in &live {
            self.send_to_rank(rank, Envelope::new(Message::StatsQuery).with_corr(corr));
        }
        self.stats.insert(
            corr,
            StatsGather {
                frontend_peer: peer,
                request,
                waiting: live,
                collected: MeshStats { engines: vec![], unreachable_ranks: unreachable },
            },
        );
        self.maybe_finish_stats(corr, false);
        ctx.run_later(STATS_TIMEOUT, move |act, _| act.maybe_finish_stats(corr, true));
    }

    fn maybe_finish_stats(&mut self, corr: u64, timed_out: bool) {
        let done = self.stats.get(&corr).is_some_and(|g| g.waiting.is_empty() || timed_out);
        if !done {
            return;
        }
        if let Some(mut g) = self.stats.remove(&corr) {
            g.collected.unreachable_ranks.extend(g.waiting.iter().copied());
            g.collected.unreachable_ranks.sort_unstable();
            g.collected.engines.sort_by_key(|e| e.engine_rank);
            if let Some(f) = &self.frontend {
                let _ = f.send(&g.frontend_peer, g.request.reply(Message::StatsReply(g.collected)));
            }
        }
    }

    /// A rank went away: end its in-flight requests with an error now.
    fn rank_lost(&mut self, rank: u32) {
        if let Some(l) = self.ranks.get_mut(rank as usize) {
            *l = RankLoad::default();
        }
        if let Some(p) = self.prefix.get_mut(rank as usize) {
            *p = policy::RankPrefix::default();
        }
        let lost: Vec<String> =
            self.in_flight.iter().filter(|(_, f)| f.rank == rank).map(|(id, _)| id.clone()).collect();
        tracing::error!(rank, in_flight = lost.len(), "engine rank lost; failing its in-flight requests");
        m::RANKS_UP.set(self.ranks.iter().filter(|l| l.connected).count() as i64);
        if lost.is_empty() {
            return;
        }
        let outputs = lost
            .iter()
            .map(|id| {
                EngineOutput::failed(id, format!("unavailable: engine rank {rank} stopped while serving this request"))
            })
            .collect();
        for id in &lost {
            // Requests that would have read P's blocks: the lost rank can no longer say it gives
            // up, so P is told from here (R1 after admission; a duplicate of the rank's own
            // give-up, if its worker still sent one, is counted by P and harmless).
            let Some(InFlight { remote_prefill: Some(params), trace, .. }) = self.in_flight.remove(id) else {
                continue;
            };
            let notice = pdmesh_protocol::RejectionNotice {
                params,
                data_parallel_rank: None,
                rejected_at_unix_us: Some(pdmesh_protocol::unix_micros()),
                trace: trace.clone(),
            };
            tracing::info!(request_id = %id, "request lost with its rank; telling P to free its blocks");
            self.dispatch_notice(Envelope::new(Message::RejectionNotice(notice)).with_trace(trace), None);
        }
        m::IN_FLIGHT.set(self.in_flight.len() as i64);
        m::FAILED_BY_RANK_LOSS.inc_by(lost.len() as u64);
        if let Some(o) = &self.outputs {
            if o.send(Envelope::new(Message::EngineOutputs(EngineOutputBatch { engine_rank: rank, outputs }))).is_err()
            {
                m::OUTPUTS_DROPPED.inc();
            }
        }
    }
}

impl Handler<FromEngines> for DpLb {
    type Result = ();
    fn handle(&mut self, FromEngines(ev): FromEngines, _: &mut Context<Self>) {
        match ev {
            RouterEvent::PeerDisconnected { peer } => {
                if let Some(rank) = self.rank_peers.remove(&peer) {
                    self.rank_lost(rank);
                    self.health.set_ready(!self.rank_peers.is_empty());
                }
            }
            RouterEvent::Message { peer, envelope } => match envelope.body {
                Message::Hello(h) => {
                    if h.rank >= self.dp_size {
                        tracing::error!(rank = h.rank, "engine with a rank outside dp_size connected; ignored");
                        return;
                    }
                    // A restarted rank: forget the old connection of the same rank.
                    self.rank_peers.retain(|_, r| *r != h.rank);
                    self.rank_peers.insert(peer, h.rank);
                    if let Some(l) = self.ranks.get_mut(h.rank as usize) {
                        *l = RankLoad { connected: true, ..Default::default() };
                    }
                    if let Some(p) = self.prefix.get_mut(h.rank as usize) {
                        *p = policy::RankPrefix::default();
                    }
                    m::RANKS_UP.set(self.ranks.iter().filter(|l| l.connected).count() as i64);
                    self.health.set_ready(true);
                    tracing::info!(rank = h.rank, pid = h.pid, "engine rank connected");
                    self.flush_pending_notices(h.rank);
                }
                Message::LoadReport(r) => self.take_load_report(&r),
                Message::StatsReply(s) => {
                    let corr = envelope.corr;
                    if let Some(g) = self.stats.get_mut(&corr) {
                        for e in s.engines {
                            g.waiting.retain(|r| *r != e.engine_rank);
                            if let Some(p) = self.prefix.get_mut(e.engine_rank as usize) {
                                *p = e.prefix.as_ref().map(policy::RankPrefix::from_summary).unwrap_or_default();
                            }
                            g.collected.engines.push(e);
                        }
                        self.maybe_finish_stats(corr, false);
                    }
                }
                other => tracing::warn!(kind = other.kind(), "unexpected message from engine"),
            },
        }
    }
}

/// Forwarders so that two ROUTERs can feed one actor with distinguishable events.
struct Tag<F>(Addr<DpLb>, F);
impl<F: Fn(RouterEvent) -> M + Unpin + 'static, M: actix::Message<Result = ()> + Send + 'static> Actor for Tag<F>
where
    DpLb: Handler<M>,
{
    type Context = Context<Self>;
}
impl<F: Fn(RouterEvent) -> M + Unpin + 'static, M: actix::Message<Result = ()> + Send + 'static> Handler<RouterEvent>
    for Tag<F>
where
    DpLb: Handler<M>,
{
    type Result = ();
    fn handle(&mut self, ev: RouterEvent, _: &mut Context<Self>) {
        self.0.do_send((self.1)(ev));
    }
}

/// A draining dp-lb waits for its in-flight table to empty.
impl Handler<Unfinished> for DpLb {
    type Result = usize;
    fn handle(&mut self, _: Unfinished, _: &mut Context<Self>) -> usize {
        self.in_flight.len()
    }
}

/// Run the dp-lb of `ctx`'s node inside the current actix System until `shutdown` begins, then
/// stop gracefully: readiness goes 503, the requests in flight finish (their outputs still
/// flow to the frontend, and a rank that goes away still ends its requests), then the ops
/// server stops. The shell holds the whole stop to the shutdown deadline.
pub async fn run(mut ctx: ServiceContext, shutdown: Shutdown) -> Result<(), DpLbError> {
    let actor = start(&ctx).await?;
    ctx.drain_actor_on_shutdown(&shutdown, "requests in flight", &actor).await;
    Ok(())
}

/// Start the dp-lb of `ctx`'s node inside the current actix System.
pub async fn start(ctx: &ServiceContext) -> Result<Addr<DpLb>, DpLbError> {
    let (node, eps) = (&ctx.node, &ctx.endpoints);
    let limits = Limits {
        max_in_flight: node.limits.dp_lb_max_in_flight,
        max_waiting: node.engine.max_waiting,
        prefix_caching: node.engine.enable_prefix_caching,
    };
    let actor = DpLb::new(node.dp_size, ctx.health.clone(), limits).start();
    let fe_tag = Tag(actor.clone(), FromFrontend).start();
    let en_tag = Tag(actor.clone(), FromEngines).start();
    let frontend = bind_router(&eps.dplb_frontend.bind, fe_tag.recipient()).await?;
    let engines = bind_router(&eps.dplb_engines.bind, en_tag.recipient()).await?;
    // Only for the failures of a rank that went away: engines send their outputs to the
    // frontend themselves (D75).
    let outputs = connect_push(&eps.frontend_outputs.connect);
    actor.do_send(Wire { frontend, engines, outputs });
    tracing::info!(frontend = %eps.dplb_frontend.bind, engines = %eps.dplb_engines.bind, dp_size = node.dp_size, "dp-lb ready");
    Ok(actor)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use pdmesh_protocol::{EngineRequest, KvTransferParams};

    /// A dp-lb with `connected` ranks and no sockets (what it sends goes nowhere).
    fn dp_lb(connected: u32, limits: Limits) -> DpLb {
        let mut lb = DpLb::new(connected, Default::default(), limits);
        for rank in &mut lb.ranks {
            rank.connected = true;
        }
        lb
    }

    fn add(lb: &mut DpLb, id: &str, rank: Option<u32>) -> Message {
        let req = EngineRequest {
            request_id: id.into(),
            client_request_id: None,
            prompt_token_ids: vec![1, 2, 3],
            sampling: Default::default(),
            eos_token_ids: vec![],
            arrival_unix_ms: 0,
            kv_transfer_params: Some(KvTransferParams { do_remote_prefill: Some(true), ..Default::default() }),
            data_parallel_rank: rank,
        };
        let env = Envelope::new(Message::AddRequest(req.clone()));
        lb.route(req, &env)
    }

    fn finish(lb: &mut DpLb, id: &str) {
        let report = EngineLoadReport { engine_rank: 0, finished_request_ids: vec![id.into()], ..Default::default() };
        lb.take_load_report(&report);
    }

    fn class(reply: &Message) -> Option<ErrorClass> {
        match reply {
            Message::Ack => None,
            Message::Error(e) => Some(e.class),
            other => panic!("unexpected reply {}", other.kind()),
        }
    }

    #[test]
    fn the_in_flight_table_is_bounded_and_frees_places_on_finish() {
        let mut lb = dp_lb(2, Limits { max_in_flight: 3, max_waiting: 0, prefix_caching: true });
        for id in ["a", "b", "c"] {
            assert_eq!(class(&add(&mut lb, id, None)), None);
        }
        let before = m::OVERLOAD_REFUSALS.with_label_values(&["in_flight"]).get();
        assert_eq!(class(&add(&mut lb, "d", None)), Some(ErrorClass::Overloaded));
        assert_eq!(m::OVERLOAD_REFUSALS.with_label_values(&["in_flight"]).get(), before + 1);
        assert_eq!(lb.in_flight.len(), 3, "a refused request is not tracked");
        finish(&mut lb, "b");
        assert_eq!(class(&add(&mut lb, "d", None)), None);
        assert_eq!(class(&add(&mut lb, "e", None)), Some(ErrorClass::Overloaded));
    }

    #[test]
    fn full_waiting_queues_are_refused_from_the_load_reports() {
        let mut lb = dp_lb(2, Limits { max_in_flight: 0, max_waiting: 2, prefix_caching: true });
        // two per rank fit (pending counts what was sent since the last report)
        for id in ["a", "b", "c", "d"] {
            assert_eq!(class(&add(&mut lb, id, None)), None, "{id}");
        }
        assert_eq!(class(&add(&mut lb, "e", None)), Some(ErrorClass::Overloaded));
        // a pinned rank with a full queue is refused too, not sent elsewhere
        assert_eq!(class(&add(&mut lb, "f", Some(1))), Some(ErrorClass::Overloaded));
        // rank 1 reports that its queue drained: it takes requests again
        lb.ranks[1] = RankLoad { connected: true, waiting: 0, running: 2, pending: 0 };
        assert_eq!(class(&add(&mut lb, "f", Some(1))), None);
        assert_eq!(class(&add(&mut lb, "g", None)), None);
        assert_eq!(lb.in_flight.get("g").map(|f| f.rank), Some(1));
        // no rank connected stays `unavailable`, not `overloaded`
        let mut down = dp_lb(1, Limits { max_in_flight: 1, max_waiting: 1, prefix_caching: true });
        down.ranks[0].connected = false;
        assert_eq!(class(&add(&mut down, "x", None)), Some(ErrorClass::Unavailable));
    }

    /// Rule R1 after admission: requests that were to read P's blocks and die with their rank
    /// cannot say so themselves; the dp-lb sends P's notice for them (here it waits, as no
    /// rank is connected, for the first one that connects). Requests that finished, or read
    /// nothing from P, get none.
    #[test]
    fn requests_lost_with_their_rank_tell_p_to_free() {
        let mut lb = dp_lb(1, Limits { max_in_flight: 0, max_waiting: 0, prefix_caching: true });
        assert_eq!(class(&add(&mut lb, "remote", Some(0))), None);
        assert_eq!(class(&add(&mut lb, "finished", Some(0))), None);
        finish(&mut lb, "finished");
        let local = EngineRequest {
            request_id: "local".into(),
            client_request_id: None,
            prompt_token_ids: vec![1],
            sampling: Default::default(),
            eos_token_ids: vec![],
            arrival_unix_ms: 0,
            kv_transfer_params: None,
            data_parallel_rank: Some(0),
        };
        let env = Envelope::new(Message::AddRequest(local.clone()));
        assert_eq!(class(&lb.route(local, &env)), None);
        assert!(lb.pending_notices.is_empty());
        lb.rank_lost(0);
        assert!(lb.in_flight.is_empty(), "every request of the lost rank ended");
        let pending = lb.pending_notices.drain(std::time::Instant::now());
        assert_eq!(pending.len(), 1, "one notice, for the request that would have read P's blocks");
        let Message::RejectionNotice(n) = &pending[0].body else { panic!("{:?}", pending[0].body.kind()) };
        assert!(n.params.wants_remote_prefill());
    }
}
