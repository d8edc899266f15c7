//! The Responses API (`/v1/responses`, text only): the response object, the in-memory store
//! behind `store`, `previous_response_id` and `GET /v1/responses/{id}`, and the answer of an
//! accepted request (one JSON object, or OpenAI's typed SSE events).
//!
//! Generation itself is the chat path's: the handler renders the conversation with the
//! model's chat template and submits it like a chat request; only the shapes differ.

use std::sync::Arc;

use actix_web::HttpResponse;
use bytes::Bytes;
use pdmesh_model_api::{ChatMessage, TextCodec};
use pdmesh_protocol::KvTransferParams;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine_client::{AbortReason, OutputReceiver};
use crate::error::ApiError;
use crate::generate::{collect_text, set_request_id, Accepted, Collected, RequestGuard, ResponseSettings};
use crate::openai::KvParamsField;
use crate::output::Finish;

/// Events buffered between the generation task and a slow client.
const BODY_BUFFER: usize = 64;

pub use crate::response_store::*;

/// What the answer of one Responses request needs beyond the generic settings.
pub struct ResponseContext {
    /// `resp_…`
    pub id: String,
    /// `msg_…`, the id of the output message.
    pub message_id: String,
    pub created_at: u64,
    pub model: String,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub previous_response_id: Option<String>,
    pub store: bool,
    /// The conversation rendered into the prompt, without the instructions.
    pub messages: Vec<ChatMessage>,
    pub store_handle: Arc<ResponseStore>,
}

impl ResponseContext {
    fn object(&self, status: &'static str, output: Vec<OutputMessage>, text: String) -> ResponseObject {
        ResponseObject {
            id: self.id.clone(),
            object: "response",
            created_at: self.created_at,
            status,
            error: None,
            incomplete_details: None,
            instructions: self.instructions.clone(),
            max_output_tokens: self.max_output_tokens,
            model: self.model.clone(),
            output,
            output_text: text,
            previous_response_id: self.previous_response_id.clone(),
            store: self.store,
            temperature: self.temperature,
            top_p: self.top_p,
            usage: None,
            kv_transfer_params: KvParamsField::Null,
        }
    }

    fn message(&self, status: &'static str, content: Vec<OutputText>) -> OutputMessage {
        OutputMessage { kind: "message", id: self.message_id.clone(), status, role: "assistant", content }
    }

    /// The response object while generating (`response.created` / `response.in_progress`).
    pub fn in_progress(&self) -> ResponseObject {
        self.object("in_progress", Vec::new(), String::new())
    }

    /// The final response object: `completed`, or `incomplete` when cut by
    /// `max_output_tokens` (or the context).
    pub fn finished(
        &self,
        text: String,
        finish: &Finish,
        usage: ResponseUsage,
        kv_transfer_params: Option<KvTransferParams>,
    ) -> ResponseObject {
        let incomplete = matches!(finish, Finish::Length);
        let status = if incomplete { "incomplete" } else { "completed" };
        let item = self.message(status, vec![OutputText::new(text.clone())]);
        let mut object = self.object(status, vec![item], text);
        if incomplete {
            object.incomplete_details = Some(IncompleteDetails { reason: "max_output_tokens" });
        }
        object.usage = Some(usage);
        object.kv_transfer_params = KvParamsField::from_option(kv_transfer_params);
        object
    }

    /// Keep a finished response when the request asked for it.
    pub fn save(&self, object: &ResponseObject) {
        if self.store {
            self.store_handle.insert(StoredResponse {
                messages: self.messages.clone(),
                output_text: object.output_text.clone(),
                object: object.clone(),
            });
        }
    }
}

