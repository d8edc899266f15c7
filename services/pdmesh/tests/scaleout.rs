//! Scale-out (D50): one topology with a router, 2 prefill and 2 decode nodes (the shape of
//! deploy/topology/scaleout.toml, synthetic executor, tcp KV backend), started as three
//! `pdmesh up --node` processes that share only the topology file, the run dir and the mesh
//! secret in their environment: `--node router`, `--node p-a,d-a`, `--node p-b --node d-b`.
//!
//! Through the router, greedy output must equal a colocated node's for the same prompts; every
//! P and every D must have served some of the requests (their frontends' finish counters), each
//! P must have answered a KV handshake (so D read blocks across `pdmesh up` processes, which
//! fails if they do not share the secret), and every P and D must end holding and using no KV
//! block. Each process keeps its own process table (`mesh.<nodes>.json`), listing its nodes only.
//! `--node nosuch`, and a P/D subset without a mesh secret, exit 78 with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{complete, metric, reserve_ports, topo, Mesh, TopologyExt, UpOptions};
use pdmesh_test_support::Launch;

/// Every node: the synthetic model at 200 µs a token, 512 blocks of 4 tokens.
fn settings(n: &mut topo::NodeConfig) {
    n.model.per_token_cost_us = 200;
    n.engine.block_size = 4;
    n.engine.num_blocks = 512;
}
const SECRET: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const EXIT_CONFIG: i32 = 78;

/// The node groups, one `pdmesh up` each, as `--node` arguments.
const GROUPS: [&[&str]; 3] = [&["--node", "router"], &["--node", "p-a,d-a"], &["--node", "p-b", "--node", "d-b"]];

/// `pdmesh up --topology <topology> <args>` with `PDMESH_MESH_SECRET` set to `secret` (or
/// unset), its stderr in `<run_dir>/<log>`; the mesh's helpers look at the router on `ports`.
fn up(topology: &Path, run_dir: &Path, ports: (u16, u16), args: &[&str], secret: Option<&str>, log: &str) -> Mesh {
    let options = UpOptions {
        args: args.iter().map(|a| a.to_string()).collect(),
        env: secret.map(|s| ("PDMESH_MESH_SECRET".to_string(), s.to_string())).into_iter().collect(),
        env_remove: ["PDMESH_MESH_SECRET", "PDMESH_API_KEY", "PDMESH_API_KEY_FILE"].map(String::from).to_vec(),
        log: Some(log.into()),
        ..Default::default()
    };
    let launch = Launch {
        run_dir: run_dir.to_path_buf(),
        file: String::new(),
        http_port: ports.0,
        base_port: ports.1,
        ready: vec![],
        options,
    };
    Mesh::launch_file(topology, launch).unwrap()
}

/// Run a `pdmesh up` that must refuse to start: its exit status and stderr.
fn refused(topology: &Path, run_dir: &Path, args: &[&str], secret: Option<&str>) -> (Option<i32>, String) {
    let mut mesh = up(topology, run_dir, (0, 0), args, secret, "refused.log");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = mesh.up.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = mesh.up.kill();
            let _ = mesh.up.wait();
            panic!("pdmesh up {args:?} was still running after 30 s; it should have refused to start");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status.code(), std::fs::read_to_string(run_dir.join("refused.log")).unwrap())
}

