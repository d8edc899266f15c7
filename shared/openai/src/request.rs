//! The request body → what the engine runs: the sampling parameters, the rendered and
//! tokenised prompt, and `max_tokens`, or the refusal naming the field. Pure functions (no I/O,
//! no shared state): the frontends call them before submitting a request, and the router calls
//! them to tokenise a prompt exactly as the node it routes to will (cache-aware routing and
//! rendered chat prompts, D72).

use pdmesh_http_edge::error::ApiError;
use pdmesh_protocol::node_http::{internal, INTERNAL_FIELD};
use serde_json::{Map, Value};

use crate::validation::{
    chat_logprobs, chat_messages, check_model, completion_logprobs, completion_prompt, render_chat, resolve_max_tokens,
    validate_params, MaxTokensDefault, ModelLimits, SamplingInput, ValidatedRequest, DEFAULT_COMPLETION_MAX_TOKENS,
};
use crate::wire::{ChatCompletionRequest, CompletionRequest};

/// The request body → engine parameters, the tokenised prompt, and `max_tokens`; or the
/// refusal. Pure (no I/O, no shared state).
pub fn validate_completion(body: &CompletionRequest, limits: &ModelLimits<'_>) -> Result<ValidatedRequest, ApiError> {
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
    crate::validation::check_beam_search(body.sampling.use_beam_search, body.sampling.stream)?;
    crate::validation::check_best_of(body.best_of, body.sampling.n)?;
    let vocab = limits.vocab_size;
    let input = SamplingInput::from_fields(&body.sampling, completion_logprobs(body.logprobs)?);
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

/// The request body → engine parameters, the rendered and tokenised prompt, and `max_tokens`;
/// or the refusal. Pure (no I/O, no shared state).
pub fn validate_chat(body: &ChatCompletionRequest, limits: &ModelLimits<'_>) -> Result<ValidatedRequest, ApiError> {
    check_model(body.model.as_deref(), &limits.options.served_model_name)?;
    crate::validation::check_unhonoured(crate::validation::Endpoint::Chat, &body.extra)?;
    crate::validation::check_beam_search(body.sampling.use_beam_search, body.sampling.stream)?;
    let vocab = limits.vocab_size;
    // `max_completion_tokens` supersedes the deprecated `max_tokens` (vLLM's precedence).
    let (max_tokens, max_tokens_param) = match body.max_completion_tokens {
        Some(m) => (Some(m), "max_completion_tokens"),
        None => (body.sampling.max_tokens, "max_tokens"),
    };
    let input = SamplingInput {
        max_tokens,
        max_tokens_param,
        ..SamplingInput::from_fields(&body.sampling, chat_logprobs(body.logprobs, body.top_logprobs)?)
    };
    let mut params = validate_params(&input, vocab)?;
    crate::validation::sampling_extras(&body.extra, vocab, limits.codec, &mut params.sampling)?;
    params.sampling.guided = crate::structured::guided_spec(&body.extra)?.map(|(spec, _)| spec);
    // A template that renders `tools` itself (Qwen's, Llama 3's) gets the tools and the
    // history's calls as data; another gets them as text (D54, D88).
    let template_tools = limits.codec.template_renders_tools();
    let mut messages = chat_messages(&body.messages, template_tools)?;
    let mut template_tool_defs = None;
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
        if template_tools {
            template_tool_defs = body.tools.as_deref();
        } else {
            // the tools go into the system message (the template has no tool support of its own)
            match messages.first_mut() {
                Some(first) if first.role == "system" => {
                    first.content = format!("{}\n\n{}", first.content, setup.system_block);
                }
                _ => messages.insert(0, pdmesh_model_api::ChatMessage::text("system", setup.system_block)),
            }
        }
        params.tools = Some(setup.mode);
    }
    let mut prompt = match prompt_token_ids(&body.extra, vocab)? {
        Some(ids) => ids,
        None => render_chat(limits.codec, &messages, template_tool_defs, vocab)?,
    };
    crate::validation::truncate_prompt(&body.extra, &mut prompt, limits.options.max_model_len)?;
    let max_tokens = resolve_max_tokens(
        u32::try_from(prompt.len()).unwrap_or(u32::MAX),
        params.requested_max_tokens,
        MaxTokensDefault::RestOfContext,
        limits.options.max_model_len,
        "messages",
    )?;
    Ok(ValidatedRequest { params, prompt, max_tokens })
}

