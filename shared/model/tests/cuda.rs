//! The GPU executor (cargo feature `cuda`) against the reference and the CPU executor, on the
//! real model: greedy tokens equal candle-transformers' `quantized_llama`, do not depend on
//! batching or chunking, the K/V it writes reaches the host cache (what KV transfers read), and
//! K/V loaded into the host cache by someone else (a P node) is what it decodes from.
//!
//! Needs an NVIDIA GPU: without a CUDA driver the tests say so and return (the feature itself
//! must build everywhere; `scripts/test.sh` builds and runs this file on every machine).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: fail loudly

mod common;

use pdmesh_model::cuda::{missing_cuda_library, CudaLlamaExecutor};
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{ChatMessage, TextCodec};

const N_NEW: usize = 32;
/// The GPU kernels follow the CPU executor's arithmetic (and so candle's) operation for
/// operation, glibc's `expf` included: the logits are the reference's, bit for bit.
const MAX_LOGIT_DEVIATION: f32 = 0.0;

/// The executor on GPU 0, or `None` (the test says why and passes) where this machine cannot
/// run one. `PDMESH_REQUIRE_GPU=1` (set by scripts/gpu-check.sh) turns that skip into a
/// failure, so a GPU check cannot pass by skipping.
fn gpu() -> Option<CudaLlamaExecutor> {
    let require = std::env::var("PDMESH_REQUIRE_GPU").as_deref() == Ok("1");
    let Some(path) = common::model_path() else {
        assert!(!require, "PDMESH_REQUIRE_GPU=1, but the model tests are skipped (PDMESH_SKIP_MODEL_TESTS)");
        return None;
    };
    if let Some(missing) = missing_cuda_library() {
        assert!(!require, "PDMESH_REQUIRE_GPU=1, but {missing} cannot be loaded");
        eprintln!("{missing} cannot be loaded here: skipping a GPU test (built with the cuda feature)");
        return None;
    }
    let exec = CudaLlamaExecutor::load(&path, &Default::default(), 0).expect("load the model onto the GPU");
    eprintln!("GPU: {}", exec.device_name());
    Some(exec)
}

fn chat(codec: &pdmesh_model::GgufTextCodec, u: &str) -> Vec<u32> {
    codec.encode(&codec.render_chat(&[ChatMessage::text("user", u)]).unwrap()).unwrap()
}

#[test]
fn gpu_greedy_tokens_match_candle_reference() {
    let Some(mut gpu) = gpu() else { return };
    let path = common::model_path().unwrap();
    let (_, codec) = common::load().unwrap();
    let prompts = vec![
        codec.encode("The capital of France is").unwrap(),
        codec.encode("Once upon a time, in a small village by the sea,").unwrap(),
        codec.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n").unwrap(),
        chat(&codec, "What is the capital of France?"),
        chat(&codec, "Write a haiku about the ocean."),
        codec.encode("1, 2, 3, 5, 8, 13, 21,").unwrap(),
    ];
    let mut kv = common::kv_cache(&gpu, 64, 16);
    let mut deviations = Vec::new();
    for (i, prompt) in prompts.into_iter().enumerate() {
        let (want, ref_logits) = common::reference_greedy(&path, &prompt, N_NEW);
        let mut reqs = vec![common::Req::new(&format!("r{i}"), prompt.clone(), 0, 64)];
        let mut ours = Vec::new();
        let t0 = std::time::Instant::now();
        common::run_with(&mut gpu, &mut kv, &mut reqs, N_NEW, usize::MAX, |e| ours.push(e.last_logits().to_vec()));
        let elapsed = t0.elapsed();
        let got = &reqs[0].generated;
        assert_eq!(
            got,
            &want,
            "prompt {i}: GPU {:?} vs reference {:?}",
            codec.decode(got).unwrap(),
            codec.decode(&want).unwrap()
        );
        let max_dev = ours
            .iter()
            .zip(&ref_logits)
            .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
            .fold(0f32, f32::max);
        eprintln!(
            "prompt {i}: {} prompt tokens + {N_NEW} generated in {elapsed:?}; max |logit - reference| = {max_dev}: {:?}",
            prompt.len(),
            codec.decode(got).unwrap()
        );
        deviations.push(max_dev);
    }
    assert!(
        deviations.iter().all(|&d| d <= MAX_LOGIT_DEVIATION),
        "GPU logits deviate from the reference by {deviations:?}"
    );
}

