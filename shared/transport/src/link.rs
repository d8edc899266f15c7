//! The connect side of a ROUTER/DEALER pair, with reconnect and request/reply correlation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::{Message as ActixMessage, Recipient};
use futures::StreamExt;
use pdmesh_protocol::Envelope;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use crate::metrics::{DECODE_ERRORS, RECEIVED, RECONNECTS, SEND_ERRORS, SENT};
use crate::seal::{endpoint_port, seal, Seal};
use crate::TransportError;
use pdmesh_mesh_auth::frame::Direction;

/// How a connect-side socket behaves.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// `ipc://…` or `tcp://host:port` of the bound peer.
    pub endpoint: String,
    /// ZeroMQ identity of this side (the ROUTER addresses us by it). `None`: random. Not
    /// used on a sealed link: the zeromq crate's ROUTER hands a routing id to whichever
    /// connection claimed it last, so a stranger claiming ours would receive our traffic.
    /// There the ROUTER draws a random id that never leaves it, and the peer learns who we
    /// are from our (sealed) hello.
    pub identity: Option<String>,
    /// Sent first after every (re)connect, so the peer learns who we are.
    pub hello: Option<Envelope>,
    /// Limit for one connect attempt; attempts repeat until the process stops.
    pub connect_timeout: Duration,
    /// Limit for handing one frame to the socket.
    pub send_timeout: Duration,
    /// Whether frames are sealed (by default: on `tcp://` once the process installed its key).
    pub seal: Seal,
}

impl LinkConfig {
    pub fn new(endpoint: impl Into<String>) -> Self {
        let endpoint = endpoint.into();
        Self {
            seal: Seal::for_endpoint(&endpoint),
            endpoint,
            identity: None,
            hello: None,
            connect_timeout: Duration::from_secs(2),
            send_timeout: Duration::from_secs(5),
        }
    }
    pub fn identity(mut self, id: impl Into<String>) -> Self {
        self.identity = Some(id.into());
        self
    }
    pub fn hello(mut self, hello: Envelope) -> Self {
        self.hello = Some(hello);
        self
    }
    /// Seal (or not) regardless of the endpoint's default.
    pub fn seal(mut self, seal: Seal) -> Self {
        self.seal = seal;
        self
    }
}

/// What a link tells its owner actor.
/// Messages dominate the traffic, so the envelope stays inline (no extra allocation).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, ActixMessage)]
#[rtype(result = "()")]
pub enum LinkEvent {
    /// Connected (first time or again). `endpoint` names the link.
    Up { endpoint: String },
    /// The peer went away; calls in flight were answered with [`TransportError::PeerGone`].
    Down { endpoint: String },
    /// A message that is not the reply to one of our calls.
    Message { endpoint: String, envelope: Envelope },
}

struct Outbound {
    envelope: Envelope,
    reply: Option<(oneshot::Sender<Result<Envelope, TransportError>>, Instant)>,
}

/// A cheap, clonable handle to a link; sending never blocks.
#[derive(Clone)]
pub struct LinkHandle {
    endpoint: Arc<str>,
    tx: mpsc::UnboundedSender<Outbound>,
    up: Arc<AtomicBool>,
}

impl std::fmt::Debug for LinkHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkHandle").field("endpoint", &self.endpoint).field("up", &self.is_up()).finish()
    }
}

impl LinkHandle {
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whether the peer is connected right now.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Send a message that expects no reply. Fails at once when the peer is down.
    pub fn send(&self, envelope: Envelope) -> Result<(), TransportError> {
        if !self.is_up() {
            return Err(TransportError::Unavailable(self.endpoint.to_string()));
        }
        self.tx.send(Outbound { envelope, reply: None }).map_err(|_| TransportError::Closed)
    }

