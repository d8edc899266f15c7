//! `qwen2` (Qwen2, Qwen2.5): llama's layers with biases on Q, K and V, and NeoX RoPE (its base
//! 1e6 comes from `qwen2.rope.freq_base`).

use super::{Architecture, HyperParams, ModelConfig, Recipe, RopeLayout};
use crate::error::ModelError;
use crate::gguf::GgufFile;

pub(crate) struct Qwen2;

impl Architecture for Qwen2 {
    fn name(&self) -> &'static str {
        "qwen2"
    }

    fn config(&self, g: &GgufFile) -> Result<ModelConfig, ModelError> {
        let hp = HyperParams::read(g, "qwen2", 1_000_000.0)?;
        let recipe = Recipe { rope: RopeLayout::Neox, qkv_bias: true, ..hp.llama_recipe() };
        hp.into_config(g, recipe)
    }
}
