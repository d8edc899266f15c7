//! `cache_aware` (D59): among ranks with room, the one holding most of the prompt's prefix,
//! while its load stays within [`OVERLAP_LOAD_SLACK`] of the least-loaded rank's.

use super::{choose, NoRank, RankLoad, RankPolicy};

#[derive(Debug)]
pub struct CacheAware;

impl RankPolicy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn choose(&self, ranks: &[RankLoad], max_waiting: u32, overlap: &[usize]) -> Result<u32, NoRank> {
        choose_with_overlap(ranks, max_waiting, overlap)
    }
}

/// A rank's score may exceed the least-loaded rank's by this much (4 = one waiting request)
/// and still win on prefix overlap: beyond it the load decides, so a hot prefix cannot pile
/// every request onto one rank (SGLang's cache-aware balance threshold, in vLLM's units).
pub const OVERLAP_LOAD_SLACK: u64 = 8;

/// [`super::choose`], preferring among ranks with room the one holding most of the prompt's prefix
/// (`overlap[rank]` blocks) while its score stays within [`OVERLAP_LOAD_SLACK`] of the
/// least-loaded one's; ties and zero overlap go to the load.
pub fn choose_with_overlap(ranks: &[RankLoad], max_waiting: u32, overlap: &[usize]) -> Result<u32, NoRank> {
    let by_load = choose(ranks, max_waiting)?;
    let floor = ranks.get(by_load as usize).map_or(0, RankLoad::score);
    let best = ranks
        .iter()
        .enumerate()
        .filter(|(_, l)| {
            l.connected && l.has_room(max_waiting) && l.score() <= floor.saturating_add(OVERLAP_LOAD_SLACK)
        })
        .map(|(i, l)| (i, overlap.get(i).copied().unwrap_or(0), l.score()))
        .filter(|(_, o, _)| *o > 0)
        .max_by_key(|(i, o, score)| (*o, std::cmp::Reverse(*score), std::cmp::Reverse(*i)));
    Ok(best.map_or(by_load, |(i, _, _)| i as u32))
}
