//! Everything that is not generation: `/v1/models`, `/health`, `/debug/kv`,
//! `/debug/engines`, and the 404 for unknown routes.

use actix_web::{web, HttpResponse};
use pdmesh_protocol::{EngineStats, MeshStats};
use serde::Serialize;

use crate::engine_client::{Readiness, Stats};
use crate::error::ApiError;
use crate::handlers::error_response;
use crate::headers::new_request_id;
use crate::openai::{ModelCard, ModelList};
use crate::state::AppState;

/// `GET /v1/models`: the one served model.
pub async fn models(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.options.served_model_name.clone(),
            object: "model",
            created: state.started,
            owned_by: "pdmesh",
            max_model_len: state.options.max_model_len,
        }],
    })
}

/// `GET /health` body while the node can serve.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HealthView {
    pub status: &'static str,
    /// Configured engine ranks, and how many are connected (fewer: serving, degraded).
    pub engine_ranks: u32,
    pub engine_ranks_up: u32,
}

/// `GET /health`: 200 when the node can serve a request now — the link to the dp-lb is up and
/// at least one engine rank (whose worker has loaded the model) is connected to it — and 503
/// otherwise, so `pdmesh up`, compose health gates and load balancers never send requests that
/// would be refused. The dp-lb answers from its own view of the ranks: a rank busy with a long
/// step still counts as up.
pub async fn health(state: web::Data<AppState>) -> HttpResponse {
    if state.readiness.is_draining() {
        return stopping();
    }
    if !state.link.is_up() {
        let e = ApiError::Unavailable(format!(
            "engine unavailable: not connected to the dp-lb at {}",
            state.link.endpoint()
        ));
        return HttpResponse::ServiceUnavailable().json(e.body());
    }
    let readiness = match state.client.send(Readiness).await {
        Ok(r) => r,
        Err(e) => Err(ApiError::Unavailable(format!("engine unavailable: the engine client is not running ({e})"))),
    };
    match readiness {
        Ok(r) if r.ranks_up > 0 => HttpResponse::Ok().json(HealthView {
            status: if r.ranks_up == r.ranks { "ready" } else { "degraded" },
            engine_ranks: r.ranks,
            engine_ranks_up: r.ranks_up,
        }),
        Ok(r) => {
            let e = ApiError::Unavailable(format!(
                "engine unavailable: no engine rank is connected to the dp-lb yet (0 of {}); a rank connects once its worker has loaded the model",
                r.ranks
            ));
            HttpResponse::ServiceUnavailable().json(e.body())
        }
        Err(e) => HttpResponse::ServiceUnavailable().json(e.body()),
    }
}

pub use pdmesh_http_edge::serve::{get_only, method_not_allowed, not_found, post_only, stopping};

/// A request held by a connector, with the rank that holds it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeldRequestView {
    pub engine_rank: u32,
    pub request_id: String,
    pub blocks: u32,
    pub age_s: f64,
    pub state: String,
}

/// `GET /debug/kv`: KV block ownership summed over the ranks that answered.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvDebug {
    pub free_blocks: u64,
    pub used_blocks: u64,
    pub held_blocks: u64,
    pub leased_blocks: u64,
    /// Blocks in the ranks' prefix caches (in use or evictable; evictable ones also count as
    /// free).
    pub cached_blocks: u64,
    pub total_blocks: u64,
    pub held_requests: Vec<HeldRequestView>,
    pub ranks: Vec<EngineStats>,
    pub unreachable_ranks: Vec<u32>,
}

impl KvDebug {
    pub fn from_stats(stats: MeshStats) -> Self {
        let sum = |f: fn(&EngineStats) -> u32| stats.engines.iter().map(|e| u64::from(f(e))).sum::<u64>();
        let held_requests = stats
            .engines
            .iter()
            .flat_map(|e| {
                e.held_requests.iter().map(|h| HeldRequestView {
                    engine_rank: e.engine_rank,
                    request_id: h.request_id.clone(),
                    blocks: h.blocks,
                    age_s: h.age_s,
                    state: h.state.clone(),
                })
            })
            .collect();
        Self {
            free_blocks: sum(|e| e.kv.free_blocks),
            used_blocks: sum(|e| e.kv.used_blocks),
            held_blocks: sum(|e| e.kv.held_blocks),
            leased_blocks: sum(|e| e.kv.leased_blocks),
            cached_blocks: sum(|e| e.kv.cached_blocks),
            total_blocks: sum(|e| e.kv.total_blocks),
            held_requests,
            ranks: stats.engines,
            unreachable_ranks: stats.unreachable_ranks,
        }
    }
}

