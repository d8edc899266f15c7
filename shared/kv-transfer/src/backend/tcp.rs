//! The `tcp` backend (across hosts): P streams leased blocks from its region, D reads them
//! straight into its local KV blocks.
//!
//! Framing, per connection (connections are kept and reused): D sends one length-prefixed
//! (`u32` big-endian) [`Envelope`] with [`Message::XferReadBlocks`]; P answers one
//! length-prefixed envelope — [`Message::XferReadReady`] followed by exactly `bytes` raw
//! bytes, or [`Message::XferLeaseRefused`] / [`Message::Error`] and nothing else.
//!
//! P checks the lease with the policy before it sends a byte and then writes the runs straight
//! from its mapping with vectored writes; D receives straight into its local blocks with
//! vectored reads. No byte is copied in user space on either side.

use std::io::{IoSlice, IoSliceMut};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt as _;
use pdmesh_mesh_auth::{Channel, ClientHello, LogLimiter, MeshSecret, ServerChallenge};
use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::{
    Envelope, ErrorClass, LeaseRefusalReason, Message, TransferBackend, WireError, XferLeaseRefused, XferReadBlocks,
    XferReadReady,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::{
    device_cache_refuses, not_mine, served_region, Backend, BackendConfig, BlockRead, DataPlane, Offer, OpenContext,
    ProducerAddress, ServedMemory,
};
use crate::agent::{if_capable, AgentStats, Served};
use crate::error::{AgentError, HandshakeError, TransferError};
use crate::hold::LeaseRefusal;
use crate::layout::{run_bytes, run_offset, wire_runs};
use crate::region::ShmReadOnly;

/// The `tcp` backend ([`super::registered`]).
pub(crate) struct Tcp;

const NAME: &str = "tcp";

impl Backend for Tcp {
    fn name(&self) -> &'static str {
        NAME
    }

    /// The block server binds the node's bind host at this rank's data port, and consumers
    /// reach it at the side channel's host.
    fn configure(&self, at: &ProducerAddress) -> BackendConfig {
        BackendConfig::Tcp {
            bind: format!("{}:{}", at.bind_host, at.data_port),
            advertise_host: Some(at.advertise_host.clone()),
        }
    }

    fn offer<'a>(
        &'a self,
        config: &'a BackendConfig,
        memory: ServedMemory<'a>,
        spec: KvCacheSpec,
    ) -> BoxFuture<'a, Result<Offer, AgentError>> {
        async move {
            let BackendConfig::Tcp { bind, advertise_host } = config else {
                return Err(AgentError::Config(not_mine(NAME, config)));
            };
            let region = served_region(memory.region(NAME)?, &spec)?;
            let bind_err = |e: std::io::Error| AgentError::Bind { endpoint: bind.clone(), reason: e.to_string() };
            let listener = TcpListener::bind(bind).await.map_err(bind_err)?;
            let local = listener.local_addr().map_err(bind_err)?;
            let host = match advertise_host {
                Some(h) => h.clone(),
                None if local.ip().is_unspecified() => {
                    return Err(AgentError::Config(format!("tcp bind {bind} is a wildcard; set advertise_host")))
                }
                None => local.ip().to_string(),
            };
            let region = Arc::new(region);
            Ok(Offer {
                advertised: TransferBackend::Tcp { host, port: local.port() },
                server: Some(Box::new(move |served| serve_blocks(listener, region, spec, served).boxed())),
            })
        }
        .boxed()
    }

    fn open(&self, advertised: &TransferBackend, at: OpenContext<'_>) -> Result<Box<dyn DataPlane>, HandshakeError> {
        let TransferBackend::Tcp { host, port } = advertised else {
            return Err(HandshakeError::Incompatible(not_mine(NAME, advertised)));
        };
        if at.config.local_on_device() {
            return Err(device_cache_refuses(NAME));
        }
        Ok(Box::new(TcpReader::new(host, *port, at.config.mesh_secret.clone())))
    }
}

