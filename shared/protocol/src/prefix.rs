//! The prefix cache's block hashes (D51) and the summary of them a node publishes (D59).
//!
//! One definition for every process that hashes a prompt: engine-core registers and looks up
//! blocks under these hashes, the dp-lb and the router compute the same chain over a request's
//! prompt to see which rank or node already holds its prefix. Were the functions copied, a
//! change on one side would silently turn every routing decision into a miss.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The hash of a full block and, through the chain, of every token before it.
pub type BlockHash = [u8; 32];

/// Most block keys one rank publishes in a [`PrefixSummary`]: a bound on the message (8 bytes
/// a key) whatever the pool size; a pool with more cached blocks publishes its most recently
/// used ones.
pub const MAX_PUBLISHED_BLOCKS: usize = 65_536;

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

/// The published key of a block: the first 8 bytes of its hash. A collision among the few
/// thousand blocks of a node costs one misrouted request, never a wrong answer (the engine
/// matches full hashes), so 8 bytes a block is enough for the summary.
pub fn block_key(hash: &BlockHash) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&hash[..8]);
    u64::from_le_bytes(b)
}

/// The keys of the full blocks of `tokens` under a node's root and block size.
pub fn prompt_keys(root: &BlockHash, block_size: u32, tokens: &[u32]) -> Vec<u64> {
    let mut hashes = Vec::new();
    extend_hashes(root, tokens, block_size, &mut hashes);
    hashes.iter().map(block_key).collect()
}

/// What one rank holds in its prefix cache, as its stats answer publishes it: enough for a
/// router or dp-lb to hash a prompt the same way and count the blocks it would hit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixSummary {
    /// Tokens per block.
    pub block_size: u32,
    /// The root of the rank's hash chains (salted with its model), so a reader needs no salt.
    #[serde(with = "serde_bytes")]
    pub root: Vec<u8>,
    /// [`block_key`]s of the cached blocks (at most [`MAX_PUBLISHED_BLOCKS`]).
    pub blocks: Vec<u64>,
}

impl PrefixSummary {
    /// The root as a chain root; `None` when the rank sent something else than 32 bytes.
    pub fn root_hash(&self) -> Option<BlockHash> {
        BlockHash::try_from(self.root.as_slice()).ok()
    }
}

/// How many of `keys` (a prompt's block keys, in order) `held` holds counting from the first
/// block: the blocks a request would hit, since a cache hit stops at the first miss.
pub fn prefix_overlap(keys: &[u64], held: impl Fn(u64) -> bool) -> usize {
    keys.iter().take_while(|k| held(**k)).count()
}

/// A node's or rank's [`PrefixSummary`] ready for lookups. Built from each new summary (a
/// snapshot replaces the last one whole, so there is no event stream to lose or replay).
#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    root: Option<BlockHash>,
    block_size: u32,
    blocks: std::collections::HashSet<u64>,
}

impl PrefixIndex {
    /// The index of `summary` (one that matches nothing for a malformed root).
    pub fn from_summary(summary: &PrefixSummary) -> Self {
        Self {
            root: summary.root_hash(),
            block_size: summary.block_size,
            blocks: summary.blocks.iter().copied().collect(),
        }
    }

    /// The prompt's block keys as this index hashes them: `None` when it holds nothing.
    pub fn keys_of(&self, tokens: &[u32]) -> Option<Vec<u64>> {
        let root = self.root.as_ref().filter(|_| !self.blocks.is_empty())?;
        Some(prompt_keys(root, self.block_size, tokens))
    }

    /// Whether `other` hashes prompts the same way (same root and block size), so that the keys
    /// computed for one serve for the other.
    pub fn same_chain(&self, other: &Self) -> bool {
        self.root == other.root && self.block_size == other.block_size
    }

    /// Of `keys` (from [`PrefixIndex::keys_of`]), the blocks held counting from the first.
    pub fn overlap_of(&self, keys: &[u64]) -> usize {
        prefix_overlap(keys, |k| self.blocks.contains(&k))
    }

    /// Full blocks of `tokens`, from the first, this index holds.
    pub fn overlap(&self, tokens: &[u32]) -> usize {
        self.keys_of(tokens).map_or(0, |keys| self.overlap_of(&keys))
    }

    /// Tokens per block of the chain (0 for an index built from nothing).
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_counts_from_the_first_block_only() {
        let root = root_hash("m");
        let tokens: Vec<u32> = (0..40).collect();
        let keys = prompt_keys(&root, 16, &tokens);
        assert_eq!(keys.len(), 2, "partial blocks are not hashed");
        assert_eq!(prefix_overlap(&keys, |k| k == keys[0]), 1);
        assert_eq!(prefix_overlap(&keys, |k| k == keys[1]), 0, "a hit after a miss does not count");
        assert_eq!(prefix_overlap(&keys, |_| true), 2);
        let other = prompt_keys(&root_hash("n"), 16, &tokens);
        assert_ne!(keys, other, "another model's blocks never match");
    }
}
