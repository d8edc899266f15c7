//! `pdmesh-load run`: load against any OpenAI-compatible server.
//!
//! Closed loop (`--concurrency` clients back to back) or open loop (`--rate`: Poisson arrivals,
//! so queueing shows up as latency instead of being hidden by the clients waiting), prompts from
//! a shipped prompt set, fixed or uniformly random lengths, optional warmup, optional client
//! disconnects, and optional Prometheus scraping while the load runs. Everything the report
//! needs comes from the standard API (SSE chunks, `usage` when the server sends it), so no
//! pdmesh-only field is required. The report schema is in `docs/LOADTEST.md`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use futures::StreamExt;
use serde::Serialize;

use crate::client::ChunkTiming;
use crate::report;
use crate::stats::{summarize, Summary};

/// The prompt set that ships with the repository, built in so the binary works from any
/// directory; `--prompts FILE` replaces it.
const DEFAULT_PROMPTS: &str = include_str!("../prompts/default.jsonl");

#[derive(Clone, Copy, Debug, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A length: `N` or a uniform range `A-B` (inclusive).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct LenSpec {
    pub min: u32,
    pub max: u32,
}

impl std::str::FromStr for LenSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parse = |x: &str| x.trim().parse::<u32>().map_err(|e| format!("{x:?}: {e}"));
        let (min, max) = match s.split_once(['-', ':']) {
            Some((a, b)) => (parse(a)?, parse(b)?),
            None => (parse(s)?, parse(s)?),
        };
        if min > max || max == 0 {
            return Err(format!("bad length {s:?}: want N or A-B with 0 < A <= B"));
        }
        Ok(LenSpec { min, max })
    }
}

#[derive(Args, Clone, Debug, Serialize)]
pub struct LoadArgs {
    /// Base URL of the server (no `/v1`).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    #[arg(long, value_enum, default_value = "completions")]
    pub endpoint: Endpoint,
    /// Model name; default: the first id of `GET /v1/models` (omitted if that fails).
    #[arg(long)]
    pub model: Option<String>,
    /// Closed loop: clients sending back to back (default 8). With `--rate`: a cap on requests
    /// in flight (default none).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Measured requests to send (default 64 unless `--duration` is given).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Stop sending after this many seconds (in-flight requests still finish).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Requests sent (at the same concurrency, closed loop) before the measurement, not counted.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Prompt length in words, `N` or `A-B`; default: each prompt as written in the set.
    #[arg(long)]
    pub input_len: Option<LenSpec>,
    /// `max_tokens`, `N` or `A-B`.
    #[arg(long, default_value = "64")]
    pub output_len: LenSpec,
    /// A JSONL prompt set (`{"prompt": "..."}` per line); default: `loadtest/prompts/default.jsonl`.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Send non-streaming requests (TTFT = E2E, no ITL).
    #[arg(long)]
    pub no_stream: bool,
    /// Do not send `ignore_eos` (servers that reject unknown fields; lengths then vary).
    #[arg(long)]
    pub no_ignore_eos: bool,
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Seed of every random choice (prompt, lengths, arrivals, disconnects).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Goodput SLO: time to first token, ms.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// Goodput SLO: time per output token after the first, ms.
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    /// Share of streaming requests the client abandons mid-stream (disconnect tests).
    #[arg(long, default_value_t = 0.0)]
    pub disconnect_fraction: f64,
    /// Output chunks a disconnecting client reads before it drops the connection.
    #[arg(long, default_value_t = 1)]
    pub disconnect_after: u32,
    /// Per-request time limit, seconds.
    #[arg(long, default_value_t = 300.0)]
    pub request_timeout_s: f64,
    /// Open a new connection for every request instead of reusing kept-alive ones. A server
    /// that closes a kept-alive connection on its own schedule (a per-connection request cap, an
    /// idle timeout) races the client's next request on it, and the loser shows up as a
    /// transport error that says nothing about the server's serving; side-by-side comparisons
    /// with other servers use this.
    #[arg(long)]
    pub fresh_connections: bool,
    /// Closed loop: a client refused with a `Retry-After` (a 503 or 429) waits that long before
    /// its next request, as a well-behaved client does, instead of asking again at once (which
    /// turns a restarting node's second of 503s into thousands of refusals).
    #[arg(long)]
    pub respect_retry_after: bool,
    /// Prometheus `/metrics` URL to sample while the load runs (repeatable).
    #[arg(long)]
    pub scrape: Vec<String>,
    /// Extra metric name prefixes to keep from the scraped pages (repeatable).
    #[arg(long)]
    pub scrape_metric: Vec<String>,
    #[arg(long, default_value_t = 1000)]
    pub scrape_interval_ms: u64,
    /// Write `report.json`, `summary.md`, `latency_cdf.svg` and `timeline.svg` here.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// A label for the report (default: the last component of `--out-dir`).
    #[arg(long)]
    pub name: Option<String>,
    /// A progress line on stderr every second.
    #[arg(long)]
    pub progress: bool,
    /// API key sent as `Authorization: Bearer <key>` on every request (a mesh started with
    /// keys). Also read from `PDMESH_LOAD_API_KEY`; never from `PDMESH_API_KEY`, which is the
    /// server's own setting and must not change what an existing run sends. Never written to
    /// the report.
    #[arg(long, env = "PDMESH_LOAD_API_KEY", hide_env_values = true)]
    #[serde(skip)]
    pub api_key: Option<ApiKey>,
}

/// A client API key: shown as `<redacted>` by `Debug`, so no log or panic message prints it.
#[derive(Clone)]
pub struct ApiKey(String);

