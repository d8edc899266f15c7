//! P's transfer agent: the side channel (ZeroMQ ROUTER) that answers handshakes, lease
//! requests and notices, and whatever its backend serves of its own (`tcp`: the block server;
//! `crate::backend`).
//!
//! The agent owns no lifecycle state: every lease decision and notice goes to the
//! [`LeasePolicy`](crate::LeasePolicy) the connector-worker passes in (normally its
//! [`HoldTable`](crate::HoldTable)), so the worker's step loop and the agent see one truth.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pdmesh_mesh_auth::{Channel, LogLimiter, MeshSecret, ServerChallenge};
use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::{
    AgentMetadata, Envelope, ErrorClass, LeaseRefusalReason, Message, WireError, XferLeaseGranted, XferLeaseRefused,
    KV_DTYPE_F32, KV_LAYOUT, TRANSFER_VERSION,
};
use tokio::task::JoinHandle;
use zeromq::{RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::backend::{self, BackendConfig, ServedMemory};
use crate::error::AgentError;
use crate::fault::FaultConfig;
use crate::hold::{CapabilityCheck, LeaseDecision, LeaseGrant, LeasePolicy, LeaseRefusal, NoticeOutcome, SharedPolicy};

/// How to start P's agent.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// This engine's id (D checks it against `remote_engine_id`).
    pub engine_id: String,
    /// Data-parallel rank of this engine.
    pub rank: u32,
    /// Side channel endpoint to bind: `tcp://host:port` (port 0 picks one) or `ipc://path`.
    pub side_channel: String,
    /// What P offers and advertises: one of `crate::backend`'s modules.
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
    /// Side channel connections P dropped: over their allowance before the handshake, evicted
    /// for a newcomer, expired, or not reading their answers (D95, D96).
    pub peers_dropped: AtomicU64,
    /// Side channel peers connected and not (yet) authenticated, as of the last change.
    pub pending_peers: AtomicU64,
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

/// A running producer agent. Dropping it stops the side channel and the backend's server.
#[derive(Debug)]
pub struct TransferAgent {
    metadata: AgentMetadata,
    side_channel: String,
    stats: Arc<AgentStats>,
    tasks: Vec<JoinHandle<()>>,
}

impl TransferAgent {
    /// Bind the side channel (and whatever the backend serves of its own: the block server for
    /// `tcp`) for the KV cache region at `region_path` with geometry `spec`. Must run inside a
    /// tokio runtime (an actix System is one); the agent's tasks are spawned on it.
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
        let offer = backend::registered(config.backend.kind()).offer(&config.backend, memory, spec).await?;
        let metadata = AgentMetadata {
            engine_id: config.engine_id.clone(),
            agent_name: format!("{}-{}", uuid::Uuid::new_v4(), std::process::id()),
            rank: config.rank,
            backend: offer.advertised,
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
        // Accepted connections start fresh entries, disconnects end sessions (a reconnect
        // authenticates again).
        let events = socket.monitor();
        prepare_ipc(&config.side_channel);
        let bind_err = |reason: String| AgentError::Bind { endpoint: config.side_channel.clone(), reason };
        let bound = match tcp_side_channel_listener(&config.side_channel) {
            Some(listener) => socket.bind_listener(listener.map_err(|e| bind_err(e.to_string()))?).await,
            None => socket.bind(&config.side_channel).await,
        }
        .map_err(|e| bind_err(e.to_string()))?
        .to_string();
        let mut handles = vec![tokio::spawn(serve_side_channel(socket, events, served.clone()))];
        if let Some(server) = offer.server {
            handles.push(tokio::spawn(server(served.clone())));
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

/// How long a side channel connection may leave P's answers unread (the kernel's
/// `TCP_USER_TIMEOUT`: data unacknowledged, or held back by a zero window) before the kernel
/// aborts it, and the ROUTER drops the peer with everything queued for it (D95).
pub const SIDE_CHANNEL_STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// For a `tcp://host:port` endpoint, a listener whose accepted connections inherit
/// [`SIDE_CHANNEL_STALL_TIMEOUT`]; `None` for another transport. The zeromq crate has no
/// socket options of its own for this (docs/DEPENDENCIES.md), but binds a listener it is given.
fn tcp_side_channel_listener(endpoint: &str) -> Option<std::io::Result<std::net::TcpListener>> {
    let addr = endpoint.strip_prefix("tcp://")?;
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let host = if host == "*" { "0.0.0.0" } else { host };
    let port: u16 = port.parse().ok()?;
    Some((|| {
        let listener = std::net::TcpListener::bind((host, port))?;
        socket2::SockRef::from(&listener).set_tcp_user_timeout(Some(SIDE_CHANNEL_STALL_TIMEOUT))?;
        Ok(listener)
    })())
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
/// session ends when its connection does; a reconnect authenticates again. A peer may choose
/// its own identity, and the ROUTER then hands the connection of a later peer with the same
/// identity the earlier one's routing id: so every accepted connection starts a fresh,
/// unauthenticated entry, ending whatever session its routing id had (D96).
///
/// Pre-handshake state is bounded and short-lived (D96): at most [`MAX_PENDING`] peers that
/// have not authenticated, at most [`MAX_PENDING_PER_SOURCE`] of one source address, each
/// allowed [`MAX_PREAUTH_FRAMES`] frames and [`PREAUTH_TTL`] before it is dropped. A newcomer
/// that finds the table full takes the slot of the oldest pending peer of the source holding
/// the most slots (its own, when it is that source), so strangers flooding from some
/// addresses never keep a peer from another address — or a peer that answers its challenge
/// at once — from authenticating.
#[derive(Default)]
pub(crate) struct Sessions {
    peers: std::collections::HashMap<Vec<u8>, Peer>,
    /// Pending (not authenticated) peers per source address.
    pending_by_source: std::collections::HashMap<String, usize>,
    /// Authenticated peers (bounded by [`MAX_AUTHENTICATED`]).
    authenticated: usize,
    /// Peers to disconnect, drained by the socket loop: over their pre-handshake allowance,
    /// evicted for a newcomer, expired, or refused for a full table of authenticated peers.
    to_drop: Vec<Vec<u8>>,
    /// Lease requests the policy parked until their hold registers (D65), by ticket: the
    /// asking peer and its request, to answer later. As many as the policy parks (bounded
    /// there), each removed when the policy answers it.
    parked: std::collections::HashMap<u64, (Vec<u8>, Envelope)>,
}

struct Peer {
    /// The connection's source address (`unknown` when the ROUTER did not say).
    source: String,
    /// When the connection was first seen: the start of its pre-handshake allowance.
    since: Instant,
    /// Frames received before it authenticated.
    preauth_frames: u32,
    auth: PeerAuth,
}

enum PeerAuth {
    /// Connected, no hello yet (or its hello was refused).
    None,
    /// Sent our challenge; waiting for the peer's proof.
    Challenged(ServerChallenge),
    Authenticated,
}

/// Authenticated peers at once (each proved the secret: mesh members).
const MAX_AUTHENTICATED: usize = 4096;
/// Peers that have not authenticated, at once.
pub(crate) const MAX_PENDING: usize = 1024;
/// Peers of one source address that have not authenticated, at once.
pub(crate) const MAX_PENDING_PER_SOURCE: usize = 64;
/// Frames a peer may send before it authenticated: a hello and a proof need two; the rest is
/// room for a peer that retries. Each is answered with at most a small refusal, so a peer
/// that never reads can make P queue a few KiB at most before it is dropped; one that re-sends
/// hellos to keep its slot is dropped too.
pub(crate) const MAX_PREAUTH_FRAMES: u32 = 16;
/// How long a peer may take to authenticate from its connection (or first frame).
pub(crate) const PREAUTH_TTL: Duration = Duration::from_secs(5);
/// The source of a peer whose connection the ROUTER did not report.
const UNKNOWN_SOURCE: &str = "unknown";

/// One refused-peer log line per second per channel at most.
static SIDE_CHANNEL_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));
/// One undecodable-frame log line per second at most (D99).
static UNDECODABLE_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));

impl Sessions {
    fn is_authenticated(&self, peer: &[u8]) -> bool {
        matches!(self.peers.get(peer), Some(Peer { auth: PeerAuth::Authenticated, .. }))
    }

    /// Peers that have not authenticated.
    pub(crate) fn pending(&self) -> usize {
        self.peers.len() - self.authenticated
    }

    /// Forget `peer` (its connection ended or is being dropped).
    fn forget(&mut self, peer: &[u8]) {
        if let Some(old) = self.peers.remove(peer) {
            if matches!(old.auth, PeerAuth::Authenticated) {
                self.authenticated -= 1;
            } else if let Some(n) = self.pending_by_source.get_mut(&old.source) {
                *n -= 1;
                if *n == 0 {
                    self.pending_by_source.remove(&old.source);
                }
            }
        }
    }

    /// Forget `peer` and have the socket loop disconnect it.
    fn drop_peer(&mut self, peer: &[u8]) {
        self.forget(peer);
        self.to_drop.push(peer.to_vec());
    }

    /// A connection was accepted from `source`: a fresh, unauthenticated entry, whatever its
    /// routing id held before (a peer-chosen identity reused by another connection).
    pub(crate) fn accepted(&mut self, peer: &[u8], source: &str, now: Instant) {
        // A hello can be read before the ROUTER reports its connection: a handshake pending
        // under this routing id is that connection's own, and goes on. Only an authenticated
        // session ends here (a chosen identity reused by another connection).
        if self.peers.get(peer).is_some_and(|p| !matches!(p.auth, PeerAuth::Authenticated)) {
            return;
        }
        self.forget(peer);
        self.admit(peer, source, now);
    }

    /// The connection of `peer` ended.
    pub(crate) fn disconnected(&mut self, peer: &[u8]) {
        self.forget(peer);
    }

    /// Make a pending entry for `peer`, making room as the fair-share rule says.
    fn admit(&mut self, peer: &[u8], source: &str, now: Instant) {
        self.expire(now);
        let own = self.pending_by_source.get(source).copied().unwrap_or(0);
        let victim_source = if own >= MAX_PENDING_PER_SOURCE {
            Some(source.to_string())
        } else if self.pending() >= MAX_PENDING {
            self.pending_by_source.iter().max_by_key(|(_, n)| **n).map(|(s, _)| s.clone())
        } else {
            None
        };
        if let Some(victim_source) = victim_source {
            let oldest = self
                .peers
                .iter()
                .filter(|(_, p)| !matches!(p.auth, PeerAuth::Authenticated) && p.source == victim_source)
                .min_by_key(|(_, p)| p.since)
                .map(|(id, _)| id.clone());
            if let Some(oldest) = oldest {
                self.drop_peer(&oldest);
            }
        }
        self.peers.insert(
            peer.to_vec(),
            Peer { source: source.to_string(), since: now, preauth_frames: 0, auth: PeerAuth::None },
        );
        *self.pending_by_source.entry(source.to_string()).or_insert(0) += 1;
    }

    /// Drop every pending peer whose allowance of time ran out.
    pub(crate) fn expire(&mut self, now: Instant) {
        let expired: Vec<Vec<u8>> = self
            .peers
            .iter()
            .filter(|(_, p)| !matches!(p.auth, PeerAuth::Authenticated) && now.duration_since(p.since) >= PREAUTH_TTL)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            self.drop_peer(&id);
        }
    }

    /// Count a frame of a peer that has not authenticated; `false` when it is over its
    /// allowance (it is then dropped, its frame unanswered).
    fn preauth_frame(&mut self, peer: &[u8], now: Instant) -> bool {
        if !self.peers.contains_key(peer) {
            self.admit(peer, UNKNOWN_SOURCE, now);
        }
        let Some(p) = self.peers.get_mut(peer) else { return false };
        p.preauth_frames += 1;
        if p.preauth_frames > MAX_PREAUTH_FRAMES || now.duration_since(p.since) >= PREAUTH_TTL {
            self.drop_peer(peer);
            return false;
        }
        true
    }

    /// The peers the socket loop is to disconnect now.
    pub(crate) fn take_drops(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.to_drop)
    }
}

