//! Errors of the HTTP services (the nodes' frontends and the router).
//!
//! [`ApiError`] is every way an API request can fail. Its HTTP status, its OpenAI `type`, its
//! `param` and its metric label are decided here and nowhere else; handlers only pick the
//! variant. Errors from other processes arrive as a [`WireError`] class and are mapped here
//! too (a broken link to the engine is the frontend's `engine_unavailable`). [`FrontendError`]
//! is why the service could not start or stopped abnormally.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use actix_web::error::JsonPayloadError;
use actix_web::http::header::RETRY_AFTER;
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use pdmesh_protocol::{ErrorClass, WireError};
use pdmesh_telemetry::log_limit::LogLimiter;
use serde::Serialize;
use thiserror::Error;

use crate::metrics::REQUEST_ERRORS_TOTAL;

/// Why an API request was refused or failed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ApiError {
    /// A parameter is invalid (400). `param` names the offending field when there is one.
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String> },
    /// Prompt plus completion do not fit the model's context (400).
    #[error("{message}")]
    ContextLength { message: String, param: &'static str },
    /// The body is not JSON or does not have the expected shape (400).
    #[error("{0}")]
    InvalidJson(String),
    /// The chat template could not render the messages (400).
    #[error("{0}")]
    Template(String),
    /// The `model` field names a model this server does not serve (404).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// Something named in the request does not exist in the mesh (404).
    #[error("{0}")]
    NotFound(String),
    /// A known path called with a method it does not serve (405, with `Allow`; OpenAI's
    /// `invalid_request_error` and its "Invalid method for URL" wording).
    #[error("Invalid method for URL ({method} {path}): this path accepts {allow}.")]
    MethodNotAllowed { method: String, path: String, allow: &'static str },
    /// `previous_response_id` names no stored response (404, OpenAI's `invalid_request_error`).
    #[error("Previous response with id '{0}' not found.")]
    PreviousResponseNotFound(String),
    /// `GET /v1/responses/{id}` names no stored response (404, OpenAI's `invalid_request_error`).
    #[error("Response with id '{0}' not found.")]
    ResponseNotFound(String),
    /// No valid API key (401): the `Authorization: Bearer <key>` header is missing, malformed
    /// or names no key this server accepts (docs/SECURITY.md, "API keys").
    #[error("{0}")]
    Unauthorized(String),
    /// The body is larger than the frontend accepts (413).
    #[error("{0}")]
    PayloadTooLarge(String),
    /// The client did not send the whole body within `limits.body_timeout_s` (408, D93).
    #[error("{0}")]
    BodyTimeout(String),
    /// The client's `X-Request-Id` names a request that is still in flight (400): outputs
    /// are routed by id, so two live requests cannot share one.
    #[error("request id `{0}` is already used by a request in flight")]
    DuplicateRequestId(String),
    /// The engine side is down or restarting (503, with `Retry-After`).
    #[error("{0}")]
    Unavailable(String),
    /// A bounded queue of the mesh is full — this frontend's in-flight bound, the dp-lb's, an
    /// engine's waiting queue or P's held-block share (503, with `Retry-After`).
    #[error("{0}")]
    Overloaded(String),
    /// The client's API key already has `limits.max_in_flight_per_key` requests in flight
    /// (429, with `Retry-After`; OpenAI's rate-limit body: `type: "requests"`,
    /// `code: "rate_limit_exceeded"`).
    #[error("{0}")]
    RateLimited(String),
    /// The engine side did not answer in time (504).
    #[error("{0}")]
    Timeout(String),
    /// A bug or an unexpected answer inside the mesh (500).
    #[error("{0}")]
    Internal(String),
    /// The mesh accepted the request and then failed it (`finish_reason = error`) (500).
    #[error("{0}")]
    EngineFailed(String),
}

/// The OpenAI error object (`{"error": {...}}`), as vLLM returns it: `code` is the HTTP
/// status, except for a 401 and a 429, where it is OpenAI's own name (`"invalid_api_key"`,
/// `"rate_limit_exceeded"`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// The inner object of an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: ErrorCode,
}

/// The `code` of an [`ErrorDetail`]: vLLM puts the HTTP status there; OpenAI names some
/// errors instead (`"invalid_api_key"`), and clients of either match on what they know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum ErrorCode {
    Status(u16),
    Name(&'static str),
}

impl ApiError {
    /// A 400 about one parameter.
    pub fn invalid(message: impl Into<String>, param: &str) -> Self {
        ApiError::InvalidRequest { message: message.into(), param: Some(param.to_string()) }
    }