impl std::str::FromStr for ApiKey {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let key = s.trim();
        if key.is_empty() {
            return Err("the API key is empty".into());
        }
        Ok(ApiKey(key.to_string()))
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The headers every request of a run carries: `Authorization` when a key is given (marked
/// sensitive, so reqwest never shows it either).
fn default_headers(key: Option<&ApiKey>) -> anyhow::Result<reqwest::header::HeaderMap> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(ApiKey(key)) = key {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
            .context("the API key is not a valid header value")?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    Ok(headers)
}

/// Metrics kept from scraped pages by default: block ownership and the counters that explain
/// a run (requests, tokens, errors, aborts, transfer failures).
const DEFAULT_SCRAPE_PREFIXES: &[&str] = &[
    "pdmesh_engine_kv_held_blocks",
    "pdmesh_engine_kv_used_blocks",
    "pdmesh_engine_kv_free_blocks",
    "pdmesh_engine_requests_running",
    "pdmesh_engine_requests_waiting",
    "pdmesh_engine_requests_finished_total",
    "pdmesh_engine_preemptions_total",
    "pdmesh_engine_kv_loads_recomputed_total",
    "pdmesh_engine_kv_load_failed_requests_total",
    "pdmesh_frontend_requests_in_flight",
    "pdmesh_frontend_http_requests_total",
    "pdmesh_frontend_request_errors_total",
    "pdmesh_frontend_generation_tokens_total",
    "pdmesh_frontend_aborts_sent_total",
    "pdmesh_worker_kv_held_blocks",
    "pdmesh_worker_kv_transfer_failures_total",
    "pdmesh_worker_kv_holds_expired_total",
    "pdmesh_worker_kv_held_block_seconds_total",
];

/// splitmix64: a few lines instead of a dependency; good enough for load shapes and fully
/// reproducible from `--seed`.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn range(&mut self, s: LenSpec) -> u32 {
        s.min + (self.next_u64() % (u64::from(s.max - s.min) + 1)) as u32
    }
}

/// What one request will send; drawn from the request's index so a run is reproducible.
struct Plan {
    prompt: String,
    prompt_words: usize,
    max_tokens: u32,
    disconnect: bool,
}

pub fn load_prompts(path: Option<&PathBuf>) -> anyhow::Result<Vec<String>> {
    let text = match path {
        Some(p) => std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        None => DEFAULT_PROMPTS.to_string(),
    };
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("prompt line {}", n + 1))?;
        let p = v["prompt"].as_str().with_context(|| format!("prompt line {}: no \"prompt\" string", n + 1))?;
        out.push(p.to_string());
    }
    anyhow::ensure!(!out.is_empty(), "the prompt set is empty");
    Ok(out)
}

fn plan(a: &LoadArgs, prompts: &[String], index: u64) -> Plan {
    let mut rng = Rng::new(a.seed ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let first = (rng.next_u64() % prompts.len() as u64) as usize;
    let prompt = match a.input_len {
        None => prompts[first].clone(),
        Some(spec) => {
            // Cycle through the set from the drawn prompt until the length is reached, so long
            // prompts are still English text rather than one prompt repeated.
            let want = rng.range(spec) as usize;
            let mut words: Vec<&str> = Vec::with_capacity(want);
            let mut k = first;
            while words.len() < want {
                words.extend(prompts[k % prompts.len()].split_whitespace().take(want - words.len()));
                k += 1;
            }
            words.join(" ")
        }
    };
    let max_tokens = rng.range(a.output_len);
    let disconnect = !a.no_stream && rng.f64() < a.disconnect_fraction;
    Plan { prompt_words: prompt.split_whitespace().count(), prompt, max_tokens, disconnect }
}

/// How one request ended.
#[derive(Debug)]
enum Outcome {
    Ok {
        ttft_ms: f64,
        itl_ms: Vec<f64>,
        e2e_ms: f64,
        output_tokens: u64,
        /// From the server's `usage`, when it sent one.
        prompt_tokens: Option<u64>,
    },
    /// The client dropped the connection on purpose (`--disconnect-fraction`).
    Disconnected,
    /// `http_<status>` (see [`refusal_kind`]), `error_event`, `transport`, `timeout`,
    /// `incomplete_stream`, `bad_body`.
    Error(String),
}

#[derive(Debug)]
struct Record {
    outcome: Outcome,
    prompt_words: usize,
    /// Output chunks received per second of the run (index = second since the phase started).
    tokens_per_second: Vec<(usize, u32)>,
    end_s: f64,
}

struct Shared {
    client: reqwest::Client,
    endpoint_url: String,
    model: Option<String>,
    args: LoadArgs,
    prompts: Vec<String>,
    t0: Instant,
    records: Mutex<Vec<Record>>,
    sent: AtomicUsize,
    done: AtomicUsize,
    failed: AtomicUsize,
    tokens: AtomicU64,
}

fn body(s: &Shared, p: &Plan) -> serde_json::Value {
    let a = &s.args;
    let mut b = serde_json::Map::new();
    if let Some(m) = &s.model {
        b.insert("model".into(), m.clone().into());
    }
    match a.endpoint {
        Endpoint::Completions => {
            b.insert("prompt".into(), p.prompt.clone().into());
        }
        Endpoint::Chat => {
            b.insert("messages".into(), serde_json::json!([{"role": "user", "content": p.prompt}]));
        }
    }
    b.insert("max_tokens".into(), p.max_tokens.into());
    b.insert("stream".into(), (!a.no_stream).into());
    if !a.no_stream {
        b.insert("stream_options".into(), serde_json::json!({"include_usage": true}));
    }
    if !a.no_ignore_eos {
        b.insert("ignore_eos".into(), true.into());
    }
    if let Some(t) = a.temperature {
        b.insert("temperature".into(), t.into());
    }
    serde_json::Value::Object(b)
}

fn classify(e: &reqwest::Error) -> String {
    // The first few transport errors are printed with their cause chain: a count alone does
    // not say whether the server reset a connection, closed a kept-alive one, or never answered.
    static PRINTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    if PRINTED.fetch_add(1, Ordering::Relaxed) < 5 {
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(e);
        while let Some(cause) = src {
            msg.push_str(&format!(": {cause}"));
            src = cause.source();
        }
        eprintln!("pdmesh-load: request error: {msg}");
    }
    if e.is_timeout() {
        "timeout".into()
    } else {
        "transport".into()
    }
}

/// Whether an error answer's body is an OpenAI error object: `{"error": {"message": "..."}}`.
fn is_openai_error(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| v["error"]["message"].is_string())
}

/// An answer's `Retry-After` in whole seconds, when it carries one (an HTTP date is valid
/// too, but no pdmesh process sends one).
pub fn retry_after_s(headers: &reqwest::header::HeaderMap) -> Option<u64> {
    headers.get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse().ok())
}

/// The error kind of an answer with failure `status`: `http_<status>` when it is a clean
/// refusal. A refusal counts as clean only with an OpenAI error object; anything else (an empty
/// or cut body, a proxy's HTML page) is `http_<status>_bad_body`, so scenarios can tell. A 503
/// or 429 also has to say when to come back: without `Retry-After` it is
/// `http_<status>_no_retry_after` (a client has nothing to pace its retries by).
pub fn refusal_kind(status: u16, retry_after: bool, body: &[u8]) -> String {
    let mut kind = format!("http_{status}");
    if !is_openai_error(body) {
        kind.push_str("_bad_body");
    }
    if matches!(status, 503 | 429) && !retry_after {
        kind.push_str("_no_retry_after");
    }
    kind
}

