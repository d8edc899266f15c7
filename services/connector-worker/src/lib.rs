//! connector-worker: owns one rank's KV-cache memory and runs the model executor (vLLM's GPU
//! worker + model runner + the worker side of the KV connector).
//!
//! - [`ExecutorActor`] runs on its own OS thread (an actix `SyncArbiter`), because a forward
//!   pass is CPU-bound and must not stall the socket actor.
//! - [`WorkerActor`] binds the ROUTER engine-core talks to, answers `WorkerInfoQuery`, and
//!   forwards `ExecuteStep` to the executor thread. A step the executor fails still answers
//!   with the step's connector output; one that finds the accelerator lost also ends the
//!   process ([`RunningWorker::device_lost`]), since nothing on that context can run again.
//! - With `tensor_parallel_size > 1` the worker is TP rank 0 of its rank: it hands every step
//!   to its TP peers and answers once all have computed it ([`tp`], D111); a peer runs
//!   [`run_tp_peer`].

pub mod consumer;
pub mod executor_actor;
pub mod metrics;
pub mod multi;
pub mod offload;
pub mod pd;
pub mod tp;

pub use executor_actor::{once, ExecutorActor, ExecutorFactory, ExecutorFaults, RunStep};

use std::collections::BTreeMap;

use actix::prelude::*;
use pdmesh_config::TransferBackendKind;
use pdmesh_model_api::{ExecutorError, KvCache, KvCacheSpec, ModelFacts};
use pdmesh_protocol::{
    Envelope, ErrorClass, Hello, KvConnectorOutput, Message, ModelRunnerOutput, SchedulerOutput, ServiceKind,
    TraceContext, WireError, WorkerInfo,
};
use pdmesh_service::{ServiceContext, Shutdown};
use pdmesh_transport::{bind_router, connect_dealer, LinkConfig, LinkEvent, PeerId, RouterEvent, RouterHandle};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("config: {0}")]
    Config(#[from] pdmesh_config::ConfigError),
    #[error("transport: {0}")]
    Transport(#[from] pdmesh_transport::TransportError),
    #[error("model: {0}")]
    Model(String),
    /// A setting of the node that cannot work (an unknown fault name): starting again cannot
    /// help, so `pdmesh` exits with its configuration-error status.
    #[error("invalid setting: {0}")]
    Setting(String),
    /// The KV cache's placement and the node's transfer backend disagree.
    #[error("KV cache placement: {0}")]
    Placement(String),
    /// The accelerator is gone for this process: it exits with an error so that `pdmesh up`,
    /// compose or Kubernetes start a fresh one.
    #[error("the accelerator is lost ({0}); exiting to be restarted")]
    DeviceLost(String),
}

/// The socket side of the worker.
pub struct WorkerActor {
    executor: Addr<ExecutorActor>,
    pd: Option<std::rc::Rc<pd::PdRuntime>>,
    info: WorkerInfo,
    router: Option<RouterHandle>,
    /// pid of the engine-core last connected, to tell a restarted engine from a reconnect.
    engine_pid: Option<u32>,
    /// Told once, when the executor reports the accelerator lost ([`RunningWorker`]).
    device_lost: Option<tokio::sync::oneshot::Sender<String>>,
    /// One connector output from the P/D and offload children's (`MultiConnector`).
    merge: multi::OutputMerge,
    /// TP rank 0's peers (D111); `None` without tensor parallelism and on a peer.
    tp: Option<tp::TpLinks>,
    /// Whether steps must name this process's incarnation (D113). Not on a TP peer: its steps
    /// come from its rank 0, which checked them against the incarnation the engine knows (the
    /// group's), and a peer lives and dies with that rank 0.
    checks_incarnation: bool,
}

impl WorkerActor {
    /// The accelerator is gone for this process: say so once; the service's main loop then
    /// gives back what it holds and exits, so the supervisor starts a fresh worker.
    fn device_lost(&mut self, why: &str) {
        if let Some(tx) = self.device_lost.take() {
            metrics::DEVICE_LOST.inc();
            tracing::error!(error = %why, "the accelerator is lost: this worker stops so a fresh one can start");
            let _ = tx.send(why.to_string());
        }
    }
}

/// A started worker: its actor, and what resolves if its accelerator is lost.
pub struct RunningWorker {
    pub actor: Addr<WorkerActor>,
    /// Resolves with the reason once a step fails with [`pdmesh_model_api::ExecutorError::DeviceLost`]; the
    /// caller should then [`shutdown`] the worker and exit with an error.
    pub device_lost: tokio::sync::oneshot::Receiver<String>,
}

impl Actor for WorkerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if let Some(period) = self.pd.as_ref().and_then(|pd| pd.agent_sweep_period()) {
            ctx.run_interval(period, |act, _| {
                if let Some(pd) = &act.pd {
                    pd.evict_idle_agents();
                }
            });
        }
    }
}

