//! The real model through the mesh: SmolLM2-135M-Instruct (GGUF) served by five processes,
//! checked against an independent reference (candle-transformers' `quantized_llama`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use common::topo::TransferBackendKind::Shm;
use common::{pd_engines, sse_events, Mesh};
use pdmesh_model_api::{ChatMessage, TextCodec};
use serde_json::{json, Value};

/// Greedy tokens from candle-transformers' own llama implementation. The prompt is fed one
/// token per call: candle's batched prefill and its one-token path differ in the last bits
/// (up to ~0.3 in a logit), and our forward pass uses the one-token arithmetic order for every
/// chunk shape, so that is the path to compare exactly (docs/MODEL.md).
fn reference_greedy(path: &std::path::Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut model =
        candle_transformers::models::quantized_llama::ModelWeights::from_gguf(content, &mut file, &Device::Cpu)
            .unwrap();
    let argmax = |t: Tensor| -> u32 {
        let v: Vec<f32> = t.squeeze(0).unwrap().to_vec1().unwrap();
        let mut best = 0;
        for (i, x) in v.iter().enumerate() {
            if *x > v[best] {
                best = i;
            }
        }
        best as u32
    };
    let mut out = Vec::new();
    let mut logits = None;
    for (pos, &t) in prompt.iter().enumerate() {
        let input = Tensor::new(&[t], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        logits = Some(model.forward(&input, pos).unwrap());
    }
    let mut next = argmax(logits.unwrap());
    out.push(next);
    for i in 0..n - 1 {
        let input = Tensor::new(&[next], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        next = argmax(model.forward(&input, prompt.len() + i).unwrap());
        out.push(next);
    }
    out
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

fn post(mesh: &Mesh, path: &str, body: &Value) -> Value {
    let r = client().post(mesh.url(path)).json(body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.json().unwrap()
}

fn streamed(mesh: &Mesh, path: &str, body: &Value) -> String {
    streamed_on(mesh, mesh.http_port, path, body).0
}

/// A streamed answer from `port`: its text and its completion tokens (usage included).
fn streamed_on(mesh: &Mesh, port: u16, path: &str, body: &Value) -> (String, u64) {
    let mut b = body.clone();
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    let r = client().post(mesh.url_on(port, path)).json(&b).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (mut text, mut tokens) = (String::new(), 0);
    for e in sse_events(&r.text().unwrap()) {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        let c = &v["choices"][0];
        text.push_str(c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or(""));
        tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(tokens);
    }
    (text, tokens)
}

#[test]
fn real_model_through_the_mesh_matches_the_reference() {
    let Some(path) = common::model_path() else { return };
    let codec = pdmesh_model::GgufTextCodec::load(&path, &pdmesh_model::ModelOptions::default()).unwrap();
    let mesh = Mesh::start_one(|n| {
        n.model.kind = common::topo::ModelKind::Gguf;
        n.model.path = path.display().to_string();
        n.engine.num_blocks = 256;
        n.engine.max_model_len = 2048;
    });

    // completion: the model knows its geography
    let body = json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0});
    let v = post(&mesh, "/v1/completions", &body);
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.starts_with(" Paris"), "{text:?}");
    let prompt_ids = codec.encode("The capital of France is").unwrap();
    let reference = codec.decode(&reference_greedy(&path, &prompt_ids, 8)).unwrap();
    assert_eq!(text, reference, "completion equals the reference greedy text");
    assert_eq!(streamed(&mesh, "/v1/completions", &body), text, "streaming = non-streaming");

    // chat: the model's own template (with its default system turn) and the reference answer
    let chat = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0});
    let v = post(&mesh, "/v1/chat/completions", &chat);
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let rendered = codec.render_chat(&[ChatMessage::text("user", "What is the capital of France?")]).unwrap();
    assert!(rendered.contains("<|im_start|>system"), "default system turn: {rendered}");
    let chat_ids = codec.encode(&rendered).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], chat_ids.len());
    let mut ref_ids = reference_greedy(&path, &chat_ids, 24);
    if let Some(stop) = ref_ids.iter().position(|t| codec.eos_token_ids().contains(t)) {
        ref_ids.truncate(stop);
    }
    assert_eq!(answer, codec.decode(&ref_ids).unwrap(), "chat answer equals the reference greedy answer");
    assert_eq!(streamed(&mesh, "/v1/chat/completions", &chat), answer, "streaming = non-streaming");
    mesh.wait_kv("blocks free", |kv| kv["used_blocks"] == 0);
}

