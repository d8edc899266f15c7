//! Frontend metrics. Names are constants so that tests, dashboards and `docs/METRICS.md`
//! can refer to them; labels are static and low-cardinality (endpoint patterns, status codes,
//! error kinds, finish reasons), never request ids or model output.

use std::sync::LazyLock;

use pdmesh_telemetry::metrics::{counter, counter_vec, gauge, histogram, latency_buckets};
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};

/// The HTTP edge's metrics (requests, errors, keys, overload), shared with the router.
pub use pdmesh_http_edge::metrics::{
    AUTHORIZED, AUTHORIZED_TOTAL, HTTP_IN_FLIGHT, HTTP_IN_FLIGHT_REQUESTS, HTTP_REQUESTS, HTTP_REQUESTS_TOTAL,
    KEY_LIMIT_REFUSALS, KEY_LIMIT_REFUSALS_TOTAL, OVERLOAD_REFUSALS, OVERLOAD_REFUSALS_TOTAL, REQUEST_ERRORS,
    REQUEST_ERRORS_TOTAL, UNAUTHORIZED, UNAUTHORIZED_TOTAL,
};

/// Generation requests that ended, by finish reason (`stop`, `length`, `abort`, `error`).
pub const FINISH_REASONS: &str = "pdmesh_frontend_request_finish_total";
/// Seconds from the request's arrival to its first generated token.
pub const TIME_TO_FIRST_TOKEN: &str = "pdmesh_frontend_time_to_first_token_seconds";
/// Seconds between two engine outputs carrying tokens of the same request.
pub const INTER_TOKEN_LATENCY: &str = "pdmesh_frontend_inter_token_latency_seconds";
/// Seconds from the request's arrival to its end (any finish reason).
pub const E2E_LATENCY: &str = "pdmesh_frontend_e2e_request_latency_seconds";
/// Prompt tokens of requests accepted by the engine.
pub const PROMPT_TOKENS: &str = "pdmesh_frontend_prompt_tokens_total";
/// Tokens generated (received from the engine) for requests.
pub const GENERATION_TOKENS: &str = "pdmesh_frontend_generation_tokens_total";
/// Generation requests accepted by the engine and not yet finished.
pub const REQUESTS_IN_FLIGHT: &str = "pdmesh_frontend_requests_in_flight";
/// Engine outputs naming a request id that no handler waits for (e.g. already aborted).
pub const UNKNOWN_REQUEST_OUTPUTS: &str = "pdmesh_frontend_unknown_request_outputs_total";
/// Abort messages sent to the dp-lb, by reason (`client_disconnect`, `stop_string`,
/// `receiver_gone`, `submit_timeout`, `output_error`, `output_overflow`).
pub const ABORTS_SENT: &str = "pdmesh_frontend_aborts_sent_total";
/// 1 while the DEALER link to the dp-lb is connected, else 0.
pub const ENGINE_LINK_UP: &str = "pdmesh_frontend_engine_link_up";
/// Requests carrying `kv_transfer_params.do_remote_prefill = true` that the frontend refused
/// before admission (their P blocks stay held until P's deadline; see the crate docs).
pub const REMOTE_PREFILL_REJECTIONS: &str = "pdmesh_frontend_remote_prefill_rejections_total";
/// Messages from the dp-lb that the frontend does not expect, by message kind.
pub const UNEXPECTED_MESSAGES: &str = "pdmesh_frontend_unexpected_messages_total";

pub(crate) static FINISH_REASONS_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(FINISH_REASONS, "Generation requests that ended, by finish reason", &["reason"]));

pub(crate) static TTFT: LazyLock<Histogram> =
    LazyLock::new(|| histogram(TIME_TO_FIRST_TOKEN, "Seconds from arrival to the first token", latency_buckets()));

pub(crate) static ITL: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(INTER_TOKEN_LATENCY, "Seconds between token-carrying outputs of a request", latency_buckets())
});

pub(crate) static E2E: LazyLock<Histogram> =
    LazyLock::new(|| histogram(E2E_LATENCY, "Seconds from arrival to the end of a request", latency_buckets()));

