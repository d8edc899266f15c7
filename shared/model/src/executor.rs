//! [`GgufExecutor`]: the forward pass of a GGUF model over the worker's paged KV cache.
//!
//! Written once for every architecture: the pieces a layer has beyond llama's (QKV biases,
//! Q/K norms, post-norms, GELU, sliding windows, NeoX RoPE) come from the model's
//! [`crate::arch::Recipe`], never from its name.
//!
//! One [`Executor::execute`] call runs one engine step:
//!
//! 1. validate every chunk (token ids, positions, block tables, cache geometry) so bad input is
//!    an [`ExecutorError`], never a panic or a silent out-of-bounds write;
//! 2. concatenate the tokens of all chunks into one `[n_tokens, hidden]` activation;
//! 3. per layer: RMSNorm → Q/K/V (one batched matmul each over all tokens) [+ biases]
//!    [→ per-head Q/K RMSNorm] → RoPE → write K/V of every token into its `(block, slot)` →
//!    causal attention per request over its block table (or the window of it a sliding layer
//!    sees) → output projection [→ RMSNorm] → residual → RMSNorm → SiLU- or GELU-gated MLP
//!    (batched) [→ RMSNorm] → residual;
//! 4. final RMSNorm and the vocabulary projection only for the last token of each chunk that
//!    samples, then [`pdmesh_model_api::sampling::sample`].
//!
//! The numerics follow candle-transformers' quantized models (the references the tests compare
//! against): the same RMSNorm formula, interleaved RoPE for llama (`rope_i`, pairs `(2i, 2i+1)`,
//! which is what GGUF llama weights are permuted for) and NeoX RoPE for the others (`rope`,
//! pairs `(i, i + d/2)`), softmax in f32, SiLU as `x / (1 + e^-x)`, GELU as candle's tanh form.
//! Every row of every matmul is computed independently of the other rows, and attention only
//! reads a request's own blocks, so a request's tokens do not depend on what it is batched
//! with or how its prefill is chunked.

use std::path::Path;

use pdmesh_model_api::{sampling, Executor, ExecutorError, KvCache, ModelFacts};
use pdmesh_protocol::{SampledToken, ScheduledChunk};

use crate::arch::{Activation, ModelConfig, RopeLayout};
use crate::attention;
use crate::embedding::Embedding;
use crate::error::ModelError;
use crate::gguf::{sha256_file, GgufFile};
use crate::linear::{Linear, LinearSet, MatmulCtx};
use crate::tp::{Gather, TpRank};
use crate::ModelOptions;

struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K, V (fused when possible).
    qkv: LinearSet,
    /// Biases added to Q, K and V (`Recipe::qkv_bias`).
    qkv_bias: Option<[Vec<f32>; 3]>,
    /// RMSNorm weights over each Q and each K head (`Recipe::qk_norm`).
    qk_norm: Option<[Vec<f32>; 2]>,
    wo: LinearSet,
    /// RMSNorm on the attention output before the residual add (`Recipe::post_norms`).
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    /// RMSNorm on the MLP output before the residual add (`Recipe::post_norms`).
    post_ffn_norm: Option<Vec<f32>>,
    /// Index of this layer's RoPE table in `GgufExecutor::ropes`.
    rope: usize,
    /// Attend over the last this many positions only.
    window: Option<usize>,
    /// gate, up (fused when possible).
    gate_up: LinearSet,
    down: LinearSet,
}

/// Reusable activation buffers, kept across steps so a step allocates (almost) nothing.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    last: Vec<f32>,
    logits: Vec<f32>,
}

/// This process's part in a tensor-parallel group (`crate::tp`, D111): without one, every
/// gather is the identity.
struct TpCtx {
    tp: TpRank,
    group: Option<Box<dyn Gather>>,
    tmp: Vec<f32>,
}

impl TpCtx {
    /// Replace `x` (`[rows, w]`, this rank's columns) by every rank's columns (`[rows, w·size]`).
    #[inline]
    fn whole(&mut self, x: &mut Vec<f32>, rows: usize) -> Result<(), ExecutorError> {
        self.gather(x, |g, x, tmp| g.all_gather(x, rows, tmp))
    }

    /// [`TpCtx::whole`] on TP rank 0 only (the one rank that samples: the logits); the other
    /// ranks' `x` is left empty.
    fn logits_to_rank0(&mut self, x: &mut Vec<f32>, rows: usize) -> Result<(), ExecutorError> {
        self.gather(x, |g, x, tmp| g.gather_to_rank0(x, rows, tmp))
    }

    fn gather(
        &mut self,
        x: &mut Vec<f32>,
        op: impl FnOnce(&mut dyn Gather, &[f32], &mut Vec<f32>) -> Result<(), crate::tp::TpError>,
    ) -> Result<(), ExecutorError> {
        let Some(g) = self.group.as_mut() else { return Ok(()) };
        op(g.as_mut(), x, &mut self.tmp).map_err(|e| ExecutorError::DeviceLost(format!("tensor parallelism: {e}")))?;
        std::mem::swap(x, &mut self.tmp);
        Ok(())
    }
}

