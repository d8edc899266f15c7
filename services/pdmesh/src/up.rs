//! `pdmesh up`: start a whole mesh from a topology file as child processes, supervise them,
//! and shut them all down on Ctrl-C / SIGTERM.
//!
//! Every child's output goes to `<run_dir>/logs/<node>.<service>[.<rank>].log`. The live
//! process table is kept in `<run_dir>/mesh.json` (service, node, rank, pid, log), so operators
//! and tests can find a process. A child that dies is reported loudly with its exit status and,
//! unless `--no-restart`, started again with a backoff; the rest of the mesh keeps serving.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use pdmesh_config::{env, NodeRole, Service, Topology};
use tokio::process::{Child, Command};

#[derive(Args, Clone)]
pub struct UpArgs {
    /// Topology file (default: the built-in mesh, see deploy/topology/default.toml).
    #[arg(long, env = env::TOPOLOGY)]
    topology: Option<PathBuf>,
    /// Report children that die but do not restart them.
    #[arg(long)]
    no_restart: bool,
    /// Seconds to wait for children to stop after SIGTERM before killing them.
    #[arg(long, default_value_t = 10)]
    shutdown_timeout_s: u64,
}

struct ChildSpec {
    service: Service,
    /// The node is a router (its frontend reports as `router` in traces).
    router: bool,
    node: String,
    rank: u32,
    log: PathBuf,
}

impl ChildSpec {
    fn label(&self) -> String {
        if self.service.per_rank() {
            format!("{}.{}.{}", self.node, self.service.name(), self.rank)
        } else {
            format!("{}.{}", self.node, self.service.name())
        }
    }
}

struct Running {
    spec: ChildSpec,
    child: Option<Child>,
    pid: u32,
    restarts: u32,
    next_start: Option<tokio::time::Instant>,
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    pdmesh_telemetry::init("pdmesh-up");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(supervise(args))
}

fn children_of(topo: &Topology, logs: &Path) -> Vec<ChildSpec> {
    let mut out = Vec::new();
    for node in &topo.nodes {
        let services: Vec<Service> = if node.role == NodeRole::Router {
            vec![Service::Frontend]
        } else {
            // Back to front, so that each process finds its peers soon after it starts.
            vec![
                Service::ConnectorWorker,
                Service::ConnectorScheduler,
                Service::DpLb,
                Service::EngineCore,
                Service::Frontend,
            ]
        };
        for s in services {
            let ranks = if s.per_rank() { node.dp_size } else { 1 };
            for rank in 0..ranks {
                let mut spec = ChildSpec {
                    service: s,
                    router: node.role == NodeRole::Router,
                    node: node.name.clone(),
                    rank,
                    log: PathBuf::new(),
                };
                spec.log = logs.join(format!("{}.log", spec.label()));
                out.push(spec);
            }
        }
    }
    out
}

/// This run's mesh secret, handed to every child (resolved once in [`supervise`]).
static MESH_SECRET: std::sync::OnceLock<pdmesh_mesh_auth::MeshSecret> = std::sync::OnceLock::new();

/// `PDMESH_MESH_SECRET`, else the topology's `mesh_secret_file`, else a fresh 256-bit secret for
/// this run: a mesh started by `pdmesh up` is never open to peers without it.
fn mesh_secret(topo: &Topology) -> anyhow::Result<pdmesh_mesh_auth::MeshSecret> {
    match pdmesh_mesh_auth::MeshSecret::resolve(topo.mesh_secret_file.as_deref())? {
        Some(secret) => Ok(secret),
        None => {
            tracing::info!(
                "generated a fresh mesh secret for this run (set {} or mesh_secret_file to share one with \
                 nodes started elsewhere)",
                env::MESH_SECRET
            );
            Ok(pdmesh_mesh_auth::MeshSecret::generate())
        }
    }
}

fn spawn(spec: &ChildSpec, topology_path: &Path, run_dir: &Path) -> anyhow::Result<Child> {
    let exe = std::env::current_exe().context("locating the pdmesh binary")?;
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&spec.log)?;
    let log2 = log.try_clone()?;
    let mut cmd = Command::new(exe);
    cmd.arg(spec.service.name())
        .arg("--topology")
        .arg(topology_path)
        .arg("--node")
        .arg(&spec.node)
        .arg("--rank")
        .arg(spec.rank.to_string())
        .env("PDMESH_PARENT_PID", std::process::id().to_string())
        .env(env::RUN_DIR, run_dir)
        .env("OTEL_SERVICE_NAME", child_service_name(spec))
        // The mesh secret goes through the environment, never the command line (process
        // arguments are readable by every user of the host).
        .env(env::MESH_SECRET, MESH_SECRET.get().map_or("", |s| s.expose_text()))
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log2)
        .kill_on_drop(true);
    Ok(cmd.spawn()?)
}

/// Every child inherits this process's environment, `OTEL_*` included, so one
/// `OTEL_EXPORTER_OTLP_ENDPOINT` on `pdmesh up` traces the whole mesh. Each child still needs
/// its own `service.name`: `pdmesh-<service>` (`pdmesh-router` for a router's frontend), or
/// `<OTEL_SERVICE_NAME>-<service>` when one was set on `pdmesh up`.
fn child_service_name(spec: &ChildSpec) -> String {
    let service = if spec.service == Service::Frontend && spec.router { "router" } else { spec.service.name() };
    match std::env::var("OTEL_SERVICE_NAME") {
        Ok(prefix) if !prefix.trim().is_empty() => format!("{prefix}-{service}"),
        _ => format!("pdmesh-{service}"),
    }
}

