//! Request headers the frontend honours: `X-Request-Id` (the engine request id, echoed back),
//! `X-data-parallel-rank` (pin to one engine rank) and W3C `traceparent` / `tracestate`.

use actix_web::http::header::HeaderMap;
use pdmesh_protocol::TraceContext;

use crate::error::ApiError;

pub use pdmesh_protocol::node_http::{
    DATA_PARALLEL_RANK_HEADER as DATA_PARALLEL_RANK, ENGINE_ID_SUFFIX_HEADER as ENGINE_ID_SUFFIX,
    REQUEST_ID_HEADER as REQUEST_ID,
};
/// Longest accepted client request id.
pub const MAX_REQUEST_ID_LEN: usize = 256;

/// What the headers of one generation request say.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestMeta {
    /// The client's request id: its `X-Request-Id` as sent, or a new uuid. Echoed in the
    /// response header, the response `id`, logs and traces.
    pub request_id: String,
    /// The engine request id: unique whatever the client sends (the client's id plus a
    /// random suffix, as vLLM does), so that a retried or reused `X-Request-Id` can never
    /// alias another request's blocks; P's `kv_transfer_params.remote_request_id` is this id.
    pub engine_request_id: String,
    pub data_parallel_rank: Option<u32>,
    /// The context for the next hop (a child of the client's, or a new root).
    pub trace: TraceContext,
    /// Trace id (hex) for log fields.
    pub trace_id: String,
    /// The client's own context (`traceparent` / `tracestate` as sent), which the frontend's
    /// request span is parented on.
    pub parent: TraceContext,
}

/// The client's request id, validated, or a fresh one. vLLM uses the header as is; ids are
/// bounded and free of control characters because they end up in logs and metrics-free
/// labels of other processes.
pub fn request_id(headers: &HeaderMap) -> Result<String, ApiError> {
    let Some(value) = headers.get(REQUEST_ID) else {
        return Ok(new_request_id());
    };
    let id = value.to_str().map_err(|_| ApiError::invalid_request("X-Request-Id must be visible ASCII text."))?.trim();
    if id.is_empty() {
        return Ok(new_request_id());
    }
    if id.len() > MAX_REQUEST_ID_LEN {
        return Err(ApiError::invalid_request(format!(
            "X-Request-Id is {} characters long; the limit is {MAX_REQUEST_ID_LEN}.",
            id.len()
        )));
    }
    if id.chars().any(char::is_control) {
        return Err(ApiError::invalid_request("X-Request-Id must not contain control characters."));
    }
    Ok(id.to_string())
}

/// A new request id (uuid v4, simple form).
pub fn new_request_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// A random engine-id suffix: 16 hex digits (60 random bits of a v4 uuid).
pub fn new_engine_id_suffix() -> String {
    let mut id = new_request_id();
    id.truncate(16);
    id
}

/// The engine request id for the client's `request_id`: `<client id>-<suffix>`, the suffix
/// the router chose for its prefill leg when it is 16 hex digits, else a fresh random one.
pub fn engine_request_id(request_id: &str, headers: &HeaderMap) -> String {
    let routed = headers
        .get(ENGINE_ID_SUFFIX)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit()));
    match routed {
        Some(suffix) => format!("{request_id}-{}", suffix.to_ascii_lowercase()),
        None => format!("{request_id}-{}", new_engine_id_suffix()),
    }
}

/// `X-data-parallel-rank` as a number; anything else is a 400 (an out-of-range rank is the
/// dp-lb's to refuse, since only it knows how many ranks there are).
pub fn data_parallel_rank(headers: &HeaderMap) -> Result<Option<u32>, ApiError> {
    let Some(value) = headers.get(DATA_PARALLEL_RANK) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .map(Some)
        .ok_or_else(|| ApiError::invalid_request("X-data-parallel-rank must be a non-negative integer."))
}

