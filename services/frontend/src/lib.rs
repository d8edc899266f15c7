//! pdmesh frontend: the OpenAI-compatible HTTP API in front of one node's mesh (vLLM's API
//! server process).
//!
//! It validates and tokenises requests, submits them to the node's DP load balancer over a
//! ZeroMQ DEALER link, receives the engine outputs on a PULL socket, detokenises them,
//! applies stop strings, and answers as JSON or server-sent events. It never talks to an
//! engine rank directly.
//!
//! ```text
//!  HTTP ─▶ handlers ─▶ validation ─▶ generate::submit ─▶ EngineClient ──DEALER──▶ dp-lb
//!                                       │                   ▲
//!            JSON ◀─ generate::collect ◀┤                   └──PULL◀── EngineOutputs
//!            SSE  ◀─ stream::run       ◀┘   (per-request channel, routed by request id)
//! ```
//!
//! Map of the modules:
//! - [`server`]: the handlers' shared state, the actix-web `App` (routes, body limit, request
//!   metrics) and start-up.
//! - [`handlers`]: one module per endpoint group; generation requests share `handlers::serve`.
//! - [`validation`]: OpenAI fields → engine parameters, or a 400/404 naming the field.
//! - [`auth`]: API keys (`Authorization: Bearer`), checked before routing.
//! - [`headers`]: `X-Request-Id`, `X-data-parallel-rank`, W3C trace context.
//! - [`engine_client`]: the actor owning the dp-lb link and the request-id → channel table.
//! - [`generate`]: submit, collect, and the guard that aborts abandoned requests.
//! - [`output`]: incremental detokenisation, stop strings with hold-back, logprobs.
//! - [`stream`]: SSE framing, chunk shapes, the streaming task.
//! - [`openai`]: request and response types.
//! - [`responses`]: the Responses API's response object, store and SSE events.
//! - [`error`]: [`ApiError`] (HTTP status / OpenAI type mapping in one place) and
//!   [`FrontendError`].
//! - [`metrics`]: metric names and definitions.
//! - [`overload`]: the bounds on requests in flight, per server (503 + `Retry-After` beyond it)
//!   and per client API key (429 + `Retry-After`).
//!
//! - [`resume`], [`parked`]: a moved stream's resume field, decode legs parked until P's params
//!   arrive.
//! - [`validation`], [`openai`], [`tools`], [`structured`] are `pdmesh-openai`'s (re-exported):
//!   the request semantics the router shares.
//!
//! The P/D router (`role = "router"`) is its own crate, `pdmesh-router`; it shares this crate's
//! request semantics through `pdmesh-openai` and its HTTP edge through `pdmesh-http-edge`, and
//! imports nothing of this one. What the two say to each other over HTTP is
//! `pdmesh_protocol::node_http`.
//!
//! What each OpenAI/vLLM field gets (honoured, accepted, or refused with a 400 naming it) is
//! docs/CONFIG.md's coverage table, checked against this crate's validation by `coverage_doc`.

pub mod engine_client;
pub mod generate;
pub mod handlers;
pub mod metrics;
pub mod output;
pub mod parked;
pub mod response_store;
pub mod responses;
pub mod resume;
pub mod server;
pub mod state;
pub mod stream;

#[cfg(test)]
mod coverage_doc;
#[cfg(test)]
mod tests;

use std::sync::Arc;

/// The HTTP edge this crate shares with the router (`pdmesh-http-edge`), under the paths the
/// frontend's modules have always used.
pub use pdmesh_http_edge::{auth, body_timeout, error, headers, overload};
/// The request semantics this crate shares with the router (`pdmesh-openai`, D109), under the
/// paths the frontend's modules have always used.
pub use pdmesh_openai::{structured, tools, validation, wire as openai, FrontendOptions};

pub use auth::ApiKeys;
pub use error::{ApiError, FrontendError};
use pdmesh_http_edge::serve::serve_until_shutdown;
use pdmesh_service::{ServiceContext, Shutdown};

/// Run the frontend of `ctx`'s node inside the current actix System (`actix_rt::System` /
/// `#[actix_web::main]`) until `shutdown` begins, then stop gracefully: `/health` goes 503, the
/// listener closes, and requests in flight finish (actix-web's graceful drain, bounded just
/// past the shutdown deadline the shell enforces). `api_keys`: what clients must present.
pub async fn run(
    ctx: ServiceContext,
    codec: Arc<dyn pdmesh_model_api::TextCodec>,
    options: FrontendOptions,
    api_keys: ApiKeys,
    shutdown: Shutdown,
) -> Result<(), FrontendError> {
    let started = server::start(&ctx, codec, options, api_keys, shutdown.deadline()).await?;
    tracing::info!(node = %ctx.node.name, addrs = ?started.addrs, "frontend listening");
    serve_until_shutdown(&ctx, started.server, shutdown).await?;
    tracing::info!(node = %ctx.node.name, "frontend stopped");
    Ok(())
}
