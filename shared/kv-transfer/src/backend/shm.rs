//! The `shm` backend (same host): P's KV cache is a file under `/dev/shm`, and D maps it
//! read-only at handshake and copies leased blocks out of it itself — one-sided, like an RDMA
//! READ: P serves nothing beyond its side channel and does no work for a read.

use futures::future::BoxFuture;
use futures::FutureExt as _;
use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::TransferBackend;

use super::{
    device_cache_refuses, not_mine, served_region, Backend, BackendConfig, BlockRead, DataPlane, Offer, OpenContext,
    ProducerAddress, ServedMemory,
};
use crate::error::{AgentError, HandshakeError, TransferError};
use crate::layout::{region_bytes, run_bytes, run_offset, SIDES};
use crate::region::{copy_run, ShmReadOnly, ShmRegion};

/// The `shm` backend ([`super::registered`]).
pub(crate) struct Shm;

const NAME: &str = "shm";

impl Backend for Shm {
    fn name(&self) -> &'static str {
        NAME
    }

    fn configure(&self, _: &ProducerAddress) -> BackendConfig {
        BackendConfig::Shm
    }

    fn offer<'a>(
        &'a self,
        config: &'a BackendConfig,
        memory: ServedMemory<'a>,
        spec: KvCacheSpec,
    ) -> BoxFuture<'a, Result<Offer, AgentError>> {
        async move {
            let BackendConfig::Shm = config else { return Err(AgentError::Config(not_mine(NAME, config))) };
            let path = memory.region(NAME)?;
            // Checked now so that a short region fails P's start, not every reader's handshake.
            served_region(path, &spec)?;
            let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
            Ok(Offer { advertised: TransferBackend::Shm { path: path.display().to_string() }, server: None })
        }
        .boxed()
    }

    fn open(&self, advertised: &TransferBackend, at: OpenContext<'_>) -> Result<Box<dyn DataPlane>, HandshakeError> {
        let TransferBackend::Shm { path } = advertised else {
            return Err(HandshakeError::Incompatible(not_mine(NAME, advertised)));
        };
        if at.config.local_on_device() {
            return Err(device_cache_refuses(NAME));
        }
        let region = ShmRegion::open_readonly(path)
            .map_err(|e| HandshakeError::Incompatible(format!("cannot map the producer's region: {e}")))?;
        if region.len_bytes() < region_bytes(&at.remote_spec) {
            return Err(HandshakeError::Incompatible(format!(
                "region {path} holds {} bytes, {} advertised",
                region.len_bytes(),
                region_bytes(&at.remote_spec)
            )));
        }
        Ok(Box::new(ShmPlane(region)))
    }
}

/// D's read-only mapping of P's whole cache, kept while D keeps the producer's agent.
#[derive(Debug)]
struct ShmPlane(ShmReadOnly);

impl DataPlane for ShmPlane {
    fn read_host<'a>(
        &'a self,
        read: BlockRead<'a>,
        mut runs: Vec<&'a mut [u8]>,
    ) -> BoxFuture<'a, Result<u64, TransferError>> {
        let copied = copy_from_region(&self.0, read.remote_spec, read.remote_block_ids, &mut runs, read.stop_after);
        futures::future::ready(copied).boxed()
    }
}

/// The one-sided read: copy each leased run out of P's mapping into its local run
/// (`runs`: every run of the local blocks, in wire order).
///
/// Layer-side major (unlike the tcp wire order), P's blocks ascending: consecutive remote
/// blocks of one layer side are adjacent in P's region, so the source is read as a few long
/// ascending streams. Each copy moves one block of one layer side with streaming stores
/// ([`copy_run`]).
fn copy_from_region(
    region: &ShmReadOnly,
    remote_spec: &KvCacheSpec,
    remote_ids: &[u32],
    runs: &mut [&mut [u8]],
    stop_after: Option<u64>,
) -> Result<u64, TransferError> {
    let src = region.bytes();
    let len = run_bytes(remote_spec);
    let per_block = 2 * remote_spec.num_layers as usize;
    let mut done = 0u64;
    // P's blocks in ascending order: the streaming stores do not care in which order the
    // destination is written, the loads do (a descending source stream measured ~15% slower).
    let mut order: Vec<usize> = (0..remote_ids.len()).collect();
    order.sort_by_key(|&i| remote_ids.get(i));
    for layer in 0..remote_spec.num_layers {
        for side in SIDES {
            for &i in &order {
                let Some(&r) = remote_ids.get(i) else { continue };
                let midway = |detail: &str| TransferError::Midway { bytes_done: done, detail: detail.into() };
                if stop_after.is_some_and(|s| done + len as u64 > s) {
                    return Err(midway("fault injection: transfer_midway"));
                }
                let from = run_offset(remote_spec, layer, side, r);
                let s = src.get(from..from + len).ok_or_else(|| midway("block outside the mapped region"))?;
                let wire = i * per_block + 2 * layer as usize + side as usize;
                let d = runs.get_mut(wire).filter(|d| d.len() == len).ok_or_else(|| midway("local run missing"))?;
                copy_run(d, s);
                done += len as u64;
            }
        }
    }
    Ok(done)
}
