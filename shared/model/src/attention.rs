//! Causal attention of one query token over its request's paged K/V, in a fixed arithmetic
//! order.
//!
//! The order of every floating-point operation is fixed per (query, key) pair and per
//! position, independent of how many tokens a step carries or how a prefill is chunked:
//! that is what makes our tokens batch- and chunk-invariant. The particular order is the one
//! candle (the reference the tests compare with) uses when it runs one token at a time:
//!
//! - `q·k`: eight FMA lanes over the head dimension (element `i` into lane `i % 8`), reduced
//!   as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))` (gemm's horizontal f32 kernel);
//! - softmax: max, `exp(x - max)`, a sum over 32 lanes (`i % 32`) reduced like candle's AVX
//!   `vec_sum`, then a division;
//! - `Σ_j p_j · v_j`: one FMA chain per output element, in position order (gemm's gemv);
//!   except over exactly two positions, where gemm takes its `gevv` path (`k <= 2`), whose
//!   products and sum are unfused: `p_1·v_1 + p_0·v_0`, each product rounded. (One position
//!   is `p_0·v_0` either way.) The 1-ulp differences an FMA there leaves in position 1's
//!   attention output are absorbed by Q8_0's activation quantization (Qwen2.5-0.5B) but not
//!   always by Q8_K's (Qwen2.5-1.5B's Q4_K `attn_output`), and then reach every later token
//!   through position 1's K/V.
//!
//! With the same weights arithmetic, this makes our logits bit-identical to candle-transformers'
//! `quantized_llama` fed one token per step (for contexts up to 256 tokens, beyond which gemm
//! switches kernels).

/// `q·k` in gemm's horizontal-kernel order (see the module doc).
#[inline]
pub(crate) fn dot(q: &[f32], k: &[f32]) -> f32 {
    let mut l = [0f32; 8];
    let cq = q.chunks_exact(8);
    let ck = k.chunks_exact(8);
    let (rq, rk) = (cq.remainder(), ck.remainder());
    for (a, b) in cq.zip(ck) {
        for i in 0..8 {
            l[i] = a[i].mul_add(b[i], l[i]);
        }
    }
    let h = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let mut s = (h[0] + h[2]) + (h[1] + h[3]);
    for (a, b) in rq.iter().zip(rk) {
        s = a.mul_add(*b, s);
    }
    s
}

/// Sum in the order of candle's AVX `vec_sum`: 32 lanes, reduced pairwise, then the tail.
#[inline]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    let chunks = x.chunks_exact(32);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..32 {
            acc[i] += c[i];
        }
    }
    // four 8-lane registers x0..x3: x0 += x1, x2 += x3, x0 += x2
    let mut r = [0f32; 8];
    for i in 0..8 {
        r[i] = (acc[i] + acc[8 + i]) + (acc[16 + i] + acc[24 + i]);
    }
    // 256 → 128 bits, then two horizontal adds
    let t0 = [r[0] + r[4], r[1] + r[5], r[2] + r[6], r[3] + r[7]];
    let mut s = (t0[0] + t0[1]) + (t0[2] + t0[3]);
    for v in tail {
        s += v;
    }
    s
}

/// In-place softmax as candle's `softmax_last_dim`.
pub(crate) fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v -= max;
    }
    crate::simd::exp_in_place(x);
    let s = sum(x);
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// Run `f` with a thread-local scratch slice of `len` scores (the pool's threads live as long
/// as the executor, so this allocates once per thread, not per head).
pub(crate) fn with_scores<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    use std::cell::RefCell;
    thread_local! {
        static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    SCORES.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < len {
                v.resize(len, 0.0);
            }
            f(&mut v[..len])
        }
        // re-entered on this thread (cannot happen with our pool): use a fresh buffer
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// Run `f` with thread-local scratch: `scores` of `len` values and `offs` of `positions`
/// offsets (as [`with_scores`]).
pub(crate) fn with_group_scratch<R>(len: usize, positions: usize, f: impl FnOnce(&mut [f32], &mut [usize]) -> R) -> R {
    use std::cell::RefCell;
    thread_local! {
        static OFFS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    }
    OFFS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < positions {
                v.resize(positions, 0);
            }
            with_scores(len, |scores| f(scores, &mut v[..positions]))
        }
        Err(_) => with_scores(len, |scores| f(scores, &mut vec![0; positions])),
    })
}

/// Attention output of the query heads of one KV group for one token: `q` and `out` hold the
/// heads' vectors one after another, `offs[j]` is the offset of position `j`'s K (and V)
/// vector, `scores` is scratch (`heads · offs.len()`). Each head's result is exactly
/// [`attend_head`]'s; the vectorised form only loads each key and value once for several heads.
pub(crate) fn attend_group(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    offs: &[usize],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    if crate::simd::attend_group(q, k_cache, v_cache, offs, scale, scores, out) {
        return;
    }
    let n = offs.len();
    let hd = q.len() / (scores.len() / n.max(1)).max(1);
    for ((qh, oh), sh) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).zip(scores.chunks_exact_mut(n.max(1))) {
        attend_head(qh, k_cache, v_cache, |j| offs[j], scale, sh, oh);
    }
}

