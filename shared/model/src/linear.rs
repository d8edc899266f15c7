//! Weight matrices and the batched matmul `y[m, rows] = x[m, cols] · Wᵀ`.
//!
//! Every projection of a step runs as one matmul over all the step's tokens (`m` rows of `x`),
//! so the weights stream from memory once per step, not once per request. Every supported
//! GGUF type goes through our kernels: Q4_1 and Q8_0 in [`crate::kernels`]; Q4_0, Q5_0, Q4_K,
//! Q5_K, Q6_K, F32, F16 and BF16 in [`crate::kquants`]. Any other type is refused at load
//! ([`ModelError::UnsupportedTensorType`]). candle's `QMatMul` remains for
//! `PDMESH_MODEL_KERNELS=candle` (comparisons) and a shape our kernels do not take (a float
//! matrix whose rows are not a multiple of 8 values).
//!
//! Projections that read the same input (Q/K/V, gate/up) are fused into one matrix when they
//! share one packed type and their row counts allow, so they cost one parallel region. Parts of
//! different types (a Q5_0 Q/K with a Q8_0 V) run as separate matmuls over one set of
//! activations, quantized once in every form the parts need.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use pdmesh_model_api::ExecutorError;

use crate::error::ModelError;
use crate::kernels::{self, Impl, Needs, Packed, QActs};
use crate::pool::Pool;

