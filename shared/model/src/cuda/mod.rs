//! [`CudaLlamaExecutor`]: the llama forward pass on an NVIDIA GPU (cargo feature `cuda`).
//!
//! Built on `cudarc` with dynamic loading: the crate compiles and links on a machine without a
//! GPU, driver or CUDA toolkit, and [`CudaLlamaExecutor::load`] returns
//! [`ModelError::Cuda`] where `libcuda`/`libnvrtc` cannot be found. The kernels
//! (`kernels.cu`) are compiled at load time with NVRTC for the GPU at hand.
//!
//! Numerics: the same as the CPU executor (quantized weights stay quantized on the GPU, the
//! activations are quantized to 8 bits per block with candle's rounding, every reduction runs in
//! the CPU executor's order), so a request's tokens do not depend on batching or chunking, and
//! the logits equal the CPU path's up to the last bit of `expf`.
//!
//! KV cache: one GPU region ([`DeviceKvRegion`]) in the host [`KvCache`]'s layout
//! (`[layer][K|V][block][slot][head][dim]`); the kernels take each layer side's address in it.
//! Two modes:
//! - **mirrored** (the default, and every node whose transfer backend is `shm` or `tcp`): the
//!   host cache stays the copy the transfer backends read and write. Every K/V slot a step
//!   writes on the GPU is written to the host cache as well, at the end of the step, so a P
//!   node's held blocks are readable by D; a block a request reads but this GPU did not write
//!   for that request (its KV was loaded from a P node into the host cache) is uploaded before
//!   the step. This is host staging, as vLLM does with a CPU KV buffer.
//! - **resident** ([`CudaLlamaExecutor::use_exported_kv`], the `cuda` transfer backend): the
//!   region is the cache's only copy. P's agent exports it over CUDA IPC and D's reads land in
//!   it device-to-device, so nothing is mirrored or uploaded and the host cache is never
//!   touched.
//!
//! `unsafe` here is the kernel launches (cudarc cannot check argument lists against a kernel's
//! signature) and the library probe; each block says what it relies on.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::CompileOptions;
use half::f16;
use pdmesh_cuda_kv::DeviceKvRegion;
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{Executor, ExecutorError, KvCache, KvCacheSpec, ModelFacts};
use pdmesh_protocol::{SampledToken, ScheduledChunk};

use crate::arch::ModelConfig;
use crate::embedding::Embedding;
use crate::error::ModelError;
use crate::executor::{effective_max_len, model_facts, norm_weights, plan_step, rope_tables};
use crate::gguf::{sha256_file, GgufFile};
use crate::ModelOptions;

const KERNELS: &str = include_str!("kernels.cu");
const QK: usize = 32;
const THREADS: u32 = 128;

fn cuda_err(what: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Cuda(format!("{what}: {e}"))
}

/// A failed CUDA call, with the driver's result code where there is one.
trait CudaFailure: std::fmt::Display {
    fn driver_code(&self) -> Option<cudarc::driver::sys::CUresult>;
}

impl CudaFailure for cudarc::driver::DriverError {
    fn driver_code(&self) -> Option<cudarc::driver::sys::CUresult> {
        Some(self.0)
    }
}

impl CudaFailure for pdmesh_cuda_kv::CudaIpcError {
    fn driver_code(&self) -> Option<cudarc::driver::sys::CUresult> {
        pdmesh_cuda_kv::CudaIpcError::driver_code(self)
    }
}

/// A step's CUDA failure: a sticky one (the context is poisoned) is a lost device, and the
/// worker exits to be restarted; any other fails the step's requests and nothing more.
fn exec_err(e: impl CudaFailure) -> ExecutorError {
    match e.driver_code() {
        Some(code) if pdmesh_cuda_kv::is_sticky(code) => ExecutorError::DeviceLost(format!("cuda: {e}")),
        _ => ExecutorError::Model(format!("cuda: {e}")),
    }
}

/// Names of the kernels in `kernels.cu`.
struct Kernels {
    quantize_q8: CudaFunction,
    mm_q4_1: CudaFunction,
    mm_q8_0: CudaFunction,
    mm_f32: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    kv_write: CudaFunction,
    attention: CudaFunction,
    silu_mul: CudaFunction,
    add_in_place: CudaFunction,
    gather_rows: CudaFunction,
}

impl Kernels {
    fn load(module: &Arc<CudaModule>) -> Result<Self, ModelError> {
        let f = |name: &str| module.load_function(name).map_err(|e| cuda_err(name, e));
        Ok(Self {
            quantize_q8: f("quantize_q8")?,
            mm_q4_1: f("mm_q4_1")?,
            mm_q8_0: f("mm_q8_0")?,
            mm_f32: f("mm_f32")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            kv_write: f("kv_write")?,
            attention: f("attention")?,
            silu_mul: f("silu_mul")?,
            add_in_place: f("add_in_place")?,
            gather_rows: f("gather_rows")?,
        })
    }
}