async fn mesh_stats(state: &AppState) -> Result<MeshStats, ApiError> {
    state
        .client
        .send(Stats)
        .await
        .map_err(|e| ApiError::Unavailable(format!("engine unavailable: the engine client is not running ({e})")))?
}

/// `GET /debug/kv`.
pub async fn debug_kv(state: web::Data<AppState>) -> HttpResponse {
    match mesh_stats(&state).await {
        Ok(stats) => HttpResponse::Ok().json(KvDebug::from_stats(stats)),
        Err(e) => error_response(e, &new_request_id()),
    }
}

/// `GET /load`: what the router weighs when it picks a node (D55), small enough to poll every
/// few hundred milliseconds: whether the node can serve, its engine queue (`waiting`,
/// `running`) and KV usage, summed over the ranks that answered. Not ready (200 with
/// `ready: false`) while draining, without a link to the dp-lb, or with no rank answering.
pub async fn load(state: web::Data<AppState>) -> HttpResponse {
    let not_ready = || HttpResponse::Ok().json(pdmesh_protocol::NodeLoad::default());
    if state.readiness.is_draining() || !state.link.is_up() {
        return not_ready();
    }
    match mesh_stats(&state).await {
        Ok(stats) if !stats.engines.is_empty() => {
            let sum = |f: fn(&EngineStats) -> u32| stats.engines.iter().map(f).fold(0u32, u32::saturating_add);
            let sum64 = |f: fn(&EngineStats) -> u32| stats.engines.iter().map(|e| u64::from(f(e))).sum::<u64>();
            HttpResponse::Ok().json(pdmesh_protocol::NodeLoad {
                ready: true,
                waiting: sum(|e| e.num_waiting),
                running: sum(|e| e.num_running),
                kv_used_blocks: sum64(|e| e.kv.used_blocks),
                kv_total_blocks: sum64(|e| e.kv.total_blocks),
                prefix: node_prefix(&stats.engines),
            })
        }
        _ => not_ready(),
    }
}

/// What the node's ranks hold in their prefix caches, as one summary (D59): the router picks
/// a node, the dp-lb then the rank, so the router needs the union. Ranks hashing another way
/// than the first (another model) are left out; the union is bounded like one rank's.
fn node_prefix(engines: &[EngineStats]) -> Option<pdmesh_protocol::PrefixSummary> {
    let mut ranks = engines.iter().filter_map(|e| e.prefix.as_ref());
    let mut union = ranks.next()?.clone();
    for r in ranks.filter(|r| r.root == union.root && r.block_size == union.block_size) {
        union.blocks.extend_from_slice(&r.blocks);
    }
    union.blocks.sort_unstable();
    union.blocks.dedup();
    union.blocks.truncate(pdmesh_protocol::prefix::MAX_PUBLISHED_BLOCKS);
    Some(union)
}

/// `GET /debug/engines`: the dp-lb's `MeshStats` as is.
pub async fn debug_engines(state: web::Data<AppState>) -> HttpResponse {
    match mesh_stats(&state).await {
        Ok(stats) => HttpResponse::Ok().json(stats),
        Err(e) => error_response(e, &new_request_id()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_protocol::{HeldRequest, KvUsage};

    #[test]
    fn kv_debug_sums_ranks() {
        let rank = |r: u32, free: u32, held: u32| EngineStats {
            engine_rank: r,
            kv: KvUsage {
                total_blocks: 100,
                free_blocks: free,
                used_blocks: 100 - free - held,
                held_blocks: held,
                leased_blocks: 0,
                cached_blocks: r + 1,
            },
            held_requests: if held > 0 {
                vec![HeldRequest { request_id: format!("h{r}"), blocks: held, age_s: 1.5, state: "held".into() }]
            } else {
                vec![]
            },
            ..Default::default()
        };
        let stats = MeshStats { engines: vec![rank(0, 90, 4), rank(1, 80, 0)], unreachable_ranks: vec![2] };
        let v = serde_json::to_value(KvDebug::from_stats(stats)).unwrap();
        assert_eq!(v["total_blocks"], 200);
        assert_eq!(v["free_blocks"], 170);
        assert_eq!(v["held_blocks"], 4);
        assert_eq!(v["used_blocks"], 26);
        assert_eq!(v["leased_blocks"], 0);
        assert_eq!(v["cached_blocks"], 3);
        assert_eq!(
            v["held_requests"][0],
            serde_json::json!({"engine_rank": 0, "request_id": "h0", "blocks": 4, "age_s": 1.5, "state": "held"})
        );
        assert_eq!(v["ranks"].as_array().unwrap().len(), 2);
        assert_eq!(v["ranks"][1]["engine_rank"], 1);
        assert_eq!(v["unreachable_ranks"], serde_json::json!([2]));
    }
}
