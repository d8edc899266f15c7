//! Fail-over on the real model (issue #24): `deploy/topology/scaleout.toml` as shipped — a
//! router over 2 P and 2 D nodes of SmolLM2-135M-Instruct, tcp KV backend — with only its
//! ports, run dir and model path rewritten, and the executor's `step_delay_ms` fault on every
//! P and D node so that the kills land while work is in flight. One `pdmesh up --no-restart`
//! starts it, so nothing comes back behind the test's back.
//!
//! 1. 16 concurrent greedy streams of 64 tokens run undisturbed: the reference texts.
//! 2. The same 16 again; once every stream has text and a D reports requests running, every
//!    process of that D gets SIGKILL (whichever D: the router's latency-aware pick may leave
//!    one out of a burst). Every stream still ends with 64 tokens, finish
//!    reason `length` and the reference text (the router moved the broken ones to the other D
//!    with the tokens already streamed), and the router counted migrations.
//! 3. The same 16 again; once a P reports requests in its engine (P only computes
//!    prefills, and each of its forward passes is slowed by `P_STEP_DELAY_MS`, so they are
//!    mid-prefill), every process of that P gets SIGKILL. The prefills it held are retried on
//!    the other P; every stream again equals the reference, and the router counted prefill
//!    retries.
//!
//! In the end the surviving nodes hold and use no KV block.
//!
//! Greedy text here does not depend on which node computed it nor on the batch a request
//! shared: the forward pass uses the one-token arithmetic order for every chunk shape
//! (docs/MODEL.md), so a migrated stream, a retried prefill and a recomputed one (D's
//! `kv_load_failure_policy = "recompute"` when the P it was pulling from died) give the same
//! tokens as the undisturbed run.
//!
//! Needs the model file (PDMESH_MODEL_PATH, or `scripts/fetch-model.sh`);
//! PDMESH_SKIP_MODEL_TESTS=1 skips it. Run alone:
//! `cargo test --release -p pdmesh --test failover_model -- --nocapture`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use common::failover::{burst_when, busy_node, check_all, check_reference, kill_node, load_of, STREAMS};
use common::topo::{self, NodeRole};
use common::{metric, reserve_ports, side_ports, Mesh, UpOptions};

/// The shipped topology this test runs.
const SCALEOUT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/topology/scaleout.toml");
/// Added to every forward pass on P: a prefill step lasts at least this long, a window the
/// test's `/load` poll and kill land in whatever the machine's speed.
const P_STEP_DELAY_MS: u64 = 1000;
/// Added to every forward pass on D: 64 decode steps last at least 64 × this, so a stream is
/// still running when the last of the 16 gets its first token.
const D_STEP_DELAY_MS: u64 = 40;

/// The nodes of the rewritten topology: names and HTTP ports, in the file's order.
#[derive(Debug, Default)]
struct Nodes {
    router: u16,
    prefill: Vec<(String, u16)>,
    decode: Vec<(String, u16)>,
}

/// `scaleout.toml` with this test's ports (`reserve_ports` ranges: 5 HTTP ports, a base range
/// of 40 per node, the side-channel ranges of the two reservations), run dir, model path and
/// executor faults; everything else as shipped.
fn topology(model: &Path, (h1, b1): (u16, u16), (h2, b2): (u16, u16)) -> (topo::Topology, Nodes) {
    let mut t = topo::Topology::load(Path::new(SCALEOUT)).unwrap();
    assert_eq!(t.nodes.len(), 5, "scaleout.toml: a router, 2 P and 2 D nodes expected");
    let http = [h1, h1 + 1, h1 + 2, h2, h2 + 1];
    let base = [b1, b1 + 40, b1 + 80, b2, b2 + 40];
    let (s1, s2) = (side_ports(h1), side_ports(h2));
    let mut side = [s1, s1 + 4, s2, s2 + 4].into_iter();
    let mut moved = HashMap::new();
    let mut out = Nodes::default();
    for (i, n) in t.nodes.iter_mut().enumerate() {
        moved.insert(n.http_port, http[i]);
        n.http_port = http[i];
        n.base_port = base[i];
        let delay = match n.role {
            NodeRole::Prefill => P_STEP_DELAY_MS,
            NodeRole::Decode => D_STEP_DELAY_MS,
            _ => 0,
        };
        if n.role != NodeRole::Router {
            n.model.path = model.display().to_string();
            n.model.fault_injection = format!("step_delay_ms={delay}");
        }
        if let Some(kv) = n.kv_transfer.as_mut() {
            let port = side.next().unwrap();
            kv.side_channel_port = port;
            kv.data_port = port + 2;
        }
        match n.role {
            NodeRole::Router => out.router = http[i],
            NodeRole::Prefill => out.prefill.push((n.name.clone(), http[i])),
            NodeRole::Decode => out.decode.push((n.name.clone(), http[i])),
            other => panic!("scaleout.toml: unexpected role {other:?}"),
        }
    }
    for n in t.nodes.iter_mut() {
        for url in n.router.prefill.iter_mut().chain(n.router.decode.iter_mut()) {
            let (host, port) = url.rsplit_once(':').unwrap();
            let new = moved[&port.parse::<u16>().unwrap()];
            *url = format!("{host}:{new}");
        }
    }
    assert_eq!((out.prefill.len(), out.decode.len()), (2, 2), "scaleout.toml: 2 P and 2 D nodes expected");
    (t, out)
}

