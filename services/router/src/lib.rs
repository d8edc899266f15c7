//! `role = "router"`: the P/D proxy (vLLM's `toy_proxy_server`, llm-d's sidecar).
//!
//! Each OpenAI request goes first to a prefill node with
//! `kv_transfer_params = {do_remote_decode: true}`, `max_tokens = 1`, `stream = false`; P's
//! answer carries the params D needs (`do_remote_prefill`, `remote_engine_id`,
//! `remote_block_ids`, ...). Then the client's original body goes to a decode node with those
//! params, and D's answer (SSE or JSON) is passed through to the client as it arrives. Both legs
//! carry the same `X-Request-Id` and trace context. A client that disconnects drops the
//! upstream request of whichever leg is running, which each node's frontend turns into an
//! abort. With `router.local_prefill_max_tokens` set, a request whose prompt the chosen decode
//! node holds all but that many tokens of (by its prefix cache as last polled) skips P: one leg,
//! and D prefills it itself (conditional disaggregation, D69).
//!
//! With API keys, the router checks the client's key ([`pdmesh_http_edge::auth`]) and presents the mesh's
//! internal key (`PDMESH_INTERNAL_API_KEY`) on every call to P and D — both legs, `/v1/models`
//! and `/v1/kv/release` — or, without one, passes the client's `Authorization` on.

mod balance;
mod first_token;
mod migrate;
mod parallel;
pub mod policy;
mod probe;
pub mod prompt;

use std::sync::{Arc, LazyLock};

use balance::Pool;

use actix_web::http::header::AUTHORIZATION;
use actix_web::http::StatusCode;
use actix_web::{web, App, HttpMessage, HttpRequest, HttpResponse, HttpServer};
use futures::StreamExt;
use pdmesh_protocol::TraceContext;
use pdmesh_service::{ServiceContext, Shutdown};
use serde_json::{json, Value};
use tracing::Instrument;

use pdmesh_http_edge::auth::ApiKeys;
use pdmesh_http_edge::error::{ApiError, FrontendError};
use pdmesh_http_edge::headers::REQUEST_ID;
use pdmesh_http_edge::metrics::HTTP_REQUESTS_TOTAL;
use pdmesh_http_edge::serve::{get_only, post_only};

/// Upstreams and the HTTP client shared by the proxy handlers.
pub struct RouterState {
    prefill: Arc<Pool>,
    decode: Arc<Pool>,
    /// The client of the load poller, and of a thread whose own client could not be built;
    /// requests use [`RouterState::client`].
    client: reqwest::Client,
    /// `router.give_up_notices`: hand P's blocks back when a request ends between the legs.
    give_up_notices: bool,
    /// `Bearer <internal key>` for every call to P and D, when the mesh has an internal key.
    internal_authorization: Option<String>,
    /// The router's own bound on requests in flight (`limits.max_in_flight`).
    in_flight: pdmesh_http_edge::overload::InFlightLimit,
    /// The router's bound per client key (`limits.max_in_flight_per_key`).
    key_limit: pdmesh_http_edge::overload::KeyLimit,
    /// Set draining when the router stops: `/health` then answers 503.
    readiness: pdmesh_telemetry::ops::Health,
    /// `router.prefill_attempts`: prefill nodes tried per request.
    prefill_attempts: u32,
    /// `router.max_migrations`: moves of one stream to another decode node.
    max_migrations: u32,
    /// `router.first_token_from_prefill`: stream P's sampled token at once (D63).
    first_token_from_prefill: bool,
    /// `router.parallel_dispatch`: send those streams' decode leg with the prefill leg (D66).
    parallel_dispatch: bool,
    /// `router.local_prefill_max_tokens`: D prefills a prompt it holds all but this many
    /// tokens of itself, without P (D69); 0: never.
    local_prefill_max_tokens: u32,
    /// The nodes' tokenizer, for `cache_aware` picks (D59); `None`: picks weigh load only.
    tokenizer: Option<prompt::PromptTokenizer>,
    /// `limits.body_timeout_s` (D93).
    body_timeout: std::time::Duration,
    /// `router.slow_migrate_ratio` / `slow_migrate_tokens`: when a slow stream moves (D104);
    /// `None`: never (off, or `round_robin`, which weighs no latency).
    slow_migrate: Option<migrate::SlowRule>,
}

impl RouterState {
    /// The state of a router over `cfg`'s upstreams.
    pub fn new(
        cfg: &pdmesh_config::RouterConfig,
        client: reqwest::Client,
        internal_authorization: Option<String>,
        in_flight: pdmesh_http_edge::overload::InFlightLimit,
        key_limit: pdmesh_http_edge::overload::KeyLimit,
        readiness: pdmesh_telemetry::ops::Health,
    ) -> Self {
        let breaker = balance::Breaker {
            after_failures: cfg.eject_after_failures,
            base: std::time::Duration::from_millis(cfg.eject_base_ms),
            max: std::time::Duration::from_millis(cfg.eject_max_ms.max(cfg.eject_base_ms)),
        };
        let latency_aware = policy::for_config(cfg.policy).weighs_latency();
        Self {
            prefill: Arc::new(Pool::new("prefill", &cfg.prefill, cfg.policy, breaker).with_slow(cfg.slow_ratio, false)),
            decode: Arc::new(
                Pool::new("decode", &cfg.decode, cfg.policy, breaker).with_slow(cfg.slow_ratio, cfg.slow_probe_ms > 0),
            ),
            client,
            give_up_notices: cfg.give_up_notices,
            internal_authorization,
            in_flight,
            key_limit,
            readiness,
            prefill_attempts: cfg.prefill_attempts.max(1),
            max_migrations: cfg.max_migrations,
            first_token_from_prefill: cfg.first_token_from_prefill,
            parallel_dispatch: cfg.parallel_dispatch,
            local_prefill_max_tokens: cfg.local_prefill_max_tokens,
            tokenizer: None,
            body_timeout: pdmesh_http_edge::body_timeout::DEFAULT,
            slow_migrate: (latency_aware && cfg.slow_migrate_ratio > 0.0 && cfg.max_migrations > 0)
                .then_some(migrate::SlowRule { ratio: cfg.slow_migrate_ratio, tokens: cfg.slow_migrate_tokens.max(1) }),
        }
    }

    /// Answer 408 to a client whose body takes longer than `limit` (D93; zero: never).
    pub fn with_body_timeout(mut self, limit: std::time::Duration) -> Self {
        self.body_timeout = limit;
        self
    }

    /// The HTTP client for calls to P and D made on this thread: one per thread (D70). A pooled
    /// connection's reads run on the thread whose request opened it, so one client shared by
    /// the router's threads (its HTTP workers and the load poller) had a leg's chunks read on one
    /// thread and relayed on another: two wake-ups per token, each a wait for a core on a busy
    /// host. With a client per thread, a connection is only ever used by the thread that reads it.
    fn client(&self) -> reqwest::Client {
        thread_local! {
            static CLIENT: std::cell::OnceCell<Option<reqwest::Client>> = const { std::cell::OnceCell::new() };
        }
        CLIENT
            .with(|c| c.get_or_init(|| upstream_client_builder().build().ok()).clone())
            .unwrap_or_else(|| self.client.clone())
    }

    /// Tokenise prompts with `tokenizer`, so that `cache_aware` can weigh what nodes hold.
    pub fn with_tokenizer(mut self, tokenizer: Option<prompt::PromptTokenizer>) -> Self {
        self.tokenizer = tokenizer;
        self
    }

    /// The `Authorization` value for calls to P and D on behalf of `req`: the internal key's
    /// when there is one, else the client's own header (nodes that share the client keys).
    fn upstream_authorization(&self, req: &HttpRequest) -> Option<String> {
        self.internal_authorization
            .clone()
            .or_else(|| req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_string))
    }
}

/// An OpenAI error answer from the router itself (the same mapping as every frontend);
/// `request_id` is echoed unless empty (requests that carry none, like `/health`).
fn error(e: ApiError, request_id: &str) -> HttpResponse {
    if request_id.is_empty() {
        e.record();
        return actix_web::ResponseError::error_response(&e);
    }
    pdmesh_http_edge::serve::error_response(e, request_id)
}

