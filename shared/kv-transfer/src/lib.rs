//! The KV transfer agent: how a decode node (D) reads a prefill node's (P) KV blocks.
//!
//! vLLM's NIXL connector, rebuilt for pdmesh (see `docs/KV_TRANSFER.md`). Map of the crate:
//! - [`region`]: the producer's KV cache as a shared-memory file ([`ShmRegion`], a
//!   [`KvBacking`](pdmesh_model_api::kv_cache::KvBacking)), read-only views of it, and the
//!   consumer's in-place writer into its own region ([`KvBlockWriter`]).
//! - [`backend`]: the data planes, one module per backend (`shm`, `tcp`, `cuda`) behind one
//!   trait, and the one place that registers them ([`BackendConfig`] is what P offers).
//! - [`local`]: where a consumer's reads land ([`LocalKv`]: its host region, or with the
//!   `cuda` feature its GPU region), one receive's blocks checked out at a time.
//! - `cuda` (feature `cuda`): GPU regions exported over CUDA IPC, the `cuda` backend's data
//!   path (`pdmesh-cuda-kv`).
//! - [`compat`]: the compatibility hash and the handshake's geometry check.
//! - [`hold`]: P's held requests and read leases ([`HoldTable`]) behind the [`LeasePolicy`]
//!   seam — LIFECYCLE.md rules R2 and R5.
//! - [`agent`]: P's side — [`TransferAgent`] binds the side channel (ZeroMQ ROUTER: handshake,
//!   lease, read done, heartbeat, give up) and starts what its backend offers (for `tcp`, the
//!   block server).
//! - [`client`]: D's side — [`TransferClient`] handshakes and opens the advertised backend's
//!   data plane, [`RemoteAgent`] leases, reads through it (`shm`: one-sided copy from P's
//!   mapping; `tcp`: streamed; `cuda`: one-sided GPU copy from P's exported region) and
//!   notifies; [`RemoteAgents`] caches one agent per remote engine.
//! - [`fault`]: [`FaultConfig`], failures injected for real at the matching points.
//!
//! Everything runs on tokio and works inside an actix System (its current-thread runtime).
//! The wire types live in `pdmesh_protocol::transfer`.

#[cfg(not(target_endian = "little"))]
compile_error!(
    "pdmesh-kv-transfer streams the cache's native f32 bytes as little-endian; big-endian hosts are not supported"
);

pub mod agent;
pub mod backend;
pub mod client;
pub mod compat;
/// The `cuda` backend's data path (CUDA IPC), from `pdmesh-cuda-kv`.
#[cfg(feature = "cuda")]
pub use pdmesh_cuda_kv as cuda;
pub mod error;
pub mod fault;
/// The fuzz targets' entry points (`fuzz/`); only with the `fuzzing` feature.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod hold;
mod layout;
pub mod local;
pub mod region;

pub use agent::{AgentConfig, AgentStats, TransferAgent};
pub use backend::cuda::host_boot_id;
pub use backend::{BackendConfig, ProducerAddress};
pub use client::{
    side_channel_endpoint, ClientConfig, Lease, ReadStats, RemoteAgent, RemoteAgents, TransferClient,
    DEFAULT_CALL_TIMEOUT, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_READ_TIMEOUT,
};
pub use compat::{check_geometry, compat_hash, CompatInputs};
pub use error::{AgentError, HandshakeError, TransferError};
pub use fault::{FaultConfig, FaultParseError};
pub use hold::{
    CapabilityCheck, HeldBlockMs, HeldInfo, HoldCounters, HoldTable, HoldTableConfig, LeaseDecision, LeaseGrant,
    LeasePolicy, LeaseRefusal, NoticeOutcome, ParkedAnswer, SharedPolicy, DEFAULT_EARLY_WAIT,
};
pub use local::{CheckoutError, LocalBlocks, LocalKv, StepWrites};
#[cfg(feature = "cuda")]
pub use local::{DeviceBlockWriter, DeviceCheckout};
pub use pdmesh_mesh_auth::MeshSecret;
pub use region::{BlockCheckout, KvBlockWriter, ShmError, ShmPeerMapping, ShmReadOnly, ShmRegion};
