//! Rules R2 and R4 under chaos: 500 requests through the router while clients disconnect at
//! random moments (before P answers, between the legs, mid-stream). Every process stays up,
//! nothing panics, and once the last request ended P and D hold and use no blocks — long
//! before P's 480 s hold deadline, so only the lifecycle's own notices can have freed them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::time::Duration;

use common::Mesh;
use serde_json::json;

fn topology(http: u16, base: u16) -> String {
    let settings =
        "model = { kind = \"synthetic\", per_token_cost_us = 300 }\nengine = { block_size = 4, num_blocks = 2048 }";
    common::pd_topology(http, base, "shm", 2, settings)
}

/// A small deterministic generator (no extra dependency): the run is the same every time,
/// the timing it meets is not.
fn lcg(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        x >> 33
    }
}

/// What one client does: 0 gives up after a few ms (before P answers or between the legs),
/// 1 streams and drops after a few chunks, 2 streams to the end, 3 waits for the JSON answer.
fn one_client(url: &str, i: u64) -> &'static str {
    let mut rnd = lcg(i);
    let mode = rnd() % 4;
    let (pad, wait_ms, keep) = (rnd() % 40, 1 + rnd() % 40, rnd() % 6);
    let body = |stream: bool| {
        json!({"prompt": format!("chaos {i}: {}", "x".repeat(pad as usize)), "max_tokens": 24,
               "temperature": 0, "stream": stream, "ignore_eos": true})
    };
    match mode {
        0 => {
            let timeout = Duration::from_millis(wait_ms);
            let client = reqwest::blocking::Client::builder().timeout(timeout).build().unwrap();
            match client.post(url).json(&body(false)).send() {
                Ok(r) => {
                    let _ = r.bytes();
                    "early-or-complete"
                }
                Err(_) => "gave-up-early",
            }
        }
        1 => {
            let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
            let r = client.post(url).json(&body(true)).send().unwrap();
            let mut seen = 0;
            for line in BufReader::new(r).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("data: ") {
                    seen += 1;
                    if seen > keep {
                        break; // drop the stream mid-way
                    }
                }
            }
            "dropped-mid-stream"
        }
        2 => {
            let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
            let text = client.post(url).json(&body(true)).send().unwrap().text().unwrap();
            assert!(text.contains("[DONE]"), "{text}");
            "streamed"
        }
        _ => {
            let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
            let r = client.post(url).json(&body(false)).send().unwrap();
            assert_eq!(r.status().as_u16(), 200);
            "answered"
        }
    }
}

#[test]
fn five_hundred_requests_with_random_disconnects_leave_nothing_held() {
    let mesh = Mesh::start_nodes(topology, |h| vec![h + 1, h + 2, h + 3]);
    let url = mesh.url("/v1/completions");
    let threads: Vec<_> = (0..16u64)
        .map(|t| {
            let url = url.clone();
            std::thread::spawn(move || {
                let mut counts = std::collections::BTreeMap::new();
                for i in (t..500).step_by(16) {
                    *counts.entry(one_client(&url, i)).or_insert(0) += 1;
                }
                counts
            })
        })
        .collect();
    let mut total = std::collections::BTreeMap::new();
    for t in threads {
        for (k, v) in t.join().expect("a client thread failed") {
            *total.entry(k).or_insert(0) += v;
        }
    }
    eprintln!("chaos outcomes: {total:?}");
    let (p, d) = (mesh.http_port + 1, mesh.http_port + 2);
    // The hold deadline is 480 s: within 30 s only notices, aborts and releases free blocks.
    mesh.wait_kv_on(p, "P holds and uses nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    mesh.wait_kv_on(d, "D holds and uses nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    let p_worker = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 20 + 112);
    let text = reqwest::blocking::get(p_worker).unwrap().text().unwrap();
    for l in text.lines().filter(|l| l.starts_with("pdmesh_worker_kv_held_block_seconds_total")) {
        eprintln!("P {l}");
    }
    assert!(!mesh.logs().contains("panicked"), "a panic in the logs");
    let up_log = std::fs::read_to_string(mesh.run_dir.join("up.log")).unwrap_or_default();
    assert!(!up_log.contains("child process died"), "a process died: {up_log}");
    // The mesh still serves.
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let r = client.post(&url).json(&json!({"prompt": "after the chaos", "max_tokens": 4})).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
}