/// Where each token of a step comes from.
pub(crate) struct TokenPlan {
    /// Position of the token in its sequence.
    pub(crate) pos: usize,
    /// Index of its chunk in the step.
    pub(crate) chunk: usize,
}

/// `cos`/`sin` of `pos * theta_i` for one RoPE base, `[max_model_len][head_dim / 2]`.
struct RopeTable {
    base: f32,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// A GGUF model of any supported architecture (`crate::arch`) implementing [`Executor`].
pub struct GgufExecutor {
    facts: ModelFacts,
    /// The whole model's hyper-parameters.
    cfg: ModelConfig,
    /// What this process's forward pass computes: `cfg` itself, or a TP rank's heads and MLP
    /// units ([`TpRank::local_config`]).
    run_cfg: ModelConfig,
    tp: TpCtx,
    embedding: Embedding,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    output: LinearSet,
    /// Thread pool, kernel choice and matmul buffers.
    mm: MatmulCtx,
    /// One table per distinct RoPE base (Gemma 3 has two).
    ropes: Vec<RopeTable>,
    scratch: Scratch,
    /// Grammar matchers of the requests with structured outputs (D53).
    guide: pdmesh_guided::Guide,
}

impl std::fmt::Debug for GgufExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufExecutor").field("facts", &self.facts).field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

/// A vector of weights (a norm's, a bias), as f32.
pub(crate) fn norm_weights(g: &mut GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = g.tensor_with_dims(name, &[len])?;
    t.dequantize(&candle_core::Device::Cpu)
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| ModelError::InvalidTensor { name: name.to_string(), reason: e.to_string() })
}

/// Rows `keep` of a `[rows, cols]` matrix (a TP rank's output rows).
fn linear_rows(
    g: &mut GgufFile,
    name: &str,
    rows: usize,
    cols: usize,
    keep: std::ops::Range<usize>,
) -> Result<Linear, ModelError> {
    let t = g.tensor_with_dims(name, &[rows, cols])?;
    Linear::new_rows(name, t, keep)
}

/// Values `keep` of a vector of weights (a TP rank's share of a bias).
fn norm_weights_part(
    g: &mut GgufFile,
    name: &str,
    len: usize,
    keep: std::ops::Range<usize>,
) -> Result<Vec<f32>, ModelError> {
    let all = norm_weights(g, name, len)?;
    all.get(keep.clone())
        .map(<[f32]>::to_vec)
        .ok_or_else(|| ModelError::InvalidTensor { name: name.into(), reason: format!("no values {keep:?}") })
}

/// Name of the model as served: the file name without `.gguf`.
pub(crate) fn model_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".to_string())
}

/// What the engine needs to know of a loaded model (shared by the CPU and GPU executors).
pub(crate) fn model_facts(
    cfg: &ModelConfig,
    path: &Path,
    max_model_len: u32,
    eos_token_ids: Vec<u32>,
    weights_id: String,
) -> ModelFacts {
    ModelFacts {
        name: model_name(path),
        num_layers: cfg.n_layers as u32,
        num_kv_heads: cfg.n_kv_heads as u32,
        head_dim: cfg.head_dim as u32,
        vocab_size: cfg.vocab_size as u32,
        max_model_len,
        eos_token_ids,
        weights_id,
    }
}

/// The effective max_model_len: the model's context length, capped by the caller.
pub(crate) fn effective_max_len(context_length: u32, options: &ModelOptions) -> u32 {
    match options.max_model_len {
        Some(cap) if cap > 0 => cap.min(context_length),
        _ => context_length,
    }
}

/// The index in `ropes` of the RoPE table for `base`, made on its first use (one table per
/// distinct base: Gemma 3's local and global layers share two).
fn rope_table_for(ropes: &mut Vec<RopeTable>, head_dim: usize, base: f32, max_len: usize) -> usize {
    match ropes.iter().position(|r| r.base == base) {
        Some(r) => r,
        None => {
            let (cos, sin) = rope_tables(head_dim, base, max_len);
            ropes.push(RopeTable { base, cos, sin });
            ropes.len() - 1
        }
    }
}

/// The rows of layer `i`'s matrices a TP rank computes (all of them without TP).
struct LayerRows {
    q: std::ops::Range<usize>,
    kv: std::ops::Range<usize>,
    hidden: std::ops::Range<usize>,
    ffn: std::ops::Range<usize>,
}

impl LayerRows {
    fn of(cfg: &ModelConfig, tp: TpRank) -> Self {
        let hd = cfg.head_dim;
        let heads = tp.share(cfg.n_heads);
        let kv_heads = tp.kv_heads(cfg.n_kv_heads);
        Self {
            q: heads.start * hd..heads.end * hd,
            kv: kv_heads.start * hd..kv_heads.end * hd,
            hidden: tp.share(cfg.hidden),
            ffn: tp.share(cfg.ffn_dim),
        }
    }
}

