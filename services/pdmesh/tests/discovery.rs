//! Upstreams by DNS (D61): a router that names its prefill and decode nodes by `host:port`
//! (`router.prefill_dns`, `router.decode_dns`, as a Kubernetes headless Service would be named)
//! instead of URLs. Here the names are `localhost:<port>`, which the system resolver answers
//! with the loopback address the nodes listen on: the router must discover one P and one D from
//! them (`pdmesh_router_upstreams{source="dns"}`), report itself ready, serve completions
//! (plain and streamed) through them, and count its picks under the resolved URL.
//!
//! Then the pods of deploy/k8s/pdmesh-scaled.yaml, as processes: P and D each a `pdmesh serve
//! --host 0.0.0.0` with an engine id of their own, P advertising another address than the one
//! D and the router reach it on (`VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.2`, as a pod advertises
//! its pod IP), and a `pdmesh proxy --topology` whose router names them by DNS. D must read P's
//! blocks at the advertised address, which works only if P's side channel and block server
//! listen on every interface.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{complete, pd_topology, topo, wait_for, Mesh, NodeExt, TopologyExt};

/// P, D (and the reference, left out): the synthetic model at 200 µs a token, 256 blocks of 4.
fn settings(n: &mut topo::NodeConfig) {
    n.model.per_token_cost_us = 200;
    n.engine.block_size = 4;
    n.engine.num_blocks = 256;
}

/// Upstreams by DNS name, `localhost:<p>` and `localhost:<d>`, re-resolved every `refresh_ms`,
/// in place of URLs.
fn by_name(r: &mut topo::RouterConfig, p: u16, d: u16, refresh_ms: u64) {
    r.prefill.clear();
    r.decode.clear();
    r.prefill_dns = Some(format!("localhost:{p}"));
    r.decode_dns = Some(format!("localhost:{d}"));
    r.dns_refresh_ms = refresh_ms;
}

/// The P/D mesh of the other tests, without its colocated reference node, whose router finds P
/// and D by name, re-resolving every 200 ms.
fn topology(http: u16, base: u16) -> topo::Topology {
    pd_topology(http, base, topo::TransferBackendKind::Shm, 1, settings)
        .without("c")
        .with_node("router", |n| by_name(&mut n.router, http + 1, http + 2, 200))
}

/// The samples of `name` on a Prometheus page whose labels contain every one of `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{')))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
        + 0.0
}

#[test]
fn a_router_finds_p_and_d_by_dns_name_and_serves_through_them() {
    let mesh = Mesh::start_nodes(topology, |h| vec![h + 1, h + 2]);
    let (p, d) = (mesh.http_port + 1, mesh.http_port + 2);
    wait_for("the router is ready over its discovered upstreams", || {
        mesh.get(&mesh.url("/health")).is_ok_and(|r| r.status().is_success())
    });
    let health: serde_json::Value = mesh.get(&mesh.url("/health")).unwrap().json().unwrap();
    assert_eq!((health["prefill_upstreams"].as_u64(), health["decode_upstreams"].as_u64()), (Some(1), Some(1)));

    let url = mesh.url("/v1/completions");
    assert!(!complete(&url, "The capital of France is", false).is_empty());
    assert!(!complete(&url, "Once upon a time", true).is_empty());

    let page = mesh.get(&mesh.url("/metrics")).unwrap().text().unwrap();
    eprintln!("router health: {health}");
    for l in page.lines().filter(|l| l.starts_with("pdmesh_router_upstreams") || l.starts_with("pdmesh_router_picks")) {
        eprintln!("{l}");
    }
    for role in ["prefill", "decode"] {
        let discovered = metric(&page, "pdmesh_router_upstreams", &[&format!("role=\"{role}\""), "source=\"dns\""]);
        assert_eq!(discovered, 1.0, "{role} upstreams discovered by DNS:\n{page}");
        let configured = metric(&page, "pdmesh_router_upstreams", &[&format!("role=\"{role}\""), "source=\"static\""]);
        assert_eq!(configured, 0.0, "{role}: no URL was configured");
    }
    for (role, port) in [("prefill", p), ("decode", d)] {
        let upstream = format!("upstream=\"http://127.0.0.1:{port}\"");
        let picks = metric(&page, "pdmesh_router_picks_total", &[&format!("role=\"{role}\""), &upstream]);
        assert!(picks >= 2.0, "both requests went to the {role} node found by name ({picks} picks):\n{page}");
    }
    assert_eq!(metric(&page, "pdmesh_router_discovery_errors_total", &[]), 0.0, "{page}");
    assert!(mesh.stop().success());
}

