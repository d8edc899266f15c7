//! The router's view of a request's prompt as token ids, for `cache_aware` routing (D59).
//!
//! The ids must be the ones the node's engine will hash, so they come from the node
//! frontends' own request → tokens code (`pdmesh_openai::request`, which renders the chat
//! template and tokenises, shared with the frontends) over the same model's tokenizer;
//! nothing here re-implements rendering. A request the node would refuse yields no ids: it is
//! routed on load alone, and the node gives the client its error.

use std::sync::Arc;

use serde_json::Value;

use pdmesh_openai::request::{validate_chat, validate_completion};
use pdmesh_openai::validation::ModelLimits;
use pdmesh_openai::wire::{ChatCompletionRequest, CompletionRequest};
use pdmesh_openai::FrontendOptions;

/// The tokenizer and model facts of the nodes behind the router.
pub struct PromptTokenizer {
    codec: Arc<dyn pdmesh_model_api::TextCodec>,
    options: FrontendOptions,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer").field("options", &self.options).finish()
    }
}

impl PromptTokenizer {
    pub fn new(codec: Arc<dyn pdmesh_model_api::TextCodec>, options: FrontendOptions) -> Self {
        Self { codec, options }
    }

    fn limits(&self) -> ModelLimits<'_> {
        let vocab_size = if self.options.vocab_size > 0 { self.options.vocab_size } else { self.codec.vocab_size() };
        ModelLimits { options: &self.options, codec: &*self.codec, vocab_size }
    }

    /// The prompt's token ids as a node frontend would compute them for `path`; `None` for
    /// other paths and for requests the node would refuse.
    pub fn tokens(&self, path: &str, body: &Value) -> Option<Vec<u32>> {
        let limits = self.limits();
        let validated = match path {
            "/v1/chat/completions" => {
                validate_chat(&serde_json::from_value::<ChatCompletionRequest>(body.clone()).ok()?, &limits)
            }
            "/v1/completions" => {
                validate_completion(&serde_json::from_value::<CompletionRequest>(body.clone()).ok()?, &limits)
            }
            _ => return None,
        };
        validated.ok().map(|v| v.prompt)
    }
}
