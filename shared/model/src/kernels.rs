//! Quantized matmul kernels: Q4_1 and Q8_0 weights × 8-bit quantized activations.
//!
//! Why our own: candle-core 0.11.1 has no SIMD `vec_dot` for Q4_1 (its scalar loop is the bulk
//! of the gap to llama.cpp, see `BASELINE_LLAMACPP.md`), and its matmul parallelises per call
//! on a pool we do not control.
//!
//! **Bit-exact with candle.** These kernels compute exactly what candle's CPU `QMatMul` does
//! (the reference the tests compare with), only faster:
//!
//! - activations are quantized like candle's `BlockQ8_1::from_float` / `BlockQ8_0::from_float`:
//!   per block of 32, `d = amax/127` stored as f16, `q = round(x / d)` (half away from zero),
//!   and for Q8_1 `s = f16(Σq) · d` in f16 ([`QActs`]);
//! - Q4_1: candle's (scalar) `vec_dot` is `Σ_b ((sumi_b · d_w) · d_a) + m_w · s_a` accumulated
//!   block by block in f32. The integer `sumi_b` is exact however it is summed, so we are free
//!   to compute it with any instructions; the float part runs for 8 or 16 rows at once in SIMD
//!   lanes with the same operations in the same order;
//! - Q8_0 (the tied output projection): candle's AVX2 `vec_dot` accumulates in 8 lanes with
//!   FMA and sums the lanes in a fixed order; we run the same instruction sequence, 4 rows ×
//!   up to 4 tokens per tile.
//!
//! **Q4_1 layout: 16 rows interleaved by 4-element quads.** Weights are repacked at load time
//! into groups of 16 rows. Per (group, block) there are 320 bytes: four 64-byte vectors whose
//! byte `4·r + e` is GGUF byte `4·v + e` of row `r` (low nibble = element `4v + e`, high nibble
//! = element `16 + 4v + e`), then the 16 rows' f16 `d`, then their f16 `m` (20 bytes per row and
//! block, as in the file). Masking a vector's low (high) nibbles gives, for all 16 rows at once,
//! the 4 weights that meet activation bytes `4j..4j+4` with `j = v` (`j = v + 4`); those 4 bytes
//! are broadcast to every lane, so one 4-way dot-product instruction (`vpdpbusd`, AVX-512 VNNI)
//! or `vpmaddubsw` (AVX2, accumulated in i16: at most 8·2·15·127 = 30 480, no overflow) adds
//! each row's partial sum into its own lane. No horizontal reduction is needed, and a decode
//! step streams each matrix front to back exactly once, at the file's 20 bytes per block.
//!
//! Every (row, token) result is computed by the same operations whatever tile, batch or thread
//! split it lands in, so batching never changes a bit. The implementation is chosen at run time
//! ([`Impl::detect`]); the portable scalar path computes the same Q4_1 bits (and Q8_0 as
//! candle's own scalar fallback does).

#![allow(unsafe_code)]

use std::ops::Range;
use std::sync::Arc;

use half::f16;

use candle_core::quantized::GgmlDType;

use crate::hugemem::{HugeBuf, Pod};
use crate::kquants::{self, FloatKind, Kind, PackedFloat, PackedLanes};
use crate::pool::{Pool, SendPtr};
use crate::simd;

/// Values per quantization block (Q4_1, Q8_0 and activation blocks alike).
pub const QK: usize = 32;
/// Weight rows per packed Q4_1 group (one 512-bit vector: 4 elements × 16 rows).
const Q4_GROUP: usize = 16;
/// Bytes per (Q4_1 group, block): 16 rows × 16 bytes of nibbles, 16 f16 `d`, 16 f16 `m`.
const Q4_BLOCK_BYTES: usize = Q4_GROUP * 20;
/// Offsets of the scales inside a (Q4_1 group, block).
const Q4_D_OFF: usize = Q4_GROUP * 16;
const Q4_M_OFF: usize = Q4_D_OFF + Q4_GROUP * 2;
/// Weight rows per packed Q8_0 group.
const Q8_GROUP: usize = 8;

/// Which implementation a matmul uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Impl {
    Scalar,
    /// AVX2 + FMA + F16C (`x86-64-v3`).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 as above, and AVX-512 F/BW/VL/VNNI for Q4_1, Q8_0 and the rows-in-lanes types
    /// (`vpdpbusd`; floats stay on AVX2).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Impl {
    /// The best implementation for this CPU. `PDMESH_MODEL_KERNELS=scalar` forces the portable
    /// one and `avx2` the AVX2 one (for comparisons; every choice gives the same bits).
    pub fn detect() -> Self {
        let forced = std::env::var("PDMESH_MODEL_KERNELS").ok();
        let available = Self::available();
        let pick = |want: Impl| available.iter().copied().find(|&i| i == want);
        match forced.as_deref() {
            Some("scalar") => Impl::Scalar,
            #[cfg(target_arch = "x86_64")]
            Some("avx2") => pick(Impl::Avx2).unwrap_or(Impl::Scalar),
            _ => available.last().copied().unwrap_or(Impl::Scalar),
        }
    }

    /// Every implementation this CPU can run, slowest first.
    pub fn available() -> Vec<Impl> {
        #[allow(unused_mut)]
        let mut out = vec![Impl::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            out.push(Impl::Avx2);
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                out.push(Impl::Avx512);
            }
        }
        out
    }

    /// Tokens per tile: how many activation rows share one unpacked weight block.
    fn tile_tokens(self, w: &Packed) -> usize {
        match (self, w) {
            #[cfg(target_arch = "x86_64")]
            (Impl::Avx512, Packed::Q4_1(_)) => 8,
            #[cfg(target_arch = "x86_64")]
            (Impl::Avx2, Packed::Lanes(q)) if q.kind == kquants::Kind::Q6K => kquants::avx2::Q6K_TILE_TOKENS,
            #[cfg(target_arch = "x86_64")]
            (Impl::Avx512, Packed::Lanes(q))
                if q.kind == kquants::Kind::Q6K && !kquants::avx512::row_pairs(q.kind, 0) =>
            {
                kquants::avx512::Q6K_TILE_TOKENS
            }
            #[cfg(target_arch = "x86_64")]
            // measured: 5-10 % less CPU per prefill matmul than 4 tokens (the decoded sub-block
            // is reused twice as often)
            (Impl::Avx2, Packed::Lanes(_)) => 8,
            #[cfg(target_arch = "x86_64")]
            (Impl::Avx512, Packed::Lanes(_)) => kquants::avx512::TILE_TOKENS,
            _ => 4,
        }
    }
}

/// Which forms of the activations a matmul reads ([`Packed::needs`]); a [`LinearSet`] whose
/// parts have different types computes the union once.
///
/// [`LinearSet`]: crate::linear::LinearSet
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    /// Blocks of 32 (Q8_0/Q8_1): Q4_0, Q4_1, Q5_0, Q8_0 weights.
    pub q8: bool,
    /// Q8_K blocks of 256: K-quant weights.
    pub q8k: bool,
    /// The f32 values themselves: float weights.
    pub f32: bool,
}

impl Needs {
    pub const Q8: Needs = Needs { q8: true, q8k: false, f32: false };

    pub fn union(self, o: Needs) -> Needs {
        Needs { q8: self.q8 || o.q8, q8k: self.q8k || o.q8k, f32: self.f32 || o.f32 }
    }
}

