//! `pdmesh up`: start a whole mesh from a topology file as child processes, supervise them,
//! and shut them all down on Ctrl-C / SIGTERM.
//!
//! Every child's output goes to `<run_dir>/logs/<node>.<service>[.<rank>].log`. The live
//! process table is kept in `<run_dir>/mesh.json` (service, node, rank, pid, log), so operators
//! and tests can find a process. `--node NAME…` starts only the named nodes, so one topology
//! drives several hosts (each runs `pdmesh up --node` for its own nodes): that process's table is
//! `<run_dir>/mesh.<node>+<node>….json`, apart from any other `pdmesh up` sharing the run dir,
//! and the nodes it starts must share the mesh secret (and the internal API key, with client
//! keys) with the others, so it refuses to start without them (D50). A child that dies is reported loudly with its exit status and,
//! unless `--no-restart`, started again after an exponential backoff (reset once it ran
//! [`STABLE_AFTER`]); the rest of the mesh keeps serving. A child that exits on a configuration
//! error ([`pdmesh_config::EXIT_CONFIG`]) stops the whole mesh instead, with its last log lines
//! on this terminal: restarting it could only fail the same way (docs/SECURITY.md, "Fail fast").
//!
//! API keys (docs/SECURITY.md): `--api-key`, `--api-key-file` or their variables reach every
//! frontend child through its environment, with the mesh's internal key — the one given in
//! `PDMESH_INTERNAL_API_KEY`, or a fresh random one per run when client keys are set — which the
//! router presents to P and D. Keys never go on a child's command line, where `ps` shows them,
//! and other children do not get them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use pdmesh_config::{env, NodeRole, Service, Topology};
use tokio::process::{Child, Command};

use crate::{ApiKeyArgs, Misconfigured};

/// First restart delay of a child that died; doubled per consecutive failure.
const RESTART_BACKOFF_BASE: Duration = Duration::from_millis(500);
/// Longest restart delay.
const RESTART_BACKOFF_CAP: Duration = Duration::from_secs(8);
/// A child that ran this long before dying starts its backoff from the beginning again.
const STABLE_AFTER: Duration = Duration::from_secs(30);
/// How much longer than the children's shutdown deadline `pdmesh up` waits before it kills
/// them: a child that overran its deadline exits on its own at the deadline, with
/// [`pdmesh_service::EXIT_SHUTDOWN_TIMEOUT`].
const KILL_GRACE: Duration = Duration::from_secs(5);
/// Log lines of a child shown on the terminal when it stops the mesh.
const LOG_TAIL_LINES: usize = 20;

#[derive(Args, Clone)]
pub struct UpArgs {
    /// Topology file (default: the built-in mesh, see deploy/topology/default.toml).
    #[arg(long, env = env::TOPOLOGY)]
    topology: Option<PathBuf>,
    /// Report children that die but do not restart them.
    #[arg(long)]
    no_restart: bool,
    /// Seconds to wait for children to stop after SIGTERM before killing them (default: their
    /// shutdown deadline, `PDMESH_SHUTDOWN_DEADLINE_S`, plus 5 s, so that a child stopping
    /// past its deadline reports it itself before it is killed).
    #[arg(long)]
    shutdown_timeout_s: Option<u64>,
    /// Start only these nodes of the topology (repeatable, or a comma list), so that one
    /// topology file drives several hosts, each starting its own nodes. Default: every node.
    /// A subset with a prefill or decode node needs the mesh's shared secret
    /// (`PDMESH_MESH_SECRET` or `mesh_secret_file`), and with client API keys a subset with a
    /// router, prefill or decode node needs `PDMESH_INTERNAL_API_KEY` (docs/SECURITY.md).
    #[arg(long = "node", value_name = "NAME", value_delimiter = ',')]
    nodes: Vec<String>,
    /// The GGUF file every model node serves (any supported architecture: docs/MODEL.md),
    /// in place of the topology's `model.path`: `scripts/fetch-model.sh qwen2.5-0.5b` prints
    /// one. Default: the topology's path, else `PDMESH_MODEL_PATH`, else SmolLM2.
    #[arg(long, value_name = "PATH")]
    model: Option<PathBuf>,
    #[command(flatten)]
    keys: ApiKeyArgs,
}