impl DataPlane for TcpReader {
    fn read_host<'a>(
        &'a self,
        read: BlockRead<'a>,
        runs: Vec<&'a mut [u8]>,
    ) -> BoxFuture<'a, Result<u64, TransferError>> {
        async move {
            let (block_ids, mut runs) =
                dest_order(read.remote_block_ids, runs, 2 * read.remote_spec.num_layers as usize);
            let req = XferReadBlocks {
                p_request_id: read.p_request_id.to_string(),
                lease_id: read.lease_id,
                block_ids,
                capability: read.capability.to_string(),
            };
            let timeout = read.read_timeout;
            match tokio::time::timeout(timeout, self.read(&req, &mut runs, read.stop_after)).await {
                Ok(r) => r,
                Err(_) => Err(TransferError::Timeout(timeout)),
            }
        }
        .boxed()
    }
}

/// Reorder a read's blocks so that their local runs are filled front to back: whatever order
/// D's allocator handed the blocks out in, the kernel then receives into ascending addresses
/// (reversed local ids cost about 15% of the bandwidth otherwise; the `shm` copy picks its own
/// order). `runs` holds `per_block` runs per block, in wire order; the pairing of remote and
/// local blocks is unchanged.
fn dest_order<'a>(remote: &[u32], runs: Vec<&'a mut [u8]>, per_block: usize) -> (Vec<u32>, Vec<&'a mut [u8]>) {
    if per_block == 0 || runs.len() != remote.len() * per_block {
        return (remote.to_vec(), runs);
    }
    let mut blocks: Vec<(u32, Vec<&'a mut [u8]>)> = Vec::with_capacity(remote.len());
    let mut it = runs.into_iter();
    for &r in remote {
        blocks.push((r, it.by_ref().take(per_block).collect()));
    }
    blocks.sort_by_key(|(_, runs)| runs.first().map(|run| run.as_ptr() as usize));
    let remote = blocks.iter().map(|(r, _)| *r).collect();
    (remote, blocks.into_iter().flat_map(|(_, runs)| runs).collect())
}

/// Largest control frame accepted (a read of 100k blocks fits easily).
const MAX_FRAME: usize = 16 << 20;
/// Runs handed to one `writev` (below every platform's IOV_MAX).
const IOV_BATCH: usize = 512;
/// Idle connections D keeps per remote agent.
const MAX_IDLE: usize = 8;
/// Longest a connection may take to authenticate; a peer that stalls is dropped.
const AUTH_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest frame read before a connection authenticated (a hello or a proof is ~100 bytes),
/// so an unauthenticated peer cannot make P allocate [`MAX_FRAME`].
const MAX_AUTH_FRAME: usize = 4096;

/// One refused-peer log line per second at most.
static TCP_AUTH_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));

async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, env: &Envelope) -> std::io::Result<()> {
    let bytes = env.encode().map_err(std::io::Error::other)?;
    let len = u32::try_from(bytes.len()).map_err(std::io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + bytes.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&bytes);
    w.write_all(&frame).await
}

/// `Ok(None)` on a clean end of stream before the frame.
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Option<Envelope>> {
    read_frame_limited(r, MAX_FRAME).await
}

async fn read_frame_limited<R: AsyncRead + Unpin>(r: &mut R, max: usize) -> std::io::Result<Option<Envelope>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::other(format!("frame of {len} bytes exceeds {max}")));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await?;
    Envelope::decode(&buf).map(Some).map_err(std::io::Error::other)
}

// ---- P: the block server ---------------------------------------------------------------------

