//! `POST /v1/responses` and `GET /v1/responses/{id}` (OpenAI's Responses API, text only).
//!
//! The conversation (the stored turns of `previous_response_id`, then `input`, with
//! `instructions` as a first system message) is rendered with the model's chat template and
//! submitted like a chat request through [`serve_with`], so every refusal before admission,
//! an unknown `previous_response_id` included, goes through the rule-R1 rejection notice.

use std::sync::Arc;
use std::time::Instant;

use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use pdmesh_model_api::ChatMessage;
use serde_json::Value;

use crate::error::ApiError;
use crate::generate::{prepare, unix_now, Api, Prepared};
use crate::handlers::{remote_prefill_params, serve_with};
use crate::headers::RequestMeta;
use crate::openai::ResponsesRequest;
use crate::responses::{answer, ResponseContext, ResponseStore};
use crate::state::AppState;
use crate::validation::{
    check_model, render_chat, resolve_max_tokens, validate_params, MaxTokensDefault, ModelLimits, SamplingInput,
    ValidatedRequest,
};

/// `POST /v1/responses`.
pub async fn create_response(
    req: HttpRequest,
    body: web::Json<ResponsesRequest>,
    state: web::Data<AppState>,
) -> HttpResponse {
    let arrival = Instant::now();
    let body = body.into_inner();
    let remote_prefill = remote_prefill_params(body.kv_transfer_params.as_ref());
    let codec = state.codec.clone();
    let chosen_id = chosen_response_id(&req, &state.responses);
    serve_with(
        &req,
        &state,
        "responses",
        remote_prefill,
        move |meta, state| validate(body, meta, state, arrival, chosen_id),
        move |accepted, ctx| answer(codec, accepted, ctx),
    )
    .await
}

/// `GET /v1/responses/{id}`: a stored response object.
pub async fn get_response(path: web::Path<String>, state: web::Data<AppState>) -> HttpResponse {
    let id = path.into_inner();
    match state.responses.get(&id) {
        Some(stored) => HttpResponse::Ok().json(&stored.object),
        None => {
            let error = ApiError::ResponseNotFound(id);
            error.record();
            error.error_response()
        }
    }
}

/// The header naming the id the response is to be stored under, set by the router so that it
/// can send a follow-up (`previous_response_id`) back to the decode node that stored it
/// (docs/DECISIONS.md D49).
pub use pdmesh_protocol::node_http::RESPONSE_ID_HEADER;

/// The id chosen by the router ([`RESPONSE_ID_HEADER`]) when it is well formed (`resp_`, then
/// up to 96 ASCII letters, digits, `_` or `-`) and names no stored response; else none, and
/// the node mints its own: a header can never make one response overwrite another.
fn chosen_response_id(req: &HttpRequest, store: &ResponseStore) -> Option<String> {
    let id = req.headers().get(RESPONSE_ID_HEADER)?.to_str().ok()?;
    let rest = id.strip_prefix("resp_")?;
    let well_formed = !rest.is_empty()
        && rest.len() <= 96
        && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    (well_formed && store.get(id).is_none()).then(|| id.to_string())
}

fn validate(
    body: ResponsesRequest,
    meta: RequestMeta,
    state: &AppState,
    arrival: Instant,
    chosen_id: Option<String>,
) -> Result<(Prepared, ResponseContext), ApiError> {
    let (v, messages) = validate_request(&body, &ModelLimits::from(state), &state.responses)?;
    let ctx = ResponseContext {
        id: chosen_id.unwrap_or_else(|| format!("resp_{}", uuid::Uuid::new_v4().simple())),
        message_id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
        created_at: unix_now(),
        model: state.options.served_model_name.clone(),
        instructions: body.instructions,
        max_output_tokens: v.params.requested_max_tokens,
        temperature: body.temperature,
        top_p: body.top_p,
        previous_response_id: body.previous_response_id,
        store: body.store.unwrap_or(true),
        messages,
        store_handle: Arc::clone(&state.responses),
    };
    Ok((prepare(Api::Chat, meta, v.params, v.prompt, v.max_tokens, state, arrival), ctx))
}