impl Handler<RouterEvent> for WorkerActor {
    type Result = ();
    fn handle(&mut self, ev: RouterEvent, ctx: &mut Context<Self>) {
        let RouterEvent::Message { peer, envelope } = ev else { return };
        let Some(router) = self.router.clone() else { return };
        match &envelope.body {
            Message::WorkerInfoQuery => {
                // ready for the engine once every TP peer is (each binds once it has loaded)
                let answer = if self.tp.as_ref().is_none_or(tp::TpLinks::all_up) {
                    Message::WorkerInfo(self.info.clone())
                } else {
                    Message::Error(WireError::new(ErrorClass::Unavailable, "tensor-parallel peers are still loading"))
                };
                let _ = router.send(&peer, envelope.reply(answer));
            }
            Message::Ping => {
                let _ = router.send(&peer, envelope.reply(Message::Pong));
            }
            Message::ConnectorMetadata(meta) => {
                if let Some(pd) = &self.pd {
                    pd.start_step(meta, &envelope.traces);
                }
                let _ = router.send(&peer, envelope.reply(Message::Ack));
            }
            Message::ExecuteStep(step) => {
                match self.checks_incarnation.then(|| refuse_stale_step(step, &self.info.incarnation)).flatten() {
                    Some(refusal) => {
                        tracing::warn!(step_id = step.step_id, error = %refusal.message, "refused a step built for another worker");
                        metrics::STALE_STEPS.inc();
                        let _ = router.send(&peer, envelope.reply(Message::Error(refusal)));
                    }
                    None => self.execute_step(peer, envelope, router, ctx),
                }
            }
            Message::Hello(h) => self.peer_connected(h),
            other => tracing::warn!(kind = other.kind(), "unexpected message"),
        }
    }
}

/// Why this worker must not run `step`: it was built for another incarnation of the worker
/// (the one before a restart), whose KV is gone; run here, its block tables would point at
/// blocks this process never wrote, and its holds and receives at state it never had. Nothing
/// of the step is applied; the engine fails its requests, and frees everything the old
/// process held once its `WorkerInfo` shows the new incarnation. `None`: run it.
pub fn refuse_stale_step(step: &SchedulerOutput, incarnation: &str) -> Option<WireError> {
    let named = step.worker_incarnation.as_deref()?;
    (named != incarnation).then(|| {
        WireError::new(
            ErrorClass::Unavailable,
            format!(
                "connector-worker restarted: step {} was built for incarnation {named}, this is {incarnation}",
                step.step_id
            ),
        )
    })
}

/// What the executor thread answered for one step: the offload child's connector output, and
/// the step's outcome (`Err`: the thread did not answer).
type Executed = (KvConnectorOutput, Result<Result<ModelRunnerOutput, ExecutorError>, String>);

impl WorkerActor {
    /// Run the step `envelope` carries on the executor thread (its offload copies first) and
    /// answer `peer` with its result and connector output, failed or not.
    fn execute_step(&mut self, peer: PeerId, envelope: Envelope, router: RouterHandle, ctx: &mut Context<Self>) {
        let Message::ExecuteStep(step) = &envelope.body else { return };
        let spans = step_spans(step, &envelope.traces);
        let pd_out = match &self.pd {
            Some(pd) => {
                pd.start_step(&step.kv_connector_metadata, &envelope.traces);
                pd.finish_step()
            }
            None => Default::default(),
        };
        self.merge.expect(&step.kv_connector_metadata.extra_async_saves);
        // TP peers get the step as it arrives; their forward passes meet rank 0's in gathers
        let peers = self.tp.as_ref().map(|t| tp::send_to_peers(&t.links, &envelope, t.peers.step_timeout));
        let executed = self.send_to_executor(step);
        let step_id = step.step_id;
        let both = async move {
            let (executed, peers) = match peers {
                Some(p) => {
                    let (e, p) = futures::future::join(executed, p).await;
                    (e, Some(p))
                }
                None => (executed.await, None),
            };
            (executed, peers)
        };
        ctx.spawn(both.into_actor(self).map(move |((offload_out, res), peers), act, _| {
            let mut out = act.step_output(step_id, res);
            if let Some(peers) = peers {
                out = act.judge_tp_step(out, peers);
            }
            // Failed or not, the step carries its connector output (ModelRunnerOutput::failure).
            out.kv_connector_output = act.merge.merge([pd_out, offload_out]);
            let _ = router.send(&peer, envelope.reply(Message::StepResult(out)));
            drop(spans);
        }));
    }