/// Accept connections until the agent drops this task; connection tasks live in a `JoinSet`
/// owned here, so they stop with it.
pub(crate) async fn serve_blocks(
    listener: TcpListener,
    region: Arc<ShmReadOnly>,
    spec: KvCacheSpec,
    served: Arc<Served>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    conns.spawn(serve_connection(stream, peer.to_string(), region.clone(), spec, served.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "block server: accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// P's side of the mesh handshake on a new connection: `Ok` once the peer proved it knows the
/// mesh secret; otherwise the peer got one refusal (and the caller closes the connection).
pub(crate) async fn authenticate_peer<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &MeshSecret,
) -> Result<(), String> {
    let refuse = |detail: &str| Message::Error(pdmesh_mesh_auth::refusal(detail));
    let hello = match read_frame_limited(stream, MAX_AUTH_FRAME).await {
        Ok(Some(env)) => env,
        Ok(None) => return Err("closed before authenticating".into()),
        Err(e) => return Err(format!("bad first frame: {e}")),
    };
    let Message::AuthHello(h) = &hello.body else {
        let _ = write_frame(stream, &hello.reply(refuse("authenticate first (auth_hello)"))).await;
        return Err(format!("{} before the handshake", hello.body.kind()));
    };
    let (challenge, reply) = match ServerChallenge::answer(secret, Channel::TcpData, h) {
        Ok(c) => c,
        Err(e) => {
            let _ = write_frame(stream, &hello.reply(refuse("bad hello"))).await;
            return Err(e.to_string());
        }
    };
    write_frame(stream, &hello.reply(Message::AuthChallenge(reply))).await.map_err(|e| e.to_string())?;
    let proof = match read_frame_limited(stream, MAX_AUTH_FRAME).await {
        Ok(Some(env)) => env,
        Ok(None) => return Err("closed during the handshake".into()),
        Err(e) => return Err(format!("bad proof frame: {e}")),
    };
    let verified = match &proof.body {
        Message::AuthProof(p) => challenge.verify(secret, p).map_err(|e| e.to_string()),
        other => Err(format!("{} instead of auth_proof", other.kind())),
    };
    match verified {
        Ok(()) => write_frame(stream, &proof.reply(Message::Ack)).await.map_err(|e| e.to_string()),
        Err(e) => {
            let _ = write_frame(stream, &proof.reply(refuse("wrong mesh secret"))).await;
            Err(e)
        }
    }
}

/// Answer one connection's block reads until it ends, once its peer (`peer`, for the log)
/// authenticated. Generic over the stream so the fuzz targets drive this very function over
/// an in-memory stream.
pub(crate) async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    peer: String,
    region: Arc<ShmReadOnly>,
    spec: KvCacheSpec,
    served: Arc<Served>,
) {
    let stats = &served.stats;
    let authenticated = tokio::time::timeout(AUTH_TIMEOUT, authenticate_peer(&mut stream, &served.secret)).await;
    if let Err(why) = authenticated.unwrap_or_else(|_| Err("no handshake within the time limit".into())) {
        AgentStats::inc(&stats.tcp_unauthenticated);
        pdmesh_mesh_auth::metrics::unauthenticated(Channel::TcpData);
        if let Some(suppressed) = TCP_AUTH_LOG.allow() {
            tracing::warn!(%peer, reason = %why, suppressed, "block server: refused an unauthenticated connection");
        }
        return;
    }
    loop {
        let env = match read_frame(&mut stream).await {
            Ok(Some(env)) => env,
            Ok(None) => return,
            Err(e) => {
                AgentStats::inc(&stats.tcp_errors);
                tracing::debug!(error = %e, "block server: bad request frame");
                return;
            }
        };
        let Message::XferReadBlocks(req) = &env.body else {
            AgentStats::inc(&stats.tcp_errors);
            let err = Message::Error(WireError::new(ErrorClass::InvalidRequest, "expected xfer_read_blocks"));
            let _ = write_frame(&mut stream, &env.reply(err)).await;
            return;
        };
        AgentStats::inc(&stats.tcp_reads);
        // One span per block read served, in the reader's trace (a child of D's `kv.read`).
        let span = pdmesh_telemetry::trace::child_of(
            tracing::info_span!("kv.serve.tcp_read", otel.kind = "server", request_id = %req.p_request_id,
                kv.blocks = req.block_ids.len(), kv.bytes = tracing::field::Empty),
            &env.trace,
        );
        let checked = check_request(req, &spec, &served);
        let runs = match checked {
            Ok(()) => collect_runs(&region, &spec, &req.block_ids),
            Err(refusal) => Err(refusal),
        };
        let runs = match runs {
            Ok(runs) => runs,
            Err(refusal) => {
                AgentStats::inc(&stats.tcp_reads_refused);
                tracing::info!(parent: &span, p_request_id = %req.p_request_id, lease_id = req.lease_id, %refusal.detail, "block read refused");
                if write_frame(&mut stream, &env.reply(Message::XferLeaseRefused(refusal))).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let bytes = (runs.len() * run_bytes(&spec)) as u64;
        let ready = Message::XferReadReady(XferReadReady { blocks: req.block_ids.len() as u32, bytes });
        let sent = async {
            write_frame(&mut stream, &env.reply(ready)).await?;
            write_runs(&mut stream, &runs).await
        }
        .await;
        match sent {
            Ok(()) => {
                stats.tcp_bytes_sent.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                span.record("kv.bytes", bytes);
                tracing::info!(parent: &span, bytes, blocks = req.block_ids.len(), "blocks sent");
            }
            Err(e) => {
                AgentStats::inc(&stats.tcp_errors);
                tracing::info!(p_request_id = %req.p_request_id, error = %e, "block read aborted by the reader");
                return;
            }
        }
    }
}

fn check_request(req: &XferReadBlocks, spec: &KvCacheSpec, served: &Served) -> Result<(), XferLeaseRefused> {
    // A lease covers distinct blocks of one request, so an honest read names at most the whole
    // cache. Without this bound a lease holder could name a covered block millions of times in
    // one frame and make P build (and stream) a run list many times its cache.
    if req.block_ids.len() > spec.num_blocks as usize {
        return Err(XferLeaseRefused {
            reason: LeaseRefusalReason::LeaseInvalid,
            detail: format!("a read of {} blocks exceeds the cache ({} blocks)", req.block_ids.len(), spec.num_blocks),
        });
    }
    if let Some(b) = req.block_ids.iter().find(|b| **b >= spec.num_blocks) {
        return Err(XferLeaseRefused {
            reason: LeaseRefusalReason::LeaseInvalid,
            detail: format!("block {b} is outside the cache ({} blocks)", spec.num_blocks),
        });
    }
    let id = &req.p_request_id;
    let as_unknown = || Err(LeaseRefusal::not_active_lease(id, req.lease_id));
    if_capable(served, id, &req.capability, "read", as_unknown, |policy| {
        policy.check_read(id, req.lease_id, &req.block_ids, Instant::now())
    })
    .map_err(|r| XferLeaseRefused { reason: r.reason, detail: r.detail })
}

/// The region's runs for `block_ids`, in wire order, borrowed from the mapping.
fn collect_runs<'a>(
    region: &'a ShmReadOnly,
    spec: &KvCacheSpec,
    block_ids: &[u32],
) -> Result<Vec<&'a [u8]>, XferLeaseRefused> {
    let len = run_bytes(spec);
    let bytes = region.bytes();
    wire_runs(spec.num_layers, block_ids.len())
        .map(|(layer, side, i)| {
            let off = block_ids.get(i).map(|b| run_offset(spec, layer, side, *b));
            off.and_then(|off| bytes.get(off..off + len)).ok_or_else(|| XferLeaseRefused {
                reason: LeaseRefusalReason::LeaseInvalid,
                detail: "block outside the mapped region".into(),
            })
        })
        .collect()
}

/// Write every run with `writev`, up to [`IOV_BATCH`] runs per call, resuming partial writes.
async fn write_runs<W: AsyncWrite + Unpin>(stream: &mut W, runs: &[&[u8]]) -> std::io::Result<()> {
    for batch in runs.chunks(IOV_BATCH) {
        let mut slices: Vec<IoSlice<'_>> = batch.iter().map(|r| IoSlice::new(r)).collect();
        let mut pending = &mut slices[..];
        while !pending.is_empty() {
            let n = stream.write_vectored(pending).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut pending, n);
        }
    }
    Ok(())
}

