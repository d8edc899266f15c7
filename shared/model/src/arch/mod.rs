//! Model architectures: one module per `general.architecture`, behind one seam.
//!
//! An architecture says three things about a GGUF file, and nothing else:
//! - its **hyper-parameters**, read from the `<arch>.*` metadata keys and cross-checked against
//!   tensor shapes ([`HyperParams::read`] does the keys every llama.cpp architecture shares);
//! - its **layer recipe** ([`Recipe`]): which optional tensors exist (QKV biases, per-head Q/K
//!   norms, the norms after attention and after the MLP), the RoPE layout, the MLP's activation,
//!   the embedding scale, the attention scale, and which layers attend over a sliding window
//!   with which RoPE base;
//! - its **name**, for messages.
//!
//! The forward pass (`crate::executor`) is written once over [`ModelConfig`]; it never asks
//! which architecture it runs. Adding an architecture whose layers are made of these pieces
//! (Mistral, Phi-3, Llama 3 without RoPE scaling, ...) is one module here plus its line in
//! [`ARCHITECTURES`]; a piece the recipe does not have yet (a new norm, a new activation) is one
//! new field, with its default being "absent" for every existing architecture.
//!
//! Tensor names are llama.cpp's (`blk.N.attn_q.weight`, ...), which every GGUF writer shares.

mod gemma3;
mod llama;
mod qwen2;

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

use crate::error::ModelError;
use crate::gguf::{md_f32, md_str, md_u32, md_u32_opt, GgufFile};

/// How a head's dimensions are paired for rotary position embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(2i, 2i + 1)`: what llama.cpp's converter permutes llama's Q/K weights into
    /// (`LLAMA_ROPE_TYPE_NORM`; candle's `rope_i`).
    Interleaved,
    /// Pairs `(i, i + d/2)`: GPT-NeoX's layout, kept by Qwen2 and Gemma (`LLAMA_ROPE_TYPE_NEOX`;
    /// candle's `rope`).
    Neox,
}

/// The MLP's gate activation: `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x / (1 + e^-x)` (llama, qwen2).
    Silu,
    /// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// What one layer's attention looks like (Gemma 3 alternates two kinds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerAttention {
    /// Attend only over the last `window` positions (the query's own included); `None`: all.
    pub sliding_window: Option<usize>,
    /// The RoPE base (`theta`) of this layer.
    pub rope_base: f32,
}

/// The layer recipe: which pieces a layer has, beyond llama's.
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    pub rope: RopeLayout,
    pub activation: Activation,
    /// `blk.N.attn_{q,k,v}.bias` are added to the projections (Qwen2).
    pub qkv_bias: bool,
    /// `blk.N.attn_{q,k}_norm.weight`: RMSNorm over each head's Q and K before RoPE (Gemma 3).
    pub qk_norm: bool,
    /// `blk.N.post_attention_norm.weight` and `blk.N.post_ffw_norm.weight`: RMSNorm on the
    /// attention and MLP outputs before each residual add (Gemma 2/3's "sandwich" norms).
    pub post_norms: bool,
    /// The embeddings are multiplied by this before the first layer (Gemma: `sqrt(hidden)`).
    pub embedding_scale: Option<f32>,
    /// `q·k` is multiplied by this (usually `1/sqrt(head_dim)`).
    pub attention_scale: f32,
    /// One entry per layer.
    pub layers: Vec<LayerAttention>,
}

/// Everything the forward pass needs to know of a model: hyper-parameters and recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture`.
    pub arch: String,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Dimension of each attention head (`<arch>.attention.key_length`, else `hidden / n_heads`).
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub rms_eps: f32,
    /// `<arch>.context_length`: the longest sequence the model was trained for.
    pub context_length: u32,
    pub recipe: Recipe,
}

impl ModelConfig {
    /// Width of all query heads together (`n_heads * head_dim`; Gemma 3's is not `hidden`).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of all K (or V) heads together.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Bytes of K and V one token takes in the KV cache, all layers together (the cache holds
    /// f32).
    pub fn kv_bytes_per_token(&self) -> u64 {
        (self.n_layers * self.kv_dim() * 2 * std::mem::size_of::<f32>()) as u64
    }

    /// Whether the model is the plain llama recipe, the only one the CUDA executor runs.
    pub fn is_plain_llama(&self) -> bool {
        let r = &self.recipe;
        r.rope == RopeLayout::Interleaved
            && r.activation == Activation::Silu
            && !r.qkv_bias
            && !r.qk_norm
            && !r.post_norms
            && r.embedding_scale.is_none()
            && r.layers.iter().all(|l| l.sliding_window.is_none())
    }
}

