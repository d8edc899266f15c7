//! The router's internal request field `pdmesh_internal` (D56): how a decode node streams the
//! token ids the router needs to move a request, and how it resumes one moved to it.
//! A whole (non-streamed) answer asked for ids carries them too: the router streams the
//! token a prefill node sampled to its client at once and has D continue after it (D63).
//!
//! `{"pdmesh_internal": {"stream_token_ids": true}}` makes every stream chunk carry the ids of
//! its tokens (a `: pdmesh_token_ids [...]` comment line of its event, D73; a whole answer's
//! `pdmesh_token_ids` field); `"resume_token_ids": [...]` continues a request whose
//! client already saw those tokens from another node: they are appended to the prompt (the
//! node prefills them, as if it had generated them), `max_tokens` shrinks by their number,
//! seeded draws continue from their output index, and the stream shows only what comes after
//! them. The router removes the field from every client body, so only the router sets it;
//! a client calling a node directly with it only gets what a longer prompt would give.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::generate::Prepared;

/// The body field (the router↔node contract, [`pdmesh_protocol::node_http`]).
pub use pdmesh_protocol::node_http::INTERNAL_FIELD as FIELD;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Internal {
    #[serde(default)]
    stream_token_ids: bool,
    #[serde(default)]
    resume_token_ids: Vec<u32>,
    /// The router's token for a decode leg sent before P answered (D66): the request is
    /// admitted and parked until its params arrive under this token (`POST /v1/kv/params`).
    #[serde(default)]
    params_follow: Option<String>,
    /// A chat request's prompt as the router already rendered and tokenised it (with the
    /// nodes' own code and tokenizer, D72): the node takes these ids instead of rendering the
    /// messages again. Read (and checked) during validation, before
    /// the rest of the field (`pdmesh_openai::request::prompt_token_ids`): accepted here only so the field is not an unknown key.
    #[serde(default, rename = "prompt_token_ids")]
    _prompt_token_ids: serde::de::IgnoredAny,
}

/// Apply the body's `pdmesh_internal` (if any) to a prepared request.
pub fn apply(extra: &Map<String, Value>, prepared: &mut Prepared, vocab_size: u32) -> Result<(), ApiError> {
    let Some(value) = extra.get(FIELD) else { return Ok(()) };
    let internal: Internal =
        serde_json::from_value(value.clone()).map_err(|e| ApiError::invalid(format!("{FIELD}: {e}"), FIELD))?;
    // A stream's chunks carry the ids of their tokens; a whole answer carries all of them
    // (the router streams a prefill node's first token itself, D63).
    prepared.settings.stream_token_ids = internal.stream_token_ids;
    if let Some(token) = internal.params_follow {
        if !prepared.settings.stream || prepared.n > 1 || token.is_empty() {
            return Err(ApiError::invalid(
                format!("{FIELD}.params_follow needs a streamed request with one choice and a token"),
                FIELD,
            ));
        }
        prepared.params_follow = Some(token);
    }
    resume_after(prepared, internal.resume_token_ids, vocab_size)
}

/// Continue `prepared` after `ids`, tokens its client already saw from another node (see the
/// module docs): from the body's field, or delivered to a parked request (D66).
pub fn resume_after(prepared: &mut Prepared, ids: Vec<u32>, vocab_size: u32) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Ok(());
    }
    if !prepared.settings.stream {
        return Err(ApiError::invalid(format!("{FIELD}.resume_token_ids needs a streamed request"), FIELD));
    }
    if let Some(bad) = ids.iter().find(|&&t| t >= vocab_size) {
        return Err(ApiError::invalid(format!("{FIELD}.resume_token_ids: token id {bad} is out of range"), FIELD));
    }
    let n = u32::try_from(ids.len()).unwrap_or(u32::MAX);
    let sampling = &mut prepared.request.sampling;
    if n >= sampling.max_tokens {
        return Err(ApiError::invalid(
            format!("{FIELD}.resume_token_ids: {n} tokens already reach max_tokens {}", sampling.max_tokens),
            FIELD,
        ));
    }
    sampling.max_tokens -= n;
    sampling.output_index_offset = n;
    prepared.request.prompt_token_ids.extend_from_slice(&ids);
    tracing::info!(parent: &prepared.span, resumed_tokens = n, "request resumes after tokens generated elsewhere");
    prepared.settings.resume_token_ids = ids;
    Ok(())
}
