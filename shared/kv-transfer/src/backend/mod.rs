//! The data planes: how a consumer (D) moves a producer's (P) KV blocks, one module per
//! backend, behind one seam (D106).
//!
//! Everything else in the crate — the side channel, the handshake's checks, leases, read done,
//! heartbeats, give-ups, fault injection — is the same for every backend. What differs is
//! only what P offers and advertises, and how D opens and reads it, so that is what a backend
//! provides ([`Backend`]):
//! - P's side: the [`BackendConfig`] a node's settings give ([`Backend::configure`]), and what
//!   its agent offers for its memory: the [`TransferBackend`] it advertises at handshake and,
//!   if the backend needs one, a server of its own beside the side channel ([`Backend::offer`]);
//! - D's side: opening the advertised memory at handshake ([`Backend::open`]), giving a
//!   [`DataPlane`] that reads leased blocks into D's blocks until it is dropped (which closes
//!   it: unmaps, disconnects, releases the IPC mapping).
//!
//! | module | P offers | D reads |
//! |---|---|---|
//! | [`shm`] | its region file (`/dev/shm`), nothing served | maps it read-only, copies one-sided |
//! | [`tcp`] | its region through a block server (`data_port + rank`) | streams into its blocks |
//! | [`cuda`] | its GPU region's CUDA IPC handle (feature `cuda` on D) | device-to-device copy |
//!
//! [`registered`] is the one place that says which module serves which configured kind. A new
//! backend is a module here implementing [`Backend`] (and [`DataPlane`]), its line in
//! [`registered`], and its variant in the enums that name backends: the wire's
//! [`TransferBackend`] (`pdmesh_protocol`), the setting's `TransferBackendKind`
//! (`pdmesh_config`) and [`BackendConfig`]; the compiler then asks for its arm in
//! [`BackendConfig::kind`] and [`advertised_kind`] below.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use pdmesh_config::TransferBackendKind;
use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::TransferBackend;

use crate::agent::Served;
use crate::client::ClientConfig;
use crate::error::{AgentError, HandshakeError, TransferError};
use crate::layout::region_bytes;
#[cfg(feature = "cuda")]
use crate::local::DeviceCheckout;
use crate::region::{ShmReadOnly, ShmRegion};

pub mod cuda;
pub mod shm;
pub mod tcp;

/// The one registration point: the module that serves each kind `kv_transfer.backend` can
/// name. Matched exhaustively, so a new kind of the setting does not build without its line.
pub(crate) fn registered(kind: TransferBackendKind) -> &'static dyn Backend {
    match kind {
        TransferBackendKind::Shm => &shm::Shm,
        TransferBackendKind::Tcp => &tcp::Tcp,
        TransferBackendKind::Cuda => &cuda::Cuda,
    }
}

/// The backend kind of what a producer advertised: which module opens it on D.
pub(crate) fn advertised_kind(advertised: &TransferBackend) -> TransferBackendKind {
    match advertised {
        TransferBackend::Shm { .. } => TransferBackendKind::Shm,
        TransferBackend::Tcp { .. } => TransferBackendKind::Tcp,
        TransferBackend::Cuda { .. } => TransferBackendKind::Cuda,
    }
}

/// Which data plane P offers, with what that backend needs to know to offer it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendConfig {
    /// Consumers on this host map the region file themselves.
    Shm,
    /// P serves block reads on `bind` (`host:port`, port 0 picks one); consumers connect to
    /// `advertise_host` (default: the bound IP, which must then not be unspecified).
    Tcp { bind: String, advertise_host: Option<String> },
    /// P's cache is a GPU region exported over CUDA IPC
    /// ([`TransferAgent::start_device`](crate::TransferAgent::start_device)); consumers on this
    /// host open it and copy device-to-device themselves.
    Cuda,
}

impl BackendConfig {
    /// What a node configured with `kind` offers, at `at` (the node's addresses for this rank).
    /// The one translation of the user-facing setting into the agent's configuration.
    pub fn for_node(kind: TransferBackendKind, at: &ProducerAddress) -> Self {
        registered(kind).configure(at)
    }

    /// The setting's kind of this configuration: which module serves it.
    pub fn kind(&self) -> TransferBackendKind {
        match self {
            Self::Shm => TransferBackendKind::Shm,
            Self::Tcp { .. } => TransferBackendKind::Tcp,
            Self::Cuda => TransferBackendKind::Cuda,
        }
    }

