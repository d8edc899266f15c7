//! Request migration (D56): a decode stream that breaks mid-generation goes on on another
//! decode node, and the client sees one uninterrupted stream.
//!
//! The router asks D for the ids of the tokens of every chunk (`pdmesh_internal.
//! stream_token_ids`, [`pdmesh_protocol::node_http`]): D writes them in a comment line of each event, which
//! the router reads and drops, passing the chunk itself on as it came (D73).
//! When D's stream breaks — the connection resets or ends before `[DONE]`, or D sends an error
//! event of a 5xx kind (its engine died) — the router sends the client's own request to
//! another decode node with `resume_token_ids` = every id the client saw: that node prefills
//! prompt + those tokens itself (no P, no KV transfer), resumes the output processor after
//! them (so text, stop strings and usage go on exactly), and continues with the same sampling
//! (greedy, or seeded from the same output index). Its role chunk is dropped and its chunks get
//! the first stream's `created`, so the client sees no seam. At most `router.max_migrations`
//! moves per request; each counts in `pdmesh_router_migrations_total` and is an event on the
//! request's span. Tokens the first node had generated but not yet sent are generated again:
//! never shown twice, never missing.
//!
//! A stream on a node that turned slow moves the same way (D104, reason `slow_stream`): when
//! `router.slow_migrate_tokens` tokens in a row came more than `router.slow_migrate_ratio`
//! times the median gap of the other decode nodes in rotation apart, and another node could
//! take it. The slow node is then left out of the rotation until a probe finds it fast
//! ([`super::probe`]). Unlike a broken stream, the slow one goes on until the other node has
//! answered: if none takes the request, it finishes where it was.

use std::convert::Infallible;
use std::sync::LazyLock;
use std::time::Instant;

use actix_web::{web, HttpRequest, HttpResponse};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use pdmesh_protocol::TraceContext;
use pdmesh_telemetry::metrics::counter_vec;
use prometheus::IntCounterVec;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{forward_headers, Leg, RouterState};
use pdmesh_http_edge::error::ApiError;
use pdmesh_http_edge::headers::REQUEST_ID;
use pdmesh_http_edge::sse::{sse_data, sse_done, sse_error};
use pdmesh_protocol::node_http::{TOKEN_IDS_COMMENT, TOKEN_IDS_FIELD};

/// Requests moved to another decode node, by `reason` (`stream_broke`: the connection broke or
/// ended early; `error_event`: D sent a 5xx error event; `no_answer`: D failed before its
/// answer started; `slow_stream`: its tokens came too slowly, D104).
pub const MIGRATIONS: &str = "pdmesh_router_migrations_total";

pub(super) static MIGRATIONS_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(MIGRATIONS, "Requests moved to another decode node mid-generation, by reason", &["reason"])
});

/// The body of a decode call that continues a request after `seen` tokens: the client's own
/// body without P's params (the node prefills itself), asking for token ids.
pub(super) fn continuation_body(original: &Value, seen: &[u32]) -> Value {
    let mut body = original.clone();
    if let Some(o) = body.as_object_mut() {
        o.remove("kv_transfer_params");
    }
    body[pdmesh_protocol::node_http::INTERNAL_FIELD][pdmesh_protocol::node_http::internal::STREAM_TOKEN_IDS] =
        json!(true);
    body[pdmesh_protocol::node_http::INTERNAL_FIELD][pdmesh_protocol::node_http::internal::RESUME_TOKEN_IDS] =
        json!(seen);
    body
}

/// Everything a relay needs to move its request.
pub(super) struct Relay {
    pub st: web::Data<RouterState>,
    pub req: HttpRequest,
    pub path: &'static str,
    pub request_id: String,
    pub original: Value,
    pub span: tracing::Span,
    pub client_trace: TraceContext,
    pub authorization: Option<String>,
    /// The decode node streaming now.
    pub d: usize,
    pub migrations: u32,
    /// Held as long as the answer streams (permits, the decode span).
    pub hold: Box<dyn std::any::Any>,
}

