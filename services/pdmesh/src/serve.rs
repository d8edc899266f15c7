//! `pdmesh serve` and `pdmesh proxy`: vLLM's operator vocabulary (D52).
//!
//! `pdmesh serve MODEL_PATH [vLLM flags]` starts one node — frontend, dp-lb and per rank an
//! engine-core, a connector-scheduler and a connector-worker — from the flags of `vllm serve`
//! where the concept exists here. It builds a one-node topology in memory and hands it to the
//! supervisor of `pdmesh up` ([`crate::up::run_launch`]): same children, logs, restarts and
//! shutdown. `pdmesh proxy` starts a router from the flags of vLLM's P/D proxy
//! (`--prefiller-hosts/--prefiller-ports/--decoder-hosts/--decoder-ports`) or from the router
//! node of a topology.
//!
//! Strict by design: a vLLM flag without a meaning here is refused by name (exit status 2, as
//! clap refuses any unknown argument), never silently accepted; docs/CONFIG.md ("vLLM flags")
//! maps every accepted flag to its topology setting.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use pdmesh_config::{
    env, KvLoadFailurePolicy, KvRole, KvTransferConfig, ModelKind, NodeRole, Topology, TransferBackendKind,
};
use serde::Deserialize;
use serde_json::Value;

use crate::up::Launch;
use crate::{ApiKeyArgs, Misconfigured};

/// vLLM's side-channel host of the NIXL connector (the address peers reach this node at).
pub const VLLM_SIDE_CHANNEL_HOST: &str = "VLLM_NIXL_SIDE_CHANNEL_HOST";
/// vLLM's side-channel port of the NIXL connector (rank r uses `port + r`).
pub const VLLM_SIDE_CHANNEL_PORT: &str = "VLLM_NIXL_SIDE_CHANNEL_PORT";
/// vLLM's API key variable, read when `--api-key` and `PDMESH_API_KEY` are unset.
pub const VLLM_API_KEY: &str = "VLLM_API_KEY";

/// `pdmesh serve`: the flags of `vllm serve` that have a meaning here, and two of pdmesh's own.
#[derive(Args, Clone)]
pub struct ServeArgs {
    /// The model: a GGUF file (`vllm serve`'s positional MODEL).
    #[arg(value_name = "MODEL_PATH")]
    model_tag: Option<String>,
    /// The model, as a flag (vLLM's `--model`); the same as the positional MODEL_PATH.
    #[arg(long)]
    model: Option<String>,
    /// Address the OpenAI server binds (vLLM binds every interface by default; pdmesh binds
    /// loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port of the OpenAI server.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[command(flatten)]
    keys: ApiKeyArgs,
    /// The model name in the API (`model` field and /v1/models); default: from the model.
    /// vLLM takes several aliases; pdmesh serves one name.
    #[arg(long, num_args = 1..)]
    served_model_name: Vec<String>,
    /// A Jinja chat template file replacing the model file's own (`model.chat_template`): for
    /// a model whose file has none, or to fix one.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Longest prompt + output (`engine.max_model_len`).
    #[arg(long)]
    max_model_len: Option<u32>,
    /// Requests in one step (`engine.max_num_seqs`).
    #[arg(long)]
    max_num_seqs: Option<u32>,
    /// Token budget of one step (`engine.max_num_batched_tokens`).
    #[arg(long)]
    max_num_batched_tokens: Option<u32>,
    /// Tokens per KV block (`engine.block_size`).
    #[arg(long)]
    block_size: Option<u32>,
    /// KV blocks per rank (`engine.num_blocks`).
    #[arg(long)]
    num_gpu_blocks_override: Option<u32>,
    /// Engine ranks behind the node's load balancer (`dp_size`).
    #[arg(long)]
    data_parallel_size: Option<u32>,
    /// Worker processes per engine rank, each computing a slice of every layer
    /// (`tensor_parallel_size`, D111).
    #[arg(long)]
    tensor_parallel_size: Option<u32>,
    /// vLLM's KV transfer configuration, as JSON: `kv_connector` (`NixlConnector` or
    /// `PdmeshConnector`), `kv_role`, `engine_id`, `kv_load_failure_policy`,
    /// `kv_connector_extra_config` (`backend`, `side_channel_host`, `side_channel_port`,
    /// `data_port`). Absent: a colocated node.
    #[arg(long)]
    kv_transfer_config: Option<String>,
    /// pdmesh: first of the node's internal ports (its services' /metrics ports lie at
    /// +100..+300). Default: derived from --port, so nodes on different ports do not clash.
    #[arg(long)]
    base_port: Option<u16>,
    /// pdmesh: report children that die but do not restart them.
    #[arg(long)]
    no_restart: bool,
}

