//! Token embedding lookup that keeps the table quantized.
//!
//! SmolLM2's `token_embd` is Q8_0 (49152 × 576): 30 MB quantized but 113 MB as f32; Gemma 3's
//! is 262144 × 640 (Q8_0, 178 MB; 671 MB as f32) and Qwen2.5's 151936 × 896 (Q5_0 or Q8_0).
//! Since a step only needs a few rows, rows are dequantized on demand from the raw GGUF blocks,
//! with the same operations per value as candle's `to_float` (bit-identical to dequantizing
//! the whole table). Every type the matmuls support has a row decoder; any other type is
//! refused at load ([`ModelError::UnsupportedTensorType`]), never expanded to a dense copy.

use candle_core::quantized::{GgmlDType, QTensor};
use half::{bf16, f16};

use crate::error::ModelError;
use crate::kquants::{self, Kind};

/// Raw GGUF blocks of a format with a row decoder below.
struct Table {
    dtype: GgmlDType,
    bytes: Vec<u8>,
    row_bytes: usize,
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
        crate::linear::check_supported(name, dtype)?;
        if !hidden.is_multiple_of(dtype.block_size()) {
            return Err(bad(format!("{hidden} values per row is not a whole number of {dtype:?} blocks")));
        }
        let row_bytes = hidden / dtype.block_size() * dtype.type_size();
        let bytes = qt.data().map_err(|e| bad(e.to_string()))?.into_owned();
        if bytes.len() != row_bytes * vocab {
            return Err(bad(format!("{} data bytes, expected {}", bytes.len(), row_bytes * vocab)));
        }
        let table = Table { dtype, bytes, row_bytes };
        Ok(Self { vocab, hidden, table })
    }

    /// Write row `id` into `out` (`hidden` values). The caller has range-checked `id`.
    pub fn row_into(&self, id: usize, out: &mut [f32]) {
        let Table { dtype, bytes, row_bytes } = &self.table;
        let Some(row) = bytes.get(id * row_bytes..(id + 1) * row_bytes) else { return };
        decode_row(*dtype, row, out);
    }
}

/// Dequantize one row of raw GGUF data of type `dtype` into `out`, as candle's `to_float`.
pub(crate) fn decode_row(dtype: GgmlDType, row: &[u8], out: &mut [f32]) {
    if let Some(kind) = Kind::from_dtype(dtype) {
        kquants::dequantize_row(kind, row, out);
        return;
    }
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
        GgmlDType::BF16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
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
        // refused by `Embedding::new`
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn table(dtype: GgmlDType, vocab: usize, hidden: usize) -> QTensor {
        let vals: Vec<f32> = (0..vocab * hidden)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.003 * (1.0 + (i % 17) as f32 * 0.1))
            .collect();
        let t = Tensor::from_vec(vals, (vocab, hidden), &Device::Cpu).unwrap();
        QTensor::quantize(&t, dtype).unwrap()
    }

    #[test]
    fn rows_equal_candle_dequantize_for_every_supported_type() {
        let (vocab, hidden) = (7, 512);
        for dtype in crate::linear::SUPPORTED {
            let qt = table(dtype, vocab, hidden);
            let want = qt.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let e = Embedding::new("token_embd.weight", &qt).unwrap();
            let mut row = vec![f32::NAN; hidden];
            for id in [0, 3, vocab - 1] {
                e.row_into(id, &mut row);
                let got: Vec<u32> = row.iter().map(|v| v.to_bits()).collect();
                let exp: Vec<u32> = want[id * hidden..(id + 1) * hidden].iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, exp, "{dtype:?} row {id}");
            }
        }
    }

    #[test]
    fn unsupported_table_type_is_refused_naming_the_tensor() {
        let qt = table(GgmlDType::Q3K, 2, 256);
        let err = Embedding::new("token_embd.weight", &qt).unwrap_err();
        assert!(
            matches!(&err, ModelError::UnsupportedTensorType { name, dtype } if name == "token_embd.weight" && dtype == "Q3K"),
            "{err}"
        );
        assert!(err.to_string().contains("token_embd.weight"), "{err}");
    }
}
