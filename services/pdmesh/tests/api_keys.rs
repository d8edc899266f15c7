//! API keys on real meshes started by `pdmesh up` (docs/SECURITY.md, "API keys"): every
//! frontend — the router, P, D and a colocated node — refuses `/v1/*` and `/debug/*` without a
//! valid key with an OpenAI 401, serves with one and leaves the probes open; the router, given
//! a client's key, gets a full P/D answer by presenting the mesh's internal key to P and D; and
//! keys reach the children through their environment, never their command line; and the
//! per-key bound on requests in flight (`limits.max_in_flight_per_key`) answers a key over its
//! share with a 429 while other keys, and the router's internal key on the nodes, are served.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader, Read};

use common::topo::{NodeConfig, TransferBackendKind::Shm};
use common::{pd_engines, pd_topology, sse_events, Mesh, TopologyExt, UpOptions};
use serde_json::{json, Value};

const CLIENT_KEY: &str = "sk-client-2";
const INTERNAL_KEY: &str = "mesh-internal-test-key";

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(std::time::Duration::from_secs(60)).build().unwrap()
}

/// POST `body` to `url` with `key` (if any): status and body text.
fn post(url: &str, key: Option<&str>, body: &Value) -> (u16, String) {
    let rb = client().post(url).json(body);
    let rb = match key {
        Some(k) => rb.bearer_auth(k),
        None => rb,
    };
    let r = rb.send().unwrap();
    (r.status().as_u16(), r.text().unwrap())
}

fn get(url: &str, key: Option<&str>) -> u16 {
    let rb = client().get(url);
    let rb = match key {
        Some(k) => rb.bearer_auth(k),
        None => rb,
    };
    rb.send().unwrap().status().as_u16()
}

fn assert_unauthorized(url: &str, key: Option<&str>) {
    let (status, text) = post(url, key, &json!({"prompt": "hello", "max_tokens": 2}));
    assert_eq!(status, 401, "{url} with {key:?}: {text}");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{url}: not JSON ({e}): {text}"));
    assert_eq!(v["error"]["code"], "invalid_api_key", "{url}: {v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{url}: {v}");
}

/// `name{labels} value` of a counter in the Prometheus text of the node on `port` (0 when
/// absent).
fn counter(mesh: &Mesh, port: u16, series: &str) -> f64 {
    let text = client().get(mesh.url_on(port, "/metrics")).send().unwrap().text().unwrap();
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.trim().parse::<f64>().ok())).unwrap_or(0.0)
}

