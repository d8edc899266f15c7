//! The topology file: which nodes make up a mesh, what each runs, and where every socket is.
//!
//! One TOML file describes the whole mesh; every service process reads it and picks its own
//! part by node name and rank (`pdmesh engine-core --topology mesh.toml --node p --rank 0`).
//! Every knob has a working default. Layering: defaults < TOML < `PDMESH_*` environment
//! (see [`env`]) < command-line flags. Cross-field checks run in [`Topology::validate`] so a
//! bad file fails at start-up with a clear message.

pub mod api_keys;
mod bytes;
pub mod env;
pub mod private;

pub use bytes::ByteSize;

pub use api_keys::ApiKeySettings;

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The default local mesh that `pdmesh up` starts when no topology is given.
pub const DEFAULT_TOPOLOGY: &str = include_str!("../../../deploy/topology/default.toml");

/// Exit status of a service that stopped on a configuration error (the BSD `EX_CONFIG`):
/// starting it again cannot help, so `pdmesh up` stops the whole mesh and shows the error
/// instead of restarting it (docs/SECURITY.md, "Fail fast").
pub const EXIT_CONFIG: u8 = 78;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read topology {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("invalid topology: {0}")]
    Parse(String),
    #[error("invalid topology: {0}")]
    Invalid(String),
    #[error("no node named {0:?} in the topology")]
    UnknownNode(String),
}

/// A whole mesh.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Where `ipc://` sockets live (one sub-directory per node).
    #[serde(default = "default_run_dir")]
    pub run_dir: PathBuf,
    /// A file holding the mesh secret (docs/SECURITY.md); `PDMESH_MESH_SECRET` overrides it.
    /// Neither set: `pdmesh up` generates a fresh secret per run, and a P/D service, or any
    /// service of a node on `tcp` transport (its internal links are sealed with it), started on
    /// its own refuses to start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh_secret_file: Option<PathBuf>,
    pub nodes: Vec<NodeConfig>,
}

fn default_run_dir() -> PathBuf {
    std::env::temp_dir().join("pdmesh")
}

/// What a node is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeRole {
    /// Prefill and decode on the same node (no KV transfer).
    Colocated,
    /// Prefills, holds KV blocks for a remote decoder.
    Prefill,
    /// Pulls KV blocks from a prefill node, then decodes.
    Decode,
    /// Only a frontend, proxying each request to a prefill then a decode node.
    Router,
}

/// How the services of one node reach each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SocketTransport {
    Ipc,
    Tcp,
}

/// One node: a frontend, a dp-lb, and per data-parallel rank an engine-core, a
/// connector-scheduler and a connector-worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    pub name: String,
    #[serde(default = "default_role")]
    pub role: NodeRole,
    /// Address the frontend's HTTP server binds.
    #[serde(default = "default_http_host")]
    pub http_host: String,
    #[serde(default = "default_http_port")]
    pub http_port: u16,
    /// Number of engine-core ranks behind the dp-lb.
    #[serde(default = "one")]
    pub dp_size: u32,
    /// Worker processes per engine rank, each computing a slice of every layer (vLLM's
    /// `tensor_parallel_size`, D111): the rank's worker starts its TP peers, hands each the
    /// engine's step and gathers their slices over shared memory. A GGUF model on the CPU whose
    /// heads, hidden width, MLP width and vocabulary divide by it; its KV heads a multiple or a
    /// divisor of it.
    #[serde(default = "one")]
    pub tensor_parallel_size: u32,
    #[serde(default = "default_transport")]
    pub transport: SocketTransport,
    /// tcp: address services bind (0.0.0.0 in containers).
    #[serde(default = "default_http_host")]
    pub bind_host: String,
    /// tcp: first of the node's internal ports (see [`NodeConfig::endpoints`]).
    #[serde(default = "default_base_port")]
    pub base_port: u16,
    /// tcp: host name per service, when services run on different hosts (containers).
    #[serde(default)]
    pub hosts: ServiceHosts,
    #[serde(default)]
    pub model: ModelConfig,
    #[serde(default)]
    pub engine: EngineConfig,
    /// Router only: the frontends of prefill and decode nodes (`http://host:port`).
    #[serde(default)]
    pub router: RouterConfig,
    /// KV transfer (vLLM's `kv_transfer_config`); absent on colocated nodes.
    #[serde(default)]
    pub kv_transfer: Option<KvTransferConfig>,
    /// Overload control: the bounds of the node's queues outside the engine (the engine's own
    /// are in [`EngineConfig`]).
    #[serde(default)]
    pub limits: LimitsConfig,
}

/// Bounds of a node's queues outside the engine. Beyond each one a request is refused with a
/// 503, `Retry-After` and an OpenAI error body instead of waiting in an unbounded queue.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Frontend (and router): generation requests in flight over HTTP, from the handler's
    /// start to the last byte of the answer. 0: no bound.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: u32,
    /// Frontend (and router): generation requests in flight per client API key, counted like
    /// `max_in_flight`; beyond it the key's requests get a 429 with `Retry-After`, so one
    /// client cannot take the whole server. 0: no bound. Without API keys there is nothing to
    /// key on and no per-key bound; on a node, the router's internal key is not bounded (it
    /// carries every client of the router, each bounded at the router).
    #[serde(default)]
    pub max_in_flight_per_key: u32,
    /// Frontend: engine outputs queued for one request whose client does not read; beyond it
    /// the request is aborted (a stalled client cannot make the frontend buffer its output).
    #[serde(default = "default_output_buffer")]
    pub output_buffer: u32,
    /// dp-lb: requests in its in-flight table (routed, not finished). 0: no bound.
    #[serde(default = "default_dp_lb_max_in_flight")]
    pub dp_lb_max_in_flight: u32,
    /// Seconds a refused client is told to wait (`Retry-After`) on every 503 and 429.
    #[serde(default = "one")]
    pub retry_after_s: u32,
    /// Frontend: seconds a generation request may live, from arrival to its last byte
    /// (D92). Past it the request is aborted in the engine (its blocks freed) and the client
    /// gets a 504, or an error event on a stream. Generous by default: a long answer from a
    /// slow model runs for many minutes. 0: no deadline.
    #[serde(default = "default_request_deadline_s")]
    pub request_deadline_s: u32,
    /// Frontend (and router): seconds a client may take to send a request's whole body
    /// once its headers arrived; past it the answer is 408 and the connection closes (D93).
    #[serde(default = "default_body_timeout_s")]
    pub body_timeout_s: u32,
    /// Structured outputs (D90): bytes of a JSON schema, regex or grammar; for a `choice`,
    /// of all its strings together.
    #[serde(default = "default_guided_max_spec_bytes")]
    pub guided_max_spec_bytes: u32,
    /// Structured outputs: strings in a `choice` (`guided_choice`, `structured_outputs.choice`).
    #[serde(default = "default_guided_max_choices")]
    pub guided_max_choices: u32,
    /// Structured outputs: the longest chain of `$ref`s a JSON schema may make the compiler
    /// follow (each step costs stack in the compiler).
    #[serde(default = "default_guided_max_ref_depth")]
    pub guided_max_ref_depth: u32,
    /// Structured outputs: milliseconds one compilation of a schema or grammar may take.
    #[serde(default = "default_guided_compile_timeout_ms")]
    pub guided_compile_timeout_ms: u32,
    /// Chat: entries in `tools` (D91).
    #[serde(default = "default_max_tools")]
    pub max_tools: u32,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_in_flight: default_max_in_flight(),
            max_in_flight_per_key: 0,
            output_buffer: default_output_buffer(),
            dp_lb_max_in_flight: default_dp_lb_max_in_flight(),
            retry_after_s: 1,
            request_deadline_s: default_request_deadline_s(),
            body_timeout_s: default_body_timeout_s(),
            guided_max_spec_bytes: default_guided_max_spec_bytes(),
            guided_max_choices: default_guided_max_choices(),
            guided_max_ref_depth: default_guided_max_ref_depth(),
            guided_compile_timeout_ms: default_guided_compile_timeout_ms(),
            max_tools: default_max_tools(),
        }
    }
}

fn default_request_deadline_s() -> u32 {
    1800
}
fn default_body_timeout_s() -> u32 {
    30
}
fn default_guided_max_spec_bytes() -> u32 {
    256 * 1024
}
fn default_guided_max_choices() -> u32 {
    1024
}
fn default_guided_max_ref_depth() -> u32 {
    64
}
fn default_guided_compile_timeout_ms() -> u32 {
    10_000
}
fn default_max_tools() -> u32 {
    128
}

fn default_max_in_flight() -> u32 {
    256
}
fn default_output_buffer() -> u32 {
    1024
}
fn default_dp_lb_max_in_flight() -> u32 {
    512
}

