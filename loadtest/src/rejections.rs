//! Rule R1 benchmark: what a D-side rejection before admission costs P, with rejection notices
//! on versus off (deadline only), against a run without rejections.
//!
//! Three P/D meshes (router + P + D, synthetic model) run side by side, started here with
//! `pdmesh up`, and are measured in interleaved rounds so machine noise hits all three alike:
//! - `baseline`: the same prompts, but D's `max_model_len` admits them all (0% rejections, so
//!   P does the same prefill work as in the other two);
//! - `notices_on`: 1 request in 10 has a prompt longer than D's `max_model_len` (P accepts it,
//!   prefills and holds its blocks; D refuses it) and D notifies P;
//! - `notices_off`: the same load with `rejection_notices = false`, so P frees at the lease
//!   deadline.
//!
//! P's KV cache is deliberately small, so blocks stranded until a deadline take capacity from
//! the requests behind them. Reported per variant: requests answered per second (a success or
//! the expected 400), output tokens per second, the block-seconds P held for requests nobody
//! read (`given_up` + `expired` in `pdmesh_worker_kv_held_block_seconds_total`) and the
//! rejection → release latency on P (`pdmesh_worker_kv_rejection_to_release_seconds`).

use pdmesh_test_support::topology::{self, EngineConfig, HoldMode, KvRole, NodeExt as _, Topology};
use pdmesh_test_support::Ready;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use tokio::sync::Mutex;

#[derive(Args, Clone)]
pub struct RejectionArgs {
    /// Concurrent clients per measurement.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Requests per variant per round.
    #[arg(long, default_value_t = 400)]
    pub requests: usize,
    /// Interleaved rounds (each variant once per round).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// P's KV blocks (of 16 tokens).
    #[arg(long, default_value_t = 256)]
    pub p_blocks: u32,
    /// P's hold deadline (lease) in seconds: what a rejected request strands without notices.
    #[arg(long, default_value_t = 5)]
    pub lease_s: u64,
    /// Synthetic model cost per token, microseconds.
    #[arg(long, default_value_t = 100)]
    pub per_token_cost_us: u64,
    /// The pdmesh binary (default: next to this one).
    #[arg(long)]
    pub pdmesh: Option<PathBuf>,
    /// Write the JSON report here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Break the rejection → release latency down by hop: the `notices_on` mesh logs every
    /// notice's age at each hop (`RUST_LOG=warn,pdmesh_notice=debug`) and the report gives
    /// the quantiles per hop. Off by default: the logging itself costs a little.
    #[arg(long)]
    pub hops: bool,
    /// Leave out the deadline-only mesh (its rounds take a lease each): for more rejections
    /// in the latency quantiles in the same time.
    #[arg(long)]
    pub latency_only: bool,
}

/// Short prompts fit D; long ones (400 tokens) fit P's `max_model_len` but not D's (256).
const SHORT_PROMPT_TOKENS: usize = 32;
const LONG_PROMPT_TOKENS: usize = 400;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Baseline,
    NoticesOn,
    NoticesOff,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Baseline => "baseline",
            Variant::NoticesOn => "notices_on",
            Variant::NoticesOff => "notices_off",
        }
    }
    /// D's `max_model_len`: the baseline admits the long prompts, the others refuse them.
    fn d_max_model_len(self) -> u32 {
        if self == Variant::Baseline {
            1024
        } else {
            256
        }
    }
}

struct MeshProc {
    variant: Variant,
    mesh: pdmesh_test_support::Mesh,
    router_url: String,
    p_url: String,
    p_worker_metrics: String,
    run_dir: PathBuf,
}

