//! engine-core metrics (listed in docs/METRICS.md).

use pdmesh_telemetry::metrics::{counter, counter_vec, gauge, histogram, latency_buckets};
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};
use std::sync::LazyLock;

pub static STEPS: LazyLock<IntCounter> = LazyLock::new(|| counter("pdmesh_engine_steps_total", "Engine steps run"));
pub static STEP_SECONDS: LazyLock<Histogram> =
    LazyLock::new(|| histogram("pdmesh_engine_step_seconds", "Wall time of one engine step", latency_buckets()));
pub static SCHEDULED_TOKENS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_engine_scheduled_tokens_total", "Tokens scheduled for compute"));
pub static NUM_WAITING: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_engine_requests_waiting", "Requests waiting"));
pub static NUM_RUNNING: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_engine_requests_running", "Requests running"));
pub static KV_FREE: LazyLock<IntGauge> = LazyLock::new(|| gauge("pdmesh_engine_kv_free_blocks", "KV blocks free"));
pub static KV_USED: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_engine_kv_used_blocks", "KV blocks used by live requests"));
pub static KV_HELD: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_engine_kv_held_blocks", "KV blocks held for the connector (remote readers)"));
pub static KV_CACHED: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge("pdmesh_engine_kv_cached_blocks", "KV blocks registered in the prefix cache (in use or evictable)")
});
pub static PREFIX_CACHE_QUERIES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_engine_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache")
});
pub static PREFIX_CACHE_HITS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_engine_prefix_cache_hits_total", "Prompt tokens found in the prefix cache"));
pub static PREFIX_CACHE_EVICTIONS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_engine_prefix_cache_evictions_total", "Cached KV blocks evicted to make room"));
pub static FINISHED: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec("pdmesh_engine_requests_finished_total", "Requests finished, by reason", &["reason"]));
pub static REQUEST_FINISHED_CALLS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_engine_request_finished_calls_total", "Connector request_finished calls"));
pub static UNKNOWN_IDS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_engine_unknown_ids_total", "Aborts, outputs or notices naming untracked requests")
});
pub static STALE_SENDS_DROPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_engine_stale_holds_dropped_total",
        "Holds and offload saves the connector queued for blocks this engine no longer holds (freed by a worker restart): not passed to the worker",
    )
});
pub static PREEMPTIONS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_engine_preemptions_total", "Preemptions"));
pub static KV_LOADS_RECOMPUTED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_engine_kv_loads_recomputed_total", "Failed KV loads prefilled locally (recompute policy)")
});
pub static RECOMPUTED_TOKENS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_engine_recomputed_tokens_total", "Prompt tokens prefilled locally after a failed KV load")
});
pub static KV_LOADS_FAILED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_engine_kv_load_failed_requests_total",
        "Requests ended with error by a failed KV load (fail policy)",
    )
});
pub static WORKER_RESTARTS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_engine_worker_restarts_total", "Connector-worker restarts seen (its KV state was lost)")
});
pub static META_ROUNDS_SKIPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_engine_meta_rounds_skipped_total",
        "Steps run on the worker without a connector-scheduler round (nothing to tell it, nothing queued)",
    )
});
pub static STEP_FAILURES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_engine_step_failures_total", "Steps whose peer call failed, by peer", &["peer"])
});
pub static REJECTED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_engine_requests_rejected_total", "Requests refused at admission, by reason", &["reason"])
});
pub static NOTICES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_engine_rejection_notices_total", "Rejection notices received, by result", &["result"])
});
pub static OVERLOAD_REFUSALS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "pdmesh_engine_overload_refusals_total",
        "Requests refused at admission for load, by bound (waiting_queue, held_blocks)",
        &["bound"],
    )
});

/// One line a second about overload refusals, whatever their rate.
static OVERLOAD_LOG: pdmesh_telemetry::log_limit::LogLimiter =
    pdmesh_telemetry::log_limit::LogLimiter::new(std::time::Duration::from_secs(1));

/// Count and log a refusal at admission: every one at `warn`, except overload refusals, which
/// come in storms and are logged at most once a second (with how many were not).
pub fn note_refusal(request_id: &str, error: &crate::scheduler::AdmissionError) {
    use crate::scheduler::AdmissionError;
    REJECTED.with_label_values(&[error.label()]).inc();
    let bound = match error {
        AdmissionError::WaitingQueueFull { .. } => "waiting_queue",
        AdmissionError::HeldBlocksFull { .. } => "held_blocks",
        _ => {
            tracing::warn!(request_id, error = %error, "request refused");
            return;
        }
    };
    OVERLOAD_REFUSALS.with_label_values(&[bound]).inc();
    if let Some(suppressed) = OVERLOAD_LOG.check() {
        tracing::warn!(request_id, error = %error, suppressed, "request refused: overloaded");
    }
}
pub static FRONTEND_ORPHANS_ABORTED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_engine_frontend_orphans_aborted_total",
        "Requests aborted because the frontend process that submitted them was replaced",
    )
});
