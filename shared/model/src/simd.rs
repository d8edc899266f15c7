//! Vectorised element-wise pieces of the forward pass, bit-identical to their scalar forms.
//!
//! The scalar code in `attention.rs`, `executor.rs` and `kernels.rs` defines the arithmetic
//! (and through it, equality with the candle reference). Each function here performs exactly
//! the same IEEE operations in the same order per element, only several elements at a time:
//!
//! - [`exp_in_place`]: glibc's `expf` (the FMA variant x86-64 dispatches to, which `f32::exp`
//!   calls) on 4 doubles per vector: the same table, shift and polynomial, lane by lane. Lanes
//!   with `|x| ≥ 88`, infinities or NaN go to `f32::exp` itself;
//! - [`attend_head`]: `q·k` as one FMA per 8 elements into 8 lanes, reduced like candle's
//!   `hsum_float_8`; `Σ p·v` as one FMA chain per output element in position order (over two
//!   positions, unfused `p1·v1 + p0·v0`, as gemm's `gevv`);
//! - [`quantize_block`]: candle's Q8_1 rounding (`round` half away from zero) on 8 lanes.
//!
//! Every entry point checks for AVX2+FMA at run time and otherwise runs the scalar form.

#![allow(unsafe_code)]

use crate::kernels::Impl;

/// Whether the AVX2+FMA paths may run: whenever the matmuls run vectorised, i.e. the same
/// detection and the same `PDMESH_MODEL_KERNELS=scalar` switch ([`Impl::detect`]).
pub(crate) fn avx2() -> bool {
    use std::sync::OnceLock;
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| Impl::detect() != Impl::Scalar)
}

/// Whether the matmuls run their AVX-512 kernels (so AVX-512 F/VL are there): the attention
/// tiles then compile with 32 vector registers instead of 16 (the same instructions' results).
#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    use std::sync::OnceLock;
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| Impl::detect() == Impl::Avx512)
}

/// `x[i] = x[i].exp()` for every element, bit for bit.
pub(crate) fn exp_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 and FMA were detected.
        unsafe { x86::exp_in_place(x) };
        return;
    }
    for v in x {
        *v = v.exp();
    }
}

/// `gate[i] = silu(gate[i]) · up[i]` with `silu(x) = x / (1 + e^-x)`, bit for bit.
pub(crate) fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let mut e = [0f32; 256];
    for (g, u) in gate.chunks_mut(256).zip(up.chunks(256)) {
        let e = &mut e[..g.len()];
        for (ev, gv) in e.iter_mut().zip(g.iter()) {
            *ev = -gv;
        }
        exp_in_place(e);
        for ((gv, uv), ev) in g.iter_mut().zip(u).zip(e.iter()) {
            *gv = *gv / (1.0 + ev) * uv;
        }
    }
}

/// Quantize one block of 32 activations like candle's `BlockQ8_1::from_float`: returns
/// `(amax / 127, Σq)` and writes `q = round(x · 127/amax)` (half away from zero).
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if avx2() && x.len() == 32 && q.len() == 32 {
        // SAFETY: AVX2 and FMA were detected; both slices hold 32 elements.
        return unsafe { x86::quantize_block(x, q) };
    }
    quantize_block_scalar(x, q)
}

/// One Q8_K block of 256 activations, bit for bit as
/// [`crate::kquants::quantize_q8k_block_scalar`]: writes `q` and the sums of each 16, returns
/// `d`. `None` (and nothing written that the scalar form would not overwrite) where the
/// vectorised form does not apply: no AVX2, or a block with a NaN, an infinite or all-zero
/// magnitude, or a scale `−127/max` that overflows. Why: the scalar form's first-maximum scan
/// and per-value rounding were 4 % of a Qwen2.5-1.5B prefill.
pub(crate) fn quantize_q8k_block(x: &[f32], q: &mut [i8], bsums: &mut [i16]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    if avx2() && x.len() == 256 && q.len() == 256 && bsums.len() == 16 {
        // SAFETY: AVX2 and FMA were detected; the slices hold 256, 256 and 16 elements.
        return unsafe { x86::quantize_q8k_block(x, q, bsums) };
    }
    let _ = (x, q, bsums);
    None
}

