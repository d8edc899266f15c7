//! The HTTP edge every pdmesh HTTP service shares: the nodes' OpenAI frontends
//! (`pdmesh-frontend`) and the P/D router (`pdmesh-router`).
//!
//! What a client meets before any request semantics: the error body and status of every
//! refusal ([`error`]), API keys ([`auth`]), the in-flight bounds per server and per key
//! ([`overload`]), request headers and trace context ([`headers`]), the body read deadline
//! ([`body_timeout`]), SSE framing ([`sse`]), the shared routes and graceful stop ([`serve`]),
//! and the metrics of all of these ([`metrics`]). The request semantics (validation, chat
//! rendering, response shapes) stay in the frontend; the router uses them from there.

pub mod auth;
pub mod body_timeout;
pub mod error;
pub mod headers;
pub mod metrics;
pub mod overload;
pub mod serve;
pub mod sse;

pub use auth::ApiKeys;
pub use error::{ApiError, FrontendError};
