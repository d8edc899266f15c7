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
//! held blocks (`Scheduler::add_request`), and the per-request output buffer in the
//! frontend's `engine_client`. Whichever refuses, the client sees the same 503 (see
//! `ApiError::Overloaded`), and a remote-prefill request refused anywhere before admission
//! sends P its rejection notice (rule R1, the frontend's `handlers::note_rejection`).
//!
//! [`KeyLimit`] is the same bound per client API key (`limits.max_in_flight_per_key`): a key
//! at its bound is refused with a 429 ([`ApiError::RateLimited`]), the others are not, so one
//! client cannot take the whole server's `max_in_flight`. It counts in a fixed array, one slot
//! per configured key ([`crate::auth::ClientKey`]), so it neither grows with clients nor keeps a
//! key. Requests without a client key — no keys configured, or the router's internal key on a
//! node, which carries every client of the router — are not bounded per key.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdmesh_telemetry::log_limit::LogLimiter;

use crate::auth::ClientKey;
use crate::error::ApiError;
use crate::metrics::{HTTP_IN_FLIGHT, KEY_LIMIT_REFUSALS_TOTAL, OVERLOAD_REFUSALS_TOTAL};

/// One line a second about refusals, whatever their rate.
static REFUSAL_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));
/// One line a second about per-key refusals.
static KEY_REFUSAL_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));

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

/// The bound on requests in flight per client key, shared by every HTTP worker of one server.
#[derive(Debug, Clone)]
pub struct KeyLimit {
    inner: Arc<KeyInner>,
}

#[derive(Debug)]
struct KeyInner {
    max: u32,
    /// Requests in flight per key, indexed by [`ClientKey::slot`].
    slots: Box<[AtomicU32]>,
    /// Label of `pdmesh_frontend_key_limit_refusals_total` (`frontend` or `router`).
    source: &'static str,
}

/// A request's place under its key's bound; given back when dropped.
#[derive(Debug)]
pub struct KeyPermit {
    inner: Arc<KeyInner>,
    slot: usize,
}

impl KeyLimit {
    /// At most `max` requests at once per key (0: no bound) for a server with `keys` keys
    /// ([`crate::ApiKeys::len`]). `source` names who refuses in metrics.
    pub fn new(max: u32, keys: usize, source: &'static str) -> Self {
        let slots = (0..if max == 0 { 0 } else { keys }).map(|_| AtomicU32::new(0)).collect();
        Self { inner: Arc::new(KeyInner { max, slots, source }) }
    }

    /// No per-key bound.
    pub fn disabled(source: &'static str) -> Self {
        Self::new(0, 0, source)
    }

    /// A place for a request that presented `key`: `Ok(None)` when nothing bounds it (no bound,
    /// or no client key), a permit, or the 429 to answer with (counted and logged,
    /// rate-limited; the log names the key's position in the configured list, never the key).
    pub fn try_acquire(&self, key: Option<ClientKey>) -> Result<Option<KeyPermit>, ApiError> {
        let max = self.inner.max;
        let Some(slot) = key.map(ClientKey::slot) else { return Ok(None) };
        let Some(count) = self.inner.slots.get(slot) else { return Ok(None) };
        let taken =
            count.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| if n < max { Some(n + 1) } else { None });
        match taken {
            Ok(_) => Ok(Some(KeyPermit { inner: self.inner.clone(), slot })),
            Err(current) => {
                KEY_LIMIT_REFUSALS_TOTAL.with_label_values(&[self.inner.source]).inc();
                if let Some(suppressed) = KEY_REFUSAL_LOG.check() {
                    tracing::warn!(
                        source = self.inner.source,
                        key_position = slot,
                        in_flight = current,
                        max,
                        suppressed,
                        "rate limited: an API key is at limits.max_in_flight_per_key"
                    );
                }
                Err(ApiError::RateLimited(format!(
                    "rate limited: this API key already has its limit of {max} requests in flight; retry later"
                )))
            }
        }
    }

    /// Requests holding a permit of `key` now.
    pub fn current(&self, key: ClientKey) -> u32 {
        self.inner.slots.get(key.slot()).map_or(0, |c| c.load(Ordering::Acquire))
    }
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        if let Some(count) = self.inner.slots.get(self.slot) {
            count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{ApiKeys, KeyMatch};

    fn key(keys: &ApiKeys, token: &str) -> Option<ClientKey> {
        keys.identify(token).and_then(KeyMatch::client_key)
    }

    #[test]
    fn a_key_at_its_bound_is_refused_with_429_and_another_key_is_not() {
        let keys = ApiKeys::with_internal(["sk-a", "sk-b"], Some("mesh-internal"));
        let limit = KeyLimit::new(2, keys.len(), "unit-test");
        let (a, b) = (key(&keys, "sk-a"), key(&keys, "sk-b"));
        let before = KEY_LIMIT_REFUSALS_TOTAL.with_label_values(&["unit-test"]).get();
        let a1 = limit.try_acquire(a).unwrap().expect("bounded");
        let _a2 = limit.try_acquire(a).unwrap().expect("bounded");
        let refused = limit.try_acquire(a).unwrap_err();
        assert_eq!(refused.status().as_u16(), 429);
        assert_eq!(refused.kind(), "rate_limited");
        assert!(refused.retry_after_s().is_some_and(|s| s >= 1), "a 429 tells the client when to retry");
        assert_eq!(KEY_LIMIT_REFUSALS_TOTAL.with_label_values(&["unit-test"]).get(), before + 1);
        assert_eq!(limit.current(a.unwrap()), 2);
        let _b1 = limit.try_acquire(b).unwrap().expect("another key has its own places");
        assert_eq!(limit.current(b.unwrap()), 1);
        // A finished request gives its place back.
        drop(a1);
        assert_eq!(limit.current(a.unwrap()), 1);
        let _a3 = limit.try_acquire(a).unwrap().expect("a place was given back");
        assert!(limit.try_acquire(a).is_err());
    }

    #[test]
    fn requests_without_a_client_key_are_not_bounded_per_key() {
        let keys = ApiKeys::with_internal(["sk-a"], Some("mesh-internal"));
        let limit = KeyLimit::new(1, keys.len(), "frontend");
        let internal = key(&keys, "mesh-internal");
        assert_eq!(internal, None, "the router's internal key carries no client identity");
        for _ in 0..10 {
            assert!(limit.try_acquire(internal).unwrap().is_none());
        }
        let none = KeyLimit::new(0, keys.len(), "frontend");
        let a = key(&keys, "sk-a");
        let permits: Vec<_> = (0..100).map(|_| none.try_acquire(a).unwrap()).collect();
        assert!(permits.iter().all(Option::is_none), "0 means no per-key bound");
    }

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
