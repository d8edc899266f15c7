//! Graceful stops (D47). Rule R4 at shutdown: a decode node that stops gracefully while it
//! still references P's blocks — requests queued for KV space, READs in flight under a lease —
//! gives every one back, so P frees them at once instead of at its 480 s hold deadline. And a
//! service stopped by SIGTERM with nothing left to drain exits 0, the status that tells a
//! clean stop from one past the shutdown deadline (124) and a failure (1).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::topo::{self, HoldMode, KvRole, NodeConfig, Topology, TransferBackendKind::Shm};
use common::{pd_engines, KvExt, Mesh, NodeExt};
use serde_json::{json, Value};

/// P and D only (this test plays the router). D's READs stall (`delay_transfer_ms`, D's own
/// fault injection), and D has room for two prompts' KV: the first two requests wait under a
/// lease, the next four wait for space. Prefix caching is off on both: the six requests share
/// their prompt's opening, and the counts below are of blocks each request holds alone.
fn topology(http: u16, base: u16) -> Topology {
    let side = common::side_ports(http);
    let no_prefix_cache = |n: &mut NodeConfig| n.engine.enable_prefix_caching = false;
    topo::topology([
        topo::prefill("p", http, base + 20).blocks(4, 256).with(no_prefix_cache).kv(topo::kv(
            KvRole::KvProducer,
            Shm,
            side,
        )
        .hold_mode(HoldMode::Fixed)),
        topo::decode("d", http + 1, base + 40).blocks(4, 24).with(no_prefix_cache).kv(topo::kv(
            KvRole::KvConsumer,
            Shm,
            side + 4,
        )
        .hold_mode(HoldMode::Fixed)
        .fault("delay_transfer_ms=600000")),
    ])
}

fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::blocking::get(url).unwrap().text().unwrap();
    text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok()).sum()
}

