//! Which node of a role serves the next request (D55): readiness, load, outlier ejection.
//!
//! Each upstream carries what the router knows of it:
//! - its own count of the router's requests in flight there;
//! - what the node reported on its last `GET /load` (polled every `router.load_poll_ms`):
//!   whether it can serve, its queue depth (`waiting`), `running`, and KV usage;
//! - an EWMA of the latency the router observed there: the gap between two events of a
//!   decode stream, or the whole prefill leg on P;
//! - a circuit breaker: `router.eject_after_failures` failures in a row (connect error, reset,
//!   a 5xx other than an overload 503) eject it for `eject_base_ms`, doubled per ejection in
//!   a row up to `eject_max_ms`; once that passed and its `/load` answers it is tried again
//!   (half-open: the next failure ejects it again at once, a success closes the breaker).
//!
//! `least_loaded` picks, among the ready non-ejected nodes, the lower cost of two candidates
//! (power of two choices; with two nodes, the cheaper one): cost = (1 + outstanding) ×
//! latency × (1 + KV used fraction), outstanding = max(router in flight, node's running +
//! waiting) + node's waiting. The latency factor is Finagle's "EWMA × outstanding" cost: a
//! node twice as slow gets work only once the other has twice its queue, so a slowed node
//! drops out of the rotation under load instead of getting every other request.
//! A node much slower than the best (latency above `SLOW_RATIO` × the best node's) is left out
//! while another can serve: under the cost rule alone it would still get a share of requests,
//! and every token it streams is a slow one, which is what the tail (p99 inter-token latency)
//! is made of. Its latency is a peak EWMA (a slower sample counts at once, a faster one by
//! `EWMA_ALPHA`), and while it gets no work its excess over the best decays with a half-life of
//! `SLOW_PROBE_HALF_LIFE`, so a node that recovered is tried again within a few half-lives.
//! `round_robin` rotates over the ready non-ejected set, whatever the latencies. When no node
//! is eligible, every node not excluded is (better a try than a refusal).
//!
//! `cache_aware` (D59) weighs, besides the cost, how much of the request's prompt each node
//! already holds in its prefix cache (the blocks from the first one on, as the node's `/load`
//! publishes them): score = cost × (1 − `OVERLAP_WEIGHT` × held fraction), lowest wins. Only
//! nodes whose cost is within `LOAD_GUARD` × the cheapest one's compete on overlap, so a hot
//! prefix cannot pile every request on one node (SGLang's balance threshold). Without a prompt
//! (the router could not tokenise it) or with nothing held anywhere, it is `least_loaded`.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use pdmesh_config::RoutingPolicy;
use pdmesh_protocol::prefix::PrefixIndex;
use pdmesh_telemetry::metrics::{counter_vec, gauge_vec, histogram_vec};
use prometheus::{HistogramVec, IntCounterVec, IntGaugeVec};

/// Requests the router sent to each upstream, by `role` and `upstream` (URL).
pub const PICKS: &str = "pdmesh_router_picks_total";
/// Times an upstream was ejected (failures in a row), by `role` and `upstream`.
pub const EJECTIONS: &str = "pdmesh_router_ejections_total";
/// 1 while an upstream is ejected, by `role` and `upstream`.
pub const EJECTED: &str = "pdmesh_router_upstream_ejected";
/// The router's requests in flight on each upstream, by `role` and `upstream`.
pub const UPSTREAM_IN_FLIGHT: &str = "pdmesh_router_upstream_in_flight";
/// Failed calls to an upstream that count toward ejection, by `role` and `upstream`.
pub const UPSTREAM_FAILURES: &str = "pdmesh_router_upstream_failures_total";

/// Prompt blocks the chosen node already held, per cache-aware pick, by `role`.
pub const PREFIX_OVERLAP: &str = "pdmesh_router_prefix_overlap_blocks";
/// Cache-aware picks, by `role` and `reason`: `overlap` (the node holding more of the prompt
/// won over a cheaper one), `load` (the cheapest node won), `no_prefix` (nothing held).
pub const CACHE_AWARE_PICKS: &str = "pdmesh_router_cache_aware_picks_total";

static PREFIX_OVERLAP_HIST: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram_vec(
        PREFIX_OVERLAP,
        "Prompt blocks the chosen upstream already held (cache-aware routing)",
        &["role"],
        vec![0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0],
    )
});
static CACHE_AWARE_PICKS_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(CACHE_AWARE_PICKS, "Cache-aware picks by what decided them", &["role", "reason"]));

