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

// The hash functions live in the protocol crate, so that the dp-lb and the router, which hash
// prompts to route them (D59), can never disagree with the pool.
pub use pdmesh_protocol::prefix::{block_hash, extend_hashes, root_hash, BlockHash};

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

    /// The published keys of the cached blocks (D59): in-use ones first, then free ones most
    /// recently used first, at most `limit` — the blocks next to be evicted are the ones left
    /// out when the pool caches more than a summary may carry.
    pub fn cached_keys(&self, limit: usize) -> Vec<u64> {
        let in_use = self.cached.iter().filter(|(_, &b)| self.ref_count(b) > 0).map(|(h, _)| h);
        let free = self.free.values().rev().filter_map(|&b| self.hash.get(b as usize).and_then(Option::as_ref));
        in_use.chain(free).take(limit).map(pdmesh_protocol::prefix::block_key).collect()
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
