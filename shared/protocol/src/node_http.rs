//! The HTTP contract between the P/D router and the nodes' frontends (D56, D63, D66, D72, D73).
//!
//! The router talks to P and D over the same OpenAI API clients use, plus a few things only it
//! sends or reads. Those were spelled in four frontend modules; they are one contract, written
//! here once so the router (`pdmesh-router`) and the frontend (`pdmesh-frontend`) agree by
//! construction and neither imports the other's internals:
//! - the body field [`INTERNAL_FIELD`] and its keys ([`internal`]): stream token ids, resume
//!   after tokens seen elsewhere, parked decode legs, prompts the router already tokenised;
//! - where a node writes the ids of a stream's tokens ([`TOKEN_IDS_FIELD`], [`TOKEN_IDS_COMMENT`]);
//! - the headers each side sets ([`REQUEST_ID_HEADER`], [`DATA_PARALLEL_RANK_HEADER`],
//!   [`ENGINE_ID_SUFFIX_HEADER`], [`RESPONSE_ID_HEADER`], [`UNAVAILABLE_HEADER`]);
//! - what a node reports of itself on [`LOAD_PATH`] ([`NodeLoad`]), and the router-only paths.
//!
//! Everything here is plain data: the HTTP code lives in the two services.

use serde::{Deserialize, Serialize};

use crate::PrefixSummary;

/// The body field only the router sets (it strips it from every client body). A client that
/// calls a node directly with it gets nothing a longer prompt would not give it.
pub const INTERNAL_FIELD: &str = "pdmesh_internal";

/// The keys of [`INTERNAL_FIELD`].
pub mod internal {
    /// `true`: every stream event carries the ids of its tokens (and a whole answer all of
    /// them in [`super::TOKEN_IDS_FIELD`]): what the router needs to move a stream (D56, D63).
    pub const STREAM_TOKEN_IDS: &str = "stream_token_ids";
    /// Token ids the client already saw from another node: the node prefills them after the
    /// prompt, shrinks `max_tokens` by their number and streams only what follows (D56).
    pub const RESUME_TOKEN_IDS: &str = "resume_token_ids";
    /// A decode leg sent before P answered (D66): the node admits and parks it until its
    /// params arrive under this token on [`super::KV_PARAMS_PATH`].
    pub const PARAMS_FOLLOW: &str = "params_follow";
    /// A chat prompt the router already rendered and tokenised with the nodes' own code
    /// (D72): the node takes the ids instead of rendering the messages again.
    pub const PROMPT_TOKEN_IDS: &str = "prompt_token_ids";
}

/// The field of a whole (non-streamed) answer that carries its token ids.
pub const TOKEN_IDS_FIELD: &str = "pdmesh_token_ids";
/// The SSE comment line that carries an event's token ids (D73): `: pdmesh_token_ids [1,2]`
/// precedes the event's `data:` line. A comment, so an OpenAI client ignores it.
pub const TOKEN_IDS_COMMENT: &str = ": pdmesh_token_ids ";

/// `X-Request-Id`, in requests and responses.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// `X-data-parallel-rank` (vLLM's header for pinning a request to one DP rank).
pub const DATA_PARALLEL_RANK_HEADER: &str = "x-data-parallel-rank";
/// Sent by the router on its prefill leg: the suffix P's frontend gives the engine request id,
/// so that the router can name P's request (to hand its blocks back) before P has answered.
/// Only a suffix: the frontend still checks the whole id, and the engine refuses any id that
/// still names blocks, so a client that sets it can collide with nothing but its own requests.
pub const ENGINE_ID_SUFFIX_HEADER: &str = "x-pdmesh-engine-id-suffix";
/// The Responses API's response id the router chose (it names the decode node, so a later
/// `GET /v1/responses/{id}` reaches the node that stored it).
pub const RESPONSE_ID_HEADER: &str = "x-pdmesh-response-id";
/// Marks a 503 that says "the engine side is down", not "busy": the router counts it as the
/// node's failure (its breaker), where an overload 503 is not.
pub const UNAVAILABLE_HEADER: &str = "x-pdmesh-unavailable";

/// `GET`: the node's [`NodeLoad`], polled by the router every `router.load_poll_ms`.
pub const LOAD_PATH: &str = "/load";
/// `POST`: hand a prefill node's held blocks back (the router's release of a reference).
pub const KV_RELEASE_PATH: &str = "/v1/kv/release";
/// `POST`: deliver P's `kv_transfer_params` to a decode leg parked under its token (D66).
pub const KV_PARAMS_PATH: &str = "/v1/kv/params";

/// What a node says of itself on [`LOAD_PATH`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeLoad {
    pub ready: bool,
    pub waiting: u32,
    pub running: u32,
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
    /// What its prefix caches hold (D59); absent with caching off and from older nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<PrefixSummary>,
}
