//! Fail-over on the scale-out shape (D55, D56): a router over 2 P and 2 D nodes (tcp KV
//! backend, synthetic executor, greedy), started by one `pdmesh up --no-restart` so nothing
//! comes back behind the test's back.
//!
//! 1. 16 concurrent streams of 64 tokens run undisturbed: the reference texts.
//! 2. The same 16 again; once every stream has tokens, every process of one D node gets
//!    SIGKILL. Every stream still ends with 64 tokens, finish reason `length` and the
//!    reference text (the router moved the broken ones to the other D with the tokens already
//!    streamed), and the router counted migrations.
//! 3. Every process of one P node gets SIGKILL, then the same 16 start at once: the prefills
//!    sent to the dead P are retried on the other P; every stream again equals the reference,
//!    the router counted prefill retries and ejected the dead P.
//!
//! The router's `/load` polling is off here (`load_poll_ms = 0`), so it learns of the dead
//! nodes from failed requests alone: the retry, migration and ejection paths run every time.
//!
//! In the end the surviving nodes hold and use no KV block.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{metric, reserve_ports, scaleout_topology, Mesh};
use serde_json::{json, Value};

const STREAMS: usize = 16;
const TOKENS: usize = 64;
/// A per-token cost so that 8 streams of 64 tokens on one D last a few seconds.
const SETTINGS: &str =
    "model = { kind = \"synthetic\", per_token_cost_us = 3000 }\nengine = { block_size = 4, num_blocks = 1024 }";

/// What one stream gave the client.
#[derive(Debug, Clone, PartialEq)]
struct Streamed {
    text: String,
    finish_reason: Option<String>,
    completion_tokens: Option<u64>,
    errors: Vec<String>,
}

/// One greedy stream of `TOKENS` tokens; `started` counts streams that received text.
fn stream_one(url: &str, i: usize, started: &AtomicUsize) -> Streamed {
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let body = json!({"prompt": format!("fail-over stream {i}: once upon a time"), "max_tokens": TOKENS,
                      "temperature": 0, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = client.post(url).json(&body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200, "stream {i}");
    let mut out = Streamed { text: String::new(), finish_reason: None, completion_tokens: None, errors: vec![] };
    let mut counted = false;
    for line in BufReader::new(r).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        assert!(v.get("pdmesh_token_ids").is_none(), "the router's internal field reached the client: {v}");
        if let Some(m) = v["error"]["message"].as_str() {
            out.errors.push(m.to_string());
            continue;
        }
        if let Some(t) = v["choices"][0]["text"].as_str() {
            out.text.push_str(t);
            if !t.is_empty() && !counted {
                counted = true;
                started.fetch_add(1, Ordering::SeqCst);
            }
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            out.finish_reason = Some(f.to_string());
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            out.completion_tokens = Some(n);
        }
    }
    out
}

/// Run the 16 streams at once; `during` runs once `wait_started` of them have text.
fn burst(url: &str, wait_started: usize, during: impl FnOnce()) -> Vec<Streamed> {
    let started = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..STREAMS)
        .map(|i| {
            let (url, started) = (url.to_string(), started.clone());
            std::thread::spawn(move || stream_one(&url, i, &started))
        })
        .collect();
    common::wait_for("streams have started", || started.load(Ordering::SeqCst) >= wait_started);
    during();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// SIGKILL every process of `node` (from the process table); returns how many.
fn kill_node(mesh: &Mesh, node: &str) -> usize {
    let pids: Vec<i32> = mesh
        .processes()
        .iter()
        .filter(|p| p["node"] == node)
        .filter_map(|p| p["pid"].as_i64())
        .map(|p| p as i32)
        .collect();
    for &pid in &pids {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
    pids.len()
}

fn check_all(got: &[Streamed], reference: &[Streamed], what: &str) {
    for (i, (g, r)) in got.iter().zip(reference).enumerate() {
        assert!(g.errors.is_empty(), "{what}: stream {i} got errors {:?}", g.errors);
        assert_eq!(g.finish_reason.as_deref(), Some("length"), "{what}: stream {i}");
        assert_eq!(g.completion_tokens, Some(TOKENS as u64), "{what}: stream {i}");
        assert_eq!(g.text, r.text, "{what}: stream {i} differs from the undisturbed run");
    }
}

#[test]
fn killing_a_decode_node_then_a_prefill_node_loses_no_stream() {
    let (r1, r2) = (reserve_ports(), reserve_ports());
    let run_dir = std::env::temp_dir().join(format!("pdmesh-failover-{}-{}", std::process::id(), r1.0));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).unwrap();
    let (text, ports) = scaleout_topology(&run_dir, r1, r2, SETTINGS, "load_poll_ms = 0");
    let ready: Vec<u16> = ports.p.iter().chain(&ports.d).copied().collect();
    let mesh = common::start_scaleout(&run_dir, &text, ports.router, r1.1, &ready);
    let url = format!("http://127.0.0.1:{}/v1/completions", ports.router);

    // 1. The undisturbed run.
    let reference = burst(&url, 0, || {});
    for (i, r) in reference.iter().enumerate() {
        assert!(r.errors.is_empty() && r.finish_reason.as_deref() == Some("length"), "reference {i}: {r:?}");
        assert_eq!(r.completion_tokens, Some(TOKENS as u64));
        assert_eq!(r.text.len(), TOKENS, "one byte per synthetic token");
    }
    let before = metric(ports.router, "pdmesh_router_migrations_total", "");
    assert_eq!(before, 0.0, "nothing moved in the undisturbed run");

    // 2. SIGKILL every process of decode-a mid-stream.
    let got = burst(&url, STREAMS, || {
        let killed = kill_node(&mesh, "d-a");
        assert!(killed >= 3, "d-a's frontend, dp-lb and engine processes");
        eprintln!("killed {killed} processes of d-a");
    });
    check_all(&got, &reference, "d-a killed");
    let moved = metric(ports.router, "pdmesh_router_migrations_total", "");
    eprintln!("migrations: {moved}");
    assert!(moved >= 1.0, "streams on d-a moved to d-b");

    // 3. SIGKILL every process of prefill-a, then the 16 streams at once.
    assert!(kill_node(&mesh, "p-a") >= 3);
    let got = burst(&url, 0, || {});
    check_all(&got, &reference, "p-a killed");
    let retries = metric(ports.router, "pdmesh_router_prefill_retries_total", "");
    let ejected = metric(ports.router, "pdmesh_router_ejections_total", &format!(":{}\"", ports.p[0]));
    eprintln!("prefill retries: {retries}, ejections of p-a: {ejected}");
    assert!(retries >= 1.0, "prefills sent to the dead p-a were retried on p-b");
    assert!(ejected >= 1.0, "p-a was ejected after failures in a row");
    // Once ejected, p-a gets nothing: a last request goes straight to p-b.
    let last = stream_one(&url, 0, &AtomicUsize::new(0));
    assert_eq!(last.text, reference[0].text);

    // Nothing stays held on the survivors.
    for port in ports.p.iter().skip(1) {
        mesh.wait_kv_on(*port, "P holds nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    }
    mesh.wait_kv_on(ports.d[1], "D's blocks are free", |kv| kv["used_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"));
    drop(mesh);
    let _ = std::fs::remove_dir_all(&run_dir);
}
