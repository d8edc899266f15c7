//! `OffloadConnector`: the scheduler side of host-memory KV offload (vLLM's
//! `OffloadingConnector` scheduler role; LMCache's CPU backend plays the same part).
//!
//! Finished requests' full prompt blocks are copied to a CPU store in the connector-worker;
//! a later request whose prompt starts with the same blocks loads them back instead of
//! prefilling them. Blocks are named by a chained content hash (block i's hash covers the
//! hash of block i-1 and block i's token ids, rooted in the model and cache identity), so a
//! match on block i implies the whole prefix up to it matches.
//!
//! This side owns the index ([`OffloadIndex`]: which hash lives in which store slot, LRU
//! order, pins); the worker only copies between device blocks and slots as the step's
//! [`OffloadMetadata`] says (`services/connector-worker/src/offload.rs`). Because the worker
//! applies a step's copies in order before that step's forward pass, a save is in the store
//! before any later step's load reads it, and a load is done by the time its request is
//! reported in `finished_recving`.
//!
//! Lifecycle rules (docs/LIFECYCLE.md, "Offload"):
//! - a block being saved is never freed first: `request_finished` answers `delay_free` while
//!   its save is pending, and the worker reports `finished_sending` after the copy;
//! - a store entry being loaded is never evicted mid-load: it is pinned from the match until
//!   the request's `finished_recving` (or its end);
//! - a request aborted while loading keeps its blocks until the load settles (the engine's
//!   `free_on_recv`, as for P/D loads).

use std::collections::{BTreeMap, HashMap};
use std::sync::LazyLock;

use pdmesh_protocol::{
    FinishedStatus, KvConnectorMetadata, KvConnectorOutput, KvTransferParams, OffloadMetadata, OffloadTransfer,
};
use pdmesh_telemetry::metrics::{counter, gauge};
use prometheus::{IntCounter, IntGauge};
use sha2::{Digest, Sha256};

use crate::connector::KvConnectorScheduler;

static HITS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_offload_hits_total", "Requests whose prompt prefix was found in the offload store")
});
static MISSES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_offload_misses_total", "Requests with at least one full prompt block and none of it stored")
});
static HIT_TOKENS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_offload_hit_tokens_total", "Prompt tokens matched in the offload store"));
static EVICTIONS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_offload_evictions_total", "Blocks evicted from the offload store (LRU)"));
static STORE_FULL: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_offload_save_skipped_total", "Blocks not saved because every store slot was pinned by a load")
});
static INDEXED_BLOCKS: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_offload_indexed_blocks", "Blocks the offload index says are in the store"));
static INVALIDATED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_offload_invalidated_total", "Index entries dropped after the worker refused to load them")
});

/// A block's chained content hash.
pub type BlockHash = [u8; 32];

/// The chained hashes of the full blocks of `tokens`: block i's hash is
/// `sha256(hash of block i-1 | token ids of block i)`, block 0's parent being `root` (the
/// model and cache identity).
pub fn block_hashes(root: &BlockHash, tokens: &[u32], block_size: u32) -> Vec<BlockHash> {
    let mut parent = *root;
    tokens
        .chunks_exact(block_size.max(1) as usize)
        .map(|block| {
            let mut h = Sha256::new();
            h.update(parent);
            for t in block {
                h.update(t.to_le_bytes());
            }
            parent = h.finalize().into();
            parent
        })
        .collect()
}

/// The root of the hash chain: what must be equal for two caches' blocks to be exchangeable
/// (model, block size, anything else the caller puts in `identity`).
pub fn chain_root(identity: &str) -> BlockHash {
    Sha256::digest(identity.as_bytes()).into()
}

/// The 64-bit stamp a slot carries in the worker, to refuse a load from a slot that does not
/// hold that block (an emptied or reused store).
pub fn stamp(hash: &BlockHash) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&hash[..8]);
    u64::from_le_bytes(b)
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: u32,
    /// Loads in progress from this entry: never evicted while above zero.
    pins: u32,
    /// Position in the LRU order (higher = more recent).
    tick: u64,
}