/// Whether `peer` is a routing id P's ROUTER made up (16 random bytes shaped as a UUID v4, what
/// the zeromq crate gives a connection that claims no identity), rather than one the peer chose.
/// Only such connections are authenticated (D96): a chosen identity can be claimed again by a
/// stranger's connection, which the ROUTER would then hand the first one's routing id. A
/// chosen identity shaped as a UUID v4 passes, but can meet only another chosen one: the
/// ROUTER's own are 122 random bits that never leave P. Accepted connections reset their
/// routing id's entry as well ([`Sessions::accepted`]).
fn router_named(peer: &[u8]) -> bool {
    peer.len() == 16 && peer[6] >> 4 == 4 && peer[8] & 0xc0 == 0x80
}

/// The reply to a message of a peer that has not authenticated: the handshake's next step or
/// a refusal, carrying nothing the peer sent but the fixed-size correlation number D matches
/// answers by — no request id, no trace (D95): a stranger cannot make P hold or send back
/// bytes of its choosing.
fn preauth_reply(env: &Envelope, body: Message) -> Option<Vec<u8>> {
    Envelope::new(body).with_corr(env.corr).encode().ok()
}

/// The longest request id an answer echoes.
pub(crate) const ECHOED_ID_MAX: usize = 128;

/// The envelope of an answer to an authenticated peer: its correlation number and, when it is
/// at most [`ECHOED_ID_MAX`] bytes, its request id — never its trace context (D95). Every
/// answer is then of a size P decides, so what a peer can make P queue for it is bounded by
/// its frames, not by their size.
fn member_reply(env: &Envelope, body: Message) -> Envelope {
    let mut reply = Envelope::new(body).with_corr(env.corr);
    reply.request_id = env.request_id.clone().filter(|id| id.len() <= ECHOED_ID_MAX);
    reply
}

