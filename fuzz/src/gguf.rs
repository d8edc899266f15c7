//! Target `gguf`: any bytes as a model file, through what `pdmesh up` does with one before it
//! loads weights: the GGUF header parser, the architecture's hyper-parameters and recipe
//! (`pdmesh_model::read_config`), and the tokenizer and chat template rebuilt from the metadata
//! (`GgufTextCodec::load`).
//!
//! Must hold: every file is answered with a model or a `ModelError` naming what is wrong, never
//! a panic, an abort on a huge allocation, or a hang (absurd counts in the header are refused
//! before anything is sized from them).

use std::io::Write;

/// The target's harness: one scratch file, rewritten for each input (both loaders take a path).
#[derive(Debug)]
pub struct Harness {
    path: std::path::PathBuf,
}

impl Default for Harness {
    fn default() -> Self {
        let dir = std::env::temp_dir();
        Self { path: dir.join(format!("pdmesh-fuzz-gguf-{}.gguf", std::process::id())) }
    }
}

impl Harness {
    pub fn check(&mut self, data: &[u8]) {
        let written = std::fs::File::create(&self.path).and_then(|mut f| f.write_all(data));
        if written.is_err() {
            return;
        }
        let options = pdmesh_model::ModelOptions { max_model_len: Some(256), ..Default::default() };
        if let Ok(cfg) = pdmesh_model::read_config(&self.path) {
            // an accepted header describes a model the forward pass can be sized for
            assert!(cfg.n_layers > 0 && cfg.head_dim > 0 && cfg.n_kv_heads > 0, "{cfg:?}");
            assert_eq!(cfg.recipe.layers.len(), cfg.n_layers);
            let _ = cfg.kv_bytes_per_token();
        }
        let _ = pdmesh_model::GgufTextCodec::load(&self.path, &options);
    }
}

/// A GGUF v3 header in bytes: `kvs` as (key, type, value bytes), no tensors.
fn header(kvs: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes()); // tensors
    b.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for (k, ty, v) in kvs {
        b.extend_from_slice(&(k.len() as u64).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(v);
    }
    b
}

fn string(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

const U32: u32 = 4;
const F32: u32 = 6;
const STRING: u32 = 8;

/// Seeds: headers of each supported architecture (no tensors, so each stops at a missing
/// tensor), one with an unsupported architecture, one with absurd counts.
pub fn seeds() -> Vec<Vec<u8>> {
    let arch = |name: &str, blocks: u32| {
        header(&[
            ("general.architecture", STRING, string(name)),
            (&format!("{name}.block_count"), U32, blocks.to_le_bytes().to_vec()),
            (&format!("{name}.embedding_length"), U32, 64u32.to_le_bytes().to_vec()),
            (&format!("{name}.attention.head_count"), U32, 4u32.to_le_bytes().to_vec()),
            (&format!("{name}.attention.head_count_kv"), U32, 2u32.to_le_bytes().to_vec()),
            (&format!("{name}.attention.layer_norm_rms_epsilon"), F32, 1e-6f32.to_le_bytes().to_vec()),
            (&format!("{name}.context_length"), U32, 128u32.to_le_bytes().to_vec()),
            (&format!("{name}.attention.sliding_window"), U32, 32u32.to_le_bytes().to_vec()),
            ("tokenizer.ggml.model", STRING, string("gpt2")),
        ])
    };
    vec![arch("llama", 2), arch("qwen2", 2), arch("gemma3", 6), arch("bert", 2), arch("llama", u32::MAX)]
}
