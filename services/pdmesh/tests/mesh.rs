//! The mesh as users run it: `pdmesh up` starts five real processes per node that talk
//! MessagePack over ZeroMQ; these tests drive it over HTTP (synthetic executor).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{sse_events, Mesh, UpOptions};
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap()
}

fn post(mesh: &Mesh, path: &str, body: Value) -> (u16, Value) {
    let r = client().post(mesh.url(path)).json(&body).send().unwrap();
    let status = r.status().as_u16();
    let text = r.text().unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

fn stream_text(mesh: &Mesh, path: &str, body: Value) -> (String, Vec<String>) {
    let r = client().post(mesh.url(path)).json(&body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let events = sse_events(&r.text().unwrap());
    let mut text = String::new();
    for e in &events {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        if let Some(t) = c["text"].as_str() {
            text.push_str(t);
        }
        if let Some(t) = c["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    (text, events)
}

#[test]
fn serves_completions_chat_and_streams_across_five_processes() {
    let mesh = Mesh::start_one(|_| {});

    // five separate, live processes, one per service
    let procs = mesh.processes();
    let mut services: Vec<String> = procs.iter().map(|p| p["service"].as_str().unwrap().to_string()).collect();
    services.sort();
    assert_eq!(services, ["connector-scheduler", "connector-worker", "dp-lb", "engine-core", "frontend"]);
    let mut pids: Vec<i64> = procs.iter().map(|p| p["pid"].as_i64().unwrap()).collect();
    pids.sort();
    pids.dedup();
    assert_eq!(pids.len(), 5);
    for pid in &pids {
        let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(cmdline.contains("pdmesh"), "{cmdline}");
    }

    let body =
        json!({"model": "pdmesh-synthetic", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0});
    let (status, v) = post(&mesh, "/v1/completions", body.clone());
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(text.len(), 12, "one byte per synthetic token: {v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 24);
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["usage"]["total_tokens"], 36);
    assert_eq!(v["object"], "text_completion");

    // deterministic, and streaming gives the same text
    let (_, again) = post(&mesh, "/v1/completions", body.clone());
    assert_eq!(again["choices"][0]["text"], text.as_str());
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (streamed, events) = stream_text(&mesh, "/v1/completions", sbody);
    assert_eq!(streamed, text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));

    // chat, streaming and not
    let chat = json!({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0});
    let (status, v) = post(&mesh, "/v1/chat/completions", chat.clone());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(content.len(), 6);
    let mut schat = chat.clone();
    schat["stream"] = json!(true);
    let (streamed, _) = stream_text(&mesh, "/v1/chat/completions", schat);
    assert_eq!(streamed, content);

    // X-Request-Id is honoured and echoed
    let r =
        client().post(mesh.url("/v1/completions")).header("X-Request-Id", "my-request-42").json(&body).send().unwrap();
    assert_eq!(r.headers()["x-request-id"], "my-request-42");

    // models
    let v: Value = client().get(mesh.url("/v1/models")).send().unwrap().json().unwrap();
    assert_eq!(v["data"][0]["id"], "pdmesh-synthetic");

    // every block is free again once the mesh is idle
    mesh.wait_kv("idle mesh frees all blocks", |kv| kv["used_blocks"] == 0 && kv["held_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"), "no panic in any log");
    assert!(mesh.stop().success(), "pdmesh up stops cleanly on SIGTERM");
}

#[test]
fn bad_input_gets_openai_errors_and_loses_nothing() {
    let mesh = Mesh::start_one(|n| n.engine.max_model_len = 64);
    let cases: Vec<(Value, u16, &str)> = vec![
        (json!({"prompt": "hi", "temperature": -1}), 400, "temperature"),
        (json!({"prompt": "hi", "top_p": 0}), 400, "top_p"),
        (json!({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
        (json!({"prompt": "hi", "n": 65}), 400, "n"),
        (json!({"prompt": "hi", "max_tokens": "many"}), 400, ""),
        (json!({"prompt": "x".repeat(80)}), 400, ""),
        (json!({"prompt": "x".repeat(40), "max_tokens": 40}), 400, ""),
        (json!({"prompt": "hi", "model": "no-such-model"}), 404, ""),
    ];
    for (body, status, param) in cases {
        let (got, v) = post(&mesh, "/v1/completions", body.clone());
        assert_eq!(got, status, "{body} -> {v}");
        let err = &v["error"];
        assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(err["type"].as_str().is_some(), "{v}");
        assert!(err.get("param").is_some() && err.get("code").is_some(), "{v}");
        if !param.is_empty() {
            assert_eq!(err["param"], param, "{v}");
        }
    }
    // malformed JSON
    let r = client()
        .post(mesh.url("/v1/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().unwrap();
    assert!(v["error"]["message"].is_string());
    // chat template error (an unknown role) is a 400
    let (got, v) = post(&mesh, "/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "x"}]}));
    assert_eq!(got, 400, "{v}");
    // a DP rank outside [0, dp_size) is a 400; not a number is a 400
    for rank in ["7", "abc"] {
        let r = client()
            .post(mesh.url("/v1/completions"))
            .header("X-data-parallel-rank", rank)
            .json(&json!({"prompt": "hi", "max_tokens": 2}))
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 400, "rank {rank}");
    }
    // ... and the mesh still serves
    let (got, v) = post(&mesh, "/v1/completions", json!({"prompt": "hi", "max_tokens": 3}));
    assert_eq!(got, 200, "{v}");
    let metrics = client().get(mesh.url("/metrics")).send().unwrap().text().unwrap();
    assert!(metrics.contains("pdmesh_frontend_request_errors_total"), "errors are counted");
    mesh.wait_kv("no block leaked by refused requests", |kv| kv["used_blocks"] == 0);
}

#[test]
fn sixty_four_concurrent_streams_complete() {
    let mesh = Mesh::start_one(|n| n.model.per_token_cost_us = 50);
    let url = mesh.url("/v1/completions");
    let handles: Vec<_> = (0..64)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || {
                let body =
                    json!({"prompt": format!("stream number {i}"), "max_tokens": 32, "stream": true, "temperature": 0});
                let r = client().post(url).json(&body).send().unwrap();
                assert_eq!(r.status().as_u16(), 200);
                let events = sse_events(&r.text().unwrap());
                assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
                let mut n = 0;
                for e in &events[..events.len() - 1] {
                    let v: Value = serde_json::from_str(e).unwrap();
                    n += v["choices"][0]["text"].as_str().map(str::len).unwrap_or(0);
                }
                n
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 32, "every stream delivered all its tokens");
    }
    mesh.wait_kv("all blocks free after 64 streams", |kv| kv["used_blocks"] == 0);
}

#[test]
fn client_disconnect_mid_stream_aborts_and_frees_blocks() {
    // slow tokens so the stream is still running when the client goes away
    let mesh = Mesh::start_one(|n| n.model.per_token_cost_us = 2000);
    let mut r = client()
        .post(mesh.url("/v1/completions"))
        .json(&json!({"prompt": "a long story", "max_tokens": 2000, "stream": true}))
        .send()
        .unwrap();
    let mut buf = [0u8; 256];
    let n = std::io::Read::read(&mut r, &mut buf).unwrap();
    assert!(n > 0);
    mesh.wait_kv("the request holds blocks while it streams", |kv| kv["used_blocks"].as_u64().unwrap_or(0) > 0);
    drop(r); // the client disconnects
    mesh.wait_kv("blocks free after the disconnect", |kv| kv["used_blocks"] == 0 && kv["ranks"][0]["num_running"] == 0);
    let kv = mesh.kv();
    assert_eq!(kv["free_blocks"], kv["total_blocks"]);
}

#[test]
fn killed_engine_core_gives_503_instead_of_hanging() {
    let mesh = Mesh::start_one_with(
        |n| n.model.per_token_cost_us = 2000,
        &UpOptions { args: vec!["--no-restart".into()], ..Default::default() },
    );
    // a stream in flight when the engine dies ends with an error, not a hang
    let url = mesh.url("/v1/completions");
    let inflight = std::thread::spawn(move || {
        let r = client().post(url).json(&json!({"prompt": "x", "max_tokens": 3000, "stream": true})).send().unwrap();
        r.text().unwrap()
    });
    mesh.wait_kv("stream running", |kv| kv["used_blocks"].as_u64().unwrap_or(0) > 0);
    mesh.kill9("engine-core", 0);
    let body = inflight.join().unwrap();
    assert!(body.contains("error"), "the in-flight stream reports an error: {body}");
    // new requests get a clear 503
    let mut got = 0;
    for _ in 0..50 {
        let (status, v) = post(&mesh, "/v1/completions", json!({"prompt": "hi", "max_tokens": 2}));
        got = status;
        if status == 503 {
            assert!(v["error"]["message"].as_str().unwrap().contains("unavailable"), "{v}");
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(got, 503);
}

#[test]
fn a_restarted_worker_serves_again() {
    let mesh = Mesh::start_one(|_| {});
    let (status, _) = post(&mesh, "/v1/completions", json!({"prompt": "before", "max_tokens": 4}));
    assert_eq!(status, 200);
    let old = mesh.pid_of("connector-worker", 0);
    mesh.kill9("connector-worker", 0);
    // `pdmesh up` reports the death and restarts it; the engine reconnects
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, v) = post(&mesh, "/v1/completions", json!({"prompt": "after", "max_tokens": 4}));
        if status == 200 && mesh.pid_of("connector-worker", 0) != old {
            assert_eq!(v["choices"][0]["text"].as_str().unwrap().len(), 4);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "mesh did not recover: {status} {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let up_log = std::fs::read_to_string(mesh.run_dir.join("up.log")).unwrap();
    assert!(up_log.contains("died"), "the death was reported");
}

#[test]
fn data_parallel_ranks_pinned_by_header_and_balanced_without() {
    let mesh = Mesh::start_one(|n| n.dp_size = 2);
    let procs = mesh.processes();
    assert_eq!(procs.len(), 8, "frontend + dp-lb + 2 × (engine-core, connector-scheduler, connector-worker)");
    for _ in 0..4 {
        let r = client()
            .post(mesh.url("/v1/completions"))
            .header("X-data-parallel-rank", "1")
            .json(&json!({"prompt": "pinned", "max_tokens": 2}))
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    let engines = || -> Value { client().get(mesh.url("/debug/engines")).send().unwrap().json().unwrap() };
    let v = engines();
    assert_eq!(v["engines"][0]["finished_requests"], 0, "{v}");
    assert_eq!(v["engines"][1]["finished_requests"], 4, "{v}");
    // without the header, concurrent load goes to the least loaded rank: both get work
    let url = mesh.url("/v1/completions");
    let hs: Vec<_> = (0..16)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || {
                client()
                    .post(url)
                    .json(&json!({"prompt": format!("free {i}"), "max_tokens": 64}))
                    .send()
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap(), 200);
    }
    let v = engines();
    let r0 = v["engines"][0]["finished_requests"].as_u64().unwrap();
    let r1 = v["engines"][1]["finished_requests"].as_u64().unwrap() - 4;
    assert_eq!(r0 + r1, 16);
    assert!(r0 > 0 && r1 > 0, "both ranks served unpinned requests: {r0} / {r1}");
}
