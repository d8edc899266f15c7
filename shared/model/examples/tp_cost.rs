//! What tensor parallelism costs on this host (D111): step time of a model split over TP ranks
//! against the same model in one process with as many threads, side by side in one run, and
//! the share of rank 0's step spent in the all-gathers (copying through shared memory, and
//! waiting for the other ranks to publish).
//!
//! ```text
//! cargo run --release -p pdmesh-model --example tp_cost -- [MODEL.gguf] [--tp 2] [--rounds 3]
//! ```
//! Each TP rank runs on its own thread with one matmul thread and its own executor, gathering
//! through the shared-memory group the worker processes use; the one-process baseline runs
//! with `tp` matmul threads. Shapes: decode at batch 1 and 8 (context 128), prefill of 128 and
//! 512 tokens. Rounds alternate baseline and TP; the table prints medians and the spread.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pdmesh_model::tp::{Gather, ShmGroup, TpRank};
use pdmesh_model::{GgufExecutor, ModelOptions};
use pdmesh_model_api::{Executor, KvCache, KvCacheSpec};
use pdmesh_protocol::{SamplingParams, ScheduledChunk};

const BLOCK: u32 = 16;
const MAX_LEN: u32 = 1024;

#[derive(Clone, Copy, Debug)]
enum Shape {
    Decode { batch: usize },
    Prefill { tokens: usize },
}

impl Shape {
    fn name(self) -> String {
        match self {
            Shape::Decode { batch } => format!("decode, batch {batch}"),
            Shape::Prefill { tokens } => format!("prefill {tokens}"),
        }
    }
}

fn chunk(id: usize, tokens: Vec<u32>, start: usize) -> ScheduledChunk {
    let per = MAX_LEN / BLOCK;
    ScheduledChunk {
        request_id: format!("r{id}"),
        token_ids: tokens,
        start_pos: start as u32,
        block_ids: (id as u32 * per..(id as u32 + 1) * per).collect(),
        sample: true,
        sampling: SamplingParams { temperature: 0.0, ..SamplingParams::default() },
        output_index: 0,
        guided_output: Vec::new(),
        history: None,
    }
}

fn synthetic(n: usize, seed: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + seed * 104_729) % 30_000 + 100) as u32).collect()
}

/// The steps a shape times: (untimed context steps, timed steps).
fn steps(shape: Shape) -> (Vec<Vec<ScheduledChunk>>, Vec<Vec<ScheduledChunk>>) {
    match shape {
        Shape::Decode { batch } => {
            let ctx = 128;
            let setup = vec![(0..batch).map(|r| chunk(r, synthetic(ctx, r), 0)).collect()];
            let timed =
                (0..16).map(|s| (0..batch).map(|r| chunk(r, vec![100 + r as u32], ctx + s)).collect()).collect();
            (setup, timed)
        }
        Shape::Prefill { tokens } => (Vec::new(), (0..3).map(|r| vec![chunk(r, synthetic(tokens, r), 0)]).collect()),
    }
}

fn spec(exec: &GgufExecutor) -> KvCacheSpec {
    let f = exec.facts();
    KvCacheSpec {
        num_layers: f.num_layers,
        num_blocks: 8 * MAX_LEN / BLOCK,
        block_size: BLOCK,
        num_kv_heads: f.num_kv_heads,
        head_dim: f.head_dim,
    }
}

fn options(threads: usize) -> ModelOptions {
    ModelOptions { max_model_len: Some(MAX_LEN), threads: Some(threads), nice: 0 }
}

/// Seconds per timed step in one process with `threads` matmul threads.
fn one_process(exec: &mut GgufExecutor, kv: &mut KvCache, shape: Shape) -> f64 {
    let (setup, timed) = steps(shape);
    for s in &setup {
        exec.execute(kv, s).unwrap();
    }
    let t = Instant::now();
    for s in &timed {
        exec.execute(kv, s).unwrap();
    }
    t.elapsed().as_secs_f64() / timed.len() as f64
}

/// A rank on its own thread: its steps in, a signal out once each is computed.
type Peer = (mpsc::Sender<Option<Vec<ScheduledChunk>>>, mpsc::Receiver<()>, std::thread::JoinHandle<()>);

/// The TP group: rank 0 here, the other ranks on threads fed through channels.
struct Group {
    rank0: GgufExecutor,
    kv0: KvCache,
    peers: Vec<Peer>,
    file: PathBuf,
}

