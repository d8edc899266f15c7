//! `llama`: RMSNorm, interleaved RoPE, SiLU-gated MLP, no biases (SmolLM2, Llama 2/3 without
//! RoPE scaling, Mistral-style files that say `llama`).

use super::{Architecture, HyperParams, ModelConfig};
use crate::error::ModelError;
use crate::gguf::GgufFile;

pub(crate) struct Llama;

impl Architecture for Llama {
    fn name(&self) -> &'static str {
        "llama"
    }

    fn config(&self, g: &GgufFile) -> Result<ModelConfig, ModelError> {
        let hp = HyperParams::read(g, "llama", 10_000.0)?;
        let recipe = hp.llama_recipe();
        hp.into_config(g, recipe)
    }
}
