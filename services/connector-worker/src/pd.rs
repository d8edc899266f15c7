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
//!
//! D's decisions — what a step's receives do, how each is judged, what a step reports — live
//! in the sans-IO [`Consumer`] (`crate::consumer`, D107); this module performs the I/O its
//! actions name: one task per receive over the transfer agent, heartbeats, the shutdown's
//! give-ups.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdmesh_kv_transfer::{
    compat_hash, AgentConfig, BackendConfig, ClientConfig, CompatInputs, FaultConfig, HeldBlockMs, HoldTable,
    HoldTableConfig, KvBlockWriter, Lease, LocalKv, MeshSecret, RemoteAgent, RemoteAgents, SharedPolicy, TransferAgent,
    TransferClient, TransferError,
};
use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::{KvConnectorMetadata, KvConnectorOutput, RecvRequest, SendRequest, TraceContext};
use pdmesh_telemetry::trace;
use tracing::Instrument;

pub use crate::consumer::FailureKind;
use crate::consumer::{Action, Batch, Consumer, GiveBack, GiveUpWhy, NewReceive, Next, ReadFailure, RecvId};
use crate::metrics as m;

/// P: the context of each held request's `kv.hold` span, for the `kv.release` span when its
/// blocks are freed (after D's read, a give-up or expiry), possibly many steps later.
static HOLD_TRACES: trace::RequestContexts = trace::RequestContexts::new();

/// D: the READ tasks in flight, by receive, so that an engine-core restart can cancel them
/// before the new engine reuses their blocks.
type ReadTasks = Arc<Mutex<std::collections::HashMap<RecvId, tokio::task::AbortHandle>>>;

/// D's state machine, shared by the step handler and the receive tasks (all on the worker's
/// actix thread; never locked across an await).
type SharedConsumer = Arc<Mutex<Consumer<Arc<Lease>>>>;

