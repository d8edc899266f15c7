//! The KV cache memory a connector-worker owns.

use crate::ExecutorError;

/// Geometry of a paged KV cache. Per layer, K and V are each
/// `[num_blocks, block_size, num_kv_heads, head_dim]` of `f32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub num_layers: u32,
    pub num_blocks: u32,
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
}

impl KvCacheSpec {
    /// Floats of one block of K (or of V) in one layer.
    pub fn floats_per_block(&self) -> usize {
        self.block_size as usize * self.num_kv_heads as usize * self.head_dim as usize
    }
    /// Floats of K (or V) of one layer.
    pub fn floats_per_layer_side(&self) -> usize {
        self.floats_per_block() * self.num_blocks as usize
    }
    /// Bytes of one block over all layers, K and V: the unit of transfer.
    pub fn bytes_per_block(&self) -> u64 {
        (self.floats_per_block() * 2 * self.num_layers as usize * std::mem::size_of::<f32>()) as u64
    }
    /// Total floats of the cache.
    pub fn total_floats(&self) -> usize {
        self.floats_per_layer_side() * 2 * self.num_layers as usize
    }
}

/// K or V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSide {
    Key = 0,
    Value = 1,
}

/// Memory that a KV cache can live in besides the heap (e.g. a shared-memory file that a
/// transfer backend lets another process read).
pub trait KvBacking: Send + std::fmt::Debug {
    fn as_slice(&self) -> &[f32];
    fn as_mut_slice(&mut self) -> &mut [f32];
}

#[derive(Debug)]
enum KvMemory {
    Heap(Vec<f32>),
    Backed(Box<dyn KvBacking>),
}

/// The KV cache: one contiguous allocation laid out `[layer][K|V][block][slot][head][dim]`, so
/// that one block of one layer side is one contiguous run (the unit a transfer copies) and the
/// whole region can be registered with a transfer backend.
#[derive(Debug)]
pub struct KvCache {
    spec: KvCacheSpec,
    data: KvMemory,
}

impl KvCache {
    /// Allocate a zeroed cache on the heap, touching every page so the memory is really
    /// committed at start rather than at the first long prompt.
    pub fn new_heap(spec: KvCacheSpec) -> Self {
        let mut v = vec![0.0f32; spec.total_floats()];
        for x in v.iter_mut().step_by(1024) {
            *x = 0.0;
        }
        Self { spec, data: KvMemory::Heap(v) }
    }

    /// A heap cache whose pages are left untouched: zeroed memory from the allocator costs no
    /// RAM until written. For an executor whose real cache lives elsewhere (a GPU-resident
    /// cache), to which this one only gives the geometry.
    pub fn new_untouched(spec: KvCacheSpec) -> Self {
        Self { spec, data: KvMemory::Heap(vec![0.0f32; spec.total_floats()]) }
    }

    /// A cache over externally provided memory. `None` if the memory is smaller than the
    /// spec needs.
    pub fn with_backing(spec: KvCacheSpec, backing: Box<dyn KvBacking>) -> Option<Self> {
        if backing.as_slice().len() < spec.total_floats() {
            return None;
        }
        Some(Self { spec, data: KvMemory::Backed(backing) })
    }

    fn data(&self) -> &[f32] {
        match &self.data {
            KvMemory::Heap(v) => v,
            KvMemory::Backed(b) => b.as_slice(),
        }
    }

    fn data_mut(&mut self) -> &mut [f32] {
        match &mut self.data {
            KvMemory::Heap(v) => v,
            KvMemory::Backed(b) => b.as_mut_slice(),
        }
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    fn side_offset(&self, layer: usize, side: KvSide) -> usize {
        (layer * 2 + side as usize) * self.spec.floats_per_layer_side()
    }

    /// K or V of one layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub fn layer(&self, layer: usize, side: KvSide) -> &[f32] {
        let start = self.side_offset(layer, side);
        let len = self.spec.floats_per_layer_side();
        self.data().get(start..start + len).unwrap_or(&[])
    }

    /// Mutable K or V of one layer.
    pub fn layer_mut(&mut self, layer: usize, side: KvSide) -> &mut [f32] {
        let start = self.side_offset(layer, side);
        let len = self.spec.floats_per_layer_side();
        self.data_mut().get_mut(start..start + len).unwrap_or(&mut [])
    }

    /// K and V of one layer, both mutable.
    pub fn layer_kv_mut(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        let start = self.side_offset(layer, KvSide::Key);
        let len = self.spec.floats_per_layer_side();
        match self.data_mut().get_mut(start..start + 2 * len) {
            Some(both) => both.split_at_mut(len),
            None => (&mut [], &mut []),
        }
    }

    /// One block of one layer side.
    pub fn block(&self, layer: usize, side: KvSide, block: u32) -> Result<&[f32], ExecutorError> {
        self.check_block(block)?;
        let per = self.spec.floats_per_block();
        let start = block as usize * per;
        Ok(self.layer(layer, side).get(start..start + per).unwrap_or(&[]))
    }

    /// One block of one layer side, mutable.
    pub fn block_mut(&mut self, layer: usize, side: KvSide, block: u32) -> Result<&mut [f32], ExecutorError> {
        self.check_block(block)?;
        let per = self.spec.floats_per_block();
        let start = block as usize * per;
        Ok(self.layer_mut(layer, side).get_mut(start..start + per).unwrap_or(&mut []))
    }

    pub fn check_block(&self, block: u32) -> Result<(), ExecutorError> {
        if block >= self.spec.num_blocks {
            return Err(ExecutorError::BlockOutOfRange { block, num_blocks: self.spec.num_blocks });
        }
        Ok(())
    }

    /// The whole region (for transfer backends and checksums).
    pub fn as_slice(&self) -> &[f32] {
        self.data()
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self.data_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_do_not_overlap() {
        let spec = KvCacheSpec { num_layers: 2, num_blocks: 4, block_size: 2, num_kv_heads: 1, head_dim: 3 };
        let mut kv = KvCache::new_heap(spec);
        let mut n = 0.0;
        for layer in 0..2 {
            for side in [KvSide::Key, KvSide::Value] {
                for b in 0..4 {
                    for x in kv.block_mut(layer, side, b).unwrap() {
                        *x = n;
                    }
                    n += 1.0;
                }
            }
        }
        // every block holds its own distinct value: no aliasing between layers, sides, blocks
        let mut seen = std::collections::BTreeSet::new();
        for layer in 0..2 {
            for side in [KvSide::Key, KvSide::Value] {
                for b in 0..4 {
                    let blk = kv.block(layer, side, b).unwrap();
                    assert_eq!(blk.len(), 6);
                    assert!(blk.iter().all(|x| *x == blk[0]));
                    assert!(seen.insert(blk[0] as i64));
                }
            }
        }
        assert_eq!(spec.bytes_per_block(), 6 * 2 * 2 * 4);
        assert!(kv.block(0, KvSide::Key, 4).is_err());
    }
}
