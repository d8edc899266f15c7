//! Matmul kernels for the GGUF types of Q4_K_M files (Q4_K, Q5_K, Q6_K, Q5_0; also Q4_0) and
//! for float weights (F32, F16, BF16). The Q4_1/Q8_0 kernels live in [`crate::kernels`], which
//! dispatches to these through [`crate::kernels::Packed`].
//!
//! **Rows in lanes.** Weights are repacked at load into groups of 8 rows ([`LANES`], one f32
//! lane each in an AVX2 register). A block's values are cut into *quads* (4 consecutive
//! values) and stored so that 32 bytes hold one quad of each of the 8 rows: byte `4r + e` of
//! the vector for quad `q` is value `4q + e` of row `r`. One `vpmaddubsw` of that vector with
//! the 4 matching activation bytes broadcast to every lane, then `vpmaddwd`, adds each row's
//! partial dot product into its own lane: no horizontal sums, and a decode step streams each
//! matrix front to back once. Two quads share a byte (low and high nibble) and the 5th/6th bits
//! of every quad of a sub-block sit in one more vector, so the packed matrix is as small as
//! the file's blocks (Q4_K and Q5_K: +4 bytes per 256 values, their 6-bit scales unpacked).
//! A tile decodes a sub-block of 8 rows to bytes once and reuses it for up to 8 tokens.
//!
//! **Arithmetic.** Integer dot products are exact however they are summed; the float part of
//! every (row, token) result follows one fixed sequence, the same in the AVX2 and the scalar
//! path (bit-identical) and whatever the batch, tile or thread split:
//!
//! - Q4_K (Q5_K the same with 5-bit values), activations in Q8_K (candle's
//!   `BlockQ8K::from_float`: 256 values, `d = max / -127`, per-16 sums): per sub-block `s` of 32
//!   `acc = fma(isum_s, (d·sc_s)·d_a, acc); acc = fma(−(dmin·m_s), d_a·(bsum_2s + bsum_2s+1), acc)`
//!   — candle 0.11.1's own AVX2 Q4_K path (`repack_x86`, used at every batch size), so Q4_K
//!   equals candle's `QMatMul` bit for bit;
//! - Q6_K: candle's one-token arithmetic (`vec_dot_q6k_q8k`, AVX2, what its `QMatMul` runs at
//!   m = 1) at every batch size: per super-block 8 exact integer partial sums `sumi_L` (lane
//!   `L` takes the 4 values `4L..4L+4` of every 32, each `sc·(v − 32)·x`), then
//!   `acc_L = fma(d_a·d, sumi_L, acc_L)`, and candle's `hsum_float_8` of the 8 accumulators.
//!   So a one-token reference matches bit for bit; candle's own batches (m > 1) use a
//!   repacked kernel with per-sub-block float sums, which differs from its m = 1 result;
//! - Q5_0 and Q4_0, activations in Q8_0: per block `acc += (sumi·d_w)·d_a`, candle's scalar
//!   `vec_dot` for Q5_0 (bit-identical; candle has no SIMD Q5_0). candle's Q4_0 uses an AVX2
//!   `vec_dot` with 8 partial sums (last-bit differences);
//! - F32/F16/BF16: per row 8 lanes of `fma(w, x)` in order, then candle's `hsum_float_8`; candle
//!   multiplies these with a dense f32 matmul (gemm), a different summation order.
//!
//! Where we differ from candle, the difference is rounding of a sum of the same exact terms:
//! relative to `Σ|w·x|` it stays below 1e-5 (asserted in the tests).

#![allow(unsafe_code)]

use candle_core::quantized::GgmlDType;
use half::{bf16, f16};

use crate::kernels::{QActs, Store, Tile};

/// Values per K-quant super-block (and per Q8_K activation block).
pub const QK_K: usize = 256;
/// Weight rows per packed group: one f32 lane per row in an AVX2 register.
pub const LANES: usize = 8;
/// Weight rows per group of a float matrix.
pub const FLOAT_GROUP: usize = 4;

/// The quantized types packed rows-in-lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Q4_0 = 0,
    Q5_0 = 1,
    Q4K = 2,
    Q5K = 3,
    Q6K = 4,
}

/// The layout constants of one [`Kind`].
#[derive(Debug, Clone, Copy)]
struct Layout {
    /// Values per GGUF block.
    block: usize,
    /// Bytes per GGUF block.
    gguf_bytes: usize,
    /// Values per sub-block (one integer sum and one scale each).
    sub: usize,
    /// Value bits above the low nibble (0, 1 or 2).
    hbits: usize,
    /// 6-bit scales and mins (Q4_K, Q5_K).
    mins: bool,
    /// Per-sub-block scales at all (K-quants).
    scales: bool,
}

impl Layout {
    const fn of(kind: Kind) -> Self {
        match kind {
            Kind::Q4_0 => Layout { block: 32, gguf_bytes: 18, sub: 32, hbits: 0, mins: false, scales: false },
            Kind::Q5_0 => Layout { block: 32, gguf_bytes: 22, sub: 32, hbits: 1, mins: false, scales: false },
            Kind::Q4K => Layout { block: QK_K, gguf_bytes: 144, sub: 32, hbits: 0, mins: true, scales: true },
            Kind::Q5K => Layout { block: QK_K, gguf_bytes: 176, sub: 32, hbits: 1, mins: true, scales: true },
            Kind::Q6K => Layout { block: QK_K, gguf_bytes: 210, sub: 16, hbits: 2, mins: false, scales: true },
        }
    }
    const fn subs(&self) -> usize {
        self.block / self.sub
    }
    /// Quads per sub-block.
    const fn quads(&self) -> usize {
        self.sub / 4
    }
    /// Bytes per (group, sub-block): nibbles of 8 rows, then the high-bit vector.
    const fn sub_bytes(&self) -> usize {
        self.sub * 4 + if self.hbits > 0 { 32 } else { 0 }
    }
    /// Offset of the per-(sub-block, row) scale bytes inside a (group, block) chunk.
    const fn sc_off(&self) -> usize {
        self.subs() * self.sub_bytes()
    }
    /// Offset of the mins (Q4_K/Q5_K).
    const fn mn_off(&self) -> usize {
        self.sc_off() + if self.scales { self.subs() * LANES } else { 0 }
    }
    /// Offset of the 8 rows' f16 `d`, followed (with mins) by their f16 `dmin`.
    const fn d_off(&self) -> usize {
        self.mn_off() + if self.mins { self.subs() * LANES } else { 0 }
    }
    /// Bytes per (group, block).
    const fn chunk(&self) -> usize {
        self.d_off() + 2 * LANES * if self.mins { 2 } else { 1 }
    }
    /// Subtracted from every value (Q4_0: 8, Q5_0: 16); K-quants handle it through scales.
    const fn offset(&self) -> i32 {
        match (self.block, self.hbits) {
            (32, 0) => 8,
            (32, _) => 16,
            _ => 0,
        }
    }
}

impl Kind {
    pub fn from_dtype(dtype: GgmlDType) -> Option<Kind> {
        Some(match dtype {
            GgmlDType::Q4_0 => Kind::Q4_0,
            GgmlDType::Q5_0 => Kind::Q5_0,
            GgmlDType::Q4K => Kind::Q4K,
            GgmlDType::Q5K => Kind::Q5K,
            GgmlDType::Q6K => Kind::Q6K,
            _ => return None,
        })
    }

    /// Whether the activations are Q8_K (else Q8_0 blocks of 32).
    pub fn q8k(self) -> bool {
        Layout::of(self).block == QK_K
    }
}