/// The trace context to put on the Envelope: a child of the client's `traceparent`, or a new
/// root when there is none or it is malformed (as the W3C spec asks).
pub fn trace_context(headers: &HeaderMap) -> TraceContext {
    pdmesh_telemetry::trace::next_hop(&client_trace(headers))
}

/// The client's `traceparent` / `tracestate` headers as sent.
pub fn client_trace(headers: &HeaderMap) -> TraceContext {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    TraceContext { traceparent: get("traceparent"), tracestate: get("tracestate") }
}

/// Every header of a generation request. The request id is settled first so that a refusal
/// of a later header still answers with some id.
pub fn request_meta(headers: &HeaderMap) -> Result<RequestMeta, (String, ApiError)> {
    let request_id = request_id(headers).map_err(|e| (new_request_id(), e))?;
    let data_parallel_rank = data_parallel_rank(headers).map_err(|e| (request_id.clone(), e))?;
    let engine_request_id = engine_request_id(&request_id, headers);
    let parent = client_trace(headers);
    let trace = pdmesh_telemetry::trace::next_hop(&parent);
    let trace_id = pdmesh_telemetry::trace::trace_id(&trace);
    Ok(RequestMeta { request_id, engine_request_id, data_parallel_rank, trace, trace_id, parent })
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::{HeaderName, HeaderValue};

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_bytes(v).unwrap());
        }
        h
    }

    #[test]
    fn request_id_is_kept_or_generated() {
        assert_eq!(request_id(&headers(&[("X-Request-Id", b"abc-123")])).unwrap(), "abc-123");
        let fresh = request_id(&headers(&[])).unwrap();
        assert_eq!(fresh.len(), 32);
        assert_ne!(fresh, request_id(&headers(&[])).unwrap());
        assert_eq!(request_id(&headers(&[("x-request-id", b"  ")])).unwrap().len(), 32);
    }

    #[test]
    fn bad_request_ids_are_400() {
        let long = "a".repeat(MAX_REQUEST_ID_LEN + 1);
        let e = request_id(&headers(&[("x-request-id", long.as_bytes())])).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        assert!(request_id(&headers(&[("x-request-id", "a".repeat(256).as_bytes())])).is_ok());
        let e = request_id(&headers(&[("x-request-id", b"a\tb")])).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        let e = request_id(&headers(&[("x-request-id", b"caf\xc3\xa9")])).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
    }

    #[test]
    fn dp_rank_header() {
        assert_eq!(data_parallel_rank(&headers(&[])).unwrap(), None);
        assert_eq!(data_parallel_rank(&headers(&[("X-data-parallel-rank", b"3")])).unwrap(), Some(3));
        assert_eq!(data_parallel_rank(&headers(&[("x-data-parallel-rank", b" 0 ")])).unwrap(), Some(0));
        for bad in [&b"-1"[..], b"x", b"", b"1.5", b"99999999999"] {
            let e = data_parallel_rank(&headers(&[("x-data-parallel-rank", bad)])).unwrap_err();
            assert_eq!(e.status().as_u16(), 400);
        }
    }

    #[test]
    fn trace_context_continues_the_clients_trace() {
        let tp = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let m = request_meta(&headers(&[("traceparent", tp), ("tracestate", b"k=v")])).unwrap();
        assert_eq!(m.trace_id, "0af7651916cd43dd8448eb211c80319c");
        assert_ne!(m.trace.traceparent.as_deref().unwrap().as_bytes(), tp);
        assert_eq!(m.trace.tracestate.as_deref(), Some("k=v"));
        let m = request_meta(&headers(&[("traceparent", b"garbage")])).unwrap();
        assert_eq!(m.trace_id.len(), 32);
        let (id, e) = request_meta(&headers(&[("x-request-id", b"r1"), ("x-data-parallel-rank", b"x")])).unwrap_err();
        assert_eq!(id, "r1");
        assert_eq!(e.status().as_u16(), 400);
    }
}