/// vLLM's `kv_transfer_config`, with pdmesh's transfer knobs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvTransferConfig {
    /// Connector implementation: `PdConnector` (pdmesh's NIXL-like connector),
    /// `OffloadConnector` (host-memory KV offload) or `MultiConnector` (the children listed in
    /// `kv_connector_children`, in order).
    #[serde(default = "default_connector")]
    pub kv_connector: String,
    /// `MultiConnector` only: its children, in the order they are asked for a request's
    /// external KV (the first that has some loads it), e.g. `["PdConnector", "OffloadConnector"]`.
    #[serde(default)]
    pub kv_connector_children: Vec<String>,
    /// The offload connector's CPU store.
    #[serde(default)]
    pub offload: OffloadConfig,
    pub kv_role: KvRole,
    /// Identity of this engine for remote peers; empty: `<node name>`.
    #[serde(default)]
    pub engine_id: String,
    #[serde(default)]
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    /// Transfer backend: `shm` (same host), `tcp` (across hosts) or `cuda` (GPU to GPU on one
    /// host; needs `model.device = "cuda"` and a `cuda` build). Both nodes of a P/D pair use
    /// the same one.
    #[serde(default)]
    pub backend: TransferBackendKind,
    /// Address peers use to reach this node's side channel (handshake, leases, notices).
    #[serde(default = "default_side_host")]
    pub side_channel_host: String,
    /// Side-channel port of rank 0; rank r uses `side_channel_port + r`.
    #[serde(default = "default_side_port")]
    pub side_channel_port: u16,
    /// tcp backend: block-read port of rank 0; rank r uses `+ r`.
    #[serde(default = "default_data_port")]
    pub data_port: u16,
    /// How long P holds blocks for a reader: a lease extended by D's heartbeats
    /// (`kv_lease_duration_s`), or vLLM's older fixed timeout (`abort_request_timeout_s`).
    #[serde(default)]
    pub hold_mode: HoldMode,
    /// Lease mode: the hold P starts with, and how far each of D's heartbeats moves it on
    /// (vLLM's `kv_lease_duration`).
    #[serde(default = "default_lease_s")]
    pub kv_lease_duration_s: u64,
    /// How long one read lease protects the blocks D is reading: a reader that neither
    /// finishes nor gives up within it loses them, and its `read done` is refused (its load
    /// then follows `kv_load_failure_policy`). Beyond vLLM, which has no read leases.
    #[serde(default = "default_read_lease_s")]
    pub kv_read_lease_s: u64,
    /// P: how long (ms) a lease request for a request whose hold P's worker has not registered
    /// yet waits for it, and how long a give-up that came first is remembered. P answers in the
    /// step that finishes its prefill, one step before the hold registers (docs/DECISIONS.md
    /// D65), so a fast reader can be early; past the wait the lease is refused as "not held".
    /// 0 turns the wait off. Beyond vLLM, whose NIXL reads need no lease.
    #[serde(default = "default_early_lease_wait_ms")]
    pub kv_early_lease_wait_ms: u64,
    #[serde(default = "default_abort_timeout_s")]
    pub abort_request_timeout_s: u64,
    /// D: drop a prefill engine's cached handshake (and with it the mapping of P's cache or
    /// the data connections) after this long without a request for that engine, so engines
    /// that went away are not kept mapped; a later request handshakes again.
    #[serde(default = "default_remote_agent_idle_s")]
    pub remote_agent_idle_s: u64,
    /// Rule R1: D notifies P when it refuses a remote-prefill request before admission
    /// (`false` only to measure the deadline-only baseline).
    #[serde(default = "yes")]
    pub rejection_notices: bool,
    /// Rules R2/R4: D tells P when it gives up on blocks P holds for it — a request aborted
    /// before its receive, a failed load, a graceful shutdown with references left — so P frees
    /// at once (`false` only to measure what the hold deadline alone leaves stranded; the
    /// router has the same switch for its releases). `PDMESH_GIVE_UP_NOTICES` overrides it.
    #[serde(default = "yes")]
    pub give_up_notices: bool,
    /// Fault injection for this node's transfer agent, a comma list such as
    /// `"lease_refused"` or `"transfer_midway,delay_transfer_ms=200"` (docs/KV_TRANSFER.md has
    /// the table). Empty: none. `PDMESH_FAULT` overrides it for one process.
    #[serde(default)]
    pub fault_injection: String,
    /// Free-form extra settings (vLLM's `kv_connector_extra_config`).
    #[serde(default)]
    pub kv_connector_extra_config: std::collections::BTreeMap<String, String>,
}

fn yes() -> bool {
    true
}

/// The host-memory KV offload connector (`OffloadConnector`, alone or as a `MultiConnector`
/// child): finished requests' full prompt blocks are copied to a CPU store and loaded back for
/// a later request with the same prefix.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadConfig {
    /// Capacity of the CPU store in KV blocks (each `bytes_per_block` of the worker's cache:
    /// layers × 2 × block_size × kv_heads × head_dim × 4 bytes); the least recently used
    /// unpinned block is evicted when it is full.
    #[serde(default = "default_offload_cpu_blocks")]
    pub cpu_blocks: u32,
}

fn default_offload_cpu_blocks() -> u32 {
    1024
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self { cpu_blocks: default_offload_cpu_blocks() }
    }
}

/// One KV connector a node runs (alone, or as a `MultiConnector` child).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectorKind {
    /// P/D transfer (`PdConnector`).
    Pd,
    /// Host-memory offload (`OffloadConnector`).
    Offload,
}

impl ConnectorKind {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "PdConnector" => Some(Self::Pd),
            "OffloadConnector" => Some(Self::Offload),
            _ => None,
        }
    }
}

fn default_connector() -> String {
    "PdConnector".into()
}
fn default_side_host() -> String {
    "127.0.0.1".into()
}
fn default_side_port() -> u16 {
    5600
}
fn default_data_port() -> u16 {
    5700
}
fn default_lease_s() -> u64 {
    30
}
fn default_read_lease_s() -> u64 {
    10
}
fn default_early_lease_wait_ms() -> u64 {
    1000
}
fn default_abort_timeout_s() -> u64 {
    480
}
fn default_remote_agent_idle_s() -> u64 {
    600
}

impl KvTransferConfig {
    /// The connectors this node runs, in `MultiConnector` order (one for a plain connector).
    pub fn connectors(&self) -> Result<Vec<ConnectorKind>, String> {
        let unknown = |n: &str| {
            format!("unknown connector {n:?} (known: \"PdConnector\", \"OffloadConnector\", \"MultiConnector\")")
        };
        if self.kv_connector != "MultiConnector" {
            if !self.kv_connector_children.is_empty() {
                return Err(format!(
                    "kv_connector_children is for kv_connector = \"MultiConnector\", not {:?}",
                    self.kv_connector
                ));
            }
            return ConnectorKind::parse(&self.kv_connector)
                .map(|k| vec![k])
                .ok_or_else(|| unknown(&self.kv_connector));
        }
        if self.kv_connector_children.is_empty() {
            return Err("kv_connector = \"MultiConnector\" needs kv_connector_children, e.g. [\"PdConnector\", \"OffloadConnector\"]".into());
        }
        let mut kinds = Vec::new();
        for name in &self.kv_connector_children {
            let kind = ConnectorKind::parse(name).ok_or_else(|| unknown(name))?;
            if kinds.contains(&kind) {
                return Err(format!("kv_connector_children names {name:?} twice"));
            }
            kinds.push(kind);
        }
        Ok(kinds)
    }

    /// Whether this node takes part in P/D (runs the `PdConnector`, alone or as a child).
    pub fn uses_pd(&self) -> bool {
        self.connectors().is_ok_and(|k| k.contains(&ConnectorKind::Pd))
    }

    /// Whether this node offloads KV to host memory (runs the `OffloadConnector`).
    pub fn uses_offload(&self) -> bool {
        self.connectors().is_ok_and(|k| k.contains(&ConnectorKind::Offload))
    }

    /// How long a read lease lasts on P.
    pub fn read_lease(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.kv_read_lease_s)
    }

    /// How long P waits for a hold to register before refusing an early lease (D65).
    pub fn early_lease_wait(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.kv_early_lease_wait_ms)
    }

    /// How far a heartbeat moves P's hold deadline on: `kv_lease_duration_s` (in both hold
    /// modes: a fixed-timeout hold is still kept alive by a reader that says it is coming).
    pub fn heartbeat_extension(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.kv_lease_duration_s)
    }

    /// The hold deadline P starts with when a request finishes.
    pub fn hold_duration(&self) -> std::time::Duration {
        std::time::Duration::from_secs(match self.hold_mode {
            HoldMode::Lease => self.kv_lease_duration_s,
            HoldMode::Fixed => self.abort_request_timeout_s,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvRole {
    KvProducer,
    KvConsumer,
    KvBoth,
}

impl KvRole {
    pub fn produces(self) -> bool {
        matches!(self, KvRole::KvProducer | KvRole::KvBoth)
    }
    pub fn consumes(self) -> bool {
        matches!(self, KvRole::KvConsumer | KvRole::KvBoth)
    }
}

/// What D does when loading remote KV fails (vLLM's names; vLLM's default is `fail`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvLoadFailurePolicy {
    /// Prefill the missing tokens locally; same output as a successful transfer.
    Recompute,
    /// End the request with finish reason `error`.
    #[default]
    Fail,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferBackendKind {
    #[default]
    Shm,
    Tcp,
    /// The KV cache lives in GPU memory, exported over CUDA IPC; D copies device to device.
    Cuda,
}

impl TransferBackendKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "shm" => Some(Self::Shm),
            "tcp" => Some(Self::Tcp),
            "cuda" => Some(Self::Cuda),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldMode {
    #[default]
    Lease,
    Fixed,
}

fn default_role() -> NodeRole {
    NodeRole::Colocated
}
fn default_http_host() -> String {
    "127.0.0.1".into()
}
fn default_http_port() -> u16 {
    8000
}
fn one() -> u32 {
    1
}
fn default_transport() -> SocketTransport {
    SocketTransport::Ipc
}
fn default_base_port() -> u16 {
    7100
}

/// Per-service host names for tcp across hosts. `{rank}` is replaced by the rank.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceHosts {
    pub frontend: Option<String>,
    pub dp_lb: Option<String>,
    pub engine_core: Option<String>,
    pub connector_scheduler: Option<String>,
    pub connector_worker: Option<String>,
}

/// Which model the connector-workers run.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// `synthetic` (tests, load tests) or `gguf` (a real model).
    #[serde(default = "default_model_kind")]
    pub kind: ModelKind,
    /// Name served in the OpenAI API (`model` field). Empty: derived from the model.
    #[serde(default)]
    pub name: String,
    /// GGUF file. Empty: `PDMESH_MODEL_PATH`, then the default cache location.
    #[serde(default)]
    pub path: String,
    /// Where a GGUF model runs: `cpu` (default) or `cuda` / `cuda:N` (GPU N; needs a binary
    /// built with the `cuda` feature). docs/MODEL.md.
    #[serde(default = "default_model_device")]
    pub device: String,
    /// Synthetic executor: microseconds of simulated compute per scheduled token.
    #[serde(default)]
    pub per_token_cost_us: u64,
    /// Synthetic executor: microseconds of simulated compute per step.
    #[serde(default)]
    pub per_step_cost_us: u64,
    /// Fault injection for the executor of this node's workers, any model: `step_error_every=N`
    /// (every N-th forward pass fails) or `device_lost_at_step=N` (the N-th and every later one
    /// fails as a lost accelerator, and the worker exits to be restarted). Empty: none.
    /// `PDMESH_EXECUTOR_FAULT` overrides it for one process.
    #[serde(default)]
    pub fault_injection: String,
    /// CPU threads of a GGUF model's forward pass on this node's workers (llama.cpp's
    /// `--threads`). 0 (default): `PDMESH_MODEL_THREADS`, else every core this process may use.
    /// Nodes that share a host's cores (P and D on one machine) may each take fewer.
    #[serde(default)]
    pub threads: u32,
    /// Niceness (Linux `nice`, 0–19) of a GGUF model's forward-pass threads on the CPU; 10 by
    /// default. Those threads fill every core they are given, and on a host they share with
    /// the node's serving processes (frontend, engine-core, a router, another node) a waking
    /// process would otherwise wait behind a pass's time slice to relay a token or admit a
    /// request. Below them, it takes a core at once (D71). 0 leaves the threads at the
    /// process's priority. Ignored on a GPU.
    #[serde(default = "default_cpu_nice")]
    pub cpu_nice: u8,
    /// A Jinja chat template file that replaces the GGUF file's own (vLLM's `--chat-template`):
    /// for a model whose file has none (base models such as Gemma 3 270M), or to fix one.
    /// Empty (default): the file's template; without one, `/v1/chat/completions` answers 400.
    /// A file that cannot be read or does not compile stops the node (exit 78). docs/MODEL.md.
    #[serde(default)]
    pub chat_template: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            kind: ModelKind::Synthetic,
            name: String::new(),
            path: String::new(),
            device: default_model_device(),
            per_token_cost_us: 0,
            per_step_cost_us: 0,
            fault_injection: String::new(),
            threads: 0,
            cpu_nice: default_cpu_nice(),
            chat_template: String::new(),
        }
    }
}

