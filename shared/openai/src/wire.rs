//! The OpenAI-compatible wire types of the HTTP API, as vLLM serves them.
//!
//! Request types are deliberately loose where OpenAI accepts several shapes (`prompt`,
//! `stop`, message `content`, `kv_transfer_params` are kept as JSON values) so that
//! [`crate::validation`] can give a precise message naming the offending field instead of
//! serde's "did not match any variant". Fields we do not name are kept in `extra`: the real
//! OpenAI/vLLM fields among them that would change the answer are refused with a 400 naming
//! them ([`crate::validation::check_unhonoured`]); anything else is ignored, as vLLM does. Numbers
//! that must be positive are read as signed integers for the same reason.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage of the whole request.
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// vLLM: usage on every chunk. Not served: refused when true.
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// The sampling, stopping and P/D fields that completions and chat share (OpenAI's and vLLM's
/// names), flattened into both request types so that one [`crate::validation::SamplingInput`]
/// constructor reads them for either.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub seed: Option<i64>,
    /// A string or an array of at most 4 strings.
    #[serde(default)]
    pub stop: Option<Value>,
    #[serde(default)]
    pub stop_token_ids: Option<Vec<i64>>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub include_stop_str_in_output: Option<bool>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<i64>,
    /// vLLM's extra parameter; beam search is not served (refused with a 400).
    #[serde(default)]
    pub use_beam_search: Option<bool>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    #[serde(default)]
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub min_tokens: Option<i64>,
    #[serde(default)]
    pub user: Option<String>,
    /// vLLM's P/D parameters, passed through to the engine.
    #[serde(default)]
    pub kv_transfer_params: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// A string, an array of one string, an array of token ids, or an array of one array of
    /// token ids.
    #[serde(default)]
    pub prompt: Option<Value>,
    /// Number of top alternatives per token (0..=20).
    #[serde(default)]
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub best_of: Option<i64>,
    #[serde(default)]
    pub suffix: Option<String>,
    /// The fields completions and chat share (before `extra`: serde hands a flattened map
    /// only what the flattened struct left).
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Every field this struct does not name: [`crate::validation::check_unhonoured`] refuses
    /// the real OpenAI/vLLM fields among them that would change the answer.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// One message of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, an array of `{"type": "text", "text": ...}` parts, or null.
    #[serde(default)]
    pub content: Option<Value>,
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant message's calls (OpenAI's shape), rendered back as the model writes them.
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `role: "tool"` message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    /// Takes precedence over `max_tokens`, as in vLLM.
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// 0..=20; needs `logprobs: true`.
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// Function tools the model may call ([`crate::tools`], D54).
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name": ...}}`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// The fields completions and chat share (before `extra`: serde hands a flattened map
    /// only what the flattened struct left).
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Every field this struct does not name: [`crate::validation::check_unhonoured`] refuses
    /// the real OpenAI/vLLM fields among them that would change the answer.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// `usage` of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    /// As OpenAI reports it: how many prompt tokens came from the prefix cache.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details` (`input_tokens_details` in the Responses API).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV the engine reused from its prefix cache.
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails::default(),
        }
    }

    /// The same usage, with `cached_tokens` of the prompt reused from the prefix cache.
    pub fn with_cached(mut self, cached_tokens: u32) -> Self {
        self.prompt_tokens_details.cached_tokens = cached_tokens.min(self.prompt_tokens);
        self
    }
}

/// Completions-style logprobs of a run of tokens (`choices[i].logprobs`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<serde_json::Map<String, Value>>,
    pub text_offset: Vec<u32>,
}

/// `choices[i]` of a completion (whole or chunk).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM: the stop string or stop token id that ended the request (null for EOS).
    pub stop_reason: Option<Value>,
}

/// The body of a non-streaming completion, and of each streamed chunk
/// (`object = "text_completion"` in both, as OpenAI does).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    /// Present on whole responses; on chunks only with `include_usage` (null but the last).
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
    /// vLLM's top-level `kv_transfer_params` (P's answer to the router); whole responses only.
    #[serde(skip_serializing_if = "KvParamsField::is_absent")]
    pub kv_transfer_params: KvParamsField,
}

