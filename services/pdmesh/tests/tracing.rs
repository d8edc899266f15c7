//! One request through the router is one trace: the mesh exports its spans over OTLP/HTTP to a
//! receiver inside this test, and every service of both nodes (router, P, D) contributes spans
//! whose parent links resolve within the trace; D's KV read span carries bytes and blocks, and
//! P's hold/lease/read-done/free lifecycle joins the same trace.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use common::topo::TransferBackendKind::{Shm, Tcp};
use common::Mesh;
use pdmesh_otlp_sink::{serve_http, SpanRecord, SpanStore};
use serde_json::json;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn attr_u64(s: &SpanRecord, key: &str) -> u64 {
    s.attributes.get(key).and_then(|v| v.as_u64().or_else(|| v.as_str().and_then(|t| t.parse().ok()))).unwrap_or(0)
}

fn node_of(s: &SpanRecord) -> String {
    s.resource.get("pdmesh.node").and_then(|v| v.as_str()).unwrap_or("").to_string()
}

fn has_event(spans: &[SpanRecord], service: &str, node: &str, event: &str) -> bool {
    spans.iter().any(|s| s.service == service && node_of(s) == node && s.event_names().contains(&event))
}

/// What one complete trace must contain; `None` when complete, else what is still missing.
fn missing(spans: &[SpanRecord]) -> Option<String> {
    let have: BTreeSet<(String, String)> = spans.iter().map(|s| (s.service.clone(), node_of(s))).collect();
    let mut want = vec![("pdmesh-router".to_string(), "router".to_string())];
    for node in ["p", "d"] {
        for svc in ["frontend", "dp-lb", "engine-core", "connector-scheduler", "connector-worker"] {
            want.push((format!("pdmesh-{svc}"), node.to_string()));
        }
    }
    let absent: Vec<_> = want.iter().filter(|w| !have.contains(*w)).collect();
    if !absent.is_empty() {
        return Some(format!("services {absent:?}"));
    }
    let read = spans.iter().any(|s| s.name == "kv.read" && attr_u64(s, "kv.bytes") > 0);
    let checks = [
        ("kv.read with bytes", read),
        ("P hold started", has_event(spans, "pdmesh-connector-worker", "p", "hold started")),
        ("P lease granted", has_event(spans, "pdmesh-connector-worker", "p", "lease granted")),
        ("P read done", has_event(spans, "pdmesh-connector-worker", "p", "read done")),
        ("P held blocks freed", has_event(spans, "pdmesh-connector-worker", "p", "held blocks freed")),
        ("D read done", has_event(spans, "pdmesh-connector-worker", "d", "read done")),
        ("D frontend finished", has_event(spans, "pdmesh-frontend", "d", "request finished")),
        ("router root", spans.iter().any(|s| s.name == "router.request")),
    ];
    checks.iter().find(|(_, ok)| !ok).map(|(what, _)| what.to_string())
}