/// `--model PATH` written into every GGUF node of the topology (the children read the
/// topology's text, so the text is written anew from it). A path that is not a file is a
/// configuration error here, before anything starts.
fn with_model(mut topo: Topology, model: &Path) -> anyhow::Result<(Topology, String)> {
    if !model.is_file() {
        return Err(anyhow::anyhow!(
            "--model {}: no such file (scripts/fetch-model.sh --list names the models it fetches)",
            model.display()
        )
        .context(Misconfigured("--model".into())));
    }
    let path = std::fs::canonicalize(model).context(Misconfigured("--model".into()))?;
    for node in &mut topo.nodes {
        if node.model.kind == pdmesh_config::ModelKind::Gguf {
            node.model.path = path.to_string_lossy().into_owned();
        }
    }
    let text = topo.to_toml()?;
    Ok((topo, text))
}

/// The nodes one `pdmesh up` starts: every node of the topology, or those `--node` names.
#[derive(Debug, PartialEq, Eq)]
struct Selection {
    /// Names of the nodes to start, in topology order.
    names: Vec<String>,
    /// Some nodes of the topology are left to other `pdmesh up` processes.
    subset: bool,
}

impl Selection {
    /// `--node` names checked against the topology: an unknown one is a configuration error
    /// naming it and the known ones (a typo must not start a mesh that is missing a node).
    fn of(topo: &Topology, wanted: &[String]) -> anyhow::Result<Selection> {
        let wanted: Vec<&str> = wanted.iter().map(|n| n.trim()).filter(|n| !n.is_empty()).collect();
        if wanted.is_empty() {
            return Ok(Selection { names: topo.nodes.iter().map(|n| n.name.clone()).collect(), subset: false });
        }
        let known: Vec<&str> = topo.nodes.iter().map(|n| n.name.as_str()).collect();
        if let Some(unknown) = wanted.iter().find(|w| !known.contains(w)) {
            return Err(anyhow::anyhow!("no node named {unknown:?} in the topology (its nodes: {})", known.join(", "))
                .context(Misconfigured("--node".into())));
        }
        let names: Vec<String> = known.iter().filter(|k| wanted.contains(k)).map(|k| k.to_string()).collect();
        let subset = names.len() < known.len();
        Ok(Selection { names, subset })
    }