#[test]
fn every_frontend_needs_a_key_and_the_router_serves_p_d_with_one() {
    let options = UpOptions {
        env: vec![
            ("PDMESH_API_KEY".into(), format!("sk-client-1,{CLIENT_KEY}")),
            ("PDMESH_INTERNAL_API_KEY".into(), INTERNAL_KEY.into()),
        ],
        api_key: Some(CLIENT_KEY.into()),
        ..Default::default()
    };
    let mesh = Mesh::start_nodes_with(
        |h, b| {
            pd_topology(h, b, Shm, 1, |n| {
                n.engine.block_size = 4;
                n.engine.num_blocks = 512;
            })
        },
        pd_engines,
        &options,
    );
    let (router, p, d, c) = (mesh.http_port, mesh.http_port + 1, mesh.http_port + 2, mesh.http_port + 3);

    for port in [router, p, d, c] {
        let completions = mesh.url_on(port, "/v1/completions");
        assert_unauthorized(&completions, None);
        assert_unauthorized(&completions, Some("sk-wrong"));
        assert_eq!(get(&mesh.url_on(port, "/v1/models"), None), 401, ":{port} /v1/models without a key");
        assert_eq!(get(&mesh.url_on(port, "/v1/models"), Some(CLIENT_KEY)), 200, ":{port} /v1/models with a key");
        for probe in ["/health", "/live", "/metrics"] {
            assert_eq!(get(&mesh.url_on(port, probe), None), 200, ":{port} {probe} is open");
        }
        assert!(counter(&mesh, port, "pdmesh_frontend_unauthorized_total{reason=\"invalid\"}") >= 1.0, ":{port}");
    }
    for port in [p, d, c] {
        for path in ["/debug/kv", "/debug/engines"] {
            assert_eq!(get(&mesh.url_on(port, path), None), 401, ":{port} {path} without a key");
            assert_eq!(get(&mesh.url_on(port, path), Some(CLIENT_KEY)), 200, ":{port} {path} with a key");
        }
        // The nodes take the internal key; the router does not take it from its clients.
        assert_eq!(get(&mesh.url_on(port, "/v1/models"), Some(INTERNAL_KEY)), 200, ":{port}");
    }
    assert_eq!(get(&mesh.url_on(router, "/v1/models"), Some(INTERNAL_KEY)), 401);
    let release = json!({"kv_transfer_params": {"do_remote_prefill": true, "remote_request_id": "x"}});
    assert_eq!(post(&mesh.url_on(p, "/v1/kv/release"), None, &release).0, 401, "/v1/kv/release needs the key");

    // Through the router with a client key: a full P/D answer, the same as the colocated node's,
    // with P and D seeing the router's internal key.
    let internal = |port| counter(&mesh, port, "pdmesh_frontend_authorized_total{credential=\"internal\"}");
    let (p_before, d_before) = (internal(p), internal(d));
    let body = json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0});
    let (status, reference) = post(&mesh.url_on(c, "/v1/completions"), Some(CLIENT_KEY), &body);
    assert_eq!(status, 200, "{reference}");
    let want: Value = serde_json::from_str(&reference).unwrap();
    let (status, text) = post(&mesh.url_on(router, "/v1/completions"), Some(CLIENT_KEY), &body);
    assert_eq!(status, 200, "{text}");
    let got: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"], "P/D answer = colocated answer");
    assert_eq!(got["usage"]["completion_tokens"], 12, "{got}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, text) = post(&mesh.url_on(router, "/v1/completions"), Some(CLIENT_KEY), &streamed);
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let streamed_text: String = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(streamed_text, want["choices"][0]["text"].as_str().unwrap());
    assert!(internal(p) >= p_before + 2.0, "P saw the internal key on both prefill legs");
    assert!(internal(d) >= d_before + 2.0, "D saw the internal key on both decode legs");
    mesh.wait_kv_on(p, "P holds nothing once D has read", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    assert!(mesh.stop().success());
}

/// The command line of `pid`, NUL-separated arguments joined with spaces.
fn cmdline(pid: i64) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// The value of `name` in the environment of `pid`.
fn environ(pid: i64, name: &str) -> Option<String> {
    let bytes = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    bytes
        .split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok())
        .find_map(|kv| kv.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')).map(str::to_string))
}

#[test]
fn up_hands_keys_to_frontends_through_the_environment_only() {
    let options = UpOptions {
        args: vec!["--api-key".into(), "sk-from-flag".into()],
        api_key: Some("sk-from-flag".into()),
        ..Default::default()
    };
    let mesh = Mesh::start_one_with(|_| {}, &options);
    assert_unauthorized(&mesh.url("/v1/completions"), None);
    let (status, text) =
        post(&mesh.url("/v1/completions"), Some("sk-from-flag"), &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(status, 200, "{text}");

    let procs = mesh.processes();
    let frontend = procs.iter().find(|p| p["service"] == "frontend").unwrap()["pid"].as_i64().unwrap();
    let internal = environ(frontend, "PDMESH_INTERNAL_API_KEY").expect("the frontend got an internal key");
    assert_eq!(internal.len(), 64, "a fresh random key per run");
    assert_eq!(environ(frontend, "PDMESH_API_KEY").as_deref(), Some("sk-from-flag"));
    // The node takes the generated internal key (what a router of this run would present).
    assert_eq!(get(&mesh.url("/v1/models"), Some(&internal)), 200);
    for p in &procs {
        let pid = p["pid"].as_i64().unwrap();
        let line = cmdline(pid);
        assert!(!line.is_empty(), "pid {pid} is alive");
        assert!(!line.contains("sk-from-flag") && !line.contains(&internal), "no key on a command line: {line}");
        if p["service"] != "frontend" {
            assert_eq!(environ(pid, "PDMESH_API_KEY"), None, "{}: only frontends get keys", p["service"]);
            assert_eq!(environ(pid, "PDMESH_INTERNAL_API_KEY"), None, "{}: only frontends get keys", p["service"]);
        }
    }
    assert!(mesh.stop().success());
}

/// Synthetic tokens that each cost a step of 80 ms: a 100-token stream stays in flight for
/// about eight seconds after its first event (the executor sleeps, so a loaded machine does not
/// shorten it), far longer than the few requests the test makes meanwhile, the first of them
/// right after the first event.
fn slow_nodes(n: &mut NodeConfig) {
    n.model.per_token_cost_us = 40;
    n.model.per_step_cost_us = 80000;
    n.engine.block_size = 16;
    n.engine.num_blocks = 512;
    n.engine.max_model_len = 4096;
    n.limits.max_in_flight_per_key = 1;
}

/// A stream opened and read up to its first event (so the server has admitted it and holds
/// its place), the rest left unread for now.
struct OpenStream {
    reader: BufReader<reqwest::blocking::Response>,
}

impl OpenStream {
    fn open(url: &str, key: &str) -> OpenStream {
        let body = json!({"prompt": "a stream that holds its place", "max_tokens": 100, "ignore_eos": true,
                          "temperature": 0, "stream": true});
        let r = client().post(url).bearer_auth(key).json(&body).send().unwrap();
        assert_eq!(r.status().as_u16(), 200, "{url}");
        let mut reader = BufReader::new(r);
        let mut line = String::new();
        while !line.starts_with("data: ") {
            line.clear();
            assert!(reader.read_line(&mut line).unwrap() > 0, "{url}: the stream ended before its first event");
        }
        OpenStream { reader }
    }

    /// Read the stream to its end: its events (the first one excluded).
    fn finish(mut self) -> Vec<String> {
        let mut rest = String::new();
        self.reader.read_to_string(&mut rest).unwrap();
        sse_events(&rest)
    }
}

/// `limits.max_in_flight_per_key` on a real P/D mesh with two client keys: the router's bound
/// is 2, the nodes' 1. Key A holds two streams open through the router (each read to its first
/// event, so both are admitted); a third request with A gets the router's 429 with
/// `Retry-After` and OpenAI's rate-limit body, before P is asked; a request with key B is
/// served meanwhile — through D, which already carries A's two streams under the router's
/// internal key, so it fails if the internal key were bounded per key on the nodes. The
/// colocated node applies its own bound to A the same way. Once A's streams have ended, A is
/// served again, P and D hold no KV block, and the refusal counters moved by exactly the
/// refusals made. Fails if the bound is not applied, if a stream gives its place back before
/// its end, if one key's requests count against another's, or if a refusal leaks blocks.
#[test]
fn a_key_over_its_share_gets_429_while_other_keys_and_the_router_are_served() {
    let options = UpOptions {
        env: vec![
            ("PDMESH_API_KEY".into(), "sk-key-a,sk-key-b".into()),
            ("PDMESH_INTERNAL_API_KEY".into(), INTERNAL_KEY.into()),
        ],
        api_key: Some("sk-key-b".into()),
        ..Default::default()
    };
    let mesh = Mesh::start_nodes_with(
        |h, b| {
            pd_topology(h, b, Shm, 1, slow_nodes).with_node("router", |r| {
                r.limits.max_in_flight_per_key = 2;
                r.limits.retry_after_s = 3;
            })
        },
        pd_engines,
        &options,
    );
    let (router, p, d, c) = (mesh.http_port, mesh.http_port + 1, mesh.http_port + 2, mesh.http_port + 3);
    let refusals = |port, source: &str| {
        counter(&mesh, port, &format!("pdmesh_frontend_key_limit_refusals_total{{source=\"{source}\"}}"))
    };
    let (router_before, c_before) = (refusals(router, "router"), refusals(c, "frontend"));
    let completions = |port| mesh.url_on(port, "/v1/completions");
    let short = json!({"prompt": "hello", "max_tokens": 2, "temperature": 0});

    let held = [OpenStream::open(&completions(router), "sk-key-a"), OpenStream::open(&completions(router), "sk-key-a")];
    // P's answered completions (the router's `/load` polls also use the internal key, so the
    // key's counter moves on its own every poll).
    let p_completions =
        || counter(&mesh, p, "pdmesh_frontend_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"}");
    let p_prefills = p_completions();
    assert!(p_prefills >= 2.0, "P answered both held streams' prefills");
    let r = client().post(completions(router)).bearer_auth("sk-key-a").json(&short).send().unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("3"), "limits.retry_after_s");
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["type"], "requests", "{v}");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    assert!(v["error"].get("param").is_some(), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().starts_with("rate limited"), "{v}");
    assert_eq!(p_completions(), p_prefills, "refused before P was asked");
    let (status, text) = post(&completions(router), Some("sk-key-b"), &short);
    assert_eq!(status, 200, "another key is served while A is at its bound: {text}");

    // A node's own bound: one A stream on the colocated node, then A is refused there too.
    let on_c = OpenStream::open(&completions(c), "sk-key-a");
    let (status, text) = post(&completions(c), Some("sk-key-a"), &short);
    assert_eq!(status, 429, "{text}");
    assert_eq!(post(&completions(c), Some("sk-key-b"), &short).0, 200);

    for stream in held.into_iter().chain([on_c]) {
        let events = stream.finish();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        assert!(!events.iter().any(|e| e.contains("\"error\"")), "{events:?}");
    }
    for port in [router, c] {
        let (status, text) = post(&completions(port), Some("sk-key-a"), &short);
        assert_eq!(status, 200, ":{port} serves A again once its streams ended: {text}");
    }
    assert_eq!(refusals(router, "router"), router_before + 1.0);
    assert_eq!(refusals(c, "frontend"), c_before + 1.0);
    for port in [p, d] {
        assert_eq!(refusals(port, "frontend"), 0.0, ":{port}: the router's internal key is not bounded per key");
        mesh.wait_kv_on(port, "no KV block held or used once every request ended", |kv| {
            kv["held_blocks"] == 0 && kv["used_blocks"] == 0
        });
    }
    assert!(mesh.stop().success());
}