/// The offload store's index: which block hash lives in which of `capacity` slots, in LRU
/// order, with pins for entries being loaded. Pure bookkeeping (no bytes), so it can run in
/// the scheduler process and in tests.
#[derive(Debug)]
pub struct OffloadIndex {
    capacity: u32,
    entries: HashMap<BlockHash, Entry>,
    /// LRU order: tick → hash (every entry, pinned ones included; eviction skips those).
    lru: BTreeMap<u64, BlockHash>,
    free_slots: Vec<u32>,
    tick: u64,
    pub evictions: u64,
    /// Inserts refused because every slot was pinned.
    pub full: u64,
}

impl OffloadIndex {
    pub fn new(capacity_blocks: u32) -> Self {
        Self {
            capacity: capacity_blocks,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            // Lowest slot handed out first.
            free_slots: (0..capacity_blocks).rev().collect(),
            tick: 0,
            evictions: 0,
            full: 0,
        }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.entries.contains_key(hash)
    }

    pub fn slot(&self, hash: &BlockHash) -> Option<u32> {
        self.entries.get(hash).map(|e| e.slot)
    }

    pub fn pins(&self, hash: &BlockHash) -> u32 {
        self.entries.get(hash).map_or(0, |e| e.pins)
    }

    /// How many of `hashes`, from the first, are stored (a chain stops at its first gap).
    pub fn longest_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.entries.contains_key(*h)).count()
    }

    /// Mark `hash` most recently used.
    pub fn touch(&mut self, hash: &BlockHash) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(hash) {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, *hash);
        }
    }

    /// Pin stored entries (a load from them is pending); unknown hashes are skipped.
    pub fn pin(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(e) = self.entries.get_mut(h) {
                e.pins += 1;
            }
        }
    }

    pub fn unpin(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(e) = self.entries.get_mut(h) {
                e.pins = e.pins.saturating_sub(1);
            }
        }
    }

    /// Drop an entry whose slot turned out not to hold it. A pinned one stays (the loads
    /// pinning it will fail the same way and unpin it); its slot is reused only once free.
    pub fn invalidate(&mut self, hash: &BlockHash) -> bool {
        match self.entries.get(hash) {
            Some(e) if e.pins == 0 => {
                let e = *e;
                self.entries.remove(hash);
                self.lru.remove(&e.tick);
                self.free_slots.push(e.slot);
                true
            }
            _ => false,
        }
    }

    /// A slot for a new block `hash`: a free one, else the least recently used unpinned
    /// entry's (evicted). `None` when `hash` is already stored (it is touched instead) or
    /// every slot is pinned.
    pub fn insert(&mut self, hash: BlockHash) -> Option<u32> {
        if self.entries.contains_key(&hash) {
            self.touch(&hash);
            return None;
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                let victim = self.lru.iter().find(|(_, h)| self.entries.get(*h).is_some_and(|e| e.pins == 0));
                let Some((&tick, &victim)) = victim else {
                    self.full += 1;
                    return None;
                };
                self.lru.remove(&tick);
                let e = self.entries.remove(&victim)?;
                self.evictions += 1;
                e.slot
            }
        };
        self.tick += 1;
        self.entries.insert(hash, Entry { slot, pins: 0, tick: self.tick });
        self.lru.insert(self.tick, hash);
        Some(slot)
    }
}

/// Counters of the connector's decisions (also exported as `pdmesh_offload_*`).
#[derive(Debug, Default, Clone)]
pub struct OffloadCounters {
    pub hits: u64,
    pub misses: u64,
    pub hit_tokens: u64,
    pub loads_issued: u64,
    pub saves_issued: u64,
    pub blocks_saved: u64,
    pub load_failures: u64,
}

#[derive(Debug, Default)]
struct ReqState {
    /// Chained hashes of the prompt's full blocks.
    hashes: Vec<BlockHash>,
    /// Entries pinned for this request's load (released when the load settles or the
    /// request ends).
    pinned: Vec<BlockHash>,
    /// The device blocks a load was issued into (to tell its failure in the worker's output).
    loading_into: Vec<u32>,
}

/// The scheduler side of the host-memory KV offload connector.
#[derive(Debug)]
pub struct OffloadConnector {
    block_size: u32,
    root: BlockHash,
    index: OffloadIndex,
    reqs: HashMap<String, ReqState>,
    pending: OffloadMetadata,
    pub counters: OffloadCounters,
}

