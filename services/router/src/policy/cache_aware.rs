//! `cache_aware` (D59, the default): load, and how much of the prompt each node already holds
//! in its prefix cache (the blocks from the first one on, as the node's `/load` publishes
//! them): score = cost × (1 − `OVERLAP_WEIGHT` × held fraction), lowest wins. Only nodes whose
//! cost is within `LOAD_GUARD` × the cheapest one's, and that hold at least
//! `MIN_OVERLAP_FRACTION` of the prompt, compete on overlap, so a hot prefix cannot pile every
//! request on one node (SGLang's balance and cache thresholds). Without a prompt (the router
//! could not tokenise it) it is `least_loaded`.

use std::sync::LazyLock;

use pdmesh_telemetry::metrics::{counter_vec, histogram_vec};
use prometheus::{HistogramVec, IntCounterVec};

use super::{cheapest, Candidate, Choice, Pick, RoutingPolicy};

/// How much a fully held prompt lowers a node's cost (0.9: to a tenth).
const OVERLAP_WEIGHT: f64 = 0.9;
/// A node costing more than this many times the cheapest competes on load only.
const LOAD_GUARD: f64 = 4.0;
/// A node holding less than this share of the prompt competes on load only (SGLang's cache
/// threshold): a few shared opening blocks must not pin every request to one node while the
/// others idle; a conversation's follow-up holds most of its prompt.
const MIN_OVERLAP_FRACTION: f64 = 0.5;

/// Prompt blocks the chosen node already held, per cache-aware pick, by `role`.
pub const PREFIX_OVERLAP: &str = "pdmesh_router_prefix_overlap_blocks";
/// Cache-aware picks, by `role` and `reason`: `overlap` (the node holding more of the prompt
/// won over a cheaper one), `load` (the cheapest node won), `no_prefix` (nothing held).
pub const CACHE_AWARE_PICKS: &str = "pdmesh_router_cache_aware_picks_total";

pub(crate) static PREFIX_OVERLAP_HIST: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram_vec(
        PREFIX_OVERLAP,
        "Prompt blocks the chosen upstream already held (cache-aware routing)",
        &["role"],
        vec![0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0],
    )
});
pub(crate) static CACHE_AWARE_PICKS_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(CACHE_AWARE_PICKS, "Cache-aware picks by what decided them", &["role", "reason"]));

#[derive(Debug)]
pub struct CacheAware;

impl RoutingPolicy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn weighs_prefix(&self) -> bool {
        true
    }

    fn choose(&self, candidates: &[Candidate], pick: Pick<'_>) -> Choice {
        let by_load = cheapest(candidates, pick.turn);
        if candidates.iter().any(|c| c.held.is_none()) {
            return Choice { index: by_load, overlap: None };
        }
        let held = |k: usize| candidates[k].held.unwrap_or(0);
        let least = candidates[by_load].cost;
        let blocks = pick.prompt_blocks.max(1);
        let score = |k: usize| {
            let c = candidates[k].cost;
            let fraction = (held(k) as f64 / blocks as f64).min(1.0);
            if c <= LOAD_GUARD * least && fraction >= MIN_OVERLAP_FRACTION {
                c * (1.0 - OVERLAP_WEIGHT * fraction)
            } else {
                c
            }
        };
        let n = candidates.len().max(1);
        let best = (0..n).map(|k| (k + pick.turn) % n).min_by(|&a, &b| score(a).total_cmp(&score(b))).unwrap_or(0);
        let reason = match held(best) {
            0 => "no_prefix",
            h if best != by_load && h > held(by_load) => "overlap",
            _ => "load",
        };
        PREFIX_OVERLAP_HIST.with_label_values(&[pick.role]).observe(held(best) as f64);
        CACHE_AWARE_PICKS_TOTAL.with_label_values(&[pick.role, reason]).inc();
        Choice { index: best, overlap: Some(held(best)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(turn: usize, prompt_blocks: usize) -> Pick<'static> {
        Pick { role: "test", turn, prompt_blocks }
    }

    #[test]
    fn the_holder_wins_within_the_load_guard_and_loses_beyond_it() {
        let c = |cost, held| Candidate { cost, held: Some(held) };
        assert_eq!(CacheAware.choose(&[c(1.0, 0), c(2.0, 8)], pick(0, 8)), Choice { index: 1, overlap: Some(8) });
        assert_eq!(CacheAware.choose(&[c(1.0, 0), c(5.0, 8)], pick(0, 8)).index, 0, "beyond 4× the cheapest");
        assert_eq!(CacheAware.choose(&[c(1.0, 0), c(2.0, 3)], pick(0, 8)).index, 0, "under half the prompt");
    }

    #[test]
    fn without_a_prompt_it_is_least_loaded() {
        let c = [Candidate { cost: 3.0, held: None }, Candidate { cost: 1.0, held: None }];
        assert_eq!(CacheAware.choose(&c, pick(0, 1)), Choice { index: 1, overlap: None });
    }
}