#[test]
fn one_request_through_the_router_is_one_trace_across_both_nodes() {
    // The receiver speaks OTLP/HTTP here (the compose test exercises OTLP/gRPC).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let store = SpanStore::new();
    let sink_store = store.clone();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move { serve_http(vec![listener], sink_store).unwrap().await })
    });

    // This test binary holds only this test, so its environment is the mesh's: `pdmesh up`
    // passes it on to every child (and names each child's service).
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{addr}"));
    std::env::set_var("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf");
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    std::env::remove_var("OTEL_SERVICE_NAME");
    // P holds for at most 2 s, so the expiry below comes quickly (D reads within milliseconds).
    let mesh = Mesh::start_nodes(
        |h, b| {
            common::pd_topology(h, b, Shm, 2, |n| {
                common::blocks(4, 512)(n);
                if let Some(kv) = n.kv_transfer.as_mut() {
                    kv.abort_request_timeout_s = 2;
                }
            })
        },
        |h| vec![h + 1, h + 2],
    );

    let traceparent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    let started = Instant::now();
    let r = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
        .post(mesh.url("/v1/completions"))
        .header("traceparent", &traceparent)
        .json(&json!({"prompt": "the quick brown fox jumps over", "max_tokens": 6, "temperature": 0, "stream": true}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let body = r.text().unwrap();
    assert!(body.contains("[DONE]"), "{body}");

    // Deterministic wait: poll until the whole trace arrived (spans are exported as they end).
    let deadline = Instant::now() + Duration::from_secs(60);
    let spans = loop {
        let spans = store.trace(TRACE_ID);
        match missing(&spans) {
            None => break spans,
            Some(what) if Instant::now() > deadline => {
                let names: Vec<_> = spans.iter().map(|s| format!("{}@{}:{}", s.service, node_of(s), s.name)).collect();
                panic!(
                    "trace incomplete after 60 s, missing {what}; have {names:?}; logs in {}",
                    mesh.run_dir.display()
                );
            }
            Some(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    eprintln!("trace complete: {} spans in {:?}", spans.len(), started.elapsed());

    // One request, one trace: nothing else was exported.
    let all = store.spans();
    let others: Vec<_> = all
        .iter()
        .filter(|s| s.trace_id != TRACE_ID)
        .map(|s| format!("{}@{} {} {:?} {:?}", s.service, node_of(s), s.name, s.attributes, s.event_names()))
        .collect();
    assert!(others.is_empty(), "spans outside the request's trace: {others:?}");

    // Parent links: the router's span is the client's child; every other span's parent is in the trace.
    let by_id: HashMap<&str, &SpanRecord> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let root = spans.iter().find(|s| s.name == "router.request").unwrap();
    assert_eq!(root.parent_span_id, CLIENT_SPAN, "router span is a child of the client's span");
    for s in &spans {
        if s.span_id == root.span_id {
            continue;
        }
        assert!(by_id.contains_key(s.parent_span_id.as_str()), "span {} ({}) has a dangling parent", s.name, s.service);
    }
    // The chain from D's read up to the client: kv.read → worker/engine … → router.request.
    let read = spans.iter().find(|s| s.name == "kv.read" && attr_u64(s, "kv.bytes") > 0).unwrap();
    assert!(attr_u64(read, "kv.blocks") > 0, "transfer span has a block count: {:?}", read.attributes);
    assert_eq!(node_of(read), "d");
    let chain_of = |s: &SpanRecord| {
        let mut chain = vec![format!("{}@{}", s.name, node_of(s))];
        let mut cur = s.clone();
        while let Some(parent) = by_id.get(cur.parent_span_id.as_str()) {
            chain.push(format!("{}@{}", parent.name, node_of(parent)));
            cur = (*parent).clone();
        }
        (chain, cur.span_id == root.span_id)
    };
    let (chain, to_root) = chain_of(read);
    assert!(to_root, "kv.read leads up to the router: {chain:?}");
    for hop in
        ["engine.request@d", "dp_lb.route@d", "frontend.generate@d", "frontend.request@d", "router.decode@router"]
    {
        assert!(chain.iter().any(|c| c == hop), "{hop} on the path of kv.read: {chain:?}");
    }
    // P's side-channel spans are children of D's read span: the lifecycle joins across nodes.
    // A lease that reached P before its hold registered is parked (D65) and answered later in
    // a second span: one span says "lease parked", one "lease granted", both under the read.
    let leases: Vec<_> = spans.iter().filter(|s| s.name == "kv.serve.xfer_lease").collect();
    assert!(
        leases.iter().any(|s| s.event_names().contains(&"lease granted")),
        "a lease span with its grant: {:?}",
        leases.iter().map(|s| s.event_names()).collect::<Vec<_>>()
    );
    for s in &leases {
        assert_eq!(node_of(s), "p");
        assert_eq!(s.parent_span_id, read.span_id, "P's lease span is a child of D's kv.read");
        let events = s.event_names();
        assert!(events.contains(&"lease granted") || events.contains(&"lease parked"), "{events:?}");
    }
    // P's prefill, hold and release are under the router's prefill leg.
    for name in ["worker.prefill", "kv.hold", "kv.release"] {
        let s = spans.iter().find(|s| s.name == name && node_of(s) == "p").unwrap_or_else(|| panic!("{name} on P"));
        let (chain, to_root) = chain_of(s);
        assert!(to_root, "{name} leads up to the router: {chain:?}");
        for hop in ["engine.request@p", "dp_lb.route@p", "frontend.request@p", "router.prefill@router"] {
            assert!(chain.iter().any(|c| c == hop), "{hop} on the path of {name}: {chain:?}");
        }
    }
    // D's decode steps are spans of the request.
    let decode_steps = spans.iter().filter(|s| s.name == "worker.decode" && node_of(s) == "d").count();
    assert!(decode_steps >= 4, "decode steps as spans: {decode_steps}");

    rejection_notice_joins_the_trace(&mesh, &store);
    hold_expiry_is_an_event_of_the_trace(&mesh, &store);
    assert_eq!(mesh.stop().code(), Some(0));
    tcp_block_reads_are_spans_of_the_reader(&store);
}

/// The tcp backend: P serves the block read in a `kv.serve.tcp_read` span (bytes and blocks),
/// a child of D's `kv.read`, in the request's trace.
fn tcp_block_reads_are_spans_of_the_reader(store: &SpanStore) {
    const TRACE: &str = "7bf92f3577b34da6a3ce929d0e0e4739";
    let mesh =
        Mesh::start_nodes(|h, b| common::pd_topology(h, b, Tcp, 1, common::blocks(4, 512)), |h| vec![h + 1, h + 2]);
    let tp = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let body = json!({"prompt": "the quick brown fox jumps over", "max_tokens": 2, "temperature": 0});
    assert_eq!(post_traced(&mesh, mesh.http_port, &tp, "traced-tcp", &body).status().as_u16(), 200);
    let spans = wait_for(store, TRACE, "P's tcp block read under D's read", |spans| {
        spans.iter().any(|s| {
            s.name == "kv.serve.tcp_read"
                && attr_u64(s, "kv.bytes") > 0
                && spans.iter().any(|r| r.span_id == s.parent_span_id)
        })
    });
    let served = spans.iter().find(|s| s.name == "kv.serve.tcp_read" && attr_u64(s, "kv.bytes") > 0).unwrap();
    assert_eq!(node_of(served), "p");
    assert!(attr_u64(served, "kv.blocks") > 0, "{:?}", served.attributes);
    assert!(served.event_names().contains(&"blocks sent"), "{:?}", served.event_names());
    let read = spans.iter().find(|s| s.span_id == served.parent_span_id).expect("the read span is in the trace");
    assert_eq!((read.name.as_str(), node_of(read).as_str()), ("kv.read", "d"));
    assert_eq!(mesh.stop().code(), Some(0));
}

fn post_traced(
    mesh: &Mesh,
    port: u16,
    traceparent: &str,
    id: &str,
    body: &serde_json::Value,
) -> reqwest::blocking::Response {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
        .post(mesh.url_on(port, "/v1/completions"))
        .header("traceparent", traceparent)
        .header("X-Request-Id", id)
        .json(body)
        .send()
        .unwrap()
}

/// Poll the receiver until the spans of `trace_id` satisfy `found` (spans arrive as they end,
/// a parent after its children, so a check on a parent link waits for both ends).
fn wait_for(store: &SpanStore, trace_id: &str, what: &str, found: impl Fn(&[SpanRecord]) -> bool) -> Vec<SpanRecord> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let spans = store.trace(trace_id);
        if found(&spans) {
            return spans;
        }
        if Instant::now() > deadline {
            let names: Vec<_> = spans
                .iter()
                .map(|s| format!("{}@{}:{} {:?}", s.service, node_of(s), s.name, s.event_names()))
                .collect();
            panic!("no {what} in trace {trace_id} after 60 s; have {names:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn released_by(s: &SpanRecord) -> &str {
    s.attributes.get("released_by").and_then(|v| v.as_str()).unwrap_or("")
}

/// R1 in the trace: P prefills and holds (under the client's trace), D refuses the decode leg
/// (invalid sampling params); D's notice to P (`kv.notify`), P's answer to it
/// (`kv.serve.xfer_give_up`, a child of the notice) and P's release (`released_by = given_up`)
/// are all in that same trace.
fn rejection_notice_joins_the_trace(mesh: &Mesh, store: &SpanStore) {
    const TRACE: &str = "5bf92f3577b34da6a3ce929d0e0e4737";
    let tp = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let (p, d) = (mesh.http_port + 1, mesh.http_port + 2);
    let held = json!({"prompt": "hello there", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let v: serde_json::Value = post_traced(mesh, p, &tp, "traced-reject", &held).json().unwrap();
    let refused = json!({"prompt": "hello there", "temperature": -1, "kv_transfer_params": v["kv_transfer_params"]});
    assert_eq!(post_traced(mesh, d, &tp, "traced-reject", &refused).status().as_u16(), 400);
    // Spans arrive as they end (a parent after its children): wait for the whole picture.
    let deadline = Instant::now() + Duration::from_secs(60);
    let spans = loop {
        let spans = store.trace(TRACE);
        let released =
            spans.iter().any(|s| s.name == "kv.release" && node_of(s) == "p" && released_by(s) == "given_up");
        let answered_notice = spans.iter().any(|served| {
            served.name == "kv.serve.xfer_give_up"
                && spans.iter().any(|n| n.span_id == served.parent_span_id && n.name == "kv.notify")
        });
        let refused = spans.iter().any(|s| s.name == "frontend.request" && node_of(s) == "d");
        if released && answered_notice && refused {
            break spans;
        }
        assert!(Instant::now() < deadline, "rejection trace incomplete after 60 s: {:?}", {
            spans.iter().map(|s| format!("{}@{}", s.name, node_of(s))).collect::<Vec<_>>()
        });
        std::thread::sleep(Duration::from_millis(50));
    };
    let served = spans
        .iter()
        .find(|s| s.name == "kv.serve.xfer_give_up" && spans.iter().any(|n| n.span_id == s.parent_span_id))
        .unwrap();
    let notify = spans.iter().find(|n| n.span_id == served.parent_span_id).unwrap();
    assert_eq!(node_of(notify), "d");
    assert!(notify.event_names().contains(&"notice delivered to P"), "{:?}", notify.event_names());
    assert_eq!(node_of(served), "p");
    // (with two D ranks and no rank header, each rank sends a notice: one kv.notify each)
    let by_id: HashMap<&str, &SpanRecord> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let mut up = served.parent_span_id.as_str();
    let mut chain = Vec::new();
    while let Some(parent) = by_id.get(up) {
        chain.push(format!("{}@{}", parent.name, node_of(parent)));
        up = parent.parent_span_id.as_str();
    }
    assert!(chain.first().is_some_and(|c| c == "kv.notify@d"), "P's answer is a child of D's notice: {chain:?}");
    assert!(chain.iter().any(|c| c == "frontend.request@d"), "… within D's refused request: {chain:?}");
    assert!(served.event_names().contains(&"consumer gave up"), "{:?}", served.event_names());
    let release = spans.iter().find(|s| s.name == "kv.release" && node_of(s) == "p").unwrap();
    assert!(release.event_names().contains(&"held blocks freed"), "{:?}", release.event_names());
    // The rejection itself is an event of D's refused request, on D's frontend.
    let refused = spans.iter().find(|s| s.name == "frontend.request" && node_of(s) == "d").unwrap();
    assert_eq!(refused.service, "pdmesh-frontend");
    assert!(
        refused.event_names().contains(&"refused a remote-prefill request before admission; notified P"),
        "{:?}",
        refused.event_names()
    );
}

/// A hold nobody reads expires at P's deadline (2 s here): the release carries
/// `released_by = expired` and a `hold expired` event, in the trace of the request that made it.
fn hold_expiry_is_an_event_of_the_trace(mesh: &Mesh, store: &SpanStore) {
    const TRACE: &str = "6bf92f3577b34da6a3ce929d0e0e4738";
    let tp = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let held =
        json!({"prompt": "nobody reads this", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    assert_eq!(post_traced(mesh, mesh.http_port + 1, &tp, "traced-expiry", &held).status().as_u16(), 200);
    let spans = wait_for(store, TRACE, "the hold's expiry under its hold", |spans| {
        spans.iter().any(|r| {
            r.name == "kv.release"
                && released_by(r) == "expired"
                && spans.iter().any(|h| h.name == "kv.hold" && r.parent_span_id == h.span_id)
        })
    });
    let release = spans.iter().find(|s| s.name == "kv.release").unwrap();
    assert_eq!(node_of(release), "p");
    assert!(release.event_names().contains(&"hold expired"), "{:?}", release.event_names());
    assert!(spans.iter().any(|s| s.name == "kv.hold" && release.parent_span_id == s.span_id), "release under its hold");
}
