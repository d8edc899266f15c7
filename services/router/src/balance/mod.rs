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
//! Which node a pick takes among the eligible ones is the policy's ([`crate::policy`]: one file
//! each for `round_robin`, `least_loaded`, `power_of_two` and `cache_aware`); this module
//! decides which nodes are eligible and what each costs: cost = (1 + outstanding) ×
//! latency × (1 + KV used fraction), outstanding = max(router in flight, node's running +
//! waiting) + node's waiting. The latency factor is Finagle's "EWMA × outstanding" cost: a
//! node twice as slow gets work only once the other has twice its queue, so a slowed node
//! drops out of the rotation under load instead of getting every other request.
//! A node much slower than the best (latency above `SLOW_RATIO` × the best node's) is left out
//! while another can serve: under the cost rule alone it would still get a share of requests,
//! and every token it streams is a slow one, which is what the tail (p99 inter-token latency)
//! is made of. Its latency is a peak EWMA (a slower sample counts at once, a faster one by
//! `EWMA_ALPHA`). How a left-out node comes back depends on the pool:
//! - decode nodes with `router.slow_probe_ms` set (D104): the decision to leave a node out
//!   reads a smoothed latency (`SPEED_ALPHA` both ways, so one late token does not count),
//!   the node stays out, whatever time passes, until a probe the router sends it itself
//!   ([`super::probe`]) measures it within `router.slow_ratio` of the fastest node in
//!   rotation. Before, its estimate decayed until a live request was spent on it, and every
//!   such request was one user's whole stream at the slow node's pace (the p99 of issue 44);
//! - prefill nodes (a probe would hold P's blocks) and decode nodes without probes: its excess
//!   over the best decays with a half-life of `SLOW_PROBE_HALF_LIFE`, so a node that recovered
//!   is tried again within a few half-lives (D55).
//!
//! A policy that weighs no latency (`round_robin`) sees every ready non-ejected node. When no
//! node is eligible, every node not excluded is (better a try than a refusal).
//!
//! The set of nodes may change while the router runs (D61): [`discover`] re-resolves a role's
//! DNS name and [`Pool::sync_discovered`] applies the difference. Requests therefore name a
//! node by its stable id, not its position, and hold the node itself while counted on it.
//!
//! Each concern has its own module: [`ejection`] (the breaker), [`discovery`] (DNS), [`load`]
//! (`GET /load` polls), [`slow`] (latency, leaving slow nodes out, probes); this one holds the
//! nodes, what a node costs, and the pick.
//!
//! For a policy that weighs the prefix cache (`cache_aware`, D59), the pool also tells how
//! many of the prompt's blocks each candidate holds, as the node's `/load` published them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::{Duration, Instant};

use pdmesh_config::RoutingPolicy as RoutingKind;

use crate::policy::{Candidate, Pick, RoutingPolicy};
use pdmesh_protocol::node_http::{NodeLoad, LOAD_PATH};
use pdmesh_protocol::prefix::PrefixIndex;
use pdmesh_telemetry::metrics::{counter_vec, gauge_vec};
use prometheus::{IntCounterVec, IntGaugeVec};

mod discovery;
mod ejection;
mod load;
mod slow;

pub use discovery::discover;
pub use load::poll_loads;

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

/// Upstreams the router has now, by `role` and `source` (`static`: configured; `dns`:
/// discovered from `router.prefill_dns` / `decode_dns`).
pub const UPSTREAMS: &str = "pdmesh_router_upstreams";
/// DNS refreshes that failed (the name did not resolve, or not in time), by `role`; the
/// upstream set is then kept as it was.
pub const DISCOVERY_ERRORS: &str = "pdmesh_router_discovery_errors_total";

static UPSTREAMS_GAUGE: LazyLock<IntGaugeVec> =
    LazyLock::new(|| gauge_vec(UPSTREAMS, "Upstreams the router routes to, by role and source", &["role", "source"]));
static DISCOVERY_ERRORS_TOTAL: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec(DISCOVERY_ERRORS, "DNS refreshes of an upstream name that failed", &["role"]));
/// 1 while an upstream is left out of the rotation as slow (D104), by `role` and `upstream`.
pub const SLOW: &str = "pdmesh_router_upstream_slow";
/// Times an upstream was left out as slow (D104), by `role` and `upstream`.
pub const LEFT_OUT: &str = "pdmesh_router_slow_left_out_total";
/// Probes the router sent a decode node itself (D104), by `role`, and `outcome`: `fast` (the
/// node is, or is back, in rotation), `slow` (it stays left out), `failed` (no usable answer).
pub const PROBES: &str = "pdmesh_router_probes_total";
static SLOW_GAUGE: LazyLock<IntGaugeVec> =
    LazyLock::new(|| gauge_vec(SLOW, "1 while an upstream is left out of the rotation as slow", &["role", "upstream"]));
