//! Logging, trace context and Prometheus metrics, set up the same way in every service.
//!
//! - [`init`] installs the `tracing` subscriber (`RUST_LOG`, default `info`; JSON lines with
//!   `PDMESH_LOG_FORMAT=json`). OTLP export plugs in here (`docs/OBSERVABILITY.md`).
//! - [`trace`] parses, creates and propagates W3C `traceparent` values so that every
//!   Envelope and HTTP hop of one request carries the same trace id.
//! - [`metrics`] builds metrics in the process-wide registry and serves `/metrics`.

pub mod metrics;
pub mod trace;

use tracing_subscriber::{fmt, prelude::*, EnvFilter};

/// Install the global subscriber for a service. Safe to call twice (the second call is a
/// no-op), so in-process tests can start several services.
pub fn init(service_name: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("PDMESH_LOG_FORMAT").map(|v| v == "json").unwrap_or(false);
    let registry = tracing_subscriber::registry().with(filter);
    let result = if json {
        registry.with(fmt::layer().json().with_current_span(true)).try_init()
    } else {
        registry.with(fmt::layer().with_target(true)).try_init()
    };
    if result.is_ok() {
        metrics::register_process_collector();
        tracing::info!(service = service_name, pid = std::process::id(), "telemetry initialised");
    }
}

pub mod ops;
