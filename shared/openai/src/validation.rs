//! Input validation: OpenAI request fields → engine parameters, or an [`ApiError`] naming the
//! field. Pure functions (no I/O), so every refusal is unit-tested here.
//!
//! Order, as in vLLM: model name (404) first, then the sampling fields, then the prompt
//! (render / tokenise), then the context length, which needs the prompt's token count.

use pdmesh_model_api::{ChatMessage, TextCodec, TextError};
use pdmesh_protocol::{KvTransferParams, SamplingParams};
use serde_json::Value;

use pdmesh_http_edge::error::ApiError;

use crate::wire::{ChatMessageIn, StreamOptions};
use crate::FrontendOptions;

/// Most stop strings a request may carry (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// Most top alternatives per token (vLLM's default `max_logprobs`).
pub const MAX_LOGPROBS: i64 = 20;
/// `max_tokens` of a completion request that names none (OpenAI's and vLLM's default).
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;
/// Longest stop string, in bytes: the frontend holds back that much output per request.
pub const MAX_STOP_STRING_BYTES: usize = 1024;

/// The fields that completions and chat share, borrowed from either request type.
#[derive(Debug, Clone, Default)]
pub struct SamplingInput<'a> {
    pub max_tokens: Option<i64>,
    /// Which field `max_tokens` came from, for error messages.
    pub max_tokens_param: &'static str,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<&'a Value>,
    pub stop_token_ids: Option<&'a [i64]>,
    pub ignore_eos: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    /// Already validated by [`completion_logprobs`] or [`chat_logprobs`].
    pub logprobs: Option<u32>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<&'a StreamOptions>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<&'a serde_json::Map<String, Value>>,
    pub min_tokens: Option<i64>,
    pub kv_transfer_params: Option<&'a Value>,
}

impl<'a> SamplingInput<'a> {
    /// The shared fields of a completions or chat body; `logprobs` already validated by the
    /// endpoint's own rule ([`completion_logprobs`] or [`chat_logprobs`]).
    pub fn from_fields(f: &'a crate::wire::SamplingFields, logprobs: Option<u32>) -> Self {
        Self {
            max_tokens: f.max_tokens,
            max_tokens_param: "max_tokens",
            temperature: f.temperature,
            top_p: f.top_p,
            top_k: f.top_k,
            seed: f.seed,
            stop: f.stop.as_ref(),
            stop_token_ids: f.stop_token_ids.as_deref(),
            ignore_eos: f.ignore_eos,
            include_stop_str_in_output: f.include_stop_str_in_output,
            logprobs,
            n: f.n,
            stream: f.stream,
            stream_options: f.stream_options.as_ref(),
            presence_penalty: f.presence_penalty,
            frequency_penalty: f.frequency_penalty,
            repetition_penalty: f.repetition_penalty,
            logit_bias: f.logit_bias.as_ref(),
            min_tokens: f.min_tokens,
            kv_transfer_params: f.kv_transfer_params.as_ref(),
        }
    }
}

/// What a generation request is checked against: the served model's options and its codec.
/// [`crate::request`]'s checks take it instead of a server's state, so the JSON body → engine
/// parameters path is a pure function (unit tests, the `http_body` fuzz target and the router
/// drive it without a server).
#[derive(Clone, Copy)]
pub struct ModelLimits<'a> {
    pub options: &'a FrontendOptions,
    pub codec: &'a dyn TextCodec,
    /// Token ids at or above it are refused (the frontend's `AppState::vocab_size`).
    pub vocab_size: u32,
}

impl std::fmt::Debug for ModelLimits<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelLimits").field("options", self.options).field("vocab_size", &self.vocab_size).finish()
    }
}

/// A generation request that passed validation: what `generate::prepare` turns into an
/// engine request.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedRequest {
    pub params: ValidatedParams,
    pub prompt: Vec<u32>,
    /// `max_tokens` settled against the context ([`resolve_max_tokens`]).
    pub max_tokens: u32,
}

/// Validated parameters of a generation request (the prompt comes separately).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedParams {
    /// Engine sampling parameters; `max_tokens` is settled by [`resolve_max_tokens`].
    pub sampling: SamplingParams,
    /// `max_tokens` as the client gave it (validated ≥ 1).
    pub requested_max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub kv_transfer_params: Option<KvTransferParams>,
    /// Choices to generate (`n`): that many engine requests, fanned out by the frontend
    /// (the frontend's `generate::submit`, D58).
    pub n: u32,
    /// How to read tool calls out of a chat answer (D54); `None` without tools.
    pub tools: Option<crate::tools::ToolMode>,
    /// Completions `echo`: the prompt's text to show before the completion.
    pub echo: Option<String>,
}

impl ValidatedParams {
    /// Whether this request is the decode leg of a P/D pair (P holds blocks for it).
    pub fn wants_remote_prefill(&self) -> bool {
        self.kv_transfer_params.as_ref().is_some_and(KvTransferParams::wants_remote_prefill)
    }
}

/// 404 unless `requested` is absent, empty, or the served model name.
pub fn check_model(requested: Option<&str>, served: &str) -> Result<(), ApiError> {
    match requested {
        None => Ok(()),
        Some(m) if m.is_empty() || m == served => Ok(()),
        Some(m) => Err(ApiError::ModelNotFound(m.to_string())),
    }
}

/// Completions `logprobs` (an integer 0..=20) → number of top alternatives.
pub fn completion_logprobs(logprobs: Option<i64>) -> Result<Option<u32>, ApiError> {
    match logprobs {
        None => Ok(None),
        Some(n) if (0..=MAX_LOGPROBS).contains(&n) => Ok(Some(n as u32)),
        Some(n) => Err(ApiError::invalid(format!("logprobs must be in [0, {MAX_LOGPROBS}], got {n}."), "logprobs")),
    }
}

/// Chat `logprobs` (bool) + `top_logprobs` (0..=20) → number of top alternatives.
pub fn chat_logprobs(logprobs: Option<bool>, top_logprobs: Option<i64>) -> Result<Option<u32>, ApiError> {
    if let Some(t) = top_logprobs {
        if !(0..=MAX_LOGPROBS).contains(&t) {
            return Err(ApiError::invalid(
                format!("top_logprobs must be in [0, {MAX_LOGPROBS}], got {t}."),
                "top_logprobs",
            ));
        }
        if t > 0 && logprobs != Some(true) {
            return Err(ApiError::invalid(
                "when using `top_logprobs`, `logprobs` must be set to true.",
                "top_logprobs",
            ));
        }
    }
    Ok(if logprobs == Some(true) { Some(top_logprobs.unwrap_or(0) as u32) } else { None })
}

