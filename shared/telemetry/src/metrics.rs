//! Prometheus metrics in the process-wide default registry.
//!
//! Metric names are constants in each service's `metrics.rs` and listed in `docs/METRICS.md`.
//! Definitions are static, so building one cannot fail at run time for a reason that depends
//! on input; the constructors below still never panic: a definition that the registry refuses
//! (a duplicate name) is logged and returned unregistered.

use actix_web::{HttpResponse, Responder};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

fn register<C: prometheus::core::Collector + Clone + 'static>(c: C, name: &str) -> C {
    if let Err(e) = prometheus::default_registry().register(Box::new(c.clone())) {
        tracing::warn!(metric = name, error = %e, "metric not registered");
    }
    c
}

/// Build a metric, falling back to a placeholder name if the definition is refused.
macro_rules! build {
    ($ty:ty, $make:expr, $fallback:expr) => {
        match $make {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(error = %e, "invalid metric definition");
                $fallback
            }
        }
    };
}

fn fallback_opts() -> Opts {
    Opts::new("pdmesh_invalid_metric", "a metric whose definition was invalid")
}

pub fn counter(name: &str, help: &str) -> IntCounter {
    let c = build!(
        IntCounter,
        IntCounter::with_opts(Opts::new(name, help)),
        IntCounter::with_opts(fallback_opts()).unwrap_or_else(|_| unreachable_metric())
    );
    register(c, name)
}

pub fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = build!(
        IntCounterVec,
        IntCounterVec::new(Opts::new(name, help), labels),
        IntCounterVec::new(fallback_opts(), labels).unwrap_or_else(|_| unreachable_metric())
    );
    register(c, name)
}

/// A counter of non-integer amounts (e.g. block-seconds), by labels.
pub fn float_counter_vec(name: &str, help: &str, labels: &[&str]) -> prometheus::CounterVec {
    let c = build!(
        prometheus::CounterVec,
        prometheus::CounterVec::new(Opts::new(name, help), labels),
        prometheus::CounterVec::new(fallback_opts(), labels).unwrap_or_else(|_| unreachable_metric())
    );
    register(c, name)
}

pub fn gauge(name: &str, help: &str) -> IntGauge {
    let g = build!(
        IntGauge,
        IntGauge::with_opts(Opts::new(name, help)),
        IntGauge::with_opts(fallback_opts()).unwrap_or_else(|_| unreachable_metric())
    );
    register(g, name)
}

pub fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = build!(
        IntGaugeVec,
        IntGaugeVec::new(Opts::new(name, help), labels),
        IntGaugeVec::new(fallback_opts(), labels).unwrap_or_else(|_| unreachable_metric())
    );
    register(g, name)
}

pub fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    let h = build!(
        Histogram,
        Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)),
        Histogram::with_opts(HistogramOpts::new("pdmesh_invalid_metric", "invalid"))
            .unwrap_or_else(|_| unreachable_metric())
    );
    register(h, name)
}

pub fn histogram_vec(name: &str, help: &str, labels: &[&str], buckets: Vec<f64>) -> HistogramVec {
    let h = build!(
        HistogramVec,
        HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels),
        HistogramVec::new(HistogramOpts::new("pdmesh_invalid_metric", "invalid"), labels)
            .unwrap_or_else(|_| unreachable_metric())
    );
    register(h, name)
}

#[allow(clippy::panic)]
fn unreachable_metric<T>() -> T {
    // The fallback definitions above are constant and valid (see tests); this cannot run.
    panic!("constant fallback metric definition rejected")
}

/// Latency buckets in seconds, from 100 µs to 60 s.
pub fn latency_buckets() -> Vec<f64> {
    vec![
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0,
    ]
}

/// Register the process collector (CPU, memory, fds) once.
pub fn register_process_collector() {
    let pc = prometheus::process_collector::ProcessCollector::for_self();
    let _ = prometheus::default_registry().register(Box::new(pc));
}

/// Render every metric of this process in the Prometheus text format.
pub fn render() -> String {
    let mut buf = Vec::new();
    let encoder = prometheus::TextEncoder::new();
    if let Err(e) = encoder.encode(&prometheus::gather(), &mut buf) {
        tracing::error!(error = %e, "cannot encode metrics");
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// actix-web handler for `GET /metrics`.
pub async fn metrics_handler() -> impl Responder {
    HttpResponse::Ok().content_type("text/plain; version=0.0.4").body(render())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render() {
        let c = counter("pdmesh_test_counter_total", "test");
        c.inc();
        let v = counter_vec("pdmesh_test_vec_total", "test", &["kind"]);
        v.with_label_values(&["a"]).inc_by(2);
        let h = histogram("pdmesh_test_seconds", "test", latency_buckets());
        h.observe(0.01);
        let text = render();
        assert!(text.contains("pdmesh_test_counter_total 1"));
        assert!(text.contains("pdmesh_test_vec_total{kind=\"a\"} 2"));
        assert!(text.contains("pdmesh_test_seconds_count 1"));
        // the fallbacks are valid definitions
        assert!(IntCounter::with_opts(fallback_opts()).is_ok());
    }
}
