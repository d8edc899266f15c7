//! Server-sent events: framing, the chunk shapes of both APIs, and the task that turns one
//! request's engine outputs into an SSE body.
//!
//! The body is fed through a bounded channel by a task that owns the request's
//! [`RequestGuard`]. When the client disconnects, actix-web drops the body, the channel
//! closes, the task notices at once (it waits on the channel's closure as well as on the
//! engine) and drops the guard, which aborts the engine request.

use std::convert::Infallible;
use std::sync::Arc;

use actix_web::HttpResponse;
use bytes::Bytes;
use futures::StreamExt;
use pdmesh_model_api::TextCodec;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::engine_client::{AbortReason, OutputReceiver};
use crate::error::ApiError;
use crate::generate::{Api, RequestGuard, ResponseSettings};
use crate::openai::{
    ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, CompletionResponse, KvParamsField, Usage,
    UsageField,
};
use crate::output::{chat_logprobs, completion_logprobs, Finish, OutputProcessor, TokenLogprob};

/// Chunks buffered between the generation task and a slow client.
const BODY_BUFFER: usize = 64;

pub use pdmesh_http_edge::sse::{sse_data, sse_done, sse_error};

/// Builds the chunks of one streamed response.
#[derive(Clone)]
pub struct ChunkFormatter {
    api: Api,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
    /// The choice this formatter's chunks carry (`n > 1`: one formatter per choice).
    index: u32,
    /// Chunks carry `pdmesh_token_ids` (asked by the router, D56).
    token_ids: bool,
}

/// Where answers carry their tokens' ids on the router's internal calls (D56, D73): a whole
/// answer's field, a stream event's comment line. The router takes both out before its client
/// sees the answer.
pub use pdmesh_protocol::node_http::{TOKEN_IDS_COMMENT, TOKEN_IDS_FIELD};

/// The comment line of an event that carries `ids` ([`TOKEN_IDS_COMMENT`]).
fn token_ids_line(ids: &[u32]) -> Vec<u8> {
    let mut line = Vec::with_capacity(TOKEN_IDS_COMMENT.len() + 8 * ids.len() + 3);
    line.extend_from_slice(TOKEN_IDS_COMMENT.as_bytes());
    // A list of integers always serialises, and writing into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut line, ids);
    line.push(b'\n');
    line
}

impl ChunkFormatter {
    /// The same formatter for choice `index`.
    pub fn for_choice(&self, index: u32) -> Self {
        Self { index, ..self.clone() }
    }

    pub fn new(settings: &ResponseSettings) -> Self {
        Self {
            api: settings.api,
            id: settings.response_id(),
            created: settings.created,
            model: settings.model.clone(),
            include_usage: settings.include_usage,
            logprobs: settings.logprobs.is_some(),
            index: 0,
            token_ids: settings.stream_token_ids,
        }
    }

    /// [`ChunkFormatter::delta_chunk`] with the ids of its tokens when the router asked for
    /// them (every token since the last chunk: outputs with nothing to show send no chunk).
    ///
    /// The ids go in an SSE comment line of the same event ([`token_ids_line`]), ahead of its
    /// `data:` line, not into the JSON: the router reads them and passes the `data:` line on
    /// as it came, so neither side parses and re-serialises a chunk per token (D73). A client
    /// that somehow got the event would ignore the comment, as SSE says.
    pub fn delta_chunk_with_ids(
        &self,
        text: String,
        logprobs: &[TokenLogprob],
        finish: Option<&Finish>,
        ids: &[u32],
    ) -> Bytes {
        let chunk = self.delta_chunk(text, logprobs, finish);
        if !self.token_ids {
            return chunk;
        }
        let mut buf = token_ids_line(ids);
        buf.extend_from_slice(&chunk);
        Bytes::from(buf)
    }

    fn usage_placeholder(&self) -> UsageField {
        if self.include_usage {
            UsageField::Null
        } else {
            UsageField::Absent
        }
    }

    /// A chat chunk of this stream with `choices` and `usage`, SSE-framed.
    fn chat_chunk(&self, choices: Vec<ChatChunkChoice>, usage: UsageField) -> Bytes {
        sse_data(&ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
    }

    /// A completion chunk of this stream with `choices` and `usage`, SSE-framed.
    fn completion_chunk(&self, choices: Vec<CompletionChoice>, usage: UsageField) -> Bytes {
        sse_data(&CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            kv_transfer_params: KvParamsField::Absent,
        })
    }

