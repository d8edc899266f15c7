//! Issue 40 at process level: no request may crash or hang a frontend. A real one-node mesh
//! (`pdmesh up`, synthetic model) takes the requests that killed or stalled a frontend and
//! the frontend restart that left requests waiting forever.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::Mesh;
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    // generous: a request that runs past it has hung (the defects below hung forever)
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

/// A JSON schema whose root is a chain of `depth` `$ref`s.
fn ref_chain(depth: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..depth {
        // each an object whose one property is the next: the shape that overflowed at 300
        let next = if i + 1 == depth {
            json!({"type": "integer"})
        } else {
            json!({"type": "object", "properties": {"x": {"$ref": format!("#/$defs/a{}", i + 1)}}, "required": ["x"]})
        };
        defs.insert(format!("a{i}"), next);
    }
    json!({"$ref": "#/$defs/a0", "$defs": defs})
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).json(body).send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// Defects 1 and 3: a 300-step `$ref` chain killed the frontend process (SIGABRT, stack
/// overflow); 100k `guided_choice` strings took 29 s to a 400 that carried a Rust backtrace.
/// Now both are 400s naming the limit, with no backtrace or path, the frontend process is the
/// same one after them, and it serves on.
#[test]
fn hostile_specs_neither_kill_nor_stall_the_frontend() {
    let mesh = Mesh::start_one(|_| {});
    let frontend = mesh.pid_of("frontend", 0);
    let chat = mesh.url("/v1/chat/completions");
    let rf = json!({"type": "json_schema", "json_schema": {"name": "deep", "schema": ref_chain(300)}});
    let (s, v) = post(&chat, &json!({"messages": [{"role": "user", "content": "n"}], "response_format": rf}));
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("limits.guided_max_ref_depth"), "{v}");
    let choices: Vec<String> = (0..100_000).map(|i| format!("choice {i}")).collect();
    let (s, v) = post(&mesh.url("/v1/completions"), &json!({"prompt": "n", "guided_choice": choices}));
    assert_eq!(s, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("limits.guided_max_choices"), "{message}");
    for leak in ["backtrace", ".rs:", "/src/", "panic"] {
        assert!(!message.contains(leak), "the error leaks `{leak}`: {message}");
    }
    assert!(client().get(mesh.url("/live")).send().unwrap().status().is_success());
    let (s, v) = post(&mesh.url("/v1/completions"), &json!({"prompt": "n", "max_tokens": 4}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(mesh.pid_of("frontend", 0), frontend, "the frontend process survived");
    assert!(!mesh.logs().contains("stack overflow"), "a stack overflow in the logs");
}

/// Defect 2: after the frontend died and `pdmesh up` restarted it, engine-core went on
/// sending outputs to the dead process's socket for 25–45 s (seen on a P node behind the
/// router); requests in that window hung forever. Now the new frontend's hello re-points every
/// output stream at once and the old process's requests are aborted in the engine. On this
/// one-node ipc mesh the old stream happens to fail fast, so what this test pins is the
/// re-admission itself: the hello reaches the engine, which aborts the orphans (on the commit
/// before the fix nothing does, and the assertion on the counter fails), every request after
/// the restart is answered, nothing stays in flight, the engine ends using no blocks. The
/// deadline that ends a request whose outputs are lost anyway is
/// `pdmesh-frontend`'s `requests_end_at_their_deadline_and_are_aborted`.
#[test]
fn a_restarted_frontend_gets_its_outputs_at_once() {
    let mesh = Mesh::start_one(|n| n.model.per_token_cost_us = 20000);
    // requests in flight when the frontend dies: their clients go with it
    let orphans: Vec<_> = (0..4)
        .map(|i| {
            let url = mesh.url("/v1/completions");
            std::thread::spawn(move || {
                let body =
                    json!({"prompt": format!("orphan {i}"), "max_tokens": 400, "ignore_eos": true, "stream": true});
                let _ = client().post(url).json(&body).send().and_then(|r| r.text());
            })
        })
        .collect();
    mesh.wait_kv("the orphans are running", |kv| kv["used_blocks"].as_u64().unwrap_or(0) > 0);
    let old = mesh.pid_of("frontend", 0);
    mesh.kill9("frontend", 0);
    for h in orphans {
        h.join().unwrap();
    }
    common::wait_for("pdmesh up restarted the frontend", || {
        mesh.processes()
            .iter()
            .any(|p| p["service"] == "frontend" && p["pid"].as_i64().is_some_and(|p| p != i64::from(old)))
            && client().get(mesh.url("/health")).send().is_ok_and(|r| r.status().is_success())
    });
    // Every request from now on is answered.
    for i in 0..12 {
        let text = common::complete(&mesh.url("/v1/completions"), &format!("after the restart {i}"), i % 2 == 0);
        assert!(!text.is_empty());
    }
    mesh.wait_kv("the old frontend's requests were aborted", |kv| kv["used_blocks"] == 0 && kv["held_blocks"] == 0);
    let in_flight = common::metric(mesh.http_port, "pdmesh_frontend_http_in_flight_requests", "");
    assert_eq!(in_flight, 0.0);
    let engine_metrics = mesh.base_port + 110;
    assert!(common::metric(engine_metrics, "pdmesh_engine_frontend_orphans_aborted_total", "") >= 1.0);
    assert!(!mesh.logs().contains("panicked"), "a panic in the logs");
}