fn write_state(run_dir: &Path, procs: &[Running]) {
    let entries: Vec<serde_json::Value> = procs
        .iter()
        .map(|p| {
            serde_json::json!({
                "node": p.spec.node, "service": p.spec.service.name(), "rank": p.spec.rank,
                "pid": p.pid, "alive": p.child.is_some(), "restarts": p.restarts, "log": p.spec.log,
            })
        })
        .collect();
    let text = serde_json::to_string_pretty(&serde_json::json!({ "up_pid": std::process::id(), "processes": entries }))
        .unwrap_or_default();
    let tmp = run_dir.join("mesh.json.tmp");
    if std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(&tmp, run_dir.join("mesh.json"));
    }
}

async fn supervise(args: UpArgs) -> anyhow::Result<()> {
    let mut topo = match &args.topology {
        Some(p) => Topology::load(p)?,
        None => Topology::default_mesh()?,
    };
    if let Some(dir) = env::get(env::RUN_DIR) {
        topo.run_dir = PathBuf::from(dir);
    }
    let _ = MESH_SECRET.set(mesh_secret(&topo)?);
    let run_dir = topo.run_dir.clone();
    let logs = run_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    // Children read the same topology; write the effective one where they can find it.
    let topology_path = run_dir.join("topology.toml");
    let text = match &args.topology {
        Some(p) => std::fs::read_to_string(p)?,
        None => pdmesh_config::DEFAULT_TOPOLOGY.to_string(),
    };
    std::fs::write(&topology_path, text)?;

    let mut procs: Vec<Running> = Vec::new();
    for spec in children_of(&topo, &logs) {
        let child = spawn(&spec, &topology_path, &run_dir).with_context(|| format!("starting {}", spec.label()))?;
        let pid = child.id().unwrap_or(0);
        tracing::info!(process = %spec.label(), pid, log = %spec.log.display(), "started");
        procs.push(Running { spec, child: Some(child), pid, restarts: 0, next_start: None });
    }
    write_state(&run_dir, &procs);
    for node in &topo.nodes {
        let url = format!("http://{}:{}", node.http_host, node.http_port);
        tokio::spawn(announce_when_ready(node.name.clone(), url));
    }

    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = tick.tick() => {}
        }
        let mut changed = false;
        for p in procs.iter_mut() {
            if let Some(child) = p.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    tracing::error!(process = %p.spec.label(), pid = p.pid, %status, log = %p.spec.log.display(),
                        "child process died");
                    eprintln!(
                        "pdmesh up: {} (pid {}) died: {status}; see {}",
                        p.spec.label(),
                        p.pid,
                        p.spec.log.display()
                    );
                    p.child = None;
                    changed = true;
                    if !args.no_restart {
                        let backoff = Duration::from_millis(500 * 2u64.pow(p.restarts.min(4)));
                        p.next_start = Some(tokio::time::Instant::now() + backoff);
                    }
                }
            } else if p.next_start.is_some_and(|t| t <= tokio::time::Instant::now()) {
                p.next_start = None;
                match spawn(&p.spec, &topology_path, &run_dir) {
                    Ok(child) => {
                        p.pid = child.id().unwrap_or(0);
                        p.child = Some(child);
                        p.restarts += 1;
                        tracing::warn!(process = %p.spec.label(), pid = p.pid, restarts = p.restarts, "restarted");
                        changed = true;
                    }
                    Err(e) => {
                        tracing::error!(process = %p.spec.label(), error = %e, "restart failed");
                        p.next_start = Some(tokio::time::Instant::now() + Duration::from_secs(5));
                    }
                }
            }
        }
        if changed {
            write_state(&run_dir, &procs);
        }
    }

    // ---- graceful shutdown: SIGTERM everyone, wait, then kill what is left
    tracing::info!("stopping the mesh");
    for p in procs.iter() {
        if p.child.is_some() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.pid as i32), nix::sys::signal::Signal::SIGTERM);
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.shutdown_timeout_s);
    let mut forced = 0;
    for p in procs.iter_mut() {
        if let Some(child) = p.child.as_mut() {
            match tokio::time::timeout_at(deadline, child.wait()).await {
                Ok(_) => {}
                Err(_) => {
                    forced += 1;
                    tracing::error!(process = %p.spec.label(), "did not stop in time; killing");
                    let _ = child.kill().await;
                }
            }
        }
    }
    let _ = std::fs::remove_file(run_dir.join("mesh.json"));
    if forced > 0 {
        anyhow::bail!("{forced} process(es) had to be killed at shutdown");
    }
    tracing::info!("mesh stopped");
    Ok(())
}

async fn announce_when_ready(node: String, url: String) {
    let client = reqwest::Client::new();
    for _ in 0..1200 {
        if let Ok(r) = client.get(format!("{url}/health")).send().await {
            if r.status().is_success() {
                tracing::info!(%node, %url, "node ready");
                eprintln!("pdmesh up: node {node} ready on {url}");
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tracing::error!(%node, %url, "node not ready after 5 minutes");
}