/// Answer the client with a stream relayed from `upstream` (D's successful SSE answer), moved
/// to another decode node if it breaks.
pub(super) fn respond(relay: Relay, upstream: reqwest::Response) -> HttpResponse {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let request_id = relay.request_id.clone();
    actix_web::rt::spawn(run(relay, upstream, tx));
    let body = tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<Bytes, Infallible>);
    let mut res = HttpResponse::Ok();
    res.content_type("text/event-stream").insert_header(("Cache-Control", "no-cache"));
    res.insert_header((REQUEST_ID, request_id));
    res.streaming(body)
}

/// How one upstream stream ended.
enum Pumped {
    /// `[DONE]` passed on: the request is over.
    Done,
    /// The client went away: dropping the upstream aborts the request on D.
    ClientGone,
    /// D failed mid-stream; `reason` is the metric label.
    Broken { reason: &'static str, detail: String },
    /// D's tokens come too slowly (D104); the stream is whole and could go on.
    Slow { detail: String },
}

/// When a stream is slow enough to move (D104): `router.slow_migrate_ratio` and
/// `router.slow_migrate_tokens`.
#[derive(Debug, Clone, Copy)]
pub(super) struct SlowRule {
    pub ratio: f64,
    pub tokens: u32,
}

/// A stream's run of slow tokens ([`SlowRule`]).
#[derive(Debug, Default)]
struct SlowRun {
    tokens: u32,
}

impl SlowRun {
    /// Count an event of `ids` tokens that came `gap` seconds per token after the previous one,
    /// against `reference` (the median gap of the other decode nodes); true once the run is long
    /// enough to move.
    fn note(&mut self, rule: SlowRule, gap: f64, ids: usize, reference: Option<f64>) -> bool {
        match reference {
            Some(r) if gap > rule.ratio * r => {
                self.tokens = self.tokens.saturating_add(u32::try_from(ids).unwrap_or(u32::MAX));
            }
            _ => self.tokens = 0,
        }
        self.tokens >= rule.tokens
    }
}

/// What the relay learned from the events so far.
#[derive(Default)]
struct Seen {
    ids: Vec<u32>,
    /// The first stream's `created`, which a continuation's chunks take.
    created: Option<u64>,
    finished: bool,
    /// Drop the next role chunk (a continuation's opening chunk).
    skip_role: bool,
}

async fn run(r: Relay, upstream: reqwest::Response, tx: mpsc::Sender<Bytes>) {
    run_from(r, upstream, tx, Seen::default()).await;
}

/// Relay `upstream` after what the client has `seen`, moving the request when it breaks or
/// turns slow.
async fn run_from(mut r: Relay, mut upstream: reqwest::Response, tx: mpsc::Sender<Bytes>, mut seen: Seen) {
    let st = r.st.clone();
    let mut in_flight = st.decode.start(r.d);
    // Bytes of an event not complete yet: kept across a slow stream that could not move.
    let mut buf = BytesMut::new();
    let mut slow_rule = st.slow_migrate;
    loop {
        let (reason, detail) = match pump(&st, r.d, &mut upstream, &tx, &mut seen, &r.span, &mut buf, slow_rule).await {
            Pumped::Done | Pumped::ClientGone => return,
            Pumped::Broken { reason, detail } => (reason, detail),
            Pumped::Slow { detail } => {
                let from = r.d;
                st.decode.leave_out(from, "a stream on it was slow");
                match move_on(&mut r, &seen, "slow_stream", &detail).await {
                    Some((to, next)) => {
                        // Dropping the slow stream aborts the request there (its blocks go).
                        r.d = to;
                        in_flight = st.decode.start(to);
                        upstream = next;
                        buf.clear();
                        seen.skip_role = true;
                    }
                    None => {
                        tracing::warn!(parent: &r.span, request_id = %r.request_id, detail,
                            "no other decode node took the slow stream; it goes on where it is");
                        slow_rule = None;
                    }
                }
                continue;
            }
        };
        st.decode.failure(r.d, reason);
        drop(in_flight);
        if seen.finished {
            // The last chunk got through; only `[DONE]` was lost.
            let _ = tx.send(sse_done()).await;
            return;
        }
        let Some((to, next)) = move_on(&mut r, &seen, reason, &detail).await else {
            let e = ApiError::Unavailable(format!("unavailable: the decode node's stream broke: {detail}"));
            e.record();
            let _ = tx.send(sse_error(&e)).await;
            return;
        };
        r.d = to;
        in_flight = st.decode.start(to);
        upstream = next;
        buf.clear();
        seen.skip_role = true;
    }
}

/// The hand-over of P's params to a parked decode leg (D66): `Err` when D did not take them.
pub(super) type Handover = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>>>>;

/// Answer the client with P's token (D63, [`super::first_token`]), then with `upstream`: the
/// stream of a decode node that read P's blocks and resumed after that token. Called once D
/// has answered (its status and headers only: it has admitted the request), so a refusal by D
/// still reaches the client with its own status; the token goes out without waiting for D's
/// read or forward. Moves like any relayed stream if D breaks later.
pub(super) fn respond_after_first_token(
    relay: Relay,
    first: super::first_token::FirstToken,
    upstream: reqwest::Response,
    handover: Option<Handover>,
) -> HttpResponse {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let request_id = relay.request_id.clone();
    super::first_token::FIRST_TOKEN_FROM_PREFILL_TOTAL.inc();
    actix_web::rt::spawn(async move {
        for chunk in &first.chunks {
            if tx.send(sse_data(chunk)).await.is_err() {
                return; // the client went away: dropping D's answer aborts the request there
            }
        }
        tracing::info!(parent: &relay.span, token_id = first.id, "first token from the prefill node");
        let mut seen = Seen { ids: vec![first.id], created: Some(first.created), finished: false, skip_role: true };
        let Some(handover) = handover else {
            return run_from(relay, upstream, tx, seen).await;
        };
        // D66: D's leg was parked; P's params went to it while the token went out. If D did not
        // take them, nothing of D reached the client: the request moves on after the token,
        // and P's blocks went back with the handover's guard.
        let mut relay = relay;
        match handover.await {
            Ok(()) => run_from(relay, upstream, tx, seen).await,
            Err(detail) => {
                drop(upstream);
                relay.st.decode.failure(relay.d, "reset");
                match move_on(&mut relay, &seen, "params_not_taken", &detail).await {
                    Some((to, next)) => {
                        relay.d = to;
                        seen.skip_role = true;
                        run_from(relay, next, tx, seen).await
                    }
                    None => {
                        let e =
                            ApiError::Unavailable(format!("unavailable: no decode node took the request: {detail}"));
                        e.record();
                        let _ = tx.send(sse_error(&e)).await;
                    }
                }
            }
        }
    });
    let body = tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<Bytes, Infallible>);
    let mut res = HttpResponse::Ok();
    res.content_type("text/event-stream").insert_header(("Cache-Control", "no-cache"));
    res.insert_header((REQUEST_ID, request_id));
    res.streaming(body)
}