/// An id a peer sent, as it may appear in an answer's text: at most 128 bytes of it (D95).
fn shown(id: &str) -> &str {
    let mut end = id.len().min(ECHOED_ID_MAX);
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    &id[..end]
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
    if !sessions.peers.contains_key(peer) {
        sessions.admit(peer, UNKNOWN_SOURCE, now);
    }
    match &env.body {
        Message::AuthHello(_) if !router_named(peer) => {
            refuse_unauthenticated(served, &"a peer-chosen ZeroMQ identity");
            Some(Message::Error(pdmesh_mesh_auth::refusal(
                "set no ZeroMQ identity: P names side channel connections itself",
            )))
        }
        Message::AuthHello(hello) => {
            // A new hello restarts the handshake (and ends an earlier session of this peer).
            if sessions.is_authenticated(peer) {
                let source = sessions.peers.get(peer).map_or(UNKNOWN_SOURCE.to_string(), |p| p.source.clone());
                sessions.forget(peer);
                sessions.admit(peer, &source, now);
            }
            match ServerChallenge::answer(&served.secret, Channel::SideChannel, hello) {
                Ok((challenge, reply)) => {
                    if let Some(p) = sessions.peers.get_mut(peer) {
                        p.auth = PeerAuth::Challenged(challenge);
                    }
                    Some(Message::AuthChallenge(reply))
                }
                Err(e) => {
                    refuse_unauthenticated(served, &e);
                    Some(Message::Error(pdmesh_mesh_auth::refusal("bad hello")))
                }
            }
        }
        Message::AuthProof(proof) => {
            if sessions.is_authenticated(peer) {
                // A proof on an established session ends it.
                let source = sessions.peers.get(peer).map_or(UNKNOWN_SOURCE.to_string(), |p| p.source.clone());
                sessions.forget(peer);
                sessions.admit(peer, &source, now);
                refuse_unauthenticated(served, &"auth_proof on an established session");
                return Some(Message::Error(pdmesh_mesh_auth::refusal("no handshake in progress")));
            }
            let challenge = match sessions.peers.get_mut(peer) {
                Some(p) => match std::mem::replace(&mut p.auth, PeerAuth::None) {
                    PeerAuth::Challenged(c) => Some(c),
                    _ => None,
                },
                None => None,
            };
            let Some(challenge) = challenge else {
                refuse_unauthenticated(served, &"auth_proof without a challenge");
                return Some(Message::Error(pdmesh_mesh_auth::refusal("no handshake in progress")));
            };
            match challenge.verify(&served.secret, proof) {
                Ok(()) if sessions.authenticated < MAX_AUTHENTICATED => {
                    let source = sessions.peers.get(peer).map_or(UNKNOWN_SOURCE.to_string(), |p| p.source.clone());
                    sessions.forget(peer);
                    sessions.peers.insert(
                        peer.to_vec(),
                        Peer { source, since: now, preauth_frames: 0, auth: PeerAuth::Authenticated },
                    );
                    sessions.authenticated += 1;
                    tracing::debug!("side channel: peer authenticated");
                    Some(Message::Ack)
                }
                Ok(()) => {
                    refuse_unauthenticated(served, &"too many authenticated peers");
                    sessions.drop_peer(peer);
                    Some(Message::Error(pdmesh_mesh_auth::refusal("busy")))
                }
                Err(e) => {
                    refuse_unauthenticated(served, &e);
                    Some(Message::Error(pdmesh_mesh_auth::refusal("wrong mesh secret")))
                }
            }
        }
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
        if !send_to(socket, peer.clone(), bytes).await {
            tracing::warn!("side channel: a peer stopped reading its answers; dropped");
            sessions.drop_peer(&peer);
        }
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
        let Ok(bytes) = member_reply(&env, body).encode() else { continue };
        out.push((peer, bytes));
    }
    out
}

