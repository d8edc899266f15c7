//! HTTP handlers. Generation endpoints share [`serve`]: headers → span → validate → submit →
//! respond, with every refusal rendered as an OpenAI error body carrying `X-Request-Id`.

pub mod admin;
pub mod chat;
pub mod completions;
pub mod responses;

use actix_web::{web, HttpMessage, HttpRequest, HttpResponse};
use tracing::Instrument;

use crate::auth::ClientKey;
use crate::error::ApiError;
use std::future::Future;

use crate::generate::{respond, submit, Accepted, Api, Prepared};
use crate::headers::{request_meta, RequestMeta};
use crate::metrics::{REJECTION_NOTICES_SENT, REMOTE_PREFILL_REJECTIONS_TOTAL};
use crate::state::AppState;
use pdmesh_protocol::{Envelope, KvTransferParams, Message, RejectionNotice};

pub use pdmesh_http_edge::serve::error_response;

/// Rule R1: a request that carried `do_remote_prefill = true` was refused before the engine
/// admitted it, so P holds blocks that no one will read. Send a rejection notice with the raw
/// params (and the client's DP rank header) so P frees them at once. The client's error
/// answer is neither masked nor delayed: the notice is fire-and-forget.
fn note_rejection(state: &AppState, params: Option<&KvTransferParams>, rank: Option<u32>, error: &ApiError) {
    let Some(params) = params.filter(|p| p.wants_remote_prefill()) else { return };
    REMOTE_PREFILL_REJECTIONS_TOTAL.inc();
    if !state.options.rejection_notices {
        tracing::warn!(error = %error, "refused a remote-prefill request before admission; notices are off, P frees at its deadline");
        return;
    }
    let notice = RejectionNotice {
        params: params.clone(),
        data_parallel_rank: rank,
        rejected_at_unix_us: Some(pdmesh_protocol::unix_micros()),
        // the refused request's trace travels with the notice to P
        trace: pdmesh_telemetry::trace::current(),
    };
    match state
        .link
        .send(Envelope::new(Message::RejectionNotice(notice)).with_trace(pdmesh_telemetry::trace::current()))
    {
        Ok(()) => {
            REJECTION_NOTICES_SENT.inc();
            tracing::info!(error = %error, "refused a remote-prefill request before admission; notified P");
        }
        Err(e) => tracing::warn!(error = %error, send_error = %e, "rejection notice not sent; P frees at its deadline"),
    }
}

/// The params of a body's `kv_transfer_params` if it asks for a remote prefill.
pub(crate) fn remote_prefill_params(value: Option<&serde_json::Value>) -> Option<KvTransferParams> {
    crate::validation::kv_transfer_params(value).ok().flatten().filter(KvTransferParams::wants_remote_prefill)
}

/// The shared flow of a generation request. `prepare` validates the body into an engine
/// request; it runs inside the request's span, off the async worker (see [`serve_with`]).
pub async fn serve<F>(
    req: &HttpRequest,
    state: &web::Data<AppState>,
    api: Api,
    remote_prefill: Option<KvTransferParams>,
    prepare: F,
) -> HttpResponse
where
    F: FnOnce(RequestMeta, &AppState) -> Result<Prepared, ApiError> + Send + 'static,
{
    let endpoint = match api {
        Api::Completion => "completions",
        Api::Chat => "chat_completions",
    };
    serve_with(
        req,
        state,
        endpoint,
        remote_prefill,
        move |meta, state| prepare(meta, state).map(|p| (p, ())),
        |accepted, ()| respond(state, accepted),
    )
    .await
}

