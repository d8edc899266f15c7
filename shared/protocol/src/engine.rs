//! Messages between the frontend, the DP load balancer and the engine-core ranks.

use serde::{Deserialize, Serialize};

use crate::kv::{HeldRequest, KvTransferParams, KvUsage};

/// Sampling parameters as the engine and the worker need them. Stop *strings* are the
/// frontend's business (they need detokenised text); stop *token ids* are the engine's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 means no nucleus truncation.
    pub top_p: f32,
    /// 0 means no top-k truncation.
    pub top_k: u32,
    /// Per-request seed; `None` means the worker's own randomness.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Maximum number of tokens to generate.
    pub max_tokens: u32,
    /// Extra token ids that end generation (besides EOS unless `ignore_eos`).
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    #[serde(default)]
    pub ignore_eos: bool,
    /// Number of top alternatives to return with each sampled token (OpenAI `logprobs`).
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Tokens this request generated before it moved here (D56: a migrated stream resumes
    /// with them appended to its prompt): seeded draws continue from this output index, so a
    /// seeded request draws what it would have drawn where it started.
    #[serde(default)]
    pub output_index_offset: u32,
    /// Structured output: the grammar every sampled token must keep the output inside (D53).
    /// Validated by the frontend; enforced by the worker's sampler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided: Option<GuidedSpec>,
    /// OpenAI `logit_bias`: `(token id, bias)` added to that token's logit before sampling
    /// (greedy included); logprobs stay those of the raw logits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM `min_p` (0 = off): tokens whose probability (after temperature) is below `min_p`
    /// times the most likely token's are dropped before top-k/top-p.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub min_p: f32,
    /// vLLM `allowed_token_ids`: when not empty, only these ids can be sampled.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_token_ids: Vec<u32>,
    /// OpenAI/vLLM `presence_penalty` (0 = off): subtracted once from the logit of every token
    /// the request has generated.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub presence_penalty: f32,
    /// OpenAI/vLLM `frequency_penalty` (0 = off): subtracted from a token's logit once per time
    /// the request has generated it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub frequency_penalty: f32,
    /// vLLM `repetition_penalty` (1 = off): the logit of every token in the prompt or the output
    /// is divided by it when positive, multiplied by it otherwise.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub repetition_penalty: f32,
    /// vLLM `min_tokens`: EOS and `stop_token_ids` cannot be sampled (nor stop strings match)
    /// before the request has generated this many tokens.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub min_tokens: u32,
    /// vLLM `bad_words`, tokenised by the frontend (each word with and without a leading
    /// space, as vLLM does): a word's last token cannot be sampled right after the rest of it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bad_words_token_ids: Vec<Vec<u32>>,
}

impl SamplingParams {
    /// Whether the sampler needs the request's token history ([`crate::SamplingHistory`]):
    /// penalties, `min_tokens` and `bad_words` read it.
    pub fn needs_history(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || self.min_tokens > 0
            || !self.bad_words_token_ids.is_empty()
    }
}

/// What a request has seen so far, as the sampler's penalties, `min_tokens` and `bad_words`
/// need it. Built by the engine for each sampling chunk of a request that asks for any of
/// them ([`SamplingParams::needs_history`]); the worker keeps no per-request state, so the
/// step carries it (a few bytes per token, paid only by those requests).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingHistory {
    /// The distinct ids of the prompt, ascending; empty unless `repetition_penalty` is on.
    /// Tokens a moved request generated elsewhere (`output_index_offset`) are output, not
    /// prompt, so P, D and a colocated node penalise the same history.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_token_ids: Vec<u32>,
    /// Every token generated so far, in order, including those generated before a move.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub output_token_ids: Vec<u32>,
    /// The ids `min_tokens` holds back until it is reached: the model's EOS ids (unless
    /// `ignore_eos`) and the request's `stop_token_ids`; empty without `min_tokens`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
}

fn is_zero(v: &f32) -> bool {
    *v == 0.0
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

fn one() -> f32 {
    1.0
}

fn is_one(v: &f32) -> bool {
    *v == 1.0
}

/// A grammar the output must follow (OpenAI `response_format`, vLLM `structured_outputs` /
/// `guided_*`). Travels as source text: the worker compiles it against its own vocabulary, so
/// the frontend, P and D need not agree on anything but the text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuidedSpec {
    /// A JSON schema, as JSON text.
    JsonSchema(String),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A regular expression the whole output must match.
    Regex(String),
    /// One of these strings, verbatim.
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark syntax.
    Lark(String),
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            output_index_offset: 0,
            guided: None,
            logit_bias: Vec::new(),
            min_p: 0.0,
            allowed_token_ids: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_tokens: 0,
            bad_words_token_ids: Vec::new(),
        }
    }
}