/// Text of a chunk's first choice (completions `text`, chat `delta.content`).
fn chunk_text(v: &serde_json::Value) -> Option<&str> {
    let c = &v["choices"][0];
    c["text"].as_str().or_else(|| c["delta"]["content"].as_str())
}

/// Output chunks per second of the run, as `(second since the phase started, chunks)`, kept
/// for the report's timeline.
struct PerSecond {
    t0: Instant,
    counts: Vec<(usize, u32)>,
}

impl PerSecond {
    fn new(t0: Instant) -> Self {
        PerSecond { t0, counts: Vec::new() }
    }

    /// Count one chunk that arrived at `now`.
    fn count(&mut self, now: Instant) {
        let sec = now.duration_since(self.t0).as_secs() as usize;
        match self.counts.last_mut() {
            Some((k, n)) if *k == sec => *n += 1,
            _ => self.counts.push((sec, 1)),
        }
    }
}

/// One request and how it ended; with it, the `Retry-After` of a refusal that carried one.
async fn one_request(s: &Shared, p: &Plan) -> (Record, Option<Duration>) {
    let start = Instant::now();
    let mut per_sec = PerSecond::new(s.t0);
    let (outcome, retry_after) = request_outcome(s, p, start, &mut per_sec).await;
    let record = Record {
        outcome,
        prompt_words: p.prompt_words,
        tokens_per_second: per_sec.counts,
        end_s: s.t0.elapsed().as_secs_f64(),
    };
    (record, retry_after.map(Duration::from_secs))
}

/// Send the request sent at `start` and read its answer: how it ended, and a refusal's
/// `Retry-After` in seconds.
async fn request_outcome(s: &Shared, p: &Plan, start: Instant, per_sec: &mut PerSecond) -> (Outcome, Option<u64>) {
    let r = match s.client.post(&s.endpoint_url).json(&body(s, p)).send().await {
        Ok(r) => r,
        Err(e) => return (Outcome::Error(classify(&e)), None),
    };
    if !r.status().is_success() {
        return refusal(r).await;
    }
    let outcome = if s.args.no_stream {
        whole_answer(r, start, per_sec).await
    } else {
        streamed_answer(s, p, r, start, per_sec).await
    };
    (outcome, None)
}

/// A failure status: its error kind (see [`refusal_kind`]) and its `Retry-After`, if any.
async fn refusal(r: reqwest::Response) -> (Outcome, Option<u64>) {
    let status = r.status().as_u16();
    let retry_after = retry_after_s(r.headers());
    let told = retry_after.is_some();
    let outcome = match r.bytes().await {
        Err(e) if e.is_timeout() => Outcome::Error("timeout".into()),
        Ok(b) => Outcome::Error(refusal_kind(status, told, &b)),
        Err(_) => Outcome::Error(refusal_kind(status, told, &[])),
    };
    (outcome, retry_after)
}

/// A non-streamed answer: one body, so its TTFT is its E2E and it has no inter-token gaps.
async fn whole_answer(r: reqwest::Response, start: Instant, per_sec: &mut PerSecond) -> Outcome {
    let v: serde_json::Value = match r.json().await {
        Ok(v) => v,
        Err(e) if e.is_timeout() => return Outcome::Error("timeout".into()),
        Err(_) => return Outcome::Error("bad_body".into()),
    };
    if v.get("error").is_some() {
        return Outcome::Error("error_event".into());
    }
    let e2e = start.elapsed().as_secs_f64() * 1000.0;
    let out = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    per_sec.count(Instant::now());
    Outcome::Ok {
        ttft_ms: e2e,
        itl_ms: Vec::new(),
        e2e_ms: e2e,
        output_tokens: out,
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64(),
    }
}

/// A streamed answer: SSE events until `[DONE]`, each `data:` line handled by
/// [`StreamProgress::event`].
async fn streamed_answer(
    s: &Shared,
    p: &Plan,
    r: reqwest::Response,
    start: Instant,
    per_sec: &mut PerSecond,
) -> Outcome {
    let mut stream = r.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut progress = StreamProgress { start, timing: ChunkTiming::new(start), usage: None };
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return Outcome::Error(classify(&e)),
        };
        buf.extend_from_slice(&chunk);
        // SSE events end with a blank line; `\r\n\r\n` is allowed too.
        while let Some((pos, sep)) = find_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..pos + sep).collect();
            let event = String::from_utf8_lossy(&event);
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    return progress.done();
                }
                // Returning drops the stream: a planned disconnect closes the connection here.
                if let Some(end) = progress.event(s, p, data, per_sec) {
                    return end;
                }
            }
        }
    }
    Outcome::Error("incomplete_stream".into())
}

/// What a streamed answer has given so far.
struct StreamProgress {
    start: Instant,
    timing: ChunkTiming,
    /// `(prompt_tokens, completion_tokens)` of the last chunk that carried `usage`.
    usage: Option<(Option<u64>, Option<u64>)>,
}

