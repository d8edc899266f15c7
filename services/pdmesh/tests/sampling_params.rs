//! vLLM's sampling parameters through P/D on the real model (issue 41): penalties,
//! `min_tokens`, `bad_words`, `logit_bias`, `truncate_prompt_tokens` and `echo` give through
//! the router (P samples the first token, D the rest, streamed or whole) exactly what a
//! colocated node gives, so D's sampler saw the history P's would; the official SDK's
//! penalties change the text; P and D end holding nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::topo::TransferBackendKind::Shm;
use common::{sse_events, Mesh};
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap()
}

/// A completion's text, whole or streamed (the chunks' texts joined), and its finish reason.
fn complete(url: &str, body: &Value) -> (String, String) {
    let r = client().post(url).json(body).send().unwrap();
    let status = r.status().as_u16();
    let text = r.text().unwrap();
    assert_eq!(status, 200, "{body}: {text}");
    if body["stream"] == true {
        let mut out = String::new();
        let mut finish = String::new();
        for e in sse_events(&text).iter().filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).unwrap();
            assert!(v.get("error").is_none(), "{v}");
            if let Some(c) = v["choices"].get(0) {
                out.push_str(c["text"].as_str().unwrap_or_default());
                if let Some(f) = c["finish_reason"].as_str() {
                    finish = f.to_string();
                }
            }
        }
        (out, finish)
    } else {
        let v: Value = serde_json::from_str(&text).unwrap();
        let c = &v["choices"][0];
        (c["text"].as_str().unwrap().to_string(), c["finish_reason"].as_str().unwrap().to_string())
    }
}

#[test]
fn sampling_parameters_are_equal_through_pd_and_colocated() {
    let Some(path) = common::model_path() else { return };
    let mesh = Mesh::start_nodes(
        |http, base| common::pd_topology(http, base, Shm, 1, common::gguf(&path, 256, 1024)),
        common::pd_engines,
    );
    let router = mesh.http_port;
    let (via_router, colocated) = (mesh.url_on(router, "/v1/completions"), mesh.url_on(router + 3, "/v1/completions"));
    let prompt = "Once upon a time, in a small village by the sea,";
    let greedy = |extra: Value| {
        let mut b = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let (plain, _) = complete(&colocated, &greedy(json!({})));
    // the plain answer's first word, banned; and its first two words as one bad word: through
    // P/D the first is P's token, so D bans the second only if it counts P's token as output
    let word = plain.split_whitespace().next().unwrap().to_string();
    let two_words = plain.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
    for extra in [
        json!({"bad_words": [two_words]}),
        json!({"presence_penalty": 2.0, "frequency_penalty": 2.0}),
        json!({"frequency_penalty": 0.5, "presence_penalty": 0.3}),
        json!({"repetition_penalty": 1.3}),
        json!({"repetition_penalty": 1.2, "frequency_penalty": 0.2, "min_p": 0.05}),
        json!({"bad_words": [word]}),
        json!({"logit_bias": {"28": -100}, "presence_penalty": 1.0}),
    ] {
        let (want, _) = complete(&colocated, &greedy(extra.clone()));
        assert_ne!(want, plain, "{extra} changes the greedy text");
        for stream in [false, true] {
            let mut body = greedy(extra.clone());
            body["stream"] = json!(stream);
            let (got, _) = complete(&via_router, &body);
            assert_eq!(got, want, "{extra}, stream {stream}: through P/D as on a colocated node");
        }
    }
    // composed with a structured output: the grammar mask first, then the penalties
    let choice = greedy(json!({"guided_choice": ["yes", "no", "maybe"], "presence_penalty": 2.0,
                               "frequency_penalty": 2.0, "repetition_penalty": 1.5}));
    let (want, finish) = complete(&colocated, &choice);
    assert!(["yes", "no", "maybe"].contains(&want.as_str()) && finish == "stop", "{want:?} {finish}");
    assert_eq!(complete(&via_router, &choice).0, want);

    // n > 1: every choice carries its own history, each equal to the one-choice answer
    let penalised = greedy(json!({"frequency_penalty": 0.5, "presence_penalty": 0.3, "n": 3}));
    let (want, _) = complete(&colocated, &greedy(json!({"frequency_penalty": 0.5, "presence_penalty": 0.3})));
    let v: Value = client().post(&via_router).json(&penalised).send().unwrap().json().unwrap();
    let texts: Vec<&str> = v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts, vec![want.as_str(); 3], "n = 3 through P/D");

    // bad_words: the word never appears
    let (text, _) = complete(&via_router, &greedy(json!({"bad_words": [word], "stream": true})));
    assert!(!text.split_whitespace().any(|w| w == word), "{word:?} in {text:?}");

    // min_tokens: a chat answered in a few tokens goes on; through P/D as colocated
    let chat = |port: u16, extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "Reply with one word: yes or no?"}],
                           "max_tokens": 40, "temperature": 0, "stream": false});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let v: Value =
            client().post(mesh.url_on(port, "/v1/chat/completions")).json(&b).send().unwrap().json().unwrap();
        (
            v["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
            v["usage"]["completion_tokens"].as_u64().unwrap(),
        )
    };
    let (_, short) = chat(router + 3, json!({}));
    assert!(short < 12, "the premise: a short answer ({short} tokens)");
    let (long_text, long) = chat(router + 3, json!({"min_tokens": 12}));
    assert!(long >= 12, "min_tokens 12: {long} tokens");
    let (text, n) = chat(router, json!({"min_tokens": 12}));
    assert_eq!((text.as_str(), n), (long_text.as_str(), long), "min_tokens through P/D");
    // streamed through P/D (P's first token, D the rest): the completions endpoint's text
    let min = greedy(json!({"prompt": "Q: Is water wet? Answer yes or no.\nA:", "min_tokens": 10, "max_tokens": 30}));
    let (want, _) = complete(&colocated, &min);
    let mut streamed = min.clone();
    streamed["stream"] = json!(true);
    assert_eq!(complete(&via_router, &streamed).0, want, "min_tokens streamed through P/D");

    // truncate_prompt_tokens keeps the prompt's last tokens: the same answer as that tail
    let tail_of = |n: usize| {
        let v: Value = client()
            .post(mesh.url_on(router + 3, "/v1/completions"))
            .json(&json!({"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": n, "temperature": 0}))
            .send()
            .unwrap()
            .json()
            .unwrap();
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    assert_eq!(tail_of(5), 5);
    let truncated = greedy(json!({"truncate_prompt_tokens": 6}));
    let (want, _) = complete(&colocated, &truncated);
    assert_eq!(complete(&via_router, &truncated).0, want);

    // echo: the prompt, then the completion, through the router as on the node
    for stream in [false, true] {
        let body = greedy(json!({"echo": true, "stream": stream}));
        let (on_node, _) = complete(&colocated, &body);
        assert_eq!(on_node, format!("{prompt}{plain}"), "stream {stream}");
        assert_eq!(complete(&via_router, &body).0, on_node, "stream {stream}");
    }

    // the official SDK, through the router
    eprintln!("{}", common::run_sdk_script("penalties_sdk.py", &mesh.url_on(router, "")));

    mesh.wait_kv_on(router + 1, "P holds nothing once D has read", |kv| {
        kv["held_blocks"] == 0 && kv["used_blocks"] == 0
    });
    mesh.wait_kv_on(router + 2, "D's blocks are free", |kv| kv["used_blocks"] == 0);
}
