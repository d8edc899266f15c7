//! Rank choice for requests no client pinned (`X-data-parallel-rank`): one file per policy
//! behind [`RankPolicy`] (D108), chosen once in [`for_ranks`]. `least_loaded` is vLLM's
//! score; `cache_aware` weighs the prompt blocks a rank already holds too (D59). Both only
//! choose among connected ranks with room in their waiting queue; the dp-lb owns what a rank's
//! load is ([`RankLoad`]) and answers the refusals ([`NoRank`]).

mod cache_aware;
mod least_loaded;

pub use cache_aware::{CacheAware, OVERLAP_LOAD_SLACK};
pub use least_loaded::{choose, least_loaded, LeastLoaded};

pub use pdmesh_protocol::prefix::PrefixIndex as RankPrefix;

/// What the dp-lb knows of one rank's load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankLoad {
    pub connected: bool,
    pub waiting: u32,
    pub running: u32,
    /// Requests sent since the rank's last load report (optimistic accounting, as vLLM adds
    /// to the chosen engine's waiting count).
    pub pending: u32,
}

impl RankLoad {
    /// vLLM's score: 4 × waiting + running.
    pub fn score(&self) -> u64 {
        4 * u64::from(self.waiting + self.pending) + u64::from(self.running)
    }

    /// Whether the rank's waiting queue, as last reported plus what was sent since, has room
    /// for one more under `max_waiting` (the engine's own bound; 0: no bound). The dp-lb
    /// refuses before the engine would, so the client gets its 503 before any `Ack`, and a
    /// stream never starts only to fail.
    pub fn has_room(&self, max_waiting: u32) -> bool {
        max_waiting == 0 || u64::from(self.waiting) + u64::from(self.pending) < u64::from(max_waiting)
    }
}

/// Why no rank can take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRank {
    /// No rank is connected.
    Unavailable,
    /// Every connected rank's waiting queue is full.
    Full,
}

/// A way of choosing a rank.
pub trait RankPolicy: Send + std::fmt::Debug {
    /// Its name, for logs.
    fn name(&self) -> &'static str;
    /// A connected rank with room under `max_waiting` (0: no bound) for a request whose prompt
    /// blocks each rank holds are `overlap[rank]` (empty: unknown, or one rank connected).
    fn choose(&self, ranks: &[RankLoad], max_waiting: u32, overlap: &[usize]) -> Result<u32, NoRank>;
}

/// The policy of a dp-lb: `cache_aware` where ranks publish their prefix caches, else
/// `least_loaded`.
pub fn for_ranks(prefix_caching: bool) -> Box<dyn RankPolicy> {
    if prefix_caching {
        Box::new(CacheAware)
    } else {
        Box::new(LeastLoaded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_protocol::prefix::prompt_keys;
    use pdmesh_protocol::PrefixSummary;

    fn summary(tokens: &[u32], blocks: usize) -> PrefixSummary {
        let root = pdmesh_protocol::prefix::root_hash("m");
        let keys = prompt_keys(&root, 4, tokens);
        PrefixSummary { block_size: 4, root: root.to_vec(), blocks: keys.into_iter().take(blocks).collect() }
    }

    #[test]
    fn the_index_counts_held_blocks_from_the_first_and_a_snapshot_replaces_it() {
        let tokens: Vec<u32> = (0..17).collect();
        let mut idx = RankPrefix::from_summary(&summary(&tokens, 3));
        assert_eq!(idx.overlap(&tokens), 3);
        assert_eq!(idx.overlap(&tokens[..8]), 2, "a shorter prompt hits only its own full blocks");
        assert_eq!(idx.overlap(&[9, 9, 9, 9, 0, 1, 2, 3]), 0);
        // the next answer lost the first block (evicted): nothing counts past a miss
        let mut s = summary(&tokens, 4);
        s.blocks.remove(0);
        idx = RankPrefix::from_summary(&s);
        assert_eq!(idx.overlap(&tokens), 0);
        // cleared (caching reset, another model): empty
        idx = RankPrefix::from_summary(&PrefixSummary { blocks: vec![], ..summary(&tokens, 0) });
        assert!(idx.is_empty());
        assert_eq!(idx.overlap(&tokens), 0);
        let bad_root = PrefixSummary { root: vec![1, 2], ..summary(&tokens, 4) };
        assert_eq!(RankPrefix::from_summary(&bad_root).overlap(&tokens), 0, "a malformed root matches nothing");
    }

    #[test]
    fn overlap_wins_within_the_load_slack_only() {
        let up = |w, r| RankLoad { connected: true, waiting: w, running: r, pending: 0 };
        // rank 1 holds the prefix and is a little busier: it wins
        assert_eq!(CacheAware.choose(&[up(0, 0), up(0, 3)], 0, &[0, 5]), Ok(1));
        // much busier (score 4·3 = 12 > 0 + 8): the load decides
        assert_eq!(CacheAware.choose(&[up(0, 0), up(3, 0)], 0, &[0, 5]), Ok(0));
        // the longer overlap wins between two holders
        assert_eq!(CacheAware.choose(&[up(0, 0), up(0, 1), up(0, 0)], 0, &[2, 5, 1]), Ok(1));
        // no overlap anywhere: plain least-loaded
        assert_eq!(CacheAware.choose(&[up(0, 2), up(0, 1)], 0, &[0, 0]), Ok(1));
        // a full queue is never chosen for its overlap
        assert_eq!(CacheAware.choose(&[up(0, 0), up(1, 0)], 1, &[0, 9]), Ok(0));
        assert_eq!(CacheAware.choose(&[RankLoad::default(), up(0, 0)], 0, &[9, 0]), Ok(1), "not connected");
    }

    #[test]
    fn picks_least_loaded_connected_rank() {
        let up = |w, r| RankLoad { connected: true, waiting: w, running: r, pending: 0 };
        assert_eq!(least_loaded(&[]), None);
        assert_eq!(least_loaded(&[RankLoad::default()]), None);
        assert_eq!(least_loaded(&[up(1, 0), up(0, 3)]), Some(1)); // 4 vs 3
        assert_eq!(least_loaded(&[up(0, 5), up(1, 0)]), Some(1)); // 5 vs 4
        assert_eq!(least_loaded(&[up(0, 0), up(0, 0)]), Some(0));
        let mut pending = up(0, 0);
        pending.pending = 1;
        assert_eq!(least_loaded(&[pending, up(0, 3)]), Some(1));
        assert_eq!(least_loaded(&[RankLoad::default(), up(9, 9)]), Some(1));
    }

    #[test]
    fn choice_skips_ranks_whose_waiting_queue_is_full() {
        let up = |w, r, p| RankLoad { connected: true, waiting: w, running: r, pending: p };
        // rank 0 has the lower score but a full queue (2 waiting + 1 sent since its report)
        assert_eq!(choose(&[up(2, 0, 1), up(1, 30, 0)], 3), Ok(1));
        assert_eq!(choose(&[up(2, 0, 1), up(1, 30, 0)], 0), Ok(0), "0 = no bound");
        assert_eq!(choose(&[up(2, 0, 1), up(3, 0, 0)], 3), Err(NoRank::Full));
        assert_eq!(choose(&[RankLoad::default(), up(0, 0, 3)], 3), Err(NoRank::Full));
        assert_eq!(choose(&[RankLoad::default()], 3), Err(NoRank::Unavailable));
        assert_eq!(choose(&[up(0, 0, 0)], 1), Ok(0));
        assert!(!up(u32::MAX, 0, u32::MAX).has_room(u32::MAX), "no overflow");
    }
}
