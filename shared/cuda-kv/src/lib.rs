//! KV cache regions in GPU memory that other processes can map: CUDA IPC.
//!
//! One type, [`DeviceKvRegion`], is both the GPU executor's KV cache (`pdmesh-model`, feature
//! `cuda`) and what the `cuda` transfer backend serves (`pdmesh-kv-transfer`, feature `cuda`):
//! the worker allocates it once and shares it (`Arc`) between the two, so P's kernels write the
//! very memory D reads, and D's reads land where its kernels attend. That is why this is a crate
//! of its own: the model and the transfer agent both need it, and neither should depend on the
//! other.
//!
//! The `cuda` backend's data path is the GPU counterpart of the `shm` backend: P allocates its
//! KV region with `cuMemAlloc` (IPC cannot export stream-ordered pool memory) and exports a
//! 64-byte IPC handle; D opens the handle once per peer (`cuIpcOpenMemHandle`) and copies the
//! blocks it leased device-to-device into its own region: one 2D copy per contiguous run of
//! blocks (a row per layer side), with no host staging and no work on P's side.
//!
//! The region has the host cache's layout (`[layer][K|V][block][slot][head][dim]`, f32), so
//! block offsets are computed exactly as for `shm` and `tcp`.
//!
//! Every copy here runs on the context's legacy default stream, as the GPU executor's kernels
//! do: a read into D's region is ordered with the forward passes of the same context without
//! any event bookkeeping.
//!
//! cudarc with dynamic loading: this builds anywhere and fails with [`CudaIpcError`] where no
//! driver is found. `unsafe` is the driver calls; each block says what it relies on.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use pdmesh_model_api::KvCacheSpec;

/// Errors of the CUDA IPC data path.
#[derive(Debug, thiserror::Error)]
pub enum CudaIpcError {
    #[error("no CUDA driver library found (libcuda)")]
    NoDriver,
    #[error("cuda: {what}: {source}")]
    Driver { what: &'static str, source: cudarc::driver::DriverError },
    #[error("block {block} is outside a region of {num_blocks} blocks")]
    BlockOutOfRange { block: u32, num_blocks: u32 },
    #[error("{remote} remote blocks for {local} local blocks")]
    LengthMismatch { remote: usize, local: usize },
    #[error("geometry mismatch: remote {remote:?}, local {local:?}")]
    Geometry { remote: KvCacheSpec, local: KvCacheSpec },
    #[error("{len} floats at offset {offset} do not fit a region of {total} floats")]
    OutOfRegion { offset: usize, len: usize, total: usize },
}

impl CudaIpcError {
    /// The driver's result code behind this error, where the driver reported one.
    pub fn driver_code(&self) -> Option<sys::CUresult> {
        match self {
            Self::Driver { source, .. } => Some(source.0),
            _ => None,
        }
    }
}

/// Whether a driver error leaves the context unusable for the rest of the process. CUDA calls
/// these "sticky": after a kernel faults (illegal address or instruction, misaligned or
/// out-of-space access, a bad PC, a launch failure) or the hardware reports an uncorrectable
/// error, every later call in that process fails, and only a new process gets a working
/// context. Anything else (out of memory, a bad argument, a handle another process closed)
/// fails one call and leaves the context usable.
pub fn is_sticky(code: sys::CUresult) -> bool {
    use sys::CUresult as E;
    matches!(
        code,
        E::CUDA_ERROR_ILLEGAL_ADDRESS
            | E::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | E::CUDA_ERROR_MISALIGNED_ADDRESS
            | E::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | E::CUDA_ERROR_INVALID_PC
            | E::CUDA_ERROR_LAUNCH_FAILED
            | E::CUDA_ERROR_HARDWARE_STACK_ERROR
            | E::CUDA_ERROR_ECC_UNCORRECTABLE
            | E::CUDA_ERROR_NVLINK_UNCORRECTABLE
            | E::CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

fn check(what: &'static str, r: sys::CUresult) -> Result<(), CudaIpcError> {
    r.result().map_err(|source| CudaIpcError::Driver { what, source })
}

/// The 64 opaque bytes that name a device allocation to another process (carried in the
/// agent metadata the way the shm backend carries its file path).
#[derive(Clone, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcHandle({})", self.to_hex())
    }
}

impl IpcHandle {
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        let s = s.trim();
        if s.len() != 128 {
            return None;
        }
        let mut out = [0u8; 64];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Self(out))
    }
}

