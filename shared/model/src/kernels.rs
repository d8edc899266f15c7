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
//!   block by block in f32. We compute each block's integer `sumi_b` with AVX2
//!   (`vpmaddubsw`/`vpmaddwd`) for 8 weight rows at once, reduce the 8 rows' lanes with a
//!   horizontal-add tree into one vector holding the 8 exact integer sums, and then do the
//!   float part for 8 rows in the 8 lanes with the same operations in the same order;
//! - Q8_0 (the tied output projection): candle's AVX2 `vec_dot` accumulates in 8 lanes with
//!   FMA and sums the lanes in a fixed order; we run the same instruction sequence, 4 rows ×
//!   up to 4 tokens per tile.
//!
//! Weights are repacked at load time into groups of 8 rows, block-interleaved
//! (`[group][block][row][bytes]`), with the f16 scales widened to f32 once, so a decode step
//! streams each matrix front to back. Every (row, token) result is computed by the same
//! operations whatever tile, batch or thread split it lands in, so batching never changes a
//! bit. The AVX2+FMA path is chosen at run time; the portable scalar path computes the same
//! Q4_1 bits (and Q8_0 as candle's own scalar fallback does).

#![allow(unsafe_code)]

use half::f16;

use crate::pool::{Pool, SendPtr};

/// Values per quantization block (Q4_1, Q8_0 and activation blocks alike).
pub const QK: usize = 32;
/// Weight rows per packed group.
const GROUP: usize = 8;
/// Tokens per tile.
const TILE_T: usize = 4;

/// Which implementation a matmul uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Impl {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Impl {
    /// The best implementation for this CPU (`PDMESH_MODEL_KERNELS=scalar` forces the portable
    /// one).
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::env::var("PDMESH_MODEL_KERNELS").as_deref() != Ok("scalar")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
        {
            return Impl::Avx2;
        }
        Impl::Scalar
    }
}

/// Activations `[rows, k]` quantized to 8 bits in blocks of [`QK`], with candle's rounding.
#[derive(Debug, Default, Clone)]
pub struct QActs {
    pub rows: usize,
    pub k: usize,
    qs: Vec<i8>,
    /// Block scale (an f16 value, widened).
    d: Vec<f32>,
    /// Q8_1 `s = f16(Σq) · d` computed in f16 (widened); used by Q4_1.
    s: Vec<f32>,
}

impl QActs {
    /// Quantize `x` (`rows × k`, `k` a multiple of [`QK`]) into `self`, reusing its buffers.
    pub fn quantize(&mut self, x: &[f32], rows: usize, k: usize) {
        let nb = k / QK;
        self.rows = rows;
        self.k = k;
        self.qs.clear();
        self.qs.resize(rows * k, 0);
        self.d.clear();
        self.d.resize(rows * nb, 0.0);
        self.s.clear();
        self.s.resize(rows * nb, 0.0);
        for ((xb, qb), (d, s)) in
            x.chunks_exact(QK).zip(self.qs.chunks_exact_mut(QK)).zip(self.d.iter_mut().zip(self.s.iter_mut()))
        {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                let r = round_half_away(v * inv) as i8;
                *q = r;
                sum += i32::from(r);
            }
            let d16 = f16::from_f32(scale);
            *d = d16.to_f32();
            *s = (f16::from_f32(sum as f32) * d16).to_f32();
        }
    }
}

/// `x.round()` (half away from zero, as candle uses) without the libm call, so the loop
/// vectorises: truncate, then step away from zero when the dropped fraction is ≥ 0.5. Exact for
/// every finite f32 (the subtraction of the truncated part is exact).
#[inline]
fn round_half_away(x: f32) -> f32 {
    let t = x.trunc();
    if (x - t).abs() >= 0.5 {
        t + 1f32.copysign(x)
    } else {
        t
    }
}

fn f16_le(b: &[u8]) -> f32 {
    match b {
        [lo, hi, ..] => f16::from_le_bytes([*lo, *hi]).to_f32(),
        _ => 0.0,
    }
}

/// Q4_1 weights `[rows, k]` in 8-row groups: per block `w = d·q + m`, `q ∈ 0..16`; byte `j`
/// of a block holds element `j` (low nibble) and element `j + 16` (high nibble), as in GGUF.
#[derive(Debug, Clone)]
pub struct PackedQ4_1 {
    pub rows: usize,
    pub k: usize,
    /// `[group][block][row][16]`.
    qs: Vec<u8>,
    /// `[group][block][row]`.
    d: Vec<f32>,
    m: Vec<f32>,
}

