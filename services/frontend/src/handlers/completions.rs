//! `POST /v1/completions`.

use std::time::Instant;

use actix_web::{web, HttpRequest, HttpResponse};

use crate::error::ApiError;
use crate::generate::{prepare, Api, Prepared};
use crate::handlers::serve;
use crate::headers::RequestMeta;
use crate::openai::CompletionRequest;
use crate::state::AppState;
use crate::validation::ModelLimits;

/// The handler.
pub async fn completions(
    req: HttpRequest,
    body: web::Json<CompletionRequest>,
    state: web::Data<AppState>,
) -> HttpResponse {
    let arrival = Instant::now();
    let body = body.into_inner();
    let remote_prefill = crate::handlers::remote_prefill_params(body.sampling.kv_transfer_params.as_ref());
    serve(&req, &state, Api::Completion, remote_prefill, move |meta, state| validate(body, meta, state, arrival)).await
}

fn validate(
    body: CompletionRequest,
    meta: RequestMeta,
    state: &AppState,
    arrival: Instant,
) -> Result<Prepared, ApiError> {
    let limits = ModelLimits::from(state);
    let v = pdmesh_openai::request::validate_completion(&body, &limits)?;
    if let Some(g) = &v.params.sampling.guided {
        crate::metrics::STRUCTURED_OUTPUTS_TOTAL.with_label_values(&[crate::structured::kind(g)]).inc();
    }
    let mut prepared = prepare(Api::Completion, meta, v.params, v.prompt, v.max_tokens, state, arrival);
    crate::resume::apply(&body.extra, &mut prepared, limits.vocab_size)?;
    Ok(prepared)
}
