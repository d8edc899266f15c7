//! The worker side of host-memory KV offload: a CPU store of KV blocks, and the copies
//! between it and the device cache that a step's [`OffloadMetadata`] asks for.
//!
//! The store is a set of slots, each one KV block over all layers (K and V) plus a stamp of
//! the content hash it holds. The connector-scheduler's index decides which slot holds what
//! (and evicts); this side only copies, and refuses a load whose slot does not carry the
//! expected stamp (a store emptied by a worker restart, say), reporting the request's blocks
//! from that one on in `invalid_block_ids` so the engine applies `kv_load_failure_policy`.
//!
//! Copies run on the executor thread, which owns the KV cache, before the step's forward
//! pass: saves first (their blocks are held by the engine until the request's
//! `finished_sending`, reported in the same step), then loads (their requests wait in
//! `WAITING_FOR_REMOTE_KVS` until `finished_recving`, same step). Slots are allocated on
//! first use, so an idle store costs no memory.

use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{KvCache, KvCacheSpec};
use pdmesh_protocol::{KvConnectorOutput, OffloadMetadata, OffloadTransfer};

use crate::metrics as m;

#[derive(Debug)]
struct Slot {
    stamp: u64,
    /// `[layer][K|V][floats of one block]`.
    data: Vec<f32>,
}

/// Counters of the store's work (also exported as `pdmesh_offload_*`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OffloadWorkerCounters {
    pub saves: u64,
    pub blocks_saved: u64,
    pub loads: u64,
    pub blocks_loaded: u64,
    pub load_failures: u64,
    pub save_failures: u64,
}

/// The CPU store of one worker.
#[derive(Debug)]
pub struct OffloadStore {
    spec: KvCacheSpec,
    slots: Vec<Option<Slot>>,
    pub counters: OffloadWorkerCounters,
}