/// Which API a body was sent to, for [`check_unhonoured`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
    Responses,
}

/// Fields, not named by our request types, that OpenAI or vLLM define and that would change
/// the answer, with the values that leave it unchanged (accepted). Anything here with any
/// other value is refused with a 400 naming it: answering as if it were honoured would hand
/// the client something else than it asked for (a JSON request getting markdown back).
/// docs/CONFIG.md ("OpenAI API coverage") lists every field and what the server does with it.
fn unhonoured_value(endpoint: Endpoint, field: &str, value: &Value) -> Option<bool> {
    let null = value.is_null();
    let falsy = null || *value == Value::Bool(false);
    let empty = null || value.as_array().is_some_and(Vec::is_empty) || value.as_object().is_some_and(|o| o.is_empty());
    let zero = null || value.as_f64() == Some(0.0);
    let common = match field {
        // Structured outputs and tool calling (vLLM's guided decoding included).
        "tools" | "functions" => Some(!empty),
        "tool_choice" | "function_call" => Some(!(null || value == "none" || value == "auto")),
        // Structured outputs on completions and chat: `crate::structured` (D53).
        "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar" | "structured_outputs"
        | "guided_json_object"
            if endpoint != Endpoint::Responses =>
        {
            None
        }
        // one backend (llguidance): naming one changes nothing
        "guided_decoding_backend" if endpoint != Endpoint::Responses => None,
        "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar" | "structured_outputs" => Some(!null),
        "guided_decoding_backend" | "guided_whitespace_pattern" | "guided_json_object" => Some(!falsy),
        // vLLM's sampling extras the engine does not apply.
        // honoured on chat and completions ([`sampling_extras`])
        "min_p" | "allowed_token_ids" if endpoint != Endpoint::Responses => None,
        "min_p" => Some(!zero),
        "length_penalty" => Some(!(null || value.as_f64() == Some(1.0))),
        "bad_words" | "truncate_prompt_tokens" if endpoint != Endpoint::Responses => None,
        "allowed_token_ids" | "bad_words" | "logits_processors" => Some(!empty),
        "prompt_logprobs" | "truncate_prompt_tokens" => Some(!null),
        "skip_special_tokens" | "spaces_between_special_tokens" => Some(!(null || *value == Value::Bool(true))),
        "return_tokens_as_token_ids" | "return_token_ids" => Some(!falsy),
        "priority" => Some(!zero),
        _ => None,
    };
    if common.is_some() {
        return common;
    }
    match endpoint {
        Endpoint::Completions | Endpoint::Chat => match field {
            // honoured (`crate::structured`, D53)
            "response_format" => None,
            _ => match (endpoint, field) {
                (Endpoint::Chat, "audio" | "prediction" | "web_search_options" | "chat_template" | "documents") => {
                    Some(!null)
                }
                (Endpoint::Chat, "modalities") => {
                    Some(!(null || value.as_array().is_some_and(|m| m.iter().all(|x| x == "text"))))
                }
                (Endpoint::Chat, "reasoning_effort") => Some(!null),
                (Endpoint::Chat, "chat_template_kwargs" | "mm_processor_kwargs") => Some(!empty),
                (Endpoint::Chat, "add_generation_prompt") => Some(!(null || *value == Value::Bool(true))),
                (Endpoint::Chat, "continue_final_message") => Some(!falsy),
                // vLLM's chat `echo` (prepend the last message); completions honour theirs
                (Endpoint::Chat, "echo") => Some(!falsy),
                _ => None,
            },
        },
        Endpoint::Responses => match field {
            // `text.format` other than plain text is structured output.
            "text" => Some(
                !(null
                    || value
                        .get("format")
                        .is_none_or(|f| f.is_null() || f.get("type").and_then(Value::as_str) == Some("text"))),
            ),
            "reasoning" | "prompt" | "conversation" | "max_tool_calls" => Some(!null),
            "include" => Some(!empty),
            "background" => Some(!falsy),
            "truncation" => Some(!(null || value == "disabled")),
            // Sampling fields /v1/responses does not apply (chat and completions do).
            "n" => Some(!(null || value.as_i64() == Some(1))),
            "top_k" | "seed" | "stop" | "stop_token_ids" | "logit_bias" | "top_logprobs" | "logprobs"
            | "presence_penalty" | "frequency_penalty" | "repetition_penalty" | "min_tokens" | "ignore_eos" => {
                Some(!null)
            }
            _ => None,
        },
    }
}

/// Refuse (400, `param` = the field) the first field of `extra` that OpenAI or vLLM define
/// with an effect this server does not honour (see [`unhonoured_value`]). Harmless metadata
/// (`user`, `metadata`, `store` on chat, `service_tier`, ...) and fields unknown to both are
/// left alone, as vLLM does.
pub fn check_unhonoured(endpoint: Endpoint, extra: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    for (field, value) in extra {
        if unhonoured_value(endpoint, field, value) == Some(true) {
            let hint = match field.as_str() {
                "text" | "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar" | "structured_outputs" => {
                    " Structured outputs are served on /v1/chat/completions and /v1/completions."
                }
                "tools" | "tool_choice" => " Tool calling is served on /v1/chat/completions.",
                "functions" | "function_call" => " Use `tools` and `tool_choice`.",
                _ => "",
            };
            return Err(ApiError::invalid(format!("`{field}` is not supported by this server.{hint}"), field));
        }
    }
    Ok(())
}

