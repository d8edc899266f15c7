//! HTTP handlers. Generation endpoints share [`serve`]: headers → span → validate → submit →
//! respond, with every refusal rendered as an OpenAI error body carrying `X-Request-Id`.

pub mod admin;
pub mod chat;
pub mod completions;

use actix_web::{HttpRequest, HttpResponse, ResponseError};
use tracing::Instrument;

use crate::error::ApiError;
use crate::generate::{respond, set_request_id, submit, Api, Prepared};
use crate::headers::{request_meta, RequestMeta};
use crate::metrics::REMOTE_PREFILL_REJECTIONS_TOTAL;
use crate::server::AppState;

/// Render an error as the response to a request (counted and logged once, here).
pub fn error_response(error: ApiError, request_id: &str) -> HttpResponse {
    error.record();
    let mut response = error.error_response();
    set_request_id(&mut response, request_id);
    response
}

/// A request that carried `do_remote_prefill = true` is refused before the engine admitted
/// it: P holds blocks for it that no one will read. vLLM (#41269) notifies P through the
/// engine at this point; the pdmesh wire has no message for that yet, so P frees on its
/// hold deadline. Counted so that the gap is visible.
fn note_rejection(remote_prefill: bool, error: &ApiError) {
    if remote_prefill {
        REMOTE_PREFILL_REJECTIONS_TOTAL.inc();
        tracing::warn!(error = %error, "refused a remote-prefill request before admission; P keeps its blocks until its hold deadline");
    }
}

/// The shared flow of a generation request. `prepare` validates the body into an engine
/// request; it runs inside the request's span.
pub async fn serve<F>(req: &HttpRequest, state: &AppState, api: Api, remote_prefill: bool, prepare: F) -> HttpResponse
where
    F: FnOnce(RequestMeta, &AppState) -> Result<Prepared, ApiError>,
{
    let meta = match request_meta(req.headers()) {
        Ok(meta) => meta,
        Err((request_id, error)) => {
            note_rejection(remote_prefill, &error);
            return error_response(error, &request_id);
        }
    };
    let request_id = meta.request_id.clone();
    let endpoint = match api {
        Api::Completion => "completions",
        Api::Chat => "chat_completions",
    };
    let span =
        tracing::info_span!("frontend.request", request_id = %meta.request_id, trace_id = %meta.trace_id, endpoint);
    async move {
        let accepted = match prepare(meta, state) {
            Ok(prepared) => {
                tracing::debug!(
                    prompt_tokens = prepared.settings.prompt_tokens,
                    max_tokens = prepared.request.sampling.max_tokens,
                    stream = prepared.settings.stream,
                    dp_rank = ?prepared.request.data_parallel_rank,
                    "submitting"
                );
                submit(state, prepared).await
            }
            Err(e) => Err(e),
        };
        let accepted = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                note_rejection(remote_prefill, &error);
                return error_response(error, &request_id);
            }
        };
        match respond(state, accepted).await {
            Ok(response) => response,
            Err(error) => error_response(error, &request_id),
        }
    }
    .instrument(span)
    .await
}
