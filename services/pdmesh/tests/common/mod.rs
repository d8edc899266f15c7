//! Test support: start a real mesh with `pdmesh up` on private ports and a private run dir,
//! talk to it over HTTP, read its process table, stop it.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

pub mod failover;

static NEXT: AtomicU16 = AtomicU16::new(0);

/// A running mesh; stopped (SIGTERM, then kill) on drop.
pub struct Mesh {
    pub up: Child,
    pub run_dir: PathBuf,
    pub http_port: u16,
    pub base_port: u16,
    /// The API key the helpers present on `/debug/*` when the mesh requires one.
    pub api_key: Option<String>,
}

/// How to start `pdmesh up` beyond its topology.
#[derive(Debug, Clone, Default)]
pub struct UpOptions {
    /// Extra arguments of `pdmesh up`.
    pub args: Vec<String>,
    /// Extra environment of `pdmesh up` (and so of every child).
    pub env: Vec<(String, String)>,
    /// The key the helpers present (`Authorization: Bearer`) when the mesh requires one.
    pub api_key: Option<String>,
}

/// Ports unique to this test process and this mesh: HTTP ports `http..http+4` (one per node
/// of a multi-node mesh) and internal/ops ports `base..base+240` (a three-node mesh uses up to
/// `base + 60 + 175`), 320 apart from the next mesh's so that meshes of concurrent tests never
/// share a port. Everything stays below 32768, where Linux's ephemeral ports begin. Test
/// binaries run one after the other, so only meshes of one process need to stay apart.
fn ports() -> (u16, u16) {
    let k = NEXT.fetch_add(1, Ordering::SeqCst);
    let slot = (std::process::id() % 40) as u16 * 40 + k * 4;
    (18000 + slot, 20000 + ((u32::from(slot) * 80) % 12000) as u16)
}

/// Ports for a mesh a test starts by hand (`http`, `base`), apart from every [`Mesh`]'s.
pub fn reserve_ports() -> (u16, u16) {
    ports()
}

/// The `pdmesh` binary under test (`PDMESH_TEST_BIN` overrides it).
pub fn pdmesh_bin() -> std::ffi::OsString {
    std::env::var_os("PDMESH_TEST_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_pdmesh").into())
}