// ---- D: the reader ---------------------------------------------------------------------------

/// D's connections to one block server (kept alive between reads).
#[derive(Debug)]
pub(crate) struct TcpReader {
    addr: String,
    idle: Mutex<Vec<TcpStream>>,
    secret: MeshSecret,
}

/// Where a read failed, so the caller knows whether local blocks were touched.
enum ReadFailure {
    /// Before any data byte; `retry` when a pooled connection turned out dead.
    Before {
        err: TransferError,
        retry: bool,
    },
    After(TransferError),
}

impl TcpReader {
    pub(crate) fn new(host: &str, port: u16, secret: MeshSecret) -> Self {
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Self { addr, idle: Mutex::new(Vec::new()), secret }
    }

    fn take_idle(&self) -> Option<TcpStream> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    fn put_idle(&self, stream: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(stream);
        }
    }

    async fn connect(&self) -> Result<TcpStream, TransferError> {
        let stream = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| TransferError::Setup(format!("connect {}: {e}", self.addr)))?;
        let _ = stream.set_nodelay(true);
        let mut stream = stream;
        match tokio::time::timeout(AUTH_TIMEOUT, authenticate_to(&mut stream, &self.secret)).await {
            Ok(Ok(())) => Ok(stream),
            Ok(Err(e)) => Err(TransferError::Setup(format!("block server {}: {e}", self.addr))),
            Err(_) => Err(TransferError::Setup(format!("block server {}: no mesh handshake answer", self.addr))),
        }
    }

    /// Read `req.block_ids` into `runs`: every run of the local blocks, in wire order (one
    /// block of one layer side each, disjoint). `stop_after` (fault injection) ends the read,
    /// dropping the connection, once that many data bytes were taken.
    pub(crate) async fn read(
        &self,
        req: &XferReadBlocks,
        runs: &mut [&mut [u8]],
        stop_after: Option<u64>,
    ) -> Result<u64, TransferError> {
        let (stream, pooled) = match self.take_idle() {
            Some(s) => (s, true),
            None => (self.connect().await?, false),
        };
        match self.read_on(stream, pooled, req, runs, stop_after).await {
            Ok(n) => Ok(n),
            Err(ReadFailure::Before { retry: true, .. }) => {
                // The pooled connection was closed by P (restart, idle timeout): once more on a
                // fresh one. Nothing was written locally.
                let stream = self.connect().await?;
                match self.read_on(stream, false, req, runs, stop_after).await {
                    Ok(n) => Ok(n),
                    Err(ReadFailure::Before { err, .. } | ReadFailure::After(err)) => Err(err),
                }
            }
            Err(ReadFailure::Before { err, .. } | ReadFailure::After(err)) => Err(err),
        }
    }

    async fn read_on(
        &self,
        mut stream: TcpStream,
        pooled: bool,
        req: &XferReadBlocks,
        runs: &mut [&mut [u8]],
        stop_after: Option<u64>,
    ) -> Result<u64, ReadFailure> {
        let before = |e: std::io::Error| ReadFailure::Before {
            err: TransferError::Setup(format!("block server {}: {e}", self.addr)),
            retry: pooled,
        };
        // D's `kv.read` span is the parent of P's `kv.serve.tcp_read`.
        let env = Envelope::new(Message::XferReadBlocks(req.clone())).with_trace(pdmesh_telemetry::trace::current());
        write_frame(&mut stream, &env).await.map_err(before)?;
        let header = read_frame(&mut stream)
            .await
            .map_err(before)?
            .ok_or_else(|| before(std::io::ErrorKind::UnexpectedEof.into()))?;
        let run = runs.first().map_or(0, |r| r.len());
        let expected: u64 = runs.iter().map(|r| r.len() as u64).sum();
        let bytes = match header.body {
            Message::XferReadReady(r) if r.bytes == expected => r.bytes,
            Message::XferReadReady(r) => {
                let err =
                    TransferError::SideChannel(format!("server announced {} bytes, {expected} expected", r.bytes));
                return Err(ReadFailure::Before { err, retry: false });
            }
            Message::XferLeaseRefused(r) => {
                self.put_idle(stream);
                let err = TransferError::LeaseRefused { reason: r.reason, detail: r.detail };
                return Err(ReadFailure::Before { err, retry: false });
            }
            Message::Error(e) => {
                return Err(ReadFailure::Before { err: TransferError::SideChannel(e.message), retry: false });
            }
            other => {
                let err = TransferError::SideChannel(format!("unexpected {} from block server", other.kind()));
                return Err(ReadFailure::Before { err, retry: false });
            }
        };
        let take = match stop_after.filter(|l| *l < bytes) {
            Some(limit) => (limit as usize).checked_div(run).unwrap_or(0).min(runs.len()),
            None => runs.len(),
        };
        let runs = &mut runs[..take];
        let wanted: usize = runs.iter().map(|r| r.len()).sum();
        let done = receive_into(&stream, runs).await.map_err(ReadFailure::After)?;
        if (wanted as u64) < bytes {
            // Fault injection: the connection is dropped with bytes unread, which P sees as a
            // reset mid-stream.
            return Err(ReadFailure::After(TransferError::Midway {
                bytes_done: done,
                detail: "fault injection: transfer_midway".into(),
            }));
        }
        self.put_idle(stream);
        Ok(done)
    }
}