/// The weights of layer `i` (`blk.{i}.*`), with the pieces its recipe asks for: TP rank
/// `tp`'s rows of each matrix and bias.
fn load_layer(
    g: &mut GgufFile,
    cfg: &ModelConfig,
    tp: TpRank,
    i: usize,
    rope: usize,
    window: Option<usize>,
) -> Result<Layer, ModelError> {
    let (hd, h, f) = (cfg.head_dim, cfg.hidden, cfg.ffn_dim);
    let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
    let rows = LayerRows::of(cfg, tp);
    let recipe = &cfg.recipe;
    let p = format!("blk.{i}");
    Ok(Layer {
        attn_norm: norm_weights(g, &format!("{p}.attn_norm.weight"), h)?,
        qkv: LinearSet::new(vec![
            linear_rows(g, &format!("{p}.attn_q.weight"), q_dim, h, rows.q.clone())?,
            linear_rows(g, &format!("{p}.attn_k.weight"), kv_dim, h, rows.kv.clone())?,
            linear_rows(g, &format!("{p}.attn_v.weight"), kv_dim, h, rows.kv.clone())?,
        ]),
        qkv_bias: if recipe.qkv_bias {
            Some([
                norm_weights_part(g, &format!("{p}.attn_q.bias"), q_dim, rows.q.clone())?,
                norm_weights_part(g, &format!("{p}.attn_k.bias"), kv_dim, rows.kv.clone())?,
                norm_weights_part(g, &format!("{p}.attn_v.bias"), kv_dim, rows.kv.clone())?,
            ])
        } else {
            None
        },
        qk_norm: if recipe.qk_norm {
            Some([
                norm_weights(g, &format!("{p}.attn_q_norm.weight"), hd)?,
                norm_weights(g, &format!("{p}.attn_k_norm.weight"), hd)?,
            ])
        } else {
            None
        },
        wo: LinearSet::single(linear_rows(g, &format!("{p}.attn_output.weight"), h, q_dim, rows.hidden.clone())?),
        post_attn_norm: if recipe.post_norms {
            Some(norm_weights(g, &format!("{p}.post_attention_norm.weight"), h)?)
        } else {
            None
        },
        ffn_norm: norm_weights(g, &format!("{p}.ffn_norm.weight"), h)?,
        post_ffn_norm: if recipe.post_norms {
            Some(norm_weights(g, &format!("{p}.post_ffw_norm.weight"), h)?)
        } else {
            None
        },
        rope,
        window,
        gate_up: LinearSet::new(vec![
            linear_rows(g, &format!("{p}.ffn_gate.weight"), f, h, rows.ffn.clone())?,
            linear_rows(g, &format!("{p}.ffn_up.weight"), f, h, rows.ffn)?,
        ]),
        down: LinearSet::single(linear_rows(g, &format!("{p}.ffn_down.weight"), h, f, rows.hidden)?),
    })
}

/// The weights a step streams, on huge pages (crate::hugemem) where they are wanted; on
/// failure they stay where they are, with a warning.
fn gather_on_huge_pages(output: &mut LinearSet, layers: &mut [Layer]) {
    if !crate::hugemem::huge_pages_wanted() {
        return;
    }
    let mut packed = output.packed_mut();
    for l in layers {
        packed.extend(l.qkv.packed_mut());
        packed.extend(l.wo.packed_mut());
        packed.extend(l.gate_up.packed_mut());
        packed.extend(l.down.packed_mut());
    }
    if let Err(e) = crate::kernels::gather_weights(&mut packed) {
        tracing::warn!(error = %e, "could not map the weights for huge pages; they stay on ordinary pages");
    }
}

impl GgufExecutor {
    /// Load the weights of the GGUF file at `path` (and hash the file for
    /// [`ModelFacts::weights_id`]).
    pub fn load(path: impl AsRef<Path>, options: &ModelOptions) -> Result<Self, ModelError> {
        Self::load_tp(path, options, TpRank::SINGLE, None)
    }

