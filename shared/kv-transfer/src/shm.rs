//! Shared-memory regions: the producer's KV cache lives in a file under `/dev/shm` so that a
//! consumer on the same host can map it read-only and copy blocks itself (one-sided, like an
//! RDMA READ), and so that the producer's TCP server can stream blocks without copying them.
//!
//! This is the only module of the crate that uses `unsafe`: mapping a file is unsafe in Rust
//! because another process may change or truncate it under the mapping, and viewing the
//! page-aligned bytes as `f32` needs a reinterpretation. Each block says why it holds here.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapMut, MmapOptions};
use pdmesh_model_api::kv_cache::KvBacking;
use pdmesh_model_api::{KvCache, KvCacheSpec};
use thiserror::Error;

/// Why a region could not be created or opened.
#[derive(Debug, Error)]
pub enum ShmError {
    #[error("invalid region name {0:?}: use letters, digits, '.', '_' and '-' only")]
    InvalidName(String),
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("region {path} is not 4-byte aligned for an f32 view")]
    Misaligned { path: PathBuf },
    #[error("region {path} holds {have} bytes, {need} needed")]
    TooSmall { path: PathBuf, have: usize, need: usize },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ShmError + 'a {
    move |source| ShmError::Io { op, path: path.to_path_buf(), source }
}

/// Where region files go: `/dev/shm` when it exists (tmpfs: the pages are RAM, nothing reaches
/// a disk), else the temporary directory (still mmap-able, e.g. on macOS).
pub fn default_shm_dir() -> PathBuf {
    let dev_shm = Path::new("/dev/shm");
    if dev_shm.is_dir() {
        dev_shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// A read-write shared-memory region owned by its creator (P's KV cache). The file is removed
/// when the region is dropped; readers that mapped it keep their mapping until they drop it.
#[derive(Debug)]
pub struct ShmRegion {
    path: PathBuf,
    map: MmapMut,
    len: usize,
}

impl ShmRegion {
    /// Create (or replace a stale) region file `name` in [`default_shm_dir`] of `bytes` bytes
    /// (rounded up to whole `f32`s) and map it read-write, zero-filled.
    ///
    /// The file is filled by writing zeros rather than just `set_len`, so that a full tmpfs is
    /// an error here (ENOSPC) instead of a SIGBUS at the first touch of a page mid-serving.
    pub fn create(name: &str, bytes: usize) -> Result<Self, ShmError> {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
            return Err(ShmError::InvalidName(name.to_string()));
        }
        Self::create_at(&default_shm_dir().join(name), bytes)
    }

    /// A region sized for a KV cache of `spec`.
    pub fn create_for_spec(name: &str, spec: &KvCacheSpec) -> Result<Self, ShmError> {
        Self::create(name, spec.total_floats() * std::mem::size_of::<f32>())
    }

    /// Like [`ShmRegion::create`] at an explicit path.
    pub fn create_at(path: &Path, bytes: usize) -> Result<Self, ShmError> {
        let len = bytes.div_ceil(4) * 4;
        if len == 0 {
            return Err(ShmError::TooSmall { path: path.to_path_buf(), have: 0, need: 4 });
        }
        // A file left by a crashed previous incarnation is replaced, never reused: a reader
        // still mapping the old inode keeps seeing the old bytes, not ours.
        let _ = std::fs::remove_file(path);
        let mut file =
            OpenOptions::new().read(true).write(true).create_new(true).open(path).map_err(io_err("create", path))?;
        let zeros = vec![0u8; 1 << 20];
        let mut left = len;
        while left > 0 {
            let n = left.min(zeros.len());
            file.write_all(&zeros[..n]).map_err(io_err("fill", path))?;
            left -= n;
        }
        // SAFETY: we created this file ourselves (create_new) and keep it at `len` bytes for
        // as long as the mapping lives; the protocol never lets another process write or
        // truncate it (readers open it read-only). Removing the file on drop does not
        // invalidate the mapping.
        let map = unsafe { MmapOptions::new().len(len).map_mut(&file) }.map_err(io_err("map", path))?;
        let region = Self { path: path.to_path_buf(), map, len };
        if region.floats().is_none() {
            return Err(ShmError::Misaligned { path: path.to_path_buf() });
        }
        Ok(region)
    }

    /// Map an existing region read-only (the consumer side, or P's own TCP server).
    pub fn open_readonly(path: impl AsRef<Path>) -> Result<ShmReadOnly, ShmError> {
        ShmReadOnly::open(path.as_ref())
    }

    /// The file backing the region (advertised to readers).
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// Put a KV cache of `spec` on this region (which moves into the cache, so the file lives
    /// exactly as long as the cache).
    pub fn into_kv_cache(self, spec: KvCacheSpec) -> Result<KvCache, ShmError> {
        let need = spec.total_floats() * std::mem::size_of::<f32>();
        let (path, have) = (self.path.clone(), self.len);
        KvCache::with_backing(spec, Box::new(self)).ok_or(ShmError::TooSmall { path, have, need })
    }

    fn floats(&self) -> Option<&[f32]> {
        let bytes = &self.map[..];
        // SAFETY: every bit pattern is a valid f32 and align_to only yields the part of the
        // slice that is correctly aligned; an mmap is page aligned so the prefix is empty.
        let (head, mid, tail) = unsafe { bytes.align_to::<f32>() };
        (head.is_empty() && tail.is_empty()).then_some(mid)
    }
}

impl KvBacking for ShmRegion {
    fn as_slice(&self) -> &[f32] {
        self.floats().unwrap_or(&[])
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        let bytes = &mut self.map[..];
        // SAFETY: as in `floats`: any bit pattern is a valid f32, alignment is checked by
        // align_to_mut, and `create_at` refused a region whose view is not whole.
        let (head, mid, tail) = unsafe { bytes.align_to_mut::<f32>() };
        if head.is_empty() && tail.is_empty() {
            mid
        } else {
            &mut []
        }
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::debug!(path = %self.path.display(), error = %e, "shm region already removed");
        }
    }
}

