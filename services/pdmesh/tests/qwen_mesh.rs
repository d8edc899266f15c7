//! A model users bring, through the whole mesh: Qwen2.5-Coder-0.5B-Instruct (qwen2, Q4_K_M,
//! 24 layers × 2 KV heads × 64, a 151 936-token BPE vocabulary and ChatML) served by P and D
//! behind the router, against a colocated node on the same file.
//!
//! - 16 prompts, completions and chat, streamed and not: the router's answers equal the
//!   colocated node's, and P and D end holding nothing;
//! - rule R1: D's engine refuses the request before admission (its own fault injection), and P
//!   frees its blocks at once (P holds for 480 s here, so only the notice can free it in time).
//!
//! Rule R3 on this model is `faults.rs`'s `qwen2_transfer_fails_midway`. The file comes from
//! `scripts/fetch-model.sh qwen2.5-0.5b` (scripts/test.sh fetches it).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::topo::TransferBackendKind::Shm;
use common::{answer, Mesh, TopologyExt};
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap()
}

#[test]
fn qwen2_disaggregated_equals_colocated() {
    let Some(path) = common::qwen_model_path() else { return };
    let mesh = Mesh::start_nodes(
        |http, base| common::pd_topology(http, base, Shm, 1, common::gguf(&path, 128, 1024)),
        common::pd_engines,
    );
    let (router, colocated) = (mesh.http_port, mesh.http_port + 3);
    let models: Value = client().get(mesh.url("/v1/models")).send().unwrap().json().unwrap();
    assert_eq!(models["data"][0]["id"], "qwen2.5-coder-0.5b-instruct-q4_k_m", "{models}");

    let bodies = common::mixed_requests();
    assert_eq!(bodies.len(), 16);
    for (i, (path, body)) in bodies.iter().enumerate() {
        let stream = i % 2 == 1;
        let want = answer(colocated, path, body, stream);
        let got = answer(router, path, body, stream);
        assert!(want.1 > 0 && !want.0.is_empty(), "the colocated node answered {path} {body}: {want:?}");
        assert_eq!(got, want, "{path} (stream {stream}) {body}");
    }
    // The chat answer about France is right: the model, template and tokenizer work together.
    let (paris, _) = answer(router, "/v1/chat/completions", &bodies[8].1, false);
    assert!(paris.contains("Paris"), "{paris:?}");
    mesh.wait_kv_on(router + 1, "P holds nothing once D has read", |kv| {
        kv["held_blocks"] == 0 && kv["used_blocks"] == 0
    });
    mesh.wait_kv_on(router + 2, "D's blocks are free", |kv| kv["used_blocks"] == 0);
}

/// Rule R1 on Qwen: D's engine refuses every request at admission; the router's client gets a
/// clear error, and P frees its blocks at once instead of holding them to the 480 s deadline.
#[test]
fn qwen2_refusal_on_d_frees_p_at_once() {
    let Some(path) = common::qwen_model_path() else { return };
    let mesh = Mesh::start_nodes(
        |h, b| {
            common::pd_topology(h, b, Shm, 1, common::gguf(&path, 128, 1024))
                .with_node("d", |d| d.engine.fault_injection = "refuse_admission_every=1".into())
        },
        common::pd_engines,
    );
    let p = mesh.http_port + 1;
    let body = json!({"prompt": "def quicksort(arr):\n", "max_tokens": 8, "temperature": 0});
    let r = client().post(mesh.url("/v1/completions")).json(&body).send().unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().unwrap_or(Value::Null);
    assert!((400..600).contains(&status), "a clear error from D's refusal: {status} {v}");
    assert!(v["error"]["message"].is_string(), "an OpenAI-style error body: {v}");
    mesh.wait_kv_on(p, "P freed at once", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    // P still serves: the same prompt on P alone (colocated path of P's own engine).
    let r = client().post(mesh.url_on(p, "/v1/completions")).json(&body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
}
