//! The lifecycle's holes around request ids and refusals on the real mesh: a reused
//! `X-Request-Id` never aliases or leaks P's blocks (R5), and every refusal on D — inside its
//! engine, with no engine rank connected, or for a rank it does not have — frees P at once
//! (R1). P holds with a 480 s deadline here, so only a notice can free it within the test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::topo::TransferBackendKind::Shm;
use common::{Mesh, TopologyExt};
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap()
}

fn post(url: &str, headers: &[(&str, &str)], body: &Value) -> (u16, Value) {
    let mut rb = client().post(url).json(body);
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    let r = rb.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// The P/D test mesh (router, P, D with `d_ranks` ranks, colocated reference; 512 blocks of 4
/// tokens) with `d_fault` as the fault injection of D's engine.
fn mesh(d_ranks: u32, d_fault: &'static str, up_args: &'static [&'static str]) -> Mesh {
    let topology = move |h, b| {
        common::pd_topology(h, b, Shm, d_ranks, common::blocks(4, 512))
            .with_node("d", |d| d.engine.fault_injection = d_fault.into())
    };
    let options = common::UpOptions { args: up_args.iter().map(|a| a.to_string()).collect(), ..Default::default() };
    Mesh::start_nodes_with(topology, common::pd_engines, &options)
}

/// Prefill `prompt` on P for a remote decode; P's params.
fn prefill(mesh: &Mesh, request_id: &str, prompt: &str) -> Value {
    let body = json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let (status, v) = post(&mesh.url_on(mesh.http_port + 1, "/v1/completions"), &[("X-Request-Id", request_id)], &body);
    assert_eq!(status, 200, "{v}");
    v["kv_transfer_params"].clone()
}

fn decode_body(prompt: &str, params: &Value) -> Value {
    json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "kv_transfer_params": params})
}

fn p_holds(mesh: &Mesh) -> u64 {
    mesh.kv_on(mesh.http_port + 1)["held_blocks"].as_u64().unwrap()
}

