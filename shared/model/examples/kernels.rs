//! Speed of our matmul kernels per GGUF type at the shapes of Qwen2.5-0.5B and -1.5B, side by
//! side with candle's `QMatMul` on the same weights and threads.
//!
//! ```text
//! cargo run --release -p pdmesh-model --example kernels [-- OPTIONS]
//!   --models 0.5b,1.5b      which models' shapes (default both)
//!   --m 1,8,128,512         batch sizes (tokens per matmul)
//!   --types real|all|q4_k,...  real: the types the Q4_K_M files use at each shape (default);
//!                           all: every supported type where the shape allows it
//!   --threads 2             threads of both (candle: RAYON_NUM_THREADS, set here)
//!   --secs 0.3              minimum timed seconds per case (after one warm-up call)
//!   --no-candle             only ours
//!   --check-gguf FILE       instead: every matrix of FILE, ours vs candle's QMatMul on the
//!                           real weights (m = 1 and 4): bit-equal or the largest difference,
//!                           and bits equal to candle run one token per call
//! ```
//!
//! Reports per case the best time of a call (activation quantization included, as a real
//! `LinearSet::forward` pays it), weight GB/s (matrix bytes in the file's format / time) and
//! GFLOP/s (2·rows·k·m / time), and ours ÷ candle's time as a speed-up.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench code: fail loudly

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use half::{bf16, f16};
use pdmesh_model::kernel_bench::KernelMatmul;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

fn dtype(name: &str) -> GgmlDType {
    match name {
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q5_0" => GgmlDType::Q5_0,
        "q8_0" => GgmlDType::Q8_0,
        "q4_k" => GgmlDType::Q4K,
        "q5_k" => GgmlDType::Q5K,
        "q6_k" => GgmlDType::Q6K,
        "f32" => GgmlDType::F32,
        "f16" => GgmlDType::F16,
        "bf16" => GgmlDType::BF16,
        other => panic!("unknown type {other}"),
    }
}

const ALL: [&str; 10] = ["q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "f16", "bf16", "f32"];

/// (model, what, rows, k, the types the Q4_K_M file uses there)
fn shapes(models: &[String]) -> Vec<(&'static str, &'static str, usize, usize, &'static [&'static str])> {
    let mut out = Vec::new();
    if models.iter().any(|m| m == "0.5b") {
        out.extend([
            ("0.5b", "q/o", 896, 896, &["q5_0"][..]),
            ("0.5b", "k/v", 128, 896, &["q5_0", "q8_0"][..]),
            ("0.5b", "gate/up", 4864, 896, &["q5_0"][..]),
            ("0.5b", "down", 896, 4864, &["q4_k", "q6_k"][..]),
            ("0.5b", "output", 151936, 896, &["q8_0"][..]),
        ]);
    }
    if models.iter().any(|m| m == "1.5b") {
        out.extend([
            ("1.5b", "q/o", 1536, 1536, &["q4_k"][..]),
            ("1.5b", "k/v", 256, 1536, &["q4_k", "q6_k"][..]),
            ("1.5b", "gate/up", 8960, 1536, &["q4_k"][..]),
            ("1.5b", "down", 1536, 8960, &["q4_k", "q6_k"][..]),
        ]);
    }
    out
}