impl OffloadConnector {
    /// `identity`: the model and cache identity that roots every hash chain (two nodes with
    /// different identities never match each other's blocks); `capacity_blocks`: store slots.
    pub fn new(block_size: u32, capacity_blocks: u32, identity: &str) -> Self {
        Self {
            block_size: block_size.max(1),
            root: chain_root(&format!("{identity}|block_size={block_size}")),
            index: OffloadIndex::new(capacity_blocks),
            reqs: HashMap::new(),
            pending: OffloadMetadata::default(),
            counters: OffloadCounters::default(),
        }
    }

    pub fn index(&self) -> &OffloadIndex {
        &self.index
    }

    fn publish_gauges(&self) {
        INDEXED_BLOCKS.set(self.index.len() as i64);
    }
}

impl KvConnectorScheduler for OffloadConnector {
    fn observe_prompt(&mut self, request_id: &str, prompt_token_ids: &[u32]) {
        let st = self.reqs.entry(request_id.to_string()).or_default();
        if st.hashes.is_empty() {
            st.hashes = block_hashes(&self.root, prompt_token_ids, self.block_size);
        }
    }

    fn get_num_new_matched_tokens(
        &mut self,
        request_id: &str,
        num_prompt_tokens: u32,
        num_computed_tokens: u32,
        _params: Option<&KvTransferParams>,
    ) -> (Option<u32>, bool) {
        // The engine loads into a request that has computed nothing yet; the last prompt
        // token is always computed locally (it yields the first logits), so at most the full
        // blocks before it.
        let loadable = (num_prompt_tokens.saturating_sub(1) / self.block_size) as usize;
        let Some(st) = self.reqs.get_mut(request_id) else { return (Some(0), false) };
        if !st.pinned.is_empty() {
            // Asked again (a MultiConnector sibling could not decide yet): the same answer.
            return (Some(st.pinned.len() as u32 * self.block_size), true);
        }
        if num_computed_tokens > 0 || loadable == 0 {
            return (Some(0), false);
        }
        let candidates = &st.hashes[..loadable.min(st.hashes.len())];
        let found = self.index.longest_prefix(candidates);
        if found == 0 {
            self.counters.misses += 1;
            MISSES.inc();
            return (Some(0), false);
        }
        let matched = candidates[..found].to_vec();
        self.index.pin(&matched);
        for h in &matched {
            self.index.touch(h);
        }
        let tokens = found as u32 * self.block_size;
        self.counters.hits += 1;
        self.counters.hit_tokens += u64::from(tokens);
        HITS.inc();
        HIT_TOKENS.inc_by(u64::from(tokens));
        if let Some(st) = self.reqs.get_mut(request_id) {
            st.pinned = matched;
        }
        (Some(tokens), true)
    }

    fn update_state_after_alloc(&mut self, request_id: &str, block_ids: &[u32], num_external_tokens: u32) {
        let loaded_blocks = (num_external_tokens / self.block_size) as usize;
        let Some(st) = self.reqs.get_mut(request_id) else { return };
        if loaded_blocks == 0 || st.pinned.is_empty() {
            // Not ours to load (another connector's, or computed locally after all).
            let pinned = std::mem::take(&mut st.pinned);
            self.index.unpin(&pinned);
            return;
        }
        let n = loaded_blocks.min(st.pinned.len()).min(block_ids.len());
        // With a local prefix-cache hit, the engine allocated blocks only past it and counts
        // only the tokens after it: load the tail of the matched blocks into them.
        let skip = st.pinned.len().saturating_sub(loaded_blocks);
        let mut load = OffloadTransfer { request_id: request_id.to_string(), ..Default::default() };
        for (h, &block) in st.pinned.iter().skip(skip).zip(block_ids).take(n) {
            let Some(slot) = self.index.slot(h) else { break };
            load.block_ids.push(block);
            load.slots.push(slot);
            load.stamps.push(stamp(h));
        }
        st.loading_into = load.block_ids.clone();
        self.counters.loads_issued += 1;
        self.pending.loads.push(load);
    }

    fn build_connector_meta(&mut self, _step_id: u64) -> KvConnectorMetadata {
        self.publish_gauges();
        KvConnectorMetadata { offload: std::mem::take(&mut self.pending), ..Default::default() }
    }