/// Find another decode node that takes the request after `seen.ids`: up to the request's
/// remaining migrations, each node tried once. `None`: none did.
async fn move_on(
    r: &mut Relay,
    seen: &Seen,
    mut reason: &'static str,
    detail: &str,
) -> Option<(usize, reqwest::Response)> {
    let st = r.st.clone();
    let mut tried = vec![r.d];
    let mut from = r.d;
    while r.migrations < st.max_migrations {
        let to = st.decode.pick(&tried)?;
        tried.push(to);
        r.migrations += 1;
        MIGRATIONS_TOTAL.with_label_values(&[reason]).inc();
        let (from_url, to_url) = (st.decode.url(from).unwrap_or_default(), st.decode.url(to).unwrap_or_default());
        if reason == "slow_stream" {
            tracing::warn!(parent: &r.span, request_id = %r.request_id, from = from_url, to = to_url,
                tokens_seen = seen.ids.len(), migration = r.migrations, reason, detail,
                "decode stream slow; the request moves to another decode node");
        } else {
            tracing::warn!(parent: &r.span, request_id = %r.request_id, from = from_url, to = to_url,
                tokens_seen = seen.ids.len(), migration = r.migrations, reason, detail,
                "decode stream broke; the request moves to another decode node");
        }
        let body = continuation_body(&r.original, &seen.ids);
        let (res, d_span) = call_decode(r, to, &to_url, &body, seen.ids.len()).await;
        match res {
            Ok(res) if res.status().is_success() => {
                r.hold = Box::new((std::mem::replace(&mut r.hold, Box::new(())), d_span));
                return Some((to, res));
            }
            Ok(res) if res.status().is_server_error() && res.status() != reqwest::StatusCode::SERVICE_UNAVAILABLE => {
                st.decode.failure(to, "5xx");
            }
            Ok(res) => {
                // Refused (overloaded, or the continuation itself is invalid): try another.
                tracing::warn!(parent: &r.span, upstream = to_url, status = res.status().as_u16(),
                    "the decode node refused the continuation");
            }
            Err(e) => {
                st.decode.failure(to, if e.is_connect() { "connect" } else { "reset" });
            }
        }
        from = to;
        reason = "no_answer";
    }
    None
}

