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