#[test]
fn three_up_processes_serve_one_scaleout_mesh() {
    let (r1, r2) = (reserve_ports(), reserve_ports());
    let run_dir = common::fresh_run_dir("pdmesh-scaleout", r1.0);
    let (mut t, ports) = topo::scaleout(r1, r2);
    t.run_dir = run_dir.clone();
    let text = t.all_nodes(settings).text();
    // connector-worker `/metrics` of each P (rank 0)
    let p_worker_metrics = [r1.1 + 20 + 112, r2.1 + 20 + 112];
    let topo = run_dir.join("scaleout.toml");
    std::fs::write(&topo, text).unwrap();

    // (c) an unknown node, (d) a P/D subset without the shared secret: refused before anything
    // starts, with the configuration-error status and the reason.
    let (code, err) = refused(&topo, &run_dir, &["--node", "p-a,nosuch"], Some(SECRET));
    assert_eq!(code, Some(EXIT_CONFIG), "{err}");
    assert!(err.contains("\"nosuch\""), "the error names the unknown node: {err}");
    let (code, err) = refused(&topo, &run_dir, &["--node", "p-a,d-a"], None);
    assert_eq!(code, Some(EXIT_CONFIG), "{err}");
    assert!(err.contains("PDMESH_MESH_SECRET"), "the error says what to set: {err}");
    assert!(!run_dir.join("logs").exists() || std::fs::read_dir(run_dir.join("logs")).unwrap().next().is_none());

    // (a) one `pdmesh up` per node group, sharing the topology, the run dir and the secret.
    let mut meshes: Vec<Mesh> = GROUPS
        .iter()
        .enumerate()
        .map(|(i, args)| up(&topo, &run_dir, (ports.router, r1.1), args, Some(SECRET), &format!("up-{i}.log")))
        .collect();
    for port in ports.p.iter().chain(&ports.d) {
        assert!(meshes[0].wait_ready_on(*port), "node on :{port} not ready; logs in {}", run_dir.display());
    }
    common::wait_for("the router is healthy", || {
        reqwest::blocking::get(format!("http://127.0.0.1:{}/health", ports.router))
            .is_ok_and(|r| r.status().is_success())
    });
    let colocated = Mesh::start_one(settings);

    // Each process keeps its own table, listing its own nodes only.
    for (file, nodes) in [
        ("mesh.router.json", &["router"][..]),
        ("mesh.p-a+d-a.json", &["p-a", "d-a"][..]),
        ("mesh.p-b+d-b.json", &["p-b", "d-b"][..]),
    ] {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run_dir.join(file)).unwrap()).unwrap();
        let mut seen: Vec<String> =
            v["processes"].as_array().unwrap().iter().map(|p| p["node"].as_str().unwrap().to_string()).collect();
        seen.dedup();
        assert_eq!(seen, nodes, "{file}");
    }
    assert!(!run_dir.join("mesh.json").exists(), "no process claims the whole mesh's table");

    // (b) requests through the router equal the colocated node's.
    let router = format!("http://127.0.0.1:{}/v1/completions", ports.router);
    let reference = colocated.url("/v1/completions");
    for i in 0..12 {
        let prompt = format!("scale-out prompt {i} {}", "y".repeat(i * 2));
        let expected = complete(&reference, &prompt, false);
        assert_eq!(complete(&router, &prompt, i % 2 == 0), expected, "{prompt}");
    }
    let finished = "pdmesh_frontend_request_finish_total";
    for port in ports.p.iter().chain(&ports.d) {
        let n = metric(*port, finished, "");
        eprintln!("node :{port} {finished} = {n}");
        assert!(n > 0.0, "the node on :{port} served none of the requests ({finished} = {n})");
    }
    for port in p_worker_metrics {
        let n = metric(port, "pdmesh_worker_kv_handshakes_served", "");
        assert!(n >= 1.0, "no D read blocks from the P whose worker is on :{port}");
    }
    let probe = &meshes[0];
    for port in ports.p {
        probe.wait_kv_on(port, "P holds nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    }
    for port in ports.d {
        probe.wait_kv_on(port, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    }
    assert!(!probe.logs().contains("panicked"));
    drop(colocated);
    // Stop the groups one by one: each `pdmesh up` stops its own nodes and exits cleanly.
    while let Some(mesh) = meshes.pop() {
        let mut up = mesh;
        let pid = nix::unistd::Pid::from_raw(up.up.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = up.up.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "pdmesh up did not stop in 30 s");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(status.success(), "pdmesh up stopped with {status}");
    }
    let _ = std::fs::remove_dir_all(&run_dir);
}