/// Validate the shared sampling fields. `vocab_size` bounds stop token ids. Each field is
/// checked in vLLM's order (the first refusal names its field), a group of them a function.
pub fn validate_params(input: &SamplingInput<'_>, vocab_size: u32) -> Result<ValidatedParams, ApiError> {
    let n = choices(input.n)?;
    let (temperature, top_p, top_k) = sampling_knobs(input)?;
    let requested_max_tokens = requested_max_tokens(input)?;
    let (presence_penalty, frequency_penalty, repetition_penalty) = penalties(input)?;
    let logit_bias = match input.logit_bias {
        None => Vec::new(),
        Some(map) => logit_bias(map, vocab_size)?,
    };
    let min_tokens = min_tokens(input, requested_max_tokens)?;
    let (stream, include_usage) = stream_settings(input)?;
    let stop = stop_strings(input.stop)?;
    let stop_token_ids = match input.stop_token_ids {
        None => Vec::new(),
        Some(ids) => token_ids(ids, vocab_size, "stop_token_ids")?,
    };
    let kv_transfer_params = kv_transfer_params(input.kv_transfer_params)?;
    Ok(ValidatedParams {
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            // Any 64-bit integer is a valid seed; negative ones keep their bits.
            seed: input.seed.map(|s| s as u64),
            max_tokens: requested_max_tokens.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS),
            stop_token_ids,
            ignore_eos: input.ignore_eos.unwrap_or(false),
            logprobs: input.logprobs,
            // set by the handler from the request's structured-output fields (D53)
            guided: None,
            output_index_offset: 0,
            logit_bias,
            // set by the handler from the request's vLLM extras ([`sampling_extras`])
            min_p: 0.0,
            allowed_token_ids: Vec::new(),
            presence_penalty: presence_penalty as f32,
            frequency_penalty: frequency_penalty as f32,
            repetition_penalty: repetition_penalty as f32,
            min_tokens,
            // set by the handler from `bad_words` ([`sampling_extras`])
            bad_words_token_ids: Vec::new(),
        },
        requested_max_tokens,
        stop,
        include_stop_str_in_output: input.include_stop_str_in_output.unwrap_or(false),
        stream,
        include_usage,
        n,
        kv_transfer_params,
        tools: None,
        echo: None,
    })
    .and_then(one_choice_per_prefill)
}

/// `temperature` in [0, 2], `top_p` in (0, 1], `top_k` -1/0 (off) or at least 1.
fn sampling_knobs(input: &SamplingInput<'_>) -> Result<(f64, f64, u32), ApiError> {
    let temperature = input.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(format!("temperature must be in [0, 2], got {temperature}."), "temperature"));
    }
    let top_p = input.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(format!("top_p must be in (0, 1], got {top_p}."), "top_p"));
    }
    let top_k = match input.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k >= 1 => u32::try_from(k).unwrap_or(u32::MAX),
        k => {
            return Err(ApiError::invalid(format!("top_k must be -1 or 0 (disable), or at least 1, got {k}."), "top_k"))
        }
    };
    Ok((temperature, top_p, top_k))
}

/// The `max_tokens` the client asked for (named by the field it came from), at least 1.
fn requested_max_tokens(input: &SamplingInput<'_>) -> Result<Option<u32>, ApiError> {
    match input.max_tokens {
        None => Ok(None),
        Some(m) if m >= 1 => Ok(Some(u32::try_from(m).unwrap_or(u32::MAX))),
        Some(m) => {
            let p = input.max_tokens_param;
            Err(ApiError::invalid(format!("{p} must be at least 1, got {m}."), p))
        }
    }
}

/// Presence, frequency and repetition penalties within vLLM's bounds: OpenAI's [-2, 2] for the
/// first two, any finite positive repetition penalty.
fn penalties(input: &SamplingInput<'_>) -> Result<(f64, f64, f64), ApiError> {
    let presence_penalty = input.presence_penalty.unwrap_or(0.0);
    if !(-2.0..=2.0).contains(&presence_penalty) {
        return Err(ApiError::invalid(
            format!("presence_penalty must be in [-2, 2], got {presence_penalty}."),
            "presence_penalty",
        ));
    }
    let frequency_penalty = input.frequency_penalty.unwrap_or(0.0);
    if !(-2.0..=2.0).contains(&frequency_penalty) {
        return Err(ApiError::invalid(
            format!("frequency_penalty must be in [-2, 2], got {frequency_penalty}."),
            "frequency_penalty",
        ));
    }
    let repetition_penalty = input.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty.is_finite()) {
        return Err(ApiError::invalid(
            format!("repetition_penalty must be a finite number greater than zero, got {repetition_penalty}."),
            "repetition_penalty",
        ));
    }
    Ok((presence_penalty, frequency_penalty, repetition_penalty))
}

/// `min_tokens`, at least 0 and at most the requested `max_tokens`.
fn min_tokens(input: &SamplingInput<'_>, requested_max_tokens: Option<u32>) -> Result<u32, ApiError> {
    let min_tokens = match input.min_tokens.unwrap_or(0) {
        m if m < 0 => {
            return Err(ApiError::invalid(format!("min_tokens must be at least 0, got {m}."), "min_tokens"));
        }
        m => u32::try_from(m).unwrap_or(u32::MAX),
    };
    if let Some(max) = requested_max_tokens.filter(|&max| min_tokens > max) {
        return Err(ApiError::invalid(
            format!("min_tokens must be less than or equal to {} ({max}), got {min_tokens}.", input.max_tokens_param),
            "min_tokens",
        ));
    }
    Ok(min_tokens)
}

/// `stream` and `stream_options.include_usage` (options only with a stream; continuous usage
/// is not served).
fn stream_settings(input: &SamplingInput<'_>) -> Result<(bool, bool), ApiError> {
    let stream = input.stream.unwrap_or(false);
    if input.stream_options.is_some() && !stream {
        return Err(ApiError::invalid("Stream options can only be defined when `stream=True`.", "stream_options"));
    }
    if input.stream_options.and_then(|o| o.continuous_usage_stats) == Some(true) {
        return Err(ApiError::invalid(
            "`stream_options.continuous_usage_stats` is not supported by this server; use `include_usage`.",
            "stream_options.continuous_usage_stats",
        ));
    }
    Ok((stream, input.stream_options.and_then(|o| o.include_usage).unwrap_or(false)))
}

/// OpenAI `logit_bias`: token id (a decimal string) → bias in [-100, 100], ids below the
/// vocabulary size; sorted by id.
fn logit_bias(map: &serde_json::Map<String, Value>, vocab_size: u32) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let id = key.parse::<u32>().ok().filter(|&id| id < vocab_size).ok_or_else(|| {
            ApiError::invalid(
                format!("logit_bias keys must be token ids below {vocab_size}, got {key:?}."),
                "logit_bias",
            )
        })?;
        let bias = value.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            ApiError::invalid(
                format!("logit_bias values must be numbers in [-100, 100], got {value} for {key}."),
                "logit_bias",
            )
        })?;
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

