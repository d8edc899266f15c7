//! A Gemma 3 reference built from candle's operations, one token per forward call.
//!
//! Why not candle-transformers' `quantized_gemma3`: in 0.11.1 its MLP applies SiLU, while Gemma 3
//! defines `gelu_pytorch_tanh` (Hugging Face's `Gemma3TextConfig.hidden_activation`, and
//! llama.cpp's `LLM_FFN_GELU` for this architecture); and in single-token steps it ignores the
//! sliding window. Its greedy text on gemma-3-270m drifts from llama.cpp's within a few tokens. This
//! reference is candle-transformers' model with those two points put right and nothing else: the
//! same candle `QMatMul`s, `rms_norm`, `rope`, `softmax_last_dim` and `gelu` — arithmetic that
//! shares nothing with our kernels.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{Device, Module, Tensor};

struct Layer {
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    q_norm: Tensor,
    k_norm: Tensor,
    attn_norm: Tensor,
    post_attn_norm: Tensor,
    ffn_norm: Tensor,
    post_ffn_norm: Tensor,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
    window: Option<usize>,
    cos: Tensor,
    sin: Tensor,
    k_cache: Option<Tensor>,
    v_cache: Option<Tensor>,
}

pub struct Gemma3Reference {
    embeddings: Tensor,
    hidden: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    eps: f64,
    layers: Vec<Layer>,
    norm: Tensor,
    output: QMatMul,
}

fn rope_table(head_dim: usize, base: f32, len: usize) -> (Tensor, Tensor) {
    let theta: Vec<f32> = (0..head_dim).step_by(2).map(|i| 1f32 / base.powf(i as f32 / head_dim as f32)).collect();
    let n = theta.len();
    let theta = Tensor::new(theta.as_slice(), &Device::Cpu).unwrap().reshape((1, n)).unwrap();
    let idx = Tensor::arange(0, len as u32, &Device::Cpu)
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .reshape((len, 1))
        .unwrap();
    let a = idx.matmul(&theta).unwrap();
    (a.cos().unwrap(), a.sin().unwrap())
}

impl Gemma3Reference {
    pub fn load(path: &std::path::Path, max_len: usize) -> Self {
        let mut f = std::fs::File::open(path).unwrap();
        let ct = gguf_file::Content::read(&mut f).unwrap();
        let u = |k: &str| ct.metadata[&format!("gemma3.{k}")].to_u32().unwrap() as usize;
        let (hidden, n_heads, n_kv_heads, head_dim) =
            (u("embedding_length"), u("attention.head_count"), u("attention.head_count_kv"), u("attention.key_length"));
        let n_layers = u("block_count");
        let window = u("attention.sliding_window");
        let eps = ct.metadata["gemma3.attention.layer_norm_rms_epsilon"].to_f32().unwrap() as f64;
        let base = ct.metadata["gemma3.rope.freq_base"].to_f32().unwrap();
        let dev = Device::Cpu;
        let mut t = |name: &str| ct.tensor(&mut f, name, &dev).unwrap();
        let embeddings = t("token_embd.weight").dequantize(&dev).unwrap();
        let norm = t("output_norm.weight").dequantize(&dev).unwrap();
        let output = QMatMul::from_qtensor(t("token_embd.weight")).unwrap();
        let (gcos, gsin) = rope_table(head_dim, base, max_len);
        let (lcos, lsin) = rope_table(head_dim, 10_000.0, max_len);
        let layers = (0..n_layers)
            .map(|i| {
                let p = format!("blk.{i}");
                let mut q = |n: &str| QMatMul::from_qtensor(t(&format!("{p}.{n}.weight"))).unwrap();
                let (wq, wk, wv, wo, gate, up, down) = (
                    q("attn_q"),
                    q("attn_k"),
                    q("attn_v"),
                    q("attn_output"),
                    q("ffn_gate"),
                    q("ffn_up"),
                    q("ffn_down"),
                );
                let mut v = |n: &str| t(&format!("{p}.{n}.weight")).dequantize(&dev).unwrap();
                let sliding = (i + 1) % 6 != 0;
                Layer {
                    wq,
                    wk,
                    wv,
                    wo,
                    gate,
                    up,
                    down,
                    q_norm: v("attn_q_norm"),
                    k_norm: v("attn_k_norm"),
                    attn_norm: v("attn_norm"),
                    post_attn_norm: v("post_attention_norm"),
                    ffn_norm: v("ffn_norm"),
                    post_ffn_norm: v("post_ffw_norm"),
                    window: sliding.then_some(window),
                    cos: if sliding { lcos.clone() } else { gcos.clone() },
                    sin: if sliding { lsin.clone() } else { gsin.clone() },
                    k_cache: None,
                    v_cache: None,
                }
            })
            .collect();
        Self { embeddings, hidden, n_heads, n_kv_heads, head_dim, eps, layers, norm, output }
    }

