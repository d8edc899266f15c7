//! Rule R3 on the real model: every injected transfer fault (`kv_transfer.fault_injection`,
//! the product's own fault injection, docs/KV_TRANSFER.md) follows `kv_load_failure_policy`.
//! Under `recompute` D prefills locally and the greedy output equals the fault-free output;
//! under `fail` that request gets a clear 5xx error and the next request on the same D is
//! served; no engine dies and P ends holding nothing.
//!
//! One mesh per fault: P (producer), D-recompute and D-fail (consumers), all on
//! SmolLM2-135M. The test plays the router's part itself (prefill on P with
//! `do_remote_decode`, then D with P's params), so each D can be addressed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use std::path::Path;

use common::topo::{
    self, HoldMode, KvLoadFailurePolicy::*, KvRole, ModelKind, NodeConfig, Topology, TransferBackendKind::Shm,
};
use common::{pd_engines, KvExt, Mesh, NodeExt};
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

/// The GGUF model at `path`: 64 blocks, prompts up to 512 tokens.
fn settings_for(path: &Path) -> impl Fn(&mut NodeConfig) + Copy + '_ {
    move |n| {
        n.model.kind = ModelKind::Gguf;
        n.model.path = path.display().to_string();
        n.engine.num_blocks = 64;
        n.engine.max_model_len = 512;
    }
}

/// P on `http+1`, D-recompute on `http+2`, D-fail on `http+3`. P holds under a 3 s lease so
/// that faults which keep D from notifying P end in an expiry the test can wait for.
/// `tp`: the tensor-parallel size of P and of both D nodes.
fn topology(http: u16, base: u16, model: &Path, p_faults: &str, d_faults: &str, tp: (u32, u32)) -> Topology {
    let side = common::side_ports(http);
    let kv = |role, port: u16, policy, faults: &str| {
        let mut kv = topo::kv(role, Shm, port).data_port(port + 1).failure_policy(policy).fault(faults);
        kv.hold_mode = HoldMode::Lease;
        kv.kv_lease_duration_s = 3;
        kv
    };
    let settings = settings_for(model);
    let (p_tp, d_tp) = tp;
    let p_settings = move |n: &mut NodeConfig| {
        settings(n);
        n.tensor_parallel_size = p_tp;
    };
    let d_settings = move |n: &mut NodeConfig| {
        settings(n);
        n.tensor_parallel_size = d_tp;
    };
    topo::topology([
        topo::prefill("p", http + 1, base + 20).with(p_settings).kv(kv(KvRole::KvProducer, side, Fail, p_faults)),
        topo::decode("drec", http + 2, base + 40).with(d_settings).kv(kv(
            KvRole::KvConsumer,
            side + 2,
            Recompute,
            d_faults,
        )),
        topo::decode("dfail", http + 3, base + 60).with(d_settings).kv(kv(
            KvRole::KvConsumer,
            side + 4,
            Fail,
            d_faults,
        )),
    ])
}

fn post(url: &str, request_id: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).header("X-Request-Id", request_id).json(body).send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// Sum of a metric's samples whose line contains every one of `filters`.
fn metric(url: &str, name: &str, filters: &[&str]) -> f64 {
    let text = reqwest::blocking::get(url).unwrap().text().unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && filters.iter().all(|f| l.contains(f)))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

const PROMPT: &str = "The quick brown fox jumps over the lazy dog. Then the dog wakes up and";

/// Where the fault is injected and what D must do.
#[derive(Clone, Copy, PartialEq)]
enum Side {
    P,
    D,
}

/// Run one fault. `fails`: the load fails (policy applies); otherwise the request succeeds
/// under either policy. `kind`: the failure kind D's worker counts.
fn scenario(fault: &str, side: Side, fails: bool, kind: &str) {
    let Some(model) = common::model_path() else { return };
    scenario_on(&model, fault, side, fails, kind);
}

fn scenario_on(model: &Path, fault: &str, side: Side, fails: bool, kind: &str) {
    scenario_tp(model, fault, side, fails, kind, (1, 1));
}

