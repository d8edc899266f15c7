//! Tensor parallelism through the whole node (D111): Qwen2.5-Coder-0.5B (14 heads, 2 KV heads)
//! served by a node with `tensor_parallel_size = 2` — its worker and a TP peer process, each
//! with half of every layer and one KV head, gathering over shared memory — beside a node with
//! one worker, on the same file.
//!
//! - 16 prompts, completions and chat, streamed and not: the TP node's answers equal the
//!   one-worker node's, token for token (`shared/model/tests/tensor_parallel.rs` shows the
//!   logits are bit-equal), and its pool ends empty;
//! - a TP peer killed mid-stream: the stream ends with an error event (no hang), the group
//!   restarts as a whole (a fresh worker and a fresh peer), and the node answers as before.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{answer, sse_events, topo, Mesh, TopologyExt};
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap()
}

/// A one-worker node `one` (on `http`) and a TP-2 node `two` (on `http + 1`) on the file.
fn mesh(path: &std::path::Path) -> Mesh {
    Mesh::start_nodes(
        |http, base| {
            topo::topology([topo::colocated("one", http, base), topo::colocated("two", http + 1, base + 40)])
                .engine_nodes(common::gguf(path, 128, 1024))
                .with_node("two", |n| n.tensor_parallel_size = 2)
        },
        |http| vec![http, http + 1],
    )
}

/// pids of this node's TP peer processes (`pdmesh tp-peer --node NAME`).
fn tp_peers(node: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let args: Vec<String> = cmd.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        if args.iter().any(|a| a == "tp-peer") && args.windows(2).any(|w| w[0] == "--node" && w[1] == node) {
            pids.push(pid);
        }
    }
    pids
}

#[test]
fn qwen2_over_two_tp_ranks_answers_as_one_worker_and_survives_a_lost_peer() {
    let Some(path) = common::qwen_model_path() else { return };
    let mesh = mesh(&path);
    let (one, two) = (mesh.http_port, mesh.http_port + 1);
    assert_eq!(tp_peers("two").len(), 1, "the TP-2 node runs one peer beside its worker");
    assert!(tp_peers("one").is_empty());

    let bodies = common::mixed_requests();
    assert_eq!(bodies.len(), 16);
    for (i, (path, body)) in bodies.iter().enumerate() {
        let stream = i % 2 == 1;
        let want = answer(one, path, body, stream);
        let got = answer(two, path, body, stream);
        assert!(want.1 > 0 && !want.0.is_empty(), "the one-worker node answered {path} {body}: {want:?}");
        assert_eq!(got, want, "{path} (stream {stream}) {body}");
    }
    mesh.wait_kv_on(two, "the TP node's pool is empty", |kv| kv["used_blocks"] == 0);

    // A peer killed while a stream is decoding: the stream ends with an error, never hangs.
    let long = json!({"prompt": "Write a long story about a dragon.", "max_tokens": 400, "temperature": 0,
        "ignore_eos": true, "stream": true});
    let url = format!("http://127.0.0.1:{two}/v1/completions");
    let r = client().post(&url).json(&long).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut reader = std::io::BufReader::new(r);
    let mut line = String::new();
    while !line.starts_with("data:") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut reader, &mut line).unwrap() > 0, "the stream started");
    }
    let old_worker = mesh.pid_on("two", "connector-worker", 0);
    let peer = tp_peers("two")[0];
    rustix::process::kill_process(rustix::process::Pid::from_raw(peer).unwrap(), rustix::process::Signal::KILL)
        .unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut reader, &mut rest).unwrap();
    let events = sse_events(&rest);
    assert!(
        events.iter().any(|e| e.contains("\"error\"")),
        "the broken stream ends with an error event: {}",
        &rest[rest.len().saturating_sub(400)..]
    );

    // The group restarts whole and answers as before.
    let deadline = Instant::now() + Duration::from_secs(240);
    let (path0, body0) = &bodies[0];
    let want = answer(one, path0, body0, false);
    loop {
        let r = client().post(format!("http://127.0.0.1:{two}{path0}")).json(body0).send().unwrap();
        if r.status().as_u16() == 200 {
            let v: Value = r.json().unwrap();
            assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want.0, "after the restart");
            break;
        }
        assert!(Instant::now() < deadline, "the TP node did not come back: {}", r.status());
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_ne!(mesh.pid_on("two", "connector-worker", 0), old_worker, "rank 0 restarted with its peer");
    let peers = tp_peers("two");
    assert!(peers.len() == 1 && peers[0] != peer, "a fresh peer: {peers:?}");
    mesh.wait_kv_on(two, "the pool is empty after the lost step", |kv| kv["used_blocks"] == 0);
}

