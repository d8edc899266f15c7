//! The pool of KV-cache blocks of one engine rank, with automatic prefix caching (vLLM's
//! `BlockPool` + `FreeKVCacheBlockQueue` semantics, our own code).
//!
//! Every block has a reference count: a live request that uses it, a finished request whose
//! blocks the connector holds for a remote reader, or a request parked until its READ settles
//! each count once. Who the references are is the scheduler's business; the pool only refuses
//! to let a count go below zero (a double free is refused and counted, never a panic).
//!
//! **Prefix caching.** A *full* block whose KV has been computed can be registered under its
//! [`BlockHash`], a hash chained over the hash of the block before it, the block's token ids
//! and a salt naming everything else that changes the KV (the model). A later request whose
//! prompt starts with the same tokens finds the block by hash ([`BlockPool::lookup`]) and takes
//! a reference to it ([`BlockPool::touch`]) instead of recomputing it. When the last reference
//! goes, a cached block is *not* forgotten: it joins the tail of the free queue with its hash,
//! and a later request can still hit it. Allocation takes free blocks from the head of the
//! queue — blocks that cache nothing first, then cached ones least-recently-used — and only
//! then does a cached block lose its hash (an *eviction*).
//!
//! **Generations.** Each block carries a generation that is bumped exactly when its content
//! may change: when [`BlockPool::allocate`] hands it out for new KV (after a plain free, or
//! by evicting its cached content). Freeing a block and hitting it in the cache leave the
//! generation alone, because neither changes a byte. So a `(block, generation)` pair names
//! one content: P hands D the generations with the block ids of a request it holds, and its
//! hold table refuses a lease whose generations differ; a test that remembers a block's
//! generation sees any reuse as a different generation. A block with a reference (held,
//! leased, parked or in use) is never in the free queue, so it is never evicted and its
//! generation never moves while anyone relies on it.
//!
//! **Who writes a block.** Only the request that allocated a block writes KV into it (its own
//! prefill and decode, or D's READ into it); a request that hits a cached block starts
//! computing after it (its `num_computed_tokens` is past the block), so shared blocks are
//! read-only. Registering happens only after the KV is in the block (the scheduler caches a
//! block once the step that computed its last token has run).

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

/// The hash of a full block and, through the chain, of every token before it.
pub type BlockHash = [u8; 32];

/// The root of a request's hash chain: the salt names what, besides the tokens, makes the
/// KV what it is (the model), so blocks of another model never match.
pub fn root_hash(salt: &str) -> BlockHash {
    let mut h = Sha256::new();
    h.update(b"pdmesh-kv-prefix-v1\0");
    h.update(salt.as_bytes());
    h.finalize().into()
}

/// The hash of one full block: the parent's hash (the root for the first block) and the
/// block's token ids, little-endian.
pub fn block_hash(parent: &BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// Extend `hashes` with the hashes of every full block of `tokens` not hashed yet.
pub fn extend_hashes(root: &BlockHash, tokens: &[u32], block_size: u32, hashes: &mut Vec<BlockHash>) {
    let bs = block_size.max(1) as usize;
    let full = tokens.len() / bs;
    while hashes.len() < full {
        let i = hashes.len();
        let parent = hashes.last().copied().unwrap_or(*root);
        let Some(chunk) = tokens.get(i * bs..(i + 1) * bs) else { return };
        hashes.push(block_hash(&parent, chunk));
    }
}

/// Counters of the cache, exported as metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheCounters {
    /// Cached blocks whose content was dropped to make room for new KV.
    pub evictions: u64,
    /// Times the whole cache was dropped (the worker that held the KV restarted).
    pub resets: u64,
}

