//! The processes of a tensor-parallel rank (D111): TP rank 0 — the rank's `connector-worker`,
//! the one engine-core talks to — creates the group's shared-memory file and starts TP ranks
//! 1..N as its children (`pdmesh tp-peer`), which load their slices of the model while it
//! loads its own. The group lives and dies with rank 0: a peer stops when rank 0 is gone
//! (`PDMESH_PARENT_PID`, checked twice a second), rank 0 stops its peers when it stops, and
//! rank 0 exits with an error when a peer exits, so that its supervisor starts the whole
//! group afresh.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use pdmesh_model::tp::{GroupPoison, ShmGroup, TpRank};
use pdmesh_service::ServiceContext;

use crate::Misconfigured;

/// `pdmesh tp-peer`: one TP peer of a rank's worker (started by TP rank 0, not by hand).
#[derive(Args, Clone, Debug)]
pub struct TpPeerArgs {
    #[arg(long, env = pdmesh_config::env::TOPOLOGY)]
    pub topology: Option<PathBuf>,
    #[arg(long)]
    pub node: String,
    /// The engine (data-parallel) rank this peer belongs to.
    #[arg(long)]
    pub rank: u32,
    #[arg(long)]
    pub tp_rank: u32,
    /// The group's shared-memory file, created by TP rank 0.
    #[arg(long)]
    pub group: PathBuf,
    /// The socket this peer serves TP rank 0 on.
    #[arg(long)]
    pub endpoint: String,
    /// The rank's KV cache region (every head), created by TP rank 0.
    #[arg(long)]
    pub kv_region: PathBuf,
}

/// TP rank 0's view of its group: the file, the peers it started, and their sockets.
pub struct TpGroup {
    path: PathBuf,
    size: usize,
    children: Arc<Mutex<Vec<(u32, Child)>>>,
    endpoints: Vec<String>,
    rank0: Option<ShmGroup>,
    /// The rank's KV cache region, until the worker takes it.
    region: Option<pdmesh_connector_worker::tp::KvRegion>,
}

/// Remove peers' sockets (`pdmesh-tp-<pid>-<t>.sock`) whose rank 0 process no longer exists
/// (one killed with SIGKILL cannot remove its own).
fn sweep_stale_sockets(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("pdmesh-tp-").filter(|r| r.ends_with(".sock")) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

impl TpGroup {
    /// For a node with `tensor_parallel_size > 1`: create the group of `ctx`'s rank and start
    /// its peers. `None` for a node without tensor parallelism.
    pub fn start(ctx: &ServiceContext, topology: Option<&Path>) -> anyhow::Result<Option<Self>> {
        let node = &ctx.node;
        let size = node.tensor_parallel_size as usize;
        if size <= 1 {
            return Ok(None);
        }
        let path = crate::model::gguf_path(node).context(Misconfigured("preparing the model".into()))?;
        let cfg = pdmesh_model::read_config(&path).context(Misconfigured("reading the model's header".into()))?;
        TpRank { rank: 0, size }.check(&cfg).context(Misconfigured("tensor_parallel_size".into()))?;
        let widest = [cfg.vocab_size, cfg.ffn_dim, cfg.hidden, cfg.q_dim()].into_iter().max().unwrap_or(0) / size;
        // the rank's KV cache, every head of it, shared by the TP ranks (D111)
        let geometry = (cfg.n_layers as u32, cfg.n_kv_heads as u32, cfg.head_dim as u32);
        let region = pdmesh_connector_worker::tp::create_rank_region(node, ctx.rank, geometry)?;
        let pid = std::process::id();
        let file = pdmesh_connector_worker::tp::group_file(&node.name, ctx.rank);
        let rank0 = ShmGroup::create(&file, size, ShmGroup::section_bytes_for(widest))
            .with_context(|| format!("creating the tensor-parallel group {}", file.display()))?;
        sweep_stale_sockets(&std::env::temp_dir());
        let exe = std::env::current_exe().context("the path of this program, to start the TP peers")?;
        let mut children = Vec::new();
        let mut endpoints = Vec::new();
        for t in 1..size as u32 {
            let endpoint =
                format!("ipc://{}", std::env::temp_dir().join(format!("pdmesh-tp-{pid}-{t}.sock")).display());
            let mut cmd = Command::new(&exe);
            cmd.arg("tp-peer")
                .args(["--node", &node.name])
                .args(["--rank", &ctx.rank.to_string(), "--tp-rank", &t.to_string()])
                .arg("--group")
                .arg(&file)
                .args(["--endpoint", &endpoint])
                .arg("--kv-region")
                .arg(region.path())
                .env("PDMESH_PARENT_PID", pid.to_string())
                .stdin(Stdio::null());
            if let Some(t) = topology {
                cmd.arg("--topology").arg(t);
            }
            let child = cmd.spawn().with_context(|| format!("starting TP peer {t}"))?;
            tracing::info!(tp_rank = t, pid = child.id(), %endpoint, "tensor-parallel peer started");
            children.push((t, child));
            endpoints.push(endpoint);
        }
        Ok(Some(Self {
            path: file,
            size,
            children: Arc::new(Mutex::new(children)),
            endpoints,
            rank0: Some(rank0),
            region: Some(region),
        }))
    }

    /// Rank 0's slice and its side of the gathers (taken once, by the executor).
    pub fn rank0(&mut self) -> Option<(TpRank, Box<dyn pdmesh_model::tp::Gather>)> {
        let g = self.rank0.take()?;
        Some((TpRank { rank: 0, size: self.size }, Box::new(g)))
    }

    /// What the connector-worker needs of its peers.
    pub fn peers(&mut self, step_timeout: Duration) -> pdmesh_connector_worker::tp::TpPeers {
        let poison = GroupPoison::new(&self.path);
        pdmesh_connector_worker::tp::TpPeers {
            endpoints: self.endpoints.clone(),
            poison: Arc::new(move || poison.poison()),
            step_timeout,
            region: self.region.take(),
            exited: Some(Box::pin(Self::peer_exited(self.children.clone()))),
        }
    }

    /// Resolves when a peer process exits (its rank 0 must then restart the group): a peer
    /// that dies before it connects (while loading) is noticed here, one that was connected
    /// also by its socket.
    async fn peer_exited(children: Arc<Mutex<Vec<(u32, Child)>>>) -> String {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let mut children = children.lock().unwrap_or_else(|p| p.into_inner());
            for (t, child) in children.iter_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return format!("TP peer {t} (pid {}) exited: {status}", child.id());
                }
            }
        }
    }
}

