//! The life of one generation request after validation, shared by completions and chat:
//! submit to the engine, then either collect the whole answer or stream it
//! ([`crate::stream`]). [`RequestGuard`] ties the engine request to the HTTP request: when the
//! handler (or the SSE body) is dropped before the request finished, the engine request is
//! aborted, and every accepted request records exactly one finish reason.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use actix::Addr;
use actix_web::HttpResponse;
use pdmesh_model_api::TextCodec;
use pdmesh_protocol::{EngineRequest, KvTransferParams, TraceContext};

use crate::engine_client::{next_ticket, thread_inbox, Abort, AbortReason, EngineClient, OutputReceiver, Submit};
use crate::error::ApiError;
use crate::headers::RequestMeta;
use crate::metrics::{E2E, FINISH_REASONS_TOTAL, GENERATION_TOKENS_TOTAL, IN_FLIGHT, ITL, PROMPT_TOKENS_TOTAL, TTFT};
use crate::openai::{
    ChatChoice, ChatCompletionResponse, ChatMessageOut, CompletionChoice, CompletionResponse, KvParamsField, Usage,
    UsageField,
};
use crate::output::{chat_logprobs, completion_logprobs, Finish, OutputProcessor, TokenLogprob};
use crate::state::AppState;
use crate::validation::ValidatedParams;
pub use pdmesh_http_edge::serve::set_request_id;

/// Which OpenAI API a request came through (decides only the response shapes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completion,
    Chat,
}

/// Everything needed to shape the response of one request.
#[derive(Debug, Clone)]
pub struct ResponseSettings {
    pub api: Api,
    /// The client's request id (`X-Request-Id`), echoed in the answer.
    pub request_id: String,
    pub created: u64,
    pub model: String,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub eos_token_ids: Vec<u32>,
    pub logprobs: Option<u32>,
    pub stream: bool,
    pub include_usage: bool,
    pub prompt_tokens: u32,
    /// Chat with tools: read tool calls out of the answer (D54).
    pub tools: Option<crate::tools::ToolMode>,
    /// Stream chunks carry their token ids (`pdmesh_token_ids`) for the router (D56).
    pub stream_token_ids: bool,
    /// Tokens generated elsewhere before the request moved here (D56): the client has seen
    /// them; the output processor consumes them first without showing them.
    pub resume_token_ids: Vec<u32>,
    /// vLLM's `min_tokens`: stop strings count only after it ([`OutputProcessor::with_min_tokens`]).
    pub min_tokens: u32,
    /// Completions `echo`: the prompt's text, shown before the completion's (streamed: in a
    /// first chunk of each choice, unless the request resumes where the client saw it).
    pub echo: Option<String>,
}

impl ResponseSettings {
    /// The output processor of one choice of this response.
    pub fn processor<'a>(&self, codec: &'a dyn TextCodec) -> OutputProcessor<'a> {
        OutputProcessor::new(
            codec,
            self.stop.clone(),
            self.include_stop_str_in_output,
            self.eos_token_ids.clone(),
            self.logprobs,
        )
        .with_min_tokens(self.min_tokens)
    }

    /// The `id` of the response body: `cmpl-<request id>` / `chatcmpl-<request id>` (vLLM).
    pub fn response_id(&self) -> String {
        match self.api {
            Api::Completion => format!("cmpl-{}", self.request_id),
            Api::Chat => format!("chatcmpl-{}", self.request_id),
        }
    }
}

/// A validated request, ready to submit.
#[derive(Debug)]
pub struct Prepared {
    pub settings: ResponseSettings,
    pub request: EngineRequest,
    pub trace: TraceContext,
    pub arrival: Instant,
    /// `frontend.generate`: open until the response is over (it lives in the [`RequestGuard`]).
    pub span: tracing::Span,
    /// Choices asked for (`n`): [`submit`] fans out that many engine requests (D58).
    pub n: u32,
    /// A decode leg sent before P answered: parked under this token until its params arrive
    /// ([`crate::parked`], D66).
    pub params_follow: Option<String>,
}

pub use crate::state::unix_now;

