//! `/v1/responses` through the router on a real P/D mesh (synthetic executor, shared-memory
//! transfer): both legs, streaming, `previous_response_id` found again on the decode node
//! that stored the conversation, retrieval by id, and the router's 405 — with P and D holding
//! nothing at the end. The synthetic executor computes each token from the KV cache it reads,
//! so an answer equal to the colocated node's proves the right bytes moved, and a follow-up
//! equal to the colocated answer for the whole conversation proves the first turn was used.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::topo::TransferBackendKind::Shm;
use common::Mesh;
use serde_json::{json, Value};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap()
}

fn post(url: &str, body: &Value) -> Value {
    let r = client().post(url).json(body).send().unwrap();
    let status = r.status().as_u16();
    let text = r.text().unwrap();
    assert_eq!(status, 200, "{url} {body}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// The final event's response (`response.completed`, or `response.incomplete` at the token cap) of a streamed `/v1/responses` answer.
fn completed_of_stream(url: &str, body: &Value) -> Value {
    let r = client().post(url).json(body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().unwrap();
    common::sse_events(&text)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|v| v["type"] == "response.completed" || v["type"] == "response.incomplete")
        .unwrap_or_else(|| panic!("no final response event in {}", &text[text.len().saturating_sub(3000)..]))
        ["response"]
        .clone()
}

/// Fails if the router 404s `/v1/responses`, sends P a request that generates or stores more
/// than its one token, sends the follow-up anywhere but the decode node that stored the first
/// turn (P or another node answer 404 for an id they never stored), or if the follow-up's
/// prompt is not the whole conversation (its tokens and text would differ from the colocated
/// node's answer to the explicit conversation); or if P or D still hold blocks at the end.
#[test]
fn responses_through_the_router_keep_the_conversation_on_the_decode_node() {
    let mesh = Mesh::start_nodes(|h, b| common::pd_topology(h, b, Shm, 2, common::blocks(4, 512)), common::pd_engines);
    let router = mesh.url("/v1/responses");
    let colocated = mesh.url_on(mesh.http_port + 3, "/v1/responses");
    let first = json!({"input": "hello there", "max_output_tokens": 8, "temperature": 0});

    let r1 = post(&router, &first);
    let id1 = r1["id"].as_str().unwrap().to_string();
    assert!(id1.starts_with("resp_d0_"), "the router's id names the decode node: {id1}");
    let c1 = post(&colocated, &first);
    assert_eq!(r1["output_text"], c1["output_text"], "P/D answer equals the colocated one");
    assert_eq!(r1["usage"], c1["usage"]);
    let text1 = r1["output_text"].as_str().unwrap().to_string();

    // Streaming through both legs: the same answer, under a router id too.
    let s1 = completed_of_stream(
        &router,
        &json!({"input": "hello there", "max_output_tokens": 8, "temperature": 0, "stream": true}),
    );
    assert_eq!(s1["output_text"], c1["output_text"]);
    assert!(s1["id"].as_str().unwrap().starts_with("resp_d0_"), "{s1}");

    // The follow-up: found again on D, rendered as the whole conversation.
    let follow = json!({"input": "and then?", "previous_response_id": id1, "max_output_tokens": 8, "temperature": 0});
    let r2 = post(&router, &follow);
    assert_eq!(r2["previous_response_id"], id1.as_str());
    let explicit = json!({"input": [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": text1},
        {"role": "user", "content": "and then?"}
    ], "max_output_tokens": 8, "temperature": 0});
    let c2 = post(&colocated, &explicit);
    assert_eq!(r2["output_text"], c2["output_text"], "the follow-up saw the first turn");
    assert_eq!(r2["usage"]["input_tokens"], c2["usage"]["input_tokens"]);
    assert!(
        r2["usage"]["input_tokens"].as_u64().unwrap() > r1["usage"]["total_tokens"].as_u64().unwrap(),
        "the conversation's prompt grew: {} then {}",
        r1["usage"],
        r2["usage"]
    );
    // A follow-up of the follow-up stays on the same node.
    let id2 = r2["id"].as_str().unwrap().to_string();
    assert!(id2.starts_with("resp_d0_"), "{id2}");
    let r3 =
        post(&router, &json!({"input": "ok", "previous_response_id": id2, "max_output_tokens": 4, "temperature": 0}));
    assert!(r3["usage"]["input_tokens"].as_u64().unwrap() > r2["usage"]["total_tokens"].as_u64().unwrap());

    // Retrieval through the router, and P kept nothing of its leg.
    let got: Value = client().get(format!("{router}/{id1}")).send().unwrap().json().unwrap();
    assert_eq!(got["id"], id1.as_str());
    assert_eq!(got["output_text"], text1.as_str());
    let on_p = client().get(mesh.url_on(mesh.http_port + 1, &format!("/v1/responses/{id1}"))).send().unwrap();
    assert_eq!(on_p.status().as_u16(), 404, "the conversation lives on D only");

    // The router's 405 on a real listener.
    let r = client().get(&router).send().unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(r.headers()["allow"], "POST");
    let e: Value = r.json().unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error");

    let (p, d) = (mesh.http_port + 1, mesh.http_port + 2);
    mesh.wait_kv_on(p, "P holds nothing once D has read", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    mesh.wait_kv_on(d, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"));
}
