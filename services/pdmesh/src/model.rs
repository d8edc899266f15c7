//! Build the model pieces a node's services need: the executor (connector-worker) and the text
//! codec (frontend).

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use pdmesh_config::{ModelKind, NodeConfig};
use pdmesh_connector_worker::ExecutorFactory;
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
    if node.engine.max_model_len == 0 {
        model_max
    } else {
        node.engine.max_model_len.min(model_max)
    }
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
                },
            })
        }
        ModelKind::Gguf => bail!("the gguf model kind is not available in this build"),
    }
}

pub fn executor_factory(node: &NodeConfig) -> anyhow::Result<(ModelFacts, ExecutorFactory)> {
    match node.model.kind {
        ModelKind::Synthetic => {
            let cfg = synthetic_config(node);
            let facts = pdmesh_model_api::Executor::facts(&SyntheticExecutor::new(cfg.clone())).clone();
            let factory: ExecutorFactory = Arc::new(move || Ok(Box::new(SyntheticExecutor::new(cfg.clone())) as _));
            Ok((facts, factory))
        }
        ModelKind::Gguf => bail!("the gguf model kind is not available in this build"),
    }
}