/// Open GPU `ordinal`'s primary context (shared with the GPU executor in the same process).
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, CudaIpcError> {
    // SAFETY: only tries to dlopen libcuda.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaIpcError::NoDriver);
    }
    CudaContext::new(ordinal).map_err(|source| CudaIpcError::Driver { what: "open GPU", source })
}

/// Float offset of `(layer, side, block)` in a region of `spec`'s layout (side 0 is K, 1 is V).
pub fn block_offset(spec: &KvCacheSpec, layer: usize, side: usize, block: u32) -> usize {
    ((layer * 2 + side) * spec.num_blocks as usize + block as usize) * spec.floats_per_block()
}

/// A KV region in GPU memory that other processes can open.
#[derive(Debug)]
pub struct DeviceKvRegion {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    spec: KvCacheSpec,
}

// SAFETY: the region is a device address; the driver calls made through it are thread-safe
// once the context is bound (every method binds it).
unsafe impl Send for DeviceKvRegion {}
unsafe impl Sync for DeviceKvRegion {}

impl DeviceKvRegion {
    /// Allocate a zeroed region of `spec`'s size on the context's GPU.
    pub fn new(ctx: Arc<CudaContext>, spec: KvCacheSpec) -> Result<Self, CudaIpcError> {
        ctx.bind_to_thread().map_err(|source| CudaIpcError::Driver { what: "bind context", source })?;
        let bytes = spec.total_floats() * 4;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) })?;
        // SAFETY: `ptr` was just allocated with `bytes` bytes.
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes) })?;
        Ok(Self { ctx, ptr, spec })
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    /// The context the region was allocated in (the GPU executor's, on a worker).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Base device address (for kernels or copies in this process).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Device address of `layer`'s K (`side` 0) or V (`side` 1): `num_blocks` blocks of
    /// `[slot][head][dim]` floats, the argument the executor's kernels take for one layer side.
    /// `None` outside the region.
    pub fn layer_side_ptr(&self, layer: usize, side: usize) -> Option<u64> {
        (layer < self.spec.num_layers as usize && side < 2)
            .then(|| self.ptr + (block_offset(&self.spec, layer, side, 0) * 4) as u64)
    }

    /// Copy `data` from the host to the region, starting `float_offset` floats in (the GPU
    /// executor uploads blocks whose K/V came into its host cache this way). Synchronous.
    pub fn write_floats(&self, float_offset: usize, data: &[f32]) -> Result<(), CudaIpcError> {
        let total = self.spec.total_floats();
        if float_offset.checked_add(data.len()).is_none_or(|end| end > total) {
            return Err(CudaIpcError::OutOfRegion { offset: float_offset, len: data.len(), total });
        }
        self.bind()?;
        let dst = self.ptr + (float_offset * 4) as u64;
        // SAFETY: `float_offset + data.len()` floats lie inside the region (checked above) and
        // `data` is a valid host slice of that length.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len() * 4) })
    }

    /// One block of one layer side, copied to the host (tests and diagnostics).
    pub fn read_block(&self, layer: usize, side: usize, block: u32) -> Result<Vec<f32>, CudaIpcError> {
        if block >= self.spec.num_blocks || layer >= self.spec.num_layers as usize || side >= 2 {
            return Err(CudaIpcError::BlockOutOfRange { block, num_blocks: self.spec.num_blocks });
        }
        let n = self.spec.floats_per_block();
        let mut out = vec![0f32; n];
        let src = self.ptr + (block_offset(&self.spec, layer, side, block) * 4) as u64;
        self.bind()?;
        // SAFETY: the block lies inside the region (checked above); `out` holds `n` floats.
        check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, n * 4) })?;
        Ok(out)
    }

    /// The IPC handle another process opens with [`RemoteDeviceKv::open`].
    pub fn export(&self) -> Result<IpcHandle, CudaIpcError> {
        self.bind()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `h` is a valid out-pointer and `ptr` the base of a cuMemAlloc allocation.
        check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) })?;
        Ok(IpcHandle(h.reserved.map(|c| c as u8)))
    }

    /// Copy `data` (at most the region's floats) to the start of the region.
    pub fn upload(&self, data: &[f32]) -> Result<(), CudaIpcError> {
        let n = data.len().min(self.spec.total_floats());
        self.bind()?;
        // SAFETY: `n` floats fit both the host slice and the region.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(self.ptr, data.as_ptr().cast(), n * 4) })
    }

    /// The whole region, copied to the host.
    pub fn download(&self) -> Result<Vec<f32>, CudaIpcError> {
        let n = self.spec.total_floats();
        let mut out = vec![0f32; n];
        self.bind()?;
        // SAFETY: `out` has room for the region's `n` floats.
        check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr, n * 4) })?;
        Ok(out)
    }

    fn bind(&self) -> Result<(), CudaIpcError> {
        self.ctx.bind_to_thread().map_err(|source| CudaIpcError::Driver { what: "bind context", source })
    }
}

