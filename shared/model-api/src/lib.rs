//! The seam between the mesh and a model.
//!
//! Services never name a concrete model: the connector-worker runs an [`Executor`] over a
//! [`KvCache`] it owns, and the frontend turns text into tokens and back through a
//! [`TextCodec`]. Two implementations exist: `pdmesh-synthetic-executor` (deterministic tokens at
//! a configurable cost, for tests and load tests) and `pdmesh-model` (a llama-architecture GGUF
//! model with candle, for real serving).

pub mod kv_cache;
pub mod sampling;
pub mod text;

pub use kv_cache::{KvCache, KvCacheSpec};
pub use text::{ChatMessage, DecodeStream, TextCodec, TextError};

use pdmesh_protocol::{SampledToken, ScheduledChunk};
use thiserror::Error;

/// Facts about the model an executor runs, needed to size the KV cache and to validate input.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFacts {
    /// Name served as `model` in the OpenAI API.
    pub name: String,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub vocab_size: u32,
    /// The longest sequence (prompt + output) the model supports.
    pub max_model_len: u32,
    pub eos_token_ids: Vec<u32>,
    /// Identity of the weights (e.g. sha256 of the file), part of the KV compatibility hash.
    pub weights_id: String,
}

/// Why a step could not run. The worker reports it to engine-core, which fails the step's
/// requests with a clear error. Only [`ExecutorError::DeviceLost`] ends the worker process.
#[derive(Debug, Error)]
pub enum ExecutorError {
    #[error("block {block} is outside the KV cache ({num_blocks} blocks)")]
    BlockOutOfRange { block: u32, num_blocks: u32 },
    #[error("request {request_id}: block table too short for position {pos}")]
    BlockTableTooShort { request_id: String, pos: u32 },
    #[error("token id {token} is outside the vocabulary ({vocab} tokens)")]
    TokenOutOfRange { token: u32, vocab: u32 },
    #[error("model failure: {0}")]
    Model(String),
    /// The accelerator is unusable for the rest of this process: a CUDA "sticky" error (an
    /// illegal address, a kernel that faulted, an uncorrectable ECC error) poisons the context,
    /// and every later call fails. The worker fails the step, gives back what it holds and
    /// exits, so that its supervisor starts a fresh process on a fresh context.
    #[error("accelerator lost: {0}")]
    DeviceLost(String),
}

impl ExecutorError {
    /// Whether no later step of this process can succeed.
    pub fn is_device_lost(&self) -> bool {
        matches!(self, Self::DeviceLost(_))
    }
}

/// Runs the model for one engine step.
///
/// `execute` computes K/V for every token of every chunk into the chunk's blocks of `kv`
/// (position `start_pos + i` lives in block `block_ids[(start_pos + i) / block_size]`, slot
/// `(start_pos + i) % block_size`), attends over the request's blocks, and samples one token
/// for every chunk with `sample == true`. All chunks of a step run together (one batched
/// matmul per weight), so batching never changes a greedy result.
pub trait Executor: Send {
    fn facts(&self) -> &ModelFacts;
    fn execute(&mut self, kv: &mut KvCache, chunks: &[ScheduledChunk]) -> Result<Vec<SampledToken>, ExecutorError>;

    /// These requests ended: drop any per-request cache (the grammar matchers of structured
    /// outputs, D53). Only a cache: a step never depends on it being there.
    fn release(&mut self, _request_ids: &[String]) {}
}
