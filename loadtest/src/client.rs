//! The HTTP side: streaming OpenAI requests, closed loop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::Mutex;

use pdmesh_test_support::topology::Topology;
use pdmesh_test_support::{Launch, Mesh, Ready, UpOptions};

use crate::stats::{summarize, RunResult};

/// The pdmesh binary: `given`, else the one next to this program.
pub fn pdmesh_binary(given: Option<&std::path::Path>) -> anyhow::Result<std::path::PathBuf> {
    Ok(match given {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()?.with_file_name("pdmesh"),
    })
}

/// Start `topology` with pdmesh-test-support's launcher (the tests' own), on a blocking
/// thread: written as `file` into `run_dir`, `pdmesh up` with `RUST_LOG=rust_log`, waiting up
/// to `limit` for each of `ready` in turn (a node: healthy with its engines connected; a
/// router: every upstream healthy). Stopped (SIGTERM, then kill) when dropped; see
/// [`stop_mesh`].
pub async fn start_mesh(
    pdmesh: &std::path::Path,
    topology: Topology,
    run_dir: &std::path::Path,
    file: &str,
    rust_log: &str,
    ready: Vec<Ready>,
    limit: Duration,
) -> anyhow::Result<Mesh> {
    let (http_port, base_port) = topology.nodes.first().map(|n| (n.http_port, n.base_port)).unwrap_or_default();
    let launch = Launch {
        run_dir: run_dir.to_path_buf(),
        file: file.to_string(),
        http_port,
        base_port,
        ready,
        options: UpOptions {
            env: vec![("NO_COLOR".into(), "1".into())],
            rust_log: Some(rust_log.to_string()),
            ready_within: Some(limit),
            bin: Some(pdmesh.to_path_buf()),
            ..Default::default()
        },
    };
    tokio::task::spawn_blocking(move || Mesh::launch(topology, launch).map_err(|e| anyhow::anyhow!("mesh: {e}")))
        .await?
}

/// SIGTERM the mesh's `pdmesh up` and wait up to `limit` for it to exit (then kill it).
pub async fn stop_mesh(mut mesh: Mesh, limit: Duration) {
    let _ = tokio::task::spawn_blocking(move || mesh.terminate(limit)).await;
}

/// `(sum, count)` of `pdmesh_engine_step_seconds` from a Prometheus text page.
pub async fn scrape_step_seconds(url: &str) -> Option<(f64, f64)> {
    let text = reqwest::get(url).await.ok()?.text().await.ok()?;
    let find = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some((find("pdmesh_engine_step_seconds_sum")?, find("pdmesh_engine_step_seconds_count")?))
}

#[derive(Default)]
struct Samples {
    e2e: Vec<f64>,
    ttft: Vec<f64>,
    itl: Vec<f64>,
    tokens: u64,
    errors: usize,
}

/// Closed loop: `concurrency` workers each send requests back to back until `requests` were
/// sent. Prompts are `prompt_tokens` synthetic bytes (one token each for the synthetic model).
pub async fn run_tokens(
    url: &str,
    concurrency: usize,
    requests: usize,
    prompt_tokens: usize,
    max_tokens: u32,
) -> anyhow::Result<RunResult> {
    let prompt =
        move |i: usize| -> String { (0..prompt_tokens).map(|j| (b'a' + ((i + j) % 26) as u8) as char).collect() };
    run_closed_loop(url, concurrency, requests, max_tokens, Arc::new(prompt)).await
}

