//! Rank choice.

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
}

/// The connected rank with the lowest score; ties go to the lowest rank.
pub fn least_loaded(ranks: &[RankLoad]) -> Option<u32> {
    ranks.iter().enumerate().filter(|(_, l)| l.connected).min_by_key(|(i, l)| (l.score(), *i)).map(|(i, _)| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
