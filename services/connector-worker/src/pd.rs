//! The worker side of P/D: P holds blocks for readers and serves them through the transfer
//! agent; D reads remote blocks, notifies P, and reports receives to the engine.
//!
//! D's reads run as async tasks beside the forward pass and land in place: the request's own
//! blocks, checked out of a second mapping of D's shared-memory cache ([`KvBlockWriter`]) or,
//! with the `cuda` backend, of D's GPU region ([`LocalKv`]), which nobody else touches until
//! the receive is reported finished (the
//! scheduler does not schedule the request, nor free its blocks, before that). A receive is
//! reported in the first step after its read and `read done` completed, so the scheduler never
//! sees a request as loaded before its bytes are in place. When the engine-core restarts, the
//! reads it started are cancelled at once: the new engine may hand their blocks to other
//! requests (docs/DECISIONS.md, D33).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdmesh_kv_transfer::{
    compat_hash, side_channel_endpoint, AgentConfig, BackendConfig, ClientConfig, CompatInputs, FaultConfig,
    HeldBlockMs, HoldTable, HoldTableConfig, KvBlockWriter, Lease, LocalKv, MeshSecret, RemoteAgent, RemoteAgents,
    SharedPolicy, TransferAgent, TransferClient, TransferError,
};
use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::{
    KvConnectorMetadata, KvConnectorOutput, KvTransferParams, LeaseRefusalReason, RecvRequest, SendRequest,
    TraceContext,
};
use pdmesh_telemetry::trace;
use tracing::Instrument;

use crate::metrics as m;

/// P: the context of each held request's `kv.hold` span, for the `kv.release` span when its
/// blocks are freed (after D's read, a give-up or expiry), possibly many steps later.
static HOLD_TRACES: trace::RequestContexts = trace::RequestContexts::new();

/// How a receive with local blocks ended.
#[derive(Debug)]
enum Settled {
    /// Read into its blocks and confirmed by P.
    Loaded {
        request_id: String,
    },
    Failed {
        request_id: String,
        local_block_ids: Vec<u32>,
        kind: FailureKind,
        error: String,
    },
}

/// D: the READ tasks in flight, by D's request id, so that an engine-core restart can cancel
/// them before the new engine reuses their blocks.
type ReadTasks = Arc<Mutex<std::collections::HashMap<String, tokio::task::AbortHandle>>>;

/// P/D state of one connector-worker.
pub struct PdRuntime {
    /// P: held requests and leases (shared with the agent's side channel).
    hold: Option<Arc<Mutex<HoldTable>>>,
    agent: Option<TransferAgent>,
    hold_ttl: Duration,
    /// D: handshaken remote engines, and reads that settled since the last step.
    agents: Option<Arc<RemoteAgents>>,
    /// D: how long a remote engine's handshake is kept unused.
    agent_idle: Duration,
    settled: Arc<Mutex<Vec<Settled>>>,
    /// D: writes reads into the requests' blocks of this worker's own cache region.
    writer: Option<LocalKv>,
    /// D: READs in flight (cancelled when the engine-core restarts).
    reads: ReadTasks,
    /// D: receives started for the current engine-core; a load that settles for another
    /// (one that restarted since) is dropped, never copied into blocks the new engine owns.
    live_recvs: LiveRecvs,
    faults: FaultConfig,
    /// D: P's blocks this worker references (R4), to give back if it shuts down.
    refs: Arc<Mutex<RemoteRefs>>,
    /// D: `kv_transfer.give_up_notices` (R2/R4 notices after a failed load and at shutdown).
    give_up_notices: bool,
    /// D: set once a graceful shutdown began: no new lease is taken, every reference is given up.
    shutting_down: Arc<AtomicBool>,
    /// Held block-milliseconds already exported (the metric follows the table's counts).
    exported_block_ms: std::cell::Cell<HeldBlockMs>,
}

/// D's receives as the executor thread sees them (D68): where they write, and how many were
/// started and not yet reported to the engine. While one is pending the engine is about to add
/// its request to the decode batch, so a step run ahead would leave that row to a second pass.
#[derive(Debug, Clone)]
pub struct ReceiveView {
    pub writer: LocalKv,
    pub pending: Arc<AtomicUsize>,
}

/// D: the receives started for the current engine-core and not yet reported to it, with their
/// count shared with the executor thread ([`ReceiveView::pending`]), kept equal on every change.
#[derive(Debug, Default)]
struct LiveRecvs {
    ids: std::cell::RefCell<std::collections::HashSet<String>>,
    count: Arc<AtomicUsize>,
}

