//! `pdmesh`: one binary for every service of the mesh, plus `pdmesh up` to start a whole mesh.

mod links;
mod model;
mod up;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use pdmesh_config::{env, ApiKeySettings, Topology};

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
    /// Exit 0 if `URL` answers 2xx within 3 s (container health checks: the runtime image
    /// has no curl).
    Healthcheck {
        /// e.g. http://127.0.0.1:8000/health
        url: String,
    },
}

fn load_topology(path: &Option<PathBuf>) -> anyhow::Result<Topology> {
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
                || matches!(
                    c.downcast_ref::<FrontendError>(),
                    Some(FrontendError::Config(_) | FrontendError::Options(_))
                )
                || matches!(
                    c.downcast_ref::<WorkerError>(),
                    Some(WorkerError::BadRank { .. } | WorkerError::Setting(_))
                )
                || matches!(
                    c.downcast_ref::<pdmesh_engine_core::EngineError>(),
                    Some(pdmesh_engine_core::EngineError::BadRank { .. } | pdmesh_engine_core::EngineError::Faults(_))
                )
        })
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
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

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Up(args) => up::run(args),
        Command::Healthcheck { url } => {
            let client = reqwest::blocking::Client::builder().timeout(std::time::Duration::from_secs(3)).build()?;
            let status = client.get(&url).send().with_context(|| format!("GET {url}"))?.status();
            anyhow::ensure!(status.is_success(), "GET {url}: {status}");
            Ok(())
        }
        Command::Frontend(FrontendArgs { service, keys }) => serve("frontend", service, |topo, a| async move {
            let node = topo.node(&a.node)?.clone();
            let keys = keys.resolve()?;
            if node.role == pdmesh_config::NodeRole::Router {
                let client_keys = pdmesh_frontend::ApiKeys::new(keys.router_keys());
                pdmesh_frontend::router::run_router(topo, a.node.clone(), client_keys, keys.internal).await?;
                return Ok(());
            }
            let loaded = model::load_text(&node).context(Misconfigured("loading the tokenizer".into()))?;
            let api_keys = pdmesh_frontend::ApiKeys::with_internal(&keys.client, keys.internal.as_deref());
            pdmesh_frontend::run(topo, a.node.clone(), loaded.codec, loaded.options, api_keys).await?;
            Ok(())
        }),
        Command::DpLb(a) => serve("dp-lb", a, |topo, a| async move {
            pdmesh_dp_lb::run(&topo, &a.node).await?;
            wait_for_shutdown().await;
            Ok(())
        }),
        Command::EngineCore(a) => serve("engine-core", a, |topo, a| async move {
            pdmesh_engine_core::run(&topo, &a.node, a.rank)?;
            wait_for_shutdown().await;
            Ok(())
        }),
        Command::ConnectorScheduler(a) => serve("connector-scheduler", a, |topo, a| async move {
            pdmesh_connector_scheduler::run(&topo, &a.node, a.rank).await?;
            wait_for_shutdown().await;
            Ok(())
        }),
        Command::ConnectorWorker(a) => serve("connector-worker", a, |topo, a| async move {
            let node = topo.node(&a.node)?.clone();
            let (facts, factory, placement) =
                model::executor_factory(&node).context(Misconfigured("preparing the model".into()))?;
            let worker = pdmesh_connector_worker::run(&topo, &a.node, a.rank, factory, facts, placement).await?;
            let device_lost = async {
                match worker.device_lost.await {
                    Ok(why) => why,
                    // the actor is gone without a loss to report: wait for the signal
                    Err(_) => std::future::pending().await,
                }
            };
            let lost = tokio::select! {
                () = wait_for_shutdown() => None,
                why = device_lost => Some(why),
            };
            // D gives P's blocks back before it goes (R4), while its sockets still work.
            pdmesh_connector_worker::shutdown(&worker.actor).await;
            pdmesh_connector_worker::cleanup_shm();
            match lost {
                // Exit with an error: `pdmesh up`, compose or Kubernetes start a fresh process.
                Some(why) => Err(anyhow::anyhow!("the accelerator is lost ({why}); exiting to be restarted")),
                None => Ok(()),
            }
        }),
    }
}

/// Run one service inside an actix System until SIGINT/SIGTERM (or its parent `pdmesh up`
/// going away). Telemetry starts once the topology says who this process is (a frontend on a
/// router node reports as `router`), and its guard is dropped only after the System stopped:
/// that flushes the spans of the last requests (docs/TRACING.md).
fn serve<F, Fut>(name: &'static str, args: ServiceArgs, f: F) -> anyhow::Result<()>
where
    F: FnOnce(Topology, ServiceArgs) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + 'static,
{
    let topo = load_topology(&args.topology);
    let identity = service_identity(name, &args, topo.as_ref().ok());
    let telemetry = pdmesh_telemetry::init_service(&identity);
    let topo = topo?;
    links::seal_internal_links(&topo, &args.node)?;
    let system = actix_rt::System::new();
    let res = system.block_on(async move {
        tokio::spawn(watch_parent());
        f(topo, args).await
    });
    if let Err(e) = &res {
        tracing::error!(service = name, error = %format!("{e:#}"), "service failed");
    }
    drop(system);
    drop(telemetry);
    res
}

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

/// Resolve on SIGINT or SIGTERM.
async fn wait_for_shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down");
}

/// Children of `pdmesh up` exit when their parent is gone (even after a kill -9 of `up`),
/// so a crashed supervisor never leaves a half mesh holding ports.
async fn watch_parent() {
    let Some(expected) = std::env::var("PDMESH_PARENT_PID").ok().and_then(|p| p.parse::<u32>().ok()) else { return };
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        if std::os::unix::process::parent_id() != expected {
            tracing::warn!("parent pdmesh up is gone; exiting");
            std::process::exit(3);
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
    }

    #[test]
    fn an_empty_key_file_setting_names_no_file() {
        let cli = Cli::try_parse_from(["pdmesh", "frontend", "--api-key-file", "", "--api-key", "sk-a,sk-b"]).unwrap();
        let Command::Frontend(args) = cli.command else { panic!("not the frontend command") };
        assert!(args.keys.key_file().is_none(), "compose passes an unset variable as empty");
        assert_eq!(args.keys.resolve().unwrap().client, ["sk-a", "sk-b"]);
    }
}