#[test]
fn a_decode_node_stopping_gracefully_gives_p_its_blocks_back() {
    let mesh = Mesh::start_nodes(topology, |h| vec![h, h + 1]);
    let (p, d) = (mesh.http_port, mesh.http_port + 1);
    let p_worker = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 20 + 112);
    let d_worker = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 40 + 112);
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();

    // P prefills six requests (11 blocks each) and holds them for D; D gets each one.
    for i in 0..6 {
        let id = format!("sd-{i}");
        let prompt = format!("shutdown {i}: {}", "x".repeat(30));
        let r = client
            .post(mesh.url_on(p, "/v1/completions"))
            .header("X-Request-Id", &id)
            .json(&json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}))
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let params = r.json::<Value>().unwrap()["kv_transfer_params"].clone();
        assert_eq!(params["do_remote_prefill"], true, "{params}");
        let url = mesh.url_on(d, "/v1/completions");
        // D never answers before it stops: the client's outcome is not what this test is about.
        std::thread::spawn(move || {
            let c = reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
            let _ = c
                .post(url)
                .header("X-Request-Id", id)
                .json(&json!({"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}))
                .send();
        });
    }
    // Parked: two READs stalled under a lease, four requests queued for D's KV space; D's
    // worker references all six.
    mesh.wait_kv_on(p, "P holds six requests, two of them leased", |kv| {
        kv["held_requests"].as_array().is_some_and(|h| h.len() == 6) && kv["leased_blocks"].as_u64() == Some(22)
    });
    common::wait_for("D's worker references all six", || {
        metric(&d_worker, "pdmesh_worker_kv_remote_references") == 6.0
    });
    let held_before = mesh.kv_on(p)["held_blocks"].as_u64().unwrap();
    assert_eq!(held_before, 66);

    // Stop node D gracefully: SIGTERM to each of its processes, as `pdmesh up` does at shutdown.
    for proc in mesh.processes().iter().filter(|pr| pr["node"] == "d") {
        let pid = proc["pid"].as_i64().unwrap() as i32;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
    }

    // P frees everything at once: the hold deadline is 480 s and the leases' 10 s, and no
    // hold or lease expired, so only D's give-ups can have done it.
    mesh.wait_kv_on(p, "P holds and uses nothing after D stopped", |kv| {
        kv["held_blocks"] == 0 && kv["used_blocks"] == 0
    });
    assert_eq!(metric(&p_worker, "pdmesh_worker_kv_holds_expired_total"), 0.0, "nothing reached a deadline");
    let given_up = metric(&p_worker, "pdmesh_worker_kv_held_block_seconds_total{released_by=\"given_up\"}");
    assert!(given_up > 0.0, "released by D's give-ups");
    assert!(mesh.logs().contains("shutting down: giving P's blocks back"));
    assert!(!mesh.logs().contains("panicked"), "a panic in the logs");
    // D's worker gave its blocks back within the deadline: `pdmesh up` saw a clean stop.
    common::wait_for("up reports D's worker stopped", || {
        std::fs::read_to_string(mesh.run_dir.join("up.log")).unwrap_or_default().contains("d.connector-worker.0")
    });
    let up_log = std::fs::read_to_string(mesh.run_dir.join("up.log")).unwrap();
    let line = up_log.lines().find(|l| l.contains("d.connector-worker.0") && l.contains("pdmesh up:")).unwrap();
    assert!(line.contains(" stopped: exit status: 0"), "{line}");
}

/// `pdmesh dp-lb` on its own, stopped by SIGTERM: with nothing in flight its stop is clean,
/// so it exits 0 and says so. Fails if the signal were not fed to the service's shutdown
/// handle (no exit), if the stop overran the deadline (124) or failed (1), or if the exit
/// status did not tell them apart.
#[test]
fn a_service_stopped_by_sigterm_exits_cleanly() {
    let (http, base) = common::reserve_ports();
    let (run_dir, topology) = common::one_node_run_dir("pdmesh-clean-stop", http, base, |_| {});
    let log = run_dir.join("dp-lb.log");
    let mut child = std::process::Command::new(common::pdmesh_bin())
        .args(["dp-lb", "--node", "main", "--topology"])
        .arg(&topology)
        .env("PDMESH_RUN_DIR", &run_dir)
        .env("RUST_LOG", "info")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let live = format!("http://127.0.0.1:{}/live", base + 100);
    common::wait_for("the dp-lb serving /live", || reqwest::blocking::get(&live).is_ok_and(|r| r.status() == 200));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let mut status = None;
    common::wait_for("the dp-lb exits after SIGTERM", || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.unwrap().code(), Some(0), "{text}");
    assert!(text.contains("stopped cleanly"), "{text}");
    let _ = std::fs::remove_dir_all(&run_dir);
}

/// Issue 42: `pdmesh up` stops front to back (D108). Eight streams in flight through the
/// router when `pdmesh up` gets Ctrl-C (SIGINT) all finish whole — every token, the usage chunk
/// and `[DONE]` — because the router drains while P and D still serve, and the workers stop
/// last; then `pdmesh up` exits 0, every child it started is gone, and every engine logs
/// that it stopped using, holding and leasing no KV block. Before, every child got the signal
/// at once (a terminal's Ctrl-C reached the whole process group), D's engine stopped under
/// the streams and they ended in error events.
#[test]
fn eight_streams_in_flight_at_ctrl_c_finish_whole() {
    use std::io::Read;
    const STREAMS: usize = 8;
    // 60 tokens at 40 ms a step: the streams are still running when the signal comes.
    let settings = |n: &mut NodeConfig| {
        n.model.per_step_cost_us = 40000;
        n.engine.block_size = 4;
        n.engine.num_blocks = 256;
    };
    let mut mesh = Mesh::start_nodes(|h, b| common::pd_topology(h, b, Shm, 1, settings), pd_engines);
    let children: Vec<i32> = mesh.processes().iter().filter_map(|p| p["pid"].as_i64()).map(|p| p as i32).collect();
    assert!(children.len() >= 10, "router, P, D and the reference node's processes: {children:?}");
    let (first_token, got_first) = std::sync::mpsc::channel::<()>();
    let readers: Vec<_> = (0..STREAMS)
        .map(|i| {
            let (url, first_token) = (mesh.url("/v1/completions"), first_token.clone());
            std::thread::spawn(move || {
                let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
                let body = json!({"prompt": format!("stream {i} across the stop"), "max_tokens": 60,
                    "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
                let mut r = client.post(url).json(&body).send().unwrap();
                assert_eq!(r.status().as_u16(), 200);
                let (mut text, mut buf, mut signalled) = (String::new(), [0u8; 4096], false);
                loop {
                    let n = r.read(&mut buf).unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    text.push_str(&String::from_utf8_lossy(&buf[..n]));
                    if !signalled && text.contains("\"text\"") {
                        signalled = true;
                        first_token.send(()).unwrap();
                    }
                }
                text
            })
        })
        .collect();
    for _ in 0..STREAMS {
        got_first.recv_timeout(Duration::from_secs(60)).expect("every stream's first token");
    }
    let pid = nix::unistd::Pid::from_raw(mesh.up.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    for (i, reader) in readers.into_iter().enumerate() {
        let body = reader.join().unwrap();
        let events = common::sse_events(&body);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "stream {i}: {body}");
        assert!(!body.contains("\"error\""), "stream {i} ended in an error: {body}");
        let usage = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
            .unwrap_or_else(|| panic!("stream {i}: no usage chunk: {body}"));
        assert_eq!(usage["completion_tokens"], 60, "stream {i}: {body}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    let status = loop {
        if let Some(s) = mesh.up.try_wait().unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "pdmesh up did not stop after Ctrl-C");
        std::thread::sleep(Duration::from_millis(50));
    };
    let logs = mesh.logs();
    assert!(status.success(), "pdmesh up exited {status}: {logs}");
    for child in &children {
        let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*child), None).is_ok();
        assert!(!alive, "child {child} outlived pdmesh up");
    }
    // P, D and the reference node: each engine's last word on its pool
    let at_stop: Vec<&str> = logs.lines().filter(|l| l.contains("KV blocks at stop")).collect();
    assert_eq!(at_stop.len(), 3, "one line per engine rank: {at_stop:?}");
    for line in at_stop {
        for field in ["used_blocks=0", "held_blocks=0", "leased_blocks=0"] {
            assert!(line.contains(field), "{line}");
        }
    }
}
