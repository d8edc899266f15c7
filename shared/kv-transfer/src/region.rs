//! Shared-memory regions: the producer's KV cache lives in a file under `/dev/shm` so that a
//! consumer on the same host can map it read-only and copy blocks itself (one-sided, like an
//! RDMA READ), and so that the producer's TCP server can stream blocks without copying them.
//! The consumer's cache lives in one too, so that its reads land in place ([`KvBlockWriter`]).
//! This module is memory only; the data planes that read a region are the `shm` and `tcp`
//! backends (`crate::backend`).
//!
//! This is the only module of the crate that uses `unsafe`: mapping a file is unsafe in Rust
//! because another process may change or truncate it under the mapping, and viewing the
//! page-aligned bytes as `f32` needs a reinterpretation. Each block says why it holds here.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::{Mmap, MmapMut, MmapOptions};
use pdmesh_model_api::kv_cache::KvBacking;
use pdmesh_model_api::{KvCache, KvCacheSpec};
use thiserror::Error;

use crate::layout::{run_bytes, run_offset, wire_runs};
use crate::local::{BlockClaims, CheckoutError};

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

/// Mode of a region file: its creator's user alone may open it (D97).
pub const REGION_MODE: u32 = 0o600;

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
        // Owner-only (0600, D97): the cache encodes other users' prompts, and any local user
        // who could open the file could map it. Readers (D on this host) run as P's user.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(REGION_MODE)
            .open(path)
            .map_err(io_err("create", path))?;
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
        // invalidate the mapping. `populate` maps every page now: the cache is written while
        // serving (each new token's K and V rows), and a page first touched there is a page
        // fault on the forward pass's thread (~10 per output token measured before).
        let map = unsafe { MmapOptions::new().len(len).populate().map_mut(&file) }.map_err(io_err("map", path))?;
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

/// A tensor-parallel peer's read-write mapping of its rank's KV region (D111): TP rank 0
/// creates the region (with every KV head) and owns its file; each TP rank's executor writes
/// and reads only its own heads of it, so the ranks of a node share one cache, which the
/// transfer agent and D's reads see whole, whatever the TP size. The file is not removed when
/// this mapping is dropped (rank 0 owns it).
#[derive(Debug)]
pub struct ShmPeerMapping {
    /// For `Debug`: which region this maps.
    #[allow(dead_code)]
    path: PathBuf,
    map: MmapMut,
}

impl ShmPeerMapping {
    /// Map the region at `path`, which must hold a KV cache of `spec`, and put the cache on it.
    pub fn open_kv_cache(path: impl AsRef<Path>, spec: KvCacheSpec) -> Result<KvCache, ShmError> {
        let path = path.as_ref();
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io_err("open", path))?;
        let len = file.metadata().map_err(io_err("stat", path))?.len() as usize;
        let need = spec.total_floats() * std::mem::size_of::<f32>();
        if len < need {
            return Err(ShmError::TooSmall { path: path.to_path_buf(), have: len, need });
        }
        // SAFETY: rank 0 created the file at this size and keeps it so while its group lives
        // (a peer stops with its rank 0); every rank writes only the heads it computes, and
        // reads what it wrote or what D's reads wrote into blocks no step touches meanwhile.
        let map = unsafe { MmapOptions::new().len(len).populate().map_mut(&file) }.map_err(io_err("map", path))?;
        let mapping = Self { path: path.to_path_buf(), map };
        KvCache::with_backing(spec, Box::new(mapping)).ok_or(ShmError::Misaligned { path: path.to_path_buf() })
    }
}

