//! Wiring: the shared state of the handlers, the actix-web `App` (routes, body limits,
//! request metrics), and start-up (engine client, output socket, HTTP listener).

use std::net::SocketAddr;
use std::sync::Arc;

use actix_web::body::MessageBody;
use actix_web::dev::{Server, Service, ServiceFactory, ServiceRequest, ServiceResponse};
use actix_web::http::header::HeaderName;
use actix_web::middleware::from_fn;
use actix_web::{web, App, HttpServer, ResponseError};
use pdmesh_model_api::TextCodec;
use pdmesh_protocol::node_http;
use pdmesh_service::ServiceContext;
use pdmesh_transport::bind_pull;

use crate::auth::ApiKeys;
use crate::engine_client::EngineClient;
use crate::error::{ApiError, FrontendError};
use crate::handlers;
use crate::headers::REQUEST_ID;
use crate::metrics::HTTP_REQUESTS_TOTAL;
use crate::overload::{InFlightLimit, KeyLimit};
use crate::FrontendOptions;

pub use pdmesh_http_edge::serve::{drain_timeout_s, MAX_BODY_BYTES};

pub use crate::state::AppState;

/// Body limits and the OpenAI error body for malformed JSON. The content type is not
/// required: `curl -d` clients send none or a form type, and vLLM accepts them.
pub fn json_config() -> web::JsonConfig {
    web::JsonConfig::default().limit(MAX_BODY_BYTES).content_type_required(false).error_handler(|err, req| {
        let api = ApiError::from_json_error(&err);
        api.record();
        let mut response = api.error_response();
        if let Some(id) = req.headers().get(REQUEST_ID) {
            response.headers_mut().insert(HeaderName::from_static(REQUEST_ID), id.clone());
        }
        actix_web::error::InternalError::from_response(err, response).into()
    })
}

/// The application: every route, behind the API-key check ([`crate::auth`]) and a middleware
/// counting requests by route and status.
pub fn app(
    state: web::Data<AppState>,
) -> App<
    impl ServiceFactory<
        ServiceRequest,
        Config = (),
        Response = ServiceResponse<impl MessageBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    let api_keys = web::Data::new(state.api_keys.clone());
    let body_timeout = crate::body_timeout::BodyTimeout(state.body_timeout);
    App::new()
        .app_data(state)
        .app_data(api_keys)
        .app_data(json_config())
        .app_data(body_timeout)
        .wrap(from_fn(crate::body_timeout::middleware))
        .wrap(from_fn(crate::auth::require_api_key))
        .wrap_fn(|req, srv| {
            let fut = srv.call(req);
            async move {
                let result = fut.await;
                match &result {
                    Ok(res) => {
                        let endpoint = res.request().match_pattern().unwrap_or_else(|| "unmatched".to_string());
                        HTTP_REQUESTS_TOTAL.with_label_values(&[&endpoint, res.status().as_str()]).inc();
                    }
                    Err(e) => {
                        let status = e.as_response_error().status_code();
                        HTTP_REQUESTS_TOTAL.with_label_values(&["unknown", status.as_str()]).inc();
                    }
                }
                result
            }
        })
        .service(handlers::admin::post_only("/v1/completions", handlers::completions::completions))
        .service(handlers::admin::post_only("/v1/chat/completions", handlers::chat::chat_completions))
        .service(handlers::admin::post_only("/v1/responses", handlers::responses::create_response))
        .service(handlers::admin::get_only("/v1/responses/{id}", handlers::responses::get_response))
        .service(handlers::admin::post_only(node_http::KV_RELEASE_PATH, handlers::kv_release))
        .service(handlers::admin::post_only(node_http::KV_PARAMS_PATH, handlers::kv_params))
        .service(handlers::admin::get_only("/v1/models", handlers::admin::models))
        .service(handlers::admin::get_only("/health", handlers::admin::health))
        .service(handlers::admin::get_only("/live", pdmesh_telemetry::ops::live))
        .service(handlers::admin::get_only("/metrics", pdmesh_telemetry::metrics::metrics_handler))
        .service(handlers::admin::get_only("/debug/kv", handlers::admin::debug_kv))
        .service(handlers::admin::get_only(node_http::LOAD_PATH, handlers::admin::load))
        .service(handlers::admin::get_only("/debug/engines", handlers::admin::debug_engines))
        .default_service(web::to(handlers::admin::not_found))
}