    /// Queue the step's offload copies (when it has any) and the step itself on the executor
    /// thread; resolves with both answers.
    fn send_to_executor(&self, step: &SchedulerOutput) -> impl std::future::Future<Output = Executed> + 'static {
        // Queued before the step, so the executor thread copies before the forward pass.
        let offload_meta = &step.kv_connector_metadata.offload;
        let offload_fut =
            (!offload_meta.is_empty()).then(|| self.executor.send(executor_actor::ApplyOffload(offload_meta.clone())));
        let (reply, answer) = tokio::sync::oneshot::channel();
        let step_req = self.executor.send(RunStep { step: step.clone(), reply });
        async move {
            let offload_out = match offload_fut {
                Some(f) => f.await.unwrap_or_else(|e| {
                    tracing::error!(error = %e, "executor thread gone before the offload copies");
                    Default::default()
                }),
                None => Default::default(),
            };
            // The answer comes before the executor's handler returns (it may go on with
            // the next decode step, D67); the request is driven too, so that a message
            // the mailbox could not take at once is still delivered.
            tokio::pin!(step_req, answer);
            let res = tokio::select! {
                biased;
                r = &mut answer => r.map_err(|e| e.to_string()),
                r = &mut step_req => match r {
                    Ok(()) => answer.await.map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                },
            };
            (offload_out, res)
        }
    }

    /// The step's output, or one carrying its failure; a lost accelerator also stops the
    /// worker ([`WorkerActor::device_lost`]).
    fn step_output(
        &mut self,
        step_id: u64,
        res: Result<Result<ModelRunnerOutput, ExecutorError>, String>,
    ) -> ModelRunnerOutput {
        let result = match res {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) if e.is_device_lost() => {
                self.device_lost(&e.to_string());
                Err(WireError::new(ErrorClass::Unavailable, e.to_string()))
            }
            Ok(Err(e)) => Err(WireError::new(ErrorClass::Internal, e.to_string())),
            Err(e) => Err(WireError::new(ErrorClass::Unavailable, format!("executor thread: {e}"))),
        };
        result.unwrap_or_else(|error| ModelRunnerOutput { step_id, failure: Some(error), ..Default::default() })
    }

    /// The step as the TP group computed it: rank 0's output when every rank agrees, else a
    /// failure that takes the group down (module [`tp`]).
    fn judge_tp_step(
        &mut self,
        own: ModelRunnerOutput,
        peers: Vec<Result<Envelope, pdmesh_transport::TransportError>>,
    ) -> ModelRunnerOutput {
        let (out, broken) = tp::judge(own, peers);
        if let Some(why) = broken {
            self.tp_group_lost(&why);
        }
        out
    }

    /// The TP group is out of step: poison its gathers and restart it through the
    /// lost-accelerator path.
    fn tp_group_lost(&mut self, why: &str) {
        if let Some(t) = &self.tp {
            (t.peers.poison)();
        }
        metrics::TP_GROUP_FAILURES.inc();
        self.device_lost(&format!("tensor-parallel group: {why}"));
    }

    /// A peer said hello: another engine-core process than before means the old one's KV
    /// state is gone.
    fn peer_connected(&mut self, h: &Hello) {
        tracing::info!(service = ?h.service, rank = h.rank, pid = h.pid, "peer connected");
        if h.service == ServiceKind::EngineCore {
            let restarted = self.engine_pid.is_some_and(|old| old != h.pid);
            self.engine_pid = Some(h.pid);
            if let (true, Some(pd)) = (restarted, &self.pd) {
                pd.engine_restarted();
            }
            if restarted {
                self.merge.clear();
            }
        }
    }
}

impl Handler<LinkEvent> for WorkerActor {
    type Result = ();
    fn handle(&mut self, ev: LinkEvent, _: &mut Context<Self>) {
        let (endpoint, up) = match &ev {
            LinkEvent::Up { endpoint } => (endpoint, true),
            LinkEvent::Down { endpoint } => (endpoint, false),
            LinkEvent::Message { .. } => return,
        };
        let Some(t) = self.tp.as_mut() else { return };
        if up {
            tracing::info!(%endpoint, "tensor-parallel peer connected");
        }
        if let Some(rank) = t.on_link(endpoint, up) {
            self.tp_group_lost(&format!("TP rank {rank}'s worker is gone"));
        }
    }
}

