//! The bound side of a ROUTER/DEALER pair.

use actix::{Message as ActixMessage, Recipient};
use bytes::Bytes;
use futures::StreamExt;
use pdmesh_protocol::Envelope;
use tokio::sync::mpsc;
use zeromq::{RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::metrics::{DECODE_ERRORS, RECEIVED, SEND_ERRORS, SENT};
use crate::seal::{endpoint_port, seal, Seal};
use crate::{prepare_ipc_endpoint, TransportError};
use pdmesh_mesh_auth::frame::Direction;

/// The ZeroMQ identity of a connected peer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerId(pub Bytes);

impl std::fmt::Display for PeerId {
    /// A readable identity as text; a random one (a peer that set none) in hex.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(s) if !s.is_empty() && s.chars().all(|c| c.is_ascii_graphic()) => f.write_str(s),
            _ => self.0.iter().try_for_each(|b| write!(f, "{b:02x}")),
        }
    }
}

/// What a ROUTER tells its owner actor.
/// Messages dominate the traffic, so the envelope stays inline (no extra allocation).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, ActixMessage)]
#[rtype(result = "()")]
pub enum RouterEvent {
    Message { peer: PeerId, envelope: Envelope },
    PeerDisconnected { peer: PeerId },
}

/// Clonable handle for sending through a bound ROUTER.
#[derive(Clone, Debug)]
pub struct RouterHandle {
    endpoint: String,
    tx: mpsc::UnboundedSender<(PeerId, Envelope)>,
}

impl RouterHandle {
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Queue a message for `peer`. A peer that is gone is counted and logged by the socket
    /// task (ZeroMQ reports it), never an error for the caller's state machine.
    pub fn send(&self, peer: &PeerId, envelope: Envelope) -> Result<(), TransportError> {
        self.tx.send((peer.clone(), envelope)).map_err(|_| TransportError::Closed)
    }
}

/// Bind a ROUTER on `endpoint`; inbound messages and peer disconnects go to `sink`. Frames
/// are sealed on `tcp://` once the process installed its key ([`crate::seal_tcp_links`]).
pub async fn bind_router(endpoint: &str, sink: Recipient<RouterEvent>) -> Result<RouterHandle, TransportError> {
    bind_router_with(endpoint, sink, Seal::for_endpoint(endpoint)).await
}

/// [`bind_router`] with the sealing chosen by the caller. A refused inbound frame is dropped
/// without an answer.
pub async fn bind_router_with(
    endpoint: &str,
    sink: Recipient<RouterEvent>,
    seal_with: Seal,
) -> Result<RouterHandle, TransportError> {
    prepare_ipc_endpoint(endpoint);
    let mut socket = RouterSocket::new();
    let bound = socket.bind(endpoint).await.map_err(|e| TransportError::Bind(endpoint.to_string(), e.to_string()))?;
    let endpoint = bound.to_string();
    let mut monitor = socket.monitor();
    let (tx, mut rx) = mpsc::unbounded_channel::<(PeerId, Envelope)>();
    let (mut send_half, mut recv_half) = socket.split();
    let label = endpoint.clone();
    let port = endpoint_port(&endpoint);
    let mut sealer = seal_with.sealer(port, Direction::FromBound);
    let mut guard = seal_with.guard(&endpoint, port, Direction::ToBound);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                out = rx.recv() => {
                    let Some((peer, env)) = out else { return };
                    let bytes = match env.encode() {
                        Ok(b) => b,
                        Err(e) => { tracing::error!(error = %e, "cannot encode"); continue; }
                    };
                    let mut msg = ZmqMessage::from(seal(&mut sealer, bytes));
                    msg.push_front(peer.0.clone());
                    match send_half.send(msg).await {
                        Ok(()) => SENT.with_label_values(&[&label]).inc(),
                        Err(e) => {
                            SEND_ERRORS.with_label_values(&[&label]).inc();
                            tracing::debug!(endpoint = %label, %peer, error = %e, "send to peer failed");
                        }
                    }
                }
                msg = recv_half.recv() => {
                    let Ok(msg) = msg else { continue };
                    RECEIVED.with_label_values(&[&label]).inc();
                    let mut frames = msg.into_vec();
                    if frames.len() < 2 {
                        DECODE_ERRORS.with_label_values(&[&label]).inc();
                        continue;
                    }
                    let peer = PeerId(frames.remove(0));
                    let Some(frame) = frames.pop() else { continue };
                    let Some(payload) = guard.open(&frame, Some(&peer)) else { continue };
                    match Envelope::decode(payload) {
                        Ok(envelope) => sink.do_send(RouterEvent::Message { peer, envelope }),
                        Err(e) => {
                            DECODE_ERRORS.with_label_values(&[&label]).inc();
                            tracing::warn!(endpoint = %label, %peer, error = %e, "dropping undecodable frame");
                        }
                    }
                }
                ev = monitor.next() => match ev {
                    Some(SocketEvent::Disconnected(peer)) => {
                        sink.do_send(RouterEvent::PeerDisconnected { peer: PeerId(Bytes::copy_from_slice(&peer)) });
                    }
                    Some(_) => {}
                    None => return,
                },
            }
        }
    });
    Ok(RouterHandle { endpoint, tx })
}