/// Q8_0 weights `[rows, k]` in 8-row groups: per block `w = d·q`, `q: i8`.
#[derive(Debug, Clone)]
pub struct PackedQ8_0 {
    pub rows: usize,
    pub k: usize,
    /// `[group][block][row][32]`.
    qs: Vec<i8>,
    /// `[group][block][row]`.
    d: Vec<f32>,
}

impl PackedQ4_1 {
    /// Repack raw GGUF Q4_1 blocks (20 bytes: f16 d, f16 m, 16 bytes of nibbles), row-major.
    pub fn from_gguf_bytes(bytes: &[u8], rows: usize, k: usize) -> Option<Self> {
        if !k.is_multiple_of(QK) || bytes.len() != rows * (k / QK) * 20 {
            return None;
        }
        let nb = k / QK;
        let groups = rows.div_ceil(GROUP);
        let mut qs = vec![0u8; groups * nb * GROUP * 16];
        let mut d = vec![0f32; groups * nb * GROUP];
        let mut m = vec![0f32; groups * nb * GROUP];
        for (row, rb) in bytes.chunks_exact(nb * 20).enumerate() {
            let (g, r) = (row / GROUP, row % GROUP);
            for (b, blk) in rb.chunks_exact(20).enumerate() {
                let i = (g * nb + b) * GROUP + r;
                d[i] = f16_le(&blk[0..2]);
                m[i] = f16_le(&blk[2..4]);
                qs[i * 16..i * 16 + 16].copy_from_slice(&blk[4..20]);
            }
        }
        Some(Self { rows, k, qs, d, m })
    }
}

impl PackedQ8_0 {
    /// Repack raw GGUF Q8_0 blocks (34 bytes: f16 d, 32 × i8), row-major.
    pub fn from_gguf_bytes(bytes: &[u8], rows: usize, k: usize) -> Option<Self> {
        if !k.is_multiple_of(QK) || bytes.len() != rows * (k / QK) * 34 {
            return None;
        }
        let nb = k / QK;
        let groups = rows.div_ceil(GROUP);
        let mut qs = vec![0i8; groups * nb * GROUP * QK];
        let mut d = vec![0f32; groups * nb * GROUP];
        for (row, rb) in bytes.chunks_exact(nb * 34).enumerate() {
            let (g, r) = (row / GROUP, row % GROUP);
            for (b, blk) in rb.chunks_exact(34).enumerate() {
                let i = (g * nb + b) * GROUP + r;
                d[i] = f16_le(&blk[0..2]);
                for (dst, &src) in qs[i * QK..i * QK + QK].iter_mut().zip(&blk[2..34]) {
                    *dst = src as i8;
                }
            }
        }
        Some(Self { rows, k, qs, d })
    }
}

/// A weight matrix one of our kernels can multiply.
#[derive(Debug, Clone)]
pub enum Packed {
    Q4_1(PackedQ4_1),
    Q8_0(PackedQ8_0),
}

impl Packed {
    pub fn rows(&self) -> usize {
        match self {
            Packed::Q4_1(w) => w.rows,
            Packed::Q8_0(w) => w.rows,
        }
    }

    pub fn k(&self) -> usize {
        match self {
            Packed::Q4_1(w) => w.k,
            Packed::Q8_0(w) => w.k,
        }
    }

    /// Stack the rows of matrices of the same type and `k` (to fuse projections that read the
    /// same input, e.g. Q, K and V). Needs every part's rows to fill whole 8-row groups.
    pub fn concat(parts: &[&Packed]) -> Option<Packed> {
        let first = parts.first()?;
        let k = first.k();
        if parts.iter().any(|p| p.k() != k || p.rows() % GROUP != 0) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows()).sum();
        match first {
            Packed::Q4_1(_) => {
                let mut out = PackedQ4_1 { rows, k, qs: Vec::new(), d: Vec::new(), m: Vec::new() };
                for p in parts {
                    let Packed::Q4_1(p) = p else { return None };
                    out.qs.extend_from_slice(&p.qs);
                    out.d.extend_from_slice(&p.d);
                    out.m.extend_from_slice(&p.m);
                }
                Some(Packed::Q4_1(out))
            }
            Packed::Q8_0(_) => {
                let mut out = PackedQ8_0 { rows, k, qs: Vec::new(), d: Vec::new() };
                for p in parts {
                    let Packed::Q8_0(p) = p else { return None };
                    out.qs.extend_from_slice(&p.qs);
                    out.d.extend_from_slice(&p.d);
                }
                Some(Packed::Q8_0(out))
            }
        }
    }
}

