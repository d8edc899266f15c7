//! Token embedding lookup that keeps the table quantized.
//!
//! SmolLM2's `token_embd` is Q8_0 (49152 × 576): 30 MB quantized but 113 MB as f32. Since
//! a step only needs a few rows, rows are dequantized on demand from the raw GGUF blocks. The
//! arithmetic is the same single multiply per value that candle's `to_float` does, so the
//! result is bit-identical to dequantizing the whole table. Formats without a row decoder here
//! fall back to a dense f32 copy made at load time.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use half::f16;

use crate::error::ModelError;

enum Table {
    /// Raw GGUF blocks of a format with a row decoder below.
    Blocks { dtype: GgmlDType, bytes: Vec<u8>, row_bytes: usize },
    /// Dense `[vocab, hidden]`.
    Dense(Vec<f32>),
}

/// `[vocab, hidden]` embedding table.
pub(crate) struct Embedding {
    vocab: usize,
    hidden: usize,
    table: Table,
}

impl std::fmt::Debug for Embedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedding").field("vocab", &self.vocab).field("hidden", &self.hidden).finish_non_exhaustive()
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    match b.get(i..i + 2) {
        Some(&[lo, hi]) => f16::from_le_bytes([lo, hi]).to_f32(),
        _ => 0.0,
    }
}

impl Embedding {
    pub fn new(name: &str, qt: &QTensor) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::InvalidTensor { name: name.to_string(), reason };
        let (vocab, hidden) = match qt.shape().dims() {
            [v, h] => (*v, *h),
            other => return Err(bad(format!("expected a matrix, got {other:?}"))),
        };
        let dtype = qt.dtype();
        let decodable =
            matches!(dtype, GgmlDType::Q8_0 | GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::F16 | GgmlDType::F32);
        let table = if decodable && hidden % dtype.block_size() == 0 {
            let row_bytes = hidden / dtype.block_size() * dtype.type_size();
            let bytes = qt.data().map_err(|e| bad(e.to_string()))?.into_owned();
            if bytes.len() != row_bytes * vocab {
                return Err(bad(format!("{} data bytes, expected {}", bytes.len(), row_bytes * vocab)));
            }
            Table::Blocks { dtype, bytes, row_bytes }
        } else {
            let dense = qt
                .dequantize(&Device::Cpu)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| bad(e.to_string()))?;
            Table::Dense(dense)
        };
        Ok(Self { vocab, hidden, table })
    }

    /// Write row `id` into `out` (`hidden` values). The caller has range-checked `id`.
    pub fn row_into(&self, id: usize, out: &mut [f32]) {
        let h = self.hidden;
        match &self.table {
            Table::Dense(d) => {
                if let Some(src) = d.get(id * h..(id + 1) * h) {
                    out.copy_from_slice(src);
                }
            }
            Table::Blocks { dtype, bytes, row_bytes } => {
                let Some(row) = bytes.get(id * row_bytes..(id + 1) * row_bytes) else { return };
                match dtype {
                    GgmlDType::F32 => {
                        for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        }
                    }
                    GgmlDType::F16 => {
                        for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                            *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                        }
                    }
                    GgmlDType::Q8_0 => {
                        // block: f16 d, 32 x i8
                        for (ob, blk) in out.chunks_exact_mut(32).zip(row.chunks_exact(34)) {
                            let d = f16_at(blk, 0);
                            for (o, &q) in ob.iter_mut().zip(&blk[2..]) {
                                *o = f32::from(q as i8) * d;
                            }
                        }
                    }
                    GgmlDType::Q4_0 => {
                        // block: f16 d, 16 bytes of nibbles; value = (q - 8) * d
                        for (ob, blk) in out.chunks_exact_mut(32).zip(row.chunks_exact(18)) {
                            let d = f16_at(blk, 0);
                            for (j, &q) in blk[2..].iter().enumerate() {
                                ob[j] = (i32::from(q & 0x0F) - 8) as f32 * d;
                                ob[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
                            }
                        }
                    }
                    GgmlDType::Q4_1 => {
                        // block: f16 d, f16 m, 16 bytes of nibbles; value = q * d + m
                        for (ob, blk) in out.chunks_exact_mut(32).zip(row.chunks_exact(20)) {
                            let d = f16_at(blk, 0);
                            let m = f16_at(blk, 2);
                            for (j, &q) in blk[4..].iter().enumerate() {
                                ob[j] = f32::from(q & 0x0F) * d + m;
                                ob[j + 16] = f32::from(q >> 4) * d + m;
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}