/// `pdmesh proxy`: vLLM's P/D proxy flags, or a topology's router node.
#[derive(Args, Clone)]
pub struct ProxyArgs {
    /// Address the proxy binds.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port of the proxy.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Hosts of the prefill nodes (`pdmesh serve` with kv_role kv_producer or kv_both).
    #[arg(long, alias = "prefiller-host", num_args = 1..)]
    prefiller_hosts: Vec<String>,
    /// Ports of the prefill nodes, one per host.
    #[arg(long, alias = "prefiller-port", num_args = 1..)]
    prefiller_ports: Vec<u16>,
    /// Hosts of the decode nodes.
    #[arg(long, alias = "decoder-host", num_args = 1..)]
    decoder_hosts: Vec<String>,
    /// Ports of the decode nodes, one per host.
    #[arg(long, alias = "decoder-port", num_args = 1..)]
    decoder_ports: Vec<u16>,
    /// Instead of the flags above: run the router node of this topology.
    #[arg(long, env = env::TOPOLOGY, conflicts_with_all = ["prefiller_hosts", "prefiller_ports", "decoder_hosts", "decoder_ports"])]
    topology: Option<PathBuf>,
    /// With --topology: which router node (default: its only one).
    #[arg(long, requires = "topology")]
    node: Option<String>,
    #[command(flatten)]
    keys: ApiKeyArgs,
    /// pdmesh: report a proxy that dies but do not restart it.
    #[arg(long)]
    no_restart: bool,
}

/// vLLM's `--kv-transfer-config`, the keys that have a meaning here. Any other key is refused
/// by name (`deny_unknown_fields`): `kv_buffer_device`, `kv_ip`, `kv_port`… configure
/// connectors pdmesh does not have.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VllmKvTransferConfig {
    kv_connector: Option<String>,
    kv_role: Option<KvRole>,
    engine_id: Option<String>,
    kv_load_failure_policy: Option<KvLoadFailurePolicy>,
    #[serde(default)]
    kv_connector_extra_config: serde_json::Map<String, Value>,
}

/// A usage error of `serve`/`proxy`: reported as a configuration error (exit 78).
fn misconfigured(flag: &str, why: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{why}").context(Misconfigured(format!("pdmesh: {flag}")))
}

/// The default base port of a served node: a 400-port window per `--port` modulo 50, below
/// Linux's ephemeral ports, so that nodes served on one host on nearby ports never share one.
fn default_base_port(http_port: u16) -> u16 {
    10_000 + (http_port % 50) * 400
}