/// Answer an accepted Responses request: one JSON object, or the SSE events.
pub async fn answer(
    codec: Arc<dyn TextCodec>,
    accepted: Accepted,
    ctx: ResponseContext,
) -> Result<HttpResponse, ApiError> {
    let Accepted { settings, outputs, guard, more: _ } = accepted;
    if settings.stream {
        return Ok(stream(codec, settings, outputs, guard, ctx));
    }
    let Collected { text, finish, completion_tokens, cached_tokens, kv_transfer_params, .. } =
        collect_text(&*codec, &settings, outputs, guard).await?;
    let usage = ResponseUsage::new(settings.prompt_tokens, completion_tokens).with_cached(cached_tokens);
    let object = ctx.finished(text, &finish, usage, kv_transfer_params);
    ctx.save(&object);
    let mut response = HttpResponse::Ok().json(&object);
    set_request_id(&mut response, &settings.request_id);
    Ok(response)
}

/// Numbers and frames the typed SSE events of one response.
struct Events {
    sequence_number: u64,
}

impl Events {
    /// `event: <name>\ndata: {"type": <name>, "sequence_number": n, ...payload}\n\n`.
    fn event(&mut self, name: &str, payload: Value) -> Bytes {
        let mut data = match payload {
            Value::Object(map) => map,
            other => {
                let mut map = serde_json::Map::new();
                map.insert("value".into(), other);
                map
            }
        };
        data.insert("type".into(), Value::String(name.to_string()));
        data.insert("sequence_number".into(), Value::from(self.sequence_number));
        self.sequence_number += 1;
        let json = Value::Object(data).to_string();
        Bytes::from(format!("event: {name}\ndata: {json}\n\n"))
    }

    fn error(&mut self, error: &ApiError) -> Bytes {
        error.record();
        self.event(
            "error",
            json!({"code": error.status().as_u16(), "message": error.to_string(), "param": error.param()}),
        )
    }
}

fn to_value<T: Serialize>(value: &T) -> Value {
    serde_json::to_value(value).unwrap_or_else(|e| {
        tracing::error!(error = %e, "cannot serialise a response event");
        Value::Null
    })
}

fn stream(
    codec: Arc<dyn TextCodec>,
    settings: ResponseSettings,
    rx: OutputReceiver,
    guard: RequestGuard,
    ctx: ResponseContext,
) -> HttpResponse {
    let (tx, body_rx) = mpsc::channel::<Bytes>(BODY_BUFFER);
    let request_id = settings.request_id.clone();
    let span = tracing::Span::current();
    actix_web::rt::spawn(tracing::Instrument::instrument(run(codec, settings, rx, guard, ctx, tx), span));
    crate::stream::sse_response(&request_id, body_rx)
}

