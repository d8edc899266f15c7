//! D's side of the P/D runtime as a sans-IO state machine: every decision D's connector worker
//! makes about a receive — which receives a step starts and which P's blocks D then references,
//! the heartbeats it owes P, how a receive goes from handshake to lease to READ, when it gives P
//! its blocks back (R4), how each failure settles under `kv_load_failure_policy` (R3), and what
//! the next step reports as finished receiving — with every call to P turned into an
//! [`Action`] the driver performs and answers.
//!
//! The worker drives it over the transfer agent's side channel and data planes
//! (`crate::pd`: one async task per receive performing its actions); the lifecycle property
//! test (`tests/lifecycle.rs`) drives it with P's real hold table and READs the test plays.
//! Both therefore run this code, as both run the engine's step machine
//! (`pdmesh_engine_core::step`), and a rule the property test proves of D's receives is a rule
//! of the worker that serves them (docs/DECISIONS.md D107).
//!
//! No socket, task or clock here: time comes in as an argument (`start_step`'s `now`), and the
//! lease is whatever handle the driver holds (`L`: the agent's `Arc<Lease>` in the worker, P's
//! lease id in the test). The machine logs and counts (Prometheus) like the engine's step does;
//! an event for a receive it does not know, or in a phase that cannot take it, is counted and
//! ignored, never asserted.
//!
//! ```text
//! let started = consumer.start_step(&meta, now);          // heartbeats; new receives' first actions
//! for NewReceive { action, .. } in started.receives {     // per receive, until it ends:
//!     let mut next = Next::Act(action);
//!     while let Next::Act(a) = next {
//!         next = match a {
//!             Action::Handshake { recv, .. } => consumer.on_handshake(recv, handshake().await),
//!             Action::Lease { recv, .. } => consumer.on_lease(recv, lease().await),
//!             Action::Read { recv, .. } => consumer.on_read(recv, read_and_read_done().await),
//!             Action::GiveUp { recv, .. } => consumer.on_give_up(recv, give_up().await),
//!         };
//!     }
//! }
//! let out = consumer.finish_step();                        // finished_recving, invalid_block_ids
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use pdmesh_kv_transfer::{side_channel_endpoint, TransferError};
use pdmesh_protocol::{KvConnectorMetadata, KvConnectorOutput, KvTransferParams, LeaseRefusalReason, RecvRequest};

use crate::metrics as m;

/// One receive of the machine, from the step that started it until it ends. Receives are named
/// by the machine, not by D's request id: two receives may carry the same id (one for an
/// engine-core that restarted since, or a notify-only one beside a read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RecvId(u64);

/// Why a load failed: the `kind` label of `pdmesh_worker_kv_transfer_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Handshake: unreachable, timed out, incompatible, undecodable, wrong engine.
    Handshake,
    /// P refused the lease (freed, stale generation, fault) or it could not be asked.
    Lease,
    /// The READ itself failed (setup, midway, timeout).
    Read,
    /// P did not confirm `read done`: the bytes may have been overwritten meanwhile.
    ReadDone,
    /// The task running the read ended without a result.
    Exception,
    /// The worker began a graceful shutdown before the read started.
    Shutdown,
    /// The request's local blocks could not be taken for writing (out of range, or another
    /// receive is writing one of them): a scheduler invariant broke; nothing was written.
    LocalBlocks,
}

impl FailureKind {
    pub fn label(self) -> &'static str {
        match self {
            FailureKind::Handshake => "handshake",
            FailureKind::Lease => "lease",
            FailureKind::Read => "read",
            FailureKind::ReadDone => "read_done",
            FailureKind::Exception => "exception",
            FailureKind::Shutdown => "shutdown",
            FailureKind::LocalBlocks => "local_blocks",
        }
    }
}

/// How a READ (the blocks read into the request's own, then `read done`) failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadFailure {
    pub kind: FailureKind,
    pub error: String,
}

/// Why D gives P a request's blocks back, which decides the give-up's metric label and what
/// the receive does once the give-up was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUpWhy {
    /// R1: D refused the request before admission (a notify-only receive).
    Rejection,
    /// The request finished on D before its receive was enqueued (a notify-only receive).
    FinishedBeforeReceive,
    /// The worker is shutting down: too late to read (R4, D25).
    Shutdown,
    /// P refused the lease by fault injection while it may still hold the blocks.
    LeaseRefused,
    /// The READ or its `read done` failed under a lease (R4: P frees at once).
    ReadFailed,
}

impl GiveUpWhy {
    /// The `reason` label of `pdmesh_worker_kv_give_ups_total`.
    pub fn label(self) -> &'static str {
        match self {
            GiveUpWhy::Rejection => "rejection",
            GiveUpWhy::FinishedBeforeReceive => "abort",
            GiveUpWhy::Shutdown => "shutdown",
            GiveUpWhy::LeaseRefused | GiveUpWhy::ReadFailed => "load_failure",
        }
    }

    /// What the give-up tells P (its logs).
    pub fn reason(self) -> &'static str {
        match self {
            GiveUpWhy::Rejection => "rejected before admission (notify only)",
            GiveUpWhy::FinishedBeforeReceive => "finished on D before its receive",
            GiveUpWhy::Shutdown => "decode worker shutting down",
            GiveUpWhy::LeaseRefused => "lease failed",
            GiveUpWhy::ReadFailed => "read failed",
        }
    }

    /// A notice of a notify-only receive (R1, or an abort while waiting).
    pub fn is_notice(self) -> bool {
        matches!(self, GiveUpWhy::Rejection | GiveUpWhy::FinishedBeforeReceive)
    }
}