/// The node's KV transfer settings from vLLM's JSON and the NIXL side-channel variables.
/// `side_env`: (`VLLM_NIXL_SIDE_CHANNEL_HOST`, `VLLM_NIXL_SIDE_CHANNEL_PORT`).
fn kv_transfer_from_json(
    text: &str,
    side_env: (Option<String>, Option<String>),
) -> anyhow::Result<(KvTransferConfig, NodeRole)> {
    let flag = "--kv-transfer-config";
    let vllm: VllmKvTransferConfig =
        serde_json::from_str(text).map_err(|e| misconfigured(flag, format!("not a valid KV transfer config: {e}")))?;
    match vllm.kv_connector.as_deref() {
        Some("NixlConnector" | "PdmeshConnector" | "PdConnector") => {}
        Some(other) => {
            return Err(misconfigured(
                flag,
                format!(
                    "kv_connector {other:?} is not supported (pdmesh has \"NixlConnector\", its own transfer agent, \
                     also named \"PdmeshConnector\")"
                ),
            ))
        }
        None => return Err(misconfigured(flag, "kv_connector is required (\"NixlConnector\" or \"PdmeshConnector\")")),
    }
    let Some(role) = vllm.kv_role else {
        return Err(misconfigured(flag, "kv_role is required (\"kv_producer\", \"kv_consumer\" or \"kv_both\")"));
    };
    let mut kv: KvTransferConfig = serde_json::from_value(serde_json::json!({ "kv_role": role }))
        .map_err(|e| misconfigured(flag, format!("kv_role: {e}")))?;
    if let Some(id) = vllm.engine_id.filter(|id| !id.is_empty()) {
        kv.engine_id = id;
    }
    if let Some(policy) = vllm.kv_load_failure_policy {
        kv.kv_load_failure_policy = policy;
    }
    let (env_host, env_port) = side_env;
    if let Some(host) = env_host.filter(|h| !h.is_empty()) {
        kv.side_channel_host = host;
    }
    if let Some(port) = env_port.filter(|p| !p.is_empty()) {
        kv.side_channel_port =
            port.parse().map_err(|_| misconfigured(VLLM_SIDE_CHANNEL_PORT, format!("{port:?} is not a port")))?;
    }
    for (key, value) in &vllm.kv_connector_extra_config {
        // A key's value is read only in its own arm: an unknown key is named as such before its
        // value is looked at (vLLM's keys for other transfer engines, `backends`, ..., are
        // lists, and "not supported" is the useful answer).
        let text = || match value {
            Value::String(s) => Ok(s.clone()),
            Value::Number(n) => Ok(n.to_string()),
            other => {
                Err(misconfigured(flag, format!("kv_connector_extra_config.{key}: {other} is not a string or number")))
            }
        };
        let port = || {
            let text = text()?;
            text.parse::<u16>()
                .map_err(|_| misconfigured(flag, format!("kv_connector_extra_config.{key}: {text:?} is not a port")))
        };
        match key.as_str() {
            "backend" => {
                let text = text()?;
                kv.backend = TransferBackendKind::parse(&text).ok_or_else(|| {
                    misconfigured(
                        flag,
                        format!("kv_connector_extra_config.backend {text:?}: expected \"shm\", \"tcp\" or \"cuda\""),
                    )
                })?
            }
            "side_channel_host" => kv.side_channel_host = text()?,
            "side_channel_port" => kv.side_channel_port = port()?,
            "data_port" => kv.data_port = port()?,
            other => {
                return Err(misconfigured(
                    flag,
                    format!(
                        "kv_connector_extra_config key {other:?} is not supported (pdmesh reads \"backend\", \
                         \"side_channel_host\", \"side_channel_port\" and \"data_port\")"
                    ),
                ))
            }
        }
    }
    let node_role = match role {
        KvRole::KvProducer => NodeRole::Prefill,
        KvRole::KvConsumer => NodeRole::Decode,
        KvRole::KvBoth => NodeRole::Colocated,
    };
    Ok((kv, node_role))
}