/// How long the loop waits for a peer's send queue to take an answer. The queue (the zeromq
/// crate's, 100,000 messages, not configurable) is full only when the peer stopped reading:
/// it is then dropped rather than waited on (D95).
const SEND_WAIT: Duration = Duration::from_millis(100);

/// Queue `bytes` for `peer`; `false` when its queue would not take them (the peer is then to
/// be dropped).
async fn send_to(socket: &mut RouterSocket, peer: Vec<u8>, bytes: Vec<u8>) -> bool {
    let mut out = ZmqMessage::from(bytes);
    out.push_front(peer.into());
    match tokio::time::timeout(SEND_WAIT, socket.send(out)).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "side channel: peer gone before the answer");
            true
        }
        Err(_) => false,
    }
}

/// Disconnect `peer` from the ROUTER: its queued answers are discarded and its frames no
/// longer read (the zeromq crate's own removal of a peer, which its ROUTER also runs when a
/// connection fails).
fn disconnect(served: &Served, socket: &RouterSocket, peer: &[u8]) {
    let Ok(id) = zeromq::util::PeerIdentity::try_from(peer) else { return };
    AgentStats::inc(&served.stats.peers_dropped);
    pdmesh_mesh_auth::metrics::SIDE_CHANNEL_PEERS_DROPPED.inc();
    socket.backend().peer_disconnected(&id);
}