    /// Logits after feeding `token` at position `pos` (positions must come in order; 0 starts
    /// a new sequence).
    pub fn step(&mut self, token: u32, pos: usize) -> Vec<f32> {
        if pos == 0 {
            for l in &mut self.layers {
                l.k_cache = None;
                l.v_cache = None;
            }
        }
        let (nh, nkv, hd, eps) = (self.n_heads, self.n_kv_heads, self.head_dim, self.eps as f32);
        let rms = |x: &Tensor, w: &Tensor| candle_nn::ops::rms_norm(x, w, eps).unwrap();
        let mut x = self.embeddings.narrow(0, token as usize, 1).unwrap().unsqueeze(0).unwrap(); // (1, 1, h)
        x = (x * (self.hidden as f64).sqrt()).unwrap();
        for l in &mut self.layers {
            let h = rms(&x, &l.attn_norm);
            let q = l.wq.forward(&h).unwrap().reshape((1, 1, nh, hd)).unwrap().transpose(1, 2).unwrap();
            let k = l.wk.forward(&h).unwrap().reshape((1, 1, nkv, hd)).unwrap().transpose(1, 2).unwrap();
            let v = l.wv.forward(&h).unwrap().reshape((1, 1, nkv, hd)).unwrap().transpose(1, 2).unwrap();
            let q = rms(&q.contiguous().unwrap(), &l.q_norm);
            let k = rms(&k.contiguous().unwrap(), &l.k_norm);
            let (cos, sin) = (l.cos.narrow(0, pos, 1).unwrap(), l.sin.narrow(0, pos, 1).unwrap());
            let q = candle_nn::rotary_emb::rope(&q, &cos, &sin).unwrap();
            let k = candle_nn::rotary_emb::rope(&k, &cos, &sin).unwrap();
            let (k, v) = match (&l.k_cache, &l.v_cache) {
                (Some(kc), Some(vc)) => (Tensor::cat(&[kc, &k], 2).unwrap(), Tensor::cat(&[vc, &v], 2).unwrap()),
                _ => (k, v),
            };
            l.k_cache = Some(k.clone());
            l.v_cache = Some(v.clone());
            // the window: the last `w` positions, the query's own included
            let len = k.dim(2).unwrap();
            let first = l.window.map_or(0, |w| len.saturating_sub(w));
            let (k, v) = (k.narrow(2, first, len - first).unwrap(), v.narrow(2, first, len - first).unwrap());
            let k = candle_transformers::utils::repeat_kv(k, nh / nkv).unwrap().contiguous().unwrap();
            let v = candle_transformers::utils::repeat_kv(v, nh / nkv).unwrap().contiguous().unwrap();
            let att = (q.matmul(&k.t().unwrap()).unwrap() * (1.0 / (hd as f64).sqrt())).unwrap();
            let att = candle_nn::ops::softmax_last_dim(&att).unwrap();
            let y = att.matmul(&v).unwrap().transpose(1, 2).unwrap().reshape((1, 1, nh * hd)).unwrap();
            let y = rms(&l.wo.forward(&y).unwrap(), &l.post_attn_norm);
            x = (x + y).unwrap();
            let h = rms(&x, &l.ffn_norm);
            let g = l.gate.forward(&h).unwrap().gelu().unwrap();
            let m = l.down.forward(&(g * l.up.forward(&h).unwrap()).unwrap()).unwrap();
            x = (x + rms(&m, &l.post_ffn_norm)).unwrap();
        }
        let x = rms(&x, &self.norm);
        self.output.forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }
}
