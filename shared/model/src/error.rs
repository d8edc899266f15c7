//! Load-time errors of the model crate.
//!
//! Step-time failures use [`pdmesh_model_api::ExecutorError`] and text failures
//! [`pdmesh_model_api::TextError`]; this type covers everything that can go wrong while
//! opening a GGUF file and building the executor or the text codec from it.

use std::path::PathBuf;

use thiserror::Error;

/// Why a model could not be loaded.
#[derive(Debug, Error)]
pub enum ModelError {
    /// The path does not exist (run `scripts/fetch-model.sh` to get the default model).
    #[error("model file not found: {} (run scripts/fetch-model.sh to fetch the default model)", path.display())]
    NotFound { path: PathBuf },
    /// The file exists but could not be read.
    #[error("cannot read model file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a GGUF file, or its header / tensor table is corrupt.
    #[error("{} is not a valid GGUF file: {reason}", path.display())]
    InvalidGguf { path: PathBuf, reason: String },
    /// `general.architecture` names an architecture we do not serve.
    #[error("unsupported model architecture {arch:?} (supported: {supported})")]
    UnsupportedArchitecture { arch: String, supported: String },
    /// The architecture is supported, but the file uses a part of it we do not implement
    /// (RoPE scaling, mixture of experts, ...).
    #[error("unsupported model feature: {feature}")]
    UnsupportedFeature { feature: String },
    /// A required metadata key is absent.
    #[error("GGUF metadata key {key:?} is missing")]
    MissingMetadata { key: String },
    /// A metadata key has the wrong type or an unusable value.
    #[error("GGUF metadata key {key:?} is invalid: {reason}")]
    InvalidMetadata { key: String, reason: String },
    /// A weight tensor the architecture needs is absent.
    #[error("tensor {name:?} is missing from the GGUF file")]
    MissingTensor { name: String },
    /// A tensor is present but has the wrong shape, or cannot be read.
    #[error("tensor {name:?} is invalid: {reason}")]
    InvalidTensor { name: String, reason: String },
    /// A tensor's GGML type has no kernel here (Q2_K, Q3_K, the IQ types, Q8_1, ...): refused at
    /// load rather than computed slowly or wrongly.
    #[error("tensor {name:?} has GGML type {dtype}, which this build cannot compute with (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)")]
    UnsupportedTensorType { name: String, dtype: String },
    /// The GPU executor (feature `cuda`) could not start: no driver, no GPU, or a kernel that
    /// did not compile or load.
    #[error("cuda: {0}")]
    Cuda(String),
    /// The tokenizer described by the metadata is not one we can build.
    #[error("unsupported tokenizer: {0}")]
    UnsupportedTokenizer(String),
    /// Building the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template does not compile.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The model cannot be split over the node's `tensor_parallel_size` (a count of heads or
    /// units that is not a multiple of it), or its TP group could not be joined.
    #[error("tensor parallelism: {0}")]
    TensorParallel(String),
}