/// Activations `[rows, k]` in the forms the step's matmuls need ([`Needs`]), each computed
/// once per [`crate::linear::LinearSet::forward`]:
///
/// - 8 bits in blocks of [`QK`] with candle's `BlockQ8_1`/`BlockQ8_0` rounding (`qs`, `d`, `s`,
///   `isum`);
/// - Q8_K, candle's `BlockQ8K` (`qk`, `dk`, `bsums`; [`crate::kquants::quantize_q8k`]);
/// - a copy of the f32 values (`x`).
#[derive(Debug, Default, Clone)]
pub struct QActs {
    pub rows: usize,
    pub k: usize,
    pub(crate) has: Needs,
    pub(crate) qs: Vec<i8>,
    /// Block scale (an f16 value, widened).
    pub(crate) d: Vec<f32>,
    /// Q8_1 `s = f16(Σq) · d` computed in f16 (widened); used by Q4_1.
    pub(crate) s: Vec<f32>,
    /// `Σq` of each block of 32 (exact): the Q4_0/Q5_0 offsets.
    pub(crate) isum: Vec<i32>,
    /// Q8_K values, `[rows, k]`.
    pub(crate) qk: Vec<i8>,
    /// Q8_K scales, `[rows, k / 256]`.
    pub(crate) dk: Vec<f32>,
    /// Q8_K sums of each 16 values, `[rows, k / 16]`.
    pub(crate) bsums: Vec<i16>,
    /// Per 32 Q8_K values `d · (bsum_2s + bsum_2s+1)`, `[rows, k / 32]`: the Q4_K/Q5_K mins
    /// term's activation factor, computed once here instead of per weight row group.
    pub(crate) mins32: Vec<f32>,
    /// The f32 activations, `[rows, k]`.
    pub(crate) x: Vec<f32>,
}

impl QActs {
    /// Quantize `x` (`rows × k`, `k` a multiple of [`QK`]) into blocks of 32, reusing the
    /// buffers; rows are quantized in parallel on `pool` (each row's bits do not depend on the
    /// split). (The forward pass uses [`QActs::prepare`].)
    #[cfg(test)]
    pub fn quantize(&mut self, x: &[f32], rows: usize, k: usize, pool: &Pool) {
        self.prepare(x, rows, k, Needs::Q8, pool);
    }

    /// Compute the forms of `x` that `needs` asks for (others are left empty). Q8_K needs `k`
    /// to be a multiple of 256, blocks of 32 a multiple of 32; a form whose `k` does not fit is
    /// not computed (a matmul that needs it then refuses with a shape error).
    pub fn prepare(&mut self, x: &[f32], rows: usize, k: usize, needs: Needs, pool: &Pool) {
        self.rows = rows;
        self.k = k;
        let ok = x.len() >= rows * k;
        let q8 = needs.q8 && ok && k.is_multiple_of(QK);
        let q8k = needs.q8k && ok && k.is_multiple_of(crate::kquants::QK_K);
        let f = needs.f32 && ok;
        self.has = Needs { q8, q8k, f32: f };
        let nb = k / QK;
        let nbk = k / crate::kquants::QK_K;
        // sized, not cleared: the loop below writes every value of every form it computes (a
        // zero-fill first was serial time, 6 MB per matmul at m = 512 and k = 8960)
        fn reset<T: Clone>(v: &mut Vec<T>, n: usize, zero: T) {
            v.resize(n, zero);
        }
        reset(&mut self.qs, if q8 { rows * k } else { 0 }, 0);
        reset(&mut self.d, if q8 { rows * nb } else { 0 }, 0.0);
        reset(&mut self.s, if q8 { rows * nb } else { 0 }, 0.0);
        reset(&mut self.isum, if q8 { rows * nb } else { 0 }, 0);
        reset(&mut self.qk, if q8k { rows * k } else { 0 }, 0);
        reset(&mut self.dk, if q8k { rows * nbk } else { 0 }, 0.0);
        reset(&mut self.bsums, if q8k { rows * (k / 16) } else { 0 }, 0);
        reset(&mut self.mins32, if q8k { rows * (k / 32) } else { 0 }, 0.0);
        self.x.clear();
        if f {
            self.x.extend_from_slice(&x[..rows * k]);
        }
        if !q8 && !q8k {
            return;
        }
        let (qs, d, s, isum) = (
            SendPtr(self.qs.as_mut_ptr()),
            SendPtr(self.d.as_mut_ptr()),
            SendPtr(self.s.as_mut_ptr()),
            SendPtr(self.isum.as_mut_ptr()),
        );
        let (qk, dk, bsums) =
            (SendPtr(self.qk.as_mut_ptr()), SendPtr(self.dk.as_mut_ptr()), SendPtr(self.bsums.as_mut_ptr()));
        let mins32 = SendPtr(self.mins32.as_mut_ptr());
        pool.for_each(rows, &|r| {
            let xr = &x[r * k..(r + 1) * k];
            if q8 {
                // SAFETY: row r owns qs[r·k..(r+1)·k] and d/s/isum[r·nb..(r+1)·nb] (all resized
                // above to rows·k and rows·nb); `for_each` visits each row once, so the slices
                // are disjoint.
                let (qr, dr, sr, ir) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(qs.get().add(r * k), k),
                        std::slice::from_raw_parts_mut(d.get().add(r * nb), nb),
                        std::slice::from_raw_parts_mut(s.get().add(r * nb), nb),
                        std::slice::from_raw_parts_mut(isum.get().add(r * nb), nb),
                    )
                };
                for (((xb, qb), (d, s)), is) in
                    xr.chunks_exact(QK).zip(qr.chunks_exact_mut(QK)).zip(dr.iter_mut().zip(sr)).zip(ir)
                {
                    let (scale, sum) = simd::quantize_block(xb, qb);
                    let d16 = f16::from_f32(scale);
                    *d = d16.to_f32();
                    *s = (f16::from_f32(sum as f32) * d16).to_f32();
                    *is = sum;
                }
            }
            if q8k {
                // SAFETY: as above for qk[r·k..], dk[r·nbk..], bsums[r·k/16..] and
                // mins32[r·k/32..].
                let (qr, dr, br, mr) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(qk.get().add(r * k), k),
                        std::slice::from_raw_parts_mut(dk.get().add(r * nbk), nbk),
                        std::slice::from_raw_parts_mut(bsums.get().add(r * (k / 16)), k / 16),
                        std::slice::from_raw_parts_mut(mins32.get().add(r * (k / 32)), k / 32),
                    )
                };
                crate::kquants::quantize_q8k(xr, qr, dr, br);
                crate::kquants::q8k_terms(dr, br, mr);
            }
        });
    }
}

fn f16_le(b: &[u8]) -> f32 {
    match b {
        [lo, hi, ..] => f16::from_le_bytes([*lo, *hi]).to_f32(),
        _ => 0.0,
    }
}

/// One cache line; the Q4_1 data is a vector of these so every (group, block) starts aligned.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

// SAFETY: 64 plain bytes, any bit pattern valid, no drop glue, alignment 64.
unsafe impl Pod for Line {}

/// Where a matrix's data lives: its own vector while the model loads, then a range of one
/// mapping shared by every matrix of the model ([`gather_weights`]: huge pages).
#[derive(Debug, Clone)]
pub(crate) enum Store<T: Pod> {
    Own(Vec<T>),
    Shared(Arc<HugeBuf<T>>, Range<usize>),
}

