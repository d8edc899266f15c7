//! In-process tests of the whole frontend over real ZeroMQ sockets, against a scripted fake
//! dp-lb that speaks the frontend ⇄ dp-lb contract (ROUTER for calls, PUSH for outputs).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use actix_web::http::StatusCode;
use actix_web::{test, web};
use bytes::Bytes;
use pdmesh_config::Topology;
use pdmesh_protocol::{
    EngineOutput, EngineOutputBatch, EngineRequest, EngineStats, Envelope, ErrorClass, FinishReason, KvTransferParams,
    KvUsage, MeshStats, Message as WireMessage, NodeReadiness, WireError,
};
use pdmesh_synthetic_executor::SyntheticTextCodec;
use pdmesh_transport::{bind_router, connect_push, PushHandle, RouterEvent, RouterHandle};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::auth::ApiKeys;
use crate::server::{app, start, AppState};
use crate::FrontendOptions;

/// What the fake dp-lb does with one `AddRequest`.
struct Script {
    reply: Option<WireMessage>,
    outputs: Vec<EngineOutput>,
}

type ScriptFn = Box<dyn Fn(&EngineRequest) -> Script + Send>;

fn output(id: &str, text: &str, finish: Option<FinishReason>) -> EngineOutput {
    EngineOutput {
        request_id: id.to_string(),
        new_token_ids: text.bytes().map(u32::from).collect(),
        new_logprobs: None,
        finish_reason: finish,
        stop_token_id: None,
        kv_transfer_params: None,
        num_external_tokens: 0,
        num_cached_tokens: 0,
        error: None,
    }
}

struct FakeLb {
    router: RouterHandle,
    push: PushHandle,
    script: ScriptFn,
    seen: Arc<Mutex<Vec<Envelope>>>,
    /// Engine ranks this fake dp-lb reports connected (of 1) to readiness queries.
    ranks_up: u32,
}

impl Actor for FakeLb {
    type Context = Context<Self>;
}

impl Handler<RouterEvent> for FakeLb {
    type Result = ();

    fn handle(&mut self, event: RouterEvent, _ctx: &mut Self::Context) {
        let RouterEvent::Message { peer, envelope } = event else { return };
        self.seen.lock().unwrap().push(envelope.clone());
        match &envelope.body {
            WireMessage::AddRequest(req) => {
                let script = (self.script)(req);
                if let Some(reply) = script.reply {
                    self.router.send(&peer, envelope.reply(reply)).unwrap();
                }
                for o in script.outputs {
                    let batch = EngineOutputBatch { engine_rank: 0, outputs: vec![o] };
                    self.push.send(Envelope::new(WireMessage::EngineOutputs(batch))).unwrap();
                }
            }
            WireMessage::StatsQuery => {
                let stats = MeshStats {
                    engines: vec![EngineStats {
                        engine_rank: 0,
                        kv: KvUsage {
                            total_blocks: 10,
                            free_blocks: 7,
                            used_blocks: 3,
                            held_blocks: 0,
                            leased_blocks: 0,
                            cached_blocks: 0,
                        },
                        ..Default::default()
                    }],
                    unreachable_ranks: vec![],
                };
                self.router.send(&peer, envelope.reply(WireMessage::StatsReply(stats))).unwrap();
            }
            WireMessage::ReadinessQuery => {
                let r = NodeReadiness { ranks: 1, ranks_up: self.ranks_up };
                self.router.send(&peer, envelope.reply(WireMessage::Readiness(r))).unwrap();
            }
            _ => {}
        }
    }
}

/// Push an arbitrary batch to the frontend.
#[derive(Message)]
#[rtype(result = "()")]
struct PushOutputs(Vec<EngineOutput>);

impl Handler<PushOutputs> for FakeLb {
    type Result = ();
    fn handle(&mut self, msg: PushOutputs, _ctx: &mut Self::Context) {
        let batch = EngineOutputBatch { engine_rank: 0, outputs: msg.0 };
        self.push.send(Envelope::new(WireMessage::EngineOutputs(batch))).unwrap();
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct StopLb;

/// Report this many engine ranks connected from now on.
#[derive(Message)]
#[rtype(result = "()")]
struct SetRanksUp(u32);

impl Handler<SetRanksUp> for FakeLb {
    type Result = ();
    fn handle(&mut self, msg: SetRanksUp, _ctx: &mut Self::Context) {
        self.ranks_up = msg.0;
    }
}

impl Handler<StopLb> for FakeLb {
    type Result = ();
    fn handle(&mut self, _msg: StopLb, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

struct Harness {
    state: web::Data<AppState>,
    lb: Addr<FakeLb>,
    seen: Arc<Mutex<Vec<Envelope>>>,
    addr: SocketAddr,
    run_dir: PathBuf,
    /// Stops the frontend as the service shell does (dropping it stops it too).
    trigger: pdmesh_service::ShutdownTrigger,
    /// The server under `serve_until_shutdown`: resolves once the stop has drained.
    stopped: tokio::task::JoinHandle<Result<(), crate::FrontendError>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

const MODEL: &str = "pdmesh-synthetic";

async fn harness(script: impl Fn(&EngineRequest) -> Script + Send + 'static) -> Harness {
    harness_full("", script, ApiKeys::default()).await
}

/// [`harness`] with API keys required.
async fn harness_with_keys(script: impl Fn(&EngineRequest) -> Script + Send + 'static, keys: ApiKeys) -> Harness {
    harness_full("", script, keys).await
}

/// A harness whose node has `node_toml` appended to its `[[nodes]]` table (e.g. limits).
async fn harness_with(node_toml: &str, script: impl Fn(&EngineRequest) -> Script + Send + 'static) -> Harness {
    harness_full(node_toml, script, ApiKeys::default()).await
}

async fn harness_full(
    node_toml: &str,
    script: impl Fn(&EngineRequest) -> Script + Send + 'static,
    keys: ApiKeys,
) -> Harness {
    let run_dir = std::env::temp_dir().join(format!("pdmesh-fe-{}", uuid::Uuid::new_v4().simple()));
    let topology = Topology::from_toml(&format!(
        "run_dir = {:?}\n[[nodes]]\nname = \"main\"\nhttp_port = 0\n{node_toml}\n",
        run_dir.display().to_string()
    ))
    .unwrap();
    let endpoints = topology.nodes[0].endpoints(&topology.run_dir);
    // the fake dp-lb binds first, as the real one does
    let seen = Arc::new(Mutex::new(Vec::new()));
    let ctx = Context::<FakeLb>::new();
    let router = bind_router(&endpoints.dplb_frontend.bind, ctx.address().recipient()).await.unwrap();
    let options = FrontendOptions {
        served_model_name: MODEL.into(),
        max_model_len: 64,
        vocab_size: 257,
        eos_token_ids: vec![256],
        rejection_notices: true,
    };
    let service = pdmesh_service::ServiceContext::start(topology, "main", pdmesh_config::Service::Frontend, 0).unwrap();
    let deadline = pdmesh_service::DEFAULT_SHUTDOWN_DEADLINE;
    let started = start(&service, Arc::new(SyntheticTextCodec), options, keys, deadline).await.unwrap();
    let push = connect_push(&endpoints.frontend_outputs.connect);
    let lb = ctx.run(FakeLb { router, push: push.clone(), script: Box::new(script), seen: seen.clone(), ranks_up: 1 });
    let addr = started.addrs[0];
    let (trigger, shutdown) = pdmesh_service::shutdown_channel(deadline);
    let server = started.server;
    let stopped = actix_web::rt::spawn(async move { crate::serve_until_shutdown(&service, server, shutdown).await });
    let state = started.state;
    for _ in 0..500 {
        if state.link.is_up() && push.is_up() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(state.link.is_up() && push.is_up(), "sockets did not connect");
    Harness { state, lb, seen, addr, run_dir, trigger, stopped }
}

/// Answer every request with Ack and then `text` in one-byte outputs, the last one finishing
/// with `finish`.
fn generates(text: &'static str, finish: Option<FinishReason>) -> impl Fn(&EngineRequest) -> Script + Send + 'static {
    move |req| {
        let n = text.len();
        let outputs = text
            .char_indices()
            .map(|(i, c)| output(&req.request_id, &c.to_string(), if i + 1 == n { finish } else { None }))
            .collect();
        Script { reply: Some(WireMessage::Ack), outputs }
    }
}

async fn call(h: &Harness, path: &str, body: Value, headers: &[(&str, &str)]) -> (StatusCode, Option<String>, Bytes) {
    let app = test::init_service(app(h.state.clone())).await;
    let mut req = test::TestRequest::post().uri(path).set_json(body);
    for (k, v) in headers {
        req = req.insert_header((*k, *v));
    }
    let res = test::call_service(&app, req.to_request()).await;
    let status = res.status();
    let id = res.headers().get("x-request-id").map(|v| v.to_str().unwrap().to_string());
    (status, id, test::read_body(res).await)
}

async fn get(h: &Harness, path: &str) -> (StatusCode, Bytes) {
    let app = test::init_service(app(h.state.clone())).await;
    let res = test::call_service(&app, test::TestRequest::get().uri(path).to_request()).await;
    (res.status(), test::read_body(res).await)
}

fn json_of(body: &Bytes) -> Value {
    serde_json::from_slice(body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(body)))
}

fn sse_events(body: &Bytes) -> Vec<Value> {
    let text = std::str::from_utf8(body).unwrap();
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap_or_else(|| panic!("bad event {e:?}"));
            if data == "[DONE]" {
                Value::String("[DONE]".into())
            } else {
                serde_json::from_str(data).unwrap()
            }
        })
        .collect()
}

fn added(h: &Harness) -> Vec<Envelope> {
    h.seen.lock().unwrap().iter().filter(|e| matches!(e.body, WireMessage::AddRequest(_))).cloned().collect()
}

/// Whether `engine_id` is the engine request id the frontend made for the client's `client_id`
/// (the client's id, a dash, 16 hex digits).
fn is_engine_id_of(engine_id: &str, client_id: &str) -> bool {
    engine_id
        .strip_prefix(client_id)
        .and_then(|rest| rest.strip_prefix('-'))
        .is_some_and(|suffix| suffix.len() == 16 && suffix.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Wait until the engine request of the client's request `id` is aborted.
async fn wait_for_abort(h: &Harness, id: &str) -> bool {
    for _ in 0..300 {
        let aborted = h.seen.lock().unwrap().iter().any(|e| match &e.body {
            WireMessage::Abort(a) => a.request_ids.iter().any(|r| is_engine_id_of(r, id)),
            _ => false,
        });
        if aborted {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[actix_web::test]
async fn completion_round_trip_follows_the_contract() {
    let h = harness(|req| {
        let mut last = output(&req.request_id, "ld", Some(FinishReason::Length));
        last.kv_transfer_params = Some(KvTransferParams {
            do_remote_prefill: Some(true),
            remote_block_ids: Some(vec![4, 5]),
            ..Default::default()
        });
        Script { reply: Some(WireMessage::Ack), outputs: vec![output(&req.request_id, "hello wor", None), last] }
    })
    .await;
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let (status, id, body) = call(
        &h,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "hi", "max_tokens": 11, "temperature": 0,
               "kv_transfer_params": {"do_remote_decode": true}}),
        &[("X-Request-Id", "req-1"), ("traceparent", traceparent), ("X-data-parallel-rank", "1")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(id.as_deref(), Some("req-1"));
    let v = json_of(&body);
    assert_eq!(v["id"], "cmpl-req-1");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["choices"][0]["text"], "hello world");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 2, "completion_tokens": 11, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 0}})
    );
    assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], true);
    assert_eq!(v["kv_transfer_params"]["remote_block_ids"], json!([4, 5]));

    let sent = added(&h);
    assert_eq!(sent.len(), 1);
    assert_eq!(pdmesh_telemetry::trace::trace_id(&sent[0].trace), "0af7651916cd43dd8448eb211c80319c");
    let WireMessage::AddRequest(req) = &sent[0].body else { unreachable!() };
    assert!(is_engine_id_of(&req.request_id, "req-1"), "{}", req.request_id);
    assert_eq!(sent[0].request_id.as_deref(), Some(req.request_id.as_str()));
    assert_eq!(req.client_request_id.as_deref(), Some("req-1"));
    assert_eq!(req.prompt_token_ids, vec![104, 105]);
    assert_eq!(req.sampling.max_tokens, 11);
    assert_eq!(req.sampling.temperature, 0.0);
    assert_eq!(req.eos_token_ids, vec![256]);
    assert_eq!(req.data_parallel_rank, Some(1));
    assert!(req.kv_transfer_params.as_ref().unwrap().wants_remote_decode());
    assert!(h.seen.lock().unwrap().iter().any(|e| matches!(e.body, WireMessage::Hello(_))));

    // an output for an id nobody waits for is counted, not an error
    let before = crate::metrics::UNKNOWN_OUTPUTS.get();
    h.lb.send(PushOutputs(vec![output("nobody", "x", None)])).await.unwrap();
    for _ in 0..300 {
        if crate::metrics::UNKNOWN_OUTPUTS.get() > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(crate::metrics::UNKNOWN_OUTPUTS.get() > before);
}

#[actix_web::test]
async fn stop_string_cuts_and_aborts() {
    let h = harness(generates("foo STOP bar", None)).await;
    let (status, _, body) = call(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 50, "stop": ["STOP"]}),
        &[("x-request-id", "s1")],
    )
    .await;
    assert_eq!(status, 200);
    let v = json_of(&body);
    assert_eq!(v["choices"][0]["text"], "foo ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], "STOP");
    assert!(wait_for_abort(&h, "s1").await, "the engine request must be aborted");
}

#[actix_web::test]
async fn chat_streams_with_role_content_finish_usage_done() {
    let h = harness(generates("hi there", Some(FinishReason::Stop))).await;
    let (status, id, body) = call(
        &h,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "yo"}], "stream": true,
               "stream_options": {"include_usage": true}, "max_completion_tokens": 20}),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(id.unwrap().len(), 32);
    let events = sse_events(&body);
    assert_eq!(events[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"].get(0).and_then(|c| c["delta"]["content"].as_str()).map(str::to_string))
        .collect();
    assert_eq!(text, "hi there");
    let n = events.len();
    assert_eq!(events[n - 1], "[DONE]");
    assert_eq!(events[n - 2]["choices"], json!([]));
    assert_eq!(events[n - 2]["usage"]["completion_tokens"], 8);
    assert_eq!(events[n - 3]["choices"][0]["finish_reason"], "stop");
    assert!(events.iter().all(|e| e == "[DONE]" || e["object"] == "chat.completion.chunk"));
    let WireMessage::AddRequest(req) = &added(&h)[0].body else { unreachable!() };
    assert_eq!(req.sampling.max_tokens, 20);
}

#[actix_web::test]
async fn streaming_stop_string_is_held_back() {
    let h = harness(generates("ab<e>cd", None)).await;
    let (status, _, body) =
        call(&h, "/v1/completions", json!({"prompt": "x", "stream": true, "stop": "<e>"}), &[("x-request-id", "hb")])
            .await;
    assert_eq!(status, 200);
    let events = sse_events(&body);
    let texts: Vec<&str> = events.iter().filter_map(|e| e["choices"].get(0)?["text"].as_str()).collect();
    assert_eq!(texts.concat(), "ab");
    assert!(texts.iter().all(|t| !t.contains('<')), "{texts:?}");
    assert_eq!(events[events.len() - 2]["choices"][0]["finish_reason"], "stop");
    assert!(wait_for_abort(&h, "hb").await);
}

#[actix_web::test]
async fn refusals_and_failures_map_to_statuses() {
    let h = harness(|req| match req.prompt_token_ids.first().copied() {
        Some(1) => Script {
            reply: Some(WireMessage::Error(WireError::new(ErrorClass::Unavailable, "no rank"))),
            outputs: vec![],
        },
        Some(2) => Script {
            reply: Some(WireMessage::Error(WireError::new(ErrorClass::InvalidRequest, "rank 9 out of range"))),
            outputs: vec![],
        },
        _ => {
            let mut o = output(&req.request_id, "", Some(FinishReason::Error));
            o.error = Some(
                if req.prompt_token_ids.first() == Some(&3) { "unavailable: rank died" } else { "KV load failed" }
                    .into(),
            );
            Script { reply: Some(WireMessage::Ack), outputs: vec![output(&req.request_id, "ab", None), o] }
        }
    })
    .await;
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": [1]}), &[]).await;
    assert_eq!(s, 503);
    assert_eq!(json_of(&b)["error"]["message"], "no rank");
    let (s, _, _) = call(&h, "/v1/completions", json!({"prompt": [2]}), &[("x-data-parallel-rank", "9")]).await;
    assert_eq!(s, 400);
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": [3]}), &[]).await;
    assert_eq!(s, 503, "{}", String::from_utf8_lossy(&b));
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": [4]}), &[]).await;
    assert_eq!(s, 500);
    assert_eq!(json_of(&b)["error"]["message"], "KV load failed");
    // streaming: the text so far, then an error event and [DONE]
    let (s, _, b) =
        call(&h, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "q"}], "stream": true}), &[])
            .await;
    assert_eq!(s, 200);
    let events = sse_events(&b);
    let n = events.len();
    assert_eq!(events[n - 1], "[DONE]");
    assert_eq!(events[n - 2]["error"]["code"], 500);
    assert_eq!(events[n - 2]["error"]["message"], "KV load failed");
}

