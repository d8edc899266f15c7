//! The block pool: reference counts, the prefix cache's hash chain, LRU eviction, and
//! generations that move only when a block's content can change (D51).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use pdmesh_engine_core::block_pool::{extend_hashes, root_hash, BlockHash, BlockPool};

fn hashes(tokens: &[u32], bs: u32) -> Vec<BlockHash> {
    let mut v = Vec::new();
    extend_hashes(&root_hash("m"), tokens, bs, &mut v);
    v
}

#[test]
fn allocate_free_and_generations() {
    let mut p = BlockPool::with_caching(4, false);
    let a = p.allocate(3).unwrap();
    assert_eq!(p.num_free(), 1);
    assert!(p.allocate(2).is_none(), "all-or-nothing");
    assert_eq!(p.num_free(), 1);
    let g0 = p.generation(a[0]).unwrap();
    assert_eq!(p.free(&a[..1]), 0);
    assert_eq!(p.generation(a[0]).unwrap(), g0, "a free changes no byte");
    assert_eq!(p.free(&a[..1]), 1, "double free refused");
    assert_eq!(p.free(&[99]), 1, "out of range refused");
    assert_eq!(p.double_frees(), 2);
    assert_eq!(p.num_free(), 2);
    let again = p.allocate(2).unwrap();
    assert!(again.contains(&a[0]));
    assert_eq!(p.generation(a[0]).unwrap(), g0 + 1, "reallocation is a new content");
}

#[test]
fn hash_chain_depends_on_every_earlier_token_and_the_salt() {
    let a: Vec<u32> = (0..8).collect();
    let mut b = a.clone();
    b[0] = 99;
    let (ha, hb) = (hashes(&a, 4), hashes(&b, 4));
    assert_eq!(ha.len(), 2);
    assert_ne!(ha[1], hb[1], "block 1 has the same tokens but another prefix");
    let mut other = Vec::new();
    extend_hashes(&root_hash("other-model"), &a, 4, &mut other);
    assert_ne!(ha[0], other[0]);
    assert_eq!(hashes(&a[..7], 4).len(), 1, "only full blocks are hashed");
}

#[test]
fn freed_cached_blocks_are_hit_then_evicted_lru() {
    let mut p = BlockPool::new(4);
    let h = hashes(&(0..8).collect::<Vec<_>>(), 4);
    let a = p.allocate(2).unwrap();
    assert!(p.cache(a[0], h[0]) && p.cache(a[1], h[1]));
    let gens: Vec<_> = a.iter().map(|&b| p.generation(b)).collect();
    p.free(&a);
    assert_eq!((p.num_free(), p.num_cached(), p.num_cached_free()), (4, 2, 2));
    assert_eq!(p.lookup(&h), a, "freed blocks still hit");
    // A second request shares them; they cannot be evicted while referenced.
    p.touch(&a);
    assert_eq!(p.ref_count(a[0]), 1);
    assert!(p.allocate(3).is_none());
    let other = p.allocate(2).unwrap();
    assert!(!other.contains(&a[0]) && !other.contains(&a[1]));
    assert_eq!(p.counters().evictions, 0);
    p.free(&a);
    assert_eq!(a.iter().map(|&b| p.generation(b)).collect::<Vec<_>>(), gens, "a hit changes no byte");
    // Plain free blocks go before cached ones; then the LRU cached one (the tail block,
    // freed first) is evicted, and only then the head block.
    p.free(&other);
    let x = p.allocate(2).unwrap();
    assert!(!x.contains(&a[0]) && !x.contains(&a[1]));
    let y = p.allocate(1).unwrap();
    assert_eq!(y, vec![a[1]], "the tail of the prefix goes first");
    assert_eq!(p.counters().evictions, 1);
    assert_eq!(p.generation(a[1]), gens[1].map(|g| g + 1));
    assert_eq!(p.lookup(&h), vec![a[0]], "the chain stops at the evicted block");
    assert!(p.is_cached(a[0]) && !p.is_cached(a[1]));
}

#[test]
fn one_block_per_hash_and_reset() {
    let mut p = BlockPool::new(3);
    let h = hashes(&[1, 2], 2);
    let a = p.allocate(2).unwrap();
    assert!(p.cache(a[0], h[0]));
    assert!(!p.cache(a[1], h[0]), "a duplicate content stays uncached");
    assert!(!p.cache(a[0], hashes(&[3, 4], 2)[0]), "a cached block keeps its hash");
    p.free(&a);
    p.reset_cache();
    assert_eq!((p.num_cached(), p.num_free()), (0, 3));
    assert!(p.lookup(&h).is_empty());
    let off = BlockPool::with_caching(2, false);
    assert!(off.lookup(&h).is_empty());
}

#[test]
fn refcounts_refuse_the_extra_free() {
    let mut p = BlockPool::new(2);
    let a = p.allocate(1).unwrap();
    p.touch(&a);
    assert_eq!(p.free(&a), 0);
    assert!(p.is_allocated(a[0]), "one reference left");
    assert_eq!(p.free(&a), 0);
    assert_eq!(p.free(&a), 1);
    assert_eq!(p.double_frees(), 1);
}
