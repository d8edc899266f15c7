//! Prefix caching on P and D (D51): vLLM's three P/D edge cases — a prompt shorter than one
//! block, a prompt D has fully cached, a longer prompt D has partly cached — give the same
//! greedy text as one colocated node, through the router and through a client that calls P
//! and then D itself. D reads only the blocks it lacks (nothing on a full hit), P is told at
//! once either way, and `usage.prompt_tokens_details.cached_tokens` reports the reused prefix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::topo::TransferBackendKind::Shm;
use common::Mesh;
use serde_json::{json, Value};

/// One D rank, so that D's cache is one cache; blocks of 4 tokens.
const BS: u64 = 4;

fn post(url: &str, body: &Value) -> Value {
    let r = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
        .post(url)
        .json(body)
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{url}");
    r.json().unwrap()
}

fn greedy(prompt: &str) -> Value {
    json!({"prompt": prompt, "max_tokens": 10, "temperature": 0})
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

/// Bytes D's worker has read from P so far.
fn d_read_bytes(mesh: &Mesh) -> u64 {
    let url = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 40 + 112);
    let metrics = reqwest::blocking::get(url).unwrap().text().unwrap();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("pdmesh_worker_kv_transfer_bytes_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// The three cases, in an order that makes D's cache hold what each needs: `short` (under a
/// block), `base` (read whole), `base` again (fully cached on D), `longer` (partly cached).
const SHORT: &str = "ab";
const BASE: &str = "a shared system prompt of several blocks";
const LONGER: &str = "a shared system prompt of several blocks, then a question";

/// Runs every case through `pd` (a function that answers one request the P/D way) and checks
/// text, bytes read and cached tokens against the colocated node.
fn check_cases(mesh: &Mesh, pd: impl Fn(&str) -> Value) {
    let colocated = mesh.url_on(mesh.http_port + 3, "/v1/completions");
    let p = mesh.http_port + 1;
    let read = |prompt: &str| {
        let before = d_read_bytes(mesh);
        let v = pd(prompt);
        let expected = post(&colocated, &greedy(prompt));
        assert_eq!(text(&v), text(&expected), "P/D vs colocated for {prompt:?}");
        // P frees at once in every case (its hold deadline is minutes away).
        mesh.wait_kv_on(p, "P freed the request's blocks", |kv| kv["held_blocks"] == 0);
        (v, d_read_bytes(mesh) - before)
    };
    let (short, short_bytes) = read(SHORT);
    assert!(short_bytes > 0, "a prompt under one block is read from P");
    assert_eq!(cached(&short), 0);

    let (first, first_bytes) = read(BASE);
    assert!(first_bytes > 0);
    let n = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(n > 3 * BS, "the base prompt spans several blocks ({n} tokens)");
    assert_eq!(cached(&first), 0, "D had nothing cached yet");

    let (again, again_bytes) = read(BASE);
    assert_eq!(again_bytes, 0, "D has the prompt cached: it reads nothing");
    assert_eq!(cached(&again), (n - 1) / BS * BS, "every block but the last token's is reused");

    let (longer, longer_bytes) = read(LONGER);
    let m = longer["usage"]["prompt_tokens"].as_u64().unwrap();
    // The tokenizer is byte-level: the longer prompt starts with every token of the base one.
    assert_eq!(cached(&longer), n / BS * BS, "the base prompt's full blocks are reused");
    let per_block = first_bytes / n.div_ceil(BS);
    assert_eq!(
        longer_bytes,
        per_block * (m.div_ceil(BS) - n / BS),
        "only the blocks D lacks are read ({m} tokens, {} cached)",
        n / BS * BS
    );
}

#[test]
fn pd_edge_cases_through_the_router() {
    let mesh = Mesh::start_nodes(|h, b| common::pd_topology(h, b, Shm, 1, common::blocks(4, 512)), common::pd_engines);
    let router = mesh.url("/v1/completions");
    check_cases(&mesh, |prompt| post(&router, &greedy(prompt)));
    // P skipped its own cached prefix too: the same prompts hit P's cache.
    // The engine's own metrics page: P's node base (base_port + 20) plus the engine's ops offset.
    let p_engine_metrics = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 20 + 110);
    let metrics = reqwest::blocking::get(p_engine_metrics).unwrap().text().unwrap();
    let hits: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("pdmesh_engine_prefix_cache_hits_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64);
    assert!(hits > 0, "P reused its cached prefix");
    mesh.wait_kv_on(mesh.http_port + 2, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    assert!(mesh.kv_on(mesh.http_port + 2)["cached_blocks"].as_u64().unwrap() > 0, "D keeps its cache");
    assert!(!mesh.logs().contains("panicked"));
}

#[test]
fn pd_edge_cases_through_a_client_that_calls_p_then_d() {
    let mesh = Mesh::start_nodes(|h, b| common::pd_topology(h, b, Shm, 1, common::blocks(4, 512)), common::pd_engines);
    let (p, d) =
        (mesh.url_on(mesh.http_port + 1, "/v1/completions"), mesh.url_on(mesh.http_port + 2, "/v1/completions"));
    check_cases(&mesh, |prompt| {
        let mut prefill = greedy(prompt);
        prefill["max_tokens"] = json!(1);
        prefill["kv_transfer_params"] = json!({"do_remote_decode": true});
        let params = post(&p, &prefill)["kv_transfer_params"].clone();
        assert!(params["remote_block_ids"].is_array(), "{params}");
        let mut decode = greedy(prompt);
        decode["kv_transfer_params"] = params;
        post(&d, &decode)
    });
    mesh.wait_kv_on(mesh.http_port + 2, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"));
}