    fn request_finished(
        &mut self,
        request_id: &str,
        status: FinishedStatus,
        block_ids: &[u32],
        _block_generations: &[u64],
        _params: Option<&KvTransferParams>,
    ) -> (bool, Option<KvTransferParams>) {
        let st = self.reqs.remove(request_id).unwrap_or_default();
        self.index.unpin(&st.pinned);
        // Only a request that ended normally has its whole prompt in KV.
        if !matches!(status, FinishedStatus::Stopped | FinishedStatus::LengthCapped) {
            return (false, None);
        }
        let (evictions, full) = (self.index.evictions, self.index.full);
        let mut save = OffloadTransfer { request_id: request_id.to_string(), ..Default::default() };
        for (h, &block) in st.hashes.iter().zip(block_ids) {
            if let Some(slot) = self.index.insert(*h) {
                save.block_ids.push(block);
                save.slots.push(slot);
                save.stamps.push(stamp(h));
            }
        }
        EVICTIONS.inc_by(self.index.evictions - evictions);
        STORE_FULL.inc_by(self.index.full - full);
        if save.block_ids.is_empty() {
            return (false, None);
        }
        self.counters.saves_issued += 1;
        self.counters.blocks_saved += save.block_ids.len() as u64;
        self.pending.saves.push(save);
        (true, None)
    }

