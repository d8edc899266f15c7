//! A real model for pdmesh: GGUF files on the CPU (llama, qwen2 and gemma3 architectures).
//!
//! The mesh talks to models only through `pdmesh-model-api`; this crate provides the two
//! implementations that serve a GGUF file:
//!
//! - [`GgufExecutor`] ([`pdmesh_model_api::Executor`]): our own forward pass over the worker's
//!   paged [`pdmesh_model_api::KvCache`]. All tokens of a step go through each weight matmul
//!   together; attention is per request over its block table. See [`executor`].
//! - [`GgufTextCodec`] ([`pdmesh_model_api::TextCodec`]): tokenizer and chat template rebuilt
//!   from the GGUF metadata. See [`text`].
//!
//! Use [`load_gguf`] to get both from one file (the frontend needs only [`GgufTextCodec::load`],
//! the connector-worker only [`GgufExecutor::load`]).
//!
//! Module map:
//! - [`gguf`]: header parsing, typed metadata, the sha256 weights id.
//! - [`arch`]: one module per architecture (hyper-parameters and layer recipe:
//!   [`ModelConfig`]); adding an architecture is a module there.
//! - [`executor`]: the forward pass, written once over [`ModelConfig`], and [`GgufExecutor`].
//! - `linear`: weight matrices and the batched matmul dispatch.
//! - `embedding`: token embedding rows, dequantized on demand.
//! - `kernels`: AVX2 Q4_1/Q8_0 matmul kernels (bit-identical to candle's), scalar fallback.
//! - `kquants`: kernels for Q4_K/Q5_K/Q6_K/Q5_0/Q4_0 and F32/F16/BF16 weights.
//! - `pool`: the persistent worker threads the forward pass runs on.
//! - `attention`: causal attention over the paged KV cache, in a fixed arithmetic order.
//! - [`text`]: [`GgufTextCodec`] and its incremental detokenizer.
//! - [`tp`]: tensor parallelism: which slice a TP rank computes, and the shared-memory
//!   all-gather between a node's TP processes (D111).
//! - [`error`]: [`ModelError`], the load-time error type.
//!
//! Sampling lives in `pdmesh_model_api::sampling` (model-agnostic). `docs/MODEL.md` has the
//! design, the build target and measured speed.

pub mod arch;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod executor;
pub mod gguf;
#[doc(hidden)]
pub mod kernel_bench;
pub mod text;
pub mod tp;

mod attention;
mod embedding;
mod guided;
mod hugemem;
mod kernels;
mod kquants;
mod linear;
mod pool;
mod simd;

use std::path::Path;

pub use arch::ModelConfig;
pub use error::ModelError;
pub use executor::GgufExecutor;
pub use text::GgufTextCodec;

/// Options for loading a model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelOptions {
    /// Cap on the sequence length (prompt + output); `None` uses the model's context length
    /// (`llama.context_length`, 8192 for SmolLM2). A cap above the context length is ignored.
    pub max_model_len: Option<u32>,
    /// Threads of the forward pass; `None`: [`pool::default_threads`].
    pub threads: Option<usize>,
    /// Niceness the forward pass's threads run at (the executor's calling thread from its first
    /// pass); 0 leaves them at the process's priority (D71).
    pub nice: i32,
}

/// Load the executor and the text codec of the GGUF file at `path`, parsing the header
/// once.
pub fn load_gguf(path: impl AsRef<Path>, options: &ModelOptions) -> Result<(GgufExecutor, GgufTextCodec), ModelError> {
    let path = path.as_ref();
    let mut g = gguf::GgufFile::open(path)?;
    arch::model_config(&g)?;
    let codec = GgufTextCodec::from_gguf(&g, options)?;
    let weights_id = gguf::sha256_file(path)?;
    let executor = GgufExecutor::from_gguf(&mut g, options, weights_id, codec.eos_token_ids().to_vec())?;
    Ok((executor, codec))
}

/// The architecture, hyper-parameters and layer recipe of the GGUF file at `path`, from its
/// header alone (no weights are read): what the KV cache's geometry and a memory budget's block
/// count are computed from before the model loads.
pub fn read_config(path: impl AsRef<Path>) -> Result<ModelConfig, ModelError> {
    let g = gguf::GgufFile::open(path.as_ref())?;
    arch::model_config(&g)
}

/// Where the default model lives: `$PDMESH_MODEL_PATH`, else
/// `$PDMESH_MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf`, else
/// `$HOME/.cache/pdmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf` (where `scripts/fetch-model.sh`
/// puts it).
pub fn default_model_path() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("PDMESH_MODEL_PATH") {
        return p.into();
    }
    let dir = std::env::var_os("PDMESH_MODEL_DIR").map(std::path::PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(std::path::PathBuf::from).unwrap_or_default();
        home.join(".cache").join("pdmesh").join("models")
    });
    dir.join(DEFAULT_MODEL_FILE)
}

/// File name of the default model (SmolLM2-135M-Instruct, Q4_1).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