/// P/D between nodes of different tensor-parallel sizes: (P 2, D 1) over shared memory,
/// (P 1, D 2) over tcp, (P 2, D 2) over shared memory. A node's TP ranks share one KV cache
/// of every head, so P serves and D fills whole blocks whatever either's TP size; the router's
/// answers equal a colocated one-worker node's, and P and D end holding nothing.
#[test]
fn qwen2_pd_between_tp_sizes_equals_colocated() {
    use common::topo::TransferBackendKind::{Shm, Tcp};
    let Some(path) = common::qwen_model_path() else { return };
    let bodies = common::mixed_requests();
    for (p_tp, d_tp, backend, take) in [(2, 1, Shm, 16), (1, 2, Tcp, 8), (2, 2, Shm, 8)] {
        let mesh = Mesh::start_nodes(
            |h, b| {
                common::pd_topology(h, b, backend, 1, common::gguf(&path, 128, 1024))
                    .with_node("p", |n| n.tensor_parallel_size = p_tp)
                    .with_node("d", |n| n.tensor_parallel_size = d_tp)
            },
            common::pd_engines,
        );
        let (router, colocated) = (mesh.http_port, mesh.http_port + 3);
        for (i, (path, body)) in bodies.iter().enumerate().take(take) {
            let stream = i % 2 == 1;
            let want = answer(colocated, path, body, stream);
            let got = answer(router, path, body, stream);
            assert!(want.1 > 0, "the colocated node answered {path} {body}: {want:?}");
            assert_eq!(got, want, "P tp {p_tp}, D tp {d_tp} ({backend:?}): {path} (stream {stream}) {body}");
        }
        mesh.wait_kv_on(router + 1, "P holds nothing once D has read", |kv| {
            kv["held_blocks"] == 0 && kv["used_blocks"] == 0
        });
        mesh.wait_kv_on(router + 2, "D's blocks are free", |kv| kv["used_blocks"] == 0);
        assert!(!mesh.logs().contains("panicked"), "P tp {p_tp}, D tp {d_tp}: a panic in the logs");
    }
}

