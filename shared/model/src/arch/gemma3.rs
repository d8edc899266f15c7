//! `gemma3` (Gemma 3 text models): RMSNorm'd Q and K heads, norms after attention and after the
//! MLP as well as before, a GELU(tanh)-gated MLP, embeddings scaled by `sqrt(hidden)`, NeoX RoPE,
//! and layers that alternate between a sliding window (RoPE base 10 000) and global attention
//! (the file's `rope.freq_base`): every `sliding_window_type`-th layer (6 unless the file says
//! otherwise) is global, as in llama.cpp and Hugging Face's `Gemma3TextConfig`.
//!
//! The norm weights in a GGUF already hold Gemma's `1 + w` (llama.cpp's converter adds the 1),
//! so the norms are plain RMSNorms here. The attention scale is `1/sqrt(key_length)`
//! (`query_pre_attn_scalar` equals the head size in every Gemma 3 text model but the 27B, which
//! uses `1/sqrt(hidden / heads)`).

use super::{Activation, Architecture, HyperParams, LayerAttention, ModelConfig, Recipe, RopeLayout};
use crate::error::ModelError;
use crate::gguf::{md_f32, md_u32, md_u32_opt, GgufFile};

pub(crate) struct Gemma3;

/// Layers `(i + 1) % N != 0` use the sliding window (Gemma 3's 5 local : 1 global).
const DEFAULT_SLIDING_WINDOW_PATTERN: usize = 6;
/// RoPE base of the sliding-window layers (fixed by the architecture, not in the file).
const LOCAL_ROPE_BASE: f32 = 10_000.0;
/// Gemma 3 27B, whose `query_pre_attn_scalar` is `hidden / heads`, not the head size.
const GEMMA3_27B_LAYERS: usize = 62;

impl Architecture for Gemma3 {
    fn name(&self) -> &'static str {
        "gemma3"
    }

    fn config(&self, g: &GgufFile) -> Result<ModelConfig, ModelError> {
        let md = g.metadata();
        let hp = HyperParams::read(g, "gemma3", 1_000_000.0)?;
        let window = md_u32(md, "gemma3.attention.sliding_window")? as usize;
        let pattern = md_u32_opt(md, "gemma3.attention.sliding_window_type")?
            .map_or(DEFAULT_SLIDING_WINDOW_PATTERN, |v| v as usize)
            .max(1);
        let local_base = md_f32(md, "gemma3.rope.local_freq_base").unwrap_or(LOCAL_ROPE_BASE);
        if md.contains_key("gemma3.attn_logit_softcapping") || md.contains_key("gemma3.final_logit_softcapping") {
            return Err(ModelError::UnsupportedFeature { feature: "gemma3 logit soft-capping".into() });
        }
        // Gemma 3 27B (62 layers) scales by `1/sqrt(hidden / heads)`; llama.cpp tells it by its
        // layer count the same way.
        let attention_scale = if hp.n_layers == GEMMA3_27B_LAYERS {
            (1.0 / ((hp.hidden / hp.n_heads) as f64).sqrt()) as f32
        } else {
            hp.default_attention_scale()
        };
        let layers = (0..hp.n_layers)
            .map(|i| {
                if (i + 1) % pattern != 0 {
                    LayerAttention { sliding_window: Some(window), rope_base: local_base }
                } else {
                    LayerAttention { sliding_window: None, rope_base: hp.rope_base }
                }
            })
            .collect();
        let recipe = Recipe {
            rope: RopeLayout::Neox,
            activation: Activation::GeluTanh,
            qkv_bias: false,
            qk_norm: true,
            post_norms: true,
            embedding_scale: Some((hp.hidden as f64).sqrt() as f32),
            attention_scale,
            layers,
        };
        hp.into_config(g, recipe)
    }
}