impl Group {
    fn start(path: &Path, size: usize) -> Self {
        let file = std::env::temp_dir().join(format!("pdmesh-tp-cost-{}", std::process::id()));
        let rank0_group = ShmGroup::create(&file, size, ShmGroup::section_bytes_for(1 << 18)).unwrap();
        let mut peers = Vec::new();
        for rank in 1..size {
            let (tx, rx) = mpsc::channel::<Option<Vec<ScheduledChunk>>>();
            let (done_tx, done_rx) = mpsc::channel();
            let (path, file) = (path.to_path_buf(), file.clone());
            let handle = std::thread::spawn(move || {
                let g: Box<dyn Gather> = Box::new(ShmGroup::open(&file, rank).unwrap());
                let mut exec = GgufExecutor::load_tp(&path, &options(1), TpRank { rank, size }, Some(g)).unwrap();
                let mut kv = KvCache::new_heap(spec(&exec));
                done_tx.send(()).unwrap();
                while let Ok(Some(chunks)) = rx.recv() {
                    exec.execute(&mut kv, &chunks).unwrap();
                    done_tx.send(()).unwrap();
                }
            });
            done_rx.recv().unwrap();
            peers.push((tx, done_rx, handle));
        }
        let rank0 =
            GgufExecutor::load_tp(path, &options(1), TpRank { rank: 0, size }, Some(Box::new(rank0_group))).unwrap();
        let kv0 = KvCache::new_heap(spec(&rank0));
        Self { rank0, kv0, peers, file }
    }

    fn step(&mut self, chunks: &[ScheduledChunk]) {
        for (tx, _, _) in &self.peers {
            tx.send(Some(chunks.to_vec())).unwrap();
        }
        self.rank0.execute(&mut self.kv0, chunks).unwrap();
        for (_, done, _) in &self.peers {
            done.recv().unwrap();
        }
    }

    /// Seconds per timed step, and rank 0's gather time per timed step.
    fn run(&mut self, shape: Shape) -> (f64, Duration, Duration) {
        let (setup, timed) = steps(shape);
        for s in &setup {
            self.step(s);
        }
        let before = self.rank0.tp_gather_time();
        let t = Instant::now();
        for s in &timed {
            self.step(s);
        }
        let per = t.elapsed().as_secs_f64() / timed.len() as f64;
        let after = self.rank0.tp_gather_time();
        let n = timed.len() as u32;
        (per, (after.total - before.total) / n, (after.waiting - before.waiting) / n)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        for (tx, _, _) in &self.peers {
            let _ = tx.send(None);
        }
        for (_, _, h) in self.peers.drain(..) {
            let _ = h.join();
        }
        let _ = std::fs::remove_file(&self.file);
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str, default: usize| {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, |v| v.parse().unwrap())
    };
    let (tp, rounds) = (flag("--tp", 2), flag("--rounds", 3));
    let path = args
        .iter()
        .enumerate()
        .find(|(i, a)| !a.starts_with("--") && (*i == 0 || !args[i - 1].starts_with("--")))
        .map(|(_, a)| PathBuf::from(a))
        .unwrap_or_else(pdmesh_model::default_model_path);
    let shapes = [
        Shape::Decode { batch: 1 },
        Shape::Decode { batch: 8 },
        Shape::Prefill { tokens: 128 },
        Shape::Prefill { tokens: 512 },
    ];
    eprintln!("model {}, TP {tp} against one process with {tp} threads, {rounds} rounds", path.display());
    let mut single = GgufExecutor::load(&path, &options(tp)).unwrap();
    let mut single_kv = KvCache::new_heap(spec(&single));
    let mut group = Group::start(&path, tp);
    println!("| shape | one process, ms/step | TP {tp}, ms/step | TP ÷ one, median | spread | gathers, share of TP step | of which waiting |");
    println!("|---|---|---|---|---|---|---|");
    for shape in shapes {
        let (mut base, mut split, mut ratio, mut share, mut wait) = (vec![], vec![], vec![], vec![], vec![]);
        for _ in 0..rounds {
            let b = one_process(&mut single, &mut single_kv, shape);
            let (t, gathered, waiting) = group.run(shape);
            base.push(b * 1e3);
            split.push(t * 1e3);
            ratio.push(t / b);
            share.push(gathered.as_secs_f64() / t);
            wait.push(waiting.as_secs_f64() / t);
        }
        let (lo, hi) = ratio.iter().fold((f64::MAX, f64::MIN), |(l, h), &r| (l.min(r), h.max(r)));
        println!(
            "| {} | {:.2} | {:.2} | {:.2}× | {:.2}–{:.2}× | {:.0} % | {:.0} % |",
            shape.name(),
            median(&mut base),
            median(&mut split),
            median(&mut ratio),
            lo,
            hi,
            100.0 * median(&mut share),
            100.0 * median(&mut wait),
        );
    }
}
