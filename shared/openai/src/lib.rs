//! pdmesh's OpenAI request semantics: what a request body means, shared by the node frontends
//! (which serve it) and the router (which must tokenise a prompt exactly as the node it routes
//! to will, to route by cached prefix and to send a chat prompt already rendered, D72).
//!
//! It sits above the HTTP edge (`pdmesh-http-edge`: error bodies, keys, headers) and below
//! every service: no server state, no I/O. Its own crate so that the router, a service, needs
//! no other service (D109).
//!
//! - [`wire`]: the OpenAI request and response types (loose where clients are loose, so that
//!   [`validation`] can name the offending field).
//! - [`validation`]: OpenAI fields → engine parameters, or a 400/404 naming the field.
//! - [`request`]: a whole completions or chat body → parameters, prompt token ids and
//!   `max_tokens` ([`request::validate_completion`], [`request::validate_chat`]).
//! - [`tools`], [`structured`]: tool calling and structured outputs (their grammars, parsing
//!   a model's tool calls back).
//! - [`metrics`]: the one metric counted here (structured-output refusals).

pub mod metrics;
pub mod request;
pub mod structured;
pub mod tools;
pub mod validation;
pub mod wire;

use pdmesh_http_edge::error::FrontendError;

/// Facts about the served model that request validation needs. They come from the model (the
/// caller loads or asks for them) rather than from the topology, so that a frontend refuses
/// exactly what the engine could not serve, and the router tokenises as the nodes do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrontendOptions {
    /// The `model` name clients must use (`/v1/models` lists it); requests naming another
    /// model get a 404.
    pub served_model_name: String,
    /// Longest prompt + completion, in tokens; longer requests get a 400.
    pub max_model_len: u32,
    /// Token ids at or above it are refused (0: use the codec's vocabulary size).
    pub vocab_size: u32,
    /// End-of-sequence ids, put on every engine request (honoured unless `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
    /// Rule R1: tell P when a remote-prefill request is refused before admission (off only to
    /// measure the deadline-only baseline).
    pub rejection_notices: bool,
}

impl FrontendOptions {
    /// Refuse options that would make every request fail in a confusing way.
    pub fn validate(&self) -> Result<(), FrontendError> {
        if self.served_model_name.is_empty() {
            return Err(FrontendError::Options("served_model_name must not be empty".into()));
        }
        if self.max_model_len == 0 {
            return Err(FrontendError::Options("max_model_len must be at least 1".into()));
        }
        Ok(())
    }
}
