//! Request migration (D56): a decode stream that breaks mid-generation goes on on another
//! decode node, and the client sees one uninterrupted stream.
//!
//! The router asks D for the ids of the tokens of every chunk (`pdmesh_internal.
//! stream_token_ids`, [`crate::resume`]) and takes them out of each chunk before passing it on.
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

use std::convert::Infallible;
use std::sync::LazyLock;
use std::time::Instant;

use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;
use futures::StreamExt;
use pdmesh_protocol::TraceContext;
use pdmesh_telemetry::metrics::counter_vec;
use prometheus::IntCounterVec;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{forward_headers, Leg, RouterState};
use crate::error::ApiError;
use crate::headers::REQUEST_ID;
use crate::stream::{sse_data, sse_done, sse_error, TOKEN_IDS_FIELD};

/// Requests moved to another decode node, by `reason` (`stream_broke`: the connection broke or
/// ended early; `error_event`: D sent a 5xx error event; `no_answer`: D failed before its
/// answer started).
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
    body[crate::resume::FIELD]["stream_token_ids"] = json!(true);
    body[crate::resume::FIELD]["resume_token_ids"] = json!(seen);
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
}

/// What the relay learned from the events so far.
#[derive(Default)]
struct Seen {
    ids: Vec<u32>,
    created: Option<Value>,
    finished: bool,
    /// Drop the next role chunk (a continuation's opening chunk).
    skip_role: bool,
}

async fn run(r: Relay, upstream: reqwest::Response, tx: mpsc::Sender<Bytes>) {
    run_from(r, upstream, tx, Seen::default()).await;
}

/// Relay `upstream` after what the client has `seen`, moving the request when it breaks.
async fn run_from(mut r: Relay, mut upstream: reqwest::Response, tx: mpsc::Sender<Bytes>, mut seen: Seen) {
    let st = r.st.clone();
    let mut in_flight = st.decode.start(r.d);
    loop {
        let (reason, detail) = match pump(&st, r.d, &mut upstream, &tx, &mut seen, &r.span).await {
            Pumped::Done | Pumped::ClientGone => return,
            Pumped::Broken { reason, detail } => (reason, detail),
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
        let mut seen =
            Seen { ids: vec![first.id], created: Some(first.created.clone()), finished: false, skip_role: true };
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
        tracing::warn!(parent: &r.span, request_id = %r.request_id, from = from_url, to = to_url,
            tokens_seen = seen.ids.len(), migration = r.migrations, reason, detail,
            "decode stream broke; the request moves to another decode node");
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

/// Relay one upstream stream's events to the client until it ends.
async fn pump(
    st: &RouterState,
    d: usize,
    upstream: &mut reqwest::Response,
    tx: &mpsc::Sender<Bytes>,
    seen: &mut Seen,
    span: &tracing::Span,
) -> Pumped {
    let mut buf: Vec<u8> = Vec::new();
    let mut answered = false;
    let mut last_tokens: Option<Instant> = None;
    loop {
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
        while let Some(end) = first_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..end).collect();
            let Some(data) = event_data(&event) else { continue };
            if data == "[DONE]" {
                let _ = tx.send(sse_done()).await;
                return Pumped::Done;
            }
            let Ok(mut v) = serde_json::from_str::<Value>(data) else {
                // Not ours to judge: pass it on as it came.
                if tx.send(Bytes::from(event)).await.is_err() {
                    return Pumped::ClientGone;
                }
                continue;
            };
            if let Some(code) = v["error"]["code"].as_u64().filter(|c| *c >= 500) {
                let detail = v["error"]["message"].as_str().unwrap_or("error event").to_string();
                return Pumped::Broken { reason: "error_event", detail: format!("{code}: {detail}") };
            }
            let mut first_relayed = false;
            if let Some(ids) = v.as_object_mut().and_then(|o| o.remove(TOKEN_IDS_FIELD)) {
                let ids: Vec<u32> = serde_json::from_value(ids).unwrap_or_default();
                first_relayed = seen.ids.is_empty() && !ids.is_empty();
                if !ids.is_empty() {
                    let now = Instant::now();
                    if let Some(t) = last_tokens {
                        st.decode.observe_latency(d, now.duration_since(t).as_secs_f64() / ids.len() as f64);
                    }
                    last_tokens = Some(now);
                }
                seen.ids.extend(ids);
            }
            if seen.skip_role {
                seen.skip_role = false;
                if !v["choices"][0]["delta"]["role"].is_null() {
                    continue;
                }
            }
            match &seen.created {
                None => seen.created = Some(v["created"].clone()),
                Some(c) if !v["created"].is_null() => v["created"] = c.clone(),
                Some(_) => {}
            }
            if !v["choices"][0]["finish_reason"].is_null() {
                seen.finished = true;
            }
            if tx.send(sse_data(&v)).await.is_err() {
                return Pumped::ClientGone;
            }
            if first_relayed {
                // The router's share of the first token's path ends here (ttft-breakdown.sh).
                tracing::info!(parent: span, "first token relayed");
            }
        }
    }
}

/// End of the first complete SSE event in `buf` (after its blank line), if any.
fn first_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| p + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The `data:` payload of one event (its data lines joined), if it has one.
fn event_data(event: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(event).ok()?;
    text.lines().find_map(|l| l.strip_prefix("data:")).map(str::trim)
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

    #[test]
    fn events_split_on_their_first_blank_line() {
        assert_eq!(first_event_end(b"data: a\n\ndata: b\n\n"), Some(9));
        assert_eq!(first_event_end(b"data: a\n"), None);
        assert_eq!(event_data(b"data: {\"x\":1}\n\n"), Some("{\"x\":1}"));
        assert_eq!(event_data(b": comment\n\n"), None);
    }
}