/// One weight matrix `[rows, k]` in GPU memory.
enum GpuLinear {
    Q4_1 { rows: usize, k: usize, qs: CudaSlice<u8>, d: CudaSlice<f32>, m: CudaSlice<f32> },
    Q8_0 { rows: usize, k: usize, qs: CudaSlice<i8>, d: CudaSlice<f32> },
    F32 { rows: usize, k: usize, w: CudaSlice<f32> },
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    match b.get(i..i + 2) {
        Some(&[lo, hi]) => f16::from_le_bytes([lo, hi]).to_f32(),
        _ => 0.0,
    }
}

impl GpuLinear {
    fn load(stream: &Arc<CudaStream>, g: &mut GgufFile, name: &str, rows: usize, k: usize) -> Result<Self, ModelError> {
        let qt = g.tensor_with_dims(name, &[rows, k])?;
        Self::from_qtensor(stream, name, &qt, rows, k)
    }

    fn from_qtensor(
        stream: &Arc<CudaStream>,
        name: &str,
        qt: &candle_core::quantized::QTensor,
        rows: usize,
        k: usize,
    ) -> Result<Self, ModelError> {
        use candle_core::quantized::GgmlDType;
        let bad = |reason: String| ModelError::InvalidTensor { name: name.to_string(), reason };
        let nb = k / QK;
        let up = |e| cuda_err(name, e);
        match qt.dtype() {
            GgmlDType::Q4_1 if k.is_multiple_of(QK) => {
                let raw = qt.data().map_err(|e| bad(e.to_string()))?;
                if raw.len() != rows * nb * 20 {
                    return Err(bad(format!("{} bytes of Q4_1 for [{rows}, {k}]", raw.len())));
                }
                let (mut qs, mut d, mut m) = (Vec::with_capacity(rows * nb * 16), Vec::new(), Vec::new());
                for blk in raw.chunks_exact(20) {
                    d.push(f16_at(blk, 0));
                    m.push(f16_at(blk, 2));
                    qs.extend_from_slice(&blk[4..20]);
                }
                Ok(GpuLinear::Q4_1 {
                    rows,
                    k,
                    qs: stream.clone_htod(&qs).map_err(up)?,
                    d: stream.clone_htod(&d).map_err(up)?,
                    m: stream.clone_htod(&m).map_err(up)?,
                })
            }
            GgmlDType::Q8_0 if k.is_multiple_of(QK) => {
                let raw = qt.data().map_err(|e| bad(e.to_string()))?;
                if raw.len() != rows * nb * 34 {
                    return Err(bad(format!("{} bytes of Q8_0 for [{rows}, {k}]", raw.len())));
                }
                let (mut qs, mut d) = (Vec::with_capacity(rows * k), Vec::new());
                for blk in raw.chunks_exact(34) {
                    d.push(f16_at(blk, 0));
                    qs.extend(blk[2..34].iter().map(|&b| b as i8));
                }
                Ok(GpuLinear::Q8_0 {
                    rows,
                    k,
                    qs: stream.clone_htod(&qs).map_err(up)?,
                    d: stream.clone_htod(&d).map_err(up)?,
                })
            }
            _ => {
                let w = qt
                    .dequantize(&candle_core::Device::Cpu)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(|e| bad(e.to_string()))?;
                Ok(GpuLinear::F32 { rows, k, w: stream.clone_htod(&w).map_err(up)? })
            }
        }
    }

    fn rows(&self) -> usize {
        match self {
            GpuLinear::Q4_1 { rows, .. } | GpuLinear::Q8_0 { rows, .. } | GpuLinear::F32 { rows, .. } => *rows,
        }
    }

    fn is_dense(&self) -> bool {
        matches!(self, GpuLinear::F32 { .. })
    }
}

struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    wq: GpuLinear,
    wk: GpuLinear,
    wv: GpuLinear,
    wo: GpuLinear,
    ffn_norm: CudaSlice<f32>,
    gate: GpuLinear,
    up: GpuLinear,
    down: GpuLinear,
}

/// Activations quantized on the GPU ([`Kernels::quantize_q8`]'s outputs).
struct QActs {
    qs: CudaSlice<i8>,
    d: CudaSlice<f32>,
    s: CudaSlice<f32>,
}

/// The GPU's paged KV cache and, when the host cache is the truth, who wrote each block.
struct DeviceKv {
    region: Arc<DeviceKvRegion>,
    /// The region is the cache's only copy (the `cuda` transfer backend): no mirror, no uploads.
    resident: bool,
    /// Mirrored mode: the request whose K/V this GPU last wrote into each block; a block read by
    /// another request (or never written here) is uploaded from the host cache first.
    writer: Vec<Option<String>>,
}

