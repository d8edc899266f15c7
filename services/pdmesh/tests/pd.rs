//! P/D disaggregation through the router: P prefills and holds its blocks, D reads them over
//! the transfer agent (shared memory), decodes and streams. The synthetic executor computes
//! each token from the KV cache it reads back, so identical output on a colocated node proves
//! the right bytes moved.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::topo::{self, KvLoadFailurePolicy, NodeConfig, Topology, TransferBackendKind::*};
use common::{complete, pd_engines, Mesh, TopologyExt};
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap()
}

/// P, D and the reference: 512 blocks of 4 tokens.
fn engine(n: &mut NodeConfig) {
    n.engine.block_size = 4;
    n.engine.num_blocks = 512;
}

fn pd_topology(http: u16, base: u16) -> Topology {
    common::pd_topology(http, base, Shm, 2, engine)
}

fn pd_topology_tcp(http: u16, base: u16) -> Topology {
    common::pd_topology(http, base, Tcp, 2, engine)
}

/// The P/D shape with one D rank and [`engine`].
fn pd_one_rank(http: u16, base: u16) -> Topology {
    common::pd_topology(http, base, Shm, 1, engine)
}

#[test]
fn disaggregated_output_equals_colocated_and_every_block_is_freed() {
    check_pd_equals_colocated(Mesh::start_nodes(pd_topology, pd_engines), "127.0.0.1");
}

/// The tcp backend: P serves block reads over a socket, listening on 127.0.0.2 while D is on
/// 127.0.0.1 (two addresses, as two hosts would be).
#[test]
fn tcp_backend_moves_the_same_bytes() {
    check_pd_equals_colocated(Mesh::start_nodes(pd_topology_tcp, pd_engines), "127.0.0.2");
}

