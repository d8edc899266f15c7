//! `pdmesh-load offload`: host-memory KV offload on versus off, side by side in one mesh (two
//! colocated nodes with the same model and KV pool, one with `OffloadConnector`).
//!
//! Workload: `prompts` distinct long prompts, each served once (first visit), then all of
//! them again in the same order (revisit). The device pool holds only a few prompts, so by
//! the time a prompt is revisited its blocks were reused by the others: without offload it is
//! prefilled again, with offload its full blocks load from the CPU store. Every request goes
//! to both nodes, one after the other (the order alternates), so both see the same machine
//! load. Reported: TTFT per phase and node, prefilled tokens per phase and node (the workers'
//! `pdmesh_worker_tokens_computed_total`), store hits, and whether the greedy outputs agree.

use pdmesh_test_support::topology::{self, NodeExt as _};
use pdmesh_test_support::Ready;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;

#[derive(Args, Clone)]
pub struct OffloadArgs {
    /// Distinct prompts (the device pool holds `pool_prompts` of them).
    #[arg(long, default_value_t = 8)]
    pub prompts: usize,
    /// Approximate prompt length in words (about one token each).
    #[arg(long, default_value_t = 240)]
    pub prompt_words: usize,
    #[arg(long, default_value_t = 4)]
    pub max_tokens: u32,
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

/// Prompt `i`: a distinct opening, then enough varied words.
fn prompt(i: usize, words: usize) -> String {
    const WORDS: [&str; 16] = [
        "river", "stone", "garden", "lantern", "harbor", "meadow", "copper", "violet", "engine", "window", "forest",
        "signal", "market", "orbit", "canvas", "winter",
    ];
    let mut s = format!("Report {i} of the survey, section {}. ", i * 7 + 3);
    for w in 0..words {
        s.push_str(WORDS[(w * 7 + i * 3 + w / 5) % WORDS.len()]);
        s.push(if w % 12 == 11 { '.' } else { ' ' });
    }
    s.push_str("\nSummary:");
    s
}

/// One streaming completion: (TTFT ms, text).
async fn stream(client: &reqwest::Client, url: &str, prompt: &str, max_tokens: u32) -> anyhow::Result<(f64, String)> {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true});
    let start = Instant::now();
    let r = client.post(format!("{url}/v1/completions")).json(&body).send().await?;
    if !r.status().is_success() {
        anyhow::bail!("{url}: status {}", r.status());
    }
    let mut bytes = r.bytes_stream();
    let (mut buf, mut text, mut ttft) = (String::new(), String::new(), None);
    while let Some(chunk) = bytes.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(pos) = buf.find("\n\n") {
            let event: String = buf.drain(..pos + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                return Ok((ttft.unwrap_or(f64::NAN), text));
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            if let Some(t) = v["choices"][0]["text"].as_str().filter(|t| !t.is_empty()) {
                ttft.get_or_insert_with(|| start.elapsed().as_secs_f64() * 1000.0);
                text.push_str(t);
            }
        }
    }
    Ok((ttft.unwrap_or(f64::NAN), text))
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

#[derive(Default)]
struct Phase {
    ttft: [Vec<f64>; 2],
    prefilled: [f64; 2],
}

/// `(max_model_len, num_blocks)`: a pool that holds one request of the longest prompt's bytes
/// (an upper bound on its tokens; a few of the real model's prompts, one synthetic prompt):
/// well short of all prompts, so a revisited prompt's blocks were reused in between.
fn pool_size(prompts: &[String], max_tokens: u32) -> (u32, u32) {
    let longest = prompts.iter().map(String::len).max().unwrap_or(0) as u32 + max_tokens;
    let max_model_len = longest.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    (max_model_len, max_model_len / BLOCK_SIZE)
}

/// Two colocated nodes with the model and the pool: `off` at `http`, and `on` at `http + 1`,
/// which adds the offload connector's CPU store (room for every prompt).
fn offload_topology(a: &OffloadArgs, http: u16, base: u16, max_model_len: u32, num_blocks: u32) -> topology::Topology {
    let node = |name: &str, http: u16, base: u16| {
        let n = topology::colocated(name, http, base);
        match &a.model {
            Some(p) => n.gguf(p),
            None => n.synthetic(a.per_token_cost_us),
        }
        .engine(|e| {
            e.block_size = BLOCK_SIZE;
            e.num_blocks = num_blocks;
            e.max_model_len = max_model_len;
            e.max_num_seqs = 4;
        })
    };
    let mut offload = topology::kv_defaults(topology::KvRole::KvBoth);
    offload.kv_connector = "OffloadConnector".into();
    offload.offload.cpu_blocks = num_blocks * a.prompts as u32;
    topology::topology([node("off", http, base), node("on", http + 1, base + 40).kv(offload)])
}

/// The two nodes as a phase reads them (index 0: offload off, 1: on).
struct Nodes {
    client: reqwest::Client,
    urls: [String; 2],
    workers: [String; 2],
}