static LEFT_OUT_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(LEFT_OUT, "Times an upstream was left out of the rotation as slow", &["role", "upstream"])
});
pub(super) static PROBES_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(PROBES, "Probe streams the router sent a left-out or unmeasured node, by outcome", &["role", "outcome"])
});

/// Polls of the upstreams' `GET /load`, by `role` and `outcome` (`answered`, `failed`).
pub const LOAD_POLLS: &str = "pdmesh_router_load_polls_total";
static LOAD_POLLS_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(LOAD_POLLS, "Polls of an upstream's GET /load, by whether it answered", &["role", "outcome"])
});

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
/// Weight of a new sample, either way, in the smoothed latency that decides whether a node is
/// slow (D104): about the last 20 samples, so one late token (a busy host) cannot leave a
/// healthy node out, while a node that really slowed is judged within a few of its tokens.
const SPEED_ALPHA: f64 = 0.05;
/// Samples of a node's own streams before its smoothed latency may leave it out (a probe's
/// median counts as enough).
const MIN_SPEED_SAMPLES: u32 = 4;
/// A node whose latency is above this many times the best node's is left out (least_loaded),
/// unless `router.slow_ratio` says otherwise.
const SLOW_RATIO: f64 = 3.0;
/// A left-out node is back when its probe is within `slow_ratio` / this of the fastest node in
/// rotation (D104): without the margin, a node just above the ratio flaps in and out as the
/// fast node's estimate moves with its load, and each time in costs a user's stream.
const RECOVERY_MARGIN: f64 = 1.5;
/// Half-life of a left-out node's latency excess over the best, while it gets no samples.
const SLOW_PROBE_HALF_LIFE: Duration = Duration::from_secs(10);
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
    /// Smoothed latency (`SPEED_ALPHA` both ways) and its samples since the last probe: what
    /// decides whether the node is slow (probing pools, D104).
    speed: Option<f64>,
    speed_samples: u32,
    /// Left out of the rotation as slow until a probe finds it fast again (probing pools).
    left_out: bool,
    /// A probe of the node is running.
    probing: bool,
    /// Ejections in a row (0: the breaker is closed).
    ejections: u32,
    ejected_until: Option<Instant>,
}

/// Where an upstream came from: the configured list (kept for the router's life) or a DNS
/// name (`router.prefill_dns` / `decode_dns`, kept while the name resolves to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Static,
    Dns,
}

impl Source {
    fn label(self) -> &'static str {
        match self {
            Source::Static => "static",
            Source::Dns => "dns",
        }
    }
}

/// One node of a role. Shared (`Arc`) between the pool and the requests counted on it, so a
/// node that leaves the pool (it left DNS) stays whole until its last request ends.
#[derive(Debug)]
pub struct Upstream {
    /// Stable for the router's life: requests name nodes by id, never by position, so a node
    /// set that changes under them cannot make an id point at another node.
    id: usize,
    pub url: String,
    source: Source,
    in_flight: AtomicU32,
    state: Mutex<State>,
}

impl Upstream {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

/// The nodes of one role and how to pick among them. The set may change at run time
/// ([`Pool::sync_discovered`]); every method takes a snapshot of it and never holds the lock
/// across an await.
#[derive(Debug)]
pub struct Pool {
    role: &'static str,
    nodes: RwLock<Vec<Arc<Upstream>>>,
    /// The id each URL ever got: a node that leaves DNS and comes back (a pod whose readiness
    /// flapped) gets its id again, so the response ids naming it (`resp_d<id>_…`) still reach it.
    ids: Mutex<HashMap<String, usize>>,
    next_id: AtomicUsize,
    next: AtomicUsize,
    policy: Box<dyn RoutingPolicy>,
    breaker: Breaker,
    /// `router.slow_ratio` (0: no node is left out for its latency).
    slow_ratio: f64,
    /// Left-out nodes come back through probes, not through decay (D104; decode only). Turned
    /// off for good when the nodes refuse the probes ([`Pool::probes_refused`]).
    probed: AtomicBool,
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
pub struct InFlight {
    role: &'static str,
    node: Option<Arc<Upstream>>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(u) = &self.node {
            u.in_flight.fetch_sub(1, Ordering::Relaxed);
            IN_FLIGHT_GAUGE.with_label_values(&[self.role, &u.url]).dec();
        }
    }
}

/// What a node's latency is compared with ([`Pool::reference`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reference {
    Fastest,
    Median,
}

/// What one DNS refresh changed in a pool.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff {
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

