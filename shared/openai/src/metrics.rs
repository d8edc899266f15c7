//! The metric this crate counts itself: structured-output specs refused while a request is
//! validated. Its name keeps the frontend's prefix (dashboards and docs/METRICS.md use it); the
//! frontend and the router register it at start (`init`).

use std::sync::LazyLock;

use pdmesh_telemetry::metrics::counter_vec;
use prometheus::IntCounterVec;

/// Structured-output specs refused before any engine work, by reason.
pub const GUIDED_REFUSALS: &str = "pdmesh_frontend_guided_refusals_total";

pub(crate) static GUIDED_REFUSALS_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        GUIDED_REFUSALS,
        "Structured-output specs refused before any engine work, by reason (invalid, limit, busy, compiler)",
        &["reason"],
    )
});

/// Register the metric so that `/metrics` lists it (at zero) from the start.
pub fn init() {
    LazyLock::force(&GUIDED_REFUSALS_TOTAL);
}