impl DeviceKv {
    fn spec(&self) -> &KvCacheSpec {
        self.region.spec()
    }

    /// Device addresses of every layer's K and V, the kernels' cache arguments.
    fn layer_ptrs(&self) -> Result<Vec<(u64, u64)>, ExecutorError> {
        (0..self.spec().num_layers as usize)
            .map(|li| match (self.region.layer_side_ptr(li, 0), self.region.layer_side_ptr(li, 1)) {
                (Some(k), Some(v)) => Ok((k, v)),
                _ => Err(ExecutorError::Model(format!("cuda: layer {li} is outside the KV region"))),
            })
            .collect()
    }
}

/// A llama-architecture GGUF model on an NVIDIA GPU, implementing [`Executor`].
pub struct CudaLlamaExecutor {
    facts: ModelFacts,
    /// Grammar matchers of the requests with structured outputs (D53).
    guide: pdmesh_guided::Guide,
    cfg: ModelConfig,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    embedding: Embedding,
    layers: Vec<GpuLayer>,
    out_norm: CudaSlice<f32>,
    output: GpuLinear,
    rope_cos: CudaSlice<f32>,
    rope_sin: CudaSlice<f32>,
    kv: Option<DeviceKv>,
    device_name: String,
    logits: Vec<f32>,
}

impl std::fmt::Debug for CudaLlamaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLlamaExecutor")
            .field("facts", &self.facts)
            .field("device", &self.device_name)
            .finish_non_exhaustive()
    }
}

/// Whether a CUDA driver and NVRTC can be loaded on this machine (without touching a GPU).
pub fn cuda_available() -> bool {
    missing_cuda_library().is_none()
}

/// The library the GPU executor needs and cannot load here, named for the operator: the
/// driver (`libcuda`, comes with the GPU's driver) or NVRTC (`libnvrtc`, the CUDA toolkit's
/// runtime compiler, which builds the kernels at start-up).
pub fn missing_cuda_library() -> Option<&'static str> {
    // SAFETY: these only try to dlopen the libraries; they call nothing in them.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        Some("the CUDA driver library (libcuda)")
    } else if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Some("NVRTC (libnvrtc, from the CUDA toolkit)")
    } else {
        None
    }
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn grid2(n: usize, m: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS).max(1), m as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch a kernel of `kernels.cu` with its arguments in the order of its signature.
macro_rules! launch {
    ($self:expr, $f:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let mut b = $self.stream.launch_builder(&$f);
        $( b.arg($arg); )*
        // SAFETY: every call site passes the kernel's arguments in the order and types of its
        // signature in kernels.cu, and every buffer holds at least the elements the launch's
        // sizes index (the step plan range-checked tokens, positions and block ids).
        unsafe { b.launch($cfg) }.map(|_| ()).map_err(exec_err)
    }};
}

fn to_i32(v: usize) -> Result<i32, ExecutorError> {
    i32::try_from(v).map_err(|_| ExecutorError::Model(format!("cuda: {v} does not fit a kernel argument")))
}

