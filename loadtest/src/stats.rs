//! Latency summaries.

use serde::Serialize;

#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub count: usize,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
}

pub fn summarize(samples_ms: &[f64]) -> Summary {
    if samples_ms.is_empty() {
        // NaN (JSON null): "no sample" must not read as a latency of zero.
        return Summary { count: 0, mean_ms: f64::NAN, p50_ms: f64::NAN, p90_ms: f64::NAN, p99_ms: f64::NAN };
    }
    let mut v = samples_ms.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    Summary {
        count: v.len(),
        mean_ms: v.iter().sum::<f64>() / v.len() as f64,
        p50_ms: q(0.5),
        p90_ms: q(0.9),
        p99_ms: q(0.99),
    }
}

/// One measurement run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunResult {
    pub concurrency: usize,
    pub requests: usize,
    pub errors: usize,
    pub wall_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub e2e_mean_ms: f64,
    pub e2e: Summary,
    pub ttft: Summary,
    pub itl: Summary,
    /// In-process only: mean engine step time.
    pub step_mean_ms: f64,
}
