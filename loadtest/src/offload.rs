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

pub async fn run(a: OffloadArgs) -> anyhow::Result<()> {
    let pdmesh = crate::client::pdmesh_binary(a.pdmesh.as_deref())?;
    let run_dir = std::env::temp_dir().join(format!("pdmesh-offload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir)?;
    let slot = (std::process::id() % 8) as u16;
    let http = 19400 + slot * 4;
    let base = 27000 + slot * 100;
    let prompts: Vec<String> = (0..a.prompts).map(|i| prompt(i, a.prompt_words)).collect();
    // The pool holds one request of the longest prompt's bytes (an upper bound on its tokens;
    // a few of the real model's prompts, one synthetic prompt): well short of all prompts, so
    // a revisited prompt's blocks were reused in between.
    let longest = prompts.iter().map(String::len).max().unwrap_or(0) as u32 + a.max_tokens;
    let max_model_len = longest.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    let num_blocks = max_model_len / BLOCK_SIZE;
    // Both nodes: the model and the pool; `on` adds the offload connector's CPU store.
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
    let topo = topology::topology([node("off", http, base), node("on", http + 1, base + 40).kv(offload)]);
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
    let urls = [format!("http://127.0.0.1:{http}"), format!("http://127.0.0.1:{}", http + 1)];
    let workers =
        [format!("http://127.0.0.1:{}/metrics", base + 112), format!("http://127.0.0.1:{}/metrics", base + 152)];
    let on_scheduler = format!("http://127.0.0.1:{}/metrics", base + 151);
    let client = reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?;
    let computed = "pdmesh_worker_tokens_computed_total";
    let mut phases = [Phase::default(), Phase::default()];
    let mut outputs: [Vec<String>; 2] = [Vec::new(), Vec::new()];
    let mut mismatches = 0usize;
    for (phase_no, phase) in phases.iter_mut().enumerate() {
        let before =
            [crate::client::scrape(&workers[0], computed).await, crate::client::scrape(&workers[1], computed).await];
        for (i, p) in prompts.iter().enumerate() {
            let order = if (i + phase_no) % 2 == 0 { [0, 1] } else { [1, 0] };
            let mut texts = [String::new(), String::new()];
            for node in order {
                let (ttft, text) = stream(&client, &urls[node], p, a.max_tokens).await?;
                phase.ttft[node].push(ttft);
                texts[node] = text;
            }
            mismatches += usize::from(texts[0] != texts[1]);
            for (node, t) in texts.into_iter().enumerate() {
                outputs[node].push(t);
            }
        }
        for node in 0..2 {
            phase.prefilled[node] = crate::client::scrape(&workers[node], computed).await - before[node];
        }
    }
    let hits = crate::client::scrape(&on_scheduler, "pdmesh_offload_hits_total").await;
    let hit_tokens = crate::client::scrape(&on_scheduler, "pdmesh_offload_hit_tokens_total").await;
    let loaded_blocks = crate::client::scrape(&workers[1], "pdmesh_offload_loaded_blocks_total").await;
    let row = |name: &str, ph: &Phase| {
        serde_json::json!({
            "phase": name,
            "ttft_mean_ms": {"off": mean(&ph.ttft[0]), "on": mean(&ph.ttft[1])},
            "ttft_median_ms": {"off": median(&ph.ttft[0]), "on": median(&ph.ttft[1])},
            "ttft_mean_ratio_on_over_off": mean(&ph.ttft[1]) / mean(&ph.ttft[0]),
            "tokens_computed": {"off": ph.prefilled[0], "on": ph.prefilled[1]},
            "tokens_computed_ratio_on_over_off": ph.prefilled[1] / ph.prefilled[0],
        })
    };
    let report = serde_json::json!({
        "model": a.model.as_ref().map_or("synthetic".to_string(), |p| p.display().to_string()),
        "prompts": a.prompts,
        "prompt_bytes": prompts.first().map_or(0, String::len),
        "num_blocks": num_blocks,
        "block_size": BLOCK_SIZE,
        "max_tokens": a.max_tokens,
        "first_visit": row("first visit", &phases[0]),
        "revisit": row("revisit", &phases[1]),
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
