//! `power_of_two`: two candidates drawn at random, the cheaper of them (Mitzenmacher's power
//! of two choices; SGLang's router and Envoy offer it). Against `least_loaded` it trades a
//! little balance for robustness to stale load: routers that share nodes, or loads polled
//! every `router.load_poll_ms`, cannot all pile onto the one node that looked emptiest.
//! The draws are a hash of the pick's number: no shared random state, reproducible in tests.

use super::{Candidate, Choice, Pick, RoutingPolicy};

#[derive(Debug)]
pub struct PowerOfTwo;

/// SplitMix64: a well-mixed 64-bit value from a counter.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Two distinct indices below `n` (the same one when `n` is 1), drawn from `turn`.
fn draw(turn: usize, n: usize) -> (usize, usize) {
    if n <= 1 {
        return (0, 0);
    }
    let r = mix(turn as u64);
    let n64 = n as u64;
    let a = (r % n64) as usize;
    let step = 1 + ((r >> 32) % (n64 - 1)) as usize;
    (a, (a + step) % n)
}

impl RoutingPolicy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn choose(&self, candidates: &[Candidate], pick: Pick<'_>) -> Choice {
        let (a, b) = draw(pick.turn, candidates.len());
        let index = if candidates[b].cost < candidates[a].cost { b } else { a };
        Choice { index, overlap: None }
    }
}

#[cfg(test)]
mod tests {
    use super::super::costs;
    use super::*;

    #[test]
    fn two_distinct_draws_and_every_pair_comes_up() {
        let mut seen = std::collections::HashSet::new();
        for turn in 0..2000 {
            let (a, b) = draw(turn, 4);
            assert!(a < 4 && b < 4 && a != b, "{turn}: {a} {b}");
            seen.insert((a, b));
        }
        assert_eq!(seen.len(), 12, "every ordered pair of 4 nodes");
        assert_eq!(draw(7, 1), (0, 0));
    }

    #[test]
    fn the_cheaper_of_the_two_and_never_the_dearest_of_three() {
        let c = costs(&[1.0, 5.0, 9.0]);
        let mut counts = [0usize; 3];
        for turn in 0..3000 {
            counts[PowerOfTwo.choose(&c, Pick { role: "decode", turn, prompt_blocks: 1 }).index] += 1;
        }
        // The cheapest wins both pairs it is in (2 of 3 pairs), the middle one its pair with
        // the dearest; the dearest never wins.
        assert_eq!(counts[2], 0, "{counts:?}");
        assert!(counts[0] > counts[1] && counts[1] > 0, "{counts:?}");
    }

    #[test]
    fn two_nodes_the_cheaper_one_and_ties_shared() {
        let mut wins = [0usize; 2];
        for turn in 0..1000 {
            assert_eq!(PowerOfTwo.choose(&costs(&[2.0, 1.0]), Pick { role: "d", turn, prompt_blocks: 1 }).index, 1);
            wins[PowerOfTwo.choose(&costs(&[1.0, 1.0]), Pick { role: "d", turn, prompt_blocks: 1 }).index] += 1;
        }
        assert!(wins[0] > 300 && wins[1] > 300, "ties go either way: {wins:?}");
    }
}
