//! A decode node that turns slow mid-stream (issue 44, D104), on the real model: a router over
//! 2 P and 2 D nodes of SmolLM2-135M-Instruct (tcp KV backend), started by one
//! `pdmesh up --no-restart`. Each D's executor carries the fault
//! `step_delay_ms=SLOW_MS,step_delay_while=<run dir>/slow-<node>`: full speed until the test
//! creates that file, then every forward pass SLOW_MS slower.
//!
//! 1. The router probes both D nodes before any request (they are not measured yet).
//! 2. One greedy stream of `TOKENS` tokens runs undisturbed: the reference text.
//! 3. The same stream again; once it has text, the D running it is slowed (its file created).
//!    The router finds the stream's gaps far above the other D's and moves it there with the
//!    tokens already streamed (`pdmesh_router_migrations_total{reason="slow_stream"}`): the
//!    client's one stream ends with `TOKENS` tokens, finish reason `length` and the reference
//!    text, and the slowed node is left out (`pdmesh_router_upstream_slow` = 1).
//! 4. Requests sent while it is slow never go to it: its decode picks do not move.
//! 5. Its file removed, a probe finds it fast: it is back in rotation without any user's
//!    request spent on it.
//!
//! Every P and D ends holding and using no KV block. Nothing here measures time: the slowed
//! node is told apart by a delay far above a forward pass of this model.
//!
//! With PDMESH_SKIP_MODEL_TESTS=1 the same runs on the synthetic executor (its greedy text is
//! a deterministic function of the tokens, so the reference check holds there too). Run alone:
//! `cargo test --release -p pdmesh --test slow_decode_model -- --nocapture`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use common::failover::{busy_node, load_of, stream_greedy, Streamed};
use common::{metric, reserve_ports, topo, TopologyExt};
use serde_json::json;

/// Tokens of the stream: long enough that it is still running when the test slows its node
/// (a forward pass of this model is a few ms to a few tens of ms here; the test slows the node
/// as soon as the stream has text).
const TOKENS: u64 = 256;
/// Added to every forward pass of a slowed D: dozens of times a pass of this model.
const SLOW_MS: u64 = 300;

/// One greedy stream of `TOKENS` tokens; `started` becomes 1 once it has text.
fn stream(url: &str, started: &AtomicUsize) -> Streamed {
    stream_greedy(url, "A slow node must not show: once upon a time", TOKENS, started)
}

/// A short request (8 tokens) through the router, answered 200.
fn short(url: &str, i: usize) {
    let body = json!({"prompt": format!("request {i} while a node is slow"), "max_tokens": 8, "temperature": 0});
    let r = reqwest::blocking::Client::new().post(url).json(&body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().unwrap_or_default());
}

/// The node settings: the model (real or synthetic) with the switchable delay, whose file is
/// `<flags>/slow-<node>` (each node's own name).
fn settings<'a>(model: Option<&'a Path>, flags: &'a Path) -> impl FnMut(&mut topo::NodeConfig) + 'a {
    move |n| {
        match model {
            Some(path) => {
                n.model.kind = topo::ModelKind::Gguf;
                n.model.path = path.display().to_string();
                n.engine.num_blocks = 256;
                n.engine.max_model_len = 2048;
            }
            None => {
                n.model.per_token_cost_us = 3000;
                n.engine.block_size = 4;
                n.engine.num_blocks = 1024;
            }
        }
        n.model.fault_injection =
            format!("step_delay_ms={SLOW_MS},step_delay_while={}/slow-{}", flags.display(), n.name);
    }
}

