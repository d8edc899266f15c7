//! `pdmesh-load overhead --model-step`: the mesh's cost per engine step against the real
//! model's step (issue #22's target: at most 2 %).
//!
//! One colocated node serving the GGUF model, loaded closed loop at each concurrency. Around
//! each run the engine's `pdmesh_engine_step_seconds` (a whole step, connector and worker
//! round trips included), the worker's `pdmesh_worker_execute_seconds` (the forward pass) and
//! `pdmesh_engine_steps_total` (steps that ran on the worker) are read, so per step:
//! mesh cost = step − forward pass, the time the step spends outside the model. The worker's
//! `pdmesh_worker_step_gap_seconds` (its idle time between two forward passes of a decode
//! chain) gives the same cost as the user pays it, and stays honest when steps overlap
//! (`engine.async_scheduling`, D67): gap per step and its share of forward + gap. The
//! frontend's per-token work is its process's CPU time (`/proc/<pid>/stat`, user + system)
//! per streamed token at `--frontend-streams`, set against the real step time per token at
//! that load. The other services' CPU per token is reported beside it.

use pdmesh_test_support::topology::{self, NodeExt as _};
use pdmesh_test_support::Ready;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::client;
use crate::stats::RunResult;
use crate::OverheadArgs;

/// Block size of the node under test.
const BLOCK_SIZE: u32 = 16;

/// The model file: `--model`, else `$PDMESH_MODEL_PATH`, else the cached SmolLM2 GGUF.
fn model_path(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("PDMESH_MODEL_PATH").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
    let p = home.join(".cache/pdmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    anyhow::ensure!(p.exists(), "no model: pass --model or set PDMESH_MODEL_PATH ({} missing)", p.display());
    Ok(p)
}

/// The engine's and worker's step figures at one moment.
#[derive(Debug, Clone, Copy)]
struct StepCounters {
    step_sum: f64,
    steps: f64,
    forward_sum: f64,
    skipped_meta: f64,
    /// The worker's idle time between consecutive forward passes while decoding.
    gap_sum: f64,
    spec_used: f64,
    spec_discarded: f64,
}

async fn step_counters(engine: &str, worker: &str) -> StepCounters {
    StepCounters {
        step_sum: client::scrape(engine, "pdmesh_engine_step_seconds_sum").await,
        steps: client::scrape(engine, "pdmesh_engine_steps_total").await,
        forward_sum: client::scrape(worker, "pdmesh_worker_execute_seconds_sum").await,
        skipped_meta: client::scrape(engine, "pdmesh_engine_meta_rounds_skipped_total").await,
        gap_sum: client::scrape(worker, "pdmesh_worker_step_gap_seconds_sum").await,
        spec_used: scrape_or_zero(worker, "pdmesh_worker_speculative_rows_total{outcome=\"used\"}").await,
        spec_discarded: scrape_or_zero(worker, "pdmesh_worker_speculative_rows_total{outcome=\"discarded\"}").await,
    }
}

/// One labelled series (`name{label="value"}`) of the page at `url`; zero when it does not
/// exist yet (a labelled counter appears with its first increment) or at all (an older build).
async fn scrape_or_zero(url: &str, series: &str) -> f64 {
    let Ok(r) = reqwest::get(url).await else { return f64::NAN };
    let Ok(text) = r.text().await else { return f64::NAN };
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse::<f64>().ok()).unwrap_or(0.0)
}

/// Clock ticks per second for `/proc/<pid>/stat` (`getconf CLK_TCK`; Linux uses 100).
fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|t| *t > 0.0)
        .unwrap_or(100.0)
}

/// CPU seconds of each service process `pdmesh up` started in `run_dir`, by service name
/// (argv: `pdmesh SERVICE --topology RUN_DIR/topology.toml --node NAME --rank R`).
///
/// Read from each thread's `/proc/<pid>/task/<tid>/schedstat` (nanoseconds on a CPU), which
/// is exact; `/proc/<pid>/stat`'s user + system time counts 10 ms ticks, ±2.4 µs per token
/// over a 4096-token run, as much as the differences it is meant to show. A thread that exits
/// between two readings takes its time with it: the services' threads live as long as they
/// do. Without schedstat (a kernel built without it) the ticks are read instead.
fn service_cpu(run_dir: &Path, ticks: f64) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return out };
    for entry in dir.flatten() {
        let path = entry.path();
        let Ok(cmdline) = std::fs::read(path.join("cmdline")) else { continue };
        let args: Vec<String> = cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).to_string()).collect();
        if args.len() < 4 || args[2] != "--topology" || Path::new(&args[3]).parent() != Some(run_dir) {
            continue;
        }
        let seconds = threads_on_cpu_seconds(&path).or_else(|| ticks_seconds(&path, ticks));
        if let Some(s) = seconds {
            *out.entry(args[1].clone()).or_insert(0.0) += s;
        }
    }
    out
}