/// A process of the pod-shaped mesh, stopped with SIGTERM (then killed) on drop.
struct Pod(Child, &'static str);

impl Drop for Pod {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("{} did not stop in 20 s; killing", self.1);
        let _ = self.0.kill();
    }
}

const SECRET: &str = "0123456789abcdef0123456789abcdef-discovery-test";

fn pod(run_dir: &std::path::Path, name: &'static str, args: &[String], env: &[(&str, String)]) -> Pod {
    let child = Command::new(common::pdmesh_bin())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("PDMESH_RUN_DIR", run_dir)
        .env("PDMESH_MESH_SECRET", SECRET)
        .env_remove("PDMESH_TOPOLOGY")
        .env_remove("PDMESH_API_KEY")
        .env_remove("PDMESH_API_KEY_FILE")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(run_dir.join(format!("{name}.log"))).unwrap())
        .spawn()
        .unwrap();
    Pod(child, name)
}

/// `pdmesh serve` as a P or D pod runs it (the manifest's args, on this test's ports).
fn serve_args(model: &str, port: u16, base: u16, kv_role: &str, engine_id: &str, side: u16) -> Vec<String> {
    let kv = serde_json::json!({
        "kv_connector": "PdmeshConnector", "kv_role": kv_role, "engine_id": engine_id,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"backend": "tcp", "side_channel_port": side, "data_port": side + 2},
    });
    let args = ["serve", model, "--host=0.0.0.0", &format!("--port={port}"), &format!("--base-port={base}")];
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend(["--max-model-len", "1024", "--num-gpu-blocks-override", "128"].map(String::from));
    args.extend(["--kv-transfer-config".to_string(), kv.to_string()]);
    args
}

fn ready(port: u16, run_dir: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline {
        if reqwest::blocking::get(format!("http://127.0.0.1:{port}/health")).is_ok_and(|r| r.status().is_success()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("node on :{port} not ready in 90 s; logs in {}", run_dir.display());
}

#[test]
fn pods_of_the_scaled_manifest_serve_p_d_at_their_advertised_addresses() {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping");
        return;
    }
    let model = pdmesh_model::default_model_path();
    assert!(model.is_file(), "model {} missing: run scripts/fetch-model.sh", model.display());
    let model = model.display().to_string();
    let (http, base) = common::reserve_ports();
    let side = common::side_ports(http);
    let (router, p, d) = (http, http + 1, http + 2);
    let run_dir = common::fresh_run_dir("pdmesh-discovery", http);
    let topology = run_dir.join("router.toml");
    let router_node =
        topo::router("router", router, base, &[], &[]).http_host("0.0.0.0").router_with(|r| by_name(r, p, d, 500));
    std::fs::write(&topology, topo::topology([router_node]).text()).unwrap();
    // P advertises 127.0.0.2 (its "pod IP"); D and the router reach it on 127.0.0.1.
    let p_env = [("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.2".to_string())];
    let p_args = serve_args(&model, p, base + 20, "kv_producer", "pdmesh-prefill-5d8c7-x2k4q", side);
    let _p = pod(&run_dir, "p", &p_args, &p_env);
    let d_env = [("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1".to_string())];
    let d_args = serve_args(&model, d, base + 40, "kv_consumer", "pdmesh-decode-7f9b6-m3n8z", side + 4);
    let _d = pod(&run_dir, "d", &d_args, &d_env);
    let proxy_args: Vec<String> =
        ["proxy", "--topology", &topology.display().to_string()].iter().map(|a| a.to_string()).collect();
    let _router = pod(&run_dir, "router", &proxy_args, &[]);
    ready(p, &run_dir);
    ready(d, &run_dir);
    ready(router, &run_dir);

    let url = format!("http://127.0.0.1:{router}/v1/completions");
    assert!(!complete(&url, "The capital of France is", false).is_empty());
    assert!(!complete(&url, "Once upon a time", true).is_empty());
    // D read P's blocks: P's connector-worker (base + 112) served its handshakes, at 127.0.0.2.
    let worker =
        reqwest::blocking::get(format!("http://127.0.0.1:{}/metrics", base + 20 + 112)).unwrap().text().unwrap();
    assert!(handshakes_served(&worker) >= 1.0, "D read from P:\n{worker}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.2", side)).is_ok(),
        "P's side channel listens on every interface, not only on loopback's 127.0.0.1"
    );
}

/// `pdmesh_worker_kv_handshakes_served` on a connector-worker's metrics page (no labels).
fn handshakes_served(page: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix("pdmesh_worker_kv_handshakes_served "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}