fn default_cpu_nice() -> u8 {
    10
}

fn default_model_device() -> String {
    "cpu".to_string()
}

fn default_model_kind() -> ModelKind {
    ModelKind::Synthetic
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    Synthetic,
    Gguf,
}

/// Scheduler and KV-cache sizing (vLLM's names and meanings).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// KV-cache blocks per rank. Replaced at start by what `kv_cache_memory` holds when that
    /// is set.
    #[serde(default = "default_num_blocks")]
    pub num_blocks: u32,
    /// The KV cache's memory per rank (`"2GiB"`, `"512MiB"` or bytes; vLLM's
    /// `kv_cache_memory_bytes`): the number of blocks is what this budget holds for the model
    /// served, so a larger model gets fewer blocks instead of more memory. Every process of the
    /// node reads the model's KV geometry from its file's header and comes to the same count.
    /// Start-up refuses a budget that cannot hold one `max_model_len` sequence (the model's
    /// context length when `max_model_len = 0`), naming both. Unset: `num_blocks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_memory: Option<ByteSize>,
    #[serde(default = "default_max_num_seqs")]
    pub max_num_seqs: u32,
    /// Token budget of one step (prefill chunks + decode tokens).
    #[serde(default = "default_max_batched")]
    pub max_num_batched_tokens: u32,
    /// Longest prompt + output; 0: the model's own limit.
    #[serde(default)]
    pub max_model_len: u32,
    /// Worker step timeout in milliseconds (a hung worker fails the step instead of the engine).
    #[serde(default = "default_step_timeout_ms")]
    pub step_timeout_ms: u64,
    /// Fault injection for the engine's scheduler: `refuse_admission_every=N` (every N-th
    /// request the dp-lb hands it is refused at admission, as a request the pool could never
    /// hold would be), to drill rule R1 inside the engine. Empty: none.
    /// `PDMESH_ENGINE_FAULT` overrides it for one process.
    #[serde(default)]
    pub fault_injection: String,
    /// Requests in the waiting queue of one rank; beyond it new requests are refused (503).
    /// The dp-lb also refuses, from the ranks' load reports, before a rank would. 0: no bound.
    #[serde(default = "default_max_waiting")]
    pub max_waiting: u32,
    /// Prefill nodes: the share of the KV pool that blocks held for remote decoders (and
    /// blocks promised to remote-decode requests still being prefilled) may take. A
    /// remote-decode request that would push them above it is refused (503), so holds that
    /// nobody reads cannot fill P. 1.0: no bound.
    #[serde(default = "default_max_held_fraction")]
    pub max_held_fraction: f64,
    /// Automatic prefix caching (vLLM's `enable_prefix_caching`): full KV blocks are hashed
    /// by their token prefix and reused by later requests with the same prefix; freed ones stay
    /// cached until evicted least-recently-used. `PDMESH_ENABLE_PREFIX_CACHING` overrides it.
    #[serde(default = "yes")]
    pub enable_prefix_caching: bool,
    /// Overlap the mesh's hops with the forward pass (vLLM's `--async-scheduling`, done on the
    /// worker side, D67): right after a step, the executor runs the next decode step of its
    /// requests speculatively from the tokens it just sampled, while its answer travels to
    /// engine-core and the engine schedules; the engine's real step reuses every row that
    /// matches exactly. It runs ahead only when it can run the whole next step (D68: a second
    /// pass for the rest would cost more than the overlap saves). P/D nodes too (D's receives
    /// and the step run ahead share one book of claimed blocks); not offloading nodes (their
    /// copies run between steps on the executor thread) and never with `model.fault_injection`.
    /// On by default; `PDMESH_ASYNC_SCHEDULING` overrides it for one process.
    #[serde(default = "yes")]
    pub async_scheduling: bool,
}

impl EngineConfig {
    /// With `kv_cache_memory` set: the number of blocks the budget holds for a model whose K
    /// and V take `kv_bytes_per_token` per token (all layers), written into `num_blocks`. An
    /// error (naming the budget, the sequence length and the fix) when the budget cannot hold
    /// one sequence of `max_model_len` tokens, or of the model's `model_max_len` when
    /// `max_model_len = 0` (as vLLM refuses one). Without a budget: nothing changes.
    pub fn apply_kv_budget(&mut self, kv_bytes_per_token: u64, model_max_len: u32) -> Result<(), String> {
        let Some(budget) = self.kv_cache_memory else { return Ok(()) };
        let per_block = kv_bytes_per_token.saturating_mul(u64::from(self.block_size)).max(1);
        let blocks = u32::try_from(budget.0 / per_block).unwrap_or(u32::MAX);
        let want = if self.max_model_len == 0 { model_max_len } else { self.max_model_len.min(model_max_len) };
        let fits_tokens = u64::from(blocks) * u64::from(self.block_size);
        if blocks < 2 || fits_tokens < u64::from(want) {
            let need = ByteSize(u64::from(want.div_ceil(self.block_size)).max(2) * per_block);
            return Err(format!(
                "kv_cache_memory {budget} holds {blocks} blocks of {} tokens ({fits_tokens} tokens at {kv_bytes_per_token} \
                 bytes per token), less than one sequence of max_model_len {want} tokens, which needs {need}: \
                 raise kv_cache_memory to at least {need} or set max_model_len to at most {fits_tokens}",
                self.block_size
            ));
        }
        self.num_blocks = blocks;
        Ok(())
    }

    /// Tokens the KV pool of one rank can hold: one request longer than this could never run.
    pub fn pool_tokens(&self) -> u64 {
        u64::from(self.num_blocks) * u64::from(self.block_size)
    }

    /// The longest prompt + output a rank accepts, given the model's own limit: the configured
    /// `max_model_len` (never above the model's), or with `0` the model's limit cut to what the
    /// pool can hold. [`Topology::validate`] refuses an explicit value the pool cannot hold, so
    /// every request the frontend admits fits the pool and the engine never has to refuse one
    /// for its size after admission.
    pub fn effective_max_model_len(&self, model_max: u32) -> u32 {
        let pool = u32::try_from(self.pool_tokens()).unwrap_or(u32::MAX);
        if self.max_model_len == 0 {
            model_max.min(pool)
        } else {
            self.max_model_len.min(model_max)
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: default_block_size(),
            num_blocks: default_num_blocks(),
            kv_cache_memory: None,
            max_num_seqs: default_max_num_seqs(),
            max_num_batched_tokens: default_max_batched(),
            max_model_len: 0,
            step_timeout_ms: default_step_timeout_ms(),
            fault_injection: String::new(),
            max_waiting: default_max_waiting(),
            max_held_fraction: default_max_held_fraction(),
            enable_prefix_caching: true,
            async_scheduling: true,
        }
    }
}

fn default_block_size() -> u32 {
    16
}
fn default_num_blocks() -> u32 {
    2048
}
fn default_max_num_seqs() -> u32 {
    256
}
fn default_max_batched() -> u32 {
    2048
}
fn default_step_timeout_ms() -> u64 {
    60_000
}
fn default_max_waiting() -> u32 {
    256
}
fn default_max_held_fraction() -> f64 {
    0.5
}