/// Disconnect every peer the session table gave up on.
fn apply_drops(served: &Served, sessions: &mut Sessions, socket: &RouterSocket) {
    for peer in sessions.take_drops() {
        disconnect(served, socket, &peer);
    }
    served.stats.pending_peers.store(sessions.pending() as u64, Ordering::Relaxed);
}

/// The source address of an accepted connection (`ipc` peers share one).
fn source_of(endpoint: &zeromq::Endpoint) -> String {
    match endpoint {
        zeromq::Endpoint::Tcp(host, _) => host.to_string(),
        other => other.to_string(),
    }
}

/// One task answers every side channel message in arrival order. Each answer takes
/// microseconds (a policy call under its lock), so one task is plenty and keeps the policy's
/// calls serial. Every peer authenticates first ([`authenticate`]); until it has, every other
/// message gets only a refusal, and its connection a bounded allowance ([`Sessions`]). A lease
/// request that arrives before its hold registered is parked by the policy and answered here
/// when the policy signals the registration, or when its wait ends (D65). A peer whose send
/// queue stopped taking answers is dropped (D95).
async fn serve_side_channel(
    mut socket: RouterSocket,
    mut events: futures::channel::mpsc::Receiver<SocketEvent>,
    served: Arc<Served>,
) {
    let mut sessions = Sessions::default();
    let wakeup = served.policy().parked_wakeup();
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let parked_until = if sessions.parked.is_empty() { None } else { served.policy().next_parked_deadline() };
        let msg = tokio::select! {
            biased;
            Some(event) = events.next() => {
                match event {
                    SocketEvent::Accepted(endpoint, peer) => {
                        sessions.accepted(peer.as_ref(), &source_of(&endpoint), Instant::now());
                    }
                    SocketEvent::Disconnected(peer) => sessions.disconnected(peer.as_ref()),
                    _ => {}
                }
                apply_drops(&served, &mut sessions, &socket);
                continue;
            }
            () = registered(wakeup.as_deref()) => {
                answer_parked(&served, &mut sessions, &mut socket).await;
                apply_drops(&served, &mut sessions, &socket);
                continue;
            }
            () = until(parked_until) => {
                answer_parked(&served, &mut sessions, &mut socket).await;
                apply_drops(&served, &mut sessions, &socket);
                continue;
            }
            _ = sweep.tick() => {
                sessions.expire(Instant::now());
                apply_drops(&served, &mut sessions, &socket);
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
            undecodable(&served, &"a message without a routing id and a frame");
            continue;
        }
        let peer = frames.remove(0);
        let Some(frame) = frames.pop() else { continue };
        let reply = handle_peer_frame(&served, &mut sessions, &peer, &frame);
        if let Some(bytes) = reply {
            if !send_to(&mut socket, peer.to_vec(), bytes).await {
                tracing::warn!("side channel: a peer stopped reading its answers; dropped");
                sessions.disconnected(&peer);
                disconnect(&served, &socket, &peer);
            }
        }
        apply_drops(&served, &mut sessions, &socket);
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
            undecodable(served, &e);
            return None;
        }
    };
    if let Some(step) = authenticate(served, sessions, peer, &env) {
        return preauth_reply(&env, step);
    }
    let span = side_channel_span(&env);
    let mut parked = None;
    let reply = span.in_scope(|| answer(served, &env, &mut parked));
    if let Some(ticket) = parked {
        sessions.parked.insert(ticket, (peer.to_vec(), env));
    }
    reply
}