/// One span per scheduled request of `step`, in its own trace; they end with the step.
fn step_spans(step: &SchedulerOutput, traces: &BTreeMap<String, TraceContext>) -> Vec<tracing::Span> {
    step.chunks
        .iter()
        .filter_map(|c| {
            let trace = traces.get(&c.request_id)?;
            let phase = if c.sample && c.token_ids.len() == 1 && c.start_pos > 0 { "decode" } else { "prefill" };
            Some(pdmesh_telemetry::trace::child_of(
                tracing::info_span!("worker.execute", otel.kind = "server",
                    otel.name = %format_args!("worker.{phase}"), request_id = %c.request_id,
                    step_id = step.step_id, phase, tokens = c.token_ids.len(), start_pos = c.start_pos,
                    blocks = c.block_ids.len(), batch = step.chunks.len()),
                trace,
            ))
        })
        .collect()
}

/// Graceful shutdown of the P/D part (R4): D gives back every reference to P's blocks it still
/// holds. Answers how many P acknowledged.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct GiveUpAll {
    pub budget: std::time::Duration,
}

impl Handler<GiveUpAll> for WorkerActor {
    type Result = ResponseFuture<usize>;
    fn handle(&mut self, m: GiveUpAll, _: &mut Context<Self>) -> Self::Result {
        let pd = self.pd.clone();
        Box::pin(async move {
            match pd {
                Some(pd) => pd.shutdown(m.budget).await,
                None => 0,
            }
        })
    }
}

/// Time a stopping worker gives its give-ups to reach P before it exits anyway (at most the
/// shutdown deadline: the give-ups are one step of the stop the deadline bounds).
pub const SHUTDOWN_GIVE_UP_BUDGET: std::time::Duration = std::time::Duration::from_secs(3);

/// Called when the worker stops (its shutdown began, or its accelerator is lost), while its
/// sockets still work: a D worker tells P to free every block it still references (requests
/// queued or waiting for their KV, READs in flight), rather than leave them held until P's
/// deadline (rule R4). `budget`: how long the give-ups may take.
pub async fn shutdown(worker: &Addr<WorkerActor>, budget: std::time::Duration) {
    match worker.send(GiveUpAll { budget }).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(given_up = n, "P's blocks handed back before exit"),
        Err(e) => tracing::warn!(error = %e, "worker gone before its references were given back"),
    }
}

/// Shared-memory files this process created, removed by [`cleanup_shm`] at shutdown.
static SHM_FILES: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Remove this process's shared-memory KV files (called on graceful shutdown; the executor
/// thread may still hold its mapping, which stays valid until the process exits).
pub fn cleanup_shm() {
    let files = std::mem::take(&mut *SHM_FILES.lock().unwrap_or_else(|p| p.into_inner()));
    for f in files {
        let _ = std::fs::remove_file(&f);
    }
}

