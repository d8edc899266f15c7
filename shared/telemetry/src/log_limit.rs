//! Rate-limited log lines for events that can come in storms (overload refusals): the first
//! event of each interval is logged with how many were suppressed since the last line, the
//! rest only counted. Metrics count every event; the log says that it is happening without
//! letting a storm of refusals become a storm of log writes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// One limiter per kind of event (a `static` next to the code that logs).
#[derive(Debug)]
pub struct LogLimiter {
    interval: Duration,
    /// Milliseconds since [`EPOCH`] at which the next line may be written.
    next_ms: AtomicU64,
    suppressed: AtomicU64,
}

/// A process-wide origin for the limiters' clocks (`Instant` cannot live in an atomic).
static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

impl LogLimiter {
    /// At most one line per `interval`.
    pub const fn new(interval: Duration) -> Self {
        Self { interval, next_ms: AtomicU64::new(0), suppressed: AtomicU64::new(0) }
    }

    /// `Some(n)`: write a line now, `n` events were suppressed since the previous one.
    /// `None`: count this event and stay quiet.
    pub fn check(&self) -> Option<u64> {
        let now = EPOCH.elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        let interval = self.interval.as_millis() as u64;
        if now >= next
            && self.next_ms.compare_exchange(next, now + interval, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_suppressed_count() {
        let limiter = LogLimiter::new(Duration::from_millis(200));
        assert_eq!(limiter.check(), Some(0));
        assert_eq!(limiter.check(), None);
        assert_eq!(limiter.check(), None);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(limiter.check(), Some(2));
        assert_eq!(limiter.check(), None);
    }
}
