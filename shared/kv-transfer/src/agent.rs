//! P's transfer agent: the side channel (ZeroMQ ROUTER) that answers handshakes, lease
//! requests and notices, and, for the `tcp` backend, the block server.
//!
//! The agent owns no lifecycle state: every lease decision and notice goes to the
//! [`LeasePolicy`](crate::LeasePolicy) the connector-worker passes in (normally its
//! [`HoldTable`](crate::HoldTable)), so the worker's step loop and the agent see one truth.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pdmesh_mesh_auth::{Channel, LogLimiter, MeshSecret, ServerChallenge};
use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::{
    AgentMetadata, Envelope, ErrorClass, LeaseRefusalReason, Message, TransferBackend, WireError, XferLeaseGranted,
    XferLeaseRefused, KV_DTYPE_F32, KV_LAYOUT, TRANSFER_VERSION,
};
use tokio::task::JoinHandle;
use zeromq::{RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::error::AgentError;
use crate::fault::FaultConfig;
use crate::hold::{CapabilityCheck, LeaseDecision, LeaseGrant, LeasePolicy, LeaseRefusal, NoticeOutcome, SharedPolicy};
use crate::layout::region_bytes;
use crate::shm::{ShmReadOnly, ShmRegion};
use crate::tcp;

/// Which data plane P offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendConfig {
    /// Consumers on this host map the region file themselves.
    Shm,
    /// P serves block reads on `bind` (`host:port`, port 0 picks one); consumers connect to
    /// `advertise_host` (default: the bound IP, which must then not be unspecified).
    Tcp { bind: String, advertise_host: Option<String> },
    /// P's cache is a GPU region exported over CUDA IPC ([`TransferAgent::start_device`]);
    /// consumers on this host open it and copy device-to-device themselves.
    Cuda,
}

/// What P's agent serves: its host region (shm, tcp) or its exported GPU region (cuda).
enum ServedMemory<'a> {
    Region(&'a Path),
    Device { ipc_handle: String },
}

/// This host's kernel boot id (empty if unknown): names the host for CUDA IPC, which works only
/// between processes of one host. Containers on one host share it.
pub fn host_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// How to start P's agent.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// This engine's id (D checks it against `remote_engine_id`).
    pub engine_id: String,
    /// Data-parallel rank of this engine.
    pub rank: u32,
    /// Side channel endpoint to bind: `tcp://host:port` (port 0 picks one) or `ipc://path`.
    pub side_channel: String,
    pub backend: BackendConfig,
    /// [`crate::compat_hash`] of this engine's model and cache.
    pub compat_hash: String,
    pub faults: FaultConfig,
    /// The mesh secret every side channel and block server connection must prove it knows
    /// before anything is served (docs/SECURITY.md).
    pub mesh_secret: MeshSecret,
}

/// Counters of what the agent served (for metrics and tests).
#[derive(Debug, Default)]
pub struct AgentStats {
    pub metadata_requests: AtomicU64,
    pub leases_granted: AtomicU64,
    pub leases_refused: AtomicU64,
    pub read_done: AtomicU64,
    pub read_done_rejected: AtomicU64,
    pub heartbeats: AtomicU64,
    pub give_ups: AtomicU64,
    pub decode_errors: AtomicU64,
    pub unexpected_messages: AtomicU64,
    pub tcp_reads: AtomicU64,
    pub tcp_reads_refused: AtomicU64,
    pub tcp_bytes_sent: AtomicU64,
    pub tcp_errors: AtomicU64,
    /// Side channel messages refused because their peer had not authenticated (or failed to).
    pub unauthenticated: AtomicU64,
    /// Block server connections refused for want of authentication.
    pub tcp_unauthenticated: AtomicU64,
    /// Leases, reads and notices that carried a wrong capability token for a held request.
    pub capability_refused: AtomicU64,
    /// Rejection → release latencies (µs) of give-ups for rejections before admission (R1),
    /// drained by the worker into its histogram.
    pub rejection_to_release_us: std::sync::Mutex<Vec<u64>>,
}