    /// The backend's name, as `kv_transfer.backend` spells it.
    pub fn name(&self) -> &'static str {
        registered(self.kind()).name()
    }
}

/// A producer rank's addresses, from its node's settings: what a backend that serves
/// something of its own (tcp's block server) binds and advertises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerAddress {
    /// The host the node's services bind (`bind_host`).
    pub bind_host: String,
    /// This rank's data port (`kv_transfer.data_port + rank`).
    pub data_port: u16,
    /// The host consumers reach this node at (`kv_transfer.side_channel_host`).
    pub advertise_host: String,
}

/// One backend: what P offers, and how D opens it. Implemented by a unit struct per module;
/// [`registered`] hands out the one instance.
pub(crate) trait Backend: Sync {
    /// The backend's name, as `kv_transfer.backend` spells it; also in logs and refusals.
    fn name(&self) -> &'static str;

    /// The agent configuration of a node configured with this backend (see
    /// [`BackendConfig::for_node`]).
    fn configure(&self, at: &ProducerAddress) -> BackendConfig;

    /// P's side, at agent start: check that `memory` is what this backend serves (refusing
    /// anything else with [`AgentError::Config`]), bind whatever it serves on, and say what to
    /// advertise. `config` is this backend's variant. Nothing is served until the agent runs
    /// [`Offer::server`].
    fn offer<'a>(
        &'a self,
        config: &'a BackendConfig,
        memory: ServedMemory<'a>,
        spec: KvCacheSpec,
    ) -> BoxFuture<'a, Result<Offer, AgentError>>;

    /// D's side, at handshake (after the compatibility and geometry checks): open what the
    /// producer advertised (this backend's variant), or refuse with the reason as
    /// [`HandshakeError::Incompatible`], so the request follows the load-failure policy.
    fn open(&self, advertised: &TransferBackend, at: OpenContext<'_>) -> Result<Box<dyn DataPlane>, HandshakeError>;
}

/// What P's agent serves: its host region (shm, tcp) or its exported GPU region (cuda).
pub(crate) enum ServedMemory<'a> {
    Region(&'a Path),
    Device { ipc_handle: String },
}

impl<'a> ServedMemory<'a> {
    /// The host region, for a backend that serves host memory (`backend`: its name).
    pub(crate) fn region(self, backend: &str) -> Result<&'a Path, AgentError> {
        match self {
            Self::Region(path) => Ok(path),
            Self::Device { .. } => {
                Err(AgentError::Config(format!("a GPU region is served by the cuda backend only, not {backend}")))
            }
        }
    }

    /// The exported GPU region's handle, for a backend that serves GPU memory.
    pub(crate) fn device(self, backend: &str) -> Result<String, AgentError> {
        match self {
            Self::Device { ipc_handle } => Ok(ipc_handle),
            Self::Region(_) => {
                Err(AgentError::Config(format!("the {backend} backend serves a GPU region (start_device)")))
            }
        }
    }
}

/// A server of a backend's own, run by the agent beside its side channel once the agent is up,
/// sharing the side channel's policy, faults, counters and mesh secret. It runs until the
/// agent drops it.
pub(crate) type BackendServer = Box<dyn FnOnce(Arc<Served>) -> BoxFuture<'static, ()> + Send>;

/// What P's agent offers through one backend.
pub(crate) struct Offer {
    /// What the agent advertises at handshake (`AgentMetadata::backend`).
    pub advertised: TransferBackend,
    /// The backend's own server, if it has one (tcp's block server).
    pub server: Option<BackendServer>,
}

/// What a backend opening a producer's memory at handshake may need from D's side.
#[derive(Clone, Copy)]
pub(crate) struct OpenContext<'a> {
    pub config: &'a ClientConfig,
    /// P's geometry: D's, with P's block count.
    pub remote_spec: KvCacheSpec,
}

/// One leased read, as the data plane needs it (the lease and the blocks were checked by the
/// caller, [`RemoteAgent`](crate::RemoteAgent), before the plane is asked).
pub(crate) struct BlockRead<'a> {
    /// The lease the read is under: a backend whose producer serves reads presents it.
    pub p_request_id: &'a str,
    pub lease_id: u64,
    pub capability: &'a str,
    /// P's blocks, paired in order with D's local blocks.
    pub remote_block_ids: &'a [u32],
    pub remote_spec: &'a KvCacheSpec,
    /// Fault injection (`transfer_midway`): end the read once about this many bytes moved.
    pub stop_after: Option<u64>,
    /// How long a read may take when the backend waits on the producer.
    pub read_timeout: Duration,
}

