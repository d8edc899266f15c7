//! Weight matrices and the batched matmul `y[m, rows] = x[m, cols] · Wᵀ`.
//!
//! Every projection of a step runs as one matmul over all the step's tokens (`m` rows of `x`),
//! so the weights stream from memory once per step, not once per request. Q4_1 and Q8_0
//! matrices (all of SmolLM2) go through our kernels ([`crate::kernels`]); any other GGUF type
//! falls back to candle's `QMatMul`, which computes the same thing more slowly.
//!
//! Projections that read the same input (Q/K/V, gate/up) are fused into one matrix when their
//! row counts allow, so they cost one activation quantization and one parallel region.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use pdmesh_model_api::ExecutorError;

use crate::error::ModelError;
use crate::kernels::{self, Impl, Packed, PackedQ4_1, PackedQ8_0, QActs};
use crate::pool::Pool;

/// One weight matrix `[rows (out), cols (in)]`, as stored in the GGUF file.
pub(crate) enum Linear {
    Packed(Packed),
    Candle { rows: usize, cols: usize, qmm: QMatMul },
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Linear::Packed(Packed::Q4_1(_)) => "q4_1",
            Linear::Packed(Packed::Q8_0(_)) => "q8_0",
            Linear::Candle { .. } => "candle",
        };
        f.debug_struct("Linear").field("rows", &self.rows()).field("cols", &self.cols()).field("kind", &kind).finish()
    }
}

/// Shared per-executor state for matmuls: the thread pool and reusable buffers.
pub(crate) struct MatmulCtx {
    pub pool: Pool,
    pub imp: Impl,
    acts: QActs,
    fused: Vec<f32>,
}

impl MatmulCtx {
    pub fn new(threads: usize, nice: i32) -> Self {
        Self { pool: Pool::new(threads, nice), imp: Impl::detect(), acts: QActs::default(), fused: Vec::new() }
    }
}

fn model_err(e: impl std::fmt::Display) -> ExecutorError {
    ExecutorError::Model(e.to_string())
}

impl Linear {
    pub fn new(name: &str, qt: QTensor) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::InvalidTensor { name: name.to_string(), reason };
        let (rows, cols) = match qt.shape().dims() {
            [r, c] => (*r, *c),
            other => return Err(bad(format!("expected a matrix, got {other:?}"))),
        };
        // PDMESH_MODEL_KERNELS=candle: use candle's QMatMul for everything (same bits, slower;
        // for comparisons and as an escape hatch).
        let candle_only = std::env::var("PDMESH_MODEL_KERNELS").as_deref() == Ok("candle");
        let packed = match qt.dtype() {
            GgmlDType::Q4_1 | GgmlDType::Q8_0 if !candle_only => {
                let raw = qt.data().map_err(|e| bad(e.to_string()))?;
                match qt.dtype() {
                    GgmlDType::Q4_1 => PackedQ4_1::from_gguf_bytes(&raw, rows, cols).map(Packed::Q4_1),
                    _ => PackedQ8_0::from_gguf_bytes(&raw, rows, cols).map(Packed::Q8_0),
                }
            }
            _ => None,
        };
        match packed {
            Some(p) => Ok(Linear::Packed(p)),
            None => {
                let qmm = QMatMul::from_arc(Arc::new(qt)).map_err(|e| bad(e.to_string()))?;
                Ok(Linear::Candle { rows, cols, qmm })
            }
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            Linear::Packed(p) => p.rows(),
            Linear::Candle { rows, .. } => *rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Linear::Packed(p) => p.k(),
            Linear::Candle { cols, .. } => *cols,
        }
    }

    /// `out[m, rows] = x[m, cols] · Wᵀ`; `out` is resized. For packed weights, `ctx.acts` must
    /// already hold `x` quantized (see [`LinearSet::forward`]).
    fn forward_quantized(
        &self,
        x: &[f32],
        m: usize,
        ctx: &mut MatmulCtx,
        out: &mut Vec<f32>,
    ) -> Result<(), ExecutorError> {
        let rows = self.rows();
        out.clear();
        out.resize(m * rows, 0.0);
        match self {
            Linear::Packed(p) => kernels::matmul(p, &ctx.acts, out, ctx.imp, &ctx.pool).map_err(|e| model_err(e.0)),
            Linear::Candle { cols, qmm, .. } => {
                let xt = Tensor::from_slice(x, (m, *cols), &Device::Cpu).map_err(model_err)?;
                let y = qmm
                    .forward(&xt)
                    .and_then(|y| y.flatten_all())
                    .and_then(|y| y.to_vec1::<f32>())
                    .map_err(model_err)?;
                if y.len() != out.len() {
                    return Err(model_err(format!(
                        "candle matmul returned {} values, expected {}",
                        y.len(),
                        out.len()
                    )));
                }
                out.copy_from_slice(&y);
                Ok(())
            }
        }
    }
}

