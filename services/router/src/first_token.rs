//! The token P sampled goes to the client at once (D63).
//!
//! P's prefill samples the request's first token anyway (its answer is a one-token
//! completion). Without this, the client waits for D to read P's blocks and run one forward
//! over the last prompt token only to sample that same token again. Instead, the router
//! streams P's token to the client as soon as P answers and sends D the request with P's
//! params and `resume_token_ids = [that token]`: D reads P's blocks, computes the first token's
//! KV and samples the second, and its stream goes on after the seam as a migrated stream does
//! (D56: its role chunk dropped, the first chunk's `created` kept, text and usage continuing
//! exactly). Time to first token becomes P's answer time; D's read and forward move behind it.
//!
//! Only where the token P shows is exactly what a colocated node would have shown at that
//! point: a streamed completion or chat with one choice, no stop strings (a stop string could
//! start with that token and hold it back), no logprobs, no echo or suffix, no tools or
//! grammar, more than one token to generate, and P's token complete text (not a partial UTF-8
//! sequence) that ended P's answer by length. Anything else takes the plain two-leg path.

use std::sync::LazyLock;

use prometheus::IntCounter;
use serde_json::Value;

use pdmesh_openai::wire::{
    ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, CompletionResponse, UsageField,
};
use pdmesh_protocol::node_http::TOKEN_IDS_FIELD;

/// Requests whose first token the router streamed from P's answer.
pub const FIRST_TOKEN_FROM_PREFILL: &str = "pdmesh_router_first_token_from_prefill_total";

pub(super) static FIRST_TOKEN_FROM_PREFILL_TOTAL: LazyLock<IntCounter> = LazyLock::new(|| {
    pdmesh_telemetry::metrics::counter(
        FIRST_TOKEN_FROM_PREFILL,
        "Requests whose first token the router streamed from the prefill node's answer",
    )
});

pub(super) const COMPLETIONS: &str = "/v1/completions";
pub(super) const CHAT: &str = "/v1/chat/completions";

/// P's token, ready to be streamed.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct FirstToken {
    /// Its id: D resumes after it.
    pub id: u32,
    /// The chunks the client gets for it (chat: the role chunk, then the text).
    pub chunks: Vec<Value>,
    /// The chunks' `created`: D's chunks get it too.
    pub created: u64,
}

/// Whether the client's request may take its first token from P (see the module docs).
pub(super) fn eligible(path: &str, body: &Value) -> bool {
    if path != COMPLETIONS && path != CHAT {
        return false;
    }
    let unset = |key: &str| match body.get(key) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    };
    let at_most_one = |key: &str| body.get(key).and_then(Value::as_u64).is_none_or(|n| n <= 1);
    let more_than_one = |key: &str| body.get(key).and_then(Value::as_u64).is_none_or(|n| n > 1);
    // One prompt: a string, or one list of token ids (a list of strings or lists is several).
    let single_prompt = path == CHAT
        || match body.get("prompt") {
            Some(Value::String(_)) => true,
            Some(Value::Array(items)) => items.first().is_some_and(Value::is_number),
            _ => false,
        };
    body.get("stream").and_then(Value::as_bool) == Some(true)
        && single_prompt
        && at_most_one("n")
        && at_most_one("best_of")
        && more_than_one("max_tokens")
        && more_than_one("max_completion_tokens")
        && [
            "stop",
            "logprobs",
            "top_logprobs",
            "echo",
            "suffix",
            "tools",
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        ]
        .iter()
        .all(|k| unset(k))
}