/// The request body (with the stored turns of `previous_response_id` from `store`) → engine
/// parameters, the rendered and tokenised prompt, and `max_tokens`, plus the conversation to
/// store with the answer (without `instructions`); or the refusal. Pure apart from reading
/// `store`.
pub fn validate_request(
    body: &ResponsesRequest,
    limits: &ModelLimits<'_>,
    store: &ResponseStore,
) -> Result<(ValidatedRequest, Vec<ChatMessage>), ApiError> {
    check_model(body.model.as_deref(), &limits.options.served_model_name)?;
    crate::validation::check_unhonoured(crate::validation::Endpoint::Responses, &body.extra)?;
    let vocab = limits.vocab_size;
    let input = SamplingInput {
        max_tokens: body.max_output_tokens,
        max_tokens_param: "max_output_tokens",
        temperature: body.temperature,
        top_p: body.top_p,
        stream: body.stream,
        kv_transfer_params: body.kv_transfer_params.as_ref(),
        ..SamplingInput::default()
    };
    let params = validate_params(&input, vocab)?;
    let mut messages = match body.previous_response_id.as_deref() {
        Some(id) => {
            let previous = store.get(id).ok_or_else(|| ApiError::PreviousResponseNotFound(id.to_string()))?;
            let mut messages = previous.messages.clone();
            messages.push(ChatMessage::text("assistant", previous.output_text.clone()));
            messages
        }
        None => Vec::new(),
    };
    messages.extend(input_messages(body.input.as_ref())?);
    let mut rendered = Vec::with_capacity(messages.len() + 1);
    if let Some(instructions) = body.instructions.as_ref().filter(|i| !i.is_empty()) {
        rendered.push(ChatMessage::text("system", instructions.clone()));
    }
    rendered.extend(messages.iter().cloned());
    let prompt = render_chat(limits.codec, &rendered, None, vocab)?;
    let max_tokens = resolve_max_tokens(
        u32::try_from(prompt.len()).unwrap_or(u32::MAX),
        params.requested_max_tokens,
        MaxTokensDefault::RestOfContext,
        limits.options.max_model_len,
        "input",
    )?;
    Ok((ValidatedRequest { params, prompt, max_tokens }, messages))
}

/// `input` → messages: a string is one user message; an array holds message items.
fn input_messages(input: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    match input {
        None | Some(Value::Null) => Err(ApiError::invalid("`input` is required.", "input")),
        Some(Value::String(s)) => Ok(vec![ChatMessage::text("user", s.clone())]),
        Some(Value::Array(items)) if items.is_empty() => Err(ApiError::invalid("`input` must not be empty.", "input")),
        Some(Value::Array(items)) => items.iter().map(input_item).collect(),
        Some(_) => Err(ApiError::invalid("`input` must be a string or an array of message items.", "input")),
    }
}

/// One message item: `{"role", "content"}` (optionally `"type": "message"`); content is a
/// string or an array of text parts, joined with newlines as chat does.
fn input_item(item: &Value) -> Result<ChatMessage, ApiError> {
    let Some(item) = item.as_object() else {
        return Err(ApiError::invalid("each `input` item must be an object {\"role\", \"content\"}.", "input"));
    };
    if let Some(kind) = item.get("type").and_then(Value::as_str).filter(|&k| k != "message") {
        return Err(ApiError::invalid(format!("input items of type `{kind}` are not supported."), "input"));
    }
    let Some(role) = item.get("role").and_then(Value::as_str) else {
        return Err(ApiError::invalid("each `input` item needs a string `role`.", "input"));
    };
    // OpenAI's `developer` role is the system role of chat templates.
    let role = if role == "developer" { "system" } else { role };
    let content = match item.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("input_text" | "output_text" | "text"), Some(t)) => Ok(t),
                (Some(other), _) if !matches!(other, "input_text" | "output_text" | "text") => {
                    Err(ApiError::invalid(format!("only text content parts are supported, got `{other}`."), "input"))
                }
                _ => Err(ApiError::invalid(
                    "a content part must be {\"type\": \"input_text\", \"text\": \"...\"}.",
                    "input",
                )),
            })
            .collect::<Result<Vec<_>, _>>()?
            .join("\n"),
        _ => {
            return Err(ApiError::invalid("message content must be a string or an array of input_text parts.", "input"))
        }
    };
    Ok(ChatMessage::text(role, content))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn input_shapes() {
        let m = input_messages(Some(&json!("hi"))).unwrap();
        assert_eq!(m, vec![ChatMessage::text("user", "hi")]);
        let m = input_messages(Some(&json!([
            {"role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_text", "text": "b"}]}
        ])))
        .unwrap();
        assert_eq!(m[0], ChatMessage::text("system", "be brief"));
        assert_eq!(m[1], ChatMessage::text("user", "a\nb"));
        for bad in [
            json!(null),
            json!([]),
            json!(3),
            json!([{"content": "x"}]),
            json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            json!([{"type": "function_call", "role": "user", "content": "x"}]),
        ] {
            let e = input_messages(Some(&bad)).expect_err("must be refused");
            assert_eq!(e.status().as_u16(), 400);
            assert_eq!(e.param().as_deref(), Some("input"));
        }
    }
}