/// A node's `Retry-After` (on its 503/429) passed to the client unchanged.
fn pass_retry_after(builder: &mut actix_web::HttpResponseBuilder, value: Option<reqwest::header::HeaderValue>) {
    if let Some(v) = value.and_then(|v| actix_web::http::header::HeaderValue::from_bytes(v.as_bytes()).ok()) {
        builder.insert_header((actix_web::http::header::RETRY_AFTER, v));
    }
}

/// The client's header pinning the prefill leg to one of P's data-parallel ranks.
pub const PREFILL_DP_RANK: &str = "x-prefill-data-parallel-rank";
/// The client's header pinning the decode leg to one of D's data-parallel ranks (a plain
/// `X-data-parallel-rank` does the same: the decode node is the one that answers).
pub const DECODE_DP_RANK: &str = "x-decode-data-parallel-rank";

/// Which leg of a P/D request a call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leg {
    Prefill,
    Decode,
}

/// Headers forwarded to a leg; `trace` is the leg's own context (its client span's, or a
/// child of the client's when export is off). P and D have their own ranks, so each leg gets
/// only the rank meant for its node, as that node's `X-data-parallel-rank`; `authorization`
/// is [`RouterState::upstream_authorization`].
fn forward_headers(
    req: &HttpRequest,
    rb: reqwest::RequestBuilder,
    request_id: &str,
    leg: Leg,
    trace: &TraceContext,
    authorization: Option<&str>,
) -> reqwest::RequestBuilder {
    let mut rb = rb.header(REQUEST_ID, request_id);
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let rank = match leg {
        Leg::Prefill => header(PREFILL_DP_RANK),
        Leg::Decode => header(DECODE_DP_RANK).or_else(|| header(pdmesh_http_edge::headers::DATA_PARALLEL_RANK)),
    };
    if let Some(rank) = rank {
        rb = rb.header(pdmesh_http_edge::headers::DATA_PARALLEL_RANK, rank);
    }
    if let Some(v) = authorization {
        rb = rb.header(AUTHORIZATION.as_str(), v);
    }
    if let Some(tp) = &trace.traceparent {
        rb = rb.header("traceparent", tp);
    }
    if let Some(ts) = &trace.tracestate {
        rb = rb.header("tracestate", ts);
    }
    rb
}

/// The router's span of one request and the W3C context the client sent.
fn request_span(req: &HttpRequest, request_id: &str, path: &str) -> (tracing::Span, TraceContext) {
    let client = pdmesh_http_edge::headers::client_trace(req.headers());
    let span = tracing::info_span!(
        "router.request",
        otel.kind = "server",
        request_id,
        path,
        prefill_overlap_blocks = tracing::field::Empty,
        decode_overlap_blocks = tracing::field::Empty,
        decode_uncached_tokens = tracing::field::Empty,
        prefill = tracing::field::Empty
    );
    pdmesh_telemetry::trace::set_parent(&span, &client);
    (span, client)
}

/// `/v1/responses`: the path whose answers are stored on the decode node.
const RESPONSES: &str = "/v1/responses";

/// The id the router gives a response that decode node `d` answers: `resp_d<d>_<uuid>`. The
/// node stores it under this id (its `x-pdmesh-response-id` header), so a follow-up naming it
/// (`previous_response_id`, `GET /v1/responses/{id}`) goes back to `d` (D49).
fn response_id_for(d: usize) -> String {
    format!("resp_d{d}_{}", uuid::Uuid::new_v4().simple())
}

/// The decode node that stored the response `id` (see [`response_id_for`]), if the id is one
/// the router made for a decode upstream it has now (`known`: whether a node id is one).
fn decode_of_response(id: &str, known: impl Fn(usize) -> bool) -> Option<usize> {
    let rest = id.strip_prefix("resp_d")?;
    let (index, _) = rest.split_once('_')?;
    index.parse::<usize>().ok().filter(|&i| known(i))
}

/// Prefill retries on another P after one failed before answering.
pub const PREFILL_RETRIES: &str = "pdmesh_router_prefill_retries_total";

static PREFILL_RETRIES_TOTAL: LazyLock<prometheus::IntCounter> = LazyLock::new(|| {
    pdmesh_telemetry::metrics::counter(PREFILL_RETRIES, "Prefill legs retried on another P after a failure")
});

/// Decode legs sent with their prefill leg and handed P's params (D66).
pub const PARALLEL_DECODE_LEGS: &str = "pdmesh_router_parallel_decode_legs_total";

static PARALLEL_DECODE_LEGS_TOTAL: LazyLock<prometheus::IntCounter> = LazyLock::new(|| {
    pdmesh_telemetry::metrics::counter(
        PARALLEL_DECODE_LEGS,
        "Decode legs sent at the same time as their prefill leg and handed P's params when P answered",
    )
});

/// Where conditional disaggregation (D69) put requests' prefills, with the knob on.
pub const PREFILL_PLACEMENT: &str = "pdmesh_router_prefill_placement_total";

static PREFILL_PLACEMENT_TOTAL: LazyLock<prometheus::IntCounterVec> = LazyLock::new(|| {
    pdmesh_telemetry::metrics::counter_vec(
        PREFILL_PLACEMENT,
        "Requests by where their prefill ran under router.local_prefill_max_tokens: remote (a prefill node) or local (the decode node)",
        &["placement"],
    )
});

/// Time the router spends turning a request into prompt token ids (chat template and
/// tokenizer) for `cache_aware` picks and conditional disaggregation: it sits on every such
/// request's path to its first byte, before any leg leaves.
pub const PROMPT_TOKENIZE: &str = "pdmesh_router_prompt_tokenize_seconds";

static PROMPT_TOKENIZE_HIST: LazyLock<prometheus::Histogram> = LazyLock::new(|| {
    pdmesh_telemetry::metrics::histogram(
        PROMPT_TOKENIZE,
        "Seconds the router spent rendering and tokenising a request's prompt before picking its nodes",
        vec![0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05],
    )
});

/// What one request's legs share.
struct Legs<'a> {
    req: &'a HttpRequest,
    st: &'a web::Data<RouterState>,
    path: &'static str,
    request_id: &'a str,
    span: &'a tracing::Span,
    client_trace: &'a TraceContext,
    authorization: Option<&'a str>,
    /// P's token goes to the client at once, D continuing after it (D63).
    first_token: bool,
    /// The prompt's token ids, when the router tokenised it (`cache_aware`, D59).
    prompt: Option<&'a [u32]>,
    /// The decode node already picked for this request (to weigh a local prefill, D69): the
    /// decode leg's first pick takes it instead of picking again.
    decode_pick: std::cell::Cell<Option<balance::Picked>>,
}

impl Legs<'_> {
    /// The decode node for the next try of this request, never one of `tried`: the one picked
    /// beforehand, once, then the pool's pick.
    fn pick_decode(&self, tried: &[usize]) -> Option<balance::Picked> {
        let picked = match self.decode_pick.take().filter(|p| !tried.contains(&p.node)) {
            Some(p) => p,
            None => self.st.decode.pick_for(tried, self.prompt)?,
        };
        if let Some(held) = picked.overlap {
            self.span.record("decode_overlap_blocks", held);
        }
        Some(picked)
    }
}

/// A prefill leg that P answered: its params for D, the guard over P's blocks, and P's
/// whole answer (its token, when the router streams it at once: D63).
struct Prefilled {
    params: Value,
    release: ReleaseOnDrop,
    answer: Value,
}

impl Legs<'_> {
    /// The relay of a stream D answered (D56/D63), carrying what the request's legs share.
    fn relay(&self, original: Value, d: usize, migrations: u32, hold: Box<dyn std::any::Any>) -> migrate::Relay {
        migrate::Relay {
            st: self.st.clone(),
            req: self.req.clone(),
            path: self.path,
            request_id: self.request_id.to_string(),
            original,
            span: self.span.clone(),
            client_trace: self.client_trace.clone(),
            authorization: self.authorization.map(str::to_string),
            d,
            migrations,
            hold,
        }
    }
}

/// Whether a node's answer says the node itself failed: a failure status, or a 503 marked
/// "down" (not "busy", D66) — retried elsewhere rather than passed to the client.
fn node_failed(r: &reqwest::Response) -> bool {
    is_failure(r.status()) || r.headers().contains_key(pdmesh_protocol::node_http::UNAVAILABLE_HEADER)
}