impl LiveRecvs {
    fn insert(&self, id: String) {
        let mut ids = self.ids.borrow_mut();
        ids.insert(id);
        self.count.store(ids.len(), Ordering::Release);
    }

    /// Whether `id` was live.
    fn remove(&self, id: &str) -> bool {
        let mut ids = self.ids.borrow_mut();
        let was = ids.remove(id);
        self.count.store(ids.len(), Ordering::Release);
        was
    }

    /// Forget them all (the engine-core restarted); returns how many there were.
    fn clear(&self) -> usize {
        let n = std::mem::take(&mut *self.ids.borrow_mut()).len();
        self.count.store(0, Ordering::Release);
        n
    }
}

/// Identifies P's blocks: (remote engine id, P's request id).
type RefKey = (String, String);

/// One reference D holds to P's blocks: from the step that took the request in until its
/// receive ends (read and confirmed, or given up).
#[derive(Debug, Clone)]
struct RemoteRef {
    endpoint: String,
    /// The request's capability token (`remote_capability`), for the give-up at shutdown.
    capability: String,
    /// The read lease, once granted: a give-up that names it frees P at once even mid-READ.
    lease: Option<Arc<Lease>>,
    /// Last step that mentioned it (taken in, or heartbeat); stale entries are dropped.
    seen: Instant,
}

/// D's references to P's blocks, so that a graceful shutdown can give back each one (R4):
/// requests queued on D before their receive, receives waiting for a lease, READs in flight.
#[derive(Debug, Default)]
pub struct RemoteRefs {
    refs: std::collections::HashMap<RefKey, RemoteRef>,
}

impl RemoteRefs {
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

    fn leased(&mut self, p: &KvTransferParams, lease: &Arc<Lease>) {
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

    pub fn len(&self) -> usize {
        self.refs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.refs.is_empty()
    }
}

fn wall_to_instant(unix_ms: u64) -> Instant {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    Instant::now() + Duration::from_millis(unix_ms.saturating_sub(now_ms))
}

/// What a worker needs to know to take part in P/D.
pub struct PdSetup {
    pub engine_id: String,
    pub rank: u32,
    pub produces: bool,
    pub consumes: bool,
    pub side_channel_bind: String,
    pub backend: BackendConfig,
    pub weights_id: String,
    pub hold: Duration,
    /// P's read-lease length and heartbeat extension (`kv_read_lease_s`,
    /// `kv_lease_duration_s`).
    pub hold_table: HoldTableConfig,
    /// `kv_transfer.remote_agent_idle_s`.
    pub remote_agent_idle: Duration,
    pub faults: FaultConfig,
    /// `kv_transfer.give_up_notices`.
    pub give_up_notices: bool,
    /// The mesh secret the side channel and block server demand, and D presents to producers.
    pub mesh_secret: MeshSecret,
}

/// Where this worker's KV cache lives, as the transfer agent serves it and receives fill it.
#[derive(Debug, Clone)]
pub enum PdMemory {
    /// The shared-memory file holding the cache (`shm` and `tcp` backends).
    Host(std::path::PathBuf),
    /// The GPU executor's exported region (`cuda` backend).
    #[cfg(feature = "cuda")]
    Device(Arc<pdmesh_kv_transfer::cuda::DeviceKvRegion>),
}

impl PdRuntime {
    /// Start the agent (P) and the client (D) over this worker's KV cache `memory`.
    pub async fn start(setup: PdSetup, spec: KvCacheSpec, memory: PdMemory) -> Result<Self, String> {
        let hash = compat_hash(&CompatInputs::for_spec(setup.weights_id.clone(), &spec));
        let mut hold = None;
        let mut agent = None;
        if setup.produces {
            let table = Arc::new(Mutex::new(HoldTable::new(setup.hold_table)));
            let policy: SharedPolicy = table.clone();
            let cfg = AgentConfig {
                engine_id: setup.engine_id.clone(),
                rank: setup.rank,
                side_channel: setup.side_channel_bind.clone(),
                backend: setup.backend.clone(),
                compat_hash: hash.clone(),
                faults: setup.faults.clone(),
                mesh_secret: setup.mesh_secret.clone(),
            };
            let started = match &memory {
                PdMemory::Host(region) => TransferAgent::start(cfg, region, spec, policy).await,
                #[cfg(feature = "cuda")]
                PdMemory::Device(region) => {
                    let handle = region.export().map_err(|e| format!("exporting the GPU KV region: {e}"))?;
                    TransferAgent::start_device(cfg, handle.to_hex(), spec, policy).await
                }
            };
            agent = Some(started.map_err(|e| e.to_string())?);
            hold = Some(table);
        }
        let agents = setup.consumes.then(|| {
            let mut cfg =
                ClientConfig::new(format!("{}/{}", setup.engine_id, setup.rank), spec, hash, setup.mesh_secret.clone());
            cfg.faults = setup.faults.clone();
            #[cfg(feature = "cuda")]
            if let PdMemory::Device(region) = &memory {
                cfg.local_device = Some(region.clone());
            }
            Arc::new(RemoteAgents::new(TransferClient::new(cfg)))
        });
        let writer = match (setup.consumes, &memory) {
            (false, _) => None,
            (true, PdMemory::Host(region)) => {
                Some(LocalKv::Host(Arc::new(KvBlockWriter::open(region, spec).map_err(|e| e.to_string())?)))
            }
            #[cfg(feature = "cuda")]
            (true, PdMemory::Device(region)) => {
                Some(LocalKv::Device(Arc::new(pdmesh_kv_transfer::DeviceBlockWriter::new(region.clone()))))
            }
        };
        Ok(Self {
            hold,
            agent,
            hold_ttl: setup.hold,
            agents,
            agent_idle: setup.remote_agent_idle,
            settled: Arc::new(Mutex::new(Vec::new())),
            writer,
            reads: Default::default(),
            live_recvs: Default::default(),
            faults: setup.faults,
            refs: Arc::new(Mutex::new(RemoteRefs::default())),
            give_up_notices: setup.give_up_notices,
            shutting_down: Arc::new(AtomicBool::new(false)),
            exported_block_ms: std::cell::Cell::new(HeldBlockMs::default()),
        })
    }