/// Attention output of one query head.
///
/// `key_off(j)` gives the offset of position `j`'s K (and V) vector for this head's KV head
/// inside `k_cache`/`v_cache`; positions `0..scores.len()` are attended. `scores` is scratch.
pub(crate) fn attend_head(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    key_off: impl Fn(usize) -> usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    if crate::simd::attend_head(q, k_cache, v_cache, &key_off, scale, scores, out) {
        return;
    }
    let hd = q.len();
    for (j, s) in scores.iter_mut().enumerate() {
        let off = key_off(j);
        *s = dot(q, &k_cache[off..off + hd]) * scale;
    }
    softmax(scores);
    if let [p0, p1] = *scores {
        // two positions: gemm's `gevv` (see the module doc)
        let (v0, v1) = (&v_cache[key_off(0)..][..hd], &v_cache[key_off(1)..][..hd]);
        for ((o, &x0), &x1) in out.iter_mut().zip(v0).zip(v1) {
            *o = p1 * x1 + p0 * x0;
        }
        return;
    }
    out.fill(0.0);
    for (j, &p) in scores.iter().enumerate() {
        let off = key_off(j);
        for (o, &v) in out.iter_mut().zip(&v_cache[off..off + hd]) {
            *o = p.mul_add(v, *o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_matches_naive_within_rounding() {
        let x: Vec<f32> = (0..77).map(|i| (i as f32 * 0.37).sin()).collect();
        let naive: f64 = x.iter().map(|&v| f64::from(v)).sum();
        assert!((f64::from(sum(&x)) - naive).abs() < 1e-5);
        let d = dot(&x[..64], &x[1..65]);
        let naive: f64 = x[..64].iter().zip(&x[1..65]).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
        assert!((f64::from(d) - naive).abs() < 1e-5);
    }

    /// Over two positions the output is gemm's unfused `p1·v1 + p0·v0`, over three an FMA
    /// chain, on the SIMD head sizes (64, 128) and the scalar fallback (256) alike.
    #[test]
    fn weighted_sum_of_values_follows_gemm() {
        for hd in [64, 128, 256] {
            let val = |i: usize| ((i * 7919 % 1013) as f32 - 506.0) * 1.37e-3;
            let q: Vec<f32> = (0..hd).map(val).collect();
            let k: Vec<f32> = (0..3 * hd).map(|i| val(i + 17)).collect();
            let v: Vec<f32> = (0..3 * hd).map(|i| val(i + 101) * 3.1).collect();
            let scale = (1.0 / (hd as f64).sqrt()) as f32;
            for n in [2, 3] {
                let mut p: Vec<f32> = (0..n).map(|j| dot(&q, &k[j * hd..(j + 1) * hd]) * scale).collect();
                softmax(&mut p);
                let want: Vec<f32> = (0..hd)
                    .map(|i| match n {
                        2 => p[1] * v[hd + i] + p[0] * v[i],
                        _ => (0..n).fold(0f32, |o, j| p[j].mul_add(v[j * hd + i], o)),
                    })
                    .collect();
                let (mut scores, mut out) = (vec![0f32; n], vec![0f32; hd]);
                attend_head(&q, &k, &v, |j| j * hd, scale, &mut scores, &mut out);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&want), "head_dim {hd}, {n} positions");
            }
        }
    }

    /// A KV group's heads computed together have exactly the bits of each head alone, for
    /// group sizes that fill the 3-head tiles or not, position counts around the 4-key tiles
    /// and the two-position special case, and scattered cache slots.
    #[test]
    fn a_group_of_heads_has_the_bits_of_each_head_alone() {
        for hd in [64, 128, 256] {
            for heads in [1, 2, 3, 4, 6, 7] {
                for n in [1, 2, 3, 4, 5, 9, 31] {
                    let val = |i: usize| ((i * 7919 % 1013) as f32 - 506.0) * 1.37e-3;
                    let slots = 40;
                    let k: Vec<f32> = (0..slots * hd).map(|i| val(i + 17)).collect();
                    let v: Vec<f32> = (0..slots * hd).map(|i| val(i + 101) * 3.1).collect();
                    let q: Vec<f32> = (0..heads * hd).map(|i| val(i * 3 + n)).collect();
                    let offs: Vec<usize> = (0..n).map(|j| ((j * 7 + 3) % slots) * hd).collect();
                    let scale = (1.0 / (hd as f64).sqrt()) as f32;
                    let (mut scores, mut got) = (vec![0f32; heads * n], vec![0f32; heads * hd]);
                    attend_group(&q, &k, &v, &offs, scale, &mut scores, &mut got);
                    let mut want = vec![0f32; heads * hd];
                    for (qh, oh) in q.chunks_exact(hd).zip(want.chunks_exact_mut(hd)) {
                        attend_head(qh, &k, &v, |j| offs[j], scale, &mut vec![0f32; n], oh);
                    }
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "head_dim {hd}, {heads} heads, {n} positions");
                }
            }
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, f32::NEG_INFINITY];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
    }
}