/// Random but valid raw GGUF data: random quants with small finite scales, or random floats.
fn raw_weights(dt: GgmlDType, rows: usize, k: usize) -> Vec<u8> {
    let n = rows * k / dt.block_size() * dt.type_size();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let small = |v: u64| ((v >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
    match dt {
        GgmlDType::F32 => (0..rows * k).flat_map(|_| small(next()).to_le_bytes()).collect(),
        GgmlDType::F16 => (0..rows * k).flat_map(|_| f16::from_f32(small(next())).to_le_bytes()).collect(),
        GgmlDType::BF16 => (0..rows * k).flat_map(|_| bf16::from_f32(small(next())).to_le_bytes()).collect(),
        _ => {
            let mut b: Vec<u8> = (0..n.div_ceil(8)).flat_map(|_| next().to_le_bytes()).take(n).collect();
            let d = f16::from_f32(0.003).to_le_bytes();
            let ts = dt.type_size();
            for blk in b.chunks_exact_mut(ts) {
                let at: &[usize] = match dt {
                    GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q4_1 => &[0, 2],
                    GgmlDType::Q6K => &[208],
                    _ => &[0],
                };
                for &o in at {
                    blk[o..o + 2].copy_from_slice(&d);
                }
            }
            b
        }
    }
}

/// CPU seconds this process has used so far (all threads; `/proc/self/stat`, clock ticks).
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // fields after the ")" that closes the command name: utime and stime are the 12th and 13th
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    match (f.get(11).and_then(|v| v.parse::<f64>().ok()), f.get(12).and_then(|v| v.parse::<f64>().ok())) {
        (Some(u), Some(s)) => (u + s) / 100.0,
        _ => f64::NAN,
    }
}

/// Best wall seconds per call of `f` over at least `secs` (after one warm-up call), and the
/// process CPU seconds per call over the same calls. On a shared host the best wall time is
/// what a quiet moment gives; CPU time per call is the work itself (our pool's workers spin
/// briefly between calls, so it slightly overstates ours).
fn time(secs: f64, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let start = Instant::now();
    let cpu0 = cpu_secs();
    let mut best = f64::INFINITY;
    let mut n = 0u32;
    while start.elapsed().as_secs_f64() < secs || best.is_infinite() {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        n += 1;
    }
    (best, (cpu_secs() - cpu0) / f64::from(n))
}

/// Every 2-D tensor of a GGUF file through ours and candle's `QMatMul`, on the real weights.
fn check_gguf(path: &str, threads: usize) {
    use candle_core::quantized::gguf_file::Content;
    let mut f = std::fs::File::open(path).unwrap();
    let content = Content::read(&mut f).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let (mut equal, mut close, mut total, mut equal_one) = (0, 0, 0, 0);
    for name in names {
        let qt = content.tensor(&mut f, name, &Device::Cpu).unwrap();
        let [rows, k] = qt.shape().dims() else { continue };
        let (rows, k, dt) = (*rows, *k, qt.dtype());
        let raw = qt.data().unwrap().into_owned();
        let Some(mut ours) = KernelMatmul::new(dt, &raw, rows, k, threads) else {
            println!("{name:<28} {dt:?} {rows}x{k}: not packed (refused or shape)");
            continue;
        };
        let qmm = QMatMul::from_qtensor(qt).unwrap();
        for m in [1usize, 4] {
            let x: Vec<f32> = (0..m * k).map(|i| (((i * 7919 + m) % 2003) as f32 - 1001.0) * 0.002).collect();
            let mut out = Vec::new();
            ours.forward(&x, m, &mut out).unwrap();
            let run = |x: &[f32], m: usize| {
                qmm.forward(&Tensor::from_slice(x, (m, k), &Device::Cpu).unwrap())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            let want = run(&x, m);
            // candle one token per call (its m = 1 arithmetic, what a one-token reference runs)
            let one: Vec<f32> = (0..m).flat_map(|t| run(&x[t * k..(t + 1) * k], 1)).collect();
            let same_one = out.iter().zip(&one).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
            if same_one == one.len() {
                equal_one += 1;
            }
            let same = out.iter().zip(&want).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let diff = out.iter().zip(&want).fold(0f32, |a, (o, w)| a.max((o - w).abs()));
            total += 1;
            if same == want.len() {
                equal += 1;
            } else if diff <= 1e-5 * scale {
                close += 1;
            }
            println!(
                "{name:<28} {:<5} {rows:>6}x{k:<5} m={m}: {same}/{} bits equal, max |diff| {diff:.3e} (max |y| {scale:.3e}); one token per call: {same_one} equal",
                format!("{dt:?}"),
                want.len()
            );
        }
    }
    println!("{equal} of {total} (matrix, m) bit-equal to candle, {close} more within 1e-5 of max |y|");
    println!("{equal_one} of {total} (matrix, m) bit-equal to candle run one token per call");
}

fn main() {
    if let Some(path) = arg("--check-gguf") {
        let threads: usize = arg("--threads").map_or(2, |s| s.parse().unwrap());
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
        check_gguf(&path, threads);
        return;
    }
    let threads: usize = arg("--threads").map_or(2, |s| s.parse().unwrap());
    // candle sizes its pool from this on first use
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    let models: Vec<String> = arg("--models").unwrap_or("0.5b,1.5b".into()).split(',').map(String::from).collect();
    let ms: Vec<usize> = arg("--m").unwrap_or("1,8,128,512".into()).split(',').map(|s| s.parse().unwrap()).collect();
    let types = arg("--types").unwrap_or("real".into());
    let secs: f64 = arg("--secs").map_or(0.3, |s| s.parse().unwrap());
    let candle = !flag("--no-candle");

    println!("threads {threads}, m {ms:?}; time per call includes activation quantization");
    println!("ms: best wall time of a call; cpu: process CPU ms per call; GB/s and GFLOP/s from the best time");
    println!(
        "{:<5} {:<8} {:>13} {:<5} {:>4} | {:>9} {:>8} {:>7} {:>7} | {:>9} {:>8} {:>7} | {:>8} {:>8}",
        "model",
        "matrix",
        "rows x k",
        "type",
        "m",
        "ours ms",
        "cpu",
        "GB/s",
        "GFLOP/s",
        "candle ms",
        "cpu",
        "GFLOP/s",
        "x (wall)",
        "x (cpu)"
    );
    for (model, what, rows, k, real) in shapes(&models) {
        let list: Vec<&str> = match types.as_str() {
            "real" => real.to_vec(),
            "all" => ALL.to_vec(),
            some => some.split(',').collect(),
        };
        for name in list {
            let dt = dtype(name);
            if k % dt.block_size() != 0 {
                continue;
            }
            let raw = raw_weights(dt, rows, k);
            let Some(mut ours) = KernelMatmul::new(dt, &raw, rows, k, threads) else {
                println!("{model:<5} {what:<8} {rows:>6}x{k:<6} {name:<5} not packed");
                continue;
            };
            let qmm = candle.then(|| {
                let storage = QStorage::from_data(std::borrow::Cow::Borrowed(&raw), &Device::Cpu, dt).unwrap();
                QMatMul::from_qtensor(QTensor::new(storage, (rows, k)).unwrap()).unwrap()
            });
            let bytes = raw.len() as f64;
            drop(raw);
            for &m in &ms {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 0.001).collect();
                let mut out = Vec::new();
                let (t, cpu) = time(secs, || ours.forward(&x, m, &mut out).unwrap());
                let flop = 2.0 * (rows * k * m) as f64;
                let mut line = format!(
                    "{model:<5} {what:<8} {:>13} {name:<5} {m:>4} | {:>9.3} {:>8.3} {:>7.1} {:>7.1}",
                    format!("{rows}x{k}"),
                    t * 1e3,
                    cpu * 1e3,
                    bytes / t / 1e9,
                    flop / t / 1e9
                );
                // candle's slowest cases would take minutes (e.g. Q8_0 151936x896 at m=512)
                let qmm = qmm.as_ref().filter(|_| (rows * k * m) as f64 <= 2e10);
                if let Some(qmm) = qmm {
                    let xt = Tensor::from_slice(&x, (m, k), &Device::Cpu).unwrap();
                    let (tc, cpuc) = time(secs, || {
                        let _ = qmm.forward(&xt).unwrap();
                    });
                    line += &format!(
                        " | {:>9.3} {:>8.3} {:>7.1} | {:>7.2}x {:>7.2}x",
                        tc * 1e3,
                        cpuc * 1e3,
                        flop / tc / 1e9,
                        tc / t,
                        cpuc / cpu
                    );
                }
                println!("{line}");
            }
        }
    }
}
