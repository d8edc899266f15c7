// The llama forward pass on an NVIDIA GPU, compiled at run time with NVRTC (so the build needs
// no CUDA toolkit). Compiled with --fmad=false: a multiply followed by an add stays two
// roundings, as in the CPU executor, and every explicit fused multiply-add is written `fmaf`.
//
// Each output element is computed by one thread in the CPU executor's arithmetic order (the
// order candle-transformers' quantized_llama uses, see attention.rs and kernels.rs). That makes
// the GPU path batch- and chunk-invariant like the CPU path, and equal to it bit for bit (exp is
// glibc's algorithm, below). It is not the fastest layout; it is the one whose numbers we can
// check against the reference.

#define QK 32

// f32 -> f16 (round to nearest even) -> f32, as the `half` crate's `f16::from_f32`.
__device__ __forceinline__ float f16_round(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}

#define F2U(x) __float_as_uint(x)
#define U2F(u) __uint_as_float(u)
#define D2U(x) ((unsigned long long)__double_as_longlong(x))
#define U2D(u) __longlong_as_double((long long)(u))

// glibc's expf, in the arithmetic of the FMA variant that x86-64 dispatches to: the CPU executor
// (and candle) call glibc's expf, and CUDA's own expf differs from it in the last bit, which the
// 8-bit activation quantization can amplify into a different quantized value. Checked against
// glibc on every 7th f32 bit pattern (0 mismatches; see docs/MODEL.md).
#define EXPF_N 32
__device__ const unsigned long long EXP2F_TAB[32] = {
    0x3ff0000000000000ULL, 0x3fefd9b0d3158574ULL, 0x3fefb5586cf9890fULL, 0x3fef9301d0125b51ULL,
    0x3fef72b83c7d517bULL, 0x3fef54873168b9aaULL, 0x3fef387a6e756238ULL, 0x3fef1e9df51fdee1ULL,
    0x3fef06fe0a31b715ULL, 0x3feef1a7373aa9cbULL, 0x3feedea64c123422ULL, 0x3feece086061892dULL,
    0x3feebfdad5362a27ULL, 0x3feeb42b569d4f82ULL, 0x3feeab07dd485429ULL, 0x3feea47eb03a5585ULL,
    0x3feea09e667f3bcdULL, 0x3fee9f75e8ec5f74ULL, 0x3feea11473eb0187ULL, 0x3feea589994cce13ULL,
    0x3feeace5422aa0dbULL, 0x3feeb737b0cdc5e5ULL, 0x3feec49182a3f090ULL, 0x3feed503b23e255dULL,
    0x3feee89f995ad3adULL, 0x3feeff76f2fb5e47ULL, 0x3fef199bdd85529cULL, 0x3fef3720dcef9069ULL,
    0x3fef5818dcfba487ULL, 0x3fef7c97337b9b5fULL, 0x3fefa4afa2a490daULL, 0x3fefd0765b6e4540ULL,
};
__device__ float expf_libm(float x) {
    unsigned int ux = F2U(x);
    unsigned int abstop = (ux >> 20) & 0x7ff;
    if (abstop >= 0x42b) {  // |x| >= 88, inf or nan
        if (ux == 0xff800000u) return 0.0f;
        if (abstop >= 0x7f8) return x + x;
        if (x > 0x1.62e42ep6f) return U2F(0x7f800000u);
        if (x < -0x1.9fe368p6f) return 0.0f;
    }
    double xd = (double)x;
    double z = (0x1.71547652b82fep+0 * EXPF_N) * xd;
    double kd = z + 0x1.8p+52;
    unsigned long long ki = D2U(kd);
    kd -= 0x1.8p+52;
    double r = z - kd;
    unsigned long long t = EXP2F_TAB[ki % EXPF_N] + (ki << 47);
    double s = U2D(t);
    double zz = fma(0x1.c6af84b912394p-5 / EXPF_N / EXPF_N / EXPF_N, r, 0x1.ebfce50fac4f3p-3 / EXPF_N / EXPF_N);
    double r2 = r * r;
    double y = fma(0x1.62e42ff0c52d6p-1 / EXPF_N, r, 1.0);
    y = fma(zz, r2, y);
    y = y * s;
    return (float)y;
}

// Activations [rows, k] to 8 bits per QK block, as candle's Q8_1 (`s` is used by Q4_1 weights)
// and Q8_0 (the same `qs` and `d`). One thread per (row, block).
extern "C" __global__ void quantize_q8(const float* __restrict__ x, int rows, int k,
                                       signed char* __restrict__ qs, float* __restrict__ d,
                                       float* __restrict__ s) {
    int nb = k / QK;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * nb) return;
    int row = i / nb, b = i % nb;
    const float* xb = x + (size_t)row * k + b * QK;
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(xb[j]));
    float scale = amax / 127.0f;
    float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int sum = 0;
    signed char* q = qs + (size_t)row * k + b * QK;
    for (int j = 0; j < QK; ++j) {
        int r = (int)roundf(xb[j] * inv);  // half away from zero, as candle
        q[j] = (signed char)r;
        sum += r;
    }
    float d16 = f16_round(scale);
    d[i] = d16;
    s[i] = f16_round(f16_round((float)sum) * d16);
}

