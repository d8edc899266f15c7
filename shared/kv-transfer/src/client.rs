//! D's side: handshake with a producer's side channel, then lease, read, and notify.
//!
//! [`TransferClient::handshake`] connects to P's side channel, fetches and checks its
//! [`AgentMetadata`] and opens the data plane of the backend P advertised (`crate::backend`:
//! maps P's region for `shm`, prepares a connection pool for `tcp`, opens P's GPU region for
//! `cuda`), giving a [`RemoteAgent`]. [`RemoteAgents`] caches one per remote engine and
//! handshakes again after a failure instead of caching it (vLLM deletes its handshake future
//! for the same reason).
//!
//! The read protocol for one request: [`RemoteAgent::lease`] (P checks the blocks are still
//! held with the same generations), [`RemoteAgent::read_blocks_into`] (into blocks checked out
//! of D's own cache region; [`RemoteAgent::read_blocks`] into any [`KvCache`]; one-sided for
//! `shm`, served for `tcp`), then [`RemoteAgent::read_done`], whose answer says whether the
//! lease held until then — only then are the bytes known to be the ones P held.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use pdmesh_mesh_auth::{Channel, ClientHello, MeshSecret};
use pdmesh_model_api::{KvCache, KvCacheSpec};
use pdmesh_protocol::{AgentMetadata, Envelope, Message, XferGiveUp, XferHeartbeat, XferLeaseRequest, XferReadDone};
use tokio::sync::{oneshot, Mutex as AsyncMutex};
use zeromq::{
    DealerRecvHalf, DealerSendHalf, DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend,
    ZmqMessage,
};

use crate::backend::{advertised_kind, registered, BlockRead, DataPlane, OpenContext};
use crate::compat::check_geometry;
use crate::error::{HandshakeError, TransferError};
use crate::fault::FaultConfig;
use crate::layout::{run_bytes, run_offset, wire_runs};
#[cfg(feature = "cuda")]
use crate::local::DeviceCheckout;
use crate::local::LocalBlocks;
use crate::region::{floats_as_bytes_mut, BlockCheckout};
#[cfg(feature = "cuda")]
use pdmesh_cuda_kv::DeviceKvRegion;

/// Default limit for a handshake (vLLM: 5000 ms).
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default limit for a lease or notice round trip.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Default limit for one block read.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections one handshake opens at most when P closes them before it is through (see
/// `SideLink::connect`).
const HANDSHAKE_CONNECTIONS: u32 = 4;

/// How D's side behaves.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Who reads (e.g. `"{engine_id}/{rank}"`); P logs it and binds leases to it.
    pub consumer: String,
    /// D's own cache geometry; a remote agent must match it.
    pub local_spec: KvCacheSpec,
    /// D's own [`crate::compat_hash`].
    pub compat_hash: String,
    pub handshake_timeout: Duration,
    pub call_timeout: Duration,
    pub read_timeout: Duration,
    pub faults: FaultConfig,
    /// The mesh secret: D proves it knows it to every producer, and a producer that cannot
    /// prove the same is never sent a request (docs/SECURITY.md).
    pub mesh_secret: MeshSecret,
    /// D's cache on the GPU (`kv_transfer.backend = "cuda"`): reads land in this region, and
    /// only producers offering `cuda` can be read. `None`: the cache is in host memory.
    #[cfg(feature = "cuda")]
    pub local_device: Option<Arc<DeviceKvRegion>>,
}

impl ClientConfig {
    pub fn new(
        consumer: impl Into<String>,
        local_spec: KvCacheSpec,
        compat_hash: impl Into<String>,
        mesh_secret: MeshSecret,
    ) -> Self {
        Self {
            mesh_secret,
            consumer: consumer.into(),
            local_spec,
            compat_hash: compat_hash.into(),
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            read_timeout: DEFAULT_READ_TIMEOUT,
            faults: FaultConfig::default(),
            #[cfg(feature = "cuda")]
            local_device: None,
        }
    }

    /// Whether this node's cache is GPU memory (only a `cuda` producer can be read then).
    pub(crate) fn local_on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.local_device.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }
}

/// The side channel endpoint for `kv_transfer_params.remote_host` / `remote_port`.
pub fn side_channel_endpoint(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("tcp://[{host}]:{port}")
    } else {
        format!("tcp://{host}:{port}")
    }
}

/// Starts handshakes. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TransferClient {
    config: Arc<ClientConfig>,
}