    /// The first chat chunk: `delta: {"role": "assistant", "content": ""}`.
    pub fn role_chunk(&self) -> Bytes {
        let choice = ChatChunkChoice {
            index: self.index,
            delta: ChatDelta { role: Some("assistant"), content: Some(String::new()), tool_calls: None },
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
        };
        self.chat_chunk(vec![choice], self.usage_placeholder())
    }

    /// A chunk with new text (possibly empty) and, on the last one, the finish reason.
    pub fn delta_chunk(&self, text: String, logprobs: &[TokenLogprob], finish: Option<&Finish>) -> Bytes {
        match self.api {
            Api::Completion => {
                let choice = CompletionChoice {
                    index: self.index,
                    text,
                    logprobs: self.logprobs.then(|| completion_logprobs(logprobs)),
                    finish_reason: finish.map(Finish::as_str),
                    stop_reason: finish.and_then(Finish::stop_reason),
                };
                self.completion_chunk(vec![choice], self.usage_placeholder())
            }
            Api::Chat => {
                let choice = ChatChunkChoice {
                    index: self.index,
                    delta: ChatDelta { role: None, content: (!text.is_empty()).then_some(text), tool_calls: None },
                    logprobs: self.logprobs.then(|| chat_logprobs(logprobs)),
                    finish_reason: finish.map(Finish::as_str),
                    stop_reason: finish.and_then(Finish::stop_reason),
                };
                self.chat_chunk(vec![choice], self.usage_placeholder())
            }
        }
    }

    /// The last chunk of a chat answer with tools, whose text was held back: its calls as one
    /// `tool_calls` delta (`finish_reason: "tool_calls"`), or the text when it holds none (D54).
    pub fn tool_chunk(&self, settings: &ResponseSettings, text: String, finish: &Finish) -> Bytes {
        let (message, finish_reason) = crate::generate::chat_message(settings, text, finish);
        let tool_calls = message.tool_calls.map(|mut calls| {
            if let Some(list) = calls.as_array_mut() {
                for (i, c) in list.iter_mut().enumerate() {
                    c["index"] = serde_json::json!(i);
                }
            }
            calls
        });
        let choice = ChatChunkChoice {
            index: self.index,
            delta: ChatDelta { role: None, content: message.content.filter(|c| !c.is_empty()), tool_calls },
            logprobs: None,
            finish_reason: Some(finish_reason),
            stop_reason: finish.stop_reason(),
        };
        self.chat_chunk(vec![choice], self.usage_placeholder())
    }

    /// The usage chunk sent after the last one with `stream_options.include_usage`.
    pub fn usage_chunk(&self, usage: Usage) -> Bytes {
        match self.api {
            Api::Completion => self.completion_chunk(vec![], UsageField::Set(usage)),
            Api::Chat => self.chat_chunk(vec![], UsageField::Set(usage)),
        }
    }
}

/// Start streaming one accepted request: spawn the generation task and answer with the SSE
/// response that reads from it.
pub fn respond(
    codec: Arc<dyn TextCodec>,
    settings: ResponseSettings,
    rx: OutputReceiver,
    guard: RequestGuard,
) -> HttpResponse {
    let (tx, body_rx) = mpsc::channel::<Bytes>(BODY_BUFFER);
    let request_id = settings.request_id.clone();
    let span = tracing::Span::current();
    actix_web::rt::spawn(tracing::Instrument::instrument(run(codec, settings, rx, guard, tx), span));
    sse_response(&request_id, body_rx)
}

/// An SSE response whose body the caller fills later: a decode leg parked until its params
/// arrive (D66) answers its headers at once and streams once it is submitted.
pub(crate) fn deferred(request_id: &str) -> (mpsc::Sender<Bytes>, HttpResponse) {
    let (tx, body_rx) = mpsc::channel::<Bytes>(BODY_BUFFER);
    (tx, sse_response(request_id, body_rx))
}

/// Stream an accepted request (one choice) into `tx`, a [`deferred`] response's body.
pub(crate) async fn run_into(
    codec: Arc<dyn TextCodec>,
    settings: ResponseSettings,
    rx: OutputReceiver,
    guard: RequestGuard,
    tx: mpsc::Sender<Bytes>,
) {
    run(codec, settings, rx, guard, tx).await
}