fn check_pd_equals_colocated(mesh: Mesh, p_host: &str) {
    let router = mesh.url("/v1/completions");
    let colocated = mesh.url_on(mesh.http_port + 3, "/v1/completions");
    // shorter than one block (4 tokens), exactly N blocks, N blocks + 1 token, longer
    let prompts = ["abc", "abcdefgh", "abcdefghi", "the quick brown fox jumps over the lazy dog"];
    for p in prompts {
        let expected = complete(&colocated, p, false);
        assert_eq!(complete(&router, p, false), expected, "non-streaming P/D for {p:?}");
        assert_eq!(complete(&router, p, true), expected, "streaming P/D for {p:?}");
    }
    // 16 concurrent mixed prompts
    let hs: Vec<_> = (0..16)
        .map(|i| {
            let (router, colocated) = (router.clone(), colocated.clone());
            std::thread::spawn(move || {
                let p = format!("concurrent prompt {i} {}", "x".repeat(i * 3));
                let expected = complete(&colocated, &p, false);
                assert_eq!(complete(&router, &p, i % 2 == 0), expected, "{p}");
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let (p, d) = (mesh.http_port + 1, mesh.http_port + 2);
    mesh.wait_kv_on(p, "P holds nothing once D has read", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    mesh.wait_kv_on(d, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    // One handshake per engine pair (D has two ranks), not one per request (24 requests).
    let metrics = reqwest::blocking::get(format!("http://{p_host}:{}/metrics", mesh.base_port + 20 + 112))
        .unwrap()
        .text()
        .unwrap();
    let served: i64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("pdmesh_worker_kv_handshakes_served "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    assert!((1..=2).contains(&served), "handshakes served by P: {served}");
    assert!(!mesh.logs().contains("panicked"));
}

fn post(url: &str, request_id: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).header("X-Request-Id", request_id).json(body).send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// A block reference whose blocks were freed and reused is refused by P's lease check, never
/// read: D follows its load-failure policy (`fail`: an error for that request only;
/// `recompute`: the same output as a colocated run).
fn stale_reference_is_refused(policy: KvLoadFailurePolicy) {
    let mesh = Mesh::start_nodes(
        // Prefix caching off: with it, D's second decode of a prompt it already decoded is a
        // full local hit that reads nothing from P, and the stale reference is never tried.
        |h, b| {
            topo::pd_with_policy(h, b, Shm, 1, policy).engine_nodes(|n| {
                engine(n);
                n.engine.enable_prefix_caching = false;
            })
        },
        pd_engines,
    );
    let (p, d, c) = (mesh.http_port + 1, mesh.http_port + 2, mesh.http_port + 3);
    let url = |port: u16| mesh.url_on(port, "/v1/completions");
    let prefill = |prompt: &str| {
        let body = json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
        let (status, v) = post(&url(p), "stale-1", &body);
        assert_eq!(status, 200, "{v}");
        v["kv_transfer_params"].clone()
    };
    let decode = |prompt: &str, params: &Value| {
        post(
            &url(d),
            "stale-1",
            &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "kv_transfer_params": params}),
        )
    };
    let (a, b) = ("first prompt, read once", "second prompt, longer than the first one");
    let params_a = prefill(a);
    assert!(params_a["remote_block_generations"].is_array(), "{params_a}");
    let (status, _) = decode(a, &params_a);
    assert_eq!(status, 200);
    mesh.wait_kv_on(p, "P freed after the read", |kv| kv["held_blocks"] == 0);
    // P reuses the id and blocks for another prompt; the old reference is now stale.
    let params_b = prefill(b);
    let (status, v) = decode(a, &params_a);
    let colocated_a = post(&url(c), "ref-a", &json!({"prompt": a, "max_tokens": 8, "temperature": 0})).1;
    if policy == KvLoadFailurePolicy::Recompute {
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], colocated_a["choices"][0]["text"], "recomputed locally, same output");
    } else {
        assert!(status >= 500, "the stale read fails that request: {status} {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("kv load")), "{v}");
    }
    // The fresh reference still works, and nothing is left held.
    let (status, v) = decode(b, &params_b);
    assert_eq!(status, 200, "{v}");
    let colocated_b = post(&url(c), "ref-b", &json!({"prompt": b, "max_tokens": 8, "temperature": 0})).1;
    assert_eq!(v["choices"][0]["text"], colocated_b["choices"][0]["text"]);
    mesh.wait_kv_on(p, "P holds nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    mesh.wait_kv_on(d, "D's blocks are free", |kv| kv["used_blocks"] == 0);
}

#[test]
fn stale_block_reference_fails_cleanly_under_fail_policy() {
    stale_reference_is_refused(KvLoadFailurePolicy::Fail);
}

#[test]
fn stale_block_reference_is_recomputed_under_recompute_policy() {
    stale_reference_is_refused(KvLoadFailurePolicy::Recompute);
}

fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::blocking::get(url).unwrap().text().unwrap();
    text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok()).sum()
}

/// Rule R1: D refuses a remote-prefill request before admission (bad sampling parameter,
/// unknown model, chat template error, unknown `previous_response_id` on `/v1/responses`, beam search with streaming); D's client gets its normal error, and P frees the
/// held blocks at once — the hold deadline here is 480 s, so only the notice can free them.
/// Without a rank header every D rank gets the notice (P frees once, the second is counted
/// as a duplicate); with one, only that rank.
#[test]
fn rejection_before_admission_frees_p_at_once() {
    let mesh = Mesh::start_nodes(pd_topology, pd_engines);
    let (p, d) = (mesh.http_port + 1, mesh.http_port + 2);
    let dplb_metrics = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 40 + 100);
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        ("/v1/completions", json!({"prompt": "hello there", "temperature": -1}), 400, None),
        ("/v1/completions", json!({"prompt": "hello there", "model": "no-such-model"}), 404, None),
        ("/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "x"}]}), 400, None),
        ("/v1/responses", json!({"input": "hello there", "previous_response_id": "resp_unknown"}), 404, None),
        ("/v1/completions", json!({"prompt": "hello there", "use_beam_search": true, "stream": true}), 400, None),
        ("/v1/completions", json!({"prompt": "hello there", "top_p": 0}), 400, Some("1")),
    ];
    for (i, (path, mut body, status, rank)) in cases.into_iter().enumerate() {
        let id = format!("r1-{i}");
        let (s, v) = post(
            &mesh.url_on(p, "/v1/completions"),
            &id,
            &json!({"prompt": "hello there", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
        );
        assert_eq!(s, 200, "{v}");
        mesh.wait_kv_on(p, "P holds the prefilled blocks", |kv| kv["held_blocks"].as_u64().unwrap_or(0) > 0);
        let before = metric(&dplb_metrics, "pdmesh_dplb_rejection_notices_forwarded_total");
        body["kv_transfer_params"] = v["kv_transfer_params"].clone();
        let mut rb = client().post(mesh.url_on(d, path)).header("X-Request-Id", &id).json(&body);
        if let Some(r) = rank {
            rb = rb.header("X-data-parallel-rank", r);
        }
        let r = rb.send().unwrap();
        assert_eq!(r.status().as_u16(), status, "{path}");
        let err: Value = r.json().unwrap();
        assert!(err["error"]["message"].is_string(), "D's client gets its normal error body: {err}");
        mesh.wait_kv_on(p, "P freed by the notice, long before its 480 s deadline", |kv| {
            kv["held_blocks"] == 0 && kv["used_blocks"] == 0
        });
        let forwarded = metric(&dplb_metrics, "pdmesh_dplb_rejection_notices_forwarded_total") - before;
        assert_eq!(forwarded, if rank.is_some() { 1.0 } else { 2.0 }, "ranks that received the notice");
    }
    assert!(!mesh.logs().contains("panicked"));
}

/// R4 at the router: when the decode leg never starts (D unreachable; likewise a client gone
/// between the legs), the router hands P's reference back through P's `/v1/kv/release`, and P
/// frees at once instead of at its 480 s deadline. The endpoint itself refuses params that
/// name nothing.
#[test]
fn router_hands_p_blocks_back_when_the_decode_leg_never_starts() {
    let mesh = Mesh::start_nodes(pd_one_rank, pd_engines);
    let p = mesh.http_port + 1;

    // The endpoint on P: a held request is released at once; junk is a 400.
    let (s, v) = post(
        &mesh.url_on(p, "/v1/completions"),
        "rel-1",
        &json!({"prompt": "hold me", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    assert_eq!(s, 200, "{v}");
    mesh.wait_kv_on(p, "P holds the prefilled blocks", |kv| kv["held_blocks"].as_u64().unwrap_or(0) > 0);
    let (s, _) =
        post(&mesh.url_on(p, "/v1/kv/release"), "rel-1", &json!({"kv_transfer_params": v["kv_transfer_params"]}));
    assert_eq!(s, 202);
    mesh.wait_kv_on(p, "released through /v1/kv/release", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    let (s, v) = post(&mesh.url_on(p, "/v1/kv/release"), "rel-2", &json!({"kv_transfer_params": {"x": 1}}));
    assert_eq!(s, 400, "{v}");

    // What the router's guard sends when its client leaves before P answered: it chose the
    // engine-id suffix and the capability of its prefill leg, so it can name P's request
    // without P's answer. A wrong capability releases nothing.
    let (suffix, token) = ("00112233445566ff", "0123456789abcdef0123456789abcdef");
    let r = client()
        .post(mesh.url_on(p, "/v1/completions"))
        .header("X-Request-Id", "pre")
        .header("X-Pdmesh-Engine-Id-Suffix", suffix)
        .json(&json!({"prompt": "hold me too", "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": true, "remote_capability": token}}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["kv_transfer_params"]["remote_request_id"], format!("pre-{suffix}"));
    assert_eq!(v["kv_transfer_params"]["remote_capability"], token);
    let named = |capability: &str| {
        json!({"kv_transfer_params": {"do_remote_prefill": true,
        "remote_request_id": format!("pre-{suffix}"), "remote_capability": capability}})
    };
    let p_engine_metrics = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 20 + 110);
    let refused = || metric(&p_engine_metrics, "pdmesh_kv_capability_refused_total");
    let before = refused();
    let (s, _) = post(&mesh.url_on(p, "/v1/kv/release"), "pre", &named("ffffffffffffffffffffffffffffffff"));
    assert_eq!(s, 202, "the notice is sent; P checks the token");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while refused() == before {
        assert!(std::time::Instant::now() < deadline, "P's engine never judged the release");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(mesh.kv_on(p)["held_blocks"].as_u64().unwrap() > 0, "a wrong capability released nothing");
    let (s, _) = post(&mesh.url_on(p, "/v1/kv/release"), "pre", &named(token));
    assert_eq!(s, 202);
    mesh.wait_kv_on(p, "released by id and capability alone", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);

    // Through the router with D's frontend gone: the client gets a clear 503, P frees at once.
    let mut attempts = 0;
    loop {
        attempts += 1;
        mesh.kill9_on("d", "frontend", 0);
        let (s, v) = post(
            &mesh.url("/v1/completions"),
            &format!("rel-r{attempts}"),
            &json!({"prompt": "no decode", "max_tokens": 4}),
        );
        if s == 200 && attempts < 4 {
            continue; // D's frontend was back already (pdmesh up restarts it); try again
        }
        assert!(s >= 500, "{s} {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("decode")), "{v}");
        break;
    }
    mesh.wait_kv_on(p, "P freed by the router's release, long before its deadline", |kv| {
        kv["held_blocks"] == 0 && kv["used_blocks"] == 0
    });
    assert!(!mesh.logs().contains("panicked"));
}

/// R5 accounting: while D's READ is in flight (delayed by the product's `delay_transfer_ms`
/// fault), P's `/debug/kv` counts the request's blocks as leased and lists it as `leased`;
/// once D is done, nothing is held or leased.
#[test]
fn p_reports_leased_blocks_while_a_read_is_in_flight() {
    let mesh = Mesh::start_nodes(
        |h, b| {
            pd_one_rank(h, b).with_node("d", |d| {
                d.kv_transfer.as_mut().unwrap().fault_injection = "delay_transfer_ms=1500".into();
            })
        },
        pd_engines,
    );
    let p = mesh.http_port + 1;
    let url = mesh.url("/v1/completions");
    let request = std::thread::spawn(move || {
        let body = json!({"prompt": "a prompt read slowly", "max_tokens": 4, "temperature": 0});
        client().post(url).json(&body).send().unwrap().status().as_u16()
    });
    mesh.wait_kv_on(p, "P shows the lease of the in-flight read", |kv| {
        kv["leased_blocks"].as_u64().unwrap_or(0) > 0
            && kv["leased_blocks"] == kv["held_blocks"]
            && kv["held_requests"][0]["state"] == "leased"
    });
    assert_eq!(request.join().unwrap(), 200);
    mesh.wait_kv_on(p, "nothing held or leased after the read", |kv| {
        kv["held_blocks"] == 0 && kv["leased_blocks"] == 0 && kv["used_blocks"] == 0
    });
}

/// Read leases with heartbeats (R2): P holds under a 1 s lease; D runs one sequence at a
/// time, so a second request waits on D well past that second before its READ. D's
/// heartbeats keep P's hold alive: the waiting request loads (under the `fail` policy, a
/// lapsed hold would have failed it), and P ends holding nothing.
#[test]
fn heartbeats_keep_p_holding_while_the_request_waits_on_d() {
    let settings = |n: &mut NodeConfig| {
        n.model.per_token_cost_us = 10000;
        n.engine.block_size = 4;
        n.engine.num_blocks = 256;
        n.engine.max_num_seqs = 1;
        if let Some(kv) = n.kv_transfer.as_mut() {
            kv.hold_mode = topo::HoldMode::Lease;
            kv.kv_lease_duration_s = 1;
        }
    };
    let mesh = Mesh::start_nodes(|h, b| common::pd_topology(h, b, Shm, 1, settings), pd_engines);
    let (p, d) = (mesh.http_port + 1, mesh.http_port + 2);
    let url = mesh.url("/v1/completions");
    let first = {
        let url = url.clone();
        std::thread::spawn(move || {
            let body = json!({"prompt": "first", "max_tokens": 150, "temperature": 0, "ignore_eos": true});
            client().post(url).json(&body).send().unwrap().status().as_u16()
        })
    };
    mesh.wait_kv_on(d, "the first request runs on D", |kv| kv["used_blocks"].as_u64().unwrap_or(0) > 0);
    let body = json!({"prompt": "second, queued behind the first", "max_tokens": 4, "temperature": 0});
    let r = client().post(&url).json(&body).send().unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().unwrap();
    assert_eq!(status, 200, "the queued request still loaded P's blocks: {v}");
    assert_eq!(first.join().unwrap(), 200);
    let d_worker = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 40 + 112);
    assert!(metric(&d_worker, "pdmesh_worker_kv_heartbeats_sent_total") >= 2.0, "D sent heartbeats");
    let p_worker = format!("http://127.0.0.1:{}/metrics", mesh.base_port + 20 + 112);
    assert_eq!(metric(&p_worker, "pdmesh_worker_kv_holds_expired_total"), 0.0, "no hold lapsed");
    mesh.wait_kv_on(p, "P holds nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
}

/// Every service's `/metrics` (router, both frontends, both dp-lbs, and each rank's
/// engine-core, connector-scheduler and connector-worker) shows its named metrics moving
/// under a short load through the router.
#[test]
fn every_service_metrics_move_under_a_short_load() {
    let mesh = Mesh::start_nodes(pd_one_rank, pd_engines);
    let http = |port: u16| format!("http://127.0.0.1:{port}/metrics");
    let ops = |node_base: u16, offset: u16| http(node_base + offset);
    let (pb, db) = (mesh.base_port + 20, mesh.base_port + 40);
    let watched: Vec<(String, &str)> = vec![
        (http(mesh.http_port), "pdmesh_frontend_http_requests_total"),
        (http(mesh.http_port + 1), "pdmesh_frontend_prompt_tokens_total"),
        (http(mesh.http_port + 2), "pdmesh_frontend_generation_tokens_total"),
        (ops(pb, 100), "pdmesh_dplb_requests_routed_total"),
        (ops(db, 100), "pdmesh_dplb_requests_routed_total"),
        (ops(pb, 110), "pdmesh_engine_steps_total"),
        (ops(db, 110), "pdmesh_engine_scheduled_tokens_total"),
        (ops(pb, 111), "pdmesh_transport_messages_received_total"),
        (ops(db, 111), "pdmesh_transport_messages_received_total"),
        (ops(pb, 112), "pdmesh_worker_kv_held_block_seconds_total"),
        (ops(db, 112), "pdmesh_worker_kv_transfer_bytes_total"),
        (ops(db, 112), "pdmesh_worker_tokens_computed_total"),
    ];
    let before: Vec<f64> = watched.iter().map(|(u, n)| metric(u, n)).collect();
    for i in 0..8 {
        let body = json!({"prompt": format!("metrics under load {i}"), "max_tokens": 6, "temperature": 0});
        let r = client().post(mesh.url("/v1/completions")).json(&body).send().unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    mesh.wait_kv_on(mesh.http_port + 1, "P holds nothing", |kv| kv["held_blocks"] == 0);
    for ((url, name), b) in watched.iter().zip(before) {
        let after = metric(url, name);
        assert!(after > b, "{name} on {url} did not move: {b} -> {after}");
    }
}

/// D66: a streamed request's decode leg leaves with its prefill leg; D parks it until the
/// router hands it P's params. The stream equals the colocated node's, and a refusal by D
/// keeps D's status while P ends holding nothing (its leg dropped, or its hold handed back).
/// Params for no parked request are a 404.
#[test]
fn the_decode_leg_parks_until_p_answers_and_a_refusal_keeps_its_status() {
    // D takes prompts of at most 48 tokens; P and the colocated node take longer ones.
    let topology = |h, b| pd_one_rank(h, b).with_node("d", |d| d.engine.max_model_len = 48);
    let mesh = Mesh::start_nodes(topology, pd_engines);
    let (p, d, c) = (mesh.http_port + 1, mesh.http_port + 2, mesh.http_port + 3);
    let parallel = || common::metric(mesh.http_port, "pdmesh_router_parallel_decode_legs_total", "");
    let parked = || common::metric(d, "pdmesh_frontend_parked_requests_total", "outcome=\"parked\"");

    let text = complete(&mesh.url("/v1/completions"), "tell me", true);
    assert_eq!(text, complete(&mesh.url_on(c, "/v1/completions"), "tell me", true));
    assert_eq!((parallel(), parked()), (1.0, 1.0), "the leg was sent in parallel and parked on D");
    mesh.wait_kv_on(p, "P freed after D's read", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);

    let long = "a long prompt ".repeat(8);
    let r = client()
        .post(mesh.url("/v1/completions"))
        .header("X-Request-Id", "too-long-for-d")
        .json(&json!({"prompt": long, "max_tokens": 8, "stream": true}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400, "D's refusal reaches the client with its status");
    let err: Value = r.json().unwrap();
    assert!(err["error"]["message"].as_str().is_some_and(|m| m.contains("maximum context length")), "{err}");
    mesh.wait_kv_on(p, "P holds nothing for the refused request", |kv| {
        kv["held_blocks"] == 0 && kv["used_blocks"] == 0
    });
    assert_eq!(parallel(), 1.0, "a refused leg was never handed params");

    let (s, v) = post(
        &mesh.url_on(d, "/v1/kv/params"),
        "nobody",
        &json!({"token": "0123456789abcdef0123456789abcdef", "kv_transfer_params": null}),
    );
    assert_eq!(s, 404, "{v}");
    let (s, v) = post(&mesh.url_on(d, "/v1/kv/params"), "nobody", &json!({"kv_transfer_params": null}));
    assert_eq!(s, 400, "{v}");
    assert_eq!(common::metric(d, "pdmesh_frontend_parked_requests_total", "outcome=\"unknown_token\""), 1.0);
    assert!(!mesh.logs().contains("panicked"));
}