/// The router role's upstreams.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    #[serde(default)]
    pub prefill: Vec<String>,
    #[serde(default)]
    pub decode: Vec<String>,
    /// A DNS name whose addresses are prefill nodes, as `host:port` (a Kubernetes headless
    /// Service, e.g. `pdmesh-prefill.pdmesh.svc.cluster.local:8000`): every A/AAAA record is
    /// an upstream `http://addr:port`, re-resolved every `dns_refresh_ms`, beside any URL of
    /// `prefill` (D61).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_dns: Option<String>,
    /// The same for decode nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_dns: Option<String>,
    /// Milliseconds between two resolutions of `prefill_dns` / `decode_dns`: a pod that joins
    /// or leaves a Service is picked up or dropped within this period.
    #[serde(default = "default_dns_refresh_ms")]
    pub dns_refresh_ms: u64,
    /// Rule R4 for the router: a request that ends between the legs (client gone, D
    /// unreachable) hands P's blocks back through P's `/v1/kv/release` (`false` only to measure
    /// the deadline-only baseline, like `kv_transfer.give_up_notices`).
    #[serde(default = "yes")]
    pub give_up_notices: bool,
    /// How the router picks a node of each role (D55, D59): `cache_aware` (the default: cost
    /// lowered by the share of the prompt a node already holds in its prefix cache; the
    /// router loads the node's tokenizer from `model` for it), `least_loaded` (the lower cost
    /// of two candidates: outstanding requests times the node's observed latency) or
    /// `round_robin`.
    #[serde(default)]
    pub policy: RoutingPolicy,
    /// Milliseconds between two polls of every upstream's `GET /load` (readiness, queue depth,
    /// KV usage); 0: no polling (the router's own in-flight counts and latencies only).
    #[serde(default = "default_load_poll_ms")]
    pub load_poll_ms: u64,
    /// Requests in a row an upstream must fail (connect error, reset, a 5xx other than an
    /// overload 503) before it is ejected; 0: never eject.
    #[serde(default = "default_eject_after_failures")]
    pub eject_after_failures: u32,
    /// First ejection's length in milliseconds; each ejection in a row doubles it, up to
    /// `eject_max_ms`. An ejected node comes back once that time passed and its `/load` answers.
    #[serde(default = "default_eject_base_ms")]
    pub eject_base_ms: u64,
    #[serde(default = "default_eject_max_ms")]
    pub eject_max_ms: u64,
    /// Prefill nodes tried per request when a P fails before answering (1: no retry).
    #[serde(default = "default_prefill_attempts")]
    pub prefill_attempts: u32,
    /// Times one streamed request may move to another decode node when its stream breaks
    /// (D56); 0: no migration (the client gets an error event).
    #[serde(default = "default_max_migrations")]
    pub max_migrations: u32,
    /// Stream the token P sampled to the client as soon as P answers, D continuing from the
    /// second (D63); only for streams whose first token shows as it is (one choice, no stop
    /// strings, logprobs, tools or grammar). `false`: the client's first token comes from D.
    #[serde(default = "yes")]
    pub first_token_from_prefill: bool,
    /// For the streams that take their first token from P: send the decode leg at the same
    /// time as the prefill leg; D admits and parks it until the router hands it P's params, so
    /// D's admission hop runs while P prefills (D66, SGLang's parallel dispatch). `false`: the
    /// decode leg leaves once P answered.
    #[serde(default = "yes")]
    pub parallel_dispatch: bool,
    /// Conditional disaggregation (D69, Dynamo's and llm-d's): a request whose prompt the
    /// chosen decode node would have at most this many tokens left to compute — its length
    /// less the blocks that node's prefix cache holds, by the router's last `/load` poll of it
    /// — skips the prefill node and is prefilled on the decode node itself. Such a prompt gives
    /// P little to compute and D nothing, or almost nothing, to read, while P's forward pass and
    /// hops cost as much as a decode step. 0 (the default): every request goes through P.
    /// Needs the router to tokenise prompts (it loads the nodes' tokenizer from `model`).
    #[serde(default)]
    pub local_prefill_max_tokens: u32,
    /// `least_loaded` and `cache_aware`: a node whose smoothed latency (per token on D, per
    /// prefill leg on P) is above this many times the fastest other node's is left out of the
    /// rotation while another can serve (D55, D104); 0: never (the cost rule alone). At least
    /// 1.5: a lower ratio would leave out nodes that are only as slow as their load makes them.
    #[serde(default = "default_slow_ratio")]
    pub slow_ratio: f64,
    /// Milliseconds between two probes of a decode node that is left out as slow or not
    /// measured yet: a short greedy stream the router sends itself, whose per-token gap
    /// decides whether the node is back in rotation (D104), so no user's request is spent
    /// finding out. 0: no probes, a left-out node's estimate decays (10 s half-life) until it is
    /// tried again with a live request (D55). Prefill nodes are never probed (a probe would
    /// hold blocks on P).
    #[serde(default = "default_slow_probe_ms")]
    pub slow_probe_ms: u64,
    /// `least_loaded` and `cache_aware`: a stream whose inter-token gaps are above this many
    /// times the median of the other decode nodes' for `slow_migrate_tokens` tokens in a row
    /// moves to another decode node (D104), like one whose node died (D56: one stream for
    /// the client, counted within `max_migrations`). 0: never.
    #[serde(default = "default_slow_migrate_ratio")]
    pub slow_migrate_ratio: f64,
    /// Tokens in a row above `slow_migrate_ratio` before the stream moves (1 or more): a
    /// single late token (a busy host) moves nothing.
    #[serde(default = "default_slow_migrate_tokens")]
    pub slow_migrate_tokens: u32,
}

impl RouterConfig {
    /// Each role needs upstreams (URLs, a DNS name or both); a DNS name is `host:port`.
    fn check(&self) -> Result<(), String> {
        for (role, urls, dns) in
            [("prefill", &self.prefill, &self.prefill_dns), ("decode", &self.decode, &self.decode_dns)]
        {
            if urls.is_empty() && dns.is_none() {
                return Err(format!("needs {role} upstreams: router.{role} (URLs) or router.{role}_dns (a DNS name)"));
            }
            if let Some(name) = dns {
                check_dns_name(name).map_err(|why| format!("router.{role}_dns = {name:?}: {why}"))?;
            }
        }
        if (self.prefill_dns.is_some() || self.decode_dns.is_some()) && self.dns_refresh_ms < 100 {
            return Err(format!("router.dns_refresh_ms = {} must be at least 100", self.dns_refresh_ms));
        }
        for (key, ratio) in [("slow_ratio", self.slow_ratio), ("slow_migrate_ratio", self.slow_migrate_ratio)] {
            if !(ratio == 0.0 || (ratio.is_finite() && ratio >= 1.5)) {
                return Err(format!("router.{key} = {ratio} must be 0 (off) or at least 1.5"));
            }
        }
        if self.slow_probe_ms != 0 && self.slow_probe_ms < 100 {
            return Err(format!("router.slow_probe_ms = {} must be 0 (off) or at least 100", self.slow_probe_ms));
        }
        if self.slow_migrate_tokens == 0 {
            return Err("router.slow_migrate_tokens must be at least 1".into());
        }
        Ok(())
    }
}

/// `host:port` of an upstream DNS name: a host name (or address) and the nodes' HTTP port, no
/// scheme and no path (every record is reached as `http://addr:port`).
fn check_dns_name(name: &str) -> Result<(), String> {
    if name.contains("://") || name.contains('/') {
        return Err(
            "must be host:port, without a scheme or path (e.g. \"pdmesh-prefill.pdmesh.svc.cluster.local:8000\")"
                .into(),
        );
    }
    let Some((host, port)) = name.rsplit_once(':') else {
        return Err("must be host:port: the port of the nodes' HTTP server is missing".into());
    };
    if !port.parse::<u16>().is_ok_and(|p| p != 0) {
        return Err(format!("{port:?} is not a port (1..=65535)"));
    }
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let valid = !host.is_empty()
        && (host.parse::<std::net::IpAddr>().is_ok()
            || host.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.'));
    if !valid {
        return Err(format!("{host:?} is not a host name"));
    }
    Ok(())
}

/// `router.policy`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingPolicy {
    /// Load and the prompt blocks each node already holds (D59); `least_loaded` when the
    /// router cannot tokenise (no model to load the tokenizer from).
    #[default]
    CacheAware,
    /// The cheapest node (outstanding requests × latency × KV use).
    LeastLoaded,
    /// The cheaper of two nodes drawn at random (power of two choices).
    PowerOfTwo,
    RoundRobin,
}

fn default_dns_refresh_ms() -> u64 {
    5000
}
fn default_load_poll_ms() -> u64 {
    200
}
fn default_eject_after_failures() -> u32 {
    3
}
fn default_eject_base_ms() -> u64 {
    1000
}
fn default_eject_max_ms() -> u64 {
    30_000
}
fn default_prefill_attempts() -> u32 {
    2
}
fn default_max_migrations() -> u32 {
    2
}
fn default_slow_ratio() -> f64 {
    3.0
}
fn default_slow_probe_ms() -> u64 {
    1000
}
fn default_slow_migrate_ratio() -> f64 {
    3.0
}
fn default_slow_migrate_tokens() -> u32 {
    8
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            prefill: Vec::new(),
            decode: Vec::new(),
            prefill_dns: None,
            decode_dns: None,
            dns_refresh_ms: default_dns_refresh_ms(),
            give_up_notices: true,
            policy: RoutingPolicy::default(),
            load_poll_ms: default_load_poll_ms(),
            eject_after_failures: default_eject_after_failures(),
            eject_base_ms: default_eject_base_ms(),
            eject_max_ms: default_eject_max_ms(),
            prefill_attempts: default_prefill_attempts(),
            max_migrations: default_max_migrations(),
            first_token_from_prefill: true,
            parallel_dispatch: true,
            local_prefill_max_tokens: 0,
            slow_ratio: default_slow_ratio(),
            slow_probe_ms: default_slow_probe_ms(),
            slow_migrate_ratio: default_slow_migrate_ratio(),
            slow_migrate_tokens: default_slow_migrate_tokens(),
        }
    }
}

/// The services of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Service {
    Frontend,
    DpLb,
    EngineCore,
    ConnectorScheduler,
    ConnectorWorker,
}

impl Service {
    pub const ALL: [Service; 5] =
        [Service::Frontend, Service::DpLb, Service::EngineCore, Service::ConnectorScheduler, Service::ConnectorWorker];

    pub fn name(self) -> &'static str {
        match self {
            Service::Frontend => "frontend",
            Service::DpLb => "dp-lb",
            Service::EngineCore => "engine-core",
            Service::ConnectorScheduler => "connector-scheduler",
            Service::ConnectorWorker => "connector-worker",
        }
    }

    /// Whether the node runs one of these per data-parallel rank.
    pub fn per_rank(self) -> bool {
        matches!(self, Service::EngineCore | Service::ConnectorScheduler | Service::ConnectorWorker)
    }
}

/// A socket address: what the owner binds and what peers connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub bind: String,
    pub connect: String,
}