pub(crate) static PROMPT_TOKENS_TOTAL: LazyLock<IntCounter> =
    LazyLock::new(|| counter(PROMPT_TOKENS, "Prompt tokens of requests accepted by the engine"));

pub(crate) static GENERATION_TOKENS_TOTAL: LazyLock<IntCounter> =
    LazyLock::new(|| counter(GENERATION_TOKENS, "Tokens generated for requests"));

pub(crate) static IN_FLIGHT: LazyLock<IntGauge> =
    LazyLock::new(|| gauge(REQUESTS_IN_FLIGHT, "Generation requests accepted and not yet finished"));

pub(crate) static UNKNOWN_OUTPUTS: LazyLock<IntCounter> =
    LazyLock::new(|| counter(UNKNOWN_REQUEST_OUTPUTS, "Engine outputs for request ids nobody waits for"));

pub(crate) static ABORTS_SENT_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(ABORTS_SENT, "Abort messages sent to the dp-lb, by reason", &["reason"]));

pub(crate) static LINK_UP: LazyLock<IntGauge> =
    LazyLock::new(|| gauge(ENGINE_LINK_UP, "1 while the link to the dp-lb is connected"));

pub(crate) static KV_RELEASES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_frontend_kv_releases_total", "Held-block references handed back through /v1/kv/release")
});
pub(crate) static REJECTION_NOTICES_SENT: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("pdmesh_frontend_rejection_notices_sent_total", "Rejection notices sent toward P (rule R1)")
});

pub(crate) static REMOTE_PREFILL_REJECTIONS_TOTAL: LazyLock<IntCounter> =
    LazyLock::new(|| counter(REMOTE_PREFILL_REJECTIONS, "Remote-prefill requests refused before admission"));

/// Requests accepted with a structured output (D53), by kind of grammar.
pub(crate) static STRUCTURED_OUTPUTS_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "pdmesh_frontend_structured_output_requests_total",
        "Requests accepted with a structured output or a forced tool call, by kind of grammar",
        &["kind"],
    )
});

/// Requests ended by `limits.request_deadline_s` (D92).
pub(crate) static DEADLINE_EXPIRED_TOTAL: LazyLock<IntCounter> =
    LazyLock::new(|| counter("pdmesh_frontend_request_deadline_expired_total", "Requests ended at their deadline"));

pub(crate) static UNEXPECTED_MESSAGES_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(UNEXPECTED_MESSAGES, "Unexpected messages from the dp-lb, by kind", &["kind"]));

/// Touch every metric so that `/metrics` lists them (at zero) from the start, which keeps
/// dashboards and `rate()` queries well-defined before the first request.
pub(crate) fn init() {
    pdmesh_http_edge::metrics::init();
    LazyLock::force(&FINISH_REASONS_TOTAL);
    LazyLock::force(&TTFT);
    LazyLock::force(&ITL);
    LazyLock::force(&E2E);
    LazyLock::force(&PROMPT_TOKENS_TOTAL);
    LazyLock::force(&GENERATION_TOKENS_TOTAL);
    LazyLock::force(&IN_FLIGHT);
    LazyLock::force(&UNKNOWN_OUTPUTS);
    LazyLock::force(&ABORTS_SENT_TOTAL);
    LazyLock::force(&LINK_UP);
    LazyLock::force(&REMOTE_PREFILL_REJECTIONS_TOTAL);
    LazyLock::force(&UNEXPECTED_MESSAGES_TOTAL);
    LazyLock::force(&STRUCTURED_OUTPUTS_TOTAL);
    pdmesh_openai::metrics::init();
    LazyLock::force(&DEADLINE_EXPIRED_TOTAL);
}

/// Decode legs parked before P answered (D66), by outcome: `parked` (taken in), `expired` (the
/// params never came), `unknown_token` (params for no parked request).
pub const PARKED_REQUESTS: &str = "pdmesh_frontend_parked_requests_total";

pub(crate) static PARKED_REQUESTS_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(PARKED_REQUESTS, "Decode legs taken in before their prefill answered, by outcome", &["outcome"])
});
