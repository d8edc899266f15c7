//! Where a rejection notice (rule R1) goes, and what happens to one nobody can take yet.
//!
//! Any rank of a decode node can free P: its connector turns the notice's params into a
//! notify-only receive and its worker sends P `give up`. So a notice goes to the rank it is
//! pinned to when that rank is connected, else to every connected rank (P releases once and
//! counts the duplicates). With no rank connected (engines down or restarting, the very case
//! where D refuses with "unavailable") the notice waits here, bounded in number and age, and
//! goes to the first rank that connects — instead of being dropped and leaving P to its
//! deadline.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use pdmesh_protocol::Envelope;

/// How many notices wait for a rank at most; the oldest goes first when full.
pub const MAX_PENDING: usize = 4096;
/// How long a notice waits for a rank: past P's default hold deadline (480 s) it frees
/// nothing any more.
pub const MAX_PENDING_AGE: Duration = Duration::from_secs(600);

/// The ranks a notice goes to now; empty: none is connected, keep it.
pub fn targets(pinned: Option<u32>, connected: &[u32]) -> Vec<u32> {
    match pinned {
        Some(r) if connected.contains(&r) => vec![r],
        _ => connected.to_vec(),
    }
}

/// Notices that arrived while no rank was connected.
#[derive(Debug)]
pub struct PendingNotices {
    queue: VecDeque<(Instant, Envelope)>,
    capacity: usize,
    max_age: Duration,
    /// Notices dropped unsent (full, or too old): P frees those at its deadline.
    pub dropped: u64,
}

impl Default for PendingNotices {
    fn default() -> Self {
        Self::new(MAX_PENDING, MAX_PENDING_AGE)
    }
}

impl PendingNotices {
    pub fn new(capacity: usize, max_age: Duration) -> Self {
        Self { queue: VecDeque::new(), capacity: capacity.max(1), max_age, dropped: 0 }
    }

    /// Keep a notice until a rank connects.
    pub fn push(&mut self, notice: Envelope, now: Instant) {
        if self.queue.len() >= self.capacity {
            self.queue.pop_front();
            self.dropped += 1;
        }
        self.queue.push_back((now, notice));
    }

    /// Every notice still worth sending (a rank just connected); expired ones are dropped.
    pub fn drain(&mut self, now: Instant) -> Vec<Envelope> {
        let max_age = self.max_age;
        let (fresh, stale): (Vec<_>, Vec<_>) =
            self.queue.drain(..).partition(|(at, _)| now.saturating_duration_since(*at) <= max_age);
        self.dropped += stale.len() as u64;
        fresh.into_iter().map(|(_, n)| n).collect()
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_protocol::Message;

    #[test]
    fn pinned_to_a_connected_rank_goes_there_else_to_every_connected_rank() {
        assert_eq!(targets(Some(1), &[0, 1]), vec![1]);
        assert_eq!(targets(Some(1), &[0]), vec![0], "a rank that is down cannot free P; another can");
        assert_eq!(targets(Some(7), &[0, 1]), vec![0, 1], "a rank outside the node is no target");
        assert_eq!(targets(None, &[0, 1]), vec![0, 1]);
        assert!(targets(None, &[]).is_empty());
        assert!(targets(Some(0), &[]).is_empty());
    }

    #[test]
    fn pending_notices_are_bounded_and_expire() {
        let t0 = Instant::now();
        let mut p = PendingNotices::new(2, Duration::from_secs(10));
        for _ in 0..3 {
            p.push(Envelope::new(Message::Ping), t0);
        }
        assert_eq!((p.len(), p.dropped), (2, 1), "the oldest goes when full");
        assert_eq!(p.drain(t0 + Duration::from_secs(5)).len(), 2);
        assert!(p.is_empty());
        p.push(Envelope::new(Message::Ping), t0);
        assert!(p.drain(t0 + Duration::from_secs(11)).is_empty(), "too old to free anything");
        assert_eq!(p.dropped, 2);
    }
}