/// Every internal endpoint of a node.
#[derive(Debug, Clone)]
pub struct NodeEndpoints {
    /// dp-lb ROUTER that the frontend's DEALER connects to.
    pub dplb_frontend: Endpoint,
    /// dp-lb ROUTER that each engine-core's DEALER connects to.
    pub dplb_engines: Endpoint,
    /// frontend PULL for engine outputs: each engine-core's PUSH (D75), and the dp-lb's for
    /// the failures of a rank that went away.
    pub frontend_outputs: Endpoint,
    /// per rank: connector-scheduler ROUTER.
    pub connector_scheduler: Vec<Endpoint>,
    /// per rank: connector-worker ROUTER.
    pub connector_worker: Vec<Endpoint>,
}

impl NodeConfig {
    /// Whether this node's worker runs each next decode step ahead (`engine.async_scheduling`,
    /// D67/D68): not where it offloads KV (the copies run between steps on the executor
    /// thread) nor with `model.fault_injection` (faults count forward passes). The engine
    /// then also gives a request going on the block of its next position a step early (D78).
    pub fn steps_run_ahead(&self) -> bool {
        self.engine.async_scheduling
            && self.tensor_parallel_size <= 1
            && !self.kv_transfer.as_ref().is_some_and(|k| k.uses_offload())
            && self.model.fault_injection.split(',').all(|f| f.trim().is_empty())
    }

    /// What a tensor-parallel node needs (D111): the split is of a GGUF model's forward pass on
    /// the CPU, and the rank's worker hands its peers each step as the engine sends it.
    fn check_tensor_parallel(&self) -> Result<(), String> {
        let tp = self.tensor_parallel_size;
        if tp == 0 || tp > 16 {
            return Err("must be 1..=16".into());
        }
        if tp == 1 || self.role == NodeRole::Router {
            return Ok(());
        }
        if self.model.kind != ModelKind::Gguf {
            return Err("tensor parallelism splits a GGUF model (model.kind = \"gguf\")".into());
        }
        if !matches!(self.model.device.as_str(), "" | "cpu") {
            return Err(format!("splits a model on the CPU; model.device is {:?}", self.model.device));
        }
        if self.kv_transfer.as_ref().is_some_and(KvTransferConfig::uses_offload) {
            return Err("the OffloadConnector runs with tensor_parallel_size = 1".into());
        }
        if !self.model.fault_injection.trim().is_empty() {
            return Err(
                "model.fault_injection counts one process's forward passes; it runs with tensor_parallel_size = 1"
                    .into(),
            );
        }
        Ok(())
    }

    fn host_of(&self, configured: &Option<String>, rank: u32) -> String {
        configured.as_ref().map(|h| h.replace("{rank}", &rank.to_string())).unwrap_or_else(|| {
            if self.bind_host == "0.0.0.0" {
                "127.0.0.1".into()
            } else {
                self.bind_host.clone()
            }
        })
    }

    fn endpoint(&self, run_dir: &Path, name: &str, port_offset: u16, host: String) -> Endpoint {
        match self.transport {
            SocketTransport::Ipc => {
                let path = run_dir.join(&self.name).join(format!("{name}.sock"));
                let e = format!("ipc://{}", path.display());
                Endpoint { bind: e.clone(), connect: e }
            }
            SocketTransport::Tcp => {
                let port = self.base_port.saturating_add(port_offset);
                Endpoint { bind: format!("tcp://{}:{port}", self.bind_host), connect: format!("tcp://{host}:{port}") }
            }
        }
    }

    /// Internal endpoints. tcp ports: base+0 dp-lb (frontend side), +1 dp-lb (engine side),
    /// +2 unused (the dp-lb's output relay before D75; kept so no port moves), +3 frontend outputs, +10+2r connector-scheduler r,
    /// +11+2r connector-worker r.
    pub fn endpoints(&self, run_dir: &Path) -> NodeEndpoints {
        let lb = self.host_of(&self.hosts.dp_lb, 0);
        let fe = self.host_of(&self.hosts.frontend, 0);
        NodeEndpoints {
            dplb_frontend: self.endpoint(run_dir, "dplb-frontend", 0, lb.clone()),
            dplb_engines: self.endpoint(run_dir, "dplb-engines", 1, lb),
            frontend_outputs: self.endpoint(run_dir, "frontend-outputs", 3, fe),
            connector_scheduler: (0..self.dp_size)
                .map(|r| {
                    let h = self.host_of(&self.hosts.connector_scheduler, r);
                    self.endpoint(run_dir, &format!("connector-scheduler-{r}"), 10 + 2 * r as u16, h)
                })
                .collect(),
            connector_worker: (0..self.dp_size)
                .map(|r| {
                    let h = self.host_of(&self.hosts.connector_worker, r);
                    self.endpoint(run_dir, &format!("connector-worker-{r}"), 11 + 2 * r as u16, h)
                })
                .collect(),
        }
    }

    /// Every port this node listens on, with the address it binds and what it is for: its HTTP
    /// port, its services' `/metrics` ports, its internal tcp ports, and per rank its KV side
    /// channel and (tcp backend) block server. [`Topology::validate`] refuses two uses of one.
    pub fn listening_ports(&self, run_dir: &Path) -> Vec<ListeningPort> {
        let at = |host: &str, port: u16, what: String| ListeningPort { host: host.to_string(), port, what };
        let mut out = vec![at(&self.http_host, self.http_port, format!("node {:?} HTTP", self.name))];
        if self.role == NodeRole::Router {
            return out;
        }
        out.push(at(
            &self.bind_host,
            self.metrics_port(Service::DpLb, 0),
            format!("node {:?} dp-lb metrics", self.name),
        ));
        for r in 0..self.dp_size {
            for s in [Service::EngineCore, Service::ConnectorScheduler, Service::ConnectorWorker] {
                out.push(at(
                    &self.bind_host,
                    self.metrics_port(s, r),
                    format!("node {:?} {} {r} metrics", self.name, s.name()),
                ));
            }
        }
        let e = self.endpoints(run_dir);
        let internal = [&e.dplb_frontend, &e.dplb_engines, &e.frontend_outputs]
            .into_iter()
            .chain(&e.connector_scheduler)
            .chain(&e.connector_worker);
        for ep in internal {
            if let Some(port) = ep.bind.strip_prefix("tcp://").and_then(|a| a.rsplit(':').next()?.parse().ok()) {
                out.push(at(&self.bind_host, port, format!("node {:?} internal link {}", self.name, ep.bind)));
            }
        }
        if let Some(kv) = &self.kv_transfer {
            for r in 0..self.dp_size {
                let r16 = r as u16;
                out.push(at(
                    &self.bind_host,
                    kv.side_channel_port.saturating_add(r16),
                    format!("node {:?} KV side channel of rank {r}", self.name),
                ));
                if kv.backend == TransferBackendKind::Tcp {
                    out.push(at(
                        &self.bind_host,
                        kv.data_port.saturating_add(r16),
                        format!("node {:?} KV block server of rank {r}", self.name),
                    ));
                }
            }
        }
        out
    }

    /// HTTP port of a service's `/metrics` (and `/health`) server. The frontend serves them
    /// on its API port; the others on base+100+… so every port of a node is predictable.
    pub fn metrics_port(&self, service: Service, rank: u32) -> u16 {
        let r = rank as u16;
        match service {
            Service::Frontend => self.http_port,
            Service::DpLb => self.base_port.saturating_add(100),
            Service::EngineCore => self.base_port.saturating_add(110 + 3 * r),
            Service::ConnectorScheduler => self.base_port.saturating_add(111 + 3 * r),
            Service::ConnectorWorker => self.base_port.saturating_add(112 + 3 * r),
        }
    }
}

/// One port a node listens on ([`NodeConfig::listening_ports`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListeningPort {
    /// The address it binds.
    pub host: String,
    pub port: u16,
    /// What listens there, for the error that names both uses of a port.
    pub what: String,
}

impl Topology {
    /// No two listeners may share a port: within a node whatever the addresses (its services
    /// may bind the same host, and a wildcard covers every address), across nodes when they
    /// bind the same specific address. Nodes that bind a wildcard (`0.0.0.0`, `::`) are not
    /// compared with each other: one topology file drives several hosts (`pdmesh up --node`),
    /// and nodes on different hosts may use the same ports. A collision is refused naming both
    /// uses, instead of one process failing to bind and being restarted in a loop.
    fn check_ports(&self) -> Result<(), ConfigError> {
        let mut seen: std::collections::BTreeMap<(String, u16), String> = std::collections::BTreeMap::new();
        for n in &self.nodes {
            let mut own: std::collections::BTreeMap<u16, String> = std::collections::BTreeMap::new();
            for p in n.listening_ports(&self.run_dir) {
                if let Some(other) = own.insert(p.port, p.what.clone()) {
                    return Err(ConfigError::Invalid(format!("port {} is used twice: {other} and {}", p.port, p.what)));
                }
                let wildcard = matches!(p.host.as_str(), "0.0.0.0" | "::" | "[::]" | "");
                if wildcard {
                    continue;
                }
                if let Some(other) = seen.insert((p.host.clone(), p.port), p.what.clone()) {
                    return Err(ConfigError::Invalid(format!(
                        "port {} on {} is used twice: {other} and {}",
                        p.port, p.host, p.what
                    )));
                }
            }
        }
        Ok(())
    }