    fn update_connector_output(&mut self, output: &KvConnectorOutput) {
        for id in &output.finished_recving {
            let Some(st) = self.reqs.get_mut(id) else { continue };
            if st.loading_into.is_empty() {
                continue;
            }
            let loading_into = std::mem::take(&mut st.loading_into);
            let pinned = std::mem::take(&mut st.pinned);
            self.index.unpin(&pinned);
            // A refused load names the request's blocks in `invalid_block_ids`: the entries
            // from the first refused block on are not what the index says; drop them.
            if let Some(first_bad) = loading_into.iter().position(|b| output.invalid_block_ids.contains(b)) {
                self.counters.load_failures += 1;
                for h in &pinned[first_bad.min(pinned.len())..] {
                    if self.index.invalidate(h) {
                        INVALIDATED.inc();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> BlockHash {
        [n; 32]
    }

    #[test]
    fn index_evicts_the_least_recently_used_unpinned_block() {
        let mut ix = OffloadIndex::new(3);
        assert_eq!(ix.insert(h(1)), Some(0));
        assert_eq!(ix.insert(h(2)), Some(1));
        assert_eq!(ix.insert(h(3)), Some(2));
        assert_eq!(ix.insert(h(2)), None, "already stored: touched, not saved again");
        // LRU is now 1, 3, 2: inserting 4 evicts 1 and reuses its slot
        assert_eq!(ix.insert(h(4)), Some(0));
        assert!(!ix.contains(&h(1)));
        assert_eq!(ix.evictions, 1);
        // pinning 3 (the LRU) makes 2 the victim
        ix.pin(&[h(3)]);
        assert_eq!(ix.insert(h(5)), Some(1));
        assert!(ix.contains(&h(3)) && !ix.contains(&h(2)));
        assert_eq!(ix.len(), 3, "capacity holds");
    }

    #[test]
    fn index_never_evicts_a_pinned_block_and_refuses_when_all_are_pinned() {
        let mut ix = OffloadIndex::new(2);
        ix.insert(h(1));
        ix.insert(h(2));
        ix.pin(&[h(1), h(2)]);
        assert_eq!(ix.insert(h(3)), None);
        assert_eq!(ix.full, 1);
        assert!(ix.contains(&h(1)) && ix.contains(&h(2)));
        assert!(!ix.invalidate(&h(1)), "a pinned entry is not dropped under its load");
        ix.unpin(&[h(1)]);
        assert_eq!(ix.insert(h(3)), Some(0), "unpinned: evictable again");
        assert_eq!(ix.pins(&h(2)), 1);
    }

    #[test]
    fn chained_hashes_depend_on_the_whole_prefix_and_the_identity() {
        let root = chain_root("model-a");
        let a = block_hashes(&root, &[1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(a.len(), 3, "full blocks only");
        let b = block_hashes(&root, &[9, 2, 3, 4], 2);
        assert_ne!(a[1], b[1], "same tokens in block 1, different block 0");
        assert_eq!(a[..2], block_hashes(&root, &[1, 2, 3, 4], 2)[..]);
        assert_ne!(a[0], block_hashes(&chain_root("model-b"), &[1, 2], 2)[0]);
    }

    fn finish(c: &mut OffloadConnector, id: &str, prompt: &[u32], blocks: &[u32]) -> (bool, KvConnectorMetadata) {
        c.observe_prompt(id, prompt);
        let m = c.get_num_new_matched_tokens(id, prompt.len() as u32, 0, None);
        c.update_state_after_alloc(id, blocks, m.0.unwrap_or(0));
        let (delay, params) = c.request_finished(id, FinishedStatus::Stopped, blocks, &[], None);
        assert!(params.is_none());
        (delay, c.build_connector_meta(0))
    }

    #[test]
    fn a_finished_prompt_is_saved_then_matched_by_full_blocks_short_of_the_last_token() {
        let mut c = OffloadConnector::new(4, 16, "m");
        let prompt: Vec<u32> = (0..12).collect();
        let (delay, meta) = finish(&mut c, "a", &prompt, &[7, 8, 9, 10]);
        assert!(delay, "blocks wait for the save");
        assert_eq!(meta.offload.saves.len(), 1);
        assert_eq!(meta.offload.saves[0].block_ids, vec![7, 8, 9], "full prompt blocks only");
        // the same 12-token prompt: 2 blocks (8 tokens) load, the third holds the last token
        c.observe_prompt("b", &prompt);
        assert_eq!(c.get_num_new_matched_tokens("b", 12, 0, None), (Some(8), true));
        c.update_state_after_alloc("b", &[1, 2, 3], 8);
        let meta = c.build_connector_meta(1);
        assert_eq!(meta.offload.loads[0].block_ids, vec![1, 2]);
        assert_eq!(meta.offload.loads[0].slots, vec![0, 1], "the slots blocks 0 and 1 were saved to");
        assert!(c.index().pins(&block_hashes(&c.root, &prompt, 4)[0]) == 1, "pinned while loading");
        c.update_connector_output(&KvConnectorOutput { finished_recving: vec!["b".into()], ..Default::default() });
        assert_eq!(c.index().pins(&block_hashes(&c.root, &prompt, 4)[0]), 0, "unpinned once loaded");
        // b's own finish saves nothing new: its blocks are stored already
        assert_eq!(c.request_finished("b", FinishedStatus::Stopped, &[1, 2, 3], &[], None), (false, None));
        // a different first block: no match at all
        let other: Vec<u32> = (100..112).collect();
        c.observe_prompt("c", &other);
        assert_eq!(c.get_num_new_matched_tokens("c", 12, 0, None), (Some(0), false));
        assert_eq!((c.counters.hits, c.counters.misses, c.counters.hit_tokens), (1, 2, 8));
    }

    #[test]
    fn an_aborted_request_saves_nothing_and_releases_its_pins() {
        let mut c = OffloadConnector::new(2, 8, "m");
        let prompt = [1, 2, 3, 4, 5];
        finish(&mut c, "a", &prompt, &[1, 2, 3]);
        c.observe_prompt("b", &prompt);
        assert_eq!(c.get_num_new_matched_tokens("b", 5, 0, None), (Some(4), true));
        let first = block_hashes(&c.root, &prompt, 2)[0];
        assert_eq!(c.index().pins(&first), 1);
        assert_eq!(c.request_finished("b", FinishedStatus::Aborted, &[], &[], None), (false, None));
        assert_eq!(c.index().pins(&first), 0);
        assert!(c.build_connector_meta(1).offload.is_empty());
    }

    #[test]
    fn a_refused_load_drops_the_entries_it_named() {
        let mut c = OffloadConnector::new(2, 8, "m");
        let prompt = [1, 2, 3, 4, 5];
        finish(&mut c, "a", &prompt, &[1, 2, 3]);
        c.observe_prompt("b", &prompt);
        c.get_num_new_matched_tokens("b", 5, 0, None);
        c.update_state_after_alloc("b", &[5, 6, 7], 4);
        let _ = c.build_connector_meta(1);
        // the worker refused the second block (say, restarted with an empty store)
        c.update_connector_output(&KvConnectorOutput {
            finished_recving: vec!["b".into()],
            invalid_block_ids: vec![6],
            ..Default::default()
        });
        assert_eq!(c.counters.load_failures, 1);
        c.observe_prompt("c", &prompt);
        assert_eq!(c.get_num_new_matched_tokens("c", 5, 0, None), (Some(2), true), "block 0 still good");
    }
}