impl CudaLlamaExecutor {
    /// Load the GGUF file at `path` onto GPU `ordinal`.
    pub fn load(path: impl AsRef<std::path::Path>, options: &ModelOptions, ordinal: usize) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let mut g = GgufFile::open(path)?;
        let weights_id = sha256_file(path)?;
        let eos = crate::text::eos_token_ids(g.metadata())?;
        Self::from_gguf(&mut g, options, weights_id, eos, ordinal)
    }

    pub(crate) fn from_gguf(
        g: &mut GgufFile,
        options: &ModelOptions,
        weights_id: String,
        eos_token_ids: Vec<u32>,
        ordinal: usize,
    ) -> Result<Self, ModelError> {
        // The GPU kernels implement the llama recipe only: any other architecture is refused
        // here, by name, before the GPU is touched (the CPU executor serves it).
        let cfg = crate::arch::model_config(g)?;
        if !cfg.is_plain_llama() {
            return Err(ModelError::UnsupportedFeature {
                feature: format!(
                    "the CUDA executor runs the llama recipe only; {:?} (its biases, norms, activation or \
                     sliding windows) runs on the CPU executor (model.device = \"cpu\")",
                    cfg.arch
                ),
            });
        }
        if let Some(missing) = missing_cuda_library() {
            return Err(ModelError::Cuda(format!("{missing} cannot be loaded on this machine")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("open GPU", e))?;
        let device_name = ctx.name().unwrap_or_else(|_| format!("cuda:{ordinal}"));
        let stream = ctx.default_stream();
        let opts = CompileOptions { fmad: Some(false), ..Default::default() };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts).map_err(|e| cuda_err("compile kernels", e))?;
        let module = ctx.load_module(ptx).map_err(|e| cuda_err("load kernels", e))?;
        let kernels = Kernels::load(&module)?;

        let (hd, h, f) = (cfg.head_dim, cfg.hidden, cfg.ffn_dim);
        let (q_dim, kv_dim) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let up = |what: &str, e| cuda_err(what, e);
        let embd_q = g.tensor_with_dims("token_embd.weight", &[cfg.vocab_size, h])?;
        let embedding = Embedding::new("token_embd.weight", &embd_q)?;
        let output = if g.has_tensor("output.weight") {
            GpuLinear::load(&stream, g, "output.weight", cfg.vocab_size, h)?
        } else {
            GpuLinear::from_qtensor(&stream, "token_embd.weight", &embd_q, cfg.vocab_size, h)?
        };
        let out_norm =
            stream.clone_htod(&norm_weights(g, "output_norm.weight", h)?).map_err(|e| up("output_norm", e))?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let p = format!("blk.{i}");
            let norm = |g: &mut GgufFile, n: &str| -> Result<CudaSlice<f32>, ModelError> {
                stream.clone_htod(&norm_weights(g, n, h)?).map_err(|e| cuda_err(n, e))
            };
            layers.push(GpuLayer {
                attn_norm: norm(g, &format!("{p}.attn_norm.weight"))?,
                wq: GpuLinear::load(&stream, g, &format!("{p}.attn_q.weight"), q_dim, h)?,
                wk: GpuLinear::load(&stream, g, &format!("{p}.attn_k.weight"), kv_dim, h)?,
                wv: GpuLinear::load(&stream, g, &format!("{p}.attn_v.weight"), kv_dim, h)?,
                wo: GpuLinear::load(&stream, g, &format!("{p}.attn_output.weight"), h, q_dim)?,
                ffn_norm: norm(g, &format!("{p}.ffn_norm.weight"))?,
                gate: GpuLinear::load(&stream, g, &format!("{p}.ffn_gate.weight"), f, h)?,
                up: GpuLinear::load(&stream, g, &format!("{p}.ffn_up.weight"), f, h)?,
                down: GpuLinear::load(&stream, g, &format!("{p}.ffn_down.weight"), h, f)?,
            });
        }
        let max_model_len = effective_max_len(cfg.context_length, options);
        let (cos, sin) =
            rope_tables(hd, cfg.recipe.layers.first().map_or(10_000.0, |l| l.rope_base), max_model_len as usize);
        let rope_cos = stream.clone_htod(&cos).map_err(|e| up("rope", e))?;
        let rope_sin = stream.clone_htod(&sin).map_err(|e| up("rope", e))?;
        stream.synchronize().map_err(|e| up("upload weights", e))?;
        let facts = model_facts(&cfg, &g.path, max_model_len, eos_token_ids, weights_id);
        let guide = crate::guided::guide_from_gguf(g, cfg.vocab_size, &facts.eos_token_ids);
        tracing::info!(name = %facts.name, device = %device_name, layers = cfg.n_layers, "loaded llama GGUF model on the GPU");
        Ok(Self {
            facts,
            guide,
            cfg,
            stream,
            kernels,
            embedding,
            layers,
            out_norm,
            output,
            rope_cos,
            rope_sin,
            kv: None,
            device_name,
            logits: Vec::new(),
        })
    }

    /// The GPU's name, as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The logits (`[n_sampled, vocab]`, in chunk order) of the last step's sampling chunks.
    pub fn last_logits(&self) -> &[f32] {
        &self.logits
    }

    fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, ExecutorError> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(exec_err)
    }

    fn quantize(&self, x: &CudaSlice<f32>, rows: usize, k: usize) -> Result<QActs, ExecutorError> {
        let nb = k / QK;
        let mut q = QActs { qs: self.alloc(rows * k)?, d: self.alloc(rows * nb)?, s: self.alloc(rows * nb)? };
        let (r, kk) = (to_i32(rows)?, to_i32(k)?);
        launch!(self, self.kernels.quantize_q8, grid(rows * nb); x, &r, &kk, &mut q.qs, &mut q.d, &mut q.s)?;
        Ok(q)
    }

    /// `out[m, rows] = x[m, k] · Wᵀ`; `qx` is `x` quantized (unused for dense weights).
    fn matmul(&self, w: &GpuLinear, x: &CudaSlice<f32>, qx: &QActs, m: usize) -> Result<CudaSlice<f32>, ExecutorError> {
        let mut out = self.alloc::<f32>(m * w.rows())?;
        let mi = to_i32(m)?;
        match w {
            GpuLinear::Q4_1 { rows, k, qs, d, m: mins } => {
                let (r, kk) = (to_i32(*rows)?, to_i32(*k)?);
                launch!(self, self.kernels.mm_q4_1, grid2(*rows, m); qs, d, mins, &r, &kk, &qx.qs, &qx.d, &qx.s, &mi, &mut out)?;
            }
            GpuLinear::Q8_0 { rows, k, qs, d } => {
                let (r, kk) = (to_i32(*rows)?, to_i32(*k)?);
                launch!(self, self.kernels.mm_q8_0, grid2(*rows, m); qs, d, &r, &kk, &qx.qs, &qx.d, &mi, &mut out)?;
            }
            GpuLinear::F32 { rows, k, w } => {
                let (r, kk) = (to_i32(*rows)?, to_i32(*k)?);
                launch!(self, self.kernels.mm_f32, grid2(*rows, m); w, &r, &kk, x, &mi, &mut out)?;
            }
        }
        Ok(out)
    }

    /// Quantize `x` once for the quantized weights among `ws`, then multiply each.
    fn matmuls<const N: usize>(
        &self,
        ws: [&GpuLinear; N],
        x: &CudaSlice<f32>,
        m: usize,
        k: usize,
    ) -> Result<[CudaSlice<f32>; N], ExecutorError> {
        let qx = if ws.iter().all(|w| w.is_dense()) {
            QActs { qs: self.alloc(1)?, d: self.alloc(1)?, s: self.alloc(1)? }
        } else {
            self.quantize(x, m, k)?
        };
        let mut outs = Vec::with_capacity(N);
        for w in ws {
            outs.push(self.matmul(w, x, &qx, m)?);
        }
        outs.try_into().map_err(|_| ExecutorError::Model("cuda: matmul outputs".into()))
    }

    fn rms_norm(&self, x: &CudaSlice<f32>, w: &CudaSlice<f32>, rows: usize) -> Result<CudaSlice<f32>, ExecutorError> {
        let d = self.cfg.hidden;
        let mut out = self.alloc::<f32>(rows * d)?;
        let (r, di, eps) = (to_i32(rows)?, to_i32(d)?, self.cfg.rms_eps);
        launch!(self, self.kernels.rms_norm, grid(rows); x, w, &r, &di, &eps, &mut out)?;
        Ok(out)
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<(), ExecutorError> {
        let ni = to_i32(n)?;
        launch!(self, self.kernels.add_in_place, grid(n); x, y, &ni)
    }

    /// Put this executor's KV cache in one exportable GPU region of `spec`'s geometry and make it
    /// the cache's only copy (resident mode: no host mirror, no uploads). For the `cuda`
    /// transfer backend: the worker shares the returned region with its transfer agent, which
    /// exports it to D (P), and with its transfer client, whose reads land in it (D). Every
    /// later step must use a host cache of the same geometry.
    pub fn use_exported_kv(&mut self, spec: KvCacheSpec) -> Result<Arc<DeviceKvRegion>, ModelError> {
        let region = DeviceKvRegion::new(self.stream.context().clone(), spec)
            .map_err(|e| cuda_err("allocate the KV region", e))?;
        let region = Arc::new(region);
        self.kv = Some(DeviceKv { region: region.clone(), resident: true, writer: Vec::new() });
        tracing::info!(blocks = spec.num_blocks, bytes = spec.total_floats() * 4, "KV cache resident on the GPU");
        Ok(region)
    }

    /// Make the device cache match the host cache's geometry (allocating it on first use; a
    /// resident cache never changes).
    fn ensure_kv(&mut self, spec: KvCacheSpec) -> Result<(), ExecutorError> {
        match &self.kv {
            Some(k) if *k.spec() == spec => return Ok(()),
            Some(k) if k.resident => {
                return Err(ExecutorError::Model(format!(
                    "cuda: the step's cache geometry {spec:?} differs from the resident region's {:?}",
                    k.spec()
                )))
            }
            _ => {}
        }
        let region = DeviceKvRegion::new(self.stream.context().clone(), spec).map_err(exec_err)?;
        self.kv =
            Some(DeviceKv { region: Arc::new(region), resident: false, writer: vec![None; spec.num_blocks as usize] });
        Ok(())
    }

    /// Upload the blocks a chunk reads (positions before its start) that this GPU did not write
    /// for that request: their K/V came into the host cache from elsewhere (a KV transfer).
    fn upload_foreign_blocks(&mut self, host: &KvCache, chunks: &[ScheduledChunk]) -> Result<u64, ExecutorError> {
        let Some(dev) = self.kv.as_mut().filter(|d| !d.resident) else { return Ok(0) };
        let spec = *dev.spec();
        let bs = spec.block_size as usize;
        let mut uploaded = 0u64;
        for c in chunks {
            let read_blocks = (c.start_pos as usize).div_ceil(bs);
            for &b in c.block_ids.iter().take(read_blocks) {
                let bi = b as usize;
                if dev.writer.get(bi).and_then(|w| w.as_deref()) == Some(c.request_id.as_str()) {
                    continue;
                }
                for li in 0..spec.num_layers as usize {
                    for (side, kv_side) in [(0, KvSide::Key), (1, KvSide::Value)] {
                        let src = host.block(li, kv_side, b)?;
                        let off = pdmesh_cuda_kv::block_offset(&spec, li, side, b);
                        dev.region.write_floats(off, src).map_err(exec_err)?;
                    }
                }
                if let Some(w) = dev.writer.get_mut(bi) {
                    *w = Some(c.request_id.clone());
                }
                uploaded += 1;
            }
        }
        Ok(uploaded)
    }

    fn forward(&mut self, host: &mut KvCache, chunks: &[ScheduledChunk]) -> Result<Vec<SampledToken>, ExecutorError> {
        let plan = plan_step(&self.cfg, self.facts.max_model_len as usize, host, chunks)?;
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        self.ensure_kv(*host.spec())?;
        self.upload_foreign_blocks(host, chunks)?;
        let result = self.run_step(host, chunks, &plan);
        if result.is_err() {
            // A step that failed midway may have written part of its slots. Mirrored: trust
            // nothing on the device, and the next steps upload what they read from the host
            // cache. Resident: the failed step's requests are failed by the engine; every
            // other block is untouched.
            if let Some(dev) = self.kv.as_mut().filter(|d| !d.resident) {
                dev.writer.fill(None);
            }
        }
        result
    }

    fn run_step(
        &mut self,
        host: &mut KvCache,
        chunks: &[ScheduledChunk],
        plan: &[crate::executor::TokenPlan],
    ) -> Result<Vec<SampledToken>, ExecutorError> {
        let spec = *host.spec();
        let dev = self.kv.as_ref().ok_or_else(|| ExecutorError::Model("cuda: no KV cache".into()))?;
        let (kv_ptrs, resident) = (dev.layer_ptrs()?, dev.resident);
        let bs = spec.block_size as usize;
        let n_layers = self.cfg.n_layers;

        let layout = self.host_layout(chunks, plan, bs)?;
        let (mut x, mut step) = self.upload_step(&layout, plan.len(), bs)?;
        // K/V of this step's tokens per layer, copied to the host cache at the end.
        let mut new_k = Vec::with_capacity(n_layers);
        let mut new_v = Vec::with_capacity(n_layers);
        for li in 0..n_layers {
            // The layer's K and V in the cache region: raw device addresses, passed to the
            // kernels exactly as a `CudaSlice`'s own address is (every launch is on the one
            // default stream, so no event tracking is lost).
            let kv_ptr =
                kv_ptrs.get(li).copied().ok_or_else(|| ExecutorError::Model(format!("cuda: no layer {li}")))?;
            let (k, v) = self.run_layer(li, &mut x, &mut step, kv_ptr)?;
            if !resident {
                new_k.push(k);
                new_v.push(v);
            }
        }
        let result = self.sample_last_tokens(chunks, &x)?;

        if resident {
            // The step's K/V is in the region only when its kernels have run: wait for them
            // before reporting the step done, as the mirrored mode's copies back to the host
            // do. The scheduler starts a P hold, and D reads, only after a step is reported
            // done; without this only a step that samples (its logits copy waits) would
            // guarantee that, and a kernel fault would surface in a later step.
            self.stream.synchronize().map_err(exec_err)?;
            return Ok(result);
        }
        self.mirror_kv_to_host(host, &new_k, &new_v, &layout.slot)?;
        self.record_writers(chunks, plan, bs);
        Ok(result)
    }

    /// The step's layout on the host: every token's embedding, position and cache slot, each
    /// chunk's block table (concatenated) and where it starts, and the longest sequence.
    fn host_layout(
        &self,
        chunks: &[ScheduledChunk],
        plan: &[crate::executor::TokenPlan],
        bs: usize,
    ) -> Result<HostLayout, ExecutorError> {
        let (n, h) = (plan.len(), self.cfg.hidden);
        let mut x = vec![0f32; n * h];
        let ids = chunks.iter().flat_map(|c| c.token_ids.iter().copied());
        for (row, id) in x.chunks_exact_mut(h).zip(ids) {
            self.embedding.row_into(id as usize, row);
        }
        let mut tables: Vec<i32> = Vec::new();
        let mut chunk_table_off = Vec::with_capacity(chunks.len());
        for c in chunks {
            chunk_table_off.push(to_i32(tables.len())?);
            for &b in &c.block_ids {
                tables.push(to_i32(b as usize)?);
            }
        }
        let (mut pos, mut slot, mut bt_off) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        let mut max_len = 0usize;
        for tp in plan {
            let c = &chunks[tp.chunk];
            pos.push(to_i32(tp.pos)?);
            slot.push(to_i32(c.block_ids[tp.pos / bs] as usize * bs + tp.pos % bs)?);
            bt_off.push(chunk_table_off[tp.chunk]);
            max_len = max_len.max(tp.pos + 1);
        }
        Ok(HostLayout { x, tables, pos, slot, bt_off, max_len })
    }

    /// The step's activations (the embeddings) and layout on the device, with the attention's
    /// score buffer and the kernels' size arguments.
    fn upload_step(
        &self,
        layout: &HostLayout,
        n: usize,
        bs: usize,
    ) -> Result<(CudaSlice<f32>, DeviceStep), ExecutorError> {
        let cfg = &self.cfg;
        let (hd, nh, nkv) = (cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let st = &self.stream;
        let x = st.clone_htod(&layout.x).map_err(exec_err)?;
        let pos = st.clone_htod(&layout.pos).map_err(exec_err)?;
        let slot = st.clone_htod(&layout.slot).map_err(exec_err)?;
        let bt_off = st.clone_htod(&layout.bt_off).map_err(exec_err)?;
        let tables = st.clone_htod(&layout.tables).map_err(exec_err)?;
        let scores = self.alloc::<f32>(n * nh * layout.max_len)?;
        let step = DeviceStep {
            tokens: n,
            pos,
            slot,
            bt_off,
            tables,
            scores,
            n: to_i32(n)?,
            nh: to_i32(nh)?,
            nkv: to_i32(nkv)?,
            hd: to_i32(hd)?,
            bs: to_i32(bs)?,
            kv_dim: to_i32(nkv * hd)?,
            stride: to_i32(layout.max_len)?,
            scale: (1.0 / (hd as f64).sqrt()) as f32,
        };
        Ok((x, step))
    }

    /// Layer `li` over the step's activations `x`: attention (its K/V written into the cache
    /// at `kv_ptr`, the layer's K and V addresses) and MLP, each added to `x`. Returns the
    /// layer's K and V of the step's tokens, for the host mirror.
    fn run_layer(
        &self,
        li: usize,
        x: &mut CudaSlice<f32>,
        d: &mut DeviceStep,
        (kc, vc): (u64, u64),
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>), ExecutorError> {
        let cfg = &self.cfg;
        let (n, h, hd, nh, nkv) = (d.tokens, cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let kv_dim = nkv * hd;
        let layer = &self.layers[li];
        let hn = self.rms_norm(x, &layer.attn_norm, n)?;
        let [mut q, mut k, v] = self.matmuls([&layer.wq, &layer.wk, &layer.wv], &hn, n, h)?;
        launch!(self, self.kernels.rope, grid(n * nh * hd / 2); &mut q, &d.n, &d.nh, &d.hd, &d.pos, &self.rope_cos, &self.rope_sin)?;
        launch!(self, self.kernels.rope, grid(n * nkv * hd / 2); &mut k, &d.n, &d.nkv, &d.hd, &d.pos, &self.rope_cos, &self.rope_sin)?;
        launch!(self, self.kernels.kv_write, grid(n * kv_dim); &k, &v, &d.n, &d.kv_dim, &d.slot, &kc, &vc)?;
        let mut attn = self.alloc::<f32>(n * nh * hd)?;
        launch!(self, self.kernels.attention, grid(n * nh); &q, &kc, &vc, &d.n, &d.nh, &d.nkv, &d.hd, &d.bs, &d.pos, &d.bt_off, &d.tables, &d.scale, &mut d.scores, &d.stride, &mut attn)?;
        let [proj] = self.matmuls([&layer.wo], &attn, n, nh * hd)?;
        self.add(x, &proj, n * h)?;
        let hn = self.rms_norm(x, &layer.ffn_norm, n)?;
        let [mut gate, upv] = self.matmuls([&layer.gate, &layer.up], &hn, n, h)?;
        let nf = to_i32(n * cfg.ffn_dim)?;
        launch!(self, self.kernels.silu_mul, grid(n * cfg.ffn_dim); &mut gate, &upv, &nf)?;
        let [proj] = self.matmuls([&layer.down], &gate, n, cfg.ffn_dim)?;
        self.add(x, &proj, n * h)?;
        Ok((k, v))
    }

    /// Logits of the last token of every sampling chunk (kept in `self.logits`, empty when no
    /// chunk samples) and the tokens drawn from them, under each grammar's mask.
    fn sample_last_tokens(
        &mut self,
        chunks: &[ScheduledChunk],
        x: &CudaSlice<f32>,
    ) -> Result<Vec<SampledToken>, ExecutorError> {
        let (h, vocab) = (self.cfg.hidden, self.cfg.vocab_size);
        let mut last_rows = Vec::new();
        let mut sampling_chunks = Vec::new();
        let mut row_start = 0usize;
        for c in chunks {
            let len = c.token_ids.len();
            if c.sample && len > 0 {
                last_rows.push(to_i32(row_start + len - 1)?);
                sampling_chunks.push(c);
            }
            row_start += len;
        }
        if sampling_chunks.is_empty() {
            self.logits.clear();
            return Ok(Vec::new());
        }
        let m = last_rows.len();
        let idx = self.stream.clone_htod(&last_rows).map_err(exec_err)?;
        let mut last = self.alloc::<f32>(m * h)?;
        let (mi, hi) = (to_i32(m)?, to_i32(h)?);
        launch!(self, self.kernels.gather_rows, grid(m * h); x, &idx, &mi, &hi, &mut last)?;
        let hn = self.rms_norm(&last, &self.out_norm, m)?;
        let [logits] = self.matmuls([&self.output], &hn, m, h)?;
        self.logits = self.stream.clone_dtoh(&logits).map_err(exec_err)?;
        let masks = crate::guided::masks(&mut self.guide, &sampling_chunks);
        let eos = self.facts.eos_token_ids.first().copied().unwrap_or(0);
        let mut out = Vec::with_capacity(m);
        for ((c, row), mask) in sampling_chunks.iter().zip(self.logits.chunks_exact(vocab)).zip(&masks) {
            let s = crate::guided::sample_masked(row, c, mask.as_ref(), eos)
                .map_err(|e| ExecutorError::Model(e.to_string()))?;
            if c.sampling.guided.is_some() {
                self.guide.commit(&c.request_id, s.token_id);
            }
            out.push(SampledToken { request_id: c.request_id.clone(), token_id: s.token_id, logprobs: s.logprobs });
        }
        Ok(out)
    }

    /// Mirrored mode: copy this step's K/V (`new_k`, `new_v`, one per layer) into the host
    /// cache, what transfer backends read, at each token's `slot`.
    fn mirror_kv_to_host(
        &self,
        host: &mut KvCache,
        new_k: &[CudaSlice<f32>],
        new_v: &[CudaSlice<f32>],
        slot: &[i32],
    ) -> Result<(), ExecutorError> {
        let kv_dim = self.cfg.n_kv_heads * self.cfg.head_dim;
        for (li, (k, v)) in new_k.iter().zip(new_v).enumerate() {
            let k_host = self.stream.clone_dtoh(k).map_err(exec_err)?;
            let v_host = self.stream.clone_dtoh(v).map_err(exec_err)?;
            let (kc, vc) = host.layer_kv_mut(li);
            for (t, &s) in slot.iter().enumerate() {
                let off = s as usize * kv_dim;
                kc[off..off + kv_dim].copy_from_slice(&k_host[t * kv_dim..(t + 1) * kv_dim]);
                vc[off..off + kv_dim].copy_from_slice(&v_host[t * kv_dim..(t + 1) * kv_dim]);
            }
        }
        Ok(())
    }

    /// Mirrored mode: record which request wrote each block this step wrote, so a later read
    /// by another request uploads it from the host cache first.
    fn record_writers(&mut self, chunks: &[ScheduledChunk], plan: &[crate::executor::TokenPlan], bs: usize) {
        let Some(dev) = self.kv.as_mut() else { return };
        for tp in plan {
            let c = &chunks[tp.chunk];
            if let Some(w) = dev.writer.get_mut(c.block_ids[tp.pos / bs] as usize) {
                if w.as_deref() != Some(c.request_id.as_str()) {
                    *w = Some(c.request_id.clone());
                }
            }
        }
    }
}

/// A step's layout on the host ([`CudaLlamaExecutor::host_layout`]): what its device copies
/// are made from.
struct HostLayout {
    /// Every token's embedding, `[n, hidden]`.
    x: Vec<f32>,
    /// Every chunk's block table, concatenated.
    tables: Vec<i32>,
    /// Every token's position.
    pos: Vec<i32>,
    /// Every token's cache slot (`block * block_size + offset`).
    slot: Vec<i32>,
    /// Where each token's chunk's table starts in `tables`.
    bt_off: Vec<i32>,
    /// The longest sequence of the step (the attention scores' row stride).
    max_len: usize,
}

/// A step's layout on the device and the size arguments every layer's kernels take
/// ([`CudaLlamaExecutor::upload_step`]).
struct DeviceStep {
    /// The step's token count (`n` as a `usize`).
    tokens: usize,
    pos: CudaSlice<i32>,
    slot: CudaSlice<i32>,
    bt_off: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    /// The attention's scratch, `[n, n_heads, stride]`, reused by every layer.
    scores: CudaSlice<f32>,
    n: i32,
    nh: i32,
    nkv: i32,
    hd: i32,
    bs: i32,
    kv_dim: i32,
    stride: i32,
    scale: f32,
}

impl Executor for CudaLlamaExecutor {
    fn facts(&self) -> &ModelFacts {
        &self.facts
    }

    fn execute(&mut self, kv: &mut KvCache, chunks: &[ScheduledChunk]) -> Result<Vec<SampledToken>, ExecutorError> {
        self.forward(kv, chunks)
    }

    fn release(&mut self, request_ids: &[String]) {
        self.guide.release(request_ids);
    }
}