    /// Parse and validate TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let topo: Topology = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        topo.validate()?;
        Ok(topo)
    }

    /// The topology as TOML text that [`Topology::from_toml`] reads back: `pdmesh serve` builds
    /// a topology in memory and hands its children this text.
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        toml::to_string(self).map_err(|e| ConfigError::Invalid(format!("cannot write the topology as TOML: {e}")))
    }

    /// Read, parse and validate a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { path: path.display().to_string(), reason: e.to_string() })?;
        Self::from_toml(&text)
    }

    /// Apply the per-process overrides from the environment (`PDMESH_RUN_DIR`,
    /// `PDMESH_FAULT`, `PDMESH_EXECUTOR_FAULT`, `PDMESH_KV_LOAD_FAILURE_POLICY`,
    /// `PDMESH_GIVE_UP_NOTICES`, `PDMESH_MODEL_DEVICE`, `PDMESH_KV_BACKEND`,
    /// `PDMESH_ENABLE_PREFIX_CACHING`, `PDMESH_ASYNC_SCHEDULING`) to every node
    /// that has the section they change. A service process serves one node, so the override
    /// acts on that node; set on `pdmesh up` it reaches every child.
    pub fn apply_env(&mut self) -> Result<(), ConfigError> {
        if let Some(dir) = env::get(env::RUN_DIR) {
            self.run_dir = PathBuf::from(dir);
        }
        let give_ups = env_bool(env::GIVE_UP_NOTICES)?;
        if let Some(on) = give_ups {
            for n in self.nodes.iter_mut() {
                n.router.give_up_notices = on;
                if let Some(kv) = n.kv_transfer.as_mut() {
                    kv.give_up_notices = on;
                }
            }
        }
        let prefix_caching = env_bool(env::ENABLE_PREFIX_CACHING)?;
        if let Some(on) = prefix_caching {
            for n in self.nodes.iter_mut() {
                n.engine.enable_prefix_caching = on;
            }
        }
        if let Some(on) = env_bool(env::ASYNC_SCHEDULING)? {
            for n in self.nodes.iter_mut() {
                n.engine.async_scheduling = on;
            }
        }
        let faults = env::get(env::FAULT);
        let policy = match env::get(env::KV_LOAD_FAILURE_POLICY).as_deref() {
            None => None,
            Some("recompute") => Some(KvLoadFailurePolicy::Recompute),
            Some("fail") => Some(KvLoadFailurePolicy::Fail),
            Some(other) => {
                return Err(ConfigError::Invalid(format!(
                    "{}={other:?}: expected \"recompute\" or \"fail\"",
                    env::KV_LOAD_FAILURE_POLICY
                )))
            }
        };
        if let Some(device) = env::get(env::MODEL_DEVICE) {
            for node in &mut self.nodes {
                node.model.device = device.clone();
            }
        }
        if let Some(fault) = env::get(env::EXECUTOR_FAULT) {
            for node in &mut self.nodes {
                node.model.fault_injection = fault.clone();
            }
        }
        if let Some(fault) = env::get(env::ENGINE_FAULT) {
            for node in &mut self.nodes {
                node.engine.fault_injection = fault.clone();
            }
        }
        let backend = match env::get(env::KV_BACKEND) {
            None => None,
            Some(b) => Some(TransferBackendKind::parse(&b).ok_or_else(|| {
                ConfigError::Invalid(format!("{}={b:?}: expected \"shm\", \"tcp\" or \"cuda\"", env::KV_BACKEND))
            })?),
        };
        for kv in self.nodes.iter_mut().filter_map(|n| n.kv_transfer.as_mut()) {
            if let Some(f) = &faults {
                kv.fault_injection = f.clone();
            }
            if let Some(p) = policy {
                kv.kv_load_failure_policy = p;
            }
            if let Some(b) = backend {
                kv.backend = b;
            }
        }
        self.check_node_settings()
    }

    /// Per-node settings that stand alone: a model's niceness is one Linux accepts, and a
    /// `cuda` transfer backend needs the node's model on a GPU (the cache it serves is the GPU
    /// executor's).
    fn check_node_settings(&self) -> Result<(), ConfigError> {
        for n in &self.nodes {
            if n.model.cpu_nice > 19 {
                return Err(ConfigError::Invalid(format!(
                    "node {:?}: model.cpu_nice = {} is outside 0..=19 (Linux niceness)",
                    n.name, n.model.cpu_nice
                )));
            }
            let Some(kv) = &n.kv_transfer else { continue };
            let on_gpu = n.model.kind == ModelKind::Gguf && n.model.device.starts_with("cuda");
            if kv.backend == TransferBackendKind::Cuda && !on_gpu {
                return Err(ConfigError::Invalid(format!(
                    "node {:?}: kv_transfer.backend = \"cuda\" needs a GGUF model on a GPU (model.device = \"cuda\"), \
                     found model.kind = {:?}, model.device = {:?}",
                    n.name, n.model.kind, n.model.device
                )));
            }
        }
        Ok(())
    }

    /// The built-in default mesh.
    pub fn default_mesh() -> Result<Self, ConfigError> {
        Self::from_toml(DEFAULT_TOPOLOGY)
    }

    pub fn node(&self, name: &str) -> Result<&NodeConfig, ConfigError> {
        self.nodes.iter().find(|n| n.name == name).ok_or_else(|| ConfigError::UnknownNode(name.to_string()))
    }

    /// Cross-field checks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.nodes.is_empty() {
            return invalid("at least one node is needed".into());
        }
        let mut names = std::collections::BTreeSet::new();
        let mut http = std::collections::BTreeSet::new();
        for n in &self.nodes {
            if n.name.is_empty() || !n.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
                return invalid(format!("node name {:?} must be non-empty [A-Za-z0-9_-]", n.name));
            }
            if !names.insert(n.name.clone()) {
                return invalid(format!("two nodes are named {:?}", n.name));
            }
            if !http.insert((n.http_host.clone(), n.http_port)) {
                return invalid(format!("node {:?}: HTTP port {} is used twice", n.name, n.http_port));
            }
            if n.dp_size == 0 || n.dp_size > 64 {
                return invalid(format!("node {:?}: dp_size must be 1..=64", n.name));
            }
            if let Err(why) = n.check_tensor_parallel() {
                return invalid(format!("node {:?}: tensor_parallel_size {}: {why}", n.name, n.tensor_parallel_size));
            }
            let e = &n.engine;
            if e.block_size == 0 || e.block_size > 1024 {
                return invalid(format!("node {:?}: block_size must be 1..=1024", n.name));
            }
            if e.num_blocks < 2 {
                return invalid(format!("node {:?}: num_blocks must be at least 2", n.name));
            }
            // with a memory budget, the pool is known only once the model is (checked at start)
            if e.kv_cache_memory.is_none() && u64::from(e.max_model_len) > e.pool_tokens() {
                return invalid(format!(
                    "node {:?}: max_model_len {} does not fit the KV pool: {} blocks of {} tokens hold {} tokens; \
                     raise num_blocks to at least {} or lower max_model_len",
                    n.name,
                    e.max_model_len,
                    e.num_blocks,
                    e.block_size,
                    e.pool_tokens(),
                    e.max_model_len.div_ceil(e.block_size)
                ));
            }
            if e.max_num_seqs == 0 || e.max_num_batched_tokens == 0 {
                return invalid(format!("node {:?}: max_num_seqs and max_num_batched_tokens must be positive", n.name));
            }
            if let Some(kv) = &n.kv_transfer {
                if let Err(why) = kv.connectors() {
                    return invalid(format!("node {:?}: kv_transfer: {why}", n.name));
                }
                if kv.uses_offload() && kv.offload.cpu_blocks == 0 {
                    return invalid(format!("node {:?}: kv_transfer.offload.cpu_blocks must be positive", n.name));
                }
                if kv.uses_offload() && kv.backend == TransferBackendKind::Cuda {
                    return invalid(format!(
                        "node {:?}: the OffloadConnector copies a host KV cache; kv_transfer.backend = \"cuda\" keeps it on the GPU",
                        n.name
                    ));
                }
                if kv.kv_lease_duration_s == 0 || kv.kv_read_lease_s == 0 || kv.abort_request_timeout_s == 0 {
                    return invalid(format!(
                        "node {:?}: kv_lease_duration_s, kv_read_lease_s and abort_request_timeout_s must be positive",
                        n.name
                    ));
                }
            }
            if !(e.max_held_fraction > 0.0 && e.max_held_fraction <= 1.0) {
                return invalid(format!("node {:?}: engine.max_held_fraction must be in (0, 1]", n.name));
            }
            if n.limits.output_buffer == 0 {
                return invalid(format!("node {:?}: limits.output_buffer must be at least 1", n.name));
            }
            if n.role == NodeRole::Router {
                n.router.check().map_err(|why| ConfigError::Invalid(format!("router node {:?}: {why}", n.name)))?;
            }
        }
        self.check_node_settings()?;
        self.check_ports()
    }
}

/// A boolean environment override: `None` when unset, `"true"` or `"false"`, else an error
/// naming the variable.
fn env_bool(name: &str) -> Result<Option<bool>, ConfigError> {
    match env::get(name).as_deref() {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(other) => Err(ConfigError::Invalid(format!("{name}={other:?}: expected \"true\" or \"false\""))),
    }
}

#[cfg(test)]
mod kv_budget_tests {
    #![allow(clippy::unwrap_used)]
    use super::{ByteSize, EngineConfig};