/// vLLM's sampling extras chat and completions honour, from the request's other fields:
/// `min_p` in [0, 1], `allowed_token_ids` (ids below the vocabulary size; empty = off) and
/// `bad_words` (strings, tokenised with `codec` as vLLM does: [`bad_words_token_ids`]).
pub fn sampling_extras(
    extra: &serde_json::Map<String, Value>,
    vocab_size: u32,
    codec: &dyn TextCodec,
    sampling: &mut SamplingParams,
) -> Result<(), ApiError> {
    if let Some(v) = extra.get("bad_words").filter(|v| !v.is_null()) {
        let words: Vec<String> = serde_json::from_value(v.clone())
            .map_err(|_| ApiError::invalid("bad_words must be a list of strings.", "bad_words"))?;
        if words.len() > MAX_BAD_WORDS {
            return Err(ApiError::invalid(
                format!("bad_words may hold at most {MAX_BAD_WORDS} words, got {}.", words.len()),
                "bad_words",
            ));
        }
        sampling.bad_words_token_ids = bad_words_token_ids(&words, codec)?;
    }
    if let Some(v) = extra.get("min_p").filter(|v| !v.is_null()) {
        let min_p = v
            .as_f64()
            .filter(|p| (0.0..=1.0).contains(p))
            .ok_or_else(|| ApiError::invalid(format!("min_p must be in [0, 1], got {v}."), "min_p"))?;
        sampling.min_p = min_p as f32;
    }
    if let Some(v) = extra.get("allowed_token_ids").filter(|v| !v.is_null()) {
        let ids = v
            .as_array()
            .ok_or_else(|| ApiError::invalid("allowed_token_ids must be a list of token ids.", "allowed_token_ids"))?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let ok = id.as_u64().and_then(|i| u32::try_from(i).ok()).filter(|&i| i < vocab_size);
            out.push(ok.ok_or_else(|| {
                ApiError::invalid(
                    format!("allowed_token_ids must be token ids below {vocab_size}, got {id}."),
                    "allowed_token_ids",
                )
            })?);
        }
        sampling.allowed_token_ids = out;
    }
    Ok(())
}

/// Words one request's `bad_words` may hold (each costs the sampler a suffix check per step).
pub const MAX_BAD_WORDS: usize = 1024;

/// vLLM's tokenisation of `bad_words`: each word (leading whitespace stripped) as it is, and
/// with one leading space when that gives a different first token and as many tokens (the
/// word in the middle of a sentence). Longer than the context, a word could never appear.
pub fn bad_words_token_ids(words: &[String], codec: &dyn TextCodec) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |text: &str| {
        codec
            .encode(text)
            .map_err(|e| ApiError::invalid(format!("bad_words: cannot tokenise {text:?}: {e}"), "bad_words"))
    };
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(words.len() * 2);
    for word in words {
        let bare = encode(word.trim_start())?;
        let Some(&first) = bare.first() else { continue };
        let spaced = encode(&format!(" {}", word.trim_start()))?;
        let len = bare.len();
        out.push(bare);
        if spaced.first() != Some(&first) && spaced.len() == len {
            out.push(spaced);
        }
    }
    Ok(out)
}

/// vLLM's `truncate_prompt_tokens`: keep only the prompt's last `k` tokens (`-1`: the last
/// `max_model_len`); applied before the context check, after chat rendering.
pub fn truncate_prompt(
    extra: &serde_json::Map<String, Value>,
    prompt: &mut Vec<u32>,
    max_model_len: u32,
) -> Result<(), ApiError> {
    let Some(v) = extra.get("truncate_prompt_tokens").filter(|v| !v.is_null()) else { return Ok(()) };
    let bad = || {
        ApiError::invalid(
            format!(
                "truncate_prompt_tokens must be -1 or an integer from 1 to max_model_len ({max_model_len}), got {v}."
            ),
            "truncate_prompt_tokens",
        )
    };
    let keep = match v.as_i64().ok_or_else(bad)? {
        -1 => max_model_len,
        k if k >= 1 && k <= i64::from(max_model_len) => k as u32,
        _ => return Err(bad()),
    } as usize;
    if prompt.len() > keep {
        prompt.drain(..prompt.len() - keep);
    }
    Ok(())
}

/// The most choices one request may ask for: each is an engine request, so `n` is bounded
/// like any other fan-out a client could otherwise make unbounded.
pub const MAX_N: u32 = 64;

/// `n`: 1 when absent, else 1..=[`MAX_N`].
fn choices(n: Option<i64>) -> Result<u32, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=i64::from(MAX_N)).contains(&n) => Ok(n as u32),
        Some(n) => Err(ApiError::invalid(format!("n must be in 1..={MAX_N}, got {n}."), "n")),
    }
}

/// A prefill for a remote decoder (`do_remote_decode`) is one request whose blocks P holds for
/// one reader; the router sends P `n = 1` and D the client's `n` (D58).
fn one_choice_per_prefill(params: ValidatedParams) -> Result<ValidatedParams, ApiError> {
    let remote_decode = params.kv_transfer_params.as_ref().is_some_and(KvTransferParams::wants_remote_decode);
    if params.n > 1 && remote_decode {
        return Err(ApiError::invalid(
            "n must be 1 on a prefill for a remote decoder (kv_transfer_params.do_remote_decode); the decode leg takes n.",
            "n",
        ));
    }
    Ok(params)
}

/// `best_of` as vLLM V1 takes it: vLLM V1 no longer ranks candidates, so `best_of` is accepted
/// only where it changes nothing (absent, or equal to `n`: every candidate is returned), and
/// refused otherwise, as vLLM refuses it (D58).
pub fn check_best_of(best_of: Option<i64>, n: Option<i64>) -> Result<(), ApiError> {
    let n = n.unwrap_or(1);
    match best_of {
        None => Ok(()),
        Some(b) if b == n => Ok(()),
        Some(b) if b < n => Err(ApiError::invalid(format!("best_of must be at least n ({n}), got {b}."), "best_of")),
        Some(b) => Err(ApiError::invalid(
            format!(
                "best_of ({b}) greater than n ({n}) is not supported: candidates are not ranked (as in vLLM V1); \
                 ask for n={b} and rank the choices by their logprobs."
            ),
            "best_of",
        )),
    }
}

