//! The HTTP edge's metrics, counted alike by the nodes' frontends and the router (each in its
//! own process, so the names stay `pdmesh_frontend_*`, as dashboards know them). Names are
//! constants so that tests, dashboards and `docs/METRICS.md` can refer to them; labels are
//! static and low-cardinality (route patterns, status codes, error kinds, sources).

use std::sync::LazyLock;

use pdmesh_telemetry::metrics::{counter_vec, gauge};
use prometheus::{IntCounterVec, IntGauge};

/// HTTP requests by route pattern and status code (counted when the response head is sent).
pub const HTTP_REQUESTS: &str = "pdmesh_frontend_http_requests_total";
/// Requests refused or failed, by error kind (`ApiError::kind`).
pub const REQUEST_ERRORS: &str = "pdmesh_frontend_request_errors_total";
/// Requests refused with 401 because no valid API key came with them, by reason (`missing`,
/// `malformed`, `invalid`); docs/SECURITY.md.
pub const UNAUTHORIZED: &str = "pdmesh_frontend_unauthorized_total";
/// Requests let through by a valid API key, by kind of key (`client`, or `internal`: the
/// router calling this node); counted only where keys are required.
pub const AUTHORIZED: &str = "pdmesh_frontend_authorized_total";
/// Generation requests holding a place under `limits.max_in_flight` (from the handler's
/// start to the end of the answer).
pub const HTTP_IN_FLIGHT_REQUESTS: &str = "pdmesh_frontend_http_in_flight_requests";
/// Requests refused because this server's in-flight bound was reached, by `source`
/// (`frontend`, `router`). Refusals decided further in (dp-lb, engine) are counted in
/// `pdmesh_frontend_request_errors_total{kind="overloaded"}` with these.
pub const OVERLOAD_REFUSALS: &str = "pdmesh_frontend_overload_refusals_total";
/// Requests refused with 429 because their API key had `limits.max_in_flight_per_key`
/// requests in flight, by `source` (`frontend`, `router`). No key in the labels: keys are
/// secret and their number is unbounded.
pub const KEY_LIMIT_REFUSALS: &str = "pdmesh_frontend_key_limit_refusals_total";

pub static HTTP_REQUESTS_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(HTTP_REQUESTS, "HTTP requests by route pattern and status", &["endpoint", "status"]));

pub static REQUEST_ERRORS_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(REQUEST_ERRORS, "Requests refused or failed, by error kind", &["kind"]));

pub static UNAUTHORIZED_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(UNAUTHORIZED, "Requests refused with 401 for a missing, malformed or unknown API key", &["reason"])
});

pub static AUTHORIZED_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(AUTHORIZED, "Requests let through by a valid API key, by kind of key", &["credential"])
});

pub static HTTP_IN_FLIGHT: LazyLock<IntGauge> =
    LazyLock::new(|| gauge(HTTP_IN_FLIGHT_REQUESTS, "Generation requests holding a place under limits.max_in_flight"));

pub static OVERLOAD_REFUSALS_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(OVERLOAD_REFUSALS, "Requests refused at this server's in-flight bound, by source", &["source"])
});

pub static KEY_LIMIT_REFUSALS_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(KEY_LIMIT_REFUSALS, "Requests refused with 429 at limits.max_in_flight_per_key, by source", &["source"])
});

/// Touch every metric so that `/metrics` lists them (at zero) from the start.
pub fn init() {
    LazyLock::force(&HTTP_REQUESTS_TOTAL);
    LazyLock::force(&REQUEST_ERRORS_TOTAL);
    LazyLock::force(&UNAUTHORIZED_TOTAL);
    LazyLock::force(&AUTHORIZED_TOTAL);
    LazyLock::force(&HTTP_IN_FLIGHT);
    LazyLock::force(&OVERLOAD_REFUSALS_TOTAL);
    LazyLock::force(&KEY_LIMIT_REFUSALS_TOTAL);
}
