//! `pdmesh`: one binary for every service of the mesh, plus `pdmesh up` to start a whole mesh.

mod links;
mod model;
mod serve;
mod tp;
mod up;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use pdmesh_config::{env, ApiKeySettings, Service, Topology};
use pdmesh_service::{ServiceContext, Shutdown, StartError};

#[derive(Parser)]
#[command(name = "pdmesh", version, about = "A service mesh for disaggregated prefill/decode LLM serving")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct ServiceArgs {
    /// Topology file (default: the built-in mesh).
    #[arg(long, env = env::TOPOLOGY)]
    topology: Option<PathBuf>,
    /// Node of the topology this process belongs to.
    #[arg(long, default_value = "main")]
    node: String,
    /// Data-parallel rank (engine-core, connector-scheduler, connector-worker).
    #[arg(long, default_value_t = 0)]
    rank: u32,
}

/// API keys of a frontend (docs/SECURITY.md, "API keys"). The internal key is read from
/// `PDMESH_INTERNAL_API_KEY` only: a flag would show it to `ps`.
#[derive(Args, Clone)]
pub struct ApiKeyArgs {
    /// Client API keys, comma-separated: `/v1/*` and `/debug/*` then need
    /// `Authorization: Bearer <key>` (prefer the environment or a file: `ps` shows flags).
    #[arg(long, env = env::API_KEY, hide_env_values = true)]
    pub api_key: Option<String>,
    /// A file of client API keys, one per line (blank lines and `#` comments ignored).
    // A string, not a path: clap refuses an empty path, and compose passes an unset variable
    // on as an empty one.
    #[arg(long, env = env::API_KEY_FILE)]
    pub api_key_file: Option<String>,
}

impl ApiKeyArgs {
    /// The keys of this process: the flags (or their variables) and `PDMESH_INTERNAL_API_KEY`.
    pub fn resolve(&self) -> anyhow::Result<ApiKeySettings> {
        let internal = env::get(env::INTERNAL_API_KEY);
        ApiKeySettings::resolve(self.api_key.as_deref(), self.key_file(), internal.as_deref())
            .map_err(anyhow::Error::from)
    }

    /// The key file, if one is named (an empty `PDMESH_API_KEY_FILE`, as compose passes an
    /// unset one, names none).
    pub fn key_file(&self) -> Option<&std::path::Path> {
        self.api_key_file.as_deref().filter(|p| !p.is_empty()).map(std::path::Path::new)
    }
}

#[derive(Args, Clone)]
struct FrontendArgs {
    #[command(flatten)]
    service: ServiceArgs,
    #[command(flatten)]
    keys: ApiKeyArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Start a whole mesh from a topology file as child processes.
    Up(up::UpArgs),
    /// Serve one node from `vllm serve`'s flags: `pdmesh serve MODEL_PATH [--port …]
    /// [--kv-transfer-config JSON]` (docs/CONFIG.md, "vLLM flags").
    Serve(serve::ServeArgs),
    /// A P/D router from vLLM's proxy flags (`--prefiller-hosts/--prefiller-ports/
    /// --decoder-hosts/--decoder-ports`) or from a topology's router node.
    Proxy(serve::ProxyArgs),
    /// The OpenAI-compatible HTTP frontend of a node.
    Frontend(FrontendArgs),
    /// The data-parallel load balancer of a node.
    DpLb(ServiceArgs),
    /// One engine-core rank (scheduler + step loop).
    EngineCore(ServiceArgs),
    /// The KV connector, scheduler side, of one rank.
    ConnectorScheduler(ServiceArgs),
    /// The KV cache and model executor of one rank.
    ConnectorWorker(ServiceArgs),
    /// One tensor-parallel peer of a rank's worker (started by the worker itself, D111).
    #[command(hide = true)]
    TpPeer(tp::TpPeerArgs),
    /// Exit 0 if `URL` answers 2xx within 3 s (container health checks: the runtime image
    /// has no curl).
    Healthcheck {
        /// e.g. http://127.0.0.1:8000/health
        url: String,
    },
}