    /// Send a request and wait for its reply (matched by correlation id) for at most
    /// `timeout`. Answered with an error, never left hanging, when the peer is down or goes
    /// away.
    pub async fn call(&self, envelope: Envelope, timeout: Duration) -> Result<Envelope, TransportError> {
        if !self.is_up() {
            return Err(TransportError::Unavailable(self.endpoint.to_string()));
        }
        let (tx, rx) = oneshot::channel();
        let deadline = Instant::now() + timeout;
        self.tx.send(Outbound { envelope, reply: Some((tx, deadline)) }).map_err(|_| TransportError::Closed)?;
        match tokio::time::timeout_at(deadline + Duration::from_millis(50), rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(TransportError::Closed),
            Err(_) => Err(TransportError::Timeout(self.endpoint.to_string(), timeout)),
        }
    }
}

/// Start a DEALER that connects to `config.endpoint`, reconnecting for as long as the
/// returned handle (or a clone) lives. Events go to `sink`.
pub fn connect_dealer(config: LinkConfig, sink: Recipient<LinkEvent>) -> LinkHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let up = Arc::new(AtomicBool::new(false));
    let handle = LinkHandle { endpoint: Arc::from(config.endpoint.as_str()), tx, up: up.clone() };
    tokio::spawn(run_link(config, rx, sink, up));
    handle
}

type Pending = HashMap<u64, (oneshot::Sender<Result<Envelope, TransportError>>, Instant)>;

async fn run_link(
    config: LinkConfig,
    mut rx: mpsc::UnboundedReceiver<Outbound>,
    sink: Recipient<LinkEvent>,
    up: Arc<AtomicBool>,
) {
    let endpoint = config.endpoint.clone();
    let mut pending: Pending = HashMap::new();
    let mut next_corr: u64 = 1;
    let mut first = true;
    // One session for the link's life: a reconnect continues its counter.
    let port = endpoint_port(&endpoint);
    let mut sealer = config.seal.sealer(port, Direction::ToBound);
    let mut guard = config.seal.guard(&endpoint, port, Direction::FromBound);
    loop {
        // ---- connect, failing anything queued meanwhile
        let Some((socket, mut monitor)) = connect_with_backoff(&config, &endpoint, &mut rx).await else { return };
        if !first {
            RECONNECTS.with_label_values(&[&endpoint]).inc();
        }
        first = false;
        let (mut send_half, mut recv_half) = socket.split();
        if let Some(hello) = &config.hello {
            if let Ok(bytes) = hello.encode() {
                let _ = send_half.send(ZmqMessage::from(seal(&mut sealer, bytes))).await;
            }
        }
        up.store(true, Ordering::Release);
        tracing::debug!(%endpoint, "link up");
        sink.do_send(LinkEvent::Up { endpoint: endpoint.clone() });

        // ---- connected
        let mut sweep = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                out = rx.recv() => {
                    let Some(mut out) = out else { return };
                    if let Some((reply, deadline)) = out.reply.take() {
                        out.envelope.corr = next_corr;
                        pending.insert(next_corr, (reply, deadline));
                        next_corr += 1;
                    }
                    let corr = out.envelope.corr;
                    let bytes = match out.envelope.encode() {
                        Ok(b) => b,
                        Err(e) => {
                            if let Some((tx, _)) = pending.remove(&corr) {
                                let _ = tx.send(Err(TransportError::Codec(e.to_string())));
                            }
                            continue;
                        }
                    };
                    let frame = ZmqMessage::from(seal(&mut sealer, bytes));
                    match tokio::time::timeout(config.send_timeout, send_half.send(frame)).await {
                        Ok(Ok(())) => SENT.with_label_values(&[&endpoint]).inc(),
                        _ => {
                            SEND_ERRORS.with_label_values(&[&endpoint]).inc();
                            if let Some((tx, _)) = pending.remove(&corr) {
                                let _ = tx.send(Err(TransportError::PeerGone(endpoint.clone())));
                            }
                            break;
                        }
                    }
                }
                msg = recv_half.recv() => {
                    let Ok(msg) = msg else { break };
                    RECEIVED.with_label_values(&[&endpoint]).inc();
                    let Some(frame) = msg.into_vec().pop() else { continue };
                    let Some(payload) = guard.open(&frame, None) else { continue };
                    deliver(payload, &endpoint, &mut pending, &sink);
                }
                ev = monitor.next() => {
                    if matches!(ev, Some(SocketEvent::Disconnected(_)) | None) {
                        break;
                    }
                }
                _ = sweep.tick() => expire(&mut pending, &endpoint, config.send_timeout),
            }
        }

        // ---- peer gone: answer everything in flight, then reconnect
        up.store(false, Ordering::Release);
        tracing::warn!(%endpoint, in_flight = pending.len(), "link down; reconnecting");
        for (_, (tx, _)) in pending.drain() {
            let _ = tx.send(Err(TransportError::PeerGone(endpoint.clone())));
        }
        sink.do_send(LinkEvent::Down { endpoint: endpoint.clone() });
        drop(send_half);
        drop(recv_half);
    }
}