impl KvBacking for ShmPeerMapping {
    fn as_slice(&self) -> &[f32] {
        // SAFETY: as in `ShmRegion::floats`.
        let (head, mid, tail) = unsafe { self.map.align_to::<f32>() };
        if head.is_empty() && tail.is_empty() {
            mid
        } else {
            &[]
        }
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as in `ShmRegion::as_mut_slice`.
        let (head, mid, tail) = unsafe { self.map.align_to_mut::<f32>() };
        if head.is_empty() && tail.is_empty() {
            mid
        } else {
            &mut []
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
        if !len.is_multiple_of(4) {
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

/// D's write access to its **own** cache region, for reads that land in place: a second,
/// read-write mapping of the region file its executor's cache lives on, handing out the blocks
/// of one receive at a time ([`BlockCheckout`]).
///
/// Why a second mapping and not a staging buffer: D's reads run beside the forward pass (the
/// executor thread owns the cache), so without this they land in a heap buffer that the
/// executor copies into the cache before the next step — an allocation, page faults and a
/// second copy of every byte, which on some CPUs (relative misalignment of heap and mapping)
/// halved the transfer's speed. Writing through a second mapping is the shape of an RDMA WRITE
/// into registered memory: the memory is shared with the executor, and correctness rests on
/// who may touch which block when:
/// - D's scheduler allocates a receive's blocks to that request alone and never schedules it
///   (so the executor never reads or writes those blocks) until the receive is reported
///   finished, and never frees them while a read may still write (`docs/LIFECYCLE.md`, checked
///   by the lifecycle property test);
/// - within this process, [`KvBlockWriter::checkout`] refuses a block another live checkout
///   holds, so two receives can never write the same block even if that invariant broke;
/// - the executor's view is a different mapping, so no Rust reference covers memory this one
///   writes (to the executor these writes are like another process writing shared memory, the
///   contract every shared-memory block cache has).
#[derive(Debug)]
pub struct KvBlockWriter {
    spec: KvCacheSpec,
    /// The mapping's start. Derived once from `map`, which is never borrowed again: every
    /// access goes through checkouts, so no reference to the whole mapping ever exists.
    base: *mut u8,
    /// Keeps the mapping alive (unmapped on drop).
    _map: MmapMut,
    /// Blocks held by live checkouts (and by the executor's step run ahead).
    pub(crate) claims: BlockClaims,
}

// SAFETY: `base` points into `_map`, which lives as long as the writer; the writer only hands
// out memory through checkouts whose block sets are disjoint (enforced under `checked_out`),
// so sharing it between threads cannot create aliasing writes.
unsafe impl Send for KvBlockWriter {}
// SAFETY: as above; `&KvBlockWriter` only allows `checkout` (locked) and reads of plain fields.
unsafe impl Sync for KvBlockWriter {}

impl KvBlockWriter {
    /// Map the region file at `path` (this process's own cache, laid out as `spec`) read-write.
    pub fn open(path: impl AsRef<Path>, spec: KvCacheSpec) -> Result<Self, ShmError> {
        let path = path.as_ref();
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io_err("open", path))?;
        let have = file.metadata().map_err(io_err("stat", path))?.len() as usize;
        let need = spec.total_floats() * std::mem::size_of::<f32>();
        if have < need {
            return Err(ShmError::TooSmall { path: path.to_path_buf(), have, need });
        }
        // SAFETY: the file is this process's own cache region (created by `ShmRegion`), kept
        // at its size while the process runs and never truncated; see the type's doc for who
        // writes which blocks through the two mappings. `populate` faults the page tables in
        // now rather than during the first reads.
        let mut map = unsafe { MmapOptions::new().len(need).populate().map_mut(&file) }.map_err(io_err("map", path))?;
        let base = map.as_mut_ptr();
        if base.align_offset(std::mem::align_of::<f32>()) != 0 {
            return Err(ShmError::Misaligned { path: path.to_path_buf() });
        }
        Ok(Self { spec, base, _map: map, claims: BlockClaims::default() })
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    /// Blocks held by live checkouts now.
    pub fn checked_out(&self) -> usize {
        self.claims.len()
    }

    /// Take `block_ids` (in the order the read fills them) for one receive, until the returned
    /// checkout is dropped. Refused if a block is out of range, named twice, or held by
    /// another checkout.
    pub fn checkout(self: &Arc<Self>, block_ids: &[u32]) -> Result<BlockCheckout, CheckoutError> {
        self.claims.claim(block_ids, self.spec.num_blocks)?;
        Ok(self.claimed(block_ids))
    }

    /// The checkout of blocks already claimed for a receive in `claims`.
    pub(crate) fn claimed(self: &Arc<Self>, block_ids: &[u32]) -> BlockCheckout {
        BlockCheckout { writer: self.clone(), block_ids: block_ids.to_vec() }
    }
}

/// The blocks of one receive, writable until dropped (see [`KvBlockWriter`]).
#[derive(Debug)]
pub struct BlockCheckout {
    writer: Arc<KvBlockWriter>,
    block_ids: Vec<u32>,
}

impl BlockCheckout {
    /// The local blocks, in the order a read fills them.
    pub fn block_ids(&self) -> &[u32] {
        &self.block_ids
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.writer.spec
    }

    /// Every run of the checked-out blocks (one block of one layer side each), in wire order.
    pub(crate) fn runs(&mut self) -> Vec<&mut [u8]> {
        let spec = self.writer.spec;
        let len = run_bytes(&spec);
        let base = self.writer.base;
        wire_runs(spec.num_layers, self.block_ids.len())
            .filter_map(|(layer, side, i)| self.block_ids.get(i).map(|&b| run_offset(&spec, layer, side, b)))
            .map(|off| {
                // SAFETY: `checkout` checked every block < num_blocks, so each run lies inside
                // the mapping (`open` checked it holds the whole spec). Runs of distinct
                // (layer, side, block) do not overlap, the block ids are distinct, no other
                // checkout holds them, and `&mut self` keeps this checkout from handing out a
                // second set while these borrows live: the slices alias nothing.
                unsafe { std::slice::from_raw_parts_mut(base.add(off), len) }
            })
            .collect()
    }
}

impl Drop for BlockCheckout {
    fn drop(&mut self) {
        self.writer.claims.release(&self.block_ids);
    }
}

/// Copy `src` into `dst` (same length) for a block read, bypassing the caches on the way out
/// where the CPU allows: a read moves megabytes that the forward pass reads once, much later,
/// so ordinary stores would first pull every destination line in (read-for-ownership) only to
/// overwrite it — a third of the memory traffic. Non-temporal stores skip that (measured here:
/// 1.25× the bandwidth of `copy_from_slice` on 12 KiB runs). They are SSE2 (every x86-64 CPU);
/// other targets, and buffers that are not 16-byte aligned, use `copy_from_slice`. A store
/// fence at the end orders the copy before whatever signals its completion.
pub(crate) fn copy_run(dst: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if dst.len() == src.len()
        && dst.len().is_multiple_of(64)
        && (dst.as_ptr() as usize).is_multiple_of(16)
        && (src.as_ptr() as usize).is_multiple_of(16)
    {
        use std::arch::x86_64::{__m128i, _mm_load_si128, _mm_sfence, _mm_stream_si128};
        let n = dst.len() / 16;
        let (d, s) = (dst.as_mut_ptr().cast::<__m128i>(), src.as_ptr().cast::<__m128i>());
        // SAFETY: SSE2 is part of x86-64. Both buffers hold `n` 16-byte vectors (same length,
        // a multiple of 64) and are 16-byte aligned (checked above), as the aligned load and
        // the streaming store require; `dst` is exclusively borrowed and does not overlap
        // `src` (a shared borrow). The fence makes the streamed stores visible before any
        // later store, such as the one that reports the read as done.
        unsafe {
            for i in (0..n).step_by(4) {
                let v0 = _mm_load_si128(s.add(i));
                let v1 = _mm_load_si128(s.add(i + 1));
                let v2 = _mm_load_si128(s.add(i + 2));
                let v3 = _mm_load_si128(s.add(i + 3));
                _mm_stream_si128(d.add(i), v0);
                _mm_stream_si128(d.add(i + 1), v1);
                _mm_stream_si128(d.add(i + 2), v2);
                _mm_stream_si128(d.add(i + 3), v3);
            }
            _mm_sfence();
        }
        return;
    }
    dst.copy_from_slice(src);
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

    /// Issue 40 (defect 6): P's KV region is owner-only (0600) whatever the process's
    /// file-creation mask, so no other local user can map the cache and read its prompts.
    #[test]
    fn region_file_is_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let name = format!("pdmesh-test-shm-mode-{}", uuid::Uuid::new_v4());
        let region = ShmRegion::create(&name, 4096).unwrap();
        let mode = std::fs::metadata(region.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "region mode {mode:o}");
    }

    /// This thread's minor page faults so far (`/proc/thread-self/stat`, field 10).
    #[cfg(target_os = "linux")]
    fn thread_minor_faults() -> u64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        stat.rsplit_once(')').unwrap().1.split_whitespace().nth(7).unwrap().parse().unwrap()
    }

    /// The cache is written while serving (each new token's rows): its pages must be mapped
    /// when the region is created, not faulted in one by one on the forward pass's thread.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_new_region_is_written_without_page_faults() {
        let pages = 2048;
        let name = format!("pdmesh-test-shm-{}", uuid::Uuid::new_v4());
        let mut region = ShmRegion::create(&name, pages * 4096).unwrap();
        let floats = region.as_mut_slice();
        let before = thread_minor_faults();
        for page in 0..pages {
            floats[page * 1024] = 1.0;
        }
        let faults = thread_minor_faults() - before;
        assert!(faults < pages as u64 / 10, "{faults} page faults writing {pages} fresh pages");
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

    #[test]
    fn checked_out_blocks_are_written_in_place_and_exclusive() {
        use pdmesh_model_api::kv_cache::KvSide;
        let spec = KvCacheSpec { num_layers: 2, num_blocks: 6, block_size: 2, num_kv_heads: 1, head_dim: 4 };
        let name = format!("pdmesh-test-shm-{}", uuid::Uuid::new_v4());
        let region = ShmRegion::create_for_spec(&name, &spec).unwrap();
        let path = region.path().to_path_buf();
        // the executor's view of the cache, and the writer's second mapping of the same file
        let kv = region.into_kv_cache(spec).unwrap();
        let writer = Arc::new(KvBlockWriter::open(&path, spec).unwrap());
        let mut a = writer.checkout(&[4, 1]).unwrap();
        assert_eq!(writer.checked_out(), 2);
        assert_eq!(writer.checkout(&[2, 1]).unwrap_err(), CheckoutError::Busy(1));
        assert_eq!(writer.checkout(&[3, 3]).unwrap_err(), CheckoutError::Duplicate(3));
        assert_eq!(writer.checkout(&[6]).unwrap_err(), CheckoutError::OutOfRange { block: 6, num_blocks: 6 });
        assert_eq!(writer.checked_out(), 2, "refused checkouts take nothing");
        // wire order: block 4 (L0 K, L0 V, L1 K, L1 V), then block 1
        let runs = a.runs();
        assert_eq!(runs.len(), 8);
        for (n, run) in runs.into_iter().enumerate() {
            assert_eq!(run.len(), spec.floats_per_block() * 4);
            run.fill(n as u8 + 1);
        }
        let byte = |layer, side, block| kv.block(layer, side, block).unwrap()[0].to_ne_bytes()[0];
        assert_eq!(byte(0, KvSide::Key, 4), 1);
        assert_eq!(byte(1, KvSide::Value, 4), 4);
        assert_eq!(byte(0, KvSide::Key, 1), 5);
        assert_eq!(byte(1, KvSide::Value, 1), 8);
        for other in [0, 2, 3, 5] {
            assert!(kv.block(0, KvSide::Key, other).unwrap().iter().all(|x| *x == 0.0), "block {other} untouched");
        }
        drop(a);
        assert_eq!(writer.checked_out(), 0);
        assert!(writer.checkout(&[1, 2]).is_ok(), "free again once the first checkout ended");
    }

    #[test]
    fn a_writer_needs_a_region_holding_the_whole_cache() {
        let spec = KvCacheSpec { num_layers: 2, num_blocks: 3, block_size: 2, num_kv_heads: 1, head_dim: 4 };
        let name = format!("pdmesh-test-shm-{}", uuid::Uuid::new_v4());
        let region = ShmRegion::create(&name, 16).unwrap();
        assert!(matches!(KvBlockWriter::open(region.path(), spec), Err(ShmError::TooSmall { .. })));
        assert!(matches!(KvBlockWriter::open("/nonexistent/pdmesh-region", spec), Err(ShmError::Io { .. })));
    }
}
