//! `POST /v1/chat/completions`.

use std::time::Instant;

use actix_web::{web, HttpRequest, HttpResponse};

use crate::error::ApiError;
use crate::generate::{prepare, Api, Prepared};
use crate::handlers::serve;
use crate::headers::RequestMeta;
use crate::openai::ChatCompletionRequest;
use crate::server::AppState;
use crate::validation::{
    chat_logprobs, chat_messages, check_model, render_chat, resolve_max_tokens, validate_params, MaxTokensDefault,
    ModelLimits, SamplingInput, ValidatedRequest,
};

/// The handler.
pub async fn chat_completions(
    req: HttpRequest,
    body: web::Json<ChatCompletionRequest>,
    state: web::Data<AppState>,
) -> HttpResponse {
    let arrival = Instant::now();
    let body = body.into_inner();
    let remote_prefill = crate::handlers::remote_prefill_params(body.kv_transfer_params.as_ref());
    serve(&req, &state, Api::Chat, remote_prefill, move |meta, state| validate(body, meta, state, arrival)).await
}

fn validate(
    body: ChatCompletionRequest,
    meta: RequestMeta,
    state: &AppState,
    arrival: Instant,
) -> Result<Prepared, ApiError> {
    let limits = ModelLimits::from(state);
    let v = validate_request(&body, &limits)?;
    if let Some(g) = &v.params.sampling.guided {
        crate::metrics::STRUCTURED_OUTPUTS_TOTAL.with_label_values(&[crate::structured::kind(g)]).inc();
    }
    let mut prepared = prepare(Api::Chat, meta, v.params, v.prompt, v.max_tokens, state, arrival);
    crate::resume::apply(&body.extra, &mut prepared, limits.vocab_size)?;
    Ok(prepared)
}

/// The request body → engine parameters, the rendered and tokenised prompt, and `max_tokens`;
/// or the refusal. Pure (no I/O, no shared state).
pub fn validate_request(body: &ChatCompletionRequest, limits: &ModelLimits<'_>) -> Result<ValidatedRequest, ApiError> {
    check_model(body.model.as_deref(), &limits.options.served_model_name)?;
    crate::validation::check_unhonoured(crate::validation::Endpoint::Chat, &body.extra)?;
    crate::validation::check_beam_search(body.use_beam_search, body.stream)?;
    let vocab = limits.vocab_size;
    // `max_completion_tokens` supersedes the deprecated `max_tokens` (vLLM's precedence).
    let (max_tokens, max_tokens_param) = match body.max_completion_tokens {
        Some(m) => (Some(m), "max_completion_tokens"),
        None => (body.max_tokens, "max_tokens"),
    };
    let input = SamplingInput {
        max_tokens,
        max_tokens_param,
        temperature: body.temperature,
        top_p: body.top_p,
        top_k: body.top_k,
        seed: body.seed,
        stop: body.stop.as_ref(),
        stop_token_ids: body.stop_token_ids.as_deref(),
        ignore_eos: body.ignore_eos,
        include_stop_str_in_output: body.include_stop_str_in_output,
        logprobs: chat_logprobs(body.logprobs, body.top_logprobs)?,
        n: body.n,
        stream: body.stream,
        stream_options: body.stream_options.as_ref(),
        presence_penalty: body.presence_penalty,
        frequency_penalty: body.frequency_penalty,
        repetition_penalty: body.repetition_penalty,
        logit_bias: body.logit_bias.as_ref(),
        min_tokens: body.min_tokens,
        kv_transfer_params: body.kv_transfer_params.as_ref(),
    };
    let mut params = validate_params(&input, vocab)?;
    params.sampling.guided = crate::structured::guided_spec(&body.extra)?.map(|(spec, _)| spec);
    let mut messages = chat_messages(&body.messages)?;
    if let Some(setup) = crate::tools::tool_setup(body.tools.as_deref(), body.tool_choice.as_ref())? {
        if setup.guided.is_some() {
            if params.sampling.guided.is_some() {
                return Err(ApiError::invalid(
                    "`tool_choice` `required` or a named function cannot be combined with a structured output.",
                    "tool_choice",
                ));
            }
            params.sampling.guided = setup.guided;
        }
        // the tools go into the system message (the template has no tool support of its own)
        match messages.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{}", first.content, setup.system_block);
            }
            _ => {
                messages.insert(0, pdmesh_model_api::ChatMessage { role: "system".into(), content: setup.system_block })
            }
        }
        params.tools = Some(setup.mode);
    }
    let prompt = match crate::resume::prompt_token_ids(&body.extra, vocab)? {
        Some(ids) => ids,
        None => render_chat(limits.codec, &messages, vocab)?,
    };
    let max_tokens = resolve_max_tokens(
        u32::try_from(prompt.len()).unwrap_or(u32::MAX),
        params.requested_max_tokens,
        MaxTokensDefault::RestOfContext,
        limits.options.max_model_len,
        "messages",
    )?;
    Ok(ValidatedRequest { params, prompt, max_tokens })
}
