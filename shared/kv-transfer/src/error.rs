//! Errors of the transfer agent. Each maps to one load-failure cause of LIFECYCLE.md R3; none
//! is ever a panic.

use std::time::Duration;

use pdmesh_protocol::LeaseRefusalReason;
use thiserror::Error;

use crate::region::ShmError;

/// Why D could not set up a remote agent. Every kind follows the load-failure policy; the
/// failure is not cached, so the next request handshakes again.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HandshakeError {
    /// P's answer was not decodable as metadata (another protocol version, or corrupt).
    #[error("undecodable agent metadata: {0}")]
    UndecodableMetadata(String),
    /// P's model/cache facts hash differently: its KV bytes would mean something else here.
    #[error("compatibility hash mismatch: local {local}, remote {remote}")]
    CompatMismatch { local: String, remote: String },
    /// The side channel answered for another engine than the params named.
    #[error("engine id mismatch: expected {expected}, remote is {found}")]
    EngineIdMismatch { expected: String, found: String },
    /// Same hash, but the geometry or backend cannot be used here (details inside).
    #[error("incompatible remote agent: {0}")]
    Incompatible(String),
    /// No answer within the handshake timeout.
    #[error("no handshake answer within {0:?}")]
    Timeout(Duration),
    /// The side channel cannot be reached (connection refused, bad address).
    #[error("side channel unreachable: {0}")]
    Unreachable(String),
    /// P answered with an error or an unexpected message.
    #[error("side channel refused the handshake: {0}")]
    Remote(String),

    /// The mesh handshake failed: P did not prove it knows the mesh secret, or refused ours.
    #[error("mesh authentication failed: {0}")]
    Unauthenticated(String),
}

/// Why a lease, a read or a notice failed. After any error from `read_blocks` the local
/// blocks named in the call must be treated as invalid.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TransferError {
    /// P refused the lease (or the TCP read): nothing was read.
    #[error("lease refused ({reason:?}): {detail}")]
    LeaseRefused { reason: LeaseRefusalReason, detail: String },
    /// P granted the lease as another agent than the one D handshook with: P restarted since
    /// the handshake, and D's view of it (e.g. its shm mapping) is stale. Nothing was read; a
    /// new handshake gets P's current view, and P grants the same lease again to the same reader.
    #[error(
        "lease {lease_id} granted by agent {granted_by} but the handshake was with {handshake_with} (P restarted)"
    )]
    ProducerRestarted { lease_id: u64, granted_by: String, handshake_with: String },
    /// The lease is not usable for this read (expired, already done, other engine, blocks
    /// not covered): nothing was read.
    #[error("lease not valid for this read: {0}")]
    LeaseInvalid(String),
    /// P answered `read done` saying the lease no longer held: the bytes read may have been
    /// overwritten meanwhile and must not be used.
    #[error("lease lost before read done: {0}")]
    LeaseLost(String),
    /// A block id outside a cache.
    #[error("{which} block {block} is outside the cache ({num_blocks} blocks)")]
    BlockOutOfRange { which: &'static str, block: u32, num_blocks: u32 },
    /// The call itself is malformed (e.g. remote and local block lists of different lengths).
    #[error("bad transfer request: {0}")]
    BadRequest(String),
    /// The read could not start (connect, map, fault injection); local blocks untouched.
    #[error("transfer setup failed: {0}")]
    Setup(String),
    /// The read failed after `bytes_done` bytes were written into local blocks.
    #[error("transfer failed after {bytes_done} bytes: {detail}")]
    Midway { bytes_done: u64, detail: String },
    /// No answer (side channel) or no progress (data plane) within the deadline.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The side channel failed or answered something unexpected.
    #[error("side channel: {0}")]
    SideChannel(String),
}

impl TransferError {
    /// Whether local blocks may have been (partly) written by the failed call.
    pub fn local_blocks_touched(&self) -> bool {
        matches!(self, TransferError::Midway { .. } | TransferError::LeaseLost(_) | TransferError::Timeout(_))
    }
}

/// Why P's agent could not start.
#[derive(Debug, Error)]
pub enum AgentError {
    #[error("invalid agent config: {0}")]
    Config(String),
    #[error("cannot bind {endpoint}: {reason}")]
    Bind { endpoint: String, reason: String },
    #[error(transparent)]
    Shm(#[from] ShmError),
}