impl Drop for TpGroup {
    /// Stop the peers (SIGTERM, then SIGKILL after 3 s) and remove the group's file and their
    /// sockets.
    fn drop(&mut self) {
        GroupPoison::new(&self.path).poison();
        let mut children = std::mem::take(&mut *self.children.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, child) in &children {
            if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        for (t, child) in &mut children {
            while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if matches!(child.try_wait(), Ok(None)) {
                tracing::warn!(tp_rank = *t, "TP peer did not stop within 3 s; killing it");
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_file(&self.path);
        for e in &self.endpoints {
            if let Some(socket) = e.strip_prefix("ipc://") {
                let _ = std::fs::remove_file(socket);
            }
        }
    }
}

/// `pdmesh tp-peer`: serve one TP rank's slice of the model to its rank 0 until rank 0 stops
/// it (SIGTERM), goes away, or the group is lost.
pub fn run_peer(a: TpPeerArgs) -> anyhow::Result<()> {
    let topo = crate::load_topology(&a.topology);
    let identity = pdmesh_telemetry::ServiceIdentity::new("connector-worker", a.node.clone(), Some(a.rank));
    let telemetry = pdmesh_telemetry::init_service(&identity);
    let mut topo = topo?;
    crate::model::resolve_kv_budgets(&mut topo).context(Misconfigured("engine.kv_cache_memory".into()))?;
    let node = topo.node(&a.node)?.clone();
    let deadline = pdmesh_service::deadline_from_env()?;
    let system = actix_rt::System::new();
    let res = system.block_on(async move {
        let shutdown = crate::shutdown_on_signal(deadline);
        let tp = TpRank { rank: a.tp_rank as usize, size: node.tensor_parallel_size as usize };
        let group = ShmGroup::open(&a.group, tp.rank).context("joining the tensor-parallel group")?;
        let (facts, factory, _) = crate::model::executor_factory(&node, Some((tp, Box::new(group))))
            .context(Misconfigured("preparing the model".into()))?;
        pdmesh_connector_worker::run_tp_peer(&node, a.tp_rank, &a.endpoint, &a.kv_region, factory, facts, shutdown)
            .await?;
        anyhow::Ok(())
    });
    if let Err(e) = &res {
        tracing::error!(tp_rank = a.tp_rank, error = %format!("{e:#}"), "tensor-parallel peer failed");
    }
    drop(system);
    drop(telemetry);
    res
}
