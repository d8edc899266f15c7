//! Test support of these tests: the mesh launcher and the topology builders come from
//! `pdmesh-test-support` (shared with the load tests); what stays here is test-local: HTTP
//! helpers, the model paths, the openai SDK's Python, raw topology files of the fail-fast tests.
#![allow(dead_code, unused_imports, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub mod failover;

pub use pdmesh_test_support::topology::{
    self as topo, side_ports, KvExt, NodeExt, ScaleoutPorts, TopologyExt, TransferBackendKind,
};
pub use pdmesh_test_support::{fresh_run_dir, reserve_ports, Mesh, UpOptions};

/// The `pdmesh` binary under test (`PDMESH_TEST_BIN` overrides it), for the tests that start
/// `pdmesh` by hand.
pub fn pdmesh_bin() -> std::ffi::OsString {
    std::env::var_os("PDMESH_TEST_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_pdmesh").into())
}

/// A fresh run dir `<tmp>/<prefix>-<pid>-<http>` holding `topology-in.toml`: the one-node
/// shape (node `main` on `http` and `base`) changed by `node`, written without validation so
/// that the fail-fast tests can hand `pdmesh` what it must refuse. Returns (run dir, topology).
pub fn one_node_run_dir(
    prefix: &str,
    http: u16,
    base: u16,
    node: impl FnOnce(&mut topo::NodeConfig),
) -> (PathBuf, PathBuf) {
    let run_dir = fresh_run_dir(prefix, http);
    let topology = run_dir.join("topology-in.toml");
    let mut t = topo::one_node(http, base);
    t.run_dir = run_dir.clone();
    node(&mut t.nodes[0]);
    std::fs::write(&topology, t.to_toml().unwrap()).unwrap();
    (run_dir, topology)
}

/// The HTTP ports of the P/D test shape's P, D and reference nodes (whose engines a start
/// waits for).
pub fn pd_engines(http: u16) -> Vec<u16> {
    vec![http + 1, http + 2, http + 3]
}

/// Settings of P, D and the reference: `num_blocks` KV blocks of `block_size` tokens.
pub fn blocks(block_size: u32, num_blocks: u32) -> impl Fn(&mut topo::NodeConfig) + Copy {
    move |n| {
        n.engine.block_size = block_size;
        n.engine.num_blocks = num_blocks;
    }
}

/// Settings of P, D and the reference: the GGUF model at `path`, `num_blocks` KV blocks (of
/// the default size), prompts and answers up to `max_model_len` tokens.
pub fn gguf(path: &std::path::Path, num_blocks: u32, max_model_len: u32) -> impl Fn(&mut topo::NodeConfig) + Copy + '_ {
    move |n| {
        n.model.kind = topo::ModelKind::Gguf;
        n.model.path = path.display().to_string();
        n.engine.num_blocks = num_blocks;
        n.engine.max_model_len = max_model_len;
    }
}

/// The P/D test shape ([`topo::pd`]) with `settings` on P, D and the reference node.
pub fn pd_topology(
    http: u16,
    base: u16,
    backend: TransferBackendKind,
    d_ranks: u32,
    settings: impl FnMut(&mut topo::NodeConfig),
) -> topo::Topology {
    topo::pd(http, base, backend, d_ranks).engine_nodes(settings)
}

/// Parse an SSE body into its `data:` payloads.
pub fn sse_events(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A greedy completion of 12 tokens (streamed or not) through `url`: its text.
pub fn complete(url: &str, prompt: &str, stream: bool) -> String {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream});
    let r = reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(120))
        .build()
        .unwrap()
        .post(url)
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{url}");
    let text = r.text().unwrap();
    if !stream {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        return v["choices"][0]["text"].as_str().unwrap().to_string();
    }
    let mut out = String::new();
    for e in sse_events(&text) {
        if e != "[DONE]" {
            let v: serde_json::Value = serde_json::from_str(&e).unwrap();
            out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        }
    }
    out
}

/// Wait until `cond` holds (polled every 20 ms), or fail the test after 30 s saying `what`.
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{what}: never true");
}

/// Start the scale-out `topology` in `run_dir` with `pdmesh up --no-restart`, so nothing
/// comes back behind the test's back, and wait until every port of `ready` serves.
pub fn start_scaleout(
    run_dir: &std::path::Path,
    topology: topo::Topology,
    router: u16,
    base: u16,
    ready: &[u16],
) -> Mesh {
    Mesh::start_in(topology, run_dir, "scaleout.toml", (router, base), ready, &UpOptions::no_restart())
}

