//! Build the model pieces a node's services need: the executor (connector-worker) and the text
//! codec (frontend).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use pdmesh_config::{ModelKind, NodeConfig};
use pdmesh_connector_worker::{ExecutorFactory, KvPlacement};
use pdmesh_model_api::{ModelFacts, TextCodec};
use pdmesh_synthetic_executor::{SyntheticConfig, SyntheticExecutor, SyntheticTextCodec};

pub struct LoadedText {
    pub codec: Arc<dyn TextCodec>,
    pub options: pdmesh_frontend::FrontendOptions,
}

fn synthetic_config(node: &NodeConfig) -> SyntheticConfig {
    let mut c = SyntheticConfig::default();
    if !node.model.name.is_empty() {
        c.name = node.model.name.clone();
    }
    if node.engine.max_model_len > 0 {
        c.max_model_len = node.engine.max_model_len;
    }
    c.per_token_cost = Duration::from_micros(node.model.per_token_cost_us);
    c.per_step_cost = Duration::from_micros(node.model.per_step_cost_us);
    c
}

fn effective_max_len(node: &NodeConfig, model_max: u32) -> u32 {
    node.engine.effective_max_model_len(model_max)
}

pub fn load_text(node: &NodeConfig) -> anyhow::Result<LoadedText> {
    match node.model.kind {
        ModelKind::Synthetic => {
            let ex = SyntheticExecutor::new(synthetic_config(node));
            let f = pdmesh_model_api::Executor::facts(&ex).clone();
            Ok(LoadedText {
                codec: Arc::new(SyntheticTextCodec),
                options: pdmesh_frontend::FrontendOptions {
                    served_model_name: f.name.clone(),
                    max_model_len: effective_max_len(node, f.max_model_len),
                    vocab_size: f.vocab_size,
                    eos_token_ids: f.eos_token_ids.clone(),
                    rejection_notices: rejection_notices(node),
                },
            })
        }
        ModelKind::Gguf => {
            let path = gguf_path(node)?;
            let mut codec = pdmesh_model::GgufTextCodec::load(&path, &gguf_options(node))
                .with_context(|| format!("loading the tokenizer of {}", path.display()))?;
            if !node.model.chat_template.is_empty() {
                codec = with_chat_template(codec, &node.model.chat_template)?;
            }
            let max_model_len = effective_max_len(node, codec.max_model_len());
            let eos = codec.eos_token_ids().to_vec();
            let vocab = pdmesh_model_api::TextCodec::vocab_size(&codec);
            Ok(LoadedText {
                codec: Arc::new(codec),
                options: pdmesh_frontend::FrontendOptions {
                    served_model_name: served_name(node, &path),
                    max_model_len,
                    vocab_size: vocab,
                    eos_token_ids: eos,
                    rejection_notices: rejection_notices(node),
                },
            })
        }
    }
}

/// `engine.kv_cache_memory` turned into `engine.num_blocks` on every node that sets it, from
/// the KV bytes per token of the node's model (its GGUF header, or the synthetic model's
/// facts). Every process of a mesh runs this on the same topology and files, so the frontend,
/// the engine and the workers agree on the pool. A budget that cannot hold one sequence is a
/// configuration error naming both numbers.
pub fn resolve_kv_budgets(topo: &mut pdmesh_config::Topology) -> anyhow::Result<()> {
    for node in &mut topo.nodes {
        if node.engine.kv_cache_memory.is_none() {
            continue;
        }
        let (per_token, model_max) = match node.model.kind {
            ModelKind::Synthetic => {
                let f = pdmesh_model_api::Executor::facts(&SyntheticExecutor::new(synthetic_config(node))).clone();
                (u64::from(f.num_layers) * u64::from(f.num_kv_heads) * u64::from(f.head_dim) * 2 * 4, f.max_model_len)
            }
            ModelKind::Gguf => {
                let path = gguf_path(node)?;
                let cfg = pdmesh_model::read_config(&path).with_context(|| format!("reading {}", path.display()))?;
                // per engine rank: its TP ranks share one cache of every head (D111)
                (cfg.kv_bytes_per_token(), cfg.context_length)
            }
        };
        node.engine
            .apply_kv_budget(per_token, model_max)
            .map_err(|why| anyhow::anyhow!("node {:?}: {why}", node.name))?;
    }
    Ok(())
}