/// `stop`: null, a string, or an array of at most [`MAX_STOP_STRINGS`] non-empty strings.
pub fn stop_strings(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match stop {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        // counted before anything is copied (D91)
        Some(Value::Array(items)) if items.len() > MAX_STOP_STRINGS => {
            return Err(ApiError::invalid(
                format!("`stop` may hold at most {MAX_STOP_STRINGS} strings, got {}.", items.len()),
                "stop",
            ))
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(ApiError::invalid("`stop` must be a string or an array of strings.", "stop")),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(ApiError::invalid("`stop` must be a string or an array of strings.", "stop")),
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            format!("`stop` may hold at most {MAX_STOP_STRINGS} strings, got {}.", list.len()),
            "stop",
        ));
    }
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop strings must not be empty.", "stop"));
    }
    if let Some(long) = list.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(ApiError::invalid(
            format!("a stop string may be at most {MAX_STOP_STRING_BYTES} bytes, got {}.", long.len()),
            "stop",
        ));
    }
    Ok(list)
}

/// Token ids in `0..vocab_size`.
pub(crate) fn token_ids(ids: &[i64], vocab_size: u32, param: &str) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&id| match u32::try_from(id) {
            Ok(t) if t < vocab_size => Ok(t),
            _ => Err(ApiError::invalid(
                format!("Token id {id} is out of vocabulary (vocabulary size {vocab_size})."),
                param,
            )),
        })
        .collect()
}

/// `kv_transfer_params`: null or an object of vLLM's fields.
pub fn kv_transfer_params(value: Option<&Value>) -> Result<Option<KvTransferParams>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => serde_json::from_value::<KvTransferParams>(v.clone())
            .map(Some)
            .map_err(|e| ApiError::invalid(format!("invalid kv_transfer_params: {e}"), "kv_transfer_params")),
        Some(_) => Err(ApiError::invalid("kv_transfer_params must be an object.", "kv_transfer_params")),
    }
}

fn text_error(e: TextError) -> ApiError {
    match e {
        TextError::Template(m) => ApiError::Template(format!("chat template error: {m}")),
        e @ TextError::NoChatTemplate => ApiError::invalid(e.to_string(), "messages"),
        TextError::Tokenizer(m) => ApiError::invalid(format!("cannot tokenise the input: {m}"), "prompt"),
    }
}

/// The completions `prompt`: a string, `[string]`, `[ids...]` or `[[ids...]]` → token ids.
/// Batches (several prompts) are refused: one request is one engine request here. Text is
/// encoded as a whole prompt (BOS first when the model asks for it, as vLLM's
/// `add_special_tokens=True`); token ids are taken as they are.
pub fn completion_prompt(prompt: Option<&Value>, codec: &dyn TextCodec, vocab_size: u32) -> Result<Vec<u32>, ApiError> {
    let shape_error =
        || ApiError::invalid("prompt must be a string, an array of one string, or an array of token ids.", "prompt");
    let batch_error = || ApiError::invalid("batched prompts are not supported; send one prompt per request.", "prompt");
    let empty_error = || ApiError::invalid("The prompt cannot be empty.", "prompt");
    let tokens = match prompt {
        None | Some(Value::Null) => return Err(ApiError::invalid("prompt is required.", "prompt")),
        Some(Value::String(s)) => {
            if s.is_empty() {
                return Err(empty_error());
            }
            codec.encode_prompt(s).map_err(text_error)?
        }
        Some(Value::Array(items)) => match items.as_slice() {
            [] => return Err(empty_error()),
            [Value::String(s)] => {
                if s.is_empty() {
                    return Err(empty_error());
                }
                codec.encode_prompt(s).map_err(text_error)?
            }
            [Value::Array(inner)] => ids_of(inner, vocab_size).ok_or_else(shape_error)??,
            items if items.iter().all(Value::is_number) => ids_of(items, vocab_size).ok_or_else(shape_error)??,
            items if items.iter().all(|v| v.is_string() || v.is_array()) => return Err(batch_error()),
            _ => return Err(shape_error()),
        },
        Some(_) => return Err(shape_error()),
    };
    if tokens.is_empty() {
        return Err(empty_error());
    }
    Ok(tokens)
}

/// Token ids from JSON numbers: `None` if one is not an integer, `Some(Err)` if one is out
/// of the vocabulary.
fn ids_of(items: &[Value], vocab_size: u32) -> Option<Result<Vec<u32>, ApiError>> {
    let ids: Option<Vec<i64>> = items.iter().map(Value::as_i64).collect();
    ids.map(|ids| token_ids(&ids, vocab_size, "prompt"))
}

/// Chat messages → the codec's messages. Content may be a string, null, or an array of text
/// parts (joined with newlines, as vLLM does); other part types are refused.
///
/// Tool calls in the history: with `template_tools` (the template renders tools itself, see
/// [`TextCodec::template_renders_tools`]) they are handed to the template as `tool_calls`, each
/// call's `arguments` parsed to a JSON object as vLLM does, and a tool result keeps its
/// `tool_call_id`; otherwise they are written into the content the way the model is told to
/// write calls, tool results wrapped as Hermes templates show them (D54).
pub fn chat_messages(messages: &[ChatMessageIn], template_tools: bool) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty.", "messages"));
    }
    messages
        .iter()
        .map(|m| {
            let content = match &m.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let texts = parts
                        .iter()
                        .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => Ok(t),
                            (Some(other), _) if other != "text" => Err(ApiError::invalid(
                                format!("only text content parts are supported, got `{other}`."),
                                "messages",
                            )),
                            _ => Err(ApiError::invalid(
                                "a content part must be {\"type\": \"text\", \"text\": \"...\"}.",
                                "messages",
                            )),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    texts.join("\n")
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        "message content must be a string or an array of text parts.",
                        "messages",
                    ))
                }
            };
            let calls = m.tool_calls.as_ref().filter(|c| !c.is_empty());
            if template_tools {
                return Ok(ChatMessage {
                    role: m.role.clone(),
                    content,
                    tool_calls: calls.map(|c| crate::tools::template_tool_calls(c)).transpose()?,
                    tool_call_id: m.tool_call_id.clone(),
                    name: m.name.clone(),
                });
            }
            let content = match (calls, m.role.as_str()) {
                (Some(calls), _) => {
                    let calls = crate::tools::render_tool_calls(calls)?;
                    if content.is_empty() {
                        calls
                    } else {
                        format!("{content}\n{calls}")
                    }
                }
                (_, "tool") => crate::tools::render_tool_result(&content),
                _ => content,
            };
            Ok(ChatMessage::text(m.role.clone(), content))
        })
        .collect()
}

