//! docs/CONFIG.md's "OpenAI API coverage" table against the validator: every field a row
//! names is sent to every API the row names, with a value that changes the answer, through
//! that endpoint's own validation (`pdmesh_openai::request`, the Responses handler's `validate_request`); it must be refused (a 400 naming it) exactly where
//! the row says "refused". A field the validator starts or stops honouring without the table
//! following fails here, as does a row naming a field no probe below knows.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: fail loudly

use std::collections::BTreeSet;

use pdmesh_synthetic_executor::SyntheticTextCodec;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::responses::ResponseStore;
use crate::validation::ModelLimits;
use crate::FrontendOptions;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Api {
    Completions,
    Chat,
    Responses,
}

const APIS: [Api; 3] = [Api::Completions, Api::Chat, Api::Responses];

/// Fields the table names that a probe cannot exercise on its own (the request itself, or a
/// field whose effect is a handler's, not validation's).
const NOT_PROBED: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "input",
    "instructions",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "kv_transfer_params",
    "previous_response_id",
    "best_of",
    "tool_calls",
    "response_format",
    "structured_outputs",
    "guided_grammar",
];

/// A body fragment that asks for `field` with a value that is not its default, on `api`.
fn probe(field: &str, api: Api) -> Option<Value> {
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    Some(match field {
        "top_k" => json!({"top_k": 5}),
        "seed" => json!({"seed": 1}),
        "stop" => json!({"stop": ["x"]}),
        "stop_token_ids" => json!({"stop_token_ids": [1]}),
        "ignore_eos" => json!({"ignore_eos": true}),
        "include_stop_str_in_output" => json!({"include_stop_str_in_output": true}),
        "logit_bias" => json!({"logit_bias": {"1": 5}}),
        "min_p" => json!({"min_p": 0.1}),
        "allowed_token_ids" => json!({"allowed_token_ids": [1, 2]}),
        "presence_penalty" => json!({"presence_penalty": 0.5}),
        "frequency_penalty" => json!({"frequency_penalty": 0.5}),
        "repetition_penalty" => json!({"repetition_penalty": 1.2}),
        "min_tokens" => json!({"min_tokens": 2}),
        "bad_words" => json!({"bad_words": ["ab"]}),
        "truncate_prompt_tokens" => json!({"truncate_prompt_tokens": 4}),
        "logprobs" => match api {
            Api::Chat => json!({"logprobs": true}),
            _ => json!({"logprobs": 1}),
        },
        "top_logprobs" => json!({"logprobs": true, "top_logprobs": 2}),
        "n" => json!({"n": 2}),
        "use_beam_search" => json!({"use_beam_search": true}),
        "echo" => json!({"echo": true}),
        "suffix" => json!({"suffix": "x"}),
        "guided_json" => json!({"guided_json": {"type": "object"}}),
        "guided_regex" => json!({"guided_regex": "a+"}),
        "guided_choice" => json!({"guided_choice": ["a", "b"]}),
        "guided_decoding_backend" => json!({"guided_decoding_backend": "xgrammar"}),
        "guided_whitespace_pattern" => json!({"guided_whitespace_pattern": " "}),
        "tools" => json!({"tools": tool}),
        "tool_choice" => match api {
            Api::Chat => json!({"tools": tool, "tool_choice": "required"}),
            _ => json!({"tool_choice": "required"}),
        },
        "functions" => json!({"functions": [{"name": "f"}]}),
        "function_call" => json!({"function_call": {"name": "f"}}),
        "length_penalty" => json!({"length_penalty": 1.5}),
        "logits_processors" => json!({"logits_processors": ["x"]}),
        "prompt_logprobs" => json!({"prompt_logprobs": 1}),
        "skip_special_tokens" => json!({"skip_special_tokens": false}),
        "spaces_between_special_tokens" => json!({"spaces_between_special_tokens": false}),
        "return_tokens_as_token_ids" => json!({"return_tokens_as_token_ids": true}),
        "return_token_ids" => json!({"return_token_ids": true}),
        "priority" => json!({"priority": 1}),
        "audio" => json!({"audio": {"voice": "x"}}),
        "prediction" => json!({"prediction": {"type": "content", "content": "x"}}),
        "web_search_options" => json!({"web_search_options": {}}),
        "reasoning_effort" => json!({"reasoning_effort": "low"}),
        "modalities" => json!({"modalities": ["audio"]}),
        "chat_template" => json!({"chat_template": "x"}),
        "chat_template_kwargs" => json!({"chat_template_kwargs": {"a": 1}}),
        "documents" => json!({"documents": [{"text": "x"}]}),
        "mm_processor_kwargs" => json!({"mm_processor_kwargs": {"a": 1}}),
        "add_generation_prompt" => json!({"add_generation_prompt": false}),
        "continue_final_message" => json!({"continue_final_message": true}),
        "reasoning" => json!({"reasoning": {"effort": "low"}}),
        "conversation" => json!({"conversation": "c"}),
        "max_tool_calls" => json!({"max_tool_calls": 2}),
        "include" => json!({"include": ["x"]}),
        "background" => json!({"background": true}),
        "truncation" => json!({"truncation": "auto"}),
        "text" => json!({"text": {"format": {"type": "json_object"}}}),
        "user" => json!({"user": "u"}),
        "metadata" => json!({"metadata": {"a": "b"}}),
        "service_tier" => json!({"service_tier": "auto"}),
        "store" => json!({"store": false}),
        "parallel_tool_calls" => json!({"parallel_tool_calls": false}),
        "prompt_cache_key" => json!({"prompt_cache_key": "k"}),
        "safety_identifier" => json!({"safety_identifier": "s"}),
        _ => return None,
    })
}