impl Drop for DeviceKvRegion {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc and is freed once.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Another process's [`DeviceKvRegion`], mapped into this one.
///
/// Every `RemoteDeviceKv` of one handle in one context shares one mapping ([`MAPPINGS`]): the
/// driver allows a context to open a given allocation once at a time (on some drivers a second
/// `cuIpcOpenMemHandle` fails with `CUDA_ERROR_ALREADY_MAPPED`, on others it returns the same
/// address and the first close unmaps it for both). A D worker opens a producer's handle again
/// whenever it handshakes again with an unchanged P (after a side-channel timeout, say) while
/// reads through the previous handshake may still be in flight.
#[derive(Debug)]
pub struct RemoteDeviceKv {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    spec: KvCacheSpec,
    key: MappingKey,
}

/// A context (by its driver handle) and the IPC handle opened in it.
type MappingKey = (usize, [u8; 64]);

fn mapping_key(ctx: &CudaContext, handle: &IpcHandle) -> MappingKey {
    (ctx.cu_ctx() as usize, handle.0)
}

/// The mappings open in this process: address and number of [`RemoteDeviceKv`]s using each.
/// Opening and closing happen under this lock, so a close never races an open of the same
/// handle.
static MAPPINGS: std::sync::Mutex<Vec<(MappingKey, sys::CUdeviceptr, usize)>> = std::sync::Mutex::new(Vec::new());

fn mappings() -> std::sync::MutexGuard<'static, Vec<(MappingKey, sys::CUdeviceptr, usize)>> {
    // A panic while holding the lock cannot leave the list half-updated (each update is one
    // push, remove or increment), so a poisoned lock is still usable.
    MAPPINGS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How many [`RemoteDeviceKv`]s of `ctx` use `handle`'s mapping; 0 when it is not open
/// (tests and diagnostics).
pub fn mapping_users(ctx: &CudaContext, handle: &IpcHandle) -> usize {
    let key = mapping_key(ctx, handle);
    mappings().iter().find(|(k, _, _)| *k == key).map_or(0, |(_, _, users)| *users)
}

// SAFETY: as for DeviceKvRegion.
unsafe impl Send for RemoteDeviceKv {}
unsafe impl Sync for RemoteDeviceKv {}

impl RemoteDeviceKv {
    /// Map the region a peer exported. A handle from another machine, a freed region or
    /// garbage bytes is an error, never a crash.
    ///
    /// A handle this context has open already is not opened again: the new value shares the
    /// mapping, which is closed when the last value using it is dropped.
    pub fn open(ctx: Arc<CudaContext>, handle: &IpcHandle, spec: KvCacheSpec) -> Result<Self, CudaIpcError> {
        let key = mapping_key(&ctx, handle);
        let mut open = mappings();
        if let Some((_, ptr, users)) = open.iter_mut().find(|(k, _, _)| *k == key) {
            *users += 1;
            return Ok(Self { ctx, ptr: *ptr, spec, key });
        }
        ctx.bind_to_thread().map_err(|source| CudaIpcError::Driver { what: "bind context", source })?;
        let h = sys::CUipcMemHandle_st { reserved: handle.0.map(|b| b as _) };
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: `ptr` is a valid out-pointer; the driver validates the handle.
        check("cuIpcOpenMemHandle", unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags) })?;
        open.push((key, ptr, 1));
        Ok(Self { ctx, ptr, spec, key })
    }

    /// Copy `remote_blocks[i]` of the peer into `local_blocks[i]` of `local`, every layer, K and
    /// V; contiguous runs of blocks become one copy per layer side. Returns the bytes copied.
    pub fn read_blocks(
        &self,
        remote_blocks: &[u32],
        local: &DeviceKvRegion,
        local_blocks: &[u32],
    ) -> Result<u64, CudaIpcError> {
        self.copy_blocks(remote_blocks, local, local_blocks, true)
    }

    /// [`Self::read_blocks`] through its fallback alone, a copy per row (run, layer, side): what
    /// a device whose pitch limit refuses the 2D copy runs. Public so that its test can force it.
    #[doc(hidden)]
    pub fn read_blocks_row_by_row(
        &self,
        remote_blocks: &[u32],
        local: &DeviceKvRegion,
        local_blocks: &[u32],
    ) -> Result<u64, CudaIpcError> {
        self.copy_blocks(remote_blocks, local, local_blocks, false)
    }

    fn copy_blocks(
        &self,
        remote_blocks: &[u32],
        local: &DeviceKvRegion,
        local_blocks: &[u32],
        two_d: bool,
    ) -> Result<u64, CudaIpcError> {
        let (rs, ls) = (self.spec, local.spec);
        if rs.num_layers != ls.num_layers || rs.floats_per_block() != ls.floats_per_block() {
            return Err(CudaIpcError::Geometry { remote: rs, local: ls });
        }
        if remote_blocks.len() != local_blocks.len() {
            return Err(CudaIpcError::LengthMismatch { remote: remote_blocks.len(), local: local_blocks.len() });
        }
        for (&b, n) in
            remote_blocks.iter().map(|b| (b, rs.num_blocks)).chain(local_blocks.iter().map(|b| (b, ls.num_blocks)))
        {
            if b >= n {
                return Err(CudaIpcError::BlockOutOfRange { block: b, num_blocks: n });
            }
        }
        // runs of consecutive (remote, local) block pairs
        let mut runs: Vec<(u32, u32, usize)> = Vec::new();
        for (&r, &l) in remote_blocks.iter().zip(local_blocks) {
            match runs.last_mut() {
                Some((r0, l0, n)) if *r0 + *n as u32 == r && *l0 + *n as u32 == l => *n += 1,
                _ => runs.push((r, l, 1)),
            }
        }
        self.ctx.bind_to_thread().map_err(|source| CudaIpcError::Driver { what: "bind context", source })?;
        let fpb = rs.floats_per_block();
        let layer_sides = rs.num_layers as usize * 2;
        let mut bytes = 0u64;
        for &(r, l, n) in &runs {
            // One 2D copy per run: a row per (layer, side), rows a layer side apart in each
            // region. Pitches above the device's limit fall back to a copy per row.
            let copy = sys::CUDA_MEMCPY2D_st {
                srcXInBytes: r as usize * fpb * 4,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: self.ptr,
                srcArray: std::ptr::null_mut(),
                srcPitch: rs.num_blocks as usize * fpb * 4,
                dstXInBytes: l as usize * fpb * 4,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: local.ptr,
                dstArray: std::ptr::null_mut(),
                dstPitch: ls.num_blocks as usize * fpb * 4,
                WidthInBytes: n * fpb * 4,
                Height: layer_sides,
            };
            // SAFETY: every row lies inside its region (block ids checked above).
            if !two_d
                || check("cuMemcpy2DAsync", unsafe { sys::cuMemcpy2DAsync_v2(&copy, std::ptr::null_mut()) }).is_err()
            {
                for layer in 0..rs.num_layers as usize {
                    for side in 0..2 {
                        let src = self.ptr + (block_offset(&rs, layer, side, r) * 4) as u64;
                        let dst = local.ptr + (block_offset(&ls, layer, side, l) * 4) as u64;
                        // SAFETY: as above.
                        check("cuMemcpyDtoDAsync", unsafe {
                            sys::cuMemcpyDtoDAsync_v2(dst, src, n * fpb * 4, std::ptr::null_mut())
                        })?;
                    }
                }
            }
            bytes += (n * fpb * 4 * layer_sides) as u64;
        }
        wait_for_queued_copies()?;
        Ok(bytes)
    }
}