fn unix_now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Assemble the engine request and the response settings of a validated request.
pub fn prepare(
    api: Api,
    meta: RequestMeta,
    params: ValidatedParams,
    prompt_token_ids: Vec<u32>,
    max_tokens: u32,
    state: &AppState,
    arrival: Instant,
) -> Prepared {
    let n = params.n;
    let mut sampling = params.sampling;
    sampling.max_tokens = max_tokens;
    let settings = ResponseSettings {
        api,
        request_id: meta.request_id.clone(),
        created: unix_now(),
        model: state.options.served_model_name.clone(),
        stop: params.stop,
        include_stop_str_in_output: params.include_stop_str_in_output,
        eos_token_ids: state.options.eos_token_ids.clone(),
        logprobs: sampling.logprobs,
        stream: params.stream,
        include_usage: params.include_usage,
        prompt_tokens: u32::try_from(prompt_token_ids.len()).unwrap_or(u32::MAX),
        tools: params.tools,
        stream_token_ids: false,
        resume_token_ids: Vec::new(),
        min_tokens: sampling.min_tokens,
        echo: params.echo,
    };
    let request = EngineRequest {
        request_id: meta.engine_request_id,
        client_request_id: Some(meta.request_id),
        prompt_token_ids,
        sampling,
        eos_token_ids: state.options.eos_token_ids.clone(),
        arrival_unix_ms: unix_now_ms(),
        kv_transfer_params: params.kv_transfer_params,
        data_parallel_rank: meta.data_parallel_rank,
    };
    // A child of the handler's `frontend.request` span that lives as long as the response
    // (the handler's ends when it returns a stream), holding the request's events.
    let span = tracing::info_span!(
        "frontend.generate",
        request_id = %settings.request_id,
        engine_request_id = %request.request_id,
        api = ?api,
        prompt_tokens = settings.prompt_tokens,
        max_tokens,
        stream = settings.stream,
        remote_prefill = request.kv_transfer_params.as_ref().is_some_and(|p| p.wants_remote_prefill()),
    );
    // The AddRequest carries this span's context (or, export off, a child of the client's).
    let trace = match pdmesh_telemetry::trace::context_of(&span) {
        Some(ctx) => ctx,
        None => meta.trace,
    };
    Prepared { settings, request, trace, arrival, span, n, params_follow: None }
}

/// Ties an accepted engine request to its HTTP request (see the module docs).
pub struct RequestGuard {
    client: Addr<EngineClient>,
    request_id: String,
    ticket: u64,
    arrival: Instant,
    last_tokens_at: Option<Instant>,
    finished: bool,
    span: tracing::Span,
    /// The request's place under `limits.max_in_flight`, given back with the guard.
    permit: Option<crate::overload::InFlightPermit>,
    /// Its place under its key's `limits.max_in_flight_per_key`, given back with the guard.
    key_permit: Option<crate::overload::KeyPermit>,
}

impl RequestGuard {
    fn new(client: Addr<EngineClient>, request_id: String, ticket: u64, arrival: Instant, span: tracing::Span) -> Self {
        IN_FLIGHT.inc();
        Self {
            client,
            request_id,
            ticket,
            arrival,
            last_tokens_at: None,
            finished: false,
            span,
            permit: None,
            key_permit: None,
        }
    }

    /// Keep the request's in-flight permits until the answer is over (the guard is dropped).
    pub fn hold(&mut self, permit: crate::overload::InFlightPermit, key_permit: Option<crate::overload::KeyPermit>) {
        self.permit = Some(permit);
        self.key_permit = key_permit;
    }

    /// Record the arrival of `n` new tokens (TTFT for the first, inter-token latency after).
    pub fn on_tokens(&mut self, n: u32) {
        if n == 0 {
            return;
        }
        GENERATION_TOKENS_TOTAL.inc_by(u64::from(n));
        let now = Instant::now();
        match self.last_tokens_at {
            None => {
                TTFT.observe(now.duration_since(self.arrival).as_secs_f64());
                tracing::info!(parent: &self.span, tokens = n, "first token");
            }
            Some(t) => ITL.observe(now.duration_since(t).as_secs_f64()),
        }
        self.last_tokens_at = Some(now);
    }

    /// The request is over for the client; `reason` is the finish reason label.
    pub fn finish(&mut self, reason: &str) {
        if self.finished {
            return;
        }
        self.finished = true;
        tracing::info!(parent: &self.span, reason, "request finished");
        FINISH_REASONS_TOTAL.with_label_values(&[reason]).inc();
        E2E.observe(self.arrival.elapsed().as_secs_f64());
    }

    /// Abort the engine request now (it is still running but nobody needs its output).
    pub fn abort_now(&self, reason: AbortReason) {
        self.client.do_send(Abort { request_id: self.request_id.clone(), ticket: self.ticket, reason });
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.finished {
            tracing::info!(request_id = %self.request_id, "client went away; aborting the request");
            self.finish("abort");
            self.abort_now(AbortReason::ClientDisconnect);
        }
        IN_FLIGHT.dec();
    }
}