async fn run_closed_loop(
    url: &str,
    concurrency: usize,
    requests: usize,
    max_tokens: u32,
    prompt: Arc<dyn Fn(usize) -> String + Send + Sync>,
) -> anyhow::Result<RunResult> {
    let client = reqwest::Client::builder().tcp_nodelay(true).pool_max_idle_per_host(concurrency.max(1)).build()?;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let samples = Arc::new(Mutex::new(Samples::default()));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, next, samples, prompt) = (client.clone(), next.clone(), samples.clone(), prompt.clone());
        let endpoint = format!("{url}/v1/completions");
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= requests {
                    return;
                }
                let body = serde_json::json!({
                    "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0,
                    "stream": true, "ignore_eos": true,
                });
                let start = Instant::now();
                let res = one_stream(&client, &endpoint, &body, start).await;
                let mut s = samples.lock().await;
                match res {
                    Ok((ttft, itls, n)) => {
                        s.e2e.push(start.elapsed().as_secs_f64() * 1000.0);
                        if let Some(t) = ttft {
                            s.ttft.push(t);
                        }
                        s.itl.extend(itls);
                        s.tokens += n;
                    }
                    Err(_) => s.errors += 1,
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let wall = t0.elapsed().as_secs_f64();
    let s = samples.lock().await;
    let e2e = summarize(&s.e2e);
    Ok(RunResult {
        concurrency,
        requests,
        errors: s.errors,
        wall_s: wall,
        requests_per_s: (requests - s.errors) as f64 / wall,
        output_tokens_per_s: s.tokens as f64 / wall,
        e2e_mean_ms: e2e.mean_ms,
        e2e,
        ttft: summarize(&s.ttft),
        itl: summarize(&s.itl),
        step_mean_ms: f64::NAN,
    })
}

/// One streaming request: (TTFT ms, inter-token gaps ms, output chunks with text).
async fn one_stream(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    start: Instant,
) -> anyhow::Result<(Option<f64>, Vec<f64>, u64)> {
    let r = client.post(url).json(body).send().await?;
    if !r.status().is_success() {
        anyhow::bail!("status {}", r.status());
    }
    let mut stream = r.bytes_stream();
    let mut buf = String::new();
    let mut timing = ChunkTiming::new(start);
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(pos) = buf.find("\n\n") {
            let event: String = buf.drain(..pos + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                return Ok(timing.into_parts());
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            if v.get("error").is_some() {
                anyhow::bail!("error event: {data}");
            }
            if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                timing.chunk(Instant::now());
            }
        }
    }
    Ok(timing.into_parts())
}

/// The client-side latencies of one stream, kept as its chunks with text arrive: time to the
/// first one (TTFT) and the gaps between the later ones (ITL), in ms.
#[derive(Debug)]
pub struct ChunkTiming {
    start: Instant,
    last: Instant,
    /// From the request's start to the first chunk with text; `None` until one came.
    pub ttft_ms: Option<f64>,
    /// Between each chunk with text and the one before it.
    pub itl_ms: Vec<f64>,
    /// Chunks with text so far.
    pub chunks: u64,
}

impl ChunkTiming {
    /// Timing for a request sent at `start`.
    pub fn new(start: Instant) -> Self {
        ChunkTiming { start, last: start, ttft_ms: None, itl_ms: Vec::new(), chunks: 0 }
    }

    /// A chunk with text arrived at `now`: the first sets TTFT, each later one adds a gap.
    pub fn chunk(&mut self, now: Instant) {
        match self.ttft_ms {
            None => self.ttft_ms = Some(now.duration_since(self.start).as_secs_f64() * 1000.0),
            Some(_) => self.itl_ms.push(now.duration_since(self.last).as_secs_f64() * 1000.0),
        }
        self.last = now;
        self.chunks += 1;
    }

    /// `(TTFT ms, inter-token gaps ms, chunks with text)`.
    pub fn into_parts(self) -> (Option<f64>, Vec<f64>, u64) {
        (self.ttft_ms, self.itl_ms, self.chunks)
    }
}

/// The sum of every series of the metric `name` on the Prometheus page at `url` (all label
/// sets); NaN when the page cannot be read, so a missing scrape never passes for a zero.
pub async fn scrape(url: &str, name: &str) -> f64 {
    let Ok(r) = reqwest::get(url).await else { return f64::NAN };
    let Ok(text) = r.text().await else { return f64::NAN };
    text.lines()
        .filter(|l| l.split([' ', '{']).next() == Some(name))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}