/// The generation task of one streamed response. Returns when the request is over, or as
/// soon as the client is gone (dropping the guard aborts the engine request).
async fn run(
    codec: Arc<dyn TextCodec>,
    settings: ResponseSettings,
    mut rx: OutputReceiver,
    mut guard: RequestGuard,
    ctx: ResponseContext,
    tx: mpsc::Sender<Bytes>,
) {
    let mut events = Events { sequence_number: 0 };
    let mut processor = settings.processor(&*codec);
    let item_id = ctx.message_id.clone();
    let start = ctx.in_progress();
    let mut head = Vec::new();
    head.extend_from_slice(&events.event("response.created", json!({"response": to_value(&start)})));
    head.extend_from_slice(&events.event("response.in_progress", json!({"response": to_value(&start)})));
    head.extend_from_slice(&events.event(
        "response.output_item.added",
        json!({"output_index": 0, "item": to_value(&ctx.message("in_progress", Vec::new()))}),
    ));
    head.extend_from_slice(&events.event(
        "response.content_part.added",
        json!({"item_id": item_id, "output_index": 0, "content_index": 0,
               "part": to_value(&OutputText::new(String::new()))}),
    ));
    if tx.send(Bytes::from(head)).await.is_err() {
        return;
    }
    let mut text = String::new();
    loop {
        let delta = match crate::stream::next_delta(&tx, &mut rx, &mut guard, &mut processor).await {
            Ok(delta) => delta,
            Err(None) => return,
            Err(Some(e)) => {
                let _ = tx.send(events.error(&e)).await;
                return;
            }
        };
        guard.on_tokens(delta.new_tokens);
        let mut chunk = Vec::new();
        if !delta.text.is_empty() {
            chunk.extend_from_slice(&events.event(
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": delta.text}),
            ));
            text.push_str(&delta.text);
        }
        match &delta.finish {
            None => {}
            Some(Finish::Error(message)) => {
                guard.finish("error");
                chunk.extend_from_slice(&events.error(&ApiError::from_engine_failure(message.as_deref())));
                let _ = tx.send(Bytes::from(chunk)).await;
                return;
            }
            Some(Finish::Abort) => {
                guard.finish("abort");
                let e = ApiError::Unavailable("unavailable: the engine aborted the request".into());
                chunk.extend_from_slice(&events.error(&e));
                let _ = tx.send(Bytes::from(chunk)).await;
                return;
            }
            Some(finish) => {
                if !delta.engine_finished {
                    guard.abort_now(AbortReason::StopString);
                }
                guard.finish(finish.as_str());
                let usage = ResponseUsage::new(settings.prompt_tokens, processor.completion_tokens())
                    .with_cached(processor.cached_tokens());
                let object = ctx.finished(text.clone(), finish, usage, delta.kv_transfer_params.clone());
                ctx.save(&object);
                let part = OutputText::new(text.clone());
                chunk.extend_from_slice(&events.event(
                    "response.output_text.done",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text}),
                ));
                chunk.extend_from_slice(&events.event(
                    "response.content_part.done",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": to_value(&part)}),
                ));
                let item = object.output.first().map(to_value).unwrap_or(Value::Null);
                chunk.extend_from_slice(
                    &events.event("response.output_item.done", json!({"output_index": 0, "item": item})),
                );
                // OpenAI ends a response cut by `max_output_tokens` with `response.incomplete`.
                let last = if object.status == "incomplete" { "response.incomplete" } else { "response.completed" };
                chunk.extend_from_slice(&events.event(last, json!({"response": to_value(&object)})));
                let _ = tx.send(Bytes::from(chunk)).await;
                return;
            }
        }
        if !chunk.is_empty() && tx.send(Bytes::from(chunk)).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(id: &str) -> StoredResponse {
        let ctx = ResponseContext {
            id: id.into(),
            message_id: "msg_1".into(),
            created_at: 1,
            model: "m".into(),
            instructions: None,
            max_output_tokens: None,
            temperature: None,
            top_p: None,
            previous_response_id: None,
            store: true,
            messages: vec![],
            store_handle: Arc::new(ResponseStore::new(1)),
        };
        let object = ctx.finished("t".into(), &Finish::Stop(None), ResponseUsage::new(1, 1), None);
        StoredResponse { messages: vec![], output_text: "t".into(), object }
    }

    #[test]
    fn store_evicts_the_oldest() {
        let store = ResponseStore::new(2);
        store.insert(stored("a"));
        store.insert(stored("b"));
        store.insert(stored("a"));
        assert_eq!(store.len(), 2);
        store.insert(stored("c"));
        assert_eq!(store.len(), 2);
        assert!(store.get("a").is_none());
        assert!(store.get("b").is_some() && store.get("c").is_some());
    }

    #[test]
    fn shapes_and_event_framing() {
        let s = stored("x");
        assert_eq!(s.object.status, "completed");
        let v = serde_json::to_value(&s.object).unwrap();
        assert!(v["incomplete_details"].is_null());
        assert_eq!(v["output"][0]["content"][0], json!({"type": "output_text", "text": "t", "annotations": []}));
        assert_eq!(
            v["usage"],
            json!({"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "input_tokens_details": {"cached_tokens": 0}})
        );
        let mut e = Events { sequence_number: 3 };
        let b = e.event("response.output_text.delta", json!({"delta": "x"}));
        let text = std::str::from_utf8(&b).unwrap();
        assert!(text.starts_with("event: response.output_text.delta\ndata: {"), "{text}");
        assert!(text.contains("\"sequence_number\":3") && text.ends_with("\n\n"), "{text}");
    }
}