/// One streamed decode call of the relay's request to node `to` (at `url`), counted on it
/// while the answer's headers come, in its own `router.decode` span (returned: it covers the
/// stream that follows).
async fn call_decode(
    r: &Relay,
    to: usize,
    url: &str,
    body: &Value,
    resumed_tokens: usize,
) -> (reqwest::Result<reqwest::Response>, tracing::Span) {
    let st = &r.st;
    let d_span = tracing::info_span!(parent: &r.span, "router.decode", otel.kind = "client", upstream = %url,
        stream = true, resumed_tokens);
    let d_trace = pdmesh_telemetry::trace::outgoing(&d_span, &r.client_trace);
    let rb = forward_headers(
        &r.req,
        st.client().post(format!("{url}{}", r.path)),
        &r.request_id,
        Leg::Decode,
        &d_trace,
        r.authorization.as_deref(),
    );
    let _counted = st.decode.start(to);
    let res = tracing::Instrument::instrument(rb.json(body).send(), d_span.clone()).await;
    (res, d_span)
}

/// Relay one upstream stream's events to the client until it ends, or, with `slow`, until its
/// tokens come too slowly and the request could move (events are relayed whole; `buf` keeps
/// the bytes of the next one).
#[allow(clippy::too_many_arguments)]
async fn pump(
    st: &RouterState,
    d: usize,
    upstream: &mut reqwest::Response,
    tx: &mpsc::Sender<Bytes>,
    seen: &mut Seen,
    span: &tracing::Span,
    buf: &mut BytesMut,
    slow: Option<SlowRule>,
) -> Pumped {
    let mut answered = false;
    let mut last_tokens: Option<Instant> = None;
    let mut slow_run = SlowRun::default();
    loop {
        // Complete events first: a stream resumed after a slow one that could not move may
        // hold some already (its `[DONE]` among them).
        while let Some(end) = first_event_end(buf) {
            let event = buf.split_to(end).freeze();
            let (out, ids) = match relay_event(event, seen) {
                Relayed::Send(out, ids) => (out, ids),
                Relayed::Skip => continue,
                Relayed::Done => {
                    let _ = tx.send(sse_done()).await;
                    return Pumped::Done;
                }
                Relayed::Failed(detail) => return Pumped::Broken { reason: "error_event", detail },
            };
            let first_relayed = ids > 0 && seen.ids.len() == ids;
            let mut slowed = None;
            if ids > 0 {
                let now = Instant::now();
                if let Some(t) = last_tokens {
                    let gap = now.duration_since(t).as_secs_f64() / ids as f64;
                    st.decode.observe_latency(d, gap);
                    if let Some(rule) = slow {
                        let reference = st.decode.reference(d, super::balance::Reference::Median);
                        if slow_run.note(rule, gap, ids, reference) && !seen.finished && st.decode.has_alternative(d) {
                            slowed = Some(format!(
                                "{} tokens in a row above {:.1}x the other decode nodes' median gap ({:.1} ms; the last {:.1} ms)",
                                slow_run.tokens,
                                rule.ratio,
                                reference.unwrap_or(0.0) * 1e3,
                                gap * 1e3
                            ));
                        }
                    }
                }
                last_tokens = Some(now);
            }
            if tx.send(out).await.is_err() {
                return Pumped::ClientGone;
            }
            if first_relayed {
                // The router's share of the first token's path ends here (ttft-breakdown.sh).
                tracing::info!(parent: span, "first token relayed");
            }
            if let Some(detail) = slowed {
                return Pumped::Slow { detail };
            }
        }
        let chunk = tokio::select! {
            biased;
            _ = tx.closed() => return Pumped::ClientGone,
            chunk = upstream.chunk() => chunk,
        };
        let bytes = match chunk {
            Ok(Some(b)) => b,
            Ok(None) => {
                return Pumped::Broken { reason: "stream_broke", detail: "the stream ended before [DONE]".into() }
            }
            Err(e) => return Pumped::Broken { reason: "stream_broke", detail: e.to_string() },
        };
        if !answered {
            answered = true;
            st.decode.success(d);
        }
        buf.extend_from_slice(&bytes);
    }
}

