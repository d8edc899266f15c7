//! Our forward pass against candle-transformers' `quantized_llama` on the same GGUF file:
//! greedy tokens must be identical, and so are the logits, bit for bit.
//!
//! The reference is fed one token per forward call. That is candle's only shape-independent
//! arithmetic: with a multi-token forward, gemm picks its summation order from the matrix shape,
//! so candle's own prefill and incremental logits differ (by up to ~0.3 here, enough to flip
//! near-ties). Our executor uses that one-token order for every chunk shape, so it matches the
//! reference exactly while we prefill the whole prompt in one chunk.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test/bench code: fail loudly

mod common;

use pdmesh_model_api::{ChatMessage, TextCodec};

const N_NEW: usize = 32;
/// Our arithmetic reproduces candle's bit for bit (see the module doc and `kernels.rs`).
const MAX_LOGIT_DEVIATION: f32 = 0.0;

fn prompts(codec: &pdmesh_model::GgufTextCodec) -> Vec<Vec<u32>> {
    let chat = |u: &str| codec.encode(&codec.render_chat(&[ChatMessage::text("user", u)]).unwrap()).unwrap();
    vec![
        codec.encode("The capital of France is").unwrap(),
        codec.encode("Once upon a time, in a small village by the sea,").unwrap(),
        codec.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n").unwrap(),
        chat("What is the capital of France?"),
        chat("Write a haiku about the ocean."),
        codec.encode("1, 2, 3, 5, 8, 13, 21,").unwrap(),
    ]
}

#[test]
fn greedy_tokens_match_candle_reference() {
    let Some(path) = common::model_path() else { return };
    let (mut exec, codec) = pdmesh_model::load_gguf(&path, &Default::default()).unwrap();
    let mut kv = common::kv_cache(&exec, 64, 16);
    for (i, prompt) in prompts(&codec).into_iter().enumerate() {
        let (want, ref_logits) = common::reference_greedy(&path, &prompt, N_NEW);
        let mut reqs = vec![common::Req::new("r", prompt.clone(), 0, 64)];
        // whole prompt in one chunk, then one token per step; keep our logits of every step
        let mut ours_logits = Vec::new();
        common::run_with(&mut exec, &mut kv, &mut reqs, N_NEW, usize::MAX, |e| {
            ours_logits.push(e.last_logits().to_vec())
        });
        let got = &reqs[0].generated;
        let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
        let note = first_diff.map(|p| {
            let l = &ref_logits[p];
            format!(
                "; at step {p} the reference's logits were {} for its token and {} for ours",
                l[want[p] as usize], l[got[p] as usize]
            )
        });
        assert_eq!(
            got,
            &want,
            "prompt {i} ({:?}): ours {:?} vs reference {:?}{}",
            codec.decode(&prompt).unwrap(),
            codec.decode(got).unwrap(),
            codec.decode(&want).unwrap(),
            note.unwrap_or_default()
        );
        let max_dev = ours_logits
            .iter()
            .zip(&ref_logits)
            .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
            .fold(0f32, f32::max);
        eprintln!("prompt {i}: max |logit - reference| = {max_dev}: {:?}", codec.decode(got).unwrap());
        assert!(max_dev <= MAX_LOGIT_DEVIATION, "prompt {i}: logits deviate from the reference by {max_dev}");
    }
}

#[test]
fn capital_of_france_is_paris() {
    let Some(path) = common::model_path() else { return };
    let (mut exec, codec) = pdmesh_model::load_gguf(&path, &Default::default()).unwrap();
    let mut kv = common::kv_cache(&exec, 8, 16);
    let prompt = codec.encode("The capital of France is").unwrap();
    let mut reqs = vec![common::Req::new("r", prompt, 0, 8)];
    common::run(&mut exec, &mut kv, &mut reqs, 4, usize::MAX);
    let text = codec.decode(&reqs[0].generated).unwrap();
    assert!(text.starts_with(" Paris"), "{text:?}");
}
