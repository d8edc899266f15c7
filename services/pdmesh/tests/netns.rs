//! The tcp backend across two hosts: a P host and a D host made by the test as two network
//! namespaces (`ip netns`) joined by a veth pair, P at 10.77.0.1 and D at 10.77.0.2. Both hosts
//! read one topology file, and each host's `pdmesh up --node` starts its own nodes of it (D50):
//! `--node p` on the P host, `--node router,d` on the D host. D reaches P's side channel and block server only over the veth pair
//! (its only route to P), so every KV byte crosses it. The test reaches the router and P's
//! `/debug/kv` over two more veth pairs from its own namespace (no route between those and the
//! P–D link). Greedy output through the router must equal the same requests on a colocated node
//! in the test's namespace, and P must end holding no blocks.
//!
//! Needs root and iproute2; otherwise the test prints why and passes without running.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::topo::{self, HoldMode, KvRole, NodeConfig, TransferBackendKind::Tcp};
use common::{complete, KvExt, Mesh, NodeExt, TopologyExt};
use serde_json::Value;

/// P, D and the reference: the synthetic model at 200 µs a token, 512 blocks of 4 tokens.
fn settings(n: &mut NodeConfig) {
    n.model.per_token_cost_us = 200;
    n.engine.block_size = 4;
    n.engine.num_blocks = 512;
}
const P_ADDR: &str = "10.77.0.1";
const D_ADDR: &str = "10.77.0.2";
/// Ports inside the namespaces: nothing else lives there.
const ROUTER_PORT: u16 = 8000;
const P_PORT: u16 = 8100;
const D_PORT: u16 = 8200;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Two namespaces, three veth pairs; everything is deleted on drop, also when the test fails.
struct Hosts {
    p_ns: String,
    d_ns: String,
    /// The test's side of its links: (address of the D host, address of the P host).
    d_from_root: String,
    p_from_root: String,
    /// Root-side veth ends (deleting one deletes its pair).
    root_links: Vec<String>,
}

impl Hosts {
    fn create() -> Result<Hosts, String> {
        sweep_stale();
        let pid = std::process::id();
        // Links to the test's namespace get a subnet per test process, so two runs never
        // route the same addresses; the P–D link lives in the namespaces only.
        let k = pid % 250;
        let mut h = Hosts {
            p_ns: format!("pdmesh-p-{pid}"),
            d_ns: format!("pdmesh-d-{pid}"),
            d_from_root: format!("10.78.{k}.2"),
            p_from_root: format!("10.78.{k}.6"),
            root_links: Vec::new(),
        };
        ip(&["netns", "add", &h.p_ns])?;
        ip(&["netns", "add", &h.d_ns])?;
        let (p, d) = (h.p_ns.clone(), h.d_ns.clone());
        for ns in [&p, &d] {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        // P <-> D: the only path between the hosts.
        let (pd_p, pd_d) = (format!("pdp{pid}"), format!("pdd{pid}"));
        ip(&["link", "add", &pd_p, "type", "veth", "peer", "name", &pd_d])?;
        h.root_links.push(pd_p.clone());
        ip(&["link", "set", &pd_p, "netns", &p])?;
        ip(&["link", "set", &pd_d, "netns", &d])?;
        h.root_links.pop();
        ip(&["-n", &p, "addr", "add", &format!("{P_ADDR}/24"), "dev", &pd_p])?;
        ip(&["-n", &d, "addr", "add", &format!("{D_ADDR}/24"), "dev", &pd_d])?;
        ip(&["-n", &p, "link", "set", &pd_p, "up"])?;
        ip(&["-n", &d, "link", "set", &pd_d, "up"])?;
        // The test's namespace <-> each host (/30 each: .1/.2 to D, .5/.6 to P).
        for (ns, root_addr, host_addr, tag) in [
            (&d, format!("10.78.{k}.1"), h.d_from_root.clone(), "d"),
            (&p, format!("10.78.{k}.5"), h.p_from_root.clone(), "p"),
        ] {
            let (outer, inner) = (format!("pdr{tag}{pid}"), format!("pdh{tag}{pid}"));
            ip(&["link", "add", &outer, "type", "veth", "peer", "name", &inner])?;
            h.root_links.push(outer.clone());
            ip(&["link", "set", &inner, "netns", ns])?;
            ip(&["addr", "add", &format!("{root_addr}/30"), "dev", &outer])?;
            ip(&["link", "set", &outer, "up"])?;
            ip(&["-n", ns, "addr", "add", &format!("{host_addr}/30"), "dev", &inner])?;
            ip(&["-n", ns, "link", "set", &inner, "up"])?;
        }
        Ok(h)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for l in &self.root_links {
            let _ = ip(&["link", "del", l]);
        }
        for ns in [&self.p_ns, &self.d_ns] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Remove namespaces and links left by a run of this test that was killed (its pid is gone).
fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name.strip_prefix("pdmesh-p-").or_else(|| name.strip_prefix("pdmesh-d-")) else { continue };
        if pid.parse::<u32>().is_ok() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
            for tag in ["d", "p"] {
                let _ = ip(&["link", "del", &format!("pdr{tag}{pid}")]);
            }
        }
    }
}

