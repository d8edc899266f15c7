//! How a pool chooses among the nodes that may take a request: one file per policy, one
//! registration line in [`for_config`] (D108).
//!
//! The pool ([`super::balance::Pool`]) owns everything a policy must not re-decide: which
//! nodes are eligible (ejection, readiness, slow nodes left out), what each costs (outstanding
//! requests × latency × KV use, [`super::balance`]'s module docs), and, for a policy that
//! asks, how many of the prompt's blocks each holds. A policy only chooses among those
//! [`Candidate`]s. Adding one is a file here implementing [`RoutingPolicy`], its line in
//! [`for_config`], and its name in `router.policy` (`pdmesh_config::RoutingPolicy`).

mod cache_aware;
mod least_loaded;
mod power_of_two;
mod round_robin;

pub use cache_aware::{CACHE_AWARE_PICKS, PREFIX_OVERLAP};

/// One node a policy may choose.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// The cost of one more request there (lower is better).
    pub cost: f64,
    /// Prompt blocks the node holds in its prefix cache, counting from the first; `None`
    /// unless the policy asked ([`RoutingPolicy::weighs_prefix`]) and the request has a prompt.
    pub held: Option<usize>,
}

/// What a policy knows of the request.
#[derive(Debug, Clone, Copy)]
pub struct Pick<'a> {
    /// The pool's role (`prefill`, `decode`), for the policy's metrics.
    pub role: &'a str,
    /// This pick's number in the pool: rotates ties, seeds random choices.
    pub turn: usize,
    /// Full blocks of the prompt (at least 1) when the candidates carry `held`.
    pub prompt_blocks: usize,
}

/// The index of the chosen candidate and, for a policy that weighed the prefix cache, how many
/// of the prompt's blocks it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    pub index: usize,
    pub overlap: Option<usize>,
}

/// A way of choosing a node among candidates (never empty when called).
pub trait RoutingPolicy: Send + Sync + std::fmt::Debug {
    /// Its name in `router.policy`, logs and metrics.
    fn name(&self) -> &'static str;
    /// Whether the pool measures latency for it: slow nodes left out and probed back, slow
    /// streams moved (D104), latency in the cost. A policy that ignores cost says `false`.
    fn weighs_latency(&self) -> bool {
        true
    }
    /// Whether the candidates should carry `held` (hashing the prompt costs a little).
    fn weighs_prefix(&self) -> bool {
        false
    }
    fn choose(&self, candidates: &[Candidate], pick: Pick<'_>) -> Choice;
}

/// The policy `router.policy` names.
pub fn for_config(policy: pdmesh_config::RoutingPolicy) -> Box<dyn RoutingPolicy> {
    use pdmesh_config::RoutingPolicy as P;
    match policy {
        P::RoundRobin => Box::new(round_robin::RoundRobin),
        P::LeastLoaded => Box::new(least_loaded::LeastLoaded),
        P::PowerOfTwo => Box::new(power_of_two::PowerOfTwo),
        P::CacheAware => Box::new(cache_aware::CacheAware),
    }
}

/// Touch the policies' metrics so `/metrics` lists them from the start.
pub(crate) fn init() {
    std::sync::LazyLock::force(&cache_aware::PREFIX_OVERLAP_HIST);
    std::sync::LazyLock::force(&cache_aware::CACHE_AWARE_PICKS_TOTAL);
}

/// The cheapest candidate; ties go round the candidates by `turn`, so equal nodes share work.
pub(crate) fn cheapest(candidates: &[Candidate], turn: usize) -> usize {
    let n = candidates.len().max(1);
    (0..n).map(|k| (k + turn) % n).min_by(|&a, &b| candidates[a].cost.total_cmp(&candidates[b].cost)).unwrap_or(0)
}

#[cfg(test)]
pub(crate) fn costs(costs: &[f64]) -> Vec<Candidate> {
    costs.iter().map(|&cost| Candidate { cost, held: None }).collect()
}