/// A `usage` field that can be absent, null or set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UsageField {
    #[default]
    Absent,
    Null,
    Set(Usage),
}

impl UsageField {
    fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }
}

impl Serialize for UsageField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Absent | UsageField::Null => s.serialize_none(),
            UsageField::Set(u) => u.serialize(s),
        }
    }
}

/// A `kv_transfer_params` field: absent (chunks), null, or the engine's params.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum KvParamsField {
    #[default]
    Absent,
    Null,
    Set(pdmesh_protocol::KvTransferParams),
}

impl KvParamsField {
    fn is_absent(&self) -> bool {
        matches!(self, KvParamsField::Absent)
    }

    pub fn from_option(p: Option<pdmesh_protocol::KvTransferParams>) -> Self {
        p.map_or(KvParamsField::Null, KvParamsField::Set)
    }
}

impl Serialize for KvParamsField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            KvParamsField::Absent | KvParamsField::Null => s.serialize_none(),
            KvParamsField::Set(p) => p.serialize(s),
        }
    }
}

/// One alternative of chat logprobs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// Chat logprobs of one sampled token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// `choices[i].logprobs` of a chat completion (whole or chunk).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

/// `choices[i].message` of a whole chat completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// Null when the answer is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Value>,
}

/// `choices[i]` of a whole chat completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<Value>,
}

/// A whole chat completion (`object = "chat.completion"`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub kv_transfer_params: KvParamsField,
}

/// `choices[i].delta` of a chat chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Value>,
}

/// `choices[i]` of a chat chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Value>,
}

/// One streamed chat chunk (`object = "chat.completion.chunk"`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}

/// `GET /v1/models` entry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: u32,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loose_fields_accept_every_openai_shape() {
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt": [1, 2], "stop": ["a"], "stream": null, "unknown": 1}"#).unwrap();
        assert!(r.prompt.unwrap().is_array());
        assert!(r.sampling.stream.is_none());
        assert!(r.sampling.stop.as_ref().is_some_and(Value::is_array));
        // the shared fields are taken before `extra` sees the body: only the unknown key is left
        assert_eq!(r.extra.keys().collect::<Vec<_>>(), ["unknown"]);
        let c: ChatCompletionRequest = serde_json::from_str(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": null}]}"#,
        )
        .unwrap();
        assert_eq!(c.messages.len(), 2);
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"temperature": "hot"}"#).is_err());
    }

    #[test]
    fn usage_and_kv_params_fields_serialize_as_asked() {
        let mut r = CompletionResponse {
            id: "cmpl-1".into(),
            object: "text_completion",
            created: 1,
            model: "m".into(),
            choices: vec![],
            usage: UsageField::Absent,
            kv_transfer_params: KvParamsField::Absent,
        };
        let v = serde_json::to_value(&r).unwrap();
        assert!(v.get("usage").is_none() && v.get("kv_transfer_params").is_none());
        r.usage = UsageField::Null;
        r.kv_transfer_params = KvParamsField::Null;
        let v = serde_json::to_value(&r).unwrap();
        assert!(v["usage"].is_null() && v.get("usage").is_some());
        assert!(v["kv_transfer_params"].is_null() && v.get("kv_transfer_params").is_some());
        r.usage = UsageField::Set(Usage::new(3, 4));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["usage"]["total_tokens"], 7);
    }
}

/// `POST /v1/responses` (text only).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ResponsesRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// A string (one user message) or an array of message items `{role, content}`, where
    /// content is a string or an array of `{"type": "input_text", "text": ...}` parts.
    #[serde(default)]
    pub input: Option<Value>,
    /// A system message placed first (not carried over by `previous_response_id`).
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub max_output_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub stream: Option<bool>,
    /// Keep the response for `GET /v1/responses/{id}` and `previous_response_id` (default
    /// true).
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    /// vLLM's P/D parameters, passed through to the engine.
    #[serde(default)]
    pub kv_transfer_params: Option<Value>,
    /// Every field this struct does not name: [`crate::validation::check_unhonoured`] refuses
    /// the real OpenAI/vLLM fields among them that would change the answer.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}
