//! Throughput of [`GgufExecutor`] in the shapes llama-bench measures (see
//! `BASELINE_LLAMACPP.md`): prefill of 128 and 512 tokens in one chunk (`pp128`, `pp512`),
//! decode of 128 tokens one per step from an empty cache (`tg128`), and aggregate decode with 8
//! requests per step (`tg×8`). Token ids are synthetic; greedy sampling runs on every step.
//!
//! ```text
//! CARGO_TARGET_DIR=target-model cargo run --release -p pdmesh-model --example bench [REPS]
//! ```
//! Uses `$PDMESH_MODEL_PATH` or the default model path; `PDMESH_MODEL_THREADS` sets threads.
//!
//! Besides wall-clock tok/s it prints tok per second of the *calling thread's* CPU time
//! (`/proc/thread-self/schedstat`). With `PDMESH_MODEL_THREADS=1` that is the single-core
//! speed even when other processes compete for the CPU (this box is shared).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test/bench code: fail loudly

use std::time::Instant;

use pdmesh_model::{default_model_path, GgufExecutor, ModelOptions};
use pdmesh_model_api::{Executor, KvCache, KvCacheSpec};
use pdmesh_protocol::{SamplingParams, ScheduledChunk};

const BLOCK: u32 = 16;

fn chunk(id: usize, tokens: Vec<u32>, start: usize, blocks: Vec<u32>) -> ScheduledChunk {
    ScheduledChunk {
        request_id: format!("r{id}"),
        token_ids: tokens,
        start_pos: start as u32,
        block_ids: blocks,
        sample: true,
        sampling: SamplingParams { temperature: 0.0, ..SamplingParams::default() },
        output_index: 0,
        guided_output: Vec::new(),
        history: None,
    }
}

fn synthetic(n: usize, seed: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + seed * 104_729) % 40_000 + 100) as u32).collect()
}

/// (wall, thread-CPU) seconds to prefill `n` tokens in one chunk.
fn prefill(exec: &mut GgufExecutor, kv: &mut KvCache, n: usize) -> (f64, f64) {
    let blocks: Vec<u32> = (0..(n as u32).div_ceil(BLOCK)).collect();
    let (t, c) = (Instant::now(), thread_cpu());
    exec.execute(kv, &[chunk(0, synthetic(n, 1), 0, blocks)]).expect("prefill");
    (t.elapsed().as_secs_f64(), thread_cpu() - c)
}

/// (wall, thread-CPU) seconds for `steps` decode steps of `batch` requests, each starting from
/// `ctx` cached tokens (the context prefill is not timed).
fn decode(exec: &mut GgufExecutor, kv: &mut KvCache, batch: usize, ctx: usize, steps: usize) -> (f64, f64) {
    let per_req = ((ctx + steps) as u32).div_ceil(BLOCK);
    let blocks = |r: usize| -> Vec<u32> { (r as u32 * per_req..(r as u32 + 1) * per_req).collect() };
    if ctx > 0 {
        let chunks: Vec<_> = (0..batch).map(|r| chunk(r, synthetic(ctx, r), 0, blocks(r))).collect();
        exec.execute(kv, &chunks).expect("context prefill");
    }
    let mut last: Vec<u32> = (0..batch).map(|r| 100 + r as u32).collect();
    let (t, c) = (Instant::now(), thread_cpu());
    for s in 0..steps {
        let chunks: Vec<_> = (0..batch).map(|r| chunk(r, vec![last[r]], ctx + s, blocks(r))).collect();
        let out = exec.execute(kv, &chunks).expect("decode");
        for (l, o) in last.iter_mut().zip(out) {
            *l = o.token_id;
        }
    }
    (t.elapsed().as_secs_f64(), thread_cpu() - c)
}

/// CPU time of this thread in seconds (Linux), or 0.
fn thread_cpu() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()))
        .map_or(0.0, |ns| ns / 1e9)
}

/// A `/proc/self/status` figure in MiB (Linux), or 0.
fn status_mib(key: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Run `f` `reps` times; returns (wall tok/s samples, tok per thread-CPU-second samples).
fn measure(reps: usize, tokens: f64, mut f: impl FnMut() -> (f64, f64)) -> (Vec<f64>, Vec<f64>) {
    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let (secs, cpu_secs) = f();
        wall.push(tokens / secs);
        cpu.push(tokens / cpu_secs.max(1e-9));
    }
    (wall, cpu)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let reps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let path = default_model_path();
    let t = Instant::now();
    let mut exec =
        GgufExecutor::load(&path, &ModelOptions::default()).expect("load model (run scripts/fetch-model.sh)");
    println!("load: {:.0} ms ({})", t.elapsed().as_secs_f64() * 1e3, path.display());
    let file_mib = std::fs::metadata(&path).map_or(0.0, |m| m.len() as f64 / 1048576.0);
    println!(
        "memory after load: RSS {:.0} MiB, peak RSS {:.0} MiB (file {file_mib:.0} MiB)",
        status_mib("VmRSS:"),
        status_mib("VmHWM:")
    );
    let f = exec.facts().clone();
    let mut kv = KvCache::new_heap(KvCacheSpec {
        num_layers: f.num_layers,
        num_blocks: 1024,
        block_size: BLOCK,
        num_kv_heads: f.num_kv_heads,
        head_dim: f.head_dim,
    });
    // warm-up on the measured shapes
    prefill(&mut exec, &mut kv, 128);
    prefill(&mut exec, &mut kv, 512);
    decode(&mut exec, &mut kv, 1, 0, 8);
    decode(&mut exec, &mut kv, 8, 0, 8);

    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let rows = [
        (
            "pp128",
            if only.is_empty() || "pp128".starts_with(&only) {
                measure(reps, 128.0, || prefill(&mut exec, &mut kv, 128))
            } else {
                (vec![], vec![])
            },
        ),
        (
            "pp512",
            if only.is_empty() || "pp512".starts_with(&only) {
                measure(reps, 512.0, || prefill(&mut exec, &mut kv, 512))
            } else {
                (vec![], vec![])
            },
        ),
        (
            "tg128 (batch 1)",
            if only.is_empty() || "tg128 (batch 1)".starts_with(&only) {
                measure(reps, 128.0, || decode(&mut exec, &mut kv, 1, 0, 128))
            } else {
                (vec![], vec![])
            },
        ),
        (
            "tg64 x 8",
            if only.is_empty() || "tg64 x 8".starts_with(&only) {
                measure(reps, 512.0, || decode(&mut exec, &mut kv, 8, 0, 64))
            } else {
                (vec![], vec![])
            },
        ),
        (
            "tg64 x 8, ctx 48",
            if only.is_empty() || "tg64 x 8, ctx 48".starts_with(&only) {
                measure(reps, 512.0, || decode(&mut exec, &mut kv, 8, 48, 64))
            } else {
                (vec![], vec![])
            },
        ),
    ];
    println!("{:<18} {:>10} {:>14}   wall samples", "", "tok/s", "tok/cpu-s(t0)");
    for (name, (wall, cpu)) in rows {
        if wall.is_empty() {
            continue;
        }
        println!("{name:<18} {:>10.1} {:>14.1}   {wall:.1?}", median(wall.clone()), median(cpu));
    }
}