pub(crate) fn load_topology(path: &Option<PathBuf>) -> anyhow::Result<Topology> {
    let mut topo = match path {
        Some(p) => Topology::load(p)?,
        None => Topology::default_mesh()?,
    };
    topo.apply_env()?;
    Ok(topo)
}

/// Marks an error as a configuration error (a missing model file, a bad setting): the
/// process exits with [`pdmesh_config::EXIT_CONFIG`] so that `pdmesh up` stops the mesh and
/// shows it instead of restarting the process in a loop. Attached with `.context(...)`.
#[derive(Debug)]
pub struct Misconfigured(pub String);

impl std::fmt::Display for Misconfigured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether `e` is a configuration error: marked [`Misconfigured`], or caused by a topology or
/// setting error of a library.
fn is_config_error(e: &anyhow::Error) -> bool {
    use pdmesh_connector_worker::WorkerError;
    use pdmesh_frontend::FrontendError;
    e.downcast_ref::<Misconfigured>().is_some()
        || e.chain().any(|c| {
            c.is::<pdmesh_config::ConfigError>()
                || c.is::<pdmesh_mesh_auth::SecretError>()
                || c.downcast_ref::<StartError>().is_some_and(StartError::is_config)
                || matches!(
                    c.downcast_ref::<FrontendError>(),
                    Some(FrontendError::Config(_) | FrontendError::Options(_))
                )
                || matches!(c.downcast_ref::<WorkerError>(), Some(WorkerError::Setting(_)))
                || matches!(
                    c.downcast_ref::<pdmesh_engine_core::EngineError>(),
                    Some(pdmesh_engine_core::EngineError::Faults(_))
                )
        })
}

fn main() -> ExitCode {
    // Everything this process (or a library in it) creates on the host — logs, `ipc` sockets,
    // P's KV region in /dev/shm, the run dir's files — is its user's alone (D97,
    // docs/SECURITY.md "Same-host access"); children of `pdmesh up` inherit the mask too.
    let _previous = rustix::process::umask(rustix::fs::Mode::from_bits_truncate(pdmesh_config::private::PRIVATE_UMASK));
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<StopTimedOut>() => {
            eprintln!("Error: {e}");
            eprintln!("(a stop past the shutdown deadline: exit status {})", pdmesh_service::EXIT_SHUTDOWN_TIMEOUT);
            ExitCode::from(pdmesh_service::EXIT_SHUTDOWN_TIMEOUT)
        }
        Err(e) => {
            let config = is_config_error(&e);
            // The cause chain on one line, no backtrace: `pdmesh up` shows this line.
            eprintln!("Error: {e:#}");
            if config {
                eprintln!("(a configuration error: exit status {})", pdmesh_config::EXIT_CONFIG);
                ExitCode::from(pdmesh_config::EXIT_CONFIG)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Parse the command line. `serve` and `proxy` take vLLM's spelling of flags
/// (`--max_model_len`), and refuse a flag they do not honour by name (exit status 2, clap's
/// usage status, which `pdmesh up` also treats as a configuration error).
fn parse_cli() -> Cli {
    let args = serve::normalise_vllm_flags(std::env::args().collect());
    let sub = args.get(1).cloned().unwrap_or_default();
    match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) if matches!(sub.as_str(), "serve" | "proxy") && e.kind() == clap::error::ErrorKind::UnknownArgument => {
            let flag = match e.get(clap::error::ContextKind::InvalidArg) {
                Some(clap::error::ContextValue::String(s)) => s.clone(),
                _ => "an argument".to_string(),
            };
            eprintln!("{}", serve::unsupported_flag_message(&sub, &flag));
            std::process::exit(CLAP_USAGE_STATUS);
        }
        Err(e) => e.exit(),
    }
}

/// The tokenizer a router hashes prompts with, for `cache_aware` picks (D59) and for
/// conditional disaggregation (`local_prefill_max_tokens`, D69): the nodes' model, as the
/// router node's own `model` names it or, when it names none, as the topology's first
/// prefill or decode node does (a router table rarely repeats the model; hashing with another
/// tokenizer would find no overlap anywhere). Not loaded when neither needs it; a model that
/// fails to load leaves the router picking by load and every prefill on P (logged once).
fn router_tokenizer(ctx: &ServiceContext) -> Option<pdmesh_router::prompt::PromptTokenizer> {
    let node = &ctx.node;
    if node.router.policy != pdmesh_config::RoutingPolicy::CacheAware && node.router.local_prefill_max_tokens == 0 {
        return None;
    }
    let unnamed = node.model.kind == pdmesh_config::ModelKind::Synthetic && node.model.path.is_empty();
    let upstream_model = ctx
        .topology
        .nodes
        .iter()
        .find(|n| matches!(n.role, pdmesh_config::NodeRole::Prefill | pdmesh_config::NodeRole::Decode))
        .map(|n| n.model.clone());
    let mut node = node.clone();
    if unnamed {
        let Some(model) = upstream_model else {
            tracing::warn!("cache_aware: the router names no model and its topology has no prefill or decode node; picking by load");
            return None;
        };
        node.model = model;
    }
    match model::load_text(&node) {
        Ok(loaded) => Some(pdmesh_router::prompt::PromptTokenizer::new(loaded.codec, loaded.options)),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "router cannot load the nodes' tokenizer");
            None
        }
    }
}

