//! `least_loaded`: the cheapest candidate (outstanding requests × latency × KV use), ties in
//! turn. The router counts its own requests the moment it picks, so consecutive picks see each
//! other and do not pile onto one node between two load polls.

use super::{cheapest, Candidate, Choice, Pick, RoutingPolicy};

#[derive(Debug)]
pub struct LeastLoaded;

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn choose(&self, candidates: &[Candidate], pick: Pick<'_>) -> Choice {
        Choice { index: cheapest(candidates, pick.turn), overlap: None }
    }
}

#[cfg(test)]
mod tests {
    use super::super::costs;
    use super::*;

    fn choose(c: &[f64], turn: usize) -> usize {
        LeastLoaded.choose(&costs(c), Pick { role: "decode", turn, prompt_blocks: 1 }).index
    }

    #[test]
    fn the_cheapest_of_all_and_ties_in_turn() {
        assert_eq!(choose(&[3.0, 1.0, 2.0, 4.0], 0), 1);
        assert_eq!(choose(&[3.0, 1.0, 2.0, 4.0], 3), 1);
        let ties: Vec<usize> = (0..3).map(|t| choose(&[1.0, 1.0, 1.0], t)).collect();
        assert_eq!(ties, vec![0, 1, 2]);
    }
}
