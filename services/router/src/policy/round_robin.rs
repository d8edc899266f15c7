//! `round_robin`: every candidate in turn, whatever its load or latency (vLLM's toy proxy).

use super::{Candidate, Choice, Pick, RoutingPolicy};

#[derive(Debug)]
pub struct RoundRobin;

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn weighs_latency(&self) -> bool {
        false
    }

    fn choose(&self, candidates: &[Candidate], pick: Pick<'_>) -> Choice {
        Choice { index: pick.turn % candidates.len().max(1), overlap: None }
    }
}

#[cfg(test)]
mod tests {
    use super::super::costs;
    use super::*;

    #[test]
    fn every_candidate_in_turn_whatever_its_cost() {
        let c = costs(&[1.0, 100.0, 5.0]);
        let picks: Vec<usize> =
            (0..6).map(|turn| RoundRobin.choose(&c, Pick { role: "decode", turn, prompt_blocks: 1 }).index).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }
}