/// clap's exit status for a usage error.
const CLAP_USAGE_STATUS: i32 = 2;

fn run() -> anyhow::Result<()> {
    let cli = parse_cli();
    match cli.command {
        Command::Up(args) => up::run(args),
        Command::Serve(args) => serve::run_serve(args),
        Command::Proxy(args) => serve::run_proxy(args),
        Command::Healthcheck { url } => {
            let client = reqwest::blocking::Client::builder().timeout(std::time::Duration::from_secs(3)).build()?;
            let status = client.get(&url).send().with_context(|| format!("GET {url}"))?.status();
            anyhow::ensure!(status.is_success(), "GET {url}: {status}");
            Ok(())
        }
        Command::Frontend(FrontendArgs { service, keys }) => {
            serve(Service::Frontend, service, |ctx, shutdown| async move {
                let keys = keys.resolve()?;
                if ctx.node.role == pdmesh_config::NodeRole::Router {
                    let client_keys = pdmesh_frontend::ApiKeys::new(keys.router_keys());
                    let tokenizer = router_tokenizer(&ctx);
                    pdmesh_router::run_router(ctx, client_keys, keys.internal, tokenizer, shutdown).await?;
                    return Ok(());
                }
                let loaded = model::load_text(&ctx.node).context(Misconfigured("loading the tokenizer".into()))?;
                let api_keys = pdmesh_frontend::ApiKeys::with_internal(&keys.client, keys.internal.as_deref());
                pdmesh_frontend::run(ctx, loaded.codec, loaded.options, api_keys, shutdown).await?;
                Ok(())
            })
        }
        Command::DpLb(a) => {
            serve(Service::DpLb, a, |ctx, shutdown| async move { Ok(pdmesh_dp_lb::run(ctx, shutdown).await?) })
        }
        Command::EngineCore(a) => {
            serve(
                Service::EngineCore,
                a,
                |ctx, shutdown| async move { Ok(pdmesh_engine_core::run(ctx, shutdown).await?) },
            )
        }
        Command::ConnectorScheduler(a) => serve(Service::ConnectorScheduler, a, |ctx, shutdown| async move {
            Ok(pdmesh_connector_scheduler::run(ctx, shutdown).await?)
        }),
        Command::ConnectorWorker(a) => {
            let topology = a.topology.clone();
            serve(Service::ConnectorWorker, a, |ctx, shutdown| async move {
                // TP rank 0 starts its peers first: they load their slices while it loads its own
                let mut group = tp::TpGroup::start(&ctx, topology.as_deref())?;
                let (facts, factory, placement) =
                    model::executor_factory(&ctx.node, group.as_mut().and_then(tp::TpGroup::rank0))
                        .context(Misconfigured("preparing the model".into()))?;
                let step_timeout = std::time::Duration::from_millis(ctx.node.engine.step_timeout_ms);
                let peers = group.as_mut().map(|g| g.peers(step_timeout));
                let res = pdmesh_connector_worker::run(ctx, factory, facts, placement, peers, shutdown).await;
                // the group (its peers stopped, its file removed) ends with the worker
                drop(group);
                Ok(res?)
            })
        }
        Command::TpPeer(a) => tp::run_peer(a),
    }
}