#[derive(Debug)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    generation: Vec<u64>,
    /// The hash a block is cached under, if any.
    hash: Vec<Option<BlockHash>>,
    /// Cached blocks by hash (one block per hash: a second block computed with the same
    /// content stays uncached).
    cached: HashMap<BlockHash, u32>,
    /// Free blocks in allocation order: uncached ones get keys below zero (taken first),
    /// cached ones keys above zero in the order they were freed (least-recently-used first).
    free: BTreeMap<i64, u32>,
    /// Each free block's key in `free`.
    free_key: Vec<Option<i64>>,
    next_front: i64,
    next_back: i64,
    caching: bool,
    double_frees: u64,
    counters: CacheCounters,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, with prefix caching on.
    pub fn new(num_blocks: u32) -> Self {
        Self::with_caching(num_blocks, true)
    }

    /// A pool of `num_blocks` blocks; `caching = false` never registers a block, so every
    /// free block is plain free (vLLM's `enable_prefix_caching = False`).
    pub fn with_caching(num_blocks: u32, caching: bool) -> Self {
        let n = num_blocks as usize;
        let mut pool = Self {
            ref_cnt: vec![0; n],
            generation: vec![0; n],
            hash: vec![None; n],
            cached: HashMap::new(),
            free: BTreeMap::new(),
            free_key: vec![None; n],
            next_front: -1,
            next_back: 1,
            caching,
            double_frees: 0,
            counters: CacheCounters::default(),
        };
        // Block 0 first, as before caching existed (tests and logs read better).
        for b in (0..num_blocks).rev() {
            pool.enqueue(b);
        }
        pool
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    pub fn num_blocks(&self) -> u32 {
        self.ref_cnt.len() as u32
    }

    /// Blocks nobody references: plain free ones and cached ones that can be evicted.
    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Blocks registered in the cache (referenced or not).
    pub fn num_cached(&self) -> u32 {
        self.cached.len() as u32
    }

    /// Cached blocks nobody references (evictable).
    pub fn num_cached_free(&self) -> u32 {
        self.cached.values().filter(|&&b| self.ref_count(b) == 0).count() as u32
    }

    pub fn counters(&self) -> CacheCounters {
        self.counters
    }

    fn enqueue(&mut self, b: u32) {
        let cached = self.hash.get(b as usize).is_some_and(Option::is_some);
        let key = if cached {
            self.next_back += 1;
            self.next_back
        } else {
            self.next_front -= 1;
            self.next_front
        };
        self.free.insert(key, b);
        if let Some(k) = self.free_key.get_mut(b as usize) {
            *k = Some(key);
        }
    }

    fn dequeue(&mut self, b: u32) {
        if let Some(key) = self.free_key.get_mut(b as usize).and_then(Option::take) {
            self.free.remove(&key);
        }
    }

    /// Drop a block's cached content (it is about to be rewritten, or the KV is gone).
    fn uncache(&mut self, b: u32) -> bool {
        let Some(h) = self.hash.get_mut(b as usize).and_then(Option::take) else { return false };
        if self.cached.get(&h) == Some(&b) {
            self.cached.remove(&h);
        }
        true
    }

    /// Take `n` blocks for new KV, or none at all if fewer are free. Plain free blocks go
    /// first, then cached ones least-recently-used (evicted: their hash is dropped). Every
    /// block handed out gets a new generation.
    pub fn allocate(&mut self, n: u32) -> Option<Vec<u32>> {
        if n as usize > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let (_, b) = self.free.pop_first()?;
            if let Some(k) = self.free_key.get_mut(b as usize) {
                *k = None;
            }
            if self.uncache(b) {
                self.counters.evictions += 1;
            }
            if let Some(g) = self.generation.get_mut(b as usize) {
                *g += 1;
            }
            if let Some(r) = self.ref_cnt.get_mut(b as usize) {
                *r = 1;
            }
            out.push(b);
        }
        Some(out)
    }

    /// The cached blocks of the longest prefix of `hashes` (a chain: block `i` only counts if
    /// blocks `0..i` do).
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<u32> {
        if !self.caching {
            return Vec::new();
        }
        hashes.iter().map_while(|h| self.cached.get(h).copied()).collect()
    }

    /// Take a reference to each of `blocks` (cache hits): a block nobody referenced leaves the
    /// free queue, so it can no longer be evicted.
    pub fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if self.ref_count(b) == 0 {
                self.dequeue(b);
            }
            if let Some(r) = self.ref_cnt.get_mut(b as usize) {
                *r += 1;
            }
        }
    }

    /// Register `block` (referenced, its KV computed) under `hash`. A block already cached, or
    /// a hash another block is cached under, is left as it is. Returns whether it was added.
    pub fn cache(&mut self, block: u32, hash: BlockHash) -> bool {
        if !self.caching || self.ref_count(block) == 0 || self.cached.contains_key(&hash) {
            return false;
        }
        match self.hash.get_mut(block as usize) {
            Some(slot @ None) => {
                *slot = Some(hash);
                self.cached.insert(hash, block);
                true
            }
            _ => false,
        }
    }

    /// Drop one reference to each of `blocks`, the last block first (so that, among blocks
    /// freed together, the end of a sequence is evicted before its more shareable start).
    /// Blocks without a reference (double free, or out of range) are skipped and counted;
    /// returns how many were refused.
    pub fn free(&mut self, blocks: &[u32]) -> u32 {
        let mut refused = 0;
        for &b in blocks.iter().rev() {
            match self.ref_cnt.get_mut(b as usize) {
                Some(r) if *r > 0 => {
                    *r -= 1;
                    if *r == 0 {
                        self.enqueue(b);
                    }
                }
                _ => refused += 1,
            }
        }
        if refused > 0 {
            self.double_frees += u64::from(refused);
            tracing::error!(refused, "refused to free blocks that are not allocated");
        }
        refused
    }

    /// Forget every cached content (the KV behind it is gone, e.g. the worker restarted).
    /// Blocks still referenced keep their references; free ones become plain free.
    pub fn reset_cache(&mut self) {
        let blocks: Vec<u32> = self.cached.values().copied().collect();
        for b in blocks {
            self.uncache(b);
            if self.ref_count(b) == 0 {
                // Re-queue as a plain free block (taken before cached ones).
                self.dequeue(b);
                self.enqueue(b);
            }
        }
        self.counters.resets += 1;
    }

    pub fn generation(&self, block: u32) -> Option<u64> {
        self.generation.get(block as usize).copied()
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_cnt.get(block as usize).copied().unwrap_or(0)
    }

    /// Whether anyone references `block`.
    pub fn is_allocated(&self, block: u32) -> bool {
        self.ref_count(block) > 0
    }

    /// Whether `block` is registered in the cache.
    pub fn is_cached(&self, block: u32) -> bool {
        self.hash.get(block as usize).is_some_and(Option::is_some)
    }

    pub fn double_frees(&self) -> u64 {
        self.double_frees
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