#[actix_web::test]
async fn validation_errors_have_the_openai_shape() {
    let h = harness(generates("x", Some(FinishReason::Length))).await;
    let check = |status: StatusCode, body: &Bytes, want: u16, kind: &str| {
        assert_eq!(status.as_u16(), want, "{}", String::from_utf8_lossy(body));
        let v = json_of(body);
        assert_eq!(v["error"]["type"], kind, "{v}");
        assert_eq!(v["error"]["code"], want);
        assert!(v["error"]["message"].is_string() && v["error"].get("param").is_some());
    };
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "x", "model": "nope"}), &[]).await;
    check(s, &b, 404, "NotFoundError");
    assert_eq!(json_of(&b)["error"]["message"], "The model `nope` does not exist.");
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "x", "temperature": 3}), &[]).await;
    check(s, &b, 400, "invalid_request_error");
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "x", "temperature": "hot"}), &[]).await;
    check(s, &b, 400, "invalid_request_error");
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "x", "n": 0}), &[]).await;
    check(s, &b, 400, "invalid_request_error");
    let (s, id, b) =
        call(&h, "/v1/completions", json!({"prompt": "x"}), &[("x-request-id", "v1"), ("x-data-parallel-rank", "one")])
            .await;
    check(s, &b, 400, "invalid_request_error");
    assert_eq!(id.as_deref(), Some("v1"));
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "x".repeat(60), "max_tokens": 10}), &[]).await;
    check(s, &b, 400, "invalid_request_error");
    assert!(json_of(&b)["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("This model's maximum context length is 64 tokens."));
    let (s, _, b) =
        call(&h, "/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "x"}]}), &[]).await;
    check(s, &b, 400, "invalid_request_error");
    let (s, _, b) = call(&h, "/v1/chat/completions", json!({"messages": []}), &[]).await;
    check(s, &b, 400, "invalid_request_error");
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "x", "echo": true, "logprobs": 1}), &[]).await;
    check(s, &b, 400, "invalid_request_error");

    // malformed JSON and oversized bodies go through JsonConfig's error handler
    let app = test::init_service(app(h.state.clone())).await;
    let req = test::TestRequest::post().uri("/v1/completions").set_payload("{not json").to_request();
    let res = test::call_service(&app, req).await;
    let s = res.status();
    check(s, &test::read_body(res).await, 400, "invalid_request_error");
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(crate::server::MAX_BODY_BYTES));
    let req = test::TestRequest::post()
        .uri("/v1/completions")
        .insert_header(("content-type", "application/json"))
        .set_payload(big)
        .to_request();
    let res = test::call_service(&app, req).await;
    let s = res.status();
    check(s, &test::read_body(res).await, 413, "invalid_request_error");
    assert!(added(&h).is_empty(), "nothing invalid reaches the engine");
}

#[actix_web::test]
async fn concurrent_requests_get_their_own_outputs() {
    let h = harness(|req| {
        // echo the prompt back
        let text: String = req.prompt_token_ids.iter().map(|&t| t as u8 as char).collect();
        let n = text.len();
        let outputs = text
            .char_indices()
            .map(|(i, c)| output(&req.request_id, &c.to_string(), (i + 1 == n).then_some(FinishReason::Length)))
            .collect();
        Script { reply: Some(WireMessage::Ack), outputs }
    })
    .await;
    let app = test::init_service(app(h.state.clone())).await;
    let calls = (0..24).map(|i| {
        let prompt = format!("prompt number {i}");
        let req = test::TestRequest::post()
            .uri("/v1/completions")
            .set_json(json!({"prompt": prompt, "stream": i % 2 == 0}))
            .to_request();
        let app = &app;
        async move {
            let res = test::call_service(app, req).await;
            assert_eq!(res.status(), 200);
            let body = test::read_body(res).await;
            let text = if i % 2 == 0 {
                sse_events(&body)
                    .iter()
                    .filter_map(|e| e["choices"].get(0)?["text"].as_str().map(str::to_string))
                    .collect()
            } else {
                json_of(&body)["choices"][0]["text"].as_str().unwrap().to_string()
            };
            assert_eq!(text, prompt);
        }
    });
    futures::future::join_all(calls).await;
    let n = h.state.client.send(crate::engine_client::InFlightCount).await.unwrap();
    assert_eq!(n, 0);
}

