//! One-way streams: PUSH (connect, reconnecting) → PULL (bind).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::{Message as ActixMessage, Recipient};
use futures::StreamExt;
use pdmesh_protocol::Envelope;
use tokio::sync::mpsc;
use zeromq::{PullSocket, PushSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::metrics::{DECODE_ERRORS, RECEIVED, RECONNECTS, SEND_ERRORS, SENT};
use crate::seal::{endpoint_port, seal, Seal};
use crate::{prepare_ipc_endpoint, TransportError};
use pdmesh_mesh_auth::frame::Direction;

/// A message that arrived on a PULL socket.
#[derive(Debug, ActixMessage)]
#[rtype(result = "()")]
pub struct PullEvent {
    pub envelope: Envelope,
}

/// Bind a PULL socket; every decoded message goes to `sink`. Frames must be sealed on
/// `tcp://` once the process installed its key ([`crate::seal_tcp_links`]).
pub async fn bind_pull(endpoint: &str, sink: Recipient<PullEvent>) -> Result<String, TransportError> {
    bind_pull_with(endpoint, sink, Seal::for_endpoint(endpoint)).await
}

/// [`bind_pull`] with the sealing chosen by the caller.
pub async fn bind_pull_with(
    endpoint: &str,
    sink: Recipient<PullEvent>,
    seal_with: Seal,
) -> Result<String, TransportError> {
    prepare_ipc_endpoint(endpoint);
    let mut socket = PullSocket::new();
    let bound = socket.bind(endpoint).await.map_err(|e| TransportError::Bind(endpoint.to_string(), e.to_string()))?;
    let label = bound.to_string();
    let ret = label.clone();
    let mut guard = seal_with.guard(&label, endpoint_port(&label), Direction::ToBound);
    tokio::spawn(async move {
        loop {
            let Ok(msg) = socket.recv().await else { continue };
            RECEIVED.with_label_values(&[&label]).inc();
            let Some(frame) = msg.into_vec().pop() else { continue };
            let Some(payload) = guard.open(&frame, None) else { continue };
            match Envelope::decode(payload) {
                Ok(envelope) => sink.do_send(PullEvent { envelope }),
                Err(e) => {
                    DECODE_ERRORS.with_label_values(&[&label]).inc();
                    tracing::warn!(endpoint = %label, error = %e, "dropping undecodable frame");
                }
            }
        }
    });
    Ok(ret)
}

/// Messages a PUSH socket keeps while its peer is not (yet) connected; beyond that they are
/// dropped and counted. Outputs produced in the moments before a peer connects, or while it
/// restarts, must not be lost: a client would wait for them forever.
pub const PUSH_QUEUE_LIMIT: usize = 65_536;

/// Handle to a reconnecting PUSH socket.
#[derive(Clone, Debug)]
pub struct PushHandle {
    endpoint: Arc<str>,
    tx: mpsc::UnboundedSender<Envelope>,
    up: Arc<AtomicBool>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
    /// Asks the socket task to drop its connection and connect afresh ([`PushHandle::reconnect`]).
    reset: Arc<tokio::sync::Notify>,
}

impl PushHandle {
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Drop the connection and connect again, keeping every message not yet sent. For a
    /// peer known to have restarted (a frontend's hello with a new pid, D92): its old socket
    /// may look connected for tens of seconds, and what is sent there is lost. Messages
    /// queued after this call go out on the new connection.
    pub fn reconnect(&self) {
        self.reset.notify_one();
    }

    /// Queue a message. While the peer is not connected, up to [`PUSH_QUEUE_LIMIT`] messages
    /// wait and are delivered once it connects; beyond that they are dropped and counted.
    pub fn send(&self, envelope: Envelope) -> Result<(), TransportError> {
        if self.queued.load(Ordering::Acquire) >= PUSH_QUEUE_LIMIT {
            SEND_ERRORS.with_label_values(&[&self.endpoint]).inc();
            return Err(TransportError::Unavailable(self.endpoint.to_string()));
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        self.tx.send(envelope).map_err(|_| TransportError::Closed)
    }
}

/// Start a PUSH socket that connects to `endpoint` and reconnects when its peer restarts.
/// Frames are sealed on `tcp://` once the process installed its key ([`crate::seal_tcp_links`]).
pub fn connect_push(endpoint: &str) -> PushHandle {
    connect_push_with(endpoint, Seal::for_endpoint(endpoint))
}

/// [`connect_push`] with the sealing chosen by the caller.
pub fn connect_push_with(endpoint: &str, seal_with: Seal) -> PushHandle {
    let (tx, mut rx) = mpsc::unbounded_channel::<Envelope>();
    let up = Arc::new(AtomicBool::new(false));
    let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let reset = Arc::new(tokio::sync::Notify::new());
    let handle =
        PushHandle { endpoint: Arc::from(endpoint), tx, up: up.clone(), queued: queued.clone(), reset: reset.clone() };
    let endpoint = endpoint.to_string();
    // One session for the stream's life: a reconnect continues its counter.
    let mut sealer = seal_with.sealer(endpoint_port(&endpoint), Direction::ToBound);
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let mut socket = PushSocket::new();
            let mut monitor = socket.monitor();
            // Messages stay queued in the channel while connecting.
            loop {
                if socket.connect(&endpoint).await.is_ok() {
                    break;
                }
                if rx.is_closed() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if !first {
                RECONNECTS.with_label_values(&[&endpoint]).inc();
            }
            first = false;
            up.store(true, Ordering::Release);
            loop {
                tokio::select! {
                    // before any message: one queued after a reset goes to the new peer
                    biased;
                    () = reset.notified() => {
                        tracing::info!(%endpoint, "push stream: peer restarted; reconnecting");
                        break;
                    }
                    out = rx.recv() => {
                        let Some(env) = out else { return };
                        queued.fetch_sub(1, Ordering::AcqRel);
                        let Ok(bytes) = env.encode() else { continue };
                        let frame = ZmqMessage::from(seal(&mut sealer, bytes));
                        match tokio::time::timeout(Duration::from_secs(5), socket.send(frame)).await {
                            Ok(Ok(())) => SENT.with_label_values(&[&endpoint]).inc(),
                            _ => { SEND_ERRORS.with_label_values(&[&endpoint]).inc(); break; }
                        }
                    }
                    ev = monitor.next() => {
                        if matches!(ev, Some(SocketEvent::Disconnected(_)) | None) { break; }
                    }
                }
            }
            up.store(false, Ordering::Release);
            tracing::warn!(%endpoint, "push stream down; reconnecting");
        }
    });
    handle
}
