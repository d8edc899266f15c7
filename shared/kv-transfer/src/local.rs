//! Where a consumer's reads land: blocks of its own KV cache, checked out for one receive.
//!
//! D's worker writes a receive's bytes straight into the blocks the scheduler gave the request
//! (D33): into a second mapping of its shared-memory cache ([`KvBlockWriter`]) when the cache is
//! in host memory, or into its GPU region ([`DeviceBlockWriter`], feature `cuda`) when the cache
//! is on the GPU (`kv_transfer.backend = "cuda"`). Either way a receive first checks out exactly
//! its blocks, and the check-out refuses blocks out of range, named twice, or held by another
//! live receive, so two receives can never write the same block even if a scheduler invariant
//! broke. [`BlockClaims`] is that bookkeeping, shared by both kinds of memory.
//!
//! The executor's decode step run ahead of the engine (D67) claims the blocks it writes in the
//! same book ([`LocalKv::claim_step_writes`]): that step is planned before the engine's next
//! schedule, so a block it writes may meanwhile have been freed (its request aborted) and given
//! to a request whose receive starts at once. A receive that meets such a claim waits for the
//! step to end ([`LocalKv::checkout_after_step`]); the step leaves out a row whose block a
//! receive already holds.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use thiserror::Error;

use crate::region::{BlockCheckout, KvBlockWriter};

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

/// Who holds a claimed block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// A live receive writing it.
    Receive,
    /// The executor's step run ahead, writing one slot of it.
    Step,
}

/// The blocks of one cache that live receives, and the executor's step run ahead, are writing.
#[derive(Debug, Default)]
pub(crate) struct BlockClaims {
    held: Mutex<HashMap<u32, Holder>>,
    /// Woken whenever the step run ahead gives its blocks back.
    step_done: Notify,
}

impl BlockClaims {
    /// Claim every id of `block_ids` (all or none) for a receive. Refused if one is out of
    /// range, named twice, or already claimed.
    pub(crate) fn claim(&self, block_ids: &[u32], num_blocks: u32) -> Result<(), CheckoutError> {
        self.claim_as_receive(block_ids, num_blocks).map_err(|(e, _)| e)
    }

    /// As [`Self::claim`], also saying whether a refusal was the step run ahead's (so it ends).
    fn claim_as_receive(&self, block_ids: &[u32], num_blocks: u32) -> Result<(), (CheckoutError, Option<Holder>)> {
        let mut seen = HashSet::with_capacity(block_ids.len());
        for &b in block_ids {
            if b >= num_blocks {
                return Err((CheckoutError::OutOfRange { block: b, num_blocks }, None));
            }
            if !seen.insert(b) {
                return Err((CheckoutError::Duplicate(b), None));
            }
        }
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((&b, &who)) = block_ids.iter().find_map(|b| held.get_key_value(b)) {
            return Err((CheckoutError::Busy(b), Some(who)));
        }
        held.extend(block_ids.iter().map(|&b| (b, Holder::Receive)));
        Ok(())
    }

    /// Claim, for a receive, every id of `block_ids`, waiting while the step run ahead writes
    /// one of them (it ends within one forward pass); refused as [`Self::claim`] otherwise.
    pub(crate) async fn claim_after_step(&self, block_ids: &[u32], num_blocks: u32) -> Result<(), CheckoutError> {
        loop {
            // Registered before the look, so a step ending in between still wakes this one.
            let done = self.step_done.notified();
            match self.claim_as_receive(block_ids, num_blocks) {
                Err((_, Some(Holder::Step))) => done.await,
                other => return other.map_err(|(e, _)| e),
            }
        }
    }