/// A refusal after a [`deferred`] response's headers went out: the stream's error event.
pub(crate) async fn fail_into(tx: &mpsc::Sender<Bytes>, error: ApiError) {
    send_error(tx, error).await
}

/// The next engine output of a streamed request, detokenised. `Err(None)`: the client went
/// away (the guard aborts the engine request when dropped); `Err(Some(e))`: the request failed
/// and `e` is to be sent as the stream's error event. Shared by chat, completions and the
/// Responses API, which differ only in how they frame a delta.
pub(crate) async fn next_delta(
    tx: &mpsc::Sender<Bytes>,
    rx: &mut OutputReceiver,
    guard: &mut RequestGuard,
    processor: &mut OutputProcessor<'_>,
) -> Result<crate::output::Delta, Option<ApiError>> {
    let output = tokio::select! {
        biased;
        _ = tx.closed() => {
            tracing::info!("client disconnected mid-stream");
            return Err(None);
        }
        output = rx.recv() => output,
    };
    let Some(output) = output else {
        guard.finish("error");
        return Err(Some(ApiError::Unavailable(
            "engine unavailable: the output stream closed before the request finished".into(),
        )));
    };
    processor.process(&output).map_err(|e| {
        guard.abort_now(AbortReason::OutputError);
        guard.finish("error");
        Some(e)
    })
}

/// The HTTP response of an SSE stream fed by `body_rx` (shared by chat, completions and the
/// Responses API).
pub(crate) fn sse_response(request_id: &str, body_rx: mpsc::Receiver<Bytes>) -> HttpResponse {
    let body = ReceiverStream::new(body_rx).map(Ok::<Bytes, Infallible>);
    let mut response = HttpResponse::Ok();
    response
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"));
    if let Ok(value) = actix_web::http::header::HeaderValue::from_str(request_id) {
        response.insert_header((crate::headers::REQUEST_ID, value));
    }
    response.streaming(body)
}

/// The generation task of one streamed request. Returns when the request is over, or as
/// soon as the client is gone (the guard then aborts the engine request).
async fn run(
    codec: Arc<dyn TextCodec>,
    settings: ResponseSettings,
    rx: OutputReceiver,
    guard: RequestGuard,
    tx: mpsc::Sender<Bytes>,
) {
    let fmt = ChunkFormatter::new(&settings);
    let Some((completion_tokens, cached_tokens)) = run_choice(&*codec, &settings, &fmt, rx, guard, &tx).await else {
        return;
    };
    send_usage_and_done(&settings, &fmt, completion_tokens, cached_tokens, &tx).await;
}

/// The end of every stream: the usage chunk when asked for (`include_usage`), then `[DONE]`,
/// in one write.
async fn send_usage_and_done(
    settings: &ResponseSettings,
    fmt: &ChunkFormatter,
    completion_tokens: u32,
    cached_tokens: u32,
    tx: &mpsc::Sender<Bytes>,
) {
    let mut last = Vec::new();
    if settings.include_usage {
        last.extend_from_slice(
            &fmt.usage_chunk(Usage::new(settings.prompt_tokens, completion_tokens).with_cached(cached_tokens)),
        );
    }
    last.extend_from_slice(&sse_done());
    let _ = tx.send(Bytes::from(last)).await;
}

/// Start streaming a request with `n > 1`: one task per choice, each sending its chunks with
/// its `index` into the one body as they come (chunks of different choices interleave, as
/// vLLM's do); after the last choice finished, the usage chunk (prompt once, every choice's
/// completion tokens) and `[DONE]`. A choice that fails ends the stream with its error event,
/// and the other choices are aborted (D58).
pub fn respond_choices(
    codec: Arc<dyn TextCodec>,
    settings: ResponseSettings,
    choices: Vec<(OutputReceiver, RequestGuard)>,
) -> HttpResponse {
    let (tx, body_rx) = mpsc::channel::<Bytes>(BODY_BUFFER);
    let request_id = settings.request_id.clone();
    let span = tracing::Span::current();
    actix_web::rt::spawn(tracing::Instrument::instrument(run_choices(codec, settings, choices, tx), span));
    sse_response(&request_id, body_rx)
}