/// The one start-up shell of every service (D47). In order:
/// 1. the topology, and telemetry once it says who this process is (a frontend on a router
///    node reports as `router`);
/// 2. the process-wide settings, before the System starts and before any socket opens: the
///    seal of a tcp node's internal links under the mesh secret ([`links`], D45) and the
///    shutdown deadline (`PDMESH_SHUTDOWN_DEADLINE_S`);
/// 3. the actix System, in which the service's [`ServiceContext`] is built (node, rank checked
///    against `dp_size`, endpoints, readiness, ops server);
/// 4. one shutdown source: SIGINT, SIGTERM or the parent `pdmesh up` going away start the
///    [`pdmesh_service::Shutdown`] the service's `run` waits on;
/// 5. the deadline held around the service's stop ([`pdmesh_service::stop_within_deadline`]):
///    a stop past it exits with [`pdmesh_service::EXIT_SHUTDOWN_TIMEOUT`] ([`StopTimedOut`]).
///
/// The telemetry guard is dropped only after the System stopped: that flushes the spans of
/// the last requests (docs/TRACING.md).
fn serve<F, Fut>(service: Service, args: ServiceArgs, f: F) -> anyhow::Result<()>
where
    F: FnOnce(ServiceContext, Shutdown) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + 'static,
{
    let name = service.name();
    let topo = load_topology(&args.topology);
    let identity = service_identity(name, &args, topo.as_ref().ok());
    let telemetry = pdmesh_telemetry::init_service(&identity);
    let mut topo = topo?;
    model::resolve_kv_budgets(&mut topo).context(Misconfigured("engine.kv_cache_memory".into()))?;
    // The node's `ipc` sockets live in the run dir: it must be this user's and private (D97).
    if topo.node(&args.node).is_ok_and(|n| n.transport == pdmesh_config::SocketTransport::Ipc) {
        pdmesh_config::private::private_dir(&topo.run_dir)?;
    }
    links::seal_internal_links(&topo, &args.node)?;
    let deadline = pdmesh_service::deadline_from_env()?;
    let system = actix_rt::System::new();
    let res = system.block_on(async move {
        let shutdown = shutdown_on_signal(deadline);
        let ctx = ServiceContext::start(topo, &args.node, service, args.rank)?;
        // D90: one set of structured-output bounds per node, for the frontend and the worker
        pdmesh_frontend::server::apply_guided_limits(&ctx.node.limits);
        match pdmesh_service::stop_within_deadline(f(ctx, shutdown.clone()), &shutdown).await {
            Ok(res) => res,
            Err(overran) => Err(anyhow::Error::new(StopTimedOut(overran))),
        }
    });
    match &res {
        Err(e) if e.is::<StopTimedOut>() => tracing::error!(service = name, error = %e, "stopped past the deadline"),
        Err(e) => tracing::error!(service = name, error = %format!("{e:#}"), "service failed"),
        Ok(()) => tracing::info!(service = name, "stopped cleanly"),
    }
    drop(system);
    drop(telemetry);
    res
}