/// Requests in the engine of the node on `port`, by its `/load`.
fn in_engine(port: u16) -> u64 {
    let load = load_of(port);
    load["running"].as_u64().unwrap_or(0) + load["waiting"].as_u64().unwrap_or(0)
}

#[test]
fn scaleout_loses_no_stream_when_a_decode_node_then_a_prefill_node_mid_prefill_dies() {
    let Some(model) = common::model_path() else { return };
    let (r1, r2) = (reserve_ports(), reserve_ports());
    let run_dir = common::failover::fresh_run_dir("pdmesh-failover-model", r1.0);
    let (t, nodes) = topology(&model, r1, r2);
    let engines: Vec<u16> = nodes.prefill.iter().chain(&nodes.decode).map(|(_, port)| *port).collect();
    let started = Instant::now();
    let mesh = Mesh::start_in(t, &run_dir, "scaleout.toml", (nodes.router, r1.1), &engines, &UpOptions::no_restart());
    eprintln!("mesh ready in {:.1} s", started.elapsed().as_secs_f64());
    let url = format!("http://127.0.0.1:{}/v1/completions", nodes.router);
    // 1. The undisturbed run.
    let t = Instant::now();
    let (reference, ()) = burst_when(&url, |_| Some(()), |()| {});
    eprintln!("undisturbed burst: {:.1} s", t.elapsed().as_secs_f64());
    check_reference(&reference);
    assert_eq!(metric(nodes.router, "pdmesh_router_migrations_total", ""), 0.0, "nothing moved undisturbed");
    assert_eq!(metric(nodes.router, "pdmesh_router_prefill_retries_total", ""), 0.0, "nothing retried undisturbed");

    // 2. SIGKILL every process of a D while its streams run: the first one seen running
    // requests once every stream has text (the router may have left either D out).
    let t = Instant::now();
    let (got, d_victim) = burst_when(
        &url,
        |n| {
            if n >= STREAMS {
                busy_node(&nodes.decode, |port| load_of(port)["running"].as_u64().unwrap_or(0))
            } else {
                None
            }
        },
        |d| {
            let d_dead = &nodes.decode[d].0;
            let killed = kill_node(&mesh, d_dead);
            assert!(killed >= 3, "{d_dead}'s frontend, dp-lb and engine processes");
            eprintln!("killed {killed} processes of {d_dead} mid-stream");
        },
    );
    let (d_dead, _) = &nodes.decode[d_victim];
    eprintln!("burst with {d_dead} killed: {:.1} s", t.elapsed().as_secs_f64());
    check_all(&got, &reference, &format!("{d_dead} killed"));
    let moved = metric(nodes.router, "pdmesh_router_migrations_total", "");
    eprintln!("migrations: {moved}");
    assert!(moved >= 1.0, "streams on {d_dead} moved to the other D");

    // 3. SIGKILL every process of a P while it computes prefills: the first one seen with
    // requests in its engine.
    let retried_before = metric(nodes.router, "pdmesh_router_prefill_retries_total", "");
    let t = Instant::now();
    let (got, p_victim) = burst_when(
        &url,
        |_| busy_node(&nodes.prefill, in_engine),
        |p| {
            let p_dead = &nodes.prefill[p].0;
            let killed = kill_node(&mesh, p_dead);
            assert!(killed >= 3, "{p_dead}'s frontend, dp-lb and engine processes");
            eprintln!("killed {killed} processes of {p_dead} with requests in its engine (mid-prefill)");
        },
    );
    let (p_dead, _) = &nodes.prefill[p_victim];
    eprintln!("burst with {p_dead} killed: {:.1} s", t.elapsed().as_secs_f64());
    check_all(&got, &reference, &format!("{p_dead} killed"));
    let retries = metric(nodes.router, "pdmesh_router_prefill_retries_total", "") - retried_before;
    eprintln!("prefill retries: {retries}");
    assert!(retries >= 1.0, "prefills in {p_dead} were retried on the other P");

    // Nothing stays held on the survivors.
    let (_, p_alive) = &nodes.prefill[1 - p_victim];
    mesh.wait_kv_on(*p_alive, "P holds nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    let (_, d_alive) = &nodes.decode[1 - d_victim];
    mesh.wait_kv_on(*d_alive, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"));
    drop(mesh);
    let _ = std::fs::remove_dir_all(&run_dir);
}