/// An engine request the dp-lb accepted.
pub struct Accepted {
    pub settings: ResponseSettings,
    pub outputs: OutputReceiver,
    pub guard: RequestGuard,
    /// Choices 1..n of a request with `n > 1` (choice 0 is `outputs`/`guard`), in index order.
    pub more: Vec<(OutputReceiver, RequestGuard)>,
}

/// Submit to the engine; errors are the mesh's refusals (before admission). A request with
/// `n > 1` is `n` engine requests (vLLM V1's parallel sampling: the frontend fans the parent
/// out into children and merges their outputs, D58), submitted by [`submit_choices`].
pub async fn submit(state: &AppState, prepared: Prepared) -> Result<Accepted, ApiError> {
    if prepared.n > 1 {
        return submit_choices(state, prepared).await;
    }
    let Prepared { settings, request, trace, arrival, span, n: _, params_follow: _ } = prepared;
    let (outputs, guard) = submit_one(state, request, trace, arrival, span).await?;
    PROMPT_TOKENS_TOTAL.inc_by(u64::from(settings.prompt_tokens));
    Ok(Accepted { settings, outputs, guard, more: Vec::new() })
}

async fn submit_one(
    state: &AppState,
    request: EngineRequest,
    trace: TraceContext,
    arrival: Instant,
    span: tracing::Span,
) -> Result<(OutputReceiver, RequestGuard), ApiError> {
    let engine_request_id = request.request_id.clone();
    let ticket = next_ticket();
    let inbox = thread_inbox();
    let outputs =
        state.client.send(Submit { request, trace, ticket, inbox }).await.map_err(|e| {
            ApiError::Unavailable(format!("engine unavailable: the engine client is not running ({e})"))
        })??;
    Ok((outputs, RequestGuard::new(state.client.clone(), engine_request_id, ticket, arrival, span)))
}

/// The engine request of choice `index` (≥ 1) of a request with `n > 1`: its own id
/// (`<parent id>-<index>`), its own seed (`seed + index`, as vLLM derives its children's, so
/// seeded choices differ but repeat), and no remote prefill: only choice 0 reads P's blocks, so
/// P's blocks are read once and each engine request finishes once (rules R1–R5 hold per engine
/// request); the others prefill the prompt on this node.
pub fn child_request(parent: &EngineRequest, index: u32) -> EngineRequest {
    let mut child = parent.clone();
    child.request_id = format!("{}-{index}", parent.request_id);
    child.sampling.seed = parent.sampling.seed.map(|s| s.wrapping_add(u64::from(index)));
    if child.kv_transfer_params.as_ref().is_some_and(KvTransferParams::wants_remote_prefill) {
        child.kv_transfer_params = None;
    }
    child
}

/// Submit the `n` engine requests of one request. Choices 1..n first, choice 0 (the one that
/// may carry P's blocks) last: if any is refused, none that reads P's blocks was admitted, so
/// the caller's rejection notice (R1) is the only word P gets; the choices already admitted
/// are aborted as their guards drop.
async fn submit_choices(state: &AppState, prepared: Prepared) -> Result<Accepted, ApiError> {
    let Prepared { settings, request, trace, arrival, span, n, params_follow: _ } = prepared;
    let mut more = Vec::with_capacity(n.saturating_sub(1) as usize);
    for index in 1..n {
        let child = child_request(&request, index);
        more.push(submit_one(state, child, trace.clone(), arrival, span.clone()).await?);
    }
    let (outputs, guard) = submit_one(state, request, trace, arrival, span).await?;
    PROMPT_TOKENS_TOTAL.inc_by(u64::from(settings.prompt_tokens).saturating_mul(u64::from(n)));
    Ok(Accepted { settings, outputs, guard, more })
}

/// Answer an accepted request: an SSE stream, or the whole response once it finished.
pub async fn respond(state: &AppState, accepted: Accepted) -> Result<HttpResponse, ApiError> {
    let Accepted { settings, outputs, guard, more } = accepted;
    if !more.is_empty() {
        let mut choices = vec![(outputs, guard)];
        choices.extend(more);
        return if settings.stream {
            Ok(crate::stream::respond_choices(state.codec.clone(), settings, choices))
        } else {
            collect_choices(&*state.codec, settings, choices).await
        };
    }
    if settings.stream {
        Ok(crate::stream::respond(state.codec.clone(), settings, outputs, guard))
    } else {
        collect(&*state.codec, settings, outputs, guard).await
    }
}