/// What the socket loop does with one frame from `peer`: a peer that has not authenticated
/// spends one frame of its allowance first, and one over it (or past its time) is dropped
/// unanswered (D96); then [`handle_frame`].
fn handle_peer_frame(served: &Served, sessions: &mut Sessions, peer: &[u8], frame: &[u8]) -> Option<Vec<u8>> {
    if !sessions.is_authenticated(peer) && !sessions.preauth_frame(peer, Instant::now()) {
        refuse_unauthenticated(served, &"over its allowance before the handshake; dropped");
        return None;
    }
    handle_frame(served, sessions, peer, frame)
}

/// Count an undecodable frame (stats and `pdmesh_kv_side_channel_undecodable_frames_total`)
/// and log it at most once a second with the number not logged (D99): a flood of garbage is
/// not a flood of log lines.
fn undecodable(served: &Served, e: &dyn std::fmt::Display) {
    AgentStats::inc(&served.stats.decode_errors);
    pdmesh_mesh_auth::metrics::UNDECODABLE_FRAMES.inc();
    if let Some(suppressed) = UNDECODABLE_LOG.allow() {
        tracing::warn!(error = %e, suppressed, "side channel: dropping undecodable frame");
    }
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
            Message::XferLeaseRefused(XferLeaseRefused {
                reason: refusal.reason,
                detail: shown(&refusal.detail).to_string(),
            })
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
    let stats = &served.stats;
    let body = match &env.body {
        // The handshake answers alone: a fault may cut its encoded frame or withhold it.
        Message::XferGetMetadata => return answer_metadata(served, env),
        Message::XferLease(req) => answer_lease(served, req, now, parked)?,
        Message::XferReadDone(n) => answer_read_done(served, n, now),
        Message::XferHeartbeat(h) => answer_heartbeat(served, h, now),
        Message::XferGiveUp(g) => answer_give_up(served, g, now),
        Message::Ping => Message::Pong,
        other => {
            AgentStats::inc(&stats.unexpected_messages);
            tracing::warn!(kind = other.kind(), "side channel: unexpected message");
            Message::Error(WireError::new(ErrorClass::InvalidRequest, format!("unexpected {}", other.kind())))
        }
    };
    member_reply(env, body).encode().ok()
}