static PICKS_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(PICKS, "Requests sent to each upstream", &["role", "upstream"]));
static EJECTIONS_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(EJECTIONS, "Upstream ejections after failures in a row", &["role", "upstream"]));
static EJECTED_GAUGE: LazyLock<IntGaugeVec> =
    LazyLock::new(|| gauge_vec(EJECTED, "1 while an upstream is ejected", &["role", "upstream"]));
static IN_FLIGHT_GAUGE: LazyLock<IntGaugeVec> =
    LazyLock::new(|| gauge_vec(UPSTREAM_IN_FLIGHT, "Router requests in flight per upstream", &["role", "upstream"]));
static FAILURES_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(UPSTREAM_FAILURES, "Failed upstream calls counted toward ejection", &["role", "upstream"])
});

/// Weight of a new, faster latency sample in the EWMA (slower ones count at once).
const EWMA_ALPHA: f64 = 0.1;
/// A node whose latency is above this many times the best node's is left out (least_loaded).
const SLOW_RATIO: f64 = 3.0;
/// Half-life of a left-out node's latency excess over the best, while it gets no samples.
const SLOW_PROBE_HALF_LIFE: Duration = Duration::from_secs(10);
/// `cache_aware`: how much a fully held prompt lowers a node's cost (0.9: to a tenth).
const OVERLAP_WEIGHT: f64 = 0.9;
/// `cache_aware`: a node costing more than this many times the cheapest competes on load only.
const LOAD_GUARD: f64 = 4.0;

/// What a node says of itself on `GET /load`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NodeLoad {
    pub ready: bool,
    pub waiting: u32,
    pub running: u32,
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
    /// What its prefix caches hold (D59); absent with caching off and from older nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<pdmesh_protocol::PrefixSummary>,
}

/// Ejection settings (`router.eject_*`).
#[derive(Debug, Clone, Copy)]
pub struct Breaker {
    pub after_failures: u32,
    pub base: Duration,
    pub max: Duration,
}

#[derive(Debug, Default)]
struct State {
    /// Last poll: `None` before the first answer (and with polling off); its `prefix` is
    /// moved into `prefix`.
    load: Option<NodeLoad>,
    /// The node's prefix cache as its last poll published it.
    prefix: PrefixIndex,
    /// The last poll failed (connect error, timeout, a non-2xx other than 404).
    unreachable: bool,
    latency: Option<f64>,
    /// When `latency` last got a sample.
    latency_at: Option<Instant>,
    failures_in_row: u32,
    /// Ejections in a row (0: the breaker is closed).
    ejections: u32,
    ejected_until: Option<Instant>,
}

/// One node of a role.
#[derive(Debug)]
pub struct Upstream {
    pub url: String,
    in_flight: AtomicU32,
    state: Mutex<State>,
}

/// The nodes of one role and how to pick among them.
#[derive(Debug)]
pub struct Pool {
    role: &'static str,
    nodes: Vec<Upstream>,
    next: AtomicUsize,
    policy: RoutingPolicy,
    breaker: Breaker,
}

/// The node a pick chose and, for a `cache_aware` pick with a prompt, how many of its blocks
/// that node holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Picked {
    pub node: usize,
    pub overlap: Option<usize>,
}

/// One request's place on an upstream: counted in its in-flight number until dropped.
#[derive(Debug)]
pub struct InFlight<'a> {
    pool: &'a Pool,
    index: usize,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(u) = self.pool.nodes.get(self.index) {
            u.in_flight.fetch_sub(1, Ordering::Relaxed);
            IN_FLIGHT_GAUGE.with_label_values(&[self.pool.role, &u.url]).dec();
        }
    }
}

