//! `qwen2` (Qwen2, Qwen2.5): llama's layers with biases on Q, K and V, and NeoX RoPE (its base
//! 1e6 comes from `qwen2.rope.freq_base`).

use super::{Activation, Architecture, HyperParams, ModelConfig, Recipe, RopeLayout};
use crate::error::ModelError;
use crate::gguf::GgufFile;

pub(crate) struct Qwen2;

impl Architecture for Qwen2 {
    fn name(&self) -> &'static str {
        "qwen2"
    }

    fn config(&self, g: &GgufFile) -> Result<ModelConfig, ModelError> {
        let hp = HyperParams::read(g, "qwen2", 1_000_000.0)?;
        let recipe = Recipe {
            rope: RopeLayout::Neox,
            activation: Activation::Silu,
            qkv_bias: true,
            qk_norm: false,
            post_norms: false,
            embedding_scale: None,
            attention_scale: hp.default_attention_scale(),
            layers: hp.uniform_layers(),
        };
        hp.into_config(g, recipe)
    }
}