#[test]
fn a_stream_on_a_decode_node_that_turns_slow_finishes_on_the_other_with_the_same_text() {
    let model = if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: on the synthetic executor");
        None
    } else {
        common::model_path()
    };
    let (r1, r2) = (reserve_ports(), reserve_ports());
    let run_dir = common::failover::fresh_run_dir("pdmesh-slow-decode", r1.0);
    let (t, ports) = topo::scaleout(r1, r2);
    let t = t.all_nodes(settings(model.as_deref(), &run_dir)).with_node("router", |n| {
        n.router.policy = topo::RoutingPolicy::LeastLoaded;
        n.router.slow_probe_ms = 300;
        n.router.slow_migrate_tokens = 4;
    });
    let ready: Vec<u16> = ports.p.iter().chain(&ports.d).copied().collect();
    let started = Instant::now();
    let mesh = common::start_scaleout(&run_dir, t, ports.router, r1.1, &ready);
    eprintln!("mesh ready in {:.1} s", started.elapsed().as_secs_f64());
    let url = format!("http://127.0.0.1:{}/v1/completions", ports.router);
    let decode = [("d-a".to_string(), ports.d[0]), ("d-b".to_string(), ports.d[1])];
    let upstream = |port: u16| format!("upstream=\"http://127.0.0.1:{port}\"");
    let slow_gauge = |port: u16| metric(ports.router, "pdmesh_router_upstream_slow", &upstream(port));
    let decode_picks = |port: u16| metric(ports.router, "pdmesh_router_picks_total", &upstream(port));

    // 1. Both D measured by the router's own probes, before any request.
    common::wait_for("both decode nodes probed", || {
        metric(ports.router, "pdmesh_router_probes_total", "outcome=\"fast\"") >= 2.0
    });
    assert_eq!(decode_picks(ports.d[0]) + decode_picks(ports.d[1]), 0.0, "probes are not picks");

    // 2. The undisturbed stream.
    let reference = stream(&url, &AtomicUsize::new(0));
    assert!(reference.errors.is_empty(), "{reference:?}");
    assert_eq!(reference.finish_reason.as_deref(), Some("length"));
    assert_eq!(reference.completion_tokens, Some(TOKENS));
    assert!(!reference.text.is_empty());
    assert_eq!(metric(ports.router, "pdmesh_router_migrations_total", ""), 0.0, "nothing moved undisturbed");

    // 3. The same stream; its D slowed once it has text.
    let picks: Vec<f64> = decode.iter().map(|(_, port)| decode_picks(*port)).collect();
    let flag = Arc::new(AtomicUsize::new(0));
    let handle = {
        let (url, flag) = (url.clone(), flag.clone());
        std::thread::spawn(move || stream(&url, &flag))
    };
    let mut slowed = None;
    common::wait_for("the stream has text and a decode node runs it", || {
        if flag.load(Ordering::SeqCst) == 0 {
            return false;
        }
        slowed = busy_node(&decode, |port| load_of(port)["running"].as_u64().unwrap_or(0));
        slowed.is_some()
    });
    let slowed = slowed.unwrap();
    let (slow_name, slow_port) = &decode[slowed];
    let (_, fast_port) = &decode[1 - slowed];
    std::fs::write(run_dir.join(format!("slow-{slow_name}")), b"").unwrap();
    eprintln!("{slow_name} slowed mid-stream");
    let got = handle.join().unwrap();
    assert!(got.errors.is_empty(), "the client saw an error: {got:?}");
    assert_eq!(got.finish_reason.as_deref(), Some("length"));
    assert_eq!(got.completion_tokens, Some(TOKENS), "no token missing or shown twice");
    assert_eq!(got.text, reference.text, "the moved stream's text is the undisturbed one");
    let moved = metric(ports.router, "pdmesh_router_migrations_total", "reason=\"slow_stream\"");
    assert_eq!(moved, 1.0, "the stream moved once, for being slow");
    assert_eq!(metric(ports.router, "pdmesh_router_migrations_total", ""), 1.0, "and for nothing else");
    assert_eq!(decode_picks(*slow_port), picks[slowed] + 1.0, "the stream started on {slow_name}");
    assert_eq!(decode_picks(*fast_port), picks[1 - slowed] + 1.0, "and finished on the other D");
    assert_eq!(slow_gauge(*slow_port), 1.0, "{slow_name} is left out");
    assert_eq!(slow_gauge(*fast_port), 0.0);
    assert!(metric(ports.router, "pdmesh_router_slow_left_out_total", &upstream(*slow_port)) >= 1.0);

    // 4. While it is slow, no request goes to it.
    let picks_before = decode_picks(*slow_port);
    for i in 0..4 {
        short(&url, i);
    }
    assert_eq!(decode_picks(*slow_port), picks_before, "no user's request on the slow node");
    assert_eq!(slow_gauge(*slow_port), 1.0, "its probes find it slow");

    // 5. Fast again: a probe brings it back, no user's request spent on it.
    std::fs::remove_file(run_dir.join(format!("slow-{slow_name}"))).unwrap();
    common::wait_for("a probe finds the node fast again", || slow_gauge(*slow_port) == 0.0);
    assert_eq!(decode_picks(*slow_port), picks_before, "brought back by a probe, not by a request");
    assert!(metric(ports.router, "pdmesh_router_probes_total", "outcome=\"slow\"") >= 1.0);

    // Nothing stays held.
    for port in ports.p.iter().chain(&ports.d) {
        mesh.wait_kv_on(*port, "the node holds and uses nothing", |kv| {
            kv["held_blocks"] == 0 && kv["used_blocks"] == 0
        });
    }
    assert!(!mesh.logs().contains("panicked"));
    drop(mesh);
    let _ = std::fs::remove_dir_all(&run_dir);
}
