//! Our matmul kernels behind a small public surface, for `examples/kernels.rs` (which times
//! them against candle's `QMatMul` at real model shapes). Not part of the crate's API: hidden
//! from the docs and free to change.

use candle_core::quantized::GgmlDType;

use crate::kernels::{self, Impl, Packed, QActs};
use crate::pool::Pool;

/// One weight matrix packed for our kernels, with its own thread pool and activation buffers.
pub struct KernelMatmul {
    w: Packed,
    acts: QActs,
    pool: Pool,
    imp: Impl,
}

impl std::fmt::Debug for KernelMatmul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelMatmul").field("w", &self.w.type_name()).field("imp", &self.imp).finish_non_exhaustive()
    }
}

impl KernelMatmul {
    /// Pack `[rows, k]` raw GGUF data of `dtype` (moved to huge pages as the executor does);
    /// `None` for a type or shape our kernels do not take.
    pub fn new(dtype: GgmlDType, raw: &[u8], rows: usize, k: usize, threads: usize) -> Option<Self> {
        let mut w = Packed::from_gguf(dtype, raw, rows, k)?;
        // on failure the matrix keeps its own memory: same results
        let _ = kernels::gather_weights(&mut [&mut w]);
        Some(Self { w, acts: QActs::default(), pool: Pool::new(threads, 0), imp: Impl::detect() })
    }

    /// The implementation in use (`PDMESH_MODEL_KERNELS` can force one).
    pub fn implementation(&self) -> String {
        format!("{:?}", self.imp)
    }

    /// `out[m, rows] = x[m, k] · Wᵀ`, the activation quantization included (as a
    /// `LinearSet::forward` of one matrix does).
    pub fn forward(&mut self, x: &[f32], m: usize, out: &mut Vec<f32>) -> Result<(), String> {
        let (rows, k) = (self.w.rows(), self.w.k());
        self.acts.prepare(x, m, k, self.w.needs(), &self.pool);
        out.clear();
        out.resize(m * rows, 0.0);
        kernels::matmul(&self.w, &self.acts, out, self.imp, &self.pool).map_err(|e| e.0)
    }
}
