//! `POST /v1/completions`.

use std::time::Instant;

use actix_web::{web, HttpRequest, HttpResponse};

use crate::error::ApiError;
use crate::generate::{prepare, Api, Prepared};
use crate::handlers::serve;
use crate::headers::RequestMeta;
use crate::openai::CompletionRequest;
use crate::state::AppState;
use crate::validation::{
    check_model, completion_logprobs, completion_prompt, resolve_max_tokens, validate_params, MaxTokensDefault,
    ModelLimits, SamplingInput, ValidatedRequest, DEFAULT_COMPLETION_MAX_TOKENS,
};

/// The handler.
pub async fn completions(
    req: HttpRequest,
    body: web::Json<CompletionRequest>,
    state: web::Data<AppState>,
) -> HttpResponse {
    let arrival = Instant::now();
    let body = body.into_inner();
    let remote_prefill = crate::handlers::remote_prefill_params(body.kv_transfer_params.as_ref());
    serve(&req, &state, Api::Completion, remote_prefill, move |meta, state| validate(body, meta, state, arrival)).await
}

fn validate(
    body: CompletionRequest,
    meta: RequestMeta,
    state: &AppState,
    arrival: Instant,
) -> Result<Prepared, ApiError> {
    let limits = ModelLimits::from(state);
    let v = validate_request(&body, &limits)?;
    if let Some(g) = &v.params.sampling.guided {
        crate::metrics::STRUCTURED_OUTPUTS_TOTAL.with_label_values(&[crate::structured::kind(g)]).inc();
    }
    let mut prepared = prepare(Api::Completion, meta, v.params, v.prompt, v.max_tokens, state, arrival);
    crate::resume::apply(&body.extra, &mut prepared, limits.vocab_size)?;
    Ok(prepared)
}

/// The request body → engine parameters, the tokenised prompt, and `max_tokens`; or the
/// refusal. Pure (no I/O, no shared state).
pub fn validate_request(body: &CompletionRequest, limits: &ModelLimits<'_>) -> Result<ValidatedRequest, ApiError> {
    check_model(body.model.as_deref(), &limits.options.served_model_name)?;
    crate::validation::check_unhonoured(crate::validation::Endpoint::Completions, &body.extra)?;
    if body.echo == Some(true) && body.logprobs.is_some() {
        return Err(ApiError::invalid(
            "`echo` with `logprobs` asks for the prompt's logprobs, which this server does not compute; \
             send `echo` or `logprobs`.",
            "echo",
        ));
    }
    if body.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("`suffix` is not supported by this server.", "suffix"));
    }
    crate::validation::check_beam_search(body.use_beam_search, body.stream)?;
    crate::validation::check_best_of(body.best_of, body.n)?;
    let vocab = limits.vocab_size;
    let input = SamplingInput {
        max_tokens: body.max_tokens,
        max_tokens_param: "max_tokens",
        temperature: body.temperature,
        top_p: body.top_p,
        top_k: body.top_k,
        seed: body.seed,
        stop: body.stop.as_ref(),
        stop_token_ids: body.stop_token_ids.as_deref(),
        ignore_eos: body.ignore_eos,
        include_stop_str_in_output: body.include_stop_str_in_output,
        logprobs: completion_logprobs(body.logprobs)?,
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
    crate::validation::sampling_extras(&body.extra, vocab, limits.codec, &mut params.sampling)?;
    params.sampling.guided = crate::structured::guided_spec(&body.extra)?.map(|(spec, _)| spec);
    let mut prompt = completion_prompt(body.prompt.as_ref(), limits.codec, vocab)?;
    let full_len = prompt.len();
    crate::validation::truncate_prompt(&body.extra, &mut prompt, limits.options.max_model_len)?;
    if body.echo == Some(true) {
        // the prompt as the client wrote it; token ids (or a truncated prompt) decoded
        params.echo = Some(match body.prompt.as_ref().and_then(|p| p.as_str()) {
            Some(text) if prompt.len() == full_len => text.to_string(),
            _ => limits
                .codec
                .decode(&prompt)
                .map_err(|e| ApiError::invalid(format!("cannot decode the prompt: {e}"), "prompt"))?,
        });
    }
    let max_tokens = resolve_max_tokens(
        u32::try_from(prompt.len()).unwrap_or(u32::MAX),
        params.requested_max_tokens,
        MaxTokensDefault::Fixed(DEFAULT_COMPLETION_MAX_TOKENS),
        limits.options.max_model_len,
        "prompt",
    )?;
    Ok(ValidatedRequest { params, prompt, max_tokens })
}