    /// A 400 not tied to one parameter.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { message: message.into(), param: None }
    }

    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. }
            | ApiError::ContextLength { .. }
            | ApiError::InvalidJson(_)
            | ApiError::Template(_)
            | ApiError::DuplicateRequestId(_) => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_)
            | ApiError::NotFound(_)
            | ApiError::PreviousResponseNotFound(_)
            | ApiError::ResponseNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::RateLimited(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) | ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) | ApiError::EngineFailed(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI `type` field. 400s use OpenAI's `invalid_request_error`; the others use
    /// vLLM's names (`NotFoundError`, ...), which clients of vLLM already match on.
    pub fn error_type(&self) -> &'static str {
        if matches!(self, ApiError::PreviousResponseNotFound(_) | ApiError::ResponseNotFound(_)) {
            // The Responses API's own 404s read as OpenAI's.
            return "invalid_request_error";
        }
        match self.status() {
            // OpenAI answers a missing or wrong key with `invalid_request_error` too.
            StatusCode::BAD_REQUEST
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::REQUEST_TIMEOUT
            | StatusCode::UNAUTHORIZED
            | StatusCode::METHOD_NOT_ALLOWED => "invalid_request_error",
            StatusCode::NOT_FOUND => "NotFoundError",
            // OpenAI's rate-limit errors name the unit that ran out; ours is requests. vLLM has
            // no 429 of its own, so OpenAI's shape is what clients know.
            StatusCode::TOO_MANY_REQUESTS => "requests",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::GATEWAY_TIMEOUT => "TimeoutError",
            _ => "InternalServerError",
        }
    }

    /// The OpenAI `param` field.
    pub fn param(&self) -> Option<String> {
        match self {
            ApiError::InvalidRequest { param, .. } => param.clone(),
            ApiError::ContextLength { param, .. } => Some((*param).to_string()),
            ApiError::ModelNotFound(_) => Some("model".to_string()),
            ApiError::Template(_) => Some("messages".to_string()),
            ApiError::PreviousResponseNotFound(_) => Some("previous_response_id".to_string()),
            _ => None,
        }
    }

    /// Label of `pdmesh_frontend_request_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest { .. } => "invalid_request",
            ApiError::ContextLength { .. } => "context_length",
            ApiError::InvalidJson(_) => "invalid_json",
            ApiError::Template(_) => "template",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::PreviousResponseNotFound(_) | ApiError::ResponseNotFound(_) => "response_not_found",
            ApiError::PayloadTooLarge(_) => "payload_too_large",
            ApiError::BodyTimeout(_) => "body_timeout",
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::DuplicateRequestId(_) => "duplicate_request_id",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::RateLimited(_) => "rate_limited",
            ApiError::Timeout(_) => "timeout",
            ApiError::Internal(_) => "internal",
            ApiError::EngineFailed(_) => "engine_error",
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.error_type(),
                param: self.param(),
                code: match self {
                    ApiError::Unauthorized(_) => ErrorCode::Name("invalid_api_key"),
                    ApiError::RateLimited(_) => ErrorCode::Name("rate_limit_exceeded"),
                    _ => ErrorCode::Status(self.status().as_u16()),
                },
            },
        }
    }

    /// Count the error and log it: client mistakes at `info`, mesh trouble at `warn`/`error`.
    /// Called once per failed request, wherever the error is rendered (JSON or SSE).
    pub fn record(&self) {
        REQUEST_ERRORS_TOTAL.with_label_values(&[self.kind()]).inc();
        let status = self.status().as_u16();
        if matches!(self, ApiError::Overloaded(_)) {
            // Refusals come in storms: one line a second says it is happening.
            if let Some(suppressed) = OVERLOAD_LOG.check() {
                tracing::warn!(status, kind = self.kind(), error = %self, suppressed, "request refused: overloaded");
            }
            return;
        }
        if matches!(self, ApiError::RateLimited(_)) {
            // One client over its bound can send as fast as a storm; the message names no key.
            if let Some(suppressed) = RATE_LIMITED_LOG.check() {
                tracing::info!(status, kind = self.kind(), error = %self, suppressed, "request refused: rate limited");
            }
            return;
        }
        if matches!(self, ApiError::MethodNotAllowed { .. } | ApiError::NotFound(_)) {
            // Wrong paths and methods come from scanners and misconfigured clients, at any rate.
            if let Some(suppressed) = ROUTE_LOG.check() {
                tracing::info!(status, kind = self.kind(), error = %self, suppressed, "request refused: no such route");
            }
            return;
        }
        match status {
            500.. if matches!(self, ApiError::Internal(_)) => {
                tracing::error!(status, kind = self.kind(), error = %self, "request failed")
            }
            500.. => tracing::warn!(status, kind = self.kind(), error = %self, "request failed"),
            _ => tracing::info!(status, kind = self.kind(), error = %self, "request refused"),
        }
    }

    /// Map an error answer of the dp-lb: the class decides the status.
    pub fn from_wire(err: WireError) -> Self {
        match err.class {
            ErrorClass::InvalidRequest => ApiError::invalid_request(err.message),
            ErrorClass::NotFound => ApiError::NotFound(err.message),
            ErrorClass::Unavailable => ApiError::Unavailable(err.message),
            ErrorClass::Timeout => ApiError::Timeout(err.message),
            // A mesh-internal link that failed authentication: a deployment fault, not the client's.
            ErrorClass::Internal | ErrorClass::Unauthenticated => ApiError::Internal(err.message),
            ErrorClass::Overloaded => ApiError::Overloaded(err.message),
        }
    }

    /// A request the mesh failed after accepting it (`finish_reason = error`): 503 when the
    /// mesh says it was a capacity or liveness problem (message starts with "overloaded" or
    /// "unavailable"), 400 when the engine refused the request itself at admission ("invalid
    /// request"), 500 otherwise.
    pub fn from_engine_failure(message: Option<&str>) -> Self {
        let message = message.unwrap_or("the engine failed the request");
        let lower = message.trim_start().to_ascii_lowercase();
        if lower.starts_with("overloaded") {
            ApiError::Overloaded(message.to_string())
        } else if lower.starts_with("unavailable") {
            ApiError::Unavailable(message.to_string())
        } else if lower.starts_with("invalid request") {
            ApiError::invalid_request(message)
        } else if lower.starts_with("timeout") {
            ApiError::Timeout(message.to_string())
        } else {
            ApiError::EngineFailed(message.to_string())
        }
    }

    /// Map a body extraction failure (actix-web's `JsonConfig::error_handler`).
    pub fn from_json_error(err: &JsonPayloadError) -> Self {
        match err {
            JsonPayloadError::OverflowKnownLength { length, limit } => ApiError::PayloadTooLarge(format!(
                "request body of {length} bytes is larger than the limit of {limit} bytes"
            )),
            JsonPayloadError::Overflow { limit } => {
                ApiError::PayloadTooLarge(format!("request body is larger than the limit of {limit} bytes"))
            }
            JsonPayloadError::ContentType => ApiError::InvalidJson("the request body must be JSON".to_string()),
            JsonPayloadError::Deserialize(e) => ApiError::InvalidJson(format!("invalid request body: {e}")),
            JsonPayloadError::Payload(p) => Self::from_payload_error(p),
            other => ApiError::InvalidJson(format!("cannot read the request body: {other}")),
        }
    }
}

