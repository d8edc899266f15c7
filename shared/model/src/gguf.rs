//! Opening a GGUF file: header, typed metadata access and the weights id (the hyper-parameters
//! are each architecture's business: `crate::arch`).
//!
//! Parsing is candle's `gguf_file::Content`, which bounds-checks every length in the header
//! against the file size, so a corrupt or truncated file is an error, never a huge allocation or
//! a panic. Everything here maps candle's stringly errors onto [`ModelError`] variants.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;
use sha2::{Digest, Sha256};

use crate::error::ModelError;

/// An opened GGUF file: its parsed header and a reader positioned anywhere.
pub(crate) struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    reader: BufReader<File>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile").field("path", &self.path).finish_non_exhaustive()
    }
}

fn open_file(path: &Path) -> Result<File, ModelError> {
    File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ModelError::NotFound { path: path.to_path_buf() },
        _ => ModelError::Io { path: path.to_path_buf(), source: e },
    })
}

impl GgufFile {
    /// Open `path` and parse the GGUF header (metadata and tensor table; no tensor data).
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = open_file(path)?;
        if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
            return Err(ModelError::InvalidGguf { path: path.to_path_buf(), reason: "is a directory".into() });
        }
        let mut reader = BufReader::new(file);
        if alignment_is_zero(&mut reader) {
            return Err(ModelError::InvalidGguf {
                path: path.to_path_buf(),
                reason: "`general.alignment` is 0 (tensor data cannot be aligned to 0 bytes)".into(),
            });
        }
        reader.seek(std::io::SeekFrom::Start(0)).map_err(|e| ModelError::Io { path: path.to_path_buf(), source: e })?;
        let content = Content::read(&mut reader)
            .map_err(|e| ModelError::InvalidGguf { path: path.to_path_buf(), reason: e.to_string() })?;
        Ok(Self { path: path.to_path_buf(), content, reader })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Shape of a tensor as candle reports it: `[rows (out), cols (in)]` for a matrix.
    pub fn tensor_dims(&self, name: &str) -> Result<Vec<usize>, ModelError> {
        self.content
            .tensor_infos
            .get(name)
            .map(|t| t.shape.dims().to_vec())
            .ok_or_else(|| ModelError::MissingTensor { name: name.to_string() })
    }

    /// Read one tensor's data.
    pub fn tensor(&mut self, name: &str) -> Result<QTensor, ModelError> {
        if !self.has_tensor(name) {
            return Err(ModelError::MissingTensor { name: name.to_string() });
        }
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| ModelError::InvalidTensor { name: name.to_string(), reason: e.to_string() })
    }

    /// Read a tensor and check its shape.
    pub fn tensor_with_dims(&mut self, name: &str, dims: &[usize]) -> Result<QTensor, ModelError> {
        let got = self.tensor_dims(name)?;
        if got != dims {
            return Err(ModelError::InvalidTensor {
                name: name.to_string(),
                reason: format!("shape {got:?}, expected {dims:?}"),
            });
        }
        self.tensor(name)
    }
}

