//! `least_loaded`: vLLM's rank choice, the connected rank with the lowest score
//! (4 × waiting + running, counting what was sent since the last report).

use super::{NoRank, RankLoad, RankPolicy};

#[derive(Debug)]
pub struct LeastLoaded;

impl RankPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn choose(&self, ranks: &[RankLoad], max_waiting: u32, _overlap: &[usize]) -> Result<u32, NoRank> {
        choose(ranks, max_waiting)
    }
}

/// The connected rank with the lowest score; ties go to the lowest rank.
pub fn least_loaded(ranks: &[RankLoad]) -> Option<u32> {
    ranks.iter().enumerate().filter(|(_, l)| l.connected).min_by_key(|(i, l)| (l.score(), *i)).map(|(i, _)| i as u32)
}

/// The least-loaded connected rank whose waiting queue has room under `max_waiting`.
pub fn choose(ranks: &[RankLoad], max_waiting: u32) -> Result<u32, NoRank> {
    let Some(best) = least_loaded(ranks) else { return Err(NoRank::Unavailable) };
    if ranks.get(best as usize).is_some_and(|l| l.has_room(max_waiting)) {
        return Ok(best);
    }
    ranks
        .iter()
        .enumerate()
        .filter(|(_, l)| l.connected && l.has_room(max_waiting))
        .min_by_key(|(i, l)| (l.score(), *i))
        .map(|(i, _)| i as u32)
        .ok_or(NoRank::Full)
}