/// The sum of every sample of `name` (with `label` in its labels, if given) on a metrics page.
pub fn metric(port: u16, name: &str, label: &str) -> f64 {
    let text = reqwest::blocking::get(format!("http://127.0.0.1:{port}/metrics")).unwrap().text().unwrap();
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{')))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The real model for the tests that run it, or `None` (they skip, saying so) under
/// `PDMESH_SKIP_MODEL_TESTS=1`; missing otherwise is a failure naming the fetch script.
pub fn model_path() -> Option<PathBuf> {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping");
        return None;
    }
    let p = pdmesh_model::default_model_path();
    assert!(p.is_file(), "model {} missing: run scripts/fetch-model.sh", p.display());
    Some(p)
}

/// A model `scripts/fetch-model.sh NAME` fetches, by its file name in the model directory
/// (`$PDMESH_MODEL_DIR`, else `~/.cache/pdmesh/models`), or `None` under
/// `PDMESH_SKIP_MODEL_TESTS=1`; missing otherwise is a failure naming the fetch command.
pub fn named_model_path(name: &str, file: &str) -> Option<PathBuf> {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping");
        return None;
    }
    let dir = std::env::var_os("PDMESH_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/pdmesh/models"));
    let p = dir.join(file);
    assert!(p.is_file(), "model {} missing: run scripts/fetch-model.sh {name}", p.display());
    Some(p)
}

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M (`scripts/fetch-model.sh qwen2.5-0.5b`).
pub fn qwen_model_path() -> Option<PathBuf> {
    named_model_path("qwen2.5-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
}

/// A Python with the `openai` SDK: `PDMESH_OPENAI_PYTHON` if set, else a venv made under the
/// target directory (kept between runs) with `pip install openai`. No SDK is a failure, never a
/// skip: the round trip is the point of the test.
pub fn openai_python() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("PDMESH_OPENAI_PYTHON") {
        return p.into();
    }
    let venv = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let has_sdk = |py: &std::path::Path| {
        std::process::Command::new(py).args(["-c", "import openai"]).status().is_ok_and(|s| s.success())
    };
    if has_sdk(&python) {
        return python;
    }
    let made = std::process::Command::new("python3").arg("-m").arg("venv").arg(&venv).status();
    assert!(made.is_ok_and(|s| s.success()), "python3 -m venv failed: the SDK tests need python3 with venv");
    let pip = std::process::Command::new(venv.join("bin/pip")).args(["install", "--quiet", "openai"]).status();
    assert!(
        pip.is_ok_and(|s| s.success()) && has_sdk(&python),
        "pip install openai failed: the SDK tests need the official openai SDK (or PDMESH_OPENAI_PYTHON)"
    );
    python
}

/// Run `tests/py/<script>` with the openai SDK's Python ([`openai_python`]) against `base_url`;
/// it must exit 0 and print `OK`. Returns its stdout (the figures it prints).
pub fn run_sdk_script(script: &str, base_url: &str) -> String {
    let python = openai_python();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py").join(script);
    let out = std::process::Command::new(&python).arg(&path).arg(base_url).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("OK"), "{script} failed:\n{stdout}\n{stderr}");
    stdout.into_owned()
}

/// An answer's text and completion tokens from the node or router on `port`, streamed (the SSE
/// deltas joined, usage included) or not; a non-200 answer or an error event fails the test.
pub fn answer(port: u16, path: &str, body: &serde_json::Value, stream: bool) -> (String, u64) {
    use serde_json::{json, Value};
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
    let url = format!("http://127.0.0.1:{port}{path}");
    let mut b = body.clone();
    if stream {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    let r = client.post(&url).json(&b).send().unwrap();
    assert_eq!(r.status().as_u16(), 200, "{path} on :{port}");
    if !stream {
        let v: Value = r.json().unwrap();
        let c = &v["choices"][0];
        let text = c["text"].as_str().or(c["message"]["content"].as_str()).unwrap_or("").to_string();
        return (text, v["usage"]["completion_tokens"].as_u64().unwrap());
    }
    let (mut text, mut tokens) = (String::new(), 0);
    for e in sse_events(&r.text().unwrap()) {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if let Some(c) = v["choices"].get(0) {
            text.push_str(c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or(""));
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        }
    }
    (text, tokens)
}

/// Sixteen greedy requests for a code model: eight completions and eight chats, of 12 to 19
/// tokens each (`(path, body)`).
pub fn mixed_requests() -> Vec<(&'static str, serde_json::Value)> {
    use serde_json::json;
    let completions = [
        "The capital of France is",
        "def quicksort(arr):\n",
        "// A function in Rust that reverses a string\nfn reverse(",
        "Once upon a time, in a small village by the sea,",
        "1, 2, 3, 5, 8, 13, 21,",
        "SELECT name FROM users WHERE",
        "The three primary colours are",
        "import numpy as np\n\n# compute the mean of a list\n",
    ];
    let chats = [
        "What is the capital of France?",
        "Write a Python function that returns the square of a number.",
        "Explain what a hash map is in one sentence.",
        "Name three programming languages.",
        "What does HTTP stand for?",
        "Write a haiku about the ocean.",
        "How do I reverse a list in Python?",
        "Translate 'good morning' into French.",
    ];
    let mut bodies = Vec::new();
    for (i, p) in completions.iter().enumerate() {
        bodies.push(("/v1/completions", json!({"prompt": p, "max_tokens": 12 + i, "temperature": 0})));
    }
    for (i, c) in chats.iter().enumerate() {
        bodies.push((
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": c}], "max_tokens": 12 + i, "temperature": 0}),
        ));
    }
    bodies
}