impl StreamProgress {
    /// One `data:` payload other than `[DONE]`; `Some` when it ends the request: a body that
    /// is not JSON, an error event, or this request's planned disconnect.
    fn event(&mut self, s: &Shared, p: &Plan, data: &str, per_sec: &mut PerSecond) -> Option<Outcome> {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            return Some(Outcome::Error("bad_body".into()));
        };
        if v.get("error").is_some() {
            return Some(Outcome::Error("error_event".into()));
        }
        if v["usage"].is_object() {
            self.usage = Some((v["usage"]["prompt_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64()));
        }
        if chunk_text(&v).is_some_and(|t| !t.is_empty()) {
            let now = Instant::now();
            self.timing.chunk(now);
            per_sec.count(now);
            s.tokens.fetch_add(1, Ordering::Relaxed);
            if p.disconnect && self.timing.chunks >= u64::from(s.args.disconnect_after) {
                // Dropping the stream closes the connection: the server sees a client
                // disconnect mid-stream.
                return Some(Outcome::Disconnected);
            }
        }
        None
    }

    /// The outcome at `[DONE]`: output tokens from `usage` when the server sent it, else the
    /// chunks with text.
    fn done(self) -> Outcome {
        let e2e_ms = self.start.elapsed().as_secs_f64() * 1000.0;
        let Some(ttft_ms) = self.timing.ttft_ms else {
            // A stream that finished with no content (e.g. max_tokens reached by an empty
            // string): count it as answered with zero tokens.
            return Outcome::Ok {
                ttft_ms: e2e_ms,
                itl_ms: self.timing.itl_ms,
                e2e_ms,
                output_tokens: 0,
                prompt_tokens: None,
            };
        };
        let (pt, ct) = self.usage.unwrap_or((None, None));
        Outcome::Ok {
            ttft_ms,
            itl_ms: self.timing.itl_ms,
            e2e_ms,
            output_tokens: ct.unwrap_or(self.timing.chunks),
            prompt_tokens: pt,
        }
    }
}

fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Send request `index` and record how it ended; the refusal's `Retry-After`, if any.
async fn run_and_record(s: Arc<Shared>, index: u64) -> Option<Duration> {
    let p = plan(&s.args, &s.prompts, index);
    s.sent.fetch_add(1, Ordering::Relaxed);
    let (rec, retry_after) = one_request(&s, &p).await;
    if matches!(rec.outcome, Outcome::Error(_)) {
        s.failed.fetch_add(1, Ordering::Relaxed);
    }
    s.done.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut r) = s.records.lock() {
        r.push(rec);
    }
    retry_after
}

/// The measured phase's limits: stop sending after `requests` or at `deadline`.
struct Limits {
    requests: usize,
    deadline: Option<Instant>,
}

impl Limits {
    fn open(&self, sent: usize) -> bool {
        sent < self.requests && self.deadline.is_none_or(|d| Instant::now() < d)
    }
}

async fn closed_loop(s: Arc<Shared>, concurrency: usize, limits: Limits, index_base: u64) {
    let next = Arc::new(AtomicUsize::new(0));
    let limits = Arc::new(limits);
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (s, next, limits) = (s.clone(), next.clone(), limits.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if !limits.open(i) {
                    return;
                }
                let retry_after = run_and_record(s.clone(), index_base + i as u64).await;
                if let Some(wait) = retry_after.filter(|_| s.args.respect_retry_after) {
                    // Not past the phase's end: a refusal near it must not delay the report.
                    let until = Instant::now() + wait;
                    tokio::time::sleep_until(limits.deadline.map_or(until, |d| until.min(d)).into()).await;
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

async fn open_loop(s: Arc<Shared>, rate: f64, cap: Option<usize>, limits: Limits, index_base: u64) {
    let sem = cap.map(|c| Arc::new(tokio::sync::Semaphore::new(c.max(1))));
    let mut rng = Rng::new(s.args.seed ^ 0xA5A5_5A5A_F00D_BEEF);
    let mut tasks = Vec::new();
    let mut next_at = Instant::now();
    let mut i = 0usize;
    while limits.open(i) {
        tokio::time::sleep_until(next_at.into()).await;
        let permit = match &sem {
            Some(sem) => sem.clone().acquire_owned().await.ok(),
            None => None,
        };
        let s2 = s.clone();
        let index = index_base + i as u64;
        tasks.push(tokio::spawn(async move {
            run_and_record(s2, index).await;
            drop(permit);
        }));
        i += 1;
        // Exponential gaps: a Poisson process at `rate`.
        let gap = -(1.0 - rng.f64()).ln() / rate;
        next_at += Duration::from_secs_f64(gap);
    }
    for t in tasks {
        let _ = t.await;
    }
}

async fn first_model(client: &reqwest::Client, url: &str) -> Option<String> {
    let v: serde_json::Value = client.get(format!("{url}/v1/models")).send().await.ok()?.json().await.ok()?;
    v["data"][0]["id"].as_str().map(str::to_string)
}

/// Scraped time series of one URL, kept by series name (name plus labels).
#[derive(Debug, Default, Serialize)]
pub struct ScrapeSeries {
    pub url: String,
    pub t_s: Vec<f64>,
    pub series: BTreeMap<String, Vec<Option<f64>>>,
    pub failures: usize,
}

/// Keep the samples of a Prometheus text page whose metric name starts with one of `prefixes`
/// (histogram buckets left out: they are many series and the report has its own latencies).
pub fn parse_prometheus(text: &str, prefixes: &[String]) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, rest) = match line.rfind('}') {
            Some(i) => (&line[..=i], &line[i + 1..]),
            None => match line.split_once(char::is_whitespace) {
                Some((a, b)) => (a, b),
                None => continue,
            },
        };
        let name = series.split('{').next().unwrap_or(series);
        if name.ends_with("_bucket") || !prefixes.iter().any(|p| name.starts_with(p.as_str())) {
            continue;
        }
        if let Some(v) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) {
            out.push((series.to_string(), v));
        }
    }
    out
}

async fn scraper(
    urls: Vec<String>,
    prefixes: Vec<String>,
    interval: Duration,
    t0: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<ScrapeSeries> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap_or_default();
    let mut out: Vec<ScrapeSeries> =
        urls.iter().map(|u| ScrapeSeries { url: u.clone(), ..Default::default() }).collect();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        // One last sample after the load stopped, so the series end in the idle state.
        let last = stop.load(Ordering::SeqCst);
        for s in out.iter_mut() {
            let t = t0.elapsed().as_secs_f64();
            let text = match client.get(&s.url).send().await {
                Ok(r) => r.text().await.ok(),
                Err(_) => None,
            };
            let Some(text) = text else {
                s.failures += 1;
                continue;
            };
            let k = s.t_s.len();
            s.t_s.push(t);
            for (name, v) in parse_prometheus(&text, &prefixes) {
                let col = s.series.entry(name).or_default();
                col.resize(k, None);
                col.push(Some(v));
            }
            for col in s.series.values_mut() {
                col.resize(k + 1, None);
            }
        }
        if last {
            return out;
        }
    }
}

/// The measured outcome of a run, before it is written out.
#[derive(Debug, Serialize)]
pub struct Report {
    pub schema: &'static str,
    pub name: String,
    pub started_at_unix_s: u64,
    pub config: LoadArgs,
    pub model: Option<String>,
    pub mode: &'static str,
    pub summary: RunSummary,
    pub timeline: Timeline,
    pub cdf: BTreeMap<&'static str, Vec<[f64; 2]>>,
    pub scrape: Vec<ScrapeSeries>,
}

