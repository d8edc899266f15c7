//! Fail-over on the scale-out shape (D55, D56): a router over 2 P and 2 D nodes (tcp KV
//! backend, synthetic executor, greedy), started by one `pdmesh up --no-restart` so nothing
//! comes back behind the test's back.
//!
//! 1. 16 concurrent streams of 64 tokens run undisturbed: the reference texts.
//! 2. The same 16 again; once every stream has tokens, every process of a D node running
//!    some of them gets SIGKILL. Every stream still ends with 64 tokens, finish reason `length` and the
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

use std::sync::atomic::AtomicUsize;

use common::failover::{
    burst, burst_when, busy_node, check_all, check_reference, kill_node, load_of, stream_one, STREAMS, TOKENS,
};
use common::{metric, reserve_ports, topo, TopologyExt};

/// A per-token cost so that 8 streams of 64 tokens on one D last a few seconds.
fn settings(n: &mut topo::NodeConfig) {
    n.model.per_token_cost_us = 3000;
    n.engine.block_size = 4;
    n.engine.num_blocks = 1024;
}

#[test]
fn killing_a_decode_node_then_a_prefill_node_loses_no_stream() {
    let (r1, r2) = (reserve_ports(), reserve_ports());
    let run_dir = common::failover::fresh_run_dir("pdmesh-failover", r1.0);
    let (t, ports) = topo::scaleout(r1, r2);
    let t = t.all_nodes(settings).with_node("router", |n| n.router.load_poll_ms = 0);
    let ready: Vec<u16> = ports.p.iter().chain(&ports.d).copied().collect();
    let mesh = common::start_scaleout(&run_dir, t, ports.router, r1.1, &ready);
    let url = format!("http://127.0.0.1:{}/v1/completions", ports.router);

    // 1. The undisturbed run.
    let reference = burst(&url, 0, || {});
    check_reference(&reference);
    for r in &reference {
        assert_eq!(r.text.len(), TOKENS, "one byte per synthetic token");
    }
    let before = metric(ports.router, "pdmesh_router_migrations_total", "");
    assert_eq!(before, 0.0, "nothing moved in the undisturbed run");

    // 2. SIGKILL every process of a D mid-stream: the first one seen running requests once
    // every stream has tokens (the router's latency-aware pick may leave either out).
    let decode = [("d-a".to_string(), ports.d[0]), ("d-b".to_string(), ports.d[1])];
    let (got, d_victim) = burst_when(
        &url,
        |n| if n >= STREAMS { busy_node(&decode, |port| load_of(port)["running"].as_u64().unwrap_or(0)) } else { None },
        |d| {
            let d_dead = &decode[d].0;
            let killed = kill_node(&mesh, d_dead);
            assert!(killed >= 3, "{d_dead}'s frontend, dp-lb and engine processes");
            eprintln!("killed {killed} processes of {d_dead}");
        },
    );
    let d_alive = 1 - d_victim;
    check_all(&got, &reference, "a D killed");
    let moved = metric(ports.router, "pdmesh_router_migrations_total", "");
    eprintln!("migrations: {moved}");
    assert!(moved >= 1.0, "streams on the killed D moved to the other");

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
    mesh.wait_kv_on(decode[d_alive].1, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"));
    drop(mesh);
    let _ = std::fs::remove_dir_all(&run_dir);
}
