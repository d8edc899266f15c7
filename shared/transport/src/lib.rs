//! ZeroMQ sockets bridged to actix actors.
//!
//! pdmesh processes talk over two socket shapes, both carrying one encoded
//! [`pdmesh_protocol::Envelope`] per frame:
//! - **ROUTER (bind) ⇄ DEALER (connect)** for request/reply and for bidirectional control
//!   links ([`bind_router`], [`connect_dealer`]). The DEALER side correlates replies with
//!   requests ([`LinkHandle::call`]) and answers in-flight calls with an error when the peer
//!   goes away.
//! - **PUSH (connect) → PULL (bind)** for one-way streams such as engine outputs
//!   ([`bind_pull`], [`connect_push`]).
//!
//! The pure-Rust `zeromq` crate does not reconnect DEALER or PUSH sockets whose peer restarts,
//! so every connect-side socket here runs in a supervising task that watches the socket
//! monitor, reports [`LinkEvent::Down`], fails in-flight calls, rebuilds the socket and
//! connects again (`docs/DECISIONS.md`). Inbound frames that fail to decode are logged and
//! counted (`pdmesh_transport_decode_errors_total`), never a panic.
//!
//! Endpoints are `ipc://path` on one host or `tcp://host:port` across hosts. On `tcp://`, once
//! the process installed its node's key ([`seal_tcp_links`]), every frame carries a MAC and
//! receivers drop frames that are not authentic, fresh and new before decoding them
//! ([`seal`], docs/DECISIONS.md D45).

mod link;
mod metrics;
mod router;
pub mod seal;
mod stream;

pub use link::{connect_dealer, LinkConfig, LinkEvent, LinkHandle};
pub use pdmesh_mesh_auth::frame::LinkKey;
pub use router::{bind_router, bind_router_with, PeerId, RouterEvent, RouterHandle};
pub use seal::{seal_tcp_links, tcp_links_sealed, AlreadySealed, Seal};
pub use stream::{bind_pull, bind_pull_with, connect_push, connect_push_with, PullEvent, PushHandle};

use std::time::Duration;
use thiserror::Error;

/// Why a message could not be delivered or answered.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum TransportError {
    /// The peer is not connected (down, restarting, or not started yet).
    #[error("peer {0} is unavailable")]
    Unavailable(String),
    /// The peer went away while a call was in flight.
    #[error("peer {0} went away before answering")]
    PeerGone(String),
    /// No answer within the deadline.
    #[error("no answer from {0} within {1:?}")]
    Timeout(String, Duration),
    #[error("cannot bind {0}: {1}")]
    Bind(String, String),
    #[error("codec error: {0}")]
    Codec(String),
    /// The socket task has stopped (process shutting down).
    #[error("socket closed")]
    Closed,
}

/// Default time to wait for a reply before [`TransportError::Timeout`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Remove the socket file of an `ipc://` endpoint left by a previous process and make sure
/// its directory exists, so that a restarted service can bind again.
pub(crate) fn prepare_ipc_endpoint(endpoint: &str) {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        let path = std::path::Path::new(path);
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = std::fs::remove_file(path);
    }
}