#[derive(Debug, Serialize)]
pub struct RunSummary {
    pub duration_s: f64,
    pub requests_sent: usize,
    pub succeeded: usize,
    pub disconnected: usize,
    pub failed: usize,
    /// Refused with 503 (an overloaded mesh: `Retry-After`, OpenAI body), included in `failed`.
    pub overloaded_503: usize,
    /// Refused with 429 (the API key's own bound, `limits.max_in_flight_per_key`), included in
    /// `failed`: the client, not the mesh, is over its share.
    pub rate_limited_429: usize,
    pub errors_by_kind: BTreeMap<String, usize>,
    pub warmup_requests: usize,
    pub warmup_failed: usize,
    pub request_throughput_rps: f64,
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    /// `usage` when every successful request carried it, else `words` (a prompt-word count).
    pub prompt_tokens_source: &'static str,
    pub output_token_throughput_tps: f64,
    pub total_token_throughput_tps: f64,
    pub ttft_ms: Summary,
    pub tpot_ms: Summary,
    pub itl_ms: Summary,
    pub e2e_ms: Summary,
    pub goodput: Option<Goodput>,
}

#[derive(Debug, Serialize)]
pub struct Goodput {
    pub slo_ttft_ms: Option<f64>,
    pub slo_tpot_ms: Option<f64>,
    pub requests_meeting_slo: usize,
    pub fraction_of_sent: f64,
    pub goodput_rps: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct Timeline {
    pub interval_s: f64,
    pub t_s: Vec<f64>,
    pub output_tokens: Vec<u64>,
    pub requests_finished: Vec<u64>,
    pub requests_failed: Vec<u64>,
}

/// At most `points` (value, cumulative fraction) pairs of the sorted samples.
fn cdf(samples: &[f64], points: usize) -> Vec<[f64; 2]> {
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return Vec::new();
    }
    let step = (n / points.max(1)).max(1);
    let mut out: Vec<[f64; 2]> = (0..n).step_by(step).map(|i| [v[i], (i + 1) as f64 / n as f64]).collect();
    if out.last().is_some_and(|l| l[1] < 1.0) {
        out.push([v[n - 1], 1.0]);
    }
    out
}

impl Timeline {
    /// One-second bins covering `duration_s` (at least one).
    fn empty(duration_s: f64) -> Self {
        let secs = duration_s.ceil().max(1.0) as usize;
        Timeline {
            interval_s: 1.0,
            t_s: (0..secs).map(|s| s as f64).collect(),
            output_tokens: vec![0; secs],
            requests_finished: vec![0; secs],
            requests_failed: vec![0; secs],
        }
    }

    /// A record's output tokens in the seconds they arrived, and its end (a success or a
    /// failure; a disconnect is neither) in the second it ended, the last bin if later.
    fn add(&mut self, r: &Record) {
        for &(sec, n) in &r.tokens_per_second {
            if let Some(x) = self.output_tokens.get_mut(sec) {
                *x += u64::from(n);
            }
        }
        let sec = (r.end_s as usize).min(self.t_s.len().saturating_sub(1));
        let bins = match r.outcome {
            Outcome::Ok { .. } => &mut self.requests_finished,
            Outcome::Error(_) => &mut self.requests_failed,
            Outcome::Disconnected => return,
        };
        if let Some(x) = bins.get_mut(sec) {
            *x += 1;
        }
    }
}

/// What a run's records add up to, before it becomes a [`RunSummary`].
#[derive(Default)]
struct Tally {
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    itl: Vec<f64>,
    e2e: Vec<f64>,
    errors: BTreeMap<String, usize>,
    succeeded: usize,
    disconnected: usize,
    output_tokens: u64,
    /// Prompt tokens by the server's `usage`; valid only if no success came without one.
    usage_prompt_tokens: u64,
    usage_missing: bool,
    prompt_words: u64,
    /// Successes within the goodput SLO.
    good: usize,
}

impl Tally {
    fn add(&mut self, a: &LoadArgs, r: &Record) {
        match &r.outcome {
            Outcome::Ok { ttft_ms, itl_ms, e2e_ms, output_tokens, prompt_tokens } => {
                self.succeeded += 1;
                self.ttft.push(*ttft_ms);
                self.e2e.push(*e2e_ms);
                self.itl.extend_from_slice(itl_ms);
                self.output_tokens += output_tokens;
                self.prompt_words += r.prompt_words as u64;
                match prompt_tokens {
                    Some(p) => self.usage_prompt_tokens += p,
                    None => self.usage_missing = true,
                }
                let per_token = time_per_output_token(a, *ttft_ms, *e2e_ms, *output_tokens);
                self.tpot.extend(per_token);
                if meets_slo(a, *ttft_ms, per_token) {
                    self.good += 1;
                }
            }
            Outcome::Disconnected => self.disconnected += 1,
            Outcome::Error(kind) => *self.errors.entry(kind.clone()).or_default() += 1,
        }
    }

    /// The prompt tokens to report and where they come from: `usage` when every success
    /// carried it, else the prompts' words.
    fn prompt_tokens(&self) -> (u64, &'static str) {
        if !self.usage_missing && self.succeeded > 0 {
            (self.usage_prompt_tokens, "usage")
        } else {
            (self.prompt_words, "words")
        }
    }

    fn cdfs(&self) -> BTreeMap<&'static str, Vec<[f64; 2]>> {
        let mut cdfs = BTreeMap::new();
        cdfs.insert("ttft_ms", cdf(&self.ttft, 200));
        cdfs.insert("tpot_ms", cdf(&self.tpot, 200));
        cdfs.insert("itl_ms", cdf(&self.itl, 200));
        cdfs.insert("e2e_ms", cdf(&self.e2e, 200));
        cdfs
    }
}

/// Time per output token after the first, ms. Without streaming the first token is not seen
/// apart from the last: no TPOT.
fn time_per_output_token(a: &LoadArgs, ttft_ms: f64, e2e_ms: f64, output_tokens: u64) -> Option<f64> {
    (output_tokens > 1 && !a.no_stream).then(|| (e2e_ms - ttft_ms) / (output_tokens - 1) as f64)
}

/// Whether a success met the goodput SLO (a bound not given always holds; so does the TPOT
/// bound for an answer without a TPOT).
fn meets_slo(a: &LoadArgs, ttft_ms: f64, per_token: Option<f64>) -> bool {
    a.slo_ttft_ms.is_none_or(|s| ttft_ms <= s) && a.slo_tpot_ms.is_none_or(|s| per_token.is_none_or(|t| t <= s))
}