/// P's token from its answer, when it can be shown as it is: one token id, non-empty text
/// that is not a partial character, and P stopped by its one-token length (an end of sequence
/// or a stop token takes the plain path: D then ends the request as a colocated node would).
pub(super) fn from_answer(path: &str, client_body: &Value, answer: &Value) -> Option<FirstToken> {
    let ids = answer.get(TOKEN_IDS_FIELD)?.as_array()?;
    let [id] = ids.as_slice() else { return None };
    let id = u32::try_from(id.as_u64()?).ok()?;
    let choice = answer.get("choices")?.get(0)?;
    if choice.get("finish_reason")?.as_str()? != "length" {
        return None;
    }
    let text = if path == CHAT {
        let message = choice.get("message")?;
        if message.get("tool_calls").is_some_and(|v| !v.is_null()) {
            return None;
        }
        message.get("content")?.as_str()?
    } else {
        choice.get("text")?.as_str()?
    };
    if text.is_empty() || text.contains('\u{FFFD}') {
        return None;
    }
    let response_id = answer.get("id")?.as_str()?.to_string();
    let created = answer.get("created")?.as_u64()?;
    let model = answer.get("model")?.as_str()?.to_string();
    let include_usage = client_body["stream_options"]["include_usage"].as_bool() == Some(true);
    let usage = if include_usage { UsageField::Null } else { UsageField::Absent };
    let chunks = if path == CHAT {
        let chunk = |delta: ChatDelta| ChatCompletionChunk {
            id: response_id.clone(),
            object: "chat.completion.chunk",
            created,
            model: model.clone(),
            choices: vec![ChatChunkChoice { index: 0, delta, logprobs: None, finish_reason: None, stop_reason: None }],
            usage,
        };
        vec![
            serde_json::to_value(chunk(ChatDelta {
                role: Some("assistant"),
                content: Some(String::new()),
                tool_calls: None,
            }))
            .ok()?,
            serde_json::to_value(chunk(ChatDelta { role: None, content: Some(text.to_string()), tool_calls: None }))
                .ok()?,
        ]
    } else {
        vec![serde_json::to_value(CompletionResponse {
            id: response_id,
            object: "text_completion",
            created,
            model,
            choices: vec![CompletionChoice {
                index: 0,
                text: text.to_string(),
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }],
            usage,
            kv_transfer_params: pdmesh_openai::wire::KvParamsField::Absent,
        })
        .ok()?]
    };
    Some(FirstToken { id, chunks, created })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_plain_single_choice_streams_are_eligible() {
        let chat = json!({"messages": [], "stream": true, "max_tokens": 16});
        assert!(eligible(CHAT, &chat));
        assert!(eligible(CHAT, &json!({"messages": [], "stream": true, "stop": [], "logprobs": false})));
        assert!(!eligible("/v1/responses", &chat));
        for (key, value) in [
            ("stream", json!(false)),
            ("n", json!(2)),
            ("max_tokens", json!(1)),
            ("max_completion_tokens", json!(1)),
            ("stop", json!(["\n"])),
            ("stop", json!("END")),
            ("logprobs", json!(true)),
            ("tools", json!([{"type": "function"}])),
            ("response_format", json!({"type": "json_object"})),
        ] {
            let mut body = chat.clone();
            body[key] = value;
            assert!(!eligible(CHAT, &body), "{key}");
        }
        assert!(eligible(COMPLETIONS, &json!({"prompt": "x", "stream": true})));
        assert!(!eligible(COMPLETIONS, &json!({"prompt": ["x", "y"], "stream": true})), "several prompts");
        assert!(!eligible(COMPLETIONS, &json!({"prompt": [[1, 2], [3]], "stream": true})), "several prompts");
        assert!(eligible(COMPLETIONS, &json!({"prompt": [1, 2, 3], "stream": true})), "one prompt of token ids");
        assert!(!eligible(COMPLETIONS, &json!({"prompt": "x", "stream": true, "echo": true})));
    }

    fn answer(text: &str, finish: &str, ids: Value) -> Value {
        json!({"id": "cmpl-r1", "object": "text_completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}], "pdmesh_token_ids": ids})
    }

    #[test]
    fn a_completion_token_becomes_one_chunk() {
        let body = json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": true}});
        let first = from_answer(COMPLETIONS, &body, &answer(" fox", "length", json!([42]))).unwrap();
        assert_eq!(first.id, 42);
        assert_eq!(first.created, 7);
        assert_eq!(first.chunks.len(), 1);
        let c = &first.chunks[0];
        assert_eq!((c["id"].as_str(), c["choices"][0]["text"].as_str()), (Some("cmpl-r1"), Some(" fox")));
        assert!(c["choices"][0]["finish_reason"].is_null());
        assert!(
            c["usage"].is_null() && c.get("usage").is_some(),
            "include_usage: null usage on every chunk but the last"
        );
    }

    #[test]
    fn a_chat_token_becomes_the_role_chunk_and_its_text() {
        let a = json!({"id": "chatcmpl-r1", "created": 7, "model": "m", "pdmesh_token_ids": [9],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length"}]});
        let first = from_answer(CHAT, &json!({"stream": true}), &a).unwrap();
        assert_eq!(first.chunks.len(), 2);
        assert_eq!(first.chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
        assert_eq!(first.chunks[1]["choices"][0]["delta"], json!({"content": "Hi"}));
        assert!(first.chunks[1].get("usage").is_none());
    }

    #[test]
    fn tokens_that_cannot_be_shown_as_they_are_take_the_plain_path() {
        let body = json!({"prompt": "x", "stream": true});
        assert!(from_answer(COMPLETIONS, &body, &answer(" fox", "stop", json!([42]))).is_none(), "end of sequence");
        assert!(from_answer(COMPLETIONS, &body, &answer("", "length", json!([42]))).is_none(), "held back");
        assert!(from_answer(COMPLETIONS, &body, &answer("\u{FFFD}", "length", json!([42]))).is_none(), "partial");
        assert!(from_answer(COMPLETIONS, &body, &answer(" fox", "length", json!([]))).is_none(), "no ids");
        assert!(from_answer(COMPLETIONS, &body, &answer(" fox", "length", json!([1, 2]))).is_none());
        let mut no_ids = answer(" fox", "length", json!([42]));
        no_ids.as_object_mut().unwrap().remove("pdmesh_token_ids");
        assert!(from_answer(COMPLETIONS, &body, &no_ids).is_none());
    }
}