    /// Load TP rank `tp`'s slice of the model (module `crate::tp`), gathering with `group`
    /// (`None` only when `tp.size == 1`). Its [`ModelFacts`] and KV cache hold every KV head
    /// (a node's TP ranks share one cache); the rank writes and reads its own.
    pub fn load_tp(
        path: impl AsRef<Path>,
        options: &ModelOptions,
        tp: TpRank,
        group: Option<Box<dyn Gather>>,
    ) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let mut g = GgufFile::open(path)?;
        // refuse a model we cannot run before hashing a file of gigabytes
        let cfg = crate::arch::model_config(&g)?;
        tp.check(&cfg)?;
        if tp.size > 1 && group.as_ref().is_none_or(|g| g.tp() != tp) {
            return Err(ModelError::TensorParallel(format!("TP rank {} of {} without its group", tp.rank, tp.size)));
        }
        let weights_id = sha256_file(path)?;
        let eos_token_ids = crate::text::eos_token_ids(g.metadata())?;
        let mut ex = Self::from_gguf_tp(&mut g, options, weights_id, eos_token_ids, tp)?;
        ex.tp.group = group.filter(|_| tp.size > 1);
        Ok(ex)
    }

    pub(crate) fn from_gguf(
        g: &mut GgufFile,
        options: &ModelOptions,
        weights_id: String,
        eos_token_ids: Vec<u32>,
    ) -> Result<Self, ModelError> {
        Self::from_gguf_tp(g, options, weights_id, eos_token_ids, TpRank::SINGLE)
    }

    fn from_gguf_tp(
        g: &mut GgufFile,
        options: &ModelOptions,
        weights_id: String,
        eos_token_ids: Vec<u32>,
        tp: TpRank,
    ) -> Result<Self, ModelError> {
        let cfg = crate::arch::model_config(g)?;
        tp.check(&cfg)?;
        let (hd, h) = (cfg.head_dim, cfg.hidden);
        let recipe = &cfg.recipe;
        let vocab_rows = tp.share(cfg.vocab_size);

        let embd_q = g.tensor_with_dims("token_embd.weight", &[cfg.vocab_size, h])?;
        let embedding = Embedding::new("token_embd.weight", &embd_q)?;
        // Tied output projection when the file has no separate `output.weight`.
        let mut output = LinearSet::single(if g.has_tensor("output.weight") {
            linear_rows(g, "output.weight", cfg.vocab_size, h, vocab_rows)?
        } else {
            Linear::new_rows("token_embd.weight", embd_q, vocab_rows)?
        });
        let out_norm = norm_weights(g, "output_norm.weight", h)?;

        let mut ropes: Vec<RopeTable> = Vec::new();
        let max_model_len = effective_max_len(cfg.context_length, options);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for (i, attn) in recipe.layers.iter().enumerate() {
            let rope = rope_table_for(&mut ropes, hd, attn.rope_base, max_model_len as usize);
            layers.push(load_layer(g, &cfg, tp, i, rope, attn.sliding_window)?);
        }
        gather_on_huge_pages(&mut output, &mut layers);

        let run_cfg = tp.local_config(&cfg);
        // the KV cache holds every KV head, whatever the TP size: a node's TP ranks share one
        // (each writing and reading its own heads), which P/D transfers see whole (D111)
        let facts = model_facts(&cfg, &g.path, max_model_len, eos_token_ids, weights_id);
        tracing::info!(name = %facts.name, arch = %cfg.arch, layers = cfg.n_layers, hidden = h, heads = cfg.n_heads,
            kv_heads = cfg.n_kv_heads, head_dim = hd, vocab = cfg.vocab_size, max_model_len,
            tp_rank = tp.rank, tp_size = tp.size, "loaded GGUF model");
        let guide = crate::guided::guide_from_gguf(g, cfg.vocab_size, &facts.eos_token_ids);
        // the TP ranks of a node share its cores
        let mm = MatmulCtx::new(
            options.threads.filter(|&n| n > 0).unwrap_or_else(|| (crate::pool::default_threads() / tp.size).max(1)),
            options.nice,
        );
        tracing::info!(threads = mm.pool.n_threads(), nice = options.nice, worker_nice = ?mm.pool.worker_nice(), kernels = ?mm.imp, "model compute");
        let tp = TpCtx { tp, group: None, tmp: Vec::new() };
        Ok(Self {
            facts,
            cfg,
            run_cfg,
            tp,
            embedding,
            layers,
            out_norm,
            output,
            mm,
            ropes,
            scratch: Scratch::default(),
            guide,
        })
    }

    /// Override the served model name (defaults to the file name without `.gguf`).
    pub fn set_name(&mut self, name: impl Into<String>) {
        self.facts.name = name.into();
    }

    /// The logits (`[n_sampled, vocab]`, in chunk order) of the chunks that sampled in the last
    /// [`Executor::execute`] call: for diagnostics and tests (e.g. comparing with a reference).
    pub fn last_logits(&self) -> &[f32] {
        &self.scratch.logits
    }

    /// Where this TP rank's gathers spent their time (zero without tensor parallelism).
    pub fn tp_gather_time(&self) -> crate::tp::GatherTime {
        self.tp.group.as_ref().map(|g| g.time()).unwrap_or_default()
    }

    /// The hyper-parameters and layer recipe read from the file.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn forward(
        &mut self,
        kv: &mut KvCache,
        chunks: &[ScheduledChunk],
        plan: &[TokenPlan],
    ) -> Result<Vec<SampledToken>, ExecutorError> {
        let Self { run_cfg: cfg, embedding, layers, out_norm, output, mm, ropes, scratch: s, guide, facts, tp, .. } =
            self;
        let bs = kv.spec().block_size as usize;
        let slots = chunk_slots(chunks, bs);
        let kv_heads = tp.tp.kv_heads(facts.num_kv_heads as usize);
        let step = Step {
            cfg,
            kv_stride: facts.num_kv_heads as usize,
            kv_first: kv_heads.start,
            ropes,
            chunks,
            plan,
            slots: &slots,
            block_size: bs,
            rope_fn: match cfg.recipe.rope {
                RopeLayout::Interleaved => rope_interleaved,
                RopeLayout::Neox => rope_neox,
            },
        };
        step.embed(embedding, &mut s.x);
        for (li, layer) in layers.iter().enumerate() {
            step.attention_block(layer, kv, li, mm, s, tp)?;
            step.mlp_block(layer, mm, s, tp)?;
        }

        // ---- logits for the last token of every sampling chunk
        let sampling_chunks = last_rows_of_sampling_chunks(chunks, cfg.hidden, &s.x, &mut s.last);
        if sampling_chunks.is_empty() {
            s.logits.clear();
            return Ok(Vec::new());
        }
        rms_norm(&s.last, out_norm, cfg.rms_eps, &mut s.h);
        output.forward(&s.h, sampling_chunks.len(), mm, &mut [&mut s.logits])?;
        tp.logits_to_rank0(&mut s.logits, sampling_chunks.len())?;
        if tp.tp.rank != 0 {
            // sampling happens once, on TP rank 0
            return Ok(Vec::new());
        }
        let eos = facts.eos_token_ids.first().copied().unwrap_or(0);
        sample_chunks(mm, guide, &s.logits, cfg.vocab_size, &sampling_chunks, eos)
    }
}

