//! connector-worker metrics.

use pdmesh_telemetry::metrics::{counter, gauge, histogram, latency_buckets};
use prometheus::{Histogram, IntCounter, IntGauge};
use std::sync::LazyLock;

pub static EXECUTE_SECONDS: LazyLock<Histogram> =
    LazyLock::new(|| histogram("pdmesh_worker_execute_seconds", "Forward pass time per step", latency_buckets()));
pub static TOKENS_COMPUTED: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_tokens_computed_total", "Tokens run through the model"));
pub static EXECUTE_ERRORS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_execute_errors_total", "Steps the executor refused or failed"));
pub static KV_CACHE_BYTES: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_worker_kv_cache_bytes", "Bytes of KV cache memory allocated"));