/// The chat prompt's token ids the router sent in `pdmesh_internal.prompt_token_ids` (D72),
/// checked as a completions prompt of token ids is ([`crate::validation::token_ids`]: every id
/// in the vocabulary). `None` when the body has none (a client's own request): the node renders
/// the messages itself. A client that sends them directly gets what the same ids as a
/// completions prompt would give.
pub fn prompt_token_ids(extra: &Map<String, Value>, vocab_size: u32) -> Result<Option<Vec<u32>>, ApiError> {
    const FIELD: &str = INTERNAL_FIELD;
    let Some(ids) = extra.get(FIELD).and_then(|v| v.get(internal::PROMPT_TOKEN_IDS)) else { return Ok(None) };
    let ids: Vec<i64> = serde_json::from_value(ids.clone())
        .map_err(|e| ApiError::invalid(format!("{FIELD}.prompt_token_ids: {e}"), FIELD))?;
    if ids.is_empty() {
        return Err(ApiError::invalid(format!("{FIELD}.prompt_token_ids is empty"), FIELD));
    }
    crate::validation::token_ids(&ids, vocab_size, FIELD).map(Some)
}

/// Chat over the real tokenizers and templates of the models users bring (pdmesh-model's
/// codec, loaded from `PDMESH_QWEN25_PATH` / `PDMESH_GEMMA3_PATH`, which scripts/test.sh sets;
/// unset, a test says it skips).
#[cfg(test)]
mod model_templates {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: fail loudly

    use pdmesh_model_api::TextCodec;
    use serde_json::json;

    use super::*;
    use crate::tools::{parse, ToolCall, ToolMode};
    use crate::FrontendOptions;

    fn codec(var: &str) -> Option<pdmesh_model::GgufTextCodec> {
        let Some(path) = std::env::var_os(var) else {
            eprintln!("{var} is unset: skipping (scripts/fetch-model.sh fetches the model; scripts/test.sh sets it)");
            return None;
        };
        Some(pdmesh_model::GgufTextCodec::load(&path, &pdmesh_model::ModelOptions::default()).unwrap())
    }

    fn options(codec: &pdmesh_model::GgufTextCodec) -> FrontendOptions {
        FrontendOptions {
            served_model_name: "m".into(),
            max_model_len: codec.max_model_len(),
            vocab_size: codec.vocab_size(),
            eos_token_ids: codec.eos_token_ids().to_vec(),
            rejection_notices: true,
        }
    }

    fn request(body: serde_json::Value) -> ChatCompletionRequest {
        serde_json::from_value(body).unwrap()
    }

    /// A tools request to Qwen: the tools reach Qwen's own template (its `# Tools` block with
    /// the definition), not the Hermes block written for templates without tool support; the
    /// history's call and result render as Qwen's template writes them; and the answer the
    /// template asks for is read back as a call.
    #[test]
    fn qwen_gets_the_tools_through_its_template_and_its_answer_parses() {
        let Some(c) = codec("PDMESH_QWEN25_PATH") else { return };
        let options = options(&c);
        let limits = ModelLimits { options: &options, codec: &c, vocab_size: c.vocab_size() };
        let tool = json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
        let body = request(json!({
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"},
                {"role": "user", "content": "And in Rome?"}
            ],
            "tools": [tool],
        }));
        let v = validate_chat(&body, &limits).unwrap();
        assert_eq!(v.params.tools, Some(ToolMode::Auto));
        let text = c.decode(&v.prompt).unwrap();
        assert!(
            text.contains("# Tools") && text.contains(r#"{"type": "function", "function": {"name": "get_weather""#),
            "{text}"
        );
        assert!(!text.contains("You are a function calling AI model"), "no second tool block: {text}");
        assert!(
            text.contains(
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
            ),
            "{text}"
        );
        assert!(text.contains("<tool_response>\n18C\n</tool_response>"), "{text}");
        assert_eq!(v.prompt[0], 151644, "no BOS before <|im_start|> (Qwen's add_bos_token is false)");

        let answer = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let (content, calls) = parse(&ToolMode::Auto, answer).unwrap();
        assert_eq!(content, None);
        assert_eq!(calls, vec![ToolCall { name: "get_weather".into(), arguments: "{\"city\":\"Rome\"}".into() }]);
    }

    /// Gemma 3 270M's file has no chat template: chat is a 400 naming the fix, completions work
    /// and begin with BOS.
    #[test]
    fn gemma_without_a_template_refuses_chat_by_name_and_completes_with_bos() {
        let Some(c) = codec("PDMESH_GEMMA3_PATH") else { return };
        let options = options(&c);
        let limits = ModelLimits { options: &options, codec: &c, vocab_size: c.vocab_size() };
        let e = validate_chat(&request(json!({"messages": [{"role": "user", "content": "hi"}]})), &limits).unwrap_err();
        assert_eq!(e.status(), actix_web::http::StatusCode::BAD_REQUEST);
        let body = serde_json::to_value(e.body()).unwrap();
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("no chat template") && message.contains("--chat-template"), "{body}");
        assert_eq!(body["error"]["param"], "messages");

        let completion: crate::wire::CompletionRequest =
            serde_json::from_value(json!({"prompt": "Hello world", "max_tokens": 4})).unwrap();
        let v = validate_completion(&completion, &limits).unwrap();
        assert_eq!(v.prompt, vec![2, 9259, 1902]);
    }
}