/// The whole output of a request that finished normally (stop or length).
pub struct Collected {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Finish,
    pub completion_tokens: u32,
    /// Prompt tokens the engine reused from its prefix cache.
    pub cached_tokens: u32,
    pub kv_transfer_params: Option<KvTransferParams>,
    /// The ids of the output tokens (the router asks a prefill node for them, D63).
    pub token_ids: Vec<u32>,
}

/// Wait for the whole output of a request; a failed or aborted request is an error.
pub async fn collect_text(
    codec: &dyn TextCodec,
    settings: &ResponseSettings,
    mut outputs: OutputReceiver,
    mut guard: RequestGuard,
) -> Result<Collected, ApiError> {
    let mut processor = settings.processor(codec);
    let mut text = String::new();
    let mut logprobs: Vec<TokenLogprob> = Vec::new();
    let mut token_ids: Vec<u32> = Vec::new();
    let (finish, kv_transfer_params) = loop {
        let Some(output) = outputs.recv().await else {
            guard.finish("error");
            return Err(ApiError::Unavailable(
                "engine unavailable: the output stream closed before the request finished".into(),
            ));
        };
        let delta = match processor.process(&output) {
            Ok(delta) => delta,
            Err(e) => {
                guard.abort_now(AbortReason::OutputError);
                guard.finish("error");
                return Err(e);
            }
        };
        guard.on_tokens(delta.new_tokens);
        text.push_str(&delta.text);
        logprobs.extend(delta.logprobs);
        token_ids.extend_from_slice(&delta.token_ids);
        if let Some(finish) = delta.finish {
            if !delta.engine_finished {
                guard.abort_now(AbortReason::StopString);
            }
            break (finish, delta.kv_transfer_params);
        }
    };
    guard.finish(finish.as_str());
    match finish {
        Finish::Error(message) => return Err(ApiError::from_engine_failure(message.as_deref())),
        Finish::Abort => return Err(ApiError::Unavailable("unavailable: the engine aborted the request".into())),
        Finish::Stop(_) | Finish::Length => {}
    }
    Ok(Collected {
        text,
        logprobs,
        finish,
        completion_tokens: processor.completion_tokens(),
        cached_tokens: processor.cached_tokens(),
        kv_transfer_params,
        token_ids,
    })
}

/// Wait for the whole output of a non-streaming request.
async fn collect(
    codec: &dyn TextCodec,
    settings: ResponseSettings,
    outputs: OutputReceiver,
    guard: RequestGuard,
) -> Result<HttpResponse, ApiError> {
    let Collected { text, logprobs, finish, completion_tokens, cached_tokens, kv_transfer_params, token_ids } =
        collect_text(codec, &settings, outputs, guard).await?;
    let usage = Usage::new(settings.prompt_tokens, completion_tokens).with_cached(cached_tokens);
    let body = match settings.api {
        Api::Completion => {
            serde_json::to_value(completion_body(&settings, text, &logprobs, &finish, usage, kv_transfer_params))
        }
        Api::Chat => serde_json::to_value(chat_body(&settings, text, &logprobs, &finish, usage, kv_transfer_params)),
    };
    let mut body = body.map_err(|e| ApiError::Internal(format!("response body: {e}")))?;
    // The router's internal call asked for the ids of the output (D63).
    if settings.stream_token_ids {
        body[crate::stream::TOKEN_IDS_FIELD] = serde_json::json!(token_ids);
    }
    let mut response = HttpResponse::Ok().json(body);
    set_request_id(&mut response, &settings.request_id);
    Ok(response)
}

/// The whole output of a request with `n > 1`: every choice collected concurrently, one
/// `choices` entry each with its `index`, usage counting the prompt once and every choice's
/// completion tokens (as vLLM reports it). One failed choice fails the request; the others are
/// aborted as their guards drop.
async fn collect_choices(
    codec: &dyn TextCodec,
    settings: ResponseSettings,
    choices: Vec<(OutputReceiver, RequestGuard)>,
) -> Result<HttpResponse, ApiError> {
    let collected = futures::future::try_join_all(
        choices.into_iter().map(|(outputs, guard)| collect_text(codec, &settings, outputs, guard)),
    )
    .await?;
    let completion_tokens = collected.iter().map(|c| c.completion_tokens).fold(0u32, u32::saturating_add);
    let usage = Usage::new(settings.prompt_tokens, completion_tokens);
    let mut bodies = collected.into_iter();
    let Some(first) = bodies.next() else {
        return Err(ApiError::Internal("a request with n > 1 has no choices".into()));
    };
    let mut response = match settings.api {
        Api::Completion => {
            let mut body = completion_body(&settings, first.text, &first.logprobs, &first.finish, usage, None);
            let more = bodies.map(|c| completion_body(&settings, c.text, &c.logprobs, &c.finish, usage, None).choices);
            body.choices.extend(numbered_from_one(more, |choice, index| choice.index = index));
            HttpResponse::Ok().json(body)
        }
        Api::Chat => {
            let mut body = chat_body(&settings, first.text, &first.logprobs, &first.finish, usage, None);
            let more = bodies.map(|c| chat_body(&settings, c.text, &c.logprobs, &c.finish, usage, None).choices);
            body.choices.extend(numbered_from_one(more, |choice, index| choice.index = index));
            HttpResponse::Ok().json(body)
        }
    };
    set_request_id(&mut response, &settings.request_id);
    Ok(response)
}