    fn contains(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Whether a node of one of `roles` is among those started.
    fn has_role(&self, topo: &Topology, roles: &[NodeRole]) -> bool {
        topo.nodes.iter().any(|n| self.contains(&n.name) && roles.contains(&n.role))
    }

    /// What a subset needs that a whole mesh can make up for itself: secrets shared with the
    /// nodes other `pdmesh up` processes start. A fresh mesh secret per process would make P
    /// and D refuse each other's handshakes; a fresh internal key per process would make P and
    /// D refuse the router (401). `secret_given`: `PDMESH_MESH_SECRET` or `mesh_secret_file`;
    /// `client_keys`: client API keys are set; `internal_given`: `PDMESH_INTERNAL_API_KEY`.
    fn check_shared_secrets(
        &self,
        topo: &Topology,
        secret_given: bool,
        client_keys: bool,
        internal_given: bool,
    ) -> Result<(), String> {
        if !self.subset {
            return Ok(());
        }
        let nodes = self.names.join(",");
        if !secret_given && self.has_role(topo, &[NodeRole::Prefill, NodeRole::Decode]) {
            return Err(format!(
                "--node {nodes} starts part of a P/D mesh: every `pdmesh up` of that mesh must share one mesh secret, \
                 so set {} (or mesh_secret_file in the topology) to the same secret on every host",
                env::MESH_SECRET
            ));
        }
        if client_keys
            && !internal_given
            && self.has_role(topo, &[NodeRole::Router, NodeRole::Prefill, NodeRole::Decode])
        {
            return Err(format!(
                "--node {nodes} starts part of a mesh with client API keys: the router and the P/D nodes started \
                 apart must share one internal key, so set {} to the same key on every host",
                env::INTERNAL_API_KEY
            ));
        }
        Ok(())
    }

    /// Suffix of this process's files in the shared `run_dir` (`mesh.json`, the topology
    /// copy): none for a whole mesh, `.<node>+<node>…` for a subset, so that several
    /// `pdmesh up` of one topology on one host do not overwrite each other's. Logs and `ipc`
    /// sockets are per node already.
    fn file_suffix(&self) -> String {
        if self.subset {
            format!(".{}", self.names.join("+"))
        } else {
            String::new()
        }
    }
}

/// What every frontend child gets in its environment for API keys (and no other child).
#[derive(Default)]
struct KeyEnv {
    api_key: Option<String>,
    api_key_file: Option<PathBuf>,
    internal: Option<String>,
}

impl KeyEnv {
    fn apply(&self, cmd: &mut Command, service: Service) {
        let vars = [
            (env::API_KEY, self.api_key.clone()),
            (env::API_KEY_FILE, self.api_key_file.as_ref().map(|p| p.display().to_string())),
            (env::INTERNAL_API_KEY, self.internal.clone()),
        ];
        for (name, value) in vars {
            match value {
                Some(v) if service == Service::Frontend => cmd.env(name, v),
                _ => cmd.env_remove(name),
            };
        }
    }
}

/// A fresh internal key: 32 bytes from the operating system's generator, hex.
fn generate_internal_key() -> String {
    use rand::RngCore as _;
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Delay before restarting a child after `failures` consecutive deaths (0 for the first):
/// [`RESTART_BACKOFF_BASE`] doubled per failure, at most [`RESTART_BACKOFF_CAP`].
fn restart_backoff(failures: u32) -> Duration {
    RESTART_BACKOFF_BASE.saturating_mul(1u32 << failures.min(16)).min(RESTART_BACKOFF_CAP)
}

/// Whether a child's exit says that starting it again cannot help: our configuration-error
/// status, or clap's usage status 2 — `pdmesh up` passes only valid arguments, so that is a
/// `PDMESH_*` variable behind a flag that clap refused.
fn is_config_exit(status: std::process::ExitStatus) -> bool {
    matches!(status.code(), Some(code) if code == i32::from(pdmesh_config::EXIT_CONFIG) || code == CLAP_USAGE_ERROR)
}

/// How a child's exit reads on the terminal: a stop (0, after a signal that did not come from
/// us), a stop past its shutdown deadline, or a death.
fn describe_exit(status: std::process::ExitStatus) -> &'static str {
    match status.code() {
        Some(0) => "stopped",
        Some(code) if code == i32::from(pdmesh_service::EXIT_SHUTDOWN_TIMEOUT) => "stopped past its shutdown deadline",
        _ => "died",
    }
}

/// The status clap exits with when it refuses an argument or an environment value.
const CLAP_USAGE_ERROR: i32 = 2;

/// The last `n` lines of a child's log, for the terminal.
fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].iter().map(|l| format!("  | {l}\n")).collect()
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
    /// Deaths since the child last ran [`STABLE_AFTER`]: the exponent of its backoff.
    failures: u32,
    started_at: tokio::time::Instant,
    next_start: Option<tokio::time::Instant>,
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    pdmesh_telemetry::init("pdmesh-up");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(supervise(args))
}

fn children_of(topo: &Topology, selection: &Selection, logs: &Path) -> Vec<ChildSpec> {
    let mut out = Vec::new();
    for node in topo.nodes.iter().filter(|n| selection.contains(&n.name)) {
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
fn mesh_secret(given: Option<pdmesh_mesh_auth::MeshSecret>) -> pdmesh_mesh_auth::MeshSecret {
    match given {
        Some(secret) => secret,
        None => {
            tracing::info!(
                "generated a fresh mesh secret for this run (set {} or mesh_secret_file to share one with \
                 nodes started elsewhere)",
                env::MESH_SECRET
            );
            pdmesh_mesh_auth::MeshSecret::generate()
        }
    }
}

/// The binary `pdmesh up` starts its children from: its own, opened once at start and held
/// open (D98). A rebuild replaces the file at the binary's path (a new inode; the old one is
/// "(deleted)"), so resolving the path again per spawn — as before — failed every restart
/// after a `cargo build`. The open file keeps the running inode alive, and each child is
/// executed through `/proc/self/fd/<n>`, so every child, first start or restart, runs exactly
/// the binary `pdmesh up` runs.
pub(crate) struct OwnBinary {
    /// Held open for the life of the supervisor: the inode the children run.
    file: std::fs::File,
    /// What the children see as their name (`argv[0]`).
    name: std::ffi::OsString,
}

impl OwnBinary {
    pub(crate) fn open() -> anyhow::Result<Self> {
        let file = std::fs::File::open("/proc/self/exe").context("opening the pdmesh binary (/proc/self/exe)")?;
        let name = std::env::args_os().next().unwrap_or_else(|| "pdmesh".into());
        Ok(Self { file, name })
    }

    /// The path that executes the held inode. The descriptor is close-on-exec: the kernel
    /// resolves the path before it closes it, so the child does not keep it.
    fn exec_path(&self) -> PathBuf {
        use std::os::fd::AsRawFd as _;
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }
}

/// Open (or create) a child's log, owner-only (D97): a log left by an older run with a wider
/// mode is narrowed.
fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let log =
        std::fs::OpenOptions::new().create(true).append(true).mode(pdmesh_config::private::FILE_MODE).open(path)?;
    pdmesh_config::private::make_private_file(path)?;
    Ok(log)
}

/// Write `text` to `path`, owner-only (D97).
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(pdmesh_config::private::FILE_MODE)
        .open(path)?;
    pdmesh_config::private::make_private_file(path)?;
    f.write_all(text.as_bytes())
}