/// The one-node topology `pdmesh serve` runs. `env_of` reads a variable (the process
/// environment, or a test's).
fn serve_topology(args: &ServeArgs, env_of: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<Topology> {
    let model = match (&args.model_tag, &args.model) {
        (Some(a), Some(b)) if a != b => {
            return Err(misconfigured("--model", format!("two models given: {a:?} and --model {b:?}")))
        }
        (Some(m), _) | (None, Some(m)) => m.clone(),
        (None, None) => {
            return Err(misconfigured("MODEL_PATH", "no model: `pdmesh serve MODEL_PATH` or `--model MODEL_PATH`"))
        }
    };
    if !std::path::Path::new(&model).is_file() {
        return Err(misconfigured(
            "MODEL_PATH",
            format!("{model:?} is not a file: pdmesh serves a local GGUF file (it does not download models)"),
        ));
    }
    if args.served_model_name.len() > 1 {
        return Err(misconfigured(
            "--served-model-name",
            format!("{} names given: pdmesh serves a model under one name", args.served_model_name.len()),
        ));
    }
    let name = format!("serve-{}", args.port);
    let mut topo = Topology::from_toml(&format!("[[nodes]]\nname = {name:?}\n"))?;
    let node = &mut topo.nodes[0];
    node.http_host = args.host.clone();
    // An address given to --host is bound by the node's other sockets too (its side channel and
    // block server): a node that serves HTTP on every interface of a pod must also be reachable
    // by its peers there (D61). A host name keeps the default loopback.
    if args.host.parse::<std::net::IpAddr>().is_ok() {
        node.bind_host = args.host.clone();
    }
    node.http_port = args.port;
    node.base_port = args.base_port.unwrap_or_else(|| default_base_port(args.port));
    node.model.kind = ModelKind::Gguf;
    node.model.path = model;
    node.model.name = args.served_model_name.first().cloned().unwrap_or_default();
    if let Some(file) = &args.chat_template {
        // absolute, so that the node's processes read it wherever they run
        let path = std::fs::canonicalize(file).map_err(|e| {
            misconfigured("--chat-template", format!("{}: {e} (a Jinja chat template file)", file.display()))
        })?;
        node.model.chat_template = path.to_string_lossy().into_owned();
    }
    if let Some(dp) = args.data_parallel_size {
        node.dp_size = dp;
    }
    if let Some(tp) = args.tensor_parallel_size {
        node.tensor_parallel_size = tp;
    }
    let e = &mut node.engine;
    e.max_model_len = args.max_model_len.unwrap_or(e.max_model_len);
    e.max_num_seqs = args.max_num_seqs.unwrap_or(e.max_num_seqs);
    e.max_num_batched_tokens = args.max_num_batched_tokens.unwrap_or(e.max_num_batched_tokens);
    e.block_size = args.block_size.unwrap_or(e.block_size);
    e.num_blocks = args.num_gpu_blocks_override.unwrap_or(e.num_blocks);
    if let Some(text) = &args.kv_transfer_config {
        let (kv, role) = kv_transfer_from_json(text, (env_of(VLLM_SIDE_CHANNEL_HOST), env_of(VLLM_SIDE_CHANNEL_PORT)))?;
        node.role = role;
        node.kv_transfer = Some(kv);
    }
    topo.validate().context(Misconfigured("pdmesh serve: the flags make an invalid node".into()))?;
    Ok(topo)
}

/// A P/D node started on its own shares secrets with its peers that it cannot make up: the
/// mesh secret (D40: P and D refuse each other's handshakes otherwise) and, with client API
/// keys, the internal key the proxy presents (D39). `pdmesh up` of a whole mesh generates both;
/// `pdmesh serve` and `pdmesh proxy` start one node and must be given them.
fn check_shared(pd: bool, router: bool, secret_given: bool, keys: &ApiKeyArgs) -> anyhow::Result<()> {
    if pd && !secret_given {
        return Err(misconfigured(
            "--kv-transfer-config",
            format!(
                "a P/D node started on its own must share one mesh secret with its peers: set {} to the same \
                 secret (at least 32 characters, e.g. `openssl rand -hex 32`) for every `pdmesh serve` of the mesh",
                env::MESH_SECRET
            ),
        ));
    }
    let settings = keys.resolve().context(Misconfigured("API keys".into()))?;
    if (pd || router) && !settings.client.is_empty() && settings.internal.is_none() {
        return Err(misconfigured(
            "--api-key",
            format!(
                "with client API keys, the proxy and the P/D nodes started apart must share one internal key: \
                 set {} to the same key for every `pdmesh serve` and `pdmesh proxy` of the mesh",
                env::INTERNAL_API_KEY
            ),
        ));
    }
    Ok(())
}

/// `--api-key` falls back to vLLM's `VLLM_API_KEY` when neither it nor `PDMESH_API_KEY` is set.
fn with_vllm_api_key(mut keys: ApiKeyArgs) -> ApiKeyArgs {
    if keys.api_key.as_deref().is_none_or(str::is_empty) {
        if let Some(k) = env::get(VLLM_API_KEY) {
            keys.api_key = Some(k);
        }
    }
    keys
}

pub fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let topo = serve_topology(&args, &env::get)?;
    let keys = with_vllm_api_key(args.keys.clone());
    let pd = topo.nodes[0].kv_transfer.is_some();
    let secret = pdmesh_mesh_auth::MeshSecret::resolve(None)?.is_some();
    check_shared(pd, false, secret, &keys)?;
    let text = topo.to_toml()?;
    let suffix = format!(".{}", topo.nodes[0].name);
    crate::up::run_launch(Launch {
        topo,
        text,
        nodes: Vec::new(),
        file_suffix: Some(suffix),
        keys,
        no_restart: args.no_restart,
        shutdown_timeout_s: None,
    })
}

/// `--X-hosts` with `--X-ports`, paired in order: `http://host:port` each. One host with several
/// ports (or one port with several hosts) repeats it, as vLLM's proxy defaults to `localhost`.
fn upstreams(kind: &str, hosts: &[String], ports: &[u16]) -> anyhow::Result<Vec<String>> {
    let flag = format!("--{kind}-ports");
    if ports.is_empty() {
        return Err(misconfigured(&flag, format!("no {kind} given: --{kind}-hosts H… --{kind}-ports P…")));
    }
    let hosts: Vec<String> = match hosts.len() {
        0 => vec!["localhost".to_string(); ports.len()],
        1 => vec![hosts[0].clone(); ports.len()],
        n if n == ports.len() => hosts.to_vec(),
        n => {
            return Err(misconfigured(
                &flag,
                format!("{n} --{kind}-hosts and {} --{kind}-ports: give one port per host", ports.len()),
            ))
        }
    };
    Ok(hosts.iter().zip(ports).map(|(h, p)| format!("http://{h}:{p}")).collect())
}