/// One supported `general.architecture`.
pub(crate) trait Architecture: Sync {
    /// The `general.architecture` value this module reads.
    fn name(&self) -> &'static str;
    /// Hyper-parameters and recipe of `g`, whose architecture is [`Architecture::name`].
    fn config(&self, g: &GgufFile) -> Result<ModelConfig, ModelError>;
}

/// Every architecture pdmesh serves. One line per architecture.
static ARCHITECTURES: &[&dyn Architecture] = &[&llama::Llama, &qwen2::Qwen2, &gemma3::Gemma3];

/// The names of the supported architectures, for messages and docs.
pub fn supported() -> Vec<&'static str> {
    ARCHITECTURES.iter().map(|a| a.name()).collect()
}

/// `general.architecture` of the file, checked against the supported ones.
pub(crate) fn architecture_of(md: &HashMap<String, Value>) -> Result<&'static dyn Architecture, ModelError> {
    let arch = md_str(md, "general.architecture")?;
    ARCHITECTURES.iter().copied().find(|a| a.name() == arch).ok_or_else(|| ModelError::UnsupportedArchitecture {
        arch: arch.to_string(),
        supported: supported().join(", "),
    })
}

/// The model's configuration: its architecture's hyper-parameters and recipe.
pub(crate) fn model_config(g: &GgufFile) -> Result<ModelConfig, ModelError> {
    let cfg = architecture_of(g.metadata())?.config(g)?;
    cfg.check()?;
    Ok(cfg)
}

fn invalid(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidMetadata { key: key.to_string(), reason: reason.into() }
}

/// The largest values any key may take: a header with absurd counts is refused before anything
/// is sized from it (no allocation of `n_layers` layers or `context_length` rope rows first).
const MAX_LAYERS: usize = 1024;
const MAX_WIDTH: usize = 1 << 18;
const MAX_HEADS: usize = 4096;
const MAX_CONTEXT: u32 = 1 << 24;

/// The keys every llama.cpp architecture shares, read under its prefix.
#[derive(Debug, Clone)]
pub(crate) struct HyperParams {
    pub prefix: &'static str,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub context_length: u32,
}

impl HyperParams {
    pub fn read(g: &GgufFile, prefix: &'static str, default_rope_base: f32) -> Result<Self, ModelError> {
        let md = g.metadata();
        let key = |k: &str| format!("{prefix}.{k}");
        let n_layers = md_u32(md, &key("block_count"))? as usize;
        let hidden = md_u32(md, &key("embedding_length"))? as usize;
        let n_heads = md_u32(md, &key("attention.head_count"))? as usize;
        let n_kv_heads = md_u32_opt(md, &key("attention.head_count_kv"))?.map_or(n_heads, |v| v as usize);
        let rms_eps = md_f32(md, &key("attention.layer_norm_rms_epsilon"))?;
        let rope_base = if md.contains_key(&key("rope.freq_base")) {
            md_f32(md, &key("rope.freq_base"))?
        } else {
            default_rope_base
        };
        let context_length = md_u32(md, &key("context_length"))?;
        if n_layers == 0 || hidden == 0 || n_heads == 0 || n_kv_heads == 0 {
            return Err(invalid(&key("*"), "block_count, embedding_length and head counts must be positive"));
        }
        if n_layers > MAX_LAYERS || hidden > MAX_WIDTH || n_heads > MAX_HEADS || context_length > MAX_CONTEXT {
            return Err(invalid(
                &key("*"),
                format!(
                    "implausible sizes (block_count {n_layers}, embedding_length {hidden}, head_count {n_heads}, \
                     context_length {context_length})"
                ),
            ));
        }
        let head_dim = match md_u32_opt(md, &key("attention.key_length"))? {
            Some(k) => k as usize,
            None if hidden.is_multiple_of(n_heads) => hidden / n_heads,
            None => return Err(invalid(&key("attention.head_count"), format!("{n_heads} does not divide {hidden}"))),
        };
        if let Some(v) = md_u32_opt(md, &key("attention.value_length"))? {
            if v as usize != head_dim {
                return Err(invalid(
                    &key("attention.value_length"),
                    format!("{v} != key_length {head_dim} (different K and V head sizes are not supported)"),
                ));
            }
        }
        if head_dim == 0 || head_dim > MAX_WIDTH || !head_dim.is_multiple_of(2) {
            return Err(invalid(&key("attention.key_length"), format!("unusable head dimension {head_dim}")));
        }
        if !n_heads.is_multiple_of(n_kv_heads) {
            return Err(invalid(&key("attention.head_count_kv"), format!("{n_kv_heads} does not divide {n_heads}")));
        }
        if let Some(rope_dim) = md_u32_opt(md, &key("rope.dimension_count"))? {
            if rope_dim as usize != head_dim {
                return Err(invalid(
                    &key("rope.dimension_count"),
                    format!("{rope_dim} != head_dim {head_dim} (partial RoPE is not supported)"),
                ));
            }
        }
        if md_u32_opt(md, &key("expert_count"))?.unwrap_or(0) > 1 {
            return Err(ModelError::UnsupportedFeature {
                feature: format!("{prefix} mixture of experts ({})", key("expert_count")),
            });
        }
        if let Ok(kind) = md_str(md, &key("rope.scaling.type")) {
            let factor = md_f32(md, &key("rope.scaling.factor")).unwrap_or(1.0);
            if kind != "none" && factor != 1.0 {
                return Err(ModelError::UnsupportedFeature {
                    feature: format!("RoPE scaling {kind:?} (factor {factor}) in {}", key("rope.scaling.type")),
                });
            }
        }
        if g.has_tensor("rope_freqs.weight") {
            return Err(ModelError::UnsupportedFeature {
                feature: "per-dimension RoPE frequencies (rope_freqs.weight, llama-3.1-style RoPE scaling)".into(),
            });
        }
        Ok(Self { prefix, n_layers, hidden, n_heads, n_kv_heads, head_dim, rms_eps, rope_base, context_length })
    }