    /// D: how many references to P's blocks this worker holds now.
    pub fn remote_refs(&self) -> usize {
        self.refs.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Graceful shutdown (R4): give back every reference to P's blocks this worker still holds
    /// — requests queued before their receive, receives waiting for a lease, READs in flight
    /// (naming their lease, so P frees at once) — so P does not keep them until its deadline.
    /// No new lease is taken afterwards. Bounded by `budget`; returns how many P acknowledged.
    pub async fn shutdown(&self, budget: Duration) -> usize {
        self.shutting_down.store(true, Ordering::Release);
        let Some(agents) = self.agents.clone() else { return 0 };
        let refs: Vec<(RefKey, RemoteRef)> = self.refs.lock().unwrap_or_else(|p| p.into_inner()).refs.drain().collect();
        if refs.is_empty() {
            return 0;
        }
        if !self.give_up_notices {
            tracing::info!(references = refs.len(), "shutting down; give-up notices are off: P frees at its deadline");
            return 0;
        }
        tracing::info!(references = refs.len(), "shutting down: giving P's blocks back");
        match tokio::time::timeout(budget, give_up_all(agents, refs, "decode worker shutting down")).await {
            Ok(n) => n,
            Err(_) => {
                m::NOTIFY_FAILURES.inc();
                tracing::warn!(
                    ?budget,
                    "not every give-up was delivered before shutdown; P frees the rest at its deadline"
                );
                0
            }
        }
    }

    /// D: drop the cached handshakes of prefill engines unused for `remote_agent_idle_s`, or
    /// whose side channel failed, unless a read still uses them; this unmaps P's cache (`shm`)
    /// or closes its connections (`tcp`). Run on a timer: a D with no requests runs no steps,
    /// and that is when a departed P's mapping would otherwise stay forever. Returns how many
    /// were dropped.
    pub fn evict_idle_agents(&self) -> usize {
        let Some(agents) = &self.agents else { return 0 };
        let evicted = agents.evict_idle(Instant::now(), self.agent_idle);
        for engine in &evicted {
            tracing::info!(%engine, idle_s = self.agent_idle.as_secs(),
                "dropped the cached handshake of a prefill engine (unused, or its side channel failed)");
        }
        m::REMOTE_AGENTS_EVICTED.inc_by(evicted.len() as u64);
        m::REMOTE_AGENTS.set(agents.engines().len() as i64);
        evicted.len()
    }

    /// How often [`Self::evict_idle_agents`] runs: a fraction of the idle time, so an engine
    /// goes at most a quarter later than its idle time says.
    pub fn agent_sweep_period(&self) -> Option<Duration> {
        self.agents.as_ref().map(|_| (self.agent_idle / 4).clamp(Duration::from_secs(1), Duration::from_secs(30)))
    }

    /// What the executor's step run ahead needs of this node's receives (a node that consumes
    /// KV), D68.
    pub fn receive_view(&self) -> Option<ReceiveView> {
        self.writer.clone().map(|writer| ReceiveView { writer, pending: self.live_recvs.count.clone() })
    }

    /// Apply the step's connector metadata: start holds (P) and reads (D).
    /// `traces`: the requests' trace contexts from the step's Envelope (holds and reads are
    /// spans of the request's trace).
    pub fn start_step(&self, meta: &KvConnectorMetadata, traces: &BTreeMap<String, TraceContext>) {
        if let Some(table) = &self.hold {
            let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
            let cap = Instant::now() + self.hold_ttl * 2;
            producer_start_step(&mut t, meta, |s| wall_to_instant(s.deadline_unix_ms).min(cap));
            for s in &meta.reqs_to_send {
                if let Some(trace) = traces.get(&s.request_id) {
                    let span = trace::child_of(
                        tracing::info_span!("kv.hold", request_id = %s.request_id, blocks = s.block_ids.len()),
                        trace,
                    );
                    tracing::info!(parent: &span, blocks = s.block_ids.len(), ttl_ms = self.hold_ttl.as_millis() as u64,
                        "hold started");
                    HOLD_TRACES.remember(&s.request_id, trace::outgoing(&span, trace));
                }
            }
        }
        if let (Some(agents), Some(writer)) = (&self.agents, &self.writer) {
            if self.give_up_notices {
                let now = Instant::now();
                let mut refs = self.refs.lock().unwrap_or_else(|p| p.into_inner());
                for p in &meta.reqs_referenced {
                    refs.take(p, now);
                }
                for p in &meta.reqs_to_heartbeat {
                    refs.refresh(p, now);
                }
                let dropped = refs.prune(now, self.hold_ttl * 2);
                if dropped > 0 {
                    tracing::debug!(dropped, "references no step mentioned any more dropped");
                }
            }
            if !meta.reqs_to_heartbeat.is_empty() {
                actix::spawn(heartbeat(agents.clone(), meta.reqs_to_heartbeat.clone()));
            }
            for r in &meta.reqs_to_recv {
                let span = tracing::info_span!("kv.read", otel.kind = "client", request_id = %r.request_id,
                    blocks = r.local_block_ids.len(), kv.bytes = tracing::field::Empty, kv.blocks = tracing::field::Empty,
                    remote_engine = r.params.remote_engine_id.as_deref().unwrap_or(""));
                if let Some(trace) = traces.get(&r.request_id) {
                    trace::set_parent(&span, trace);
                }
                if !r.local_block_ids.is_empty() {
                    self.live_recvs.insert(r.request_id.clone());
                }
                let ctx = ReceiveCtx {
                    agents: agents.clone(),
                    writer: writer.clone(),
                    reads: self.reads.clone(),
                    settled: self.settled.clone(),
                    faults: self.faults.clone(),
                    refs: self.refs.clone(),
                    give_up_notices: self.give_up_notices,
                    shutting_down: self.shutting_down.clone(),
                };
                actix::spawn(receive(ctx, r.clone()).instrument(span));
            }
        }
    }

    /// The engine-core this worker serves restarted (another process connected): its block
    /// pool starts empty and may hand out any block at once. P releases every hold (a reader
    /// mid-READ is refused at `read done`, so it never uses bytes the new engine may
    /// overwrite); D cancels the READs it was running for the old engine's requests — they
    /// write into blocks the new engine may give to others, so none may write again — and
    /// drops whatever settles for them (each still ends towards P: a give-up).
    pub fn engine_restarted(&self) {
        m::ENGINE_RESTARTS.inc();
        // Every READ task runs on this thread and is parked at an await point whenever this
        // runs, so a cancelled one is never polled, and never writes, again.
        let cancelled: Vec<_> = self.reads.lock().unwrap_or_else(|p| p.into_inner()).drain().collect();
        for (_, task) in &cancelled {
            task.abort();
        }
        if !cancelled.is_empty() {
            tracing::warn!(reads = cancelled.len(), "cancelled the old engine's reads in flight");
        }
        let dropped_recvs = self.live_recvs.clear();
        let released = match &self.hold {
            Some(table) => table.lock().unwrap_or_else(|p| p.into_inner()).release_all(Instant::now()),
            None => 0,
        };
        tracing::warn!(released, dropped_recvs, "engine-core restarted: dropped the old engine's KV state");
    }

    /// Reads that settled since the last step, as the connector output (finished receives,
    /// invalid blocks, finished sends). A loaded receive's bytes are already in its blocks.
    pub fn finish_step(&self) -> KvConnectorOutput {
        let mut out = KvConnectorOutput::default();
        let settled = std::mem::take(&mut *self.settled.lock().unwrap_or_else(|p| p.into_inner()));
        for s in settled {
            let id = match &s {
                Settled::Loaded { request_id } | Settled::Failed { request_id, .. } => request_id,
            };
            if !self.live_recvs.remove(id) {
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
        if self.agents.is_some() {
            m::REMOTE_REFERENCES.set(self.remote_refs() as i64);
        }
        if let Some(agent) = &self.agent {
            let stats = agent.stats();
            m::HANDSHAKES_SERVED.set(stats.metadata_requests.load(std::sync::atomic::Ordering::Relaxed) as i64);
            m::LEASES_GRANTED.set(stats.leases_granted.load(std::sync::atomic::Ordering::Relaxed) as i64);
            m::LEASES_REFUSED.set(stats.leases_refused.load(std::sync::atomic::Ordering::Relaxed) as i64);
            for us in stats.take_rejection_latencies() {
                m::REJECTION_TO_RELEASE_SECONDS.observe(us as f64 / 1e6);
            }
        }
        if let Some(table) = &self.hold {
            let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
            let (expired, causes) = producer_finish_step_with_causes(&mut t, Instant::now(), &mut out);
            if expired > 0 {
                m::HOLDS_EXPIRED.inc_by(expired as u64);
            }
            for (id, cause) in out.finished_sending.iter().zip(causes) {
                if let Some(trace) = HOLD_TRACES.take(id) {
                    let span = trace::child_of(
                        tracing::info_span!("kv.release", request_id = %id, released_by = cause),
                        &trace,
                    );
                    if cause == "expired" {
                        tracing::warn!(parent: &span, "hold expired");
                    }
                    tracing::info!(parent: &span, released_by = cause, "held blocks freed");
                }
            }
            m::HELD_BLOCKS.set(t.held_blocks() as i64);
            let now = t.counters().held_block_ms;
            let before = self.exported_block_ms.replace(now);
            for (label, n, b) in [
                ("read_done", now.read_done, before.read_done),
                ("given_up", now.given_up, before.given_up),
                ("aborted", now.aborted, before.aborted),
                ("expired", now.expired, before.expired),
            ] {
                if n > b {
                    m::HELD_BLOCK_SECONDS.with_label_values(&[label]).inc_by((n - b) as f64 / 1000.0);
                }
            }
            m::LEASED_BLOCKS.set(t.leased_blocks() as i64);
        }
        out
    }
}

/// P, when a step's metadata arrives: start the holds `request_finished` queued (deadline from
/// `deadline_of`) and pass aborts after finish on to the hold table. No clock and no I/O, so
/// the lifecycle property test (`tests/lifecycle.rs`) drives the very code the worker runs.
pub fn producer_start_step(
    t: &mut HoldTable,
    meta: &KvConnectorMetadata,
    deadline_of: impl Fn(&SendRequest) -> Instant,
) {
    for s in &meta.reqs_to_send {
        let deadline = deadline_of(s);
        t.hold_with_capability(
            &s.request_id,
            s.block_ids.clone(),
            s.block_generations.clone(),
            deadline,
            s.capability.clone(),
        );
    }
    for id in &meta.reqs_aborted_after_finish {
        let outcome = t.abort(id);
        tracing::info!(request_id = %id, ?outcome, "abort after finish");
    }
}

/// P, at the end of a step: release holds and leases past their deadline, then report every
/// released request exactly once (`finished_sending`: only now may the scheduler free its
/// blocks) and the requests under a lease. Returns how many expired.
pub fn producer_finish_step(t: &mut HoldTable, now: Instant, out: &mut KvConnectorOutput) -> usize {
    producer_finish_step_with_causes(t, now, out).0
}

/// [`producer_finish_step`], also returning why each of `out.finished_sending` was released.
pub fn producer_finish_step_with_causes(
    t: &mut HoldTable,
    now: Instant,
    out: &mut KvConnectorOutput,
) -> (usize, Vec<&'static str>) {
    let expired = t.expire(now);
    let (ids, causes): (Vec<_>, Vec<_>) = t.take_finished_sending_with_causes().into_iter().unzip();
    out.finished_sending = ids;
    out.leased_request_ids = t.held_requests(now).into_iter().filter(|h| h.leased).map(|h| h.request_id).collect();
    (expired, causes)
}

/// Keep P's holds alive for requests that wait on D (R2 read leases: the hold deadline is
/// extended by D's heartbeats), one message per remote engine. A heartbeat that cannot be
/// delivered is counted; P then frees at its deadline and D's later lease follows the
/// load-failure policy.
async fn heartbeat(agents: Arc<RemoteAgents>, params: Vec<pdmesh_protocol::KvTransferParams>) {
    let mut by_engine: std::collections::BTreeMap<(String, String), Vec<(String, String)>> = Default::default();
    for p in params {
        if let (Some(engine), Some(host), Some(port), Some(id)) =
            (p.remote_engine_id, p.remote_host, p.remote_port, p.remote_request_id)
        {
            let token = p.remote_capability.unwrap_or_default();
            by_engine.entry((engine, side_channel_endpoint(&host, port))).or_default().push((id, token));
        }
    }
    for ((engine, endpoint), ids) in by_engine {
        let sent = match agents.get(&engine, &endpoint).await {
            Ok(agent) => agent.heartbeat(&ids).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match sent {
            Ok(()) => m::HEARTBEATS_SENT.inc_by(ids.len() as u64),
            Err(error) => {
                m::NOTIFY_FAILURES.inc();
                tracing::warn!(%engine, %error, requests = ids.len(), "heartbeat not delivered");
            }
        }
    }
}

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

/// What a receive task shares with its worker.
struct ReceiveCtx {
    agents: Arc<RemoteAgents>,
    writer: LocalKv,
    reads: ReadTasks,
    settled: Arc<Mutex<Vec<Settled>>>,
    faults: FaultConfig,
    refs: Arc<Mutex<RemoteRefs>>,
    give_up_notices: bool,
    shutting_down: Arc<AtomicBool>,
}

/// Give P back every reference in `refs` (shutdown), per remote engine, naming active leases.
/// Returns how many P acknowledged; the rest are counted as undelivered notices.
async fn give_up_all(agents: Arc<RemoteAgents>, refs: Vec<(RefKey, RemoteRef)>, reason: &str) -> usize {
    /// P's request ids (with their capability and the active lease, if any) per (engine,
    /// side channel).
    type ByEngine = BTreeMap<(String, String), Vec<(String, String, Option<Arc<Lease>>)>>;
    let mut by_engine = ByEngine::new();
    for ((engine, p_req), r) in refs {
        by_engine.entry((engine, r.endpoint)).or_default().push((p_req, r.capability, r.lease));
    }
    let mut acked = 0;
    for ((engine, endpoint), reqs) in by_engine {
        let agent = match agents.get(&engine, &endpoint).await {
            Ok(a) => a,
            Err(e) => {
                m::NOTIFY_FAILURES.inc_by(reqs.len() as u64);
                tracing::warn!(%engine, error = %e, requests = reqs.len(), "cannot reach P to give its blocks back");
                continue;
            }
        };
        let sends = reqs.iter().map(|(p_req, token, lease)| agent.give_up(p_req, token, reason, lease.as_deref()));
        for res in futures::future::join_all(sends).await {
            match res {
                Ok(()) => {
                    acked += 1;
                    m::GIVE_UPS.with_label_values(&["shutdown"]).inc();
                }
                Err(e) => {
                    m::NOTIFY_FAILURES.inc();
                    tracing::debug!(%engine, error = %e, "give-up not delivered");
                }
            }
        }
    }
    acked
}

/// One receive: handshake (cached), lease, read, notify. A notify-only receive (no local
/// blocks) tells P to free and is never reported to the scheduler. Every failure ends in the
/// one failure handler ([`Settled::Failed`] → `finish_step`), which reports the request as
/// received together with its invalid blocks, so the scheduler applies the load-failure policy.
async fn receive(ctx: ReceiveCtx, r: RecvRequest) {
    let ReceiveCtx { agents, writer, reads, settled, faults, refs, give_up_notices, shutting_down } = ctx;
    let p = &r.params;
    let (Some(engine), Some(host), Some(port), Some(p_req)) =
        (p.remote_engine_id.as_deref(), p.remote_host.as_deref(), p.remote_port, p.remote_request_id.as_deref())
    else {
        return;
    };
    let endpoint = side_channel_endpoint(host, port);
    // The capability P handed out with the params: every message about these blocks carries it.
    let token = p.remote_capability.as_deref().unwrap_or("");
    let notify_only = r.local_block_ids.is_empty();
    let hop = |hop: &'static str| trace::notice_hop(hop, p_req, r.rejected_at_unix_us);
    hop("worker.receive");
    let fail = |kind: FailureKind, e: &dyn std::fmt::Display| (kind, e.to_string());
    let result: Result<bool, (FailureKind, String)> = async {
        let agent = agents.get(engine, &endpoint).await.map_err(|e| fail(FailureKind::Handshake, &e))?;
        tracing::info!(%endpoint, "handshake done");
        if notify_only {
            hop("worker.handshaken");
            let (reason, label) = match r.rejected_at_unix_us {
                Some(_) => ("rejected before admission (notify only)", "rejection"),
                None => ("finished on D before its receive", "abort"),
            };
            // A span in the refused request's trace: P's answer (`kv.serve.xfer_give_up`) and
            // its release of the held blocks then sit in that trace too.
            let span = trace::child_of(
                tracing::info_span!("kv.notify", otel.kind = "client", request_id = %p_req, reason = label),
                &r.trace,
            );
            agent
                .give_up_at(p_req, token, reason, None, r.rejected_at_unix_us)
                .instrument(span.clone())
                .await
                .map_err(|e| fail(FailureKind::Lease, &e))?;
            hop("worker.p_answered");
            tracing::info!(parent: &span, "notice delivered to P");
            m::GIVE_UPS.with_label_values(&[label]).inc();
            return Ok(false);
        }
        if shutting_down.load(Ordering::Acquire) {
            // Too late to read: give the reference back rather than take a lease.
            if give_up_notices && agent.give_up(p_req, token, "decode worker shutting down", None).await.is_ok() {
                m::GIVE_UPS.with_label_values(&["shutdown"]).inc();
            }
            return Err(fail(FailureKind::Shutdown, &"the worker is shutting down"));
        }
        let remote = p.remote_block_ids.clone().unwrap_or_default();
        let n = r.local_block_ids.len().min(remote.len());
        // A partial local prefix hit reads only the tail of P's blocks.
        let remote_tail = remote.get(remote.len() - n..).unwrap_or(&[]).to_vec();
        let gens = p.remote_block_generations.clone().unwrap_or_default();
        let gens_tail =
            if gens.len() == remote.len() { gens.get(gens.len() - n..).unwrap_or(&[]).to_vec() } else { gens };
        let (agent, lease) =
            lease_blocks(&agents, agent, engine, &endpoint, (p_req, token), &remote_tail, &gens_tail, give_up_notices)
                .await
                .map_err(|e| fail(FailureKind::Lease, &e))?;
        tracing::info!(blocks = remote_tail.len(), "lease granted");
        let lease = Arc::new(lease);
        refs.lock().unwrap_or_else(|p| p.into_inner()).leased(p, &lease);
        // The request's blocks (the tail a partial local prefix hit leaves to read).
        let local_tail = r.local_block_ids.get(r.local_block_ids.len() - n..).unwrap_or(&[]).to_vec();
        // The READ and its `read done` run as their own task, so that a task dying without a
        // result (the `transfer_exception` fault, or a cancel when the engine-core restarts)
        // still lands in the failure handler below. It writes straight into the request's
        // blocks, checked out for exactly as long as it runs.
        let task = actix::spawn(
            {
                let (agent, lease, remote_tail, writer) = (agent.clone(), lease.clone(), remote_tail.clone(), writer);
                async move {
                    // After the executor's step run ahead, if it writes one of them (D68).
                    let mut blocks = writer
                        .checkout_after_step(&local_tail)
                        .await
                        .map_err(|e| fail(FailureKind::LocalBlocks, &e))?;
                    let stats = agent
                        .read_into(&lease, &remote_tail, &mut blocks)
                        .await
                        .map_err(|e| fail(FailureKind::Read, &e))?;
                    drop(blocks);
                    agent.read_done(&lease).await.map_err(|e| fail(FailureKind::ReadDone, &e))?;
                    Ok::<_, (FailureKind, String)>(stats)
                }
            }
            .instrument(tracing::Span::current()),
        );
        reads.lock().unwrap_or_else(|p| p.into_inner()).insert(r.request_id.clone(), task.abort_handle());
        if faults.transfer_exception {
            tracing::warn!(request_id = %r.request_id, "fault injection: the read task dies");
            task.abort();
        }
        let outcome = task.await.unwrap_or_else(|e| Err(fail(FailureKind::Exception, &e)));
        reads.lock().unwrap_or_else(|p| p.into_inner()).remove(&r.request_id);
        match outcome {
            Ok(stats) => {
                let span = tracing::Span::current();
                span.record("kv.bytes", stats.bytes);
                span.record("kv.blocks", stats.blocks);
                tracing::info!(
                    bytes = stats.bytes,
                    blocks = stats.blocks,
                    elapsed_us = stats.elapsed.as_micros() as u64,
                    "read done"
                );
                m::TRANSFER_BYTES.inc_by(stats.bytes);
                m::TRANSFER_SECONDS.observe(stats.elapsed.as_secs_f64());
                Ok(true)
            }
            Err(failure) if !give_up_notices => {
                tracing::debug!("give-up notices are off: P frees at its lease deadline");
                Err(failure)
            }
            Err(failure) => {
                // D gives up (R4): P frees at once instead of at its deadline.
                match agent.give_up(p_req, token, "read failed", Some(lease.as_ref())).await {
                    Ok(()) => m::GIVE_UPS.with_label_values(&["load_failure"]).inc(),
                    Err(e) => {
                        m::NOTIFY_FAILURES.inc();
                        tracing::debug!(error = %e, "give up after a failed read not delivered");
                    }
                }
                Err(failure)
            }
        }
    }
    .await;
    // The receive ended (read and confirmed, given up, or failed): no reference is left.
    refs.lock().unwrap_or_else(|p| p.into_inner()).end(p);
    if let Err((kind, error)) = &result {
        tracing::warn!(kind = kind.label(), %error, notify_only, "receive failed");
    }
    let mut s = settled.lock().unwrap_or_else(|p| p.into_inner());
    match result {
        Ok(true) => s.push(Settled::Loaded { request_id: r.request_id.clone() }),
        Ok(false) => {}
        Err((kind, error)) if !notify_only => s.push(Settled::Failed {
            request_id: r.request_id.clone(),
            local_block_ids: r.local_block_ids.clone(),
            kind,
            error,
        }),
        Err((_, error)) => {
            m::NOTIFY_FAILURES.inc();
            tracing::warn!(request_id = %r.request_id, %error, "could not notify P; it frees at its deadline");
        }
    }
}

/// Ask P for a read lease, repairing what D can (R4):
/// - P restarted after the handshake (its grant names another agent), or the side channel
///   failed or went silent (P's worker died and may be back by now): D's view of P is stale.
///   Handshake again and ask once more. A restarted P grants the lease if it prefilled this
///   request itself (the same lease again to the same reader), and refuses one of its
///   predecessor's, whose blocks are gone with it.
/// - P refused by fault injection (`lease_refused`), still holding the blocks: D will never
///   read them, so it says so at once and P frees them now, not at its deadline. Any other
///   refusal says P's hold is gone (freed, expired, aborted) or is not this reference (other
///   blocks or generations under a reused request id, another reader's lease): a give-up,
///   which names only the request id, could then free someone else's blocks, so D says
///   nothing. With `give_up_notices` off (the deadline-only baseline) D says nothing either.
#[allow(clippy::too_many_arguments)] // one receive's coordinates, each used once
async fn lease_blocks(
    agents: &RemoteAgents,
    agent: Arc<RemoteAgent>,
    engine: &str,
    endpoint: &str,
    (p_req, token): (&str, &str),
    blocks: &[u32],
    generations: &[u64],
    give_up_notices: bool,
) -> Result<(Arc<RemoteAgent>, Lease), TransferError> {
    let first = agent.lease(p_req, token, blocks, generations).await;
    let (agent, result) = match first {
        Err(
            e @ (TransferError::ProducerRestarted { .. } | TransferError::SideChannel(_) | TransferError::Timeout(_)),
        ) => {
            m::LEASE_RETRIES.inc();
            tracing::info!(engine, error = %e, "lease failed on a stale view of P: handshaking again");
            agent.mark_stale();
            let fresh = agents.get(engine, endpoint).await.map_err(|h| TransferError::SideChannel(h.to_string()))?;
            let again = fresh.lease(p_req, token, blocks, generations).await;
            (fresh, again)
        }
        other => (agent, other),
    };
    match result {
        Ok(lease) => Ok((agent, lease)),
        Err(e @ TransferError::LeaseRefused { reason: LeaseRefusalReason::FaultInjected, .. }) if give_up_notices => {
            // P refused although it may hold the blocks (a drill): D will never read them.
            match agent.give_up(p_req, token, "lease failed", None).await {
                Ok(()) => m::GIVE_UPS.with_label_values(&["load_failure"]).inc(),
                Err(notify) => {
                    m::NOTIFY_FAILURES.inc();
                    tracing::debug!(error = %notify, "give up after a failed lease not delivered");
                }
            }
            Err(e)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(id: &str) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: Some(true),
            remote_engine_id: Some("p".into()),
            remote_request_id: Some(id.into()),
            remote_block_ids: Some(vec![1]),
            remote_host: Some("127.0.0.1".into()),
            remote_port: Some(5600),
            ..Default::default()
        }
    }

    #[test]
    fn references_live_from_intake_to_the_end_of_their_receive() {
        let mut refs = RemoteRefs::default();
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