async fn run_choices(
    codec: Arc<dyn TextCodec>,
    settings: ResponseSettings,
    choices: Vec<(OutputReceiver, RequestGuard)>,
    tx: mpsc::Sender<Bytes>,
) {
    let fmt = ChunkFormatter::new(&settings);
    let mut tasks: futures::stream::FuturesUnordered<_> = (0u32..)
        .zip(choices)
        .map(|(index, (rx, guard))| {
            let (codec, settings, fmt, tx) = (codec.clone(), settings.clone(), fmt.for_choice(index), tx.clone());
            async move { run_choice(&*codec, &settings, &fmt, rx, guard, &tx).await }
        })
        .collect();
    let (mut completion_tokens, mut cached_tokens) = (0u32, 0);
    while let Some(done) = tasks.next().await {
        match done {
            // The prompt is counted once, so its cached part too: the most any choice found.
            Some((tokens, cached)) => {
                completion_tokens = completion_tokens.saturating_add(tokens);
                cached_tokens = cached_tokens.max(cached);
            }
            // Dropping the other choices' futures drops their guards: their engine requests
            // are aborted.
            None => return,
        }
    }
    send_usage_and_done(&settings, &fmt, completion_tokens, cached_tokens, &tx).await;
}

/// Stream one choice's chunks (`fmt` carries its index) up to and including its last delta
/// chunk. `Some((completion tokens, cached prompt tokens))` when it finished normally; `None`
/// when the stream is over for the client (it went away, or this choice's error event was sent).
async fn run_choice(
    codec: &dyn TextCodec,
    settings: &ResponseSettings,
    fmt: &ChunkFormatter,
    mut rx: OutputReceiver,
    mut guard: RequestGuard,
    tx: &mpsc::Sender<Bytes>,
) -> Option<(u32, u32)> {
    let mut processor = settings.processor(codec);
    if !settings.resume_token_ids.is_empty() {
        // Tokens the client saw from the node this request started on (D56): they pass through
        // the processor so detokenisation, stop strings and usage go on exactly from there.
        let seen = pdmesh_protocol::EngineOutput {
            request_id: String::new(),
            new_token_ids: settings.resume_token_ids.clone(),
            new_logprobs: None,
            finish_reason: None,
            stop_token_id: None,
            kv_transfer_params: None,
            num_external_tokens: 0,
            num_cached_tokens: 0,
            error: None,
        };
        if let Err(e) = processor.process(&seen) {
            send_error(tx, e).await;
            return None;
        }
    }
    if settings.api == Api::Chat && tx.send(fmt.role_chunk()).await.is_err() {
        return None;
    }
    // `echo`: the prompt's text first, once (a resumed stream's client has it already)
    if let Some(prompt) = settings.echo.clone().filter(|_| settings.resume_token_ids.is_empty()) {
        if tx.send(fmt.delta_chunk(prompt, &[], None)).await.is_err() {
            return None;
        }
    }
    // With tools the text is held to the end: whether it is a call is known only then (D54).
    let hold_for_tools = settings.api == Api::Chat && settings.tools.is_some();
    let mut held = String::new();
    // Ids of tokens whose outputs sent no chunk yet (text held back, nothing to show).
    let mut unsent_ids: Vec<u32> = Vec::new();
    loop {
        let delta = match next_delta(tx, &mut rx, &mut guard, &mut processor).await {
            Ok(delta) => delta,
            Err(None) => return None,
            Err(Some(e)) => {
                send_error(tx, e).await;
                return None;
            }
        };
        guard.on_tokens(delta.new_tokens);
        unsent_ids.extend_from_slice(&delta.token_ids);
        let chunk = match &delta.finish {
            None if hold_for_tools => {
                held.push_str(&delta.text);
                continue;
            }
            None if delta.text.is_empty() && delta.logprobs.is_empty() => continue,
            None => fmt.delta_chunk_with_ids(delta.text, &delta.logprobs, None, &std::mem::take(&mut unsent_ids)),
            Some(Finish::Error(message)) => {
                guard.finish("error");
                send_error(tx, ApiError::from_engine_failure(message.as_deref())).await;
                return None;
            }
            Some(Finish::Abort) => {
                // The mesh gave up on the request: the stream just ends.
                guard.finish("abort");
                if !delta.text.is_empty() {
                    let _ = tx.send(fmt.delta_chunk_with_ids(delta.text, &delta.logprobs, None, &unsent_ids)).await;
                }
                return None;
            }
            Some(finish) => {
                if !delta.engine_finished {
                    guard.abort_now(AbortReason::StopString);
                }
                guard.finish(finish.as_str());
                let last = if hold_for_tools {
                    held.push_str(&delta.text);
                    fmt.tool_chunk(settings, std::mem::take(&mut held), finish)
                } else {
                    fmt.delta_chunk_with_ids(delta.text, &delta.logprobs, Some(finish), &unsent_ids)
                };
                return tx.send(last).await.ok().map(|()| (processor.completion_tokens(), processor.cached_tokens()));
            }
        };
        if tx.send(chunk).await.is_err() {
            return None;
        }
    }
}