/// Why a kernel call was refused (a shape mismatch: a caller bug, reported instead of a panic).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

/// `out[m, rows] = acts · Wᵀ`, computed on `pool`, one 8-row group per work item.
pub fn matmul(w: &Packed, acts: &QActs, out: &mut [f32], imp: Impl, pool: &Pool) -> Result<(), ShapeError> {
    let (rows, k, m) = (w.rows(), w.k(), acts.rows);
    if acts.k != k || out.len() != rows * m || acts.qs.len() != m * k || k % QK != 0 {
        return Err(ShapeError(format!("matmul [{rows}x{k}] x acts [{m}x{}] into {} values", acts.k, out.len())));
    }
    if m == 0 || rows == 0 {
        return Ok(());
    }
    let dst = SendPtr(out.as_mut_ptr());
    let ok = pool.for_each(rows.div_ceil(GROUP), &|g| {
        let nr = (rows - g * GROUP).min(GROUP);
        let mut t0 = 0;
        while t0 < m {
            let nt = (m - t0).min(TILE_T);
            let tile = Tile { g, nr, t0, nt, rows, out: dst.get() };
            match imp {
                // SAFETY: see `Tile`: group g < groups, t0 + nt ≤ m, out holds m·rows values;
                // each group writes only its own columns, so work items never overlap.
                Impl::Scalar => unsafe { scalar_group(w, acts, &tile) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above, and `Impl::Avx2` is only constructed after detecting AVX2
                // and FMA; packed groups are complete (padding rows are zero-filled).
                Impl::Avx2 => unsafe { avx2::group(w, acts, &tile) },
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

/// One unit of kernel work: weight rows `g·8 .. g·8+nr` × tokens `t0 .. t0+nt`, written to
/// `out[t·rows + row]`.
///
/// Invariants the kernels rely on: `g < rows.div_ceil(8)`, `nr = min(8, rows − g·8)`,
/// `nt ≤ 4`, `t0 + nt ≤ acts.rows`, and `out` points to `acts.rows · rows` writable values
/// that no other thread writes in these columns.
struct Tile {
    g: usize,
    nr: usize,
    t0: usize,
    nt: usize,
    rows: usize,
    out: *mut f32,
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
                let i = (g * nb + b) * GROUP + r;
                let da = a.d[tok * nb + b];
                let aqb = &aq[b * QK..(b + 1) * QK];
                match w {
                    Packed::Q4_1(w) => {
                        let mut sumi = 0i32;
                        for (j, &byte) in w.qs[i * 16..i * 16 + 16].iter().enumerate() {
                            sumi += i32::from(byte & 0x0F) * i32::from(aqb[j])
                                + i32::from(byte >> 4) * i32::from(aqb[j + 16]);
                        }
                        sumf += sumi as f32 * w.d[i] * da + w.m[i] * a.s[tok * nb + b];
                    }
                    Packed::Q8_0(w) => {
                        let sumi: i32 =
                            w.qs[i * QK..i * QK + QK].iter().zip(aqb).map(|(&x, &y)| i32::from(x) * i32::from(y)).sum();
                        sumf += sumi as f32 * w.d[i] * da;
                    }
                }
            }
            // SAFETY: tok < m and g·8 + r < rows (Tile invariants).
            unsafe { *out.add(tok * rows + g * GROUP + r) = sumf };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Packed, PackedQ4_1, PackedQ8_0, QActs, Tile, GROUP, QK};

    /// One [`Tile`] with the AVX2 kernels.
    ///
    /// # Safety
    /// AVX2 and FMA must be available, `a` must hold `a.rows · w.k` values, and the [`Tile`]
    /// invariants must hold.
    #[target_feature(enable = "avx2,fma")]
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

    /// Sum each of 8 vectors of 8 `i32` lanes: lane `i` of the result is the total of `v[i]`.
    /// Integer adds are exact, so the tree's order does not matter.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum8_i32(v: &[__m256i; 8]) -> __m256i {
        let s01 = _mm256_hadd_epi32(v[0], v[1]);
        let s23 = _mm256_hadd_epi32(v[2], v[3]);
        let s45 = _mm256_hadd_epi32(v[4], v[5]);
        let s67 = _mm256_hadd_epi32(v[6], v[7]);
        // per 128-bit half: [v0, v1, v2, v3] partials (low half: lanes 0-3, high half: 4-7)
        let s0123 = _mm256_hadd_epi32(s01, s23);
        let s4567 = _mm256_hadd_epi32(s45, s67);
        let lo = _mm256_permute2x128_si256::<0x20>(s0123, s4567);
        let hi = _mm256_permute2x128_si256::<0x31>(s0123, s4567);
        _mm256_add_epi32(lo, hi)
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

    /// # Safety
    /// As [`group`] with `nt = T`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4_1_group<const T: usize>(w: &PackedQ4_1, a: &QActs, tile: &Tile) {
        let k = a.k;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let nb = k / QK;
        let mask = _mm_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        // SAFETY: group g has nb blocks of GROUP rows: qs has 16 bytes, d/m one f32 per (block,
        // row), so every offset below is < (g+1)·nb·GROUP·{16,1}; token rows t0..t0+T < m, so
        // activation offsets are < m·k (qs) and < m·nb (d, s); output offsets are
        // (t0+t)·rows + g·8 + r with r < nr (Tile invariants). Loads/stores are unaligned.
        unsafe {
            let wq = w.qs.as_ptr().add(g * nb * GROUP * 16);
            let wd = w.d.as_ptr().add(g * nb * GROUP);
            let wm = w.m.as_ptr().add(g * nb * GROUP);
            for b in 0..nb {
                let mut wv = [_mm256_setzero_si256(); GROUP];
                for (r, v) in wv.iter_mut().enumerate() {
                    let bytes = _mm_loadu_si128(wq.add((b * GROUP + r) * 16) as *const __m128i);
                    let lo = _mm_and_si128(bytes, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), mask);
                    *v = _mm256_set_m128i(hi, lo);
                }
                let dxv = _mm256_loadu_ps(wd.add(b * GROUP));
                let mxv = _mm256_loadu_ps(wm.add(b * GROUP));
                for (t, acc_t) in acc.iter_mut().enumerate() {
                    let tok = t0 + t;
                    let av = _mm256_loadu_si256(a.qs.as_ptr().add(tok * k + b * QK) as *const __m256i);
                    let mut p = [_mm256_setzero_si256(); GROUP];
                    for (pr, wr) in p.iter_mut().zip(&wv) {
                        *pr = _mm256_madd_epi16(_mm256_maddubs_epi16(*wr, av), ones);
                    }
                    let sumi = _mm256_cvtepi32_ps(hsum8_i32(&p));
                    let da = _mm256_set1_ps(*a.d.as_ptr().add(tok * nb + b));
                    let sa = _mm256_set1_ps(*a.s.as_ptr().add(tok * nb + b));
                    // candle: sumf += sumi * d_w * d_a + m_w * s_a  (no FMA contraction)
                    let term = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(sumi, dxv), da), _mm256_mul_ps(mxv, sa));
                    *acc_t = _mm256_add_ps(*acc_t, term);
                }
            }
            for (t, acc_t) in acc.iter().enumerate() {
                let dst = out.add((t0 + t) * rows + g * GROUP);
                if nr == GROUP {
                    _mm256_storeu_ps(dst, *acc_t);
                } else {
                    let mut lanes = [0f32; GROUP];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), *acc_t);
                    for (r, &v) in lanes.iter().enumerate().take(nr) {
                        *dst.add(r) = v;
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
        // SAFETY: as in `q4_1_group`, with 32 weight bytes per (block, row).
        unsafe {
            let wq = w.qs.as_ptr().add(g * nb * GROUP * QK);
            let wd = w.d.as_ptr().add(g * nb * GROUP);
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
                        let i = b * GROUP + r0 + r;
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
                            *out.add((t0 + t) * rows + g * GROUP + r0 + r) = hsum_f32(*v);
                        }
                    }
                }
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
        a.quantize(x, m, k);
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
        let pool = Pool::new(2);
        for &(rows, k, m) in &[(16, 64, 1), (24, 576, 3), (40, 1536, 9), (8, 32, 5), (13, 96, 2)] {
            let raw = q4_1_bytes(rows, k, rows as u64 * 31 + k as u64);
            let w = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&raw, rows, k).unwrap());
            let x = acts(m, k, 7 + m as u64);
            let want = candle_matmul(GgmlDType::Q4_1, &raw, rows, k, &x, m);
            assert_eq!(bits(&ours(&w, &x, m, Impl::Scalar, &pool)), bits(&want), "scalar {rows}x{k} m={m}");
            let detected = Impl::detect();
            assert_eq!(bits(&ours(&w, &x, m, detected, &pool)), bits(&want), "{detected:?} {rows}x{k} m={m}");
        }
    }

    #[test]
    fn q8_0_matches_candle() {
        use candle_core::quantized::GgmlDType;
        let pool = Pool::new(2);
        for &(rows, k, m) in &[(16, 576, 1), (40, 576, 6), (12, 64, 3)] {
            let raw = q8_0_bytes(rows, k, rows as u64 + 3);
            let w = Packed::Q8_0(PackedQ8_0::from_gguf_bytes(&raw, rows, k).unwrap());
            let x = acts(m, k, 11 + m as u64);
            let want = candle_matmul(GgmlDType::Q8_0, &raw, rows, k, &x, m);
            let detected = Impl::detect();
            let got = ours(&w, &x, m, detected, &pool);
            #[cfg(target_arch = "x86_64")]
            if detected == Impl::Avx2 {
                // candle uses its AVX2 vec_dot here too: same instructions, same bits
                assert_eq!(bits(&got), bits(&want), "{rows}x{k} m={m}");
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
        let one = Pool::new(1);
        let three = Pool::new(3);
        let imp = Impl::detect();
        let batched = ours(&w, &x, 7, imp, &three);
        for t in 0..7 {
            let alone = ours(&w, &x[t * k..(t + 1) * k], 1, imp, &one);
            assert_eq!(bits(&alone), bits(&batched[t * rows..(t + 1) * rows]));
        }
    }

    #[test]
    fn fused_rows_equal_separate_matmuls() {
        let k = 64;
        let a = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(16, k, 1), 16, k).unwrap());
        let b = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(8, k, 2), 8, k).unwrap());
        let ab = Packed::concat(&[&a, &b]).unwrap();
        let pool = Pool::new(2);
        let x = acts(3, k, 4);
        let imp = Impl::detect();
        let (ya, yb, yab) = (ours(&a, &x, 3, imp, &pool), ours(&b, &x, 3, imp, &pool), ours(&ab, &x, 3, imp, &pool));
        for t in 0..3 {
            assert_eq!(bits(&yab[t * 24..t * 24 + 16]), bits(&ya[t * 16..t * 16 + 16]));
            assert_eq!(bits(&yab[t * 24 + 16..t * 24 + 24]), bits(&yb[t * 8..t * 8 + 8]));
        }
        // rows that do not fill whole groups are not fused
        let c = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(5, k, 3), 5, k).unwrap());
        assert!(Packed::concat(&[&a, &c]).is_none());
    }

    #[test]
    fn rounding_matches_std() {
        for i in -3000..3000 {
            let x = i as f32 * 0.0625 + 0.001 * (i % 7) as f32;
            assert_eq!(round_half_away(x), x.round(), "{x}");
        }
        for x in [0.5f32, -0.5, 1.5, -1.5, 2.5, 126.5, -127.49999, 0.49999997, -0.0] {
            assert_eq!(round_half_away(x).to_bits(), x.round().to_bits(), "{x}");
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let w = Packed::Q4_1(PackedQ4_1::from_gguf_bytes(&q4_1_bytes(8, 64, 1), 8, 64).unwrap());
        let mut a = QActs::default();
        a.quantize(&acts(2, 32, 1), 2, 32);
        let mut out = vec![0f32; 16];
        assert!(matmul(&w, &a, &mut out, Impl::detect(), &Pool::new(1)).is_err());
        assert!(PackedQ4_1::from_gguf_bytes(&[0u8; 19], 1, 32).is_none());
    }
}