/// A read-only mapping of another agent's (or our own) region.
///
/// Readers only ever look at blocks that P has leased to them, which P does not write while
/// the lease holds; other blocks of the same file may change at any time, which is the usual
/// contract of shared memory (and of RDMA) and why a read is only trusted once P confirms the
/// lease was still valid at `read done`.
#[derive(Debug)]
pub struct ShmReadOnly {
    path: PathBuf,
    map: Mmap,
}

impl ShmReadOnly {
    fn open(path: &Path) -> Result<Self, ShmError> {
        let file = File::open(path).map_err(io_err("open", path))?;
        let len = file.metadata().map_err(io_err("stat", path))?.len() as usize;
        if len == 0 {
            return Err(ShmError::TooSmall { path: path.to_path_buf(), have: 0, need: 4 });
        }
        if len & 3 != 0 {
            // (not `is_multiple_of`: the workspace supports Rust 1.85)
            return Err(ShmError::Misaligned { path: path.to_path_buf() });
        }
        // SAFETY: the mapping is read-only on our side. The creator keeps the file at its size
        // for its lifetime and never truncates it; it may write blocks we are not leased (see
        // the type's doc), and we read only leased ones. `populate` pre-faults the page tables
        // here (handshake time) instead of in the middle of the first reads.
        let map = unsafe { MmapOptions::new().len(len).populate().map(&file) }.map_err(io_err("map", path))?;
        Ok(Self { path: path.to_path_buf(), map })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len_bytes(&self) -> usize {
        self.map.len()
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The mapped region as `f32`s (native order), so that a reader copies runs with
    /// `copy_from_slice` — a plain memcpy, which measured ~1.5× faster than decoding bytes
    /// into floats from a 4 KiB-paged tmpfs mapping (`docs/KV_TRANSFER.md`). Empty if the
    /// file is not a whole number of floats.
    pub fn floats(&self) -> &[f32] {
        // SAFETY: every bit pattern is a valid f32; align_to only yields the correctly aligned
        // middle, and an mmap is page aligned, so head is empty and tail only holds a partial
        // float (rejected below).
        let (head, mid, tail) = unsafe { self.map.align_to::<f32>() };
        if head.is_empty() && tail.is_empty() {
            mid
        } else {
            &[]
        }
    }
}

/// The bytes of a run of KV floats, so the TCP data plane can receive a block straight into
/// the local cache with no copy in user space (decoding through a staging buffer cost ~20% of
/// loopback bandwidth, `docs/KV_TRANSFER.md`). It lives here because this is the crate's one
/// module allowed `unsafe`. Native byte order: the crate refuses to build on big-endian hosts.
pub(crate) fn floats_as_bytes_mut(floats: &mut [f32]) -> &mut [u8] {
    let len = std::mem::size_of_val(floats);
    // SAFETY: the pointer and length cover exactly the memory of `floats`, which the returned
    // slice borrows mutably for its whole lifetime (no aliasing). u8 needs no alignment, and
    // f32 has no padding and accepts any bit pattern, so every write through the bytes leaves
    // valid floats behind.
    unsafe { std::slice::from_raw_parts_mut(floats.as_mut_ptr().cast::<u8>(), len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_is_zeroed_mapped_and_removed_on_drop() {
        let name = format!("pdmesh-test-shm-{}", uuid::Uuid::new_v4());
        let mut region = ShmRegion::create(&name, 4096 + 3).unwrap();
        assert_eq!(region.len_bytes(), 4100);
        let path = region.path().to_path_buf();
        assert!(path.exists());
        assert!(region.as_slice().iter().all(|x| *x == 0.0));
        region.as_mut_slice()[7] = 1.5;
        let ro = ShmRegion::open_readonly(&path).unwrap();
        assert_eq!(ro.len_bytes(), 4100);
        assert_eq!(ro.bytes()[28..32], 1.5f32.to_ne_bytes());
        assert_eq!(ro.floats().len(), 1025);
        assert_eq!(ro.floats()[7], 1.5);
        drop(region);
        assert!(!path.exists());
        // The reader's mapping outlives the file.
        assert_eq!(ro.bytes()[28..32], 1.5f32.to_ne_bytes());
    }

    #[test]
    fn float_bytes_view_writes_floats() {
        let mut xs = [0.0f32; 3];
        floats_as_bytes_mut(&mut xs)[4..8].copy_from_slice(&2.5f32.to_ne_bytes());
        assert_eq!(xs, [0.0, 2.5, 0.0]);
        assert_eq!(floats_as_bytes_mut(&mut xs).len(), 12);
    }

    #[test]
    fn bad_names_are_refused() {
        assert!(matches!(ShmRegion::create("../etc", 16), Err(ShmError::InvalidName(_))));
        assert!(matches!(ShmRegion::create("", 16), Err(ShmError::InvalidName(_))));
    }

    #[test]
    fn a_kv_cache_lives_on_a_region() {
        let spec = KvCacheSpec { num_layers: 2, num_blocks: 3, block_size: 2, num_kv_heads: 1, head_dim: 4 };
        let name = format!("pdmesh-test-shm-{}", uuid::Uuid::new_v4());
        let region = ShmRegion::create_for_spec(&name, &spec).unwrap();
        let path = region.path().to_path_buf();
        let mut kv = region.into_kv_cache(spec).unwrap();
        kv.block_mut(1, pdmesh_model_api::kv_cache::KvSide::Value, 2).unwrap()[0] = 9.0;
        let ro = ShmRegion::open_readonly(&path).unwrap();
        // layer 1, V: layer-side 3, of 3 blocks each; block 2.
        let off = (3 * 3 + 2) * spec.floats_per_block() * 4;
        assert_eq!(ro.bytes()[off..off + 4], 9.0f32.to_ne_bytes());
        drop(kv);
        assert!(!path.exists());
    }

    #[test]
    fn too_small_region_is_refused_as_cache() {
        let spec = KvCacheSpec { num_layers: 2, num_blocks: 3, block_size: 2, num_kv_heads: 1, head_dim: 4 };
        let name = format!("pdmesh-test-shm-{}", uuid::Uuid::new_v4());
        let region = ShmRegion::create(&name, 16).unwrap();
        assert!(matches!(region.into_kv_cache(spec), Err(ShmError::TooSmall { .. })));
    }
}