impl ApiError {
    /// A failure reading the body: 408 when the body timer ([`crate::body_timeout`]) ran out.
    pub fn from_payload_error(err: &actix_web::error::PayloadError) -> Self {
        match err {
            actix_web::error::PayloadError::Io(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                ApiError::BodyTimeout(e.to_string())
            }
            actix_web::error::PayloadError::Overflow => {
                ApiError::PayloadTooLarge("request body is larger than the limit".to_string())
            }
            other => ApiError::InvalidJson(format!("cannot read the request body: {other}")),
        }
    }
}

/// Marks a 503 that says "the engine side is down" (not "busy"): [`ApiError::Unavailable`].
pub use pdmesh_protocol::node_http::UNAVAILABLE_HEADER;

/// `Retry-After` of every 503 (and 429) this process sends (`limits.retry_after_s`).
static RETRY_AFTER_S: AtomicU32 = AtomicU32::new(1);

/// One overload log line a second, whatever the rate of refusals.
static OVERLOAD_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));

/// One per-key refusal log line a second.
static RATE_LIMITED_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));

/// One wrong-path or wrong-method log line a second.
static ROUTE_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));

/// Set the `Retry-After` this process sends (once, at start-up, from the node's limits).
pub fn set_retry_after_s(seconds: u32) {
    RETRY_AFTER_S.store(seconds, Ordering::Relaxed);
}

impl ApiError {
    /// The `Retry-After` header of this error: on 503 and 429 answers, which tell the client
    /// to come back rather than that it erred.
    pub fn retry_after_s(&self) -> Option<u32> {
        matches!(self.status(), StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS)
            .then(|| RETRY_AFTER_S.load(Ordering::Relaxed))
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status()
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status());
        if let ApiError::MethodNotAllowed { allow, .. } = self {
            response.insert_header((actix_web::http::header::ALLOW, *allow));
        }
        if let Some(seconds) = self.retry_after_s() {
            response.insert_header((RETRY_AFTER, seconds.to_string()));
        }
        if matches!(self, ApiError::Unavailable(_)) {
            // Both "down" and "busy" are 503s for a client; a router must tell them apart: a
            // node whose engine side is down is retried elsewhere, a busy one is not (D55).
            response.insert_header((UNAVAILABLE_HEADER, "1"));
        }
        response.json(self.body())
    }
}