/// What the driver does for one receive, then answers with the matching `on_*` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<L> {
    /// Get P's agent for `engine` at `endpoint` (a cached handshake, or a new one). `stale`:
    /// D's view of P failed a lease (P restarted, or its side channel failed or went silent):
    /// mark the cached agent stale first, so that this handshakes again. → [`Consumer::on_handshake`]
    Handshake { recv: RecvId, engine: String, endpoint: String, stale: bool },
    /// Ask P for a read lease on `blocks` of `p_req` with their `generations`, presenting
    /// `token`. → [`Consumer::on_lease`]
    Lease { recv: RecvId, p_req: String, token: String, blocks: Vec<u32>, generations: Vec<u64> },
    /// Read P's `remote` blocks under `lease` into D's `local` blocks (the same count), then
    /// tell P `read done`: one task, whose death is a failure too. → [`Consumer::on_read`]
    Read { recv: RecvId, lease: L, remote: Vec<u32>, local: Vec<u32> },
    /// Tell P that D will never read `p_req` (naming `lease` if one is active, so P frees at
    /// once even mid-READ). → [`Consumer::on_give_up`]
    GiveUp { recv: RecvId, p_req: String, token: String, lease: Option<L>, why: GiveUpWhy },
}

/// How a receive ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Read and confirmed by P: reported in the next step's `finished_recving`.
    Loaded,
    /// Failed: reported in the next step's `finished_recving` with its local blocks in
    /// `invalid_block_ids`, so the scheduler applies `kv_load_failure_policy` (R3).
    Failed(FailureKind),
    /// A notify-only receive (delivered or not): never reported to the scheduler.
    Unreported,
}

/// What a receive does after an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next<L> {
    Act(Action<L>),
    Ended(Ended),
}

/// A receive a step started: its position in the step's `reqs_to_recv` and its first action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewReceive<L> {
    pub index: usize,
    pub action: Action<L>,
}

/// Requests of one P engine, for one message (heartbeats, or the give-ups of a shutdown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch<T> {
    pub engine: String,
    pub endpoint: String,
    pub requests: Vec<T>,
}

/// What a step's metadata asks of D's worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started<L> {
    /// Heartbeats to P for requests queued on D (P's request id, capability token), one
    /// message per remote engine (R2 read leases).
    pub heartbeats: Vec<Batch<(String, String)>>,
    pub receives: Vec<NewReceive<L>>,
}

/// One reference a shutdown gives back: P's request id, its capability token, and the active
/// lease, if any (so P frees at once even mid-READ).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct GiveBack<L> {
    pub p_req: String,
    pub token: String,
    pub lease: Option<L>,
}

/// What a graceful shutdown gives back (R4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShutdownPlan<L> {
    /// References D held when the shutdown began.
    pub references: usize,
    /// Per P engine; empty with `give_up_notices` off (P then frees at its deadline).
    pub give_ups: Vec<Batch<GiveBack<L>>>,
}

/// Events the machine could not apply (an unknown receive, or one in another phase).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerCounters {
    pub unexpected_events: u64,
    /// Receives whose params lack P's engine, host, port or request id: nothing is asked of P.
    pub incomplete_params: u64,
}

/// How a receive with local blocks ended, waiting for the next step to report it.
#[derive(Debug)]
enum Settled {
    Loaded { request_id: String },
    Failed { request_id: String, local_block_ids: Vec<u32>, kind: FailureKind, error: String },
}

/// Identifies P's blocks: (remote engine id, P's request id).
type RefKey = (String, String);

/// One reference D holds to P's blocks: from the step that took the request in until its
/// receive ends (read and confirmed, or given up).
#[derive(Debug, Clone)]
struct RemoteRef<L> {
    endpoint: String,
    /// The request's capability token (`remote_capability`), for the give-up at shutdown.
    capability: String,
    /// The read lease, once granted: a give-up that names it frees P at once even mid-READ.
    lease: Option<L>,
    /// Last step that mentioned it (taken in, or heartbeat); stale entries are dropped.
    seen: Instant,
}

/// D's references to P's blocks, so that a graceful shutdown can give back each one (R4):
/// requests queued on D before their receive, receives waiting for a lease, READs in flight.
#[derive(Debug)]
struct RemoteRefs<L> {
    refs: HashMap<RefKey, RemoteRef<L>>,
}

impl<L> Default for RemoteRefs<L> {
    fn default() -> Self {
        Self { refs: HashMap::new() }
    }
}

impl<L: Clone> RemoteRefs<L> {
    fn key(p: &KvTransferParams) -> Option<(RefKey, String, String)> {
        let (Some(engine), Some(host), Some(port), Some(id)) =
            (p.remote_engine_id.as_ref(), p.remote_host.as_deref(), p.remote_port, p.remote_request_id.as_ref())
        else {
            return None;
        };
        let capability = p.remote_capability.clone().unwrap_or_default();
        Some(((engine.clone(), id.clone()), side_channel_endpoint(host, port), capability))
    }

    /// A request D took in; a heartbeat of one refreshes it.
    fn take(&mut self, p: &KvTransferParams, now: Instant) {
        if let Some((key, endpoint, capability)) = Self::key(p) {
            self.refs.entry(key).and_modify(|r| r.seen = now).or_insert(RemoteRef {
                endpoint,
                capability,
                lease: None,
                seen: now,
            });
        }
    }

    fn refresh(&mut self, p: &KvTransferParams, now: Instant) {
        if let Some((key, ..)) = Self::key(p) {
            if let Some(r) = self.refs.get_mut(&key) {
                r.seen = now;
            }
        }
    }