/// The endpoint's validation of a minimal request with `extra` merged in.
fn validate(api: Api, extra: &Value) -> Result<(), ApiError> {
    let codec = SyntheticTextCodec;
    let options = FrontendOptions {
        served_model_name: "m".into(),
        max_model_len: 64,
        vocab_size: 257,
        eos_token_ids: vec![256],
        rejection_notices: true,
    };
    let limits = ModelLimits { options: &options, codec: &codec, vocab_size: 257 };
    let mut body = match api {
        Api::Completions => json!({"prompt": "hello", "max_tokens": 4}),
        Api::Chat => json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        Api::Responses => json!({"input": "hi", "max_output_tokens": 4}),
    };
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let parse_error = |e: serde_json::Error| ApiError::invalid(format!("body: {e}"), "body");
    match api {
        Api::Completions => {
            let body = serde_json::from_value(body).map_err(parse_error)?;
            pdmesh_openai::request::validate_completion(&body, &limits).map(drop)
        }
        Api::Chat => {
            let body = serde_json::from_value(body).map_err(parse_error)?;
            pdmesh_openai::request::validate_chat(&body, &limits).map(drop)
        }
        Api::Responses => {
            let body = serde_json::from_value(body).map_err(parse_error)?;
            crate::handlers::responses::validate_request(&body, &limits, &ResponseStore::new(4)).map(drop)
        }
    }
}

/// One row: the fields it names, the APIs, and whether it says they are refused.
struct Row {
    line: String,
    fields: Vec<String>,
    apis: Vec<Api>,
    refused: bool,
}

fn rows() -> Vec<Row> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/CONFIG.md")).unwrap();
    let section = doc.split("## OpenAI API coverage").nth(1).expect("the coverage section");
    let section = section.split("\n## ").next().unwrap();
    let mut out = Vec::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cols: Vec<&str> = line.split(" | ").collect();
        assert!(cols.len() >= 3, "a row of three columns: {line}");
        // bare identifiers in backticks outside parentheses (which hold values and conditions)
        let mut depth = 0usize;
        let outside: String = cols[0]
            .chars()
            .filter(|&c| {
                match c {
                    '(' => depth += 1,
                    ')' => depth = depth.saturating_sub(1),
                    _ => return depth == 0,
                }
                false
            })
            .collect();
        let fields: Vec<String> = outside
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .filter(|t| !matches!(*t, "false" | "true" | "none" | "auto" | "required" | "text" | "json_object"))
            .map(str::to_string)
            .collect();
        let api_col = cols[1];
        let apis: Vec<Api> = if api_col.contains("all") || api_col.contains("as OpenAI/vLLM define them") {
            APIS.to_vec()
        } else {
            let mut a = Vec::new();
            if api_col.contains("completions") {
                a.push(Api::Completions);
            }
            if api_col.contains("chat") {
                a.push(Api::Chat);
            }
            if api_col.contains("responses") {
                a.push(Api::Responses);
            }
            a
        };
        assert!(!apis.is_empty(), "a row names its APIs: {line}");
        let verdict = cols[2].trim_start_matches('|').trim();
        let refused = verdict.starts_with("refused");
        assert!(
            refused || verdict.starts_with("honoured") || verdict.starts_with("accepted"),
            "a row starts its verdict with honoured, accepted or refused: {line}"
        );
        out.push(Row { line: line.to_string(), fields, apis, refused });
    }
    assert!(out.len() > 20, "the coverage table was found ({} rows)", out.len());
    out
}

#[test]
fn the_coverage_table_says_what_the_validator_does() {
    let mut named = BTreeSet::new();
    let mut failures = Vec::new();
    for row in rows() {
        for field in &row.fields {
            named.insert(field.clone());
            if NOT_PROBED.contains(&field.as_str()) {
                continue;
            }
            for &api in &row.apis {
                let Some(extra) = probe(field, api) else {
                    failures.push(format!("no probe for `{field}` (row: {})", row.line));
                    continue;
                };
                let refused_here = match validate(api, &extra) {
                    Ok(()) => false,
                    Err(e) => {
                        let body = serde_json::to_value(e.body()).unwrap();
                        body["error"]["param"] == field.as_str()
                            || (field == "top_logprobs" && body["error"]["param"] == "logprobs")
                    }
                };
                if refused_here != row.refused {
                    let said = if row.refused { "refused" } else { "not refused" };
                    failures.push(format!("{api:?} `{field}`: the table says {said}, the validator disagrees"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "docs/CONFIG.md's coverage table and the validator disagree:\n{}",
        failures.join("\n")
    );
    // the fields whose handling changed most lately are in the table at all
    for f in ["presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "bad_words", "echo"] {
        assert!(named.contains(f), "`{f}` is missing from the coverage table");
    }
}

#[test]
fn a_disagreement_is_caught() {
    // the check itself can fail: a field the validator honours, claimed refused
    let extra = probe("presence_penalty", Api::Chat).unwrap();
    assert!(validate(Api::Chat, &extra).is_ok(), "honoured on chat");
    let extra = probe("prompt_logprobs", Api::Chat).unwrap();
    let e = validate(Api::Chat, &extra).unwrap_err();
    assert_eq!(serde_json::to_value(e.body()).unwrap()["error"]["param"], "prompt_logprobs");
}