/// A reused `X-Request-Id` (a client's or a proxy's retry) is two requests, never one: each
/// gets its own engine request id, so neither can alias the other's engine state or KV blocks,
/// and each gets its own answer under the client's id.
#[actix_web::test]
async fn a_reused_request_id_makes_two_engine_requests() {
    let h = harness(|_| Script { reply: Some(WireMessage::Ack), outputs: vec![] }).await;
    let app = test::init_service(app(h.state.clone())).await;
    let post = |prompt: &str| {
        test::TestRequest::post()
            .uri("/v1/completions")
            .insert_header(("x-request-id", "dup"))
            .set_json(json!({"prompt": prompt}))
            .to_request()
    };
    let answer = async {
        let mut engine_ids = Vec::new();
        for _ in 0..300 {
            engine_ids = added(&h)
                .iter()
                .filter_map(|e| match &e.body {
                    WireMessage::AddRequest(r) => Some(r.request_id.clone()),
                    _ => None,
                })
                .collect();
            if engine_ids.len() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(engine_ids.len(), 2, "both requests reach the engine");
        assert_ne!(engine_ids[0], engine_ids[1]);
        assert!(engine_ids.iter().all(|id| is_engine_id_of(id, "dup")), "{engine_ids:?}");
        let outputs = engine_ids.iter().map(|id| output(id, &format!("z-{id}"), Some(FinishReason::Length))).collect();
        h.lb.send(PushOutputs(outputs)).await.unwrap();
        engine_ids
    };
    let (a, b, engine_ids) =
        futures::join!(test::call_service(&app, post("x")), test::call_service(&app, post("y")), answer);
    let mut texts = Vec::new();
    for res in [a, b] {
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers().get("x-request-id").unwrap(), "dup");
        let v = json_of(&test::read_body(res).await);
        assert_eq!(v["id"], "cmpl-dup");
        texts.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    texts.sort();
    let mut expected: Vec<String> = engine_ids.iter().map(|id| format!("z-{id}")).collect();
    expected.sort();
    assert_eq!(texts, expected, "each request got its own output");
}

#[actix_web::test]
async fn link_down_fails_requests_in_flight_and_health() {
    let h = harness(|req| Script { reply: Some(WireMessage::Ack), outputs: vec![output(&req.request_id, "a", None)] })
        .await;
    let (s, b) = get(&h, "/health").await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b), json!({"status": "ready", "engine_ranks": 1, "engine_ranks_up": 1}));
    let (s, b) = get(&h, "/debug/kv").await;
    assert_eq!(s, 200);
    let kv = json_of(&b);
    assert_eq!(kv["total_blocks"], 10);
    assert_eq!(kv["free_blocks"], 7);
    assert_eq!(kv["held_requests"], json!([]));
    assert_eq!(kv["ranks"][0]["engine_rank"], 0);
    let (s, b) = get(&h, "/debug/engines").await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b)["engines"][0]["kv"]["used_blocks"], 3);
    let (s, b) = get(&h, "/v1/models").await;
    assert_eq!(s, 200);
    let m = json_of(&b);
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["data"][0]["max_model_len"], 64);
    assert_eq!(m["data"][0]["owned_by"], "pdmesh");

    let app = test::init_service(app(h.state.clone())).await;
    let hanging = test::TestRequest::post().uri("/v1/completions").set_json(json!({"prompt": "x"})).to_request();
    let streaming =
        test::TestRequest::post().uri("/v1/completions").set_json(json!({"prompt": "x", "stream": true})).to_request();
    let kill = async {
        while added(&h).len() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // let the Acks and the first outputs arrive: the requests are then being generated
        tokio::time::sleep(Duration::from_millis(200)).await;
        h.lb.send(StopLb).await.unwrap();
    };
    let run = async {
        let (a, b) = futures::join!(test::call_service(&app, hanging), test::call_service(&app, streaming));
        (a.status(), b.status(), test::read_body(a).await, test::read_body(b).await)
    };
    let ((sa, sb, ba, bb), ()) = tokio::time::timeout(Duration::from_secs(10), async { futures::join!(run, kill) })
        .await
        .expect("requests in flight must end when the link goes down");
    assert_eq!(sa, 503, "{}", String::from_utf8_lossy(&ba));
    let message = json_of(&ba)["error"]["message"].as_str().unwrap().to_string();
    assert!(message.starts_with("unavailable: lost the connection to the dp-lb"), "{message}");
    assert_eq!(sb, 200);
    let events = sse_events(&bb);
    assert_eq!(events[events.len() - 2]["error"]["code"], 503);
    assert_eq!(events[events.len() - 1], "[DONE]");
    let (s, b) = get(&h, "/health").await;
    assert_eq!(s, 503);
    assert_eq!(json_of(&b)["error"]["code"], 503);
    // not ready, but alive: an orchestrator must not restart the frontend for its dp-lb
    let (s, b) = get(&h, "/live").await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b), json!({"status": "alive"}));
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "x"}), &[]).await;
    assert_eq!(s, 503);
    assert!(json_of(&b)["error"]["message"].as_str().unwrap().starts_with("engine unavailable: "));
}

#[actix_web::test]
async fn health_waits_for_an_engine_rank_behind_the_dp_lb() {
    // the dp-lb is reachable but no rank has connected yet (workers still loading the model):
    // requests would be refused, so the node is not healthy
    let h = harness(|_| Script { reply: Some(WireMessage::Ack), outputs: vec![] }).await;
    h.lb.send(SetRanksUp(0)).await.unwrap();
    let (s, b) = get(&h, "/health").await;
    assert_eq!(s, 503, "{}", String::from_utf8_lossy(&b));
    let message = json_of(&b)["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("no engine rank is connected"), "{message}");
    h.lb.send(SetRanksUp(1)).await.unwrap();
    let (s, b) = get(&h, "/health").await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json_of(&b)["engine_ranks_up"], 1);
}

/// Send a raw HTTP/1.1 POST and return the connection.
async fn raw_post(addr: SocketAddr, request_id: &str, body: &Value) -> tokio::net::TcpStream {
    let body = body.to_string();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Request-Id: {request_id}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    conn
}

#[actix_web::test]
async fn client_disconnect_aborts_the_engine_request() {
    // the engine produces a little and then nothing: only the closed connection can tell
    let h =
        harness(|req| Script { reply: Some(WireMessage::Ack), outputs: vec![output(&req.request_id, "abc", None)] })
            .await;
    let mut conn = raw_post(h.addr, "gone", &json!({"prompt": "x", "stream": true, "max_tokens": 30})).await;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "connection closed early");
        seen.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&seen).to_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("x-request-id: gone") && head.contains("text/event-stream"), "{head}");
    drop(conn);
    assert!(wait_for_abort(&h, "gone").await, "a disconnect mid-stream must abort the engine request");

    // non-streaming: the handler is waiting for the end when the client leaves
    let conn = raw_post(h.addr, "gone-too", &json!({"prompt": "x", "max_tokens": 30})).await;
    while added(&h).len() < 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(conn);
    assert!(wait_for_abort(&h, "gone-too").await, "a non-streaming disconnect must abort the engine request");
    for _ in 0..300 {
        if h.state.client.send(crate::engine_client::InFlightCount).await.unwrap() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.state.client.send(crate::engine_client::InFlightCount).await.unwrap(), 0);
}

// ---- the Responses API ----