/// A request as the engine sees it: already tokenised.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineRequest {
    /// The engine request id: unique among the node's live requests whatever the client
    /// sent (the frontend suffixes the client's id).
    pub request_id: String,
    /// The client's `X-Request-Id`, for logs and traces.
    #[serde(default)]
    pub client_request_id: Option<String>,
    pub prompt_token_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// End-of-sequence ids of the model (honoured unless `sampling.ignore_eos`).
    #[serde(default)]
    pub eos_token_ids: Vec<u32>,
    /// Milliseconds since the Unix epoch when the frontend accepted the request.
    #[serde(default)]
    pub arrival_unix_ms: u64,
    #[serde(default)]
    pub kv_transfer_params: Option<KvTransferParams>,
    /// Pin to one data-parallel rank (`X-data-parallel-rank`).
    #[serde(default)]
    pub data_parallel_rank: Option<u32>,
}

/// Abort requests by id. Unknown ids are counted by the receiver, never an error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AbortRequests {
    pub request_ids: Vec<String>,
}

/// Why a request stopped, with vLLM's/OpenAI's names on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the model's length limit.
    Length,
    /// Aborted by the client or by the mesh.
    Abort,
    /// Failed inside the mesh (e.g. `kv_load_failure_policy = fail`).
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// Top alternatives for one sampled position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// Log-probability of the sampled token.
    pub logprob: f32,
    /// `(token_id, logprob)` of the most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// New tokens (and possibly the end) of one request, from one engine step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineOutput {
    pub request_id: String,
    pub new_token_ids: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_logprobs: Option<Vec<TokenLogprobs>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<FinishReason>,
    /// The stop token id that ended the request, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_id: Option<u32>,
    /// Params for the decode side, set on P's final output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
    /// Prompt tokens that were not computed locally (loaded from a remote KV cache).
    #[serde(default)]
    pub num_external_tokens: u32,
    /// Prompt tokens whose KV came from this engine's prefix cache (OpenAI's
    /// `usage.prompt_tokens_details.cached_tokens`).
    #[serde(default)]
    pub num_cached_tokens: u32,
    /// Human-readable detail when `finish_reason` is `Error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl EngineOutput {
    /// The output that ends request `request_id` with `error` and says why: what every process
    /// that fails a request (the engine, the dp-lb for a lost rank) sends.
    pub fn failed(request_id: impl Into<String>, message: impl Into<String>) -> Self {
        EngineOutput {
            request_id: request_id.into(),
            new_token_ids: vec![],
            new_logprobs: None,
            finish_reason: Some(FinishReason::Error),
            stop_token_id: None,
            kv_transfer_params: None,
            num_external_tokens: 0,
            num_cached_tokens: 0,
            error: Some(message.into()),
        }
    }
}

/// All outputs of one engine step of one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineOutputBatch {
    pub engine_rank: u32,
    pub outputs: Vec<EngineOutput>,
}

/// A rank's load, for the DP load balancer (vLLM scores a rank 4 × waiting + running), and
/// the requests that finished on it since the last report.
///
/// An engine sends one after a step only when something in it changed (D75): its outputs go
/// straight to the frontend, so this report is how the dp-lb learns which of its in-flight
/// requests are over, and a steady decode step sends the dp-lb nothing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineLoadReport {
    pub engine_rank: u32,
    pub num_waiting: u32,
    pub num_running: u32,
    pub kv: KvUsage,
    /// Requests whose finishing output this rank sent since its last report.
    #[serde(default)]
    pub finished_request_ids: Vec<String>,
}

/// Statistics of one engine rank, for `/debug/kv` and the tests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    pub engine_rank: u32,
    pub num_waiting: u32,
    pub num_running: u32,
    pub kv: KvUsage,
    #[serde(default)]
    pub held_requests: Vec<HeldRequest>,
    /// Engine steps run since start.
    #[serde(default)]
    pub steps: u64,
    /// Requests that reached a finished state since start.
    #[serde(default)]
    pub finished_requests: u64,
    /// Times `request_finished` was called on the connector (exactly once per request).
    #[serde(default)]
    pub request_finished_calls: u64,
    /// Aborts and outputs naming ids the engine does not track.
    #[serde(default)]
    pub unknown_ids: u64,
    #[serde(default)]
    pub preemptions: u64,
    /// What the rank holds in its prefix cache (D59); `None` with prefix caching off.
    #[serde(default)]
    pub prefix: Option<crate::PrefixSummary>,
}

/// The engine ranks behind one dp-lb, and how many of them are connected. A rank connects to
/// its dp-lb only once its connector-worker has loaded the model, so `ranks_up > 0` means the
/// node can serve.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReadiness {
    /// Configured data-parallel ranks (`dp_size`).
    pub ranks: u32,
    pub ranks_up: u32,
}

/// Statistics over every rank behind one dp-lb. A rank that did not answer is listed in
/// `unreachable_ranks`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MeshStats {
    pub engines: Vec<EngineStats>,
    #[serde(default)]
    pub unreachable_ranks: Vec<u32>,
}