    /// Claim, for the step run ahead, each block of `block_ids` that no receive holds; returns
    /// the ones claimed (give them back with [`Self::release_step`]).
    pub(crate) fn claim_step(&self, block_ids: &[u32]) -> Vec<u32> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let mut claimed = Vec::with_capacity(block_ids.len());
        for &b in block_ids {
            if let std::collections::hash_map::Entry::Vacant(v) = held.entry(b) {
                v.insert(Holder::Step);
                claimed.push(b);
            }
        }
        claimed
    }

    /// Give back the step run ahead's blocks and wake the receives waiting for them.
    pub(crate) fn release_step(&self, block_ids: &[u32]) {
        {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            for b in block_ids {
                if held.get(b) == Some(&Holder::Step) {
                    held.remove(b);
                }
            }
        }
        self.step_done.notify_waiters();
    }

    /// Give back blocks claimed by one [`Self::claim`].
    pub(crate) fn release(&self, block_ids: &[u32]) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        for b in block_ids {
            if held.get(b) == Some(&Holder::Receive) {
                held.remove(b);
            }
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
        self.claims().claim(block_ids, self.num_blocks())?;
        Ok(self.claimed(block_ids))
    }

    /// As [`Self::checkout`], first waiting for the executor's step run ahead to end if it is
    /// writing one of `block_ids`.
    pub async fn checkout_after_step(&self, block_ids: &[u32]) -> Result<LocalBlocks, CheckoutError> {
        self.claims().claim_after_step(block_ids, self.num_blocks()).await?;
        Ok(self.claimed(block_ids))
    }

    /// Claim for the executor's step run ahead the blocks it writes (one per row), except those
    /// a receive is writing. The claim lasts until the returned [`StepWrites`] is dropped.
    pub fn claim_step_writes(&self, block_ids: &[u32]) -> StepWrites {
        StepWrites { blocks: self.claims().claim_step(block_ids), kv: self.clone() }
    }

    /// The blocks of `block_ids`, already claimed for a receive.
    fn claimed(&self, block_ids: &[u32]) -> LocalBlocks {
        match self {
            LocalKv::Host(w) => LocalBlocks::Host(w.claimed(block_ids)),
            #[cfg(feature = "cuda")]
            LocalKv::Device(w) => LocalBlocks::Device(w.claimed(block_ids)),
        }
    }

    fn claims(&self) -> &BlockClaims {
        match self {
            LocalKv::Host(w) => &w.claims,
            #[cfg(feature = "cuda")]
            LocalKv::Device(w) => &w.claims,
        }
    }

    fn num_blocks(&self) -> u32 {
        match self {
            LocalKv::Host(w) => w.spec().num_blocks,
            #[cfg(feature = "cuda")]
            LocalKv::Device(w) => w.spec().num_blocks,
        }
    }
}

/// The blocks the executor's step run ahead writes, claimed until dropped: a receive waiting
/// for one of them goes on then, even if the pass failed or panicked.
#[derive(Debug)]
pub struct StepWrites {
    blocks: Vec<u32>,
    kv: LocalKv,
}

impl StepWrites {
    /// Whether the step holds `block` (a receive held the others when it claimed).
    pub fn holds(&self, block: u32) -> bool {
        self.blocks.contains(&block)
    }
}

impl Drop for StepWrites {
    fn drop(&mut self) {
        self.kv.claims().release_step(&self.blocks);
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
        pub(crate) claims: BlockClaims,
    }

    impl DeviceBlockWriter {
        pub fn new(region: Arc<DeviceKvRegion>) -> Self {
            Self { region, claims: BlockClaims::default() }
        }

        pub fn spec(&self) -> &KvCacheSpec {
            self.region.spec()
        }