/// A running frontend: the HTTP server future and the addresses it listens on.
pub struct Started {
    pub server: Server,
    pub addrs: Vec<SocketAddr>,
    pub state: web::Data<AppState>,
}

/// Start the engine client, bind the output socket and the HTTP listener of `ctx`'s node.
/// Must run inside an actix System. `api_keys`: what clients must present (empty: nothing).
/// The server ignores the process's signals: it stops through [`crate::run`]'s shutdown
/// handle, draining in-flight requests for up to [`drain_timeout_s`] of the deadline.
pub async fn start(
    ctx: &ServiceContext,
    codec: Arc<dyn TextCodec>,
    options: FrontendOptions,
    api_keys: ApiKeys,
    deadline: std::time::Duration,
) -> Result<Started, FrontendError> {
    options.validate()?;
    crate::metrics::init();
    let (node, endpoints) = (&ctx.node, &ctx.endpoints);
    crate::error::set_retry_after_s(node.limits.retry_after_s);
    let request_deadline =
        Some(node.limits.request_deadline_s).filter(|s| *s > 0).map(|s| std::time::Duration::from_secs(u64::from(s)));
    let (client, link) = EngineClient::start_with_deadline(
        endpoints.dplb_frontend.connect.clone(),
        node.limits.output_buffer as usize,
        request_deadline,
    );
    apply_guided_limits(&node.limits);
    crate::tools::set_max_tools(node.limits.max_tools);
    let outputs = bind_pull(&endpoints.frontend_outputs.bind, client.clone().recipient())
        .await
        .map_err(|e| FrontendError::OutputSocket(Box::new(e)))?;
    tracing::info!(dp_lb = %endpoints.dplb_frontend.connect, %outputs, "engine client started");
    let in_flight = InFlightLimit::new(node.limits.max_in_flight, "frontend");
    tracing::info!(
        api_keys = api_keys.enabled(),
        max_in_flight_per_key = node.limits.max_in_flight_per_key,
        "API keys {}",
        if api_keys.enabled() { "required" } else { "not required" }
    );
    let mut app_state = AppState::new(client, link, codec, options, in_flight);
    app_state.key_limit = KeyLimit::new(node.limits.max_in_flight_per_key, api_keys.len(), "frontend");
    app_state.api_keys = api_keys;
    app_state.readiness = ctx.health.clone();
    app_state.body_timeout = std::time::Duration::from_secs(u64::from(node.limits.body_timeout_s));
    let state = web::Data::new(app_state);
    let app_state = state.clone();
    let addr = format!("{}:{}", node.http_host, node.http_port);
    let server = HttpServer::new(move || app(app_state.clone()))
        .shutdown_timeout(drain_timeout_s(deadline))
        .disable_signals()
        // A client that closes its side is gone (no HTTP client half-closes and then reads):
        // end the connection so the handler or SSE body is dropped and the request aborted,
        // even while no token is being written.
        .h1_allow_half_closed(false)
        // Tokens are small writes: without TCP_NODELAY, Nagle holds each one until the
        // client's (delayed, ~40 ms) ACK of the previous write on a kept-alive connection.
        .tcp_nodelay(true)
        .bind((node.http_host.as_str(), node.http_port))
        .map_err(|source| FrontendError::HttpBind { addr, source })?;
    let addrs = server.addrs();
    Ok(Started { server: server.run(), addrs, state })
}

/// The structured-output bounds of a node's `limits` (D90).
pub fn guided_limits(limits: &pdmesh_config::LimitsConfig) -> pdmesh_guided::GuidedLimits {
    pdmesh_guided::GuidedLimits {
        max_spec_bytes: limits.guided_max_spec_bytes as usize,
        max_choices: limits.guided_max_choices as usize,
        max_ref_depth: limits.guided_max_ref_depth as usize,
        compile_timeout: std::time::Duration::from_millis(u64::from(limits.guided_compile_timeout_ms)),
        ..pdmesh_guided::GuidedLimits::default()
    }
}

/// Set this process's structured-output bounds from a node's `limits`: every service that
/// compiles grammars (the frontend validating, the worker's executor masking) applies the
/// same ones, so the worker never refuses a spec its frontend accepted.
pub fn apply_guided_limits(limits: &pdmesh_config::LimitsConfig) {
    pdmesh_guided::set_limits(guided_limits(limits));
}
