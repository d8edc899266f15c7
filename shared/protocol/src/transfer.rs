//! The KV transfer agent's side channel (ZeroMQ ROUTER on P) and the framing of its TCP data
//! plane.
//!
//! D handshakes with P's side channel ([`Message::XferGetMetadata`] →
//! [`Message::XferMetadata`]), takes a read lease for one request's held blocks
//! ([`Message::XferLease`] → [`Message::XferLeaseGranted`] | [`Message::XferLeaseRefused`]),
//! reads the blocks through the backend P advertised, then notifies P
//! ([`Message::XferReadDone`], answered with [`Message::Ack`] while the lease still held, or an
//! [`Message::Error`] when it was lost and the bytes cannot be trusted). D also sends
//! [`Message::XferHeartbeat`] while a request waits, and [`Message::XferGiveUp`] when it will
//! never read. The TCP backend frames one [`Message::XferReadBlocks`] per read, answered by
//! [`Message::XferReadReady`] followed by the raw block bytes.
//!
//! [`Message`]: crate::Message

use serde::{Deserialize, Serialize};

/// Version of the transfer protocol and block layout. Part of the compatibility hash: bump it
/// for any change to [`AgentMetadata`] semantics, the lease rules or the byte layout of a block
/// on the wire, so that mismatched P and D refuse each other at handshake instead of moving
/// wrong bytes.
///
/// 2: every side channel and `tcp` data plane connection authenticates with the mesh secret
/// first ([`AuthHello`] / [`AuthChallenge`] / [`AuthProof`]), and every lease, read and notice
/// carries the request's capability token (docs/DECISIONS.md D40). A version-1 peer neither
/// authenticates nor presents tokens, so it would be refused message by message; the
/// handshake's version check names the real cause instead.
pub const TRANSFER_VERSION: u32 = 2;

/// The one KV layout this build speaks: the cache is `[layer][K|V][block][slot][kv_head][head_dim]`,
/// so one block of one layer side is one contiguous run.
pub const KV_LAYOUT: &str = "layer_kv_block_slot_head_dim";

/// The one element type this build speaks.
pub const KV_DTYPE_F32: &str = "f32";

/// How a consumer reaches the producer's KV bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferBackend {
    /// The producer's cache is a shared-memory file on this host; the consumer maps it
    /// read-only and copies the blocks itself (one-sided, like an RDMA READ).
    Shm { path: String },
    /// The producer serves block reads on a TCP socket (across hosts).
    Tcp { host: String, port: u16 },
    /// The producer's cache is GPU memory exported over CUDA IPC; a consumer on the same host
    /// opens it and copies the blocks device-to-device itself (one-sided).
    Cuda {
        /// The 64-byte `cuIpcMemHandle` of the region, as 128 hex digits.
        ipc_handle: String,
        /// The producer's kernel boot id (`/proc/sys/kernel/random/boot_id`; empty if
        /// unknown): CUDA IPC works only between processes of one host, and containers on one
        /// host share it, so a consumer with another boot id is refused with a clear reason
        /// instead of a driver error.
        host_boot_id: String,
    },
}

/// What a producer's agent tells a consumer at handshake: who it is, how to reach its bytes,
/// and the exact geometry of its cache so the consumer can check it before reading anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    /// The engine id D expects (`kv_transfer_params.remote_engine_id`).
    pub engine_id: String,
    /// Unique per agent incarnation (uuid + pid), so a restarted producer is recognisable.
    pub agent_name: String,
    /// Data-parallel rank of the producer engine.
    pub rank: u32,
    pub backend: TransferBackend,
    /// Always [`KV_LAYOUT`] in this build.
    pub layout: String,
    pub num_layers: u32,
    pub num_blocks: u32,
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    /// Always [`KV_DTYPE_F32`] in this build.
    pub dtype: String,
    /// Bytes of one block over all layers, K and V (the unit of transfer).
    pub bytes_per_block: u64,
    /// Hex sha256 over the model and cache facts both sides must share.
    pub compat_hash: String,
    /// [`TRANSFER_VERSION`] of the producer.
    pub protocol_version: u32,
}

/// D asks for a read lease on one request's held blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferLeaseRequest {
    /// P's request id (`kv_transfer_params.remote_request_id`).
    pub p_request_id: String,
    /// Exactly the block ids P handed out for the request.
    pub block_ids: Vec<u32>,
    /// Exactly the generations P handed out, one per block id.
    pub block_generations: Vec<u64>,
    /// Who will read (D's engine id, rank and agent), for logs and for matching notices.
    pub consumer: String,
    /// The request's capability token (`kv_transfer_params.remote_capability`). A wrong one is
    /// refused exactly like an unknown request.
    #[serde(default)]
    pub capability: String,
}

