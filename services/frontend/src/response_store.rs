//! The Responses API's objects and their in-memory store (`store`, `previous_response_id`,
//! `GET /v1/responses/{id}`): plain data below the generation path, so the handlers' shared
//! state can hold the store without depending on how a response is answered
//! ([`crate::responses`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pdmesh_model_api::ChatMessage;
use serde::Serialize;
use serde_json::Value;

use crate::openai::KvParamsField;

/// Most responses kept by the store; the oldest is evicted first.
pub const STORE_CAPACITY: usize = 10_000;

/// `usage` of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ResponseUsage {
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub total_tokens: u32,
    /// Input tokens reused from the engine's prefix cache (OpenAI's Responses usage).
    pub input_tokens_details: crate::openai::PromptTokensDetails,
}

impl ResponseUsage {
    pub fn new(input_tokens: u32, output_tokens: u32) -> Self {
        Self {
            input_tokens,
            output_tokens,
            total_tokens: input_tokens.saturating_add(output_tokens),
            input_tokens_details: Default::default(),
        }
    }

    /// The same usage, with `cached_tokens` of the input reused from the prefix cache.
    pub fn with_cached(mut self, cached_tokens: u32) -> Self {
        self.input_tokens_details.cached_tokens = cached_tokens.min(self.input_tokens);
        self
    }
}

/// `incomplete_details`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IncompleteDetails {
    pub reason: &'static str,
}

/// An `output_text` content part.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputText {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
    pub annotations: Vec<Value>,
}

impl OutputText {
    pub(crate) fn new(text: String) -> Self {
        Self { kind: "output_text", text, annotations: Vec::new() }
    }
}

/// An output item of type `message`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputMessage {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub id: String,
    pub status: &'static str,
    pub role: &'static str,
    pub content: Vec<OutputText>,
}

/// The response object (`"object": "response"`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseObject {
    pub id: String,
    pub object: &'static str,
    pub created_at: u64,
    /// `in_progress`, `completed` or `incomplete`.
    pub status: &'static str,
    pub error: Option<Value>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub model: String,
    pub output: Vec<OutputMessage>,
    pub output_text: String,
    pub previous_response_id: Option<String>,
    pub store: bool,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub usage: Option<ResponseUsage>,
    pub kv_transfer_params: KvParamsField,
}

/// One stored response.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The conversation this response answered (earlier turns and this input; the
    /// `instructions` are not part of it, as in OpenAI's API).
    pub messages: Vec<ChatMessage>,
    pub output_text: String,
    pub object: ResponseObject,
}

/// The in-memory store of responses, bounded (oldest evicted first).
pub struct ResponseStore {
    inner: Mutex<StoreInner>,
    capacity: usize,
}

#[derive(Default)]
struct StoreInner {
    map: HashMap<String, Arc<StoredResponse>>,
    order: VecDeque<String>,
}

impl ResponseStore {
    pub fn new(capacity: usize) -> Self {
        Self { inner: Mutex::new(StoreInner::default()), capacity }
    }

    fn lock(&self) -> MutexGuard<'_, StoreInner> {
        // The map stays consistent even if a holder panicked: every update is one insert or remove.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn get(&self, id: &str) -> Option<Arc<StoredResponse>> {
        self.lock().map.get(id).cloned()
    }

    pub fn insert(&self, response: StoredResponse) {
        if self.capacity == 0 {
            return;
        }
        let id = response.object.id.clone();
        let mut inner = self.lock();
        if inner.map.insert(id.clone(), Arc::new(response)).is_none() {
            inner.order.push_back(id);
        }
        while inner.map.len() > self.capacity {
            let Some(oldest) = inner.order.pop_front() else { break };
            inner.map.remove(&oldest);
        }
    }

    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::new(STORE_CAPACITY)
    }
}