/// Rule R3 when a tensor-parallel rank fails mid-transfer (D111): P runs over 2 TP ranks; while
/// D's reads of four requests are in flight (slowed by `delay_transfer_ms`), P's TP peer is
/// killed, so P's whole group restarts and every lease D holds is gone. Each request is judged
/// exactly once, by D's policy: `recompute` answers P's own text, `fail` a clear error for that
/// request alone; both D nodes serve the next request, and nothing stays held or used on P or D.
#[test]
fn a_prefill_tp_peer_lost_while_d_reads_follows_the_load_failure_policy() {
    use common::topo::{HoldMode, KvLoadFailurePolicy, KvRole, TransferBackendKind::Shm};
    use common::{KvExt, NodeExt};
    let Some(path) = common::qwen_model_path() else { return };
    let mesh = Mesh::start_nodes(
        |http, base| {
            let side = common::side_ports(http);
            let kv = |role, port: u16, policy, faults: &str| {
                let mut kv = topo::kv(role, Shm, port).data_port(port + 1).failure_policy(policy).fault(faults);
                kv.hold_mode = HoldMode::Lease;
                kv.kv_lease_duration_s = 3;
                kv
            };
            let settings = common::gguf(&path, 128, 1024);
            topo::topology([
                topo::prefill("p", http + 1, base + 20).with(settings).with(|n| n.tensor_parallel_size = 2).kv(kv(
                    KvRole::KvProducer,
                    side,
                    KvLoadFailurePolicy::Fail,
                    "",
                )),
                topo::decode("drec", http + 2, base + 40).with(settings).kv(kv(
                    KvRole::KvConsumer,
                    side + 2,
                    KvLoadFailurePolicy::Recompute,
                    "delay_transfer_ms=2000",
                )),
                topo::decode("dfail", http + 3, base + 60).with(settings).kv(kv(
                    KvRole::KvConsumer,
                    side + 4,
                    KvLoadFailurePolicy::Fail,
                    "delay_transfer_ms=2000",
                )),
            ])
        },
        common::pd_engines,
    );
    let (p, drec, dfail) = (mesh.http_port + 1, mesh.http_port + 2, mesh.http_port + 3);
    let url = |port: u16| format!("http://127.0.0.1:{port}/v1/completions");
    let prompts = ["The capital of France is", "def quicksort(arr):\n", "1, 2, 3, 5, 8,", "SELECT name FROM"];
    let plain = |p: &str| json!({"prompt": p, "max_tokens": 10, "temperature": 0});
    let want: Vec<String> = prompts
        .iter()
        .map(|pr| {
            let v: Value = client().post(url(p)).json(&plain(pr)).send().unwrap().json().unwrap();
            v["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect();
    // P prefills each (the router's first leg), then two go to each D, in flight together
    let legs: Vec<(u16, usize, Value)> = prompts
        .iter()
        .enumerate()
        .map(|(i, pr)| {
            let first = json!({"prompt": pr, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
            let v: Value = client().post(url(p)).json(&first).send().unwrap().json().unwrap();
            let params = v["kv_transfer_params"].clone();
            assert!(params["remote_block_ids"].is_array(), "{v}");
            let d = if i % 2 == 0 { drec } else { dfail };
            let mut body = plain(pr);
            body["kv_transfer_params"] = params;
            (d, i, body)
        })
        .collect();
    let answers: Vec<_> = legs
        .into_iter()
        .map(|(d, i, body)| {
            let u = url(d);
            std::thread::spawn(move || {
                let r = client().post(&u).json(&body).send().unwrap();
                let status = r.status().as_u16();
                (d, i, status, r.json::<Value>().unwrap_or(Value::Null))
            })
        })
        .collect();
    // the reads are in flight once both D nodes hold blocks for them
    let deadline = Instant::now() + Duration::from_secs(30);
    while [drec, dfail].iter().any(|&d| mesh.kv_on(d)["used_blocks"] == 0) {
        assert!(Instant::now() < deadline, "D's receives did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let peer = tp_peers("p");
    assert_eq!(peer.len(), 1, "P runs one TP peer");
    rustix::process::kill_process(rustix::process::Pid::from_raw(peer[0]).unwrap(), rustix::process::Signal::KILL)
        .unwrap();
    for a in answers {
        let (d, i, status, v) = a.join().unwrap();
        if d == drec {
            assert_eq!(status, 200, "recompute: {v}");
            assert_eq!(v["choices"][0]["text"], want[i], "recompute gives P's own text");
        } else {
            assert!(status >= 500, "fail: an error for that request: {status} {v}");
            assert!(v["error"]["message"].as_str().unwrap_or("").contains("kv load failed"), "{v}");
        }
    }
    // judged once each: two loads failed on each D, counted once
    for (d, base) in [(drec, mesh.base_port + 40), (dfail, mesh.base_port + 60)] {
        let text = client().get(format!("http://127.0.0.1:{}/metrics", base + 112)).send().unwrap().text().unwrap();
        let failed: f64 = text
            .lines()
            .filter(|l| l.starts_with("pdmesh_worker_kv_transfer_failures_total"))
            .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .sum();
        assert_eq!(failed, 2.0, "D on :{d}: each of its two loads failed once");
        let v: Value = client().post(url(d)).json(&plain(prompts[0])).send().unwrap().json().unwrap();
        assert_eq!(v["choices"][0]["text"], want[0], "D on :{d} serves the next request");
        mesh.wait_kv_on(d, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    }
    // P's group came back whole and holds nothing
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let r = client().post(url(p)).json(&plain(prompts[1])).send().unwrap();
        if r.status().as_u16() == 200 {
            let v: Value = r.json().unwrap();
            assert_eq!(v["choices"][0]["text"], want[1]);
            break;
        }
        assert!(Instant::now() < deadline, "P did not come back");
        std::thread::sleep(Duration::from_millis(500));
    }
    mesh.wait_kv_on(p, "P holds nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"), "a panic in the logs");
}

/// Rule R4 when a decode node's tensor-parallel group is lost mid-transfer (D111): D runs over
/// 2 TP ranks and reads slowly (`delay_transfer_ms`); with two requests' reads in flight, D's TP
/// peer is killed. D's rank 0 stops through the lost-accelerator path (its give-ups to P), and
/// D's engine fails the requests whose KV was there, telling P: either way P, which would hold
/// for 480 s, frees their blocks at once. The clients get a clear error, and D's group comes
/// back and serves. (Each of the two notices alone frees P: with the worker's give-ups left
/// out of that path locally, this still passed.)
#[test]
fn a_decode_tp_peer_lost_mid_transfer_gives_p_its_blocks_back() {
    use common::topo::TransferBackendKind::Shm;
    let Some(path) = common::qwen_model_path() else { return };
    let mesh = Mesh::start_nodes(
        |h, b| {
            common::pd_topology(h, b, Shm, 1, common::gguf(&path, 128, 1024)).with_node("d", |n| {
                n.tensor_parallel_size = 2;
                if let Some(kv) = n.kv_transfer.as_mut() {
                    kv.fault_injection = "delay_transfer_ms=5000".into();
                }
            })
        },
        common::pd_engines,
    );
    let (router, p, d) = (mesh.http_port, mesh.http_port + 1, mesh.http_port + 2);
    assert!(mesh.kv_on(p)["held_blocks"] == 0);
    // the router's two legs played here, so that nothing but D can free P (a router would
    // release P's hold itself when the decode leg fails)
    let legs: Vec<_> = ["The capital of France is", "def quicksort(arr):\n"]
        .into_iter()
        .map(|prompt| {
            let first = json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
            let v: Value = client()
                .post(format!("http://127.0.0.1:{p}/v1/completions"))
                .json(&first)
                .send()
                .unwrap()
                .json()
                .unwrap();
            assert!(v["kv_transfer_params"]["remote_block_ids"].is_array(), "{v}");
            let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0,
                "kv_transfer_params": v["kv_transfer_params"].clone()});
            let url = format!("http://127.0.0.1:{d}/v1/completions");
            std::thread::spawn(move || {
                let r = client().post(&url).json(&body).send().unwrap();
                (r.status().as_u16(), r.json::<Value>().unwrap_or(Value::Null))
            })
        })
        .collect();
    // both reads are in flight once D holds blocks for them and P holds theirs
    let deadline = Instant::now() + Duration::from_secs(60);
    while mesh.kv_on(d)["used_blocks"] == 0 || mesh.kv_on(p)["held_blocks"] == 0 {
        assert!(Instant::now() < deadline, "D's reads did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let peer = tp_peers("d");
    assert_eq!(peer.len(), 1, "D runs one TP peer");
    rustix::process::kill_process(rustix::process::Pid::from_raw(peer[0]).unwrap(), rustix::process::Signal::KILL)
        .unwrap();
    // only D's notices can free P within the wait: its hold is 480 s
    mesh.wait_kv_on(p, "P freed at once by D's give-ups", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    for leg in legs {
        let (status, v) = leg.join().unwrap();
        assert!(status >= 500 && v["error"]["message"].is_string(), "a clear error: {status} {v}");
    }
    let deadline = Instant::now() + Duration::from_secs(240);
    let body = json!({"prompt": "1, 2, 3, 5, 8,", "max_tokens": 8, "temperature": 0});
    loop {
        let r = client().post(format!("http://127.0.0.1:{router}/v1/completions")).json(&body).send().unwrap();
        if r.status().as_u16() == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "D did not come back: {}", r.status());
        std::thread::sleep(Duration::from_millis(500));
    }
    mesh.wait_kv_on(d, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"), "a panic in the logs");
}