/// Phase `phase_no` (0: first visit, 1: revisit): every prompt to both nodes, the order
/// alternating; the phase's figures and how many prompts got different answers.
async fn run_phase(
    nodes: &Nodes,
    prompts: &[String],
    phase_no: usize,
    max_tokens: u32,
) -> anyhow::Result<(Phase, usize)> {
    let computed = "pdmesh_worker_tokens_computed_total";
    let mut phase = Phase::default();
    let mut mismatches = 0usize;
    let before = [
        crate::client::scrape(&nodes.workers[0], computed).await,
        crate::client::scrape(&nodes.workers[1], computed).await,
    ];
    for (i, p) in prompts.iter().enumerate() {
        let order = if (i + phase_no).is_multiple_of(2) { [0, 1] } else { [1, 0] };
        let mut texts = [String::new(), String::new()];
        for node in order {
            let (ttft, text) = stream(&nodes.client, &nodes.urls[node], p, max_tokens).await?;
            phase.ttft[node].push(ttft);
            texts[node] = text;
        }
        mismatches += usize::from(texts[0] != texts[1]);
    }
    for ((prefilled, worker), before) in phase.prefilled.iter_mut().zip(&nodes.workers).zip(before) {
        *prefilled = crate::client::scrape(worker, computed).await - before;
    }
    Ok((phase, mismatches))
}

/// A phase's report: TTFT and prefilled tokens, off versus on.
fn phase_row(name: &str, ph: &Phase) -> serde_json::Value {
    serde_json::json!({
        "phase": name,
        "ttft_mean_ms": {"off": mean(&ph.ttft[0]), "on": mean(&ph.ttft[1])},
        "ttft_median_ms": {"off": median(&ph.ttft[0]), "on": median(&ph.ttft[1])},
        "ttft_mean_ratio_on_over_off": mean(&ph.ttft[1]) / mean(&ph.ttft[0]),
        "tokens_computed": {"off": ph.prefilled[0], "on": ph.prefilled[1]},
        "tokens_computed_ratio_on_over_off": ph.prefilled[1] / ph.prefilled[0],
    })
}

pub async fn run(a: OffloadArgs) -> anyhow::Result<()> {
    let pdmesh = crate::client::pdmesh_binary(a.pdmesh.as_deref())?;
    let run_dir = std::env::temp_dir().join(format!("pdmesh-offload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir)?;
    let slot = (std::process::id() % 8) as u16;
    let http = 19400 + slot * 4;
    let base = 27000 + slot * 100;
    let prompts: Vec<String> = (0..a.prompts).map(|i| prompt(i, a.prompt_words)).collect();
    let (max_model_len, num_blocks) = pool_size(&prompts, a.max_tokens);
    let topo = offload_topology(&a, http, base, max_model_len, num_blocks);
    let _up = crate::client::start_mesh(
        &pdmesh,
        topo,
        &run_dir,
        "offload.toml",
        "warn",
        vec![Ready::Node(http), Ready::Node(http + 1)],
        Duration::from_secs(180),
    )
    .await?;
    let nodes = Nodes {
        client: reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?,
        urls: [format!("http://127.0.0.1:{http}"), format!("http://127.0.0.1:{}", http + 1)],
        workers: [
            format!("http://127.0.0.1:{}/metrics", base + 112),
            format!("http://127.0.0.1:{}/metrics", base + 152),
        ],
    };
    let on_scheduler = format!("http://127.0.0.1:{}/metrics", base + 151);
    let (first_visit, first_mismatches) = run_phase(&nodes, &prompts, 0, a.max_tokens).await?;
    let (revisit, revisit_mismatches) = run_phase(&nodes, &prompts, 1, a.max_tokens).await?;
    let mismatches = first_mismatches + revisit_mismatches;
    let hits = crate::client::scrape(&on_scheduler, "pdmesh_offload_hits_total").await;
    let hit_tokens = crate::client::scrape(&on_scheduler, "pdmesh_offload_hit_tokens_total").await;
    let loaded_blocks = crate::client::scrape(&nodes.workers[1], "pdmesh_offload_loaded_blocks_total").await;
    let report = serde_json::json!({
        "model": a.model.as_ref().map_or("synthetic".to_string(), |p| p.display().to_string()),
        "prompts": a.prompts,
        "prompt_bytes": prompts.first().map_or(0, String::len),
        "num_blocks": num_blocks,
        "block_size": BLOCK_SIZE,
        "max_tokens": a.max_tokens,
        "first_visit": phase_row("first visit", &first_visit),
        "revisit": phase_row("revisit", &revisit),
        "offload_hits": hits,
        "offload_hit_tokens": hit_tokens,
        "offload_loaded_blocks": loaded_blocks,
        "output_mismatches_on_vs_off": mismatches,
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(out) = &a.out {
        std::fs::write(out, &text)?;
    }
    if mismatches > 0 {
        anyhow::bail!("{mismatches} outputs differ between offload on and off");
    }
    Ok(())
}