fn spawn(
    exe: &OwnBinary,
    spec: &ChildSpec,
    topology_path: &Path,
    run_dir: &Path,
    keys: &KeyEnv,
) -> anyhow::Result<Child> {
    let log = open_log(&spec.log).with_context(|| format!("opening its log {}", spec.log.display()))?;
    let log2 = log.try_clone()?;
    let mut cmd = Command::new(exe.exec_path());
    cmd.arg0(&exe.name);
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
        // Its own process group: a terminal's Ctrl-C reaches `pdmesh up` alone, which then stops
        // the children front to back (D108); a child still stops by itself if `pdmesh up` dies.
        .process_group(0)
        .kill_on_drop(true);
    keys.apply(&mut cmd, spec.service);
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

fn write_state(state: &Path, procs: &[Running]) {
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
    let tmp = state.with_extension("json.tmp");
    if write_private(&tmp, &text).is_ok() {
        let _ = std::fs::rename(&tmp, state);
    }
}

/// One supervised launch: the nodes to start, from a topology held in memory, and how.
/// `pdmesh up` builds it from a topology file; `pdmesh serve` and `pdmesh proxy` build a
/// one-node topology from vLLM's flags (crate::serve) and hand it to the same supervisor.
pub(crate) struct Launch {
    /// The topology as read, before the environment's overrides (the children apply them).
    pub topo: Topology,
    /// Its text, written where the children read it.
    pub text: String,
    /// `--node` names; empty: every node.
    pub nodes: Vec<String>,
    /// Suffix of this launch's files in the run dir; `None`: from the selection.
    pub file_suffix: Option<String>,
    pub keys: ApiKeyArgs,
    pub no_restart: bool,
    pub shutdown_timeout_s: Option<u64>,
}

async fn supervise(args: UpArgs) -> anyhow::Result<()> {
    let topo = match &args.topology {
        Some(p) => Topology::load(p)?,
        None => Topology::default_mesh()?,
    };
    let text = match &args.topology {
        Some(p) => std::fs::read_to_string(p)?,
        None => pdmesh_config::DEFAULT_TOPOLOGY.to_string(),
    };
    let (topo, text) = match &args.model {
        Some(model) => with_model(topo, model)?,
        None => (topo, text),
    };
    supervise_launch(Launch {
        topo,
        text,
        nodes: args.nodes,
        file_suffix: None,
        keys: args.keys,
        no_restart: args.no_restart,
        shutdown_timeout_s: args.shutdown_timeout_s,
    })
    .await
}

/// Run a [`Launch`] to its end (`pdmesh serve` and `pdmesh proxy` enter here).
pub(crate) fn run_launch(launch: Launch) -> anyhow::Result<()> {
    pdmesh_telemetry::init("pdmesh-up");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(supervise_launch(launch))
}

async fn supervise_launch(args: Launch) -> anyhow::Result<()> {
    let (mut mesh, topo, selection) = Supervisor::prepare(&args)?;
    mesh.start_children(&topo, &selection)?;
    let stopped_because = mesh.watch().await?;

    // ---- graceful shutdown, front to back (D108): each tier is sent SIGTERM once the tiers
    // in front of it stopped, so a stream in flight at Ctrl-C drains through a router whose
    // nodes are still whole; a tier left running past `kill_after` is killed.
    tracing::info!("stopping the mesh, front to back");
    let (mut forced, mut overran) = (0, 0);
    for tier in 0..=StopTier::LAST {
        let (f, o) = stop_tier(&mut mesh.procs, tier, mesh.kill_after).await;
        forced += f;
        overran += o;
    }
    let _ = std::fs::remove_file(&mesh.state);
    match stopped_because {
        Some(StopCause::Misconfigured(why)) => {
            return Err(anyhow::Error::msg(why).context(Misconfigured("the mesh stopped".into())));
        }
        Some(StopCause::Unrestartable(why)) => return Err(anyhow::Error::msg(why).context("the mesh stopped")),
        None => {}
    }
    if forced > 0 {
        anyhow::bail!("{forced} process(es) had to be killed at shutdown");
    }
    if overran > 0 {
        // The mesh stopped, but not cleanly: `pdmesh up` exits as its children did.
        tracing::warn!(processes = overran, "mesh stopped; some processes stopped past their shutdown deadline");
        return Err(crate::StopTimedOut(pdmesh_service::DeadlineExceeded(mesh.child_deadline)).into());
    }
    tracing::info!("mesh stopped");
    Ok(())
}

/// Why the mesh stops on its own (not on a signal).
enum StopCause {
    /// A child stopped on a configuration error: the mesh stops with it.
    Misconfigured(String),
    /// A child could not be started again: the mesh stops with it (D98).
    Unrestartable(String),
}

/// One `pdmesh up` run: its children and what starting them again needs.
struct Supervisor {
    procs: Vec<Running>,
    exe: OwnBinary,
    topology_path: PathBuf,
    run_dir: PathBuf,
    /// `mesh.json`: the live process table.
    state: PathBuf,
    key_env: KeyEnv,
    no_restart: bool,
    /// The children's shutdown deadline, and how long a tier may take to stop before it is killed.
    child_deadline: Duration,
    kill_after: Duration,
}

impl Supervisor {
    /// Check what the launch asks for (overrides, keys, selection, secrets), make the run dir
    /// private and write the effective topology where the children read it.
    fn prepare(args: &Launch) -> anyhow::Result<(Supervisor, Topology, Selection)> {
        let mut topo = args.topo.clone();
        // The children apply the same overrides; a bad one stops the mesh before it starts.
        topo.apply_env()?;
        // The children read the same deadline from the same environment.
        let child_deadline = pdmesh_service::deadline_from_env()?;
        let kill_after = args.shutdown_timeout_s.map_or(child_deadline.saturating_add(KILL_GRACE), Duration::from_secs);
        let keys = args.keys.resolve().context(Misconfigured("API keys".into()))?;
        let key_env = KeyEnv {
            api_key: args.keys.api_key.clone(),
            api_key_file: args.keys.key_file().map(Path::to_path_buf),
            internal: keys.internal.clone().or_else(|| (!keys.client.is_empty()).then(generate_internal_key)),
        };
        if !keys.client.is_empty() {
            tracing::info!(
                client_keys = keys.client.len(),
                internal_key_given = keys.internal.is_some(),
                "API keys required on every frontend"
            );
        }
        let selection = Selection::of(&topo, &args.nodes)?;
        let given_secret = pdmesh_mesh_auth::MeshSecret::resolve(topo.mesh_secret_file.as_deref())?;
        selection
            .check_shared_secrets(&topo, given_secret.is_some(), !keys.client.is_empty(), keys.internal.is_some())
            .map_err(|why| anyhow::Error::msg(why).context(Misconfigured("--node".into())))?;
        if selection.subset {
            tracing::info!(nodes = %selection.names.join(","), "starting only these nodes of the topology");
        }
        let _ = MESH_SECRET.set(mesh_secret(given_secret));
        let exe = OwnBinary::open()?;
        let run_dir = topo.run_dir.clone();
        make_private(&[&run_dir, &run_dir.join("logs")])?;
        let suffix = args.file_suffix.clone().unwrap_or_else(|| selection.file_suffix());
        let state = run_dir.join(format!("mesh{suffix}.json"));
        // Children read the same topology; write the effective one where they can find it.
        let topology_path = run_dir.join(format!("topology{suffix}.toml"));
        write_private(&topology_path, &args.text).with_context(|| format!("writing {}", topology_path.display()))?;
        let mesh = Supervisor {
            procs: Vec::new(),
            exe,
            topology_path,
            run_dir,
            state,
            key_env,
            no_restart: args.no_restart,
            child_deadline,
            kill_after,
        };
        Ok((mesh, topo, selection))
    }

    /// Start every child of the selected nodes, back to front, and announce each node once ready.
    fn start_children(&mut self, topo: &Topology, selection: &Selection) -> anyhow::Result<()> {
        for spec in children_of(topo, selection, &self.run_dir.join("logs")) {
            let child = spawn(&self.exe, &spec, &self.topology_path, &self.run_dir, &self.key_env)
                .with_context(|| format!("starting {}", spec.label()))?;
            let pid = child.id().unwrap_or(0);
            tracing::info!(process = %spec.label(), pid, log = %spec.log.display(), "started");
            let started_at = tokio::time::Instant::now();
            self.procs.push(Running {
                spec,
                child: Some(child),
                pid,
                restarts: 0,
                failures: 0,
                started_at,
                next_start: None,
            });
        }
        write_state(&self.state, &self.procs);
        for node in topo.nodes.iter().filter(|n| selection.contains(&n.name)) {
            let url = format!("http://{}:{}", node.http_host, node.http_port);
            tokio::spawn(announce_when_ready(node.name.clone(), url));
        }
        Ok(())
    }

    /// Supervise until Ctrl-C/SIGTERM (`None`) or a cause to stop the mesh.
    async fn watch(&mut self) -> anyhow::Result<Option<StopCause>> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = term.recv() => return Ok(None),
                _ = int.recv() => return Ok(None),
                _ = tick.tick() => {}
            }
            let (changed, cause) = self.tend();
            if changed {
                write_state(&self.state, &self.procs);
            }
            if cause.is_some() {
                return Ok(cause);
            }
        }
    }

    /// One look at every child: note the ones that stopped (and schedule their restart), start
    /// the ones whose backoff ended. Returns whether the table changed, and a cause to stop.
    fn tend(&mut self) -> (bool, Option<StopCause>) {
        let mut changed = false;
        for i in 0..self.procs.len() {
            let p = &mut self.procs[i];
            if let Some(child) = p.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    p.child = None;
                    changed = true;
                    if let Some(cause) = self.stopped(i, status) {
                        return (changed, Some(cause));
                    }
                }
            } else if p.next_start.is_some_and(|t| t <= tokio::time::Instant::now()) {
                p.next_start = None;
                match self.restart(i) {
                    Ok(()) => changed = true,
                    Err(cause) => return (changed, Some(cause)),
                }
            }
        }
        (changed, None)
    }

    /// Child `i` exited with `status`: report it, and stop the mesh (a configuration error) or
    /// schedule its restart.
    fn stopped(&mut self, i: usize, status: std::process::ExitStatus) -> Option<StopCause> {
        let no_restart = self.no_restart;
        let p = &mut self.procs[i];
        if is_config_exit(status) {
            tracing::error!(process = %p.spec.label(), pid = p.pid, %status, log = %p.spec.log.display(),
                "child stopped on a configuration error; stopping the mesh");
            eprintln!(
                "pdmesh up: {} (pid {}) stopped on a configuration error ({status}); stopping the mesh. \
                 Its last lines ({}):\n{}",
                p.spec.label(),
                p.pid,
                p.spec.log.display(),
                log_tail(&p.spec.log, LOG_TAIL_LINES)
            );
            return Some(StopCause::Misconfigured(format!(
                "{} stopped on a configuration error; see {}",
                p.spec.label(),
                p.spec.log.display()
            )));
        }
        let how = describe_exit(status);
        if status.success() {
            tracing::warn!(process = %p.spec.label(), pid = p.pid, %status, log = %p.spec.log.display(),
                "child process stopped");
        } else {
            tracing::error!(process = %p.spec.label(), pid = p.pid, %status, log = %p.spec.log.display(),
                "child process {how}");
        }
        eprintln!("pdmesh up: {} (pid {}) {how}: {status}; see {}", p.spec.label(), p.pid, p.spec.log.display());
        if p.started_at.elapsed() >= STABLE_AFTER {
            p.failures = 0;
        }
        if !no_restart {
            let backoff = restart_backoff(p.failures);
            p.failures = p.failures.saturating_add(1);
            tracing::info!(process = %p.spec.label(), backoff_ms = backoff.as_millis() as u64,
                "restarting after a backoff");
            p.next_start = Some(tokio::time::Instant::now() + backoff);
        }
        None
    }

    /// Start child `i` again; one that cannot be started stops the mesh (D98).
    fn restart(&mut self, i: usize) -> Result<(), StopCause> {
        match spawn(&self.exe, &self.procs[i].spec, &self.topology_path, &self.run_dir, &self.key_env) {
            Ok(child) => {
                let p = &mut self.procs[i];
                p.pid = child.id().unwrap_or(0);
                p.child = Some(child);
                p.started_at = tokio::time::Instant::now();
                p.restarts += 1;
                tracing::warn!(process = %p.spec.label(), pid = p.pid, restarts = p.restarts, "restarted");
                Ok(())
            }
            Err(e) => {
                // Retrying cannot help (the binary is held open; what failed is the host: its
                // log, a limit): a node left down without a word is worse than a mesh that stops
                // and says why (D98).
                let label = self.procs[i].spec.label();
                tracing::error!(process = %label, error = %format!("{e:#}"), "cannot restart a child; stopping the mesh");
                eprintln!("pdmesh up: cannot restart {label}: {e:#}; stopping the mesh");
                Err(StopCause::Unrestartable(format!("cannot restart {label}: {e:#}")))
            }
        }
    }
}