/// Whether an upstream's status counts as its failure (for ejection and retries): a 5xx that
/// is not an overload 503 (a 503 says "busy", not "broken", and carries `Retry-After`).
fn is_failure(status: reqwest::StatusCode) -> bool {
    status.is_server_error() && status != reqwest::StatusCode::SERVICE_UNAVAILABLE
}

/// The guard on P's blocks from the prefill leg's send until D has the request: the router may
/// be the last one to know of them there, so if the client goes away (the handler is dropped)
/// or D cannot be reached, the guard hands them back and P frees at once (R4), not at its
/// deadline. Before P answers it names P's request by id (P's own abort covers a request still
/// running; this covers one that just finished and whose answer nobody will read). Disarmed
/// from the start in the deadline-only baseline (`router.give_up_notices = false`).
fn prefill_release(legs: &Legs<'_>, p: &str, p_engine_id: &str, p_capability: &str) -> ReleaseOnDrop {
    let mut release = ReleaseOnDrop::new(
        &legs.st.client(),
        p,
        legs.request_id,
        &json!({"do_remote_prefill": true, "remote_request_id": p_engine_id, "remote_capability": p_capability}),
        legs.authorization.map(str::to_string),
    );
    if !legs.st.give_up_notices {
        release.disarm();
    }
    release
}

/// P's body for the prefill leg: the client's request cut to one token, not streamed, one
/// choice, with the capability token the router chose; with `first_token`, P's answer names
/// its token's id (the router streams it and D resumes after it).
fn prefill_body(legs: &Legs<'_>, original: &Value, p_capability: &str) -> Value {
    let mut p_body = original.clone();
    p_body["kv_transfer_params"] =
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_capability": p_capability});
    if legs.path == RESPONSES {
        // P's answer is only the handle on its blocks: nothing of it is kept on P.
        p_body["max_output_tokens"] = json!(1);
        p_body["store"] = json!(false);
    } else {
        p_body["max_tokens"] = json!(1);
        if p_body.get("max_completion_tokens").is_some() {
            p_body["max_completion_tokens"] = json!(1);
        }
        // P's one token obeys `min_tokens` as a colocated node's first would (no EOS while
        // any is asked for); more cannot be asked of a one-token answer
        if p_body.get("min_tokens").and_then(Value::as_i64).is_some_and(|m| m > 1) {
            p_body["min_tokens"] = json!(1);
        }
    }
    p_body["stream"] = json!(false);
    if let Some(o) = p_body.as_object_mut() {
        o.remove("stream_options");
    }
    if legs.first_token {
        // P's answer names its token's id: the router streams it and D resumes after it.
        p_body[pdmesh_protocol::node_http::INTERNAL_FIELD][pdmesh_protocol::node_http::internal::STREAM_TOKEN_IDS] =
            json!(true);
    }
    one_choice_on_prefill(&mut p_body);
    p_body
}