/// The encoded answer to a handshake: this agent's metadata, as the configured faults
/// (withheld, wrong compat hash or engine id, half a frame) would have it.
fn answer_metadata(served: &Served, env: &Envelope) -> Option<Vec<u8>> {
    let faults = &served.faults;
    AgentStats::inc(&served.stats.metadata_requests);
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
    let reply = member_reply(env, Message::XferMetadata(meta)).encode().ok()?;
    if faults.undecodable_metadata {
        // A frame cut in half: what a reader of another version or a corrupt link sees.
        return Some(reply[..reply.len() / 2].to_vec());
    }
    Some(reply)
}

/// The answer to a lease request, or `None` when the policy parked it: `parked` then holds
/// the ticket it is answered under later.
fn answer_lease(
    served: &Served,
    req: &pdmesh_protocol::XferLeaseRequest,
    now: Instant,
    parked: &mut Option<u64>,
) -> Option<Message> {
    let decision = if served.faults.lease_refused {
        LeaseDecision::Refused(LeaseRefusal::new(LeaseRefusalReason::FaultInjected, "fault injection: lease_refused"))
    } else {
        let id = &req.p_request_id;
        let as_unknown = || LeaseDecision::Refused(LeaseRefusal::not_held(id));
        if_capable(served, id, &req.capability, "lease", as_unknown, |policy| {
            policy.grant_or_park(id, &req.block_ids, &req.block_generations, &req.consumer, &req.capability, now)
        })
    };
    match decision {
        LeaseDecision::Granted(grant) => Some(lease_answer(served, req, Ok(grant))),
        LeaseDecision::Refused(refusal) => Some(lease_answer(served, req, Err(refusal))),
        LeaseDecision::Parked(ticket) => {
            // Early: P answered before its worker registered the hold (D65). The
            // answer goes out later, in a second `kv.serve.xfer_lease` span; this event
            // says why this one ends without it.
            tracing::info!(p_request_id = %req.p_request_id, ticket, "lease parked");
            *parked = Some(ticket);
            None
        }
    }
}

/// The answer to a read-done notice: `Ack` when it released an active lease, an error
/// otherwise.
fn answer_read_done(served: &Served, n: &pdmesh_protocol::XferReadDone, now: Instant) -> Message {
    let stats = &served.stats;
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
            format!("lease {} of {} is not active ({outcome:?})", n.lease_id, shown(&n.p_request_id)),
        ))
    }
}

/// Extends the holds a heartbeat names, those whose token matches; always `Ack`.
fn answer_heartbeat(served: &Served, h: &pdmesh_protocol::XferHeartbeat, now: Instant) -> Message {
    AgentStats::inc(&served.stats.heartbeats);
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

/// Releases what a consumer gave up on and records the rejection-to-release time; always
/// `Ack`.
fn answer_give_up(served: &Served, g: &pdmesh_protocol::XferGiveUp, now: Instant) -> Message {
    let stats = &served.stats;
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