impl TransferClient {
    pub fn new(config: ClientConfig) -> Self {
        Self { config: Arc::new(config) }
    }

    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Handshake with the side channel at `endpoint` and check that it is `expected_engine_id`
    /// with a cache compatible with ours. Never waits longer than the handshake timeout.
    pub async fn handshake(&self, endpoint: &str, expected_engine_id: &str) -> Result<RemoteAgent, HandshakeError> {
        let timeout = self.config.handshake_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let link =
            match tokio::time::timeout_at(deadline, SideLink::connect(endpoint, timeout, &self.config.mesh_secret))
                .await
            {
                Ok(r) => r?,
                Err(_) => return Err(HandshakeError::Timeout(timeout)),
            };
        let reply = tokio::time::timeout_at(deadline, link.call(Message::XferGetMetadata)).await;
        let meta = match reply {
            Err(_) => {
                return Err(HandshakeError::Timeout(timeout));
            }
            Ok(Err(LinkError::Undecodable(e))) => return Err(HandshakeError::UndecodableMetadata(e)),
            Ok(Err(LinkError::Io(e))) => return Err(HandshakeError::Unreachable(e)),
            Ok(Ok(Message::XferMetadata(meta))) => meta,
            Ok(Ok(Message::Error(e))) => return Err(HandshakeError::Remote(e.message)),
            Ok(Ok(other)) => {
                return Err(HandshakeError::UndecodableMetadata(format!(
                    "expected xfer_metadata, got {}",
                    other.kind()
                )))
            }
        };
        if meta.compat_hash != self.config.compat_hash {
            return Err(HandshakeError::CompatMismatch {
                local: self.config.compat_hash.clone(),
                remote: meta.compat_hash,
            });
        }
        if meta.engine_id != expected_engine_id {
            return Err(HandshakeError::EngineIdMismatch {
                expected: expected_engine_id.to_string(),
                found: meta.engine_id,
            });
        }
        check_geometry(&meta, &self.config.local_spec).map_err(HandshakeError::Incompatible)?;
        let remote_spec = KvCacheSpec { num_blocks: meta.num_blocks, ..self.config.local_spec };
        // The backend P advertised opens its data plane (and refuses what D cannot read).
        let at = OpenContext { config: &self.config, remote_spec };
        let data = registered(advertised_kind(&meta.backend)).open(&meta.backend, at)?;
        tracing::info!(endpoint, engine_id = %meta.engine_id, agent = %meta.agent_name, backend = ?meta.backend, "handshake done");
        Ok(RemoteAgent { endpoint: endpoint.to_string(), remote_spec, meta, config: self.config.clone(), link, data })
    }
}

/// What went wrong on the side channel link itself.
#[derive(Debug)]
enum LinkError {
    Undecodable(String),
    Io(String),
}

/// A DEALER connected to one producer's ROUTER, shared by every request to that producer.
///
/// Calls are multiplexed: a caller holds the send half only to hand its frame over, and one
/// reader task routes each answer to its caller by correlation id. So a notice (a rejection's
/// give-up, rule R1) never waits behind the round trips of other requests' leases and read
/// dones on the same link; serialised calls made it queue behind every one in flight.
/// Late answers to calls that timed out find no caller and are dropped.
struct SideLink {
    send: AsyncMutex<DealerSendHalf>,
    waiters: Arc<Waiters>,
    next_corr: AtomicU64,
    healthy: Arc<AtomicBool>,
    reader: tokio::task::JoinHandle<()>,
}

/// Callers waiting for an answer, by correlation id; `closed` once the reader task ended
/// (no answer will come, so a new call fails at once instead of at its timeout).
#[derive(Default)]
struct Pending {
    calls: HashMap<u64, oneshot::Sender<Result<Message, LinkError>>>,
    closed: bool,
}

type Waiters = std::sync::Mutex<Pending>;

fn lock_waiters(w: &Waiters) -> std::sync::MutexGuard<'_, Pending> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

impl std::fmt::Debug for SideLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SideLink").field("healthy", &self.healthy.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

impl Drop for SideLink {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Removes a caller's entry when its call ends early (timeout: the future is dropped).
struct Waiting<'a> {
    waiters: &'a Waiters,
    corr: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        lock_waiters(self.waiters).calls.remove(&self.corr);
    }
}