pub(crate) fn quantize_block_scalar(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for (qv, &v) in q.iter_mut().zip(x) {
        let r = round_half_away(v * inv) as i8;
        *qv = r;
        sum += i32::from(r);
    }
    (scale, sum)
}

/// `x.round()` (half away from zero, as candle uses) without the libm call: truncate, then
/// step away from zero when the dropped fraction is ≥ 0.5. Exact for every finite f32 (the
/// subtraction of the truncated part is exact).
#[inline]
pub(crate) fn round_half_away(x: f32) -> f32 {
    let t = x.trunc();
    if (x - t).abs() >= 0.5 {
        t + 1f32.copysign(x)
    } else {
        t
    }
}

/// Attention of one query head over positions `0..scores.len()`, when the vectorised path
/// applies (`hd` 64 or 128 and AVX2); returns `false` (and does nothing) otherwise.
pub(crate) fn attend_head<F: Fn(usize) -> usize>(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    key_off: &F,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if avx2() && q.len() == out.len() {
        // SAFETY (both arms): AVX2 and FMA were detected; q and out hold 8·NC values; cache
        // reads go through bounds-checked slices.
        match q.len() {
            64 => unsafe { x86::attend_head::<8, F>(q, k_cache, v_cache, key_off, scale, scores, out) },
            128 => unsafe { x86::attend_head::<16, F>(q, k_cache, v_cache, key_off, scale, scores, out) },
            _ => return false,
        }
        return true;
    }
    let _ = (q, k_cache, v_cache, key_off, scale, scores, out);
    false
}