/// The typed SSE events of a Responses stream: `(event name, data)`.
fn typed_events(body: &Bytes) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(body).unwrap();
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (head, data) = e.split_once('\n').unwrap_or_else(|| panic!("bad event {e:?}"));
            let name = head.strip_prefix("event: ").unwrap_or_else(|| panic!("no event line {e:?}"));
            let data = data.strip_prefix("data: ").unwrap_or_else(|| panic!("no data line {e:?}"));
            (name.to_string(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

fn prompt_text(env: &Envelope) -> String {
    let WireMessage::AddRequest(req) = &env.body else { panic!("not an AddRequest") };
    req.prompt_token_ids.iter().map(|&t| t as u8 as char).collect()
}

fn p_params() -> Value {
    json!({"do_remote_prefill": true, "remote_engine_id": "p-engine", "remote_request_id": "p-req-7",
           "remote_block_ids": [3, 4], "remote_host": "10.0.0.2", "remote_port": 5600})
}

async fn wait_for_notice(h: &Harness, remote_request_id: &str) -> Option<pdmesh_protocol::RejectionNotice> {
    for _ in 0..300 {
        let found = h.seen.lock().unwrap().iter().find_map(|e| match &e.body {
            WireMessage::RejectionNotice(n) if n.params.remote_request_id.as_deref() == Some(remote_request_id) => {
                Some(n.clone())
            }
            _ => None,
        });
        if found.is_some() {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

#[actix_web::test]
async fn responses_round_trip_and_retrieval() {
    let h = harness(generates("hi there", Some(FinishReason::Stop))).await;
    let (status, id, body) = call(
        &h,
        "/v1/responses",
        json!({"model": MODEL, "input": "yo", "instructions": "be nice", "max_output_tokens": 20, "temperature": 0}),
        &[("x-request-id", "rr-1")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(id.as_deref(), Some("rr-1"));
    let v = json_of(&body);
    let resp_id = v["id"].as_str().unwrap().to_string();
    assert!(resp_id.starts_with("resp_"), "{resp_id}");
    assert_eq!(v["object"], "response");
    assert!(v["created_at"].as_u64().unwrap() > 0);
    assert_eq!(v["status"], "completed");
    assert!(v["incomplete_details"].is_null());
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["output"].as_array().unwrap().len(), 1);
    let item = &v["output"][0];
    assert_eq!(item["type"], "message");
    assert!(item["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(item["status"], "completed");
    assert_eq!(item["role"], "assistant");
    assert_eq!(item["content"], json!([{"type": "output_text", "text": "hi there", "annotations": []}]));
    assert_eq!(v["output_text"], "hi there");
    let prompt = "<system>be nice\n<user>yo\n<assistant>";
    let n = prompt.len() as u64;
    assert_eq!(
        v["usage"],
        json!({"input_tokens": n, "output_tokens": 8, "total_tokens": n + 8, "input_tokens_details": {"cached_tokens": 0}})
    );
    assert!(v["previous_response_id"].is_null());
    assert_eq!(v["store"], true);
    assert!(v.get("kv_transfer_params").is_some_and(Value::is_null));

    let sent = added(&h);
    assert_eq!(sent.len(), 1);
    assert_eq!(prompt_text(&sent[0]), prompt);
    let WireMessage::AddRequest(req) = &sent[0].body else { unreachable!() };
    assert_eq!(req.sampling.max_tokens, 20);
    assert_eq!(req.sampling.temperature, 0.0);

    let (s, b) = get(&h, &format!("/v1/responses/{resp_id}")).await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b), v);
    let (s, b) = get(&h, "/v1/responses/resp_unknown").await;
    assert_eq!(s, 404);
    let e = json_of(&b);
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert_eq!(e["error"]["code"], 404);
}

#[actix_web::test]
async fn responses_length_cap_is_incomplete_and_store_false_is_not_kept() {
    let h = harness(generates("abc", Some(FinishReason::Length))).await;
    let (status, _, body) =
        call(&h, "/v1/responses", json!({"input": "q", "max_output_tokens": 3, "store": false}), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v = json_of(&body);
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"], json!({"reason": "max_output_tokens"}));
    assert_eq!(v["output_text"], "abc");
    assert_eq!(v["store"], false);
    assert_eq!(v["max_output_tokens"], 3);
    let (s, _) = get(&h, &format!("/v1/responses/{}", v["id"].as_str().unwrap())).await;
    assert_eq!(s, 404);
    assert!(h.state.responses.is_empty());
}

#[actix_web::test]
async fn responses_stream_events_in_order() {
    let h = harness(generates("hi there", Some(FinishReason::Stop))).await;
    let (status, _, body) = call(
        &h,
        "/v1/responses",
        json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "yo"}]}], "stream": true}),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let events = typed_events(&body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let mut want =
        vec!["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"];
    want.extend(std::iter::repeat_n("response.output_text.delta", 8));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(names, want);
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i as u64);
    }
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert_eq!(events[0].1["response"]["output"], json!([]));
    let item_id = events[2].1["item"]["id"].as_str().unwrap().to_string();
    assert_eq!(events[2].1["item"]["status"], "in_progress");
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| {
            assert_eq!(d["item_id"], item_id.as_str());
            d["delta"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(deltas, "hi there");
    assert_eq!(events[12].1["text"], "hi there");
    assert_eq!(events[13].1["part"]["text"], "hi there");
    assert_eq!(events[14].1["item"]["content"][0]["text"], "hi there");
    assert_eq!(events[14].1["item"]["status"], "completed");
    let done = &events[15].1["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output_text"], deltas.as_str());
    assert_eq!(done["usage"]["output_tokens"], 8);
    assert_eq!(done["id"], events[0].1["response"]["id"]);
    // a streamed response is stored too
    let (s, b) = get(&h, &format!("/v1/responses/{}", done["id"].as_str().unwrap())).await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b)["output_text"], "hi there");
}

#[actix_web::test]
async fn responses_stream_engine_error_is_an_error_event() {
    let h = harness(|req| {
        let mut o = output(&req.request_id, "", Some(FinishReason::Error));
        o.error = Some("KV load failed".into());
        Script { reply: Some(WireMessage::Ack), outputs: vec![output(&req.request_id, "ab", None), o] }
    })
    .await;
    let (status, _, body) = call(&h, "/v1/responses", json!({"input": "q", "stream": true}), &[]).await;
    assert_eq!(status, 200);
    let events = typed_events(&body);
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error");
    assert_eq!(data["message"], "KV load failed");
    assert_eq!(data["code"], 500);
    assert!(events.iter().all(|(n, _)| n != "response.completed"));
    assert!(h.state.responses.is_empty());
}

#[actix_web::test]
async fn responses_previous_response_id_continues_the_conversation() {
    let h = harness(|req| {
        let text = if req.prompt_token_ids.len() < 40 { "first answer" } else { "second" };
        let n = text.len();
        let outputs = text
            .char_indices()
            .map(|(i, c)| output(&req.request_id, &c.to_string(), (i + 1 == n).then_some(FinishReason::Stop)))
            .collect();
        Script { reply: Some(WireMessage::Ack), outputs }
    })
    .await;
    let (s, _, b) = call(&h, "/v1/responses", json!({"input": "q1", "instructions": "sys"}), &[]).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let first = json_of(&b);
    assert_eq!(first["output_text"], "first answer");
    let first_id = first["id"].as_str().unwrap();
    let (s, _, b) = call(
        &h,
        "/v1/responses",
        json!({"input": [{"role": "user", "content": "q2"}], "previous_response_id": first_id, "max_output_tokens": 6}),
        &[],
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let second = json_of(&b);
    assert_eq!(second["previous_response_id"], first_id);
    assert_eq!(second["output_text"], "second");
    let sent = added(&h);
    assert_eq!(sent.len(), 2);
    // the earlier turn (its input and its output) is rendered before the new input; the
    // earlier instructions are not carried over
    let prompt = prompt_text(&sent[1]);
    assert_eq!(prompt, "<user>q1\n<assistant>first answer\n<user>q2\n<assistant>");
    let WireMessage::AddRequest(req) = &sent[1].body else { unreachable!() };
    let earlier: Vec<u32> = "first answer".bytes().map(u32::from).collect();
    assert!(req.prompt_token_ids.windows(earlier.len()).any(|w| w == earlier.as_slice()));
}

#[actix_web::test]
async fn responses_unknown_previous_response_id_is_404_and_notifies_p() {
    let h = harness(generates("x", Some(FinishReason::Stop))).await;
    let (s, id, b) = call(
        &h,
        "/v1/responses",
        json!({"input": "q", "previous_response_id": "resp_nope", "kv_transfer_params": p_params()}),
        &[("x-request-id", "np-1"), ("x-data-parallel-rank", "1")],
    )
    .await;
    assert_eq!(s, 404, "{}", String::from_utf8_lossy(&b));
    assert_eq!(id.as_deref(), Some("np-1"));
    let e = json_of(&b);
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert_eq!(e["error"]["param"], "previous_response_id");
    assert_eq!(e["error"]["message"], "Previous response with id 'resp_nope' not found.");
    assert_eq!(e["error"]["code"], 404);
    let notice = wait_for_notice(&h, "p-req-7").await.expect("a rejection notice must reach the dp-lb");
    assert_eq!(notice.params.remote_engine_id.as_deref(), Some("p-engine"));
    assert_eq!(notice.params.remote_block_ids, Some(vec![3, 4]));
    assert_eq!(notice.params.remote_host.as_deref(), Some("10.0.0.2"));
    assert_eq!(notice.params.remote_port, Some(5600));
    assert_eq!(notice.data_parallel_rank, Some(1));
    assert!(added(&h).is_empty(), "a refused request never reaches the engine");
}

#[actix_web::test]
async fn responses_template_error_is_400() {
    let h = harness(generates("x", Some(FinishReason::Stop))).await;
    let (s, _, b) = call(
        &h,
        "/v1/responses",
        json!({"input": [{"role": "wizard", "content": "x"}], "kv_transfer_params": p_params()}),
        &[],
    )
    .await;
    assert_eq!(s, 400, "{}", String::from_utf8_lossy(&b));
    let e = json_of(&b);
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(e["error"]["message"].as_str().unwrap().contains("template"), "{e}");
    assert!(wait_for_notice(&h, "p-req-7").await.is_some(), "a template refusal notifies P too");
    let (s, _, _) = call(&h, "/v1/responses", json!({"model": MODEL}), &[]).await;
    assert_eq!(s, 400, "input is required");
    assert!(added(&h).is_empty());
}

/// API keys over the real HTTP listener: every route but the probes needs a valid key, a
/// refusal is an OpenAI 401 that reaches no engine and is counted, and a valid key serves.
#[actix_web::test]
async fn api_keys_guard_everything_but_the_probes() {
    let h = harness_with_keys(generates("hi", Some(FinishReason::Stop)), ApiKeys::new(["sk-right", "sk-other"])).await;
    let client = reqwest::Client::new();
    let url = |p: &str| format!("http://{}{p}", h.addr);
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 2});
    let refused = |reason: &str| crate::metrics::UNAUTHORIZED_TOTAL.with_label_values(&[reason]).get();
    let (missing, invalid, malformed) = (refused("missing"), refused("invalid"), refused("malformed"));

    for auth in [None, Some("Bearer sk-wrong"), Some("Bearer sk-righ"), Some("Basic sk-right"), Some("sk-right")] {
        let mut rb = client.post(url("/v1/completions")).json(&body);
        if let Some(a) = auth {
            rb = rb.header("authorization", a);
        }
        let r = rb.send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{auth:?}");
        assert_eq!(r.headers()["www-authenticate"], "Bearer");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    assert!(added(&h).is_empty(), "no refused request reached the engine");
    assert!(refused("missing") > missing && refused("invalid") >= invalid + 2 && refused("malformed") >= malformed + 2);

    let r = client.post(url("/v1/completions")).bearer_auth("sk-other").json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["text"], "hi");
    assert_eq!(added(&h).len(), 1);

    // The admin routes need the key too: /debug/* reveal request ids, /v1/kv/release frees
    // blocks, /v1/kv/params hands a parked request its params (D66).
    for (method, path) in [
        ("GET", "/v1/models"),
        ("GET", "/debug/kv"),
        ("GET", "/debug/engines"),
        ("POST", "/v1/kv/release"),
        ("POST", "/v1/kv/params"),
        ("GET", "/nowhere"),
    ] {
        let rb = |key: Option<&str>| {
            let rb = if method == "GET" { client.get(url(path)) } else { client.post(url(path)).json(&json!({})) };
            match key {
                Some(k) => rb.bearer_auth(k),
                None => rb,
            }
        };
        assert_eq!(rb(None).send().await.unwrap().status().as_u16(), 401, "{path} without a key");
        let with_key = rb(Some("sk-right")).send().await.unwrap().status().as_u16();
        assert_ne!(with_key, 401, "{path} with the key");
    }
    // Probes stay open.
    for path in ["/health", "/live", "/metrics"] {
        let status = client.get(url(path)).send().await.unwrap().status().as_u16();
        assert_eq!(status, 200, "{path} without a key");
    }
    let metrics = client.get(url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("pdmesh_frontend_unauthorized_total{reason=\"missing\"}"), "listed in /metrics");
}