impl Pool {
    pub fn new(role: &'static str, urls: &[String], policy: RoutingPolicy, breaker: Breaker) -> Self {
        let nodes = urls
            .iter()
            .map(|u| {
                let url = u.trim_end_matches('/').to_string();
                PICKS_TOTAL.with_label_values(&[role, &url]);
                EJECTIONS_TOTAL.with_label_values(&[role, &url]);
                FAILURES_TOTAL.with_label_values(&[role, &url]);
                EJECTED_GAUGE.with_label_values(&[role, &url]).set(0);
                IN_FLIGHT_GAUGE.with_label_values(&[role, &url]).set(0);
                Upstream { url, in_flight: AtomicU32::new(0), state: Mutex::new(State::default()) }
            })
            .collect();
        Self { role, nodes, next: AtomicUsize::new(0), policy, breaker }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn url(&self, i: usize) -> Option<&str> {
        self.nodes.get(i).map(|u| u.url.as_str())
    }

    pub fn urls(&self) -> impl Iterator<Item = &str> {
        self.nodes.iter().map(|u| u.url.as_str())
    }

    fn with_state<T>(&self, i: usize, f: impl FnOnce(&mut State) -> T) -> Option<T> {
        let u = self.nodes.get(i)?;
        let mut guard = match u.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        Some(f(&mut guard))
    }

    /// Whether node `i` may get a request now: not ejected (or its ejection is over) and not
    /// known to be unable to serve.
    fn eligible(&self, i: usize, now: Instant) -> bool {
        self.with_state(i, |s| {
            let ejected = s.ejected_until.is_some_and(|t| now < t);
            let ready = !s.unreachable && s.load.as_ref().is_none_or(|l| l.ready);
            !ejected && ready
        })
        .unwrap_or(false)
    }

    /// The cost of one more request on node `i` (see the module docs).
    /// Node `i`'s latency as the picker sees it: measured, with its excess over `best` decayed
    /// by the time without samples; `best` for a node not measured yet.
    fn latency(&self, i: usize, best: f64, now: Instant) -> f64 {
        self.with_state(i, |s| match (s.latency, s.latency_at) {
            (Some(l), Some(at)) if l > best => {
                let age = now.saturating_duration_since(at).as_secs_f64();
                best + (l - best) * 0.5f64.powf(age / SLOW_PROBE_HALF_LIFE.as_secs_f64())
            }
            (Some(l), _) => l,
            (None, _) => best,
        })
        .unwrap_or(best)
    }

    fn cost(&self, i: usize, latency: f64) -> f64 {
        let Some(u) = self.nodes.get(i) else { return f64::INFINITY };
        let in_flight = f64::from(u.in_flight.load(Ordering::Relaxed));
        self.with_state(i, |s| {
            let (reported, waiting, kv) = match &s.load {
                Some(l) => {
                    let kv =
                        if l.kv_total_blocks > 0 { l.kv_used_blocks as f64 / l.kv_total_blocks as f64 } else { 0.0 };
                    (f64::from(l.running.saturating_add(l.waiting)), f64::from(l.waiting), kv)
                }
                None => (0.0, 0.0, 0.0),
            };
            let outstanding = in_flight.max(reported) + waiting;
            (1.0 + outstanding) * latency * (1.0 + kv)
        })
        .unwrap_or(f64::INFINITY)
    }

    /// Pick a node for one request, never one of `exclude` (nodes this request already failed
    /// on). Counts the pick; the caller holds [`Pool::start`] while the call runs.
    pub fn pick(&self, exclude: &[usize]) -> Option<usize> {
        self.pick_for(exclude, None).map(|p| p.node)
    }

    /// [`Pool::pick`] for a request whose prompt is `prompt` (token ids, when the router could
    /// tokenise it), which `cache_aware` weighs against what each node holds.
    pub fn pick_for(&self, exclude: &[usize], prompt: Option<&[u32]>) -> Option<Picked> {
        let now = Instant::now();
        let allowed: Vec<usize> = (0..self.nodes.len()).filter(|i| !exclude.contains(i)).collect();
        let eligible: Vec<usize> = allowed.iter().copied().filter(|&i| self.eligible(i, now)).collect();
        let candidates = if eligible.is_empty() { allowed } else { eligible };
        if candidates.is_empty() {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let mut overlap = None;
        let chosen = match (self.policy, prompt) {
            (RoutingPolicy::RoundRobin, _) => candidates[turn % candidates.len()],
            (RoutingPolicy::CacheAware, Some(tokens)) => {
                let (i, held) = self.cache_aware(&candidates, turn, tokens, now);
                overlap = Some(held);
                i
            }
            (RoutingPolicy::LeastLoaded | RoutingPolicy::CacheAware, _) => {
                // Nodes not measured yet count at the best measured latency, so they get tried.
                let best = candidates
                    .iter()
                    .filter_map(|&i| self.with_state(i, |s| s.latency).flatten())
                    .fold(None, |m: Option<f64>, l| Some(m.map_or(l, |m| m.min(l))))
                    .unwrap_or(1.0);
                let latency: Vec<(usize, f64)> = candidates.iter().map(|&i| (i, self.latency(i, best, now))).collect();
                let fast: Vec<usize> =
                    latency.iter().filter(|(_, l)| *l <= SLOW_RATIO * best).map(|(i, _)| *i).collect();
                let candidates = if fast.is_empty() { candidates } else { fast };
                let latency_of = |i: usize| latency.iter().find(|(j, _)| *j == i).map_or(best, |(_, l)| *l);
                let a = candidates[turn % candidates.len()];
                let b = if candidates.len() > 2 {
                    // Power of two choices: a second candidate other than `a`, spread by `turn`.
                    let step = 1 + (turn / candidates.len()) % (candidates.len() - 1);
                    candidates[(turn + step) % candidates.len()]
                } else {
                    candidates[(turn + 1) % candidates.len()]
                };
                if self.cost(b, latency_of(b)) < self.cost(a, latency_of(a)) {
                    b
                } else {
                    a
                }
            }
        };
        if let Some(u) = self.nodes.get(chosen) {
            PICKS_TOTAL.with_label_values(&[self.role, &u.url]).inc();
        }
        Some(Picked { node: chosen, overlap })
    }

    /// Node `i`'s latency and the best among `candidates`, as `least_loaded` weighs them.
    fn latencies(&self, candidates: &[usize], now: Instant) -> Vec<(usize, f64)> {
        let best = candidates
            .iter()
            .filter_map(|&i| self.with_state(i, |s| s.latency).flatten())
            .fold(None, |m: Option<f64>, l| Some(m.map_or(l, |m| m.min(l))))
            .unwrap_or(1.0);
        let latency: Vec<(usize, f64)> = candidates.iter().map(|&i| (i, self.latency(i, best, now))).collect();
        let fast: Vec<(usize, f64)> = latency.iter().copied().filter(|(_, l)| *l <= SLOW_RATIO * best).collect();
        if fast.is_empty() {
            latency
        } else {
            fast
        }
    }

    /// Prompt blocks each of `candidates` holds, counting from the first; the keys are hashed
    /// once per distinct chain (root and block size) among the nodes.
    fn overlaps(&self, candidates: &[usize], tokens: &[u32]) -> Vec<usize> {
        let mut hashed: Vec<(PrefixIndex, Option<Vec<u64>>)> = Vec::new();
        candidates
            .iter()
            .map(|&i| {
                self.with_state(i, |s| {
                    let known = hashed.iter().find(|(idx, _)| idx.same_chain(&s.prefix)).map(|(_, k)| k.clone());
                    let keys = known.unwrap_or_else(|| {
                        let keys = s.prefix.keys_of(tokens);
                        if keys.is_some() {
                            hashed.push((s.prefix.clone(), keys.clone()));
                        }
                        keys
                    });
                    keys.map_or(0, |k| s.prefix.overlap_of(&k))
                })
                .unwrap_or(0)
            })
            .collect()
    }

    /// The `cache_aware` choice among `candidates` (see the module docs) and the blocks of the
    /// prompt the chosen node holds. Ties go round the candidates by `turn`.
    fn cache_aware(&self, candidates: &[usize], turn: usize, tokens: &[u32], now: Instant) -> (usize, usize) {
        let latency = self.latencies(candidates, now);
        let nodes: Vec<usize> = latency.iter().map(|(i, _)| *i).collect();
        let held = self.overlaps(&nodes, tokens);
        let cost: Vec<f64> = latency.iter().map(|&(i, l)| self.cost(i, l)).collect();
        let blocks = (tokens.len() / self.block_size_hint().max(1) as usize).max(1);
        let cheapest = cost.iter().copied().fold(f64::INFINITY, f64::min);
        let n = nodes.len();
        let score = |k: usize| {
            let c = cost[k];
            let fraction = (held[k] as f64 / blocks as f64).min(1.0);
            if c <= LOAD_GUARD * cheapest {
                c * (1.0 - OVERLAP_WEIGHT * fraction)
            } else {
                c
            }
        };
        let order = (0..n).map(|k| (k + turn) % n.max(1));
        let best = order.clone().min_by(|&a, &b| score(a).total_cmp(&score(b))).unwrap_or(0);
        let by_load = order.min_by(|&a, &b| cost[a].total_cmp(&cost[b])).unwrap_or(0);
        let reason = match held.get(best) {
            Some(0) | None => "no_prefix",
            Some(_) if best != by_load && held.get(best) > held.get(by_load) => "overlap",
            Some(_) => "load",
        };
        let chosen_held = held.get(best).copied().unwrap_or(0);
        PREFIX_OVERLAP_HIST.with_label_values(&[self.role]).observe(chosen_held as f64);
        CACHE_AWARE_PICKS_TOTAL.with_label_values(&[self.role, reason]).inc();
        (nodes.get(best).copied().unwrap_or(candidates[turn % candidates.len()]), chosen_held)
    }

    /// The block size the nodes publish (the first that says), for the held fraction.
    fn block_size_hint(&self) -> u32 {
        (0..self.nodes.len())
            .filter_map(|i| self.with_state(i, |s| s.load.as_ref().map(|_| s.prefix.block_size())).flatten())
            .find(|&b| b > 0)
            .unwrap_or(16)
    }

    /// Count one request in flight on node `i` until the returned guard drops.
    pub fn start(&self, i: usize) -> InFlight<'_> {
        if let Some(u) = self.nodes.get(i) {
            u.in_flight.fetch_add(1, Ordering::Relaxed);
            IN_FLIGHT_GAUGE.with_label_values(&[self.role, &u.url]).inc();
        }
        InFlight { pool: self, index: i }
    }

    /// Node `i` served a call: its failures in a row start over and its breaker closes.
    pub fn success(&self, i: usize) {
        let closed = self.with_state(i, |s| {
            s.failures_in_row = 0;
            let was_open = s.ejections > 0;
            if was_open && s.ejected_until.is_none_or(|t| Instant::now() >= t) {
                s.ejections = 0;
                s.ejected_until = None;
                return true;
            }
            false
        });
        if closed == Some(true) {
            if let Some(url) = self.url(i) {
                EJECTED_GAUGE.with_label_values(&[self.role, url]).set(0);
                tracing::info!(role = self.role, upstream = url, "upstream serves again; back in rotation");
            }
        }
    }

    /// Node `i` failed a call (connect error, reset, a 5xx other than an overload 503).
    pub fn failure(&self, i: usize, why: &str) {
        let Some(url) = self.url(i).map(str::to_string) else { return };
        FAILURES_TOTAL.with_label_values(&[self.role, &url]).inc();
        let breaker = self.breaker;
        if breaker.after_failures == 0 {
            return;
        }
        let ejected_for = self.with_state(i, |s| {
            s.failures_in_row = s.failures_in_row.saturating_add(1);
            // Half-open (back after an ejection, not yet proven): one failure is enough.
            if s.failures_in_row >= breaker.after_failures || s.ejections > 0 {
                s.ejections = s.ejections.saturating_add(1);
                s.failures_in_row = 0;
                let factor = 1u32 << (s.ejections - 1).min(16);
                let length = breaker.base.saturating_mul(factor).min(breaker.max);
                s.ejected_until = Some(Instant::now() + length);
                return Some(length);
            }
            None
        });
        if let Some(Some(length)) = ejected_for {
            EJECTIONS_TOTAL.with_label_values(&[self.role, &url]).inc();
            EJECTED_GAUGE.with_label_values(&[self.role, &url]).set(1);
            tracing::warn!(role = self.role, upstream = %url, reason = why, ejected_ms = length.as_millis() as u64,
                "upstream ejected after failures in a row");
        }
    }

    /// One latency sample (seconds) of node `i`.
    pub fn observe_latency(&self, i: usize, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        self.with_state(i, |s| {
            s.latency = Some(match s.latency {
                Some(l) if seconds < l => l + EWMA_ALPHA * (seconds - l),
                _ => seconds,
            });
            s.latency_at = Some(Instant::now());
        });
    }

    /// The outcome of one poll of node `i`: its load, or `None` when it did not answer.
    pub fn set_load(&self, i: usize, load: Option<NodeLoad>) {
        self.with_state(i, |s| match load {
            Some(mut l) => {
                s.prefix = l.prefix.take().map(|p| PrefixIndex::from_summary(&p)).unwrap_or_default();
                s.load = Some(l);
                s.unreachable = false;
            }
            None => s.unreachable = true,
        });
    }

    /// A view of each node for tests: (url, in flight, ejected, latency).
    #[cfg(test)]
    pub fn snapshot(&self) -> Vec<(String, u32, bool, Option<f64>)> {
        let now = Instant::now();
        (0..self.nodes.len())
            .filter_map(|i| {
                let u = self.nodes.get(i)?;
                self.with_state(i, |s| {
                    (
                        u.url.clone(),
                        u.in_flight.load(Ordering::Relaxed),
                        s.ejected_until.is_some_and(|t| now < t),
                        s.latency,
                    )
                })
            })
            .collect()
    }
}

/// Poll every node of `pools` on `GET /load` every `period` until the task is dropped. A node
/// that answers 404 (a frontend without the endpoint) counts as ready with no load figures.
pub async fn poll_loads(
    pools: Vec<std::sync::Arc<Pool>>,
    client: reqwest::Client,
    authorization: Option<String>,
    period: Duration,
) {
    let timeout = period.max(Duration::from_millis(500));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let polls = pools
            .iter()
            .flat_map(|pool| (0..pool.len()).filter_map(|i| pool.url(i).map(|u| (pool.clone(), i, u.to_string()))));
        let polls = polls.map(|(pool, i, url)| {
            let mut rb = client.get(format!("{url}/load")).timeout(timeout);
            if let Some(v) = &authorization {
                rb = rb.header(reqwest::header::AUTHORIZATION, v.as_str());
            }
            async move {
                let load = match rb.send().await {
                    Ok(r) if r.status().is_success() => r.json::<NodeLoad>().await.ok(),
                    Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
                        Some(NodeLoad { ready: true, ..Default::default() })
                    }
                    Ok(r) if r.status() == reqwest::StatusCode::UNAUTHORIZED => {
                        Some(NodeLoad { ready: true, ..Default::default() })
                    }
                    Ok(_) | Err(_) => None,
                };
                pool.set_load(i, load);
            }
        });
        futures::future::join_all(polls).await;
    }
}

