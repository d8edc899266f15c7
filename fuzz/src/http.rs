//! Target `http_body`: a request body of `/v1/completions`, `/v1/chat/completions` or
//! `/v1/responses` (the first byte picks which) through what the frontend does with it: the
//! JSON extractor's `serde_json` decode (a failure rendered as the API's error), then the
//! endpoint's validation (`pdmesh_openai::request`, the Responses handler's) — sampling fields, prompt shapes, `kv_transfer_params` (with
//! the capability token P hands out), the chat template, the tokenizer, the context length.
//!
//! The codec is the served model's (`GgufTextCodec`: its tokenizer and its Jinja chat
//! template) when `PDMESH_MODEL_PATH` names the GGUF file, else the synthetic one.
//!
//! Must hold: a refusal is a client error (4xx) with an OpenAI error body; an accepted
//! request has a non-empty prompt of in-vocabulary ids, `max_tokens` ≥ 1 that fits the
//! context with the prompt, and sampling values in their documented ranges.

use std::sync::Arc;

use actix_web::error::JsonPayloadError;
use pdmesh_frontend::handlers::responses;
use pdmesh_frontend::openai::ResponsesRequest;
use pdmesh_frontend::responses::ResponseStore;
use pdmesh_frontend::ApiError;
use pdmesh_model_api::TextCodec;
use pdmesh_openai::request::{validate_chat, validate_completion};
use pdmesh_openai::validation::{ModelLimits, ValidatedRequest, MAX_STOP_STRINGS};
use pdmesh_openai::wire::{ChatCompletionRequest, CompletionRequest};
use pdmesh_openai::FrontendOptions;
use serde_json::json;

/// The served model's name in the options and the seeds.
const MODEL: &str = "fuzz-model";

pub struct Harness {
    codec: Arc<dyn TextCodec>,
    options: FrontendOptions,
    store: ResponseStore,
}

impl Harness {
    pub fn new() -> Self {
        let (codec, max_model_len): (Arc<dyn TextCodec>, u32) = match std::env::var_os("PDMESH_MODEL_PATH") {
            Some(path) => {
                let options = pdmesh_model::ModelOptions { max_model_len: Some(2048), ..Default::default() };
                let codec = pdmesh_model::GgufTextCodec::load(&path, &options).expect("load the model's text codec");
                eprintln!("http_body: the model's tokenizer and chat template ({})", path.to_string_lossy());
                let len = codec.max_model_len();
                (Arc::new(codec), len)
            }
            None => {
                eprintln!("http_body: PDMESH_MODEL_PATH unset; the synthetic codec");
                (Arc::new(pdmesh_synthetic_executor::SyntheticTextCodec), 512)
            }
        };
        let options = FrontendOptions {
            served_model_name: MODEL.into(),
            max_model_len,
            vocab_size: 0,
            eos_token_ids: vec![2],
            rejection_notices: true,
        };
        Self { codec, options, store: ResponseStore::new(16) }
    }

    pub fn check(&mut self, data: &[u8]) {
        let Some((&which, body)) = data.split_first() else { return };
        let limits = ModelLimits { options: &self.options, codec: &*self.codec, vocab_size: self.codec.vocab_size() };
        let result = match which % 3 {
            0 => decode::<CompletionRequest>(body).and_then(|b| validate_completion(&b, &limits)),
            1 => decode::<ChatCompletionRequest>(body).and_then(|b| validate_chat(&b, &limits)),
            _ => decode::<ResponsesRequest>(body)
                .and_then(|b| responses::validate_request(&b, &limits, &self.store))
                .map(|(v, _)| v),
        };
        match result {
            Ok(v) => check_accepted(&v, &limits),
            Err(e) => check_refused(&e),
        }
    }
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

/// What actix-web's `Json` extractor does with the body, and the error it renders.
fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::from_json_error(&JsonPayloadError::Deserialize(e)))
}

