//! `llama`: RMSNorm, interleaved RoPE, SiLU-gated MLP, no biases (SmolLM2, Llama 2/3 without
//! RoPE scaling, Mistral-style files that say `llama`).

use super::{Activation, Architecture, HyperParams, ModelConfig, Recipe, RopeLayout};
use crate::error::ModelError;
use crate::gguf::GgufFile;

pub(crate) struct Llama;

impl Architecture for Llama {
    fn name(&self) -> &'static str {
        "llama"
    }

    fn config(&self, g: &GgufFile) -> Result<ModelConfig, ModelError> {
        let hp = HyperParams::read(g, "llama", 10_000.0)?;
        let recipe = Recipe {
            rope: RopeLayout::Interleaved,
            activation: Activation::Silu,
            qkv_bias: false,
            qk_norm: false,
            post_norms: false,
            embedding_scale: None,
            attention_scale: hp.default_attention_scale(),
            layers: hp.uniform_layers(),
        };
        hp.into_config(g, recipe)
    }
}
