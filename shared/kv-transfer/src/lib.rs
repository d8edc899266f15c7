//! The KV transfer agent: how a decode node (D) reads a prefill node's (P) KV blocks.
//!
//! vLLM's NIXL connector, rebuilt for pdmesh (see `docs/KV_TRANSFER.md`). Map of the crate:
//! - [`shm`]: the producer's KV cache as a shared-memory file ([`ShmRegion`], a
//!   [`KvBacking`](pdmesh_model_api::kv_cache::KvBacking)), read-only views of it, and the
//!   consumer's in-place writer into its own region ([`KvBlockWriter`]).
//! - [`compat`]: the compatibility hash and the handshake's geometry check.
//! - [`hold`]: P's held requests and read leases ([`HoldTable`]) behind the [`LeasePolicy`]
//!   seam — LIFECYCLE.md rules R2 and R5.
//! - [`agent`]: P's side — [`TransferAgent`] binds the side channel (ZeroMQ ROUTER: handshake,
//!   lease, read done, heartbeat, give up) and, for `tcp`, the block server.
//! - [`client`]: D's side — [`TransferClient`] handshakes, [`RemoteAgent`] leases, reads
//!   (`shm`: one-sided copy from P's mapping; `tcp`: streamed) and notifies; [`RemoteAgents`]
//!   caches one agent per remote engine.
//! - [`fault`]: [`FaultConfig`], failures injected for real at the matching points.
//!
//! Everything runs on tokio and works inside an actix System (its current-thread runtime).
//! The wire types live in `pdmesh_protocol::transfer`.

#[cfg(not(target_endian = "little"))]
compile_error!(
    "pdmesh-kv-transfer streams the cache's native f32 bytes as little-endian; big-endian hosts are not supported"
);

pub mod agent;
pub mod client;
pub mod compat;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod fault;
pub mod hold;
mod layout;
pub mod shm;
mod tcp;

pub use agent::{AgentConfig, AgentStats, BackendConfig, TransferAgent};
pub use client::{
    side_channel_endpoint, ClientConfig, Lease, ReadStats, RemoteAgent, RemoteAgents, TransferClient,
    DEFAULT_CALL_TIMEOUT, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_READ_TIMEOUT,
};
pub use compat::{check_geometry, compat_hash, CompatInputs};
pub use error::{AgentError, HandshakeError, TransferError};
pub use fault::{FaultConfig, FaultParseError};
pub use hold::{
    HeldBlockMs, HeldInfo, HoldCounters, HoldTable, HoldTableConfig, LeaseGrant, LeasePolicy, LeaseRefusal,
    NoticeOutcome, SharedPolicy,
};
pub use shm::{BlockCheckout, CheckoutError, KvBlockWriter, ShmError, ShmReadOnly, ShmRegion};