    fn leased(&mut self, p: &KvTransferParams, lease: &L) {
        if let Some((key, ..)) = Self::key(p) {
            if let Some(r) = self.refs.get_mut(&key) {
                r.lease = Some(lease.clone());
            }
        }
    }

    fn end(&mut self, p: &KvTransferParams) {
        if let Some((key, ..)) = Self::key(p) {
            self.refs.remove(&key);
        }
    }

    /// Drop references no step mentioned for `max_age` and not under a lease: a safety net
    /// for a receive whose step was lost (P frees those at its own deadline anyway).
    fn prune(&mut self, now: Instant, max_age: Duration) -> usize {
        let before = self.refs.len();
        self.refs.retain(|_, r| r.lease.is_some() || now.saturating_duration_since(r.seen) < max_age);
        before - self.refs.len()
    }

    fn len(&self) -> usize {
        self.refs.len()
    }
}

/// Where a receive is: the action it waits on.
#[derive(Debug)]
enum Phase<L> {
    /// The first handshake with P's engine.
    Handshake,
    /// A lease asked; `retried`: after a second handshake (D asks again only once).
    Lease { retried: bool },
    /// A second handshake after a lease failed on a stale view of P.
    Rehandshake,
    /// The READ and `read done` under `lease`.
    Read { lease: L },
    /// A give-up sent; then the receive ends with `then` (a failure, or for a notice of a
    /// notify-only receive, nothing to report).
    GiveUp { why: GiveUpWhy, then: Option<(FailureKind, String)> },
}

/// One receive in flight.
#[derive(Debug)]
struct Receive<L> {
    /// D's request id.
    request_id: String,
    params: KvTransferParams,
    engine: String,
    endpoint: String,
    p_req: String,
    /// The capability P handed out with the params: every message about these blocks carries it.
    token: String,
    /// No local blocks: only tell P (R1 rejection, or finished on D before its receive).
    notify: Option<GiveUpWhy>,
    /// All of the request's local blocks: invalid if the load fails.
    local_block_ids: Vec<u32>,
    /// What the READ moves: P's blocks D lacks (a partial local prefix hit reads only the tail),
    /// their generations, and the request's blocks they go to.
    remote_tail: Vec<u32>,
    gens_tail: Vec<u64>,
    local_tail: Vec<u32>,
    phase: Phase<L>,
}

/// D's receives and references to P's blocks (see the module doc).
#[derive(Debug)]
pub struct Consumer<L> {
    /// `kv_transfer.give_up_notices` (R2/R4 notices after a failed load and at shutdown).
    give_up_notices: bool,
    /// How long a reference no step mentions is kept (twice the hold time).
    ref_max_age: Duration,
    /// Set once a graceful shutdown began: no new lease is taken.
    shutting_down: bool,
    refs: RemoteRefs<L>,
    /// Receives with local blocks started for the current engine-core and not yet reported to
    /// it; a load that settles for another (one that restarted since) is dropped, never
    /// reported as loaded into blocks the new engine owns.
    live: HashSet<String>,
    receives: HashMap<RecvId, Receive<L>>,
    /// Receives that settled since the last step.
    settled: Vec<Settled>,
    next_id: u64,
    counters: ConsumerCounters,
}

impl<L: Clone> Consumer<L> {
    /// `ref_max_age`: how long a reference to P's blocks that no step mentions is kept (the
    /// worker uses twice P's hold time).
    pub fn new(give_up_notices: bool, ref_max_age: Duration) -> Self {
        Self {
            give_up_notices,
            ref_max_age,
            shutting_down: false,
            refs: RemoteRefs::default(),
            live: HashSet::new(),
            receives: HashMap::new(),
            settled: Vec::new(),
            next_id: 0,
            counters: ConsumerCounters::default(),
        }
    }

    /// A step's connector metadata arrived at `now`: take in the requests it references (R4),
    /// refresh those it heartbeats, and start its receives.
    pub fn start_step(&mut self, meta: &KvConnectorMetadata, now: Instant) -> Started<L> {
        if self.give_up_notices {
            for p in &meta.reqs_referenced {
                self.refs.take(p, now);
            }
            for p in &meta.reqs_to_heartbeat {
                self.refs.refresh(p, now);
            }
            let dropped = self.refs.prune(now, self.ref_max_age);
            if dropped > 0 {
                tracing::debug!(dropped, "references no step mentioned any more dropped");
            }
        }
        let heartbeats = heartbeat_batches(&meta.reqs_to_heartbeat);
        let receives = meta.reqs_to_recv.iter().enumerate().filter_map(|(index, r)| self.start(index, r)).collect();
        Started { heartbeats, receives }
    }

