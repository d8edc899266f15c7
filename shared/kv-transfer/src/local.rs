//! Where a consumer's reads land: blocks of its own KV cache, checked out for one receive.
//!
//! D's worker writes a receive's bytes straight into the blocks the scheduler gave the request
//! (D33): into a second mapping of its shared-memory cache ([`KvBlockWriter`]) when the cache is
//! in host memory, or into its GPU region ([`DeviceBlockWriter`], feature `cuda`) when the cache
//! is on the GPU (`kv_transfer.backend = "cuda"`). Either way a receive first checks out exactly
//! its blocks, and the check-out refuses blocks out of range, named twice, or held by another
//! live receive, so two receives can never write the same block even if a scheduler invariant
//! broke. [`BlockClaims`] is that bookkeeping, shared by both kinds of memory.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use thiserror::Error;

use crate::shm::{BlockCheckout, KvBlockWriter};

/// Why blocks could not be checked out.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CheckoutError {
    #[error("block {block} is outside the cache ({num_blocks} blocks)")]
    OutOfRange { block: u32, num_blocks: u32 },
    #[error("block {0} is named twice")]
    Duplicate(u32),
    #[error("block {0} is being written by another receive")]
    Busy(u32),
}

/// The blocks of one cache that live receives are writing.
#[derive(Debug, Default)]
pub(crate) struct BlockClaims {
    held: Mutex<HashSet<u32>>,
}

impl BlockClaims {
    /// Claim every id of `block_ids` (all or none). Refused if one is out of range, named twice,
    /// or already claimed.
    pub(crate) fn claim(&self, block_ids: &[u32], num_blocks: u32) -> Result<(), CheckoutError> {
        let mut seen = HashSet::with_capacity(block_ids.len());
        for &b in block_ids {
            if b >= num_blocks {
                return Err(CheckoutError::OutOfRange { block: b, num_blocks });
            }
            if !seen.insert(b) {
                return Err(CheckoutError::Duplicate(b));
            }
        }
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&b) = block_ids.iter().find(|b| held.contains(b)) {
            return Err(CheckoutError::Busy(b));
        }
        held.extend(block_ids.iter().copied());
        Ok(())
    }

    /// Give back blocks claimed by one [`Self::claim`].
    pub(crate) fn release(&self, block_ids: &[u32]) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        for b in block_ids {
            held.remove(b);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// A consumer's own KV cache, as its receives write it. Cheap to clone.
#[derive(Debug, Clone)]
pub enum LocalKv {
    /// Host memory: a second mapping of the worker's shared-memory region.
    Host(Arc<KvBlockWriter>),
    /// GPU memory: the region the GPU executor attends over.
    #[cfg(feature = "cuda")]
    Device(Arc<DeviceBlockWriter>),
}

impl LocalKv {
    /// Take `block_ids` (in the order the read fills them) for one receive, until the returned
    /// blocks are dropped.
    pub fn checkout(&self, block_ids: &[u32]) -> Result<LocalBlocks, CheckoutError> {
        match self {
            LocalKv::Host(w) => w.checkout(block_ids).map(LocalBlocks::Host),
            #[cfg(feature = "cuda")]
            LocalKv::Device(w) => w.checkout(block_ids).map(LocalBlocks::Device),
        }
    }
}

/// The blocks of one receive, writable until dropped.
#[derive(Debug)]
pub enum LocalBlocks {
    Host(BlockCheckout),
    #[cfg(feature = "cuda")]
    Device(DeviceCheckout),
}

#[cfg(feature = "cuda")]
pub use device::{DeviceBlockWriter, DeviceCheckout};

#[cfg(feature = "cuda")]
mod device {
    use super::*;
    use pdmesh_cuda_kv::DeviceKvRegion;
    use pdmesh_model_api::KvCacheSpec;

    /// D's receives into its GPU cache region (the `cuda` backend): the device counterpart of
    /// [`KvBlockWriter`]. The copies run on the region's context's default stream, ordered with
    /// the executor's kernels; the check-out keeps two receives off the same blocks, and the
    /// scheduler keeps the executor off a block until its receive is reported finished.
    #[derive(Debug)]
    pub struct DeviceBlockWriter {
        region: Arc<DeviceKvRegion>,
        claims: BlockClaims,
    }

    impl DeviceBlockWriter {
        pub fn new(region: Arc<DeviceKvRegion>) -> Self {
            Self { region, claims: BlockClaims::default() }
        }

        pub fn spec(&self) -> &KvCacheSpec {
            self.region.spec()
        }

        /// As [`KvBlockWriter::checkout`].
        pub fn checkout(self: &Arc<Self>, block_ids: &[u32]) -> Result<DeviceCheckout, CheckoutError> {
            self.claims.claim(block_ids, self.region.spec().num_blocks)?;
            Ok(DeviceCheckout { writer: self.clone(), block_ids: block_ids.to_vec() })
        }
    }

    /// The device blocks of one receive, writable until dropped.
    #[derive(Debug)]
    pub struct DeviceCheckout {
        writer: Arc<DeviceBlockWriter>,
        block_ids: Vec<u32>,
    }

    impl DeviceCheckout {
        pub fn block_ids(&self) -> &[u32] {
            &self.block_ids
        }

        pub fn spec(&self) -> &KvCacheSpec {
            self.writer.spec()
        }

        pub(crate) fn region(&self) -> &DeviceKvRegion {
            &self.writer.region
        }
    }

    impl Drop for DeviceCheckout {
        fn drop(&mut self) {
            self.writer.claims.release(&self.block_ids);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_refuse_range_repeats_and_busy_blocks_and_release_all() {
        let c = BlockClaims::default();
        assert_eq!(c.claim(&[1, 8], 8), Err(CheckoutError::OutOfRange { block: 8, num_blocks: 8 }));
        assert_eq!(c.claim(&[1, 2, 1], 8), Err(CheckoutError::Duplicate(1)));
        assert_eq!(c.len(), 0, "a refused claim takes nothing");
        c.claim(&[1, 2], 8).unwrap();
        assert_eq!(c.claim(&[3, 2], 8), Err(CheckoutError::Busy(2)));
        assert_eq!(c.len(), 2, "a busy claim takes nothing");
        c.claim(&[3], 8).unwrap();
        c.release(&[1, 2]);
        c.claim(&[2], 8).unwrap();
        assert_eq!(c.len(), 2);
    }
}