/// Scales of one decoded GGUF block.
#[derive(Debug, Default, Clone, Copy)]
pub struct BlockParams {
    /// f16 bits of `d`.
    pub d: u16,
    /// f16 bits of `dmin` (Q4_K, Q5_K).
    pub dmin: u16,
    /// Per-sub-block scales (Q6_K: i8 stored as u8).
    pub sc: [u8; 16],
    /// Per-sub-block mins (Q4_K, Q5_K).
    pub mn: [u8; 8],
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    match b.get(i..i + 2) {
        Some(&[lo, hi]) => u16::from_le_bytes([lo, hi]),
        _ => 0,
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` from the 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Decode one GGUF block (`blk`: exactly the block's bytes) into its unsigned values
/// (`vals`: `block` of them; Q4_0/Q4_K 0..16, Q5_0/Q5_K 0..32, Q6_K 0..64) and scales.
/// The real value is `d·(v − 8)` (Q4_0), `d·(v − 16)` (Q5_0), `d·sc·v − dmin·m` (Q4_K, Q5_K)
/// or `d·sc·(v − 32)` (Q6_K), as in ggml's `dequantize_row_*`.
pub fn decode_block(kind: Kind, blk: &[u8], vals: &mut [u8]) -> BlockParams {
    let mut p = BlockParams::default();
    match kind {
        Kind::Q4_0 | Kind::Q5_0 => {
            p.d = u16_at(blk, 0);
            let (qh, qs) = if kind == Kind::Q5_0 {
                (u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]), &blk[6..22])
            } else {
                (0, &blk[2..18])
            };
            for (j, &q) in qs.iter().enumerate() {
                vals[j] = (q & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                vals[j + 16] = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
            }
        }
        Kind::Q4K | Kind::Q5K => {
            p.d = u16_at(blk, 0);
            p.dmin = u16_at(blk, 2);
            let scales = &blk[4..16];
            for j in 0..8 {
                (p.sc[j], p.mn[j]) = scale_min_k4(j, scales);
            }
            static NO_HIGH_BITS: [u8; 32] = [0; 32];
            let (qh, qs) =
                if kind == Kind::Q5K { (&blk[16..48], &blk[48..176]) } else { (&NO_HIGH_BITS[..], &blk[16..144]) };
            for c in 0..4 {
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    vals[64 * c + l] = (q & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4);
                    vals[64 * c + 32 + l] = (q >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
                }
            }
        }
        Kind::Q6K => {
            let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
            p.d = u16_at(blk, 208);
            p.sc.copy_from_slice(sc);
            for h in 0..2 {
                let (ql, qh, v) = (&ql[64 * h..], &qh[32 * h..], &mut vals[128 * h..]);
                for l in 0..32 {
                    v[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    v[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    v[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    v[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
        }
    }
    p
}

/// Dequantize one row of GGUF blocks to f32 with candle's `to_float` arithmetic (bit for bit).
pub fn dequantize_row(kind: Kind, row: &[u8], out: &mut [f32]) {
    let l = Layout::of(kind);
    let mut vals = [0u8; QK_K];
    for (blk, ob) in row.chunks_exact(l.gguf_bytes).zip(out.chunks_exact_mut(l.block)) {
        let p = decode_block(kind, blk, &mut vals);
        let d = f16::from_bits(p.d).to_f32();
        let vals = &vals[..l.block];
        match kind {
            Kind::Q4_0 | Kind::Q5_0 => {
                let off = l.offset();
                for (o, &v) in ob.iter_mut().zip(vals) {
                    *o = (i32::from(v) - off) as f32 * d;
                }
            }
            Kind::Q4K | Kind::Q5K => {
                let dmin = f16::from_bits(p.dmin).to_f32();
                for (s, (os, vs)) in ob.chunks_exact_mut(32).zip(vals.chunks_exact(32)).enumerate() {
                    let (d1, m1) = (d * f32::from(p.sc[s]), dmin * f32::from(p.mn[s]));
                    for (o, &v) in os.iter_mut().zip(vs) {
                        *o = d1 * f32::from(v) - m1;
                    }
                }
            }
            Kind::Q6K => {
                for (s, (os, vs)) in ob.chunks_exact_mut(16).zip(vals.chunks_exact(16)).enumerate() {
                    let ds = d * f32::from(p.sc[s] as i8);
                    for (o, &v) in os.iter_mut().zip(vs) {
                        *o = ds * f32::from(v as i8 - 32);
                    }
                }
            }
        }
    }
}

/// A quantized matrix `[rows, k]` packed rows-in-lanes (module doc): `[group][block][chunk]`,
/// padding rows zero.
#[derive(Debug, Clone)]
pub struct PackedLanes {
    pub kind: Kind,
    pub rows: usize,
    pub k: usize,
    pub(crate) data: Store<u8>,
}

impl PackedLanes {
    /// Repack raw GGUF blocks (row-major, `k / block` blocks per row).
    pub fn from_gguf_bytes(kind: Kind, bytes: &[u8], rows: usize, k: usize) -> Option<Self> {
        let l = Layout::of(kind);
        if k == 0 || !k.is_multiple_of(l.block) || bytes.len() != rows * (k / l.block) * l.gguf_bytes {
            return None;
        }
        let nb = k / l.block;
        let groups = rows.div_ceil(LANES);
        let chunk = l.chunk();
        let mut data = vec![0u8; groups * nb * chunk];
        let mut vals = [0u8; QK_K];
        for (row, rb) in bytes.chunks_exact(nb * l.gguf_bytes).enumerate() {
            let (g, r) = (row / LANES, row % LANES);
            for (b, blk) in rb.chunks_exact(l.gguf_bytes).enumerate() {
                let p = decode_block(kind, blk, &mut vals);
                let c = &mut data[(g * nb + b) * chunk..][..chunk];
                let half = l.quads() / 2;
                for s in 0..l.subs() {
                    let sv = &vals[s * l.sub..(s + 1) * l.sub];
                    let so = s * l.sub_bytes();
                    for e in 0..4 {
                        for q in 0..half {
                            c[so + 32 * q + 4 * r + e] = (sv[4 * q + e] & 0xF) | ((sv[4 * (q + half) + e] & 0xF) << 4);
                        }
                        if l.hbits > 0 {
                            let mut h = 0u8;
                            for q in 0..l.quads() {
                                h |= (sv[4 * q + e] >> 4) << (q * l.hbits);
                            }
                            c[so + l.sub * 4 + 4 * r + e] = h;
                        }
                    }
                    if l.scales {
                        c[l.sc_off() + s * LANES + r] = p.sc[s];
                    }
                    if l.mins {
                        c[l.mn_off() + s * LANES + r] = p.mn[s];
                    }
                }
                c[l.d_off() + 2 * r..][..2].copy_from_slice(&p.d.to_le_bytes());
                if l.mins {
                    c[l.d_off() + 2 * LANES + 2 * r..][..2].copy_from_slice(&p.dmin.to_le_bytes());
                }
            }
        }
        Some(Self { kind, rows, k, data: Store::Own(data) })
    }
}

/// The element type of a float matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatKind {
    F32,
    F16,
    Bf16,
}

impl FloatKind {
    pub fn from_dtype(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::F32 => FloatKind::F32,
            GgmlDType::F16 => FloatKind::F16,
            GgmlDType::BF16 => FloatKind::Bf16,
            _ => return None,
        })
    }
    fn size(self) -> usize {
        match self {
            FloatKind::F32 => 4,
            FloatKind::F16 | FloatKind::Bf16 => 2,
        }
    }
}

/// A float matrix `[rows, k]`, the file's bytes row-major; `k` a multiple of 8.
#[derive(Debug, Clone)]
pub struct PackedFloat {
    pub kind: FloatKind,
    pub rows: usize,
    pub k: usize,
    pub(crate) data: Store<u8>,
}

impl PackedFloat {
    pub fn from_gguf_bytes(kind: FloatKind, bytes: &[u8], rows: usize, k: usize) -> Option<Self> {
        if k == 0 || !k.is_multiple_of(8) || bytes.len() != rows * k * kind.size() {
            return None;
        }
        Some(Self { kind, rows, k, data: Store::Own(bytes.to_vec()) })
    }

    fn at(&self, i: usize) -> f32 {
        let b = &self.data[i * self.kind.size()..];
        match self.kind {
            FloatKind::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            FloatKind::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
            FloatKind::Bf16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        }
    }
}

/// Q8_K activations of one row (candle's `BlockQ8K::from_float`, bit for bit): per block of 256,
/// the signed value of largest magnitude `max`, `iscale = −127/max`, `q = round(iscale·x)`
/// (half away from zero, clamped to i8), `d = 1/iscale`, and the sums of each 16 `q`.
pub fn quantize_q8k(x: &[f32], q: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    for (((xb, qb), db), sb) in
        x.chunks_exact(QK_K).zip(q.chunks_exact_mut(QK_K)).zip(d.iter_mut()).zip(bsums.chunks_exact_mut(QK_K / 16))
    {
        // the vectorised form where it applies (same bits; it declines NaN, infinite and
        // vanishing blocks, which the loop below decides)
        if let Some(dv) = crate::simd::quantize_q8k_block(xb, qb, sb) {
            *db = dv;
            continue;
        }
        quantize_q8k_block_scalar(xb, qb, db, sb);
    }
}

/// One block of [`quantize_q8k`], the portable way (the definition of its bits).
pub(crate) fn quantize_q8k_block_scalar(xb: &[f32], qb: &mut [i8], db: &mut f32, sb: &mut [i16]) {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in xb {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        *db = 0.0;
        qb.fill(0);
        sb.fill(0);
        return;
    }
    let iscale = -127f32 / max;
    for (qv, &v) in qb.iter_mut().zip(xb) {
        *qv = crate::simd::round_half_away(iscale * v).clamp(-128.0, 127.0) as i8;
    }
    for (s, qs) in sb.iter_mut().zip(qb.chunks_exact(16)) {
        *s = qs.iter().map(|&v| i16::from(v)).sum();
    }
    *db = 1.0 / iscale;
}

/// The activation factor of the Q4_K/Q5_K mins term, per row (candle computes it per weight
/// tile; the values are the same f32 operations): `mins32[j] = d·(bsum_2j + bsum_2j+1)`.
pub fn q8k_terms(d: &[f32], bsums: &[i16], mins32: &mut [f32]) {
    for (j, (m, pair)) in mins32.iter_mut().zip(bsums.chunks_exact(2)).enumerate() {
        *m = d[j / 8] * (i32::from(pair[0]) + i32::from(pair[1])) as f32;
    }
}

/// One tile of a rows-in-lanes matrix, the portable way (same bits as the AVX2 path).
///
/// # Safety
/// The [`Tile`] invariants, with `g` a group of `w` and the activations `a` holding the
/// quantization `w.kind` needs for `a.rows` rows of `w.k` values.
pub(crate) unsafe fn lanes_scalar(w: &PackedLanes, a: &QActs, tile: &Tile) {
    let l = Layout::of(w.kind);
    let k = a.k;
    let nb = k / l.block;
    if w.kind == Kind::Q6K {
        // SAFETY: forwarded preconditions.
        return unsafe { q6k_scalar(w, a, tile) };
    }
    let Tile { g, nr, t0, nt, rows, out } = *tile;
    let chunk = l.chunk();
    let half = l.quads() / 2;
    let mut vals = [0i32; 32];
    for r in 0..nr {
        for tok in t0..t0 + nt {
            let mut acc = 0f32;
            for b in 0..nb {
                let c = &w.data[(g * nb + b) * chunk..][..chunk];
                let d = f16::from_bits(u16_at(c, l.d_off() + 2 * r)).to_f32();
                let dmin = f16::from_bits(u16_at(c, l.d_off() + 2 * LANES + 2 * r)).to_f32();
                for s in 0..l.subs() {
                    let so = s * l.sub_bytes();
                    for q in 0..l.quads() {
                        for e in 0..4 {
                            let byte = c[so + 32 * (q % half) + 4 * r + e];
                            let nib = if q < half { byte & 0xF } else { byte >> 4 };
                            let hi = if l.hbits > 0 {
                                (c[so + l.sub * 4 + 4 * r + e] >> (q * l.hbits)) & ((1 << l.hbits) - 1)
                            } else {
                                0
                            };
                            vals[4 * q + e] = i32::from(nib | (hi << 4));
                        }
                    }
                    let at = tok * k + b * l.block + s * l.sub;
                    let isum: i32 = if l.block == QK_K {
                        a.qk[at..at + l.sub].iter().zip(&vals).map(|(&x, &v)| i32::from(x) * v).sum()
                    } else {
                        a.qs[at..at + l.sub].iter().zip(&vals).map(|(&x, &v)| i32::from(x) * v).sum()
                    };
                    match w.kind {
                        Kind::Q4_0 | Kind::Q5_0 => {
                            let i = tok * (k / 32) + b;
                            let sumi = isum - l.offset() * a.isum[i];
                            acc += sumi as f32 * d * a.d[i];
                        }
                        Kind::Q4K | Kind::Q5K => {
                            let da = a.dk[tok * nb + b];
                            let sc = f32::from(c[l.sc_off() + s * LANES + r]) * d;
                            let mn = f32::from(c[l.mn_off() + s * LANES + r]) * dmin;
                            acc = (isum as f32).mul_add(sc * da, acc);
                            acc = (-mn).mul_add(a.mins32[tok * (k / 32) + b * 8 + s], acc);
                        }
                        Kind::Q6K => {} // q6k_scalar
                    }
                }
            }
            // SAFETY: tok < m and r < nr (Tile invariants).
            unsafe { *out.add(tok * rows + r) = acc };
        }
    }
}

/// The Q6_K lane of candle's one-token `vec_dot_q6k_q8k` (AVX2) that value `i` (0..256) of a
/// super-block adds into: its 8 i32 lanes each hold 4 consecutive values of every 32.
const fn q6k_lane(i: usize) -> usize {
    (i % 32) / 4
}

/// One Q6_K tile, the portable way, in candle's one-token arithmetic (module doc): per row and
/// token 8 integer partial sums per super-block, `acc_L = fma(d_a·d, sumi_L, acc_L)`, then
/// `hsum_float_8` of the 8 accumulators.
///
/// # Safety
/// As [`lanes_scalar`] with `w.kind == Kind::Q6K`.
unsafe fn q6k_scalar(w: &PackedLanes, a: &QActs, tile: &Tile) {
    let l = Layout::of(Kind::Q6K);
    let k = a.k;
    let nb = k / QK_K;
    let Tile { g, nr, t0, nt, rows, out } = *tile;
    let chunk = l.chunk();
    for r in 0..nr {
        for tok in t0..t0 + nt {
            let mut acc = [0f32; 8];
            for b in 0..nb {
                let c = &w.data[(g * nb + b) * chunk..][..chunk];
                let d = f16::from_bits(u16_at(c, l.d_off() + 2 * r)).to_f32();
                let mut sumi = [0i32; 8];
                for s in 0..l.subs() {
                    let so = s * l.sub_bytes();
                    let sc = i32::from(c[l.sc_off() + s * LANES + r] as i8);
                    for q in 0..4 {
                        for e in 0..4 {
                            let byte = c[so + 32 * (q % 2) + 4 * r + e];
                            let nib = if q < 2 { byte & 0xF } else { byte >> 4 };
                            let hi = (c[so + 64 + 4 * r + e] >> (2 * q)) & 3;
                            let i = 16 * s + 4 * q + e;
                            let x = i32::from(a.qk[tok * k + b * QK_K + i]);
                            sumi[q6k_lane(i)] += sc * ((i32::from(nib | (hi << 4)) - 32) * x);
                        }
                    }
                }
                let dd = a.dk[tok * nb + b] * d;
                for (acc_l, &s) in acc.iter_mut().zip(&sumi) {
                    *acc_l = dd.mul_add(s as f32, *acc_l);
                }
            }
            // SAFETY: tok < m and r < nr (Tile invariants).
            unsafe { *out.add(tok * rows + r) = hsum8(&acc) };
        }
    }
}

/// candle's `hsum_float_8` order on 8 lanes.
fn hsum8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// One tile of a float matrix, the portable way (same bits as the AVX2 path).
///
/// # Safety
/// The [`Tile`] invariants (group rows [`FLOAT_GROUP`]), with `a.x` holding `a.rows · w.k`.
pub(crate) unsafe fn float_scalar(w: &PackedFloat, a: &QActs, tile: &Tile) {
    let k = a.k;
    let Tile { g, nr, t0, nt, rows, out } = *tile;
    for r in 0..nr {
        let row = g * FLOAT_GROUP + r;
        for tok in t0..t0 + nt {
            let x = &a.x[tok * k..(tok + 1) * k];
            let mut lanes = [0f32; 8];
            for c in 0..k / 8 {
                for (j, lane) in lanes.iter_mut().enumerate() {
                    *lane = w.at(row * k + 8 * c + j).mul_add(x[8 * c + j], *lane);
                }
            }
            // SAFETY: tok < m and r < nr (Tile invariants).
            unsafe { *out.add(tok * rows + r) = hsum8(&lanes) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{FloatKind, Kind, Layout, PackedFloat, PackedLanes, Tile, FLOAT_GROUP, LANES, QK_K};
    use crate::kernels::QActs;

    /// How far ahead, in bytes, a tile of `tokens` tokens that streams its weights once asks
    /// for them (`PDMESH_MODEL_PREFETCH` overrides for every tile; 0 turns prefetching off).
    ///
    /// Why: a decode step (one tile covers every token of the step) reads each matrix front to
    /// back exactly once, from DRAM: about 1 GB a token on Qwen2.5-1.5B. One core's hardware
    /// prefetchers keep too few lines in flight for that stream; asking for the lines a few KiB
    /// ahead of the block being computed raised one-stream decode of the 1.5B on a 2-vCPU AMD
    /// EPYC (Zen 3) from 15–19 to 22–29 tok/s (D115, docs/benchmarks.md). A prefill, whose
    /// tiles read the same row group again for every 8 tokens from L1, does not prefetch: the
    /// next group's lines there only evicted the current one (measured slower).
    ///
    /// On a host with AVX-512 VNNI (Zen 4 measured, D116) one-token tiles do not prefetch:
    /// there one-stream decode ran at 29.8 tok/s without against 25.7 with (medians of 5
    /// alternating runs), while eight requests per step still gained (63 → 96–106 tok/s).
    pub(crate) fn prefetch_distance(tokens: usize) -> usize {
        static DIST: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
        // (one token, more)
        let (one, more) =
            *DIST.get_or_init(|| match std::env::var("PDMESH_MODEL_PREFETCH").ok().and_then(|v| v.parse().ok()) {
                Some(d) => (d, d),
                None if std::arch::is_x86_feature_detected!("avx512vnni") => (0, PREFETCH_BYTES),
                None => (PREFETCH_BYTES, PREFETCH_BYTES),
            });
        if tokens == 1 {
            one
        } else {
            more
        }
    }

    /// [`prefetch_distance`]'s default: 2–4 KiB measured alike (1.5–3.5 Q4_K chunks of 8 rows),
    /// 8 KiB worse on the same host.
    const PREFETCH_BYTES: usize = 4096;

    /// Ask for the cache lines of `len` bytes `dist` bytes past `p`. A prefetch never faults,
    /// so lines past the matrix's end are harmless (the address is formed with wrapping
    /// arithmetic and never dereferenced).
    #[inline(always)]
    pub(crate) fn prefetch_ahead(p: *const u8, len: usize, dist: usize) {
        let mut o = 0;
        while o < len {
            // SAFETY: a prefetch is a hint; it reads nothing architecturally and cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(dist + o) as *const i8) };
            o += 64;
        }
    }

    /// Tokens one AVX2 Q6_K tile serves: its decode (64 quad vectors and the correction per
    /// super-block) costs about a fifth of the tile's multiplies at 8 tokens, and its
    /// accumulators are in memory whatever the count, so more tokens cost only L1 space
    /// (`16·(256 + 256)` bytes of accumulators and biased activations).
    pub(crate) const Q6K_TILE_TOKENS: usize = 16;

    /// One rows-in-lanes tile with AVX2.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; the preconditions of [`super::lanes_scalar`],
    /// with `nt ≤ 8` (`nt ≤ Q6K_TILE_TOKENS` for Q6_K).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn lanes(w: &PackedLanes, a: &QActs, tile: &Tile) {
        macro_rules! go {
            ($k:expr) => {
                // SAFETY: forwarded preconditions.
                unsafe {
                    match tile.nt {
                        8 => lanes_tile::<{ $k as u8 }, 8>(w, a, tile),
                        7 => lanes_tile::<{ $k as u8 }, 7>(w, a, tile),
                        6 => lanes_tile::<{ $k as u8 }, 6>(w, a, tile),
                        5 => lanes_tile::<{ $k as u8 }, 5>(w, a, tile),
                        4 => lanes_tile::<{ $k as u8 }, 4>(w, a, tile),
                        3 => lanes_tile::<{ $k as u8 }, 3>(w, a, tile),
                        2 => lanes_tile::<{ $k as u8 }, 2>(w, a, tile),
                        1 => lanes_tile::<{ $k as u8 }, 1>(w, a, tile),
                        _ => {}
                    }
                }
            };
        }
        match w.kind {
            Kind::Q4_0 => go!(Kind::Q4_0),
            Kind::Q5_0 => go!(Kind::Q5_0),
            Kind::Q4K => go!(Kind::Q4K),
            Kind::Q5K => go!(Kind::Q5K),
            // SAFETY: forwarded preconditions.
            Kind::Q6K if tile.nt == 1 => unsafe { q6k_tile_few::<1>(w, a, tile) },
            // SAFETY: forwarded preconditions.
            Kind::Q6K => unsafe { q6k_tile(w, a, tile) },
        }
    }

    const fn kind_of(k: u8) -> Kind {
        match k {
            0 => Kind::Q4_0,
            1 => Kind::Q5_0,
            2 => Kind::Q4K,
            3 => Kind::Q5K,
            _ => Kind::Q6K,
        }
    }

    /// # Safety
    /// As [`lanes`] with `nt = T` and `w.kind as u8 == K`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lanes_tile<const K: u8, const T: usize>(w: &PackedLanes, a: &QActs, tile: &Tile) {
        let kind = kind_of(K);
        let l = Layout::of(kind);
        let k = a.k;
        let nb = k / l.block;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let chunk = l.chunk();
        let nq = l.quads();
        // quads summed in i16 before widening: n·2·max(v)·128 must stay below 2^15
        let run = 8 >> l.hbits;
        let ones = _mm256_set1_epi16(1);
        let q8k = l.block == QK_K;
        // SAFETY: group g has nb chunks of `chunk` bytes (packed groups are complete); the
        // activation rows t0..t0+T < m hold k values (qs or qk), k/32 scales and sums (d, isum)
        // or k/256 scales and k/32 terms (dk, mins32); output offsets from the tile's `out` are
        // (t0+t)·rows + r with r < nr (Tile invariants). Loads and stores are unaligned.
        unsafe {
            let base = w.data.as_ptr().add(g * nb * chunk);
            let mut acc = [_mm256_setzero_ps(); T];
            let dist = if T == a.rows { prefetch_distance(T) } else { 0 };
            for b in 0..nb {
                let p = base.add(b * chunk);
                if dist > 0 {
                    prefetch_ahead(p, chunk, dist);
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(p.add(l.d_off()) as *const __m128i));
                let dminv = if l.mins {
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(l.d_off() + 2 * LANES) as *const __m128i))
                } else {
                    _mm256_setzero_ps()
                };
                for s in 0..l.subs() {
                    let wq = decode_sub(l, p, s);
                    let (scv, mnv) = sub_scales(l, p, s, dv, dminv);
                    for (t, acc_t) in acc.iter_mut().enumerate() {
                        let tok = t0 + t;
                        let at = tok * k + b * l.block + s * l.sub;
                        let ap = if q8k { a.qk.as_ptr().add(at) } else { a.qs.as_ptr().add(at) };
                        let mut isum = _mm256_setzero_si256();
                        let mut s16 = _mm256_setzero_si256();
                        for (q, wv) in wq.iter().enumerate().take(nq) {
                            let av = _mm256_set1_epi32((ap.add(4 * q) as *const i32).read_unaligned());
                            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*wv, av));
                            if (q + 1) % run == 0 || q + 1 == nq {
                                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s16, ones));
                                s16 = _mm256_setzero_si256();
                            }
                        }
                        accumulate(l, a, tok, b, s, isum, (dv, scv, mnv), acc_t);
                    }
                }
            }
            for (t, acc_t) in acc.iter().enumerate() {
                let dst = out.add((t0 + t) * rows);
                if nr == LANES {
                    _mm256_storeu_ps(dst, *acc_t);
                } else {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), *acc_t);
                    for (r, &v) in lanes.iter().enumerate().take(nr) {
                        *dst.add(r) = v;
                    }
                }
            }
        }
    }

    /// Sub-block `s` of the (group, block) chunk at `p`, 8 rows decoded to one byte per value:
    /// vector `q` holds quad `q` of every row (nibble, plus the high bits of Q5/Q6 layouts).
    ///
    /// # Safety
    /// AVX2; `p` points to a complete chunk of layout `l`.
    // inlined into its callers, which enable the features (`inline(always)` cannot be put on a
    // `target_feature` function, and without it the call was not inlined into the AVX-512 tile)
    #[inline(always)]
    pub(super) unsafe fn decode_sub(l: Layout, p: *const u8, s: usize) -> [__m256i; 8] {
        let m4 = _mm256_set1_epi8(0x0F);
        let hmask = _mm256_set1_epi8(if l.hbits == 1 { 0x10 } else { 0x30 });
        let (nq, half) = (l.quads(), l.quads() / 2);
        let mut wq = [_mm256_setzero_si256(); 8];
        // SAFETY: the sub-block's bytes lie inside the chunk (caller).
        unsafe {
            let sp = p.add(s * l.sub_bytes());
            for q in 0..half {
                let raw = _mm256_loadu_si256(sp.add(32 * q) as *const __m256i);
                wq[q] = _mm256_and_si256(raw, m4);
                wq[q + half] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
            }
            if l.hbits > 0 {
                let h = _mm256_loadu_si256(sp.add(l.sub * 4) as *const __m256i);
                for (q, wv) in wq.iter_mut().enumerate().take(nq) {
                    // bits q·hbits.. of each byte to bit 4 (16-bit shifts: bits that cross a
                    // byte land outside the mask)
                    let hb = match 4 - (q * l.hbits) as i32 {
                        4 => _mm256_slli_epi16::<4>(h),
                        3 => _mm256_slli_epi16::<3>(h),
                        2 => _mm256_slli_epi16::<2>(h),
                        1 => _mm256_slli_epi16::<1>(h),
                        0 => h,
                        -1 => _mm256_srli_epi16::<1>(h),
                        -2 => _mm256_srli_epi16::<2>(h),
                        _ => _mm256_srli_epi16::<3>(h),
                    };
                    *wv = _mm256_or_si256(*wv, _mm256_and_si256(hb, hmask));
                }
            }
        }
        wq
    }

    /// The 8 rows' `d·sc_s` and `dmin·m_s` of sub-block `s` (zero where the layout has none).
    ///
    /// # Safety
    /// AVX2; `p` points to a complete chunk of layout `l` (not Q6_K).
    // inlined into its callers, which enable the features (`inline(always)` cannot be put on a
    // `target_feature` function, and without it the call was not inlined into the AVX-512 tile)
    #[inline(always)]
    pub(super) unsafe fn sub_scales(l: Layout, p: *const u8, s: usize, dv: __m256, dminv: __m256) -> (__m256, __m256) {
        if !l.scales {
            return (_mm256_setzero_ps(), _mm256_setzero_ps());
        }
        // SAFETY: scales and mins lie inside the chunk (caller).
        unsafe {
            let sc8 = _mm_loadl_epi64(p.add(l.sc_off() + s * LANES) as *const __m128i);
            let scv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8)), dv);
            let mnv = if l.mins {
                let mn8 = _mm_loadl_epi64(p.add(l.mn_off() + s * LANES) as *const __m128i);
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn8)), dminv)
            } else {
                _mm256_setzero_ps()
            };
            (scv, mnv)
        }
    }

    /// Add sub-block `s` of block `b` to token `tok`'s accumulator, given the rows' exact
    /// integer sums `isum`, in candle's float order (module doc). `(dv, scv, mnv)`: the rows'
    /// `d` and [`sub_scales`].
    ///
    /// # Safety
    /// AVX2; the activations hold the form layout `l` needs for token `tok` (not Q6_K).
    // inlined into its callers, which enable the features (`inline(always)` cannot be put on a
    // `target_feature` function, and without it the call was not inlined into the AVX-512 tile)
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn accumulate(
        l: Layout,
        a: &QActs,
        tok: usize,
        b: usize,
        s: usize,
        isum: __m256i,
        (dv, scv, mnv): (__m256, __m256, __m256),
        acc: &mut __m256,
    ) {
        let k = a.k;
        // SAFETY: the activation offsets lie inside the token's forms (caller).
        unsafe {
            if l.block != QK_K {
                // Q4_0, Q5_0
                let i = tok * (k / 32) + b;
                let sumi = _mm256_sub_epi32(isum, _mm256_set1_epi32(l.offset() * *a.isum.as_ptr().add(i)));
                let term =
                    _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sumi), dv), _mm256_set1_ps(*a.d.as_ptr().add(i)));
                *acc = _mm256_add_ps(*acc, term);
            } else {
                // Q4_K, Q5_K
                let da = _mm256_broadcast_ss(&*a.dk.as_ptr().add(tok * (k / QK_K) + b));
                let mins = _mm256_broadcast_ss(&*a.mins32.as_ptr().add(tok * (k / 32) + b * 8 + s));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(scv, da), *acc);
                *acc = _mm256_fnmadd_ps(mnv, mins, *acc);
            }
        }
    }

    /// One Q6_K tile with AVX2 in candle's one-token arithmetic (as [`super::q6k_scalar`]): a
    /// super-block of 8 rows is decoded once (64 quad vectors of `v − 32` as i8, 16 scale
    /// vectors) and reused for every token.
    ///
    /// Per token and quad one `vpmaddubsw` of the activations biased to unsigned (`x + 128`,
    /// biased once per tile) with the signed `v − 32`, then one `vpmaddwd` by the row's scale,
    /// go into the i32 partial sum of the quad's candle lane; the bias adds `128·sc·Σ(v − 32)`,
    /// a per-row constant of the super-block that is subtracted once (each lane starts from
    /// it). So the exact integers are the same as `(v·x − 32·x)` per quad, and the bits too,
    /// with two multiplies per quad and token instead of three (the second `vpmaddubsw` of
    /// `32·x` is gone). No saturation: `|2·255·32| < 2^15`.
    ///
    /// The accumulators live in memory (64 of them at 8 tokens), so the token count is a
    /// run-time bound; a super-block decoded once serves up to [`Q6K_TILE_TOKENS`].
    ///
    /// # Safety
    /// As [`lanes`] with `nt ≤ Q6K_TILE_TOKENS` and `w.kind == Kind::Q6K`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6k_tile(w: &PackedLanes, a: &QActs, tile: &Tile) {
        const T: usize = Q6K_TILE_TOKENS;
        let l = Layout::of(Kind::Q6K);
        let k = a.k;
        let nb = k / QK_K;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let nt = tile.nt.min(T);
        let chunk = l.chunk();
        // 0x80: −128 as i8, the activations' bias by xor
        let bias = _mm256_set1_epi8(-128);
        // SAFETY: as in `lanes_tile` (Q8_K activations: qk and dk); the scratch is local.
        unsafe {
            let base = w.data.as_ptr().add(g * nb * chunk);
            let zero = _mm256_setzero_si256();
            let mut acc = [[_mm256_setzero_ps(); 8]; T];
            let mut wq = [zero; 64];
            let mut scv = [zero; 16];
            let mut xb = [[0u8; QK_K]; T];
            let dist = if nt == a.rows { prefetch_distance(nt) } else { 0 };
            for b in 0..nb {
                let p = base.add(b * chunk);
                if dist > 0 {
                    prefetch_ahead(p, chunk, dist);
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(p.add(l.d_off()) as *const __m128i));
                let corr = q6k_decode_biased(l, p, &mut wq, &mut scv);
                for (t, row) in xb.iter_mut().enumerate().take(nt) {
                    let src = a.qk.as_ptr().add((t0 + t) * k + b * QK_K);
                    for c in 0..QK_K / 32 {
                        let v = _mm256_xor_si256(_mm256_loadu_si256(src.add(32 * c) as *const __m256i), bias);
                        _mm256_storeu_si256(row.as_mut_ptr().add(32 * c) as *mut __m256i, v);
                    }
                }
                for (t, acc_t) in acc.iter_mut().enumerate().take(nt) {
                    let ap = xb[t].as_ptr();
                    // candle lane 4·(s mod 2) + q takes quad q of sub-block s (`q6k_lane`); the
                    // pair loop keeps every lane index a constant, so the sums stay in registers
                    let mut sumi = corr;
                    for s2 in 0..8 {
                        for h in 0..2 {
                            let s = 2 * s2 + h;
                            for q in 0..4 {
                                let av = _mm256_set1_epi32((ap.add(16 * s + 4 * q) as *const i32).read_unaligned());
                                let p16 = _mm256_maddubs_epi16(av, wq[4 * s + q]);
                                sumi[4 * h + q] = _mm256_add_epi32(sumi[4 * h + q], _mm256_madd_epi16(p16, scv[s]));
                            }
                        }
                    }
                    let dd = _mm256_mul_ps(_mm256_broadcast_ss(&*a.dk.as_ptr().add((t0 + t) * nb + b)), dv);
                    for (acc_l, s) in acc_t.iter_mut().zip(&sumi) {
                        *acc_l = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(*s), *acc_l);
                    }
                }
            }
            for (t, acc_t) in acc.iter().enumerate().take(nt) {
                // candle's hsum_float_8 across the 8 accumulators, per row lane
                let v = _mm256_add_ps(
                    _mm256_add_ps(_mm256_add_ps(acc_t[0], acc_t[4]), _mm256_add_ps(acc_t[2], acc_t[6])),
                    _mm256_add_ps(_mm256_add_ps(acc_t[1], acc_t[5]), _mm256_add_ps(acc_t[3], acc_t[7])),
                );
                let dst = out.add((t0 + t) * rows);
                if nr == LANES {
                    _mm256_storeu_ps(dst, v);
                } else {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                    for (r, &x) in lanes.iter().enumerate().take(nr) {
                        *dst.add(r) = x;
                    }
                }
            }
        }
    }

    /// The 4 quad vectors of Q6_K sub-block at `sp` for 8 rows: vector `q` holds quad `q` of
    /// every row as bytes `v` in `0..64` (low nibble, then bits `2q..2q+1` of the high byte).
    ///
    /// # Safety
    /// AVX2; `sp` points to a complete sub-block of the Q6_K lanes layout (96 bytes).
    // inlined into its callers, which enable the features (as `decode_sub`)
    #[inline(always)]
    pub(super) unsafe fn q6k_quads(sp: *const u8) -> [__m256i; 4] {
        let m4 = _mm256_set1_epi8(0x0F);
        let hmask = _mm256_set1_epi8(0x30);
        // SAFETY: the sub-block's 96 bytes lie inside the chunk (caller).
        unsafe {
            let raw0 = _mm256_loadu_si256(sp as *const __m256i);
            let raw1 = _mm256_loadu_si256(sp.add(32) as *const __m256i);
            let h = _mm256_loadu_si256(sp.add(64) as *const __m256i);
            // bits 2q..2q+1 of each high byte to bits 4..5 (16-bit shifts: bits that cross a byte
            // land outside the mask)
            let hq = [_mm256_slli_epi16::<4>(h), _mm256_slli_epi16::<2>(h), h, _mm256_srli_epi16::<2>(h)];
            let lo = [
                _mm256_and_si256(raw0, m4),
                _mm256_and_si256(raw1, m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(raw0), m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(raw1), m4),
            ];
            [0, 1, 2, 3].map(|q| _mm256_or_si256(lo[q], _mm256_and_si256(hq[q], hmask)))
        }
    }

    /// Decode the Q6_K super-block of 8 rows at `p` for [`q6k_tile`]: `wq[4s + q]` receives quad
    /// `q` of sub-block `s` as `v − 32` (i8), `scv[s]` the rows' scales in both i16 halves of
    /// each lane; returns per candle lane `−128·Σ sc·Σ(v − 32)` over the lane's quads (exact),
    /// what the activations' bias adds.
    ///
    /// # Safety
    /// AVX2; `p` points to a complete Q6_K chunk of layout `l`.
    // inlined into its caller, which enables the features (as `decode_sub`)
    #[inline(always)]
    unsafe fn q6k_decode_biased(
        l: Layout,
        p: *const u8,
        wq: &mut [__m256i; 64],
        scv: &mut [__m256i; 16],
    ) -> [__m256i; 8] {
        let m32 = _mm256_set1_epi8(32);
        // 128 as the u8 of the correction's `vpmaddubsw`
        let bias = _mm256_set1_epi8(-128);
        let lo16 = _mm256_set1_epi32(0xFFFF);
        let mut corr = [_mm256_setzero_si256(); 8];
        // SAFETY: the sub-blocks, their high bits and the scales lie inside the chunk (caller).
        unsafe {
            for s in 0..16 {
                let quads = q6k_quads(p.add(s * l.sub_bytes()));
                // the row's i8 scale in both i16 halves of its lane
                let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(l.sc_off() + s * LANES) as *const __m128i));
                scv[s] = _mm256_or_si256(_mm256_and_si256(sc, lo16), _mm256_slli_epi32::<16>(sc));
                for (q, &vq) in quads.iter().enumerate() {
                    let v = _mm256_sub_epi8(vq, m32);
                    wq[4 * s + q] = v;
                    let c = _mm256_madd_epi16(_mm256_maddubs_epi16(bias, v), scv[s]);
                    corr[4 * (s % 2) + q] = _mm256_sub_epi32(corr[4 * (s % 2) + q], c);
                }
            }
        }
        corr
    }

    /// [`q6k_tile`] for one token (a decode step), the same exact integers without the bias:
    /// per quad `v·x − 32·x` (two `vpmaddubsw`) times the scale. [`q6k_tile`]'s correction
    /// costs two multiplies per quad and super-block, which one token does not win back.
    ///
    /// # Safety
    /// As [`lanes`] with `nt = T` and `w.kind == Kind::Q6K`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6k_tile_few<const T: usize>(w: &PackedLanes, a: &QActs, tile: &Tile) {
        let l = Layout::of(Kind::Q6K);
        let k = a.k;
        let nb = k / QK_K;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let chunk = l.chunk();
        let m32 = _mm256_set1_epi8(32);
        let lo16 = _mm256_set1_epi32(0xFFFF);
        // SAFETY: as in `lanes_tile` (Q8_K activations: qk and dk).
        unsafe {
            let base = w.data.as_ptr().add(g * nb * chunk);
            let mut acc = [[_mm256_setzero_ps(); 8]; T];
            let mut wq = [_mm256_setzero_si256(); 64];
            let mut scv = [_mm256_setzero_si256(); 16];
            let dist = if T == a.rows { prefetch_distance(T) } else { 0 };
            for b in 0..nb {
                let p = base.add(b * chunk);
                if dist > 0 {
                    prefetch_ahead(p, chunk, dist);
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(p.add(l.d_off()) as *const __m128i));
                for s in 0..16 {
                    let quads = q6k_quads(p.add(s * l.sub_bytes()));
                    wq[4 * s..4 * s + 4].copy_from_slice(&quads);
                    // the row's i8 scale in both i16 halves of its lane
                    let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(l.sc_off() + s * LANES) as *const __m128i));
                    scv[s] = _mm256_or_si256(_mm256_and_si256(sc, lo16), _mm256_slli_epi32::<16>(sc));
                }
                for (t, acc_t) in acc.iter_mut().enumerate() {
                    let tok = t0 + t;
                    let ap = a.qk.as_ptr().add(tok * k + b * QK_K);
                    // candle lane 4·(s mod 2) + q takes quad q of sub-block s (`q6k_lane`); the
                    // pair loop keeps every lane index a constant, so the sums stay in registers
                    let mut sumi = [_mm256_setzero_si256(); 8];
                    for s2 in 0..8 {
                        for h in 0..2 {
                            let s = 2 * s2 + h;
                            for q in 0..4 {
                                let av = _mm256_set1_epi32((ap.add(16 * s + 4 * q) as *const i32).read_unaligned());
                                let p16 = _mm256_sub_epi16(
                                    _mm256_maddubs_epi16(wq[4 * s + q], av),
                                    _mm256_maddubs_epi16(m32, av),
                                );
                                sumi[4 * h + q] = _mm256_add_epi32(sumi[4 * h + q], _mm256_madd_epi16(p16, scv[s]));
                            }
                        }
                    }
                    let dd = _mm256_mul_ps(_mm256_broadcast_ss(&*a.dk.as_ptr().add(tok * nb + b)), dv);
                    for (acc_l, s) in acc_t.iter_mut().zip(&sumi) {
                        *acc_l = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(*s), *acc_l);
                    }
                }
            }
            for (t, acc_t) in acc.iter().enumerate() {
                // candle's hsum_float_8 across the 8 accumulators, per row lane
                let v = _mm256_add_ps(
                    _mm256_add_ps(_mm256_add_ps(acc_t[0], acc_t[4]), _mm256_add_ps(acc_t[2], acc_t[6])),
                    _mm256_add_ps(_mm256_add_ps(acc_t[1], acc_t[5]), _mm256_add_ps(acc_t[3], acc_t[7])),
                );
                let dst = out.add((t0 + t) * rows);
                if nr == LANES {
                    _mm256_storeu_ps(dst, v);
                } else {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                    for (r, &x) in lanes.iter().enumerate().take(nr) {
                        *dst.add(r) = x;
                    }
                }
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

    /// 8 weights of a float matrix as f32.
    ///
    /// # Safety
    /// F16C/AVX2; `p` points to 8 elements of `kind`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8(kind: FloatKind, p: *const u8) -> __m256 {
        // SAFETY: forwarded.
        unsafe {
            match kind {
                FloatKind::F32 => _mm256_loadu_ps(p as *const f32),
                FloatKind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                FloatKind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(p as *const __m128i),
                ))),
            }
        }
    }

    /// One float tile with AVX2: rows in pairs, 8 lanes of FMA per (row, token).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; the preconditions of [`super::float_scalar`],
    /// with `nt ≤ 4`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn float(w: &PackedFloat, a: &QActs, tile: &Tile) {
        // SAFETY: forwarded preconditions.
        unsafe {
            match tile.nt {
                4 => float_tile::<4>(w, a, tile),
                3 => float_tile::<3>(w, a, tile),
                2 => float_tile::<2>(w, a, tile),
                1 => float_tile::<1>(w, a, tile),
                _ => {}
            }
        }
    }

    /// # Safety
    /// As [`float`] with `nt = T`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn float_tile<const T: usize>(w: &PackedFloat, a: &QActs, tile: &Tile) {
        let k = a.k;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let sz = w.kind.size();
        // SAFETY: rows g·4 + r < rows hold k elements each (r < nr); tokens t0..t0+T < m hold
        // k activations; outputs as in `lanes_tile`.
        unsafe {
            for r0 in (0..nr).step_by(2) {
                let two = r0 + 1 < nr;
                let row0 = g * FLOAT_GROUP + r0;
                let p0 = w.data.as_ptr().add(row0 * k * sz);
                let p1 = if two { p0.add(k * sz) } else { p0 };
                let mut acc0 = [_mm256_setzero_ps(); T];
                let mut acc1 = [_mm256_setzero_ps(); T];
                for c in 0..k / 8 {
                    let w0 = load8(w.kind, p0.add(8 * c * sz));
                    let w1 = load8(w.kind, p1.add(8 * c * sz));
                    for (t, (a0, a1)) in acc0.iter_mut().zip(acc1.iter_mut()).enumerate() {
                        let x = _mm256_loadu_ps(a.x.as_ptr().add((t0 + t) * k + 8 * c));
                        *a0 = _mm256_fmadd_ps(w0, x, *a0);
                        *a1 = _mm256_fmadd_ps(w1, x, *a1);
                    }
                }
                for (t, (a0, a1)) in acc0.iter().zip(&acc1).enumerate() {
                    *out.add((t0 + t) * rows + r0) = hsum_f32(*a0);
                    if two {
                        *out.add((t0 + t) * rows + r0 + 1) = hsum_f32(*a1);
                    }
                }
            }
        }
    }
}

/// The rows-in-lanes kernels with AVX-512 VNNI on 256-bit vectors (AVX-512 VL): the packing
/// and the float arithmetic of [`avx2`] (so candle's, bit for bit), with the exact integer
/// parts computed by `vpdpbusd`/`vpdpwssd`:
///
/// - Q4_0, Q5_0, Q4_K, Q5_K: each quad's 4 products go into their row's i32 lane with one
///   `vpdpbusd` (the activation dword broadcast from memory inside the instruction) instead of
///   `vpmaddubsw` + `vpaddw` + `vpmaddwd`;
/// - Q6_K: see [`avx512::q6k_tile`].
///
/// 32 vector registers let a tile keep the decoded sub-block and up to
/// [`avx512::TILE_TOKENS`] tokens' accumulators in registers.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use super::avx2::{accumulate, decode_sub, prefetch_ahead, prefetch_distance, q6k_quads, sub_scales};
    use super::{Kind, Layout, PackedLanes, Tile, LANES, QK_K};
    use crate::kernels::QActs;

    /// Tokens per tile (measured against 8: fewer passes over the decoded weights).
    pub(crate) const TILE_TOKENS: usize = 12;

    /// Tokens per 8-row Q6_K tile ([`q6k_tile`]): its accumulators and activations live in
    /// memory whatever the count, so more tokens share each decoded super-block.
    pub(crate) const Q6K_TILE_TOKENS: usize = 16;

    /// One rows-in-lanes tile with AVX-512 VNNI.
    ///
    /// # Safety
    /// AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI must be available; the preconditions of
    /// [`super::lanes_scalar`], with `nt ≤ TILE_TOKENS` (`nt ≤ Q6K_TILE_TOKENS` for Q6_K).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn lanes(w: &PackedLanes, a: &QActs, tile: &Tile) {
        macro_rules! by_tokens {
            ($f:ident $(, $k:expr)?) => {
                // SAFETY: forwarded preconditions.
                unsafe {
                    match tile.nt {
                        12 => $f::<$({ $k as u8 },)? 12>(w, a, tile),
                        11 => $f::<$({ $k as u8 },)? 11>(w, a, tile),
                        10 => $f::<$({ $k as u8 },)? 10>(w, a, tile),
                        9 => $f::<$({ $k as u8 },)? 9>(w, a, tile),
                        8 => $f::<$({ $k as u8 },)? 8>(w, a, tile),
                        7 => $f::<$({ $k as u8 },)? 7>(w, a, tile),
                        6 => $f::<$({ $k as u8 },)? 6>(w, a, tile),
                        5 => $f::<$({ $k as u8 },)? 5>(w, a, tile),
                        4 => $f::<$({ $k as u8 },)? 4>(w, a, tile),
                        3 => $f::<$({ $k as u8 },)? 3>(w, a, tile),
                        2 => $f::<$({ $k as u8 },)? 2>(w, a, tile),
                        1 => $f::<$({ $k as u8 },)? 1>(w, a, tile),
                        _ => {}
                    }
                }
            };
        }
        match w.kind {
            Kind::Q4_0 => by_tokens!(lanes_tile, Kind::Q4_0),
            Kind::Q5_0 => by_tokens!(lanes_tile, Kind::Q5_0),
            Kind::Q4K => by_tokens!(lanes_tile, Kind::Q4K),
            Kind::Q5K => by_tokens!(lanes_tile, Kind::Q5K),
            // one token: a quad at a time with VNNI (the pairs' decode costs what they save
            // at one token); two: the pairs without the bias's per-tile start (0.80 → 0.62 ms
            // for `ffn_down`)
            // SAFETY: forwarded preconditions.
            Kind::Q6K if tile.nt == 1 => unsafe { q6k_tile_one(w, a, tile) },
            // SAFETY: forwarded preconditions.
            Kind::Q6K if tile.nt == 2 => unsafe { q6k_tile_few::<2>(w, a, tile) },
            // SAFETY: forwarded preconditions (`nt ≤ Q6K_TILE_TOKENS` where this tile is used).
            Kind::Q6K => unsafe { q6k_tile(w, a, tile) },
        }
    }

    const fn kind_of(k: u8) -> Kind {
        match k {
            0 => Kind::Q4_0,
            1 => Kind::Q5_0,
            2 => Kind::Q4K,
            3 => Kind::Q5K,
            _ => Kind::Q6K,
        }
    }

    /// # Safety
    /// As [`lanes`] with `nt = T` and `w.kind as u8 == K` (not Q6_K).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn lanes_tile<const K: u8, const T: usize>(w: &PackedLanes, a: &QActs, tile: &Tile) {
        let kind = kind_of(K);
        let l = Layout::of(kind);
        let k = a.k;
        let nb = k / l.block;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let chunk = l.chunk();
        let nq = l.quads();
        let q8k = l.block == QK_K;
        // SAFETY: as in `avx2::lanes_tile` (the same packing and activation forms).
        unsafe {
            let base = w.data.as_ptr().add(g * nb * chunk);
            let mut acc = [_mm256_setzero_ps(); T];
            let dist = if T == a.rows { prefetch_distance(T) } else { 0 };
            for b in 0..nb {
                let p = base.add(b * chunk);
                if dist > 0 {
                    prefetch_ahead(p, chunk, dist);
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(p.add(l.d_off()) as *const __m128i));
                let dminv = if l.mins {
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(l.d_off() + 2 * LANES) as *const __m128i))
                } else {
                    _mm256_setzero_ps()
                };
                for s in 0..l.subs() {
                    let wq = decode_sub(l, p, s);
                    let (scv, mnv) = sub_scales(l, p, s, dv, dminv);
                    for (t, acc_t) in acc.iter_mut().enumerate() {
                        let tok = t0 + t;
                        let at = tok * k + b * l.block + s * l.sub;
                        let ap = if q8k { a.qk.as_ptr().add(at) } else { a.qs.as_ptr().add(at) } as *const i32;
                        // two chains: the order of exact integer adds does not matter
                        let mut s0 = _mm256_setzero_si256();
                        let mut s1 = _mm256_setzero_si256();
                        for q in (0..nq).step_by(2) {
                            s0 = _mm256_dpbusd_epi32(s0, wq[q], _mm256_set1_epi32(ap.add(q).read_unaligned()));
                            s1 = _mm256_dpbusd_epi32(s1, wq[q + 1], _mm256_set1_epi32(ap.add(q + 1).read_unaligned()));
                        }
                        let isum = _mm256_add_epi32(s0, s1);
                        accumulate(l, a, tok, b, s, isum, (dv, scv, mnv), acc_t);
                    }
                }
            }
            let lanes: __mmask8 = if nr >= LANES { 0xFF } else { (1u8 << nr) - 1 };
            for (t, acc_t) in acc.iter().enumerate() {
                _mm256_mask_storeu_ps(out.add((t0 + t) * rows), lanes, *acc_t);
            }
        }
    }

    /// Whether [`lanes_pair`] computes the tiles of a matrix of `kind` multiplied by `m`
    /// tokens (16 rows per 512-bit vector). `PDMESH_MODEL_ROW_PAIRS=0|1` overrides the choice
    /// for every kind and batch.
    ///
    /// Why it depends on the core, the kind and the batch: on a core that runs 512-bit VNNI at
    /// full width (Intel) pairs serve every matmul (D112). AMD's Zen 4 splits each 512-bit
    /// operation in two, yet pairs still issue half the instructions per product: measured
    /// there (D116) Q4_K and Q5_0 prefill tiles 1.12–1.18× faster with pairs; but a matmul
    /// whose tiles stream the weights once from memory (`m` within one tile: decode) lost a
    /// third of its speed with them (one-stream decode of Qwen2.5-1.5B 24.5 → 17.5 tok/s, 8
    /// streams 96 → 78), and the 8-row Q6_K tile ([`q6k_tile`], sub-block pairs on 256-bit
    /// vectors) beats the 16-row one by 1.12–1.20×. So on AMD: pairs for prefill, not Q6_K.
    pub(crate) fn row_pairs(kind: Kind, m: usize) -> bool {
        #[derive(Clone, Copy)]
        enum Choice {
            Always,
            Never,
            PrefillNotQ6k,
        }
        static CHOICE: std::sync::OnceLock<Choice> = std::sync::OnceLock::new();
        let choice = *CHOICE.get_or_init(|| match std::env::var("PDMESH_MODEL_ROW_PAIRS").as_deref() {
            Ok("0") => Choice::Never,
            Ok("1") => Choice::Always,
            _ => {
                let v = __cpuid(0);
                let vendor: Vec<u8> = [v.ebx, v.edx, v.ecx].iter().flat_map(|r| r.to_le_bytes()).collect();
                if vendor == b"GenuineIntel" {
                    Choice::Always
                } else {
                    Choice::PrefillNotQ6k
                }
            }
        });
        match choice {
            Choice::Always => true,
            Choice::Never => false,
            Choice::PrefillNotQ6k => kind != Kind::Q6K && m > TILE_TOKENS,
        }
    }

    /// One tile of two row groups (16 rows, `tile.g` counting pairs) with AVX-512 VNNI on
    /// 512-bit vectors: group `2g` in the low 8 lanes, `2g + 1` in the high 8, each lane's
    /// arithmetic exactly [`lanes_tile`]'s (the same integer sums and float operations in the
    /// same order), so the bits are the same. A pair with one group only runs [`lanes`].
    ///
    /// # Safety
    /// As [`lanes`], with `tile.g` a pair index (`2g` < groups) and `tile.nr` the rows of the
    /// pair (≤ 16); `w.kind` is not Q6_K.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn lanes_pair(w: &PackedLanes, a: &QActs, tile: &Tile) {
        if tile.nr <= LANES {
            let single = Tile { g: 2 * tile.g, ..*tile };
            // SAFETY: forwarded preconditions; group 2g holds the pair's rows.
            return unsafe { lanes(w, a, &single) };
        }
        macro_rules! by_tokens {
            ($k:expr) => {
                // SAFETY: forwarded preconditions.
                unsafe {
                    match tile.nt {
                        12 => lanes_tile2::<{ $k as u8 }, 12>(w, a, tile),
                        11 => lanes_tile2::<{ $k as u8 }, 11>(w, a, tile),
                        10 => lanes_tile2::<{ $k as u8 }, 10>(w, a, tile),
                        9 => lanes_tile2::<{ $k as u8 }, 9>(w, a, tile),
                        8 => lanes_tile2::<{ $k as u8 }, 8>(w, a, tile),
                        7 => lanes_tile2::<{ $k as u8 }, 7>(w, a, tile),
                        6 => lanes_tile2::<{ $k as u8 }, 6>(w, a, tile),
                        5 => lanes_tile2::<{ $k as u8 }, 5>(w, a, tile),
                        4 => lanes_tile2::<{ $k as u8 }, 4>(w, a, tile),
                        3 => lanes_tile2::<{ $k as u8 }, 3>(w, a, tile),
                        2 => lanes_tile2::<{ $k as u8 }, 2>(w, a, tile),
                        1 => lanes_tile2::<{ $k as u8 }, 1>(w, a, tile),
                        _ => {}
                    }
                }
            };
        }
        macro_rules! q6k_by_tokens {
            () => {
                // SAFETY: forwarded preconditions.
                unsafe {
                    match tile.nt {
                        12 => q6k_tile2::<12>(w, a, tile),
                        11 => q6k_tile2::<11>(w, a, tile),
                        10 => q6k_tile2::<10>(w, a, tile),
                        9 => q6k_tile2::<9>(w, a, tile),
                        8 => q6k_tile2::<8>(w, a, tile),
                        7 => q6k_tile2::<7>(w, a, tile),
                        6 => q6k_tile2::<6>(w, a, tile),
                        5 => q6k_tile2::<5>(w, a, tile),
                        4 => q6k_tile2::<4>(w, a, tile),
                        3 => q6k_tile2::<3>(w, a, tile),
                        _ => {}
                    }
                }
            };
        }
        match w.kind {
            Kind::Q4_0 => by_tokens!(Kind::Q4_0),
            Kind::Q5_0 => by_tokens!(Kind::Q5_0),
            Kind::Q4K => by_tokens!(Kind::Q4K),
            Kind::Q5K => by_tokens!(Kind::Q5K),
            // one or two tokens (decode): each group alone, as `lanes` runs them
            Kind::Q6K if tile.nt <= 2 => {
                let (lo, hi) = (
                    Tile { g: 2 * tile.g, nr: LANES, ..*tile },
                    Tile { g: 2 * tile.g + 1, nr: tile.nr - LANES, out: tile.out.wrapping_add(LANES), ..*tile },
                );
                // SAFETY: forwarded preconditions; the pair's two groups, each complete.
                unsafe {
                    lanes(w, a, &lo);
                    lanes(w, a, &hi);
                }
            }
            Kind::Q6K => q6k_by_tokens!(),
        }
    }

    /// Two 256-bit halves as one 512-bit vector (`lo` in lanes 0–7).
    #[inline(always)]
    unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
        // SAFETY: AVX-512 F (the callers enable it).
        unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi) }
    }

    /// [`super::avx2::decode_sub`] of sub-block `s` of two groups' chunks (`p0`: group 2g, in
    /// the low 8 lanes; `p1`: group 2g + 1).
    ///
    /// # Safety
    /// AVX-512 F/BW; `p0` and `p1` point to complete chunks of layout `l`.
    // inlined into its caller, which enables the features (as `avx2::decode_sub`)
    #[inline(always)]
    unsafe fn decode_sub2(l: Layout, p0: *const u8, p1: *const u8, s: usize) -> [__m512i; 8] {
        let m4 = _mm512_set1_epi8(0x0F);
        let hmask = _mm512_set1_epi8(if l.hbits == 1 { 0x10 } else { 0x30 });
        let (nq, half) = (l.quads(), l.quads() / 2);
        let mut wq = [_mm512_setzero_si512(); 8];
        // SAFETY: the sub-block's bytes lie inside both chunks (caller).
        unsafe {
            let (sp0, sp1) = (p0.add(s * l.sub_bytes()), p1.add(s * l.sub_bytes()));
            let both = |off: usize| {
                join(
                    _mm256_loadu_si256(sp0.add(off) as *const __m256i),
                    _mm256_loadu_si256(sp1.add(off) as *const __m256i),
                )
            };
            for q in 0..half {
                let raw = both(32 * q);
                wq[q] = _mm512_and_si512(raw, m4);
                wq[q + half] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
            }
            if l.hbits > 0 {
                let h = both(l.sub * 4);
                for (q, wv) in wq.iter_mut().enumerate().take(nq) {
                    let hb = match 4 - (q * l.hbits) as i32 {
                        4 => _mm512_slli_epi16::<4>(h),
                        3 => _mm512_slli_epi16::<3>(h),
                        2 => _mm512_slli_epi16::<2>(h),
                        1 => _mm512_slli_epi16::<1>(h),
                        0 => h,
                        -1 => _mm512_srli_epi16::<1>(h),
                        -2 => _mm512_srli_epi16::<2>(h),
                        _ => _mm512_srli_epi16::<3>(h),
                    };
                    *wv = _mm512_or_si512(*wv, _mm512_and_si512(hb, hmask));
                }
            }
        }
        wq
    }

    /// [`super::avx2::sub_scales`] of two groups' chunks, 16 lanes.
    ///
    /// # Safety
    /// AVX-512 F; `p0` and `p1` point to complete chunks of layout `l` (not Q6_K).
    #[inline(always)]
    unsafe fn sub_scales2(
        l: Layout,
        (p0, p1): (*const u8, *const u8),
        s: usize,
        dv: __m512,
        dminv: __m512,
    ) -> (__m512, __m512) {
        if !l.scales {
            return (_mm512_setzero_ps(), _mm512_setzero_ps());
        }
        // SAFETY: scales and mins lie inside both chunks (caller).
        unsafe {
            let bytes = |off: usize| {
                _mm_unpacklo_epi64(
                    _mm_loadl_epi64(p0.add(off) as *const __m128i),
                    _mm_loadl_epi64(p1.add(off) as *const __m128i),
                )
            };
            let scv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(l.sc_off() + s * LANES))), dv);
            let mnv = if l.mins {
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(l.mn_off() + s * LANES))), dminv)
            } else {
                _mm512_setzero_ps()
            };
            (scv, mnv)
        }
    }

    /// [`super::avx2::accumulate`]'s operations, in its order, on 16 lanes.
    ///
    /// # Safety
    /// AVX-512 F; the activations hold the form layout `l` needs for token `tok` (not Q6_K).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate2(
        l: Layout,
        a: &QActs,
        tok: usize,
        b: usize,
        s: usize,
        isum: __m512i,
        (dv, scv, mnv): (__m512, __m512, __m512),
        acc: &mut __m512,
    ) {
        let k = a.k;
        // SAFETY: the activation offsets lie inside the token's forms (caller).
        unsafe {
            if l.block != QK_K {
                let i = tok * (k / 32) + b;
                let sumi = _mm512_sub_epi32(isum, _mm512_set1_epi32(l.offset() * *a.isum.as_ptr().add(i)));
                let term =
                    _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sumi), dv), _mm512_set1_ps(*a.d.as_ptr().add(i)));
                *acc = _mm512_add_ps(*acc, term);
            } else {
                let da = _mm512_set1_ps(*a.dk.as_ptr().add(tok * (k / QK_K) + b));
                let mins = _mm512_set1_ps(*a.mins32.as_ptr().add(tok * (k / 32) + b * 8 + s));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scv, da), *acc);
                *acc = _mm512_fnmadd_ps(mnv, mins, *acc);
            }
        }
    }

    /// # Safety
    /// As [`lanes_pair`] with two full groups, `nt = T` and `w.kind as u8 == K`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn lanes_tile2<const K: u8, const T: usize>(w: &PackedLanes, a: &QActs, tile: &Tile) {
        let kind = kind_of(K);
        let l = Layout::of(kind);
        let k = a.k;
        let nb = k / l.block;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let chunk = l.chunk();
        let nq = l.quads();
        let q8k = l.block == QK_K;
        // SAFETY: as in `lanes_tile`, for groups 2g and 2g + 1 (both complete: the caller).
        unsafe {
            let base0 = w.data.as_ptr().add(2 * g * nb * chunk);
            let base1 = w.data.as_ptr().add((2 * g + 1) * nb * chunk);
            let mut acc = [_mm512_setzero_ps(); T];
            let dist = if T == a.rows { prefetch_distance(T) } else { 0 };
            for b in 0..nb {
                let (p0, p1) = (base0.add(b * chunk), base1.add(b * chunk));
                if dist > 0 {
                    prefetch_ahead(p0, chunk, dist);
                    prefetch_ahead(p1, chunk, dist);
                }
                let halves = |off: usize| {
                    _mm256_set_m128i(
                        _mm_loadu_si128(p1.add(off) as *const __m128i),
                        _mm_loadu_si128(p0.add(off) as *const __m128i),
                    )
                };
                let dv = _mm512_cvtph_ps(halves(l.d_off()));
                let dminv = if l.mins { _mm512_cvtph_ps(halves(l.d_off() + 2 * LANES)) } else { _mm512_setzero_ps() };
                for s in 0..l.subs() {
                    let wq = decode_sub2(l, p0, p1, s);
                    let (scv, mnv) = sub_scales2(l, (p0, p1), s, dv, dminv);
                    for (t, acc_t) in acc.iter_mut().enumerate() {
                        let tok = t0 + t;
                        let at = tok * k + b * l.block + s * l.sub;
                        let ap = if q8k { a.qk.as_ptr().add(at) } else { a.qs.as_ptr().add(at) } as *const i32;
                        let mut s0 = _mm512_setzero_si512();
                        let mut s1 = _mm512_setzero_si512();
                        for q in (0..nq).step_by(2) {
                            s0 = _mm512_dpbusd_epi32(s0, wq[q], _mm512_set1_epi32(ap.add(q).read_unaligned()));
                            s1 = _mm512_dpbusd_epi32(s1, wq[q + 1], _mm512_set1_epi32(ap.add(q + 1).read_unaligned()));
                        }
                        let isum = _mm512_add_epi32(s0, s1);
                        accumulate2(l, a, tok, b, s, isum, (dv, scv, mnv), acc_t);
                    }
                }
            }
            let lanes: __mmask16 = if nr >= 2 * LANES { 0xFFFF } else { (1u16 << nr) - 1 };
            for (t, acc_t) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(out.add((t0 + t) * rows), lanes, *acc_t);
            }
        }
    }

    /// A decoded Q6_K super-block of two row groups on 512-bit vectors (group `2g` in the low 8
    /// lanes), per quad `i = 4s + q`: the values `v − 32` as i8 (`w`), `−128·Σ(v − 32)` per row
    /// (`neg_corr`), and per sub-block the row's scale in the low i16 of its lane (`sc`).
    struct Q6kBlock2 {
        w: [__m512i; 64],
        neg_corr: [__m512i; 64],
        sc: [__m512i; 16],
    }

    /// The 8 candle lanes' exact sums of one super-block of two row groups (16 lanes) for `N`
    /// tokens, whose activations (biased by 128, so unsigned) start at `x[n]`: per quad a
    /// `vpdpbusd` from `−128·Σ(v − 32)` gives `Σ (v − 32)·x` (an i16), which `vpdpwssd` multiplies
    /// by the scale into the candle lane.
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI; each `x[n]` points to 256 bytes.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn q6k_sums2<const N: usize>(blk: &Q6kBlock2, x: [*const u8; N]) -> [[__m512i; 8]; N] {
        let mut sumi = [[_mm512_setzero_si512(); 8]; N];
        // SAFETY: forwarded.
        unsafe {
            for s2 in 0..8 {
                for h in 0..2 {
                    let s = 2 * s2 + h;
                    for q in 0..4 {
                        let i = 4 * s + q;
                        for (n, sums) in sumi.iter_mut().enumerate() {
                            let xv = _mm512_set1_epi32((x[n].add(4 * i) as *const i32).read_unaligned());
                            let d = _mm512_dpbusd_epi32(blk.neg_corr[i], xv, blk.w[i]);
                            sums[4 * h + q] = _mm512_dpwssd_epi32(sums[4 * h + q], d, blk.sc[s]);
                        }
                    }
                }
            }
        }
        sumi
    }

    /// [`q6k_tile`] over two row groups (16 rows) on 512-bit vectors, a quad at a time (Intel
    /// cores, D112/D116): per lane the same integers and the same float operations in the same
    /// order, so the same bits.
    ///
    /// # Safety
    /// As [`lanes_pair`] with two full groups, `nt = T ≥ 3` and `w.kind == Kind::Q6K`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_tile2<const T: usize>(w: &PackedLanes, a: &QActs, tile: &Tile) {
        let l = Layout::of(Kind::Q6K);
        let k = a.k;
        let nb = k / QK_K;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let chunk = l.chunk();
        let m4 = _mm512_set1_epi8(0x0F);
        let hmask = _mm512_set1_epi8(0x30);
        let m32 = _mm512_set1_epi8(32);
        let bias = _mm512_set1_epi8(-128);
        let bias256 = _mm256_set1_epi8(-128);
        let lo16 = _mm512_set1_epi32(0xFFFF);
        // SAFETY: as in `q6k_tile`, for groups 2g and 2g + 1 (both complete: the caller).
        unsafe {
            let base0 = w.data.as_ptr().add(2 * g * nb * chunk);
            let base1 = w.data.as_ptr().add((2 * g + 1) * nb * chunk);
            let mut acc = [[_mm512_setzero_ps(); 8]; T];
            let zero = _mm512_setzero_si512();
            let mut blk = Q6kBlock2 { w: [zero; 64], neg_corr: [zero; 64], sc: [zero; 16] };
            let mut xb = [[0u8; QK_K]; T];
            let dist = if T == a.rows { prefetch_distance(T) } else { 0 };
            for b in 0..nb {
                let (p0, p1) = (base0.add(b * chunk), base1.add(b * chunk));
                if dist > 0 {
                    prefetch_ahead(p0, chunk, dist);
                    prefetch_ahead(p1, chunk, dist);
                }
                let dv = _mm512_cvtph_ps(_mm256_set_m128i(
                    _mm_loadu_si128(p1.add(l.d_off()) as *const __m128i),
                    _mm_loadu_si128(p0.add(l.d_off()) as *const __m128i),
                ));
                for s in 0..16 {
                    let (sp0, sp1) = (p0.add(s * l.sub_bytes()), p1.add(s * l.sub_bytes()));
                    let load = |off: usize| {
                        join(
                            _mm256_loadu_si256(sp0.add(off) as *const __m256i),
                            _mm256_loadu_si256(sp1.add(off) as *const __m256i),
                        )
                    };
                    let (raw0, raw1, h) = (load(0), load(32), load(64));
                    let hq = [_mm512_slli_epi16::<4>(h), _mm512_slli_epi16::<2>(h), h, _mm512_srli_epi16::<2>(h)];
                    let lo = [
                        _mm512_and_si512(raw0, m4),
                        _mm512_and_si512(raw1, m4),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw0), m4),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw1), m4),
                    ];
                    for q in 0..4 {
                        let v = _mm512_sub_epi8(_mm512_or_si512(lo[q], _mm512_and_si512(hq[q], hmask)), m32);
                        blk.w[4 * s + q] = v;
                        blk.neg_corr[4 * s + q] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, v));
                    }
                    let sc8 = _mm_unpacklo_epi64(
                        _mm_loadl_epi64(p0.add(l.sc_off() + s * LANES) as *const __m128i),
                        _mm_loadl_epi64(p1.add(l.sc_off() + s * LANES) as *const __m128i),
                    );
                    blk.sc[s] = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), lo16);
                }
                for (t, row) in xb.iter_mut().enumerate() {
                    let src = a.qk.as_ptr().add((t0 + t) * k + b * QK_K);
                    for c in 0..QK_K / 32 {
                        let v = _mm256_xor_si256(_mm256_loadu_si256(src.add(32 * c) as *const __m256i), bias256);
                        _mm256_storeu_si256(row.as_mut_ptr().add(32 * c) as *mut __m256i, v);
                    }
                }
                let mut t = 0;
                while t < T {
                    let sums: ([[__m512i; 8]; 2], usize) = if t + 1 < T {
                        (q6k_sums2::<2>(&blk, [xb[t].as_ptr(), xb[t + 1].as_ptr()]), 2)
                    } else {
                        let [one] = q6k_sums2::<1>(&blk, [xb[t].as_ptr()]);
                        ([one, [zero; 8]], 1)
                    };
                    for n in 0..sums.1 {
                        let dd = _mm512_mul_ps(_mm512_set1_ps(*a.dk.as_ptr().add((t0 + t + n) * nb + b)), dv);
                        for (acc_l, s) in acc[t + n].iter_mut().zip(&sums.0[n]) {
                            *acc_l = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(*s), *acc_l);
                        }
                    }
                    t += sums.1;
                }
            }
            let lanes: __mmask16 = if nr >= 2 * LANES { 0xFFFF } else { (1u16 << nr) - 1 };
            for (t, acc_t) in acc.iter().enumerate() {
                let v = _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(acc_t[0], acc_t[4]), _mm512_add_ps(acc_t[2], acc_t[6])),
                    _mm512_add_ps(_mm512_add_ps(acc_t[1], acc_t[5]), _mm512_add_ps(acc_t[3], acc_t[7])),
                );
                _mm512_mask_storeu_ps(out.add((t0 + t) * rows), lanes, v);
            }
        }
    }

    /// candle's `hsum_float_8` across a token's 8 candle-lane accumulators, per row lane, into
    /// the first `nr` (at most 8) of the row outputs at `dst`.
    ///
    /// # Safety
    /// AVX-512 F/VL (the callers enable it); `dst` holds `nr` values.
    #[inline(always)]
    unsafe fn store_lane_sums(acc: &[__m256; 8], dst: *mut f32, nr: usize) {
        let lanes: __mmask8 = if nr >= LANES { 0xFF } else { (1u8 << nr) - 1 };
        // SAFETY: the lanes written are the first `nr` of `dst` (caller).
        unsafe {
            let v = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])),
            );
            _mm256_mask_storeu_ps(dst, lanes, v);
        }
    }

    /// Sub-blocks `s` and `s + 2` go in pairs (they feed the same candle lanes, `L = 4·(s % 2) +
    /// q`): pair `j` starts at sub-block `4·(j / 2) + j % 2`.
    const fn pair_first(j: usize) -> usize {
        4 * (j / 2) + j % 2
    }

    /// Where the 8 activation bytes of pair `j`, quad `q` sit in a token's row of [`pair_acts`]:
    /// values 0 and 1 of quad `q` of sub-blocks `s` and `s + 2`, then values 2 and 3.
    const fn pair_act_offset(j: usize, q: usize) -> usize {
        64 * (j / 2) + 32 * (q / 2) + 16 * (j % 2) + 8 * (q % 2)
    }

    /// One token's 256 Q8_K activations of a super-block, biased to unsigned (`x + 128`) and
    /// interleaved by 16-bit words into the pair order [`pair_act_offset`] reads: per 64 values
    /// (sub-blocks `4g..4g + 4`) one unpack of the low and one of the high words of the halves.
    ///
    /// # Safety
    /// AVX2; `src` holds 256 bytes.
    #[inline(always)]
    unsafe fn pair_acts(src: *const i8, dst: &mut [u8; QK_K]) {
        // SAFETY: forwarded.
        unsafe { pair_acts_xor(src, dst, _mm256_set1_epi8(-128)) }
    }

    /// [`pair_acts`] with the bytes xor-ed by `bias` (0: the signed activations as they are).
    ///
    /// # Safety
    /// AVX2; `src` holds 256 bytes.
    #[inline(always)]
    unsafe fn pair_acts_xor(src: *const i8, dst: &mut [u8; QK_K], bias: __m256i) {
        // SAFETY: 256 bytes read from `src` (caller), 256 written to `dst`.
        unsafe {
            for g in 0..4 {
                let a = _mm256_xor_si256(_mm256_loadu_si256(src.add(64 * g) as *const __m256i), bias);
                let b = _mm256_xor_si256(_mm256_loadu_si256(src.add(64 * g + 32) as *const __m256i), bias);
                let out = dst.as_mut_ptr().add(64 * g) as *mut __m256i;
                _mm256_storeu_si256(out, _mm256_unpacklo_epi16(a, b));
                _mm256_storeu_si256(out.add(1), _mm256_unpackhi_epi16(a, b));
            }
        }
    }

    /// A decoded Q6_K super-block of 8 rows in sub-block pairs (pair `j`: sub-blocks
    /// `s = pair_first(j)` and `s + 2`), per `i = 4j + q`: `lo[i]` holds in each row's lane
    /// values 0 and 1 of quad `q` of `s`, then of `s + 2` (`v − 32` as i8), `hi[i]` values 2 and 3;
    /// `sc[j]` the row's two scales as i16 (`s` low, `s + 2` high); `start[L]` per candle lane
    /// `−128·Σ sc·Σ(v − 32)`, what the activations' bias adds.
    struct Q6kPairs {
        lo: [__m256i; 32],
        hi: [__m256i; 32],
        sc: [__m256i; 8],
        start: [__m256i; 8],
    }

    /// The 8 candle lanes' exact sums of one super-block for `N` tokens whose paired, biased
    /// activations ([`pair_acts`]) start at `x[n]`, each lane starting from `blk.start`.
    ///
    /// Per pair, quad and token: two `vpmaddubsw` (activation bytes × `v − 32`, each i16 a
    /// sum of two products of one sub-block: `|·| ≤ 2·255·32`), their i16 sum (one quad's
    /// dot product per sub-block, `|·| ≤ 32640`: no saturation), and one `vpdpwssd` against
    /// the two scales adds `sc_s·Σ_s + sc_{s+2}·Σ_{s+2}` to the lane: three multiplies for two
    /// quads, where a quad at a time took two.
    ///
    /// # Safety
    /// AVX-512 VL/VNNI, AVX-512 BW; each `x[n]` points to 256 bytes.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn q6k_pair_sums<const N: usize>(blk: &Q6kPairs, x: [*const u8; N]) -> [[__m256i; 8]; N] {
        let mut sumi = [blk.start; N];
        // SAFETY: forwarded.
        unsafe {
            // h innermost but one, so that every lane index is a constant (the sums stay in
            // registers; indexed by a loop variable they went through the stack)
            for j2 in 0..4 {
                for h in 0..2 {
                    let j = 2 * j2 + h;
                    for q in 0..4 {
                        let i = 4 * j + q;
                        let off = pair_act_offset(j, q);
                        for (n, sums) in sumi.iter_mut().enumerate() {
                            let x1 = _mm256_set1_epi32((x[n].add(off) as *const i32).read_unaligned());
                            let x2 = _mm256_set1_epi32((x[n].add(off + 4) as *const i32).read_unaligned());
                            let d = _mm256_add_epi16(
                                _mm256_maddubs_epi16(x1, blk.lo[i]),
                                _mm256_maddubs_epi16(x2, blk.hi[i]),
                            );
                            sums[4 * h + q] = _mm256_dpwssd_epi32(sums[4 * h + q], d, blk.sc[j]);
                        }
                    }
                }
            }
        }
        sumi
    }