/// Without keys nothing is asked for (vLLM's default).
#[actix_web::test]
async fn without_api_keys_no_key_is_needed() {
    let h = harness(generates("ok", Some(FinishReason::Stop))).await;
    let client = reqwest::Client::new();
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 2});
    let r = client.post(format!("http://{}/v1/completions", h.addr)).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = client.get(format!("http://{}/debug/kv", h.addr)).bearer_auth("anything").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

// ---- overload control

/// `call`, with the response headers.
async fn call_with_headers(
    h: &Harness,
    path: &str,
    body: Value,
    headers: &[(&str, &str)],
) -> (StatusCode, actix_web::http::header::HeaderMap, Bytes) {
    let app = test::init_service(app(h.state.clone())).await;
    let mut req = test::TestRequest::post().uri(path).set_json(body);
    for (k, v) in headers {
        req = req.insert_header((*k, *v));
    }
    let res = test::call_service(&app, req.to_request()).await;
    let (status, headers) = (res.status(), res.headers().clone());
    (status, headers, test::read_body(res).await)
}

/// A 503 that tells the client to come back: `Retry-After` and the OpenAI error body.
fn assert_overloaded(status: StatusCode, headers: &actix_web::http::header::HeaderMap, body: &Bytes) {
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(body));
    let retry = headers.get("retry-after").expect("Retry-After on a 503").to_str().unwrap();
    assert!(retry.parse::<u32>().unwrap() >= 1, "{retry}");
    let v = json_of(body);
    assert_eq!(v["error"]["type"], "ServiceUnavailableError");
    assert_eq!(v["error"]["code"], 503);
    assert!(v["error"].get("param").is_some());
    assert!(v["error"]["message"].as_str().unwrap().starts_with("overloaded"), "{v}");
}

async fn added_count(h: &Harness) -> usize {
    added(h).len()
}