impl<T: Pod> std::ops::Deref for Store<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Store::Own(v) => v,
            // `gather` cuts the ranges from the buffer it made, end to end: always in bounds
            // (the kernels trust a matrix's length, so an empty slice here would be worse than
            // the panic this cannot reach).
            Store::Shared(buf, range) => &buf[range.clone()],
        }
    }
}

/// Move the data of `weights` into one mapping per element type that asks for transparent
/// huge pages ([`crate::hugemem`]): a decode step streams every matrix, and on 2 MiB pages it
/// stops missing the TLB. The values do not change. On an error (no memory for a mapping) the
/// matrices keep what they had so far.
pub fn gather_weights(weights: &mut [&mut Packed]) -> std::io::Result<()> {
    let (mut lines, mut qs, mut ds, mut bytes) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for w in weights.iter_mut() {
        match w {
            Packed::Q4_1(p) => lines.push(&mut p.data),
            Packed::Q8_0(p) => {
                qs.push(&mut p.qs);
                ds.push(&mut p.d);
            }
            Packed::Lanes(p) => bytes.push(&mut p.data),
            Packed::Float(p) => bytes.push(&mut p.data),
        }
    }
    gather(&mut lines)?;
    gather(&mut qs)?;
    gather(&mut ds)?;
    gather(&mut bytes)
}

fn gather<T: Pod>(stores: &mut [&mut Store<T>]) -> std::io::Result<()> {
    let buf = {
        let parts: Vec<&[T]> = stores.iter().map(|s| &***s).collect();
        Arc::new(HugeBuf::concat(&parts)?)
    };
    let mut at = 0;
    for store in stores.iter_mut() {
        let n = store.len();
        **store = Store::Shared(Arc::clone(&buf), at..at + n);
        at += n;
    }
    Ok(())
}

/// Q4_1 weights `[rows, k]`: per block `w = d·q + m`, `q ∈ 0..16`, in the 16-row interleaved
/// layout of the module doc (`[group][block][320 bytes]`; padding rows are zero).
#[derive(Debug, Clone)]
pub struct PackedQ4_1 {
    pub rows: usize,
    pub k: usize,
    data: Store<Line>,
}

/// Q8_0 weights `[rows, k]` in 8-row groups: per block `w = d·q`, `q: i8`.
#[derive(Debug, Clone)]
pub struct PackedQ8_0 {
    pub rows: usize,
    pub k: usize,
    /// `[group][block][row][32]`.
    qs: Store<i8>,
    /// `[group][block][row]`.
    d: Store<f32>,
}

impl PackedQ4_1 {
    /// Repack raw GGUF Q4_1 blocks (20 bytes: f16 d, f16 m, 16 bytes of nibbles), row-major.
    pub fn from_gguf_bytes(bytes: &[u8], rows: usize, k: usize) -> Option<Self> {
        if !k.is_multiple_of(QK) || bytes.len() != rows * (k / QK) * 20 {
            return None;
        }
        let nb = k / QK;
        let groups = rows.div_ceil(Q4_GROUP);
        let mut data = vec![Line([0; 64]); groups * nb * Q4_BLOCK_BYTES / 64];
        let flat = lines_as_bytes_mut(&mut data);
        for (row, rb) in bytes.chunks_exact(nb * 20).enumerate() {
            let (g, r) = (row / Q4_GROUP, row % Q4_GROUP);
            for (b, blk) in rb.chunks_exact(20).enumerate() {
                let base = (g * nb + b) * Q4_BLOCK_BYTES;
                flat[base + Q4_D_OFF + 2 * r..][..2].copy_from_slice(&blk[0..2]);
                flat[base + Q4_M_OFF + 2 * r..][..2].copy_from_slice(&blk[2..4]);
                for v in 0..4 {
                    flat[base + 64 * v + 4 * r..][..4].copy_from_slice(&blk[4 + 4 * v..8 + 4 * v]);
                }
            }
        }
        Some(Self { rows, k, data: Store::Own(data) })
    }

    fn bytes(&self) -> &[u8] {
        lines_as_bytes(&self.data)
    }
}

fn lines_as_bytes(lines: &[Line]) -> &[u8] {
    // SAFETY: `Line` is `repr(C)` over `[u8; 64]` with no padding (size 64 = align 64), so the
    // slice is `64 · len` initialised bytes.
    unsafe { std::slice::from_raw_parts(lines.as_ptr().cast::<u8>(), lines.len() * 64) }
}

fn lines_as_bytes_mut(lines: &mut [Line]) -> &mut [u8] {
    // SAFETY: as in `lines_as_bytes`; the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u8>(), lines.len() * 64) }
}

impl PackedQ8_0 {
    /// Repack raw GGUF Q8_0 blocks (34 bytes: f16 d, 32 × i8), row-major.
    pub fn from_gguf_bytes(bytes: &[u8], rows: usize, k: usize) -> Option<Self> {
        if !k.is_multiple_of(QK) || bytes.len() != rows * (k / QK) * 34 {
            return None;
        }
        let nb = k / QK;
        let groups = rows.div_ceil(Q8_GROUP);
        let mut qs = vec![0i8; groups * nb * Q8_GROUP * QK];
        let mut d = vec![0f32; groups * nb * Q8_GROUP];
        for (row, rb) in bytes.chunks_exact(nb * 34).enumerate() {
            let (g, r) = (row / Q8_GROUP, row % Q8_GROUP);
            for (b, blk) in rb.chunks_exact(34).enumerate() {
                let i = (g * nb + b) * Q8_GROUP + r;
                d[i] = f16_le(&blk[0..2]);
                for (dst, &src) in qs[i * QK..i * QK + QK].iter_mut().zip(&blk[2..34]) {
                    *dst = src as i8;
                }
            }
        }
        Some(Self { rows, k, qs: Store::Own(qs), d: Store::Own(d) })
    }
}

/// A weight matrix one of our kernels can multiply.
#[derive(Debug, Clone)]
pub enum Packed {
    Q4_1(PackedQ4_1),
    Q8_0(PackedQ8_0),
    /// Q4_0, Q5_0, Q4_K, Q5_K, Q6_K ([`crate::kquants`]).
    Lanes(PackedLanes),
    /// F32, F16, BF16 ([`crate::kquants`]).
    Float(PackedFloat),
}

impl Packed {
    /// Pack a GGUF tensor's raw data (`[rows, k]` row-major, the file's blocks) for our
    /// kernels; `None` for a type we have no kernel for or a `k` its blocks do not divide.
    pub fn from_gguf(dtype: GgmlDType, bytes: &[u8], rows: usize, k: usize) -> Option<Packed> {
        match dtype {
            GgmlDType::Q4_1 => PackedQ4_1::from_gguf_bytes(bytes, rows, k).map(Packed::Q4_1),
            GgmlDType::Q8_0 => PackedQ8_0::from_gguf_bytes(bytes, rows, k).map(Packed::Q8_0),
            _ => {
                if let Some(kind) = Kind::from_dtype(dtype) {
                    PackedLanes::from_gguf_bytes(kind, bytes, rows, k).map(Packed::Lanes)
                } else {
                    let kind = FloatKind::from_dtype(dtype)?;
                    PackedFloat::from_gguf_bytes(kind, bytes, rows, k).map(Packed::Float)
                }
            }
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            Packed::Q4_1(w) => w.rows,
            Packed::Q8_0(w) => w.rows,
            Packed::Lanes(w) => w.rows,
            Packed::Float(w) => w.rows,
        }
    }