#[test]
fn gpu_tokens_do_not_depend_on_batching_or_chunking_and_equal_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let (mut cpu, codec) = common::load().unwrap();
    let texts = common::EIGHT_PROMPTS;
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| chat(&codec, t)).collect();
    let bpr = 8u32;
    let mut kv = common::kv_cache(&gpu, bpr * 8, 16);
    let reqs = |tag: &str, shift: u32| -> Vec<common::Req> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| common::Req::new(&format!("{tag}{i}"), p.clone(), ((i as u32 + shift) % 8) * bpr, bpr))
            .collect()
    };
    let mut alone = vec![common::Req::new("a", prompts[0].clone(), 0, bpr)];
    common::run(&mut gpu, &mut kv, &mut alone, 24, usize::MAX);
    let mut batch = reqs("b", 3);
    common::run(&mut gpu, &mut kv, &mut batch, 24, usize::MAX);
    let mut chunked = reqs("c", 0);
    common::run(&mut gpu, &mut kv, &mut chunked, 24, 5);
    let mut cpu_kv = common::kv_cache(&cpu, bpr * 8, 16);
    let mut on_cpu = reqs("p", 0);
    common::run(&mut cpu, &mut cpu_kv, &mut on_cpu, 24, usize::MAX);

    assert_eq!(batch[0].generated, alone[0].generated, "batched with 7 others");
    assert_eq!(chunked[0].generated, alone[0].generated, "prefill in chunks of 5");
    for i in 0..8 {
        assert_eq!(chunked[i].generated, batch[i].generated, "request {i}: chunked vs batched");
        assert_eq!(on_cpu[i].generated, batch[i].generated, "request {i}: CPU vs GPU");
    }
    // The K/V the GPU wrote reached the host cache: the chunked run used the same blocks as the
    // CPU run, so both host caches hold the same keys (up to the GPU's expf) in every written slot.
    let spec = *kv.spec();
    let mut max_dev = 0f32;
    for (r, c) in chunked.iter().zip(&on_cpu) {
        let written = r.prompt.len() + r.generated.len() - 1;
        for layer in 0..spec.num_layers as usize {
            for side in [KvSide::Key, KvSide::Value] {
                for (bi, &b) in r.blocks.iter().enumerate() {
                    let slots = written.saturating_sub(bi * 16).min(16);
                    let n = slots * spec.num_kv_heads as usize * spec.head_dim as usize;
                    let g = &kv.block(layer, side, b).unwrap()[..n];
                    let h = &cpu_kv.block(layer, side, c.blocks[bi]).unwrap()[..n];
                    max_dev = g.iter().zip(h).map(|(x, y)| (x - y).abs()).fold(max_dev, f32::max);
                    assert!(n == 0 || g.iter().any(|&x| x != 0.0), "layer {layer} block {b}: nothing mirrored");
                }
            }
        }
    }
    eprintln!("max |GPU K/V in the host cache - CPU K/V| = {max_dev}");
    assert!(max_dev <= MAX_LOGIT_DEVIATION, "host K/V deviates from the CPU's by {max_dev}");
}

