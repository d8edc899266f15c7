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
pub static FINISHED: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec("pdmesh_engine_requests_finished_total", "Requests finished, by reason", &["reason"]));
pub static REQUEST_FINISHED_CALLS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_engine_request_finished_calls_total", "Connector request_finished calls"));
pub static UNKNOWN_IDS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_engine_unknown_ids_total", "Aborts, outputs or notices naming untracked requests")
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
pub static STEP_FAILURES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_engine_step_failures_total", "Steps whose peer call failed, by peer", &["peer"])
});
pub static REJECTED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_engine_requests_rejected_total", "Requests refused at admission, by reason", &["reason"])
});
pub static NOTICES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_engine_rejection_notices_total", "Rejection notices received, by result", &["result"])
});