/// The sum over a process's live threads of their time on a CPU (schedstat's first field).
fn threads_on_cpu_seconds(process: &Path) -> Option<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir(process.join("task")).ok()?.flatten() {
        // A thread that exited since the listing has nothing left to count.
        let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else { continue };
        ns += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 / 1e9)
}

/// A process's user + system time from `/proc/<pid>/stat`, in `ticks` per second.
fn ticks_seconds(process: &Path, ticks: f64) -> Option<f64> {
    let stat = std::fs::read_to_string(process.join("stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3; utime and
    // stime are fields 14 and 15.
    let rest = stat.rfind(')').and_then(|i| stat.get(i + 2..))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks_used = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    Some((ticks_used(11) + ticks_used(12)) / ticks)
}

/// Each service's CPU time between two [`service_cpu`] readings, per token, in µs.
fn cpu_per_token(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
    tokens: f64,
) -> serde_json::Map<String, serde_json::Value> {
    after
        .iter()
        .map(|(name, s)| {
            (name.clone(), serde_json::json!(per_token_us(s - before.get(name).copied().unwrap_or(0.0), tokens)))
        })
        .collect()
}

fn per_token_us(seconds: f64, tokens: f64) -> f64 {
    if tokens > 0.0 {
        1e6 * seconds / tokens
    } else {
        f64::NAN
    }
}

/// The node under test: its topology, with a pool and batch sized for the largest load the
/// run puts on it.
fn node_topology(a: &OverheadArgs, model: &Path, port: u16, base: u16) -> topology::Topology {
    let streams = a.concurrency.iter().copied().chain([a.frontend_streams]).max().unwrap_or(1);
    let max_model_len = ((a.prompt_tokens as u32 + a.max_tokens + 64).div_ceil(BLOCK_SIZE) * BLOCK_SIZE).max(128);
    let num_blocks = (max_model_len / BLOCK_SIZE) * streams as u32 + 64;
    topology::topology([topology::colocated("main", port, base).gguf(model).engine(|e| {
        e.block_size = BLOCK_SIZE;
        e.num_blocks = num_blocks;
        e.max_num_seqs = streams.max(8) as u32;
        e.max_num_batched_tokens = 2048;
        e.max_model_len = max_model_len;
    })])
}

/// Where the node under test is read: its API, its engine's and worker's metrics pages and
/// the run directory its processes were started with.
struct Probe<'a> {
    url: String,
    engine: String,
    worker: String,
    run_dir: &'a Path,
    ticks: f64,
}

/// One closed-loop load and the counters read around it.
struct Measured {
    r: RunResult,
    before: StepCounters,
    after: StepCounters,
    cpu_before: std::collections::BTreeMap<String, f64>,
    cpu_after: std::collections::BTreeMap<String, f64>,
}

impl Measured {
    fn steps(&self) -> f64 {
        self.after.steps - self.before.steps
    }

    /// Output tokens the load streamed.
    fn tokens(&self) -> f64 {
        self.r.output_tokens_per_s * self.r.wall_s
    }
}

/// `n` requests at concurrency `c`, with the service CPU times and step counters read
/// before and after.
async fn measure(p: &Probe<'_>, a: &OverheadArgs, c: usize, n: usize) -> anyhow::Result<Measured> {
    let cpu_before = service_cpu(p.run_dir, p.ticks);
    let before = step_counters(&p.engine, &p.worker).await;
    let r = client::run_tokens(&p.url, c, n, a.prompt_tokens, a.max_tokens).await?;
    let after = step_counters(&p.engine, &p.worker).await;
    let cpu_after = service_cpu(p.run_dir, p.ticks);
    Ok(Measured { r, before, after, cpu_before, cpu_after })
}

/// The row of one `--concurrency`: the step split into forward pass and mesh cost.
async fn step_row(p: &Probe<'_>, a: &OverheadArgs, c: usize) -> anyhow::Result<serde_json::Value> {
    let n = a.requests.max(2 * c);
    let m = measure(p, a, c, n).await?;
    let (before, after, r) = (&m.before, &m.after, &m.r);
    let cpu_per_token_us = cpu_per_token(&m.cpu_before, &m.cpu_after, m.tokens());
    let steps = m.steps();
    let step_ms = 1000.0 * (after.step_sum - before.step_sum) / steps;
    let forward_ms = 1000.0 * (after.forward_sum - before.forward_sum) / steps;
    let mesh_ms = step_ms - forward_ms;
    // With steps overlapped (D67) a step's forward pass runs partly before the engine asks
    // for it, so step − forward no longer measures the mesh; the worker's idle time between
    // passes does, in either mode: it is what the mesh adds to every inter-token latency.
    let gap_ms = 1000.0 * (after.gap_sum - before.gap_sum) / steps;
    Ok(serde_json::json!({
        "concurrency": c,
        "requests": n,
        "errors": r.errors,
        "output_tokens_per_s": r.output_tokens_per_s,
        "itl_p50_ms": r.itl.p50_ms,
        "steps": steps,
        "steps_without_meta_round": after.skipped_meta - before.skipped_meta,
        "step_ms": step_ms,
        "forward_ms": forward_ms,
        "mesh_ms": mesh_ms,
        "mesh_share_of_step_pct": 100.0 * mesh_ms / step_ms,
        "gap_ms": gap_ms,
        "gap_share_of_step_pct": 100.0 * gap_ms / (forward_ms + gap_ms),
        "speculative_rows_used": after.spec_used - before.spec_used,
        "speculative_rows_discarded": after.spec_discarded - before.spec_discarded,
        // Every service's CPU time per output token: at low load what the mesh's processes
        // take from the cores the forward pass runs on (the worker's includes the pass).
        "cpu_per_token_us": cpu_per_token_us,
    }))
}

/// The frontend's per-token work at `--frontend-streams`, against the step time per token.
async fn frontend_row(p: &Probe<'_>, a: &OverheadArgs) -> anyhow::Result<serde_json::Value> {
    let c = a.frontend_streams;
    let n = a.requests.max(2 * c);
    anyhow::ensure!(
        service_cpu(p.run_dir, p.ticks).contains_key("frontend"),
        "no frontend process found in {}",
        p.run_dir.display()
    );
    let m = measure(p, a, c, n).await?;
    let (before, after, r) = (&m.before, &m.after, &m.r);
    let tokens = m.tokens();
    let step_per_token_us = per_token_us(after.step_sum - before.step_sum, tokens);
    let cpu_per_token_us = cpu_per_token(&m.cpu_before, &m.cpu_after, tokens);
    let frontend_us = cpu_per_token_us.get("frontend").and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN);
    Ok(serde_json::json!({
        "concurrency": c,
        "requests": n,
        "errors": r.errors,
        "tokens_streamed": tokens,
        "output_tokens_per_s": r.output_tokens_per_s,
        "steps": m.steps(),
        "step_ms": 1000.0 * (after.step_sum - before.step_sum) / m.steps(),
        "step_time_per_token_us": step_per_token_us,
        "cpu_per_token_us": cpu_per_token_us,
        "frontend_cpu_share_of_step_time_per_token_pct": 100.0 * frontend_us / step_per_token_us,
    }))
}