/// The prefill leg: ask a P for the blocks, on another P when one fails before answering
/// (connect refused, reset, a failure status), up to `router.prefill_attempts` Ps. `Err` is the
/// answer for the client (P's refusal as P wrote it, or the router's 503).
///
/// No retry can double-free or double-read (D55): each attempt has its own engine request id
/// and capability, D only ever gets the params of the attempt that answered, and an attempt
/// that may have left a hold on its P (it was sent) keeps its release guard armed, which
/// hands that hold back through P's `/v1/kv/release` under that attempt's id and capability
/// (or P frees it at its deadline when P is gone).
async fn prefill_leg(legs: &Legs<'_>, original: &Value) -> Result<Prefilled, HttpResponse> {
    let st = legs.st;
    let mut tried: Vec<usize> = Vec::new();
    let mut last_error = String::from("no prefill upstream");
    while (tried.len() as u32) < st.prefill_attempts {
        let Some(picked) = st.prefill.pick_for(&tried, legs.prompt) else { break };
        let pi = picked.node;
        if let Some(held) = picked.overlap {
            legs.span.record("prefill_overlap_blocks", held);
        }
        if !tried.is_empty() {
            PREFILL_RETRIES_TOTAL.inc();
            tracing::warn!(parent: legs.span, request_id = legs.request_id, attempt = tried.len() + 1,
                error = %last_error, "prefill leg retried on another prefill node");
        }
        tried.push(pi);
        // The node may have left DNS since the pick: try another one.
        let Some(p) = st.prefill.url(pi) else { continue };
        // The router chooses P's capability token for this request (P adopts a well-formed one),
        // so that it can hand P's blocks back even before P has answered (see below).
        let p_capability = pdmesh_mesh_auth::new_capability();
        let p_body = prefill_body(legs, original, &p_capability);
        // P's engine request id is the client's id plus a suffix the router picks, so the router
        // can name it before P answers; P still makes it unique whatever the client sent.
        let p_suffix = pdmesh_http_edge::headers::new_engine_id_suffix();
        let mut p_release = prefill_release(legs, &p, &format!("{}-{p_suffix}", legs.request_id), &p_capability);
        let p_span = tracing::info_span!(parent: legs.span, "router.prefill", otel.kind = "client", upstream = %p);
        let p_trace = pdmesh_telemetry::trace::outgoing(&p_span, legs.client_trace);
        let started = std::time::Instant::now();
        let counted = st.prefill.start(pi);
        let p_res = forward_headers(
            legs.req,
            st.client().post(format!("{p}{}", legs.path)),
            legs.request_id,
            Leg::Prefill,
            &p_trace,
            legs.authorization,
        )
        .header(pdmesh_protocol::node_http::ENGINE_ID_SUFFIX_HEADER, p_suffix.as_str())
        .json(&p_body)
        .send()
        .instrument(p_span.clone())
        .await;
        let p_res = match p_res {
            Ok(r) => r,
            Err(e) => {
                if e.is_connect() {
                    p_release.disarm(); // nothing reached P
                }
                st.prefill.failure(pi, if e.is_connect() { "connect" } else { "reset" });
                tracing::warn!(parent: &p_span, request_id = legs.request_id, upstream = %p, error = %e, "prefill leg failed");
                last_error = format!("prefill node {p}: {e}");
                continue; // an armed guard drops here: P's possible hold is handed back
            }
        };
        let p_status = p_res.status();
        // A 503 from a P whose engine side is down (not one that is busy) is that P's failure:
        // retried on another P like a reset (a P dying process by process answers so).
        let p_failed = node_failed(&p_res);
        let p_retry_after = p_res.headers().get(reqwest::header::RETRY_AFTER).cloned();
        let p_bytes = match p_res.bytes().await {
            Ok(b) => b,
            Err(e) => {
                st.prefill.failure(pi, "reset");
                last_error = format!("prefill node {p}: {e}");
                continue;
            }
        };
        drop(counted);
        tracing::info!(parent: &p_span, status = p_status.as_u16(), "prefill answered");
        drop(p_span);
        if p_failed {
            st.prefill.failure(pi, "5xx");
            last_error = format!("prefill node {p} answered {}", p_status.as_u16());
            if (tried.len() as u32) < st.prefill_attempts && tried.len() < st.prefill.len() {
                continue;
            }
        }
        if !p_status.is_success() {
            p_release.disarm();
            // P refused the request (bad input, too long, overloaded...): the client gets P's
            // answer, `Retry-After` included.
            let status = StatusCode::from_u16(p_status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let mut builder = HttpResponse::build(status);
            pass_retry_after(&mut builder, p_retry_after);
            return Err(builder
                .insert_header((REQUEST_ID, legs.request_id.to_string()))
                .content_type("application/json")
                .body(p_bytes));
        }
        st.prefill.success(pi);
        st.prefill.observe_latency(pi, started.elapsed().as_secs_f64());
        let answer = serde_json::from_slice::<Value>(&p_bytes).unwrap_or(Value::Null);
        let params = answer["kv_transfer_params"].clone();
        p_release.update(&params);
        return Ok(Prefilled { params, release: p_release, answer });
    }
    tracing::warn!(request_id = legs.request_id, error = %last_error, "prefill leg failed on every node tried");
    Err(error(ApiError::Unavailable(format!("unavailable: {last_error}")), legs.request_id))
}

async fn proxy(req: HttpRequest, body: web::Bytes, st: web::Data<RouterState>, path: &'static str) -> HttpResponse {
    let request_id = match pdmesh_http_edge::headers::request_id(req.headers()) {
        Ok(id) => id,
        Err(e) => return error(e, &pdmesh_http_edge::headers::new_request_id()),
    };
    let Ok(mut original) = serde_json::from_slice::<Value>(&body) else {
        return error(ApiError::invalid_request("request body is not valid JSON"), &request_id);
    };
    let Some(fields) = original.as_object_mut() else {
        return error(ApiError::invalid_request("request body must be a JSON object"), &request_id);
    };
    // The router's internal field is the router's alone (D56).
    fields.remove(pdmesh_protocol::node_http::INTERNAL_FIELD);
    // Overload control: refused here, before P is asked, nothing is held anywhere yet — the
    // client key's bound (429) first, then the router's (503).
    let client_key = req.extensions().get::<pdmesh_http_edge::auth::ClientKey>().copied();
    let key_permit = match st.key_limit.try_acquire(client_key) {
        Ok(permit) => permit,
        Err(e) => return error(e, &request_id),
    };
    let permit = match st.in_flight.try_acquire() {
        Ok(permit) => permit,
        Err(e) => return error(e, &request_id),
    };
    let (span, client_trace) = request_span(&req, &request_id, path);
    let authorization = st.upstream_authorization(&req);
    // A follow-up of a stored response goes to the decode node that stored the conversation,
    // which alone can render it: one leg, D prefilling locally (P knows nothing of it; D49).
    let pinned = (path == RESPONSES)
        .then(|| original.get("previous_response_id").and_then(Value::as_str))
        .flatten()
        .and_then(|id| decode_of_response(id, |d| st.decode.contains(d)));
    if st.prefill.is_empty() || st.decode.is_empty() {
        return error(ApiError::Unavailable("unavailable: no prefill or decode upstream".into()), "");
    }
    let tokens = match (&st.tokenizer, pinned) {
        (Some(t), None) => {
            let started = std::time::Instant::now();
            let tokens = t.tokens(path, &original);
            PROMPT_TOKENIZE_HIST.observe(started.elapsed().as_secs_f64());
            tokens
        }
        _ => None,
    };
    // D72: a chat prompt tokenised here goes to the nodes as ids, so neither renders it again.
    if let Some(ids) = tokens.as_ref().filter(|_| path == first_token::CHAT) {
        original[pdmesh_protocol::node_http::INTERNAL_FIELD][pdmesh_protocol::node_http::internal::PROMPT_TOKEN_IDS] =
            json!(ids);
    }
    let legs = Legs {
        req: &req,
        st: &st,
        path,
        request_id: &request_id,
        span: &span,
        client_trace: &client_trace,
        authorization: authorization.as_deref(),
        first_token: st.first_token_from_prefill && pinned.is_none() && first_token::eligible(path, &original),
        prompt: tokens.as_deref(),
        decode_pick: std::cell::Cell::new(None),
    };
    if pinned.is_none() && prefills_on_decode(&legs) {
        return decode_leg(&legs, original, None, None, Box::new((permit, key_permit))).await;
    }
    if legs.first_token && st.parallel_dispatch {
        return parallel::dispatch(&legs, original, Box::new((permit, key_permit))).await;
    }
    let prefilled = match pinned {
        Some(_) => None,
        None => match prefill_leg(&legs, &original).await {
            Ok(p) => Some(p),
            Err(answer) => return answer,
        },
    };
    decode_leg(&legs, original, prefilled, pinned, Box::new((permit, key_permit))).await
}

/// Conditional disaggregation (D69): with `router.local_prefill_max_tokens` set and the prompt
/// tokenised, pick the decode node now (the decode leg goes to it) and say whether it would
/// have at most that many of the prompt's tokens left to compute — then it prefills the
/// request itself and P is not asked.
fn prefills_on_decode(legs: &Legs<'_>) -> bool {
    let st = legs.st;
    if st.local_prefill_max_tokens == 0 {
        return false;
    }
    let Some(prompt) = legs.prompt else { return false };
    let Some(picked) = st.decode.pick_for(&[], Some(prompt)) else { return false };
    legs.decode_pick.set(Some(picked));
    let uncached = st.decode.uncached_tokens(picked, prompt);
    let local = uncached <= st.local_prefill_max_tokens as usize;
    let placement = if local { "local" } else { "remote" };
    legs.span.record("decode_uncached_tokens", uncached);
    legs.span.record("prefill", placement);
    PREFILL_PLACEMENT_TOTAL.with_label_values(&[placement]).inc();
    if local {
        tracing::debug!(parent: legs.span, request_id = legs.request_id, uncached, "the decode node prefills the request itself");
    }
    local
}

/// The decode leg: the client's own body plus P's params (none for a pinned follow-up: D
/// prefills it itself), answered to the client as D streams it. A D that fails before its
/// answer starts is replaced by another that prefills the request itself (P's blocks are handed
/// back, never given to a second reader); a stream that breaks later moves ([`migrate`]).
async fn decode_leg(
    legs: &Legs<'_>,
    original: Value,
    prefilled: Option<Prefilled>,
    pinned: Option<usize>,
    permits: Box<dyn std::any::Any>,
) -> HttpResponse {
    let st = legs.st;
    let path = legs.path;
    let stream = original["stream"].as_bool().unwrap_or(false);
    // Completions and chat streams can move mid-generation; the Responses API's stored
    // conversations cannot.
    let movable = path != RESPONSES && pinned.is_none() && st.max_migrations > 0;
    // D63: P's token, when this stream shows it from P's answer; D resumes after it.
    let mut first = prefilled
        .as_ref()
        .filter(|p| legs.first_token && !p.params.is_null())
        .and_then(|p| first_token::from_answer(path, &original, &p.answer));
    let (mut params, mut release) = match prefilled {
        Some(p) => (Some(p.params), Some(p.release)),
        None => (None, None),
    };
    let mut tried: Vec<usize> = Vec::new();
    let mut migrations = 0u32;
    let (d_index, d_res, d_span) = loop {
        let picked = pinned.or_else(|| legs.pick_decode(&tried).map(|p| p.node));
        let Some(d_index) = picked else {
            return error(ApiError::Unavailable("unavailable: no decode upstream left to try".into()), legs.request_id);
        };
        tried.push(d_index);
        let Some(d) = st.decode.url(d_index) else {
            // It left DNS since the pick (or since it stored the conversation).
            if pinned.is_some() {
                return error(
                    ApiError::Unavailable("unavailable: the decode node that stored the conversation is gone".into()),
                    legs.request_id,
                );
            }
            continue;
        };
        let d_body = decode_body(&original, params.take(), &mut first, tried.len() > 1, stream && movable);
        let d_span =
            tracing::info_span!(parent: legs.span, "router.decode", otel.kind = "client", upstream = %d, stream);
        let d_trace = pdmesh_telemetry::trace::outgoing(&d_span, legs.client_trace);
        let mut d_rb = forward_headers(
            legs.req,
            st.client().post(format!("{d}{path}")),
            legs.request_id,
            Leg::Decode,
            &d_trace,
            legs.authorization,
        );
        if path == RESPONSES {
            d_rb = d_rb.header(pdmesh_protocol::node_http::RESPONSE_ID_HEADER, response_id_for(d_index));
        }
        let counted = st.decode.start(d_index);
        let d_res = d_rb.json(&d_body).send().instrument(d_span.clone()).await;
        drop(counted);
        let failed = match &d_res {
            Ok(r) if node_failed(r) => {
                format!("decode node {d} answered {}", r.status().as_u16())
            }
            Ok(_) => {
                // D answered, so D owns the reference now (it tells P itself if it gives up).
                if let Some(release) = release.as_mut() {
                    release.disarm();
                }
                break (d_index, d_res, d_span);
            }
            Err(e) => format!("decode node {d}: {e}"),
        };
        let reason = match &d_res {
            Err(e) if e.is_connect() => "connect",
            Err(_) => "reset",
            Ok(_) => "5xx",
        };
        st.decode.failure(d_index, reason);
        tracing::warn!(parent: &d_span, request_id = legs.request_id, upstream = %d, error = %failed, "decode leg failed");
        // P's blocks go back to P now (the guard), whatever D did with them: the next D
        // prefills the request itself.
        release = None;
        if !movable || migrations >= st.max_migrations || tried.len() >= st.decode.len() {
            return match d_res {
                Ok(r) => pass_answer(r, legs.request_id, stream).await,
                Err(_) => error(ApiError::Unavailable(format!("unavailable: {failed}")), legs.request_id),
            };
        }
        migrations += 1;
        migrate::MIGRATIONS_TOTAL.with_label_values(&["no_answer"]).inc();
        tracing::warn!(parent: legs.span, request_id = legs.request_id, from = %d, migration = migrations,
            "decode node failed before answering; the request moves to another decode node");
    };
    let d_res = match d_res {
        Ok(r) => r,
        Err(_) => return error(ApiError::Unavailable("unavailable: decode leg".into()), legs.request_id),
    };
    let decoded = Decoded { d_index, d_span, first, migrations, relayable: movable };
    answer_decoded(legs, original, d_res, decoded, stream, permits).await
}

/// D's body for one try of the decode leg. With P's `params`: them, and for a stream shown
/// from P's token (`first`), resume after it. Without, on a `retry` after a D failed: a
/// continuation that computes the request whole (nothing reached the client yet, so `first`
/// is dropped). Else the client's body without any `kv_transfer_params`. `ids`: a movable
/// stream, whose events must carry their token ids.
fn decode_body(
    original: &Value,
    params: Option<Value>,
    first: &mut Option<first_token::FirstToken>,
    retry: bool,
    ids: bool,
) -> Value {
    use pdmesh_protocol::node_http::{internal, INTERNAL_FIELD};
    let mut d_body = match params {
        Some(p) => {
            let mut b = original.clone();
            b["kv_transfer_params"] = p;
            if let Some(first) = first.as_ref() {
                b[INTERNAL_FIELD][internal::STREAM_TOKEN_IDS] = json!(true);
                b[INTERNAL_FIELD][internal::RESUME_TOKEN_IDS] = json!([first.id]);
            }
            b
        }
        None if retry => {
            *first = None;
            migrate::continuation_body(original, &[])
        }
        None => {
            let mut b = original.clone();
            if let Some(o) = b.as_object_mut() {
                o.remove("kv_transfer_params");
            }
            b
        }
    };
    if ids {
        d_body[INTERNAL_FIELD][internal::STREAM_TOKEN_IDS] = json!(true);
    }
    d_body
}

/// Where the decode leg ended up: the node that answered, its span, P's token if the client
/// sees it from P's answer, the moves so far, and whether the stream may move again.
struct Decoded {
    d_index: usize,
    d_span: tracing::Span,
    first: Option<first_token::FirstToken>,
    migrations: u32,
    relayable: bool,
}

/// Pass D's answer on: a stream that may move (or resumes after P's token) through the relay
/// that can continue it elsewhere, another stream event by event, a whole answer as it is.
async fn answer_decoded(
    legs: &Legs<'_>,
    original: Value,
    d_res: reqwest::Response,
    decoded: Decoded,
    stream: bool,
    permits: Box<dyn std::any::Any>,
) -> HttpResponse {
    let Decoded { d_index, d_span, first, migrations, relayable: movable } = decoded;
    let st = legs.st;
    let status = StatusCode::from_u16(d_res.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    tracing::info!(parent: &d_span, status = status.as_u16(), "decode answered");
    if status.is_success() {
        st.decode.success(d_index);
    }
    // A stream D resumes after P's token (D63) is relayed like a movable one: its chunks carry
    // token ids for the router alone.
    if stream && status.is_success() && (movable || first.is_some()) {
        let relay = legs.relay(original, d_index, migrations, Box::new((permits, d_span)));
        return match first {
            Some(first) => migrate::respond_after_first_token(relay, first, d_res, None),
            None => migrate::respond(relay, d_res),
        };
    }
    let mut builder = answer_builder(&d_res, legs.request_id, stream);
    if stream && status.is_success() {
        // The spans end when the stream does (dropped with it), so they cover the whole answer.
        let spans = (legs.span.clone(), d_span, permits);
        let upstream = d_res.bytes_stream().map(|chunk| chunk.map_err(|e| e.to_string()));
        builder.streaming(whole_events(upstream, legs.request_id.to_string()).map(move |chunk| {
            let _ = &spans;
            Ok::<_, std::io::Error>(chunk)
        }))
    } else {
        builder.body(d_res.bytes().await.unwrap_or_default())
    }
}

/// A node's failure answer passed to the client as it is.
async fn pass_answer(r: reqwest::Response, request_id: &str, stream: bool) -> HttpResponse {
    answer_builder(&r, request_id, stream).body(r.bytes().await.unwrap_or_default())
}

/// The client's answer for a node's answer `r`: its status, content type and `Retry-After`,
/// and the request's id.
fn answer_builder(r: &reqwest::Response, request_id: &str, stream: bool) -> actix_web::HttpResponseBuilder {
    let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or(if stream { "text/event-stream" } else { "application/json" })
        .to_string();
    let mut builder = HttpResponse::build(status);
    pass_retry_after(&mut builder, r.headers().get(reqwest::header::RETRY_AFTER).cloned());
    builder.insert_header((REQUEST_ID, request_id.to_string())).content_type(content_type);
    builder
}

/// D's SSE stream passed on in whole events. If D's stream breaks (D's frontend died, the
/// connection reset), the client gets what every frontend sends for a failure after the
/// stream started — an OpenAI error event and `[DONE]` — instead of a cut connection, and
/// never half an event: bytes after the last complete event are dropped.
fn whole_events<S>(upstream: S, request_id: String) -> impl futures::Stream<Item = web::Bytes>
where
    S: futures::Stream<Item = Result<web::Bytes, String>>,
{
    upstream
        .map(Some)
        .chain(futures::stream::once(async { None }))
        .scan((Vec::<u8>::new(), false), move |(pending, done), item| {
            if *done {
                return futures::future::ready(None);
            }
            let out = match item {
                Some(Ok(bytes)) => {
                    pending.extend_from_slice(&bytes);
                    match last_event_end(pending) {
                        Some(end) => web::Bytes::from(pending.drain(..end).collect::<Vec<u8>>()),
                        None => web::Bytes::new(),
                    }
                }
                // D ended its stream: whatever is left (normally nothing) goes as it is.
                None => {
                    *done = true;
                    web::Bytes::from(std::mem::take(pending))
                }
                Some(Err(e)) => {
                    *done = true;
                    tracing::warn!(%request_id, error = %e, "decode stream broke; ending it with an error event");
                    let err = ApiError::Unavailable(format!("unavailable: the decode node's stream broke: {e}"));
                    err.record();
                    pdmesh_http_edge::sse::sse_error(&err)
                }
            };
            futures::future::ready(Some(out))
        })
        .filter(|b| futures::future::ready(!b.is_empty()))
}

/// End of the last complete SSE event in `buf` (after its blank line), if any.
fn last_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).rposition(|w| w == b"\n\n").map(|p| p + 2);
    let crlf = buf.windows(4).rposition(|w| w == b"\r\n\r\n").map(|p| p + 4);
    lf.max(crlf)
}