/// P/D on the real model: router → P (prefill, holds its blocks) → D (reads them over shared
/// memory, decodes). Greedy output equals the colocated node's, token for token.
#[test]
fn real_model_disaggregated_equals_colocated() {
    let Some(path) = common::model_path() else { return };
    let settings = |n: &mut common::topo::NodeConfig| {
        n.model.kind = common::topo::ModelKind::Gguf;
        n.model.path = path.display().to_string();
        n.engine.num_blocks = 128;
        n.engine.max_model_len = 1024;
    };
    let mesh = Mesh::start_nodes(|http, base| common::pd_topology(http, base, Shm, 1, settings), pd_engines);
    let router = mesh.http_port;
    let colocated = mesh.http_port + 3;
    for prompt in ["The capital of France is", "Once upon a time, in a small village by the sea,", "1, 2, 3, 4,"] {
        let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0});
        let want = post_on(&mesh, colocated, "/v1/completions", &body);
        let got = post_on(&mesh, router, "/v1/completions", &body);
        assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"], "{prompt}");
    }
    let chat = json!({"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 16, "temperature": 0});
    let want = post_on(&mesh, colocated, "/v1/chat/completions", &chat);
    let got = post_on(&mesh, router, "/v1/chat/completions", &chat);
    assert_eq!(got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"]);
    // Streamed through the router, the first token comes from P's answer and D continues
    // after it (D63): the same text and token count as the colocated node's. Prompts of token
    // ids whose length is a whole number of blocks (16) put P's token in a block of its own on D.
    let first_from_p = || common::metric(router, "pdmesh_router_first_token_from_prefill_total", "");
    let before = first_from_p();
    let ids = |n: u32| (0..n).map(|i| 1000 + 37 * i).collect::<Vec<_>>();
    let bodies = [
        ("/v1/completions", json!({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0})),
        ("/v1/completions", json!({"prompt": ids(16), "max_tokens": 12, "temperature": 0})),
        ("/v1/completions", json!({"prompt": ids(32), "max_tokens": 12, "temperature": 0})),
        ("/v1/completions", json!({"prompt": ids(17), "max_tokens": 12, "temperature": 0})),
        ("/v1/chat/completions", chat.clone()),
    ];
    for (path, body) in &bodies {
        let want = streamed_on(&mesh, colocated, path, body);
        let got = streamed_on(&mesh, router, path, body);
        assert_eq!(got, want, "{path} {body}");
    }
    let served = first_from_p() - before;
    assert!(served >= 4.0, "the router streamed P's first token for most of them: {served}");
    // D ran its decode steps ahead of its engine (D67 on a node that receives KV, D68), and
    // every answer above is still the colocated node's.
    let d_worker = mesh.base_port + 40 + 112;
    let used = common::metric(d_worker, "pdmesh_worker_speculative_rows_total", "outcome=\"used\"");
    assert!(used >= 20.0, "D's engine used decode rows its worker ran ahead: {used}");
    mesh.wait_kv_on(router + 1, "P holds nothing once D has read", |kv| {
        kv["held_blocks"] == 0 && kv["used_blocks"] == 0
    });
    mesh.wait_kv_on(router + 2, "D's blocks are free", |kv| kv["used_blocks"] == 0);
}

fn post_on(mesh: &Mesh, port: u16, path: &str, body: &Value) -> Value {
    let r = client().post(mesh.url_on(port, path)).json(body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200, "{path} on :{port}");
    r.json().unwrap()
}

/// Greedy and seeded answers of a one-node mesh on the real model to requests sent together
/// (so that batches form, change as requests join and stop, and cross block boundaries).
fn answers_of_concurrent_requests(mesh: &Mesh) -> Vec<Value> {
    let bodies: Vec<Value> = [
        ("The capital of France is", 5, None),
        ("Once upon a time, in a small village by the sea,", 40, None),
        ("1, 2, 3, 4,", 23, None),
        ("The best way to learn a language is", 31, Some(7)),
        ("Write a haiku about rain.", 17, Some(11)),
        ("Rust is a programming language that", 33, None),
    ]
    .into_iter()
    .map(|(prompt, max_tokens, seed)| match seed {
        None => json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
        Some(s) => json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": s}),
    })
    .collect();
    let url = mesh.url("/v1/completions");
    std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let url = url.clone();
                s.spawn(move || {
                    let r = client().post(&url).json(b).send().unwrap();
                    assert_eq!(r.status().as_u16(), 200);
                    let v: Value = r.json().unwrap();
                    json!([v["choices"][0]["text"], v["usage"]["completion_tokens"]])
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `engine.async_scheduling` (D67): the worker runs each next decode step ahead of the
/// engine's asking. The answers are the same, greedy and seeded, as with steps in turn (also
/// after a stream aborted mid-decode left its blocks to them); the engine's steps used the rows
/// run ahead; every block is free at the end.
#[test]
fn real_model_async_scheduling_answers_as_steps_in_turn() {
    let Some(path) = common::model_path() else { return };
    let sections = |on: bool| {
        let path = path.clone();
        move |n: &mut common::topo::NodeConfig| {
            n.model.kind = common::topo::ModelKind::Gguf;
            n.model.path = path.display().to_string();
            n.engine.num_blocks = 256;
            n.engine.max_model_len = 1024;
            n.engine.async_scheduling = on;
        }
    };
    let in_turn = Mesh::start_one(sections(false));
    let want = answers_of_concurrent_requests(&in_turn);
    let used_in_turn = common::metric(in_turn.base_port + 112, "pdmesh_worker_speculative_rows_total", "");
    assert_eq!(used_in_turn, 0.0, "nothing runs ahead when the key is off");
    drop(in_turn);

    let ahead = Mesh::start_one(sections(true));
    // A stream the client drops while its next row runs ahead: the engine aborts it and frees
    // its blocks (the row is discarded, R2); the requests after it take those blocks, and the
    // row written ahead into one of them must not change their answers.
    let mut dropped = client()
        .post(ahead.url("/v1/completions"))
        .json(&json!({"prompt": "Tell me a long story about the sea.", "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true}))
        .send()
        .unwrap();
    assert_eq!(dropped.status().as_u16(), 200);
    let mut buf = [0u8; 512];
    let mut read = 0;
    while read < 300 {
        let n = std::io::Read::read(&mut dropped, &mut buf).unwrap();
        assert!(n > 0, "the stream ended before the client dropped it: {:?}", String::from_utf8_lossy(&buf[..n]));
        read += n;
    }
    drop(dropped);
    ahead.wait_kv("the dropped stream's blocks are free", |kv| {
        kv["used_blocks"] == 0 && kv["ranks"][0]["num_running"] == 0
    });
    for round in 0..2 {
        let got = answers_of_concurrent_requests(&ahead);
        assert_eq!(got, want, "round {round}: answers equal those of steps in turn");
    }
    let worker = ahead.base_port + 112;
    let used = common::metric(worker, "pdmesh_worker_speculative_rows_total", "outcome=\"used\"");
    let discarded = common::metric(worker, "pdmesh_worker_speculative_rows_total", "outcome=\"discarded\"");
    eprintln!("rows run ahead: {used} used, {discarded} discarded");
    assert!(used > 100.0, "the engine's decode steps used rows run ahead: {used} used, {discarded} discarded");
    ahead.wait_kv("blocks free", |kv| kv["used_blocks"] == 0);

    // Alone, a request runs every decode step ahead, block boundaries included: the engine
    // gives it its next position's block a step early (D78). 40 tokens after a prompt of a
    // few cross two or three 16-token boundaries; each of its 39 decode steps uses its row.
    let (used_before, discarded_before) = (used, discarded);
    let r = client()
        .post(ahead.url("/v1/completions"))
        .json(&json!({"prompt": "Count slowly:", "max_tokens": 40, "temperature": 0, "ignore_eos": true}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 40);
    let used = common::metric(worker, "pdmesh_worker_speculative_rows_total", "outcome=\"used\"") - used_before;
    let discarded =
        common::metric(worker, "pdmesh_worker_speculative_rows_total", "outcome=\"discarded\"") - discarded_before;
    assert_eq!((used, discarded), (39.0, 0.0), "every decode step of a lone request ran ahead");
    ahead.wait_kv("blocks free", |kv| kv["used_blocks"] == 0);
}
