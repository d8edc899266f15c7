//! The one mesh launcher: write a topology into a private run dir, start `pdmesh up --topology`
//! on it, wait until its nodes are ready, and give the test its process table, logs and
//! `/debug/kv`; stop it with SIGTERM (and on drop).
//!
//! Blocking (threads and `reqwest::blocking`): the tests call it directly, the async load
//! tests from `spawn_blocking`. Tests take their ports from [`ports`] (unique per process and
//! per mesh, retried on "Address already in use"); the load tests give their own.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use pdmesh_config::Topology;

use crate::topology::TopologyExt as _;

static NEXT: AtomicU16 = AtomicU16::new(0);

/// Ports unique to this process and this mesh: HTTP ports `http..http+4` (one per node of a
/// multi-node mesh) and internal/ops ports `base..base+240` (a three-node mesh uses up to
/// `base + 60 + 175`), 320 apart from the next mesh's so that meshes of concurrent tests never
/// share a port. Everything stays below 32768, where Linux's ephemeral ports begin. Test
/// binaries run one after the other, so only meshes of one process need to stay apart.
pub fn ports() -> (u16, u16) {
    let k = NEXT.fetch_add(1, Ordering::SeqCst);
    let slot = (std::process::id() % 40) as u16 * 40 + k * 4;
    (18000 + slot, 20000 + ((u32::from(slot) * 80) % 12000) as u16)
}

/// Ports for a mesh a test starts by hand (`http`, `base`), apart from every [`Mesh`]'s.
pub fn reserve_ports() -> (u16, u16) {
    ports()
}

/// The `pdmesh` binary: `PDMESH_TEST_BIN` (e.g. the `cuda` build on a GPU machine,
/// docs/MODEL.md), else the `pdmesh` of the target directory this program was built into
/// (next to it, or one up from a test binary's `deps/`).
pub fn pdmesh_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("PDMESH_TEST_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let beside = exe.with_file_name("pdmesh");
    let above = exe.parent().and_then(Path::parent).map(|d| d.join("pdmesh"));
    match above {
        Some(p) if !beside.is_file() && p.is_file() => p,
        _ => beside,
    }
}

/// A fresh, empty run dir `<tmp>/<prefix>-<pid>-<port>`.
pub fn fresh_run_dir(prefix: &str, port: u16) -> PathBuf {
    let run_dir = std::env::temp_dir().join(format!("{prefix}-{}-{port}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).unwrap();
    run_dir
}

/// What makes a node ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// A node with engines on this HTTP port: `/health` answers 2xx and `/debug/engines` lists
    /// engines and no unreachable rank.
    Node(u16),
    /// A router on this HTTP port: `/health` says `ready` (every upstream healthy).
    Router(u16),
}

/// How to start `pdmesh up` beyond its topology.
#[derive(Debug, Clone, Default)]
pub struct UpOptions {
    /// Extra arguments of `pdmesh up` (e.g. `--no-restart`).
    pub args: Vec<String>,
    /// Extra environment of `pdmesh up` (and so of every child).
    pub env: Vec<(String, String)>,
    /// Environment variables `pdmesh up` must not inherit.
    pub env_remove: Vec<String>,
    /// The key the helpers present (`Authorization: Bearer`) when the mesh requires one.
    pub api_key: Option<String>,
    /// `RUST_LOG` of the mesh (default `info`).
    pub rust_log: Option<String>,
    /// How long the mesh has to get ready (default 60 s).
    pub ready_within: Option<Duration>,
    /// The binary (default [`pdmesh_bin`]).
    pub bin: Option<PathBuf>,
    /// The file in the run dir that gets `pdmesh up`'s stderr (default `up.log`).
    pub log: Option<String>,
}

impl UpOptions {
    /// `pdmesh up --no-restart` without the API key, executor fault and mesh-auth overrides
    /// the caller's environment may carry: a mesh where nothing comes back behind the test's
    /// back (the fail-over and scale-out tests).
    pub fn no_restart() -> Self {
        UpOptions {
            args: vec!["--no-restart".into()],
            env_remove: ["PDMESH_API_KEY", "PDMESH_API_KEY_FILE", "PDMESH_EXECUTOR_FAULT"].map(String::from).to_vec(),
            ..Default::default()
        }
    }
}

/// Where and how one mesh is launched.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The run dir (created if missing); the topology file, `up.log` and the mesh's own
    /// files (`mesh.json`, `logs/`) go there.
    pub run_dir: PathBuf,
    /// The topology's file name inside the run dir.
    pub file: String,
    /// The first node's HTTP port and base port (what [`Mesh::url`] and the helpers use).
    pub http_port: u16,
    pub base_port: u16,
    /// The nodes to wait for, in order.
    pub ready: Vec<Ready>,
    pub options: UpOptions,
}