impl Pool {
    pub fn new(role: &'static str, urls: &[String], policy: RoutingKind, breaker: Breaker) -> Self {
        let pool = Self {
            role,
            nodes: RwLock::new(Vec::new()),
            ids: Mutex::new(HashMap::new()),
            next_id: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            policy: crate::policy::for_config(policy),
            breaker,
            slow_ratio: SLOW_RATIO,
            probed: AtomicBool::new(false),
        };
        let nodes: Vec<Arc<Upstream>> =
            urls.iter().map(|u| pool.make_node(u.trim_end_matches('/'), Source::Static)).collect();
        pool.replace_nodes(nodes);
        pool
    }

    /// Leave out nodes above `ratio` × the fastest one's latency (0: never), and, with
    /// `probed`, bring them back only through [`Pool::probe_result`] (D104) instead of letting
    /// their estimate decay until a live request is spent on them.
    pub fn with_slow(mut self, ratio: f64, probed: bool) -> Self {
        self.slow_ratio = ratio;
        self.probed = AtomicBool::new(probed && ratio > 0.0 && self.latency_aware());
        self
    }

    /// Whether picks weigh latency (every policy but `round_robin`).
    fn latency_aware(&self) -> bool {
        self.policy.weighs_latency()
    }

    /// Whether left-out nodes are probed back into the rotation (see [`Pool::with_slow`]).
    pub fn probed(&self) -> bool {
        self.probed.load(Ordering::Relaxed)
    }

    /// The nodes refused a probe for want of a credential (401/403: the nodes take API keys and
    /// the router has no internal key, so it can only pass clients' keys on): no probe can ever
    /// bring a left-out node back, so the pool goes back to D55's decay — every node is back
    /// in rotation, and a slow one is left out while its estimate is above the ratio.
    pub fn probes_refused(&self, status: u16) {
        if !self.probed.swap(false, Ordering::Relaxed) {
            return;
        }
        for u in self.nodes() {
            u.lock().left_out = false;
            SLOW_GAUGE.with_label_values(&[self.role, &u.url]).set(0);
        }
        tracing::warn!(role = self.role, status,
            "upstreams refuse the router's probes (set PDMESH_INTERNAL_API_KEY); slow nodes are left out by their decaying estimate instead (D55)");
    }

    /// A new upstream for `url`, with the id `url` had before or a fresh one.
    fn make_node(&self, url: &str, source: Source) -> Arc<Upstream> {
        let id = {
            let mut ids = match self.ids.lock() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            match (source, ids.get(url)) {
                // A configured list may name one URL twice (two shares of the requests): each
                // entry is its own node. Configured nodes never leave, so need no lookup.
                (Source::Static, _) | (Source::Dns, None) => {
                    let fresh = self.next_id.fetch_add(1, Ordering::Relaxed);
                    ids.entry(url.to_string()).or_insert(fresh);
                    fresh
                }
                (Source::Dns, Some(&id)) => id,
            }
        };
        let role = self.role;
        PICKS_TOTAL.with_label_values(&[role, url]);
        EJECTIONS_TOTAL.with_label_values(&[role, url]);
        FAILURES_TOTAL.with_label_values(&[role, url]);
        EJECTED_GAUGE.with_label_values(&[role, url]).set(0);
        IN_FLIGHT_GAUGE.with_label_values(&[role, url]);
        if self.probed() {
            SLOW_GAUGE.with_label_values(&[role, url]).set(0);
            LEFT_OUT_TOTAL.with_label_values(&[role, url]);
        }
        Arc::new(Upstream { id, url: url.to_string(), source, in_flight: AtomicU32::new(0), state: Mutex::default() })
    }

    fn replace_nodes(&self, nodes: Vec<Arc<Upstream>>) {
        for source in [Source::Static, Source::Dns] {
            let n = nodes.iter().filter(|u| u.source == source).count();
            UPSTREAMS_GAUGE.with_label_values(&[self.role, source.label()]).set(n as i64);
        }
        let mut guard = match self.nodes.write() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        *guard = nodes;
    }