/// Goodput when an SLO was given: `good` of `sent` requests met it in `duration_s`.
fn goodput(a: &LoadArgs, good: usize, sent: usize, duration_s: f64) -> Option<Goodput> {
    (a.slo_ttft_ms.is_some() || a.slo_tpot_ms.is_some()).then(|| Goodput {
        slo_ttft_ms: a.slo_ttft_ms,
        slo_tpot_ms: a.slo_tpot_ms,
        requests_meeting_slo: good,
        fraction_of_sent: if sent > 0 { good as f64 / sent as f64 } else { 0.0 },
        goodput_rps: good as f64 / duration_s,
    })
}

fn summarize_records(
    a: &LoadArgs,
    records: &[Record],
    duration_s: f64,
    sent: usize,
) -> (RunSummary, Timeline, BTreeMap<&'static str, Vec<[f64; 2]>>) {
    let mut tl = Timeline::empty(duration_s);
    let mut t = Tally::default();
    for r in records {
        tl.add(r);
        t.add(a, r);
    }
    let failed = t.errors.values().sum();
    let (overloaded_503, rate_limited_429) = refusals(&t.errors);
    let (prompt_total, source) = t.prompt_tokens();
    let d = duration_s.max(1e-9);
    let cdfs = t.cdfs();
    let summary = RunSummary {
        duration_s,
        requests_sent: sent,
        succeeded: t.succeeded,
        disconnected: t.disconnected,
        failed,
        overloaded_503,
        rate_limited_429,
        errors_by_kind: t.errors,
        warmup_requests: 0,
        warmup_failed: 0,
        request_throughput_rps: t.succeeded as f64 / d,
        output_tokens: t.output_tokens,
        prompt_tokens: prompt_total,
        prompt_tokens_source: source,
        output_token_throughput_tps: t.output_tokens as f64 / d,
        total_token_throughput_tps: (t.output_tokens + prompt_total) as f64 / d,
        ttft_ms: summarize(&t.ttft),
        tpot_ms: summarize(&t.tpot),
        itl_ms: summarize(&t.itl),
        e2e_ms: summarize(&t.e2e),
        goodput: goodput(a, t.good, sent, d),
    };
    (summary, tl, cdfs)
}

/// 503s and 429s among the errors, clean or not (a body that is not an OpenAI error is its own
/// kind, `http_<status>_bad_body`, but the status still says who refused).
fn refusals(errors: &BTreeMap<String, usize>) -> (usize, usize) {
    let count = |status: &str| {
        errors
            .iter()
            .filter(|(k, _)| k.strip_prefix("http_").is_some_and(|rest| rest.split('_').next() == Some(status)))
            .map(|(_, n)| n)
            .sum()
    };
    (count("503"), count("429"))
}

fn progress(s: Arc<Shared>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last_tokens = 0;
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (sent, done, failed) =
                (s.sent.load(Ordering::Relaxed), s.done.load(Ordering::Relaxed), s.failed.load(Ordering::Relaxed));
            let tokens = s.tokens.load(Ordering::Relaxed);
            eprint!(
                "\r[{:6.1} s] sent {sent} done {done} failed {failed} in flight {} | {} tok/s   ",
                s.t0.elapsed().as_secs_f64(),
                sent.saturating_sub(done),
                tokens - last_tokens
            );
            last_tokens = tokens;
        }
        eprintln!();
    })
}

/// Refuse flag combinations that cannot run.
fn check_args(a: &LoadArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.rate.is_none_or(|r| r > 0.0), "--rate must be positive");
    anyhow::ensure!((0.0..=1.0).contains(&a.disconnect_fraction), "--disconnect-fraction must lie in [0, 1]");
    anyhow::ensure!(!(a.no_stream && a.disconnect_fraction > 0.0), "disconnects need streaming");
    Ok(())
}

/// The run's HTTP client: `cap` is the concurrency (0: open loop without a cap), which sizes
/// the pool of kept-alive connections unless `--fresh-connections` turns it off.
fn http_client(a: &LoadArgs, cap: usize) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .default_headers(default_headers(a.api_key.as_ref())?)
        .tcp_nodelay(true)
        .pool_max_idle_per_host(if a.fresh_connections { 0 } else { cap.max(64) })
        .timeout(Duration::from_secs_f64(a.request_timeout_s))
        .build()?)
}

/// Warmup: its own phase, so no warmup request overlaps the measured window. Returns how many
/// warmup requests failed.
async fn warm_up(w: Arc<Shared>, requests: usize, cap: usize) -> usize {
    let c = if cap == 0 { 8 } else { cap };
    // Indices past any measured request's, so warmup does not replay the measured prompts.
    closed_loop(w.clone(), c, Limits { requests, deadline: None }, u64::MAX / 2).await;
    w.failed.load(Ordering::Relaxed)
}

/// Start scraping `--scrape` pages (when any) from `t0` until `stop`.
fn start_scraper(
    a: &LoadArgs,
    t0: Instant,
    stop: &Arc<AtomicBool>,
) -> Option<tokio::task::JoinHandle<Vec<ScrapeSeries>>> {
    let mut prefixes: Vec<String> = DEFAULT_SCRAPE_PREFIXES.iter().map(|p| p.to_string()).collect();
    prefixes.extend(a.scrape_metric.iter().cloned());
    (!a.scrape.is_empty()).then(|| {
        tokio::spawn(scraper(
            a.scrape.clone(),
            prefixes,
            Duration::from_millis(a.scrape_interval_ms.max(50)),
            t0,
            stop.clone(),
        ))
    })
}

/// The measured phase, open loop with `--rate`, else closed loop; returns the report's mode.
async fn measure(s: Arc<Shared>, cap: usize, limits: Limits) -> &'static str {
    match s.args.rate {
        Some(rate) => {
            open_loop(s, rate, (cap > 0).then_some(cap), limits, 0).await;
            "open_loop_poisson"
        }
        None => {
            closed_loop(s, cap, limits, 0).await;
            "closed_loop"
        }
    }
}

/// The report's label: `--name`, else the last component of `--out-dir`, else `run`.
fn report_name(a: &LoadArgs) -> String {
    a.name
        .clone()
        .or_else(|| a.out_dir.as_ref().and_then(|d| d.file_name()).map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "run".into())
}