/// The D side of P/D on a GPU: the prompt's K/V arrives in the host cache from elsewhere (here
/// the CPU executor plays P), the GPU recomputes the last prompt token and decodes from it.
#[test]
fn gpu_decodes_from_kv_loaded_into_the_host_cache() {
    let Some(mut gpu) = gpu() else { return };
    let (mut cpu, codec) = common::load().unwrap();
    let prompt = chat(&codec, "Name three planets of the solar system.");
    let blocks = (prompt.len() + N_NEW).div_ceil(16) as u32;
    // colocated on the CPU: the expected tokens
    let mut kv_cpu = common::kv_cache(&cpu, blocks * 2, 16);
    let mut want = vec![common::Req::new("colocated", prompt.clone(), 0, blocks)];
    common::run(&mut cpu, &mut kv_cpu, &mut want, N_NEW, usize::MAX);

    // "P": prefill on the CPU into blocks of a host cache, then hand that cache to the GPU,
    // whose device copy of those blocks was written by an earlier, unrelated request.
    let mut kv = common::kv_cache(&gpu, blocks * 2, 16);
    let mut unrelated = vec![common::Req::new("unrelated", chat(&codec, "Say hello."), blocks, blocks)];
    common::run(&mut gpu, &mut kv, &mut unrelated, 4, usize::MAX);
    let mut unrelated2 = vec![common::Req::new("unrelated2", chat(&codec, "Count to five."), blocks, blocks)];
    common::run(&mut gpu, &mut kv, &mut unrelated2, 4, usize::MAX);
    let mut p_side = vec![common::Req::new("p", prompt.clone(), blocks, blocks)];
    p_side[0].prompt.truncate(prompt.len());
    let mut kv_p = common::kv_cache(&cpu, blocks * 2, 16);
    common::run(&mut cpu, &mut kv_p, &mut p_side, 1, usize::MAX);
    for layer in 0..kv.spec().num_layers as usize {
        for side in [KvSide::Key, KvSide::Value] {
            for b in blocks..2 * blocks {
                let src = kv_p.block(layer, side, b).unwrap().to_vec();
                kv.block_mut(layer, side, b).unwrap().copy_from_slice(&src);
            }
        }
    }
    // "D": the GPU continues from the loaded K/V, recomputing the last prompt token.
    let mut d_side = vec![common::Req::new("d", prompt.clone(), blocks, blocks)];
    d_side[0].computed = prompt.len() - 1;
    common::run(&mut gpu, &mut kv, &mut d_side, N_NEW, usize::MAX);
    eprintln!("decoded from loaded K/V: {:?}", codec.decode(&d_side[0].generated).unwrap());
    assert_eq!(d_side[0].generated, want[0].generated, "GPU decode from host-loaded K/V vs colocated CPU");
}

/// Resident mode (the `cuda` transfer backend): the cache is one exported GPU region and the
/// host cache is never written. Greedy tokens equal the mirrored mode's, batched and chunked,
/// and the region holds, block for block, exactly the K/V the mirrored mode wrote to its host
/// cache: the kernels address each layer side of the one region where a transfer reads it.
#[test]
fn gpu_resident_cache_equals_the_mirrored_one() {
    let Some(mut mirrored) = gpu() else { return };
    let Some(mut resident) = gpu() else { return };
    let (_, codec) = common::load().unwrap();
    let prompts: Vec<Vec<u32>> = common::EIGHT_PROMPTS.iter().map(|t| chat(&codec, t)).collect();
    let bpr = 8u32;
    let reqs = |tag: &str| -> Vec<common::Req> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| common::Req::new(&format!("{tag}{i}"), p.clone(), i as u32 * bpr, bpr))
            .collect()
    };
    let mut host_m = common::kv_cache(&mirrored, bpr * 8, 16);
    let mut want = reqs("m");
    common::run(&mut mirrored, &mut host_m, &mut want, 24, 5);

    let spec = *host_m.spec();
    let region = resident.use_exported_kv(spec).unwrap();
    let mut host_r = common::kv_cache(&resident, bpr * 8, 16);
    host_r.as_mut_slice().fill(f32::NAN);
    let mut got = reqs("r");
    common::run(&mut resident, &mut host_r, &mut got, 24, 5);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.generated, w.generated, "{}: resident vs mirrored", g.id);
    }
    assert!(host_r.as_slice().iter().all(|x| x.is_nan()), "resident mode wrote to the host cache");

    for r in &want {
        let written = r.prompt.len() + r.generated.len() - 1;
        for layer in 0..spec.num_layers as usize {
            for (side, kv_side) in [(0, KvSide::Key), (1, KvSide::Value)] {
                for (bi, &b) in r.blocks.iter().enumerate() {
                    let n =
                        written.saturating_sub(bi * 16).min(16) * spec.num_kv_heads as usize * spec.head_dim as usize;
                    let on_gpu = region.read_block(layer, side, b).unwrap();
                    let mirror = host_m.block(layer, kv_side, b).unwrap();
                    assert_eq!(&on_gpu[..n], &mirror[..n], "layer {layer} side {side} block {b}");
                }
            }
        }
    }
}