/// A fresh run dir `<tmp>/<prefix>-<pid>-<http>` holding `topology-in.toml`: one node `main`
/// on `http` and `base`, with `node_extra` appended to its table. Returns (run dir, topology).
pub fn one_node_run_dir(prefix: &str, http: u16, base: u16, node_extra: &str) -> (PathBuf, PathBuf) {
    let run_dir = std::env::temp_dir().join(format!("{prefix}-{}-{http}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).unwrap();
    let topology = run_dir.join("topology-in.toml");
    let text = format!(
        "run_dir = {:?}\n[[nodes]]\nname = \"main\"\nhttp_port = {http}\nbase_port = {base}\n{node_extra}\n",
        run_dir.display().to_string()
    );
    std::fs::write(&topology, text).unwrap();
    (run_dir, topology)
}

/// A side-channel port range of this mesh (8 ports), apart from the HTTP and base ranges.
pub fn side_ports(http_port: u16) -> u16 {
    61000 + ((http_port - 18000) * 2) % 4000
}

impl Mesh {
    /// Start a mesh from a full topology: `nodes(http_port, base_port)` returns the `[[nodes]]`
    /// tables; every port it uses must derive from those two (http_port + 0..8, base_port +
    /// 0..150). `engine_ports` are the HTTP ports of the nodes that have engines (checked for
    /// readiness); `http_port` of the returned mesh is the first node's.
    pub fn start_nodes(nodes: impl Fn(u16, u16) -> String, engine_ports: impl Fn(u16) -> Vec<u16>) -> Mesh {
        Self::launch_retrying(nodes, &UpOptions::default(), engine_ports)
    }

    /// [`Mesh::start_nodes`] with more arguments and environment for `pdmesh up`.
    pub fn start_nodes_with(
        nodes: impl Fn(u16, u16) -> String,
        engine_ports: impl Fn(u16) -> Vec<u16>,
        options: &UpOptions,
    ) -> Mesh {
        Self::launch_retrying(nodes, options, engine_ports)
    }

    /// Our listening ports lie inside Linux's ephemeral range, so a client socket of anything
    /// on the machine may hold one for a moment. A mesh whose process could not bind is
    /// stopped and started again on the next ports (up to 4 tries).
    fn launch_retrying(
        nodes: impl Fn(u16, u16) -> String,
        options: &UpOptions,
        engine_ports: impl Fn(u16) -> Vec<u16>,
    ) -> Mesh {
        for attempt in 0.. {
            let (http_port, base_port) = ports();
            match Self::launch(nodes(http_port, base_port), options, http_port, base_port, &engine_ports(http_port)) {
                Ok(mesh) => return mesh,
                Err(mesh) if attempt < 3 && mesh.port_clash() => {
                    eprintln!("mesh on ports {http_port}/{base_port}: a port was taken; retrying on others");
                    drop(mesh);
                }
                Err(mesh) => panic!("mesh not ready in 60 s; logs in {}", mesh.run_dir.display()),
            }
        }
        unreachable!()
    }

    /// Whether some process of the mesh failed to bind its port.
    fn port_clash(&self) -> bool {
        self.logs().contains("Address already in use")
            || std::fs::read_to_string(self.run_dir.join("up.log"))
                .unwrap_or_default()
                .contains("Address already in use")
    }

    /// Write the topology, start `pdmesh up` on it, and wait until every node in
    /// `engine_ports` has its engines connected.
    fn launch(
        nodes: String,
        options: &UpOptions,
        http_port: u16,
        base_port: u16,
        engine_ports: &[u16],
    ) -> Result<Mesh, Mesh> {
        let run_dir = std::env::temp_dir().join(format!("pdmesh-test-{}-{}", std::process::id(), http_port));
        let _ = std::fs::remove_dir_all(&run_dir);
        std::fs::create_dir_all(&run_dir).unwrap();
        let topo = format!("run_dir = {:?}\n{nodes}\n", run_dir.display().to_string());
        let path = run_dir.join("test-topology.toml");
        std::fs::write(&path, topo).unwrap();
        // PDMESH_TEST_BIN: run these tests against another build of the binary (e.g. the
        // `cuda` build on a GPU machine, docs/MODEL.md).
        let up = Command::new(pdmesh_bin())
            .arg("up")
            .arg("--topology")
            .arg(&path)
            .args(&options.args)
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .env("PDMESH_RUN_DIR", &run_dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(run_dir.join("up.log")).unwrap())
            .spawn()
            .unwrap();
        let mut mesh = Mesh { up, run_dir, http_port, base_port, api_key: options.api_key.clone() };
        for &port in engine_ports {
            let saved = mesh.http_port;
            mesh.http_port = port;
            let ready = mesh.wait_ready();
            mesh.http_port = saved;
            if !ready {
                return Err(mesh);
            }
        }
        Ok(mesh)
    }

    /// The same mesh seen through another node's frontend port.
    pub fn url_on(&self, port: u16, path: &str) -> String {
        format!("http://127.0.0.1:{port}{path}")
    }

    /// `GET url`, with the mesh's API key when it has one.
    pub fn get(&self, url: &str) -> reqwest::Result<reqwest::blocking::Response> {
        let rb = reqwest::blocking::Client::new().get(url);
        match &self.api_key {
            Some(k) => rb.bearer_auth(k),
            None => rb,
        }
        .send()
    }

    /// `GET /debug/kv` of the node on `port`.
    pub fn kv_on(&self, port: u16) -> serde_json::Value {
        self.get(&self.url_on(port, "/debug/kv")).unwrap().json().unwrap()
    }

    /// Wait until `cond` holds on `/debug/kv` of the node on `port`.
    pub fn wait_kv_on(&self, port: u16, what: &str, cond: impl Fn(&serde_json::Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut last = serde_json::Value::Null;
        while Instant::now() < deadline {
            last = self.kv_on(port);
            if cond(&last) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{what}: never true; last /debug/kv on :{port} = {last}");
    }

    /// Start a one-node mesh. `node_extra` is appended to the node's TOML table, `sections`
    /// after it (e.g. `[nodes.model]` overrides).
    pub fn start(node_extra: &str, sections: &str, up_args: &[&str]) -> Mesh {
        let options = UpOptions { args: up_args.iter().map(|a| a.to_string()).collect(), ..Default::default() };
        Self::start_with(node_extra, sections, &options)
    }

    /// [`Mesh::start`] with more arguments and environment for `pdmesh up`.
    pub fn start_with(node_extra: &str, sections: &str, options: &UpOptions) -> Mesh {
        let nodes = |http_port: u16, base_port: u16| {
            format!(
                "[[nodes]]\nname = \"main\"\nhttp_port = {http_port}\nbase_port = {base_port}\n{node_extra}\n{sections}"
            )
        };
        Self::launch_retrying(nodes, options, |h| vec![h])
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.http_port, path)
    }

    /// Wait until the node on `http_port` is healthy with its engine ranks connected, or a
    /// port clash makes that impossible; false after 60 s or on a clash.
    fn wait_ready(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(60);
        let client = reqwest::blocking::Client::new();
        while Instant::now() < deadline {
            if let Ok(r) = client.get(self.url("/health")).send() {
                if r.status().is_success() {
                    // the engine ranks must be connected too
                    if let Ok(r) = self.get(&self.url("/debug/engines")) {
                        if let Ok(v) = r.json::<serde_json::Value>() {
                            if v["unreachable_ranks"].as_array().is_some_and(|a| a.is_empty())
                                && v["engines"].as_array().is_some_and(|a| !a.is_empty())
                            {
                                return true;
                            }
                        }
                    }
                }
            }
            if self.port_clash() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// Wait until the node on `port` (a node of this mesh started by another `pdmesh up` too)
    /// is healthy with its engine ranks connected; false after 60 s or on a port clash.
    pub fn wait_ready_on(&mut self, port: u16) -> bool {
        let saved = std::mem::replace(&mut self.http_port, port);
        let ready = self.wait_ready();
        self.http_port = saved;
        ready
    }

    /// The process table written by `pdmesh up`.
    pub fn processes(&self) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(self.run_dir.join("mesh.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["processes"].as_array().unwrap().clone()
    }

    pub fn pid_of(&self, service: &str, rank: u32) -> i32 {
        self.processes()
            .iter()
            .find(|p| p["service"] == service && p["rank"] == rank)
            .and_then(|p| p["pid"].as_i64())
            .unwrap() as i32
    }

    /// The pid of `service` rank `rank` of node `node` (multi-node meshes).
    pub fn pid_on(&self, node: &str, service: &str, rank: u32) -> i32 {
        self.processes()
            .iter()
            .find(|p| p["node"] == node && p["service"] == service && p["rank"] == rank)
            .and_then(|p| p["pid"].as_i64())
            .unwrap() as i32
    }

    /// SIGKILL `service` rank `rank` of node `node`; returns the pid killed.
    pub fn kill9_on(&self, node: &str, service: &str, rank: u32) -> i32 {
        let pid = self.pid_on(node, service, rank);
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
        pid
    }

    pub fn kill9(&self, service: &str, rank: u32) {
        let pid = self.pid_of(service, rank);
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    }

    /// `GET /debug/kv` as JSON.
    pub fn kv(&self) -> serde_json::Value {
        self.get(&self.url("/debug/kv")).unwrap().json().unwrap()
    }

    /// Wait until `cond` holds on `/debug/kv`, or fail with the last value.
    pub fn wait_kv(&self, what: &str, cond: impl Fn(&serde_json::Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut last = serde_json::Value::Null;
        while Instant::now() < deadline {
            last = self.kv();
            if cond(&last) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{what}: never true; last /debug/kv = {last}");
    }

    /// All log text of the mesh's processes.
    pub fn logs(&self) -> String {
        let mut all = String::new();
        if let Ok(dir) = std::fs::read_dir(self.run_dir.join("logs")) {
            for e in dir.flatten() {
                all.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
            }
        }
        all
    }

    /// SIGTERM `pdmesh up` and wait for a clean exit.
    pub fn stop(mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.up.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(s)) = self.up.try_wait() {
                let _ = std::fs::remove_dir_all(&self.run_dir);
                return s;
            }
            if Instant::now() > deadline {
                let _ = self.up.kill();
                panic!("pdmesh up did not stop in 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        if let Ok(None) = self.up.try_wait() {
            let pid = nix::unistd::Pid::from_raw(self.up.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.up.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.up.kill();
        }
    }
}

/// Parse an SSE body into its `data:` payloads.
pub fn sse_events(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A P/D mesh for tests: router (`http`), P (`http+1`), D with `d_ranks` ranks (`http+2`) and
/// a colocated reference node (`http+3`). `node_settings` (TOML lines, e.g. `model = {...}` and
/// `engine = {...}`) apply to P, D and the reference alike; `backend` is `shm` or `tcp`.
pub fn pd_topology(http: u16, base: u16, backend: &str, d_ranks: u32, node_settings: &str) -> String {
    pd_topology_with_policy(http, base, backend, d_ranks, node_settings, "fail")
}

/// [`pd_topology`] with D's `kv_load_failure_policy`.
pub fn pd_topology_with_policy(
    http: u16,
    base: u16,
    backend: &str,
    d_ranks: u32,
    node_settings: &str,
    policy: &str,
) -> String {
    let side = side_ports(http);
    let (p, d, c) = (http + 1, http + 2, http + 3);
    let (b1, b2, b3) = (base + 20, base + 40, base + 60);
    let kv = |role: &str, port: u16| {
        format!(
            "kv_transfer = {{ kv_role = \"{role}\", side_channel_port = {port}, data_port = {}, backend = \"{backend}\", kv_load_failure_policy = \"{policy}\", hold_mode = \"fixed\" }}",
            port + 2
        )
    };
    let (kv_p, kv_d) = (kv("kv_producer", side), kv("kv_consumer", side + 4));
    // tcp: P's side channel and block server listen on another loopback address than D, as a
    // second host would (tests/netns.rs puts P and D in two network namespaces).
    let (p_bind, kv_p) = if backend == "tcp" {
        ("bind_host = \"127.0.0.2\"", kv_p.replace(" }", ", side_channel_host = \"127.0.0.2\" }"))
    } else {
        ("", kv_p)
    };
    format!(
        r#"
[[nodes]]
name = "router"
role = "router"
http_port = {http}
base_port = {base}
router = {{ prefill = ["http://127.0.0.1:{p}"], decode = ["http://127.0.0.1:{d}"] }}

[[nodes]]
name = "p"
role = "prefill"
http_port = {p}
base_port = {b1}
{p_bind}
{node_settings}
{kv_p}

[[nodes]]
name = "d"
role = "decode"
http_port = {d}
base_port = {b2}
dp_size = {d_ranks}
{node_settings}
{kv_d}

[[nodes]]
name = "c"
http_port = {c}
base_port = {b3}
{node_settings}
"#
    )
}

/// A greedy completion of 12 tokens (streamed or not) through `url`: its text.
pub fn complete(url: &str, prompt: &str, stream: bool) -> String {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream});
    let r = reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(120))
        .build()
        .unwrap()
        .post(url)
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{url}");
    let text = r.text().unwrap();
    if !stream {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        return v["choices"][0]["text"].as_str().unwrap().to_string();
    }
    let mut out = String::new();
    for e in sse_events(&text) {
        if e != "[DONE]" {
            let v: serde_json::Value = serde_json::from_str(&e).unwrap();
            out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        }
    }
    out
}

/// Wait until `cond` holds (polled every 20 ms), or fail the test after 30 s saying `what`.
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{what}: never true");
}

/// The HTTP ports of the scale-out shape of [`scaleout_topology`].
pub struct ScaleoutPorts {
    pub router: u16,
    pub p: [u16; 2],
    pub d: [u16; 2],
}

/// The scale-out shape: a router over two P (`p-a`, `p-b`) and two D (`d-a`, `d-b`) nodes, tcp
/// KV backend, each node with `settings` (TOML lines: `model`, `engine`), the router with
/// `router_settings` (inline-table entries, e.g. `policy = "round_robin"`), on the two port
/// ranges `r1` and `r2` of [`reserve_ports`].
pub fn scaleout_topology(
    run_dir: &std::path::Path,
    (h1, b1): (u16, u16),
    (h2, b2): (u16, u16),
    settings: &str,
    router_settings: &str,
) -> (String, ScaleoutPorts) {
    let (s1, s2) = (side_ports(h1), side_ports(h2));
    let node = |name: &str, role: &str, http: u16, base: u16, kv_role: &str, side: u16| {
        format!(
            "[[nodes]]\nname = \"{name}\"\nrole = \"{role}\"\nhttp_host = \"127.0.0.1\"\nhttp_port = {http}\n\
             bind_host = \"127.0.0.1\"\nbase_port = {base}\n{settings}\n\
             kv_transfer = {{ kv_role = \"{kv_role}\", engine_id = \"{name}\", backend = \"tcp\", \
             side_channel_host = \"127.0.0.1\", side_channel_port = {side}, data_port = {}, \
             kv_load_failure_policy = \"recompute\" }}\n",
            side + 2
        )
    };
    let ports = ScaleoutPorts { router: h1, p: [h1 + 1, h2], d: [h1 + 2, h2 + 1] };
    let sep = if router_settings.is_empty() { "" } else { ", " };
    let text = format!(
        "run_dir = {:?}\n\
         [[nodes]]\nname = \"router\"\nrole = \"router\"\nhttp_port = {h1}\nbase_port = {b1}\n{settings}\n\
         router = {{ prefill = [\"http://127.0.0.1:{}\", \"http://127.0.0.1:{}\"], decode = [\"http://127.0.0.1:{}\", \"http://127.0.0.1:{}\"]{sep}{router_settings} }}\n\
         {}{}{}{}",
        run_dir.display().to_string(),
        ports.p[0],
        ports.p[1],
        ports.d[0],
        ports.d[1],
        node("p-a", "prefill", ports.p[0], b1 + 20, "kv_producer", s1),
        node("d-a", "decode", ports.d[0], b1 + 160, "kv_consumer", s1 + 4),
        node("p-b", "prefill", ports.p[1], b2 + 20, "kv_producer", s2),
        node("d-b", "decode", ports.d[1], b2 + 160, "kv_consumer", s2 + 4),
    );
    (text, ports)
}

/// Start `topology_text` (written into `run_dir`) with `pdmesh up --no-restart`, so nothing
/// comes back behind the test's back, and wait until every port of `ready` serves.
pub fn start_scaleout(run_dir: &std::path::Path, topology_text: &str, router: u16, base: u16, ready: &[u16]) -> Mesh {
    let topo = run_dir.join("scaleout.toml");
    std::fs::write(&topo, topology_text).unwrap();
    failover::up(&topo, run_dir, router, base, ready)
}

/// The sum of every sample of `name` (with `label` in its labels, if given) on a metrics page.
pub fn metric(port: u16, name: &str, label: &str) -> f64 {
    let text = reqwest::blocking::get(format!("http://127.0.0.1:{port}/metrics")).unwrap().text().unwrap();
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{')))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The real model for the tests that run it, or `None` (they skip, saying so) under
/// `PDMESH_SKIP_MODEL_TESTS=1`; missing otherwise is a failure naming the fetch script.
pub fn model_path() -> Option<PathBuf> {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping");
        return None;
    }
    let p = pdmesh_model::default_model_path();
    assert!(p.is_file(), "model {} missing: run scripts/fetch-model.sh", p.display());
    Some(p)
}

/// A model `scripts/fetch-model.sh NAME` fetches, by its file name in the model directory
/// (`$PDMESH_MODEL_DIR`, else `~/.cache/pdmesh/models`), or `None` under
/// `PDMESH_SKIP_MODEL_TESTS=1`; missing otherwise is a failure naming the fetch command.
pub fn named_model_path(name: &str, file: &str) -> Option<PathBuf> {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping");
        return None;
    }
    let dir = std::env::var_os("PDMESH_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/pdmesh/models"));
    let p = dir.join(file);
    assert!(p.is_file(), "model {} missing: run scripts/fetch-model.sh {name}", p.display());
    Some(p)
}

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M (`scripts/fetch-model.sh qwen2.5-0.5b`).
pub fn qwen_model_path() -> Option<PathBuf> {
    named_model_path("qwen2.5-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
}

/// A Python with the `openai` SDK: `PDMESH_OPENAI_PYTHON` if set, else a venv made under the
/// target directory (kept between runs) with `pip install openai`. No SDK is a failure, never a
/// skip: the round trip is the point of the test.
pub fn openai_python() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("PDMESH_OPENAI_PYTHON") {
        return p.into();
    }
    let venv = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let has_sdk = |py: &std::path::Path| {
        std::process::Command::new(py).args(["-c", "import openai"]).status().is_ok_and(|s| s.success())
    };
    if has_sdk(&python) {
        return python;
    }
    let made = std::process::Command::new("python3").arg("-m").arg("venv").arg(&venv).status();
    assert!(made.is_ok_and(|s| s.success()), "python3 -m venv failed: the SDK tests need python3 with venv");
    let pip = std::process::Command::new(venv.join("bin/pip")).args(["install", "--quiet", "openai"]).status();
    assert!(
        pip.is_ok_and(|s| s.success()) && has_sdk(&python),
        "pip install openai failed: the SDK tests need the official openai SDK (or PDMESH_OPENAI_PYTHON)"
    );
    python
}

/// Run `tests/py/<script>` with the openai SDK's Python ([`openai_python`]) against `base_url`;
/// it must exit 0 and print `OK`. Returns its stdout (the figures it prints).
pub fn run_sdk_script(script: &str, base_url: &str) -> String {
    let python = openai_python();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py").join(script);
    let out = std::process::Command::new(&python).arg(&path).arg(base_url).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("OK"), "{script} failed:\n{stdout}\n{stderr}");
    stdout.into_owned()
}