    /// One receive of a step; `None` if its params do not name P's blocks completely.
    fn start(&mut self, index: usize, r: &RecvRequest) -> Option<NewReceive<L>> {
        if !r.local_block_ids.is_empty() {
            self.live.insert(r.request_id.clone());
        }
        let p = &r.params;
        let (Some(engine), Some(host), Some(port), Some(p_req)) =
            (p.remote_engine_id.as_deref(), p.remote_host.as_deref(), p.remote_port, p.remote_request_id.as_deref())
        else {
            self.counters.incomplete_params += 1;
            tracing::warn!(request_id = %r.request_id, "a receive without P's engine, address or request id; ignored");
            return None;
        };
        let notify = r.local_block_ids.is_empty().then_some(match r.rejected_at_unix_us {
            Some(_) => GiveUpWhy::Rejection,
            None => GiveUpWhy::FinishedBeforeReceive,
        });
        let remote = p.remote_block_ids.clone().unwrap_or_default();
        let n = r.local_block_ids.len().min(remote.len());
        // A partial local prefix hit reads only the tail of P's blocks.
        let remote_tail = remote.get(remote.len() - n..).unwrap_or(&[]).to_vec();
        let gens = p.remote_block_generations.clone().unwrap_or_default();
        let gens_tail =
            if gens.len() == remote.len() { gens.get(gens.len() - n..).unwrap_or(&[]).to_vec() } else { gens };
        let local_tail = r.local_block_ids.get(r.local_block_ids.len() - n..).unwrap_or(&[]).to_vec();
        let recv = RecvId(self.next_id);
        self.next_id += 1;
        let receive = Receive {
            request_id: r.request_id.clone(),
            params: p.clone(),
            engine: engine.to_string(),
            endpoint: side_channel_endpoint(host, port),
            p_req: p_req.to_string(),
            token: p.remote_capability.clone().unwrap_or_default(),
            notify,
            local_block_ids: r.local_block_ids.clone(),
            remote_tail,
            gens_tail,
            local_tail,
            phase: Phase::Handshake,
        };
        let action = Action::Handshake {
            recv,
            engine: receive.engine.clone(),
            endpoint: receive.endpoint.clone(),
            stale: false,
        };
        self.receives.insert(recv, receive);
        Some(NewReceive { index, action })
    }

    /// The handshake of `recv` ended (`Err`: its error, displayed).
    pub fn on_handshake(&mut self, recv: RecvId, result: Result<(), String>) -> Next<L> {
        let Some(r) = self.receives.get_mut(&recv) else { return self.unexpected(recv, "handshake") };
        let retried = match r.phase {
            Phase::Handshake => false,
            Phase::Rehandshake => true,
            _ => return self.unexpected(recv, "handshake"),
        };
        if let Err(e) = result {
            // A second handshake that fails fails the lease it was for.
            return match retried {
                false => self.settle(recv, Err((FailureKind::Handshake, e))),
                true => self.settle(recv, Err((FailureKind::Lease, TransferError::SideChannel(e).to_string()))),
            };
        }
        if let Some(why) = r.notify {
            r.phase = Phase::GiveUp { why, then: None };
            return Next::Act(Action::GiveUp {
                recv,
                p_req: r.p_req.clone(),
                token: r.token.clone(),
                lease: None,
                why,
            });
        }
        if self.shutting_down {
            // Too late to read: give the reference back rather than take a lease.
            let failure = (FailureKind::Shutdown, "the worker is shutting down".to_string());
            if !self.give_up_notices {
                return self.settle(recv, Err(failure));
            }
            r.phase = Phase::GiveUp { why: GiveUpWhy::Shutdown, then: Some(failure) };
            return Next::Act(Action::GiveUp {
                recv,
                p_req: r.p_req.clone(),
                token: r.token.clone(),
                lease: None,
                why: GiveUpWhy::Shutdown,
            });
        }
        r.phase = Phase::Lease { retried };
        Next::Act(Action::Lease {
            recv,
            p_req: r.p_req.clone(),
            token: r.token.clone(),
            blocks: r.remote_tail.clone(),
            generations: r.gens_tail.clone(),
        })
    }

    /// P answered the lease of `recv`, repairing what D can (R4):
    /// - P restarted after the handshake (its grant names another agent), or the side channel
    ///   failed or went silent (P's worker died and may be back by now): D's view of P is
    ///   stale. Handshake again and ask once more. A restarted P grants the lease if it
    ///   prefilled this request itself (the same lease again to the same reader), and refuses
    ///   one of its predecessor's, whose blocks are gone with it.
    /// - P refused by fault injection (`lease_refused`), still holding the blocks: D will never
    ///   read them, so it says so at once and P frees them now, not at its deadline. Any other
    ///   refusal says P's hold is gone (freed, expired, aborted) or is not this reference
    ///   (other blocks or generations under a reused request id, another reader's lease): a
    ///   give-up, which names only the request id, could then free someone else's blocks, so
    ///   D says nothing. With `give_up_notices` off (the deadline-only baseline) D says
    ///   nothing either.
    pub fn on_lease(&mut self, recv: RecvId, result: Result<L, TransferError>) -> Next<L> {
        let Some(r) = self.receives.get_mut(&recv) else { return self.unexpected(recv, "lease") };
        let Phase::Lease { retried } = r.phase else { return self.unexpected(recv, "lease") };
        match result {
            Ok(lease) => {
                tracing::info!(blocks = r.remote_tail.len(), "lease granted");
                self.refs.leased(&r.params, &lease);
                r.phase = Phase::Read { lease: lease.clone() };
                Next::Act(Action::Read { recv, lease, remote: r.remote_tail.clone(), local: r.local_tail.clone() })
            }
            Err(
                e @ (TransferError::ProducerRestarted { .. }
                | TransferError::SideChannel(_)
                | TransferError::Timeout(_)),
            ) if !retried => {
                m::LEASE_RETRIES.inc();
                tracing::info!(engine = %r.engine, error = %e, "lease failed on a stale view of P: handshaking again");
                r.phase = Phase::Rehandshake;
                Next::Act(Action::Handshake {
                    recv,
                    engine: r.engine.clone(),
                    endpoint: r.endpoint.clone(),
                    stale: true,
                })
            }
            Err(e @ TransferError::LeaseRefused { reason: LeaseRefusalReason::FaultInjected, .. })
                if self.give_up_notices =>
            {
                // P refused although it may hold the blocks (a drill): D will never read them.
                let why = GiveUpWhy::LeaseRefused;
                r.phase = Phase::GiveUp { why, then: Some((FailureKind::Lease, e.to_string())) };
                Next::Act(Action::GiveUp { recv, p_req: r.p_req.clone(), token: r.token.clone(), lease: None, why })
            }
            Err(e) => self.settle(recv, Err((FailureKind::Lease, e.to_string()))),
        }
    }