fn check_accepted(v: &ValidatedRequest, limits: &ModelLimits<'_>) {
    assert!(!v.prompt.is_empty(), "an empty prompt was accepted");
    assert!(v.prompt.iter().all(|&t| t < limits.vocab_size), "a prompt id outside the vocabulary");
    assert!(v.max_tokens >= 1, "max_tokens {}", v.max_tokens);
    let total = v.prompt.len() as u64 + u64::from(v.max_tokens);
    assert!(total <= u64::from(limits.options.max_model_len), "{total} tokens exceed the context");
    let s = &v.params.sampling;
    assert!((0.0..=2.0).contains(&s.temperature), "temperature {}", s.temperature);
    assert!(s.top_p > 0.0 && s.top_p <= 1.0, "top_p {}", s.top_p);
    assert!(s.stop_token_ids.iter().all(|&t| t < limits.vocab_size), "a stop id outside the vocabulary");
    assert!(s.logprobs.is_none_or(|n| n <= 20), "logprobs {:?}", s.logprobs);
    assert!(v.params.stop.len() <= MAX_STOP_STRINGS && v.params.stop.iter().all(|s| !s.is_empty()));
}

fn check_refused(e: &ApiError) {
    let status = e.status().as_u16();
    assert!((400..500).contains(&status), "a request body made a {status}: {e}");
    let body = serde_json::to_value(e.body()).expect("the error body serialises");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert_eq!(body["error"]["code"], status);
}

/// Requests as clients send them (vLLM's and OpenAI's shapes, the P/D router's
/// `kv_transfer_params`), and refusals of each kind.
pub fn seeds() -> Vec<Vec<u8>> {
    let kv = json!({"do_remote_prefill": true, "remote_engine_id": "p-0", "remote_request_id": "cmpl-1",
                    "remote_block_ids": [1, 2], "remote_block_generations": [1, 1], "remote_host": "10.0.0.1",
                    "remote_port": 5600, "remote_dp_rank": 0,
                    "remote_capability": "0123456789abcdef0123456789abcdef"});
    let completions = [
        json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
        json!({"prompt": ["Hello"], "max_tokens": 4, "stop": ["\n", "."], "logprobs": 2, "seed": -7, "top_k": 40}),
        json!({"prompt": [1, 2, 3, 4], "max_tokens": 2, "stream": true, "stream_options": {"include_usage": true}}),
        json!({"prompt": [[5, 6]], "stop_token_ids": [2], "ignore_eos": true, "top_p": 0.9}),
        json!({"prompt": "x", "max_tokens": 1, "kv_transfer_params": kv}),
        json!({"prompt": "x", "echo": true}),
        json!({"prompt": ["a", "b"]}),
        json!({"prompt": "x", "max_tokens": 100000}),
        json!({"prompt": "x", "n": 2, "best_of": 3, "logit_bias": {"1": 5}}),
        json!({"model": "other", "prompt": "x"}),
    ];
    let chat = [
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8}),
        json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
               "max_completion_tokens": 4, "logprobs": true, "top_logprobs": 3, "stop": "\n"}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               "stream": true, "kv_transfer_params": kv}),
        json!({"messages": [{"role": "tool", "content": null, "name": "calc"}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        json!({"messages": [{"role": "wizard", "content": "{{ raise_exception('x') }}"}]}),
        json!({"messages": []}),
        json!({"messages": [{"role": "user", "content": "x"}], "use_beam_search": true, "stream": true}),
    ];
    let responses = [
        json!({"model": MODEL, "input": "Tell me a joke.", "max_output_tokens": 16}),
        json!({"input": [{"role": "developer", "content": "Be brief."},
                         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
               "instructions": "Answer in French.", "temperature": 0.5, "top_p": 0.5, "store": false}),
        json!({"input": "again", "previous_response_id": "resp_123"}),
        json!({"input": [{"type": "function_call", "role": "user", "content": "x"}]}),
        json!({"input": [], "stream": true}),
    ];
    let mut seeds = Vec::new();
    for (which, bodies) in [(0u8, &completions[..]), (1, &chat[..]), (2, &responses[..])] {
        for body in bodies {
            let mut seed = vec![which];
            seed.extend(serde_json::to_vec(body).expect("a seed serialises"));
            seeds.push(seed);
        }
        seeds.push([vec![which], b"{\"prompt\": \"x\", ".to_vec()].concat());
    }
    seeds
}
