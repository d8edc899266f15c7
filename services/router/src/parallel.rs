//! The decode leg sent at the same time as the prefill leg (D66, SGLang's parallel dispatch).
//!
//! With P's token streamed at once (D63), the client's first token waited, after P answered,
//! for the decode leg's whole admission hop: the router's request to D, D's frontend
//! (validation, template, tokenisation), its dp-lb and engine-core, and D's headers back — so
//! that a refusal by D could still reach the client with its own status. Here the router sends
//! D the request (without params, under a one-request token) when it sends P its own: D admits
//! and parks it while P prefills (the frontend's `parked` module), and answers its headers. When P answers,
//! the router hands D the params and P's token (`POST /v1/kv/params`) and streams P's token to
//! the client; D reads P's blocks and continues from the second token.
//!
//! Every outcome keeps the lifecycle rules:
//! - D refuses (4xx, 503) before P answered: the client gets D's answer with its status once P
//!   answered, and P's release guard, armed with P's params, hands the blocks back at once (rule
//!   R4). Dropping P's leg instead would leave P to notice a vanished client of a non-streamed
//!   request, and a release sent while P still runs the request names no hold.
//! - D fails (connect, reset, 5xx): once P answered, the plain two-leg path takes over on
//!   another decode node with P's params ([`super::decode_leg`]).
//! - P refuses or fails: the client gets P's answer (after P's retries); D's parked leg is
//!   dropped with its connection, before anything was admitted there.
//! - The params cannot be handed to D (it went away meanwhile): P's params were never given to
//!   any reader, so the plain path takes them to another decode node.
//!
//! Only P's guard over its blocks decides who frees them: it is disarmed once D took the params,
//! as in the plain path once D answered.

use std::pin::pin;

use actix_web::HttpResponse;
use serde_json::{json, Value};
use tracing::Instrument;

use super::{
    decode_leg, first_token, forward_headers, migrate, node_failed, pass_answer, prefill_leg, Leg, Legs, Prefilled,
    ReleaseOnDrop,
};

/// Run both legs at once; see the module docs.
pub(super) async fn dispatch(legs: &Legs<'_>, original: Value, permits: Box<dyn std::any::Any>) -> HttpResponse {
    let st = legs.st;
    let Some(picked) = legs.pick_decode(&[]) else {
        return sequential(legs, original, permits).await;
    };
    let d_index = picked.node;
    let Some(d) = st.decode.url(d_index) else {
        return sequential(legs, original, permits).await;
    };
    let token = pdmesh_mesh_auth::new_capability();
    let d_body = parked_decode_body(&original, &token);
    let d_span = tracing::info_span!(parent: legs.span, "router.decode", otel.kind = "client", upstream = %d,
        stream = true, parallel = true);
    let d_trace = pdmesh_telemetry::trace::outgoing(&d_span, legs.client_trace);
    let d_rb = forward_headers(
        legs.req,
        st.client().post(format!("{d}{}", legs.path)),
        legs.request_id,
        Leg::Decode,
        &d_trace,
        legs.authorization,
    );
    let counted = st.decode.start(d_index);
    let d_send = d_rb.json(&d_body).send().instrument(d_span.clone());
    let raced = race_legs(legs, &original, d_index, d_send, &d_span).await;
    drop(counted);
    let (prefilled, d_answer) = match raced {
        Ok(answers) => answers,
        Err(answer) => return answer,
    };
    let Some(mut p) = prefilled else {
        return sequential(legs, original, permits).await; // not reached: the race ends with P's answer
    };
    let Some(d_res) = d_answer else {
        // D failed: another decode node takes P's params the plain way.
        return decode_leg(legs, original, Some(p), None, permits).await;
    };
    let first = (!p.params.is_null()).then(|| first_token::from_answer(legs.path, &original, &p.answer)).flatten();
    let send = params_delivery(legs, &d, &token, &p.params, first.as_ref()).send().instrument(d_span.clone());
    super::PARALLEL_DECODE_LEGS_TOTAL.inc();
    let handover: Option<migrate::Handover> = if first.is_none() {
        // Nothing is shown before D's own first token: hand over first, and on failure take
        // P's params to another decode node the plain way.
        match send.await {
            Ok(r) if r.status().is_success() => p.release.disarm(), // D owns the reference now
            other => {
                let why = other.map_or_else(|e| e.to_string(), |r| format!("answered {}", r.status().as_u16()));
                tracing::warn!(parent: &d_span, request_id = legs.request_id, upstream = %d, error = %why,
                    "decode node did not take the params; the plain path takes over");
                st.decode.failure(d_index, "reset");
                drop(d_res);
                return decode_leg(legs, original, Some(p), None, permits).await;
            }
        }
        None
    } else {
        Some(handover_behind_token(send, p.release))
    };
    let relay = legs.relay(original, d_index, 0, Box::new((permits, d_span)));
    match first {
        Some(first) => migrate::respond_after_first_token(relay, first, d_res, handover),
        None => migrate::respond(relay, d_res),
    }
}