/// P granted a lease: the blocks stay put until `XferReadDone`, `XferGiveUp` or the lease TTL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferLeaseGranted {
    pub lease_id: u64,
    /// Milliseconds from the grant until the lease expires (relative, so that clock skew
    /// between hosts does not matter).
    pub lease_ttl_ms: u64,
    /// The granting agent's incarnation name (unique per process start). D compares it with
    /// the name from its handshake: a P that restarted since holds unrelated blocks under the
    /// same ids, so a mismatch is refused before any byte is read. Empty from older peers.
    #[serde(default)]
    pub agent_name: String,
}

/// Why P will not let D read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseRefusalReason {
    /// P does not hold (or no longer holds) the request: freed, expired, aborted or never held.
    Gone,
    /// The block ids do not match what P holds for the request.
    BlockMismatch,
    /// The block generations do not match: the reference is stale.
    GenerationMismatch,
    /// The request was aborted while another reader held its lease.
    Aborted,
    /// Another consumer holds the lease.
    AlreadyLeased,
    /// The lease named in a read is unknown, expired, or does not cover the blocks.
    LeaseInvalid,
    /// Refused by fault injection (`lease_refused`).
    FaultInjected,
    /// A reason this build does not know (sent by a newer producer).
    #[serde(other)]
    Other,
}

/// P refused a lease (or a TCP block read).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferLeaseRefused {
    pub reason: LeaseRefusalReason,
    /// Human-readable detail for logs.
    #[serde(default)]
    pub detail: String,
}

/// D finished reading under `lease_id`; P may free the request's blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferReadDone {
    pub p_request_id: String,
    pub lease_id: u64,
    pub consumer: String,
    /// The request's capability token.
    #[serde(default)]
    pub capability: String,
}

/// D still intends to read these requests; P extends their hold deadlines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferHeartbeat {
    pub p_request_ids: Vec<String>,
    #[serde(default)]
    pub consumer: String,
    /// The capability token of each of `p_request_ids`, in the same order; a request whose
    /// token does not match is not extended.
    #[serde(default)]
    pub capabilities: Vec<String>,
}

/// D will never read this request (rejection, abort, load failure, shutdown): P frees at once
/// unless another reader holds a lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferGiveUp {
    pub p_request_id: String,
    pub reason: String,
    #[serde(default)]
    pub consumer: String,
    /// The lease D held, if any: giving up under one's own lease ends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<u64>,
    /// A give-up for a rejection before admission: when D refused (Unix µs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected_at_unix_us: Option<u64>,
    /// The request's capability token.
    #[serde(default)]
    pub capability: String,
}

/// TCP data plane: read these blocks under a lease. Sent as one length-prefixed envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferReadBlocks {
    pub p_request_id: String,
    pub lease_id: u64,
    /// Remote block ids, in the order the bytes are wanted.
    pub block_ids: Vec<u32>,
    /// The request's capability token.
    #[serde(default)]
    pub capability: String,
}

/// TCP data plane: the read was accepted; exactly `bytes` raw bytes follow (per block in
/// request order, per layer K then V, little-endian f32).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XferReadReady {
    pub blocks: u32,
    pub bytes: u64,
}

/// First message on every side channel and `tcp` data plane connection (and, over `tcp`
/// transport, every internal link): the client's fresh nonce. Anything else before the
/// handshake completed is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthHello {
    /// Which channel the client means (`side_channel`, `tcp_data`, `internal`); bound into
    /// both proofs, so a proof for one channel is worthless on another.
    pub channel: String,
    /// 32 bytes from a CSPRNG.
    #[serde(with = "serde_bytes")]
    pub client_nonce: Vec<u8>,
}

/// The server's answer to [`AuthHello`]: its own fresh nonce and its proof that it knows the
/// mesh secret (HMAC-SHA256 over role, channel and both nonces), so the client never hands a
/// request to an impostor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthChallenge {
    #[serde(with = "serde_bytes")]
    pub server_nonce: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub server_proof: Vec<u8>,
}

/// The client's proof for this connection; answered with `Ack`, or an `Unauthenticated` error
/// (and, on a stream, a closed connection).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthProof {
    #[serde(with = "serde_bytes")]
    pub client_proof: Vec<u8>,
}