/// D's open data plane to one producer, from [`Backend::open`]. Shared by every request to
/// that producer (reads may run concurrently); dropping it closes it.
pub(crate) trait DataPlane: std::fmt::Debug + Send + Sync {
    /// Move the leased remote blocks into host memory: `runs` holds every run (one block of
    /// one layer side) of the local blocks, in wire order (per block, every layer's K then V).
    /// Returns the bytes moved. A backend whose producer serves GPU memory refuses.
    fn read_host<'a>(
        &'a self,
        read: BlockRead<'a>,
        runs: Vec<&'a mut [u8]>,
    ) -> BoxFuture<'a, Result<u64, TransferError>>;

    /// Move the leased remote blocks into blocks checked out of D's GPU region. Returns the
    /// bytes moved. Only a backend whose producer serves GPU memory can.
    #[cfg(feature = "cuda")]
    fn read_device(&self, read: BlockRead<'_>, local: &mut DeviceCheckout) -> Result<u64, TransferError> {
        let _ = (read, local);
        Err(TransferError::BadRequest("the producer serves host memory; this read targets the GPU".into()))
    }
}

/// P's own host region, checked to hold the whole cache (the backends that serve host memory).
pub(crate) fn served_region(path: &Path, spec: &KvCacheSpec) -> Result<ShmReadOnly, AgentError> {
    let region = ShmRegion::open_readonly(path)?;
    let need = region_bytes(spec);
    if region.len_bytes() < need {
        return Err(AgentError::Config(format!(
            "region {} holds {} bytes, the cache needs {need}",
            path.display(),
            region.len_bytes()
        )));
    }
    Ok(region)
}

/// D's refusal of a producer serving host memory when D's cache is on the GPU.
pub(crate) fn device_cache_refuses(backend: &str) -> HandshakeError {
    HandshakeError::Incompatible(format!(
        "this node's KV cache is on the GPU (kv_transfer.backend = \"cuda\") and the producer \
         serves host memory ({backend}): both nodes of a P/D pair need the same backend"
    ))
}

/// The answer of a backend handed another backend's configuration or advertisement: only a
/// broken registration gets here.
pub(crate) fn not_mine(backend: &str, what: &dyn std::fmt::Debug) -> String {
    format!("the {backend} backend was handed {what:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [TransferBackendKind; 3] =
        [TransferBackendKind::Shm, TransferBackendKind::Tcp, TransferBackendKind::Cuda];

    fn at() -> ProducerAddress {
        ProducerAddress { bind_host: "0.0.0.0".into(), data_port: 5701, advertise_host: "10.0.0.1".into() }
    }

    /// Each kind of the setting reaches its own module, whose configuration names it back, and
    /// the names are the setting's own spelling.
    #[test]
    fn every_kind_is_registered_once_under_its_own_name() {
        for kind in KINDS {
            let config = BackendConfig::for_node(kind, &at());
            assert_eq!(config.kind(), kind);
            assert_eq!(TransferBackendKind::parse(config.name()), Some(kind), "{config:?}");
        }
        let mut names: Vec<&str> = KINDS.iter().map(|k| registered(*k).name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), KINDS.len());
    }

    /// The tcp backend binds the node's bind host at this rank's data port and advertises the
    /// side channel host, as the worker did before the registry.
    #[test]
    fn the_node_settings_map_to_the_agent_configuration() {
        assert_eq!(BackendConfig::for_node(TransferBackendKind::Shm, &at()), BackendConfig::Shm);
        assert_eq!(BackendConfig::for_node(TransferBackendKind::Cuda, &at()), BackendConfig::Cuda);
        assert_eq!(
            BackendConfig::for_node(TransferBackendKind::Tcp, &at()),
            BackendConfig::Tcp { bind: "0.0.0.0:5701".into(), advertise_host: Some("10.0.0.1".into()) }
        );
    }

    /// What each backend advertises is opened by the same module on D.
    #[test]
    fn each_advertisement_belongs_to_its_backend() {
        let advertised = [
            TransferBackend::Shm { path: "/dev/shm/x".into() },
            TransferBackend::Tcp { host: "h".into(), port: 1 },
            TransferBackend::Cuda { ipc_handle: String::new(), host_boot_id: String::new() },
        ];
        for (adv, kind) in advertised.iter().zip(KINDS) {
            assert_eq!(advertised_kind(adv), kind);
        }
    }
}