/// One weight matrix `[rows (out), cols (in)]`, as stored in the GGUF file.
pub(crate) enum Linear {
    Packed(Packed),
    Candle { rows: usize, cols: usize, qmm: QMatMul },
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Linear::Packed(p) => p.type_name(),
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

/// The GGML types our kernels compute with ([`crate::kernels`], [`crate::kquants`]).
pub(crate) const SUPPORTED: [GgmlDType; 10] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Refuse a tensor of a type without a kernel here, naming it (a model that uses one cannot be
/// served at the speed and with the arithmetic this crate promises).
pub(crate) fn check_supported(name: &str, dtype: GgmlDType) -> Result<(), ModelError> {
    if SUPPORTED.contains(&dtype) {
        Ok(())
    } else {
        Err(ModelError::UnsupportedTensorType { name: name.to_string(), dtype: format!("{dtype:?}") })
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
        check_supported(name, qt.dtype())?;
        // PDMESH_MODEL_KERNELS=candle: use candle's QMatMul for everything (the same or nearly
        // the same bits, slower; for comparisons and as an escape hatch).
        let candle_only = std::env::var("PDMESH_MODEL_KERNELS").as_deref() == Ok("candle");
        let packed = if candle_only {
            None
        } else {
            let raw = qt.data().map_err(|e| bad(e.to_string()))?;
            Packed::from_gguf(qt.dtype(), &raw, rows, cols)
        };
        match packed {
            Some(p) => Ok(Linear::Packed(p)),
            None => {
                let qmm = QMatMul::from_arc(Arc::new(qt)).map_err(|e| bad(e.to_string()))?;
                Ok(Linear::Candle { rows, cols, qmm })
            }
        }
    }

    /// Rows `keep` of the matrix only (a TP rank's slice of its output rows): each row of a
    /// GGUF matrix is stored whole, so the slice is a byte range and every kept row computes
    /// exactly what it computes in the whole matrix.
    pub fn new_rows(name: &str, qt: QTensor, keep: std::ops::Range<usize>) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::InvalidTensor { name: name.to_string(), reason };
        let (rows, cols) = match qt.shape().dims() {
            [r, c] => (*r, *c),
            other => return Err(bad(format!("expected a matrix, got {other:?}"))),
        };
        if keep == (0..rows) {
            return Self::new(name, qt);
        }
        let dtype = qt.dtype();
        check_supported(name, dtype)?;
        if keep.start > keep.end || keep.end > rows || !cols.is_multiple_of(dtype.block_size()) {
            return Err(bad(format!("rows {keep:?} of a {rows}x{cols} {dtype:?} matrix")));
        }
        let row_bytes = cols / dtype.block_size() * dtype.type_size();
        let raw = qt.data().map_err(|e| bad(e.to_string()))?;
        let part = raw.get(keep.start * row_bytes..keep.end * row_bytes).ok_or_else(|| bad("short data".into()))?;
        let sliced =
            candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, part, vec![keep.len(), cols], &Device::Cpu)
                .map_err(|e| bad(e.to_string()))?;
        Self::new(name, sliced)
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
        // sized, not cleared: every value is overwritten below (see `size_for_overwrite`)
        size_for_overwrite(out, m * rows);
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

/// Give `out` exactly `n` values for a matmul to overwrite, without zero-filling the ones it
/// already has: every matmul writes every value of its output, and clearing then refilling a
/// reused buffer (37 MB for Qwen2.5-1.5B's gate/up at 512 tokens) was serial time each layer.
fn size_for_overwrite(out: &mut Vec<f32>, n: usize) {
    out.resize(n, 0.0);
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
        let needs = self
            .fused
            .iter()
            .chain(&self.parts)
            .filter_map(|l| match l {
                Linear::Packed(p) => Some(p.needs()),
                Linear::Candle { .. } => None,
            })
            .fold(Needs::default(), Needs::union);
        if needs != Needs::default() {
            let mut acts = std::mem::take(&mut ctx.acts);
            acts.prepare(x, m, cols, needs, &ctx.pool);
            ctx.acts = acts;
        }
        match &self.fused {
            Some(Linear::Packed(p)) => {
                // straight into the parts (no [m, rows] matrix copied apart)
                let mut dsts = Vec::with_capacity(outs.len());
                for (&rows, out) in self.part_rows.iter().zip(outs.iter_mut()) {
                    size_for_overwrite(out, m * rows);
                    dsts.push(out.as_mut_slice());
                }
                kernels::matmul_parts(p, &ctx.acts, &mut dsts, ctx.imp, &ctx.pool).map_err(|e| model_err(e.0))
            }
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

#[cfg(test)]
mod tests {
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    use super::*;

    fn qtensor(dtype: GgmlDType, rows: usize, cols: usize, seed: usize) -> QTensor {
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| (((i + seed) * 7919 % 1013) as f32 - 506.0) * 0.001 * (1.0 + (i % 11) as f32 * 0.1))
            .collect();
        QTensor::quantize(&Tensor::from_vec(vals, (rows, cols), &Device::Cpu).unwrap(), dtype).unwrap()
    }

    fn run(set: &LinearSet, x: &[f32], m: usize, ctx: &mut MatmulCtx) -> Vec<Vec<f32>> {
        let mut outs = vec![Vec::new(); set.part_rows.len()];
        {
            let mut refs: Vec<&mut Vec<f32>> = outs.iter_mut().collect();
            set.forward(x, m, ctx, &mut refs).unwrap();
        }
        outs
    }

    #[test]
    fn unsupported_types_are_refused_naming_the_tensor() {
        for dtype in [GgmlDType::Q2K, GgmlDType::Q3K, GgmlDType::Q5_1] {
            let err = Linear::new("blk.3.ffn_down.weight", qtensor(dtype, 16, 256, 1)).unwrap_err();
            match &err {
                ModelError::UnsupportedTensorType { name, dtype: d } => {
                    assert_eq!(name, "blk.3.ffn_down.weight");
                    assert_eq!(d, &format!("{dtype:?}"));
                }
                other => panic!("{dtype:?}: {other}"),
            }
            assert!(err.to_string().contains("blk.3.ffn_down.weight"), "{err}");
        }
    }

    #[test]
    fn every_supported_type_is_packed_for_our_kernels() {
        for dtype in SUPPORTED {
            let l = Linear::new("w", qtensor(dtype, 16, 512, 2)).unwrap();
            assert!(matches!(l, Linear::Packed(_)), "{dtype:?}: {l:?}");
        }
    }

    #[test]
    fn mixed_type_parts_run_separately_on_one_quantization_and_equal_lone_matmuls() {
        let (k, m) = (512, 3);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 31 % 97) as f32 - 48.0) * 0.01).collect();
        let mut ctx = MatmulCtx::new(2, 0);
        // Q5_0 q/k with a Q8_0 v (Qwen2.5), a K-quant and a float part in one set
        let types = [GgmlDType::Q5_0, GgmlDType::Q5_0, GgmlDType::Q8_0, GgmlDType::Q6K, GgmlDType::F16];
        let parts = |seed| {
            types
                .iter()
                .enumerate()
                .map(|(i, &t)| Linear::new("w", qtensor(t, 16, k, seed + i)).unwrap())
                .collect::<Vec<_>>()
        };
        let set = LinearSet::new(parts(10));
        assert!(set.fused.is_none(), "parts of different types are not fused");
        let got = run(&set, &x, m, &mut ctx);
        for (i, lone) in parts(10).into_iter().enumerate() {
            let want = run(&LinearSet::single(lone), &x, m, &mut ctx);
            let (g, w): (Vec<u32>, Vec<u32>) =
                (got[i].iter().map(|v| v.to_bits()).collect(), want[0].iter().map(|v| v.to_bits()).collect());
            assert_eq!(g, w, "part {i} ({:?})", types[i]);
        }
        // parts of one type are fused, with the same bits
        let same =
            || (0..3).map(|i| Linear::new("w", qtensor(GgmlDType::Q4K, 16, k, 40 + i)).unwrap()).collect::<Vec<_>>();
        let fused = LinearSet::new(same());
        assert!(fused.fused.is_some());
        let got = run(&fused, &x, m, &mut ctx);
        for (i, lone) in same().into_iter().enumerate() {
            let want = run(&LinearSet::single(lone), &x, m, &mut ctx);
            assert_eq!(
                got[i].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}
