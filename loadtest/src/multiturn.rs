//! `pdmesh-load multiturn`: multi-turn chat on P/D meshes, prefix caching off versus on, side
//! by side in one run.
//!
//! Workload: `conversations` chats of `turns` turns each, every one opening with the same
//! system prompt (about `system_words` tokens). Turn `t` of a conversation sends the whole
//! history so far (system, the earlier user turns and the answers this mesh gave) plus a new
//! user message, greedy, streaming. This is what real chat traffic looks like to a server:
//! each turn's prompt is the previous turn's prompt plus a little.
//!
//! Meshes, all up at once, each a router over two prefill and two decode nodes of the same
//! model and pool size (one variant per `--variants` entry):
//! - `off`: prefix caching off on every node: every turn prefills its whole history and D
//!   reads every block;
//! - `rr`: prefix caching on, the router picking round-robin;
//! - `aware`: prefix caching on, the router picking `cache_aware` (D59): it tokenises each
//!   prompt with the model's tokenizer and sends it to the P and the D holding most of it;
//! - `ll`: prefix caching on, the router picking `least_loaded` (load only).
//!
//! `off` routes `least_loaded` (the policy before D59), so its numbers stay comparable.
//!
//! Each turn index is served on every mesh in turn (the order rotates), so all meshes see the
//! same machine load. Reported per mesh: TTFT p50/p99 of turns ≥ 2, prompt tokens the workers
//! computed, KV bytes D read from P (workers' `pdmesh_worker_tokens_computed_total` and
//! `pdmesh_worker_kv_transfer_bytes_total`, scraped around that mesh's own phases),
//! `usage.prompt_tokens_details.cached_tokens` summed, and how many answers differ from the
//! `off` mesh (greedy: none should).

use pdmesh_test_support::topology::{
    self, KvLoadFailurePolicy, KvRole, NodeConfig, NodeExt as _, NodeRole, RoutingPolicy, Topology,
};
use pdmesh_test_support::Ready;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;
use serde_json::{json, Value};

#[derive(Args, Clone)]
pub struct MultiturnArgs {
    #[arg(long, default_value_t = 20)]
    pub conversations: usize,
    #[arg(long, default_value_t = 5)]
    pub turns: usize,
    /// Length of the shared system prompt in words (about one token each).
    #[arg(long, default_value_t = 300)]
    pub system_words: usize,
    /// Length of each new user message in words.
    #[arg(long, default_value_t = 24)]
    pub user_words: usize,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Conversations served at once on a mesh.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Meshes to compare: `off` (no prefix caching), `rr` (caching, round-robin router),
    /// `aware` (caching, cache-aware router), `ll` (caching, least-loaded router).
    #[arg(long, value_delimiter = ',', default_value = "off,rr")]
    pub variants: Vec<String>,
    /// KV blocks per rank on every node.
    #[arg(long, default_value_t = 512)]
    pub num_blocks: u32,
    /// The model (GGUF); default: a synthetic executor (`--per-token-cost-us` per token).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = 200)]
    pub per_token_cost_us: u64,
    /// The pdmesh binary (default: next to this one).
    #[arg(long)]
    pub pdmesh: Option<PathBuf>,
    #[arg(long)]
    pub out: Option<PathBuf>,
}

const BLOCK_SIZE: u32 = 16;
const WORDS: [&str; 24] = [
    "river", "stone", "garden", "lantern", "harbor", "meadow", "copper", "violet", "engine", "window", "forest",
    "signal", "market", "orbit", "canvas", "winter", "bridge", "candle", "falcon", "island", "pepper", "thunder",
    "velvet", "maple",
];

fn words(n: usize, seed: usize) -> String {
    let mut s = String::new();
    for w in 0..n {
        s.push_str(WORDS[(w * 7 + seed * 5 + w / 3) % WORDS.len()]);
        s.push(if w % 12 == 11 { '.' } else { ' ' });
    }
    s.trim_end().to_string()
}

fn system_prompt(n: usize) -> String {
    format!(
        "You are the archivist of a coastal town. Answer briefly and in plain words. The archive index follows: {}.",
        words(n, 0)
    )
}

fn user_message(conversation: usize, turn: usize, n: usize) -> String {
    format!("Visitor {conversation}, question {turn}: tell me about {}?", words(n, 1 + conversation * 13 + turn))
}