/// The run dir holds the node's sockets, logs and the topology: this user's alone (D97).
fn make_private(dirs: &[&Path]) -> anyhow::Result<()> {
    for dir in dirs {
        match pdmesh_config::private::private_dir(dir).context(Misconfigured("the run dir".into()))? {
            pdmesh_config::private::PrivateDir::Tightened(mode) => {
                tracing::warn!(dir = %dir.display(), was = %format!("{mode:o}"), "made a directory of the mesh owner-only (0700)");
                eprintln!("pdmesh up: {} was open to other users (mode {mode:o}); made it 0700", dir.display());
            }
            pdmesh_config::private::PrivateDir::Created | pdmesh_config::private::PrivateDir::Private => {}
        }
    }
    Ok(())
}

/// The order `pdmesh up` stops its children in (D108): routers first (they drain their streams
/// while every node still serves), then the nodes' frontends (their own requests in flight),
/// then each node's dp-lb, engine cores, connector schedulers and, last, the workers that hold
/// the KV caches (a decode node may still be reading a prefill node's blocks until then).
struct StopTier;

impl StopTier {
    const LAST: u8 = 5;

    fn of(spec: &ChildSpec) -> u8 {
        match spec.service {
            Service::Frontend if spec.router => 0,
            Service::Frontend => 1,
            Service::DpLb => 2,
            Service::EngineCore => 3,
            Service::ConnectorScheduler => 4,
            _ => Self::LAST,
        }
    }
}