/// What the relay does with one upstream event.
#[derive(Debug, PartialEq)]
enum Relayed {
    /// Pass these bytes on to the client; the event carried this many token ids.
    Send(Bytes, usize),
    /// Nothing for the client: an event without data, or a continuation's role chunk.
    Skip,
    /// `[DONE]`.
    Done,
    /// D's error event of a 5xx kind: its engine or worker failed; the request moves.
    Failed(String),
}

/// The few fields of a chunk the relay looks at, read without building the chunk as a
/// `Value` (D73): one chunk per token passes the router, and most need no change.
#[derive(serde::Deserialize)]
struct Peek {
    #[serde(default)]
    error: Option<Value>,
    #[serde(default)]
    created: Option<u64>,
    #[serde(default)]
    choices: Vec<PeekChoice>,
    /// Ids inside the chunk itself: nodes before D73.
    #[serde(default, rename = "pdmesh_token_ids")]
    inline_ids: Option<Vec<u32>>,
}

#[derive(serde::Deserialize)]
struct PeekChoice {
    #[serde(default)]
    finish_reason: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    delta: Option<PeekDelta>,
}

#[derive(serde::Deserialize)]
struct PeekDelta {
    #[serde(default)]
    role: Option<serde::de::IgnoredAny>,
}

/// Read one complete upstream event (`event`, up to and with its blank line): record its
/// token ids, whether it finishes the answer and its `created` in `seen`, and say what goes
/// to the client. The ids' comment line (D73) never does; the chunk itself goes on byte for
/// byte unless it must change: a continuation's chunks take the first stream's `created`,
/// and ids inside a chunk (nodes before D73) are taken out.
fn relay_event(event: Bytes, seen: &mut Seen) -> Relayed {
    let Ok(text) = std::str::from_utf8(&event) else { return Relayed::Send(event, 0) };
    let (comment_ids, chunk_at) = match text.strip_prefix(TOKEN_IDS_COMMENT) {
        Some(rest) => {
            let line_end = rest.find('\n').unwrap_or(rest.len());
            let ids = serde_json::from_str::<Vec<u32>>(rest[..line_end].trim()).ok();
            (ids, (TOKEN_IDS_COMMENT.len() + line_end + 1).min(text.len()))
        }
        None => (None, 0),
    };
    let Some(data) = event_data(&text[chunk_at..]) else { return Relayed::Skip };
    if data == "[DONE]" {
        return Relayed::Done;
    }
    let Ok(mut peek) = serde_json::from_str::<Peek>(data) else {
        // Not ours to judge: pass it on as it came.
        return Relayed::Send(event.slice(chunk_at..), 0);
    };
    if let Some(code) = peek.error.as_ref().and_then(|e| e["code"].as_u64()).filter(|c| *c >= 500) {
        let detail = peek.error.as_ref().and_then(|e| e["message"].as_str()).unwrap_or("error event");
        return Relayed::Failed(format!("{code}: {detail}"));
    }
    let inline_ids = peek.inline_ids.take();
    let ids_inside = inline_ids.is_some();
    let ids = comment_ids.or(inline_ids).unwrap_or_default();
    let count = ids.len();
    seen.ids.extend(ids);
    let first = peek.choices.first();
    if seen.skip_role {
        seen.skip_role = false;
        if first.and_then(|c| c.delta.as_ref()).is_some_and(|d| d.role.is_some()) {
            return Relayed::Skip;
        }
    }
    if first.is_some_and(|c| c.finish_reason.is_some()) {
        seen.finished = true;
    }
    let created = match (seen.created, peek.created) {
        (None, theirs) => {
            seen.created = theirs;
            None
        }
        (Some(ours), Some(theirs)) if ours != theirs => Some(ours),
        _ => None,
    };
    if created.is_none() && !ids_inside {
        return Relayed::Send(event.slice(chunk_at..), count);
    }
    let Ok(mut v) = serde_json::from_str::<Value>(data) else { return Relayed::Send(event.slice(chunk_at..), count) };
    if let Some(o) = v.as_object_mut() {
        o.remove(TOKEN_IDS_FIELD);
    }
    if let Some(c) = created {
        v["created"] = json!(c);
    }
    Relayed::Send(sse_data(&v), count)
}

