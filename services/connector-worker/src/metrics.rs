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
pub static TRANSFER_BYTES: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_kv_transfer_bytes_total", "KV bytes read from remote engines"));
pub static TRANSFER_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram("pdmesh_worker_kv_transfer_seconds", "Time of one request's KV read", latency_buckets())
});
pub static TRANSFER_FAILURES: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_kv_transfer_failures_total", "KV loads that failed"));
pub static NOTIFY_FAILURES: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_kv_notify_failures_total", "Notices to P that could not be sent"));
pub static HOLDS_EXPIRED: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_kv_holds_expired_total", "Held requests released at their deadline"));
pub static HELD_BLOCKS: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_worker_kv_held_blocks", "Blocks held for remote readers"));
pub static LEASED_BLOCKS: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_worker_kv_leased_blocks", "Blocks leased to in-flight remote reads"));
pub static HANDSHAKES_SERVED: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge("pdmesh_worker_kv_handshakes_served", "Handshakes (metadata requests) this P agent answered")
});
pub static LEASES_GRANTED: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_worker_kv_leases_granted", "Read leases granted by this P agent"));
pub static LEASES_REFUSED: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge("pdmesh_worker_kv_leases_refused", "Read leases refused (unknown, freed or stale references)")
});