/// The topology and node `pdmesh proxy` runs: a router node from vLLM's proxy flags, or the
/// router node of `--topology`.
fn proxy_launch(args: &ProxyArgs) -> anyhow::Result<(Topology, String, Vec<String>, Option<String>)> {
    if let Some(path) = &args.topology {
        let topo = Topology::load(path)?;
        let routers: Vec<&str> =
            topo.nodes.iter().filter(|n| n.role == NodeRole::Router).map(|n| n.name.as_str()).collect();
        let node = match (&args.node, routers.as_slice()) {
            (Some(n), _) if routers.contains(&n.as_str()) => n.clone(),
            (Some(n), _) => {
                return Err(misconfigured(
                    "--node",
                    format!("{n:?} is not a router node of {} (its routers: {})", path.display(), routers.join(", ")),
                ))
            }
            (None, [one]) => one.to_string(),
            (None, _) => {
                return Err(misconfigured(
                    "--topology",
                    format!("{} has {} router nodes: name one with --node", path.display(), routers.len()),
                ))
            }
        };
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        return Ok((topo, text, vec![node], None));
    }
    let prefill = upstreams("prefiller", &args.prefiller_hosts, &args.prefiller_ports)?;
    let decode = upstreams("decoder", &args.decoder_hosts, &args.decoder_ports)?;
    let name = format!("proxy-{}", args.port);
    let mut topo = Topology::from_toml(&format!(
        "[[nodes]]\nname = {name:?}\nrole = \"router\"\nrouter = {{ prefill = [\"x\"], decode = [\"x\"] }}\n"
    ))?;
    let node = &mut topo.nodes[0];
    node.http_host = args.host.clone();
    node.http_port = args.port;
    node.router.prefill = prefill;
    node.router.decode = decode;
    topo.validate()?;
    let text = topo.to_toml()?;
    Ok((topo, text, Vec::new(), Some(format!(".{name}"))))
}

pub fn run_proxy(args: ProxyArgs) -> anyhow::Result<()> {
    let (topo, text, nodes, file_suffix) = proxy_launch(&args)?;
    let keys = with_vllm_api_key(args.keys.clone());
    check_shared(false, true, true, &keys)?;
    crate::up::run_launch(Launch {
        topo,
        text,
        nodes,
        file_suffix,
        keys,
        no_restart: args.no_restart,
        shutdown_timeout_s: None,
    })
}

/// vLLM's parser takes `--max_model_len` for `--max-model-len`: the flags of `serve` and
/// `proxy` are normalised the same way (dashes in the name, the value untouched).
pub fn normalise_vllm_flags(args: Vec<String>) -> Vec<String> {
    let sub = args.get(1).map(String::as_str);
    if !matches!(sub, Some("serve" | "proxy")) {
        return args;
    }
    args.into_iter()
        .enumerate()
        .map(|(i, a)| {
            // vLLM's one short flag pdmesh honours
            if i >= 2 && a == "-tp" {
                return "--tensor-parallel-size".to_string();
            }
            if i < 2 || !a.starts_with("--") {
                return a;
            }
            match a.split_once('=') {
                Some((name, value)) => format!("{}={value}", name.replace('_', "-")),
                None => a.replace('_', "-"),
            }
        })
        .collect()
}

