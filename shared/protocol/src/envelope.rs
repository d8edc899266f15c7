//! The versioned envelope and its MessagePack codec.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::Message;

/// Version of the wire protocol. Bumped on any change that an older reader cannot tolerate
/// (see `docs/PROTOCOL.md`); appended `#[serde(default)]` fields do not bump it.
///
/// 2: a `StepResult` may report a failed forward pass (`ModelRunnerOutput::failure`); a
/// version-1 engine would read it as a successful step that sampled nothing.
pub const PROTOCOL_VERSION: u16 = 2;

/// W3C trace context (<https://www.w3.org/TR/trace-context/>), carried on every hop so one
/// client request is one trace across every process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceContext {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// Every frame on every pdmesh socket is one encoded `Envelope`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Always [`PROTOCOL_VERSION`] when written by this build.
    pub version: u16,
    /// The client-level request this message concerns, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Trace context of the span that sent this message.
    #[serde(default)]
    pub trace: TraceContext,
    /// Per-request trace contexts of a message that concerns several requests at once (an
    /// engine step, a batch of connector calls): each request stays in its own trace although
    /// the frame is shared. Empty (and not written) for single-request messages.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub traces: BTreeMap<String, TraceContext>,
    /// Correlation id for request/reply: a reply carries the id of the request it answers.
    /// 0 means "no reply expected / not a reply".
    #[serde(default)]
    pub corr: u64,
    /// The message itself.
    pub body: Message,
}

/// Only the version, decoded first so that a frame from another protocol version is reported
/// as such instead of as an obscure body decode error.
#[derive(Deserialize)]
struct VersionProbe {
    version: u16,
}

/// Why a frame could not be turned into an [`Envelope`] (or back).
#[derive(Debug, Error)]
pub enum CodecError {
    #[error("frame is not a pdmesh envelope: {0}")]
    NotAnEnvelope(String),
    #[error("protocol version {found} is not supported (this build speaks {supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("cannot decode {kind} body: {reason}")]
    Body { kind: &'static str, reason: String },
    #[error("cannot encode envelope: {0}")]
    Encode(String),
}

impl Envelope {
    /// A new envelope of the current version with no request id, trace or correlation.
    pub fn new(body: Message) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            request_id: None,
            trace: TraceContext::default(),
            traces: BTreeMap::new(),
            corr: 0,
            body,
        }
    }

    pub fn with_request_id(mut self, request_id: impl Into<String>) -> Self {
        self.request_id = Some(request_id.into());
        self
    }

    pub fn with_trace(mut self, trace: TraceContext) -> Self {
        self.trace = trace;
        self
    }

    /// Attach per-request trace contexts (see [`Envelope::traces`]).
    pub fn with_traces(mut self, traces: BTreeMap<String, TraceContext>) -> Self {
        self.traces = traces;
        self
    }

    pub fn with_corr(mut self, corr: u64) -> Self {
        self.corr = corr;
        self
    }

    /// A reply to `self`: same correlation id, request id and trace context.
    pub fn reply(&self, body: Message) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            request_id: self.request_id.clone(),
            trace: self.trace.clone(),
            traces: BTreeMap::new(),
            corr: self.corr,
            body,
        }
    }

    /// Encode as MessagePack with named fields.
    pub fn encode(&self) -> Result<Vec<u8>, CodecError> {
        rmp_serde::to_vec_named(self).map_err(|e| CodecError::Encode(e.to_string()))
    }

    /// Decode one frame. Never panics, whatever the bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, CodecError> {
        let probe: VersionProbe = rmp_serde::from_slice(bytes).map_err(|e| CodecError::NotAnEnvelope(e.to_string()))?;
        if probe.version != PROTOCOL_VERSION {
            return Err(CodecError::UnsupportedVersion { found: probe.version, supported: PROTOCOL_VERSION });
        }
        rmp_serde::from_slice(bytes).map_err(|e| CodecError::Body { kind: "envelope", reason: e.to_string() })
    }
}
