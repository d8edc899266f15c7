//! One engine step, between engine-core and connector-worker.
//!
//! The schedule is self-contained: every scheduled request carries the token ids to compute,
//! its position and its whole block table. The worker therefore keeps no per-request state
//! across steps, which keeps a worker restart from corrupting anything (the engine simply sees
//! the step fail) and costs a few hundred bytes per request per step.

use serde::{Deserialize, Serialize};

use crate::connector::{KvConnectorMetadata, KvConnectorOutput};
use crate::engine::{SamplingHistory, SamplingParams, TokenLogprobs};

/// The tokens of one request to run in this step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduledChunk {
    pub request_id: String,
    /// Token ids to compute now: a prefill chunk, or the one last sampled token for decode.
    pub token_ids: Vec<u32>,
    /// Position of `token_ids[0]` in the sequence (= tokens already in the KV cache).
    pub start_pos: u32,
    /// The request's KV blocks, in sequence order, covering at least `start_pos + len`.
    pub block_ids: Vec<u32>,
    /// Sample a token after this chunk (false for a prefill chunk that is not the last).
    pub sample: bool,
    pub sampling: SamplingParams,
    /// Number of tokens generated so far; with a seed, the sampler derives its randomness from
    /// `(seed, output_index)` so a request samples the same way wherever it runs.
    #[serde(default)]
    pub output_index: u32,
    /// Every token generated so far, sent only for a request with `sampling.guided`: the
    /// worker's grammar matcher must have consumed exactly these before it masks the next
    /// token. Carrying them keeps the step self-contained (a restarted worker, D after P's
    /// first token, a recompute after preemption all rebuild the matcher from them; D53).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guided_output: Vec<u32>,
    /// The request's token history for penalties, `min_tokens` and `bad_words`: sent only on
    /// a sampling chunk of a request that uses them ([`SamplingParams::needs_history`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<SamplingHistory>,
}

/// What engine-core asks connector-worker to do in one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerOutput {
    pub step_id: u64,
    pub chunks: Vec<ScheduledChunk>,
    /// Requests finished since the last step (the worker drops any per-request state).
    #[serde(default)]
    pub finished_request_ids: Vec<String>,
    /// Connector metadata built by connector-scheduler for this step.
    #[serde(default)]
    pub kv_connector_metadata: KvConnectorMetadata,
    /// The worker incarnation ([`WorkerInfo::incarnation`]) whose KV this step's block tables
    /// describe. A restarted worker lost that KV: it refuses a step naming its predecessor
    /// instead of running it over blocks it never wrote (the engine learns of the restart from
    /// its `WorkerInfo` only after its link came back, and a step can be on its way by then).
    /// `None`: not checked (tools and tests that drive a worker without an engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_incarnation: Option<String>,
}

impl SchedulerOutput {
    /// Every request this step concerns: scheduled chunks, holds to register, reads to start.
    pub fn request_ids(&self) -> impl Iterator<Item = &str> {
        let meta = &self.kv_connector_metadata;
        self.chunks
            .iter()
            .map(|c| c.request_id.as_str())
            .chain(meta.reqs_to_send.iter().map(|r| r.request_id.as_str()))
            .chain(meta.reqs_to_recv.iter().map(|r| r.request_id.as_str()))
    }
}

/// A token sampled for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampledToken {
    pub request_id: String,
    pub token_id: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<TokenLogprobs>,
}

/// The result of one step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRunnerOutput {
    pub step_id: u64,
    pub sampled: Vec<SampledToken>,
    #[serde(default)]
    pub kv_connector_output: KvConnectorOutput,
    /// Microseconds the executor spent in the forward pass (for metrics and benchmarks).
    #[serde(default)]
    pub execute_us: u64,
    /// The forward pass failed: every request scheduled in the step fails with this error,
    /// and `sampled` is empty. The connector output is still the step's and must be applied:
    /// holds that ended and loads that settled are facts whether or not the model ran, and
    /// dropping them would strand P's blocks and leave D's requests waiting for ever.
    #[serde(default)]
    pub failure: Option<crate::WireError>,
}

/// Geometry of a worker's KV cache and facts about its model, read by engine-core at start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub model_name: String,
    pub num_blocks: u32,
    pub block_size: u32,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub max_model_len: u32,
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    /// Bytes of KV cache per block over all layers (K and V).
    pub bytes_per_block: u64,
    /// Unique per worker process start. An engine that reconnects to a worker with another
    /// incarnation knows the KV it had there is gone (held blocks, in-flight reads).
    #[serde(default)]
    pub incarnation: String,
}