        /// The checkout of blocks already claimed for a receive in `claims`.
        pub(crate) fn claimed(self: &Arc<Self>, block_ids: &[u32]) -> DeviceCheckout {
            DeviceCheckout { writer: self.clone(), block_ids: block_ids.to_vec() }
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

    /// The step run ahead and the receives share one book: the step skips blocks a receive
    /// writes, a receive waits for blocks the step writes (and only for those), and neither
    /// gives back the other's blocks.
    #[actix_rt::test]
    async fn a_receive_waits_for_the_step_run_ahead_and_the_step_skips_a_receives_blocks() {
        let c = Arc::new(BlockClaims::default());
        c.claim(&[1], 8).unwrap();
        assert_eq!(c.claim_step(&[1, 2, 3]), vec![2, 3], "block 1 is a receive's");
        c.release_step(&[1]);
        assert_eq!(c.claim(&[1], 8), Err(CheckoutError::Busy(1)), "the step cannot give back a receive's block");
        c.release(&[2]);
        assert_eq!(c.claim(&[2], 8), Err(CheckoutError::Busy(2)), "a receive cannot give back the step's block");
        // Not the step's blocks: no wait. A refusal that is not the step's: no wait either.
        c.claim_after_step(&[4, 5], 8).await.unwrap();
        assert_eq!(c.claim_after_step(&[1], 8).await, Err(CheckoutError::Busy(1)));
        assert_eq!(c.claim_after_step(&[9], 8).await, Err(CheckoutError::OutOfRange { block: 9, num_blocks: 8 }));
        // Block 3 is the step's: the receive waits until the step ends, then takes it.
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let waiter = {
            let c = c.clone();
            actix_rt::spawn(async move {
                let r = c.claim_after_step(&[6, 3], 8).await;
                let _ = tx.send(r);
            })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(rx.try_recv().is_err(), "the receive waits while the step writes block 3");
        assert_eq!(c.len(), 5, "and claims nothing meanwhile: 1 to 5 are held, 6 is not");
        c.release_step(&[2, 3]);
        waiter.await.unwrap();
        assert_eq!(rx.await.unwrap(), Ok(()));
        assert_eq!(c.claim_step(&[3, 6, 7]), vec![7], "3 and 6 are the receive's now");
    }

    /// Through a real cache: the step run ahead's claim lasts as long as its `StepWrites`, a
    /// receive's check-out of one of its blocks waits for it to drop (whatever ended the pass)
    /// and then writes that block in place.
    #[actix_rt::test]
    async fn a_receive_writes_the_step_run_aheads_block_once_its_claim_is_dropped() {
        use pdmesh_model_api::kv_cache::KvSide;
        use pdmesh_model_api::KvCacheSpec;
        let spec = KvCacheSpec { num_layers: 1, num_blocks: 4, block_size: 2, num_kv_heads: 1, head_dim: 4 };
        let name = format!("pdmesh-test-local-{}", uuid::Uuid::new_v4());
        let region = crate::region::ShmRegion::create_for_spec(&name, &spec).unwrap();
        let path = region.path().to_path_buf();
        let cache = region.into_kv_cache(spec).unwrap();
        let local = LocalKv::Host(Arc::new(KvBlockWriter::open(&path, spec).unwrap()));
        let step = local.claim_step_writes(&[2, 3]);
        assert!(step.holds(2) && step.holds(3));
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let receive = {
            let local = local.clone();
            actix_rt::spawn(async move {
                let mut blocks = local.checkout_after_step(&[1, 2]).await.unwrap();
                match &mut blocks {
                    LocalBlocks::Host(b) => b.runs().into_iter().for_each(|run| run.fill(7)),
                    #[cfg(feature = "cuda")]
                    LocalBlocks::Device(_) => unreachable!("a host cache"),
                }
                let _ = tx.send(());
            })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(rx.try_recv().is_err(), "the receive waits while the step holds block 2");
        assert!(local.checkout(&[0, 3]).is_err(), "block 3 is the step's too");
        drop(step);
        // Bounded only so that a claim never given back fails the test instead of hanging it.
        tokio::time::timeout(std::time::Duration::from_secs(30), receive)
            .await
            .expect("the receive went on once the step's claim was dropped")
            .unwrap();
        rx.await.unwrap();
        let byte = |block| cache.block(0, KvSide::Key, block).unwrap()[0].to_ne_bytes()[0];
        assert_eq!((byte(1), byte(2), byte(3)), (7, 7, 0), "the receive wrote its blocks, and only those");
        assert!(local.checkout(&[0, 3]).is_ok(), "the step's other block is free again");
    }
}