#[actix_web::test]
async fn requests_beyond_max_in_flight_get_503_retry_after_and_p_is_notified() {
    // the first request is accepted and then hangs until its output is pushed
    let rest = generates("ok", Some(FinishReason::Stop));
    let h = harness_with("limits = { max_in_flight = 1 }", move |req| {
        if req.client_request_id.as_deref() == Some("slow") {
            Script { reply: Some(WireMessage::Ack), outputs: vec![] }
        } else {
            rest(req)
        }
    })
    .await;
    let state = h.state.clone();
    let first = actix_web::rt::spawn(async move {
        let app = test::init_service(app(state)).await;
        let req = test::TestRequest::post()
            .uri("/v1/completions")
            .insert_header(("x-request-id", "slow"))
            .set_json(json!({"prompt": "a", "max_tokens": 5}));
        let res = test::call_service(&app, req.to_request()).await;
        (res.status(), test::read_body(res).await)
    });
    for _ in 0..300 {
        if added_count(&h).await == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(added_count(&h).await, 1);
    assert_eq!(h.state.in_flight.current(), 1);

    // the second one is refused at once, before the dp-lb hears of it, and P is told (R1)
    let refusals = crate::metrics::OVERLOAD_REFUSALS_TOTAL.with_label_values(&["frontend"]).get();
    let (status, headers, body) = call_with_headers(
        &h,
        "/v1/completions",
        json!({"prompt": "b", "max_tokens": 5, "kv_transfer_params": p_params()}),
        &[("x-request-id", "refused"), ("X-data-parallel-rank", "1")],
    )
    .await;
    assert_overloaded(status, &headers, &body);
    assert_eq!(headers.get("x-request-id").unwrap(), "refused");
    assert_eq!(crate::metrics::OVERLOAD_REFUSALS_TOTAL.with_label_values(&["frontend"]).get(), refusals + 1);
    assert_eq!(added_count(&h).await, 1, "the refused request never reached the dp-lb");
    let notice = wait_for_notice(&h, "p-req-7").await.expect("rejection notice for P");
    assert_eq!(notice.data_parallel_rank, Some(1));

    // the first request finishes: its place is free again
    let slow = added(&h)
        .iter()
        .find_map(|e| match &e.body {
            WireMessage::AddRequest(r) if r.client_request_id.as_deref() == Some("slow") => Some(r.request_id.clone()),
            _ => None,
        })
        .unwrap();
    h.lb.send(PushOutputs(vec![output(&slow, "hello", Some(FinishReason::Length))])).await.unwrap();
    let (status, body) = first.await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(h.state.in_flight.current(), 0);
    let (status, _, body) =
        call_with_headers(&h, "/v1/completions", json!({"prompt": "c", "max_tokens": 5}), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["choices"][0]["text"], "ok");
}

#[actix_web::test]
async fn a_stream_keeps_its_place_until_it_ends() {
    // The held stream gets one token and no end until the test pushes it: its place is taken
    // for as long as the test says, whatever the scheduling.
    let rest = generates("abc", Some(FinishReason::Stop));
    let h = harness_with("limits = { max_in_flight = 1 }", move |req| match req.client_request_id.as_deref() {
        Some("held") => Script { reply: Some(WireMessage::Ack), outputs: vec![output(&req.request_id, "x", None)] },
        _ => rest(req),
    })
    .await;
    let app = test::init_service(app(h.state.clone())).await;
    let req = test::TestRequest::post()
        .uri("/v1/completions")
        .insert_header(("x-request-id", "held"))
        .set_json(json!({"prompt": "a", "max_tokens": 5, "stream": true}));
    let res = test::call_service(&app, req.to_request()).await;
    assert_eq!(res.status(), 200);
    // the handler returned, the stream is not over: its place is still taken
    let (status, headers, body) = call_with_headers(&h, "/v1/completions", json!({"prompt": "b"}), &[]).await;
    assert_overloaded(status, &headers, &body);
    h.lb.send(PushOutputs(vec![output(&engine_id_of(&h, "held"), "y", Some(FinishReason::Stop))])).await.unwrap();
    let events = sse_events(&test::read_body(res).await);
    assert_eq!(events.last().unwrap(), "[DONE]");
    for _ in 0..300 {
        if h.state.in_flight.current() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.state.in_flight.current(), 0, "given back when the stream ended");
    let (status, _, _) = call_with_headers(&h, "/v1/completions", json!({"prompt": "c", "max_tokens": 3}), &[]).await;
    assert_eq!(status, 200);
}

#[actix_web::test]
async fn overload_refusals_from_the_dp_lb_and_the_engine_are_503_with_retry_after() {
    let h = harness(|req| match req.request_id.as_str() {
        "lb-full" => Script {
            reply: Some(WireMessage::Error(WireError::new(
                ErrorClass::Overloaded,
                "overloaded: every engine rank has engine.max_waiting = 128 requests waiting",
            ))),
            outputs: vec![],
        },
        _ => {
            let mut refused = output(&req.request_id, "", Some(FinishReason::Error));
            refused.error =
                Some("overloaded: the waiting queue is full (128 requests, engine.max_waiting = 128)".into());
            Script { reply: Some(WireMessage::Ack), outputs: vec![refused] }
        }
    })
    .await;
    let before = crate::metrics::REQUEST_ERRORS_TOTAL.with_label_values(&["overloaded"]).get();
    for id in ["lb-full", "engine-full"] {
        let (status, headers, body) = call_with_headers(
            &h,
            "/v1/completions",
            json!({"prompt": "b", "max_tokens": 5, "kv_transfer_params": p_params()}),
            &[("x-request-id", id)],
        )
        .await;
        assert_overloaded(status, &headers, &body);
    }
    assert_eq!(crate::metrics::REQUEST_ERRORS_TOTAL.with_label_values(&["overloaded"]).get(), before + 2);
    // R1: the dp-lb's refusal is a refusal before admission, so the frontend tells P
    assert!(wait_for_notice(&h, "p-req-7").await.is_some());
}

/// Digit `i % 10` of the text [`floods`] generates.
fn digit(i: usize) -> String {
    char::from(b'0' + (i % 10) as u8).to_string()
}

/// A frontend whose engine answers every request with 300 one-byte outputs (the fake engine
/// ignores max_tokens), digits in turn: more than the SSE body buffer and a 4-output buffer.
async fn floods() -> Harness {
    harness_with("limits = { output_buffer = 4 }", |req| {
        let outputs =
            (0..300).map(|i| output(&req.request_id, &digit(i), (i == 299).then_some(FinishReason::Length))).collect();
        Script { reply: Some(WireMessage::Ack), outputs }
    })
    .await
}

/// Start a streamed completion with request id `id` on `h`; its body is left unread.
async fn stalled_stream(h: &Harness, id: &str) -> actix_web::dev::ServiceResponse {
    let app = test::init_service(app(h.state.clone())).await;
    let req = test::TestRequest::post()
        .uri("/v1/completions")
        .insert_header(("x-request-id", id))
        .set_json(json!({"prompt": "a", "max_tokens": 60, "stream": true}));
    let res = test::call_service(&app, req.to_request()).await;
    assert_eq!(res.status(), 200);
    res.map_into_boxed_body()
}

#[actix_web::test]
async fn a_client_that_stops_reading_is_cut_off_at_the_output_buffer() {
    let h = floods().await;
    let before = crate::metrics::ABORTS_SENT_TOTAL.with_label_values(&["output_overflow"]).get();
    let res = stalled_stream(&h, "stalled").await;
    // nobody reads the body: the frontend stops buffering and aborts the engine request
    assert!(wait_for_abort(&h, "stalled").await, "the stalled request is aborted");
    assert_eq!(crate::metrics::ABORTS_SENT_TOTAL.with_label_values(&["output_overflow"]).get(), before + 1);
    // the client that finally reads gets what was buffered, then an error event, not a hang
    let body = test::read_body(res).await;
    let events = sse_events(&body);
    assert!(events.iter().any(|e| e["error"]["code"] == 503), "{}", String::from_utf8_lossy(&body));
    assert_eq!(events.last().unwrap(), "[DONE]");
    // what it got is the start of the text, without a hole where outputs were cut off
    let text: String = events.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
    let expected: String = (0..text.len()).map(digit).collect();
    assert!(!text.is_empty() && text.len() < 300, "{text}");
    assert_eq!(text, expected);
}

#[actix_web::test]
async fn a_cut_off_reaches_the_engine_client_that_follows_the_request() {
    // One thread serves the handlers of two frontends here: the first one's request starts the
    // thread's inbox (D77), the second one's request is then cut off at a full buffer, and its
    // abort must reach the second frontend's dp-lb, not the first's.
    let first = harness(generates("ok", Some(FinishReason::Length))).await;
    let (status, _, body) = call(&first, "/v1/completions", json!({"prompt": "a", "max_tokens": 2}), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let second = floods().await;
    let res = stalled_stream(&second, "stalled-2").await;
    assert!(wait_for_abort(&second, "stalled-2").await, "the second frontend aborts its stalled request");
    drop(res);
}

// ---- per-key bound (limits.max_in_flight_per_key)

/// A 429 that tells the client to come back: `Retry-After` and OpenAI's rate-limit body.
fn assert_rate_limited(status: StatusCode, headers: &actix_web::http::header::HeaderMap, body: &Bytes) {
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(body));
    let retry = headers.get("retry-after").expect("Retry-After on a 429").to_str().unwrap();
    assert!(retry.parse::<u32>().unwrap() >= 1, "{retry}");
    let v = json_of(body);
    assert_eq!(v["error"]["type"], "requests", "{v}");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    assert!(v["error"].get("param").is_some(), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().starts_with("rate limited"), "{v}");
}

/// Engine request id of the request the client sent as `client_id`.
fn engine_id_of(h: &Harness, client_id: &str) -> String {
    added(h)
        .iter()
        .find_map(|e| match &e.body {
            WireMessage::AddRequest(r) if r.client_request_id.as_deref() == Some(client_id) => {
                Some(r.request_id.clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no AddRequest for {client_id}"))
}

/// With `max_in_flight_per_key = 1`: a stream of key A — its first token sent, its end held
/// back by the fake engine — keeps A's place until its last event, so A's next request is a 429
/// that reaches no engine and, for a remote-prefill request, sends P its rejection notice (R1);
/// key B is served meanwhile, and so is the router's internal key while a stream of its own is
/// open; once A's stream ends, A is served again. Fails if the key is not taken from the auth
/// check, if the permit is given back with the handler instead of the stream, if the internal
/// key is bounded per key, or if a 429 forgets P.
#[actix_web::test]
async fn a_key_at_its_bound_gets_429_while_other_keys_are_served() {
    let keys = ApiKeys::with_internal(["sk-a", "sk-b"], Some("mesh-internal"));
    let rest = generates("abc", Some(FinishReason::Stop));
    let h = harness_full(
        "limits = { max_in_flight_per_key = 1 }",
        move |req| match req.client_request_id.as_deref() {
            Some("held-a" | "held-internal") => {
                Script { reply: Some(WireMessage::Ack), outputs: vec![output(&req.request_id, "x", None)] }
            }
            _ => rest(req),
        },
        keys,
    )
    .await;
    let app = test::init_service(app(h.state.clone())).await;
    let open = |id: &'static str, key: &'static str| {
        test::TestRequest::post()
            .uri("/v1/completions")
            .insert_header(("authorization", key))
            .insert_header(("x-request-id", id))
            .set_json(json!({"prompt": "a", "max_tokens": 5, "stream": true}))
            .to_request()
    };
    let held = test::call_service(&app, open("held-a", "Bearer sk-a")).await;
    assert_eq!(held.status(), 200);
    assert_eq!(added_count(&h).await, 1);

    let refusals = crate::metrics::KEY_LIMIT_REFUSALS_TOTAL.with_label_values(&["frontend"]).get();
    let errors = crate::metrics::REQUEST_ERRORS_TOTAL.with_label_values(&["rate_limited"]).get();
    let (status, headers, body) = call_with_headers(
        &h,
        "/v1/completions",
        json!({"prompt": "b", "max_tokens": 5, "kv_transfer_params": p_params()}),
        &[("authorization", "Bearer sk-a"), ("x-request-id", "over"), ("X-data-parallel-rank", "1")],
    )
    .await;
    assert_rate_limited(status, &headers, &body);
    assert_eq!(headers.get("x-request-id").unwrap(), "over");
    assert!(crate::metrics::KEY_LIMIT_REFUSALS_TOTAL.with_label_values(&["frontend"]).get() > refusals);
    assert!(crate::metrics::REQUEST_ERRORS_TOTAL.with_label_values(&["rate_limited"]).get() > errors);
    assert_eq!(added_count(&h).await, 1, "the refused request never reached the dp-lb");
    let notice = wait_for_notice(&h, "p-req-7").await.expect("a 429 on D tells P too (R1)");
    assert_eq!(notice.data_parallel_rank, Some(1));

    // The router's internal key carries every client of the router: with a stream of its own
    // open, it is still served (a bound of 1 would refuse it).
    let internal_held = test::call_service(&app, open("held-internal", "Bearer mesh-internal")).await;
    assert_eq!(internal_held.status(), 200);
    for other in ["Bearer sk-b", "Bearer mesh-internal"] {
        let (status, _, body) = call_with_headers(
            &h,
            "/v1/completions",
            json!({"prompt": "c", "max_tokens": 3}),
            &[("authorization", other)],
        )
        .await;
        assert_eq!(status, 200, "{other}: {}", String::from_utf8_lossy(&body));
    }
    let (status, headers, body) = call_with_headers(
        &h,
        "/v1/completions",
        json!({"prompt": "b", "max_tokens": 5}),
        &[("authorization", "Bearer sk-a")],
    )
    .await;
    assert_rate_limited(status, &headers, &body);

    // The held streams end: A's place is given back.
    for id in ["held-a", "held-internal"] {
        h.lb.send(PushOutputs(vec![output(&engine_id_of(&h, id), "y", Some(FinishReason::Stop))])).await.unwrap();
    }
    for res in [held, internal_held] {
        let events = sse_events(&test::read_body(res).await);
        assert_eq!(events.last().unwrap(), "[DONE]");
    }
    let a = h.state.api_keys.identify("sk-a").and_then(crate::auth::KeyMatch::client_key).unwrap();
    assert_eq!(h.state.key_limit.current(a), 0, "given back when the stream ended");
    let (status, _, body) = call_with_headers(
        &h,
        "/v1/completions",
        json!({"prompt": "d", "max_tokens": 3}),
        &[("authorization", "Bearer sk-a")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["choices"][0]["text"], "abc");
}

/// Shutdown through the handle (D47): once it fires, `/health` answers 503, the request in
/// flight still completes with its whole answer, and only then does the server stop and its
/// port refuse connections. Fails if the frontend dropped the request at the stop, stopped
/// before it was answered, kept answering `/health` with 200, or kept its listener.
#[actix_web::test]
async fn the_shutdown_handle_drains_the_request_in_flight_then_closes_the_port() {
    let mut h = harness(|_| Script { reply: Some(WireMessage::Ack), outputs: vec![] }).await;
    let url = format!("http://{}/v1/completions", h.addr);
    let client = actix_web::rt::spawn(async move {
        let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2});
        let res = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
        (res.status().as_u16(), res.json::<Value>().await.unwrap())
    });
    let id = loop {
        let seen = h.seen.lock().unwrap().iter().find_map(|e| match &e.body {
            WireMessage::AddRequest(r) => Some(r.request_id.clone()),
            _ => None,
        });
        if let Some(id) = seen {
            break id;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };

    h.trigger.trigger();
    while !h.state.readiness.is_draining() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(get(&h, "/health").await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!client.is_finished(), "the request in flight was answered before its output came");

    h.lb.send(PushOutputs(vec![output(&id, "ok", Some(FinishReason::Length))])).await.unwrap();
    let (status, body) = client.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], "ok", "{body}");
    tokio::time::timeout(Duration::from_secs(30), &mut h.stopped).await.unwrap().unwrap().unwrap();
    assert!(tokio::net::TcpStream::connect(h.addr).await.is_err(), "the listener is closed");
}

/// A wrong method on every known path is a 405 with `Allow` and the OpenAI body, counted
/// under `method_not_allowed`; an unknown path stays a 404 with the OpenAI body. Fails if a
/// route lost its default service (actix's empty 405/404) or the body/header changed shape.
#[actix_web::test]
async fn wrong_method_is_405_with_allow_and_an_openai_body() {
    let h = harness(generates("x", Some(FinishReason::Stop))).await;
    let app = test::init_service(app(h.state.clone())).await;
    let counted = || crate::metrics::REQUEST_ERRORS_TOTAL.with_label_values(&["method_not_allowed"]).get();
    let before = counted();
    let cases = [
        ("GET", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/responses", "POST"),
        ("DELETE", "/v1/responses/resp_x", "GET"),
        ("GET", "/v1/kv/release", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/health", "GET"),
        ("POST", "/live", "GET"),
        ("POST", "/metrics", "GET"),
        ("POST", "/debug/kv", "GET"),
        ("PATCH", "/debug/engines", "GET"),
    ];
    for (method, path, allow) in cases {
        let req = test::TestRequest::default()
            .method(actix_web::http::Method::from_bytes(method.as_bytes()).unwrap())
            .uri(path)
            .to_request();
        let res = test::call_service(&app, req).await;
        assert_eq!(res.status(), 405, "{method} {path}");
        assert_eq!(res.headers().get("allow").unwrap().to_str().unwrap(), allow, "{method} {path}");
        let e = json_of(&test::read_body(res).await);
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert_eq!(e["error"]["code"], 405, "{e}");
        assert!(e["error"]["param"].is_null(), "{e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains(&format!("{method} {path}")) && message.contains(allow), "{message}");
    }
    assert!(counted() >= before + cases.len() as u64, "every 405 is counted");
    let res = test::call_service(&app, test::TestRequest::get().uri("/v1/nowhere").to_request()).await;
    assert_eq!(res.status(), 404);
    let e = json_of(&test::read_body(res).await);
    assert_eq!(e["error"]["type"], "NotFoundError", "{e}");
    assert_eq!(e["error"]["message"], "no route for GET /v1/nowhere", "{e}");
    assert!(added(&h).is_empty());
}

/// With API keys, the key check runs before routing: a wrong method without a key is a 401
/// (nothing about the routes leaks to an unauthenticated caller), with a key it is the 405;
/// the open probes answer a wrong method with the 405 whatever the key.
#[actix_web::test]
async fn with_api_keys_the_401_comes_before_the_405() {
    let h = harness_with_keys(generates("hi", Some(FinishReason::Stop)), ApiKeys::new(["sk-right"])).await;
    let client = reqwest::Client::new();
    let url = |p: &str| format!("http://{}{p}", h.addr);
    assert_eq!(client.get(url("/v1/completions")).send().await.unwrap().status().as_u16(), 401);
    let r = client.get(url("/v1/completions")).bearer_auth("sk-right").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(r.headers()["allow"], "POST");
    let r = client.delete(url("/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405, "the probes are open, so their 405 is too");
}

/// Each field OpenAI or vLLM define with an effect this server does not honour is refused
/// with a 400 whose `param` names it, on the API it belongs to; the values that change
/// nothing are accepted. Fails if serde drops one of them silently again.
#[actix_web::test]
async fn unhonoured_fields_are_400_naming_the_field() {
    let h = harness(generates("ok", Some(FinishReason::Stop))).await;
    let completion = |extra: Value| {
        let mut b = json!({"model": MODEL, "prompt": "x", "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let chat = |extra: Value| {
        let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let responses = |extra: Value| {
        let mut b = json!({"model": MODEL, "input": "x", "max_output_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let refused = [
        // structured outputs and tools that cannot be served as given (D53, D54)
        ("/v1/chat/completions", chat(json!({"response_format": {"type": "yaml"}})), "response_format"),
        ("/v1/completions", completion(json!({"response_format": {"type": "json_schema"}})), "response_format"),
        ("/v1/chat/completions", chat(json!({"tools": [{"type": "retrieval"}]})), "tools"),
        ("/v1/completions", completion(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})), "tools"),
        ("/v1/chat/completions", chat(json!({"tool_choice": "required"})), "tool_choice"),
        ("/v1/chat/completions", chat(json!({"functions": [{"name": "f"}]})), "functions"),
        ("/v1/chat/completions", chat(json!({"guided_json": {"type": "objekt"}})), "guided_json"),
        ("/v1/completions", completion(json!({"guided_regex": "(a"})), "guided_regex"),
        ("/v1/completions", completion(json!({"guided_choice": []})), "guided_choice"),
        ("/v1/chat/completions", chat(json!({"structured_outputs": "json"})), "structured_outputs"),
        ("/v1/completions", completion(json!({"guided_regex": "a", "guided_choice": ["a"]})), "guided_choice"),
        ("/v1/completions", completion(json!({"min_p": 1.5})), "min_p"),
        ("/v1/chat/completions", chat(json!({"allowed_token_ids": [1, "x"]})), "allowed_token_ids"),
        ("/v1/chat/completions", chat(json!({"allowed_token_ids": [257]})), "allowed_token_ids"),
        ("/v1/responses", responses(json!({"min_p": 0.1})), "min_p"),
        ("/v1/chat/completions", chat(json!({"continue_final_message": true})), "continue_final_message"),
        ("/v1/chat/completions", chat(json!({"logit_bias": {"abc": 10}})), "logit_bias"),
        ("/v1/chat/completions", chat(json!({"logit_bias": {"5": 1000}})), "logit_bias"),
        ("/v1/completions", completion(json!({"logit_bias": {"257": 1}})), "logit_bias"),
        ("/v1/chat/completions", chat(json!({"n": 65})), "n"),
        ("/v1/completions", completion(json!({"echo": true, "logprobs": 0})), "echo"),
        ("/v1/chat/completions", chat(json!({"echo": true})), "echo"),
        ("/v1/chat/completions", chat(json!({"presence_penalty": 2.5})), "presence_penalty"),
        ("/v1/completions", completion(json!({"repetition_penalty": 0})), "repetition_penalty"),
        ("/v1/completions", completion(json!({"min_tokens": 9, "max_tokens": 2})), "min_tokens"),
        ("/v1/completions", completion(json!({"bad_words": "x"})), "bad_words"),
        ("/v1/completions", completion(json!({"truncate_prompt_tokens": 0})), "truncate_prompt_tokens"),
        ("/v1/responses", responses(json!({"bad_words": ["x"]})), "bad_words"),
        ("/v1/completions", completion(json!({"suffix": "tail"})), "suffix"),
        ("/v1/completions", completion(json!({"best_of": 3})), "best_of"),
        ("/v1/responses", responses(json!({"text": {"format": {"type": "json_object"}}})), "text"),
        ("/v1/responses", responses(json!({"tools": [{"type": "web_search"}]})), "tools"),
        ("/v1/responses", responses(json!({"reasoning": {"effort": "high"}})), "reasoning"),
        ("/v1/responses", responses(json!({"seed": 7})), "seed"),
        ("/v1/responses", responses(json!({"background": true})), "background"),
        ("/v1/responses", responses(json!({"n": 2})), "n"),
        (
            "/v1/chat/completions",
            chat(json!({"stream": true, "stream_options": {"continuous_usage_stats": true}})),
            "stream_options.continuous_usage_stats",
        ),
    ];
    for (path, body, param) in &refused {
        let (s, _, b) = call(&h, path, body.clone(), &[]).await;
        assert_eq!(s, 400, "{path} {body}: {}", String::from_utf8_lossy(&b));
        let e = json_of(&b);
        assert_eq!(e["error"]["param"], *param, "{path} {body}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(param), "the message names the field: {e}");
    }
    assert!(added(&h).is_empty(), "no refused request reached the engine");
    let accepted = [
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                                            "user": "u", "metadata": {"k": "v"}, "store": false, "min_p": 0.0})),
        ),
        ("/v1/completions", completion(json!({"response_format": {"type": "text"}, "user": "u", "seed": 3}))),
        ("/v1/completions", completion(json!({"guided_regex": "o+k", "guided_decoding_backend": "guidance"}))),
        ("/v1/chat/completions", chat(json!({"response_format": {"type": "json_object"}}))),
        (
            "/v1/responses",
            responses(json!({"text": {"format": {"type": "text"}}, "metadata": {"k": "v"},
                                          "user": "u", "truncation": "disabled", "tools": []})),
        ),
    ];
    for (path, body) in &accepted {
        let (s, _, b) = call(&h, path, body.clone(), &[]).await;
        assert_eq!(s, 200, "{path} {body}: {}", String::from_utf8_lossy(&b));
    }
    // logit_bias, min_p and allowed_token_ids reach the engine's sampler (issue 41)
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let extra = json!({"logit_bias": {"7": -100, "5": 2.5}, "min_p": 0.25, "allowed_token_ids": [5, 7, 9]});
        let body = if path == "/v1/completions" { completion(extra) } else { chat(extra) };
        let (s, _, b) = call(&h, path, body, &[]).await;
        assert_eq!(s, 200, "{path}: {}", String::from_utf8_lossy(&b));
        let sent = added(&h);
        let Some(WireMessage::AddRequest(r)) = sent.last().map(|e| &e.body) else { panic!("no request sent") };
        assert_eq!(r.sampling.logit_bias, vec![(5, 2.5), (7, -100.0)], "{path}");
        assert_eq!(r.sampling.min_p, 0.25, "{path}");
        assert_eq!(r.sampling.allowed_token_ids, vec![5, 7, 9], "{path}");
    }
}

/// Rule R1: a refused field on a request that carries P's blocks (`do_remote_prefill`) still
/// tells P to free them. Fails if the new check ran before the rejection-notice path.
#[actix_web::test]
async fn a_refused_field_on_a_remote_prefill_request_notifies_p() {
    let h = harness(generates("x", Some(FinishReason::Stop))).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                      "response_format": {"type": "yaml"}, "kv_transfer_params": p_params()});
    let (s, _, b) = call(&h, "/v1/chat/completions", body, &[]).await;
    assert_eq!(s, 400);
    assert_eq!(json_of(&b)["error"]["param"], "response_format");
    let notice = wait_for_notice(&h, "p-req-7").await.expect("P must be told");
    assert_eq!(notice.params.remote_block_ids, Some(vec![3, 4]));
    let body = json!({"input": "x", "text": {"format": {"type": "json_schema"}}, "kv_transfer_params": p_params()});
    let (s, _, _) = call(&h, "/v1/responses", body, &[]).await;
    assert_eq!(s, 400);
    assert!(added(&h).is_empty());
}

/// The router's id header: a well-formed id is the stored response's id; a malformed one, or
/// one already stored, is ignored (the node mints its own), so no header overwrites a response.
#[actix_web::test]
async fn responses_take_the_routers_id_only_when_new_and_well_formed() {
    let h = harness(generates("hi", Some(FinishReason::Stop))).await;
    let header = crate::handlers::responses::RESPONSE_ID_HEADER;
    let body = json!({"model": MODEL, "input": "yo", "max_output_tokens": 4});
    let (s, _, b) = call(&h, "/v1/responses", body.clone(), &[(header, "resp_d1_abc")]).await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b)["id"], "resp_d1_abc");
    let (s, _) = get(&h, "/v1/responses/resp_d1_abc").await;
    assert_eq!(s, 200);
    for bad in ["resp_d1_abc", "resp_", "nope", "resp_a b"] {
        let (s, _, b) = call(&h, "/v1/responses", body.clone(), &[(header, bad)]).await;
        assert_eq!(s, 200);
        let id = json_of(&b)["id"].as_str().unwrap().to_string();
        assert_ne!(id, bad);
        assert!(id.starts_with("resp_"));
    }
}

/// `n > 1` (D58): one engine request per choice, merged by `index`; only choice 0 carries P's
/// blocks (`kv_transfer_params`), the others get their own ids and `seed + index`; usage counts
/// every choice's tokens. Streamed, every chunk names its choice and `[DONE]` comes once.
#[actix_web::test]
async fn n_choices_fan_out_and_merge_by_index() {
    let h = harness(generates("hi there", Some(FinishReason::Stop))).await;
    let body = json!({"prompt": "yo", "n": 3, "seed": 7, "max_tokens": 20, "kv_transfer_params": p_params()});
    let (status, _, b) = call(&h, "/v1/completions", body, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    let v = json_of(&b);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!((c["index"].as_u64(), c["text"].as_str()), (Some(i as u64), Some("hi there")), "{v}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
    let reqs: Vec<EngineRequest> = added(&h)
        .into_iter()
        .filter_map(|e| match e.body {
            WireMessage::AddRequest(r) => Some(r),
            _ => None,
        })
        .collect();
    assert_eq!(reqs.len(), 3);
    let remote: Vec<&EngineRequest> = reqs.iter().filter(|r| r.kv_transfer_params.is_some()).collect();
    assert_eq!(remote.len(), 1, "only one choice reads P's blocks");
    let parent = &remote[0].request_id;
    let mut seeds: Vec<u64> = reqs.iter().filter_map(|r| r.sampling.seed).collect();
    seeds.sort_unstable();
    assert_eq!(seeds, [7, 8, 9]);
    assert!(reqs.iter().all(|r| r.request_id == *parent || r.request_id.starts_with(&format!("{parent}-"))));

    let chat = json!({"messages": [{"role": "user", "content": "yo"}], "n": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (status, _, b) = call(&h, "/v1/chat/completions", chat, &[]).await;
    assert_eq!(status, 200);
    let events = sse_events(&b);
    let mut texts = [String::new(), String::new()];
    for e in events.iter().filter(|e| *e != "[DONE]") {
        for c in e["choices"].as_array().unwrap() {
            texts[c["index"].as_u64().unwrap() as usize].push_str(c["delta"]["content"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(texts, ["hi there", "hi there"]);
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    assert_eq!(events[events.len() - 1], "[DONE]");
    assert_eq!(events[events.len() - 2]["usage"]["completion_tokens"], 16);
}

/// D72: a chat prompt the router already rendered and tokenised reaches the engine as those
/// ids, whatever the messages render to; ids outside the vocabulary or none at all are the
/// caller's error, and a request without them is rendered as ever.
#[actix_web::test]
async fn chat_takes_the_routers_prompt_token_ids_instead_of_rendering() {
    let h = harness(generates("ok", Some(FinishReason::Stop))).await;
    let chat = |internal: Option<Value>| {
        let mut body = json!({"messages": [{"role": "user", "content": "yo"}], "max_tokens": 4});
        if let Some(v) = internal {
            body["pdmesh_internal"] = v;
        }
        body
    };
    let (status, _, _) = call(&h, "/v1/chat/completions", chat(None), &[]).await;
    assert_eq!(status, 200);
    let rendered = prompt_text(&added(&h)[0]);
    assert!(rendered.contains("yo"), "rendered by the template: {rendered:?}");

    let ids: Vec<u32> = "abc".bytes().map(u32::from).collect();
    let (status, _, body) = call(&h, "/v1/chat/completions", chat(Some(json!({"prompt_token_ids": ids}))), &[]).await;
    assert_eq!(status, 200, "{body:?}");
    assert_eq!(prompt_text(&added(&h)[1]), "abc", "the router's ids, not a second rendering");
    assert_eq!(json_of(&body)["usage"]["prompt_tokens"], 3);

    for (bad, why) in [
        (json!({"prompt_token_ids": [1, 99_999_999]}), "out of vocabulary"),
        (json!({"prompt_token_ids": []}), "empty"),
    ] {
        let (status, _, body) = call(&h, "/v1/chat/completions", chat(Some(bad)), &[]).await;
        assert_eq!(status, 400, "{why}");
        let e = json_of(&body);
        assert_eq!(e["error"]["param"], "pdmesh_internal", "{why}: {e}");
        assert!(e["error"]["message"].as_str().unwrap_or_default().contains(why), "{e}");
    }
    assert_eq!(added(&h).len(), 2, "a refused request reaches no engine");
}

// ---- issue 40: no request may crash or hang a frontend ----

/// A JSON schema whose root is a chain of `depth` `$ref`s.
fn ref_chain_schema(depth: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..depth {
        // each an object whose one property is the next: the shape that overflowed at 300
        let next = if i + 1 == depth {
            json!({"type": "integer"})
        } else {
            json!({"type": "object", "properties": {"x": {"$ref": format!("#/$defs/a{}", i + 1)}}, "required": ["x"]})
        };
        defs.insert(format!("a{i}"), next);
    }
    json!({"$ref": "#/$defs/a0", "$defs": defs})
}

/// Defect 1: a 300-step `$ref` chain in `response_format` (or `guided_json`) overflowed the
/// stack and aborted the frontend (this test process, on the commit before the fix). Now it
/// is a 400 naming the limit, and the frontend serves the next request.
#[actix_web::test]
async fn deep_ref_schema_is_a_400_naming_the_limit_not_a_crash() {
    let h = harness(generates("7", Some(FinishReason::Stop))).await;
    let rf = json!({"type": "json_schema", "json_schema": {"name": "deep", "schema": ref_chain_schema(300)}});
    let (s, _, b) = call(
        &h,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "n"}], "response_format": rf}),
        &[],
    )
    .await;
    assert_eq!(s, 400, "{}", String::from_utf8_lossy(&b));
    let e = json_of(&b);
    assert_eq!(e["error"]["param"], "response_format");
    assert!(e["error"]["message"].as_str().unwrap().contains("limits.guided_max_ref_depth"), "{e}");
    let (s, _, b) =
        call(&h, "/v1/completions", json!({"prompt": "n", "guided_json": ref_chain_schema(300)}), &[]).await;
    assert_eq!(s, 400, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json_of(&b)["error"]["param"], "guided_json");
    // a chain within the limit is served
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "n", "guided_json": ref_chain_schema(20)}), &[]).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json_of(&b)["choices"][0]["text"], "7");
}

/// Defect 3: 100k `guided_choice` strings took 29 s to a 400 whose body carried a Rust
/// backtrace with build paths. Now the count is refused before any work, naming the field
/// and the limit, and no error body names a source file. `stop` and `tools` lists are
/// counted before they are read.
#[actix_web::test]
async fn huge_lists_are_400s_naming_field_and_limit_without_backtraces() {
    let h = harness(generates("a", Some(FinishReason::Stop))).await;
    let choices: Vec<String> = (0..100_000).map(|i| format!("option {i}")).collect();
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "n", "guided_choice": choices}), &[]).await;
    assert_eq!(s, 400, "{}", String::from_utf8_lossy(&b));
    let e = json_of(&b);
    let message = e["error"]["message"].as_str().unwrap();
    assert_eq!(e["error"]["param"], "guided_choice");
    assert!(message.contains("limits.guided_max_choices") && message.contains("100000"), "{message}");
    for leak in ["backtrace", ".rs:", "/src/", "panic"] {
        assert!(!message.contains(leak), "the error leaks `{leak}`: {message}");
    }
    let stops: Vec<String> = (0..100_000).map(|i| format!("s{i}")).collect();
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "n", "stop": stops}), &[]).await;
    assert_eq!(s, 400);
    assert_eq!(json_of(&b)["error"]["param"], "stop");
    let long_stop = "x".repeat(crate::validation::MAX_STOP_STRING_BYTES + 1);
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "n", "stop": [long_stop]}), &[]).await;
    assert_eq!(s, 400);
    assert!(json_of(&b)["error"]["message"].as_str().unwrap().contains("bytes"));
    let tool = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    let tools = vec![tool; crate::tools::max_tools() + 1];
    let (s, _, b) =
        call(&h, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "n"}], "tools": tools}), &[])
            .await;
    assert_eq!(s, 400, "{}", String::from_utf8_lossy(&b));
    let e = json_of(&b);
    assert_eq!(e["error"]["param"], "tools");
    assert!(e["error"]["message"].as_str().unwrap().contains("limits.max_tools"), "{e}");
    // the frontend serves on
    let (s, _, _) = call(&h, "/v1/completions", json!({"prompt": "n", "guided_choice": ["a", "b"]}), &[]).await;
    assert_eq!(s, 200);
}

