//! Batch invariance: a request's greedy tokens do not depend on what it is batched with or on
//! how its prefill is split into chunks across steps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test/bench code: fail loudly

mod common;

use pdmesh_model_api::{ChatMessage, TextCodec};

const N_NEW: usize = 24;

#[test]
fn greedy_tokens_do_not_depend_on_batching_or_chunking() {
    let Some((mut exec, codec)) = common::load() else { return };
    let texts = common::EIGHT_PROMPTS;
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| codec.encode(&codec.render_chat(&[ChatMessage::text("user", *t)]).unwrap()).unwrap())
        .collect();
    let blocks_per_req = 8u32; // block_size 16: 128 positions each
    let mut kv = common::kv_cache(&exec, blocks_per_req * 8, 16);

    // 1. alone, whole prompt in one chunk
    let mut alone = vec![common::Req::new("a", prompts[0].clone(), 0, blocks_per_req)];
    common::run(&mut exec, &mut kv, &mut alone, N_NEW, usize::MAX);

    // 2. batched with 7 others in the same steps (request 0 uses different blocks this time)
    let mut batch: Vec<common::Req> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            common::Req::new(&format!("b{i}"), p.clone(), ((i as u32 + 3) % 8) * blocks_per_req, blocks_per_req)
        })
        .collect();
    common::run(&mut exec, &mut kv, &mut batch, N_NEW, usize::MAX);

    // 3. prefill split into chunks of 5 tokens across steps, batched with the others
    let mut chunked: Vec<common::Req> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| common::Req::new(&format!("c{i}"), p.clone(), i as u32 * blocks_per_req, blocks_per_req))
        .collect();
    common::run(&mut exec, &mut kv, &mut chunked, N_NEW, 5);

    eprintln!("alone: {:?}", codec.decode(&alone[0].generated).unwrap());
    assert_eq!(batch[0].generated, alone[0].generated, "batched with 7 others");
    assert_eq!(chunked[0].generated, alone[0].generated, "prefill in chunks of 5");
    for i in 1..8 {
        assert_eq!(chunked[i].generated, batch[i].generated, "request {i}: chunked vs batched");
    }
}

/// Nor on the forward pass's thread count (`model.threads`): the pool splits each matmul's
/// output rows between threads, and every row is computed whole by one of them.
#[test]
fn greedy_tokens_do_not_depend_on_the_thread_count() {
    let Some(path) = common::model_path() else { return };
    let generated = |threads: Option<usize>| {
        let options = pdmesh_model::ModelOptions { threads, ..Default::default() };
        let (mut exec, codec) = pdmesh_model::load_gguf(&path, &options).expect("load model");
        let prompt =
            codec.encode(&codec.render_chat(&[ChatMessage::text("user", common::EIGHT_PROMPTS[1])]).unwrap()).unwrap();
        let mut kv = common::kv_cache(&exec, 8, 16);
        let mut reqs = vec![common::Req::new("t", prompt, 0, 8)];
        common::run(&mut exec, &mut kv, &mut reqs, N_NEW, usize::MAX);
        reqs.remove(0).generated
    };
    let one = generated(Some(1));
    assert_eq!(one.len(), N_NEW);
    assert_eq!(generated(Some(3)), one, "3 threads");
    assert_eq!(generated(None), one, "the default (every core)");
}