fn lock(c: &SharedConsumer) -> MutexGuard<'_, Consumer<Arc<Lease>>> {
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// P/D state of one connector-worker.
pub struct PdRuntime {
    /// P: held requests and leases (shared with the agent's side channel).
    hold: Option<Arc<Mutex<HoldTable>>>,
    agent: Option<TransferAgent>,
    hold_ttl: Duration,
    /// D: handshaken remote engines.
    agents: Option<Arc<RemoteAgents>>,
    /// D: how long a remote engine's handshake is kept unused.
    agent_idle: Duration,
    /// D: every decision about receives and references to P's blocks (R1, R3, R4).
    consumer: SharedConsumer,
    /// D: [`Consumer::pending`], shared with the executor thread ([`ReceiveView::pending`]),
    /// stored after every call that can change it.
    pending: Arc<AtomicUsize>,
    /// D: writes reads into the requests' blocks of this worker's own cache region.
    writer: Option<LocalKv>,
    /// D: READs in flight (cancelled when the engine-core restarts).
    reads: ReadTasks,
    faults: FaultConfig,
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
            consumer: Arc::new(Mutex::new(Consumer::new(setup.give_up_notices, setup.hold * 2))),
            pending: Arc::new(AtomicUsize::new(0)),
            writer,
            reads: Default::default(),
            faults: setup.faults,
            exported_block_ms: std::cell::Cell::new(HeldBlockMs::default()),
        })
    }

    /// D: how many references to P's blocks this worker holds now.
    pub fn remote_refs(&self) -> usize {
        lock(&self.consumer).remote_refs()
    }

    /// Graceful shutdown (R4): give back every reference to P's blocks this worker still holds
    /// — requests queued before their receive, receives waiting for a lease, READs in flight
    /// (naming their lease, so P frees at once) — so P does not keep them until its deadline.
    /// No new lease is taken afterwards. Bounded by `budget`; returns how many P acknowledged.
    pub async fn shutdown(&self, budget: Duration) -> usize {
        let plan = lock(&self.consumer).begin_shutdown();
        let Some(agents) = self.agents.clone() else { return 0 };
        if plan.references == 0 {
            return 0;
        }
        if plan.give_ups.is_empty() {
            tracing::info!(
                references = plan.references,
                "shutting down; give-up notices are off: P frees at its deadline"
            );
            return 0;
        }
        tracing::info!(references = plan.references, "shutting down: giving P's blocks back");
        let reason = GiveUpWhy::Shutdown.reason();
        match tokio::time::timeout(budget, give_up_all(agents, plan.give_ups, reason)).await {
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
        self.writer.clone().map(|writer| ReceiveView { writer, pending: self.pending.clone() })
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
            let started = {
                let mut c = lock(&self.consumer);
                let started = c.start_step(meta, Instant::now());
                self.pending.store(c.pending(), Ordering::Release);
                started
            };
            if !started.heartbeats.is_empty() {
                actix::spawn(heartbeat(agents.clone(), started.heartbeats));
            }
            for NewReceive { index, action } in started.receives {
                let Some(r) = meta.reqs_to_recv.get(index) else { continue };
                let span = tracing::info_span!("kv.read", otel.kind = "client", request_id = %r.request_id,
                    blocks = r.local_block_ids.len(), kv.bytes = tracing::field::Empty, kv.blocks = tracing::field::Empty,
                    remote_engine = r.params.remote_engine_id.as_deref().unwrap_or(""));
                if let Some(trace) = traces.get(&r.request_id) {
                    trace::set_parent(&span, trace);
                }
                let ctx = ReceiveCtx {
                    agents: agents.clone(),
                    writer: writer.clone(),
                    reads: self.reads.clone(),
                    consumer: self.consumer.clone(),
                    faults: self.faults.clone(),
                    agent: None,
                };
                actix::spawn(drive_receive(ctx, r.clone(), action).instrument(span));
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
        let dropped_recvs = lock(&self.consumer).engine_restarted();
        self.pending.store(0, Ordering::Release);
        let released = match &self.hold {
            Some(table) => table.lock().unwrap_or_else(|p| p.into_inner()).release_all(Instant::now()),
            None => 0,
        };
        tracing::warn!(released, dropped_recvs, "engine-core restarted: dropped the old engine's KV state");
    }

    /// Reads that settled since the last step, as the connector output (finished receives,
    /// invalid blocks, finished sends). A loaded receive's bytes are already in its blocks.
    pub fn finish_step(&self) -> KvConnectorOutput {
        let mut out = {
            let mut c = lock(&self.consumer);
            let out = c.finish_step();
            self.pending.store(c.pending(), Ordering::Release);
            if self.agents.is_some() {
                m::REMOTE_REFERENCES.set(c.remote_refs() as i64);
            }
            out
        };
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
async fn heartbeat(agents: Arc<RemoteAgents>, batches: Vec<Batch<(String, String)>>) {
    for Batch { engine, endpoint, requests: ids } in batches {
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

/// What a receive task shares with its worker, and the P agent it talks to.
struct ReceiveCtx {
    agents: Arc<RemoteAgents>,
    writer: LocalKv,
    reads: ReadTasks,
    consumer: SharedConsumer,
    faults: FaultConfig,
    /// P's agent, once handshaken (again, after a stale view).
    agent: Option<Arc<RemoteAgent>>,
}

/// Give P back every reference of a shutdown, one batch per remote engine, naming active
/// leases. Returns how many P acknowledged; the rest are counted as undelivered notices.
async fn give_up_all(agents: Arc<RemoteAgents>, batches: Vec<Batch<GiveBack<Arc<Lease>>>>, reason: &str) -> usize {
    let mut acked = 0;
    for Batch { engine, endpoint, requests: reqs } in batches {
        let agent = match agents.get(&engine, &endpoint).await {
            Ok(a) => a,
            Err(e) => {
                m::NOTIFY_FAILURES.inc_by(reqs.len() as u64);
                tracing::warn!(%engine, error = %e, requests = reqs.len(), "cannot reach P to give its blocks back");
                continue;
            }
        };
        let sends = reqs.iter().map(|g| agent.give_up(&g.p_req, &g.token, reason, g.lease.as_deref()));
        for res in futures::future::join_all(sends).await {
            match res {
                Ok(()) => {
                    acked += 1;
                    m::GIVE_UPS.with_label_values(&[GiveUpWhy::Shutdown.label()]).inc();
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

/// One receive: performs the actions D's [`Consumer`] names for it — handshake (cached),
/// lease, READ and `read done`, give-up — and hands each result back, until the machine says
/// the receive ended. How it ended reaches the engine through [`PdRuntime::finish_step`].
async fn drive_receive(mut ctx: ReceiveCtx, r: RecvRequest, first: Action<Arc<Lease>>) {
    let p_req = r.params.remote_request_id.clone().unwrap_or_default();
    trace::notice_hop("worker.receive", &p_req, r.rejected_at_unix_us);
    let mut next = Next::Act(first);
    while let Next::Act(action) = next {
        next = match action {
            Action::Handshake { recv, engine, endpoint, stale } => {
                let result = handshake(&mut ctx, &engine, &endpoint, stale).await;
                lock(&ctx.consumer).on_handshake(recv, result)
            }
            Action::Lease { recv, p_req, token, blocks, generations } => {
                let result = match &ctx.agent {
                    Some(agent) => agent.lease(&p_req, &token, &blocks, &generations).await.map(Arc::new),
                    None => Err(TransferError::SideChannel("no handshake before the lease".into())),
                };
                lock(&ctx.consumer).on_lease(recv, result)
            }
            Action::Read { recv, lease, remote, local } => {
                let result = read(&ctx, recv, &r.request_id, lease, remote, local).await;
                lock(&ctx.consumer).on_read(recv, result)
            }
            Action::GiveUp { recv, p_req, token, lease, why } => {
                let result = give_up(&ctx, &r, (&p_req, &token), lease, why).await;
                lock(&ctx.consumer).on_give_up(recv, result)
            }
        };
    }
}

/// P's agent for `engine` (cached, or handshaken now); `stale`: the cached one failed a lease
/// (P restarted, or its side channel failed), so it is marked stale and handshaken again.
async fn handshake(ctx: &mut ReceiveCtx, engine: &str, endpoint: &str, stale: bool) -> Result<(), String> {
    if stale {
        if let Some(agent) = &ctx.agent {
            agent.mark_stale();
        }
    }
    let agent = ctx.agents.get(engine, endpoint).await.map_err(|e| e.to_string())?;
    if !stale {
        tracing::info!(%endpoint, "handshake done");
    }
    ctx.agent = Some(agent);
    Ok(())
}

/// The READ and its `read done`, run as their own task, so that a task dying without a result
/// (the `transfer_exception` fault, or a cancel when the engine-core restarts) still reaches the
/// consumer as a failure. It writes straight into the request's blocks, checked out for exactly
/// as long as it runs.
async fn read(
    ctx: &ReceiveCtx,
    recv: RecvId,
    request_id: &str,
    lease: Arc<Lease>,
    remote: Vec<u32>,
    local: Vec<u32>,
) -> Result<(), ReadFailure> {
    let fail = |kind: FailureKind, e: &dyn std::fmt::Display| ReadFailure { kind, error: e.to_string() };
    let Some(agent) = ctx.agent.clone() else {
        return Err(fail(FailureKind::Exception, &"no handshake before the read"));
    };
    let writer = ctx.writer.clone();
    let task = actix::spawn(
        async move {
            // After the executor's step run ahead, if it writes one of them (D68).
            let mut blocks =
                writer.checkout_after_step(&local).await.map_err(|e| fail(FailureKind::LocalBlocks, &e))?;
            let stats = agent.read_into(&lease, &remote, &mut blocks).await.map_err(|e| fail(FailureKind::Read, &e))?;
            drop(blocks);
            agent.read_done(&lease).await.map_err(|e| fail(FailureKind::ReadDone, &e))?;
            Ok::<_, ReadFailure>(stats)
        }
        .instrument(tracing::Span::current()),
    );
    ctx.reads.lock().unwrap_or_else(|p| p.into_inner()).insert(recv, task.abort_handle());
    if ctx.faults.transfer_exception {
        tracing::warn!(%request_id, "fault injection: the read task dies");
        task.abort();
    }
    let outcome = task.await.unwrap_or_else(|e| Err(fail(FailureKind::Exception, &e)));
    ctx.reads.lock().unwrap_or_else(|p| p.into_inner()).remove(&recv);
    let stats = outcome?;
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
    Ok(())
}

/// Tell P that D will never read `p_req`. A notice of a notify-only receive (R1, or a request
/// that finished on D before its receive) is a span in the refused request's trace, so that
/// P's answer (`kv.serve.xfer_give_up`) and its release of the held blocks sit in that trace too.
async fn give_up(
    ctx: &ReceiveCtx,
    r: &RecvRequest,
    (p_req, token): (&str, &str),
    lease: Option<Arc<Lease>>,
    why: GiveUpWhy,
) -> Result<(), String> {
    let Some(agent) = &ctx.agent else { return Err("no handshake before the give-up".into()) };
    if !why.is_notice() {
        return agent.give_up(p_req, token, why.reason(), lease.as_deref()).await.map_err(|e| e.to_string());
    }
    let hop = |hop: &'static str| trace::notice_hop(hop, p_req, r.rejected_at_unix_us);
    hop("worker.handshaken");
    let span = trace::child_of(
        tracing::info_span!("kv.notify", otel.kind = "client", request_id = %p_req, reason = why.label()),
        &r.trace,
    );
    agent
        .give_up_at(p_req, token, why.reason(), None, r.rejected_at_unix_us)
        .instrument(span.clone())
        .await
        .map_err(|e| e.to_string())?;
    hop("worker.p_answered");
    tracing::info!(parent: &span, "notice delivered to P");
    Ok(())
}