/// [`serve`] with the answer left to the caller: `prepare` validates the body into an engine
/// request plus whatever `answer` needs (`T`); `answer` turns the accepted request into the
/// response. Every refusal before admission goes through [`note_rejection`] (rule R1).
///
/// `prepare` runs on a blocking thread, not on the async worker (D91): validation can cost
/// (a grammar to compile, a long prompt to render and tokenise), and a worker busy with it
/// serves none of its other connections, `/live` included.
pub async fn serve_with<F, T, R, Fut>(
    req: &HttpRequest,
    state: &web::Data<AppState>,
    endpoint: &'static str,
    remote_prefill: Option<KvTransferParams>,
    prepare: F,
    answer: R,
) -> HttpResponse
where
    F: FnOnce(RequestMeta, &AppState) -> Result<(Prepared, T), ApiError> + Send + 'static,
    T: Send + 'static,
    R: FnOnce(Accepted, T) -> Fut,
    Fut: Future<Output = Result<HttpResponse, ApiError>>,
{
    let meta = match request_meta(req.headers()) {
        Ok(meta) => meta,
        Err((request_id, error)) => {
            note_rejection(state, remote_prefill.as_ref(), None, &error);
            return error_response(error, &request_id);
        }
    };
    let request_id = meta.request_id.clone();
    let dp_rank = meta.data_parallel_rank;
    // The client key's bound first: a client over its own share is told so (429) without
    // taking, even for a moment, a place under the server's bound. P is told as for any
    // refusal before admission (R1). The router's internal key has no client identity here.
    let client_key = req.extensions().get::<ClientKey>().copied();
    let key_permit = match state.key_limit.try_acquire(client_key) {
        Ok(permit) => permit,
        Err(error) => {
            note_rejection(state, remote_prefill.as_ref(), dp_rank, &error);
            return error_response(error, &request_id);
        }
    };
    // Overload control: a place under `limits.max_in_flight` for the whole answer, or a 503
    // now (and P's blocks handed back, R1) rather than a wait in an unbounded queue.
    let permit = match state.in_flight.try_acquire() {
        Ok(permit) => permit,
        Err(error) => {
            note_rejection(state, remote_prefill.as_ref(), dp_rank, &error);
            return error_response(error, &request_id);
        }
    };
    let span = tracing::info_span!("frontend.request", otel.kind = "server", request_id = %meta.request_id,
        trace_id = %meta.trace_id, endpoint);
    pdmesh_telemetry::trace::set_parent(&span, &meta.parent);
    let validated = {
        let (state, span) = (state.clone(), span.clone());
        web::block(move || span.in_scope(|| prepare(meta, &state)))
    };
    async move {
        let validated = validated
            .await
            .unwrap_or_else(|e| Err(ApiError::Internal(format!("request validation did not finish: {e}"))));
        let accepted = match validated {
            Ok((prepared, _)) if prepared.params_follow.is_some() => {
                return park(req, prepared, permit, key_permit, dp_rank, &request_id);
            }
            Ok((prepared, extra)) => {
                tracing::debug!(
                    prompt_tokens = prepared.settings.prompt_tokens,
                    max_tokens = prepared.request.sampling.max_tokens,
                    stream = prepared.settings.stream,
                    dp_rank = ?prepared.request.data_parallel_rank,
                    "submitting"
                );
                submit(state, prepared).await.map(|a| (a, extra))
            }
            Err(e) => Err(e),
        };
        let (accepted, extra) = match accepted {
            Ok((mut accepted, extra)) => {
                // The permits live as long as the answer (a stream's, too).
                accepted.guard.hold(permit, key_permit);
                (accepted, extra)
            }
            Err(error) => {
                note_rejection(state, remote_prefill.as_ref(), dp_rank, &error);
                return error_response(error, &request_id);
            }
        };
        match answer(accepted, extra).await {
            Ok(response) => response,
            Err(error) => {
                // An engine that refused the request for load never admitted it (R1).
                if matches!(error, ApiError::Overloaded(_)) {
                    note_rejection(state, remote_prefill.as_ref(), dp_rank, &error);
                }
                error_response(error, &request_id)
            }
        }
    }
    .instrument(span)
    .await
}

/// D66: a decode leg sent before P answered ([`crate::parked`]). Its headers go out now;
/// a task waits for the params the router delivers under the leg's token, then submits the
/// request and streams it. Everything that could refuse it without the params (validation,
/// the in-flight bounds, whose places it keeps) already ran; an engine refusal after the params
/// arrived becomes the stream's error event before any token, and P is told (rule R1).
fn park(
    req: &HttpRequest,
    prepared: Prepared,
    permit: crate::overload::InFlightPermit,
    key_permit: Option<crate::overload::KeyPermit>,
    dp_rank: Option<u32>,
    request_id: &str,
) -> HttpResponse {
    let Some(state) = req.app_data::<actix_web::web::Data<AppState>>().cloned() else {
        return error_response(ApiError::Internal("frontend state missing".into()), request_id);
    };
    let token = prepared.params_follow.clone().unwrap_or_default();
    let Some(mut slot) = state.parked.park(&token) else {
        return error_response(
            ApiError::invalid(
                format!("{}.params_follow: a request already waits under this token", crate::resume::FIELD),
                crate::resume::FIELD,
            ),
            request_id,
        );
    };
    crate::metrics::PARKED_REQUESTS_TOTAL.with_label_values(&["parked"]).inc();
    let (tx, response) = crate::stream::deferred(request_id);
    let span = tracing::Span::current();
    actix_web::rt::spawn(
        async move {
            let mut prepared = prepared;
            let delivery = tokio::select! {
                biased;
                _ = tx.closed() => {
                    tracing::info!("router went away before the params arrived; nothing was admitted");
                    return;
                }
                d = tokio::time::timeout(crate::parked::PARK_WAIT, &mut slot.delivery) => d,
            };
            let delivery = match delivery {
                Ok(Ok(d)) => d,
                _ => {
                    crate::metrics::PARKED_REQUESTS_TOTAL.with_label_values(&["expired"]).inc();
                    tracing::warn!("the prefill node's params never arrived; the request ends");
                    let e = ApiError::Unavailable("unavailable: the prefill node's params did not arrive".into());
                    crate::stream::fail_into(&tx, e).await;
                    return;
                }
            };
            let params = delivery.kv_transfer_params.filter(KvTransferParams::wants_remote_prefill);
            prepared.request.kv_transfer_params = params.clone();
            let vocab = state.vocab_size();
            if let Err(e) = crate::resume::resume_after(&mut prepared, delivery.resume_token_ids, vocab) {
                note_rejection(&state, params.as_ref(), dp_rank, &e);
                crate::stream::fail_into(&tx, e).await;
                return;
            }
            match submit(&state, prepared).await {
                Ok(mut accepted) => {
                    accepted.guard.hold(permit, key_permit);
                    let Accepted { settings, outputs, guard, .. } = accepted;
                    crate::stream::run_into(state.codec.clone(), settings, outputs, guard, tx).await;
                }
                Err(e) => {
                    note_rejection(&state, params.as_ref(), dp_rank, &e);
                    crate::stream::fail_into(&tx, e).await;
                }
            }
        }
        .instrument(span),
    );
    response
}