/// What every layer of one step's forward pass shares: the step's chunks and token plan and
/// the model's constants, borrowed (built once per step, so a layer allocates nothing).
struct Step<'a> {
    /// What this process computes (a TP rank's heads and MLP units, or the whole model).
    cfg: &'a ModelConfig,
    /// KV heads per cache slot (the whole model's: the cache holds every head).
    kv_stride: usize,
    /// The first cache head this process writes and reads (its TP rank's first KV head).
    kv_first: usize,
    /// The model's RoPE tables (one per distinct base).
    ropes: &'a [RopeTable],
    chunks: &'a [ScheduledChunk],
    plan: &'a [TokenPlan],
    /// Each chunk's cache slot per position ([`chunk_slots`]).
    slots: &'a [Vec<usize>],
    block_size: usize,
    /// The RoPE of the model's layout, chosen once per step.
    rope_fn: fn(&mut [f32], &[f32], &[f32]),
}

/// Each chunk's cache slot per position (`block * bs + offset`), once per step: the attention
/// of every layer and head reads keys through it (a division per key there cost more than the
/// key's dot product).
fn chunk_slots(chunks: &[ScheduledChunk], bs: usize) -> Vec<Vec<usize>> {
    chunks
        .iter()
        .map(|c| {
            let end = c.start_pos as usize + c.token_ids.len();
            (0..end).map(|j| c.block_ids.get(j / bs).map_or(0, |&b| b as usize * bs + j % bs)).collect()
        })
        .collect()
}