    #[test]
    fn a_budget_becomes_blocks_and_refuses_what_cannot_hold_one_sequence() {
        // Qwen2.5-1.5B: 28 layers x 2 kv heads x 128 x (K, V) x 4 bytes = 57 344 bytes a token
        let per_token = 28 * 2 * 128 * 2 * 4;
        let mut e =
            EngineConfig { kv_cache_memory: Some(ByteSize(1 << 30)), max_model_len: 4096, ..Default::default() };
        e.apply_kv_budget(per_token, 32768).unwrap();
        assert_eq!(e.num_blocks, (1u64 << 30) as u32 / (per_token as u32 * 16));
        assert!(e.pool_tokens() >= 4096);
        // max_model_len 0: the model's own 32k context must fit, and 1 GiB does not
        let mut e = EngineConfig { kv_cache_memory: Some(ByteSize(1 << 30)), ..Default::default() };
        let err = e.apply_kv_budget(per_token, 32768).unwrap_err();
        assert!(err.contains("max_model_len 32768") && err.contains("1.00 GiB"), "{err}");
        assert!(err.contains("set max_model_len to at most 18720"), "{err}");
        // no budget: num_blocks as configured
        let mut e = EngineConfig { num_blocks: 77, ..Default::default() };
        e.apply_kv_budget(per_token, 32768).unwrap();
        assert_eq!(e.num_blocks, 77);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_topology_is_valid() {
        let t = Topology::default_mesh().unwrap();
        assert_eq!(t.nodes.len(), 3, "router + P + D");
        assert_eq!(t.nodes[0].http_port, 8000);
        assert_eq!(t.nodes[0].role, NodeRole::Router);
        let d = t.node("decode").unwrap();
        assert_eq!(d.dp_size, 2);
        assert_eq!(d.endpoints(&t.run_dir).connector_worker.len(), 2);
        for extra in ["colocated.toml", "synthetic.toml"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/topology").join(extra);
            Topology::load(&path).unwrap();
        }
    }

    fn listening_ports(n: &NodeConfig, run_dir: &Path) -> Vec<(u16, String)> {
        n.listening_ports(run_dir).into_iter().map(|p| (p.port, p.what)).collect()
    }

    /// Issue 40: two uses of one port — a side channel on the node's own dp-lb `/metrics` port
    /// (`base_port` + 100), a block server on a side channel's port, two nodes on one address
    /// and one side-channel port — are refused naming both uses; every shipped topology passes.
    #[test]
    fn colliding_ports_are_refused_naming_both_uses() {
        let node = |extra: &str| format!("[[nodes]]\nname = \"a\"\nhttp_port = 9000\nbase_port = 7000\n{extra}\n");
        let err = Topology::from_toml(&node("kv_transfer = { kv_role = \"kv_both\", side_channel_port = 7100 }"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("port 7100") && err.contains("dp-lb metrics") && err.contains("KV side channel of rank 0"),
            "{err}"
        );
        let err = Topology::from_toml(&node(
            "kv_transfer = { kv_role = \"kv_both\", backend = \"tcp\", side_channel_port = 5600, data_port = 5600 }",
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("port 5600") && err.contains("block server") && err.contains("side channel"), "{err}");
        let two = format!(
            "{}{}",
            node("kv_transfer = { kv_role = \"kv_both\", side_channel_port = 5600 }"),
            "[[nodes]]\nname = \"b\"\nhttp_port = 9001\nbase_port = 7500\nkv_transfer = { kv_role = \"kv_both\", side_channel_port = 5600 }\n"
        );
        let err = Topology::from_toml(&two).unwrap_err().to_string();
        assert!(err.contains("node \"a\" KV side channel") && err.contains("node \"b\" KV side channel"), "{err}");
        Topology::from_toml(&node("kv_transfer = { kv_role = \"kv_both\", side_channel_port = 5600 }")).unwrap();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/topology");
        for f in std::fs::read_dir(&dir).unwrap().flatten() {
            if f.path().extension().is_some_and(|e| e == "toml") {
                Topology::load(&f.path()).unwrap_or_else(|e| panic!("{}: {e}", f.path().display()));
            }
        }
        Topology::default_mesh().unwrap();
    }

    /// deploy/topology/scaleout.toml: a router over 2 P and 2 D nodes on the real model, whose
    /// router lists every P and every D at its own address, and no two listeners of which share
    /// a port (it runs on one machine as is). Fails if a node is added without its URL in the
    /// router, or a port is reused.
    #[test]
    fn scaleout_topology_lists_every_node_and_no_port_twice() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/topology/scaleout.toml");
        let t = Topology::load(&path).unwrap();
        let role = |r: NodeRole| t.nodes.iter().filter(move |n| n.role == r);
        assert_eq!(
            (role(NodeRole::Router).count(), role(NodeRole::Prefill).count(), role(NodeRole::Decode).count()),
            (1, 2, 2)
        );
        let router = role(NodeRole::Router).next().unwrap();
        let urls = |r: NodeRole| -> Vec<String> {
            role(r).map(|n| format!("http://{}:{}", n.http_host, n.http_port)).collect()
        };
        assert_eq!(router.router.prefill, urls(NodeRole::Prefill));
        assert_eq!(router.router.decode, urls(NodeRole::Decode));
        let mut engine_ids = std::collections::BTreeSet::new();
        for n in role(NodeRole::Prefill).chain(role(NodeRole::Decode)) {
            assert_eq!(n.model.kind, ModelKind::Gguf, "{}: the real model", n.name);
            let kv = n.kv_transfer.as_ref().unwrap();
            assert_eq!(kv.backend, TransferBackendKind::Tcp, "{}: tcp, so the file also runs across hosts", n.name);
            assert_eq!(kv.kv_role.produces(), n.role == NodeRole::Prefill, "{}", n.name);
            assert!(engine_ids.insert(kv.engine_id.clone()), "engine id {:?} twice", kv.engine_id);
            for host in [&n.http_host, &n.bind_host, &kv.side_channel_host] {
                assert_eq!(host, "127.0.0.1", "{}: every address defaults to loopback", n.name);
            }
        }
        let mut seen = std::collections::BTreeMap::new();
        for n in &t.nodes {
            for (port, what) in listening_ports(n, &t.run_dir) {
                if let Some(other) = seen.insert(port, what.clone()) {
                    panic!("port {port}: {other} and {what}");
                }
            }
        }
        assert!(seen.len() > 5 * 4, "{seen:?}");
    }

    /// A pool that cannot hold one `max_model_len` request is a start-up error, not a refusal
    /// of that request after admission; without a configured length the pool caps it.
    #[test]
    fn the_pool_must_hold_one_max_model_len_request() {
        let node = |engine: &str| format!("[[nodes]]\nname = \"n\"\nengine = {{ {engine} }}\n");
        let err = Topology::from_toml(&node("block_size = 16, num_blocks = 64, max_model_len = 4096")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("max_model_len 4096") && msg.contains("num_blocks to at least 256"), "{msg}");
        let t = Topology::from_toml(&node("block_size = 16, num_blocks = 256, max_model_len = 4096")).unwrap();
        assert_eq!(t.nodes[0].engine.effective_max_model_len(8192), 4096);
        let t = Topology::from_toml(&node("block_size = 4, num_blocks = 24")).unwrap();
        assert_eq!(t.nodes[0].engine.effective_max_model_len(4096), 96, "cut to the pool");
        assert_eq!(t.nodes[0].engine.effective_max_model_len(50), 50, "never above the model's");
    }

    #[test]
    fn lease_settings_must_be_positive() {
        let t = "[[nodes]]\nname = \"p\"\nkv_transfer = { kv_role = \"kv_producer\", kv_read_lease_s = 0 }\n";
        assert!(Topology::from_toml(t).unwrap_err().to_string().contains("kv_read_lease_s"));
        let t = Topology::from_toml(&t.replace("kv_read_lease_s = 0", "kv_read_lease_s = 3, kv_lease_duration_s = 7"))
            .unwrap();
        let kv = t.nodes[0].kv_transfer.as_ref().unwrap();
        assert_eq!((kv.read_lease().as_secs(), kv.heartbeat_extension().as_secs()), (3, 7));
    }

    #[test]
    fn overload_limits_have_defaults_and_are_checked() {
        let t = Topology::from_toml("[[nodes]]\nname = \"a\"\n").unwrap();
        let n = &t.nodes[0];
        assert_eq!((n.limits.max_in_flight, n.limits.dp_lb_max_in_flight, n.limits.retry_after_s), (256, 512, 1));
        assert_eq!(n.limits.max_in_flight_per_key, 0, "no per-key bound unless asked for");
        assert_eq!((n.engine.max_waiting, n.engine.max_held_fraction), (256, 0.5));
        let t = Topology::from_toml(
            "[[nodes]]\nname = \"a\"\nlimits = { max_in_flight = 3, retry_after_s = 7 }\nengine = { max_waiting = 0 }\n",
        )
        .unwrap();
        assert_eq!((t.nodes[0].limits.max_in_flight, t.nodes[0].limits.retry_after_s), (3, 7));
        assert_eq!(t.nodes[0].engine.max_waiting, 0);
        let t = Topology::from_toml("[[nodes]]\nname = \"a\"\nlimits = { max_in_flight_per_key = 2 }\n").unwrap();
        assert_eq!((t.nodes[0].limits.max_in_flight_per_key, t.nodes[0].limits.max_in_flight), (2, 256));
        for bad in [
            "engine = { max_held_fraction = 0.0 }",
            "engine = { max_held_fraction = 1.5 }",
            "limits = { output_buffer = 0 }",
            "limits = { nope = 1 }",
        ] {
            assert!(Topology::from_toml(&format!("[[nodes]]\nname = \"a\"\n{bad}\n")).is_err(), "{bad}");
        }
    }

    #[test]
    fn tcp_endpoints_follow_base_port() {
        let t = Topology::from_toml(
            r#"
            [[nodes]]
            name = "p"
            transport = "tcp"
            bind_host = "0.0.0.0"
            base_port = 9000
            dp_size = 2
            hosts = { dp_lb = "p-lb", connector_worker = "p-worker-{rank}" }
            "#,
        )
        .unwrap();
        let e = t.nodes[0].endpoints(&t.run_dir);
        assert_eq!(e.dplb_engines.bind, "tcp://0.0.0.0:9001");
        assert_eq!(e.dplb_engines.connect, "tcp://p-lb:9001");
        assert_eq!(e.connector_worker[1].connect, "tcp://p-worker-1:9013");
    }

    #[test]
    fn give_up_notices_default_on_and_can_be_switched_off() {
        let t = Topology::default_mesh().unwrap();
        assert!(t.nodes.iter().all(|n| n.router.give_up_notices));
        assert!(t.nodes.iter().filter_map(|n| n.kv_transfer.as_ref()).all(|k| k.give_up_notices));
        let t = Topology::from_toml(
            r#"
            [[nodes]]
            name = "r"
            role = "router"
            router = { prefill = ["http://p"], decode = ["http://d"], give_up_notices = false }
            [[nodes]]
            name = "d"
            http_port = 8001
            kv_transfer = { kv_role = "kv_consumer", give_up_notices = false }
            "#,
        )
        .unwrap();
        assert!(!t.nodes[0].router.give_up_notices);
        assert!(!t.nodes[1].kv_transfer.as_ref().unwrap().give_up_notices);
    }

    #[test]
    fn give_up_notices_env_override_reaches_every_node() {
        // The only test of this binary that touches the environment.
        std::env::set_var(env::GIVE_UP_NOTICES, "false");
        let mut t = Topology::default_mesh().unwrap();
        let applied = t.apply_env();
        std::env::set_var(env::GIVE_UP_NOTICES, "maybe");
        let refused = Topology::default_mesh().unwrap().apply_env();
        std::env::remove_var(env::GIVE_UP_NOTICES);
        applied.unwrap();
        assert!(t.nodes.iter().all(|n| !n.router.give_up_notices));
        assert!(t.nodes.iter().filter_map(|n| n.kv_transfer.as_ref()).all(|k| !k.give_up_notices));
        assert!(refused.is_err(), "a typo is an error, never a silent default");
    }

    /// What a tensor-parallel node needs is checked at load, naming the setting (D111); P/D
    /// with TP is allowed (a rank's TP processes share one KV cache).
    #[test]
    fn tensor_parallel_nodes_refuse_what_they_cannot_split() {
        let node = |extra: &str| format!("[[nodes]]\nname = \"c\"\ntensor_parallel_size = 2\n{extra}");
        let err = |extra: &str| Topology::from_toml(&node(extra)).unwrap_err().to_string();
        let gguf = "model = { kind = \"gguf\" }\n";
        assert!(Topology::from_toml(&node(gguf)).is_ok());
        assert!(Topology::from_toml(&node(&format!("{gguf}kv_transfer = {{ kv_role = \"kv_producer\" }}"))).is_ok());
        assert!(err("").contains("GGUF"), "{}", err(""));
        let cuda = err("model = { kind = \"gguf\", device = \"cuda\" }");
        assert!(cuda.contains("tensor_parallel_size 2") && cuda.contains("cuda"), "{cuda}");
        let offload = err(&format!("{gguf}kv_transfer = {{ kv_role = \"kv_both\", kv_connector = \"OffloadConnector\", offload = {{ cpu_blocks = 8 }} }}"));
        assert!(offload.contains("OffloadConnector"), "{offload}");
        let faults = err("model = { kind = \"gguf\", fault_injection = \"step_error_every=3\" }");
        assert!(faults.contains("model.fault_injection"), "{faults}");
        let zero = Topology::from_toml("[[nodes]]\nname = \"c\"\ntensor_parallel_size = 0").unwrap_err().to_string();
        assert!(zero.contains("1..=16"), "{zero}");
        let t = Topology::from_toml(&node(gguf)).unwrap();
        assert!(!t.nodes[0].steps_run_ahead(), "a TP node does not run steps ahead");
    }

    #[test]
    fn model_threads_nice_below_the_serving_processes_by_default() {
        let node = |extra: &str| format!("[[nodes]]\nname = \"c\"\nmodel = {{ kind = \"gguf\"{extra} }}");
        assert_eq!(Topology::from_toml(&node("")).unwrap().nodes[0].model.cpu_nice, 10);
        assert_eq!(Topology::from_toml(&node(", cpu_nice = 0")).unwrap().nodes[0].model.cpu_nice, 0);
        assert_eq!(Topology::from_toml(&node(", cpu_nice = 19")).unwrap().nodes[0].model.cpu_nice, 19);
        let e = Topology::from_toml(&node(", cpu_nice = 20")).unwrap_err().to_string();
        assert!(e.contains("model.cpu_nice = 20"), "{e}");
        assert!(Topology::from_toml(&node(", cpu_nice = -5")).is_err(), "raising a priority is not ours to ask");
    }

    #[test]
    fn cuda_backend_needs_a_gpu_model() {
        let node = |device: &str| {
            format!(
                "[[nodes]]\nname = \"p\"\nmodel = {{ kind = \"gguf\", device = \"{device}\" }}\n\
                 kv_transfer = {{ kv_role = \"kv_producer\", backend = \"cuda\" }}"
            )
        };
        let t = Topology::from_toml(&node("cuda:1")).unwrap();
        assert_eq!(t.nodes[0].kv_transfer.as_ref().unwrap().backend, TransferBackendKind::Cuda);
        let e = Topology::from_toml(&node("cpu")).unwrap_err().to_string();
        assert!(e.contains("model.device = \"cuda\""), "{e}");
        let synthetic = "[[nodes]]\nname = \"p\"\nkv_transfer = { kv_role = \"kv_producer\", backend = \"cuda\" }";
        assert!(Topology::from_toml(synthetic).is_err(), "the synthetic executor has no GPU cache");
        assert_eq!(TransferBackendKind::parse("cuda"), Some(TransferBackendKind::Cuda));
        assert_eq!(TransferBackendKind::parse("gpu"), None);
    }

    #[test]
    fn bad_topologies_are_refused() {
        assert!(Topology::from_toml("nodes = []").is_err());
        assert!(Topology::from_toml("[[nodes]]\nname = \"a\"\ndp_size = 0").is_err());
        assert!(Topology::from_toml("[[nodes]]\nname = \"a\"\n[[nodes]]\nname = \"a\"\nhttp_port = 1").is_err());
        assert!(Topology::from_toml("[[nodes]]\nname = \"a\"\nbogus = 1").is_err());
        assert!(Topology::from_toml("[[nodes]]\nname = \"r\"\nrole = \"router\"").is_err());
    }

    #[test]
    fn connectors_are_parsed_in_order_and_bad_lists_are_refused() {
        let node = |kv: &str| format!("[[nodes]]\nname = \"n\"\nkv_transfer = {{ kv_role = \"kv_both\", {kv} }}\n");
        let t = Topology::from_toml(&node(
            "kv_connector = \"MultiConnector\", kv_connector_children = [\"PdConnector\", \"OffloadConnector\"], offload = { cpu_blocks = 8 }",
        ))
        .unwrap();
        let kv = t.nodes[0].kv_transfer.as_ref().unwrap();
        assert_eq!(kv.connectors().unwrap(), vec![ConnectorKind::Pd, ConnectorKind::Offload]);
        assert!(kv.uses_pd() && kv.uses_offload());
        assert_eq!(kv.offload.cpu_blocks, 8);
        let t = Topology::from_toml(&node("kv_connector = \"OffloadConnector\"")).unwrap();
        let kv = t.nodes[0].kv_transfer.as_ref().unwrap();
        assert!(!kv.uses_pd() && kv.uses_offload());
        assert_eq!(kv.offload.cpu_blocks, 1024, "default");
        // the default stays the P/D connector
        assert!(Topology::from_toml(&node("engine_id = \"x\"")).unwrap().nodes[0]
            .kv_transfer
            .as_ref()
            .unwrap()
            .uses_pd());
        for (bad, why) in [
            ("kv_connector = \"MultiConnector\"", "needs kv_connector_children"),
            ("kv_connector = \"MultiConnector\", kv_connector_children = [\"PdConnector\", \"PdConnector\"]", "twice"),
            ("kv_connector = \"MultiConnector\", kv_connector_children = [\"LMCache\"]", "unknown connector"),
            ("kv_connector = \"Nixl\"", "unknown connector"),
            ("kv_connector_children = [\"OffloadConnector\"]", "is for kv_connector = \"MultiConnector\""),
            ("kv_connector = \"OffloadConnector\", offload = { cpu_blocks = 0 }", "cpu_blocks"),
            ("kv_connector = \"OffloadConnector\", offload = { cpu_bytes = 1 }", "unknown field"),
        ] {
            let err = Topology::from_toml(&node(bad)).unwrap_err().to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn a_routers_slow_node_settings_default_and_refuse_what_cannot_work() {
        let router = |extra: &str| {
            Topology::from_toml(&format!(
                "[[nodes]]\nname = \"r\"\nrole = \"router\"\nrouter = {{ prefill = [\"http://p\"], decode = [\"http://d\"]{extra} }}\n"
            ))
        };
        let r = router("").unwrap().nodes[0].router.clone();
        assert_eq!((r.slow_ratio, r.slow_probe_ms, r.slow_migrate_ratio, r.slow_migrate_tokens), (3.0, 1000, 3.0, 8));
        let off =
            router(", slow_ratio = 0, slow_probe_ms = 0, slow_migrate_ratio = 0").unwrap().nodes[0].router.clone();
        assert_eq!((off.slow_ratio, off.slow_probe_ms, off.slow_migrate_ratio), (0.0, 0, 0.0));
        for (bad, key) in [
            (", slow_ratio = 1.2", "router.slow_ratio"),
            (", slow_ratio = -3.0", "router.slow_ratio"),
            (", slow_ratio = inf", "router.slow_ratio"),
            (", slow_migrate_ratio = 1.0", "router.slow_migrate_ratio"),
            (", slow_probe_ms = 20", "router.slow_probe_ms"),
            (", slow_migrate_tokens = 0", "router.slow_migrate_tokens"),
        ] {
            let err = router(bad).unwrap_err().to_string();
            assert!(err.contains(key), "{bad}: {err}");
        }
    }

    #[test]
    fn a_router_names_its_upstreams_by_url_or_by_a_dns_name() {
        let router = |table: &str| {
            Topology::from_toml(&format!("[[nodes]]\nname = \"r\"\nrole = \"router\"\nrouter = {{ {table} }}\n"))
        };
        let t = router(
            "prefill_dns = \"pdmesh-prefill.pdmesh.svc.cluster.local:8000\", decode = [\"http://d:8000\"], decode_dns = \"[::1]:8000\"",
        )
        .unwrap();
        let r = &t.nodes[0].router;
        assert_eq!(r.prefill_dns.as_deref(), Some("pdmesh-prefill.pdmesh.svc.cluster.local:8000"));
        assert_eq!(r.dns_refresh_ms, 5000, "default");
        assert!(Topology::from_toml(&t.to_toml().unwrap()).is_ok(), "written back as it was read");
        for (bad, why) in [
            ("prefill_dns = \"p:8000\"", "needs decode upstreams: router.decode (URLs) or router.decode_dns"),
            (
                "prefill_dns = \"http://p:8000\", decode_dns = \"d:1\"",
                "router.prefill_dns = \"http://p:8000\": must be host:port",
            ),
            ("prefill_dns = \"p\", decode_dns = \"d:1\"", "router.prefill_dns = \"p\": must be host:port"),
            ("prefill_dns = \"p:0\", decode_dns = \"d:1\"", "\"0\" is not a port"),
            (
                "prefill_dns = \"p:1\", decode_dns = \"d d:1\"",
                "router.decode_dns = \"d d:1\": \"d d\" is not a host name",
            ),
            ("prefill_dns = \"p:1\", decode_dns = \"d:1\", dns_refresh_ms = 10", "router.dns_refresh_ms = 10"),
            ("prefill = [\"http://p\"]", "needs decode upstreams"),
        ] {
            let err = router(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }
}