    /// Decode the Q6_K super-block of 8 rows at `p` into `blk` (pairs and their bias start).
    ///
    /// # Safety
    /// AVX-512 VL/VNNI, AVX-512 BW; `p` points to a complete Q6_K chunk.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn q6k_decode_pairs(p: *const u8, blk: &mut Q6kPairs) {
        // SAFETY: the chunk's sub-blocks and scales lie at `p` (caller).
        unsafe {
            q6k_pair_vectors(p, _mm256_set1_epi8(32), blk);
            // the bias's share, `128·Σ sc·Σ(v − 32)` per lane: each pair's four values summed
            // as bytes (|·| ≤ 64), then as i16 per sub-block, then by the two scales
            let ones = _mm256_set1_epi8(1);
            let mut bias = [_mm256_setzero_si256(); 8];
            for j2 in 0..4 {
                for h in 0..2 {
                    let j = 2 * j2 + h;
                    for q in 0..4 {
                        let i = 4 * j + q;
                        let w4 = _mm256_maddubs_epi16(ones, _mm256_add_epi8(blk.lo[i], blk.hi[i]));
                        bias[4 * h + q] = _mm256_dpwssd_epi32(bias[4 * h + q], w4, blk.sc[j]);
                    }
                }
            }
            blk.start = bias.map(|v| _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<7>(v)));
        }
    }

    /// The pair vectors of [`Q6kPairs`] (`lo`, `hi`, `sc`) of the Q6_K super-block of 8 rows at
    /// `p`, the values stored as `v − offset` (32: signed; 0: `v` itself, unsigned).
    ///
    /// # Safety
    /// AVX2; `p` points to a complete Q6_K chunk.
    #[inline(always)]
    unsafe fn q6k_pair_vectors(p: *const u8, offset: __m256i, blk: &mut Q6kPairs) {
        let l = Layout::of(Kind::Q6K);
        // SAFETY: the chunk's sub-blocks and scales lie at `p` (caller).
        unsafe {
            let quads = |s: usize| q6k_quads(p.add(s * l.sub_bytes())).map(|v| _mm256_sub_epi8(v, offset));
            let scale =
                |s: usize| _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(l.sc_off() + s * LANES) as *const __m128i));
            for j in 0..8 {
                let s = pair_first(j);
                let (wa, wb) = (quads(s), quads(s + 2));
                for q in 0..4 {
                    blk.lo[4 * j + q] = _mm256_blend_epi16::<0xAA>(wa[q], _mm256_slli_epi32::<16>(wb[q]));
                    blk.hi[4 * j + q] = _mm256_blend_epi16::<0xAA>(_mm256_srli_epi32::<16>(wa[q]), wb[q]);
                }
                blk.sc[j] = _mm256_blend_epi16::<0xAA>(scale(s), _mm256_slli_epi32::<16>(scale(s + 2)));
            }
        }
    }

    /// A Q6_K tile of one token (a decode step of one request), a quad at a time without the
    /// bias: the weights stay unsigned (`v`, as decoded), and a `vpdpbusd` of them with the
    /// token's signed activations starts from `−32·Σ x` of the quad (computed once per
    /// super-block), leaving the exact `Σ (v − 32)·x` (an i16) for the `vpdpwssd` by the scale:
    /// two multiplies per quad, where the AVX2 one-token tile takes three.
    ///
    /// # Safety
    /// As [`lanes`] with `nt = 1` and `w.kind == Kind::Q6K`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_tile_one(w: &PackedLanes, a: &QActs, tile: &Tile) {
        let l = Layout::of(Kind::Q6K);
        let k = a.k;
        let nb = k / QK_K;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let chunk = l.chunk();
        let ones8 = _mm256_set1_epi8(1);
        let ones16 = _mm256_set1_epi16(1);
        let lo16 = _mm256_set1_epi32(0xFFFF);
        // SAFETY: as in `q6k_tile` (Q8_K activations: qk and dk of token t0); the scratch is local.
        unsafe {
            let base = w.data.as_ptr().add(g * nb * chunk);
            let mut acc = [_mm256_setzero_ps(); 8];
            // −32·Σ x per quad of the super-block
            let mut neg32x = [0i32; QK_K / 4];
            let dist = if a.rows == 1 { prefetch_distance(1) } else { 0 };
            for b in 0..nb {
                let p = base.add(b * chunk);
                if dist > 0 {
                    prefetch_ahead(p, chunk, dist);
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(p.add(l.d_off()) as *const __m128i));
                let ap = a.qk.as_ptr().add(t0 * k + b * QK_K);
                for c in 0..QK_K / 32 {
                    let x = _mm256_loadu_si256(ap.add(32 * c) as *const __m256i);
                    let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x), ones16);
                    let neg = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<5>(sums));
                    _mm256_storeu_si256(neg32x.as_mut_ptr().add(8 * c) as *mut __m256i, neg);
                }
                let mut sumi = [_mm256_setzero_si256(); 8];
                // candle lane 4·(s mod 2) + q takes quad q of sub-block s; the pair loop keeps
                // every lane index a constant, so the sums stay in registers
                for s2 in 0..8 {
                    for h in 0..2 {
                        let s = 2 * s2 + h;
                        let quads = q6k_quads(p.add(s * l.sub_bytes()));
                        let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(l.sc_off() + s * LANES) as *const __m128i));
                        let sc = _mm256_and_si256(sc, lo16);
                        for (q, &v) in quads.iter().enumerate() {
                            let i = 4 * s + q;
                            let xv = _mm256_set1_epi32((ap.add(4 * i) as *const i32).read_unaligned());
                            let d = _mm256_dpbusd_epi32(_mm256_set1_epi32(neg32x[i]), v, xv);
                            sumi[4 * h + q] = _mm256_dpwssd_epi32(sumi[4 * h + q], d, sc);
                        }
                    }
                }
                let dd = _mm256_mul_ps(_mm256_broadcast_ss(&*a.dk.as_ptr().add(t0 * nb + b)), dv);
                for (acc_l, s) in acc.iter_mut().zip(&sumi) {
                    *acc_l = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(*s), *acc_l);
                }
            }
            store_lane_sums(&acc, out.add(t0 * rows), nr);
        }
    }

    /// A Q6_K tile of two tokens (a decode step) in sub-block pairs without the bias, whose
    /// per-lane start costs about a token's multiplies, which two tokens do not win back: the
    /// weights stay unsigned (`v`), each pair's two `vpmaddubsw` give `Σ v·x` per
    /// sub-block (`|·| ≤ 4·63·128`), and subtracting `32·Σ x` (per token and quad, computed once
    /// per super-block) leaves the exact `Σ (v − 32)·x` before the `vpdpwssd` by the scales:
    /// three multiplies per two quads and token, where the AVX2 tile takes four.
    ///
    /// # Safety
    /// As [`lanes`] with `nt = T` and `w.kind == Kind::Q6K`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_tile_few<const T: usize>(w: &PackedLanes, a: &QActs, tile: &Tile) {
        let l = Layout::of(Kind::Q6K);
        let k = a.k;
        let nb = k / QK_K;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let chunk = l.chunk();
        let ones = _mm256_set1_epi8(1);
        // SAFETY: as in `q6k_tile`; the scratch is local.
        unsafe {
            let base = w.data.as_ptr().add(g * nb * chunk);
            let mut acc = [[_mm256_setzero_ps(); 8]; T];
            let zero = _mm256_setzero_si256();
            let mut blk = Q6kPairs { lo: [zero; 32], hi: [zero; 32], sc: [zero; 8], start: [zero; 8] };
            // per token: the paired activations, and in the same places `32·Σ x` of each
            // sub-block's quad as the i16 pair the `vpdpwssd` expects
            let mut xp = [[0u8; QK_K]; T];
            let mut x32 = [[0u8; QK_K]; T];
            let dist = if T == a.rows { prefetch_distance(T) } else { 0 };
            for b in 0..nb {
                let p = base.add(b * chunk);
                if dist > 0 {
                    prefetch_ahead(p, chunk, dist);
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(p.add(l.d_off()) as *const __m128i));
                q6k_pair_vectors(p, zero, &mut blk);
                for t in 0..T {
                    pair_acts_xor(a.qk.as_ptr().add((t0 + t) * k + b * QK_K), &mut xp[t], zero);
                    for c in 0..QK_K / 32 {
                        // [a01, b01, a23, b23] per 8 bytes → (a01 + a23, b01 + b23) in the low half
                        let v = _mm256_loadu_si256(xp[t].as_ptr().add(32 * c) as *const __m256i);
                        let m = _mm256_maddubs_epi16(ones, v);
                        let sum = _mm256_add_epi16(m, _mm256_srli_epi64::<32>(m));
                        let dst = x32[t].as_mut_ptr().add(32 * c) as *mut __m256i;
                        _mm256_storeu_si256(dst, _mm256_slli_epi16::<5>(sum));
                    }
                }
                let mut sumi = [[zero; 8]; T];
                for j2 in 0..4 {
                    for h in 0..2 {
                        let j = 2 * j2 + h;
                        for q in 0..4 {
                            let (i, off) = (4 * j + q, pair_act_offset(j, q));
                            for (n, sums) in sumi.iter_mut().enumerate() {
                                let at = |o: usize| {
                                    _mm256_set1_epi32((xp[n].as_ptr().add(o) as *const i32).read_unaligned())
                                };
                                let c = _mm256_set1_epi32((x32[n].as_ptr().add(off) as *const i32).read_unaligned());
                                let d = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(blk.lo[i], at(off)),
                                    _mm256_maddubs_epi16(blk.hi[i], at(off + 4)),
                                );
                                let d = _mm256_sub_epi16(d, c);
                                sums[4 * h + q] = _mm256_dpwssd_epi32(sums[4 * h + q], d, blk.sc[j]);
                            }
                        }
                    }
                }
                for (n, sums) in sumi.iter().enumerate() {
                    let dd = _mm256_mul_ps(_mm256_broadcast_ss(&*a.dk.as_ptr().add((t0 + n) * nb + b)), dv);
                    for (acc_l, s) in acc[n].iter_mut().zip(sums) {
                        *acc_l = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(*s), *acc_l);
                    }
                }
            }
            for (t, acc_t) in acc.iter().enumerate() {
                store_lane_sums(acc_t, out.add((t0 + t) * rows), nr);
            }
        }
    }

    /// One Q6_K tile in candle's one-token arithmetic (as [`super::q6k_scalar`]): the same
    /// exact per-lane integers as the AVX2 tile, with sub-blocks `s` and `s + 2` taken together
    /// ([`q6k_pair_sums`]: three multiplies per two quads and token, against four with a
    /// `vpdpbusd` and a `vpdpwssd` per quad). Tokens go in pairs, so each decoded vector loaded
    /// serves two.
    ///
    /// # Safety
    /// As [`lanes`] with `nt = T` and `w.kind == Kind::Q6K`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_tile(w: &PackedLanes, a: &QActs, tile: &Tile) {
        const MAX: usize = Q6K_TILE_TOKENS;
        let l = Layout::of(Kind::Q6K);
        let k = a.k;
        let nb = k / QK_K;
        let Tile { g, nr, t0, rows, out, .. } = *tile;
        let nt = tile.nt.min(MAX);
        let chunk = l.chunk();
        // SAFETY: as in `avx2::q6k_tile` (Q8_K activations: qk and dk); the scratch is local.
        unsafe {
            let base = w.data.as_ptr().add(g * nb * chunk);
            let mut acc = [[_mm256_setzero_ps(); 8]; MAX];
            let zero = _mm256_setzero_si256();
            let mut blk = Q6kPairs { lo: [zero; 32], hi: [zero; 32], sc: [zero; 8], start: [zero; 8] };
            let mut xb = [[0u8; QK_K]; MAX];
            let dist = if nt == a.rows { prefetch_distance(nt) } else { 0 };
            for b in 0..nb {
                let p = base.add(b * chunk);
                if dist > 0 {
                    prefetch_ahead(p, chunk, dist);
                }
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(p.add(l.d_off()) as *const __m128i));
                q6k_decode_pairs(p, &mut blk);
                for (t, row) in xb.iter_mut().enumerate().take(nt) {
                    pair_acts(a.qk.as_ptr().add((t0 + t) * k + b * QK_K), row);
                }
                let mut t = 0;
                while t < nt {
                    let sums: ([[__m256i; 8]; 2], usize) = if t + 1 < nt {
                        (q6k_pair_sums::<2>(&blk, [xb[t].as_ptr(), xb[t + 1].as_ptr()]), 2)
                    } else {
                        let [one] = q6k_pair_sums::<1>(&blk, [xb[t].as_ptr()]);
                        ([one, [zero; 8]], 1)
                    };
                    for n in 0..sums.1 {
                        let dd = _mm256_mul_ps(_mm256_broadcast_ss(&*a.dk.as_ptr().add((t0 + t + n) * nb + b)), dv);
                        for (acc_l, s) in acc[t + n].iter_mut().zip(&sums.0[n]) {
                            *acc_l = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(*s), *acc_l);
                        }
                    }
                    t += sums.1;
                }
            }
            for (t, acc_t) in acc.iter().enumerate().take(nt) {
                store_lane_sums(acc_t, out.add((t0 + t) * rows), nr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};

    use super::*;
    use crate::kernels::{matmul, Impl, Needs, Packed};
    use crate::pool::Pool;

    const TYPES: [GgmlDType; 8] = [
        GgmlDType::Q4_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
        GgmlDType::F32,
        GgmlDType::F16,
        GgmlDType::BF16,
    ];

    /// Deterministic values with a spread of magnitudes and both signs.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                u * (0.2 + (i % 29) as f32 * 0.05)
            })
            .collect()
    }

    /// A random `[rows, k]` matrix quantized by candle, its raw blocks and its dequantized values.
    fn weights(dtype: GgmlDType, rows: usize, k: usize, seed: u64) -> (QTensor, Vec<u8>, Vec<f32>) {
        let t = Tensor::from_vec(values(rows * k, seed), (rows, k), &Device::Cpu).unwrap();
        let qt = QTensor::quantize(&t, dtype).unwrap();
        let raw = qt.data().unwrap().into_owned();
        let deq = qt.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (qt, raw, deq)
    }

    fn ours(w: &Packed, x: &[f32], m: usize, imp: Impl, pool: &Pool) -> Vec<f32> {
        let mut a = QActs::default();
        a.prepare(x, m, w.k(), w.needs(), pool);
        let mut out = vec![f32::NAN; m * w.rows()];
        matmul(w, &a, &mut out, imp, pool).unwrap();
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Whether candle's `QMatMul` runs its 256-bit repacked Q4_K/Q6_K kernels here (AVX2 + FMA
    /// without AVX-512 VNNI, which it would use instead).
    fn candle_repacks_with_avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Whether candle's one-token Q6_K `vec_dot` takes its AVX2 path (else its scalar
    /// `vec_dot_unopt`, another summation order).
    fn candle_has_avx2_fma() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// `Σ|w·x|` per (token, row): the scale rounding differences are measured against.
    fn abs_dot(deq: &[f32], x: &[f32], rows: usize, k: usize, m: usize) -> Vec<f64> {
        let mut out = vec![0f64; m * rows];
        for t in 0..m {
            for r in 0..rows {
                out[t * rows + r] = (0..k).map(|i| f64::from(deq[r * k + i] * x[t * k + i]).abs()).sum();
            }
        }
        out
    }

    #[test]
    fn every_type_matches_the_dequantized_f64_product_within_the_activation_rounding() {
        let pool = Pool::new(2, 0);
        let (k, m) = (512, 5);
        for dtype in TYPES {
            for rows in [24, 13] {
                let (_, raw, deq) = weights(dtype, rows, k, rows as u64 + dtype.type_size() as u64);
                let w = Packed::from_gguf(dtype, &raw, rows, k).unwrap();
                let x = values(m * k, 77);
                // the activation block each value is quantized in, and its rounding step
                let block = match w.needs() {
                    Needs { q8k: true, .. } => QK_K,
                    Needs { q8: true, .. } => 32,
                    _ => 0,
                };
                let absd = abs_dot(&deq, &x, rows, k, m);
                for imp in Impl::available() {
                    let got = ours(&w, &x, m, imp, &pool);
                    for t in 0..m {
                        let xt = &x[t * k..(t + 1) * k];
                        for r in 0..rows {
                            let wr = &deq[r * k..(r + 1) * k];
                            let exact: f64 = wr.iter().zip(xt).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                            // each activation moves by at most ~half a step (0.6 with the f16
                            // rounding of Q8_0's scale); the float sums add a few ulps
                            let mut bound = 1e-5 * absd[t * rows + r];
                            if block > 0 {
                                for (wb, xb) in wr.chunks(block).zip(xt.chunks(block)) {
                                    let step = f64::from(xb.iter().fold(0f32, |a, v| a.max(v.abs()))) / 127.0;
                                    bound += wb.iter().map(|&v| f64::from(v).abs()).sum::<f64>() * step * 0.6;
                                }
                            }
                            let err = (f64::from(got[t * rows + r]) - exact).abs();
                            assert!(
                                err <= bound,
                                "{dtype:?} {imp:?} row {r} tok {t}: {} vs {exact} (bound {bound})",
                                got[t * rows + r]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn matches_candle_qmatmul_bit_for_bit_where_the_arithmetic_is_the_same() {
        let pool = Pool::new(2, 0);
        // rows a multiple of 16 and k of 256: candle's repacked x86 path applies to Q4_K/Q6_K
        let (rows, k) = (32, 512);
        for dtype in TYPES {
            let (qt, raw, deq) = weights(dtype, rows, k, 5 + dtype.type_size() as u64);
            let w = Packed::from_gguf(dtype, &raw, rows, k).unwrap();
            let mm = QMatMul::from_qtensor(qt).unwrap();
            for m in [1, 5] {
                let x = values(m * k, 31 + m as u64);
                let run = |x: &[f32], m: usize| {
                    let xt = Tensor::from_slice(x, (m, k), &Device::Cpu).unwrap();
                    mm.forward(&xt).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
                };
                let batch = run(&x, m);
                // Q6_K: candle's one-token result (`vec_dot_q6k_q8k`, m = 1), token by token;
                // its own m > 1 result (repacked kernel) differs from that in the last bits,
                // ours equals the one-token result at every m.
                let want = if dtype == GgmlDType::Q6K {
                    (0..m).flat_map(|t| run(&x[t * k..(t + 1) * k], 1)).collect()
                } else {
                    batch.clone()
                };
                // Q5_0: candle's scalar vec_dot; Q4_K: its repacked AVX2 kernel (any m); Q6_K:
                // its AVX2 vec_dot. Only where candle runs those paths (AVX2 + FMA).
                let exact = match dtype {
                    GgmlDType::Q5_0 => true,
                    GgmlDType::Q4K => candle_repacks_with_avx2(),
                    GgmlDType::Q6K => candle_has_avx2_fma(),
                    _ => false,
                };
                let absd = abs_dot(&deq, &x, rows, k, m);
                for imp in Impl::available() {
                    let got = ours(&w, &x, m, imp, &pool);
                    if exact {
                        assert_eq!(bits(&got), bits(&want), "{dtype:?} {imp:?} m={m}");
                    }
                    // every type, and candle's own batched Q6_K: the same exact terms, rounded
                    // differently at most
                    for (i, (g, c)) in got.iter().zip(&batch).enumerate() {
                        let diff = f64::from((g - c).abs());
                        assert!(diff <= 1e-5 * absd[i] + 1e-30, "{dtype:?} {imp:?} m={m} [{i}]: {g} vs candle {c}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_has_the_same_bits_alone_and_anywhere_in_a_batch_on_every_impl() {
        // 37 tokens: two full 16-token Q6_K tiles (AVX2, AVX-512 on AMD) and a partial one, four
        // 8-token tiles and a partial one for the other types (16-row pairs on AVX-512 on AMD)
        let (k, m) = (768, 37);
        let one = Pool::new(1, 0);
        let three = Pool::new(3, 0);
        // 20 rows: a full 16-row pair and a 4-row rest; 28: a pair whose second group is partial
        for (dtype, rows) in TYPES.into_iter().flat_map(|d| [(d, 20), (d, 28)]) {
            let (_, raw, _) = weights(dtype, rows, k, 9);
            let w = Packed::from_gguf(dtype, &raw, rows, k).unwrap();
            let x = values(m * k, 123);
            let mut first: Option<Vec<u32>> = None;
            for imp in Impl::available() {
                let batched = bits(&ours(&w, &x, m, imp, &three));
                for t in 0..m {
                    let alone = ours(&w, &x[t * k..(t + 1) * k], 1, imp, &one);
                    assert_eq!(bits(&alone), batched[t * rows..(t + 1) * rows], "{dtype:?} {imp:?} token {t}");
                }
                // two tokens: a decode step of two requests (its own Q6_K tile on AVX-512)
                let two = bits(&ours(&w, &x[..2 * k], 2, imp, &three));
                assert_eq!(two, batched[..2 * rows], "{dtype:?} {imp:?} two tokens");
                // scalar and AVX2 (and AVX-512) give the same bits
                match &first {
                    Some(f) => assert_eq!(f, &batched, "{dtype:?} {imp:?} vs {:?}", Impl::Scalar),
                    None => first = Some(batched),
                }
            }
        }
    }

    /// A matmul written straight into parts (a fused gate/up) gives each part exactly its rows
    /// of the whole product, with parts of one group, of an odd number of groups (no 16-row
    /// pair may straddle two parts) and a last part ending in a partial group; every value of
    /// every part is written (the buffers start as NaN).
    #[test]
    fn parts_receive_exactly_their_rows_of_the_whole_product() {
        use crate::kernels::matmul_parts;
        let (k, m, sizes) = (512, 14, [8usize, 24, 16, 13]);
        let rows: usize = sizes.iter().sum();
        let pool = Pool::new(2, 0);
        for dtype in TYPES {
            let (_, raw, _) = weights(dtype, rows, k, 5);
            let w = Packed::from_gguf(dtype, &raw, rows, k).unwrap();
            let x = values(m * k, 77);
            let mut a = QActs::default();
            a.prepare(&x, m, k, w.needs(), &pool);
            for imp in Impl::available() {
                let whole = bits(&ours(&w, &x, m, imp, &pool));
                let mut parts: Vec<Vec<f32>> = sizes.iter().map(|&r| vec![f32::NAN; m * r]).collect();
                let mut dsts: Vec<&mut [f32]> = parts.iter_mut().map(|p| p.as_mut_slice()).collect();
                matmul_parts(&w, &a, &mut dsts, imp, &pool).unwrap();
                let mut first = 0;
                for (p, &r) in parts.iter().zip(&sizes) {
                    for t in 0..m {
                        let want = &whole[t * rows + first..t * rows + first + r];
                        assert_eq!(bits(&p[t * r..(t + 1) * r]), want, "{dtype:?} {imp:?} token {t}");
                    }
                    first += r;
                }
            }
            // a part that ends inside a row group (not the last) is refused
            let mut odd: Vec<Vec<f32>> = [2usize, rows - 2].iter().map(|&r| vec![0f32; m * r]).collect();
            let mut dsts: Vec<&mut [f32]> = odd.iter_mut().map(|p| p.as_mut_slice()).collect();
            assert!(matmul_parts(&w, &a, &mut dsts, Impl::Scalar, &pool).is_err());
        }
    }

    #[test]
    fn q8k_activations_are_candles() {
        use candle_core::quantized::k_quants::{BlockQ8K, GgmlType};
        let k = 768;
        let mut x = values(k, 3);
        x[300] = 0.0;
        x[512..768].fill(0.0);
        let (mut q, mut d, mut bs) = (vec![0i8; k], vec![0f32; 3], vec![0i16; k / 16]);
        quantize_q8k(&x, &mut q, &mut d, &mut bs);
        let mut blocks = vec![BlockQ8K::zeros(); 3];
        BlockQ8K::from_float(&x, &mut blocks);
        let mut deq = vec![0f32; k];
        BlockQ8K::to_float(&blocks, &mut deq);
        for i in 0..k {
            assert_eq!((f32::from(q[i]) * d[i / QK_K]).to_bits(), deq[i].to_bits(), "value {i}");
        }
        for (j, s) in bs.iter().enumerate() {
            assert_eq!(i32::from(*s), q[16 * j..16 * j + 16].iter().map(|&v| i32::from(v)).sum::<i32>());
        }
        assert_eq!(d[2], 0.0);
    }

    #[test]
    fn shapes_the_blocks_do_not_divide_are_not_packed() {
        // 896 values per row (Qwen2.5-0.5B) is not a whole number of 256-value super-blocks
        assert!(PackedLanes::from_gguf_bytes(Kind::Q4K, &[0u8; 144 * 3], 1, 896).is_none());
        assert!(PackedLanes::from_gguf_bytes(Kind::Q5_0, &[0u8; 21], 1, 32).is_none());
        assert!(PackedFloat::from_gguf_bytes(FloatKind::F32, &[0u8; 4 * 12], 1, 12).is_none());
    }
}