impl Step<'_> {
    /// Embeddings of all tokens of the step into `x`, in chunk order (scaled where the recipe
    /// says so).
    fn embed(&self, embedding: &Embedding, x: &mut Vec<f32>) {
        let h = self.cfg.hidden;
        x.clear();
        x.resize(self.plan.len() * h, 0.0);
        let ids = self.chunks.iter().flat_map(|c| c.token_ids.iter().copied());
        for (row, id) in x.chunks_exact_mut(h).zip(ids) {
            embedding.row_into(id as usize, row);
        }
        if let Some(k) = self.cfg.recipe.embedding_scale {
            x.iter_mut().for_each(|v| *v *= k);
        }
    }

    /// One layer's attention: Q/K/V of every token, its K/V into the cache, causal attention,
    /// the output projection [→ RMSNorm], added to the residual `s.x`.
    #[inline]
    fn attention_block(
        &self,
        layer: &Layer,
        kv: &mut KvCache,
        li: usize,
        mm: &mut MatmulCtx,
        s: &mut Scratch,
        tp: &mut TpCtx,
    ) -> Result<(), ExecutorError> {
        self.project_qkv(layer, mm, s)?;
        let (kc, vc) = kv.layer_kv_mut(li);
        self.write_kv(kc, vc, s);
        self.attend(layer.window, kc, vc, mm, s)?;
        let n = self.plan.len();
        tp.whole(&mut s.attn, n)?;
        layer.wo.forward(&s.attn, n, mm, &mut [&mut s.proj])?;
        tp.whole(&mut s.proj, n)?;
        if let Some(w) = &layer.post_attn_norm {
            rms_norm_in_place(&mut s.proj, w, self.cfg.rms_eps, &mut s.h);
        }
        add_in_place(&mut s.x, &s.proj);
        Ok(())
    }

    /// RMSNorm → Q/K/V [+ biases] [→ per-head Q/K RMSNorm] → RoPE, into `s.q`, `s.k`, `s.v`.
    #[inline]
    fn project_qkv(&self, layer: &Layer, mm: &mut MatmulCtx, s: &mut Scratch) -> Result<(), ExecutorError> {
        let cfg = self.cfg;
        let (hd, q_dim, kv_dim) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim());
        rms_norm(&s.x, &layer.attn_norm, cfg.rms_eps, &mut s.h);
        layer.qkv.forward(&s.h, self.plan.len(), mm, &mut [&mut s.q, &mut s.k, &mut s.v])?;
        if let Some([bq, bk, bv]) = &layer.qkv_bias {
            for (x, b) in [(&mut s.q, bq), (&mut s.k, bk), (&mut s.v, bv)] {
                for row in x.chunks_exact_mut(b.len()) {
                    add_in_place(row, b);
                }
            }
        }
        if let Some([wq, wk]) = &layer.qk_norm {
            rms_norm_in_place(&mut s.q, wq, cfg.rms_eps, &mut s.h);
            rms_norm_in_place(&mut s.k, wk, cfg.rms_eps, &mut s.h);
        }
        let rope =
            self.ropes.get(layer.rope).ok_or_else(|| ExecutorError::Model("layer without a RoPE table".into()))?;
        let rope_fn = self.rope_fn;
        for (t, tp) in self.plan.iter().enumerate() {
            let cos = rope.cos.get(tp.pos * hd / 2..(tp.pos + 1) * hd / 2).unwrap_or(&[]);
            let sin = rope.sin.get(tp.pos * hd / 2..(tp.pos + 1) * hd / 2).unwrap_or(&[]);
            for head in s.q[t * q_dim..(t + 1) * q_dim].chunks_exact_mut(hd) {
                rope_fn(head, cos, sin);
            }
            for head in s.k[t * kv_dim..(t + 1) * kv_dim].chunks_exact_mut(hd) {
                rope_fn(head, cos, sin);
            }
        }
        Ok(())
    }

    /// Write K/V of every token into its slot of the layer's cache (the plan checked block
    /// ids and tables).
    #[inline]
    fn write_kv(&self, kc: &mut [f32], vc: &mut [f32], s: &Scratch) {
        let (bs, kv_dim) = (self.block_size, self.cfg.kv_dim());
        let (slot_width, first) = (self.kv_stride * self.cfg.head_dim, self.kv_first * self.cfg.head_dim);
        for (t, tp) in self.plan.iter().enumerate() {
            let c = &self.chunks[tp.chunk];
            let block = c.block_ids[tp.pos / bs] as usize;
            let off = (block * bs + tp.pos % bs) * slot_width + first;
            kc[off..off + kv_dim].copy_from_slice(&s.k[t * kv_dim..(t + 1) * kv_dim]);
            vc[off..off + kv_dim].copy_from_slice(&s.v[t * kv_dim..(t + 1) * kv_dim]);
        }
    }

    /// Causal attention of each token over its own request's positions `first..=pos` (`first`
    /// is 0 unless the layer slides a `window`), one (token, KV group) per work item (claimed
    /// dynamically: later tokens attend further), into `s.attn`. A work item computes the
    /// group's query heads together, so each key and value vector is read once for them
    /// ([`attention::attend_group`]; every head keeps its arithmetic). Steps with fewer than
    /// four such items per thread take one (token, head) per item, so a long-context decode of
    /// one request still spreads over the threads (a model with one KV head would otherwise
    /// run its attention on one).
    #[inline]
    fn attend(
        &self,
        window: Option<usize>,
        kc: &[f32],
        vc: &[f32],
        mm: &MatmulCtx,
        s: &mut Scratch,
    ) -> Result<(), ExecutorError> {
        let cfg = self.cfg;
        let (hd, nh, nkv) = (cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let group = nh / nkv;
        let scale = cfg.recipe.attention_scale;
        let (plan, slots) = (self.plan, self.slots);
        let (stride, first_head) = (self.kv_stride, self.kv_first);
        // sized, not cleared: every head's output is written below
        s.attn.resize(plan.len() * cfg.q_dim(), 0.0);
        let q = &s.q;
        // heads per work item: the whole KV group, unless that leaves too few items to share
        // among the threads (a decode step of one or two requests), then one head as before
        let per_item = if plan.len() * nkv >= 4 * mm.pool.n_threads() { group } else { 1 };
        let (iw, per_token) = (per_item * hd, nh / per_item);
        let ok = mm.pool.par_chunks_mut(&mut s.attn, iw, |item, out| {
            let (t, i) = (item / per_token, item % per_token);
            let g = i * per_item / group;
            let tp = &plan[t];
            let slot = &slots[tp.chunk][..];
            let first = window.map_or(0, |w| (tp.pos + 1).saturating_sub(w));
            let n = tp.pos + 1 - first;
            attention::with_group_scratch(per_item * n, n, |scores, offs| {
                for (j, o) in offs.iter_mut().enumerate() {
                    *o = (slot[j + first] * stride + first_head + g) * hd;
                }
                attention::attend_group(&q[item * iw..(item + 1) * iw], kc, vc, offs, scale, scores, out);
            });
        });
        if !ok {
            return Err(ExecutorError::Model("attention worker panicked".into()));
        }
        Ok(())
    }

    /// One layer's MLP: RMSNorm → SiLU- or GELU-gated gate/up → down [→ RMSNorm], added to the
    /// residual `s.x`.
    #[inline]
    fn mlp_block(
        &self,
        layer: &Layer,
        mm: &mut MatmulCtx,
        s: &mut Scratch,
        tp: &mut TpCtx,
    ) -> Result<(), ExecutorError> {
        let (cfg, n) = (self.cfg, self.plan.len());
        rms_norm(&s.x, &layer.ffn_norm, cfg.rms_eps, &mut s.h);
        layer.gate_up.forward(&s.h, n, mm, &mut [&mut s.gate, &mut s.up])?;
        // element-wise, so any split gives the same bits; one row per work item
        let (up, ff) = (&s.up, cfg.ffn_dim);
        let act: fn(&mut [f32], &[f32]) = match cfg.recipe.activation {
            Activation::Silu => crate::simd::silu_mul,
            Activation::GeluTanh => gelu_tanh_mul,
        };
        let ok = mm.pool.par_chunks_mut(&mut s.gate, ff, |c, g| act(g, &up[c * ff..][..g.len()]));
        if !ok {
            return Err(ExecutorError::Model("activation worker panicked".into()));
        }
        tp.whole(&mut s.gate, n)?;
        layer.down.forward(&s.gate, n, mm, &mut [&mut s.proj])?;
        tp.whole(&mut s.proj, n)?;
        if let Some(w) = &layer.post_ffn_norm {
            rms_norm_in_place(&mut s.proj, w, cfg.rms_eps, &mut s.h);
        }
        add_in_place(&mut s.x, &s.proj);
        Ok(())
    }
}