    /// The READ of `recv` and its `read done` ended. After a failure D gives up (R4), naming
    /// the lease, so that P frees at once instead of at its deadline.
    pub fn on_read(&mut self, recv: RecvId, result: Result<(), ReadFailure>) -> Next<L> {
        let Some(r) = self.receives.get_mut(&recv) else { return self.unexpected(recv, "read") };
        let Phase::Read { lease } = &r.phase else { return self.unexpected(recv, "read") };
        match result {
            Ok(()) => self.settle(recv, Ok(true)),
            Err(ReadFailure { kind, error }) if !self.give_up_notices => {
                tracing::debug!("give-up notices are off: P frees at its lease deadline");
                self.settle(recv, Err((kind, error)))
            }
            Err(ReadFailure { kind, error }) => {
                let why = GiveUpWhy::ReadFailed;
                let lease = Some(lease.clone());
                r.phase = Phase::GiveUp { why, then: Some((kind, error)) };
                Next::Act(Action::GiveUp { recv, p_req: r.p_req.clone(), token: r.token.clone(), lease, why })
            }
        }
    }

    /// The give-up of `recv` was sent (`Err`: not delivered, its error displayed).
    pub fn on_give_up(&mut self, recv: RecvId, result: Result<(), String>) -> Next<L> {
        let Some(r) = self.receives.get_mut(&recv) else { return self.unexpected(recv, "give-up") };
        let Phase::GiveUp { why, then } = &mut r.phase else { return self.unexpected(recv, "give-up") };
        let (why, then) = (*why, then.take());
        match (why, result) {
            (_, Ok(())) => m::GIVE_UPS.with_label_values(&[why.label()]).inc(),
            // A notice that did not reach P: the receive fails (and, notify-only, is counted
            // as an undelivered notice when it ends).
            (GiveUpWhy::Rejection | GiveUpWhy::FinishedBeforeReceive, Err(e)) => {
                return self.settle(recv, Err((FailureKind::Lease, e)));
            }
            (GiveUpWhy::Shutdown, Err(_)) => {}
            (GiveUpWhy::LeaseRefused, Err(e)) => {
                m::NOTIFY_FAILURES.inc();
                tracing::debug!(error = %e, "give up after a failed lease not delivered");
            }
            (GiveUpWhy::ReadFailed, Err(e)) => {
                m::NOTIFY_FAILURES.inc();
                tracing::debug!(error = %e, "give up after a failed read not delivered");
            }
        }
        match then {
            Some(failure) => self.settle(recv, Err(failure)),
            None => self.settle(recv, Ok(false)),
        }
    }

    /// The receive ended (`Ok(true)`: read and confirmed; `Ok(false)`: a notice delivered;
    /// `Err`: failed): no reference to P's blocks is left, and one with local blocks is
    /// reported with the next step through the one failure handler (R3).
    fn settle(&mut self, recv: RecvId, result: Result<bool, (FailureKind, String)>) -> Next<L> {
        let Some(r) = self.receives.remove(&recv) else { return self.unexpected(recv, "settle") };
        self.refs.end(&r.params);
        let notify_only = r.notify.is_some();
        if let Err((kind, error)) = &result {
            tracing::warn!(kind = kind.label(), %error, notify_only, "receive failed");
        }
        match result {
            Ok(true) => {
                self.settled.push(Settled::Loaded { request_id: r.request_id });
                Next::Ended(Ended::Loaded)
            }
            Ok(false) => Next::Ended(Ended::Unreported),
            Err((kind, error)) if !notify_only => {
                self.settled.push(Settled::Failed {
                    request_id: r.request_id,
                    local_block_ids: r.local_block_ids,
                    kind,
                    error,
                });
                Next::Ended(Ended::Failed(kind))
            }
            Err((_, error)) => {
                m::NOTIFY_FAILURES.inc();
                tracing::warn!(request_id = %r.request_id, %error, "could not notify P; it frees at its deadline");
                Next::Ended(Ended::Unreported)
            }
        }
    }

    fn unexpected(&mut self, recv: RecvId, event: &'static str) -> Next<L> {
        self.counters.unexpected_events += 1;
        tracing::warn!(?recv, event, "an event for a receive not in a phase that takes it; ignored");
        Next::Ended(Ended::Unreported)
    }

    /// The receives that settled since the last step, as the connector output: finished
    /// receives, and a failed one's local blocks as invalid in the same step (R3). A load that
    /// settled for an engine-core that has restarted since is dropped.
    pub fn finish_step(&mut self) -> KvConnectorOutput {
        let mut out = KvConnectorOutput::default();
        for s in std::mem::take(&mut self.settled) {
            let id = match &s {
                Settled::Loaded { request_id } | Settled::Failed { request_id, .. } => request_id,
            };
            if !self.live.remove(id) {
                tracing::info!(request_id = %id, "a load settled for an engine-core that has restarted; dropped");
                continue;
            }
            match s {
                Settled::Loaded { request_id } => out.finished_recving.push(request_id),
                Settled::Failed { request_id, local_block_ids, kind, error } => {
                    tracing::warn!(%request_id, kind = kind.label(), %error, "KV load failed");
                    m::TRANSFER_FAILURES.with_label_values(&[kind.label()]).inc();
                    out.finished_recving.push(request_id);
                    out.invalid_block_ids.extend(local_block_ids);
                }
            }
        }
        out
    }

    /// The engine-core restarted: its receives are no longer reported (their READs are
    /// cancelled by the driver, and each still ends towards P). Returns how many were live.
    pub fn engine_restarted(&mut self) -> usize {
        std::mem::take(&mut self.live).len()
    }