/// SIGTERM the running children of `tier`, wait up to `kill_after` for them, kill what is left.
/// Returns how many had to be killed and how many stopped past their own shutdown deadline.
async fn stop_tier(procs: &mut [Running], tier: u8, kill_after: Duration) -> (usize, usize) {
    let mut members: Vec<&mut Running> =
        procs.iter_mut().filter(|p| p.child.is_some() && StopTier::of(&p.spec) == tier).collect();
    for p in members.iter() {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.pid as i32), nix::sys::signal::Signal::SIGTERM);
    }
    let deadline = tokio::time::Instant::now() + kill_after;
    let (mut forced, mut overran) = (0, 0);
    for p in members.iter_mut() {
        let label = p.spec.label();
        let Some(child) = p.child.as_mut() else { continue };
        match tokio::time::timeout_at(deadline, child.wait()).await {
            Ok(Ok(status)) if status.success() => {
                tracing::info!(process = %label, "stopped cleanly");
            }
            Ok(Ok(status)) => {
                if status.code() == Some(i32::from(pdmesh_service::EXIT_SHUTDOWN_TIMEOUT)) {
                    overran += 1;
                }
                tracing::warn!(process = %label, %status, "{}", describe_exit(status));
                eprintln!("pdmesh up: {label} {} at shutdown: {status}", describe_exit(status));
            }
            Ok(Err(e)) => tracing::warn!(process = %label, error = %e, "could not wait for it"),
            Err(_) => {
                forced += 1;
                tracing::error!(process = %label, "did not stop in time; killing");
                let _ = child.kill().await;
            }
        }
        p.child = None;
    }
    (forced, overran)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_back_off_exponentially_up_to_a_cap() {
        let delays: Vec<u64> = (0..8).map(|f| restart_backoff(f).as_millis() as u64).collect();
        assert_eq!(delays, [500, 1000, 2000, 4000, 8000, 8000, 8000, 8000]);
        assert_eq!(restart_backoff(u32::MAX), RESTART_BACKOFF_CAP);
    }

    const MESH: &str = r#"