/// Render chat messages with the model's template and encode them as a prompt (a template
/// error is the client's: 400). `tools` go to the template's `tools` variable.
pub fn render_chat(
    codec: &dyn TextCodec,
    messages: &[ChatMessage],
    tools: Option<&[Value]>,
    vocab_size: u32,
) -> Result<Vec<u32>, ApiError> {
    let text = codec.render_chat_with_tools(messages, tools).map_err(text_error)?;
    let tokens = codec.encode_prompt(&text).map_err(text_error)?;
    if tokens.is_empty() {
        return Err(ApiError::invalid("The rendered prompt is empty.", "messages"));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t >= vocab_size) {
        return Err(ApiError::Internal(format!("the tokenizer produced token id {bad} outside the vocabulary")));
    }
    Ok(tokens)
}

/// What `max_tokens` means when the client gives none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxTokensDefault {
    /// Completions: 16.
    Fixed(u32),
    /// Chat: whatever the context leaves after the prompt (vLLM).
    RestOfContext,
}

/// Settle `max_tokens` against the context: 400 (vLLM's wording) when the prompt alone fills
/// it, or prompt + completion exceed it. `prompt_param` is `"prompt"` or `"messages"`.
pub fn resolve_max_tokens(
    prompt_len: u32,
    requested: Option<u32>,
    default: MaxTokensDefault,
    max_model_len: u32,
    prompt_param: &'static str,
) -> Result<u32, ApiError> {
    if prompt_len >= max_model_len {
        return Err(ApiError::ContextLength {
            message: format!(
                "This model's maximum context length is {max_model_len} tokens. However, your request has \
                 {prompt_len} input tokens. Please reduce the length of the input {prompt_param}."
            ),
            param: prompt_param,
        });
    }
    let max_tokens = match (requested, default) {
        (Some(m), _) => m,
        (None, MaxTokensDefault::Fixed(m)) => m,
        (None, MaxTokensDefault::RestOfContext) => max_model_len - prompt_len,
    };
    let total = u64::from(prompt_len) + u64::from(max_tokens);
    if total > u64::from(max_model_len) {
        return Err(ApiError::ContextLength {
            message: format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested \
                 {total} tokens ({prompt_len} in the messages, {max_tokens} in the completion). Please reduce \
                 the length of the messages or completion."
            ),
            param: "max_tokens",
        });
    }
    Ok(max_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_synthetic_executor::SyntheticTextCodec;
    use serde_json::json;

    const VOCAB: u32 = 257;

    /// Every refusal is a 400 `invalid_request_error` naming `param`.
    fn assert_400(r: Result<impl std::fmt::Debug, ApiError>, param: &str) {
        let e = r.expect_err("must be refused");
        assert_eq!(e.status().as_u16(), 400, "{e:?}");
        let body = serde_json::to_value(e.body()).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(body["error"]["param"], param, "{body}");
        assert_eq!(body["error"]["code"], 400);
        assert!(!body["error"]["message"].as_str().unwrap().is_empty());
    }

    fn base() -> SamplingInput<'static> {
        SamplingInput { max_tokens_param: "max_tokens", ..Default::default() }
    }

    #[test]
    fn defaults_are_openai_defaults() {
        let p = validate_params(&base(), VOCAB).unwrap();
        assert_eq!(p.sampling.temperature, 1.0);
        assert_eq!(p.sampling.top_p, 1.0);
        assert_eq!(p.sampling.top_k, 0);
        assert_eq!(p.sampling.max_tokens, 16);
        assert!(p.stop.is_empty() && !p.stream && !p.include_usage && p.kv_transfer_params.is_none());
    }

    #[test]
    fn bad_sampling_params_are_400_naming_the_field() {
        assert_400(validate_params(&SamplingInput { temperature: Some(-0.1), ..base() }, VOCAB), "temperature");
        assert_400(validate_params(&SamplingInput { temperature: Some(2.5), ..base() }, VOCAB), "temperature");
        assert_400(validate_params(&SamplingInput { top_p: Some(0.0), ..base() }, VOCAB), "top_p");
        assert_400(validate_params(&SamplingInput { top_p: Some(1.5), ..base() }, VOCAB), "top_p");
        assert_400(validate_params(&SamplingInput { top_k: Some(-2), ..base() }, VOCAB), "top_k");
        assert_400(validate_params(&SamplingInput { max_tokens: Some(0), ..base() }, VOCAB), "max_tokens");
        assert_400(
            validate_params(
                &SamplingInput { max_tokens: Some(-1), max_tokens_param: "max_completion_tokens", ..base() },
                VOCAB,
            ),
            "max_completion_tokens",
        );
        assert_400(validate_params(&SamplingInput { n: Some(0), ..base() }, VOCAB), "n");
        assert_400(validate_params(&SamplingInput { n: Some(i64::from(MAX_N) + 1), ..base() }, VOCAB), "n");
        assert_eq!(validate_params(&SamplingInput { n: Some(3), ..base() }, VOCAB).unwrap().n, 3);
        let prefill = json!({"do_remote_decode": true});
        assert_400(
            validate_params(&SamplingInput { n: Some(2), kv_transfer_params: Some(&prefill), ..base() }, VOCAB),
            "n",
        );
        assert!(check_best_of(None, Some(3)).is_ok() && check_best_of(Some(3), Some(3)).is_ok());
        assert!(check_best_of(Some(1), None).is_ok());
        assert_400(check_best_of(Some(4), Some(3)), "best_of");
        assert_400(check_best_of(Some(2), Some(3)), "best_of");
        assert_400(
            validate_params(&SamplingInput { presence_penalty: Some(2.5), ..base() }, VOCAB),
            "presence_penalty",
        );
        assert_400(
            validate_params(&SamplingInput { frequency_penalty: Some(-2.5), ..base() }, VOCAB),
            "frequency_penalty",
        );
        for bad in [0.0, -1.0, f64::INFINITY, f64::NAN] {
            assert_400(
                validate_params(&SamplingInput { repetition_penalty: Some(bad), ..base() }, VOCAB),
                "repetition_penalty",
            );
        }
        assert_400(validate_params(&SamplingInput { min_tokens: Some(-1), ..base() }, VOCAB), "min_tokens");
        assert_400(
            validate_params(&SamplingInput { min_tokens: Some(6), max_tokens: Some(5), ..base() }, VOCAB),
            "min_tokens",
        );
        let p = validate_params(
            &SamplingInput {
                presence_penalty: Some(0.5),
                frequency_penalty: Some(-0.5),
                repetition_penalty: Some(1.5),
                min_tokens: Some(5),
                max_tokens: Some(5),
                ..base()
            },
            VOCAB,
        )
        .unwrap();
        assert_eq!(
            (
                p.sampling.presence_penalty,
                p.sampling.frequency_penalty,
                p.sampling.repetition_penalty,
                p.sampling.min_tokens
            ),
            (0.5, -0.5, 1.5, 5)
        );
        let sids = [5i64, 300];
        assert_400(validate_params(&SamplingInput { stop_token_ids: Some(&sids), ..base() }, VOCAB), "stop_token_ids");
        let opts = StreamOptions { include_usage: Some(true), ..Default::default() };
        assert_400(validate_params(&SamplingInput { stream_options: Some(&opts), ..base() }, VOCAB), "stream_options");
        let kv = json!("nope");
        assert_400(
            validate_params(&SamplingInput { kv_transfer_params: Some(&kv), ..base() }, VOCAB),
            "kv_transfer_params",
        );
        let kv = json!({"remote_port": "high"});
        assert_400(
            validate_params(&SamplingInput { kv_transfer_params: Some(&kv), ..base() }, VOCAB),
            "kv_transfer_params",
        );
    }

    #[test]
    fn bad_words_are_tokenised_as_vllm_does_and_truncation_keeps_the_tail() {
        let codec = SyntheticTextCodec;
        // the synthetic codec is one byte a token: " ab" has another first token but one
        // token more than "ab", so only the bare words are kept (leading space stripped)
        let ids = bad_words_token_ids(&["ab".into(), "  c".into(), "".into()], &codec).unwrap();
        assert_eq!(ids, vec![vec![97, 98], vec![99]]);
        let mut extra = serde_json::Map::new();
        extra.insert("bad_words".into(), json!("x"));
        let mut sampling = SamplingParams::default();
        assert_400(sampling_extras(&extra, VOCAB, &codec, &mut sampling), "bad_words");
        extra.insert("bad_words".into(), json!(vec!["w"; MAX_BAD_WORDS + 1]));
        assert_400(sampling_extras(&extra, VOCAB, &codec, &mut sampling), "bad_words");

        let mut prompt: Vec<u32> = (0..10).collect();
        let mut extra = serde_json::Map::new();
        extra.insert("truncate_prompt_tokens".into(), json!(4));
        truncate_prompt(&extra, &mut prompt, 64).unwrap();
        assert_eq!(prompt, vec![6, 7, 8, 9]);
        extra.insert("truncate_prompt_tokens".into(), json!(-1));
        let mut long: Vec<u32> = (0..100).collect();
        truncate_prompt(&extra, &mut long, 64).unwrap();
        assert_eq!((long.len(), long[0]), (64, 36));
        for bad in [json!(0), json!(-2), json!(65), json!("4")] {
            extra.insert("truncate_prompt_tokens".into(), bad);
            assert_400(truncate_prompt(&extra, &mut prompt, 64), "truncate_prompt_tokens");
        }
    }

    #[test]
    fn good_params_map_to_the_engine() {
        let stop = json!(["\n", "END"]);
        let sids = [7i64];
        let kv = json!({"do_remote_prefill": true, "remote_block_ids": [1, 2], "remote_engine_id": null});
        let opts = StreamOptions { include_usage: Some(true), ..Default::default() };
        let p = validate_params(
            &SamplingInput {
                max_tokens: Some(5),
                temperature: Some(0.0),
                top_p: Some(0.5),
                top_k: Some(-1),
                seed: Some(-1),
                stop: Some(&stop),
                stop_token_ids: Some(&sids),
                ignore_eos: Some(true),
                logprobs: Some(3),
                stream: Some(true),
                stream_options: Some(&opts),
                kv_transfer_params: Some(&kv),
                ..base()
            },
            VOCAB,
        )
        .unwrap();
        assert_eq!(p.sampling.max_tokens, 5);
        assert_eq!(p.sampling.temperature, 0.0);
        assert_eq!(p.sampling.top_k, 0);
        assert_eq!(p.sampling.seed, Some(u64::MAX));
        assert_eq!(p.sampling.stop_token_ids, vec![7]);
        assert!(p.sampling.ignore_eos);
        assert_eq!(p.sampling.logprobs, Some(3));
        assert_eq!(p.stop, vec!["\n".to_string(), "END".to_string()]);
        assert!(p.stream && p.include_usage);
        assert!(p.wants_remote_prefill());
        assert_eq!(p.kv_transfer_params.unwrap().remote_block_ids, Some(vec![1, 2]));
    }

    #[test]
    fn stop_shapes() {
        assert_eq!(stop_strings(Some(&json!("x"))).unwrap(), vec!["x".to_string()]);
        assert!(stop_strings(Some(&Value::Null)).unwrap().is_empty());
        assert_400(stop_strings(Some(&json!(["a", "b", "c", "d", "e"]))), "stop");
        assert_400(stop_strings(Some(&json!([""]))), "stop");
        assert_400(stop_strings(Some(&json!([1]))), "stop");
        assert_400(stop_strings(Some(&json!(3))), "stop");
    }

    #[test]
    fn logprobs_ranges() {
        assert_eq!(completion_logprobs(Some(0)).unwrap(), Some(0));
        assert_eq!(completion_logprobs(Some(20)).unwrap(), Some(20));
        assert_400(completion_logprobs(Some(21)), "logprobs");
        assert_400(completion_logprobs(Some(-1)), "logprobs");
        assert_eq!(chat_logprobs(Some(true), None).unwrap(), Some(0));
        assert_eq!(chat_logprobs(Some(true), Some(5)).unwrap(), Some(5));
        assert_eq!(chat_logprobs(Some(false), None).unwrap(), None);
        assert_400(chat_logprobs(Some(true), Some(21)), "top_logprobs");
        assert_400(chat_logprobs(None, Some(2)), "top_logprobs");
    }

    #[test]
    fn model_check() {
        assert!(check_model(None, "m").is_ok());
        assert!(check_model(Some(""), "m").is_ok());
        assert!(check_model(Some("m"), "m").is_ok());
        let e = check_model(Some("other"), "m").unwrap_err();
        assert_eq!(e.status().as_u16(), 404);
        assert_eq!(e.error_type(), "NotFoundError");
    }

    #[test]
    fn prompt_shapes() {
        let c = SyntheticTextCodec;
        assert_eq!(completion_prompt(Some(&json!("hi")), &c, VOCAB).unwrap(), vec![104, 105]);
        assert_eq!(completion_prompt(Some(&json!(["hi"])), &c, VOCAB).unwrap(), vec![104, 105]);
        assert_eq!(completion_prompt(Some(&json!([1, 2, 3])), &c, VOCAB).unwrap(), vec![1, 2, 3]);
        assert_eq!(completion_prompt(Some(&json!([[1, 2]])), &c, VOCAB).unwrap(), vec![1, 2]);
        assert_400(completion_prompt(Some(&json!("")), &c, VOCAB), "prompt");
        assert_400(completion_prompt(Some(&json!([])), &c, VOCAB), "prompt");
        assert_400(completion_prompt(Some(&json!([""])), &c, VOCAB), "prompt");
        assert_400(completion_prompt(None, &c, VOCAB), "prompt");
        assert_400(completion_prompt(Some(&json!(["a", "b"])), &c, VOCAB), "prompt");
        assert_400(completion_prompt(Some(&json!([[1], [2]])), &c, VOCAB), "prompt");
        assert_400(completion_prompt(Some(&json!([1, 257])), &c, VOCAB), "prompt");
        assert_400(completion_prompt(Some(&json!([1, -1])), &c, VOCAB), "prompt");
        assert_400(completion_prompt(Some(&json!([1.5])), &c, VOCAB), "prompt");
        assert_400(completion_prompt(Some(&json!({"a": 1})), &c, VOCAB), "prompt");
        assert_400(completion_prompt(Some(&json!([1, "a"])), &c, VOCAB), "prompt");
    }

    #[test]
    fn chat_content_shapes() {
        let msg = |content: Value| ChatMessageIn { role: "user".into(), content: Some(content), ..Default::default() };
        let m = chat_messages(&[msg(json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]))], false)
            .unwrap();
        assert_eq!(m[0].content, "a\nb");
        let m =
            chat_messages(&[ChatMessageIn { role: "assistant".into(), content: None, ..Default::default() }], false)
                .unwrap();
        assert_eq!(m[0].content, "");
        assert_400(chat_messages(&[], false), "messages");
        assert_400(chat_messages(&[msg(json!([{"type": "image_url", "image_url": {}}]))], false), "messages");
        assert_400(chat_messages(&[msg(json!([{"text": "no type"}]))], false), "messages");
        assert_400(chat_messages(&[msg(json!(5))], false), "messages");
        // a template error is a 400 invalid_request_error
        let c = SyntheticTextCodec;
        let bad = [ChatMessage::text("wizard", "x")];
        let e = render_chat(&c, &bad, None, VOCAB).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        assert_eq!(e.error_type(), "invalid_request_error");
    }

    #[test]
    fn context_length() {
        use MaxTokensDefault::*;
        assert_eq!(resolve_max_tokens(10, Some(5), Fixed(16), 100, "prompt").unwrap(), 5);
        assert_eq!(resolve_max_tokens(10, None, Fixed(16), 100, "prompt").unwrap(), 16);
        assert_eq!(resolve_max_tokens(10, None, RestOfContext, 100, "messages").unwrap(), 90);
        assert_eq!(resolve_max_tokens(10, Some(90), Fixed(16), 100, "prompt").unwrap(), 90);
        let e = resolve_max_tokens(10, Some(91), Fixed(16), 100, "prompt").unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        assert_eq!(e.param().as_deref(), Some("max_tokens"));
        assert_eq!(
            e.to_string(),
            "This model's maximum context length is 100 tokens. However, you requested 101 tokens \
             (10 in the messages, 91 in the completion). Please reduce the length of the messages or completion."
        );
        let e = resolve_max_tokens(100, Some(1), Fixed(16), 100, "messages").unwrap_err();
        assert_eq!(e.param().as_deref(), Some("messages"));
        assert!(e.to_string().contains("100 input tokens"));
        let e = resolve_max_tokens(120, None, RestOfContext, 100, "prompt").unwrap_err();
        assert_eq!(e.param().as_deref(), Some("prompt"));
        assert!(resolve_max_tokens(1, Some(u32::MAX), Fixed(16), 100, "prompt").is_err());
    }
}

/// vLLM's `use_beam_search`: beam search is not served. With `stream: true` the refusal names
/// streaming, as vLLM's does (one of rule R1's pre-admission rejection paths).
pub fn check_beam_search(use_beam_search: Option<bool>, stream: Option<bool>) -> Result<(), ApiError> {
    if use_beam_search != Some(true) {
        return Ok(());
    }
    if stream == Some(true) {
        return Err(ApiError::invalid("Beam search does not support streaming.", "stream"));
    }
    Err(ApiError::invalid("Beam search is not supported by this server.", "use_beam_search"))
}

#[cfg(test)]
mod beam_search_tests {
    use super::check_beam_search;

    #[test]
    fn beam_search_is_refused_and_names_streaming() {
        assert!(check_beam_search(None, Some(true)).is_ok());
        assert!(check_beam_search(Some(false), Some(true)).is_ok());
        let with_stream = check_beam_search(Some(true), Some(true)).unwrap_err();
        assert!(with_stream.to_string().contains("streaming"), "{with_stream}");
        let without = check_beam_search(Some(true), None).unwrap_err();
        assert!(without.to_string().contains("not supported"), "{without}");
    }
}