/// Touch the router's metrics so `/metrics` lists them from the start.
pub(crate) fn init() {
    LazyLock::force(&PICKS_TOTAL);
    LazyLock::force(&EJECTIONS_TOTAL);
    LazyLock::force(&EJECTED_GAUGE);
    LazyLock::force(&IN_FLIGHT_GAUGE);
    LazyLock::force(&FAILURES_TOTAL);
    LazyLock::force(&PREFIX_OVERLAP_HIST);
    LazyLock::force(&CACHE_AWARE_PICKS_TOTAL);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(policy: RoutingPolicy) -> Pool {
        let urls = vec!["http://a".to_string(), "http://b".to_string()];
        Pool::new(
            "decode",
            &urls,
            policy,
            Breaker { after_failures: 2, base: Duration::from_millis(50), max: Duration::from_secs(1) },
        )
    }

    #[test]
    fn least_loaded_leaves_a_much_slower_node_out() {
        let p = pool(RoutingPolicy::LeastLoaded);
        p.observe_latency(0, 0.010);
        p.observe_latency(1, 0.040);
        for _ in 0..6 {
            assert_eq!(p.pick(&[]), Some(0), "4× slower than the best: left out");
        }
        assert_eq!(p.pick(&[0]), Some(1), "but tried when it is the only one left");
    }

    #[test]
    fn least_loaded_avoids_the_slower_node_until_the_fast_one_queues() {
        let p = pool(RoutingPolicy::LeastLoaded);
        p.observe_latency(0, 0.010);
        p.observe_latency(1, 0.025);
        let mut held = Vec::new();
        let mut on_b = 0;
        for _ in 0..10 {
            let i = p.pick(&[]).unwrap();
            on_b += usize::from(i == 1);
            held.push(p.start(i));
        }
        // a's cost (1+n)·10 ms passes b's 25 ms at n = 2; b's second request costs 50 ms.
        assert!((1..=4).contains(&on_b), "the 2.5× slower node got {on_b} of 10");
        drop(held);
        assert!(p.snapshot().iter().all(|(_, n, _, _)| *n == 0));
    }

    #[test]
    fn round_robin_alternates_whatever_the_latency() {
        let p = pool(RoutingPolicy::RoundRobin);
        p.observe_latency(1, 10.0);
        let picks: Vec<usize> = (0..4).map(|_| p.pick(&[]).unwrap()).collect();
        assert_eq!(picks.iter().filter(|&&i| i == 1).count(), 2);
    }

    #[test]
    fn failures_in_a_row_eject_and_a_success_after_the_backoff_brings_back() {
        let p = pool(RoutingPolicy::RoundRobin);
        p.failure(0, "connect");
        assert!(!p.snapshot()[0].2, "one failure is not enough");
        p.success(0);
        p.failure(0, "connect");
        assert!(!p.snapshot()[0].2, "a success in between starts the count over");
        p.failure(0, "connect");
        assert!(p.snapshot()[0].2, "two in a row eject");
        for _ in 0..6 {
            assert_eq!(p.pick(&[]), Some(1), "an ejected node gets nothing while another can serve");
        }
        assert_eq!(p.pick(&[1]), Some(0), "but is tried when it is the only one left");
        std::thread::sleep(Duration::from_millis(60));
        assert!(!p.snapshot()[0].2, "the ejection is over");
        // Half-open: one failure ejects again, for twice as long.
        p.failure(0, "reset");
        assert!(p.snapshot()[0].2);
        std::thread::sleep(Duration::from_millis(110));
        p.success(0);
        p.failure(0, "reset");
        assert!(!p.snapshot()[0].2, "after a success the breaker is closed: one failure is not enough");
    }

    /// A `/load` answer of a node whose prefix cache holds the first `blocks` blocks of `tokens`.
    fn holding(tokens: &[u32], blocks: usize) -> NodeLoad {
        let root = pdmesh_protocol::prefix::root_hash("m");
        let keys = pdmesh_protocol::prefix::prompt_keys(&root, 4, tokens);
        let prefix = pdmesh_protocol::PrefixSummary {
            block_size: 4,
            root: root.to_vec(),
            blocks: keys.into_iter().take(blocks).collect(),
        };
        NodeLoad { ready: true, kv_total_blocks: 100, prefix: Some(prefix), ..Default::default() }
    }

    #[test]
    fn cache_aware_prefers_the_holder_of_the_prefix_within_the_load_guard() {
        let p = pool(RoutingPolicy::CacheAware);
        let prompt: Vec<u32> = (0..40).collect();
        p.set_load(0, Some(holding(&prompt, 0)));
        p.set_load(1, Some(holding(&prompt, 9)));
        for _ in 0..4 {
            let picked = p.pick_for(&[], Some(&prompt)).unwrap();
            assert_eq!(picked, Picked { node: 1, overlap: Some(9) }, "the node holding 9 of 10 blocks");
        }
        // a little busier: the overlap still wins (cost 3× but 0.19 of it)
        let busy: Vec<_> = (0..2).map(|_| p.start(1)).collect();
        assert_eq!(p.pick_for(&[], Some(&prompt)).unwrap().node, 1);
        // past the load guard (cost 5× the cheapest): the load decides
        let busier: Vec<_> = (0..2).map(|_| p.start(1)).collect();
        assert_eq!(p.pick_for(&[], Some(&prompt)).unwrap().node, 0);
        drop((busy, busier));
        // an ejected holder is not picked for its overlap
        p.failure(1, "connect");
        p.failure(1, "connect");
        assert_eq!(p.pick_for(&[], Some(&prompt)).unwrap().node, 0);
        // without a prompt the pick is least_loaded's and reports no overlap
        assert_eq!(p.pick_for(&[], None).unwrap().overlap, None);
        // a prompt nobody holds: plain load order, overlap 0
        let other: Vec<u32> = (100..140).collect();
        assert_eq!(p.pick_for(&[1], Some(&other)).unwrap(), Picked { node: 0, overlap: Some(0) });
    }

    #[test]
    fn a_node_that_does_not_answer_its_poll_is_not_picked() {
        let p = pool(RoutingPolicy::LeastLoaded);
        p.set_load(1, None);
        for _ in 0..4 {
            assert_eq!(p.pick(&[]), Some(0));
        }
        p.set_load(0, Some(NodeLoad { ready: false, ..Default::default() }));
        assert!(p.pick(&[]).is_some(), "with none eligible, any node is tried");
        p.set_load(1, Some(NodeLoad { ready: true, ..Default::default() }));
        assert_eq!(p.pick(&[]), Some(1));
        assert_eq!(p.pick(&[1]), Some(0));
        assert_eq!(p.pick(&[0, 1]), None);
    }
}