/// Defect 4: a body trickled after its headers was never timed out. Now the client gets a
/// 408 once `limits.body_timeout_s` has passed, and the connection closes.
#[actix_web::test]
async fn slow_body_gets_408() {
    let h = harness_with("[nodes.limits]\nbody_timeout_s = 1\n", generates("a", Some(FinishReason::Stop))).await;
    let mut conn = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let head =
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n";
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(b"{\"prompt\": ").await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    // the server answers and closes; the outer timeout only keeps a broken build from hanging
    loop {
        let n = tokio::time::timeout(Duration::from_secs(20), conn.read(&mut buf))
            .await
            .expect("a slow body must be answered")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&seen).to_string();
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("limits.body_timeout_s"), "{text}");
    // a body sent in time is served as before
    let (s, _, _) = call(&h, "/v1/completions", json!({"prompt": "n"}), &[]).await;
    assert_eq!(s, 200);
}

/// Defect 2: a request whose outputs never come (an engine link that lost them) waited
/// forever and held its place under `max_in_flight`. Now it ends at `limits.request_deadline_s`
/// with a 504 (an error event on a stream), the engine is told to abort it, and nothing of it
/// stays in flight.
#[actix_web::test]
async fn requests_end_at_their_deadline_and_are_aborted() {
    let h = harness_with(
        "[nodes.limits]\nrequest_deadline_s = 1\n",
        // accepted, then silence: the outputs are lost
        |_| Script { reply: Some(WireMessage::Ack), outputs: vec![] },
    )
    .await;
    let app = test::init_service(app(h.state.clone())).await;
    let plain = test::TestRequest::post()
        .uri("/v1/completions")
        .insert_header(("X-Request-Id", "late"))
        .set_json(json!({"prompt": "x"}))
        .to_request();
    let streamed = test::TestRequest::post()
        .uri("/v1/completions")
        .insert_header(("X-Request-Id", "late-stream"))
        .set_json(json!({"prompt": "x", "stream": true}))
        .to_request();
    let run = async {
        let (a, b) = futures::join!(test::call_service(&app, plain), test::call_service(&app, streamed));
        (a.status(), b.status(), test::read_body(a).await, test::read_body(b).await)
    };
    let (sa, sb, ba, bb) =
        tokio::time::timeout(Duration::from_secs(30), run).await.expect("requests must end at their deadline");
    assert_eq!(sa, 504, "{}", String::from_utf8_lossy(&ba));
    assert!(json_of(&ba)["error"]["message"].as_str().unwrap().contains("limits.request_deadline_s"));
    assert_eq!(sb, 200);
    let events = sse_events(&bb);
    assert_eq!(events[events.len() - 2]["error"]["code"], 504, "{events:?}");
    assert!(wait_for_abort(&h, "late").await && wait_for_abort(&h, "late-stream").await);
    assert_eq!(h.state.client.send(crate::engine_client::InFlightCount).await.unwrap(), 0);
    assert_eq!(h.state.in_flight.current(), 0);
}

/// Completions `echo`: the prompt's text before the completion's, whole and streamed (a first
/// chunk); a prompt given as token ids is decoded.
#[actix_web::test]
async fn echo_puts_the_prompt_before_the_completion() {
    let h = harness(generates("ok", Some(FinishReason::Stop))).await;
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": "say", "max_tokens": 4, "echo": true}), &[]).await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b)["choices"][0]["text"], "sayok");
    let ids: Vec<u32> = "hi".bytes().map(u32::from).collect();
    let (s, _, b) = call(&h, "/v1/completions", json!({"prompt": ids, "max_tokens": 4, "echo": true}), &[]).await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b)["choices"][0]["text"], "hiok");
    let body = json!({"prompt": "say", "max_tokens": 4, "echo": true, "stream": true});
    let (s, _, b) = call(&h, "/v1/completions", body, &[]).await;
    assert_eq!(s, 200);
    let texts: Vec<String> = sse_events(&b)
        .iter()
        .filter_map(|e| e["choices"].get(0).and_then(|c| c["text"].as_str()).map(str::to_string))
        .collect();
    assert_eq!(texts.first().map(String::as_str), Some("say"), "{texts:?}");
    assert_eq!(texts.concat(), "sayok");
}