pub async fn run(a: OverheadArgs) -> anyhow::Result<()> {
    let pdmesh = client::pdmesh_binary(a.pdmesh.as_deref())?;
    let model = model_path(a.model.as_deref())?;
    let run_dir = std::env::temp_dir().join(format!("pdmesh-model-step-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir)?;
    let slot = (std::process::id() % 50) as u16;
    let port = 19700 + slot;
    let base = 31000 + slot * 10;
    let topo = node_topology(&a, &model, port, base);
    let mesh = client::start_mesh(
        &pdmesh,
        topo,
        &run_dir,
        "model-step.toml",
        "warn",
        vec![Ready::Node(port)],
        Duration::from_secs(180),
    )
    .await?;
    let probe = Probe {
        url: format!("http://127.0.0.1:{port}"),
        engine: format!("http://127.0.0.1:{}/metrics", base + 110),
        worker: format!("http://127.0.0.1:{}/metrics", base + 112),
        run_dir: &run_dir,
        ticks: clock_ticks(),
    };
    // Warm-up: the model's first passes and the connections.
    client::run_tokens(&probe.url, 2, 4, a.prompt_tokens, a.max_tokens).await?;

    let mut rows = Vec::new();
    for &c in &a.concurrency {
        let row = step_row(&probe, &a, c).await?;
        eprintln!("{}", serde_json::to_string(&row)?);
        rows.push(row);
    }
    let frontend = frontend_row(&probe, &a).await?;
    eprintln!("{}", serde_json::to_string(&frontend)?);
    let report = serde_json::json!({
        "pdmesh": pdmesh.display().to_string(),
        // The key is on by default since D67; the variable overrides it for the mesh started here.
        "async_scheduling": std::env::var("PDMESH_ASYNC_SCHEDULING").unwrap_or_else(|_| "default".into()),
        "model": model.display().to_string(),
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "rows": rows,
        "frontend": frontend,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(out) = &a.out {
        std::fs::write(out, &text)?;
    }
    client::stop_mesh(mesh, Duration::from_secs(20)).await;
    let _ = std::fs::remove_dir_all(&run_dir);
    Ok(())
}