/// D's side of the mesh handshake on a new block server connection: P must prove it knows the
/// mesh secret before D asks it for anything, and D proves it too.
pub(crate) async fn authenticate_to<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &MeshSecret,
) -> Result<(), String> {
    let (client, hello) = ClientHello::new(Channel::TcpData);
    write_frame(stream, &Envelope::new(Message::AuthHello(hello))).await.map_err(|e| e.to_string())?;
    let challenge = match read_frame_limited(stream, MAX_AUTH_FRAME).await {
        Ok(Some(Envelope { body: Message::AuthChallenge(c), .. })) => c,
        Ok(Some(Envelope { body: Message::Error(e), .. })) => return Err(e.message),
        Ok(Some(other)) => return Err(format!("unexpected {} to auth_hello", other.body.kind())),
        Ok(None) => return Err("closed during the mesh handshake".into()),
        Err(e) => return Err(e.to_string()),
    };
    let proof = client.answer(secret, &challenge).map_err(|e| e.to_string())?;
    write_frame(stream, &Envelope::new(Message::AuthProof(proof))).await.map_err(|e| e.to_string())?;
    match read_frame_limited(stream, MAX_AUTH_FRAME).await {
        Ok(Some(Envelope { body: Message::Ack, .. })) => Ok(()),
        Ok(Some(Envelope { body: Message::Error(e), .. })) => Err(e.message),
        Ok(Some(other)) => Err(format!("unexpected {} to auth_proof", other.body.kind())),
        Ok(None) => Err("closed during the mesh handshake".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Receive straight into `runs`, in order, with vectored reads of up to [`IOV_BATCH`] runs.
async fn receive_into(stream: &TcpStream, runs: &mut [&mut [u8]]) -> Result<u64, TransferError> {
    let mut done = 0u64;
    for batch in runs.chunks_mut(IOV_BATCH) {
        let mut slices: Vec<IoSliceMut<'_>> = batch.iter_mut().map(|r| IoSliceMut::new(&mut r[..])).collect();
        let mut pending = &mut slices[..];
        while !pending.is_empty() {
            let midway = |detail: String| TransferError::Midway { bytes_done: done, detail };
            stream.readable().await.map_err(|e| midway(e.to_string()))?;
            match stream.try_read_vectored(pending) {
                Ok(0) => return Err(midway("block server closed the stream".into())),
                Ok(n) => {
                    done += n as u64;
                    IoSliceMut::advance_slices(&mut pending, n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(midway(e.to_string())),
            }
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::FaultConfig;
    use crate::hold::{HoldTable, LeasePolicy};
    use crate::region::ShmRegion;
    use pdmesh_protocol::AgentMetadata;

    /// Found by the `tcp_server` fuzz target: a lease holder could name one covered block over
    /// and over, and P would build a run list (and a stream) many times its cache. Fails
    /// without the bound in `check_request` (the nine-block read is then served: 36 runs of an
    /// eight-block cache). Runs the real handshake first, with the request's capability token,
    /// so the read reaches the lease check.
    #[tokio::test]
    async fn a_read_naming_more_blocks_than_the_cache_is_refused() {
        let spec = KvCacheSpec { num_layers: 2, num_blocks: 8, block_size: 1, num_kv_heads: 1, head_dim: 1 };
        let dir = std::env::temp_dir().join(format!("pdmesh-tcp-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("repeat.kv");
        let _region = ShmRegion::create_at(&path, crate::layout::region_bytes(&spec)).unwrap();
        let readonly = Arc::new(ShmRegion::open_readonly(&path).unwrap());
        let mut table = HoldTable::default();
        let now = Instant::now();
        let token = pdmesh_mesh_auth::new_capability();
        table.hold_with_capability("r", vec![1, 2], vec![1, 1], now + Duration::from_secs(60), token.clone());
        let lease_id = table.grant("r", &[1, 2], &[1, 1], "d", now).unwrap().lease_id;
        let metadata = AgentMetadata {
            engine_id: "p".into(),
            agent_name: "a".into(),
            rank: 0,
            backend: TransferBackend::Tcp { host: "127.0.0.1".into(), port: 1 },
            layout: pdmesh_protocol::KV_LAYOUT.into(),
            num_layers: spec.num_layers,
            num_blocks: spec.num_blocks,
            block_size: spec.block_size,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            dtype: pdmesh_protocol::KV_DTYPE_F32.into(),
            bytes_per_block: spec.bytes_per_block(),
            compat_hash: "h".into(),
            protocol_version: pdmesh_protocol::TRANSFER_VERSION,
        };
        let secret = MeshSecret::generate();
        let served = Arc::new(Served {
            metadata,
            policy: Arc::new(std::sync::Mutex::new(table)),
            faults: FaultConfig::none(),
            stats: Arc::new(AgentStats::default()),
            secret: secret.clone(),
        });
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let task = tokio::spawn(serve_connection(server, "test".into(), readonly, spec, served));
        authenticate_to(&mut client, &secret).await.unwrap();
        let read = |block_ids: Vec<u32>| {
            Envelope::new(Message::XferReadBlocks(XferReadBlocks {
                p_request_id: "r".into(),
                lease_id,
                block_ids,
                capability: token.clone(),
            }))
        };
        // Nine reads of a covered block exceed the eight-block cache: refused, nothing streamed.
        write_frame(&mut client, &read(vec![1; 9])).await.unwrap();
        let answer = read_frame(&mut client).await.unwrap().unwrap();
        assert!(
            matches!(&answer.body, Message::XferLeaseRefused(r) if r.reason == LeaseRefusalReason::LeaseInvalid),
            "{answer:?}"
        );
        // Within the bound the read is served, so the refusal above is the bound's.
        write_frame(&mut client, &read(vec![1, 2, 1])).await.unwrap();
        let answer = read_frame(&mut client).await.unwrap().unwrap();
        let run = run_bytes(&spec) as u64;
        assert_eq!(answer.body, Message::XferReadReady(XferReadReady { blocks: 3, bytes: 3 * 4 * run }));
        drop(client);
        task.await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn frames_round_trip_and_oversize_is_refused() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let env = Envelope::new(Message::XferReadBlocks(XferReadBlocks {
            p_request_id: "r".into(),
            lease_id: 9,
            block_ids: vec![1, 2],
            capability: "c".into(),
        }));
        write_frame(&mut a, &env).await.unwrap();
        assert_eq!(read_frame(&mut b).await.unwrap(), Some(env));
        a.write_all(&(MAX_FRAME as u32 + 1).to_be_bytes()).await.unwrap();
        assert!(read_frame(&mut b).await.is_err());
        drop(a);
        let (a2, mut b2) = tokio::io::duplex(16);
        drop(a2);
        assert_eq!(read_frame(&mut b2).await.unwrap(), None);
    }
}