/// `POST /v1/kv/params` with `{"token": ..., "kv_transfer_params": <P's params or null>,
/// "resume_token_ids": [...]}`: the router hands a decode leg it sent before P answered its
/// params (D66). `200` when a request waited under the token, `404` when none does (it was
/// never parked, already has them, or its client went away: the router then hands P's blocks
/// back itself).
pub async fn kv_params(
    req: HttpRequest,
    body: actix_web::web::Bytes,
    state: actix_web::web::Data<AppState>,
) -> HttpResponse {
    let request_id = crate::headers::request_meta(req.headers()).map(|m| m.request_id).unwrap_or_else(|(id, _)| id);
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return error_response(ApiError::invalid_request("request body is not valid JSON"), &request_id);
    };
    let Some(token) = value.get("token").and_then(serde_json::Value::as_str).filter(|t| !t.is_empty()) else {
        return error_response(ApiError::invalid("token is required", "token"), &request_id);
    };
    let kv_transfer_params = match crate::validation::kv_transfer_params(value.get("kv_transfer_params")) {
        Ok(p) => p,
        Err(e) => return error_response(e, &request_id),
    };
    let resume_token_ids = match value.get("resume_token_ids") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(v) => match serde_json::from_value::<Vec<u32>>(v.clone()) {
            Ok(ids) => ids,
            Err(e) => {
                return error_response(
                    ApiError::invalid(format!("resume_token_ids: {e}"), "resume_token_ids"),
                    &request_id,
                )
            }
        },
    };
    if state.parked.deliver(token, crate::parked::Delivery { kv_transfer_params, resume_token_ids }) {
        HttpResponse::Ok().json(serde_json::json!({"delivered": true}))
    } else {
        crate::metrics::PARKED_REQUESTS_TOTAL.with_label_values(&["unknown_token"]).inc();
        tracing::info!(%request_id, "params for no parked request");
        error_response(ApiError::NotFound("no request waits for params under this token".into()), &request_id)
    }
}

/// `POST /v1/kv/release` with `{"kv_transfer_params": <P's params>}`: whoever holds a reference
/// to blocks P holds and will not use it (the router, when its client is gone between the
/// legs) hands it back. Sent to P, the engine that holds the request treats it as an abort
/// after finish (freed at once without an active lease); sent to D, it is a rejection notice
/// (D's worker tells P). `202` when the notice was sent, `400` for params that name no held
/// request or carry no capability token (P frees only for the right token, and answers a wrong
/// one exactly like an unknown request). The rank in `remote_dp_rank` (or the `X-data-parallel-rank` header) pins it.
pub async fn kv_release(
    req: HttpRequest,
    body: actix_web::web::Bytes,
    state: actix_web::web::Data<AppState>,
) -> HttpResponse {
    let request_id = crate::headers::request_meta(req.headers()).map(|m| m.request_id).unwrap_or_else(|(id, _)| id);
    let params = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| serde_json::from_value::<KvTransferParams>(v["kv_transfer_params"].clone()).ok());
    // The capability token P handed out with the params is required: a request id alone
    // releases nothing (P checks the token; docs/SECURITY.md).
    let Some(params) =
        params.filter(|p| p.wants_remote_prefill() && p.remote_request_id.is_some() && p.remote_capability.is_some())
    else {
        return error_response(
            ApiError::invalid_request(
                "kv_transfer_params with do_remote_prefill, remote_request_id and remote_capability are required",
            ),
            &request_id,
        );
    };
    let rank = match crate::headers::data_parallel_rank(req.headers()) {
        Ok(r) => r.or(params.remote_dp_rank),
        Err(e) => return error_response(e, &request_id),
    };
    let notice = RejectionNotice {
        params,
        data_parallel_rank: rank,
        rejected_at_unix_us: Some(pdmesh_protocol::unix_micros()),
        trace: Default::default(),
    };
    match state
        .link
        .send(Envelope::new(Message::RejectionNotice(notice)).with_trace(pdmesh_telemetry::trace::current()))
    {
        Ok(()) => {
            crate::metrics::KV_RELEASES.inc();
            tracing::info!(%request_id, "kv release sent");
            HttpResponse::Accepted().json(serde_json::json!({"released": true}))
        }
        Err(e) => error_response(ApiError::Unavailable(format!("unavailable: engine link: {e}")), &request_id),
    }
}