/// Projections of the same input, fused into one matrix when possible.
pub(crate) struct LinearSet {
    /// The fused matrix, when every part is packed and fills whole row groups.
    fused: Option<Linear>,
    /// The separate matrices, when not fused. Once fused they are dropped: the fused matrix
    /// holds their rows, and keeping them would hold every fused layer's weights twice.
    parts: Vec<Linear>,
    /// Rows of each part, in order: the width of each output.
    part_rows: Vec<usize>,
    cols: usize,
}

impl std::fmt::Debug for LinearSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinearSet")
            .field("fused", &self.fused)
            .field("parts", &self.parts)
            .field("part_rows", &self.part_rows)
            .finish()
    }
}

impl LinearSet {
    pub fn new(parts: Vec<Linear>) -> Self {
        let part_rows = parts.iter().map(Linear::rows).collect();
        let cols = parts.first().map_or(0, Linear::cols);
        let packed: Option<Vec<&Packed>> = parts
            .iter()
            .map(|p| match p {
                Linear::Packed(p) => Some(p),
                Linear::Candle { .. } => None,
            })
            .collect();
        let fused = match packed {
            Some(ps) if ps.len() > 1 => Packed::concat(&ps).map(Linear::Packed),
            _ => None,
        };
        let parts = if fused.is_some() { Vec::new() } else { parts };
        Self { fused, parts, part_rows, cols }
    }

    pub fn single(l: Linear) -> Self {
        Self::new(vec![l])
    }

    /// The packed matrices a forward pass reads: the fused one, else each packed part.
    pub fn packed_mut(&mut self) -> Vec<&mut Packed> {
        match &mut self.fused {
            Some(Linear::Packed(p)) => vec![p],
            _ => self
                .parts
                .iter_mut()
                .filter_map(|l| match l {
                    Linear::Packed(p) => Some(p),
                    Linear::Candle { .. } => None,
                })
                .collect(),
        }
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `outs[i][m, rows_i] = x[m, cols] · W_iᵀ` for every part `i`.
    pub fn forward(
        &self,
        x: &[f32],
        m: usize,
        ctx: &mut MatmulCtx,
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), ExecutorError> {
        let cols = self.cols();
        if x.len() != m * cols || outs.len() != self.part_rows.len() {
            return Err(model_err(format!("matmul input has {} values, expected {m}x{cols}", x.len())));
        }
        if self.fused.is_some() || self.parts.iter().any(|p| matches!(p, Linear::Packed(_))) {
            let mut acts = std::mem::take(&mut ctx.acts);
            acts.quantize(x, m, cols, &ctx.pool);
            ctx.acts = acts;
        }
        match &self.fused {
            Some(fused) => {
                let mut all = std::mem::take(&mut ctx.fused);
                let r = fused.forward_quantized(x, m, ctx, &mut all);
                if r.is_ok() {
                    let total = fused.rows();
                    let mut start = 0;
                    for (&rows, out) in self.part_rows.iter().zip(outs.iter_mut()) {
                        out.clear();
                        for tok in all.chunks_exact(total) {
                            out.extend_from_slice(&tok[start..start + rows]);
                        }
                        start += rows;
                    }
                }
                ctx.fused = all;
                r
            }
            None => {
                for (part, out) in self.parts.iter().zip(outs.iter_mut()) {
                    part.forward_quantized(x, m, ctx, out)?;
                }
                Ok(())
            }
        }
    }
}