/// Why the frontend could not start, or stopped abnormally.
#[derive(Debug, Error)]
pub enum FrontendError {
    #[error(transparent)]
    Config(#[from] pdmesh_config::ConfigError),
    #[error("invalid frontend options: {0}")]
    Options(String),
    #[error("cannot bind the engine output socket: {0}")]
    OutputSocket(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("cannot bind the HTTP server on {addr}: {source}")]
    HttpBind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP server failed: {0}")]
    Server(#[source] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_types_are_mapped_in_one_place() {
        let cases: Vec<(ApiError, u16, &str)> = vec![
            (ApiError::invalid("bad", "temperature"), 400, "invalid_request_error"),
            (ApiError::ContextLength { message: "long".into(), param: "max_tokens" }, 400, "invalid_request_error"),
            (ApiError::InvalidJson("x".into()), 400, "invalid_request_error"),
            (ApiError::Template("x".into()), 400, "invalid_request_error"),
            (ApiError::ModelNotFound("m".into()), 404, "NotFoundError"),
            (ApiError::PayloadTooLarge("x".into()), 413, "invalid_request_error"),
            (ApiError::Unavailable("x".into()), 503, "ServiceUnavailableError"),
            (ApiError::Overloaded("x".into()), 503, "ServiceUnavailableError"),
            (ApiError::RateLimited("x".into()), 429, "requests"),
            (ApiError::Timeout("x".into()), 504, "TimeoutError"),
            (ApiError::Internal("x".into()), 500, "InternalServerError"),
            (ApiError::EngineFailed("x".into()), 500, "InternalServerError"),
            (ApiError::Unauthorized("x".into()), 401, "invalid_request_error"),
        ];
        for (err, status, kind) in cases {
            assert_eq!(err.status().as_u16(), status, "{err:?}");
            assert_eq!(err.error_type(), kind, "{err:?}");
            let body = serde_json::to_value(err.body()).unwrap();
            if status == 401 {
                assert_eq!(body["error"]["code"], "invalid_api_key", "OpenAI's code for a bad key");
            } else if status == 429 {
                assert_eq!(body["error"]["code"], "rate_limit_exceeded", "OpenAI's code for a rate limit");
            } else {
                assert_eq!(body["error"]["code"], status);
            }
            assert_eq!(body["error"]["type"], kind);
            assert!(body["error"]["message"].is_string());
            assert!(body["error"].get("param").is_some());
        }
    }

    #[test]
    fn model_not_found_reads_like_vllm() {
        let body = serde_json::to_value(ApiError::ModelNotFound("gpt-x".into()).body()).unwrap();
        assert_eq!(body["error"]["message"], "The model `gpt-x` does not exist.");
        assert_eq!(body["error"]["type"], "NotFoundError");
        assert_eq!(body["error"]["param"], "model");
    }

    #[test]
    fn wire_classes_map_to_statuses() {
        let s = |c| ApiError::from_wire(WireError::new(c, "m")).status().as_u16();
        assert_eq!(s(ErrorClass::InvalidRequest), 400);
        assert_eq!(s(ErrorClass::NotFound), 404);
        assert_eq!(s(ErrorClass::Unavailable), 503);
        assert_eq!(s(ErrorClass::Timeout), 504);
        assert_eq!(s(ErrorClass::Internal), 500);
        assert_eq!(s(ErrorClass::Overloaded), 503);
        assert_eq!(ApiError::from_wire(WireError::new(ErrorClass::Overloaded, "m")).kind(), "overloaded");
    }

    #[test]
    fn engine_failures_split_by_message() {
        assert_eq!(ApiError::from_engine_failure(Some("unavailable: rank 0 died")).status().as_u16(), 503);
        assert_eq!(ApiError::from_engine_failure(Some("KV load failed")).status().as_u16(), 500);
        assert_eq!(ApiError::from_engine_failure(None).status().as_u16(), 500);
        let late = ApiError::from_engine_failure(Some("timeout: the request ran past its deadline"));
        assert_eq!(late.status().as_u16(), 504);
        let full = ApiError::from_engine_failure(Some("overloaded: waiting queue full"));
        assert_eq!((full.status().as_u16(), full.kind()), (503, "overloaded"));
    }

    #[test]
    fn every_503_carries_retry_after_and_others_do_not() {
        for (err, header) in [
            (ApiError::Overloaded("x".into()), true),
            (ApiError::Unavailable("x".into()), true),
            (ApiError::RateLimited("x".into()), true),
            (ApiError::invalid_request("x"), false),
            (ApiError::Internal("x".into()), false),
        ] {
            let response = err.error_response();
            let got = response.headers().get(RETRY_AFTER).map(|v| v.to_str().unwrap().to_string());
            assert_eq!(got.is_some(), header, "{err:?}");
            if let Some(v) = got {
                assert!(v.parse::<u32>().unwrap() >= 1);
            }
        }
    }
}