impl Drop for RemoteDeviceKv {
    fn drop(&mut self) {
        let mut open = mappings();
        let Some(i) = open.iter().position(|(k, _, _)| *k == self.key) else { return };
        open[i].2 -= 1;
        if open[i].2 > 0 {
            return;
        }
        open.swap_remove(i);
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and its last user is gone: closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Device-to-device copy of `bytes` between two allocations of this process: the baseline the
/// IPC reads are measured against.
pub fn local_copy(dst: &DeviceKvRegion, src: &DeviceKvRegion, bytes: usize) -> Result<(), CudaIpcError> {
    let bytes = bytes.min(dst.spec.total_floats() * 4).min(src.spec.total_floats() * 4);
    dst.bind()?;
    // SAFETY: `bytes` fits both allocations.
    check("cuMemcpyDtoD", unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr, src.ptr, bytes, std::ptr::null_mut()) })?;
    wait_for_queued_copies()
}

/// Wait until the work queued so far on the current context's legacy default stream is done:
/// an event recorded after the copies, not `cuStreamSynchronize`, so a read does not also wait
/// for forward passes another thread queues on the same stream meanwhile.
fn wait_for_queued_copies() -> Result<(), CudaIpcError> {
    let mut event: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: `event` is a valid out-pointer; the caller bound the context.
    check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
    // SAFETY: `event` was just created in this context; the null stream is the legacy one.
    let waited = check("cuEventRecord", unsafe { sys::cuEventRecord(event, std::ptr::null_mut()) })
        // SAFETY: as above.
        .and_then(|()| check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event) }));
    // SAFETY: created above and destroyed once.
    let _ = unsafe { sys::cuEventDestroy_v2(event) };
    waited
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_through_hex() {
        let mut b = [0u8; 64];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37) as u8;
        }
        let h = IpcHandle(b);
        assert_eq!(IpcHandle::from_hex(&h.to_hex()), Some(h));
        assert_eq!(IpcHandle::from_hex("zz"), None);
        assert_eq!(IpcHandle::from_hex(&"g".repeat(128)), None);
    }

    #[test]
    fn only_errors_that_poison_the_context_are_sticky() {
        assert!(is_sticky(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
        assert!(is_sticky(sys::CUresult::CUDA_ERROR_LAUNCH_FAILED));
        assert!(!is_sticky(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(!is_sticky(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
        let e = CudaIpcError::Driver {
            what: "test",
            source: cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
        };
        assert_eq!(e.driver_code(), Some(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
        assert_eq!(CudaIpcError::NoDriver.driver_code(), None);
    }
}