/// A mesh that did not come up: what went wrong, and the mesh (stopped on drop), when it
/// started at all.
#[derive(Debug)]
pub struct LaunchError {
    pub mesh: Option<Mesh>,
    pub message: String,
}

impl LaunchError {
    /// Whether some process of the mesh failed to bind its port.
    pub fn port_clash(&self) -> bool {
        self.mesh.as_ref().is_some_and(Mesh::port_clash)
    }
}

impl std::fmt::Display for LaunchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for LaunchError {}

/// A running mesh; stopped (SIGTERM, then kill) on drop.
#[derive(Debug)]
pub struct Mesh {
    pub up: Child,
    pub run_dir: PathBuf,
    pub http_port: u16,
    pub base_port: u16,
    /// The API key the helpers present on `/debug/*` when the mesh requires one.
    pub api_key: Option<String>,
}

impl Mesh {
    /// Write `topology` (with the run dir of `launch`) and start `pdmesh up` on it; wait until
    /// every node of `launch.ready` is ready. Errors, never panics (the load tests' entry).
    pub fn launch(mut topology: Topology, launch: Launch) -> Result<Mesh, LaunchError> {
        let err = |message: String| LaunchError { mesh: None, message };
        std::fs::create_dir_all(&launch.run_dir)
            .map_err(|e| err(format!("creating {}: {e}", launch.run_dir.display())))?;
        topology.run_dir = launch.run_dir.clone();
        let text = topology.to_toml().map_err(|e| err(e.to_string()))?;
        Topology::from_toml(&text).map_err(|e| err(format!("{e}\n{text}")))?;
        let path = launch.run_dir.join(&launch.file);
        std::fs::write(&path, text).map_err(|e| err(format!("writing {}: {e}", path.display())))?;
        Self::launch_file(&path, launch)
    }