    pub fn k(&self) -> usize {
        match self {
            Packed::Q4_1(w) => w.k,
            Packed::Q8_0(w) => w.k,
            Packed::Lanes(w) => w.k,
            Packed::Float(w) => w.k,
        }
    }

    /// A short name of the weight type (logs, Debug, the benchmark).
    pub fn type_name(&self) -> &'static str {
        match self {
            Packed::Q4_1(_) => "q4_1",
            Packed::Q8_0(_) => "q8_0",
            Packed::Lanes(w) => match w.kind {
                Kind::Q4_0 => "q4_0",
                Kind::Q5_0 => "q5_0",
                Kind::Q4K => "q4_k",
                Kind::Q5K => "q5_k",
                Kind::Q6K => "q6_k",
            },
            Packed::Float(w) => match w.kind {
                FloatKind::F32 => "f32",
                FloatKind::F16 => "f16",
                FloatKind::Bf16 => "bf16",
            },
        }
    }

    /// The activation forms this matrix's kernel reads.
    pub fn needs(&self) -> Needs {
        match self {
            Packed::Q4_1(_) | Packed::Q8_0(_) => Needs::Q8,
            Packed::Lanes(w) if w.kind.q8k() => Needs { q8k: true, ..Needs::default() },
            Packed::Lanes(_) => Needs::Q8,
            Packed::Float(_) => Needs { f32: true, ..Needs::default() },
        }
    }

    /// Rows per packed group (the unit of work of a matmul).
    fn group_rows(&self) -> usize {
        match self {
            Packed::Q4_1(_) => Q4_GROUP,
            Packed::Q8_0(_) => Q8_GROUP,
            Packed::Lanes(_) => kquants::LANES,
            Packed::Float(_) => kquants::FLOAT_GROUP,
        }
    }

    /// Whether two matrices have the same packed type (so their rows can be stacked).
    fn same_type(&self, o: &Packed) -> bool {
        match (self, o) {
            (Packed::Q4_1(_), Packed::Q4_1(_)) | (Packed::Q8_0(_), Packed::Q8_0(_)) => true,
            (Packed::Lanes(a), Packed::Lanes(b)) => a.kind == b.kind,
            (Packed::Float(a), Packed::Float(b)) => a.kind == b.kind,
            _ => false,
        }
    }

    /// Stack the rows of matrices of the same type and `k` (to fuse projections that read the
    /// same input, e.g. Q, K and V). Needs every part's rows to fill whole groups.
    pub fn concat(parts: &[&Packed]) -> Option<Packed> {
        let first = parts.first()?;
        let k = first.k();
        let group = first.group_rows();
        if parts.iter().any(|p| p.k() != k || !p.same_type(first) || p.rows() % group != 0) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows()).sum();
        match first {
            Packed::Q4_1(_) => {
                let mut data = Vec::new();
                for p in parts {
                    let Packed::Q4_1(p) = p else { return None };
                    data.extend_from_slice(&p.data);
                }
                Some(Packed::Q4_1(PackedQ4_1 { rows, k, data: Store::Own(data) }))
            }
            Packed::Q8_0(_) => {
                let (mut qs, mut d) = (Vec::new(), Vec::new());
                for p in parts {
                    let Packed::Q8_0(p) = p else { return None };
                    qs.extend_from_slice(&p.qs);
                    d.extend_from_slice(&p.d);
                }
                Some(Packed::Q8_0(PackedQ8_0 { rows, k, qs: Store::Own(qs), d: Store::Own(d) }))
            }
            Packed::Lanes(f) => {
                let mut data = Vec::new();
                for p in parts {
                    let Packed::Lanes(p) = p else { return None };
                    data.extend_from_slice(&p.data);
                }
                Some(Packed::Lanes(PackedLanes { kind: f.kind, rows, k, data: Store::Own(data) }))
            }
            Packed::Float(f) => {
                let mut data = Vec::new();
                for p in parts {
                    let Packed::Float(p) = p else { return None };
                    data.extend_from_slice(&p.data);
                }
                Some(Packed::Float(PackedFloat { kind: f.kind, rows, k, data: Store::Own(data) }))
            }
        }
    }
}

/// Why a kernel call was refused (a shape mismatch: a caller bug, reported instead of a panic).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

/// `out[m, rows] = acts · Wᵀ`, computed on `pool`, one row group per work item.
pub fn matmul(w: &Packed, acts: &QActs, out: &mut [f32], imp: Impl, pool: &Pool) -> Result<(), ShapeError> {
    matmul_parts(w, acts, &mut [out], imp, pool)
}

/// One destination of [`matmul_parts`]: where its values start, its rows per token, and the
/// first row of `W` it receives.
struct Part {
    dst: SendPtr<f32>,
    rows: usize,
    first: usize,
}

impl Part {
    /// The parts of `outs` (`m` tokens each), checking that all but the last hold whole
    /// `group`-row groups.
    fn of(outs: &mut [&mut [f32]], m: usize, group: usize) -> Result<Vec<Part>, ShapeError> {
        let mut parts = Vec::with_capacity(outs.len());
        let mut first = 0;
        let last = outs.len().saturating_sub(1);
        for (i, o) in outs.iter_mut().enumerate() {
            let rows = o.len() / m;
            if i < last && !rows.is_multiple_of(group) {
                return Err(ShapeError(format!("matmul part {i} of {rows} rows is not whole {group}-row groups")));
            }
            parts.push(Part { dst: SendPtr(o.as_mut_ptr()), rows, first });
            first += rows;
        }
        Ok(parts)
    }
}

