//! connector-worker metrics.

use pdmesh_telemetry::metrics::{counter, counter_vec, float_counter_vec, gauge, histogram, latency_buckets};
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};
use std::sync::LazyLock;

pub static EXECUTE_SECONDS: LazyLock<Histogram> =
    LazyLock::new(|| histogram("pdmesh_worker_execute_seconds", "Forward pass time per step", latency_buckets()));
/// The mesh's cost as a user pays it in inter-token latency: from the end of one forward pass
/// to the start of the next, observed only when the next pass continues a request of the one
/// before (decoding), so idle time between bursts is not counted. It holds every hop between
/// two passes (the answer to engine-core, its step bookkeeping, the next step's way back).
pub static STEP_GAP_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "pdmesh_worker_step_gap_seconds",
        "Executor idle time between consecutive forward passes while requests decode",
        latency_buckets(),
    )
});
/// Rows of the decode steps the executor ran ahead (D67), by whether the engine's step used
/// them: discarded rows are compute spent for nothing (a request that stopped, or a batch the
/// engine changed).
pub static SPECULATIVE_ROWS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "pdmesh_worker_speculative_rows_total",
        "Requests of decode steps run ahead of the engine, by outcome (used, discarded, skipped: a KV receive was pending or writing its block)",
        &["outcome"],
    )
});
/// Forward passes run, those of steps run ahead included: with the output tokens, how many
/// passes a token costs (a pass has a fixed cost, the weights read once, whatever its rows).
pub static FORWARD_PASSES: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_forward_passes_total", "Forward passes run (steps run ahead included)"));
pub static TOKENS_COMPUTED: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_tokens_computed_total", "Tokens run through the model"));
pub static DEVICE_LOST: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_worker_device_lost_total",
        "Steps that found the accelerator lost; the worker exits to be restarted",
    )
});
pub static TP_GROUP_FAILURES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_worker_tp_group_failures_total",
        "Times a tensor-parallel group fell out of step (a peer gone or failing a step); the group restarts",
    )
});
pub static STALE_STEPS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_worker_stale_steps_total",
        "Steps refused because they were built for an earlier incarnation of this worker (before a restart)",
    )
});
pub static EXECUTE_ERRORS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_execute_errors_total", "Steps the executor refused or failed"));
pub static KV_CACHE_BYTES: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_worker_kv_cache_bytes", "Bytes of KV cache memory allocated"));
pub static TRANSFER_BYTES: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_worker_kv_transfer_bytes_total", "KV bytes read from remote engines"));
pub static TRANSFER_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram("pdmesh_worker_kv_transfer_seconds", "Time of one request's KV read", latency_buckets())
});
pub static TRANSFER_FAILURES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_worker_kv_transfer_failures_total", "KV loads that failed, by kind", &["kind"])
});
pub static LEASE_RETRIES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_worker_kv_lease_retries_total", "D: leases asked again after a new handshake (P had restarted)")
});
pub static ENGINE_RESTARTS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_worker_engine_restarts_total",
        "engine-core restarts seen (another pid connected): the old engine's holds and pending loads dropped",
    )
});
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
pub static HELD_BLOCK_SECONDS: LazyLock<prometheus::CounterVec> = LazyLock::new(|| {
    float_counter_vec(
        "pdmesh_worker_kv_held_block_seconds_total",
        "Block-seconds P held for remote readers, by what released them (expired = stranded until a deadline)",
        &["released_by"],
    )
});
pub static REJECTION_TO_RELEASE_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "pdmesh_worker_kv_rejection_to_release_seconds",
        "P: time from D's rejection before admission to the release of the held blocks (R1)",
        // fine around the R1 target (p99 ≤ 5 ms) so the quantile is read, not bounded
        vec![
            0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.0045, 0.005, 0.006, 0.0075, 0.01, 0.015,
            0.02, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0,
        ],
    )
});
pub static HEARTBEATS_SENT: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_worker_kv_heartbeats_sent_total", "D: requests whose hold on P a heartbeat extended")
});
pub static GIVE_UPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "pdmesh_worker_kv_give_ups_total",
        "D: give-ups P acknowledged, by reason (rejection, abort, load_failure, shutdown)",
        &["reason"],
    )
});
pub static REMOTE_AGENTS: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge("pdmesh_worker_kv_remote_agents", "D: prefill engines with a cached handshake (and an open data plane)")
});
pub static REMOTE_AGENTS_EVICTED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_worker_kv_remote_agents_evicted_total",
        "D: cached handshakes dropped, unused for remote_agent_idle_s or with a failed side channel",
    )
});
pub static REMOTE_REFERENCES: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "pdmesh_worker_kv_remote_references",
        "D: references to P's blocks this worker holds (requests taken in whose receive has not ended)",
    )
});
pub static OFFLOAD_STORED_BLOCKS: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_offload_stored_blocks", "KV blocks in the worker's offload store"));
pub static OFFLOAD_STORED_BYTES: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("pdmesh_offload_stored_bytes", "Bytes of KV in the worker's offload store"));
pub static OFFLOAD_SAVES: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_offload_saves_total", "Requests whose blocks were copied to the offload store"));
pub static OFFLOAD_SAVED_BLOCKS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_offload_saved_blocks_total", "KV blocks copied to the offload store"));
pub static OFFLOAD_LOADS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_offload_loads_total", "Requests loaded from the offload store"));
pub static OFFLOAD_LOADED_BLOCKS: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_offload_loaded_blocks_total", "KV blocks copied from the offload store"));
pub static OFFLOAD_LOAD_FAILURES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_offload_load_failures_total",
        "Offload loads refused (the slot did not hold the block); the request follows kv_load_failure_policy",
    )
});
pub static OFFLOAD_SAVE_FAILURES: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_offload_save_failures_total", "Blocks that could not be copied to the store"));
pub static MULTI_SWALLOWED_SENDS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_worker_multi_held_sends_total",
        "MultiConnector: finished_sending reports kept back until every child that delayed the request was done",
    )
});