/// Hands P's block reference back through P's `/v1/kv/release` when dropped armed: the
/// request ended (client disconnect drops the handler) before D took it, or D was unreachable.
struct ReleaseOnDrop {
    armed: Option<(reqwest::Client, String, String, Value)>,
    /// P's `/v1/kv/release` is under `/v1`: it needs the same credential as the legs.
    authorization: Option<String>,
}

impl ReleaseOnDrop {
    fn new(client: &reqwest::Client, p: &str, request_id: &str, params: &Value, authorization: Option<String>) -> Self {
        let usable = params.get("remote_request_id").is_some_and(Value::is_string);
        let armed = usable.then(|| {
            (
                client.clone(),
                format!("{p}{}", pdmesh_protocol::node_http::KV_RELEASE_PATH),
                request_id.to_string(),
                params.clone(),
            )
        });
        Self { armed, authorization }
    }

    fn disarm(&mut self) {
        self.armed = None;
    }

    /// Name the blocks by P's full params (engine, rank, blocks) once P answered.
    fn update(&mut self, params: &Value) {
        if params.get("remote_request_id").is_some_and(Value::is_string) {
            if let Some(armed) = self.armed.as_mut() {
                armed.3 = params.clone();
            }
        }
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some((client, url, request_id, params)) = self.armed.take() else { return };
        let authorization = self.authorization.take();
        // Dropped on a runtime thread (the handler future); without one there is nothing to do.
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        tracing::info!(%request_id, "decode leg never started; handing P's blocks back");
        rt.spawn(async move {
            let body = json!({"kv_transfer_params": params});
            // The guard most often fires because P's frontend just died (its leg was reset or
            // refused), and that frontend is the only door to P's release: its restart takes
            // about a second, while the hold, which lives on in P's engine and worker, would
            // stay until its deadline (the lease, or `abort_request_timeout_s` — minutes). So a
            // release P did not take (unreachable, or a 503 while its engine link comes back) is
            // sent again for a while; a second delivery is harmless (P frees a hold once, and a
            // notice for a hold it no longer has changes nothing).
            let mut delay = RELEASE_RETRY_FIRST;
            let give_up = tokio::time::Instant::now() + RELEASE_RETRY_FOR;
            loop {
                let mut rb = client.post(&url).header(REQUEST_ID, request_id.as_str());
                if let Some(v) = &authorization {
                    rb = rb.header(AUTHORIZATION.as_str(), v.as_str());
                }
                let failure = match rb.json(&body).send().await {
                    Ok(r) if r.status().is_success() => return,
                    Ok(r) if r.status() != reqwest::StatusCode::SERVICE_UNAVAILABLE => {
                        tracing::warn!(%request_id, status = r.status().as_u16(), "P refused the release");
                        return;
                    }
                    Ok(r) => format!("P answered {}", r.status().as_u16()),
                    Err(e) => e.to_string(),
                };
                if tokio::time::Instant::now() + delay > give_up {
                    tracing::warn!(%request_id, error = %failure, "release not delivered; P frees at its deadline");
                    return;
                }
                tracing::info!(%request_id, error = %failure, retry_in_ms = delay.as_millis() as u64,
                    "release not delivered; sending it again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RELEASE_RETRY_MAX_DELAY);
            }
        });
    }
}

/// First wait before a release P did not take is sent again (see [`ReleaseOnDrop`]).
const RELEASE_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(250);
/// Longest wait between two sends of one release.
const RELEASE_RETRY_MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(2);
/// How long a release is sent again: a frontend restart (`pdmesh up` backs off up to 8 s
/// between restarts of a child that keeps dying) fits; a P gone for good frees at its
/// deadline.
const RELEASE_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(15);

/// The prefill leg of a request with `n > 1` is one request: P prefills the prompt once and
/// holds its blocks for one reader; D fans the decode leg out into the `n` choices (D58).
fn one_choice_on_prefill(p_body: &mut Value) {
    if let Some(o) = p_body.as_object_mut() {
        if o.contains_key("n") {
            o.insert("n".into(), json!(1));
        }
        o.remove("best_of");
    }
}

async fn completions(req: HttpRequest, body: web::Bytes, st: web::Data<RouterState>) -> HttpResponse {
    proxy(req, body, st, "/v1/completions").await
}

async fn chat(req: HttpRequest, body: web::Bytes, st: web::Data<RouterState>) -> HttpResponse {
    proxy(req, body, st, "/v1/chat/completions").await
}

async fn responses(req: HttpRequest, body: web::Bytes, st: web::Data<RouterState>) -> HttpResponse {
    proxy(req, body, st, RESPONSES).await
}

/// `GET /v1/responses/{id}`: asked of the decode node that stored it (named by the id); an id
/// the router did not make is not stored anywhere it can find (404, as a node answers).
async fn get_response(req: HttpRequest, path: web::Path<String>, st: web::Data<RouterState>) -> HttpResponse {
    let id = path.into_inner();
    let Some(d) = decode_of_response(&id, |d| st.decode.contains(d)).and_then(|i| st.decode.url(i)) else {
        return error(ApiError::ResponseNotFound(id), "");
    };
    forward_get(&req, &st, &d, &format!("{RESPONSES}/{id}")).await
}

/// `/v1/models` is answered by the first decode node.
async fn passthrough_get(req: HttpRequest, st: web::Data<RouterState>) -> HttpResponse {
    let Some(d) = st.decode.urls().into_iter().next() else {
        return error(ApiError::Unavailable("unavailable: no decode upstream".into()), "");
    };
    forward_get(&req, &st, &d, req.path()).await
}

/// GET `path` on the node at `base` with the router's credential toward nodes, and hand its
/// status and JSON body to the client unchanged.
async fn forward_get(req: &HttpRequest, st: &RouterState, base: &str, path: &str) -> HttpResponse {
    let mut rb = st.client().get(format!("{base}{path}"));
    if let Some(v) = st.upstream_authorization(req) {
        rb = rb.header(AUTHORIZATION.as_str(), v);
    }
    match rb.send().await {
        Ok(r) => {
            let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            HttpResponse::build(status).content_type("application/json").body(r.bytes().await.unwrap_or_default())
        }
        Err(e) => error(ApiError::Unavailable(format!("unavailable: decode node {base}: {e}")), ""),
    }
}

/// How long an upstream has to answer the router's `/health`.
const UPSTREAM_HEALTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// `GET /health`: 200 when the router can serve — at least one prefill and one decode upstream
/// answer their own `/health` (which requires a connected engine rank) with 200 — else 503.
/// The body counts the healthy upstreams of each role.
async fn health(st: web::Data<RouterState>) -> HttpResponse {
    if st.readiness.is_draining() {
        return pdmesh_http_edge::serve::stopping();
    }
    let client = st.client();
    let (p_up, d_up) = futures::join!(healthy_upstreams(&client, &st.prefill), healthy_upstreams(&client, &st.decode));
    let body = json!({
        "prefill_upstreams": st.prefill.len(), "prefill_upstreams_up": p_up,
        "decode_upstreams": st.decode.len(), "decode_upstreams_up": d_up,
    });
    if p_up > 0 && d_up > 0 {
        let degraded = p_up < st.prefill.len() || d_up < st.decode.len();
        let mut body = body;
        body["status"] = json!(if degraded { "degraded" } else { "ready" });
        HttpResponse::Ok().json(body)
    } else {
        let e = ApiError::Unavailable(format!(
            "unavailable: {p_up} of {} prefill and {d_up} of {} decode upstreams are healthy; the router needs one of each",
            st.prefill.len(),
            st.decode.len()
        ));
        let mut v = serde_json::to_value(e.body()).unwrap_or_default();
        v["upstreams"] = body;
        HttpResponse::ServiceUnavailable().json(v)
    }
}

async fn healthy_upstreams(client: &reqwest::Client, pool: &Pool) -> usize {
    let checks = pool.urls().into_iter().map(|u| async move {
        let res = client.get(format!("{u}/health")).timeout(UPSTREAM_HEALTH_TIMEOUT).send().await;
        res.is_ok_and(|r| r.status().is_success())
    });
    futures::future::join_all(checks).await.into_iter().filter(|ok| *ok).count()
}

/// The router's application: every route behind the API-key check and the request counter;
/// a wrong method on a known path is a 405, an unknown path a 404, both with the OpenAI body
/// every node sends.
fn router_app(
    state: web::Data<RouterState>,
    client_keys: web::Data<ApiKeys>,
) -> App<
    impl actix_web::dev::ServiceFactory<
        actix_web::dev::ServiceRequest,
        Config = (),
        Response = actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    let body_timeout = pdmesh_http_edge::body_timeout::BodyTimeout(state.body_timeout);
    App::new()
        .app_data(state)
        .app_data(client_keys)
        .app_data(web::PayloadConfig::new(pdmesh_http_edge::serve::MAX_BODY_BYTES))
        .app_data(body_timeout)
        .wrap(actix_web::middleware::from_fn(pdmesh_http_edge::body_timeout::middleware))
        .wrap(actix_web::middleware::from_fn(pdmesh_http_edge::auth::require_api_key))
        .wrap_fn(|req, srv| {
            let fut = actix_web::dev::Service::call(srv, req);
            async move {
                let res = fut.await;
                if let Ok(r) = &res {
                    let endpoint = r.request().match_pattern().unwrap_or_else(|| "unmatched".into());
                    HTTP_REQUESTS_TOTAL.with_label_values(&[&endpoint, r.status().as_str()]).inc();
                }
                res
            }
        })
        .service(post_only("/v1/completions", completions))
        .service(post_only("/v1/chat/completions", chat))
        .service(post_only(RESPONSES, responses))
        .service(get_only("/v1/responses/{id}", get_response))
        .service(get_only("/v1/models", passthrough_get))
        .service(get_only("/health", health))
        .service(get_only("/live", pdmesh_telemetry::ops::live))
        .service(get_only("/metrics", pdmesh_telemetry::metrics::metrics_handler))
        .default_service(web::to(pdmesh_http_edge::serve::not_found))
}