/// Whether the header's metadata sets `general.alignment` to 0, which candle's parser divides
/// by (a panic; found by the `gguf` fuzz target). A walk over the key/value section only,
/// skipping values by their sizes; anything it cannot read is left for candle to report.
fn alignment_is_zero(r: &mut BufReader<File>) -> bool {
    fn u32_of(r: &mut impl Read) -> Option<u32> {
        let mut b = [0u8; 4];
        r.read_exact(&mut b).ok().map(|_| u32::from_le_bytes(b))
    }
    fn u64_of(r: &mut impl Read) -> Option<u64> {
        let mut b = [0u8; 8];
        r.read_exact(&mut b).ok().map(|_| u64::from_le_bytes(b))
    }
    // GGUF v1 counts and lengths are u32, later versions u64
    fn len_of(r: &mut impl Read, v1: bool) -> Option<u64> {
        if v1 {
            u32_of(r).map(u64::from)
        } else {
            u64_of(r)
        }
    }
    fn fixed_size(ty: u32) -> Option<i64> {
        match ty {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    }
    // `seek_relative` keeps BufReader's buffer: a vocabulary is 10^5 small strings
    fn skip(r: &mut BufReader<File>, ty: u32, v1: bool) -> Option<()> {
        if let Some(n) = fixed_size(ty) {
            return r.seek_relative(n).ok();
        }
        match ty {
            8 => {
                let n = i64::try_from(len_of(r, v1)?).ok()?;
                r.seek_relative(n).ok()
            }
            9 => {
                let item = u32_of(r)?;
                let n = len_of(r, v1)?;
                match fixed_size(item) {
                    Some(size) => r.seek_relative(i64::try_from(n).ok()?.checked_mul(size)?).ok(),
                    None => (0..n).try_for_each(|_| skip(r, item, v1)),
                }
            }
            _ => None,
        }
    }
    fn scan(r: &mut BufReader<File>) -> Option<bool> {
        let _magic = u32_of(r)?;
        let v1 = u32_of(r)? == 1;
        let _tensors = len_of(r, v1)?;
        let kvs = len_of(r, v1)?;
        for _ in 0..kvs {
            let key_len = usize::try_from(len_of(r, v1)?).ok()?;
            if key_len > 1 << 16 {
                return None;
            }
            let mut key = vec![0u8; key_len];
            r.read_exact(&mut key).ok()?;
            let ty = u32_of(r)?;
            // candle drops a string's trailing NULs (some writers terminate them)
            while key.last() == Some(&0) {
                key.pop();
            }
            // candle reads the alignment from the 8- to 32-bit integer types only
            if key == b"general.alignment" && ty <= 5 {
                let mut b = [0u8; 8];
                let n = usize::try_from(fixed_size(ty)?).ok()?;
                r.read_exact(b.get_mut(..n)?).ok()?;
                return Some(b.iter().all(|&x| x == 0));
            }
            skip(r, ty, v1)?;
        }
        Some(false)
    }
    scan(r).unwrap_or(false)
}

/// Hex sha256 of a file, streamed in 1 MiB pieces (the model is ~100 MB; it is never held in
/// memory twice).
pub fn sha256_file(path: &Path) -> Result<String, ModelError> {
    let mut file = open_file(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| ModelError::Io { path: path.to_path_buf(), source: e })?;
        if n == 0 {
            break;
        }
        hasher.update(buf.get(..n).unwrap_or(&[]));
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

// ---- typed metadata access -------------------------------------------------------------

fn invalid(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidMetadata { key: key.to_string(), reason: reason.into() }
}

pub(crate) fn md_get<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a Value, ModelError> {
    md.get(key).ok_or_else(|| ModelError::MissingMetadata { key: key.to_string() })
}

/// Any integer-typed value as u64 (GGUF writers differ in the integer width they use).
fn value_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(u64::from(*x)),
        Value::U16(x) => Some(u64::from(*x)),
        Value::U32(x) => Some(u64::from(*x)),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

fn value_i64(v: &Value) -> Option<i64> {
    match v {
        Value::I8(x) => Some(i64::from(*x)),
        Value::I16(x) => Some(i64::from(*x)),
        Value::I32(x) => Some(i64::from(*x)),
        Value::I64(x) => Some(*x),
        other => value_u64(other).and_then(|x| i64::try_from(x).ok()),
    }
}

pub(crate) fn md_u32(md: &HashMap<String, Value>, key: &str) -> Result<u32, ModelError> {
    let v = md_get(md, key)?;
    value_u64(v)
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| invalid(key, format!("expected an unsigned 32-bit integer, got {v:?}")))
}

pub(crate) fn md_u32_opt(md: &HashMap<String, Value>, key: &str) -> Result<Option<u32>, ModelError> {
    if md.contains_key(key) {
        md_u32(md, key).map(Some)
    } else {
        Ok(None)
    }
}

pub(crate) fn md_f32(md: &HashMap<String, Value>, key: &str) -> Result<f32, ModelError> {
    match md_get(md, key)? {
        Value::F32(x) => Ok(*x),
        Value::F64(x) => Ok(*x as f32),
        other => Err(invalid(key, format!("expected a float, got {other:?}"))),
    }
}

pub(crate) fn md_bool_opt(md: &HashMap<String, Value>, key: &str) -> Option<bool> {
    match md.get(key) {
        Some(Value::Bool(b)) => Some(*b),
        _ => None,
    }
}

pub(crate) fn md_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a str, ModelError> {
    match md_get(md, key)? {
        Value::String(s) => Ok(s.as_str()),
        other => Err(invalid(key, format!("expected a string, got {:?}", other.value_type()))),
    }
}

pub(crate) fn md_str_array<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Vec<&'a str>, ModelError> {
    match md_get(md, key)? {
        Value::Array(items) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(invalid(key, format!("expected strings, got {:?}", other.value_type()))),
            })
            .collect(),
        other => Err(invalid(key, format!("expected an array, got {:?}", other.value_type()))),
    }
}

pub(crate) fn md_int_array(md: &HashMap<String, Value>, key: &str) -> Result<Vec<i64>, ModelError> {
    match md_get(md, key)? {
        Value::Array(items) => items
            .iter()
            .map(|v| value_i64(v).ok_or_else(|| invalid(key, format!("expected integers, got {:?}", v.value_type()))))
            .collect(),
        other => Err(invalid(key, format!("expected an array, got {:?}", other.value_type()))),
    }
}