/// End of the first complete SSE event in `buf` (after its blank line), if any.
pub(super) fn first_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| p + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The `data:` payload of one event (its data lines joined), if it has one.
fn event_data(event: &str) -> Option<&str> {
    event.lines().find_map(|l| l.strip_prefix("data:")).map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_continuation_drops_ps_params_and_carries_the_seen_tokens() {
        let original = json!({"prompt": "x", "stream": true, "max_tokens": 8, "kv_transfer_params": {"a": 1}});
        let body = continuation_body(&original, &[5, 6]);
        assert!(body.get("kv_transfer_params").is_none());
        assert_eq!(body["pdmesh_internal"], json!({"stream_token_ids": true, "resume_token_ids": [5, 6]}));
        assert_eq!(body["max_tokens"], 8, "the node subtracts what was seen");
    }

    /// A chat chunk as a node writes it (`pdmesh_openai::wire`'s shape, SSE-framed).
    fn chat_chunk(created: u64, role: bool, content: &str, finish: Option<&'static str>) -> Bytes {
        use pdmesh_openai::wire::{ChatChunkChoice, ChatCompletionChunk, ChatDelta, UsageField};
        sse_data(&ChatCompletionChunk {
            id: "chatcmpl-r1".into(),
            object: "chat.completion.chunk",
            created,
            model: "m".into(),
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta {
                    role: role.then_some("assistant"),
                    content: (role || !content.is_empty()).then(|| content.to_string()),
                    tool_calls: None,
                },
                logprobs: None,
                finish_reason: finish,
                stop_reason: None,
            }],
            usage: UsageField::Absent,
        })
    }

    /// `chunk` with the ids of its tokens in the comment line a node writes before it
    /// (`stream_token_ids`, D73).
    fn with_ids(ids: &[u32], chunk: &Bytes) -> Bytes {
        let mut event = format!("{TOKEN_IDS_COMMENT}{}\n", serde_json::to_string(ids).unwrap()).into_bytes();
        event.extend_from_slice(chunk);
        Bytes::from(event)
    }

    fn sent(r: Relayed) -> (Value, usize, Bytes) {
        let Relayed::Send(bytes, ids) = r else { panic!("not sent: {r:?}") };
        let text = std::str::from_utf8(&bytes).unwrap();
        let data =
            text.strip_prefix("data: ").and_then(|t| t.strip_suffix("\n\n")).unwrap_or_else(|| panic!("{text:?}"));
        (serde_json::from_str(data).unwrap(), ids, bytes.clone())
    }

    #[test]
    fn a_nodes_chunk_reaches_the_client_byte_for_byte_without_its_ids() {
        let plain = chat_chunk(7, false, "hi", None);
        let role = chat_chunk(7, true, "", None);
        let mut seen = Seen::default();
        assert_eq!(relay_event(role.clone(), &mut seen), Relayed::Send(role, 0));
        let event = with_ids(&[11, 12], &plain);
        assert!(event.starts_with(b": pdmesh_token_ids [11,12]\n"), "{event:?}");
        let (chunk, ids, bytes) = sent(relay_event(event, &mut seen));
        assert_eq!(bytes, plain, "the chunk a client sees is the one a node sends it directly");
        assert_eq!((ids, chunk["choices"][0]["delta"]["content"].as_str()), (2, Some("hi")));
        assert_eq!(seen.ids, vec![11, 12]);
        assert_eq!(seen.created, Some(7));
        assert!(!seen.finished);
        let last = with_ids(&[13], &chat_chunk(7, false, "", Some("length")));
        let (chunk, ..) = sent(relay_event(last, &mut seen));
        assert_eq!(chunk["choices"][0]["finish_reason"], "length");
        assert!(seen.finished);
        assert_eq!(seen.ids, vec![11, 12, 13]);
        assert_eq!(relay_event(sse_done(), &mut seen), Relayed::Done);
    }

    #[test]
    fn a_continuation_drops_its_role_chunk_and_takes_the_first_streams_created() {
        // the second node's stream began later: its chunks carry another `created`
        let mut seen = Seen { ids: vec![5], created: Some(7), finished: false, skip_role: true };
        assert_eq!(relay_event(chat_chunk(9, true, "", None), &mut seen), Relayed::Skip);
        let (chunk, ids, _) = sent(relay_event(with_ids(&[6], &chat_chunk(9, false, "x", None)), &mut seen));
        assert_eq!((chunk["created"].as_u64(), ids), (Some(7), 1));
        assert!(chunk.get(TOKEN_IDS_FIELD).is_none());
        assert_eq!(seen.ids, vec![5, 6]);
    }

    #[test]
    fn ids_inside_a_chunk_from_an_older_node_are_read_and_taken_out() {
        let mut seen = Seen::default();
        let old = sse_data(&json!({"created": 7, "choices": [{"index": 0, "text": "a", "finish_reason": null}],
            "pdmesh_token_ids": [3, 4]}));
        let (chunk, ids, _) = sent(relay_event(old, &mut seen));
        assert_eq!(ids, 2);
        assert!(chunk.get(TOKEN_IDS_FIELD).is_none(), "{chunk}");
        assert_eq!(chunk["choices"][0]["text"], "a");
        assert_eq!(seen.ids, vec![3, 4]);
    }

    #[test]
    fn a_server_error_event_moves_the_request_and_a_client_error_passes_on() {
        let mut seen = Seen::default();
        let engine_died = sse_data(&json!({"error": {"code": 500, "message": "engine failed"}}));
        assert_eq!(relay_event(engine_died, &mut seen), Relayed::Failed("500: engine failed".into()));
        let refused = sse_data(&json!({"error": {"code": 400, "message": "bad"}}));
        assert_eq!(relay_event(refused.clone(), &mut seen), Relayed::Send(refused, 0));
        let odd = Bytes::from_static(b"data: not json\n\n");
        assert_eq!(relay_event(odd.clone(), &mut seen), Relayed::Send(odd, 0));
        assert_eq!(relay_event(Bytes::from_static(b": keep-alive\n\n"), &mut seen), Relayed::Skip);
        assert!(seen.ids.is_empty());
    }

    #[test]
    fn a_stream_moves_after_enough_slow_tokens_in_a_row_and_only_against_a_reference() {
        let rule = SlowRule { ratio: 3.0, tokens: 4 };
        let mut run = SlowRun::default();
        let median = Some(0.010);
        assert!(!run.note(rule, 0.100, 1, None), "nothing to compare with: never slow");
        assert!(!run.note(rule, 0.031, 1, median));
        assert!(!run.note(rule, 0.050, 2, median), "3 slow tokens");
        assert!(!run.note(rule, 0.029, 1, median), "a token within the ratio starts the run over");
        assert_eq!(run.tokens, 0);
        for _ in 0..3 {
            assert!(!run.note(rule, 0.400, 1, median));
        }
        assert!(run.note(rule, 0.400, 1, median), "the 4th slow token in a row");
    }

    #[test]
    fn events_split_on_their_first_blank_line() {
        assert_eq!(first_event_end(b"data: a\n\ndata: b\n\n"), Some(9));
        assert_eq!(first_event_end(b"data: a\n"), None);
        assert_eq!(event_data("data: {\"x\":1}\n\n"), Some("{\"x\":1}"));
        assert_eq!(event_data(": comment\n\n"), None);
    }
}