    /// Vocabulary size and MLP width from the tensor shapes, then the whole config.
    pub fn into_config(self, g: &GgufFile, recipe: Recipe) -> Result<ModelConfig, ModelError> {
        let hidden = self.hidden;
        let vocab_size = match g.tensor_dims("token_embd.weight")?.as_slice() {
            [v, h] if *h == hidden => *v,
            other => {
                return Err(ModelError::InvalidTensor {
                    name: "token_embd.weight".into(),
                    reason: format!("shape {other:?}, expected [vocab, {hidden}]"),
                })
            }
        };
        let ffn_dim = match g.tensor_dims("blk.0.ffn_gate.weight")?.as_slice() {
            [f, h] if *h == hidden => *f,
            other => {
                return Err(ModelError::InvalidTensor {
                    name: "blk.0.ffn_gate.weight".into(),
                    reason: format!("shape {other:?}, expected [ffn, {hidden}]"),
                })
            }
        };
        Ok(ModelConfig {
            arch: self.prefix.to_string(),
            n_layers: self.n_layers,
            hidden,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            ffn_dim,
            vocab_size,
            rms_eps: self.rms_eps,
            context_length: self.context_length,
            recipe,
        })
    }

    /// `1/sqrt(head_dim)`, computed as candle does (`f64`, cast to `f32`).
    pub fn default_attention_scale(&self) -> f32 {
        (1.0 / (self.head_dim as f64).sqrt()) as f32
    }

    /// llama's recipe for these hyper-parameters: interleaved RoPE, SiLU, no optional piece,
    /// every layer global. Other architectures start from it and say what differs.
    pub fn llama_recipe(&self) -> Recipe {
        Recipe {
            rope: RopeLayout::Interleaved,
            activation: Activation::Silu,
            qkv_bias: false,
            qk_norm: false,
            post_norms: false,
            embedding_scale: None,
            attention_scale: self.default_attention_scale(),
            layers: self.uniform_layers(),
        }
    }

    /// Every layer global, at the model's RoPE base.
    pub fn uniform_layers(&self) -> Vec<LayerAttention> {
        vec![LayerAttention { sliding_window: None, rope_base: self.rope_base }; self.n_layers]
    }
}

impl ModelConfig {
    /// Invariants the forward pass relies on.
    fn check(&self) -> Result<(), ModelError> {
        let arch = &self.arch;
        if self.recipe.layers.len() != self.n_layers {
            return Err(invalid(
                &format!("{arch}.block_count"),
                format!("{} layers, but the recipe describes {}", self.n_layers, self.recipe.layers.len()),
            ));
        }
        if self.vocab_size == 0 || self.ffn_dim == 0 {
            return Err(invalid(&format!("{arch}.*"), "empty vocabulary or MLP"));
        }
        for l in &self.recipe.layers {
            if l.sliding_window == Some(0) || !(l.rope_base.is_finite() && l.rope_base > 0.0) {
                return Err(invalid(&format!("{arch}.*"), format!("unusable layer attention {l:?}")));
            }
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err(invalid(&format!("{arch}.attention.layer_norm_rms_epsilon"), format!("{}", self.rms_eps)));
        }
        Ok(())
    }
}
