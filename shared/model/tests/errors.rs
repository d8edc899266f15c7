//! Bad files and bad steps give typed errors, never panics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test/bench code: fail loudly

mod common;

use std::io::Write;

use pdmesh_model::{GgufExecutor, GgufTextCodec, ModelError, ModelOptions};
use pdmesh_model_api::{Executor, ExecutorError};
use pdmesh_protocol::ScheduledChunk;

fn temp_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("pdmesh-model-test-{}-{name}", std::process::id()));
    std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
    p
}

#[test]
fn missing_file_is_not_found() {
    let p = std::path::Path::new("/nonexistent/dir/model.gguf");
    let e = GgufExecutor::load(p, &ModelOptions::default()).unwrap_err();
    assert!(matches!(e, ModelError::NotFound { .. }), "{e:?}");
    assert!(e.to_string().contains("fetch-model.sh"));
    let e = GgufTextCodec::load(p, &ModelOptions::default()).unwrap_err();
    assert!(matches!(e, ModelError::NotFound { .. }), "{e:?}");
    assert!(matches!(pdmesh_model::load_gguf(p, &ModelOptions::default()), Err(ModelError::NotFound { .. })));
}

#[test]
fn random_bytes_are_not_gguf() {
    // deterministic pseudo-random bytes
    let mut x = 0x1234_5678_u32;
    let bytes: Vec<u8> = (0..100_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    let p = temp_file("random.gguf", &bytes);
    let e = pdmesh_model::load_gguf(&p, &ModelOptions::default()).unwrap_err();
    assert!(matches!(e, ModelError::InvalidGguf { .. }), "{e:?}");
    // a GGUF magic followed by garbage is still rejected cleanly
    let mut b = b"GGUF\x03\x00\x00\x00".to_vec();
    b.extend_from_slice(&bytes);
    let p2 = temp_file("magic.gguf", &b);
    let e = pdmesh_model::load_gguf(&p2, &ModelOptions::default()).unwrap_err();
    assert!(matches!(e, ModelError::InvalidGguf { .. }), "{e:?}");
    let _ = std::fs::remove_file(p);
    let _ = std::fs::remove_file(p2);
}

#[test]
fn truncated_model_is_an_error() {
    let Some(path) = common::model_path() else { return };
    let bytes = std::fs::read(&path).unwrap();
    let p = temp_file("truncated.gguf", &bytes[..bytes.len() / 2]);
    let e = pdmesh_model::load_gguf(&p, &ModelOptions::default()).unwrap_err();
    assert!(matches!(e, ModelError::InvalidTensor { .. } | ModelError::InvalidGguf { .. }), "{e:?}");
    let _ = std::fs::remove_file(p);
}

#[test]
fn bad_steps_are_errors() {
    let Some((mut exec, _codec)) = common::load() else { return };
    let mut kv = common::kv_cache(&exec, 4, 16);
    let chunk = |tokens: Vec<u32>, start: u32, blocks: Vec<u32>| ScheduledChunk {
        request_id: "r".into(),
        token_ids: tokens,
        start_pos: start,
        block_ids: blocks,
        sample: true,
        sampling: common::greedy(),
        output_index: 0,
        guided_output: Vec::new(),
        history: None,
    };
    let e = exec.execute(&mut kv, &[chunk(vec![1, 2, 3], 0, vec![9])]).unwrap_err();
    assert!(matches!(e, ExecutorError::BlockOutOfRange { block: 9, .. }), "{e:?}");
    let e = exec.execute(&mut kv, &[chunk(vec![1, 2, 3], 15, vec![0])]).unwrap_err();
    assert!(matches!(e, ExecutorError::BlockTableTooShort { pos: 17, .. }), "{e:?}");
    let e = exec.execute(&mut kv, &[chunk(vec![1, 49152], 0, vec![0])]).unwrap_err();
    assert!(matches!(e, ExecutorError::TokenOutOfRange { token: 49152, .. }), "{e:?}");
    let e = exec.execute(&mut kv, &[chunk(vec![], 0, vec![0])]).unwrap_err();
    assert!(matches!(e, ExecutorError::Model(_)), "{e:?}");
    let e = exec.execute(&mut kv, &[chunk(vec![1], 1 << 20, vec![0])]).unwrap_err();
    assert!(matches!(e, ExecutorError::Model(_)), "{e:?}");
    // a cache of the wrong geometry
    let mut wrong = pdmesh_model_api::KvCache::new_heap(pdmesh_model_api::KvCacheSpec {
        num_layers: 2,
        num_blocks: 4,
        block_size: 16,
        num_kv_heads: 3,
        head_dim: 64,
    });
    assert!(exec.execute(&mut wrong, &[chunk(vec![1], 0, vec![0])]).is_err());
    // nothing to do is fine
    assert!(exec.execute(&mut kv, &[]).unwrap().is_empty());
    // and the executor still works after all that
    let ok = exec.execute(&mut kv, &[chunk(vec![1, 2, 3], 0, vec![0])]).unwrap();
    assert_eq!(ok.len(), 1);
}

#[test]
fn facts_describe_the_model() {
    let Some((exec, _)) = common::load() else { return };
    let f = exec.facts();
    assert_eq!((f.num_layers, f.num_kv_heads, f.head_dim, f.vocab_size), (30, 3, 64, 49152));
    assert_eq!(f.max_model_len, 8192);
    assert_eq!(f.eos_token_ids, vec![2]);
    assert_eq!(f.weights_id, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53");
    assert_eq!(f.name, "SmolLM2-135M-Instruct.Q4_1");
    let p = common::model_path().unwrap();
    let capped = GgufExecutor::load(&p, &ModelOptions { max_model_len: Some(1024), ..Default::default() }).unwrap();
    assert_eq!(capped.facts().max_model_len, 1024);
}

/// A small GGUF file with `metadata` and two tiny f32 tensors (embedding and gate), written by
/// candle's GGUF writer.
fn gguf_with(name: &str, metadata: &[(&str, candle_core::quantized::gguf_file::Value)]) -> std::path::PathBuf {
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};
    let t = |rows: usize, cols: usize| {
        QTensor::quantize(
            &Tensor::zeros((rows, cols), candle_core::DType::F32, &Device::Cpu).unwrap(),
            candle_core::quantized::GgmlDType::F32,
        )
        .unwrap()
    };
    let (embd, gate) = (t(8, 16), t(32, 16));
    let p = std::env::temp_dir().join(format!("pdmesh-model-test-{}-{name}", std::process::id()));
    let mut f = std::fs::File::create(&p).unwrap();
    let md: Vec<(&str, &candle_core::quantized::gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    candle_core::quantized::gguf_file::write(
        &mut f,
        &md,
        &[("token_embd.weight", &embd), ("blk.0.ffn_gate.weight", &gate)],
    )
    .unwrap();
    p
}

fn llama_header(
    arch: &str,
    overrides: &[(&str, candle_core::quantized::gguf_file::Value)],
) -> Vec<(String, candle_core::quantized::gguf_file::Value)> {
    use candle_core::quantized::gguf_file::Value;
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.block_count"), Value::U32(1)),
        (format!("{arch}.embedding_length"), Value::U32(16)),
        (format!("{arch}.attention.head_count"), Value::U32(2)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (format!("{arch}.context_length"), Value::U32(64)),
    ];
    for (k, v) in overrides {
        md.retain(|(key, _)| key != k);
        md.push((k.to_string(), v.clone()));
    }
    md
}

fn load_header(name: &str, md: &[(String, candle_core::quantized::gguf_file::Value)]) -> ModelError {
    let md: Vec<(&str, candle_core::quantized::gguf_file::Value)> =
        md.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let p = gguf_with(name, &md);
    let e = pdmesh_model::read_config(&p).unwrap_err();
    // the executor refuses it the same way, before reading any weight
    let e2 = GgufExecutor::load(&p, &ModelOptions::default()).unwrap_err();
    assert_eq!(e.to_string(), e2.to_string());
    let _ = std::fs::remove_file(p);
    e
}

#[test]
fn an_unsupported_architecture_is_named_with_the_supported_ones() {
    let e = load_header("bert.gguf", &llama_header("bert", &[]));
    assert!(matches!(&e, ModelError::UnsupportedArchitecture { arch, .. } if arch == "bert"), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("\"bert\"") && msg.contains("llama, qwen2, gemma3"), "{msg}");
}

#[test]
fn absurd_header_counts_are_refused_before_anything_is_sized() {
    use candle_core::quantized::gguf_file::Value;
    for (key, value) in [
        ("llama.block_count", Value::U32(4_000_000_000)),
        ("llama.embedding_length", Value::U32(u32::MAX)),
        ("llama.context_length", Value::U32(u32::MAX)),
        ("llama.attention.head_count", Value::U32(0)),
        ("llama.attention.key_length", Value::U32(3)),
    ] {
        let e = load_header("absurd.gguf", &llama_header("llama", &[(key, value)]));
        assert!(matches!(e, ModelError::InvalidMetadata { .. }), "{key}: {e:?}");
    }
}

#[test]
fn unsupported_features_are_refused_by_name() {
    use candle_core::quantized::gguf_file::Value;
    let e = load_header(
        "rope-scaling.gguf",
        &llama_header(
            "llama",
            &[
                ("llama.rope.scaling.type", Value::String("yarn".into())),
                ("llama.rope.scaling.factor", Value::F32(4.0)),
            ],
        ),
    );
    assert!(matches!(&e, ModelError::UnsupportedFeature { feature } if feature.contains("yarn")), "{e:?}");
    let e = load_header("moe.gguf", &llama_header("llama", &[("llama.expert_count", Value::U32(8))]));
    assert!(
        matches!(&e, ModelError::UnsupportedFeature { feature } if feature.contains("mixture of experts")),
        "{e:?}"
    );
}

/// `general.alignment = 0` made candle's header parser divide by zero (a panic; found by the
/// `gguf` fuzz target): it is an `InvalidGguf` naming the key, in every integer width candle
/// reads it from; a float 0 (which candle ignores) is not.
#[test]
fn a_zero_alignment_is_refused_not_a_panic() {
    use candle_core::quantized::gguf_file::Value;
    for value in [Value::U8(0), Value::I16(0), Value::U32(0), Value::I32(0)] {
        let md = llama_header("llama", &[("general.alignment", value.clone())]);
        let e = load_header("align0.gguf", &md);
        assert!(
            matches!(&e, ModelError::InvalidGguf { reason, .. } if reason.contains("general.alignment")),
            "{value:?}: {e:?}"
        );
    }
    // the fuzz target's input: the key NUL-terminated, which candle reads as the same key
    let mut raw = b"GGUF".to_vec();
    raw.extend_from_slice(&3u32.to_le_bytes());
    raw.extend_from_slice(&0u64.to_le_bytes());
    raw.extend_from_slice(&1u64.to_le_bytes());
    raw.extend_from_slice(&18u64.to_le_bytes());
    raw.extend_from_slice(b"general.alignment\0");
    raw.extend_from_slice(&0u32.to_le_bytes());
    raw.push(0);
    let p = temp_file("align-nul.gguf", &raw);
    let e = pdmesh_model::read_config(&p).unwrap_err();
    assert!(matches!(&e, ModelError::InvalidGguf { reason, .. } if reason.contains("general.alignment")), "{e:?}");
    let _ = std::fs::remove_file(p);
    let md = llama_header("llama", &[("general.alignment", Value::F32(0.0))]);
    let md: Vec<(&str, Value)> = md.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let p = gguf_with("align-float.gguf", &md);
    assert!(pdmesh_model::read_config(&p).is_ok());
    let _ = std::fs::remove_file(p);
}