impl OffloadStore {
    /// A store of `capacity_blocks` slots for blocks of a cache shaped `spec`.
    pub fn new(spec: KvCacheSpec, capacity_blocks: u32) -> Self {
        Self { spec, slots: (0..capacity_blocks).map(|_| None).collect(), counters: Default::default() }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Slots holding a block.
    pub fn stored_blocks(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    pub fn stored_bytes(&self) -> u64 {
        self.stored_blocks() as u64 * self.spec.bytes_per_block()
    }

    /// The stamp slot `slot` carries, if it holds a block.
    pub fn stamp(&self, slot: u32) -> Option<u64> {
        self.slots.get(slot as usize)?.as_ref().map(|s| s.stamp)
    }

    fn sides(&self) -> impl Iterator<Item = (usize, KvSide)> {
        (0..self.spec.num_layers as usize).flat_map(|l| [(l, KvSide::Key), (l, KvSide::Value)])
    }

    /// Copy device block `block` into `slot`, stamped `stamp`.
    pub fn save_block(&mut self, kv: &KvCache, block: u32, slot: u32, stamp: u64) -> Result<(), String> {
        let per = self.spec.floats_per_block();
        let mut data = Vec::with_capacity(per * 2 * self.spec.num_layers as usize);
        for (layer, side) in self.sides() {
            data.extend_from_slice(kv.block(layer, side, block).map_err(|e| e.to_string())?);
        }
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return Err(format!("slot {slot} is outside the store's {} slots", self.slots.len()));
        };
        *s = Some(Slot { stamp, data });
        Ok(())
    }

    /// Copy `slot` into device block `block`, if the slot holds the block stamped `stamp`.
    pub fn load_block(&self, kv: &mut KvCache, block: u32, slot: u32, stamp: u64) -> Result<(), String> {
        let Some(Some(s)) = self.slots.get(slot as usize) else {
            return Err(format!("slot {slot} holds no block"));
        };
        if s.stamp != stamp {
            return Err(format!("slot {slot} holds another block"));
        }
        let per = self.spec.floats_per_block();
        for (i, (layer, side)) in self.sides().enumerate() {
            let dst = kv.block_mut(layer, side, block).map_err(|e| e.to_string())?;
            dst.copy_from_slice(&s.data[i * per..(i + 1) * per]);
        }
        Ok(())
    }

    fn save(&mut self, kv: &KvCache, t: &OffloadTransfer) {
        for ((&block, &slot), &stamp) in t.block_ids.iter().zip(&t.slots).zip(&t.stamps) {
            match self.save_block(kv, block, slot, stamp) {
                Ok(()) => self.counters.blocks_saved += 1,
                Err(why) => {
                    // The slot keeps nothing it could be loaded from by mistake.
                    if let Some(s) = self.slots.get_mut(slot as usize) {
                        *s = None;
                    }
                    self.counters.save_failures += 1;
                    tracing::warn!(request_id = %t.request_id, block, slot, error = %why, "offload save failed");
                }
            }
        }
        self.counters.saves += 1;
    }

    /// The load's blocks from the first refused one on (empty: all loaded).
    fn load(&mut self, kv: &mut KvCache, t: &OffloadTransfer) -> Vec<u32> {
        self.counters.loads += 1;
        for (i, ((&block, &slot), &stamp)) in t.block_ids.iter().zip(&t.slots).zip(&t.stamps).enumerate() {
            if let Err(why) = self.load_block(kv, block, slot, stamp) {
                self.counters.load_failures += 1;
                tracing::warn!(request_id = %t.request_id, block, slot, error = %why, "offload load refused");
                return t.block_ids[i..].to_vec();
            }
            self.counters.blocks_loaded += 1;
        }
        Vec::new()
    }

    /// Apply one step's copies (saves, then loads) and say what settled: every save's request
    /// in `finished_sending` (its blocks may go), every load's in `finished_recving`, with
    /// the blocks of a refused load in `invalid_block_ids`.
    pub fn apply(&mut self, kv: &mut KvCache, meta: &OffloadMetadata) -> KvConnectorOutput {
        let before = self.counters.clone();
        let mut out = KvConnectorOutput::default();
        for t in &meta.saves {
            self.save(kv, t);
            out.finished_sending.push(t.request_id.clone());
        }
        for t in &meta.loads {
            out.invalid_block_ids.extend(self.load(kv, t));
            out.finished_recving.push(t.request_id.clone());
        }
        let c = &self.counters;
        m::OFFLOAD_SAVES.inc_by(c.saves - before.saves);
        m::OFFLOAD_SAVED_BLOCKS.inc_by(c.blocks_saved - before.blocks_saved);
        m::OFFLOAD_LOADS.inc_by(c.loads - before.loads);
        m::OFFLOAD_LOADED_BLOCKS.inc_by(c.blocks_loaded - before.blocks_loaded);
        m::OFFLOAD_LOAD_FAILURES.inc_by(c.load_failures - before.load_failures);
        m::OFFLOAD_SAVE_FAILURES.inc_by(c.save_failures - before.save_failures);
        m::OFFLOAD_STORED_BLOCKS.set(self.stored_blocks() as i64);
        m::OFFLOAD_STORED_BYTES.set(self.stored_bytes() as i64);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> KvCacheSpec {
        KvCacheSpec { num_layers: 2, num_blocks: 6, block_size: 2, num_kv_heads: 1, head_dim: 3 }
    }

    fn fill(kv: &mut KvCache, block: u32, v: f32) {
        for layer in 0..2 {
            for side in [KvSide::Key, KvSide::Value] {
                kv.block_mut(layer, side, block).unwrap().fill(v + layer as f32 * 10.0 + side as u8 as f32);
            }
        }
    }

    fn t(id: &str, blocks: &[u32], slots: &[u32], stamps: &[u64]) -> OffloadTransfer {
        OffloadTransfer { request_id: id.into(), block_ids: blocks.into(), slots: slots.into(), stamps: stamps.into() }
    }

    #[test]
    fn saved_blocks_load_back_byte_for_byte_into_other_blocks() {
        let mut kv = KvCache::new_heap(spec());
        fill(&mut kv, 1, 1.0);
        fill(&mut kv, 2, 2.0);
        let mut store = OffloadStore::new(spec(), 4);
        let out =
            store.apply(&mut kv, &OffloadMetadata { saves: vec![t("a", &[1, 2], &[0, 3], &[11, 22])], loads: vec![] });
        assert_eq!(out.finished_sending, vec!["a".to_string()]);
        assert_eq!((store.stored_blocks(), store.stored_bytes()), (2, 2 * spec().bytes_per_block()));
        // the engine reuses blocks 1 and 2 for other requests
        fill(&mut kv, 1, 9.0);
        fill(&mut kv, 2, 9.0);
        let out =
            store.apply(&mut kv, &OffloadMetadata { saves: vec![], loads: vec![t("b", &[4, 5], &[0, 3], &[11, 22])] });
        assert_eq!(out.finished_recving, vec!["b".to_string()]);
        assert!(out.invalid_block_ids.is_empty());
        for layer in 0..2 {
            for side in [KvSide::Key, KvSide::Value] {
                assert_eq!(kv.block(layer, side, 4).unwrap()[0], 1.0 + layer as f32 * 10.0 + side as u8 as f32);
                assert_eq!(kv.block(layer, side, 5).unwrap()[0], 2.0 + layer as f32 * 10.0 + side as u8 as f32);
            }
        }
        assert_eq!(store.counters.blocks_loaded, 2);
    }

    #[test]
    fn a_slot_without_the_expected_block_is_refused_from_there_on() {
        let mut kv = KvCache::new_heap(spec());
        fill(&mut kv, 1, 1.0);
        let mut store = OffloadStore::new(spec(), 4);
        store.apply(&mut kv, &OffloadMetadata { saves: vec![t("a", &[1], &[0], &[11])], loads: vec![] });
        // slot 0 holds block 1, slot 1 is empty (as in a restarted store): the second block is refused
        let out =
            store.apply(&mut kv, &OffloadMetadata { saves: vec![], loads: vec![t("b", &[3, 4], &[0, 1], &[11, 22])] });
        assert_eq!(out.invalid_block_ids, vec![4]);
        assert_eq!(out.finished_recving, vec!["b".to_string()], "a refused load still settles");
        // slot 0 holds another block than the one asked for
        let out = store.apply(&mut kv, &OffloadMetadata { saves: vec![], loads: vec![t("c", &[3], &[0], &[99])] });
        assert_eq!(out.invalid_block_ids, vec![3]);
        assert_eq!(store.counters.load_failures, 2);
        // a save from a block outside the cache leaves its slot empty, and still settles
        let out = store.apply(&mut kv, &OffloadMetadata { saves: vec![t("d", &[99], &[0], &[11])], loads: vec![] });
        assert_eq!(out.finished_sending, vec!["d".to_string()]);
        assert_eq!(store.stamp(0), None);
    }
}
