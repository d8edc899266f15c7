//! Where a block's bytes are, in a region laid out `[layer][K|V][block][slot][kv_head][head_dim]`
//! (the [`pdmesh_model_api::KvCache`] layout), and the wire order of a block read.
//!
//! One block of one layer side is one contiguous *run* of `floats_per_block` floats. A block
//! read moves, for each requested block in request order, for each layer, the K run then the
//! V run: `2 * num_layers` runs per block.

use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::KvCacheSpec;

/// The two sides in wire order.
pub(crate) const SIDES: [KvSide; 2] = [KvSide::Key, KvSide::Value];

/// Bytes of one run (one block of one layer side).
pub(crate) fn run_bytes(spec: &KvCacheSpec) -> usize {
    spec.floats_per_block() * std::mem::size_of::<f32>()
}

/// Byte offset of the run `(layer, side, block)` from the start of the region.
pub(crate) fn run_offset(spec: &KvCacheSpec, layer: u32, side: KvSide, block: u32) -> usize {
    let layer_side = layer as usize * 2 + side as usize;
    (layer_side * spec.num_blocks as usize + block as usize) * run_bytes(spec)
}

/// Bytes a region of `spec` must hold.
pub(crate) fn region_bytes(spec: &KvCacheSpec) -> usize {
    spec.total_floats() * std::mem::size_of::<f32>()
}

/// Every run of `blocks`, in wire order, as `(layer, side, position in blocks)`.
pub(crate) fn wire_runs(num_layers: u32, num_blocks: usize) -> impl Iterator<Item = (u32, KvSide, usize)> {
    (0..num_blocks).flat_map(move |i| (0..num_layers).flat_map(move |l| SIDES.into_iter().map(move |s| (l, s, i))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_match_kv_cache_layout() {
        let spec = KvCacheSpec { num_layers: 3, num_blocks: 5, block_size: 2, num_kv_heads: 2, head_dim: 3 };
        let mut kv = pdmesh_model_api::KvCache::new_heap(spec);
        for l in 0..3 {
            for s in SIDES {
                for b in 0..5 {
                    let v = (l * 100 + s as u32 * 10 + b) as f32;
                    kv.block_mut(l as usize, s, b).unwrap().fill(v);
                }
            }
        }
        let all = kv.as_slice();
        for l in 0..3 {
            for s in SIDES {
                for b in 0..5 {
                    let off = run_offset(&spec, l, s, b) / 4;
                    let v = (l * 100 + s as u32 * 10 + b) as f32;
                    assert!(all[off..off + spec.floats_per_block()].iter().all(|x| *x == v));
                }
            }
        }
        assert_eq!(region_bytes(&spec), all.len() * 4);
    }

    #[test]
    fn wire_order_is_block_then_layer_then_k_v() {
        let runs: Vec<_> = wire_runs(2, 2).collect();
        assert_eq!(
            runs,
            vec![
                (0, KvSide::Key, 0),
                (0, KvSide::Value, 0),
                (1, KvSide::Key, 0),
                (1, KvSide::Value, 0),
                (0, KvSide::Key, 1),
                (0, KvSide::Value, 1),
                (1, KvSide::Key, 1),
                (1, KvSide::Value, 1),
            ]
        );
    }
}