/// `acts · Wᵀ` written straight into consecutive row ranges of `W`: part `i` receives the next
/// `outs[i].len() / m` rows as its own `[m, rows_i]` matrix. Every part but the last must hold
/// whole row groups.
///
/// Why: a fused [`LinearSet`](crate::linear::LinearSet) (gate/up) used to compute one
/// `[m, rows]` matrix and copy it apart afterwards, a zero-fill and a copy of 37 MB per layer at
/// m = 512 on Qwen2.5-1.5B, on one thread while the other waited. Each value is computed by the
/// same tile as before, so the bits do not change.
pub fn matmul_parts(
    w: &Packed,
    acts: &QActs,
    outs: &mut [&mut [f32]],
    imp: Impl,
    pool: &Pool,
) -> Result<(), ShapeError> {
    let (rows, k, m) = (w.rows(), w.k(), acts.rows);
    let needs = w.needs();
    let has = needs.union(acts.has) == acts.has;
    let total: usize = outs.iter().map(|o| o.len()).sum();
    let whole = outs.iter().all(|o| if m == 0 { o.is_empty() } else { o.len().is_multiple_of(m) });
    if acts.k != k || total != rows * m || !has || !whole {
        return Err(ShapeError(format!(
            "matmul [{rows}x{k}] {} x acts [{m}x{}] {:?} into {} values",
            w.type_name(),
            acts.k,
            acts.has,
            total
        )));
    }
    if m == 0 || rows == 0 {
        return Ok(());
    }
    let base = w.group_rows();
    let parts = Part::of(outs, m, base)?;
    let inner = &parts[..parts.len().saturating_sub(1)];
    // 16-row tiles (two groups on 512-bit vectors) where they are faster for this kind
    // (`row_pairs`), and no pair straddles two parts
    #[cfg(target_arch = "x86_64")]
    let pairs = matches!((imp, w), (Impl::Avx512, Packed::Lanes(q)) if kquants::avx512::row_pairs(q.kind, m))
        && inner.iter().all(|p| p.rows.is_multiple_of(2 * base));
    #[cfg(not(target_arch = "x86_64"))]
    let pairs = false;
    let group = base * if pairs { 2 } else { 1 };
    let tile_t = imp.tile_tokens(w);
    let ok = pool.for_each(rows.div_ceil(group), &|g| {
        let nr = (rows - g * group).min(group);
        let row = g * group;
        // the last part starting at or before `row` (empty parts share the next one's start)
        let Some(part) = parts.iter().rev().find(|p| p.first <= row) else { return };
        // SAFETY: row − part.first < part.rows (the parts cover 0..rows in order), so the
        // pointer stays inside the part's m·part.rows values.
        let out = unsafe { part.dst.get().add(row - part.first) };
        let rows = part.rows;
        let mut t0 = 0;
        while t0 < m {
            let nt = (m - t0).min(tile_t);
            let tile = Tile { g, nr, t0, nt, rows, out };
            match imp {
                // SAFETY: see `Tile`: group g < groups, t0 + nt ≤ m, out holds m·rows values;
                // each group writes only its own columns, so work items never overlap.
                Impl::Scalar => unsafe {
                    match w {
                        Packed::Lanes(q) => kquants::lanes_scalar(q, acts, &tile),
                        Packed::Float(q) => kquants::float_scalar(q, acts, &tile),
                        _ => scalar_group(w, acts, &tile),
                    }
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above, and `Impl::Avx2` is only constructed after detecting AVX2,
                // FMA and F16C; packed groups are complete (padding rows are zero-filled), and
                // the activations hold the forms `w` needs (checked above).
                Impl::Avx2 => unsafe {
                    match w {
                        Packed::Lanes(q) => kquants::avx2::lanes(q, acts, &tile),
                        Packed::Float(q) => kquants::avx2::float(q, acts, &tile),
                        _ => avx2::group(w, acts, &tile),
                    }
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above; `Impl::Avx512` additionally implies AVX-512 F/BW/VNNI
                // (and AVX2, FMA, F16C for the types without AVX-512 kernels).
                Impl::Avx512 => unsafe {
                    match w {
                        Packed::Q4_1(q) => avx512::q4_1(q, acts, &tile),
                        Packed::Q8_0(q) => avx512::q8_0(q, acts, &tile),
                        // SAFETY (pairs): `g` counts pairs of groups, `nr` the pair's rows
                        Packed::Lanes(q) if pairs => kquants::avx512::lanes_pair(q, acts, &tile),
                        Packed::Lanes(q) => kquants::avx512::lanes(q, acts, &tile),
                        Packed::Float(q) => kquants::avx2::float(q, acts, &tile),
                    }
                },
            }
            t0 += nt;
        }
    });
    if ok {
        Ok(())
    } else {
        Err(ShapeError("a matmul worker panicked".into()))
    }
}

/// One unit of kernel work: weight rows `g·G .. g·G+nr` (G = the matrix's group rows) ×
/// tokens `t0 .. t0+nt`, row `g·G + r` of token `t` written to `out[t·rows + r]`.
///
/// Invariants the kernels rely on: `g < W.rows.div_ceil(G)`, `nr = min(G, W.rows − g·G)`,
/// `nt ≤` the implementation's tile tokens, `t0 + nt ≤ acts.rows`, and `out` points to the
/// output of (token 0, the tile's first row) in a destination of `rows` values per token:
/// `out + t·rows + r` (t < acts.rows, r < nr) are writable values that no other thread writes.
pub(crate) struct Tile {
    pub(crate) g: usize,
    pub(crate) nr: usize,
    pub(crate) t0: usize,
    pub(crate) nt: usize,
    pub(crate) rows: usize,
    pub(crate) out: *mut f32,
}

/// The portable path: candle's scalar `vec_dot` formulas for one tile.
///
/// # Safety
/// The [`Tile`] invariants.
unsafe fn scalar_group(w: &Packed, a: &QActs, tile: &Tile) {
    let k = a.k;
    let nb = k / QK;
    let Tile { g, nr, t0, nt, rows, out } = *tile;
    for r in 0..nr {
        for tok in t0..t0 + nt {
            let aq = &a.qs[tok * k..(tok + 1) * k];
            let mut sumf = 0f32;
            for b in 0..nb {
                let da = a.d[tok * nb + b];
                let aqb = &aq[b * QK..(b + 1) * QK];
                match w {
                    Packed::Q4_1(w) => {
                        let blk = &w.bytes()[(g * nb + b) * Q4_BLOCK_BYTES..][..Q4_BLOCK_BYTES];
                        let mut sumi = 0i32;
                        for v in 0..4 {
                            for e in 0..4 {
                                let byte = blk[64 * v + 4 * r + e];
                                sumi += i32::from(byte & 0x0F) * i32::from(aqb[4 * v + e])
                                    + i32::from(byte >> 4) * i32::from(aqb[16 + 4 * v + e]);
                            }
                        }
                        let dw = f16_le(&blk[Q4_D_OFF + 2 * r..]);
                        let mw = f16_le(&blk[Q4_M_OFF + 2 * r..]);
                        sumf += sumi as f32 * dw * da + mw * a.s[tok * nb + b];
                    }
                    Packed::Q8_0(w) => {
                        let i = (g * nb + b) * Q8_GROUP + r;
                        let sumi: i32 =
                            w.qs[i * QK..i * QK + QK].iter().zip(aqb).map(|(&x, &y)| i32::from(x) * i32::from(y)).sum();
                        sumf += sumi as f32 * w.d[i] * da;
                    }
                    // dispatched to `kquants` by `matmul`
                    Packed::Lanes(_) | Packed::Float(_) => {}
                }
            }
            // SAFETY: tok < m and r < nr (Tile invariants).
            unsafe { *out.add(tok * rows + r) = sumf };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Packed, PackedQ4_1, PackedQ8_0, QActs, Tile, Q4_BLOCK_BYTES, Q4_D_OFF, Q4_M_OFF, Q8_GROUP, QK};

    /// One [`Tile`] with the AVX2 kernels.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available, `a` must hold `a.rows · w.k` values, and the
    /// [`Tile`] invariants must hold with `nt ≤ 4`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group(w: &Packed, a: &QActs, tile: &Tile) {
        // SAFETY (all arms): the preconditions are forwarded unchanged.
        unsafe {
            match (w, tile.nt) {
                (Packed::Q4_1(w), 4) => q4_1_group::<4>(w, a, tile),
                (Packed::Q4_1(w), 3) => q4_1_group::<3>(w, a, tile),
                (Packed::Q4_1(w), 2) => q4_1_group::<2>(w, a, tile),
                (Packed::Q4_1(w), 1) => q4_1_group::<1>(w, a, tile),
                (Packed::Q8_0(w), 4) => q8_0_group::<4>(w, a, tile),
                (Packed::Q8_0(w), 3) => q8_0_group::<3>(w, a, tile),
                (Packed::Q8_0(w), 2) => q8_0_group::<2>(w, a, tile),
                (Packed::Q8_0(w), 1) => q8_0_group::<1>(w, a, tile),
                _ => {}
            }
        }
    }

    /// candle's `hsum_float_8`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum_f32(x: __m256) -> f32 {
        let res = _mm256_extractf128_ps::<1>(x);
        let res = _mm_add_ps(res, _mm256_castps256_ps128(x));
        let res = _mm_add_ps(res, _mm_movehl_ps(res, res));
        let res = _mm_add_ss(res, _mm_movehdup_ps(res));
        _mm_cvtss_f32(res)
    }

    /// Q4_1 with `vpmaddubsw`: the 16-row group as two halves of 8 rows (lanes), each half's
    /// 8 quads accumulated in i16 and widened once per block.
    ///
    /// # Safety
    /// As [`group`] with `nt = T`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_group<const T: usize>(w: &PackedQ4_1, a: &QActs, tile: &Tile) {
        let k = a.k;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let nb = k / QK;
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        // SAFETY: group g has nb blocks of Q4_BLOCK_BYTES, so every weight offset below is
        // < (g+1)·nb·Q4_BLOCK_BYTES ≤ the data length; token rows t0..t0+T < m, so activation
        // offsets are < m·k (qs) and < m·nb (d, s); output offsets from the tile's `out` are
        // (t0+t)·rows + r with r < nr (Tile invariants). Loads/stores are unaligned.
        unsafe {
            let base = w.bytes().as_ptr().add(g * nb * Q4_BLOCK_BYTES);
            for h in 0..2 {
                if 8 * h >= nr {
                    break;
                }
                let mut acc = [_mm256_setzero_ps(); T];
                for b in 0..nb {
                    let p = base.add(b * Q4_BLOCK_BYTES);
                    let mut wv = [_mm256_setzero_si256(); 8];
                    for v in 0..4 {
                        let raw = _mm256_loadu_si256(p.add(64 * v + 32 * h) as *const __m256i);
                        wv[v] = _mm256_and_si256(raw, mask);
                        wv[v + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                    }
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.add(Q4_D_OFF + 16 * h) as *const __m128i));
                    let mw = _mm256_cvtph_ps(_mm_loadu_si128(p.add(Q4_M_OFF + 16 * h) as *const __m128i));
                    for (t, acc_t) in acc.iter_mut().enumerate() {
                        let tok = t0 + t;
                        let ap = a.qs.as_ptr().add(tok * k + b * QK) as *const i32;
                        let mut s16 = _mm256_setzero_si256();
                        for (j, wj) in wv.iter().enumerate() {
                            let aj = _mm256_set1_epi32(ap.add(j).read_unaligned());
                            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*wj, aj));
                        }
                        let sumi = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
                        let da = _mm256_set1_ps(*a.d.as_ptr().add(tok * nb + b));
                        let sa = _mm256_set1_ps(*a.s.as_ptr().add(tok * nb + b));
                        // candle: sumf += sumi * d_w * d_a + m_w * s_a  (no FMA contraction)
                        let term = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(sumi, dw), da), _mm256_mul_ps(mw, sa));
                        *acc_t = _mm256_add_ps(*acc_t, term);
                    }
                }
                let n = (nr - 8 * h).min(8);
                for (t, acc_t) in acc.iter().enumerate() {
                    let dst = out.add((t0 + t) * rows + 8 * h);
                    if n == 8 {
                        _mm256_storeu_ps(dst, *acc_t);
                    } else {
                        let mut lanes = [0f32; 8];
                        _mm256_storeu_ps(lanes.as_mut_ptr(), *acc_t);
                        for (r, &v) in lanes.iter().enumerate().take(n) {
                            *dst.add(r) = v;
                        }
                    }
                }
            }
        }
    }

    /// # Safety
    /// As [`group`] with `nt = T`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q8_0_group<const T: usize>(w: &PackedQ8_0, a: &QActs, tile: &Tile) {
        let k = a.k;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let nb = k / QK;
        let ones = _mm256_set1_epi16(1);
        // SAFETY: group g has nb blocks of Q8_GROUP rows with 32 weight bytes and one f32
        // scale per (block, row); token and output offsets as in `q4_1_group`.
        unsafe {
            let wq = w.qs.as_ptr().add(g * nb * Q8_GROUP * QK);
            let wd = w.d.as_ptr().add(g * nb * Q8_GROUP);
            // 4 rows at a time keeps the 4×T accumulators in registers
            for r0 in (0..nr).step_by(4) {
                let mut acc = [[_mm256_setzero_ps(); T]; 4];
                for b in 0..nb {
                    let mut av = [_mm256_setzero_si256(); T];
                    let mut da = [0f32; T];
                    for t in 0..T {
                        av[t] = _mm256_loadu_si256(a.qs.as_ptr().add((t0 + t) * k + b * QK) as *const __m256i);
                        da[t] = *a.d.as_ptr().add((t0 + t) * nb + b);
                    }
                    for (r, acc_r) in acc.iter_mut().enumerate() {
                        let i = b * Q8_GROUP + r0 + r;
                        let wv = _mm256_loadu_si256(wq.add(i * QK) as *const __m256i);
                        let wabs = _mm256_sign_epi8(wv, wv);
                        let dw = *wd.add(i);
                        for t in 0..T {
                            // candle's mul_sum_i8_pairs_float + fmadd
                            let sy = _mm256_sign_epi8(av[t], wv);
                            let q = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, _mm256_maddubs_epi16(wabs, sy)));
                            acc_r[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da[t]), q, acc_r[t]);
                        }
                    }
                }
                for (r, acc_r) in acc.iter().enumerate() {
                    if r0 + r < nr {
                        for (t, v) in acc_r.iter().enumerate() {
                            *out.add((t0 + t) * rows + r0 + r) = hsum_f32(*v);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{PackedQ4_1, PackedQ8_0, QActs, Tile, Q4_BLOCK_BYTES, Q4_D_OFF, Q4_GROUP, Q4_M_OFF, Q8_GROUP, QK};

    /// One Q8_0 [`Tile`] with AVX-512 VNNI, in candle's AVX2 arithmetic: two rows per vector
    /// (lanes 0–7 and 8–15), each lane the exact integer sum of 4 products, then candle's
    /// `fmadd(d_w·d_a, q, acc)` and `hsum_float_8` per row. `vpdpbusd` needs one unsigned
    /// operand, so activations are biased by 128 (`a ^ 0x80`) and the weights' own
    /// `Σ 128·w` (one more `vpdpbusd`, shared by every token of the tile) is subtracted first:
    /// the sums stay exact integers, so the bits equal candle's.
    ///
    /// # Safety
    /// AVX-512 F, BW and VNNI must be available, `a` must hold `a.rows · w.k` values, and the
    /// [`Tile`] invariants must hold with `nt ≤ 4`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn q8_0(w: &PackedQ8_0, a: &QActs, tile: &Tile) {
        // SAFETY (all arms): the preconditions are forwarded unchanged.
        unsafe {
            match tile.nt {
                4 => q8_0_group::<4>(w, a, tile),
                3 => q8_0_group::<3>(w, a, tile),
                2 => q8_0_group::<2>(w, a, tile),
                1 => q8_0_group::<1>(w, a, tile),
                _ => {}
            }
        }
    }

    /// candle's `hsum_float_8` of one 8-lane half.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn hsum8(x: __m256) -> f32 {
        let res = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
        let res = _mm_add_ps(res, _mm_movehl_ps(res, res));
        let res = _mm_add_ss(res, _mm_movehdup_ps(res));
        _mm_cvtss_f32(res)
    }

    /// # Safety
    /// As [`q8_0`] with `nt = T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q8_0_group<const T: usize>(w: &PackedQ8_0, a: &QActs, tile: &Tile) {
        const PAIRS: usize = Q8_GROUP / 2;
        let k = a.k;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let nb = k / QK;
        let bias = _mm512_set1_epi8(-128);
        // SAFETY: group g has nb blocks of Q8_GROUP rows with 32 weight bytes and one f32
        // scale per (block, row), rows 2p and 2p+1 adjacent; token and output offsets as in
        // the Q4_1 kernels.
        unsafe {
            let wq = w.qs.as_ptr().add(g * nb * Q8_GROUP * QK);
            let wd = w.d.as_ptr().add(g * nb * Q8_GROUP);
            let mut acc = [[_mm512_setzero_ps(); T]; PAIRS];
            for b in 0..nb {
                let mut av = [_mm512_setzero_si512(); T];
                let mut da = [_mm512_setzero_ps(); T];
                for t in 0..T {
                    let src = a.qs.as_ptr().add((t0 + t) * k + b * QK) as *const __m256i;
                    av[t] = _mm512_xor_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256(src)), bias);
                    da[t] = _mm512_set1_ps(*a.d.as_ptr().add((t0 + t) * nb + b));
                }
                for (p, acc_p) in acc.iter_mut().enumerate() {
                    let i = b * Q8_GROUP + 2 * p;
                    let wv = _mm512_loadu_si512(wq.add(i * QK) as *const __m512i);
                    let corr =
                        _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, wv));
                    let dw = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(*wd.add(i)), _mm512_set1_ps(*wd.add(i + 1)));
                    for t in 0..T {
                        let q = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, av[t], wv));
                        acc_p[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da[t]), q, acc_p[t]);
                    }
                }
            }
            for (p, acc_p) in acc.iter().enumerate() {
                for (t, v) in acc_p.iter().enumerate() {
                    let lo = _mm512_castps512_ps256(*v);
                    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*v)));
                    for (r, half) in [(2 * p, lo), (2 * p + 1, hi)] {
                        if r < nr {
                            *out.add((t0 + t) * rows + r) = hsum8(half);
                        }
                    }
                }
            }
        }
    }

    /// One Q4_1 [`Tile`] with AVX-512 VNNI: the 16 rows of a group in the 16 lanes.
    ///
    /// # Safety
    /// AVX-512 F, BW and VNNI must be available, `a` must hold `a.rows · w.k` values, and the
    /// [`Tile`] invariants must hold with `nt ≤ 8`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn q4_1(w: &PackedQ4_1, a: &QActs, tile: &Tile) {
        // SAFETY (all arms): the preconditions are forwarded unchanged.
        unsafe {
            match tile.nt {
                8 => q4_1_group::<8>(w, a, tile),
                7 => q4_1_group::<7>(w, a, tile),
                6 => q4_1_group::<6>(w, a, tile),
                5 => q4_1_group::<5>(w, a, tile),
                4 => q4_1_group::<4>(w, a, tile),
                3 => q4_1_group::<3>(w, a, tile),
                2 => q4_1_group::<2>(w, a, tile),
                1 => q4_1_group::<1>(w, a, tile),
                _ => {}
            }
        }
    }

    /// # Safety
    /// As [`q4_1`] with `nt = T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q4_1_group<const T: usize>(w: &PackedQ4_1, a: &QActs, tile: &Tile) {
        let k = a.k;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let nb = k / QK;
        let mask = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); T];
        // SAFETY: as in the AVX2 `q4_1_group`; the masked store writes only lanes < nr.
        unsafe {
            let base = w.bytes().as_ptr().add(g * nb * Q4_BLOCK_BYTES);
            for b in 0..nb {
                let p = base.add(b * Q4_BLOCK_BYTES);
                let mut wv = [_mm512_setzero_si512(); 8];
                for v in 0..4 {
                    let raw = _mm512_loadu_si512(p.add(64 * v) as *const __m512i);
                    wv[v] = _mm512_and_si512(raw, mask);
                    wv[v + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(Q4_D_OFF) as *const __m256i));
                let mw = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(Q4_M_OFF) as *const __m256i));
                for (t, acc_t) in acc.iter_mut().enumerate() {
                    let tok = t0 + t;
                    let ap = a.qs.as_ptr().add(tok * k + b * QK) as *const i32;
                    // two independent chains halve the dependency latency (integer adds:
                    // the order does not matter)
                    let mut s0 = _mm512_setzero_si512();
                    let mut s1 = _mm512_setzero_si512();
                    for j in (0..8).step_by(2) {
                        s0 = _mm512_dpbusd_epi32(s0, wv[j], _mm512_set1_epi32(ap.add(j).read_unaligned()));
                        s1 = _mm512_dpbusd_epi32(s1, wv[j + 1], _mm512_set1_epi32(ap.add(j + 1).read_unaligned()));
                    }
                    let sumi = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                    let da = _mm512_set1_ps(*a.d.as_ptr().add(tok * nb + b));
                    let sa = _mm512_set1_ps(*a.s.as_ptr().add(tok * nb + b));
                    // candle: sumf += sumi * d_w * d_a + m_w * s_a  (no FMA contraction)
                    let term = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(sumi, dw), da), _mm512_mul_ps(mw, sa));
                    *acc_t = _mm512_add_ps(*acc_t, term);
                }
            }
            let lanes: __mmask16 = if nr >= Q4_GROUP { 0xFFFF } else { (1u16 << nr) - 1 };
            for (t, acc_t) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(out.add((t0 + t) * rows), lanes, *acc_t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random bytes.
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect()
    }

    /// Valid GGUF blocks with small, finite f16 scales.
    fn q4_1_bytes(rows: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut b = bytes(rows * k / QK * 20, seed);
        for (i, blk) in b.chunks_exact_mut(20).enumerate() {
            let d = f16::from_f32(0.001 + (i % 7) as f32 * 0.003).to_le_bytes();
            let m = f16::from_f32(-0.02 + (i % 5) as f32 * 0.004).to_le_bytes();
            blk[0..2].copy_from_slice(&d);
            blk[2..4].copy_from_slice(&m);
        }
        b
    }

    fn q8_0_bytes(rows: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut b = bytes(rows * k / QK * 34, seed);
        for (i, blk) in b.chunks_exact_mut(34).enumerate() {
            blk[0..2].copy_from_slice(&f16::from_f32(0.0005 + (i % 3) as f32 * 0.001).to_le_bytes());
        }
        b
    }

    fn acts(m: usize, k: usize, seed: u64) -> Vec<f32> {
        bytes(m * k, seed)
            .iter()
            .enumerate()
            .map(|(i, &b)| (f32::from(b) - 127.5) * 0.01 * (1.0 + (i % 13) as f32))
            .collect()
    }

    /// candle's QMatMul on the same raw blocks: the reference our kernels must equal bitwise.
    fn candle_matmul(
        dtype: candle_core::quantized::GgmlDType,
        raw: &[u8],
        rows: usize,
        k: usize,
        x: &[f32],
        m: usize,
    ) -> Vec<f32> {
        use candle_core::quantized::{QMatMul, QStorage, QTensor};
        use candle_core::{Device, Module, Tensor};
        let storage = QStorage::from_data(std::borrow::Cow::Borrowed(raw), &Device::Cpu, dtype).unwrap();
        let qt = QTensor::new(storage, (rows, k)).unwrap();
        let mm = QMatMul::from_qtensor(qt).unwrap();
        let xt = Tensor::from_slice(x, (m, k), &Device::Cpu).unwrap();
        mm.forward(&xt).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    fn ours(w: &Packed, x: &[f32], m: usize, imp: Impl, pool: &Pool) -> Vec<f32> {
        let (rows, k) = (w.rows(), w.k());
        let mut a = QActs::default();
        a.quantize(x, m, k, pool);
        let mut out = vec![0f32; m * rows];
        matmul(w, &a, &mut out, imp, pool).unwrap();
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn q4_1_is_bit_identical_to_candle() {
        use candle_core::quantized::GgmlDType;
        let pool = Pool::new(2, 0);
        for &(rows, k, m) in &[(16, 64, 1), (24, 576, 3), (40, 1536, 9), (8, 32, 5), (13, 96, 2), (48, 128, 17)] {
            let raw = q4_1_bytes(rows, k, rows as u64 * 31 + k as u64);
            let w = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&raw, rows, k).unwrap());
            let x = acts(m, k, 7 + m as u64);
            let want = candle_matmul(GgmlDType::Q4_1, &raw, rows, k, &x, m);
            for imp in Impl::available() {
                assert_eq!(bits(&ours(&w, &x, m, imp, &pool)), bits(&want), "{imp:?} {rows}x{k} m={m}");
            }
        }
    }

    #[test]
    fn q8_0_matches_candle() {
        use candle_core::quantized::GgmlDType;
        let pool = Pool::new(2, 0);
        for &(rows, k, m) in &[(16, 576, 1), (40, 576, 6), (12, 64, 3)] {
            let raw = q8_0_bytes(rows, k, rows as u64 + 3);
            let w = Packed::Q8_0(PackedQ8_0::from_gguf_bytes(&raw, rows, k).unwrap());
            let x = acts(m, k, 11 + m as u64);
            let want = candle_matmul(GgmlDType::Q8_0, &raw, rows, k, &x, m);
            for imp in Impl::available().into_iter().filter(|&i| i != Impl::Scalar) {
                // candle uses its AVX2 vec_dot here too: same instructions, same bits
                assert_eq!(bits(&ours(&w, &x, m, imp, &pool)), bits(&want), "{imp:?} {rows}x{k} m={m}");
            }
            // the scalar path is candle's scalar formula: equal up to summation order
            for (a, b) in ours(&w, &x, m, Impl::Scalar, &pool).iter().zip(&want) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_batch_or_threads() {
        let (rows, k) = (32, 256);
        let raw = q4_1_bytes(rows, k, 5);
        let w = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&raw, rows, k).unwrap());
        let x = acts(7, k, 9);
        let one = Pool::new(1, 0);
        let three = Pool::new(3, 0);
        for imp in Impl::available() {
            let batched = ours(&w, &x, 7, imp, &three);
            for t in 0..7 {
                let alone = ours(&w, &x[t * k..(t + 1) * k], 1, imp, &one);
                assert_eq!(bits(&alone), bits(&batched[t * rows..(t + 1) * rows]), "{imp:?}");
            }
        }
    }

    #[test]
    fn fused_rows_equal_separate_matmuls() {
        let k = 64;
        let a = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(16, k, 1), 16, k).unwrap());
        let b = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(32, k, 2), 32, k).unwrap());
        let ab = Packed::concat(&[&a, &b]).unwrap();
        let pool = Pool::new(2, 0);
        let x = acts(3, k, 4);
        for imp in Impl::available() {
            let (ya, yb, yab) =
                (ours(&a, &x, 3, imp, &pool), ours(&b, &x, 3, imp, &pool), ours(&ab, &x, 3, imp, &pool));
            for t in 0..3 {
                assert_eq!(bits(&yab[t * 48..t * 48 + 16]), bits(&ya[t * 16..t * 16 + 16]), "{imp:?}");
                assert_eq!(bits(&yab[t * 48 + 16..t * 48 + 48]), bits(&yb[t * 32..t * 32 + 32]), "{imp:?}");
            }
        }
        // rows that do not fill whole groups are not fused
        let c = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(8, k, 3), 8, k).unwrap());
        assert!(Packed::concat(&[&a, &c]).is_none());
    }

    #[test]
    fn gathered_weights_give_the_same_bits_from_one_mapping() {
        let k = 64;
        let pool = Pool::new(2, 0);
        let x = acts(3, k, 8);
        let mut a = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(16, k, 1), 16, k).unwrap());
        let mut b = Packed::Q8_0(PackedQ8_0::from_gguf_bytes(&q8_0_bytes(16, k, 2), 16, k).unwrap());
        let mut c = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(32, k, 3), 32, k).unwrap());
        let before: Vec<Vec<Vec<f32>>> = Impl::available()
            .into_iter()
            .map(|imp| [&a, &b, &c].map(|w| ours(w, &x, 3, imp, &pool)).to_vec())
            .collect();
        gather_weights(&mut [&mut a, &mut b, &mut c]).unwrap();
        let (Packed::Q4_1(pa), Packed::Q4_1(pc)) = (&a, &c) else { unreachable!() };
        let (Store::Shared(ba, ra), Store::Shared(bc, rc)) = (&pa.data, &pc.data) else {
            panic!("the Q4_1 matrices were not moved")
        };
        assert!(Arc::ptr_eq(ba, bc), "one mapping for every Q4_1 matrix");
        assert_eq!(ra.end, rc.start, "laid end to end");
        assert!(matches!(&b, Packed::Q8_0(p) if matches!((&p.qs, &p.d), (Store::Shared(..), Store::Shared(..)))));
        for (imp, want) in Impl::available().into_iter().zip(before) {
            let got = [&a, &b, &c].map(|w| ours(w, &x, 3, imp, &pool));
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(bits(g), bits(w), "{imp:?}");
            }
        }
    }

    #[test]
    fn rounding_matches_std() {
        for i in -3000..3000 {
            let x = i as f32 * 0.0625 + 0.001 * (i % 7) as f32;
            assert_eq!(simd::round_half_away(x), x.round(), "{x}");
        }
        for x in [0.5f32, -0.5, 1.5, -1.5, 2.5, 126.5, -127.49999, 0.49999997, -0.0] {
            assert_eq!(simd::round_half_away(x).to_bits(), x.round().to_bits(), "{x}");
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let w = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(8, 64, 1), 8, 64).unwrap());
        let mut a = QActs::default();
        a.quantize(&acts(2, 32, 1), 2, 32, &Pool::new(1, 0));
        let mut out = vec![0f32; 16];
        assert!(matmul(&w, &a, &mut out, Impl::detect(), &Pool::new(1, 0)).is_err());
        assert!(PackedQ4_1::from_gguf_bytes(&[0u8; 19], 1, 32).is_none());
    }
}
