//! Fail-over test support (tests/failover.rs on the synthetic executor, tests/failover_model.rs
//! on the real model): the load of 16 concurrent greedy streams of 64 tokens, killing
//! every process of one node, and the router's counters.

use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::Mesh;

/// Concurrent streams of one burst.
pub const STREAMS: usize = 16;
/// Tokens of each stream.
pub const TOKENS: usize = 64;

/// What one stream gave the client.
#[derive(Debug, Clone, PartialEq)]
pub struct Streamed {
    pub text: String,
    pub finish_reason: Option<String>,
    pub completion_tokens: Option<u64>,
    pub errors: Vec<String>,
}

pub use super::fresh_run_dir;

/// One greedy stream of `TOKENS` tokens; `started` counts streams that received text.
pub fn stream_one(url: &str, i: usize, started: &AtomicUsize) -> Streamed {
    stream_greedy(url, &format!("fail-over stream {i}: once upon a time"), TOKENS as u64, started)
}

/// One greedy, `ignore_eos` stream of `max_tokens` tokens of `prompt` with usage, read as the
/// client sees it (the router's internal field must never reach it); `started` is incremented
/// once, when the stream first has text.
pub fn stream_greedy(url: &str, prompt: &str, max_tokens: u64, started: &AtomicUsize) -> Streamed {
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(600)).build().unwrap();
    let body = json!({"prompt": prompt, "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = client.post(url).json(&body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200, "stream of {prompt:?}");
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

/// Run the `STREAMS` streams at once; `during` runs with what `ready(started)` gives once it
/// gives something, `started` being how many streams have text so far; returns the streams and
/// that value (which node was disturbed, say).
pub fn burst_when<T: Copy>(
    url: &str,
    ready: impl Fn(usize) -> Option<T>,
    during: impl FnOnce(T),
) -> (Vec<Streamed>, T) {
    let started = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..STREAMS)
        .map(|i| {
            let (url, started) = (url.to_string(), started.clone());
            std::thread::spawn(move || stream_one(&url, i, &started))
        })
        .collect();
    let mut moment = None;
    super::wait_for("the moment to disturb the streams", || {
        moment = ready(started.load(Ordering::SeqCst));
        moment.is_some()
    });
    let moment = moment.unwrap();
    during(moment);
    (handles.into_iter().map(|h| h.join().unwrap()).collect(), moment)
}

/// Run the `STREAMS` streams at once; `during` runs once `wait_started` of them have text.
pub fn burst(url: &str, wait_started: usize, during: impl FnOnce()) -> Vec<Streamed> {
    burst_when(url, |n| (n >= wait_started).then_some(()), |()| during()).0
}

/// SIGKILL every process of `node` (from the process table); returns how many.
pub fn kill_node(mesh: &Mesh, node: &str) -> usize {
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

/// The first of `nodes` with work by `work` (of its port). The tests kill whichever node holds
/// work rather than a fixed one: the router's latency-aware pick may leave a node that was
/// slower in the last burst out of the next.
pub fn busy_node(nodes: &[(String, u16)], work: impl Fn(u16) -> u64) -> Option<usize> {
    nodes.iter().position(|(_, port)| work(*port) > 0)
}

/// `GET /load` of the node on `port` (what the router routes by).
pub fn load_of(port: u16) -> Value {
    reqwest::blocking::get(format!("http://127.0.0.1:{port}/load")).unwrap().json().unwrap()
}

/// Every stream ended with `TOKENS` tokens, finish reason `length`, no error and the
/// reference's text.
pub fn check_all(got: &[Streamed], reference: &[Streamed], what: &str) {
    assert_eq!(got.len(), reference.len());
    for (i, (g, r)) in got.iter().zip(reference).enumerate() {
        assert!(g.errors.is_empty(), "{what}: stream {i} got errors {:?}", g.errors);
        assert_eq!(g.finish_reason.as_deref(), Some("length"), "{what}: stream {i}");
        assert_eq!(g.completion_tokens, Some(TOKENS as u64), "{what}: stream {i}");
        assert_eq!(g.text, r.text, "{what}: stream {i} differs from the undisturbed run");
    }
}

/// The undisturbed run's streams are whole: no error, `TOKENS` tokens, finish reason `length`.
pub fn check_reference(reference: &[Streamed]) {
    for (i, r) in reference.iter().enumerate() {
        assert!(r.errors.is_empty() && r.finish_reason.as_deref() == Some("length"), "reference {i}: {r:?}");
        assert_eq!(r.completion_tokens, Some(TOKENS as u64), "reference {i}");
    }
}