[[nodes]]
name = "router"
role = "router"
http_port = 9000
base_port = 7000
router = { prefill = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"], decode = ["http://127.0.0.1:9003"] }
[[nodes]]
name = "p-a"
role = "prefill"
http_port = 9001
base_port = 7200
kv_transfer = { kv_role = "kv_producer", side_channel_port = 5600 }
[[nodes]]
name = "p-b"
role = "prefill"
http_port = 9002
base_port = 7400
kv_transfer = { kv_role = "kv_producer", side_channel_port = 5620 }
[[nodes]]
name = "d-a"
role = "decode"
http_port = 9003
base_port = 7600
kv_transfer = { kv_role = "kv_consumer", side_channel_port = 5640 }
[[nodes]]
name = "solo"
http_port = 9004
base_port = 7800
"#;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// `--node` picks nodes in topology order, whatever order and list form it was given in;
    /// no `--node` is the whole mesh; an unknown name is a configuration error that names it.
    #[test]
    fn node_selection_follows_the_topology() {
        let topo = Topology::from_toml(MESH).unwrap();
        let all = Selection::of(&topo, &[]).unwrap();
        assert_eq!((all.names.len(), all.subset), (5, false));
        assert_eq!(all.file_suffix(), "");
        let some = Selection::of(&topo, &names(&["d-a", "p-a"])).unwrap();
        assert_eq!(some, Selection { names: names(&["p-a", "d-a"]), subset: true });
        assert_eq!(some.file_suffix(), ".p-a+d-a");
        let every = Selection::of(&topo, &names(&["solo", "d-a", "p-b", "p-a", "router"])).unwrap();
        assert!(!every.subset, "naming every node is the whole mesh");
        let err = Selection::of(&topo, &names(&["p-a", "nosuch"])).unwrap_err();
        assert!(err.downcast_ref::<Misconfigured>().is_some());
        let msg = format!("{err:#}");
        assert!(msg.contains("\"nosuch\"") && msg.contains("router, p-a, p-b, d-a, solo"), "{msg}");
    }

    /// A subset with a P or D node needs the shared mesh secret; with client keys, a subset
    /// with a router, P or D node needs the shared internal key. A whole mesh, or a colocated
    /// node alone, makes its own.
    #[test]
    fn a_subset_of_a_pd_mesh_needs_shared_secrets() {
        let topo = Topology::from_toml(MESH).unwrap();
        let sel = |v: &[&str]| Selection::of(&topo, &names(v)).unwrap();
        let whole = sel(&[]);
        assert_eq!(whole.check_shared_secrets(&topo, false, true, false), Ok(()));
        let p = sel(&["p-a"]);
        let err = p.check_shared_secrets(&topo, false, false, false).unwrap_err();
        assert!(err.contains(env::MESH_SECRET) && err.contains("--node p-a"), "{err}");
        assert_eq!(p.check_shared_secrets(&topo, true, false, false), Ok(()));
        let err = p.check_shared_secrets(&topo, true, true, false).unwrap_err();
        assert!(err.contains(env::INTERNAL_API_KEY), "{err}");
        assert_eq!(p.check_shared_secrets(&topo, true, true, true), Ok(()));
        let router = sel(&["router"]);
        assert_eq!(router.check_shared_secrets(&topo, false, false, false), Ok(()), "a router holds no KV");
        assert!(router.check_shared_secrets(&topo, false, true, false).is_err());
        let solo = sel(&["solo"]);
        assert_eq!(solo.check_shared_secrets(&topo, false, true, false), Ok(()));
    }

    #[test]
    fn generated_internal_keys_are_fresh_and_plain() {
        let (a, b) = (generate_internal_key(), generate_internal_key());
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