/// The summary on stderr; the report's files into `--out-dir`, else its JSON on stdout.
fn write_report(a: &LoadArgs, report: &Report) -> anyhow::Result<()> {
    let md = report::markdown(report);
    eprintln!("{md}");
    if let Some(dir) = &a.out_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(report)?)?;
        std::fs::write(dir.join("summary.md"), md)?;
        std::fs::write(dir.join("latency_cdf.svg"), report::cdf_svg(report))?;
        std::fs::write(dir.join("timeline.svg"), report::timeline_svg(report))?;
        eprintln!("wrote {}/{{report.json,summary.md,latency_cdf.svg,timeline.svg}}", dir.display());
    } else {
        println!("{}", serde_json::to_string_pretty(report)?);
    }
    Ok(())
}

pub async fn run(a: LoadArgs) -> anyhow::Result<()> {
    check_args(&a)?;
    let prompts = load_prompts(a.prompts.as_ref())?;
    let url = a.url.trim_end_matches('/').to_string();
    let cap = a.concurrency.unwrap_or(if a.rate.is_some() { 0 } else { 8 });
    let client = http_client(&a, cap)?;
    let model = match &a.model {
        Some(m) => Some(m.clone()),
        None => first_model(&client, &url).await,
    };
    let path = match a.endpoint {
        Endpoint::Completions => "/v1/completions",
        Endpoint::Chat => "/v1/chat/completions",
    };
    let requests = a.requests.unwrap_or(if a.duration.is_some() { usize::MAX } else { 64 });
    let started_at_unix_s =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let new_shared = |t0| {
        Arc::new(Shared {
            client: client.clone(),
            endpoint_url: format!("{url}{path}"),
            model: model.clone(),
            args: a.clone(),
            prompts: prompts.clone(),
            t0,
            records: Mutex::new(Vec::new()),
            sent: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            tokens: AtomicU64::new(0),
        })
    };
    let warmup_failed = if a.warmup > 0 { warm_up(new_shared(Instant::now()), a.warmup, cap).await } else { 0 };

    let t0 = Instant::now();
    let s = new_shared(t0);
    let stop = Arc::new(AtomicBool::new(false));
    let scrape = start_scraper(&a, t0, &stop);
    let prog = a.progress.then(|| progress(s.clone(), stop.clone()));
    let limits = Limits { requests, deadline: a.duration.map(|d| t0 + Duration::from_secs_f64(d)) };
    let mode = measure(s.clone(), cap, limits).await;
    let duration_s = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    if let Some(p) = prog {
        let _ = p.await;
    }
    let scrape = match scrape {
        Some(h) => h.await.unwrap_or_default(),
        None => Vec::new(),
    };
    let records = std::mem::take(&mut *s.records.lock().map_err(|_| anyhow::anyhow!("records lock poisoned"))?);
    let sent = records.len();
    let (mut summary, timeline, cdf) = summarize_records(&a, &records, duration_s, sent);
    summary.warmup_requests = a.warmup;
    summary.warmup_failed = warmup_failed;
    let report = Report {
        schema: "pdmesh-load/run/v1",
        name: report_name(&a),
        started_at_unix_s,
        config: a.clone(),
        model,
        mode,
        summary,
        timeline,
        cdf,
        scrape,
    };
    write_report(&a, &report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn len_spec_parses_fixed_and_ranges() {
        let f: LenSpec = "64".parse().unwrap();
        assert_eq!((f.min, f.max), (64, 64));
        let r: LenSpec = "16-128".parse().unwrap();
        assert_eq!((r.min, r.max), (16, 128));
        assert!("9-3".parse::<LenSpec>().is_err());
        assert!("0".parse::<LenSpec>().is_err());
    }

    #[test]
    fn only_openai_error_objects_are_clean_refusals() {
        assert!(is_openai_error(br#"{"error": {"message": "too long", "type": "invalid_request_error"}}"#));
        for bad in [&b""[..], b"<html>502 Bad Gateway</html>", br#"{"error": "x"}"#, br#"{"error": {"messa"#] {
            assert!(!is_openai_error(bad), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_refusal_without_retry_after_is_its_own_kind() {
        let body = br#"{"error": {"message": "busy", "type": "service_unavailable"}}"#;
        assert_eq!(refusal_kind(503, true, body), "http_503");
        assert_eq!(refusal_kind(503, false, body), "http_503_no_retry_after");
        assert_eq!(refusal_kind(429, false, body), "http_429_no_retry_after");
        assert_eq!(refusal_kind(400, false, body), "http_400", "only 503 and 429 must say when to retry");
        assert_eq!(refusal_kind(503, false, b"<html>"), "http_503_bad_body_no_retry_after");
        let mut headers = reqwest::header::HeaderMap::new();
        assert_eq!(retry_after_s(&headers), None);
        headers.insert(reqwest::header::RETRY_AFTER, reqwest::header::HeaderValue::from_static("1"));
        assert_eq!(retry_after_s(&headers), Some(1));
        headers.insert(reqwest::header::RETRY_AFTER, reqwest::header::HeaderValue::from_static("soon"));
        assert_eq!(retry_after_s(&headers), None);
    }

    #[test]
    fn shipped_prompts_load_and_vary() {
        let p = load_prompts(None).unwrap();
        assert!(p.len() >= 30);
        let distinct: std::collections::HashSet<_> = p.iter().collect();
        assert_eq!(distinct.len(), p.len());
    }

    #[test]
    fn prometheus_text_keeps_wanted_series_only() {
        let text = "# HELP x\npdmesh_engine_kv_held_blocks 3\npdmesh_engine_kv_used_blocks{rank=\"0\"} 5\nfoo 1\npdmesh_engine_kv_held_blocks_bucket{le=\"1\"} 2\n";
        let got = parse_prometheus(text, &["pdmesh_engine_kv".to_string()]);
        assert_eq!(
            got,
            vec![
                ("pdmesh_engine_kv_held_blocks".to_string(), 3.0),
                ("pdmesh_engine_kv_used_blocks{rank=\"0\"}".to_string(), 5.0)
            ]
        );
    }

    #[test]
    fn input_lengths_are_met_in_words() {
        let prompts = load_prompts(None).unwrap();
        let a = LoadArgs::try_parse_from_for_test(&["--input-len", "300", "--output-len", "5-9"]);
        for i in 0..20 {
            let p = plan(&a, &prompts, i);
            assert_eq!(p.prompt_words, 300);
            assert!((5..=9).contains(&p.max_tokens));
        }
    }

    #[test]
    fn tpot_and_goodput_follow_the_slo() {
        let a = LoadArgs::try_parse_from_for_test(&["--slo-ttft-ms", "10", "--slo-tpot-ms", "2"]);
        let rec = |ttft: f64, e2e: f64, n: u64| Record {
            outcome: Outcome::Ok { ttft_ms: ttft, itl_ms: vec![], e2e_ms: e2e, output_tokens: n, prompt_tokens: None },
            prompt_words: 4,
            tokens_per_second: vec![(0, n as u32)],
            end_s: 0.5,
        };
        // tpot 1 ms (meets), ttft 20 ms (misses), tpot 5 ms (misses), then one HTTP error.
        let recs = vec![
            rec(5.0, 14.0, 10),
            rec(20.0, 29.0, 10),
            rec(5.0, 50.0, 10),
            Record {
                outcome: Outcome::Error("http_503".into()),
                prompt_words: 4,
                tokens_per_second: vec![],
                end_s: 0.9,
            },
        ];
        let (s, tl, _) = summarize_records(&a, &recs, 1.0, 4);
        let g = s.goodput.unwrap();
        assert_eq!(g.requests_meeting_slo, 1);
        assert_eq!(s.errors_by_kind.get("http_503"), Some(&1));
        assert_eq!(s.output_tokens, 30);
        assert_eq!(tl.output_tokens, vec![30]);
        assert!((s.tpot_ms.p50_ms - 1.0).abs() < 1e-9);
    }

    #[test]
    fn rate_limited_429s_are_counted_apart_from_overloaded_503s() {
        let a = LoadArgs::try_parse_from_for_test(&[]);
        let err = |kind: &str| Record {
            outcome: Outcome::Error(kind.into()),
            prompt_words: 1,
            tokens_per_second: vec![],
            end_s: 0.1,
        };
        let recs = vec![err("http_429"), err("http_429"), err("http_429_bad_body"), err("http_503"), err("transport")];
        let (s, _, _) = summarize_records(&a, &recs, 1.0, 5);
        assert_eq!((s.rate_limited_429, s.overloaded_503, s.failed), (3, 1, 5));
        let md = report::markdown(&Report {
            schema: "pdmesh-load/run/v1",
            name: "t".into(),
            started_at_unix_s: 0,
            config: a.clone(),
            model: None,
            mode: "closed_loop",
            summary: s,
            timeline: Timeline::default(),
            cdf: BTreeMap::new(),
            scrape: vec![],
        });
        assert!(md.contains("| refused: 503 overloaded / 429 rate limited | 1 / 3 |"), "{md}");
    }

    #[test]
    fn the_api_key_is_sent_but_never_shown_or_reported() {
        let a = LoadArgs::try_parse_from_for_test(&["--api-key", "sk-secret-1"]);
        let headers = default_headers(a.api_key.as_ref()).unwrap();
        assert_eq!(headers[reqwest::header::AUTHORIZATION], "Bearer sk-secret-1");
        assert!(headers[reqwest::header::AUTHORIZATION].is_sensitive());
        assert!(!format!("{a:?}").contains("sk-secret-1"), "Debug redacts the key");
        let json = serde_json::to_string(&a).unwrap();
        assert!(
            !json.contains("sk-secret-1") && !json.contains("api_key"),
            "the report's config leaves it out: {json}"
        );
        let none = LoadArgs::try_parse_from_for_test(&[]);
        if std::env::var_os("PDMESH_LOAD_API_KEY").is_none() {
            assert!(none.api_key.is_none());
            assert!(default_headers(None).unwrap().is_empty(), "no key, no Authorization header");
        }
        assert!(W::parse(&["--api-key", " "]).is_err(), "an empty key is refused");
    }

    #[test]
    fn cdf_is_monotonic_ends_at_one_and_is_bounded() {
        let samples: Vec<f64> = (0..1000).map(|i| ((i * 37) % 1000) as f64).collect();
        let c = cdf(&samples, 200);
        assert!(c.len() <= 201);
        assert!(c.windows(2).all(|w| w[0][0] <= w[1][0] && w[0][1] < w[1][1]));
        assert_eq!(c.last().unwrap()[1], 1.0);
        assert!(cdf(&[], 200).is_empty());
    }

    #[test]
    fn report_renders_with_and_without_samples() {
        let a = LoadArgs::try_parse_from_for_test(&["--slo-ttft-ms", "10"]);
        for recs in [
            vec![],
            vec![Record {
                outcome: Outcome::Ok {
                    ttft_ms: 2.0,
                    itl_ms: vec![0.5, 0.7],
                    e2e_ms: 3.2,
                    output_tokens: 3,
                    prompt_tokens: Some(9),
                },
                prompt_words: 2,
                tokens_per_second: vec![(0, 3)],
                end_s: 0.1,
            }],
        ] {
            let n = recs.len();
            let (summary, timeline, cdf) = summarize_records(&a, &recs, 0.5, n);
            let mut series = BTreeMap::new();
            series.insert("pdmesh_engine_kv_held_blocks".to_string(), vec![Some(3.0), None, Some(0.0)]);
            let r = Report {
                schema: "pdmesh-load/run/v1",
                name: "t".into(),
                started_at_unix_s: 0,
                config: a.clone(),
                model: None,
                mode: "closed_loop",
                summary,
                timeline,
                cdf,
                scrape: vec![ScrapeSeries {
                    url: "http://x/metrics".into(),
                    t_s: vec![0.0, 1.0, 2.0],
                    series,
                    failures: 0,
                }],
            };
            let md = report::markdown(&r);
            assert!(md.contains("| TTFT |"));
            for svg in [report::cdf_svg(&r), report::timeline_svg(&r)] {
                assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
                assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
            }
            let json = serde_json::to_value(&r).unwrap();
            assert_eq!(json["summary"]["requests_sent"], n);
        }
    }

    #[derive(clap::Parser)]
    struct W {
        #[command(flatten)]
        a: LoadArgs,
    }

    impl W {
        fn parse(extra: &[&str]) -> Result<LoadArgs, clap::Error> {
            use clap::Parser;
            let mut argv = vec!["x"];
            argv.extend_from_slice(extra);
            W::try_parse_from(argv).map(|w| w.a)
        }
    }

    impl LoadArgs {
        fn try_parse_from_for_test(extra: &[&str]) -> LoadArgs {
            W::parse(extra).unwrap()
        }
    }
}