/// [`scenario_on`] with P and the D nodes at tensor-parallel sizes `tp` (D111).
fn scenario_tp(model: &Path, fault: &str, side: Side, fails: bool, kind: &str, tp: (u32, u32)) {
    let (p_faults, d_faults) = if side == Side::P { (fault, "") } else { ("", fault) };
    let mesh = Mesh::start_nodes(|h, b| topology(h, b, model, p_faults, d_faults, tp), pd_engines);
    let p = mesh.http_port + 1;
    let url = |port: u16| mesh.url_on(port, "/v1/completions");
    let plain = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0});
    let (status, reference) = post(&url(p), "reference", &plain);
    assert_eq!(status, 200, "{reference}");
    let want = reference["choices"][0]["text"].clone();

    for (i, (d, policy, d_base)) in
        [(p + 1, "recompute", mesh.base_port + 40), (p + 2, "fail", mesh.base_port + 60)].into_iter().enumerate()
    {
        let id = format!("fault-{i}");
        let prefill = json!({"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
        let (status, v) = post(&url(p), &id, &prefill);
        assert_eq!(status, 200, "{v}");
        let params = v["kv_transfer_params"].clone();
        assert!(params["remote_block_ids"].is_array(), "{params}");
        let worker_metrics = format!("http://127.0.0.1:{}/metrics", d_base + 112);
        let engine_metrics = format!("http://127.0.0.1:{}/metrics", d_base + 110);
        let failures_before = metric(&worker_metrics, "pdmesh_worker_kv_transfer_failures_total", &[kind]);

        let body = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "kv_transfer_params": params});
        let (status, v) = post(&url(d), &id, &body);
        if !fails || policy == "recompute" {
            assert_eq!(status, 200, "{fault} under {policy}: {v}");
            assert_eq!(
                v["choices"][0]["text"], want,
                "{fault} under {policy}: same greedy output as without the fault"
            );
        } else {
            assert!(status >= 500, "{fault} under fail: {status} {v}");
            let msg = v["error"]["message"].as_str().unwrap_or("");
            assert!(msg.contains("kv load failed"), "{fault}: a clear error: {v}");
        }
        let failures = metric(&worker_metrics, "pdmesh_worker_kv_transfer_failures_total", &[kind]) - failures_before;
        assert_eq!(failures, if fails { 1.0 } else { 0.0 }, "{fault} under {policy}: failures counted by kind {kind}");
        if fails && policy == "recompute" {
            assert!(metric(&engine_metrics, "pdmesh_engine_recomputed_tokens_total", &[]) > 0.0);
        }
        if fails && policy == "fail" {
            assert!(metric(&engine_metrics, "pdmesh_engine_kv_load_failed_requests_total", &[]) >= 1.0);
        }
        // The same D serves the next request.
        let (status, v) = post(&url(d), &format!("after-{i}"), &plain);
        assert_eq!(status, 200, "{fault}: D serves after the failure: {v}");
        assert_eq!(v["choices"][0]["text"], want);
        mesh.wait_kv_on(d, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    }
    // P frees everything: at once where D could tell it, else at the 3 s lease deadline.
    mesh.wait_kv_on(p, "P holds nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    if fault == "drop_read_done" {
        let p_worker = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 20 + 112);
        assert!(metric(&p_worker, "pdmesh_worker_kv_holds_expired_total", &[]) >= 2.0, "P freed at its deadline");
    }
    // Every engine is alive and nothing panicked.
    for port in [p, p + 1, p + 2] {
        let v: Value = reqwest::blocking::get(mesh.url_on(port, "/debug/engines")).unwrap().json().unwrap();
        assert!(v["unreachable_ranks"].as_array().is_some_and(|a| a.is_empty()), "{fault}: engines up on :{port}: {v}");
    }
    let logs = mesh.logs();
    assert!(!logs.contains("panicked"), "{fault}: a panic in the logs");
    let up_log = std::fs::read_to_string(mesh.run_dir.join("up.log")).unwrap_or_default();
    assert!(!up_log.contains("child process died"), "{fault}: a process died: {up_log}");
}

#[test]
fn handshake_timeout() {
    scenario("handshake_timeout", Side::P, true, "handshake");
}

#[test]
fn compat_hash_mismatch() {
    scenario("compat_mismatch", Side::P, true, "handshake");
}

#[test]
fn undecodable_handshake_metadata() {
    scenario("undecodable_metadata", Side::P, true, "handshake");
}

#[test]
fn engine_id_mismatch() {
    scenario("engine_id_mismatch", Side::P, true, "handshake");
}

#[test]
fn lease_refused() {
    scenario("lease_refused", Side::P, true, "lease");
}

#[test]
fn transfer_setup_error() {
    scenario("transfer_setup_error", Side::D, true, "read");
}

#[test]
fn transfer_fails_midway() {
    scenario("transfer_midway", Side::D, true, "read");
}

/// Rule R3 on Qwen2.5-0.5B (qwen2: another KV geometry, 24 layers x 2 KV heads): a transfer
/// that fails midway recomputes to the same text, or fails that request alone.
#[test]
fn qwen2_transfer_fails_midway() {
    let Some(model) = common::qwen_model_path() else { return };
    scenario_on(&model, "transfer_midway", Side::D, true, "read");
}

/// Rule R3 between tensor-parallel nodes (D111): P over 2 TP ranks, each D over 2 as well;
/// the ranks of a node share one KV cache, so the load is one read whatever the TP sizes, and a
/// failure midway recomputes to the same text, or fails that request alone.
#[test]
fn qwen2_transfer_fails_midway_between_tp_nodes() {
    let Some(model) = common::qwen_model_path() else { return };
    scenario_tp(&model, "transfer_midway", Side::D, true, "read", (2, 2));
}

#[test]
fn transfer_exception() {
    scenario("transfer_exception", Side::D, true, "exception");
}

#[test]
fn dropped_read_done_frees_at_the_deadline() {
    scenario("drop_read_done", Side::D, false, "read_done");
}

#[test]
fn delayed_transfer_still_loads() {
    scenario("delay_transfer_ms=300", Side::D, false, "read");
}
