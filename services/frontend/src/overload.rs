//! Overload control at the HTTP edge: a bound on the generation requests a frontend (or the
//! router) serves at once.
//!
//! A request takes a permit when its handler starts and gives it back when its answer is
//! complete: for a JSON answer when the handler returns, for a stream when the stream ends
//! (the permit travels with the stream). Without a permit the request is refused at once
//! with a 503, `Retry-After` and an OpenAI error body; nothing waits in a queue, so a storm
//! costs a refused request's parse and answer, never memory that grows with the storm.
//!
//! The other bounds of a node sit where their queue is: the dp-lb's in-flight table and its
//! reading of the ranks' load reports (`services/dp-lb`), the engine's waiting queue and P's
//! held blocks (`Scheduler::add_request`), and the per-request output buffer here in
//! [`crate::engine_client`]. Whichever refuses, the client sees the same 503 (see
//! `ApiError::Overloaded`), and a remote-prefill request refused anywhere before admission
//! sends P its rejection notice (rule R1, `handlers::note_rejection`).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdmesh_telemetry::log_limit::LogLimiter;

use crate::error::ApiError;
use crate::metrics::{HTTP_IN_FLIGHT, OVERLOAD_REFUSALS_TOTAL};

/// One line a second about refusals, whatever their rate.
static REFUSAL_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));

/// The bound on requests in flight, shared by every HTTP worker of one server.
#[derive(Debug, Clone)]
pub struct InFlightLimit {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    max: u32,
    current: AtomicU32,
    /// Label of `pdmesh_frontend_overload_refusals_total` (`frontend` or `router`).
    source: &'static str,
}

/// A request's place under the bound; given back when dropped.
#[derive(Debug)]
pub struct InFlightPermit {
    inner: Arc<Inner>,
}

impl InFlightLimit {
    /// At most `max` requests at once (0: no bound). `source` names who refuses in metrics.
    pub fn new(max: u32, source: &'static str) -> Self {
        Self { inner: Arc::new(Inner { max, current: AtomicU32::new(0), source }) }
    }

    /// A permit, or the refusal to answer with (counted and logged, rate-limited).
    pub fn try_acquire(&self) -> Result<InFlightPermit, ApiError> {
        let max = self.inner.max;
        let taken = self.inner.current.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            if max == 0 || n < max {
                Some(n + 1)
            } else {
                None
            }
        });
        match taken {
            Ok(_) => {
                HTTP_IN_FLIGHT.inc();
                Ok(InFlightPermit { inner: self.inner.clone() })
            }
            Err(current) => {
                OVERLOAD_REFUSALS_TOTAL.with_label_values(&[self.inner.source]).inc();
                if let Some(suppressed) = REFUSAL_LOG.check() {
                    tracing::warn!(
                        source = self.inner.source,
                        in_flight = current,
                        max,
                        suppressed,
                        "overloaded: refusing requests beyond limits.max_in_flight"
                    );
                }
                Err(ApiError::Overloaded(format!(
                    "overloaded: this server already serves its limit of {max} requests; retry later"
                )))
            }
        }
    }

    /// Requests holding a permit now.
    pub fn current(&self) -> u32 {
        self.inner.current.load(Ordering::Acquire)
    }
}

impl Drop for InFlightPermit {
    fn drop(&mut self) {
        self.inner.current.fetch_sub(1, Ordering::AcqRel);
        HTTP_IN_FLIGHT.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_are_bounded_and_given_back() {
        let limit = InFlightLimit::new(2, "frontend");
        let a = limit.try_acquire().unwrap();
        let _b = limit.try_acquire().unwrap();
        let refused = limit.try_acquire().unwrap_err();
        assert_eq!(refused.status().as_u16(), 503);
        assert_eq!(refused.kind(), "overloaded");
        assert_eq!(limit.current(), 2);
        drop(a);
        assert_eq!(limit.current(), 1);
        let _c = limit.try_acquire().unwrap();
        assert!(limit.try_acquire().is_err());
    }

    #[test]
    fn zero_means_unbounded() {
        let limit = InFlightLimit::new(0, "frontend");
        let permits: Vec<_> = (0..1000).map(|_| limit.try_acquire().unwrap()).collect();
        assert_eq!(limit.current(), 1000);
        drop(permits);
        assert_eq!(limit.current(), 0);
    }
}