/// One mesh under test: its router and the metrics pages of its four workers.
struct Mesh {
    name: String,
    url: String,
    workers: Vec<String>,
    decode_workers: Vec<String>,
}

/// Ops ports start at `base_port + 100`; rank 0's worker is at `+112` (as `offload` uses).
const WORKER_OPS_OFFSET: u16 = 112;

fn topology(a: &MultiturnArgs, http: u16, base: u16, side: u16) -> (Topology, Vec<Mesh>) {
    let with_model = |n: NodeConfig| match &a.model {
        Some(p) => n.gguf(p),
        None => n.synthetic(a.per_token_cost_us),
    };
    let mut nodes = Vec::new();
    let mut meshes = Vec::new();
    for (v, variant) in a.variants.iter().enumerate() {
        let caching = variant != "off";
        let policy = match variant.as_str() {
            "rr" => RoutingPolicy::RoundRobin,
            "aware" => RoutingPolicy::CacheAware,
            _ => RoutingPolicy::LeastLoaded,
        };
        let h = http + (v as u16) * 10;
        let b = base + (v as u16) * 1000;
        let s = side + (v as u16) * 10;
        let p_urls = [topology::url(h + 1), topology::url(h + 2)];
        let d_urls = [topology::url(h + 3), topology::url(h + 4)];
        let router = topology::router(&format!("router-{variant}"), h, b, &p_urls, &d_urls).policy(policy);
        // A cache-aware router tokenises prompts with the nodes' own model.
        nodes.push(if policy == RoutingPolicy::CacheAware { with_model(router) } else { router });
        let mut workers = Vec::new();
        let mut decode_workers = Vec::new();
        for (i, (role, suffix)) in
            [(NodeRole::Prefill, "pa"), (NodeRole::Prefill, "pb"), (NodeRole::Decode, "da"), (NodeRole::Decode, "db")]
                .into_iter()
                .enumerate()
        {
            let name = format!("{variant}-{suffix}");
            let node_base = b + 200 * (i as u16 + 1);
            let decode = role == NodeRole::Decode;
            let mut kv = topology::kv_defaults(if decode { KvRole::KvConsumer } else { KvRole::KvProducer });
            kv.engine_id = name.clone();
            kv.side_channel_port = s + i as u16;
            if decode {
                kv.kv_load_failure_policy = KvLoadFailurePolicy::Recompute;
            }
            let node = with_model(topology::node(&name, role, h + 1 + i as u16, node_base)).kv(kv).engine(|e| {
                e.block_size = BLOCK_SIZE;
                e.num_blocks = a.num_blocks;
                e.max_num_seqs = 32;
                e.max_num_batched_tokens = 1024;
                e.max_model_len = 4096;
                e.enable_prefix_caching = caching;
            });
            nodes.push(node);
            let metrics = format!("http://127.0.0.1:{}/metrics", node_base + WORKER_OPS_OFFSET);
            if decode {
                decode_workers.push(metrics.clone());
            }
            workers.push(metrics);
        }
        meshes.push(Mesh { name: variant.clone(), url: format!("http://127.0.0.1:{h}"), workers, decode_workers });
    }
    (topology::topology(nodes), meshes)
}

async fn scrape_all(urls: &[String], name: &str) -> f64 {
    let mut sum = 0.0;
    for u in urls {
        sum += crate::client::scrape(u, name).await;
    }
    sum
}

/// What one streamed turn gave back.
struct Turn {
    ttft_ms: f64,
    text: String,
    cached_tokens: u64,
    prompt_tokens: u64,
}