fn topology(i: u16, a: &RejectionArgs, variant: Variant) -> (Topology, u16, u16, u16) {
    // Every port below Linux's ephemeral range (32768+), apart per process and per mesh.
    let slot = (std::process::id() % 8) as u16 * 3 + i;
    let http = 19000 + slot * 4;
    let base = 24000 + slot * 200;
    let side = 30000 + slot * 8;
    let (p, d) = (http + 1, http + 2);
    let mut p_kv = topology::kv_defaults(KvRole::KvProducer);
    (p_kv.side_channel_port, p_kv.data_port) = (side, side + 1);
    p_kv.hold_mode = HoldMode::Lease;
    p_kv.kv_lease_duration_s = a.lease_s;
    let mut d_kv = topology::kv_defaults(KvRole::KvConsumer);
    (d_kv.side_channel_port, d_kv.data_port) = (side + 4, side + 5);
    d_kv.rejection_notices = variant != Variant::NoticesOff;
    let engine = |num_blocks: u32, max_model_len: u32| {
        move |e: &mut EngineConfig| {
            e.block_size = 16;
            e.num_blocks = num_blocks;
            e.max_model_len = max_model_len;
            e.max_num_seqs = 64;
        }
    };
    let topo = topology::topology([
        topology::router("router", http, base, &[topology::url(p)], &[topology::url(d)]),
        topology::prefill("p", p, base + 20).synthetic(a.per_token_cost_us).engine(engine(a.p_blocks, 1024)).kv(p_kv),
        topology::decode("d", d, base + 60)
            .synthetic(a.per_token_cost_us)
            .engine(engine(2048, variant.d_max_model_len()))
            .kv(d_kv),
    ]);
    (topo, http, p, base + 20)
}

async fn start_mesh(i: u16, a: &RejectionArgs, variant: Variant, pdmesh: &std::path::Path) -> anyhow::Result<MeshProc> {
    let run_dir = std::env::temp_dir().join(format!("pdmesh-r1-{}-{}", std::process::id(), variant.name()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir)?;
    let (topo, http, p_http, p_base) = topology(i, a, variant);
    let log = if a.hops && variant == Variant::NoticesOn { "warn,pdmesh_notice=debug" } else { "warn" };
    let ready = vec![Ready::Node(p_http), Ready::Node(p_http + 1)];
    let mesh =
        crate::client::start_mesh(pdmesh, topo, &run_dir, "topology.toml", log, ready, Duration::from_secs(60)).await?;
    Ok(MeshProc {
        variant,
        mesh,
        router_url: format!("http://127.0.0.1:{http}"),
        p_url: format!("http://127.0.0.1:{p_http}"),
        p_worker_metrics: format!("http://127.0.0.1:{}/metrics", p_base + 112),
        run_dir,
    })
}

#[derive(Default, Clone, Copy)]
struct Counts {
    ok: usize,
    rejected: usize,
    other: usize,
    tokens: u64,
}

/// Closed loop of non-streaming requests; request `i` is long (refused by a D whose
/// `max_model_len` is short) when `i % 10 == 9`.
async fn drive(url: &str, a: &RejectionArgs) -> anyhow::Result<(Counts, f64)> {
    let client = reqwest::Client::builder().pool_max_idle_per_host(a.concurrency).build()?;
    let next = Arc::new(AtomicUsize::new(0));
    let counts = Arc::new(Mutex::new(Counts::default()));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..a.concurrency {
        let (client, next, counts) = (client.clone(), next.clone(), counts.clone());
        let (url, n, max_tokens) = (format!("{url}/v1/completions"), a.requests, a.max_tokens);
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    return;
                }
                let len = if i % 10 == 9 { LONG_PROMPT_TOKENS } else { SHORT_PROMPT_TOKENS };
                let prompt: String = (0..len).map(|j| (b'a' + ((i * 7 + j) % 26) as u8) as char).collect();
                let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
                let res = client.post(&url).json(&body).send().await;
                let mut c = counts.lock().await;
                match res {
                    Ok(r) if r.status().is_success() => {
                        let v: serde_json::Value = r.json().await.unwrap_or_default();
                        c.tokens += v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                        c.ok += 1;
                    }
                    Ok(r) if r.status().as_u16() == 400 => c.rejected += 1,
                    _ => c.other += 1,
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let wall = t0.elapsed().as_secs_f64();
    let c = *counts.lock().await;
    Ok((c, wall))
}

/// `(block-seconds held for nobody: given_up + expired, histogram buckets of rejection →
/// release)` from P's worker metrics.
async fn scrape_p(url: &str) -> anyhow::Result<(f64, Vec<(f64, f64)>)> {
    let text = reqwest::get(url).await?.text().await?;
    let mut stranded = 0.0;
    let mut buckets = Vec::new();
    for l in text.lines() {
        let Some(v) = l.split_whitespace().last().and_then(|v| v.parse::<f64>().ok()) else { continue };
        if l.starts_with("pdmesh_worker_kv_held_block_seconds_total")
            && (l.contains("released_by=\"given_up\"") || l.contains("released_by=\"expired\""))
        {
            stranded += v;
        }
        if let Some(rest) = l.strip_prefix("pdmesh_worker_kv_rejection_to_release_seconds_bucket{le=\"") {
            let le = rest.split('"').next().unwrap_or("");
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
            buckets.push((le, v));
        }
    }
    Ok((stranded, buckets))
}

/// Cumulative bucket counts observed between two scrapes.
fn bucket_delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|(le, v)| (*le, v - before.iter().find(|(l, _)| l == le).map(|(_, b)| *b).unwrap_or(0.0)))
        .collect()
}

