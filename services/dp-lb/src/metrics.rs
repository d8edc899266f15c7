//! dp-lb metrics.

use pdmesh_telemetry::metrics::{counter, counter_vec, gauge};
use prometheus::{IntCounter, IntCounterVec, IntGauge};
use std::sync::LazyLock;

pub static ROUTED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_dplb_requests_routed_total", "Requests by chosen rank (or refusal)", &["rank"])
});
pub static IN_FLIGHT: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_dplb_requests_in_flight", "Requests in flight"));
pub static RANKS_UP: LazyLock<IntGauge> = LazyLock::new(|| gauge("pdmesh_dplb_ranks_up", "Engine ranks connected"));
pub static UNKNOWN_IDS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_dplb_unknown_ids_total", "Aborts for ids not in flight"));
pub static FAILED_BY_RANK_LOSS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_dplb_requests_failed_rank_lost_total", "Requests failed because their rank went away")
});
pub static OUTPUTS_DROPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_dplb_outputs_dropped_total", "Failure outputs of a lost rank dropped: frontend unavailable")
});
pub static NOTICES_FORWARDED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_dplb_rejection_notices_forwarded_total", "Rejection notices sent to ranks, by mode", &["mode"])
});
pub static NOTICES_PENDING: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge("pdmesh_dplb_rejection_notices_pending", "Rejection notices waiting for an engine rank to connect")
});
pub static NOTICES_DROPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_dplb_rejection_notices_dropped_total",
        "Rejection notices dropped unsent (no rank in time, or too many)",
    )
});
pub static OVERLOAD_REFUSALS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "pdmesh_dplb_overload_refusals_total",
        "Requests refused because a bound was reached, by reason (in_flight, waiting)",
        &["reason"],
    )
});
pub static FRONTEND_RESTARTS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_dplb_frontend_restarts_total",
        "Hellos from a new frontend process: output streams re-pointed, its predecessor's requests aborted",
    )
});