async fn chat_turn(client: &reqwest::Client, url: &str, messages: &[Value], max_tokens: u32) -> anyhow::Result<Turn> {
    let body = json!({
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let r = client.post(format!("{url}/v1/chat/completions")).json(&body).send().await?;
    if !r.status().is_success() {
        let status = r.status();
        anyhow::bail!("{url}: status {status}: {}", r.text().await.unwrap_or_default());
    }
    let mut bytes = r.bytes_stream();
    let mut buf = String::new();
    let mut turn = Turn { ttft_ms: f64::NAN, text: String::new(), cached_tokens: 0, prompt_tokens: 0 };
    while let Some(chunk) = bytes.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(pos) = buf.find("\n\n") {
            let event: String = buf.drain(..pos + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                return Ok(turn);
            }
            let v: Value = serde_json::from_str(data)?;
            if v.get("error").is_some() {
                anyhow::bail!("{url}: error event: {v}");
            }
            if let Some(t) = v["choices"][0]["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
                if turn.text.is_empty() {
                    turn.ttft_ms = start.elapsed().as_secs_f64() * 1000.0;
                }
                turn.text.push_str(t);
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                turn.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                turn.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            }
        }
    }
    Ok(turn)
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    let i = ((s.len() as f64 - 1.0) * p).round() as usize;
    s[i.min(s.len() - 1)]
}

#[derive(Default)]
struct Tally {
    ttft_later_turns: Vec<f64>,
    ttft_first_turn: Vec<f64>,
    tokens_computed: f64,
    tokens_computed_later_turns: f64,
    kv_bytes: f64,
    kv_bytes_later_turns: f64,
    prompt_tokens: u64,
    cached_tokens: u64,
    differs_from_first: usize,
}

impl Tally {
    /// One mesh's answers to turn `turn` (0-based), with its workers' `(tokens computed, KV
    /// bytes moved)` read before and after them.
    fn add_turn(&mut self, turn: usize, answers: &[Turn], before: (f64, f64), after: (f64, f64)) {
        for t in answers {
            if turn == 0 {
                self.ttft_first_turn.push(t.ttft_ms);
            } else {
                self.ttft_later_turns.push(t.ttft_ms);
            }
            self.prompt_tokens += t.prompt_tokens;
            self.cached_tokens += t.cached_tokens;
        }
        self.tokens_computed += after.0 - before.0;
        self.kv_bytes += after.1 - before.1;
        if turn > 0 {
            self.tokens_computed_later_turns += after.0 - before.0;
            self.kv_bytes_later_turns += after.1 - before.1;
        }
    }
}

/// What every turn is sent with: the client, the bound on conversations served at once, the
/// answers' length.
struct Chat {
    client: reqwest::Client,
    sem: Arc<tokio::sync::Semaphore>,
    max_tokens: u32,
}

/// A mesh's workers' prompt tokens computed and its decode workers' KV bytes read from P.
async fn worker_counters(mesh: &Mesh) -> (f64, f64) {
    (
        scrape_all(&mesh.workers, "pdmesh_worker_tokens_computed_total").await,
        scrape_all(&mesh.decode_workers, "pdmesh_worker_kv_transfer_bytes_total").await,
    )
}

/// Send every conversation's history to `mesh` at once (at most `--concurrency` in flight);
/// the answers in conversation order.
async fn serve_histories(chat: &Chat, mesh: &Mesh, histories: &[Vec<Value>]) -> anyhow::Result<Vec<Turn>> {
    let mut tasks = Vec::new();
    for h in histories {
        let (client, url, messages, sem) = (chat.client.clone(), mesh.url.clone(), h.clone(), chat.sem.clone());
        let max_tokens = chat.max_tokens;
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await?;
            chat_turn(&client, &url, &messages, max_tokens).await
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await??);
    }
    Ok(answers)
}

/// Turn `turn` of every conversation on one mesh: the new user messages and this mesh's
/// answers appended to its `histories`, the figures to its `tally`; the answers' texts.
async fn mesh_turn(
    chat: &Chat,
    mesh: &Mesh,
    histories: &mut [Vec<Value>],
    tally: &mut Tally,
    turn: usize,
    user_words: usize,
) -> anyhow::Result<Vec<String>> {
    for (c, h) in histories.iter_mut().enumerate() {
        h.push(json!({"role": "user", "content": user_message(c, turn, user_words)}));
    }
    let before = worker_counters(mesh).await;
    let answers = serve_histories(chat, mesh, histories).await?;
    let after = worker_counters(mesh).await;
    tally.add_turn(turn, &answers, before, after);
    let texts: Vec<String> = answers.into_iter().map(|t| t.text).collect();
    for (h, text) in histories.iter_mut().zip(&texts) {
        h.push(json!({"role": "assistant", "content": text}));
    }
    Ok(texts)
}

