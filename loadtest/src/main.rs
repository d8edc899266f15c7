//! `pdmesh-load`: drive an OpenAI-compatible server with streaming requests and report
//! latency and throughput; `overhead` measures what the mesh adds over the same engine and
//! executor called in-process.

mod client;
mod hostile;
mod inprocess;
mod load;
mod model_step;
mod multiturn;
mod offload;
mod rejections;
mod report;
mod stats;
mod topology_cmd;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use pdmesh_test_support::topology::{self, NodeExt as _};
use pdmesh_test_support::Ready;

#[derive(Parser)]
#[command(name = "pdmesh-load", version, about = "Load generator and benchmarks for pdmesh")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Load against any OpenAI-compatible server: closed loop or Poisson arrivals, latency,
    /// throughput and goodput, optional metrics scraping; JSON + Markdown + SVG report.
    Run(Box<load::LoadArgs>),
    /// Mesh overhead: the same engine and synthetic executor in-process versus through the
    /// mesh (started here with `pdmesh up`), at several concurrencies; with `--model-step`, the
    /// mesh's cost per step against the real model's step, and the frontend's CPU per token.
    Overhead(OverheadArgs),
    /// Rule R1: D rejects 10% of requests before admission; throughput and the block-seconds
    /// P strands, with rejection notices on versus off, against no rejections (three meshes
    /// started here, measured in interleaved rounds).
    Rejections(rejections::RejectionArgs),
    /// Host-memory KV offload on versus off (two colocated nodes of one mesh): TTFT and
    /// prefilled tokens when earlier prompts are revisited after leaving the device pool.
    Offload(offload::OffloadArgs),
    /// Multi-turn chat with a shared system prompt on P/D meshes, prefix caching off versus
    /// on (and per router policy), side by side: TTFT of later turns, prefill tokens
    /// computed, KV bytes moved, cached tokens reported.
    Multiturn(multiturn::MultiturnArgs),
    /// Issue 40's hostile load, for a duration: deep-`$ref` and huge-choice schemas over HTTP,
    /// side-channel peers that send bulky frames and never read, and a handshake flood of
    /// ZeroMQ connections; a JSON report of what each attacker sent and got.
    Hostile(hostile::HostileArgs),
    /// Print a topology of the load-test scenarios, from the typed builders the tests use
    /// (pdmesh-test-support); `normalize FILE` prints a file as pdmesh reads it.
    Topology {
        #[command(subcommand)]
        shape: topology_cmd::TopologyCmd,
    },
}

#[derive(Args, Clone)]
struct OverheadArgs {
    /// Concurrent streams to measure at.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256")]
    concurrency: Vec<usize>,
    /// Requests per measurement (at least 4 × concurrency are sent).
    #[arg(long, default_value_t = 512)]
    requests: usize,
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    /// The pdmesh binary (default: next to this one).
    #[arg(long)]
    pdmesh: Option<PathBuf>,
    #[arg(long)]
    out: Option<PathBuf>,
    /// Measure against the real model instead (issue #22): a colocated node serving the GGUF
    /// model; per step, the engine's step time, the worker's forward pass and the difference
    /// (the mesh's cost), at each `--concurrency`; then the frontend's CPU time per streamed
    /// token at `--frontend-streams`.
    #[arg(long)]
    model_step: bool,
    /// The GGUF model for `--model-step` (default: $PDMESH_MODEL_PATH, else
    /// ~/.cache/pdmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Concurrent streams at which `--model-step` measures the frontend's CPU per token.
    #[arg(long, default_value_t = 64)]
    frontend_streams: usize,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Cmd::Topology { shape } = cli.command {
        return topology_cmd::run(shape);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    match cli.command {
        Cmd::Run(a) => rt.block_on(load::run(*a)),
        Cmd::Overhead(a) => rt.block_on(overhead(a)),
        Cmd::Rejections(a) => rt.block_on(rejections::run(a)),
        Cmd::Offload(a) => rt.block_on(offload::run(a)),
        Cmd::Multiturn(a) => rt.block_on(multiturn::run(a)),
        Cmd::Hostile(a) => rt.block_on(hostile::run(a)),
        Cmd::Topology { .. } => Ok(()),
    }
}

async fn overhead(a: OverheadArgs) -> anyhow::Result<()> {
    if a.model_step {
        return model_step::run(a).await;
    }
    let pdmesh = client::pdmesh_binary(a.pdmesh.as_deref())?;
    let run_dir = std::env::temp_dir().join(format!("pdmesh-overhead-{}", std::process::id()));
    std::fs::create_dir_all(&run_dir)?;
    let port = 18900 + (std::process::id() % 500) as u16;
    let base = 26000 + (std::process::id() % 500) as u16 * 10;
    let topo = topology::topology([topology::colocated("main", port, base).synthetic(0).engine(|e| {
        e.num_blocks = 16384;
        e.max_num_seqs = 512;
        e.max_num_batched_tokens = 8192;
        e.max_model_len = 4096;
    })]);
    let url = format!("http://127.0.0.1:{port}");
    let mesh = client::start_mesh(
        &pdmesh,
        topo,
        &run_dir,
        "overhead.toml",
        "warn",
        vec![Ready::Node(port)],
        Duration::from_secs(60),
    )
    .await?;
    let engine_metrics = format!("http://127.0.0.1:{}/metrics", base + 110);

    let mut rows = Vec::new();
    for &c in &a.concurrency {
        let n = a.requests.max(4 * c);
        let base_run = inprocess::run(c, n, a.prompt_tokens, a.max_tokens);
        let before = client::scrape_step_seconds(&engine_metrics).await.unwrap_or_default();
        let mesh_run = client::run_tokens(&url, c, n, a.prompt_tokens, a.max_tokens).await?;
        let after = client::scrape_step_seconds(&engine_metrics).await.unwrap_or_default();
        let mesh_step_ms =
            if after.1 > before.1 { 1000.0 * (after.0 - before.0) / (after.1 - before.1) } else { f64::NAN };
        let row = serde_json::json!({
            "concurrency": c,
            "requests": n,
            "inprocess": base_run,
            "mesh": mesh_run,
            "mesh_step_ms": mesh_step_ms,
            "added_latency_per_request_ms": mesh_run.e2e_mean_ms - base_run.e2e_mean_ms,
            "added_latency_per_step_ms": mesh_step_ms - base_run.step_mean_ms,
        });
        eprintln!("{}", serde_json::to_string(&row)?);
        rows.push(row);
    }
    // requests/s for 1-token requests
    let n1 = a.requests.max(256);
    let base1 = inprocess::run(64, n1, a.prompt_tokens, 1);
    let mesh1 = client::run_tokens(&url, 64, n1, a.prompt_tokens, 1).await?;
    let report = serde_json::json!({
        "rows": rows,
        "one_token_requests": {"concurrency": 64, "requests": n1, "inprocess_rps": base1.requests_per_s, "mesh_rps": mesh1.requests_per_s},
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(out) = &a.out {
        std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
    }
    client::stop_mesh(mesh, Duration::from_secs(20)).await;
    let _ = std::fs::remove_dir_all(&run_dir);
    Ok(())
}