impl AgentStats {
    /// Take the rejection → release latencies recorded since the last call.
    pub fn take_rejection_latencies(&self) -> Vec<u64> {
        std::mem::take(&mut *self.rejection_to_release_us.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl AgentStats {
    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the side channel and the block server share.
pub(crate) struct Served {
    pub metadata: AgentMetadata,
    pub policy: SharedPolicy,
    pub faults: FaultConfig,
    pub stats: Arc<AgentStats>,
    pub secret: MeshSecret,
}

impl Served {
    /// The policy, even if a panic elsewhere poisoned the lock (its state is still the best
    /// truth we have; refusing every lease forever would strand every block).
    pub fn policy(&self) -> MutexGuard<'_, dyn LeasePolicy + 'static> {
        self.policy.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A running producer agent. Dropping it stops the side channel and the block server.
#[derive(Debug)]
pub struct TransferAgent {
    metadata: AgentMetadata,
    side_channel: String,
    stats: Arc<AgentStats>,
    tasks: Vec<JoinHandle<()>>,
}

impl TransferAgent {
    /// Bind the side channel (and the block server for `tcp`) for the KV cache region at
    /// `region_path` with geometry `spec`. Must run inside a tokio runtime (an actix System
    /// is one); the agent's tasks are spawned on it.
    pub async fn start(
        config: AgentConfig,
        region_path: &Path,
        spec: KvCacheSpec,
        policy: SharedPolicy,
    ) -> Result<Self, AgentError> {
        Self::serve(config, ServedMemory::Region(region_path), spec, policy).await
    }

    /// Bind the side channel for a KV cache in GPU memory, exported as `ipc_handle` (128 hex
    /// digits: `pdmesh_cuda_kv::DeviceKvRegion::export`), with geometry `spec`; the backend
    /// must be [`BackendConfig::Cuda`]. The agent itself makes no CUDA call: consumers open the
    /// handle and read without P's help.
    pub async fn start_device(
        config: AgentConfig,
        ipc_handle: String,
        spec: KvCacheSpec,
        policy: SharedPolicy,
    ) -> Result<Self, AgentError> {
        Self::serve(config, ServedMemory::Device { ipc_handle }, spec, policy).await
    }

    async fn serve(
        config: AgentConfig,
        memory: ServedMemory<'_>,
        spec: KvCacheSpec,
        policy: SharedPolicy,
    ) -> Result<Self, AgentError> {
        if config.engine_id.is_empty() {
            return Err(AgentError::Config("engine_id is empty".into()));
        }
        let stats = Arc::new(AgentStats::default());
        let mut block_server = None;
        let backend = match (&config.backend, memory) {
            (BackendConfig::Cuda, ServedMemory::Device { ipc_handle }) => {
                if ipc_handle.len() != 128 || !ipc_handle.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(AgentError::Config(format!("not a CUDA IPC handle: {ipc_handle:?}")));
                }
                TransferBackend::Cuda { ipc_handle, host_boot_id: host_boot_id() }
            }
            (BackendConfig::Shm, ServedMemory::Region(path)) => {
                open_served_region(path, &spec)?;
                TransferBackend::Shm { path: absolute(path).display().to_string() }
            }
            (BackendConfig::Tcp { bind, advertise_host }, ServedMemory::Region(path)) => {
                let region = open_served_region(path, &spec)?;
                let bind_err = |e: std::io::Error| AgentError::Bind { endpoint: bind.clone(), reason: e.to_string() };
                let listener = tokio::net::TcpListener::bind(bind).await.map_err(bind_err)?;
                let local = listener.local_addr().map_err(bind_err)?;
                let host = match advertise_host {
                    Some(h) => h.clone(),
                    None if local.ip().is_unspecified() => {
                        return Err(AgentError::Config(format!("tcp bind {bind} is a wildcard; set advertise_host")))
                    }
                    None => local.ip().to_string(),
                };
                block_server = Some((listener, region));
                TransferBackend::Tcp { host, port: local.port() }
            }
            (BackendConfig::Cuda, ServedMemory::Region(_)) => {
                return Err(AgentError::Config("the cuda backend serves a GPU region (start_device)".into()))
            }
            (BackendConfig::Shm | BackendConfig::Tcp { .. }, ServedMemory::Device { .. }) => {
                return Err(AgentError::Config("a GPU region is served by the cuda backend only".into()))
            }
        };
        let metadata = AgentMetadata {
            engine_id: config.engine_id.clone(),
            agent_name: format!("{}-{}", uuid::Uuid::new_v4(), std::process::id()),
            rank: config.rank,
            backend,
            layout: KV_LAYOUT.to_string(),
            num_layers: spec.num_layers,
            num_blocks: spec.num_blocks,
            block_size: spec.block_size,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            dtype: KV_DTYPE_F32.to_string(),
            bytes_per_block: spec.bytes_per_block(),
            compat_hash: config.compat_hash.clone(),
            protocol_version: TRANSFER_VERSION,
        };
        let served = Arc::new(Served {
            metadata: metadata.clone(),
            policy,
            faults: config.faults.clone(),
            stats: stats.clone(),
            secret: config.mesh_secret.clone(),
        });

        let mut socket = RouterSocket::new();
        // Peer disconnects end their authenticated sessions (a reconnect authenticates again).
        let events = socket.monitor();
        prepare_ipc(&config.side_channel);
        let bound = socket
            .bind(&config.side_channel)
            .await
            .map_err(|e| AgentError::Bind { endpoint: config.side_channel.clone(), reason: e.to_string() })?
            .to_string();
        let mut handles = vec![tokio::spawn(serve_side_channel(socket, events, served.clone()))];
        if let Some((listener, region)) = block_server {
            handles.push(tokio::spawn(tcp::serve_blocks(listener, Arc::new(region), spec, served.clone())));
        }
        tracing::info!(engine_id = %metadata.engine_id, side_channel = %bound, backend = ?metadata.backend, "transfer agent up");
        Ok(Self { metadata, side_channel: bound, stats, tasks: handles })
    }

    /// The metadata this agent advertises (before any fault injection changes it on the wire).
    pub fn metadata(&self) -> &AgentMetadata {
        &self.metadata
    }

    /// The bound side channel endpoint (with the real port when 0 was asked).
    pub fn side_channel_endpoint(&self) -> &str {
        &self.side_channel
    }

    pub fn stats(&self) -> &AgentStats {
        &self.stats
    }
}

impl Drop for TransferAgent {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// P's own host region, checked to hold the whole cache.
fn open_served_region(path: &Path, spec: &KvCacheSpec) -> Result<ShmReadOnly, AgentError> {
    let region = ShmRegion::open_readonly(path)?;
    let need = region_bytes(spec);
    if region.len_bytes() < need {
        return Err(AgentError::Config(format!(
            "region {} holds {} bytes, the cache needs {need}",
            path.display(),
            region.len_bytes()
        )));
    }
    Ok(region)
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

fn prepare_ipc(endpoint: &str) {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        let path = Path::new(path);
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = std::fs::remove_file(path);
    }
}

/// Where each side channel peer stands in the mesh handshake, by the routing id the ROUTER
/// assigned to its connection.
///
/// D's DEALER sets no identity, so the ROUTER names each connection with 128 random bits that
/// never leave P: another peer cannot name (and so cannot ride) an authenticated session. A
/// session ends when its connection does; a reconnect authenticates again.
#[derive(Default)]
pub(crate) struct Sessions {
    peers: std::collections::HashMap<Vec<u8>, PeerAuth>,
    /// Lease requests the policy parked until their hold registers (D65), by ticket: the
    /// asking peer and its request, to answer later. As many as the policy parks (bounded
    /// there), each removed when the policy answers it.
    parked: std::collections::HashMap<u64, (Vec<u8>, Envelope)>,
}

enum PeerAuth {
    /// Sent our challenge; waiting for the peer's proof.
    Challenged {
        challenge: ServerChallenge,
        since: Instant,
    },
    Authenticated,
}

/// Peers in the handshake or authenticated at once; beyond it, challenges older than
/// [`CHALLENGE_TTL`] are dropped, and if that is not enough new hellos are refused, so a flood
/// of half-open handshakes cannot grow P's memory.
const MAX_SESSIONS: usize = 8192;
const CHALLENGE_TTL: Duration = Duration::from_secs(10);

/// One refused-peer log line per second per channel at most.
static SIDE_CHANNEL_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));

impl Sessions {
    fn is_authenticated(&self, peer: &[u8]) -> bool {
        matches!(self.peers.get(peer), Some(PeerAuth::Authenticated))
    }

    fn make_room(&mut self, now: Instant) -> bool {
        if self.peers.len() >= MAX_SESSIONS {
            self.peers.retain(|_, p| match p {
                PeerAuth::Challenged { since, .. } => now.duration_since(*since) < CHALLENGE_TTL,
                PeerAuth::Authenticated => true,
            });
        }
        self.peers.len() < MAX_SESSIONS
    }
}

/// Count and (rate-limited) log a refused side channel message.
fn refuse_unauthenticated(served: &Served, why: &dyn std::fmt::Display) {
    AgentStats::inc(&served.stats.unauthenticated);
    pdmesh_mesh_auth::metrics::unauthenticated(Channel::SideChannel);
    if let Some(suppressed) = SIDE_CHANNEL_LOG.allow() {
        tracing::warn!(reason = %why, suppressed, "side channel: refused an unauthenticated peer");
    }
}

/// The handshake step for a peer's `auth_hello` / `auth_proof`, or the refusal of any other
/// message from a peer that has not authenticated. `None`: the peer is authenticated and the
/// message goes to [`answer`].
fn authenticate(served: &Served, sessions: &mut Sessions, peer: &[u8], env: &Envelope) -> Option<Message> {
    let now = Instant::now();
    match &env.body {
        Message::AuthHello(hello) => {
            // A new hello restarts the handshake (and ends an earlier session of this peer).
            sessions.peers.remove(peer);
            if !sessions.make_room(now) {
                refuse_unauthenticated(served, &"too many handshakes in progress");
                return Some(Message::Error(pdmesh_mesh_auth::refusal("busy")));
            }
            match ServerChallenge::answer(&served.secret, Channel::SideChannel, hello) {
                Ok((challenge, reply)) => {
                    sessions.peers.insert(peer.to_vec(), PeerAuth::Challenged { challenge, since: now });
                    Some(Message::AuthChallenge(reply))
                }
                Err(e) => {
                    refuse_unauthenticated(served, &e);
                    Some(Message::Error(pdmesh_mesh_auth::refusal("bad hello")))
                }
            }
        }
        Message::AuthProof(proof) => match sessions.peers.remove(peer) {
            Some(PeerAuth::Challenged { challenge, .. }) => match challenge.verify(&served.secret, proof) {
                Ok(()) => {
                    sessions.peers.insert(peer.to_vec(), PeerAuth::Authenticated);
                    tracing::debug!("side channel: peer authenticated");
                    Some(Message::Ack)
                }
                Err(e) => {
                    refuse_unauthenticated(served, &e);
                    Some(Message::Error(pdmesh_mesh_auth::refusal("wrong mesh secret")))
                }
            },
            _ => {
                refuse_unauthenticated(served, &"auth_proof without a challenge");
                Some(Message::Error(pdmesh_mesh_auth::refusal("no handshake in progress")))
            }
        },
        other if !sessions.is_authenticated(peer) => {
            refuse_unauthenticated(served, &format_args!("{} before the handshake", other.kind()));
            Some(Message::Error(pdmesh_mesh_auth::refusal("authenticate first (auth_hello)")))
        }
        _ => None,
    }
}

/// Resolves when the policy signals that a parked lease's hold registered (never without one).
async fn registered(wakeup: Option<&tokio::sync::Notify>) {
    match wakeup {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

/// Resolves at `deadline` (never without one).
async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

/// Send the answers the policy has now for parked lease requests (D65).
async fn answer_parked(served: &Served, sessions: &mut Sessions, socket: &mut RouterSocket) {
    for (peer, bytes) in parked_answers(served, sessions, Instant::now()) {
        send_to(socket, peer, bytes).await;
    }
}

/// The encoded answers the policy has at `now` for parked lease requests, each with the peer
/// it goes to. The socket loop sends them; the fuzz targets check them (`crate::fuzzing`).
pub(crate) fn parked_answers(served: &Served, sessions: &mut Sessions, now: Instant) -> Vec<(Vec<u8>, Vec<u8>)> {
    let answers = served.policy().take_parked_answers(now);
    let mut out = Vec::with_capacity(answers.len());
    for a in answers {
        let Some((peer, env)) = sessions.parked.remove(&a.ticket) else { continue };
        let Message::XferLease(req) = &env.body else { continue };
        if a.capability_refused {
            capability_refused(served, &a.p_request_id, "lease");
        }
        let span = side_channel_span(&env);
        let body = span.in_scope(|| lease_answer(served, req, a.result));
        let Ok(bytes) = env.reply(body).encode() else { continue };
        out.push((peer, bytes));
    }
    out
}

async fn send_to(socket: &mut RouterSocket, peer: Vec<u8>, bytes: Vec<u8>) {
    let mut out = ZmqMessage::from(bytes);
    out.push_front(peer.into());
    match tokio::time::timeout(Duration::from_secs(5), socket.send(out)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "side channel: peer gone before the answer"),
        Err(_) => tracing::warn!("side channel: answer not accepted within 5 s"),
    }
}

/// One task answers every side channel message in arrival order. Each answer takes
/// microseconds (a policy call under its lock), so one task is plenty and keeps the policy's
/// calls serial. Every peer authenticates first ([`authenticate`]); until it has, every other
/// message gets only a refusal. A lease request that arrives before its hold registered is
/// parked by the policy and answered here when the policy signals the registration, or when
/// its wait ends (D65).
async fn serve_side_channel(
    mut socket: RouterSocket,
    mut events: futures::channel::mpsc::Receiver<SocketEvent>,
    served: Arc<Served>,
) {
    let mut sessions = Sessions::default();
    let wakeup = served.policy().parked_wakeup();
    loop {
        let parked_until = if sessions.parked.is_empty() { None } else { served.policy().next_parked_deadline() };
        let msg = tokio::select! {
            biased;
            Some(event) = events.next() => {
                if let SocketEvent::Disconnected(peer) = event {
                    sessions.peers.remove(peer.as_ref());
                }
                continue;
            }
            () = registered(wakeup.as_deref()) => {
                answer_parked(&served, &mut sessions, &mut socket).await;
                continue;
            }
            () = until(parked_until) => {
                answer_parked(&served, &mut sessions, &mut socket).await;
                continue;
            }
            msg = socket.recv() => msg,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "side channel socket closed");
                return;
            }
        };
        let mut frames = msg.into_vec();
        if frames.len() < 2 {
            AgentStats::inc(&served.stats.decode_errors);
            continue;
        }
        let peer = frames.remove(0);
        let Some(frame) = frames.pop() else { continue };
        let Some(bytes) = handle_frame(&served, &mut sessions, &peer, &frame) else { continue };
        send_to(&mut socket, peer.to_vec(), bytes).await;
    }
}

/// The encoded answer to one side-channel frame from `peer`: decode, authenticate (the
/// handshake's steps, or the refusal of a peer that has not authenticated), dispatch, encode.
/// `None` when nothing is to be sent (an undecodable frame, counted and dropped; or a fault
/// that withholds the answer). The socket loop only moves frames around it, so this is also
/// what the fuzz targets drive (`fuzz/`, through `crate::fuzzing`).
pub(crate) fn handle_frame(served: &Served, sessions: &mut Sessions, peer: &[u8], frame: &[u8]) -> Option<Vec<u8>> {
    let env = match Envelope::decode(frame) {
        Ok(env) => env,
        Err(e) => {
            AgentStats::inc(&served.stats.decode_errors);
            tracing::warn!(error = %e, "side channel: dropping undecodable frame");
            return None;
        }
    };
    if let Some(step) = authenticate(served, sessions, peer, &env) {
        return env.reply(step).encode().ok();
    }
    let span = side_channel_span(&env);
    let mut parked = None;
    let reply = span.in_scope(|| answer(served, &env, &mut parked));
    if let Some(ticket) = parked {
        sessions.parked.insert(ticket, (peer.to_vec(), env));
    }
    reply
}

/// A span per side-channel message, child of the reader's span on D, so the handshake, lease
/// and read done of one request join its trace across nodes.
fn side_channel_span(env: &Envelope) -> tracing::Span {
    pdmesh_telemetry::trace::child_of(
        tracing::info_span!("kv.side_channel", otel.kind = "server",
            otel.name = %format_args!("kv.serve.{}", env.body.kind()), message = env.body.kind(),
            request_id = tracing::field::Empty),
        &env.trace,
    )
}

/// The answer to a lease request, now or once it was parked.
fn lease_answer(
    served: &Served,
    req: &pdmesh_protocol::XferLeaseRequest,
    decision: Result<LeaseGrant, LeaseRefusal>,
) -> Message {
    let stats = &served.stats;
    match decision {
        Ok(grant) => {
            AgentStats::inc(&stats.leases_granted);
            tracing::Span::current().record("request_id", req.p_request_id.as_str());
            tracing::info!(lease_id = grant.lease_id, blocks = req.block_ids.len(), consumer = %req.consumer,
                "lease granted");
            Message::XferLeaseGranted(XferLeaseGranted {
                lease_id: grant.lease_id,
                lease_ttl_ms: grant.ttl.as_millis().try_into().unwrap_or(u64::MAX),
                agent_name: served.metadata.agent_name.clone(),
            })
        }
        Err(refusal) => {
            AgentStats::inc(&stats.leases_refused);
            tracing::info!(p_request_id = %req.p_request_id, consumer = %req.consumer, %refusal, "lease refused");
            Message::XferLeaseRefused(XferLeaseRefused { reason: refusal.reason, detail: refusal.detail })
        }
    }
}

/// Count a message that carried the wrong capability token for a held request.
fn capability_refused(served: &Served, p_request_id: &str, what: &str) {
    AgentStats::inc(&served.stats.capability_refused);
    pdmesh_mesh_auth::metrics::CAPABILITY_REFUSED.inc();
    tracing::warn!(p_request_id, what, "refused: wrong capability token for a held request");
}

/// `call` on the policy, under one lock, if `capability` is the token `p_request_id` is held
/// under (or the request is not held: the policy's own unknown-request answer applies).
/// Otherwise the refusal is counted and the answer is `as_unknown()`: what a request P does not
/// hold gets, so that a wrong token tells a prober nothing.
pub(crate) fn if_capable<T>(
    served: &Served,
    p_request_id: &str,
    capability: &str,
    what: &str,
    as_unknown: impl FnOnce() -> T,
    call: impl FnOnce(&mut dyn LeasePolicy) -> T,
) -> T {
    let mut policy = served.policy();
    match policy.capability(p_request_id, capability) {
        CapabilityCheck::Mismatch => {
            drop(policy);
            capability_refused(served, p_request_id, what);
            as_unknown()
        }
        CapabilityCheck::Match | CapabilityCheck::NotHeld => call(&mut *policy),
    }
}

/// The encoded answer to one message, or `None` when nothing is to be sent (now: a lease
/// request the policy parked sets `parked` to its ticket and is answered later).
fn answer(served: &Served, env: &Envelope, parked: &mut Option<u64>) -> Option<Vec<u8>> {
    let now = Instant::now();
    let faults = &served.faults;
    let stats = &served.stats;
    let body = match &env.body {
        Message::XferGetMetadata => {
            AgentStats::inc(&stats.metadata_requests);
            if faults.handshake_timeout {
                tracing::warn!("fault injection: not answering a handshake");
                return None;
            }
            let mut meta = served.metadata.clone();
            if faults.compat_mismatch {
                meta.compat_hash = format!("fault-injected-{}", meta.compat_hash);
            }
            if faults.engine_id_mismatch {
                meta.engine_id = format!("{}-fault-injected", meta.engine_id);
            }
            let reply = env.reply(Message::XferMetadata(meta)).encode().ok()?;
            if faults.undecodable_metadata {
                // A frame cut in half: what a reader of another version or a corrupt link sees.
                return Some(reply[..reply.len() / 2].to_vec());
            }
            return Some(reply);
        }
        Message::XferLease(req) => {
            let decision = if faults.lease_refused {
                LeaseDecision::Refused(LeaseRefusal::new(
                    LeaseRefusalReason::FaultInjected,
                    "fault injection: lease_refused",
                ))
            } else {
                let id = &req.p_request_id;
                let as_unknown = || LeaseDecision::Refused(LeaseRefusal::not_held(id));
                if_capable(served, id, &req.capability, "lease", as_unknown, |policy| {
                    policy.grant_or_park(
                        id,
                        &req.block_ids,
                        &req.block_generations,
                        &req.consumer,
                        &req.capability,
                        now,
                    )
                })
            };
            match decision {
                LeaseDecision::Granted(grant) => lease_answer(served, req, Ok(grant)),
                LeaseDecision::Refused(refusal) => lease_answer(served, req, Err(refusal)),
                LeaseDecision::Parked(ticket) => {
                    // Early: P answered before its worker registered the hold (D65).
                    tracing::debug!(p_request_id = %req.p_request_id, ticket, "lease waits for its hold to register");
                    *parked = Some(ticket);
                    return None;
                }
            }
        }
        Message::XferReadDone(n) => {
            let outcome = if_capable(
                served,
                &n.p_request_id,
                &n.capability,
                "read_done",
                || NoticeOutcome::Unknown,
                |p| p.read_done(&n.p_request_id, n.lease_id, &n.consumer, now),
            );
            tracing::Span::current().record("request_id", n.p_request_id.as_str());
            tracing::info!(lease_id = n.lease_id, consumer = %n.consumer, ?outcome, "read done");
            if outcome == NoticeOutcome::Released {
                AgentStats::inc(&stats.read_done);
                Message::Ack
            } else {
                // The lease did not hold until now: the reader must not trust its bytes.
                AgentStats::inc(&stats.read_done_rejected);
                Message::Error(WireError::new(
                    ErrorClass::NotFound,
                    format!("lease {} of {} is not active ({outcome:?})", n.lease_id, n.p_request_id),
                ))
            }
        }
        Message::XferHeartbeat(h) => {
            AgentStats::inc(&stats.heartbeats);
            let mut policy = served.policy();
            // Only the requests whose token matches are extended; the rest are left alone.
            let ids: Vec<String> = h
                .p_request_ids
                .iter()
                .enumerate()
                .filter(|(i, id)| {
                    let token = h.capabilities.get(*i).map_or("", String::as_str);
                    match policy.capability(id, token) {
                        CapabilityCheck::Mismatch => {
                            capability_refused(served, id, "heartbeat");
                            false
                        }
                        _ => true,
                    }
                })
                .map(|(_, id)| id.clone())
                .collect();
            policy.heartbeat(&ids, now);
            Message::Ack
        }
        Message::XferGiveUp(g) => {
            AgentStats::inc(&stats.give_ups);
            let outcome = if_capable(
                served,
                &g.p_request_id,
                &g.capability,
                "give_up",
                || NoticeOutcome::Unknown,
                |p| p.give_up_with_capability(&g.p_request_id, g.lease_id, &g.consumer, &g.capability, now),
            );
            if let (Some(at), crate::hold::NoticeOutcome::Released) = (g.rejected_at_unix_us, outcome) {
                let us = pdmesh_protocol::micros_since(at);
                pdmesh_telemetry::trace::notice_hop("p.released", &g.p_request_id, Some(at));
                let mut v = stats.rejection_to_release_us.lock().unwrap_or_else(|p| p.into_inner());
                if v.len() < 65_536 {
                    v.push(us);
                }
            }
            tracing::info!(p_request_id = %g.p_request_id, reason = %g.reason, ?outcome, "consumer gave up");
            Message::Ack
        }
        Message::Ping => Message::Pong,
        other => {
            AgentStats::inc(&stats.unexpected_messages);
            tracing::warn!(kind = other.kind(), "side channel: unexpected message");
            Message::Error(WireError::new(ErrorClass::InvalidRequest, format!("unexpected {}", other.kind())))
        }
    };
    env.reply(body).encode().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(dead_code)]
    fn agent_and_start_are_send(agent: &TransferAgent, config: AgentConfig, policy: SharedPolicy) {
        fn send_sync<T: Send + Sync>(_: &T) {}
        fn send<T: Send>(_: T) {}
        send_sync(agent);
        let spec = KvCacheSpec { num_layers: 1, num_blocks: 1, block_size: 1, num_kv_heads: 1, head_dim: 1 };
        send(TransferAgent::start(config, Path::new("/x"), spec, policy));
    }
}