/// Add one round's cumulative bucket counts to the sum over rounds.
fn add_buckets(sum: &mut Vec<(f64, f64)>, delta: &[(f64, f64)]) {
    for (le, v) in delta {
        match sum.iter_mut().find(|(l, _)| l == le) {
            Some(s) => s.1 += v,
            None => sum.push((*le, *v)),
        }
    }
}

/// The `q` quantile of cumulative buckets: `(bound, estimate)`, where `bound` is the smallest
/// bucket bound below which `q` of the samples fall and `estimate` interpolates linearly
/// within that bucket (as Prometheus' `histogram_quantile` does).
fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<(f64, f64)> {
    let total = buckets.iter().find(|(le, _)| le.is_infinite())?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut below = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some((le, below.0));
            }
            let share = if count > below.1 { (rank - below.1) / (count - below.1) } else { 1.0 };
            return Some((le, below.0 + (le - below.0) * share));
        }
        below = (le, count);
    }
    None
}

/// Notice hops from the logs of a mesh run with `pdmesh_notice=debug`: two samples per
/// label, `hop → [age µs]` (time since the rejection at each hop) and `a → b → [µs]` (the
/// time each notice took from hop `a` to the next hop it reached, `b`).
fn notice_hops(run_dir: &std::path::Path) -> Vec<(String, Vec<u64>)> {
    let mut by_notice: std::collections::HashMap<String, Vec<(u64, String)>> = Default::default();
    let Ok(dir) = std::fs::read_dir(run_dir.join("logs")) else { return Vec::new() };
    for entry in dir.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path()) else { continue };
        for line in text.lines().filter(|l| l.contains("notice hop")) {
            let field = |name: &str| {
                line.split_whitespace().find_map(|w| w.strip_prefix(name)).map(|v| v.trim_matches('"').to_string())
            };
            let (Some(hop), Some(id), Some(age)) =
                (field("hop="), field("id="), field("age_us=").and_then(|v| v.parse::<u64>().ok()))
            else {
                continue;
            };
            by_notice.entry(id).or_default().push((age, hop));
        }
    }
    let mut samples: Vec<(String, Vec<u64>)> = Vec::new();
    let mut add = |label: String, v: u64| match samples.iter_mut().find(|(l, _)| *l == label) {
        Some((_, vs)) => vs.push(v),
        None => samples.push((label, vec![v])),
    };
    for hops in by_notice.values_mut() {
        hops.sort();
        for (age, hop) in hops.iter() {
            add(hop.clone(), *age);
        }
        for pair in hops.windows(2) {
            add(format!("{} → {}", pair[0].1, pair[1].1), pair[1].0.saturating_sub(pair[0].0));
        }
    }
    samples.sort_by_key(|(_, v)| v.iter().sum::<u64>() / v.len().max(1) as u64);
    samples
}