    /// Start `pdmesh up` on the topology file at `path` as it is (several `pdmesh up --node`
    /// processes sharing one file and run dir) and wait until every node of `launch.ready` is
    /// ready (none: return at once); `launch.file` is not used.
    pub fn launch_file(path: &Path, launch: Launch) -> Result<Mesh, LaunchError> {
        let err = |message: String| LaunchError { mesh: None, message };
        let o = &launch.options;
        let bin = o.bin.clone().unwrap_or_else(pdmesh_bin);
        let log_name = o.log.as_deref().unwrap_or("up.log");
        let log = std::fs::File::create(launch.run_dir.join(log_name)).map_err(|e| err(format!("{log_name}: {e}")))?;
        let mut cmd = Command::new(&bin);
        cmd.arg("up").arg("--topology").arg(path).args(&o.args);
        for k in &o.env_remove {
            cmd.env_remove(k);
        }
        let up = cmd
            .envs(o.env.iter().map(|(k, v)| (k, v)))
            .env("PDMESH_RUN_DIR", &launch.run_dir)
            .env("RUST_LOG", o.rust_log.as_deref().unwrap_or("info"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| err(format!("starting {}: {e}", bin.display())))?;
        let mesh = Mesh {
            up,
            run_dir: launch.run_dir,
            http_port: launch.http_port,
            base_port: launch.base_port,
            api_key: o.api_key.clone(),
        };
        let limit = o.ready_within.unwrap_or(Duration::from_secs(60));
        for &ready in &launch.ready {
            if !mesh.wait_until_ready(ready, limit) {
                let message = format!("{ready:?} not ready within {limit:?}; logs in {}", mesh.run_dir.display());
                return Err(LaunchError { mesh: Some(mesh), message });
            }
        }
        Ok(mesh)
    }

    /// Start the topology `nodes(http_port, base_port)` returns on ports of [`ports`]: every
    /// port it uses must derive from those two (http_port + 0..8, base_port + 0..240).
    /// `engine_ports(http_port)` are the HTTP ports of the nodes that have engines (checked for
    /// readiness); `http_port` of the returned mesh is the first node's.
    pub fn start_nodes(nodes: impl Fn(u16, u16) -> Topology, engine_ports: impl Fn(u16) -> Vec<u16>) -> Mesh {
        Self::start_nodes_with(nodes, engine_ports, &UpOptions::default())
    }

    /// [`Mesh::start_nodes`] with more arguments and environment for `pdmesh up`.
    ///
    /// Our listening ports lie inside Linux's ephemeral range, so a client socket of anything
    /// on the machine may hold one for a moment. A mesh whose process could not bind is
    /// stopped and started again on the next ports (up to 4 tries).
    pub fn start_nodes_with(
        nodes: impl Fn(u16, u16) -> Topology,
        engine_ports: impl Fn(u16) -> Vec<u16>,
        options: &UpOptions,
    ) -> Mesh {
        for attempt in 0.. {
            let (http_port, base_port) = ports();
            let launch = Launch {
                run_dir: fresh_run_dir("pdmesh-test", http_port),
                file: "test-topology.toml".into(),
                http_port,
                base_port,
                ready: engine_ports(http_port).into_iter().map(Ready::Node).collect(),
                options: options.clone(),
            };
            match Self::launch(nodes(http_port, base_port), launch) {
                Ok(mesh) => return mesh,
                Err(e) if attempt < 3 && e.port_clash() => {
                    eprintln!("mesh on ports {http_port}/{base_port}: a port was taken; retrying on others");
                }
                Err(e) => panic!("mesh not ready: {e}"),
            }
        }
        unreachable!()
    }

    /// Start a one-node mesh (the one-node shape, node `main`) changed by `node`.
    pub fn start_one(node: impl Fn(&mut pdmesh_config::NodeConfig)) -> Mesh {
        Self::start_one_with(node, &UpOptions::default())
    }

    /// [`Mesh::start_one`] with more arguments and environment for `pdmesh up`.
    pub fn start_one_with(node: impl Fn(&mut pdmesh_config::NodeConfig), options: &UpOptions) -> Mesh {
        Self::start_nodes_with(|h, b| crate::topology::one_node(h, b).with_node("main", &node), |h| vec![h], options)
    }

    /// Start `topology` in `run_dir` (file `file`) on ports the caller chose, wait until every
    /// node on `engine_ports` is ready; `http_port` is the first node's. Panics when it does
    /// not come up.
    pub fn start_in(
        topology: Topology,
        run_dir: &Path,
        file: &str,
        (http_port, base_port): (u16, u16),
        engine_ports: &[u16],
        options: &UpOptions,
    ) -> Mesh {
        let launch = Launch {
            run_dir: run_dir.to_path_buf(),
            file: file.into(),
            http_port,
            base_port,
            ready: engine_ports.iter().copied().map(Ready::Node).collect(),
            options: options.clone(),
        };
        Self::launch(topology, launch).unwrap_or_else(|e| panic!("mesh not ready: {e}"))
    }

    /// Whether some process of the mesh failed to bind its port.
    pub fn port_clash(&self) -> bool {
        self.logs().contains("Address already in use")
            || std::fs::read_to_string(self.run_dir.join("up.log"))
                .unwrap_or_default()
                .contains("Address already in use")
    }

    /// One look: whether `ready` holds now.
    pub fn is_ready(&self, ready: Ready) -> bool {
        self.ready_by(&probe_client(), ready)
    }

    /// [`Mesh::is_ready`] through `client` (one for a whole wait: a blocking client starts a
    /// runtime thread of its own, too much to make every 100 ms while a mesh comes up).
    fn ready_by(&self, client: &reqwest::blocking::Client, ready: Ready) -> bool {
        match ready {
            Ready::Router(port) => client
                .get(self.url_on(port, "/health"))
                .send()
                .and_then(|r| r.json::<serde_json::Value>())
                .is_ok_and(|v| v["status"] == "ready"),
            Ready::Node(port) => {
                let healthy = client.get(self.url_on(port, "/health")).send().is_ok_and(|r| r.status().is_success());
                let engines = client.get(self.url_on(port, "/debug/engines"));
                let engines = match &self.api_key {
                    Some(k) => engines.bearer_auth(k),
                    None => engines,
                };
                healthy
                    && engines.send().and_then(|r| r.json::<serde_json::Value>()).is_ok_and(|v| {
                        v["unreachable_ranks"].as_array().is_some_and(|a| a.is_empty())
                            && v["engines"].as_array().is_some_and(|a| !a.is_empty())
                    })
            }
        }
    }

    /// Wait until `ready` holds; false after `limit` or on a port clash.
    pub fn wait_until_ready(&self, ready: Ready, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let client = probe_client();
        while Instant::now() < deadline {
            if self.ready_by(&client, ready) {
                return true;
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
    pub fn wait_ready_on(&self, port: u16) -> bool {
        self.wait_until_ready(Ready::Node(port), Duration::from_secs(60))
    }

    pub fn url(&self, path: &str) -> String {
        self.url_on(self.http_port, path)
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

    /// `GET /debug/kv` as JSON.
    pub fn kv(&self) -> serde_json::Value {
        self.kv_on(self.http_port)
    }

    /// `GET /debug/kv` of the node on `port`.
    pub fn kv_on(&self, port: u16) -> serde_json::Value {
        self.get(&self.url_on(port, "/debug/kv")).unwrap().json().unwrap()
    }

    /// Wait until `cond` holds on `/debug/kv`, or fail with the last value.
    pub fn wait_kv(&self, what: &str, cond: impl Fn(&serde_json::Value) -> bool) {
        self.wait_kv_on(self.http_port, what, cond)
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

    /// The process table written by `pdmesh up` (`mesh.json`).
    pub fn processes(&self) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(self.run_dir.join("mesh.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["processes"].as_array().unwrap().clone()
    }

    /// The pid of `service` rank `rank` (one-node meshes: the first match).
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

    /// SIGKILL `service` rank `rank`.
    pub fn kill9(&self, service: &str, rank: u32) {
        sigkill(self.pid_of(service, rank));
    }

    /// SIGKILL `service` rank `rank` of node `node`; returns the pid killed.
    pub fn kill9_on(&self, node: &str, service: &str, rank: u32) -> i32 {
        let pid = self.pid_on(node, service, rank);
        sigkill(pid);
        pid
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

    /// SIGTERM `pdmesh up` and wait up to `limit` for it to exit (then kill it): its exit
    /// status, `None` when it had to be killed. The run dir stays.
    pub fn terminate(&mut self, limit: Duration) -> Option<ExitStatus> {
        if let Ok(Some(s)) = self.up.try_wait() {
            return Some(s);
        }
        let pid = nix::unistd::Pid::from_raw(self.up.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.up.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.up.kill();
        let _ = self.up.wait();
        None
    }

    /// SIGTERM `pdmesh up` and wait for a clean exit (30 s at most, else the test fails);
    /// removes the run dir.
    pub fn stop(mut self) -> ExitStatus {
        let status =
            self.terminate(Duration::from_secs(30)).unwrap_or_else(|| panic!("pdmesh up did not stop in 30 s"));
        let _ = std::fs::remove_dir_all(&self.run_dir);
        status
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.terminate(Duration::from_secs(15));
    }
}

/// The client of the readiness probes (5 s a request: a node still starting may not answer).
fn probe_client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(5)).build().unwrap()
}

fn sigkill(pid: i32) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
}