/// Choices 1.. of an `n > 1` answer (each body built as if alone, so with index 0), given the
/// index of their place in the answer.
fn numbered_from_one<C>(bodies: impl Iterator<Item = Vec<C>>, set_index: impl Fn(&mut C, u32)) -> Vec<C> {
    let mut out = Vec::new();
    for (index, choices) in (1u32..).zip(bodies) {
        for mut choice in choices {
            set_index(&mut choice, index);
            out.push(choice);
        }
    }
    out
}

fn completion_body(
    settings: &ResponseSettings,
    text: String,
    logprobs: &[TokenLogprob],
    finish: &Finish,
    usage: Usage,
    kv_transfer_params: Option<KvTransferParams>,
) -> CompletionResponse {
    CompletionResponse {
        id: settings.response_id(),
        object: "text_completion",
        created: settings.created,
        model: settings.model.clone(),
        choices: vec![CompletionChoice {
            index: 0,
            // `echo`: the prompt's text, then the completion's (vLLM)
            text: match &settings.echo {
                Some(prompt) => format!("{prompt}{text}"),
                None => text,
            },
            logprobs: settings.logprobs.map(|_| completion_logprobs(logprobs)),
            finish_reason: Some(finish.as_str()),
            stop_reason: finish.stop_reason(),
        }],
        usage: UsageField::Set(usage),
        kv_transfer_params: KvParamsField::from_option(kv_transfer_params),
    }
}

fn chat_body(
    settings: &ResponseSettings,
    text: String,
    logprobs: &[TokenLogprob],
    finish: &Finish,
    usage: Usage,
    kv_transfer_params: Option<KvTransferParams>,
) -> ChatCompletionResponse {
    ChatCompletionResponse {
        id: settings.response_id(),
        object: "chat.completion",
        created: settings.created,
        model: settings.model.clone(),
        choices: vec![{
            let (message, finish_reason) = chat_message(settings, text, finish);
            ChatChoice {
                index: 0,
                message,
                logprobs: settings.logprobs.map(|_| chat_logprobs(logprobs)),
                finish_reason: Some(finish_reason),
                stop_reason: finish.stop_reason(),
            }
        }],
        usage,
        kv_transfer_params: KvParamsField::from_option(kv_transfer_params),
    }
}

/// The assistant message of a finished chat answer and its `finish_reason`: with tools, calls
/// found in the text become `tool_calls` (`finish_reason: "tool_calls"`, D54).
///
/// A forced call (`tool_choice` `required` or a named function) cut by the token limit is
/// still `tool_calls`, the cut call's arguments as produced, with `finish_reason: "length"`
/// (`tools::parse_cut`): never the raw call text as `content`.
pub fn chat_message(settings: &ResponseSettings, text: String, finish: &Finish) -> (ChatMessageOut, &'static str) {
    use crate::tools::ToolMode;
    let parsed = match (&settings.tools, finish) {
        (Some(mode), Finish::Stop(_)) => crate::tools::parse(mode, &text).map(|p| (p, "tool_calls")),
        (Some(mode @ (ToolMode::Required | ToolMode::Named(_))), Finish::Length) => {
            Some(((None, crate::tools::parse_cut(mode, &text)), "length"))
        }
        _ => None,
    };
    match parsed {
        Some(((content, calls), finish_reason)) => (
            ChatMessageOut {
                role: "assistant",
                content,
                tool_calls: Some(crate::tools::calls_json(&calls, &settings.request_id, false)),
            },
            finish_reason,
        ),
        None => (ChatMessageOut { role: "assistant", content: Some(text), tool_calls: None }, finish.as_str()),
    }
}
