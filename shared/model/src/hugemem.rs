//! Memory for the model's weights that the kernel may back with 2 MiB transparent huge pages.
//!
//! Why: a decode step streams every weight matrix once (~100 MB for SmolLM2-135M Q4_1). On
//! 4 KiB pages that is ~25,000 pages per step, more than the TLBs hold, so the kernels' loads
//! keep walking page tables; on 2 MiB pages it is ~50. Measured with the `bench` example,
//! processes with and without in turn: one-stream decode +4.6 %, eight requests per step +5.8 %,
//! and a steadier speed from one process to the next (D74, docs/benchmarks.md). Many hosts run THP in `madvise` mode, where only memory that asks
//! for huge pages (`MADV_HUGEPAGE`) gets them, and the weights are spread over ~120 heap
//! allocations of 0.2–1 MB, none of which would: so the weights live in one mapping that asks.
//!
//! Only a hint: where THP is off (`never`), unsupported, or turned off here
//! (`PDMESH_MODEL_HUGE_PAGES=0`), the buffer is ordinary memory with the same contents.

#![allow(unsafe_code)]

use std::marker::PhantomData;

use memmap2::MmapMut;

/// The huge page size on x86-64 and most arm64 kernels; the buffer starts on such a boundary
/// so that its whole length can be covered.
const HUGE_PAGE: usize = 2 << 20;

/// Plain data a [`HugeBuf`] may hold.
///
/// # Safety
/// Every bit pattern must be a valid value (the buffer is filled by copying bytes), the type
/// must have no padding bytes (its values are read as bytes) and no drop glue, and its
/// alignment must not exceed a page.
pub(crate) unsafe trait Pod: Copy + 'static {}

// SAFETY: integers and floats accept every bit pattern and have no drop glue.
unsafe impl Pod for i8 {}
// SAFETY: as above.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}

/// Whether the weights go into a [`HugeBuf`] at all: yes unless `PDMESH_MODEL_HUGE_PAGES=0` (for
/// comparisons, and as an escape hatch on a host where THP compaction stalls hurt more than they
/// pay). The loader asks once; a `HugeBuf` always asks the kernel.
pub fn huge_pages_wanted() -> bool {
    std::env::var("PDMESH_MODEL_HUGE_PAGES").as_deref() != Ok("0")
}

/// A fixed-length buffer of `T` in its own anonymous mapping, advised for huge pages.
pub(crate) struct HugeBuf<T: Pod> {
    /// `None` for an empty buffer (a zero-length mapping does not exist).
    map: Option<MmapMut>,
    /// Byte offset of the first element in `map`: its first huge page boundary.
    offset: usize,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeBuf").field("len", &self.len).finish()
    }
}

impl<T: Pod> HugeBuf<T> {
    /// The parts one after the other. Advises the mapping before writing to it: a page first
    /// touched after the advice is faulted in as a huge page where the kernel has one.
    pub fn concat(parts: &[&[T]]) -> std::io::Result<Self> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let bytes = len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Ok(Self { map: None, offset: 0, len: 0, _t: PhantomData });
        }
        let mut map = MmapMut::map_anon(bytes + HUGE_PAGE)?;
        let offset = map.as_ptr().align_offset(HUGE_PAGE);
        advise_huge(&map);
        let mut at = offset;
        for part in parts {
            let src = as_bytes(part);
            map[at..at + src.len()].copy_from_slice(src);
            at += src.len();
        }
        Ok(Self { map: Some(map), offset, len, _t: PhantomData })
    }
}

#[cfg(target_os = "linux")]
fn advise_huge(map: &MmapMut) {
    if let Err(e) = map.advise(memmap2::Advice::HugePage) {
        // A kernel without THP: ordinary pages, same results.
        tracing::debug!(error = %e, "weights: no transparent huge pages");
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_: &MmapMut) {}

fn as_bytes<T: Pod>(xs: &[T]) -> &[u8] {
    // SAFETY: `T: Pod` has no padding, so every byte of `xs` is initialised; the returned
    // slice covers exactly the memory `xs` borrows, for as long as it does.
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<u8>(), std::mem::size_of_val(xs)) }
}

impl<T: Pod> std::ops::Deref for HugeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.map {
            // SAFETY: `concat` wrote `len` values of `T` from `offset` on, inside the mapping
            // (it mapped `offset + len·size_of::<T>()` bytes at least); `offset` is a huge page
            // boundary inside a page-aligned mapping, so the pointer is aligned for `T`
            // (`Pod`: alignment at most a page). The mapping lives as long as `self`.
            Some(map) => unsafe { std::slice::from_raw_parts(map.as_ptr().add(self.offset).cast::<T>(), self.len) },
            None => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_laid_end_to_end_and_aligned() {
        let a: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let b = [7.5f32; 3];
        let buf = HugeBuf::concat(&[&a, &b, &[]]).unwrap();
        assert_eq!(buf.len(), 1003);
        assert_eq!(&buf[..1000], &a[..]);
        assert_eq!(&buf[1000..], &b[..]);
        assert_eq!(buf.as_ptr() as usize % HUGE_PAGE, 0);
        let empty = HugeBuf::<i8>::concat(&[]).unwrap();
        assert!(empty.is_empty());
    }
}