/// The codec with the template of `model.chat_template` (`--chat-template`) in place of the
/// file's. A file that cannot be read or does not compile is an error of the node's
/// configuration (the caller marks it so: exit 78), not something to serve chat without.
fn with_chat_template(codec: pdmesh_model::GgufTextCodec, path: &str) -> anyhow::Result<pdmesh_model::GgufTextCodec> {
    let source = std::fs::read_to_string(path).with_context(|| format!("model.chat_template: cannot read {path:?}"))?;
    let codec = codec.with_chat_template(source).with_context(|| format!("model.chat_template {path:?}"))?;
    tracing::info!(template = %path, renders_tools = pdmesh_model_api::TextCodec::template_renders_tools(&codec),
        "chat template from the configuration");
    Ok(codec)
}

/// Rule R1 notices are on unless the node's `kv_transfer.rejection_notices = false`.
fn rejection_notices(node: &NodeConfig) -> bool {
    node.kv_transfer.as_ref().is_none_or(|k| k.rejection_notices)
}

/// The GGUF file of a node: `model.path`, else `PDMESH_MODEL_PATH`, else the fetch cache.
pub(crate) fn gguf_path(node: &NodeConfig) -> anyhow::Result<std::path::PathBuf> {
    let path = if node.model.path.is_empty() {
        pdmesh_model::default_model_path()
    } else {
        std::path::PathBuf::from(&node.model.path)
    };
    if !path.exists() {
        bail!(
            "model file {} not found: run scripts/fetch-model.sh, or set model.path / PDMESH_MODEL_PATH",
            path.display()
        );
    }
    Ok(path)
}

fn gguf_options(node: &NodeConfig) -> pdmesh_model::ModelOptions {
    pdmesh_model::ModelOptions {
        max_model_len: (node.engine.max_model_len > 0).then_some(node.engine.max_model_len),
        threads: (node.model.threads > 0).then_some(node.model.threads as usize),
        nice: i32::from(node.model.cpu_nice),
    }
}

/// The name served as `model`: `model.name`, else the file name without `.gguf` and without a
/// `.Q4_1`-style quantization suffix (`SmolLM2-135M-Instruct.Q4_1.gguf` →
/// `SmolLM2-135M-Instruct`; `qwen2.5-coder-0.5b-instruct-q4_k_m.gguf` keeps its dots).
fn served_name(node: &NodeConfig, path: &std::path::Path) -> String {
    if !node.model.name.is_empty() {
        return node.model.name.clone();
    }
    name_of_file(path)
}

fn name_of_file(path: &std::path::Path) -> String {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    match stem.rsplit_once('.') {
        Some((name, quant)) if !name.is_empty() && is_quant_suffix(quant) => name.to_string(),
        _ => stem,
    }
}

