//! Logging, tracing, trace context and Prometheus metrics, set up the same way in every service.
//!
//! - [`init_service`] installs the `tracing` subscriber (`RUST_LOG`, default `info`; JSON lines
//!   with `PDMESH_LOG_FORMAT=json`) and, when the `OTEL_*` environment asks for it, the
//!   OpenTelemetry layer that exports spans over OTLP ([`otlp`], `docs/TRACING.md`).
//! - [`trace`] parents spans on the W3C context of an incoming Envelope or HTTP request, and
//!   puts the current span's context on outgoing ones, so one request is one trace.
//! - [`metrics`] builds metrics in the process-wide registry and serves `/metrics`.
//! - [`log_limit`] keeps storms of one event (overload refusals) to one log line a second.

pub mod log_limit;
pub mod metrics;
pub mod otlp;
pub mod trace;

use std::sync::atomic::{AtomicBool, Ordering};

pub use otlp::ServiceIdentity;
use tracing_subscriber::{fmt, prelude::*, EnvFilter};

/// Set once the OpenTelemetry layer is installed; [`trace`] falls back to plain W3C id
/// propagation (no spans exported) while it is not.
static OTEL_ACTIVE: AtomicBool = AtomicBool::new(false);

/// Whether spans of this process are exported over OTLP.
pub fn otel_active() -> bool {
    OTEL_ACTIVE.load(Ordering::Acquire)
}

/// Install the global subscriber without OTLP export. Safe to call twice (the second call is
/// a no-op), so in-process tests can start several services.
pub fn init(service_name: &str) {
    let _guard = install(&ServiceIdentity::new(service_name, "", None), false);
}

/// Keeps the OTLP pipeline of a service alive; dropping it flushes queued spans. Drop it from
/// plain code after the service's runtime stopped (the flush blocks).
#[derive(Debug, Default)]
pub struct TelemetryGuard {
    pipeline: Option<otlp::OtlpPipeline>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.pipeline.take() {
            p.shutdown();
        }
    }
}

/// Install the global subscriber for one service process, with OTLP export when the
/// environment asks for it (see [`otlp`]). A failing exporter set-up is reported and the
/// service runs without export: tracing must never stop a mesh from serving.
pub fn init_service(id: &ServiceIdentity) -> TelemetryGuard {
    install(id, otlp::requested())
}

fn install(id: &ServiceIdentity, want_otlp: bool) -> TelemetryGuard {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("PDMESH_LOG_FORMAT").map(|v| v == "json").unwrap_or(false);
    let (pipeline, otlp_error) = if want_otlp {
        match otlp::OtlpPipeline::start(id) {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        }
    } else {
        (None, None)
    };
    let otel_layer = pipeline.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer()));
    let fmt_layer = if json {
        fmt::layer().json().with_current_span(true).boxed()
    } else {
        fmt::layer().with_target(true).with_ansi(colour_wanted()).boxed()
    };
    let result = tracing_subscriber::registry().with(filter).with(fmt_layer).with(otel_layer).try_init();
    if result.is_err() {
        // Already installed (in-process tests): keep the first subscriber; drop our pipeline.
        return TelemetryGuard { pipeline: None };
    }
    metrics::register_process_collector();
    if pipeline.is_some() {
        OTEL_ACTIVE.store(true, Ordering::Release);
    }
    let protocol = pipeline.as_ref().map(|p| p.protocol).unwrap_or("off");
    tracing::info!(service = %id.service, node = %id.node, pid = std::process::id(), otlp = protocol,
        "telemetry initialised");
    if let Some(e) = otlp_error {
        tracing::error!(error = %e, "OTLP trace export is off");
    }
    TelemetryGuard { pipeline }
}

pub mod ops;

/// Colour codes only on a terminal: log lines go to standard output, which `pdmesh up`,
/// compose and Kubernetes point at files, where escape codes only hinder `grep` and log
/// shippers. `NO_COLOR` (https://no-color.org) turns them off on a terminal too.
fn colour_wanted() -> bool {
    use std::io::IsTerminal as _;
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
