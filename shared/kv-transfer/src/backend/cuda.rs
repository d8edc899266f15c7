//! The `cuda` backend (GPU to GPU on one host): P's KV cache is a GPU region exported over
//! CUDA IPC, and D opens the handle once per producer at handshake and copies leased blocks
//! device to device into its own GPU region — one-sided like `shm`: P's GPU does no work for a
//! read (D34).
//!
//! P's side makes no CUDA call (it advertises the handle its executor exported), so it is
//! built without the `cuda` feature too; D's reads need the feature (`pdmesh-cuda-kv`), and a
//! build without it refuses a `cuda` producer at handshake with the reason.

use futures::future::BoxFuture;
use futures::FutureExt as _;
use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::TransferBackend;

use super::{not_mine, Backend, BackendConfig, DataPlane, Offer, OpenContext, ProducerAddress, ServedMemory};
use crate::error::{AgentError, HandshakeError};

/// The `cuda` backend ([`super::registered`]).
pub(crate) struct Cuda;

const NAME: &str = "cuda";

/// This host's kernel boot id (empty if unknown): names the host for CUDA IPC, which works only
/// between processes of one host. Containers on one host share it.
pub fn host_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

impl Backend for Cuda {
    fn name(&self) -> &'static str {
        NAME
    }

    fn configure(&self, _: &ProducerAddress) -> BackendConfig {
        BackendConfig::Cuda
    }

    fn offer<'a>(
        &'a self,
        config: &'a BackendConfig,
        memory: ServedMemory<'a>,
        _: KvCacheSpec,
    ) -> BoxFuture<'a, Result<Offer, AgentError>> {
        async move {
            let BackendConfig::Cuda = config else { return Err(AgentError::Config(not_mine(NAME, config))) };
            let ipc_handle = memory.device(NAME)?;
            if ipc_handle.len() != 128 || !ipc_handle.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(AgentError::Config(format!("not a CUDA IPC handle: {ipc_handle:?}")));
            }
            Ok(Offer { advertised: TransferBackend::Cuda { ipc_handle, host_boot_id: host_boot_id() }, server: None })
        }
        .boxed()
    }

    fn open(&self, advertised: &TransferBackend, at: OpenContext<'_>) -> Result<Box<dyn DataPlane>, HandshakeError> {
        let TransferBackend::Cuda { ipc_handle, host_boot_id } = advertised else {
            return Err(HandshakeError::Incompatible(not_mine(NAME, advertised)));
        };
        open_device(ipc_handle, host_boot_id, at)
    }
}

/// Open a producer's exported region (same host, D's cache on the GPU).
#[cfg(feature = "cuda")]
fn open_device(handle: &str, boot_id: &str, at: OpenContext<'_>) -> Result<Box<dyn DataPlane>, HandshakeError> {
    use pdmesh_cuda_kv::{IpcHandle, RemoteDeviceKv};
    let Some(local) = &at.config.local_device else { return Err(host_cache_refuses()) };
    check_same_host(boot_id)?;
    let handle = IpcHandle::from_hex(handle)
        .ok_or_else(|| HandshakeError::Incompatible(format!("undecodable CUDA IPC handle {handle:?}")))?;
    let remote = RemoteDeviceKv::open(local.context().clone(), &handle, at.remote_spec)
        .map_err(|e| HandshakeError::Incompatible(format!("cannot open the producer's GPU region: {e}")))?;
    Ok(Box::new(device::CudaPlane(remote)))
}

/// Without the feature this node's cache is in host memory: a `cuda` producer is refused.
#[cfg(not(feature = "cuda"))]
fn open_device(_: &str, boot_id: &str, _: OpenContext<'_>) -> Result<Box<dyn DataPlane>, HandshakeError> {
    check_same_host(boot_id)?;
    Err(host_cache_refuses())
}

/// The refusal when a `cuda` producer meets a consumer whose cache is in host memory.
fn host_cache_refuses() -> HandshakeError {
    HandshakeError::Incompatible(
        "the producer serves GPU memory (cuda backend) and this node's KV cache is in host memory: \
         both nodes of a P/D pair need the same backend (kv_transfer.backend)"
            .into(),
    )
}

/// CUDA IPC works between processes of one host only.
fn check_same_host(producer_boot_id: &str) -> Result<(), HandshakeError> {
    let mine = host_boot_id();
    if !producer_boot_id.is_empty() && !mine.is_empty() && producer_boot_id != mine {
        return Err(HandshakeError::Incompatible(
            "the producer's GPU region is on another host and CUDA IPC works within one host: \
             use the tcp backend across hosts"
                .into(),
        ));
    }
    Ok(())
}

/// D's mapping of a producer's GPU region, and its reads.
#[cfg(feature = "cuda")]
mod device {
    use futures::future::BoxFuture;
    use futures::FutureExt as _;
    use pdmesh_cuda_kv::{CudaIpcError, RemoteDeviceKv};

    use crate::backend::{BlockRead, DataPlane};
    use crate::error::TransferError;
    use crate::local::DeviceCheckout;

    /// P's exported GPU region, opened in D's context; closed (unmapped) on drop.
    #[derive(Debug)]
    pub(super) struct CudaPlane(pub(super) RemoteDeviceKv);

    impl DataPlane for CudaPlane {
        fn read_host<'a>(
            &'a self,
            _: BlockRead<'a>,
            _: Vec<&'a mut [u8]>,
        ) -> BoxFuture<'a, Result<u64, TransferError>> {
            let refused =
                TransferError::BadRequest("the producer serves GPU memory; this read targets host memory".into());
            futures::future::ready(Err(refused)).boxed()
        }

        /// Device to device, one 2D copy per run of consecutive blocks, no host staging and no
        /// work on P's side. Any driver error is treated as a read that may have written part
        /// of the blocks.
        fn read_device(&self, read: BlockRead<'_>, local: &mut DeviceCheckout) -> Result<u64, TransferError> {
            let remote_ids = read.remote_block_ids;
            let local_ids = local.block_ids();
            // A driver error may come after some of the copies landed: nothing is known to be done.
            let failed = |e: CudaIpcError| TransferError::Midway { bytes_done: 0, detail: format!("cuda read: {e}") };
            if read.stop_after.is_some() {
                // Half the blocks land, then the transfer fails: what a copy engine error
                // midway leaves behind.
                let half = remote_ids.len() / 2;
                let (r, l) = (remote_ids.get(..half).unwrap_or(&[]), local_ids.get(..half).unwrap_or(&[]));
                let done = self.0.read_blocks(r, local.region(), l).map_err(failed)?;
                return Err(TransferError::Midway {
                    bytes_done: done,
                    detail: "fault injection: transfer_midway".into(),
                });
            }
            self.0.read_blocks(remote_ids, local.region(), local_ids).map_err(failed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_ipc_is_refused_across_hosts() {
        let mine = host_boot_id();
        assert!(check_same_host(&mine).is_ok());
        assert!(check_same_host("").is_ok(), "a producer that cannot tell its host is tried");
        if !mine.is_empty() {
            match check_same_host("00000000-0000-4000-8000-000000000000") {
                Err(HandshakeError::Incompatible(why)) => assert!(why.contains("another host"), "{why}"),
                other => panic!("{other:?}"),
            }
        }
    }
}