/// Attention of the query heads of one KV group for one token (`q`, `out`: the heads' vectors
/// one after another; `scores`: one row of `n` positions per head), over positions `0..n` at
/// `offs` (the K/V offset of each position), when the vectorised path applies (`hd` 64 or 128
/// and AVX2); returns `false` (and does nothing) otherwise.
///
/// Every (head, position) score and every output element is computed by exactly the operations
/// of [`attend_head`] in the same order; what changes is that each key and value vector, loaded
/// once, serves up to three heads (a register tile of 3 heads × 4 keys for `q·k`, 3 heads × 32
/// output elements for `Σ p·v`), where `attend_head` read every vector once per head.
pub(crate) fn attend_group(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    offs: &[usize],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if avx2() && q.len() == out.len() && !offs.is_empty() {
        let heads = scores.len() / offs.len();
        let ok = |hd: usize| q.len() == heads * hd && scores.len() == heads * offs.len();
        // SAFETY (both arms): AVX2 and FMA were detected; q, out and scores hold `heads` rows
        // (checked); cache reads go through bounds-checked slices.
        // (AVX-512 F/VL as well in the `_512` arms)
        match (q.len() / heads.max(1), avx512()) {
            (64, false) if ok(64) => unsafe { x86::attend_group::<8>(q, k_cache, v_cache, offs, scale, scores, out) },
            (128, false) if ok(128) => unsafe {
                x86::attend_group::<16>(q, k_cache, v_cache, offs, scale, scores, out)
            },
            (64, true) if ok(64) => unsafe {
                x86::attend_group_512::<8>(q, k_cache, v_cache, offs, scale, scores, out)
            },
            (128, true) if ok(128) => unsafe {
                x86::attend_group_512::<16>(q, k_cache, v_cache, offs, scale, scores, out)
            },
            _ => return false,
        }
        return true;
    }
    let _ = (q, k_cache, v_cache, offs, scale, scores, out);
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// glibc's `__exp2f_data.tab`: `2^(i/32)` with the `i << 47` exponent bias pre-subtracted.
    const EXP2F_TAB: [u64; 32] = [
        0x3ff0000000000000,
        0x3fefd9b0d3158574,
        0x3fefb5586cf9890f,
        0x3fef9301d0125b51,
        0x3fef72b83c7d517b,
        0x3fef54873168b9aa,
        0x3fef387a6e756238,
        0x3fef1e9df51fdee1,
        0x3fef06fe0a31b715,
        0x3feef1a7373aa9cb,
        0x3feedea64c123422,
        0x3feece086061892d,
        0x3feebfdad5362a27,
        0x3feeb42b569d4f82,
        0x3feeab07dd485429,
        0x3feea47eb03a5585,
        0x3feea09e667f3bcd,
        0x3fee9f75e8ec5f74,
        0x3feea11473eb0187,
        0x3feea589994cce13,
        0x3feeace5422aa0db,
        0x3feeb737b0cdc5e5,
        0x3feec49182a3f090,
        0x3feed503b23e255d,
        0x3feee89f995ad3ad,
        0x3feeff76f2fb5e47,
        0x3fef199bdd85529c,
        0x3fef3720dcef9069,
        0x3fef5818dcfba487,
        0x3fef7c97337b9b5f,
        0x3fefa4afa2a490da,
        0x3fefd0765b6e4540,
    ];
    /// 32 / ln 2 (`0x1.71547652b82fep+0 · 32`).
    const INV_LN2_N: u64 = 0x40471547652b82fe;
    /// `0x1.8p+52`: adding it rounds to an integer held in the low mantissa bits.
    const SHIFT: u64 = 0x4338000000000000;
    /// The polynomial `C[0..3]` of glibc's `exp2f_data.poly_scaled` (`0x1.c6af84b912394p-5/32³`,
    /// `0x1.ebfce50fac4f3p-3/32²`, `0x1.62e42ff0c52d6p-1/32`).
    const C0: u64 = 0x3ebc6af84b912394;
    const C1: u64 = 0x3f2ebfce50fac4f3;
    const C2: u64 = 0x3f962e42ff0c52d6;
    /// `top12(88.0)`: from here on glibc leaves the common path.
    const ABSTOP_SPECIAL: i32 = 0x42b;

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn exp4(xd: __m256d) -> __m256d {
        let z = _mm256_mul_pd(_mm256_set1_pd(f64::from_bits(INV_LN2_N)), xd);
        let shift = _mm256_set1_pd(f64::from_bits(SHIFT));
        let kd = _mm256_add_pd(z, shift);
        let ki = _mm256_castpd_si256(kd);
        let kd = _mm256_sub_pd(kd, shift);
        let r = _mm256_sub_pd(z, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY: idx ∈ 0..32 indexes the 32-entry table.
        let tab = unsafe { _mm256_i64gather_epi64::<8>(EXP2F_TAB.as_ptr() as *const i64, idx) };
        let s = _mm256_castsi256_pd(_mm256_add_epi64(tab, _mm256_slli_epi64::<47>(ki)));
        let zz = _mm256_fmadd_pd(_mm256_set1_pd(f64::from_bits(C0)), r, _mm256_set1_pd(f64::from_bits(C1)));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(_mm256_set1_pd(f64::from_bits(C2)), r, _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(zz, r2, y);
        _mm256_mul_pd(y, s)
    }

    /// `expf` of 8 lanes on the common path (every lane `|x| < 88`).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn exp8(x: __m256) -> __m256 {
        let lo = _mm256_cvtpd_ps(exp4(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
        let hi = _mm256_cvtpd_ps(exp4(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x))));
        _mm256_set_m128(hi, lo)
    }

    /// Lanes that leave glibc's common path (`|x| ≥ 88`, ±inf, NaN), as a bit mask.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn special_lanes(x: __m256) -> i32 {
        let top = _mm256_and_si256(_mm256_srli_epi32::<20>(_mm256_castps_si256(x)), _mm256_set1_epi32(0x7ff));
        let special = _mm256_cmpgt_epi32(top, _mm256_set1_epi32(ABSTOP_SPECIAL - 1));
        _mm256_movemask_ps(_mm256_castsi256_ps(special))
    }

    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_in_place(x: &mut [f32]) {
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: `c` holds exactly 8 f32.
            unsafe {
                let v = _mm256_loadu_ps(c.as_ptr());
                let special = special_lanes(v);
                _mm256_storeu_ps(c.as_mut_ptr(), exp8(v));
                if special != 0 {
                    let mut orig = [0f32; 8];
                    _mm256_storeu_ps(orig.as_mut_ptr(), v);
                    for (i, (o, &xv)) in c.iter_mut().zip(&orig).enumerate() {
                        if special & (1 << i) != 0 {
                            *o = xv.exp();
                        }
                    }
                }
            }
        }
        for v in chunks.into_remainder() {
            *v = v.exp();
        }
    }

    /// candle's `hsum_float_8`: `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(x: __m256) -> f32 {
        let res = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
        let res = _mm_add_ps(res, _mm_movehl_ps(res, res));
        let res = _mm_add_ss(res, _mm_movehdup_ps(res));
        _mm_cvtss_f32(res)
    }

    /// `scores[j] = (q·k_j) · scale`, softmax, `out = Σ_j p_j · v_j`, for `hd = 8·NC`.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `q` and `out` must hold `8·NC` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend_head<const NC: usize, F: Fn(usize) -> usize>(
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        key_off: &F,
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = 8 * NC;
        let mut qv = [_mm256_setzero_ps(); NC];
        for (c, v) in qv.iter_mut().enumerate() {
            // SAFETY: q holds 8·NC values.
            *v = unsafe { _mm256_loadu_ps(q.as_ptr().add(8 * c)) };
        }
        // q·k for four positions at a time: four independent FMA chains.
        let n = scores.len();
        let mut j = 0;
        while j + 4 <= n {
            let ks = [
                &k_cache[key_off(j)..][..hd],
                &k_cache[key_off(j + 1)..][..hd],
                &k_cache[key_off(j + 2)..][..hd],
                &k_cache[key_off(j + 3)..][..hd],
            ];
            let mut l = [_mm256_setzero_ps(); 4];
            for (c, qc) in qv.iter().enumerate() {
                for (lp, kp) in l.iter_mut().zip(&ks) {
                    // SAFETY: every `kp` holds hd = 8·NC values.
                    *lp = _mm256_fmadd_ps(*qc, unsafe { _mm256_loadu_ps(kp.as_ptr().add(8 * c)) }, *lp);
                }
            }
            for (p, lp) in l.iter().enumerate() {
                scores[j + p] = hsum(*lp) * scale;
            }
            j += 4;
        }
        for (jj, s) in scores.iter_mut().enumerate().skip(j) {
            let kp = &k_cache[key_off(jj)..][..hd];
            let mut l = _mm256_setzero_ps();
            for (c, qc) in qv.iter().enumerate() {
                // SAFETY: kp holds hd values.
                l = _mm256_fmadd_ps(*qc, unsafe { _mm256_loadu_ps(kp.as_ptr().add(8 * c)) }, l);
            }
            *s = hsum(l) * scale;
        }
        super::super::attention::softmax(scores);
        let mut acc = [_mm256_setzero_ps(); NC];
        if let [p0, p1] = *scores {
            // two positions: `p1·v1 + p0·v0`, unfused (gemm's `gevv`, see `attention`)
            let (v0, v1) = (&v_cache[key_off(0)..][..hd], &v_cache[key_off(1)..][..hd]);
            let (p0, p1) = (_mm256_set1_ps(p0), _mm256_set1_ps(p1));
            for (c, a) in acc.iter_mut().enumerate() {
                // SAFETY: v0 and v1 hold hd values.
                let (x0, x1) =
                    unsafe { (_mm256_loadu_ps(v0.as_ptr().add(8 * c)), _mm256_loadu_ps(v1.as_ptr().add(8 * c))) };
                *a = _mm256_add_ps(_mm256_mul_ps(p1, x1), _mm256_mul_ps(p0, x0));
            }
        } else {
            for (jj, &p) in scores.iter().enumerate() {
                let vp = &v_cache[key_off(jj)..][..hd];
                let pv = _mm256_set1_ps(p);
                for (c, a) in acc.iter_mut().enumerate() {
                    // SAFETY: vp holds hd values.
                    *a = _mm256_fmadd_ps(pv, unsafe { _mm256_loadu_ps(vp.as_ptr().add(8 * c)) }, *a);
                }
            }
        }
        for (c, a) in acc.iter().enumerate() {
            // SAFETY: out holds 8·NC values.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), *a) };
        }
    }

    /// `round_half_away` on 8 lanes (as [`quantize_block`] rounds), then `cvtt` to i32.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn round_away_epi32(y: __m256, lo: __m256, hi: __m256) -> __m256i {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        let frac = _mm256_and_ps(_mm256_sub_ps(y, t), abs_mask);
        let away = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
        let step = _mm256_or_ps(_mm256_and_ps(y, sign_mask), _mm256_set1_ps(1.0));
        let r = _mm256_add_ps(t, _mm256_and_ps(away, step));
        // `clamp(lo, hi)`: r is never NaN here (finite inputs, finite scale)
        _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
    }

    /// # Safety
    /// AVX2 and FMA must be available; `x` and `q` must hold 256 elements, `bsums` 16.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_q8k_block(x: &[f32], q: &mut [i8], bsums: &mut [i16]) -> Option<f32> {
        // SAFETY: the slices hold 256, 256 and 16 elements (caller); every offset below is
        // within them.
        unsafe {
            let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            let mut m = _mm256_setzero_ps();
            let mut nan = _mm256_setzero_ps();
            for c in 0..32 {
                let v = _mm256_loadu_ps(x.as_ptr().add(8 * c));
                m = _mm256_max_ps(m, _mm256_and_ps(v, abs_mask));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            }
            if _mm256_movemask_ps(nan) != 0 {
                return None;
            }
            // the largest magnitude (max is exact in any order without NaN)
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
            if amax == 0.0 || !amax.is_finite() {
                return None;
            }
            // the scalar scan keeps the first value whose magnitude is the largest
            let target = _mm256_set1_ps(amax);
            let mut max = amax;
            for c in 0..32 {
                let v = _mm256_loadu_ps(x.as_ptr().add(8 * c));
                let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_and_ps(v, abs_mask), target));
                if hit != 0 {
                    max = x[8 * c + hit.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127f32 / max;
            if !iscale.is_finite() {
                return None;
            }
            let (sv, lo, hi) = (_mm256_set1_ps(iscale), _mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            for j in 0..8 {
                // 32 values: two sums of 16 and one 32-byte store
                let mut ints = [_mm256_setzero_si256(); 4];
                for (i, iv) in ints.iter_mut().enumerate() {
                    let v = _mm256_loadu_ps(x.as_ptr().add(32 * j + 8 * i));
                    *iv = round_away_epi32(_mm256_mul_ps(sv, v), lo, hi);
                }
                for h in 0..2 {
                    let s8 = _mm256_add_epi32(ints[2 * h], ints[2 * h + 1]);
                    let s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256::<1>(s8));
                    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
                    let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2));
                    bsums[2 * j + h] = _mm_cvtsi128_si32(s1) as i16;
                }
                let packed =
                    _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
                let ordered = _mm256_permutevar8x32_epi32(packed, order);
                _mm256_storeu_si256(q.as_mut_ptr().add(32 * j) as *mut __m256i, ordered);
            }
            Some(1.0 / iscale)
        }
    }

    /// See [`super::attend_group`].
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `q` and `out` hold `heads · 8·NC` values and `scores`
    /// `heads · offs.len()`, with `heads ≥ 1`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend_group<const NC: usize>(
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        offs: &[usize],
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        // SAFETY: forwarded.
        unsafe { attend_group_body::<NC>(q, k_cache, v_cache, offs, scale, scores, out) }
    }

    /// [`attend_group`] compiled with AVX-512 F/VL as well: the same AVX2/FMA operations, but
    /// 32 vector registers hold the 3 × 4 tiles' accumulators, which spilled with 16.
    ///
    /// # Safety
    /// As [`attend_group`], and AVX-512 F/VL must be available.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    pub(super) unsafe fn attend_group_512<const NC: usize>(
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        offs: &[usize],
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        // SAFETY: forwarded.
        unsafe { attend_group_body::<NC>(q, k_cache, v_cache, offs, scale, scores, out) }
    }

    /// The body of [`attend_group`] and [`attend_group_512`], inlined into each (so it compiles
    /// with its caller's features).
    ///
    /// # Safety
    /// As [`attend_group`].
    #[inline(always)]
    unsafe fn attend_group_body<const NC: usize>(
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        offs: &[usize],
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = 8 * NC;
        let n = offs.len();
        let heads = q.len() / hd;
        let mut h0 = 0;
        while h0 < heads {
            let r = (heads - h0).min(3);
            let (qr, sr) = (&q[h0 * hd..(h0 + r) * hd], &mut scores[h0 * n..(h0 + r) * n]);
            // SAFETY (every arm): AVX2 and FMA (caller); qr holds r·hd values, sr r·n.
            unsafe {
                match r {
                    3 => group_scores::<NC, 3>(qr, k_cache, offs, scale, sr),
                    2 => group_scores::<NC, 2>(qr, k_cache, offs, scale, sr),
                    _ => group_scores::<NC, 1>(qr, k_cache, offs, scale, sr),
                }
            }
            for row in sr.chunks_exact_mut(n) {
                super::super::attention::softmax(row);
            }
            let or = &mut out[h0 * hd..(h0 + r) * hd];
            // SAFETY: as above; or holds r·hd values.
            unsafe {
                match r {
                    3 => group_values::<NC, 3>(sr, v_cache, offs, or),
                    2 => group_values::<NC, 2>(sr, v_cache, offs, or),
                    _ => group_values::<NC, 1>(sr, v_cache, offs, or),
                }
            }
            h0 += r;
        }
    }

    /// `scores[r·n + j] = (q_r·k_j) · scale` for `R` heads: per (head, key) one 8-lane FMA chain
    /// over the head dimension reduced by [`hsum`], as in [`attend_head`], for 4 keys × `R`
    /// heads at a time (each key chunk loaded once for the `R` heads).
    ///
    /// # Safety
    /// AVX2 and FMA; `q` holds `R · 8·NC` values and `scores` `R · offs.len()`.
    #[inline(always)]
    unsafe fn group_scores<const NC: usize, const R: usize>(
        q: &[f32],
        k_cache: &[f32],
        offs: &[usize],
        scale: f32,
        scores: &mut [f32],
    ) {
        let hd = 8 * NC;
        let n = offs.len();
        let qp = q.as_ptr();
        let mut j = 0;
        while j + 4 <= n {
            let ks = [
                k_cache[offs[j]..][..hd].as_ptr(),
                k_cache[offs[j + 1]..][..hd].as_ptr(),
                k_cache[offs[j + 2]..][..hd].as_ptr(),
                k_cache[offs[j + 3]..][..hd].as_ptr(),
            ];
            let mut l = [[_mm256_setzero_ps(); 4]; R];
            for c in 0..NC {
                // SAFETY: every key holds hd = 8·NC values, q R·hd.
                unsafe {
                    let kv = [
                        _mm256_loadu_ps(ks[0].add(8 * c)),
                        _mm256_loadu_ps(ks[1].add(8 * c)),
                        _mm256_loadu_ps(ks[2].add(8 * c)),
                        _mm256_loadu_ps(ks[3].add(8 * c)),
                    ];
                    for (r, lr) in l.iter_mut().enumerate() {
                        let qc = _mm256_loadu_ps(qp.add(r * hd + 8 * c));
                        for (lp, kc) in lr.iter_mut().zip(&kv) {
                            *lp = _mm256_fmadd_ps(qc, *kc, *lp);
                        }
                    }
                }
            }
            for (r, lr) in l.iter().enumerate() {
                for (p, lp) in lr.iter().enumerate() {
                    scores[r * n + j + p] = hsum(*lp) * scale;
                }
            }
            j += 4;
        }
        for jj in j..n {
            let kp = k_cache[offs[jj]..][..hd].as_ptr();
            let mut l = [_mm256_setzero_ps(); R];
            for c in 0..NC {
                // SAFETY: as above.
                unsafe {
                    let kc = _mm256_loadu_ps(kp.add(8 * c));
                    for (r, lr) in l.iter_mut().enumerate() {
                        *lr = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(r * hd + 8 * c)), kc, *lr);
                    }
                }
            }
            for (r, lr) in l.iter().enumerate() {
                scores[r * n + jj] = hsum(*lr) * scale;
            }
        }
    }

    /// `out_r = Σ_j p_rj · v_j` for `R` heads as in [`attend_head`] (one FMA chain per output
    /// element in position order; over exactly two positions the unfused `p1·v1 + p0·v0`), 32
    /// output elements × `R` heads at a time (each value chunk loaded once for the `R` heads).
    ///
    /// # Safety
    /// AVX2 and FMA; `p` holds `R · offs.len()` probabilities and `out` `R · 8·NC` values,
    /// `NC` a multiple of 4.
    #[inline(always)]
    unsafe fn group_values<const NC: usize, const R: usize>(
        p: &[f32],
        v_cache: &[f32],
        offs: &[usize],
        out: &mut [f32],
    ) {
        let hd = 8 * NC;
        let n = offs.len();
        let op = out.as_mut_ptr();
        if n == 2 {
            // two positions: gemm's `gevv` (see `attention`)
            let (v0, v1) = (v_cache[offs[0]..][..hd].as_ptr(), v_cache[offs[1]..][..hd].as_ptr());
            for r in 0..R {
                let (p0, p1) = (_mm256_set1_ps(p[r * n]), _mm256_set1_ps(p[r * n + 1]));
                for c in 0..NC {
                    // SAFETY: v0 and v1 hold hd values, out R·hd.
                    unsafe {
                        let (x0, x1) = (_mm256_loadu_ps(v0.add(8 * c)), _mm256_loadu_ps(v1.add(8 * c)));
                        let y = _mm256_add_ps(_mm256_mul_ps(p1, x1), _mm256_mul_ps(p0, x0));
                        _mm256_storeu_ps(op.add(r * hd + 8 * c), y);
                    }
                }
            }
            return;
        }
        for c0 in (0..NC).step_by(4) {
            let mut acc = [[_mm256_setzero_ps(); 4]; R];
            for (j, &off) in offs.iter().enumerate() {
                let vp = v_cache[off..][..hd].as_ptr();
                // SAFETY: vp holds hd values and c0 + 3 < NC.
                let vv = unsafe {
                    [
                        _mm256_loadu_ps(vp.add(8 * c0)),
                        _mm256_loadu_ps(vp.add(8 * c0 + 8)),
                        _mm256_loadu_ps(vp.add(8 * c0 + 16)),
                        _mm256_loadu_ps(vp.add(8 * c0 + 24)),
                    ]
                };
                for (r, ar) in acc.iter_mut().enumerate() {
                    let pv = _mm256_set1_ps(p[r * n + j]);
                    for (a, x) in ar.iter_mut().zip(&vv) {
                        *a = _mm256_fmadd_ps(pv, *x, *a);
                    }
                }
            }
            for (r, ar) in acc.iter().enumerate() {
                for (i, a) in ar.iter().enumerate() {
                    // SAFETY: out holds R·hd values.
                    unsafe { _mm256_storeu_ps(op.add(r * hd + 8 * (c0 + i)), *a) };
                }
            }
        }
    }

    /// # Safety
    /// AVX2 and FMA must be available; `x` and `q` must hold 32 elements.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
        // SAFETY: both slices hold 32 elements (caller).
        unsafe {
            let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            let v = [
                _mm256_loadu_ps(x.as_ptr()),
                _mm256_loadu_ps(x.as_ptr().add(8)),
                _mm256_loadu_ps(x.as_ptr().add(16)),
                _mm256_loadu_ps(x.as_ptr().add(24)),
            ];
            // max is exact: any order gives the scalar fold's value for finite inputs
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)),
            );
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
            let scale = amax / 127.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            let nan = _mm256_or_ps(
                _mm256_or_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v[0], v[0]), _mm256_cmp_ps::<_CMP_UNORD_Q>(v[1], v[1])),
                _mm256_or_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v[2], v[2]), _mm256_cmp_ps::<_CMP_UNORD_Q>(v[3], v[3])),
            );
            if _mm256_movemask_ps(nan) != 0 || !amax.is_finite() || !inv.is_finite() {
                // NaN, infinite or vanishing blocks: the scalar form's saturating casts decide
                return super::quantize_block_scalar(x, q);
            }
            let inv = _mm256_set1_ps(inv);
            let half = _mm256_set1_ps(0.5);
            let one = _mm256_set1_ps(1.0);
            let sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
            let mut ints = [_mm256_setzero_si256(); 4];
            for (iv, xv) in ints.iter_mut().zip(&v) {
                let y = _mm256_mul_ps(*xv, inv);
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                let frac = _mm256_and_ps(_mm256_sub_ps(y, t), abs_mask);
                let away = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, half);
                let step = _mm256_or_ps(_mm256_and_ps(y, sign_mask), one);
                let r = _mm256_add_ps(t, _mm256_and_ps(away, step));
                *iv = _mm256_cvttps_epi32(r);
            }
            let sum8 = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
            let mut lanes = [0i32; 8];
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, sum8);
            let packed = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
            let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, ordered);
            (scale, lanes.iter().sum())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_bit_identical_to_libm() {
        // a sweep over the whole f32 range (every 4099th pattern: normals, subnormals, ±inf,
        // NaNs) and a dense sweep of the range softmax and SiLU use
        let mut xs: Vec<f32> = (0..=u32::MAX / 4099).map(|i| f32::from_bits(i * 4099)).collect();
        xs.extend((0..2_000_000).map(|i| -110.0 + i as f32 * 1.1e-4));
        let mut got = xs.clone();
        exp_in_place(&mut got);
        for (x, g) in xs.iter().zip(&got) {
            let want = x.exp();
            assert!(
                want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan()),
                "exp({x:e}) = {want:e}, vectorised {g:e}"
            );
        }
    }

    #[test]
    fn quantize_block_is_bit_identical_to_scalar() {
        let mut seed = 0x9e37_79b9_u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for case in 0..20_000 {
            let x: Vec<f32> = (0..32)
                .map(|i| match case % 4 {
                    // exact halves after scaling (ties), zeros, tiny and huge values
                    0 => (next() % 255) as f32 - 127.0 + if i % 2 == 0 { 0.5 } else { 0.0 },
                    1 => 0.0,
                    2 => (next() as i32 as f32) * 1e-12,
                    3 if case % 8 == 3 => {
                        [f32::NAN, f32::INFINITY, -f32::INFINITY, 1e-44, -3e-45, 0.0, 1.0, -2.5][(next() % 8) as usize]
                    }
                    _ => f32::from_bits(next() & 0x3fff_ffff) * if next() % 2 == 0 { 1.0 } else { -1.0 },
                })
                .collect();
            let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
            let ra = quantize_block(&x, &mut a);
            let rb = quantize_block_scalar(&x, &mut b);
            assert_eq!((ra.0.to_bits(), ra.1, a), (rb.0.to_bits(), rb.1, b), "case {case}: {x:?}");
        }
    }

    #[test]
    fn quantize_q8k_block_is_bit_identical_to_scalar() {
        let mut seed = 0x1234_5678_u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for case in 0..6_000 {
            let mut x: Vec<f32> = (0..256)
                .map(|_| match case % 5 {
                    // ties after scaling, equal magnitudes of both signs, tiny and huge values
                    0 => ((next() % 255) as f32 - 127.0) * 0.5,
                    1 => [1.0, -1.0, 0.5, -0.5, 0.0][(next() % 5) as usize],
                    2 => (next() as i32 as f32) * 1e-40,
                    3 => f32::from_bits(next()),
                    _ => (next() as i32 as f32) * 1e-9,
                })
                .collect();
            if case % 7 == 0 {
                x.fill(0.0);
                x[(next() % 256) as usize] = [f32::NAN, f32::INFINITY, -3e-45, 1e-38, -0.0][(next() % 5) as usize];
            }
            let (mut qa, mut qb) = ([0i8; 256], [0i8; 256]);
            let (mut sa, mut sb) = ([0i16; 16], [0i16; 16]);
            let mut db = 0f32;
            crate::kquants::quantize_q8k_block_scalar(&x, &mut qb, &mut db, &mut sb);
            match quantize_q8k_block(&x, &mut qa, &mut sa) {
                Some(da) => assert_eq!((da.to_bits(), qa, sa), (db.to_bits(), qb, sb), "case {case}: {x:?}"),
                None => {
                    // declined only without AVX2, or for NaN, infinite, all-zero or
                    // scale-overflowing blocks
                    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                    assert!(
                        !avx2() || x.iter().any(|v| !v.is_finite()) || amax == 0.0 || !(127.0 / amax).is_finite(),
                        "case {case} declined: {x:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn silu_mul_matches_the_scalar_formula() {
        let gate: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let up: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.11).sin()).collect();
        let mut got = gate.clone();
        silu_mul(&mut got, &up);
        for ((g, x), u) in got.iter().zip(&gate).zip(&up) {
            assert_eq!(g.to_bits(), (x / (1.0 + (-x).exp()) * u).to_bits(), "{x}");
        }
    }
}