/// The settings of every client the router calls P and D with.
fn upstream_client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        // Idle connections to P and D are dropped well before the nodes' own keep-alive (5 s)
        // closes them: a request sent on a connection the node is closing fails without
        // reaching it, which would count as that node's failure.
        .pool_idle_timeout(std::time::Duration::from_secs(2))
}

/// Run the router frontend of `ctx`'s node until `shutdown` begins, then stop gracefully like
/// a node frontend (`pdmesh_frontend::run`). `client_keys`: what clients must present (empty: nothing); `internal_key`:
/// what the router presents to P and D (none: the client's own `Authorization` is passed on).
pub async fn run_router(
    ctx: ServiceContext,
    client_keys: ApiKeys,
    internal_key: Option<String>,
    tokenizer: Option<prompt::PromptTokenizer>,
    shutdown: Shutdown,
) -> Result<(), FrontendError> {
    let node = ctx.node.clone();
    pdmesh_http_edge::metrics::init();
    let client = upstream_client_builder().build().map_err(|e| FrontendError::Options(format!("http client: {e}")))?;
    let state = web::Data::new(
        RouterState::new(
            &node.router,
            client.clone(),
            internal_key.map(|k| format!("Bearer {k}")),
            pdmesh_http_edge::overload::InFlightLimit::new(node.limits.max_in_flight, "router"),
            pdmesh_http_edge::overload::KeyLimit::new(node.limits.max_in_flight_per_key, client_keys.len(), "router"),
            ctx.health.clone(),
        )
        .with_tokenizer(tokenizer)
        .with_body_timeout(std::time::Duration::from_secs(u64::from(node.limits.body_timeout_s))),
    );
    if node.router.policy == pdmesh_config::RoutingPolicy::CacheAware && state.tokenizer.is_none() {
        tracing::warn!("router.policy = cache_aware without the nodes' tokenizer: picking by load only (least_loaded)");
    }
    balance::init();
    LazyLock::force(&PREFILL_RETRIES_TOTAL);
    LazyLock::force(&migrate::MIGRATIONS_TOTAL);
    // Readiness and load of every upstream, polled while the router runs (D55).
    let poller = (node.router.load_poll_ms > 0).then(|| {
        actix_web::rt::spawn(balance::poll_loads(
            vec![state.prefill.clone(), state.decode.clone()],
            client,
            state.internal_authorization.clone(),
            std::time::Duration::from_millis(node.router.load_poll_ms),
        ))
    });
    // Slow and unmeasured decode nodes, probed without users' requests (D104).
    let prober = (node.router.slow_probe_ms > 0 && state.decode.probed()).then(|| {
        actix_web::rt::spawn(probe::run(
            state.decode.clone(),
            state.client.clone(),
            state.internal_authorization.clone(),
            std::time::Duration::from_millis(node.router.slow_probe_ms),
        ))
    });
    // Upstreams named by DNS (a headless Service per role), re-resolved while the router runs.
    let refresh = std::time::Duration::from_millis(node.router.dns_refresh_ms.max(1));
    let discovery: Vec<_> = [(&state.prefill, &node.router.prefill_dns), (&state.decode, &node.router.decode_dns)]
        .into_iter()
        .filter_map(|(pool, name)| {
            let name = name.clone()?;
            Some(actix_web::rt::spawn(balance::discover(Arc::clone(pool), name, refresh)))
        })
        .collect();
    pdmesh_http_edge::error::set_retry_after_s(node.limits.retry_after_s);
    tracing::info!(
        api_keys = client_keys.enabled(),
        internal_key = state.internal_authorization.is_some(),
        max_in_flight_per_key = node.limits.max_in_flight_per_key,
        "API keys {}",
        if client_keys.enabled() { "required" } else { "not required" }
    );
    let client_keys = web::Data::new(client_keys);
    let addr = format!("{}:{}", node.http_host, node.http_port);
    let server = HttpServer::new(move || router_app(state.clone(), client_keys.clone()))
        .tcp_nodelay(true)
        .shutdown_timeout(pdmesh_http_edge::serve::drain_timeout_s(shutdown.deadline()))
        .disable_signals()
        .bind((node.http_host.as_str(), node.http_port))
        .map_err(|source| FrontendError::HttpBind { addr: addr.clone(), source })?;
    tracing::info!(%addr, prefill = ?node.router.prefill, decode = ?node.router.decode,
        prefill_dns = ?node.router.prefill_dns, decode_dns = ?node.router.decode_dns,
        give_up_notices = node.router.give_up_notices, policy = ?node.router.policy, "router listening");
    let served = pdmesh_http_edge::serve::serve_until_shutdown(&ctx, server.run(), shutdown).await;
    if let Some(p) = poller {
        p.abort();
    }
    if let Some(p) = prober {
        p.abort();
    }
    for task in discovery {
        task.abort();
    }
    served?;
    tracing::info!(%addr, "router stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream stand-in on a free local port, one worker: its address and server handle.
    macro_rules! spawn_stub {
        ($factory:expr) => {{
            let server = HttpServer::new($factory).workers(1).bind(("127.0.0.1", 0)).unwrap();
            let addr = server.addrs()[0];
            let server = server.run();
            let handle = server.handle();
            actix_web::rt::spawn(server);
            (addr, handle)
        }};
    }

    fn collect(items: Vec<Result<&'static str, &'static str>>) -> String {
        let upstream = futures::stream::iter(
            items
                .into_iter()
                .map(|i| i.map(|s| web::Bytes::from_static(s.as_bytes())).map_err(|e| e.to_string()))
                .collect::<Vec<_>>(),
        );
        let out: Vec<web::Bytes> = futures::executor::block_on(whole_events(upstream, "r".into()).collect());
        out.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect()
    }

    fn state_over(p: &str, d: &str, internal: Option<&str>, max_in_flight: u32) -> RouterState {
        let cfg = pdmesh_config::RouterConfig { prefill: vec![p.into()], decode: vec![d.into()], ..Default::default() };
        RouterState::new(
            &cfg,
            reqwest::Client::new(),
            internal.map(|k| format!("Bearer {k}")),
            pdmesh_http_edge::overload::InFlightLimit::new(max_in_flight, "router"),
            pdmesh_http_edge::overload::KeyLimit::disabled("router"),
            Default::default(),
        )
    }

    fn state(internal: Option<&str>) -> RouterState {
        state_over("http://p", "http://d", internal, 0)
    }

    #[test]
    fn the_internal_key_goes_upstream_instead_of_the_clients() {
        let req = actix_web::test::TestRequest::default()
            .insert_header(("authorization", "Bearer sk-client"))
            .insert_header(("x-data-parallel-rank", "1"))
            .to_http_request();
        let st = state(Some("mesh-internal"));
        let auth = st.upstream_authorization(&req);
        assert_eq!(auth.as_deref(), Some("Bearer mesh-internal"));
        let built = forward_headers(
            &req,
            st.client().post("http://p/v1/completions"),
            "r1",
            Leg::Decode,
            &TraceContext::default(),
            auth.as_deref(),
        )
        .build()
        .unwrap();
        let headers = built.headers();
        assert_eq!(headers.get_all("authorization").iter().count(), 1, "the client's key is not passed on beside it");
        assert_eq!(headers["authorization"], "Bearer mesh-internal");
        assert_eq!(headers["x-data-parallel-rank"], "1");
        // Without an internal key the client's own header goes on (nodes sharing the client keys).
        assert_eq!(state(None).upstream_authorization(&req).as_deref(), Some("Bearer sk-client"));
        let anonymous = actix_web::test::TestRequest::default().to_http_request();
        assert_eq!(state(None).upstream_authorization(&anonymous), None);
    }

    /// A router whose prefill upstream answers every request with a 503, `Retry-After: 7`.
    async fn router_before_an_overloaded_p(
        max_in_flight: u32,
    ) -> (web::Data<RouterState>, actix_web::dev::ServerHandle) {
        let (p_addr, handle) = spawn_stub!(|| {
            App::new().route(
                "/v1/completions",
                web::post().to(|| async {
                    HttpResponse::ServiceUnavailable()
                        .insert_header(("retry-after", "7"))
                        .json(json!({"error": {"message": "overloaded: P is full", "type": "ServiceUnavailableError",
                                               "param": null, "code": 503}}))
                }),
            )
        });
        let url = format!("http://{p_addr}");
        let state = web::Data::new(state_over(&url, &url, None, max_in_flight));
        (state, handle)
    }

    async fn post(state: &web::Data<RouterState>) -> (StatusCode, Option<String>, Value) {
        let app = actix_web::test::init_service(
            App::new().app_data(state.clone()).route("/v1/completions", web::post().to(completions)),
        )
        .await;
        let req = actix_web::test::TestRequest::post().uri("/v1/completions").set_json(json!({"prompt": "x"}));
        let res = actix_web::test::call_service(&app, req.to_request()).await;
        let retry = res.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
        let status = res.status();
        let body = actix_web::test::read_body(res).await;
        (status, retry, serde_json::from_slice(&body).unwrap())
    }

    #[actix_web::test]
    async fn a_nodes_503_and_retry_after_pass_through_unchanged() {
        let (state, p) = router_before_an_overloaded_p(0).await;
        let (status, retry, body) = post(&state).await;
        assert_eq!(status, 503);
        assert_eq!(retry.as_deref(), Some("7"), "P's Retry-After, not the router's own");
        assert_eq!(body["error"]["message"], "overloaded: P is full");
        assert_eq!(state.in_flight.current(), 0);
        p.stop(false).await;
    }

    #[actix_web::test]
    async fn the_router_refuses_beyond_its_own_bound_before_asking_p() {
        let (state, p) = router_before_an_overloaded_p(1).await;
        let held = state.in_flight.try_acquire().unwrap();
        let (status, retry, body) = post(&state).await;
        assert_eq!(status, 503);
        assert!(retry.unwrap().parse::<u32>().unwrap() >= 1);
        assert_eq!(body["error"]["type"], "ServiceUnavailableError");
        assert!(body["error"]["message"].as_str().unwrap().starts_with("overloaded"), "{body}");
        drop(held);
        let (_, retry, body) = post(&state).await;
        assert_eq!((retry.as_deref(), &body["error"]["message"]), (Some("7"), &json!("overloaded: P is full")));
        p.stop(false).await;
    }

    /// A node's 429 (its per-key bound; reached when the router passes its client's key on)
    /// reaches the client as the node wrote it: status, `Retry-After` and OpenAI's body.
    #[actix_web::test]
    async fn a_nodes_429_and_retry_after_pass_through_unchanged() {
        let (p_addr, handle) = spawn_stub!(|| {
            App::new().route(
                "/v1/completions",
                web::post().to(|| async {
                    let mut r = actix_web::ResponseError::error_response(&ApiError::RateLimited(
                        "rate limited: this API key already has its limit of 2 requests in flight; retry later".into(),
                    ));
                    r.headers_mut().insert(
                        actix_web::http::header::RETRY_AFTER,
                        actix_web::http::header::HeaderValue::from_static("9"),
                    );
                    r
                }),
            )
        });
        let st = web::Data::new(state_over(&format!("http://{p_addr}"), "http://d", None, 0));
        let (status, retry, body) = post(&st).await;
        assert_eq!(status, 429);
        assert_eq!(retry.as_deref(), Some("9"), "P's Retry-After, not the router's own");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
        assert_eq!(body["error"]["type"], "requests", "{body}");
        handle.stop(false).await;
    }

    #[test]
    fn a_whole_stream_passes_unchanged_even_when_split_mid_event() {
        let got = collect(vec![Ok("data: {\"a\":1}\n\nda"), Ok("ta: {\"b\":2}\n"), Ok("\ndata: [DONE]\n\n")]);
        assert_eq!(got, "data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n");
    }

    #[test]
    fn a_broken_stream_ends_with_an_error_event_and_no_half_event() {
        let got = collect(vec![Ok("data: {\"a\":1}\n\ndata: {\"tru"), Err("connection reset"), Ok("data: late\n\n")]);
        let events: Vec<&str> = got.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 3, "{got}");
        assert_eq!(events[0], "data: {\"a\":1}");
        let err: Value = serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
        assert!(err["error"]["message"].as_str().unwrap().contains("connection reset"), "{err}");
        assert_eq!(events[2], "data: [DONE]");
    }

    /// The router's own routing table: a wrong method on each of its paths is a 405 with
    /// `Allow` and the OpenAI body, an unknown path a 404 with the OpenAI body a node sends
    /// (actix's default would be an empty body). No upstream is asked.
    #[actix_web::test]
    async fn the_router_answers_wrong_methods_405_and_unknown_paths_404() {
        let app = actix_web::test::init_service(router_app(
            web::Data::new(state(None)),
            web::Data::new(ApiKeys::new(Vec::<String>::new())),
        ))
        .await;
        for (method, path, allow) in [
            ("GET", "/v1/completions", "POST"),
            ("GET", "/v1/chat/completions", "POST"),
            ("GET", "/v1/responses", "POST"),
            ("DELETE", "/v1/responses/resp_d0_x", "GET"),
            ("POST", "/v1/models", "GET"),
            ("DELETE", "/health", "GET"),
            ("POST", "/live", "GET"),
            ("PUT", "/metrics", "GET"),
        ] {
            let req = actix_web::test::TestRequest::default()
                .method(actix_web::http::Method::from_bytes(method.as_bytes()).unwrap())
                .uri(path)
                .to_request();
            let res = actix_web::test::call_service(&app, req).await;
            assert_eq!(res.status(), 405, "{method} {path}");
            assert_eq!(res.headers().get("allow").unwrap(), allow, "{method} {path}");
            let e: Value = serde_json::from_slice(&actix_web::test::read_body(res).await).unwrap();
            assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
            assert_eq!(e["error"]["code"], 405, "{e}");
        }
        let res =
            actix_web::test::call_service(&app, actix_web::test::TestRequest::get().uri("/v1/nowhere").to_request())
                .await;
        assert_eq!(res.status(), 404);
        let e: Value = serde_json::from_slice(&actix_web::test::read_body(res).await).unwrap();
        assert_eq!(e["error"]["type"], "NotFoundError", "{e}");
        assert_eq!(e["error"]["message"], "no route for GET /v1/nowhere", "{e}");
        // An id the router did not make names no decode node: 404 without asking one.
        let res = actix_web::test::call_service(
            &app,
            actix_web::test::TestRequest::get().uri("/v1/responses/resp_abc").to_request(),
        )
        .await;
        assert_eq!(res.status(), 404);
    }

    /// A release P does not take (here two 503s, as from a P frontend whose engine link is
    /// coming back after a restart) is sent again until P takes it, then no more.
    #[actix_web::test]
    async fn a_release_p_did_not_take_is_sent_again() {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = calls.clone();
        let (p_addr, handle) = spawn_stub!(move || {
            let seen = seen.clone();
            App::new().route(
                "/v1/kv/release",
                web::post().to(move || {
                    let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    async move {
                        if n < 2 {
                            actix_web::ResponseError::error_response(&ApiError::Unavailable("unavailable".into()))
                        } else {
                            HttpResponse::Accepted().json(json!({"released": true}))
                        }
                    }
                }),
            )
        });
        let params = json!({"do_remote_prefill": true, "remote_request_id": "r-1", "remote_capability": "c"});
        drop(ReleaseOnDrop::new(&reqwest::Client::new(), &format!("http://{p_addr}"), "r", &params, None));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while calls.load(std::sync::atomic::Ordering::SeqCst) < 3 && std::time::Instant::now() < deadline {
            actix_web::rt::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        actix_web::rt::time::sleep(RELEASE_RETRY_MAX_DELAY).await;
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 3, "two refusals, then the release P took");
        handle.stop(false).await;
    }

    /// Response ids name the decode node that stored them, and only one of ours.
    #[test]
    fn response_ids_name_their_decode_node() {
        let id = response_id_for(2);
        assert!(id.starts_with("resp_d2_"), "{id}");
        assert_eq!(decode_of_response(&id, |d| d < 3), Some(2));
        assert_eq!(decode_of_response(&id, |d| d < 2), None, "no such node now");
        for other in ["resp_abc", "resp_dx_1", "resp_d1", "msg_d0_1", ""] {
            assert_eq!(decode_of_response(other, |d| d < 4), None, "{other}");
        }
    }
}