/// Remove `pdmesh-*-<pid>` KV files left by processes that no longer exist (a worker killed
/// with SIGKILL cannot clean up after itself).
pub(crate) fn sweep_stale_shm() {
    let Ok(dir) = std::fs::read_dir(pdmesh_kv_transfer::region::default_shm_dir()) else { return };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("pdmesh-") else { continue };
        let Some(pid) = rest.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(file = %name, "removing a KV region left by a dead process");
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Where a worker's KV cache lives.
#[derive(Debug, Clone)]
pub enum KvPlacement {
    /// Host memory: a heap cache, or for P/D a shared-memory region the transfer agent serves.
    Host,
    /// The GPU executor's exported region (`kv_transfer.backend = "cuda"`, from
    /// `CudaLlamaExecutor::use_exported_kv`): the executor attends over it, P's agent exports
    /// it, D's reads land in it. The host cache handed to the executor is then never touched.
    #[cfg(feature = "cuda")]
    Device(std::sync::Arc<pdmesh_kv_transfer::cuda::DeviceKvRegion>),
}

/// The KV cache geometry of a worker of `node` running a model with `facts`.
pub fn kv_spec(node: &pdmesh_config::NodeConfig, facts: &ModelFacts) -> pdmesh_model_api::KvCacheSpec {
    kv_spec_of(node, facts.num_layers, facts.num_kv_heads, facts.head_dim)
}

/// [`kv_spec`] from the model's geometry alone (before the model is loaded).
pub fn kv_spec_of(
    node: &pdmesh_config::NodeConfig,
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
) -> pdmesh_model_api::KvCacheSpec {
    pdmesh_model_api::KvCacheSpec {
        num_layers,
        num_blocks: node.engine.num_blocks,
        block_size: node.engine.block_size,
        num_kv_heads,
        head_dim,
    }
}

/// The host cache of a worker without P/D (a GPU-resident cache exists for the `cuda`
/// transfer backend only).
fn place_host_only(placement: &KvPlacement, spec: KvCacheSpec) -> Result<KvCache, WorkerError> {
    match placement {
        KvPlacement::Host => Ok(KvCache::new_heap(spec)),
        #[cfg(feature = "cuda")]
        KvPlacement::Device(_) => Err(WorkerError::Placement(
            "a GPU-resident KV cache is for kv_transfer.backend = \"cuda\"; this node has no kv_transfer".into(),
        )),
    }
}

/// The host cache and the P/D memory of a tensor-parallel rank: the region its TP rank 0
/// created, which its peers share (D111).
fn shared_pd_memory(
    region: pdmesh_kv_transfer::ShmRegion,
    spec: KvCacheSpec,
) -> Result<(KvCache, pd::PdMemory), WorkerError> {
    let path = region.path().to_path_buf();
    SHM_FILES.lock().unwrap_or_else(|p| p.into_inner()).push(path.clone());
    let kv = region.into_kv_cache(spec).map_err(|e| WorkerError::Model(e.to_string()))?;
    Ok((kv, pd::PdMemory::Host(path)))
}

/// The host cache and the P/D memory of a worker with `kv_transfer.backend = backend`.
fn pd_memory(
    placement: &KvPlacement,
    backend: TransferBackendKind,
    node: &pdmesh_config::NodeConfig,
    rank: u32,
    spec: KvCacheSpec,
) -> Result<(KvCache, pd::PdMemory), WorkerError> {
    match (placement, backend) {
        (KvPlacement::Host, TransferBackendKind::Cuda) => Err(WorkerError::Placement(
            "kv_transfer.backend = \"cuda\" needs the KV cache on the GPU: model.device = \"cuda\" and a \
             build with --features cuda (docs/KV_TRANSFER.md)"
                .into(),
        )),
        (KvPlacement::Host, _) => {
            // P/D: the cache lives in shared memory so the transfer agent can serve it.
            sweep_stale_shm();
            let name = format!("pdmesh-{}-{}-{}", node.name, rank, std::process::id());
            let region = pdmesh_kv_transfer::ShmRegion::create_for_spec(&name, &spec)
                .map_err(|e| WorkerError::Model(e.to_string()))?;
            let path = region.path().to_path_buf();
            SHM_FILES.lock().unwrap_or_else(|p| p.into_inner()).push(path.clone());
            let kv = region.into_kv_cache(spec).map_err(|e| WorkerError::Model(e.to_string()))?;
            Ok((kv, pd::PdMemory::Host(path)))
        }
        #[cfg(feature = "cuda")]
        (KvPlacement::Device(region), TransferBackendKind::Cuda) => {
            if *region.spec() != spec {
                return Err(WorkerError::Placement(format!(
                    "the GPU KV region is {:?}, the node's cache is {spec:?}",
                    region.spec()
                )));
            }
            // The executor attends over the GPU region; its host cache is only the step's
            // geometry and is never written, so its pages are never touched either.
            Ok((KvCache::new_untouched(spec), pd::PdMemory::Device(region.clone())))
        }
        #[cfg(feature = "cuda")]
        (KvPlacement::Device(_), _) => Err(WorkerError::Placement(
            "a GPU-resident KV cache is served by kv_transfer.backend = \"cuda\" only".into(),
        )),
    }
}

/// Run the connector-worker of `ctx`'s rank inside the current actix System until `shutdown`
/// begins or its accelerator is lost, then stop: readiness goes 503, P's blocks are given back
/// (R4, within [`SHUTDOWN_GIVE_UP_BUDGET`] or the shutdown deadline if shorter), the
/// shared-memory KV files are removed and the ops server stops. A lost accelerator ends in
/// [`WorkerError::DeviceLost`], so that the process exits with an error and its supervisor
/// starts a fresh one. `factory`, `facts` and `placement`: see [`start`].
pub async fn run(
    mut ctx: ServiceContext,
    factory: ExecutorFactory,
    facts: ModelFacts,
    placement: KvPlacement,
    mut tp_peers: Option<tp::TpPeers>,
    shutdown: Shutdown,
) -> Result<(), WorkerError> {
    let peer_exit = tp_peers.as_mut().and_then(|t| t.exited.take().map(|f| (f, t.poison.clone())));
    let worker = start(&ctx, factory, facts, placement, tp_peers).await?;
    let device_lost = async {
        match worker.device_lost.await {
            Ok(why) => why,
            // the actor is gone without a loss to report: wait for the shutdown
            Err(_) => std::future::pending().await,
        }
    };
    let peer_exited = async {
        match peer_exit {
            Some((exited, poison)) => {
                let why = exited.await;
                // the executor may wait in a gather for the peer that is gone
                poison();
                format!("tensor-parallel group lost: {why}")
            }
            None => std::future::pending().await,
        }
    };
    let lost = tokio::select! {
        () = shutdown.started() => None,
        why = device_lost => Some(why),
        why = peer_exited => Some(why),
    };
    ctx.begin_drain();
    // D gives P's blocks back before it goes, while its sockets still work.
    self::shutdown(&worker.actor, SHUTDOWN_GIVE_UP_BUDGET.min(shutdown.deadline())).await;
    cleanup_shm();
    ctx.stop_ops().await;
    match lost {
        Some(why) => Err(WorkerError::DeviceLost(why)),
        None => {
            tracing::info!(rank = ctx.rank, "connector-worker stopped");
            Ok(())
        }
    }
}

/// Start the connector-worker of `ctx`'s rank, running the executor that `factory` builds (on
/// the executor thread) over a KV cache of the node's configured size, placed as `placement`
/// says.
pub async fn start(
    ctx: &ServiceContext,
    factory: ExecutorFactory,
    facts: ModelFacts,
    placement: KvPlacement,
    tp_peers: Option<tp::TpPeers>,
) -> Result<RunningWorker, WorkerError> {
    let (node, rank, ep) = (&ctx.node, ctx.rank, &ctx.connector_worker);
    let spec = kv_spec(node, &facts);
    let info = worker_info(node, &facts, spec);
    metrics::KV_CACHE_BYTES.set((spec.bytes_per_block() * u64::from(spec.num_blocks)) as i64);
    let mut tp_peers = tp_peers;
    let tp_region = tp_peers.as_mut().and_then(|t| t.region.take());
    let (kv, pd) = match node.kv_transfer.as_ref().filter(|k| k.uses_pd()) {
        None => match tp_region {
            Some(region) => {
                SHM_FILES.lock().unwrap_or_else(|p| p.into_inner()).push(region.path().to_path_buf());
                (region.into_kv_cache(spec).map_err(|e| WorkerError::Model(e.to_string()))?, None)
            }
            None => (place_host_only(&placement, spec)?, None),
        },
        Some(cfg) => {
            let (kv, memory) = match tp_region {
                Some(region) => shared_pd_memory(region, spec)?,
                None => pd_memory(&placement, cfg.backend, node, rank, spec)?,
            };
            let setup = pd_setup(cfg, node, rank, &ctx.topology, &facts)?;
            let rt = pd::PdRuntime::start(setup, spec, memory).await.map_err(WorkerError::Model)?;
            (kv, Some(std::rc::Rc::new(rt)))
        }
    };
    let faults = executor_actor::ExecutorFaults::parse(&node.model.fault_injection)
        .map_err(|e| WorkerError::Setting(format!("model.fault_injection: {e}")))?;
    if !faults.is_empty() {
        tracing::warn!(?faults, "executor fault injection is on");
    }
    let offload = offload_store(node, &placement, spec)?;
    // Overlapping steps (D67) on a P/D node (D68): P's readers only read blocks of finished
    // requests, which no step run ahead writes; D's receives write blocks the step run ahead
    // may write (freed and given out again since it was planned), so they share one book of
    // claimed blocks. An offload copy runs on the executor thread between steps, which the
    // step run ahead would reorder: offloading nodes step in turn.
    let speculate = node.steps_run_ahead();
    if node.engine.async_scheduling && !speculate {
        tracing::info!("engine.async_scheduling is off on this node: it offloads KV or has executor faults");
    }
    let receives = pd.as_ref().and_then(|p| p.receive_view());
    let executor = executor_actor::start(factory, kv, faults, offload, speculate, receives);
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel();
    // The mailbox exists before the actor runs, so the ROUTER is bound with its address and
    // handed to it whole; what arrives meanwhile waits in the mailbox.
    let mailbox = Context::<WorkerActor>::new();
    let router = bind_router(&ep.bind, mailbox.address().recipient()).await?;
    let tp = tp_peers.map(|peers| {
        let links = peers
            .endpoints
            .iter()
            .map(|e| connect_dealer(LinkConfig::new(e).identity(format!("tp0-{rank}")), mailbox.address().recipient()))
            .collect();
        tp::TpLinks::new(peers, links)
    });
    let actor = mailbox.run(WorkerActor {
        executor,
        pd,
        info,
        router: Some(router),
        engine_pid: None,
        device_lost: Some(lost_tx),
        merge: Default::default(),
        tp,
        checks_incarnation: true,
    });
    ctx.health.set_ready(true);
    tracing::info!(endpoint = %ep.bind, rank, kv_bytes = spec.bytes_per_block() * u64::from(spec.num_blocks), "connector-worker ready");
    Ok(RunningWorker { actor, device_lost: lost_rx })
}

/// Run TP peer `tp_rank` of `node`'s rank (D111): its slice of the model over its own KV
/// heads of the rank's shared cache (`kv_region`, created by TP rank 0), serving the steps TP rank 0 hands it on `endpoint`, until `shutdown` or until its
/// group is lost (then [`WorkerError::DeviceLost`], and the process exits with an error; its
/// rank 0 restarts the group).
pub async fn run_tp_peer(
    node: &pdmesh_config::NodeConfig,
    tp_rank: u32,
    endpoint: &str,
    kv_region: &std::path::Path,
    factory: ExecutorFactory,
    facts: ModelFacts,
    shutdown: Shutdown,
) -> Result<(), WorkerError> {
    let spec = kv_spec(node, &facts);
    let info = worker_info(node, &facts, spec);
    // the rank's cache, which TP rank 0 created: this peer writes and reads its own heads
    let kv = pdmesh_kv_transfer::ShmPeerMapping::open_kv_cache(kv_region, spec)
        .map_err(|e| WorkerError::Model(format!("the rank's KV region: {e}")))?;
    let executor = executor_actor::start(factory, kv, ExecutorFaults::default(), None, false, None);
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel();
    let mailbox = Context::<WorkerActor>::new();
    let router = bind_router(endpoint, mailbox.address().recipient()).await?;
    let _actor = mailbox.run(WorkerActor {
        executor,
        pd: None,
        info,
        router: Some(router),
        engine_pid: None,
        device_lost: Some(lost_tx),
        merge: Default::default(),
        tp: None,
        checks_incarnation: false,
    });
    tracing::info!(%endpoint, tp_rank, kv_heads = spec.num_kv_heads, "tensor-parallel peer ready");
    let lost = async {
        match lost_rx.await {
            Ok(why) => why,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        () = shutdown.started() => {
            tracing::info!(tp_rank, "tensor-parallel peer stopped");
            Ok(())
        }
        why = lost => Err(WorkerError::DeviceLost(why)),
    }
}

/// What the worker tells engine-core of itself: the cache's geometry and the model's limits
/// (`max_model_len` capped by the node's setting), under a fresh incarnation.
fn worker_info(node: &pdmesh_config::NodeConfig, facts: &ModelFacts, spec: KvCacheSpec) -> WorkerInfo {
    let max_model_len = if node.engine.max_model_len == 0 {
        facts.max_model_len
    } else {
        node.engine.max_model_len.min(facts.max_model_len)
    };
    WorkerInfo {
        model_name: facts.name.clone(),
        num_blocks: spec.num_blocks,
        block_size: spec.block_size,
        num_layers: spec.num_layers,
        num_kv_heads: spec.num_kv_heads,
        head_dim: spec.head_dim,
        max_model_len,
        vocab_size: facts.vocab_size,
        eos_token_ids: facts.eos_token_ids.clone(),
        bytes_per_block: spec.bytes_per_block(),
        incarnation: format!("{}-{}", std::process::id(), uuid::Uuid::new_v4()),
    }
}

/// How this rank's P/D runtime starts: its engine id, side channel and backend addresses
/// (the node's ports offset by the rank), faults, hold rules and the mesh secret, which P/D
/// cannot go without.
fn pd_setup(
    cfg: &pdmesh_config::KvTransferConfig,
    node: &pdmesh_config::NodeConfig,
    rank: u32,
    topology: &pdmesh_config::Topology,
    facts: &ModelFacts,
) -> Result<pd::PdSetup, WorkerError> {
    let engine_id = if cfg.engine_id.is_empty() { node.name.clone() } else { cfg.engine_id.clone() };
    let side_port = cfg.side_channel_port.saturating_add(rank as u16);
    let at = pdmesh_kv_transfer::ProducerAddress {
        bind_host: node.bind_host.clone(),
        data_port: cfg.data_port.saturating_add(rank as u16),
        advertise_host: cfg.side_channel_host.clone(),
    };
    let backend = pdmesh_kv_transfer::BackendConfig::for_node(cfg.backend, &at);
    // `PDMESH_FAULT` was folded into the config by `Topology::apply_env`.
    let faults = pdmesh_kv_transfer::FaultConfig::parse(&cfg.fault_injection)
        .map_err(|e| WorkerError::Setting(format!("kv_transfer.fault_injection: {e}")))?;
    if !faults.is_empty() {
        tracing::warn!(%faults, "fault injection is on");
    }
    // P serves its side channel and block server only to peers that know the mesh
    // secret, and D presents it: without one, no P/D (docs/SECURITY.md).
    let mesh_secret = pdmesh_mesh_auth::MeshSecret::resolve(topology.mesh_secret_file.as_deref())
        .map_err(|e| WorkerError::Setting(format!("mesh secret: {e}")))?
        .ok_or_else(|| {
            WorkerError::Setting(format!(
                "no mesh secret: set {} (e.g. `openssl rand -hex 32`) or the topology's mesh_secret_file \
                 (pdmesh up generates one per run)",
                pdmesh_mesh_auth::MESH_SECRET_ENV
            ))
        })?;
    Ok(pd::PdSetup {
        mesh_secret,
        engine_id,
        rank,
        produces: cfg.kv_role.produces(),
        consumes: cfg.kv_role.consumes(),
        side_channel_bind: format!("tcp://{}:{side_port}", node.bind_host),
        backend,
        weights_id: facts.weights_id.clone(),
        hold: cfg.hold_duration(),
        hold_table: pdmesh_kv_transfer::HoldTableConfig {
            lease_ttl: cfg.read_lease(),
            heartbeat_extension: cfg.heartbeat_extension(),
            early_wait: cfg.early_lease_wait(),
        },
        remote_agent_idle: std::time::Duration::from_secs(cfg.remote_agent_idle_s.max(1)),
        faults,
        give_up_notices: cfg.give_up_notices,
    })
}

/// The host-memory offload store, when the node offloads KV: only a host cache can be
/// offloaded.
fn offload_store(
    node: &pdmesh_config::NodeConfig,
    placement: &KvPlacement,
    spec: KvCacheSpec,
) -> Result<Option<offload::OffloadStore>, WorkerError> {
    let Some(cfg) = node.kv_transfer.as_ref().filter(|k| k.uses_offload()) else { return Ok(None) };
    if !matches!(placement, KvPlacement::Host) {
        return Err(WorkerError::Placement(
            "the OffloadConnector copies a host KV cache; this worker's cache is on the GPU".into(),
        ));
    }
    tracing::info!(
        cpu_blocks = cfg.offload.cpu_blocks,
        max_bytes = u64::from(cfg.offload.cpu_blocks) * spec.bytes_per_block(),
        "host-memory KV offload store (allocated as it fills)"
    );
    Ok(Some(offload::OffloadStore::new(spec, cfg.offload.cpu_blocks)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_config::Topology;

    /// D113: a step built for this process runs; one built for the worker before a restart
    /// is refused as `unavailable`, naming both incarnations; one naming none (a tool driving
    /// the worker without an engine) is not checked.
    #[test]
    fn a_step_built_for_the_previous_worker_process_is_refused() {
        let step = |named: Option<&str>| SchedulerOutput {
            step_id: 4,
            chunks: Vec::new(),
            finished_request_ids: Vec::new(),
            kv_connector_metadata: Default::default(),
            worker_incarnation: named.map(str::to_string),
        };
        assert_eq!(refuse_stale_step(&step(Some("12-b")), "12-b"), None);
        assert_eq!(refuse_stale_step(&step(None), "12-b"), None);
        let refusal = refuse_stale_step(&step(Some("11-a")), "12-b").map(|e| (e.class, e.message));
        let Some((class, message)) = refusal else { panic!("a stale step must be refused") };
        assert_eq!(class, ErrorClass::Unavailable);
        assert!(message.contains("11-a") && message.contains("12-b"), "{message}");
    }

    /// A node set up for the `cuda` backend whose model did not place its cache on the GPU (a
    /// build without the feature, say) refuses to start, saying what is missing; it never
    /// serves host memory under a GPU backend's name.
    #[test]
    fn a_cuda_backend_without_a_gpu_cache_is_refused_with_the_fix() {
        let topo = Topology::from_toml(
            r#"
            [[nodes]]
            name = "p"
            model = { kind = "gguf", device = "cuda" }
            kv_transfer = { kv_role = "kv_producer", backend = "cuda" }
            "#,
        )
        .unwrap();
        let node = topo.node("p").unwrap();
        let spec = KvCacheSpec { num_layers: 2, num_blocks: 4, block_size: 4, num_kv_heads: 1, head_dim: 4 };
        match pd_memory(&KvPlacement::Host, TransferBackendKind::Cuda, node, 0, spec) {
            Err(WorkerError::Placement(why)) => assert!(why.contains("--features cuda"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
