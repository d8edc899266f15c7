//! Server-sent events framing, the same for a node's stream and the router's relay of it.

use actix_web::web::Bytes;
use serde::Serialize;

use crate::error::ApiError;

/// One SSE event carrying `value` as JSON: `data: {...}\n\n`.
pub fn sse_data<T: Serialize>(value: &T) -> Bytes {
    // Serialised in place after the prefix: one buffer per event, no copy.
    let mut buf = Vec::with_capacity(256);
    buf.extend_from_slice(b"data: ");
    match serde_json::to_writer(&mut buf, value) {
        Ok(()) => {
            buf.extend_from_slice(b"\n\n");
            Bytes::from(buf)
        }
        Err(e) => {
            // Our own types always serialise; if one does not, say so in-band.
            tracing::error!(error = %e, "cannot serialise an SSE event");
            sse_data(&ApiError::Internal(format!("cannot serialise a chunk: {e}")).body())
        }
    }
}

/// The terminating event.
pub fn sse_done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// An error event (`data: {"error": {...}}`) followed by `data: [DONE]`.
pub fn sse_error(error: &ApiError) -> Bytes {
    let mut buf = sse_data(&error.body()).to_vec();
    buf.extend_from_slice(&sse_done());
    Bytes::from(buf)
}