/// `Q4_1`, `Q4_K_M`, `IQ2_XS`, `F16`, `BF16`, `f32`: a GGML type name as file names carry them.
fn is_quant_suffix(s: &str) -> bool {
    let u = s.to_ascii_uppercase();
    let body = u
        .strip_prefix("IQ")
        .or_else(|| u.strip_prefix("BF"))
        .or_else(|| u.strip_prefix('Q'))
        .or_else(|| u.strip_prefix('F'));
    body.is_some_and(|b| {
        b.starts_with(|c: char| c.is_ascii_digit()) && b.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// The executor a connector-worker of `node` runs, its model's facts, and where its KV cache
/// lives (on the GPU for the `cuda` transfer backend, else in host memory).
/// `tp`: the tensor-parallel slice this process computes and its gathers (D111); `None`: the
/// whole model.
pub fn executor_factory(
    node: &NodeConfig,
    tp: Option<(pdmesh_model::tp::TpRank, Box<dyn pdmesh_model::tp::Gather>)>,
) -> anyhow::Result<(ModelFacts, ExecutorFactory, KvPlacement)> {
    match node.model.kind {
        ModelKind::Synthetic => {
            let cfg = synthetic_config(node);
            let facts = pdmesh_model_api::Executor::facts(&SyntheticExecutor::new(cfg.clone())).clone();
            let factory: ExecutorFactory = Arc::new(move || Ok(Box::new(SyntheticExecutor::new(cfg.clone())) as _));
            Ok((facts, factory, KvPlacement::Host))
        }
        ModelKind::Gguf => {
            let path = gguf_path(node)?;
            let started = std::time::Instant::now();
            let (ex, placement) = match tp {
                Some((rank, group)) => (
                    Box::new(
                        pdmesh_model::GgufExecutor::load_tp(&path, &gguf_options(node), rank, Some(group))
                            .with_context(|| {
                                format!("loading TP rank {} of {} of {}", rank.rank, rank.size, path.display())
                            })?,
                    ) as Box<dyn pdmesh_model_api::Executor>,
                    KvPlacement::Host,
                ),
                None => load_gguf_executor(node, &path)?,
            };
            let mut facts = ex.facts().clone();
            facts.name = served_name(node, &path);
            tracing::info!(model = %facts.name, device = %node.model.device, layers = facts.num_layers,
                load_ms = started.elapsed().as_millis() as u64, "model loaded");
            Ok((facts, pdmesh_connector_worker::once(ex), placement))
        }
    }
}

/// The GPU a `model.device` names: `cuda` is GPU 0, `cuda:N` GPU N; `None` for the CPU.
fn cuda_ordinal(device: &str) -> anyhow::Result<Option<usize>> {
    match device {
        "" | "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Some(n)),
            _ => bail!("model.device {d:?}: expected \"cpu\", \"cuda\" or \"cuda:N\""),
        },
    }
}

fn load_gguf_executor(
    node: &NodeConfig,
    path: &std::path::Path,
) -> anyhow::Result<(Box<dyn pdmesh_model_api::Executor>, KvPlacement)> {
    match cuda_ordinal(&node.model.device)? {
        None => Ok((
            Box::new(
                pdmesh_model::GgufExecutor::load(path, &gguf_options(node))
                    .with_context(|| format!("loading {}", path.display()))?,
            ),
            KvPlacement::Host,
        )),
        #[cfg(feature = "cuda")]
        Some(ordinal) => {
            let mut ex = pdmesh_model::cuda::CudaLlamaExecutor::load(path, &gguf_options(node), ordinal)
                .with_context(|| format!("loading {} onto GPU {ordinal}", path.display()))?;
            // `kv_transfer.backend = "cuda"`: the cache lives in the executor's exported region
            // (the config refuses that backend for a model that is not on a GPU).
            let on_gpu =
                node.kv_transfer.as_ref().is_some_and(|k| k.backend == pdmesh_config::TransferBackendKind::Cuda);
            let placement = if on_gpu {
                let spec = pdmesh_connector_worker::kv_spec(node, pdmesh_model_api::Executor::facts(&ex));
                let region = ex.use_exported_kv(spec).context("placing the KV cache on the GPU")?;
                KvPlacement::Device(region)
            } else {
                KvPlacement::Host
            };
            Ok((Box::new(ex), placement))
        }
        #[cfg(not(feature = "cuda"))]
        Some(_) => bail!(
            "model.device {:?} needs a GPU build: cargo build --release --features cuda (docs/MODEL.md)",
            node.model.device
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::cuda_ordinal;

    #[test]
    fn served_names_drop_only_a_quant_suffix() {
        let name = |f: &str| super::name_of_file(std::path::Path::new(f));
        assert_eq!(name("/m/SmolLM2-135M-Instruct.Q4_1.gguf"), "SmolLM2-135M-Instruct");
        assert_eq!(name("/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"), "qwen2.5-coder-0.5b-instruct-q4_k_m");
        assert_eq!(name("/m/gemma-3-270m-q4_k_m.gguf"), "gemma-3-270m-q4_k_m");
        assert_eq!(name("/m/Llama-3.2-1B.BF16.gguf"), "Llama-3.2-1B");
        assert_eq!(name("/m/model.v2.gguf"), "model.v2");
    }

    #[test]
    fn devices_parse() {
        assert_eq!(cuda_ordinal("cpu").unwrap(), None);
        assert_eq!(cuda_ordinal("").unwrap(), None);
        assert_eq!(cuda_ordinal("cuda").unwrap(), Some(0));
        assert_eq!(cuda_ordinal("cuda:3").unwrap(), Some(3));
        assert!(cuda_ordinal("gpu").is_err());
        assert!(cuda_ordinal("cuda:x").is_err());
    }
}