    /// A graceful shutdown begins: no lease is taken from now on, and every reference to P's
    /// blocks is handed over to be given back, grouped per P engine.
    pub fn begin_shutdown(&mut self) -> ShutdownPlan<L> {
        self.shutting_down = true;
        let refs: Vec<(RefKey, RemoteRef<L>)> = self.refs.refs.drain().collect();
        let references = refs.len();
        if !self.give_up_notices {
            return ShutdownPlan { references, give_ups: Vec::new() };
        }
        let mut by_engine: BTreeMap<(String, String), Vec<GiveBack<L>>> = BTreeMap::new();
        for ((engine, p_req), r) in refs {
            by_engine.entry((engine, r.endpoint)).or_default().push(GiveBack {
                p_req,
                token: r.capability,
                lease: r.lease,
            });
        }
        let give_ups =
            by_engine.into_iter().map(|((engine, endpoint), requests)| Batch { engine, endpoint, requests }).collect();
        ShutdownPlan { references, give_ups }
    }

    /// References to P's blocks D holds now (R4).
    pub fn remote_refs(&self) -> usize {
        self.refs.len()
    }

    /// Receives started for the current engine-core and not yet reported to it (D68).
    pub fn pending(&self) -> usize {
        self.live.len()
    }

    /// The blocks of D's that receive `recv` may write (its READ's destination), while it runs.
    pub fn local_blocks(&self, recv: RecvId) -> Option<&[u32]> {
        self.receives.get(&recv).map(|r| r.local_tail.as_slice())
    }

    /// Receives in flight.
    pub fn receives(&self) -> usize {
        self.receives.len()
    }

    pub fn counters(&self) -> ConsumerCounters {
        self.counters
    }
}