/// A service whose graceful stop overran the shutdown deadline (or a `pdmesh up` one of whose
/// children did): the process exits with [`pdmesh_service::EXIT_SHUTDOWN_TIMEOUT`], which tells
/// it from a clean stop (0) and a failure (1).
#[derive(Debug)]
pub struct StopTimedOut(pdmesh_service::DeadlineExceeded);

impl std::fmt::Display for StopTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for StopTimedOut {}

/// Who this process is, for `service.name` and the resource attributes of its spans.
fn service_identity(name: &str, args: &ServiceArgs, topo: Option<&Topology>) -> pdmesh_telemetry::ServiceIdentity {
    let node = topo.and_then(|t| t.node(&args.node).ok());
    let service = match node {
        Some(n) if name == "frontend" && n.role == pdmesh_config::NodeRole::Router => "router",
        _ => name,
    };
    let per_rank = matches!(name, "engine-core" | "connector-scheduler" | "connector-worker");
    pdmesh_telemetry::ServiceIdentity::new(service, args.node.clone(), per_rank.then_some(args.rank))
}

/// The [`Shutdown`] a process waits on: started by SIGINT, SIGTERM or its parent `pdmesh up`
/// going away (must be called inside the runtime).
pub(crate) fn shutdown_on_signal(deadline: std::time::Duration) -> Shutdown {
    let (trigger, shutdown) = pdmesh_service::shutdown_channel(deadline);
    tokio::spawn(async move {
        tokio::select! {
            () = wait_for_signal() => {}
            () = watch_parent() => {}
        }
        trigger.trigger();
    });
    shutdown
}

/// Resolve on SIGINT or SIGTERM.
async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
    }
}

/// Resolve when the parent `pdmesh up` is gone (even after a kill -9 of `up`): its children
/// then stop, so a crashed supervisor never leaves a half mesh holding ports. Never resolves
/// for a process not started by `pdmesh up`.
async fn watch_parent() {
    let Some(expected) = std::env::var("PDMESH_PARENT_PID").ok().and_then(|p| p.parse::<u32>().ok()) else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        if std::os::unix::process::parent_id() != expected {
            tracing::warn!("parent pdmesh up is gone; stopping");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_errors_are_told_apart_from_other_failures() {
        let config = anyhow::Error::from(pdmesh_config::ConfigError::Invalid("bad".into()));
        assert!(is_config_error(&config));
        let model = anyhow::anyhow!("model file not found").context(Misconfigured("preparing the model".into()));
        assert!(is_config_error(&model.context("starting")), "a marked cause counts under more context");
        let fault = anyhow::Error::from(pdmesh_connector_worker::WorkerError::Setting("unknown fault".into()));
        assert!(is_config_error(&fault));
        let bind =
            pdmesh_frontend::FrontendError::HttpBind { addr: "x".into(), source: std::io::Error::other("in use") };
        assert!(!is_config_error(&anyhow::Error::from(bind)), "a port in use is worth a restart");
        assert!(!is_config_error(&anyhow::anyhow!("the accelerator is lost")));
        let rank = anyhow::Error::from(StartError::BadRank { rank: 2, dp_size: 2 });
        assert!(is_config_error(&rank), "a rank outside dp_size cannot start however often it tries");
        let ops = StartError::Ops { port: 1, source: std::io::Error::other("in use") };
        assert!(!is_config_error(&anyhow::Error::from(ops)), "an ops port in use is worth a restart");
    }

    #[test]
    fn an_empty_key_file_setting_names_no_file() {
        let cli = Cli::try_parse_from(["pdmesh", "frontend", "--api-key-file", "", "--api-key", "sk-a,sk-b"]).unwrap();
        let Command::Frontend(args) = cli.command else { panic!("not the frontend command") };
        assert!(args.keys.key_file().is_none(), "compose passes an unset variable as empty");
        assert_eq!(args.keys.resolve().unwrap().client, ["sk-a", "sk-b"]);
    }
}