// out[tok, row] = Σ_b (Σ_j q_w·q_a)·d_w·d_a + m_w·s_a   (Q4_1 weights × Q8_1 activations).
// Weights row-major: qs [rows][nb][16] (element j low nibble, j+16 high), d and m [rows][nb].
extern "C" __global__ void mm_q4_1(const unsigned char* __restrict__ wqs, const float* __restrict__ wd,
                                   const float* __restrict__ wm, int rows, int k,
                                   const signed char* __restrict__ aq, const float* __restrict__ ad,
                                   const float* __restrict__ as, int m, float* __restrict__ out) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    int tok = blockIdx.y;
    if (row >= rows || tok >= m) return;
    int nb = k / QK;
    float sumf = 0.0f;
    for (int b = 0; b < nb; ++b) {
        size_t wi = (size_t)row * nb + b;
        size_t ai = (size_t)tok * nb + b;
        const unsigned char* q = wqs + wi * 16;
        const signed char* a = aq + (size_t)tok * k + b * QK;
        int sumi = 0;
        for (int j = 0; j < 16; ++j) {
            sumi += (int)(q[j] & 0x0F) * (int)a[j] + (int)(q[j] >> 4) * (int)a[j + 16];
        }
        sumf += (float)sumi * wd[wi] * ad[ai] + wm[wi] * as[ai];
    }
    out[(size_t)tok * rows + row] = sumf;
}

// out[tok, row] = Σ_b (Σ_j q_w·q_a)·d_w·d_a   (Q8_0 weights × Q8_0 activations), in the order
// of candle's AVX2 kernel (kernels.rs `q8_0_group`): eight lanes, lane l holding the integer dot
// of elements 4l..4l+3 of each block, accumulated with FMA by d_w·d_a, then `hsum_float_8`.
extern "C" __global__ void mm_q8_0(const signed char* __restrict__ wqs, const float* __restrict__ wd,
                                   int rows, int k, const signed char* __restrict__ aq,
                                   const float* __restrict__ ad, int m, float* __restrict__ out) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    int tok = blockIdx.y;
    if (row >= rows || tok >= m) return;
    int nb = k / QK;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int b = 0; b < nb; ++b) {
        size_t wi = (size_t)row * nb + b;
        const signed char* q = wqs + wi * QK;
        const signed char* a = aq + (size_t)tok * k + b * QK;
        float dd = wd[wi] * ad[(size_t)tok * nb + b];
        for (int l = 0; l < 8; ++l) {
            int sumi = 0;
            for (int e = 4 * l; e < 4 * l + 4; ++e) sumi += (int)q[e] * (int)a[e];
            acc[l] = fmaf(dd, (float)sumi, acc[l]);
        }
    }
    float r0 = acc[4] + acc[0], r1 = acc[5] + acc[1], r2 = acc[6] + acc[2], r3 = acc[7] + acc[3];
    out[(size_t)tok * rows + row] = (r0 + r2) + (r1 + r3);
}

// Dense f32 weights (any other GGUF type, dequantized at load): out[tok, row] = x[tok]·w[row].
extern "C" __global__ void mm_f32(const float* __restrict__ w, int rows, int k, const float* __restrict__ x,
                                  int m, float* __restrict__ out) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    int tok = blockIdx.y;
    if (row >= rows || tok >= m) return;
    const float* wr = w + (size_t)row * k;
    const float* xr = x + (size_t)tok * k;
    float s = 0.0f;
    for (int j = 0; j < k; ++j) s = fmaf(xr[j], wr[j], s);
    out[(size_t)tok * rows + row] = s;
}

// Row-wise RMSNorm `x / sqrt(mean(x²) + eps) * w`, one thread per row, sequential sum.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, int rows, int d,
                                    float eps, float* __restrict__ out) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const float* xr = x + (size_t)row * d;
    float sum2 = 0.0f;
    for (int j = 0; j < d; ++j) sum2 += xr[j] * xr[j];
    float m = sqrtf(sum2 / (float)d + eps);
    float* o = out + (size_t)row * d;
    for (int j = 0; j < d; ++j) o[j] = xr[j] / m * w[j];
}