/// The chunks that sample (in order), with the hidden state of each one's last token copied
/// from `x` into `last` (`[n_sampled, h]`).
fn last_rows_of_sampling_chunks<'c>(
    chunks: &'c [ScheduledChunk],
    h: usize,
    x: &[f32],
    last: &mut Vec<f32>,
) -> Vec<&'c ScheduledChunk> {
    let mut sampling_chunks = Vec::new();
    last.clear();
    let mut row_start = 0usize;
    for c in chunks {
        let len = c.token_ids.len();
        if c.sample && len > 0 {
            let row = row_start + len - 1;
            last.extend_from_slice(&x[row * h..(row + 1) * h]);
            sampling_chunks.push(c);
        }
        row_start += len;
    }
    sampling_chunks
}

/// The token each sampling chunk draws from its row of `logits` (`[n_sampled, vocab]`),
/// under its grammar's mask where it has one; the grammars advance by the drawn tokens.
/// Requests sample independently (a seeded draw depends only on the request's seed and output
/// index), so they run on the pool: random sampling over a 49k vocabulary costs about as much
/// as a decode token's attention.
fn sample_chunks(
    mm: &MatmulCtx,
    guide: &mut pdmesh_guided::Guide,
    logits: &[f32],
    vocab: usize,
    sampling_chunks: &[&ScheduledChunk],
    eos: u32,
) -> Result<Vec<SampledToken>, ExecutorError> {
    let m = sampling_chunks.len();
    let masks = crate::guided::masks(guide, sampling_chunks);
    let mut drawn: Vec<Option<Result<sampling::Sampled, sampling::SamplingError>>> = (0..m).map(|_| None).collect();
    let masks_ref = &masks;
    let ok = mm.pool.par_chunks_mut(&mut drawn, 1, |i, slot| {
        if let (Some(row), Some(c), Some(slot)) =
            (logits.get(i * vocab..(i + 1) * vocab), sampling_chunks.get(i), slot.first_mut())
        {
            let mask = masks_ref.get(i).and_then(Option::as_ref);
            *slot = Some(crate::guided::sample_masked(row, c, mask, eos));
        }
    });
    if !ok {
        return Err(ExecutorError::Model("sampling worker panicked".into()));
    }
    let mut out = Vec::with_capacity(m);
    for (c, sampled) in sampling_chunks.iter().zip(drawn) {
        let sampled = sampled
            .ok_or_else(|| ExecutorError::Model("a sampling row was not computed".into()))?
            .map_err(|e| ExecutorError::Model(e.to_string()))?;
        if c.sampling.guided.is_some() {
            guide.commit(&c.request_id, sampled.token_id);
        }
        out.push(SampledToken {
            request_id: c.request_id.clone(),
            token_id: sampled.token_id,
            logprobs: sampled.logprobs,
        });
    }
    Ok(out)
}

impl Executor for GgufExecutor {
    fn facts(&self) -> &ModelFacts {
        &self.facts
    }

    fn execute(&mut self, kv: &mut KvCache, chunks: &[ScheduledChunk]) -> Result<Vec<SampledToken>, ExecutorError> {
        // every TP rank checks the same step the same way, so a refused step is refused by
        // all of them before any gather
        let plan = plan_step(&self.cfg, self.facts.max_model_len as usize, kv, chunks)?;
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        let out = self.forward(kv, chunks, &plan);
        self.mm.pool.rest();
        match (out, &self.tp.group) {
            // failed part-way: the other ranks may wait in a gather this rank never reaches,
            // and the group's rounds no longer line up: the group stops and restarts whole
            (Err(e), Some(group)) => {
                group.poison();
                Err(if e.is_device_lost() {
                    e
                } else {
                    ExecutorError::DeviceLost(format!("TP rank's step failed: {e}"))
                })
            }
            (out, _) => out,
        }
    }

    fn release(&mut self, request_ids: &[String]) {
        self.guide.release(request_ids);
    }
}