impl SideLink {
    /// Connect and run the mesh handshake: P proves it knows the mesh secret before D sends it
    /// anything else, then D proves it (P serves nothing before). The DEALER sets no identity,
    /// so P's ROUTER names this connection with random bits nobody else knows.
    ///
    /// A connection P closes before the handshake is through is opened again, up to
    /// [`HANDSHAKE_CONNECTIONS`] in all (the caller bounds the time). P drops pending peers to
    /// stay bounded under a handshake flood (D96): when its share for one source address is
    /// full, a newcomer takes the slot of that source's oldest pending peer. Strangers on P's own
    /// host share 127.0.0.1 with a D there, and one issue 40 flood evicted D's pending
    /// connection between its hello and its proof (the load failed, P's blocks waited for
    /// their lease). A fresh connection is as likely as any stranger's to get through.
    async fn connect(endpoint: &str, timeout: Duration, secret: &MeshSecret) -> Result<Self, HandshakeError> {
        probe(endpoint).await?;
        let mut tries = 1;
        loop {
            let link = Self::open(endpoint, timeout).await?;
            match link.authenticate(secret).await {
                Ok(()) => return Ok(link),
                Err(HandshakeError::Unreachable(e)) if tries < HANDSHAKE_CONNECTIONS => {
                    tracing::info!(endpoint, error = %e, "side channel closed during the handshake; connecting again");
                    tries += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A DEALER connected to `endpoint` and its answer reader, before any handshake.
    async fn open(endpoint: &str, timeout: Duration) -> Result<Self, HandshakeError> {
        let mut options = SocketOptions::default();
        options.connect_timeout(timeout);
        let mut socket = DealerSocket::with_options(options);
        // Before the connect, so that no event is missed (see `read_answers`).
        let events = socket.monitor();
        socket.connect(endpoint).await.map_err(|e| HandshakeError::Unreachable(format!("{endpoint}: {e}")))?;
        let (send, recv) = socket.split();
        let waiters = Arc::new(Waiters::default());
        let healthy = Arc::new(AtomicBool::new(true));
        let reader = tokio::spawn(read_answers(recv, events, waiters.clone(), healthy.clone()));
        Ok(Self { send: AsyncMutex::new(send), waiters, next_corr: AtomicU64::new(1), healthy, reader })
    }

    async fn authenticate(&self, secret: &MeshSecret) -> Result<(), HandshakeError> {
        let failed = |e: LinkError| match e {
            LinkError::Undecodable(e) => HandshakeError::UndecodableMetadata(e),
            LinkError::Io(e) => HandshakeError::Unreachable(e),
        };
        let (client, hello) = ClientHello::new(Channel::SideChannel);
        let challenge = match self.call(Message::AuthHello(hello)).await.map_err(failed)? {
            Message::AuthChallenge(c) => c,
            Message::Error(e) => return Err(HandshakeError::Unauthenticated(e.message)),
            other => return Err(HandshakeError::Unauthenticated(format!("unexpected {} to auth_hello", other.kind()))),
        };
        let proof = client.answer(secret, &challenge).map_err(|e| HandshakeError::Unauthenticated(e.to_string()))?;
        match self.call(Message::AuthProof(proof)).await.map_err(failed)? {
            Message::Ack => Ok(()),
            Message::Error(e) => Err(HandshakeError::Unauthenticated(e.message)),
            other => Err(HandshakeError::Unauthenticated(format!("unexpected {} to auth_proof", other.kind()))),
        }
    }

    /// Send `body` and wait for its answer (no timeout here: callers bound it).
    async fn call(&self, body: Message) -> Result<Message, LinkError> {
        let corr = self.next_corr.fetch_add(1, Ordering::Relaxed);
        // The caller's span (D's `kv.read`) is the parent of P's side-channel span.
        let bytes = Envelope::new(body)
            .with_corr(corr)
            .with_trace(pdmesh_telemetry::trace::current())
            .encode()
            .map_err(|e| LinkError::Io(e.to_string()))?;
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = lock_waiters(&self.waiters);
            if pending.closed {
                return Err(LinkError::Io("side channel link closed".into()));
            }
            pending.calls.insert(corr, tx);
        }
        let _waiting = Waiting { waiters: &self.waiters, corr };
        let sent = self.send.lock().await.send(ZmqMessage::from(bytes)).await;
        let result = match sent {
            Err(e) => Err(LinkError::Io(e.to_string())),
            Ok(()) => rx.await.unwrap_or_else(|_| Err(LinkError::Io("side channel link closed".into()))),
        };
        if result.is_err() {
            self.healthy.store(false, Ordering::Release);
        }
        result
    }
}

/// The reader task of a [`SideLink`]: hands every answer to the caller waiting for its
/// correlation id. A broken socket, or one P closed, fails every waiting call and ends the
/// link; an undecodable frame cannot be matched to its caller, so it fails them all too (the
/// link is not to be trusted after it).
async fn read_answers(
    mut recv: DealerRecvHalf,
    mut events: futures::channel::mpsc::Receiver<SocketEvent>,
    waiters: Arc<Waiters>,
    healthy: Arc<AtomicBool>,
) {
    let fail_all = |error: &dyn Fn() -> LinkError, close: bool| {
        healthy.store(false, Ordering::Release);
        let mut pending = lock_waiters(&waiters);
        pending.closed |= close;
        for (_, tx) in pending.calls.drain() {
            let _ = tx.send(Err(error()));
        }
    };
    let mut monitored = true;
    loop {
        let received = tokio::select! {
            received = recv.recv() => received,
            // P closing the connection (a FIN, not a reset) is no error to the crate's DEALER:
            // it drops the connection's stream and waits for another peer, so calls would wait
            // for their timeouts. The socket's own report of the disconnect ends the link.
            event = events.next(), if monitored => {
                match event {
                    Some(SocketEvent::Disconnected(_)) => {
                        fail_all(&|| LinkError::Io("side channel closed by P".into()), true);
                        return;
                    }
                    Some(_) => {}
                    None => monitored = false,
                }
                continue;
            }
        };
        let msg = match received {
            Ok(msg) => msg,
            Err(e) => {
                let e = e.to_string();
                fail_all(&|| LinkError::Io(e.clone()), true);
                return;
            }
        };
        let Some(frame) = msg.into_vec().pop() else { continue };
        match Envelope::decode(&frame) {
            Ok(env) => match lock_waiters(&waiters).calls.remove(&env.corr) {
                Some(tx) => {
                    let _ = tx.send(Ok(env.body));
                }
                None => tracing::debug!(corr = env.corr, "skipping a late side channel answer"),
            },
            Err(e) => {
                let e = e.to_string();
                fail_all(&|| LinkError::Undecodable(e.clone()), false);
            }
        }
    }
}

/// Tell "nothing listens there" (refused: `Unreachable`) apart from "listens but does not
/// answer" (`Timeout`): the zeromq crate retries refused connects until its timeout.
async fn probe(endpoint: &str) -> Result<(), HandshakeError> {
    let unreachable = |e: std::io::Error| HandshakeError::Unreachable(format!("{endpoint}: {e}"));
    if let Some(addr) = endpoint.strip_prefix("tcp://") {
        drop(tokio::net::TcpStream::connect(addr).await.map_err(unreachable)?);
        Ok(())
    } else if let Some(path) = endpoint.strip_prefix("ipc://") {
        drop(tokio::net::UnixStream::connect(path).await.map_err(unreachable)?);
        Ok(())
    } else {
        Err(HandshakeError::Unreachable(format!("unsupported endpoint {endpoint:?} (tcp:// or ipc://)")))
    }
}

/// A producer agent D has handshaken with: its metadata, the side channel link, and the data
/// plane. Share it (`Arc`) between requests; calls on it may run concurrently.
#[derive(Debug)]
pub struct RemoteAgent {
    endpoint: String,
    meta: AgentMetadata,
    remote_spec: KvCacheSpec,
    config: Arc<ClientConfig>,
    link: SideLink,
    /// The backend's data plane, opened at handshake; closed when the agent is dropped.
    data: Box<dyn DataPlane>,
}

/// Permission from P to read one request's blocks until `expires_at`. Only [`RemoteAgent::lease`]
/// makes one, so holding a `Lease` means P granted it.
#[derive(Debug)]
pub struct Lease {
    agent_name: String,
    p_request_id: String,
    /// The request's capability token, presented with every read and notice under the lease.
    capability: String,
    lease_id: u64,
    block_ids: Vec<u32>,
    expires_at: Instant,
    done: AtomicBool,
}

impl Lease {
    pub fn lease_id(&self) -> u64 {
        self.lease_id
    }
    pub fn p_request_id(&self) -> &str {
        &self.p_request_id
    }
    pub fn block_ids(&self) -> &[u32] {
        &self.block_ids
    }
    /// When P will consider the lease over (by D's clock, measured from the request).
    pub fn expires_at(&self) -> Instant {
        self.expires_at
    }
}

/// What a read moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadStats {
    pub bytes: u64,
    pub blocks: u32,
    pub elapsed: Duration,
}

impl ReadStats {
    /// Bytes per second.
    pub fn bandwidth(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

impl RemoteAgent {
    pub fn metadata(&self) -> &AgentMetadata {
        &self.meta
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// False once a side channel call failed or timed out: the producer may be gone or
    /// restarted, so [`RemoteAgents`] handshakes again.
    pub fn is_healthy(&self) -> bool {
        self.link.healthy.load(Ordering::Acquire)
    }

    /// Stop trusting this agent (its side channel failed, or P restarted): the next
    /// [`RemoteAgents::get`] for its engine handshakes again, once, however many requests
    /// saw the failure.
    pub fn mark_stale(&self) {
        self.link.healthy.store(false, Ordering::Release);
    }

    async fn call(&self, body: Message) -> Result<Message, TransferError> {
        let timeout = self.config.call_timeout;
        match tokio::time::timeout(timeout, self.link.call(body)).await {
            Ok(Ok(Message::Error(e))) if e.class == pdmesh_protocol::ErrorClass::Unauthenticated => {
                // P no longer knows this connection's session (it restarted and the socket
                // reconnected underneath): handshake again rather than keep being refused.
                self.link.healthy.store(false, Ordering::Release);
                Err(TransferError::SideChannel(e.message))
            }
            Ok(Ok(m)) => Ok(m),
            Ok(Err(LinkError::Io(e) | LinkError::Undecodable(e))) => Err(TransferError::SideChannel(e)),
            Err(_) => {
                self.link.healthy.store(false, Ordering::Release);
                Err(TransferError::Timeout(timeout))
            }
        }
    }

    /// Ask P for a read lease on `block_ids` (with their `generations`, exactly as P handed
    /// them out) of `p_request_id`.
    /// `capability`: the token from the request's `kv_transfer_params` (`remote_capability`);
    /// without the right one P answers as if it did not hold the request.
    pub async fn lease(
        &self,
        p_request_id: &str,
        capability: &str,
        block_ids: &[u32],
        generations: &[u64],
    ) -> Result<Lease, TransferError> {
        let asked = Instant::now();
        let req = XferLeaseRequest {
            p_request_id: p_request_id.to_string(),
            block_ids: block_ids.to_vec(),
            block_generations: generations.to_vec(),
            consumer: self.config.consumer.clone(),
            capability: capability.to_string(),
        };
        match self.call(Message::XferLease(req)).await? {
            Message::XferLeaseGranted(g) if !g.agent_name.is_empty() && g.agent_name != self.meta.agent_name => {
                // P restarted since our handshake: our view of it (its region, its block
                // server) is stale. Never read through it; the next `RemoteAgents::get`
                // handshakes again, and P grants this reader the same lease once more.
                self.link.healthy.store(false, Ordering::Release);
                Err(TransferError::ProducerRestarted {
                    lease_id: g.lease_id,
                    granted_by: g.agent_name,
                    handshake_with: self.meta.agent_name.clone(),
                })
            }
            Message::XferLeaseGranted(g) => Ok(Lease {
                agent_name: self.meta.agent_name.clone(),
                p_request_id: p_request_id.to_string(),
                capability: capability.to_string(),
                lease_id: g.lease_id,
                block_ids: block_ids.to_vec(),
                // From when we asked: P's clock started no earlier, so we never overrun it.
                expires_at: asked + Duration::from_millis(g.lease_ttl_ms),
                done: AtomicBool::new(false),
            }),
            Message::XferLeaseRefused(r) => Err(TransferError::LeaseRefused { reason: r.reason, detail: r.detail }),
            Message::Error(e) => Err(TransferError::SideChannel(e.message)),
            other => Err(TransferError::SideChannel(format!("unexpected {} to a lease request", other.kind()))),
        }
    }

    /// Copy remote blocks `remote_block_ids[i]` into local blocks `local_block_ids[i]`, every
    /// layer's K and V. Refused without touching `local` unless `lease` (from this agent, not
    /// yet done, not expired) covers every remote block; P refuses too for `tcp`. On any
    /// error, treat the local blocks as invalid.
    pub async fn read_blocks(
        &self,
        lease: &Lease,
        remote_block_ids: &[u32],
        local: &mut KvCache,
        local_block_ids: &[u32],
    ) -> Result<ReadStats, TransferError> {
        let started = Instant::now();
        self.check_read(lease, remote_block_ids, local_block_ids.len())?;
        check_local_ids(local.spec(), local_block_ids)?;
        self.check_local_geometry(local.spec())?;
        let runs = cache_runs(local, local_block_ids)?;
        self.read_runs(lease, remote_block_ids, runs, started).await
    }

    /// [`Self::read_blocks`] straight into blocks checked out of this process's own cache
    /// region ([`KvBlockWriter`](crate::region::KvBlockWriter)): the bytes land where the
    /// executor will read them, with no staging buffer and no second copy.
    pub async fn read_blocks_into(
        &self,
        lease: &Lease,
        remote_block_ids: &[u32],
        local: &mut BlockCheckout,
    ) -> Result<ReadStats, TransferError> {
        let started = Instant::now();
        self.check_read(lease, remote_block_ids, local.block_ids().len())?;
        // The checkout already refused out-of-range and repeated ids.
        self.check_local_geometry(local.spec())?;
        let runs = local.runs();
        self.read_runs(lease, remote_block_ids, runs, started).await
    }

    /// Move the leased remote blocks into `runs` (every run of the local blocks, in wire order).
    async fn read_runs(
        &self,
        lease: &Lease,
        remote_block_ids: &[u32],
        runs: Vec<&mut [u8]>,
        started: Instant,
    ) -> Result<ReadStats, TransferError> {
        self.before_read(lease).await?;
        let bytes = self.data.read_host(self.block_read(lease, remote_block_ids), runs).await?;
        Ok(ReadStats { bytes, blocks: remote_block_ids.len() as u32, elapsed: started.elapsed() })
    }

    /// [`Self::read_blocks_into`] for a receive's blocks wherever they live ([`LocalBlocks`]:
    /// host memory, or with the `cuda` feature the GPU).
    pub async fn read_into(
        &self,
        lease: &Lease,
        remote_block_ids: &[u32],
        local: &mut LocalBlocks,
    ) -> Result<ReadStats, TransferError> {
        match local {
            LocalBlocks::Host(blocks) => self.read_blocks_into(lease, remote_block_ids, blocks).await,
            #[cfg(feature = "cuda")]
            LocalBlocks::Device(blocks) => self.read_blocks_into_device(lease, remote_block_ids, blocks).await,
        }
    }

    /// Copy the leased remote blocks of a `cuda` producer into blocks checked out of this
    /// node's GPU region: device-to-device, one 2D copy per run of consecutive blocks, no host
    /// staging and no work on P's side. Any driver error is treated as a read that may have
    /// written part of the blocks.
    #[cfg(feature = "cuda")]
    pub async fn read_blocks_into_device(
        &self,
        lease: &Lease,
        remote_block_ids: &[u32],
        local: &mut DeviceCheckout,
    ) -> Result<ReadStats, TransferError> {
        let started = Instant::now();
        self.check_read(lease, remote_block_ids, local.block_ids().len())?;
        self.check_local_geometry(local.spec())?;
        self.before_read(lease).await?;
        let bytes = self.data.read_device(self.block_read(lease, remote_block_ids), local)?;
        Ok(ReadStats { bytes, blocks: remote_block_ids.len() as u32, elapsed: started.elapsed() })
    }

    /// What the data plane needs of a read checked here.
    fn block_read<'a>(&'a self, lease: &'a Lease, remote_block_ids: &'a [u32]) -> BlockRead<'a> {
        let total = remote_block_ids.len() as u64 * self.meta.bytes_per_block;
        BlockRead {
            p_request_id: &lease.p_request_id,
            lease_id: lease.lease_id,
            capability: &lease.capability,
            remote_block_ids,
            remote_spec: &self.remote_spec,
            stop_after: self.config.faults.transfer_midway.then_some(total / 2),
            read_timeout: self.config.read_timeout,
        }
    }

    /// The injected faults that strike before any byte moves: a delay (after which the lease
    /// may have run out) and a setup error.
    async fn before_read(&self, lease: &Lease) -> Result<(), TransferError> {
        let faults = &self.config.faults;
        if let Some(delay) = faults.delay_transfer {
            tokio::time::sleep(delay).await;
            if Instant::now() >= lease.expires_at {
                return Err(TransferError::LeaseInvalid(format!("lease {} expired while delayed", lease.lease_id)));
            }
        }
        if faults.transfer_setup_error {
            return Err(TransferError::Setup("fault injection: transfer_setup_error".into()));
        }
        Ok(())
    }

    /// The lease and the remote side of a read of `remote` into `n_local` local blocks.
    fn check_read(&self, lease: &Lease, remote: &[u32], n_local: usize) -> Result<(), TransferError> {
        if lease.agent_name != self.meta.agent_name {
            return Err(TransferError::LeaseInvalid(format!("lease {} was granted by another agent", lease.lease_id)));
        }
        if lease.done.load(Ordering::Acquire) {
            return Err(TransferError::LeaseInvalid(format!("lease {} is done", lease.lease_id)));
        }
        if Instant::now() >= lease.expires_at {
            return Err(TransferError::LeaseInvalid(format!("lease {} has expired", lease.lease_id)));
        }
        if remote.len() != n_local {
            return Err(TransferError::BadRequest(format!(
                "{} remote blocks for {n_local} local blocks",
                remote.len()
            )));
        }
        if let Some(b) = remote.iter().find(|b| !lease.block_ids.contains(b)) {
            return Err(TransferError::LeaseInvalid(format!("block {b} is not covered by lease {}", lease.lease_id)));
        }
        let num_blocks = self.meta.num_blocks;
        if let Some(b) = remote.iter().find(|b| **b >= num_blocks) {
            return Err(TransferError::BlockOutOfRange { which: "remote", block: *b, num_blocks });
        }
        Ok(())
    }

    /// The local cache has the geometry checked at handshake (only the block count may differ).
    fn check_local_geometry(&self, local_spec: &KvCacheSpec) -> Result<(), TransferError> {
        if *local_spec != (KvCacheSpec { num_blocks: local_spec.num_blocks, ..self.remote_spec }) {
            return Err(TransferError::BadRequest("local cache geometry differs from the handshake's".into()));
        }
        Ok(())
    }

    /// Tell P the read under `lease` is done. `Ok` means P confirms the lease held until now,
    /// so the bytes read are the ones it held; [`TransferError::LeaseLost`] means they may not
    /// be. Either way the lease can no longer be read under.
    pub async fn read_done(&self, lease: &Lease) -> Result<(), TransferError> {
        lease.done.store(true, Ordering::Release);
        if self.config.faults.drop_read_done {
            tracing::warn!(p_request_id = %lease.p_request_id, "fault injection: dropping read done");
            return Ok(());
        }
        let notice = XferReadDone {
            p_request_id: lease.p_request_id.clone(),
            lease_id: lease.lease_id,
            consumer: self.config.consumer.clone(),
            capability: lease.capability.clone(),
        };
        match self.call(Message::XferReadDone(notice)).await? {
            Message::Ack => Ok(()),
            Message::Error(e) => Err(TransferError::LeaseLost(e.message)),
            other => Err(TransferError::SideChannel(format!("unexpected {} to read done", other.kind()))),
        }
    }

    /// Tell P that D will never read `p_request_id` (rejection, abort, failed load,
    /// shutdown), ending `lease` if D holds one, so that P frees at once.
    pub async fn give_up(
        &self,
        p_request_id: &str,
        capability: &str,
        reason: &str,
        lease: Option<&Lease>,
    ) -> Result<(), TransferError> {
        self.give_up_at(p_request_id, capability, reason, lease, None).await
    }

    /// [`Self::give_up`] for a rejection before admission at `rejected_at_unix_us`, so that P
    /// can measure rejection → free.
    pub async fn give_up_at(
        &self,
        p_request_id: &str,
        capability: &str,
        reason: &str,
        lease: Option<&Lease>,
        rejected_at_unix_us: Option<u64>,
    ) -> Result<(), TransferError> {
        if let Some(l) = lease {
            l.done.store(true, Ordering::Release);
        }
        let notice = XferGiveUp {
            p_request_id: p_request_id.to_string(),
            reason: reason.to_string(),
            consumer: self.config.consumer.clone(),
            lease_id: lease.map(|l| l.lease_id),
            rejected_at_unix_us,
            capability: capability.to_string(),
        };
        self.expect_ack(Message::XferGiveUp(notice)).await
    }

    /// Keep P's holds of these requests (P's request id, capability token) alive while they
    /// wait on D.
    pub async fn heartbeat(&self, requests: &[(String, String)]) -> Result<(), TransferError> {
        let hb = XferHeartbeat {
            p_request_ids: requests.iter().map(|(id, _)| id.clone()).collect(),
            consumer: self.config.consumer.clone(),
            capabilities: requests.iter().map(|(_, token)| token.clone()).collect(),
        };
        self.expect_ack(Message::XferHeartbeat(hb)).await
    }

    async fn expect_ack(&self, body: Message) -> Result<(), TransferError> {
        match self.call(body).await? {
            Message::Ack => Ok(()),
            Message::Error(e) => Err(TransferError::SideChannel(e.message)),
            other => Err(TransferError::SideChannel(format!("unexpected {}", other.kind()))),
        }
    }
}

/// Local block ids: distinct and inside the local cache.
fn check_local_ids(local_spec: &KvCacheSpec, local_ids: &[u32]) -> Result<(), TransferError> {
    let mut seen = std::collections::HashSet::with_capacity(local_ids.len());
    if let Some(b) = local_ids.iter().find(|b| !seen.insert(**b)) {
        return Err(TransferError::BadRequest(format!("local block {b} is named twice")));
    }
    if let Some(b) = local_ids.iter().find(|b| **b >= local_spec.num_blocks) {
        return Err(TransferError::BlockOutOfRange { which: "local", block: *b, num_blocks: local_spec.num_blocks });
    }
    Ok(())
}

/// The bytes of every local run to fill, in wire order, as disjoint mutable slices of the
/// cache (so the kernel can write into all of them with one `readv`).
fn cache_runs<'a>(local: &'a mut KvCache, local_ids: &[u32]) -> Result<Vec<&'a mut [u8]>, TransferError> {
    let spec = *local.spec();
    let len = run_bytes(&spec);
    let bad = |detail: &str| TransferError::BadRequest(detail.to_string());
    // (offset, wire position), sorted by offset, to carve the cache front to back.
    let mut order: Vec<(usize, usize)> = wire_runs(spec.num_layers, local_ids.len())
        .enumerate()
        .map(|(pos, (layer, side, i))| (run_offset(&spec, layer, side, local_ids.get(i).copied().unwrap_or(0)), pos))
        .collect();
    order.sort_unstable();
    let mut slots: Vec<Option<&'a mut [u8]>> = std::iter::repeat_with(|| None).take(order.len()).collect();
    let mut rest = floats_as_bytes_mut(local.as_mut_slice());
    let mut cursor = 0usize;
    for (offset, pos) in order {
        let skip = offset.checked_sub(cursor).ok_or_else(|| bad("local block ids repeat"))?;
        if rest.len() < skip + len {
            return Err(bad("local block outside the cache"));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
        let (run, tail) = tail.split_at_mut(len);
        rest = tail;
        cursor = offset + len;
        if let Some(slot) = slots.get_mut(pos) {
            *slot = Some(run);
        }
    }
    slots.into_iter().map(|s| s.ok_or_else(|| bad("run missing"))).collect()
}

/// One [`RemoteAgent`] per remote engine, handshaken on first use. A failed handshake is not
/// cached (the next call tries again), and an agent whose side channel failed is replaced.
/// Concurrent first uses of one engine share one handshake.
///
/// A cached agent keeps P's data plane open: the `shm` mapping of P's whole KV cache (which
/// keeps those pages in memory even after P exits and its file is unlinked), the `tcp`
/// connections, or the CUDA IPC mapping. [`RemoteAgents::evict_idle`] drops agents nobody has
/// asked for in a while, so the prefill engines that went away (scaled down, replaced under
/// another engine id) do not stay mapped in every decode worker for its lifetime.
#[derive(Debug)]
pub struct RemoteAgents {
    client: TransferClient,
    slots: std::sync::Mutex<HashMap<String, AgentSlot>>,
}

/// One engine's cached agent, and when it was last asked for.
#[derive(Debug)]
struct AgentSlot {
    /// The async lock makes concurrent first uses share a handshake.
    cell: Arc<AsyncMutex<Option<Arc<RemoteAgent>>>>,
    last_used: Instant,
}

impl RemoteAgents {
    pub fn new(client: TransferClient) -> Self {
        Self { client, slots: std::sync::Mutex::new(HashMap::new()) }
    }

    pub fn client(&self) -> &TransferClient {
        &self.client
    }

    fn lock_slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, AgentSlot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The agent for `engine_id` at `endpoint`, handshaking if there is none yet, if the cached
    /// one is unhealthy, or if the engine moved to another endpoint.
    pub async fn get(&self, engine_id: &str, endpoint: &str) -> Result<Arc<RemoteAgent>, HandshakeError> {
        let cell = {
            let mut slots = self.lock_slots();
            let slot = slots
                .entry(engine_id.to_string())
                .or_insert_with(|| AgentSlot { cell: Arc::default(), last_used: Instant::now() });
            slot.last_used = Instant::now();
            slot.cell.clone()
        };
        let mut cell = cell.lock().await;
        if let Some(agent) = cell.as_ref() {
            if agent.is_healthy() && agent.endpoint() == endpoint {
                return Ok(agent.clone());
            }
        }
        *cell = None;
        let agent = Arc::new(self.client.handshake(endpoint, engine_id).await?);
        *cell = Some(agent.clone());
        Ok(agent)
    }

    /// Forget the agent of `engine_id` (e.g. after a read failed in a way that suggests P
    /// restarted), so the next `get` handshakes again.
    pub fn invalidate(&self, engine_id: &str) {
        self.lock_slots().remove(engine_id);
    }

    /// Engines with a cached agent slot.
    pub fn engines(&self) -> Vec<String> {
        self.lock_slots().keys().cloned().collect()
    }

    /// Drop the agents that nobody uses now and that either were not asked for during `idle`
    /// (before `now`) or whose side channel failed; dropping one closes its data plane (unmaps
    /// P's cache). An agent a caller still holds (a read in flight), or a slot a handshake is
    /// running in, is kept whatever its age. Returns the engines dropped.
    pub fn evict_idle(&self, now: Instant, idle: Duration) -> Vec<String> {
        let mut evicted = Vec::new();
        self.lock_slots().retain(|engine, slot| {
            // Another holder of the cell is a `get` between taking it and locking it.
            if Arc::strong_count(&slot.cell) > 1 {
                return true;
            }
            let Ok(cell) = slot.cell.try_lock() else { return true };
            let idle_for = now.saturating_duration_since(slot.last_used);
            let keep = match cell.as_ref() {
                Some(agent) => Arc::strong_count(agent) > 1 || (agent.is_healthy() && idle_for < idle),
                None => idle_for < idle,
            };
            if !keep {
                evicted.push(engine.clone());
            }
            keep
        });
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compile-time check: the handles can be shared across threads and every call's future
    /// can be spawned (`tokio::spawn`) or run inside an actor.
    #[allow(dead_code)]
    fn handles_and_futures_are_send(agent: &RemoteAgent, agents: &RemoteAgents, lease: &Lease, kv: &mut KvCache) {
        fn send_sync<T: Send + Sync>(_: &T) {}
        fn send<T: Send>(_: T) {}
        send_sync(agent);
        send_sync(agents);
        send_sync(lease);
        send(agents.get("e", "tcp://h:1"));
        send(agent.lease("r", "t", &[], &[]));
        send(agent.read_blocks(lease, &[], kv, &[]));
        send(agent.read_done(lease));
        send(agent.give_up("r", "t", "why", None));
        send(agent.heartbeat(&[]));
    }

    use crate::agent::{AgentConfig, TransferAgent};
    use crate::backend::BackendConfig;
    use crate::hold::{HoldTable, SharedPolicy};
    use crate::region::ShmRegion;
    use pdmesh_protocol::LeaseRefusalReason;

    /// D's own checks are bypassed with a forged lease: P's block server must still refuse
    /// every block its lease does not cover (P decides, not the reader).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tcp_server_refuses_blocks_outside_the_lease_even_if_d_forges_one() {
        let spec = KvCacheSpec { num_layers: 2, num_blocks: 8, block_size: 4, num_kv_heads: 1, head_dim: 8 };
        let name = format!("pdmesh-test-{}", uuid::Uuid::new_v4());
        let region = ShmRegion::create_for_spec(&name, &spec).unwrap();
        let path = region.path().to_path_buf();
        let _kv = region.into_kv_cache(spec).unwrap();
        let table = Arc::new(std::sync::Mutex::new(HoldTable::default()));
        let policy: SharedPolicy = table.clone();
        let secret = MeshSecret::generate();
        let config = AgentConfig {
            engine_id: "p".into(),
            rank: 0,
            side_channel: "tcp://127.0.0.1:0".into(),
            backend: BackendConfig::Tcp { bind: "127.0.0.1:0".into(), advertise_host: None },
            compat_hash: "h".into(),
            faults: FaultConfig::default(),
            mesh_secret: secret.clone(),
        };
        let agent = TransferAgent::start(config, &path, spec, policy).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        table.lock().unwrap().hold_with_capability("r", vec![1], vec![1], deadline, "tok".into());
        let client = TransferClient::new(ClientConfig::new("d", spec, "h", secret));
        let remote = client.handshake(agent.side_channel_endpoint(), "p").await.unwrap();
        let lease = remote.lease("r", "tok", &[1], &[1]).await.unwrap();
        let mut local = KvCache::new_heap(spec);
        for forged_blocks in [vec![1, 2], vec![1, 7]] {
            let forged = Lease {
                agent_name: lease.agent_name.clone(),
                p_request_id: "r".into(),
                capability: "tok".into(),
                lease_id: lease.lease_id,
                block_ids: forged_blocks.clone(),
                expires_at: lease.expires_at,
                done: AtomicBool::new(false),
            };
            let err = remote.read_blocks(&forged, &forged_blocks, &mut local, &[0, 1]).await.unwrap_err();
            assert!(
                matches!(err, TransferError::LeaseRefused { reason: LeaseRefusalReason::LeaseInvalid, .. }),
                "{err:?}"
            );
        }
        // Another request's id with this lease id: refused too.
        let forged = Lease { p_request_id: "other".into(), done: AtomicBool::new(false), block_ids: vec![1], ..lease };
        let err = remote.read_blocks(&forged, &[1], &mut local, &[0]).await.unwrap_err();
        assert!(matches!(err, TransferError::LeaseRefused { .. }), "{err:?}");
        assert!(local.as_slice().iter().all(|x| *x == 0.0));
        assert_eq!(agent.stats().tcp_reads_refused.load(Ordering::Relaxed), 3);
    }
}