/// The body D's parked leg is sent: the client's, without params, asking for token ids and
/// naming the one-request `token` the params will follow under.
fn parked_decode_body(original: &Value, token: &str) -> Value {
    let mut d_body = original.clone();
    if let Some(o) = d_body.as_object_mut() {
        o.remove("kv_transfer_params");
    }
    d_body[pdmesh_protocol::node_http::INTERNAL_FIELD][pdmesh_protocol::node_http::internal::STREAM_TOKEN_IDS] =
        json!(true);
    d_body[pdmesh_protocol::node_http::INTERNAL_FIELD][pdmesh_protocol::node_http::internal::PARAMS_FOLLOW] =
        json!(token);
    d_body
}

/// P's leg and D's parked leg (`d_send`), awaited together until P answered and D answered or
/// failed: `(P's answer, D's answer or None when D failed)`. `Err` is the client's answer
/// when the race settles it: P refused or failed everywhere (D's parked leg goes with its
/// dropped connection), or D refused the request (its answer, once P's is in).
async fn race_legs(
    legs: &Legs<'_>,
    original: &Value,
    d_index: usize,
    d_send: impl std::future::Future<Output = reqwest::Result<reqwest::Response>>,
    d_span: &tracing::Span,
) -> Result<(Option<Prefilled>, Option<reqwest::Response>), HttpResponse> {
    let st = legs.st;
    let (mut prefilled, mut d_answer): (Option<Prefilled>, Option<reqwest::Response>) = (None, None);
    let mut d_failed = false;
    let mut d_leg = pin!(d_send);
    let mut p_leg = pin!(prefill_leg(legs, original));
    while prefilled.is_none() || (d_answer.is_none() && !d_failed) {
        tokio::select! {
            p = &mut p_leg, if prefilled.is_none() => match p {
                Ok(p) => prefilled = Some(p),
                // P refused or failed everywhere: its answer is the client's; D's parked leg
                // goes with its dropped connection.
                Err(answer) => return Err(answer),
            },
            r = &mut d_leg, if d_answer.is_none() && !d_failed => match r {
                Ok(r) if r.status().is_success() => {
                    tracing::info!(parent: d_span, status = r.status().as_u16(), "decode answered");
                    st.decode.success(d_index);
                    d_answer = Some(r);
                }
                // D refused it (bad input, overloaded): the client gets D's answer once P
                // answered. P's request may still be running: a release names only a
                // finished hold and P may not notice a dropped non-streamed leg, so P's
                // answer is awaited and its guard, armed with P's own params, hands the
                // hold back at once (R4).
                Ok(r) if !node_failed(&r) => {
                    tracing::info!(parent: d_span, status = r.status().as_u16(), "decode refused before prefill answered");
                    if prefilled.is_none() {
                        drop((&mut p_leg).await);
                    }
                    return Err(pass_answer(r, legs.request_id, true).await);
                }
                Ok(r) => {
                    st.decode.failure(d_index, "5xx");
                    tracing::warn!(parent: d_span, status = r.status().as_u16(), "decode leg failed; the plain path takes over");
                    d_failed = true;
                }
                Err(e) => {
                    st.decode.failure(d_index, if e.is_connect() { "connect" } else { "reset" });
                    tracing::warn!(parent: d_span, error = %e, "decode leg failed; the plain path takes over");
                    d_failed = true;
                }
            },
        }
    }
    Ok((prefilled, d_answer))
}

/// The hand-over of P's params to decode node `d` (`POST /v1/kv/params`) under the parked
/// leg's `token`, with P's first token to resume after when it is shown to the client.
fn params_delivery(
    legs: &Legs<'_>,
    d: &str,
    token: &str,
    params: &Value,
    first: Option<&first_token::FirstToken>,
) -> reqwest::RequestBuilder {
    let delivery = json!({
        "token": token,
        "kv_transfer_params": params,
        "resume_token_ids": first.map(|f| vec![f.id]).unwrap_or_default(),
    });
    let mut rb = legs
        .st
        .client()
        .post(format!("{d}{}", pdmesh_protocol::node_http::KV_PARAMS_PATH))
        .header(pdmesh_http_edge::headers::REQUEST_ID, legs.request_id);
    if let Some(v) = legs.authorization {
        rb = rb.header(actix_web::http::header::AUTHORIZATION.as_str(), v);
    }
    rb.json(&delivery)
}

/// With P's token to show, the token goes out while the params travel (the relay waits for
/// this hand-over before it reads D): P's guard is disarmed once D took them, and frees P's
/// blocks otherwise.
fn handover_behind_token(
    send: impl std::future::Future<Output = reqwest::Result<reqwest::Response>> + 'static,
    mut release: ReleaseOnDrop,
) -> migrate::Handover {
    Box::pin(async move {
        match send.await {
            Ok(r) if r.status().is_success() => {
                release.disarm();
                Ok(())
            }
            Ok(r) => Err(format!("the decode node answered the params with {}", r.status().as_u16())),
            Err(e) => Err(format!("the decode node did not take the params: {e}")),
        }
    })
}

/// No decode node to send the leg to yet: the plain path (it answers the client's 503 itself).
async fn sequential(legs: &Legs<'_>, original: Value, permits: Box<dyn std::any::Any>) -> HttpResponse {
    match prefill_leg(legs, &original).await {
        Ok(p) => decode_leg(legs, original, Some(p), None, permits).await,
        Err(answer) => answer,
    }
}