    /// The nodes now, in order (static ones first).
    fn nodes(&self) -> Vec<Arc<Upstream>> {
        match self.nodes.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn node(&self, id: usize) -> Option<Arc<Upstream>> {
        self.nodes().into_iter().find(|u| u.id == id)
    }

    pub fn len(&self) -> usize {
        self.nodes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes().is_empty()
    }

    /// Whether node `id` is in the pool now.
    pub fn contains(&self, id: usize) -> bool {
        self.node(id).is_some()
    }

    /// The URL of node `id`, while it is in the pool.
    pub fn url(&self, id: usize) -> Option<String> {
        self.node(id).map(|u| u.url.clone())
    }

    /// Every node's URL now.
    pub fn urls(&self) -> Vec<String> {
        self.nodes().iter().map(|u| u.url.clone()).collect()
    }

    fn with_state<T>(&self, id: usize, f: impl FnOnce(&mut State) -> T) -> Option<T> {
        let u = self.node(id)?;
        let mut guard = u.lock();
        Some(f(&mut guard))
    }

    /// Whether node `u` may get a request now: not ejected (or its ejection is over) and not
    /// known to be unable to serve.
    fn eligible(u: &Upstream, now: Instant) -> bool {
        let s = u.lock();
        let ejected = s.ejected_until.is_some_and(|t| now < t);
        let ready = !s.unreachable && s.load.as_ref().is_none_or(|l| l.ready);
        !ejected && ready && !s.left_out
    }

    /// Node `u`'s latency as the picker sees it: measured, with its excess over `best` decayed
    /// by the time without samples; `best` for a node not measured yet.
    fn latency(u: &Upstream, best: f64, now: Instant) -> f64 {
        let s = u.lock();
        match (s.latency, s.latency_at) {
            (Some(l), Some(at)) if l > best => {
                let age = now.saturating_duration_since(at).as_secs_f64();
                best + (l - best) * 0.5f64.powf(age / SLOW_PROBE_HALF_LIFE.as_secs_f64())
            }
            (Some(l), _) => l,
            (None, _) => best,
        }
    }

    /// The cost of one more request on node `u` (see the module docs).
    fn cost(u: &Upstream, latency: f64) -> f64 {
        let in_flight = f64::from(u.in_flight.load(Ordering::Relaxed));
        let s = u.lock();
        let (reported, waiting, kv) = match &s.load {
            Some(l) => {
                let kv = if l.kv_total_blocks > 0 { l.kv_used_blocks as f64 / l.kv_total_blocks as f64 } else { 0.0 };
                (f64::from(l.running.saturating_add(l.waiting)), f64::from(l.waiting), kv)
            }
            None => (0.0, 0.0, 0.0),
        };
        let outstanding = in_flight.max(reported) + waiting;
        (1.0 + outstanding) * latency * (1.0 + kv)
    }

    /// Pick a node for one request, never one of `exclude` (ids of nodes this request already
    /// failed on), and return its id. Counts the pick; the caller holds [`Pool::start`] while
    /// the call runs.
    pub fn pick(&self, exclude: &[usize]) -> Option<usize> {
        self.pick_for(exclude, None).map(|p| p.node)
    }

    /// [`Pool::pick`] for a request whose prompt is `prompt` (token ids, when the router could
    /// tokenise it), which `cache_aware` weighs against what each node holds.
    pub fn pick_for(&self, exclude: &[usize], prompt: Option<&[u32]>) -> Option<Picked> {
        let now = Instant::now();
        let allowed: Vec<Arc<Upstream>> = self.nodes().into_iter().filter(|u| !exclude.contains(&u.id)).collect();
        let eligible: Vec<Arc<Upstream>> = allowed.iter().filter(|u| Self::eligible(u, now)).cloned().collect();
        let candidates = if eligible.is_empty() { allowed } else { eligible };
        if candidates.is_empty() {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let nodes = if self.policy.weighs_latency() {
            self.latencies(&candidates, now)
        } else {
            candidates.into_iter().map(|u| (u, 1.0)).collect()
        };
        let upstreams: Vec<Arc<Upstream>> = nodes.iter().map(|(u, _)| u.clone()).collect();
        let held = prompt.filter(|_| self.policy.weighs_prefix()).map(|tokens| Self::overlaps(&upstreams, tokens));
        let prompt_blocks =
            prompt.map_or(1, |tokens| (tokens.len() / Self::block_size_hint(&upstreams).max(1) as usize).max(1));
        let weighed: Vec<Candidate> = nodes
            .iter()
            .enumerate()
            .map(|(k, (u, latency))| Candidate {
                cost: Self::cost(u, *latency),
                held: held.as_ref().and_then(|h| h.get(k).copied()),
            })
            .collect();
        let choice = self.policy.choose(&weighed, Pick { role: self.role, turn, prompt_blocks });
        let chosen = upstreams.get(choice.index).unwrap_or(&upstreams[turn % upstreams.len()]).clone();
        PICKS_TOTAL.with_label_values(&[self.role, &chosen.url]).inc();
        Some(Picked { node: chosen.id, overlap: choice.overlap })
    }

    /// The candidates' latencies as `least_loaded` weighs them: the best measured one for a
    /// node not measured yet, and, in a pool that is not probed, the nodes above
    /// `slow_ratio` × the best left out (unless that leaves none; their excess decays). A
    /// probed pool left its slow nodes out of the candidates already (`State::left_out`).
    fn latencies(&self, candidates: &[Arc<Upstream>], now: Instant) -> Vec<(Arc<Upstream>, f64)> {
        let best = candidates
            .iter()
            .filter_map(|u| u.lock().latency)
            .fold(None, |m: Option<f64>, l| Some(m.map_or(l, |m| m.min(l))))
            .unwrap_or(1.0);
        if self.probed() {
            return candidates.iter().map(|u| (u.clone(), u.lock().latency.unwrap_or(best))).collect();
        }
        let latency: Vec<(Arc<Upstream>, f64)> =
            candidates.iter().map(|u| (u.clone(), Self::latency(u, best, now))).collect();
        if self.slow_ratio <= 0.0 {
            return latency;
        }
        let fast: Vec<(Arc<Upstream>, f64)> =
            latency.iter().filter(|(_, l)| *l <= self.slow_ratio * best).cloned().collect();
        if fast.is_empty() {
            latency
        } else {
            fast
        }
    }

    /// Prompt blocks each of `nodes` holds, counting from the first; the keys are hashed once
    /// per distinct chain (root and block size) among the nodes.
    fn overlaps(nodes: &[Arc<Upstream>], tokens: &[u32]) -> Vec<usize> {
        let mut hashed: Vec<(PrefixIndex, Option<Vec<u64>>)> = Vec::new();
        nodes
            .iter()
            .map(|u| {
                let s = u.lock();
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
            .collect()
    }

    /// Tokens of `prompt` that the `picked` node would compute itself: those past the full
    /// blocks its prefix cache holds, as its last `/load` poll published them (all of them when
    /// it published nothing). A `cache_aware` pick already counted those blocks
    /// (`picked.overlap`): the prompt is hashed again only for other policies. The basis of
    /// conditional disaggregation (D69).
    pub fn uncached_tokens(&self, picked: Picked, prompt: &[u32]) -> usize {
        let Some(u) = self.node(picked.node) else { return prompt.len() };
        let s = u.lock();
        let blocks = picked.overlap.unwrap_or_else(|| s.prefix.overlap(prompt));
        prompt.len().saturating_sub(blocks.saturating_mul(s.prefix.block_size() as usize))
    }

    /// The block size the nodes publish (the first that says), for the held fraction.
    fn block_size_hint(nodes: &[Arc<Upstream>]) -> u32 {
        nodes
            .iter()
            .filter_map(|u| {
                let s = u.lock();
                s.load.as_ref().map(|_| s.prefix.block_size())
            })
            .find(|&b| b > 0)
            .unwrap_or(16)
    }

    /// Count one request in flight on node `id` until the returned guard drops (which holds
    /// the node, so it stays counted even if the node leaves the pool meanwhile).
    pub fn start(&self, id: usize) -> InFlight {
        let node = self.node(id);
        if let Some(u) = &node {
            u.in_flight.fetch_add(1, Ordering::Relaxed);
            IN_FLIGHT_GAUGE.with_label_values(&[self.role, &u.url]).inc();
        }
        InFlight { role: self.role, node }
    }

    /// A view of each node for tests: (url, in flight, ejected, latency).
    #[cfg(test)]
    pub fn snapshot(&self) -> Vec<(String, u32, bool, Option<f64>)> {
        let now = Instant::now();
        self.nodes()
            .iter()
            .map(|u| {
                let s = u.lock();
                (
                    u.url.clone(),
                    u.in_flight.load(Ordering::Relaxed),
                    s.ejected_until.is_some_and(|t| now < t),
                    s.latency,
                )
            })
            .collect()
    }
}

/// Touch the router's metrics so `/metrics` lists them from the start.
pub(crate) fn init() {
    LazyLock::force(&PICKS_TOTAL);
    LazyLock::force(&EJECTIONS_TOTAL);
    LazyLock::force(&EJECTED_GAUGE);
    LazyLock::force(&IN_FLIGHT_GAUGE);
    LazyLock::force(&FAILURES_TOTAL);
    LazyLock::force(&UPSTREAMS_GAUGE);
    LazyLock::force(&DISCOVERY_ERRORS_TOTAL);
    crate::policy::init();
    LazyLock::force(&SLOW_GAUGE);
    LazyLock::force(&LEFT_OUT_TOTAL);
    LazyLock::force(&PROBES_TOTAL);
}

#[cfg(test)]
mod tests {
    use super::discovery::resolve;
    use super::*;

    fn pool(policy: RoutingKind) -> Pool {
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
        let p = pool(RoutingKind::LeastLoaded);
        p.observe_latency(0, 0.010);
        p.observe_latency(1, 0.040);
        for _ in 0..6 {
            assert_eq!(p.pick(&[]), Some(0), "4× slower than the best: left out");
        }
        assert_eq!(p.pick(&[0]), Some(1), "but tried when it is the only one left");
    }

    #[test]
    fn least_loaded_avoids_the_slower_node_until_the_fast_one_queues() {
        let p = pool(RoutingKind::LeastLoaded);
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

    fn probed(policy: RoutingKind) -> Pool {
        pool(policy).with_slow(3.0, true)
    }

    fn left_out(p: &Pool) -> Vec<bool> {
        p.nodes().iter().map(|u| u.lock().left_out).collect()
    }

    #[test]
    fn a_slow_node_gets_no_request_until_a_probe_finds_it_fast() {
        let p = probed(RoutingKind::LeastLoaded);
        assert_eq!(p.probes_due().len(), 2, "unmeasured nodes are owed a probe");
        assert!(p.probes_due().is_empty(), "not while their probes run");
        assert!(p.probe_result(0, Some(0.010)));
        assert!(!p.probe_result(1, Some(0.040)), "4x the other node: out from its first measurement");
        assert_eq!(left_out(&p), [false, true]);
        let busy: Vec<_> = (0..6).map(|_| p.start(0)).collect();
        for _ in 0..6 {
            assert_eq!(p.pick(&[]), Some(0), "however busy the fast node, the slow one is not tried");
        }
        assert_eq!(p.pick(&[0]), Some(1), "but it is when it is the only one left");
        assert_eq!(p.probes_due(), [(1, "http://b".to_string())], "only the left-out node is probed");
        assert!(!p.probe_result(1, Some(0.035)), "still slow: still out");
        assert_eq!(p.probes_due().len(), 1);
        assert!(!p.probe_result(1, Some(0.025)), "within 3x but not within 2x: still out (no flapping)");
        assert_eq!(p.probes_due().len(), 1);
        assert!(!p.probe_result(1, None), "a failed probe changes nothing");
        assert_eq!(left_out(&p), [false, true]);
        assert_eq!(p.probes_due().len(), 1);
        assert!(p.probe_result(1, Some(0.012)), "fast again: back in rotation");
        assert_eq!(left_out(&p), [false, false]);
        assert_eq!(p.pick(&[]), Some(1), "and picked again: the fast node is busy");
        assert!(p.probes_due().is_empty(), "a measured node in rotation is not probed");
        drop(busy);
    }

    #[test]
    fn live_samples_leave_out_a_node_that_turned_slow_but_not_one_late_token() {
        let p = probed(RoutingKind::CacheAware);
        for _ in 0..20 {
            p.observe_latency(0, 0.010);
            p.observe_latency(1, 0.010);
        }
        p.observe_latency(1, 0.100);
        assert_eq!(left_out(&p), [false, false], "one late token leaves nothing out");
        for _ in 0..40 {
            p.observe_latency(1, 0.060);
        }
        assert_eq!(left_out(&p), [false, true], "a node that stays 6x slower is out");
        for _ in 0..200 {
            p.observe_latency(0, 0.500);
        }
        assert_eq!(left_out(&p), [false, true], "the last node in rotation is never left out");
        assert!(!p.leave_out(0, "test"), "not even by a slow stream");
        assert!(!p.has_alternative(0), "so a slow stream on it has nowhere to go");
        assert!(p.has_alternative(1));
    }

    #[test]
    fn a_stream_is_compared_with_the_median_of_the_other_nodes_in_rotation() {
        let urls: Vec<String> = ["a", "b", "c", "d"].iter().map(|u| format!("http://{u}")).collect();
        let p = Pool::new(
            "decode",
            &urls,
            RoutingKind::LeastLoaded,
            Breaker { after_failures: 2, base: Duration::from_millis(50), max: Duration::from_secs(1) },
        )
        .with_slow(3.0, true);
        assert_eq!(p.reference(0, Reference::Median), None, "nothing measured: nothing to compare with");
        p.probe_result(1, Some(0.010));
        p.probe_result(2, Some(0.020));
        p.probe_result(3, Some(0.012));
        assert_eq!(p.reference(0, Reference::Median), Some(0.012));
        assert_eq!(p.reference(0, Reference::Fastest), Some(0.010));
        assert_eq!(p.reference(3, Reference::Median), Some(0.015), "its own gap is not in it");
        assert!(p.leave_out(2, "slow stream"));
        assert_eq!(p.reference(0, Reference::Median), Some(0.011), "a left-out node is not either");
        assert_eq!(p.probes_due(), [(0, "http://a".to_string()), (2, "http://c".to_string())]);
    }

    #[test]
    fn refused_probes_bring_every_node_back_and_fall_back_to_decay() {
        let p = probed(RoutingKind::LeastLoaded);
        p.probe_result(0, Some(0.010));
        p.probe_result(1, Some(0.040));
        assert_eq!(left_out(&p), [false, true]);
        p.probes_refused(401);
        assert!(!p.probed());
        assert_eq!(left_out(&p), [false, false], "no probe could bring it back: nothing stays out for good");
        assert!(p.probes_due().is_empty());
        for _ in 0..4 {
            assert_eq!(p.pick(&[]), Some(0), "the slow node is left out by its (decaying) estimate");
        }
    }

    #[test]
    fn round_robin_and_a_zero_ratio_leave_nothing_out() {
        for p in [probed(RoutingKind::RoundRobin), pool(RoutingKind::LeastLoaded).with_slow(0.0, true)] {
            assert!(!p.probed());
            p.observe_latency(0, 0.010);
            for _ in 0..10 {
                p.observe_latency(1, 1.0);
            }
            assert_eq!(left_out(&p), [false, false]);
            assert!(p.probes_due().is_empty());
        }
        let p = pool(RoutingKind::LeastLoaded).with_slow(0.0, false);
        p.observe_latency(0, 0.010);
        p.observe_latency(1, 1.0);
        let picks: Vec<usize> = (0..4).map(|_| p.pick(&[]).unwrap()).collect();
        assert!(picks.iter().all(|&i| i == 0), "the cost rule alone still prefers the fast node: {picks:?}");
        let held: Vec<_> = (0..200).map(|_| p.start(0)).collect();
        assert_eq!(p.pick(&[]), Some(1), "but the slow one gets work once the fast one is 100x as busy");
        drop(held);
    }

    #[test]
    fn round_robin_alternates_whatever_the_latency() {
        let p = pool(RoutingKind::RoundRobin);
        p.observe_latency(1, 10.0);
        let picks: Vec<usize> = (0..4).map(|_| p.pick(&[]).unwrap()).collect();
        assert_eq!(picks.iter().filter(|&&i| i == 1).count(), 2);
    }

    #[test]
    fn failures_in_a_row_eject_and_a_success_after_the_backoff_brings_back() {
        let p = pool(RoutingKind::RoundRobin);
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

    fn discovered(policy: RoutingKind, urls: &[&str]) -> Pool {
        let p = Pool::new(
            "prefill",
            &[],
            policy,
            Breaker { after_failures: 1, base: Duration::from_secs(60), max: Duration::from_secs(60) },
        );
        p.sync_discovered(&urls.iter().map(|u| u.to_string()).collect::<Vec<_>>());
        p
    }

    #[test]
    fn a_dns_refresh_adds_and_removes_only_what_changed() {
        let p = Pool::new(
            "decode",
            &["http://static".to_string()],
            RoutingKind::RoundRobin,
            Breaker { after_failures: 1, base: Duration::from_secs(60), max: Duration::from_secs(60) },
        );
        let d = p.sync_discovered(&["http://10.0.0.1:8000".into(), "http://10.0.0.2:8000/".into()]);
        assert_eq!(d.added, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
        assert!(d.removed.is_empty());
        let id2 = p.nodes().iter().find(|u| u.url == "http://10.0.0.2:8000").map(|u| u.id).unwrap();
        p.observe_latency(id2, 0.5);
        let d = p.sync_discovered(&["http://10.0.0.2:8000".into(), "http://10.0.0.3:8000".into()]);
        assert_eq!(
            (d.added, d.removed),
            (vec!["http://10.0.0.3:8000".to_string()], vec!["http://10.0.0.1:8000".into()])
        );
        assert_eq!(p.urls(), ["http://static", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]);
        assert_eq!(p.snapshot()[1].3, Some(0.5), "a node still listed keeps what the router learned of it");
        assert_eq!(p.sync_discovered(&["http://10.0.0.3:8000".into(), "http://10.0.0.2:8000".into()]), Diff::default());
        let d = p.sync_discovered(&[]);
        assert_eq!(d.removed.len(), 2);
        assert_eq!(p.urls(), ["http://static"], "a configured node is never dropped by DNS");
        assert_eq!(p.sync_discovered(&["http://static".into()]), Diff::default(), "nor listed twice");
        let twice = Pool::new("decode", &["http://x".into(), "http://x".into()], RoutingKind::RoundRobin, p.breaker);
        let ids: Vec<usize> = twice.nodes().iter().map(|u| u.id).collect();
        assert_eq!(ids, [0, 1], "a URL configured twice is two nodes, numbered in order");
    }

    #[test]
    fn a_node_that_left_dns_is_never_picked_but_its_requests_finish_on_it() {
        let p = discovered(RoutingKind::RoundRobin, &["http://a:1", "http://b:1"]);
        let ids: Vec<usize> = p.nodes().iter().map(|u| u.id).collect();
        let (a, b) = (ids[0], ids[1]);
        let held = p.start(a);
        p.sync_discovered(&["http://b:1".into()]);
        for _ in 0..6 {
            assert_eq!(p.pick(&[]), Some(b), "a left DNS: it gets no new request");
        }
        assert_eq!(p.pick(&[b]), None, "not even as a last resort");
        assert_eq!(p.url(a), None);
        // The request that was on `a` ends there: its guard still holds `a`, and reports on
        // the id that left are ignored, never applied to another node.
        assert_eq!(held.node.as_ref().map(|u| u.in_flight.load(Ordering::Relaxed)), Some(1));
        p.failure(a, "reset");
        p.observe_latency(a, 9.0);
        drop(held);
        assert_eq!(p.snapshot(), vec![("http://b:1".to_string(), 0, false, None)]);
        // A new node gets a new id; one that comes back gets its old id again.
        p.sync_discovered(&["http://b:1".into(), "http://c:1".into(), "http://a:1".into()]);
        let now: Vec<(String, usize)> = p.nodes().iter().map(|u| (u.url.clone(), u.id)).collect();
        assert!(now.contains(&("http://a:1".to_string(), a)), "{now:?}");
        let c = now.iter().find(|(u, _)| u == "http://c:1").map(|(_, id)| *id).unwrap();
        assert!(c != a && c != b);
        let a_state = p.snapshot().into_iter().find(|n| n.0 == "http://a:1").unwrap();
        assert_eq!((a_state.1, a_state.2, a_state.3), (0, false, None), "it comes back unproven");
    }

    #[test]
    fn picks_racing_a_changing_node_set_always_name_a_node_of_the_set() {
        let p = std::sync::Arc::new(discovered(RoutingKind::LeastLoaded, &["http://a:1", "http://b:1"]));
        let churn = {
            let p = p.clone();
            std::thread::spawn(move || {
                for i in 0..2000 {
                    let urls: Vec<String> = if i % 2 == 0 {
                        vec!["http://b:1".into(), "http://c:1".into()]
                    } else {
                        vec!["http://a:1".into(), "http://b:1".into()]
                    };
                    p.sync_discovered(&urls);
                }
            })
        };
        let mut held = Vec::new();
        for _ in 0..2000 {
            let id = p.pick(&[]).expect("some node is always listed");
            held.push(p.start(id));
            if held.len() > 8 {
                held.remove(0);
            }
        }
        churn.join().unwrap();
        drop(held);
        assert!(p.snapshot().iter().all(|(_, n, _, _)| *n == 0), "every count went back to 0");
    }

    #[tokio::test]
    async fn localhost_resolves_to_a_loopback_upstream() {
        let urls = resolve("localhost:8123", Duration::from_secs(5)).await.unwrap();
        assert!(urls.iter().any(|u| u == "http://127.0.0.1:8123" || u == "http://[::1]:8123"), "{urls:?}");
        assert!(resolve("no-such-host.invalid:1", Duration::from_secs(5)).await.is_err());
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
    fn a_small_shared_opening_does_not_pin_every_request_to_one_node() {
        let p = pool(RoutingKind::CacheAware);
        let prompt: Vec<u32> = (0..40).collect();
        p.set_load(0, Some(holding(&prompt, 0)));
        p.set_load(1, Some(holding(&prompt, 2)));
        let picked: std::collections::BTreeSet<usize> =
            (0..4).map(|_| p.pick_for(&[], Some(&prompt)).unwrap().node).collect();
        assert_eq!(picked.len(), 2, "2 of 10 blocks held is under the threshold: load alone decides");
    }

    #[test]
    fn cache_aware_prefers_the_holder_of_the_prefix_within_the_load_guard() {
        let p = pool(RoutingKind::CacheAware);
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
    fn uncached_tokens_are_the_prompt_past_the_blocks_a_node_published() {
        let p = pool(RoutingKind::LeastLoaded);
        let prompt: Vec<u32> = (0..41).collect();
        let on = |node: usize| Picked { node, overlap: None };
        // nothing published yet: the whole prompt
        assert_eq!(p.uncached_tokens(on(0), &prompt), 41);
        p.set_load(0, Some(holding(&prompt, 10)));
        p.set_load(1, Some(holding(&prompt, 3)));
        assert_eq!(p.uncached_tokens(on(0), &prompt), 1, "10 blocks of 4 held");
        assert_eq!(p.uncached_tokens(on(1), &prompt), 29);
        // another prompt sharing only the first two blocks
        let mut other = prompt[..8].to_vec();
        other.extend(500..520);
        assert_eq!(p.uncached_tokens(on(0), &other), 20);
        // a node gone from the pool holds nothing
        assert_eq!(p.uncached_tokens(on(7), &prompt), 41);
        // a poll that failed keeps the last view
        p.set_load(0, None);
        assert_eq!(p.uncached_tokens(on(0), &prompt), 1);
        // a cache-aware pick's own count of held blocks is taken as it is
        let aware = pool(RoutingKind::CacheAware);
        aware.set_load(0, Some(holding(&prompt, 0)));
        aware.set_load(1, Some(holding(&prompt, 9)));
        let picked = aware.pick_for(&[], Some(&prompt)).unwrap();
        assert_eq!(picked, Picked { node: 1, overlap: Some(9) });
        assert_eq!(aware.uncached_tokens(picked, &prompt), 5);
    }

    #[test]
    fn a_node_that_does_not_answer_its_poll_is_not_picked() {
        let p = pool(RoutingKind::LeastLoaded);
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
