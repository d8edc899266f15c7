//! Outlier ejection (D55): `router.eject_after_failures` failures in a row (connect error,
//! reset, a 5xx other than an overload 503) eject a node for `eject_base_ms`, doubled per
//! ejection in a row up to `eject_max_ms`; once that passed and its `/load` answers it is tried
//! again (half-open: the next failure ejects it again at once, a success closes the breaker).

use super::*;

impl Pool {
    /// Node `i` served a call: its failures in a row start over and its breaker closes.
    pub fn success(&self, i: usize) {
        let closed = self.with_state(i, |s| {
            s.failures_in_row = 0;
            let was_open = s.ejections > 0;
            if was_open && s.ejected_until.is_none_or(|t| Instant::now() >= t) {
                s.ejections = 0;
                s.ejected_until = None;
                return true;
            }
            false
        });
        if closed == Some(true) {
            if let Some(url) = self.url(i) {
                EJECTED_GAUGE.with_label_values(&[self.role, &url]).set(0);
                tracing::info!(role = self.role, upstream = url, "upstream serves again; back in rotation");
            }
        }
    }

    /// Node `i` failed a call (connect error, reset, a 5xx other than an overload 503).
    pub fn failure(&self, i: usize, why: &str) {
        let Some(url) = self.url(i) else { return };
        FAILURES_TOTAL.with_label_values(&[self.role, &url]).inc();
        let breaker = self.breaker;
        if breaker.after_failures == 0 {
            return;
        }
        let ejected_for = self.with_state(i, |s| {
            s.failures_in_row = s.failures_in_row.saturating_add(1);
            // Half-open (back after an ejection, not yet proven): one failure is enough.
            if s.failures_in_row >= breaker.after_failures || s.ejections > 0 {
                s.ejections = s.ejections.saturating_add(1);
                s.failures_in_row = 0;
                let factor = 1u32 << (s.ejections - 1).min(16);
                let length = breaker.base.saturating_mul(factor).min(breaker.max);
                s.ejected_until = Some(Instant::now() + length);
                return Some(length);
            }
            None
        });
        if let Some(Some(length)) = ejected_for {
            EJECTIONS_TOTAL.with_label_values(&[self.role, &url]).inc();
            EJECTED_GAUGE.with_label_values(&[self.role, &url]).set(1);
            tracing::warn!(role = self.role, upstream = %url, reason = why, ejected_ms = length.as_millis() as u64,
                "upstream ejected after failures in a row");
        }
    }
}