/// A client (or a proxy's retry) that sends the same `X-Request-Id` twice gets two engine
/// requests: P holds each one's blocks under its own id, D reads each prompt's own KV (the
/// synthetic model derives its tokens from the KV it reads, so aliased blocks would give the
/// other prompt's text), and everything is freed afterwards. Before engine ids were made
/// unique, the second hold overwrote the first in P's held map and the first prompt's blocks
/// stayed used forever.
#[test]
fn a_reused_request_id_never_aliases_or_leaks_ps_blocks() {
    let mesh = mesh(1, "", &[]);
    let (p, d, c) = (mesh.http_port + 1, mesh.http_port + 2, mesh.http_port + 3);
    let prompts = ["the first prompt under a reused id", "a second, different and longer prompt, same id"];
    let params: Vec<Value> = prompts.iter().map(|prompt| prefill(&mesh, "reused", prompt)).collect();
    let ids: Vec<&str> = params.iter().map(|p| p["remote_request_id"].as_str().unwrap()).collect();
    assert_ne!(ids[0], ids[1], "two holds, two ids: {ids:?}");
    assert!(ids.iter().all(|id| id.starts_with("reused-")), "the client's id stays visible: {ids:?}");
    assert!(p_holds(&mesh) > 0);
    for (prompt, params) in prompts.iter().zip(&params) {
        let (status, v) =
            post(&mesh.url_on(d, "/v1/completions"), &[("X-Request-Id", "reused")], &decode_body(prompt, params));
        assert_eq!(status, 200, "{v}");
        let (_, expected) = post(
            &mesh.url_on(c, "/v1/completions"),
            &[],
            &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
        );
        assert_eq!(v["choices"][0]["text"], expected["choices"][0]["text"], "D read {prompt:?}'s own KV");
        assert_eq!(v["id"], "cmpl-reused");
    }
    mesh.wait_kv_on(p, "P freed both holds", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    mesh.wait_kv_on(d, "D freed everything", |kv| kv["used_blocks"] == 0);
}

/// A remote-prefill request that D's engine refuses after the dp-lb accepted it (driven by the
/// engine's own fault injection, the path a request the pool cannot hold takes) gets a 400
/// naming the reason, and P frees its blocks at once. Before, only refusals in D's frontend
/// told P.
#[test]
fn a_refusal_inside_ds_engine_frees_p_at_once() {
    let mesh = mesh(1, "refuse_admission_every=1", &[]);
    let params = prefill(&mesh, "refused-in-engine", "a prompt whose decode D's engine refuses");
    assert!(p_holds(&mesh) > 0);
    let (status, v) = post(
        &mesh.url_on(mesh.http_port + 2, "/v1/completions"),
        &[],
        &decode_body("a prompt whose decode D's engine refuses", &params),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("fault injection"), "{v}");
    mesh.wait_kv_on(mesh.http_port + 1, "P freed at once", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
}

/// With every engine rank of D down, D answers 503 "unavailable" and its rejection notice has
/// no rank to go to: the dp-lb keeps it and hands it to the first rank that connects, which
/// frees P — instead of dropping it and leaving P to its deadline.
#[test]
fn an_engine_unavailable_refusal_frees_p_once_a_rank_connects() {
    let mesh = mesh(1, "", &["--no-restart"]);
    let (p, d) = (mesh.http_port + 1, mesh.http_port + 2);
    let prompt = "a prompt for a decode node without engines";
    let params = prefill(&mesh, "no-engine", prompt);
    let held = p_holds(&mesh);
    assert!(held > 0);
    mesh.kill9_on("d", "engine-core", 0);
    common::wait_for("D reports no engine rank", || {
        client().get(mesh.url_on(d, "/health")).send().map(|r| r.status().as_u16() == 503).unwrap_or(false)
    });
    let (status, v) = post(&mesh.url_on(d, "/v1/completions"), &[], &decode_body(prompt, &params));
    assert_eq!(status, 503, "{v}");
    let d_dplb_metrics = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 40 + 100);
    common::wait_for("the notice waits in D's dp-lb", || {
        metric(&d_dplb_metrics, "pdmesh_dplb_rejection_notices_pending") == 1.0
    });
    assert_eq!(p_holds(&mesh), held, "nobody has told P yet");
    // D's engine comes back (started by hand: the mesh runs without restarts).
    let mut engine = Command::new(env!("CARGO_BIN_EXE_pdmesh"))
        .args(["engine-core", "--topology"])
        .arg(mesh.run_dir.join("test-topology.toml"))
        .args(["--node", "d", "--rank", "0"])
        .env("PDMESH_RUN_DIR", &mesh.run_dir)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(mesh.run_dir.join("manual-engine.log")).unwrap())
        .spawn()
        .unwrap();
    mesh.wait_kv_on(p, "P freed once D's rank connected", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    assert_eq!(metric(&d_dplb_metrics, "pdmesh_dplb_rejection_notices_pending"), 0.0);
    let _ = engine.kill();
    let _ = engine.wait();
}

/// P and D have their own data-parallel ranks: through the router, `X-data-parallel-rank`
/// (or `X-Decode-Data-Parallel-Rank`) pins D's rank only and `X-Prefill-Data-Parallel-Rank`
/// P's. A rank a node does not have is a 400 naming the range, and a remote-prefill request
/// refused for it still frees P at once.
#[test]
fn data_parallel_ranks_are_per_leg_and_a_rank_out_of_range_is_refused() {
    let mesh = mesh(2, "", &[]);
    let (router, p, d) = (mesh.url("/v1/completions"), mesh.http_port + 1, mesh.http_port + 2);
    let body = json!({"prompt": "pinned", "max_tokens": 4, "temperature": 0});
    // P has one rank, D two: rank 1 is D's (before, both legs got it and P refused).
    for header in ["X-data-parallel-rank", "X-Decode-Data-Parallel-Rank"] {
        let (status, v) = post(&router, &[(header, "1")], &body);
        assert_eq!(status, 200, "{header}: {v}");
    }
    let (status, v) =
        post(&router, &[("X-Prefill-Data-Parallel-Rank", "0"), ("X-Decode-Data-Parallel-Rank", "0")], &body);
    assert_eq!(status, 200, "{v}");
    let (status, v) = post(&router, &[("X-Prefill-Data-Parallel-Rank", "1")], &body);
    assert_eq!(status, 400, "P has no rank 1: {v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("out of range"), "{v}");
    // Straight to D with P's params and a rank D does not have.
    let params = prefill(&mesh, "bad-rank", "a prompt pinned to a rank D lacks");
    assert!(p_holds(&mesh) > 0);
    let (status, v) = post(
        &mesh.url_on(d, "/v1/completions"),
        &[("X-data-parallel-rank", "7")],
        &decode_body("a prompt pinned to a rank D lacks", &params),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("out of range"), "{v}");
    mesh.wait_kv_on(p, "P freed at once", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    mesh.wait_kv_on(d, "D holds nothing", |kv| kv["used_blocks"] == 0);
}

/// One unlabelled sample of a Prometheus text page (NaN when absent or unreachable).
fn metric(url: &str, name: &str) -> f64 {
    let text = client().get(url).send().and_then(|r| r.text()).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(f64::NAN)
}