// Interleaved RoPE of `heads` heads per token: pairs (2i, 2i+1) rotated by the angle of
// position pos[tok]. One thread per (tok, head, pair). cos/sin: [max_len][hd/2].
extern "C" __global__ void rope(float* __restrict__ x, int n, int heads, int hd, const int* __restrict__ pos,
                                const float* __restrict__ cos_t, const float* __restrict__ sin_t) {
    int half = hd / 2;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * heads * half) return;
    int tok = i / (heads * half);
    int rem = i % (heads * half);
    int head = rem / half, p = rem % half;
    float* pair = x + ((size_t)tok * heads + head) * hd + 2 * p;
    float c = cos_t[(size_t)pos[tok] * half + p];
    float s = sin_t[(size_t)pos[tok] * half + p];
    float x0 = pair[0], x1 = pair[1];
    pair[0] = x0 * c - x1 * s;
    pair[1] = x0 * s + x1 * c;
}

// K and V of every token into its cache slot: slot[tok] = block * block_size + pos % block_size.
extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v, int n, int kv_dim,
                                    const int* __restrict__ slot, float* __restrict__ kc, float* __restrict__ vc) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * kv_dim) return;
    int tok = i / kv_dim, e = i % kv_dim;
    size_t dst = (size_t)slot[tok] * kv_dim + e;
    kc[dst] = k[i];
    vc[dst] = v[i];
}

// q·k in the order of gemm's horizontal f32 kernel (attention.rs `dot`).
__device__ float dot_ordered(const float* q, const float* k, int hd) {
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int full = hd / 8 * 8;
    for (int i = 0; i < full; i += 8)
        for (int j = 0; j < 8; ++j) l[j] = fmaf(q[i + j], k[i + j], l[j]);
    float h0 = l[0] + l[4], h1 = l[1] + l[5], h2 = l[2] + l[6], h3 = l[3] + l[7];
    float s = (h0 + h2) + (h1 + h3);
    for (int i = full; i < hd; ++i) s = fmaf(q[i], k[i], s);
    return s;
}

// Σx in the order of candle's AVX `vec_sum` (attention.rs `sum`).
__device__ float sum_ordered(const float* x, int n) {
    float acc[32];
    for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
    int full = n / 32 * 32;
    for (int c = 0; c < full; c += 32)
        for (int i = 0; i < 32; ++i) acc[i] += x[c + i];
    float r[8];
    for (int i = 0; i < 8; ++i) r[i] = (acc[i] + acc[8 + i]) + (acc[16 + i] + acc[24 + i]);
    float t0 = r[0] + r[4], t1 = r[1] + r[5], t2 = r[2] + r[6], t3 = r[3] + r[7];
    float s = (t0 + t1) + (t2 + t3);
    for (int i = full; i < n; ++i) s += x[i];
    return s;
}

// Causal attention of one (token, head) over its request's positions 0..=pos[tok], read through
// its block table (block_tables[bt_off[tok] ..]). scores: scratch of `stride` floats per item.
extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ kc,
                                     const float* __restrict__ vc, int n, int nh, int nkv, int hd, int bs,
                                     const int* __restrict__ pos, const int* __restrict__ bt_off,
                                     const int* __restrict__ block_tables, float scale,
                                     float* __restrict__ scores_all, int stride, float* __restrict__ out) {
    int item = blockIdx.x * blockDim.x + threadIdx.x;
    if (item >= n * nh) return;
    int tok = item / nh, head = item % nh;
    int g = head / (nh / nkv);
    int len = pos[tok] + 1;
    const int* table = block_tables + bt_off[tok];
    const float* qh = q + (size_t)item * hd;
    float* scores = scores_all + (size_t)item * stride;
    for (int j = 0; j < len; ++j) {
        size_t off = (((size_t)table[j / bs] * bs + j % bs) * nkv + g) * hd;
        scores[j] = dot_ordered(qh, kc + off, hd) * scale;
    }
    float mx = __int_as_float(0xff800000);  // -inf
    for (int j = 0; j < len; ++j) mx = fmaxf(mx, scores[j]);
    for (int j = 0; j < len; ++j) scores[j] = expf_libm(scores[j] - mx);
    float total = sum_ordered(scores, len);
    for (int j = 0; j < len; ++j) scores[j] = scores[j] / total;
    float* o = out + (size_t)item * hd;
    for (int d = 0; d < hd; ++d) o[d] = 0.0f;
    for (int j = 0; j < len; ++j) {
        size_t off = (((size_t)table[j / bs] * bs + j % bs) * nkv + g) * hd;
        float p = scores[j];
        for (int d = 0; d < hd; ++d) o[d] = fmaf(p, vc[off + d], o[d]);
    }
}

// gate[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + e^-x).
extern "C" __global__ void silu_mul(float* __restrict__ gate, const float* __restrict__ up, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate[i];
    gate[i] = g / (1.0f + expf_libm(-g)) * up[i];
}

// x[i] += y[i]
extern "C" __global__ void add_in_place(float* __restrict__ x, const float* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] = x[i] + y[i];
}

// out[r] = x[idx[r]] for rows of `d` values.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const int* __restrict__ idx, int rows, int d,
                                       float* __restrict__ out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * d) return;
    int r = i / d, e = i % d;
    out[i] = x[(size_t)idx[r] * d + e];
}