/// Heartbeats for `params`, one batch per remote engine; params that do not name P's blocks
/// completely are left out.
fn heartbeat_batches(params: &[KvTransferParams]) -> Vec<Batch<(String, String)>> {
    let mut by_engine: BTreeMap<(String, String), Vec<(String, String)>> = BTreeMap::new();
    for p in params {
        if let (Some(engine), Some(host), Some(port), Some(id)) =
            (&p.remote_engine_id, &p.remote_host, p.remote_port, &p.remote_request_id)
        {
            let token = p.remote_capability.clone().unwrap_or_default();
            by_engine.entry((engine.clone(), side_channel_endpoint(host, port))).or_default().push((id.clone(), token));
        }
    }
    by_engine.into_iter().map(|((engine, endpoint), requests)| Batch { engine, endpoint, requests }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_protocol::TraceContext;

    fn params(id: &str) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: Some(true),
            remote_engine_id: Some("p".into()),
            remote_request_id: Some(id.into()),
            remote_block_ids: Some(vec![1, 2, 3]),
            remote_block_generations: Some(vec![11, 12, 13]),
            remote_host: Some("127.0.0.1".into()),
            remote_port: Some(5600),
            remote_capability: Some(format!("tok-{id}")),
            ..Default::default()
        }
    }

    fn recv(id: &str, local: Vec<u32>) -> RecvRequest {
        RecvRequest {
            request_id: format!("d-{id}"),
            params: params(id),
            local_block_ids: local,
            rejected_at_unix_us: None,
            trace: TraceContext::default(),
        }
    }

    fn step(recvs: Vec<RecvRequest>) -> KvConnectorMetadata {
        KvConnectorMetadata {
            reqs_referenced: recvs.iter().map(|r| r.params.clone()).collect(),
            reqs_to_recv: recvs,
            ..Default::default()
        }
    }

    /// Starts one receive of `local` blocks and answers its handshake; returns it and its next.
    fn started(c: &mut Consumer<u64>, id: &str, local: Vec<u32>, now: Instant) -> (RecvId, Next<u64>) {
        let s = c.start_step(&step(vec![recv(id, local)]), now);
        let Some(NewReceive { action: Action::Handshake { recv, stale: false, .. }, .. }) = s.receives.first().cloned()
        else {
            panic!("no handshake first: {s:?}");
        };
        (recv, c.on_handshake(recv, Ok(())))
    }

    #[test]
    fn a_receive_leases_reads_and_is_reported_loaded() {
        let mut c = Consumer::<u64>::new(true, Duration::from_secs(60));
        let (r, next) = started(&mut c, "a", vec![7, 8, 9], Instant::now());
        assert_eq!(c.pending(), 1);
        assert_eq!(c.remote_refs(), 1);
        let Next::Act(Action::Lease { blocks, generations, token, .. }) = next else { panic!("{next:?}") };
        assert_eq!((blocks, generations, token.as_str()), (vec![1, 2, 3], vec![11, 12, 13], "tok-a"));
        let next = c.on_lease(r, Ok(42));
        assert_eq!(next, Next::Act(Action::Read { recv: r, lease: 42, remote: vec![1, 2, 3], local: vec![7, 8, 9] }));
        assert_eq!(c.on_read(r, Ok(())), Next::Ended(Ended::Loaded));
        assert_eq!(c.remote_refs(), 0, "the receive ended: no reference left");
        let out = c.finish_step();
        assert_eq!(out.finished_recving, vec!["d-a".to_string()]);
        assert!(out.invalid_block_ids.is_empty());
        assert_eq!(c.pending(), 0);
        assert_eq!(c.finish_step(), KvConnectorOutput::default(), "reported once");
    }

    #[test]
    fn a_partial_local_hit_reads_only_the_tail_and_a_failure_invalidates_every_local_block() {
        let mut c = Consumer::<u64>::new(true, Duration::from_secs(60));
        let (r, next) = started(&mut c, "a", vec![5, 6], Instant::now());
        let Next::Act(Action::Lease { blocks, generations, .. }) = next else { panic!("{next:?}") };
        assert_eq!((blocks, generations), (vec![2, 3], vec![12, 13]));
        assert_eq!(c.local_blocks(r), Some(&[5, 6][..]));
        let Next::Act(Action::Read { remote, local, .. }) = c.on_lease(r, Ok(1)) else { panic!() };
        assert_eq!((remote, local), (vec![2, 3], vec![5, 6]));
        // A failed READ gives P its blocks back naming the lease (R4), then fails the load (R3).
        let failure = ReadFailure { kind: FailureKind::Read, error: "midway".into() };
        let Next::Act(Action::GiveUp { lease, why, .. }) = c.on_read(r, Err(failure)) else { panic!() };
        assert_eq!((lease, why), (Some(1), GiveUpWhy::ReadFailed));
        assert_eq!(c.finish_step(), KvConnectorOutput::default(), "not settled before the give-up was sent");
        assert_eq!(c.on_give_up(r, Err("P gone".into())), Next::Ended(Ended::Failed(FailureKind::Read)));
        let out = c.finish_step();
        assert_eq!((out.finished_recving, out.invalid_block_ids), (vec!["d-a".to_string()], vec![5, 6]));
    }

    #[test]
    fn a_stale_view_of_p_is_handshaken_again_once() {
        let mut c = Consumer::<u64>::new(true, Duration::from_secs(60));
        let (r, _) = started(&mut c, "a", vec![7, 8, 9], Instant::now());
        let next = c.on_lease(r, Err(TransferError::Timeout(Duration::from_secs(1))));
        assert!(matches!(next, Next::Act(Action::Handshake { stale: true, .. })), "{next:?}");
        assert!(matches!(c.on_handshake(r, Ok(())), Next::Act(Action::Lease { .. })));
        // Once: a second stale answer fails the load, and says nothing to P.
        let next = c.on_lease(r, Err(TransferError::SideChannel("again".into())));
        assert_eq!(next, Next::Ended(Ended::Failed(FailureKind::Lease)));
        // A second handshake that fails fails the lease it was for.
        let (r, _) = started(&mut c, "b", vec![7, 8, 9], Instant::now());
        let _ = c.on_lease(
            r,
            Err(TransferError::ProducerRestarted { lease_id: 1, granted_by: "x".into(), handshake_with: "y".into() }),
        );
        assert_eq!(c.on_handshake(r, Err("unreachable".into())), Next::Ended(Ended::Failed(FailureKind::Lease)));
        // A first handshake that fails fails as a handshake.
        let s = c.start_step(&step(vec![recv("d", vec![1])]), Instant::now());
        let Action::Handshake { recv: d, .. } = s.receives[0].action.clone() else { panic!() };
        assert_eq!(c.on_handshake(d, Err("unreachable".into())), Next::Ended(Ended::Failed(FailureKind::Handshake)));
    }

    #[test]
    fn only_a_fault_injected_refusal_is_given_back_and_only_with_notices_on() {
        let refused = |reason| TransferError::LeaseRefused { reason, detail: String::new() };
        for notices in [true, false] {
            let mut c = Consumer::<u64>::new(notices, Duration::from_secs(60));
            let (r, _) = started(&mut c, "a", vec![7], Instant::now());
            let next = c.on_lease(r, Err(refused(LeaseRefusalReason::FaultInjected)));
            if notices {
                let Next::Act(Action::GiveUp { lease: None, why: GiveUpWhy::LeaseRefused, .. }) = next else {
                    panic!("{next:?}")
                };
                assert_eq!(c.on_give_up(r, Ok(())), Next::Ended(Ended::Failed(FailureKind::Lease)));
            } else {
                assert_eq!(next, Next::Ended(Ended::Failed(FailureKind::Lease)));
            }
            // Gone, or another reference's blocks: a give-up could free someone else's.
            let (r, _) = started(&mut c, "b", vec![8], Instant::now());
            assert_eq!(
                c.on_lease(r, Err(refused(LeaseRefusalReason::GenerationMismatch))),
                Next::Ended(Ended::Failed(FailureKind::Lease))
            );
            // Notices off: a failed READ says nothing either.
            let (r, _) = started(&mut c, "c", vec![9], Instant::now());
            let _ = c.on_lease(r, Ok(3));
            let next = c.on_read(r, Err(ReadFailure { kind: FailureKind::ReadDone, error: "lost".into() }));
            assert_eq!(matches!(next, Next::Act(Action::GiveUp { .. })), notices);
            let out = c.finish_step();
            assert_eq!(out.finished_recving.len(), 2 + usize::from(!notices));
        }
    }

    #[test]
    fn a_notify_only_receive_tells_p_and_is_never_reported() {
        let mut c = Consumer::<u64>::new(true, Duration::from_secs(60));
        let mut rejected = recv("a", vec![]);
        rejected.rejected_at_unix_us = Some(5);
        let s = c.start_step(&step(vec![rejected, recv("b", vec![])]), Instant::now());
        assert_eq!(c.pending(), 0, "notify-only receives are not waited for");
        let whys: Vec<_> = s
            .receives
            .iter()
            .map(|n| {
                let Action::Handshake { recv, .. } = n.action.clone() else { panic!() };
                let Next::Act(Action::GiveUp { why, lease: None, .. }) = c.on_handshake(recv, Ok(())) else { panic!() };
                (recv, why)
            })
            .collect();
        assert_eq!(
            whys.iter().map(|w| w.1).collect::<Vec<_>>(),
            [GiveUpWhy::Rejection, GiveUpWhy::FinishedBeforeReceive]
        );
        assert_eq!(c.on_give_up(whys[0].0, Ok(())), Next::Ended(Ended::Unreported));
        assert_eq!(c.on_give_up(whys[1].0, Err("lost".into())), Next::Ended(Ended::Unreported));
        assert_eq!(c.finish_step(), KvConnectorOutput::default());
        assert_eq!(c.remote_refs(), 0);
    }

    #[test]
    fn a_shutdown_gives_every_reference_back_and_takes_no_lease() {
        let mut c = Consumer::<u64>::new(true, Duration::from_secs(60));
        let now = Instant::now();
        let (leased, _) = started(&mut c, "a", vec![7], now);
        let _ = c.on_lease(leased, Ok(9));
        // Queued on D (referenced, no receive yet).
        let _ = c.start_step(&KvConnectorMetadata { reqs_referenced: vec![params("q")], ..Default::default() }, now);
        let s = c.start_step(&step(vec![recv("late", vec![8])]), now);
        let plan = c.begin_shutdown();
        assert_eq!(plan.references, 3);
        let [batch] = plan.give_ups.as_slice() else { panic!("{plan:?}") };
        let mut reqs = batch.requests.clone();
        reqs.sort();
        assert_eq!(
            reqs,
            vec![
                GiveBack { p_req: "a".to_string(), token: "tok-a".to_string(), lease: Some(9) },
                GiveBack { p_req: "late".into(), token: "tok-late".into(), lease: None },
                GiveBack { p_req: "q".into(), token: "tok-q".into(), lease: None }
            ]
        );
        // A receive whose handshake ends after the shutdown began gives up instead of leasing.
        let Action::Handshake { recv: late, .. } = s.receives[0].action.clone() else { panic!() };
        let Next::Act(Action::GiveUp { why: GiveUpWhy::Shutdown, .. }) = c.on_handshake(late, Ok(())) else { panic!() };
        assert_eq!(c.on_give_up(late, Err("gone".into())), Next::Ended(Ended::Failed(FailureKind::Shutdown)));
        // Notices off: nothing to give back, P frees at its deadline.
        let mut off = Consumer::<u64>::new(false, Duration::from_secs(60));
        let _ = started(&mut off, "a", vec![7], now);
        assert_eq!(off.begin_shutdown(), ShutdownPlan { references: 0, give_ups: vec![] });
    }

    #[test]
    fn loads_settled_for_a_restarted_engine_are_dropped() {
        let mut c = Consumer::<u64>::new(true, Duration::from_secs(60));
        let (r, _) = started(&mut c, "a", vec![7], Instant::now());
        let _ = c.on_lease(r, Ok(1));
        assert_eq!(c.engine_restarted(), 1);
        assert_eq!(c.pending(), 0);
        let next = c.on_read(r, Err(ReadFailure { kind: FailureKind::Exception, error: "cancelled".into() }));
        assert!(matches!(next, Next::Act(Action::GiveUp { lease: Some(1), .. })), "still ends towards P");
        let _ = c.on_give_up(r, Ok(()));
        assert_eq!(c.finish_step(), KvConnectorOutput::default());
    }

    #[test]
    fn events_out_of_place_and_incomplete_params_are_counted_not_asserted() {
        let mut c = Consumer::<u64>::new(true, Duration::from_secs(60));
        assert_eq!(c.on_read(RecvId(99), Ok(())), Next::Ended(Ended::Unreported));
        let (r, _) = started(&mut c, "a", vec![7], Instant::now());
        assert_eq!(c.on_read(r, Ok(())), Next::Ended(Ended::Unreported), "no lease yet");
        assert!(matches!(c.on_lease(r, Ok(1)), Next::Act(Action::Read { .. })), "the receive goes on");
        let mut bad = recv("b", vec![3]);
        bad.params.remote_port = None;
        let s = c.start_step(&step(vec![bad]), Instant::now());
        assert!(s.receives.is_empty());
        assert_eq!(c.counters(), ConsumerCounters { unexpected_events: 2, incomplete_params: 1 });
    }

    #[test]
    fn heartbeats_go_one_message_per_p_engine() {
        let mut c = Consumer::<u64>::new(true, Duration::from_secs(60));
        let mut other = params("c");
        other.remote_engine_id = Some("p2".into());
        let meta =
            KvConnectorMetadata { reqs_to_heartbeat: vec![params("a"), other, params("b")], ..Default::default() };
        let s = c.start_step(&meta, Instant::now());
        let got: Vec<_> = s.heartbeats.iter().map(|b| (b.engine.as_str(), b.requests.len())).collect();
        assert_eq!(got, [("p", 2), ("p2", 1)]);
    }

    #[test]
    fn references_live_from_intake_to_the_end_of_their_receive() {
        let mut refs = RemoteRefs::<u64>::default();
        let t0 = Instant::now();
        refs.take(&params("a"), t0);
        refs.take(&params("a"), t0);
        refs.take(&params("b"), t0);
        let mut incomplete = params("c");
        incomplete.remote_port = None;
        refs.take(&incomplete, t0);
        assert_eq!(refs.len(), 2, "one per P request; incomplete params are no reference");
        refs.end(&params("a"));
        refs.end(&params("zzz"));
        assert_eq!(refs.len(), 1);
        // Stale and unleased: dropped; a heartbeat keeps one alive.
        refs.take(&params("d"), t0);
        refs.refresh(&params("d"), t0 + Duration::from_secs(50));
        assert_eq!(refs.prune(t0 + Duration::from_secs(70), Duration::from_secs(60)), 1);
        assert!(refs.refs.contains_key(&("p".to_string(), "d".to_string())));
    }
}