/// A connected DEALER socket to the link's endpoint and its monitor, retried with a backoff
/// (20 ms doubling to 500 ms); anything queued meanwhile is failed as unavailable. `None`: the
/// link's owner dropped its sender (the link ends).
async fn connect_with_backoff(
    config: &LinkConfig,
    endpoint: &str,
    rx: &mut mpsc::UnboundedReceiver<Outbound>,
) -> Option<(DealerSocket, futures::channel::mpsc::Receiver<SocketEvent>)> {
    let mut backoff = Duration::from_millis(20);
    let mut options = SocketOptions::default();
    if let Some(id) = config.identity.as_ref().filter(|_| !config.seal.is_sealed()) {
        if let Ok(peer_id) = id.parse() {
            options.peer_identity(peer_id);
        }
    }
    options.connect_timeout(config.connect_timeout);
    let mut socket = DealerSocket::with_options(options);
    let monitor = socket.monitor();
    loop {
        let connected = {
            let connect = socket.connect(endpoint);
            tokio::pin!(connect);
            loop {
                tokio::select! {
                    res = &mut connect => break res.is_ok(),
                    out = rx.recv() => match out {
                        None => return None,
                        Some(o) => fail(o, TransportError::Unavailable(endpoint.to_string())),
                    },
                }
            }
        };
        if connected {
            return Some((socket, monitor));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// An opened frame from the peer: the reply a request waits for (by correlation id), else a
/// message for the link's owner; an undecodable one is counted and dropped.
fn deliver(payload: &[u8], endpoint: &str, pending: &mut Pending, sink: &Recipient<LinkEvent>) {
    match Envelope::decode(payload) {
        Ok(env) => {
            if env.corr != 0 {
                if let Some((tx, _)) = pending.remove(&env.corr) {
                    let _ = tx.send(Ok(env));
                    return;
                }
            }
            sink.do_send(LinkEvent::Message { endpoint: endpoint.to_string(), envelope: env });
        }
        Err(e) => {
            DECODE_ERRORS.with_label_values(&[endpoint]).inc();
            tracing::warn!(%endpoint, error = %e, "dropping undecodable frame");
        }
    }
}

/// Answer the requests past their deadline (or whose waiter left) with a timeout.
fn expire(pending: &mut Pending, endpoint: &str, send_timeout: Duration) {
    let now = Instant::now();
    let expired: Vec<u64> = pending
        .iter()
        .filter(|(_, (tx, deadline))| *deadline <= now || tx.is_closed())
        .map(|(corr, _)| *corr)
        .collect();
    for corr in expired {
        if let Some((tx, _)) = pending.remove(&corr) {
            let _ = tx.send(Err(TransportError::Timeout(endpoint.to_string(), send_timeout)));
        }
    }
}

fn fail(out: Outbound, err: TransportError) {
    if let Some((tx, _)) = out.reply {
        let _ = tx.send(Err(err));
    }
}