/// The refusal of an argument `serve`/`proxy` does not know: vLLM has many flags without a
/// meaning here, and silence would let an operator believe one took effect.
pub fn unsupported_flag_message(subcommand: &str, flag: &str) -> String {
    format!(
        "error: pdmesh {subcommand}: {flag} is not supported (it is not a vLLM flag pdmesh honours; the flags it \
         accepts are listed in docs/CONFIG.md, \"vLLM flags\", and by `pdmesh {subcommand} --help`)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    fn parse(args: &[&str]) -> Result<ServeArgs, clap::Error> {
        let argv: Vec<String> = ["pdmesh", "serve"].iter().chain(args).map(|s| s.to_string()).collect();
        match crate::Cli::try_parse_from(normalise_vllm_flags(argv))?.command {
            crate::Command::Serve(a) => Ok(a),
            _ => panic!("not serve"),
        }
    }

    #[test]
    fn vllm_s_short_tensor_parallel_flag_is_taken() {
        let (_dir, model) = model_file();
        let args = parse(&[&model, "-tp", "2"]).unwrap();
        let env = |_: &str| None;
        assert_eq!(serve_topology(&args, &env).unwrap().nodes[0].tensor_parallel_size, 2);
    }

    fn model_file() -> (tempdir::Dir, String) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("m.gguf");
        std::fs::write(&path, b"GGUF").unwrap();
        let p = path.display().to_string();
        (dir, p)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "pdmesh-serve-unit-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::SeqCst)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    /// Every accepted vLLM flag lands in its topology setting, underscores or dashes alike.
    #[test]
    fn vllm_flags_map_to_the_node() {
        let (_d, model) = model_file();
        let args = parse(&[
            &model,
            "--port",
            "8123",
            "--host=0.0.0.0",
            "--served-model-name",
            "smol",
            "--max_model_len",
            "1024",
            "--max-num-seqs=7",
            "--max-num-batched-tokens",
            "512",
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "64",
            "--data-parallel-size",
            "2",
            "--tensor-parallel-size",
            "1",
            "--kv-transfer-config",
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"backend":"tcp","side_channel_port":5900,"data_port":"5950"}}"#,
        ])
        .unwrap();
        let env = |k: &str| (k == VLLM_SIDE_CHANNEL_HOST).then(|| "10.0.0.7".to_string());
        let topo = serve_topology(&args, &env).unwrap();
        let n = &topo.nodes[0];
        assert_eq!((n.name.as_str(), n.http_host.as_str(), n.http_port), ("serve-8123", "0.0.0.0", 8123));
        assert_eq!(n.bind_host, "0.0.0.0", "the side channel and block server are reachable from other hosts");
        assert_eq!(
            (n.model.kind, n.model.path.as_str(), n.model.name.as_str()),
            (ModelKind::Gguf, model.as_str(), "smol")
        );
        let e = &n.engine;
        assert_eq!(
            (e.max_model_len, e.max_num_seqs, e.max_num_batched_tokens, e.block_size, e.num_blocks),
            (1024, 7, 512, 32, 64)
        );
        assert_eq!((n.dp_size, n.tensor_parallel_size), (2, 1));
        assert_eq!(n.role, NodeRole::Decode);
        let kv = n.kv_transfer.as_ref().unwrap();
        assert_eq!(kv.kv_role, KvRole::KvConsumer);
        assert_eq!(kv.kv_load_failure_policy, KvLoadFailurePolicy::Recompute);
        assert_eq!(kv.backend, TransferBackendKind::Tcp);
        assert_eq!((kv.side_channel_host.as_str(), kv.side_channel_port, kv.data_port), ("10.0.0.7", 5900, 5950));
        let back = Topology::from_toml(&topo.to_toml().unwrap()).unwrap();
        assert_eq!(back.nodes[0].engine.num_blocks, 64, "the children read the same node back");
    }

    /// `--chat-template FILE` becomes the node's `model.chat_template`, as an absolute path the
    /// children read back; a file that is not there is a configuration error naming the flag.
    #[test]
    fn chat_template_flag_sets_the_nodes_template() {
        let (d, model) = model_file();
        let template = d.0.join("chatml.jinja");
        std::fs::write(&template, "{{ messages[0].content }}").unwrap();
        let args = parse(&[&model, "--chat-template", &template.display().to_string()]).unwrap();
        let topo = serve_topology(&args, &no_env).unwrap();
        let set = &topo.nodes[0].model.chat_template;
        assert_eq!(std::path::Path::new(set), std::fs::canonicalize(&template).unwrap());
        let back = Topology::from_toml(&topo.to_toml().unwrap()).unwrap();
        assert_eq!(&back.nodes[0].model.chat_template, set);
        assert_eq!(serve_topology(&parse(&[&model]).unwrap(), &no_env).unwrap().nodes[0].model.chat_template, "");
        let missing = parse(&[&model, "--chat-template", "/nonexistent/t.jinja"]).unwrap();
        let err = serve_topology(&missing, &no_env).unwrap_err();
        assert!(err.downcast_ref::<Misconfigured>().is_some());
        assert!(format!("{err:#}").contains("--chat-template"), "{err:#}");
    }

    #[test]
    fn side_channel_port_comes_from_vllms_variable_and_extra_config_wins() {
        let env = |k: &str| (k == VLLM_SIDE_CHANNEL_PORT).then(|| "5611".to_string());
        let (kv, role) = kv_transfer_from_json(
            r#"{"kv_connector":"PdmeshConnector","kv_role":"kv_both"}"#,
            (None, env(VLLM_SIDE_CHANNEL_PORT)),
        )
        .unwrap();
        assert_eq!((kv.side_channel_port, role), (5611, NodeRole::Colocated));
        let (kv, _) = kv_transfer_from_json(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"side_channel_port":5700}}"#,
            (None, Some("5611".into())),
        )
        .unwrap();
        assert_eq!(kv.side_channel_port, 5700);
    }

    /// What has no meaning here is refused, naming it.
    #[test]
    fn what_pdmesh_cannot_honour_is_refused_by_name() {
        let refused = |json: &str, needle: &str| {
            let err = kv_transfer_from_json(json, (None, None)).unwrap_err();
            let msg = format!("{err:#}");
            assert!(msg.contains(needle), "{msg}");
            assert!(err.downcast_ref::<Misconfigured>().is_some());
        };
        refused(
            r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#,
            "\"LMCacheConnectorV1\" is not supported",
        );
        refused(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cuda"}"#,
            "kv_buffer_device",
        );
        refused(r#"{"kv_connector":"NixlConnector","kv_role":"kv_sender"}"#, "kv_sender");
        refused(r#"{"kv_connector":"NixlConnector"}"#, "kv_role is required");
        refused(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"backends":["UCX"]}}"#,
            "\"backends\" is not supported",
        );
        let Err(err) = parse(&["m.gguf", "--gpu-memory-utilization", "0.9"]) else {
            panic!("an unknown flag was accepted")
        };
        assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument);
        let (_d, model) = model_file();
        let two = parse(&[&model, "--served-model-name", "a", "b"]).unwrap();
        assert!(format!("{:#}", serve_topology(&two, &no_env).unwrap_err()).contains("one name"));
        let missing = parse(&["/nonexistent/model.gguf"]).unwrap();
        assert!(format!("{:#}", serve_topology(&missing, &no_env).unwrap_err()).contains("not a file"));
        let hf = parse(&["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]).unwrap();
        assert!(format!("{:#}", serve_topology(&hf, &no_env).unwrap_err()).contains("does not download"));
    }

    #[test]
    fn a_pd_node_on_its_own_needs_the_shared_secrets() {
        let none = ApiKeyArgs { api_key: None, api_key_file: None };
        let msg = format!("{:#}", check_shared(true, false, false, &none).unwrap_err());
        assert!(msg.contains(env::MESH_SECRET), "{msg}");
        check_shared(true, false, true, &none).unwrap();
        check_shared(false, false, false, &none).unwrap();
        let keyed = ApiKeyArgs { api_key: Some("sk-a".into()), api_key_file: None };
        if std::env::var(env::INTERNAL_API_KEY).is_err() {
            let msg = format!("{:#}", check_shared(false, true, true, &keyed).unwrap_err());
            assert!(msg.contains(env::INTERNAL_API_KEY), "{msg}");
            check_shared(false, false, false, &keyed).unwrap();
        }
    }

    #[test]
    fn proxy_upstreams_pair_hosts_with_ports() {
        let h = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(upstreams("prefiller", &h(&["a", "b"]), &[1, 2]).unwrap(), ["http://a:1", "http://b:2"]);
        assert_eq!(upstreams("decoder", &h(&["a"]), &[1, 2]).unwrap(), ["http://a:1", "http://a:2"]);
        assert_eq!(upstreams("decoder", &[], &[8200]).unwrap(), ["http://localhost:8200"]);
        assert!(upstreams("decoder", &h(&["a", "b", "c"]), &[1, 2]).is_err());
        assert!(upstreams("prefiller", &h(&["a"]), &[]).is_err());
    }

    #[test]
    fn base_ports_of_nearby_nodes_do_not_overlap() {
        for p in 8000..8049u16 {
            assert!(
                default_base_port(p + 1) >= default_base_port(p) + 400
                    || default_base_port(p + 1) < default_base_port(p)
            );
            assert!(u32::from(default_base_port(p)) + 400 < 32768);
        }
    }
}