/// Why the test cannot run here, if it cannot.
fn unavailable() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata("/proc/self") {
        Ok(m) if m.uid() == 0 => {}
        Ok(m) => return Some(format!("not root (uid {}): ip netns needs CAP_SYS_ADMIN", m.uid())),
        Err(e) => return Some(format!("cannot read /proc/self: {e}")),
    }
    match Command::new("ip").args(["netns", "list"]).output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!("ip netns list failed: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => Some(format!("no iproute2 (`ip`): {e}")),
    }
}

/// One mesh secret for every host of this test run (64 hex digits).
fn mesh_secret() -> &'static str {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        format!("{:032x}{:032x}", u128::from(std::process::id()), nanos)
    })
}

/// `pdmesh up` inside a namespace, stopped (SIGTERM, then SIGKILL) on drop.
struct HostMesh {
    up: Child,
    run_dir: PathBuf,
}

impl HostMesh {
    /// `pdmesh up --topology <topology> --node <nodes>` in namespace `ns`, with a run dir of
    /// its own (each host has its own file system in a real deployment).
    fn start(ns: &str, name: &str, topology: &std::path::Path, nodes: &str) -> HostMesh {
        let run_dir = std::env::temp_dir().join(format!("pdmesh-netns-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&run_dir);
        std::fs::create_dir_all(&run_dir).unwrap();
        let up = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(env!("CARGO_BIN_EXE_pdmesh"))
            .arg("up")
            .arg("--topology")
            .arg(topology)
            .arg("--node")
            .arg(nodes)
            .env("PDMESH_RUN_DIR", &run_dir)
            .env("RUST_LOG", "info")
            // Hosts started apart share the mesh's secret, as a real deployment does; each
            // `pdmesh up` would otherwise make its own and P would refuse D (docs/SECURITY.md).
            .env("PDMESH_MESH_SECRET", mesh_secret())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(run_dir.join("up.log")).unwrap())
            .spawn()
            .unwrap();
        HostMesh { up, run_dir }
    }

    fn logs(&self) -> String {
        let mut all = String::new();
        for e in std::fs::read_dir(self.run_dir.join("logs")).into_iter().flatten().flatten() {
            all.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
        }
        all
    }
}

impl Drop for HostMesh {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.up.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.up.try_wait() {
                if !std::thread::panicking() {
                    let _ = std::fs::remove_dir_all(&self.run_dir);
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.up.kill();
        let _ = self.up.wait();
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap()
}

/// Poll `url` (a `/debug/engines` page) until the node's engines are all connected.
fn wait_engines(url: &str, logs: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline {
        if let Ok(v) = client().get(url).send().and_then(|r| r.json::<Value>()) {
            if v["engines"].as_array().is_some_and(|a| !a.is_empty())
                && v["unreachable_ranks"].as_array().is_some_and(|a| a.is_empty())
            {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("{url} not ready in 90 s; logs:\n{}", logs());
}

fn metric(url: &str, name: &str) -> f64 {
    let text = client().get(url).send().unwrap().text().unwrap();
    text.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn tcp_transfer_between_two_network_namespaces() {
    if let Some(why) = unavailable() {
        eprintln!("SKIPPED tcp_transfer_between_two_network_namespaces: {why}");
        return;
    }
    let hosts = match Hosts::create() {
        Ok(h) => h,
        Err(e) => {
            // e.g. a container without CAP_NET_ADMIN: as unavailable as no `ip` at all.
            eprintln!("SKIPPED tcp_transfer_between_two_network_namespaces: cannot build the hosts: {e}");
            return;
        }
    };
    // The colocated reference, in the test's namespace.
    let reference = Mesh::start_one(settings);

    let kv = |role, host: &str| topo::kv(role, Tcp, 5600).side_host(host).data_port(5700).hold_mode(HoldMode::Fixed);
    // One topology for both hosts. P: everything binds every address; peers are told
    // 10.77.0.1 (the P–D link). D (two ranks) and the router, which reaches P over the P–D link,
    // are on the D host. `run_dir` comes from each host's PDMESH_RUN_DIR.
    let topology = std::env::temp_dir().join(format!("pdmesh-netns-{}-topology.toml", std::process::id()));
    let nodes = topo::topology([
        topo::prefill("p", P_PORT, 7100)
            .http_host("0.0.0.0")
            .bind_host("0.0.0.0")
            .with(settings)
            .kv(kv(KvRole::KvProducer, P_ADDR)),
        topo::router("router", ROUTER_PORT, 7500, &[format!("http://{P_ADDR}:{P_PORT}")], &[topo::url(D_PORT)])
            .http_host("0.0.0.0"),
        topo::decode("d", D_PORT, 7300)
            .http_host("0.0.0.0")
            .bind_host("0.0.0.0")
            .dp_size(2)
            .with(settings)
            .kv(kv(KvRole::KvConsumer, D_ADDR)),
    ]);
    std::fs::write(&topology, nodes.text()).unwrap();
    let p_mesh = HostMesh::start(&hosts.p_ns, "p", &topology, "p");
    let d_mesh = HostMesh::start(&hosts.d_ns, "d", &topology, "router,d");
    let (p_url, d_url, router) = (
        format!("http://{}:{P_PORT}", hosts.p_from_root),
        format!("http://{}:{D_PORT}", hosts.d_from_root),
        format!("http://{}:{ROUTER_PORT}", hosts.d_from_root),
    );
    wait_engines(&format!("{p_url}/debug/engines"), || p_mesh.logs());
    wait_engines(&format!("{d_url}/debug/engines"), || d_mesh.logs());

    let via_router = format!("{router}/v1/completions");
    let colocated = reference.url("/v1/completions");
    // shorter than one block (4 tokens), exactly N blocks, N blocks + 1 token, longer
    for prompt in ["abc", "abcdefgh", "abcdefghi", "the quick brown fox jumps over the lazy dog"] {
        let expected = complete(&colocated, prompt, false);
        assert_eq!(complete(&via_router, prompt, false), expected, "non-streaming P/D for {prompt:?}");
        assert_eq!(complete(&via_router, prompt, true), expected, "streaming P/D for {prompt:?}");
    }
    let hs: Vec<_> = (0..8)
        .map(|i| {
            let (via_router, colocated) = (via_router.clone(), colocated.clone());
            std::thread::spawn(move || {
                let p = format!("concurrent prompt {i} {}", "y".repeat(i * 5));
                assert_eq!(complete(&via_router, &p, i % 2 == 1), complete(&colocated, &p, false), "{p}");
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }

    // Every KV byte crossed the P–D link: D read them over tcp from 10.77.0.1.
    let d_worker = |rank: u16| format!("http://{}:{}/metrics", hosts.d_from_root, 7300 + 112 + 3 * rank);
    let read: f64 = (0..2).map(|r| metric(&d_worker(r), "pdmesh_worker_kv_transfer_bytes_total")).sum();
    assert!(read > 0.0, "D read no KV bytes");
    let served =
        metric(&format!("http://{}:{}/metrics", hosts.p_from_root, 7100 + 112), "pdmesh_worker_kv_handshakes_served");
    assert!((1.0..=2.0).contains(&served), "one handshake per D rank, not per request: {served}");

    // P's held blocks return to zero; D's blocks are free.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let p: Value = client().get(format!("{p_url}/debug/kv")).send().unwrap().json().unwrap();
        let d: Value = client().get(format!("{d_url}/debug/kv")).send().unwrap().json().unwrap();
        if p["held_blocks"] == 0 && p["used_blocks"] == 0 && d["used_blocks"] == 0 && d["held_blocks"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "blocks never released: P {p}, D {d}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let logs = p_mesh.logs() + &d_mesh.logs();
    assert!(!logs.contains("panicked"), "a panic in the logs");
    assert!(logs.contains(&format!("tcp://{P_ADDR}:5600")), "D handshook with P's side channel on the P–D link");
    // Each host ran only its own nodes of the shared file.
    let nodes_of = |mesh: &HostMesh, file: &str| -> Vec<String> {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(mesh.run_dir.join(file)).unwrap()).unwrap();
        let mut n: Vec<String> =
            v["processes"].as_array().unwrap().iter().map(|p| p["node"].as_str().unwrap().to_string()).collect();
        n.dedup();
        n
    };
    assert_eq!(nodes_of(&p_mesh, "mesh.p.json"), ["p"]);
    assert_eq!(nodes_of(&d_mesh, "mesh.router+d.json"), ["router", "d"]);
    drop((d_mesh, p_mesh));
    drop(hosts);
    let _ = std::fs::remove_file(&topology);
}