async fn send_error(tx: &mpsc::Sender<Bytes>, error: ApiError) {
    error.record();
    let _ = tx.send(sse_error(&error)).await;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A streamed request's settings for formatter tests.
    pub(crate) fn settings(api: Api, include_usage: bool, logprobs: Option<u32>) -> ResponseSettings {
        ResponseSettings {
            api,
            request_id: "r1".into(),
            created: 7,
            model: "m".into(),
            stop: vec![],
            include_stop_str_in_output: false,
            eos_token_ids: vec![],
            logprobs,
            stream: true,
            include_usage,
            prompt_tokens: 3,
            tools: None,
            stream_token_ids: false,
            resume_token_ids: Vec::new(),
            min_tokens: 0,
            echo: None,
        }
    }

    fn parse(event: &Bytes) -> Vec<serde_json::Value> {
        let text = std::str::from_utf8(event).unwrap();
        assert!(text.ends_with("\n\n"), "{text:?}");
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let data = e.strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data line: {e:?}"));
                if data == "[DONE]" {
                    serde_json::Value::String("[DONE]".into())
                } else {
                    serde_json::from_str(data).unwrap()
                }
            })
            .collect()
    }

    #[test]
    fn framing() {
        assert_eq!(&sse_data(&serde_json::json!({"a": 1}))[..], b"data: {\"a\":1}\n\n");
        assert_eq!(&sse_done()[..], b"data: [DONE]\n\n");
        let events = parse(&sse_error(&ApiError::Unavailable("unavailable: x".into())));
        assert_eq!(events.len(), 2);
        assert_eq!(events[0]["error"]["code"], 503);
        assert_eq!(events[0]["error"]["message"], "unavailable: x");
        assert_eq!(events[1], "[DONE]");
    }

    #[test]
    fn completion_chunks() {
        let f = ChunkFormatter::new(&settings(Api::Completion, false, None));
        let c = &parse(&f.delta_chunk("hi".into(), &[], None))[0];
        assert_eq!(c["id"], "cmpl-r1");
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["created"], 7);
        assert_eq!(c["model"], "m");
        assert_eq!(c["choices"][0]["text"], "hi");
        assert!(c["choices"][0]["finish_reason"].is_null());
        assert!(c["choices"][0]["logprobs"].is_null());
        assert!(c.get("usage").is_none(), "no usage field without include_usage");
        let c = &parse(&f.delta_chunk(String::new(), &[], Some(&Finish::Length)))[0];
        assert_eq!(c["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn chat_chunks_and_usage() {
        let f = ChunkFormatter::new(&settings(Api::Chat, true, Some(0)));
        let role = &parse(&f.role_chunk())[0];
        assert_eq!(role["object"], "chat.completion.chunk");
        assert_eq!(role["id"], "chatcmpl-r1");
        assert_eq!(role["choices"][0]["delta"], serde_json::json!({"role": "assistant", "content": ""}));
        assert!(role["usage"].is_null() && role.get("usage").is_some());
        let c = &parse(&f.delta_chunk("x".into(), &[], None))[0];
        assert_eq!(c["choices"][0]["delta"], serde_json::json!({"content": "x"}));
        assert_eq!(c["choices"][0]["logprobs"], serde_json::json!({"content": []}));
        let last = &parse(&f.delta_chunk(String::new(), &[], Some(&Finish::Stop(None))))[0];
        assert_eq!(last["choices"][0]["delta"], serde_json::json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        let u = &parse(&f.usage_chunk(Usage::new(3, 2)))[0];
        assert_eq!(u["choices"], serde_json::json!([]));
        assert_eq!(
            u["usage"],
            serde_json::json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}})
        );
    }
}