/// Wait until P holds nothing (the notices-off mesh drains at its lease deadline), so every
/// round starts from the same state and every stranded block-second is counted.
async fn wait_p_idle(p_url: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(r) = reqwest::get(format!("{p_url}/debug/kv")).await {
            if let Ok(v) = r.json::<serde_json::Value>().await {
                if v["held_blocks"] == 0 && v["used_blocks"] == 0 {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Quantiles of the rejection → release histogram (seconds): bucket bounds (`*_le_s`) and
/// estimates interpolated within the bucket (`*_s`).
fn latency_report(buckets: &[(f64, f64)]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    out.insert(
        "samples".into(),
        buckets.iter().find(|(le, _)| le.is_infinite()).map(|(_, n)| *n).unwrap_or(0.0).into(),
    );
    for (name, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
        if let Some((bound, est)) = quantile(buckets, q) {
            out.insert(format!("{name}_le_s"), if bound.is_finite() { bound.into() } else { "+Inf".into() });
            out.insert(format!("{name}_s"), est.into());
        }
    }
    serde_json::Value::Object(out)
}

/// One variant's figures summed over the rounds.
#[derive(Default, Clone)]
struct Acc {
    answered: usize,
    ok: usize,
    rejected: usize,
    other: usize,
    tokens: u64,
    wall: f64,
    stranded: f64,
    /// Cumulative rejection → release buckets summed over the rounds.
    latency: Vec<(f64, f64)>,
    /// Each round's p99 estimate (60 rejections a round: its slowest one).
    round_p99: Vec<f64>,
}

/// What one round measured on one mesh.
struct Round {
    counts: Counts,
    wall: f64,
    /// Block-seconds P held for nobody during the round.
    stranded: f64,
    /// The round's rejection → release buckets.
    latency: Vec<(f64, f64)>,
}

impl Acc {
    /// Add a round; its rejection → release p99 estimate, if it had rejections.
    fn add(&mut self, r: &Round) -> Option<f64> {
        let c = &r.counts;
        self.answered += c.ok + c.rejected;
        self.ok += c.ok;
        self.rejected += c.rejected;
        self.other += c.other;
        self.tokens += c.tokens;
        self.wall += r.wall;
        self.stranded += r.stranded;
        add_buckets(&mut self.latency, &r.latency);
        let p99 = quantile(&r.latency, 0.99).map(|(_, est)| est);
        self.round_p99.extend(p99);
        p99
    }

    /// The variant's report row; `base_rps`: the baseline's answers per second.
    fn row(&self, base_rps: f64) -> serde_json::Value {
        let rps = self.answered as f64 / self.wall;
        serde_json::json!({
            "requests_answered": self.answered,
            "succeeded": self.ok,
            "rejected_by_d": self.rejected,
            "other_errors": self.other,
            "answered_per_s": rps,
            "output_tokens_per_s": self.tokens as f64 / self.wall,
            "ratio_to_baseline": rps / base_rps,
            "stranded_block_seconds": self.stranded,
            "stranded_block_seconds_per_rejection": if self.rejected > 0 { self.stranded / self.rejected as f64 } else { 0.0 },
            "rejection_to_release": latency_report(&self.latency),
            // the bucket bounds of the same quantiles, flat (read by scenario scripts)
            "rejection_to_release_p50_le_s": quantile(&self.latency, 0.5).map(|(le, _)| le).filter(|le| le.is_finite()),
            "rejection_to_release_p99_le_s": quantile(&self.latency, 0.99).map(|(le, _)| le).filter(|le| le.is_finite()),
            "rejection_to_release_p99_by_round_s": self.round_p99,
        })
    }
}

/// One round on one mesh: from an idle P, the load, then P drained again (so what the
/// deadline strands is counted too) before its counters are read.
async fn measure_round(m: &MeshProc, a: &RejectionArgs) -> anyhow::Result<Round> {
    let drain = Duration::from_secs(a.lease_s * 3 + 10);
    wait_p_idle(&m.p_url, drain).await;
    let (s0, h0) = scrape_p(&m.p_worker_metrics).await?;
    let (counts, wall) = drive(&m.router_url, a).await?;
    wait_p_idle(&m.p_url, drain).await;
    let (s1, h1) = scrape_p(&m.p_worker_metrics).await?;
    Ok(Round { counts, wall, stranded: s1 - s0, latency: bucket_delta(&h0, &h1) })
}

/// With `--hops`: the notices-on mesh's notice ages per hop, quantiles in µs.
fn hop_report(a: &RejectionArgs, meshes: &[MeshProc]) -> serde_json::Map<String, serde_json::Value> {
    let mut hops = serde_json::Map::new();
    if !a.hops {
        return hops;
    }
    let Some(m) = meshes.iter().find(|m| m.variant == Variant::NoticesOn) else { return hops };
    for (hop, mut ages) in notice_hops(&m.run_dir) {
        ages.sort_unstable();
        let at = |q: f64| ages.get(((ages.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied();
        hops.insert(
            hop,
            serde_json::json!({"n": ages.len(), "p50_us": at(0.5), "p90_us": at(0.9), "p99_us": at(0.99),
                "max_us": ages.last()}),
        );
    }
    hops
}

pub async fn run(a: RejectionArgs) -> anyhow::Result<()> {
    let pdmesh = crate::client::pdmesh_binary(a.pdmesh.as_deref())?;
    let variants: &[Variant] = if a.latency_only {
        &[Variant::Baseline, Variant::NoticesOn]
    } else {
        &[Variant::Baseline, Variant::NoticesOn, Variant::NoticesOff]
    };
    let mut meshes = Vec::new();
    for (i, v) in variants.iter().enumerate() {
        meshes.push(start_mesh(i as u16, &a, *v, &pdmesh).await?);
    }
    let mut acc = vec![Acc::default(); variants.len()];
    for round in 0..a.rounds {
        for (k, m) in meshes.iter().enumerate() {
            let r = measure_round(m, &a).await?;
            let p99 = acc[k].add(&r);
            let p99 = p99.map(|est| format!("; rejection → release p99 ≈ {:.2} ms", est * 1e3));
            let (c, wall) = (&r.counts, r.wall);
            eprintln!(
                "round {round} {}: {} ok, {} rejected, {} other in {wall:.2} s; stranded {:.1} block-s{}",
                m.variant.name(),
                c.ok,
                c.rejected,
                c.other,
                r.stranded,
                p99.unwrap_or_default()
            );
        }
    }
    let base_rps = acc[0].answered as f64 / acc[0].wall;
    let mut rows = serde_json::Map::new();
    for (k, v) in variants.iter().enumerate() {
        rows.insert(v.name().into(), acc[k].row(base_rps));
    }
    let report = serde_json::json!({
        "setup": {
            "concurrency": a.concurrency, "requests_per_round": a.requests, "rounds": a.rounds,
            "max_tokens": a.max_tokens, "p_blocks": a.p_blocks, "block_size": 16, "lease_s": a.lease_s,
            "per_token_cost_us": a.per_token_cost_us, "rejected_share": 0.1,
            "short_prompt_tokens": SHORT_PROMPT_TOKENS, "long_prompt_tokens": LONG_PROMPT_TOKENS,
        },
        "variants": rows,
        "notice_age_by_hop_us": hop_report(&a, &meshes),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(out) = &a.out {
        std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
    }
    for m in meshes {
        crate::client::stop_mesh(m.mesh, Duration::from_secs(20)).await;
        let _ = std::fs::remove_dir_all(&m.run_dir);
    }
    Ok(())
}