/// Check a step before touching the cache (token ids, positions against `max_len`, block
/// tables, cache geometry) so bad input is an [`ExecutorError`], never a panic or an
/// out-of-bounds write; returns the per-token plan. Shared by the CPU and GPU executors.
pub(crate) fn plan_step(
    cfg: &ModelConfig,
    max_len: usize,
    kv: &KvCache,
    chunks: &[ScheduledChunk],
) -> Result<Vec<TokenPlan>, ExecutorError> {
    let spec = *kv.spec();
    if spec.num_layers as usize != cfg.n_layers
        || spec.num_kv_heads as usize != cfg.n_kv_heads
        || spec.head_dim as usize != cfg.head_dim
        || spec.block_size == 0
    {
        return Err(ExecutorError::Model(format!(
            "KV cache geometry {spec:?} does not fit the model ({} layers, {} kv heads, head_dim {})",
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        )));
    }
    let bs = spec.block_size as usize;
    let vocab = cfg.vocab_size as u32;
    let mut plan = Vec::with_capacity(chunks.iter().map(|c| c.token_ids.len()).sum());
    for (ci, c) in chunks.iter().enumerate() {
        if c.token_ids.is_empty() {
            if c.sample {
                return Err(ExecutorError::Model(format!("request {}: empty chunk cannot sample", c.request_id)));
            }
            continue;
        }
        if let Some(&token) = c.token_ids.iter().find(|&&t| t >= vocab) {
            return Err(ExecutorError::TokenOutOfRange { token, vocab });
        }
        let start = c.start_pos as usize;
        let end = start + c.token_ids.len();
        if end > max_len {
            return Err(ExecutorError::Model(format!(
                "request {}: position {} is beyond max_model_len {max_len}",
                c.request_id,
                end - 1
            )));
        }
        let needed = end.div_ceil(bs);
        if c.block_ids.len() < needed {
            return Err(ExecutorError::BlockTableTooShort { request_id: c.request_id.clone(), pos: (end - 1) as u32 });
        }
        for &b in c.block_ids.iter().take(needed) {
            kv.check_block(b)?;
        }
        plan.extend((start..end).map(|pos| TokenPlan { pos, chunk: ci }));
    }
    Ok(plan)
}

// ---- element-wise pieces (numerics mirror candle's ops used by quantized_llama) -------------

/// `cos`/`sin` tables for positions `0..max_len`: `theta_i = base^(-2i/d)`, angle = `pos * theta_i`,
/// computed in f32 exactly as candle-transformers' `precomput_freqs_cis`.
pub(crate) fn rope_tables(head_dim: usize, base: f32, max_len: usize) -> (Vec<f32>, Vec<f32>) {
    let theta: Vec<f32> = (0..head_dim).step_by(2).map(|i| 1f32 / base.powf(i as f32 / head_dim as f32)).collect();
    let mut cos = Vec::with_capacity(max_len * theta.len());
    let mut sin = Vec::with_capacity(max_len * theta.len());
    for pos in 0..max_len {
        for &t in &theta {
            let a = pos as f32 * t;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

/// Interleaved RoPE (candle `rope_i`): rotate pairs `(x[2i], x[2i+1])` by angle `i`.
fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for ((pair, &c), &s) in x.chunks_exact_mut(2).zip(cos).zip(sin) {
        let (x0, x1) = (pair[0], pair[1]);
        pair[0] = x0 * c - x1 * s;
        pair[1] = x0 * s + x1 * c;
    }
}

/// `gate = gelu(gate) * up`, GELU in its tanh form exactly as candle's `gelu` op computes it
/// for f32 (`0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²)))`), which is also Gemma's
/// `gelu_pytorch_tanh`.
pub(crate) fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    // candle's constant, to the last bit
    #[allow(clippy::excessive_precision)]
    const SQRT_TWO_OVER_PI: f32 = 0.797_884_560_802_865_355_879_892_119_868_763_737;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + f32::tanh(SQRT_TWO_OVER_PI * x * (1.0 + 0.044715 * x * x))) * u;
    }
}

/// NeoX RoPE (candle `rope`): rotate pairs `(x[i], x[i + d/2])` by angle `i`.
fn rope_neox(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let (lo, hi) = x.split_at_mut(x.len() / 2);
    for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(cos).zip(sin) {
        let (x0, x1) = (*a, *b);
        *a = x0 * c - x1 * s;
        *b = x0 * s + x1 * c;
    }
}

/// [`rms_norm`] of every `w.len()`-wide row of `x`, written back into `x` (`tmp` is scratch):
/// the per-head Q/K norms and the post-norms.
fn rms_norm_in_place(x: &mut Vec<f32>, w: &[f32], eps: f32, tmp: &mut Vec<f32>) {
    rms_norm(x, w, eps, tmp);
    std::mem::swap(x, tmp);
}

/// Row-wise RMSNorm as candle's `rms_norm`: `x / sqrt(mean(x²) + eps) * w`.
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut Vec<f32>) {
    let d = w.len();
    out.clear();
    out.resize(x.len(), 0.0);
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let sum2: f32 = xr.iter().map(|v| v * v).sum();
        let m = (sum2 / d as f32 + eps).sqrt();
        for ((o, &v), &a) in or.iter_mut().zip(xr).zip(w) {
            *o = v / m * a;
        }
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