/// One report row per mesh; ratios are to the first mesh's figures.
fn mesh_rows(meshes: &[Mesh], tallies: &[Tally]) -> Vec<Value> {
    let Some(base) = tallies.first() else { return Vec::new() };
    meshes
        .iter()
        .zip(tallies)
        .map(|(m, t)| {
            json!({
                "mesh": m.name,
                "ttft_turn1_p50_ms": percentile(&t.ttft_first_turn, 0.5),
                "ttft_later_turns_p50_ms": percentile(&t.ttft_later_turns, 0.5),
                "ttft_later_turns_p99_ms": percentile(&t.ttft_later_turns, 0.99),
                "ttft_later_turns_p50_ratio": percentile(&t.ttft_later_turns, 0.5) / percentile(&base.ttft_later_turns, 0.5),
                "tokens_computed": t.tokens_computed,
                "tokens_computed_later_turns": t.tokens_computed_later_turns,
                "tokens_computed_later_turns_ratio": t.tokens_computed_later_turns / base.tokens_computed_later_turns,
                "kv_bytes_moved": t.kv_bytes,
                "kv_bytes_moved_later_turns": t.kv_bytes_later_turns,
                "kv_bytes_moved_ratio": t.kv_bytes / base.kv_bytes,
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "answers_differing_from_first_mesh": t.differs_from_first,
            })
        })
        .collect()
}

pub async fn run(a: MultiturnArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!a.variants.is_empty(), "--variants names no mesh");
    if let Some(v) = a.variants.iter().find(|v| !["off", "rr", "aware", "ll"].contains(&v.as_str())) {
        anyhow::bail!("unknown variant {v:?}: the variants are off, rr, aware, ll");
    }
    let pdmesh = crate::client::pdmesh_binary(a.pdmesh.as_deref())?;
    let run_dir = std::env::temp_dir().join(format!("pdmesh-multiturn-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir)?;
    let slot = (std::process::id() % 8) as u16;
    let (http, base, side) = (19600 + slot * 40, 30000 + slot * 3000 % 24000, 5800 + slot * 40);
    let (topo, meshes) = topology(&a, http, base, side);
    let routers = (0..meshes.len() as u16).map(|v| Ready::Router(http + v * 10)).collect();
    let _up =
        crate::client::start_mesh(&pdmesh, topo, &run_dir, "multiturn.toml", "warn", routers, Duration::from_secs(300))
            .await?;
    let chat = Chat {
        client: reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?,
        sem: Arc::new(tokio::sync::Semaphore::new(a.concurrency.max(1))),
        max_tokens: a.max_tokens,
    };
    let system = system_prompt(a.system_words);
    // histories[mesh][conversation]: the messages so far, with this mesh's own answers.
    let mut histories: Vec<Vec<Vec<Value>>> = meshes
        .iter()
        .map(|_| (0..a.conversations).map(|_| vec![json!({"role": "system", "content": system})]).collect())
        .collect();
    let mut tallies: Vec<Tally> = meshes.iter().map(|_| Tally::default()).collect();
    for turn in 0..a.turns {
        let mut answers: Vec<Vec<String>> = vec![Vec::new(); meshes.len()];
        for k in 0..meshes.len() {
            let m = (k + turn) % meshes.len();
            answers[m] = mesh_turn(&chat, &meshes[m], &mut histories[m], &mut tallies[m], turn, a.user_words).await?;
        }
        for (m, given) in answers.iter().enumerate().skip(1) {
            tallies[m].differs_from_first += given.iter().zip(&answers[0]).filter(|(x, y)| x != y).count();
        }
        eprintln!("turn {} done", turn + 1);
    }
    let report = json!({
        "model": a.model.as_ref().map_or("synthetic".to_string(), |p| p.display().to_string()),
        "conversations": a.conversations,
        "turns": a.turns,
        "system_words": a.system_words,
        "user_words": a.user_words,
        "max_tokens": a.max_tokens,
        "concurrency": a.concurrency,
        "num_blocks": a.num_blocks,
        "meshes": mesh_rows(&meshes, &tallies),
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(out) = &a.out {
        std::fs::write(out, &text)?;
    }
    let differing: usize = tallies.iter().map(|t| t.differs_from_first).sum();
    if differing > 0 {
        anyhow::bail!("{differing} greedy answers differ between meshes");
    }
    Ok(())
}
