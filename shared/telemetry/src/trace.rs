//! W3C trace context: parse a client's `traceparent`, start a new trace when there is none,
//! and derive child contexts for each hop; parent `tracing` spans on an incoming context and
//! put the current span's context on outgoing Envelopes and HTTP requests.
//!
//! With OTLP export on ([`crate::otel_active`]), the context sent on is the sending span's own
//! (so the receiver's span is its child in the exported trace). With export off, no span has
//! an OpenTelemetry context and the functions fall back to [`next_hop`]: the trace id still
//! travels, for log correlation, and nothing else is paid.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use pdmesh_protocol::TraceContext;
use rand::Rng;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// A parsed `traceparent` (`00-<trace id>-<parent id>-<flags>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: u128,
    pub span_id: u64,
    pub sampled: bool,
}

impl TraceParent {
    /// Parse a `traceparent` header value; `None` if it is malformed (then a new trace starts,
    /// as the W3C spec asks).
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let version = parts.next()?;
        let trace = parts.next()?;
        let span = parts.next()?;
        let flags = parts.next()?;
        if version.len() != 2 || version == "ff" || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok()?;
        let span_id = u64::from_str_radix(span, 16).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        if trace_id == 0 || span_id == 0 {
            return None;
        }
        Some(Self { trace_id, span_id, sampled: flags & 1 == 1 })
    }

    /// A new root (random trace id and span id, sampled).
    pub fn new_root() -> Self {
        let mut rng = rand::thread_rng();
        Self { trace_id: rng.gen::<u128>().max(1), span_id: rng.gen::<u64>().max(1), sampled: true }
    }

    /// A child of this context: same trace, new span id.
    pub fn child(&self) -> Self {
        Self { trace_id: self.trace_id, span_id: rand::thread_rng().gen::<u64>().max(1), sampled: self.sampled }
    }

    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    pub fn header_value(&self) -> String {
        format!("00-{:032x}-{:016x}-{:02x}", self.trace_id, self.span_id, u8::from(self.sampled))
    }

    pub fn to_context(&self, tracestate: Option<String>) -> TraceContext {
        TraceContext { traceparent: Some(self.header_value()), tracestate }
    }
}

/// The context to put on the next hop: a child of `incoming`, or a new root.
pub fn next_hop(incoming: &TraceContext) -> TraceContext {
    let parent = incoming.traceparent.as_deref().and_then(TraceParent::parse).unwrap_or_else(TraceParent::new_root);
    parent.child().to_context(incoming.tracestate.clone())
}

/// The trace id (hex) of a context, for log fields.
pub fn trace_id(ctx: &TraceContext) -> String {
    ctx.traceparent.as_deref().and_then(TraceParent::parse).map(|p| p.trace_id_hex()).unwrap_or_default()
}

fn carrier(ctx: &TraceContext) -> HashMap<String, String> {
    let mut map = HashMap::new();
    if let Some(tp) = &ctx.traceparent {
        map.insert("traceparent".to_string(), tp.clone());
    }
    if let Some(ts) = &ctx.tracestate {
        map.insert("tracestate".to_string(), ts.clone());
    }
    map
}

/// Make `span` a child of the remote context `ctx` (an Envelope's or an HTTP request's). Call
/// it before the span is first entered. No-op without export, or when `ctx` holds no valid
/// `traceparent` (the span then starts a new trace, as W3C asks).
pub fn set_parent(span: &Span, ctx: &TraceContext) {
    if !crate::otel_active() || span.is_disabled() {
        return;
    }
    if ctx.traceparent.as_deref().and_then(TraceParent::parse).is_none() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&carrier(ctx));
    if let Err(e) = span.set_parent(parent) {
        tracing::debug!(error = %e, "span parent not set");
    }
}

/// `span`, made a child of `ctx` (see [`set_parent`]).
pub fn child_of(span: Span, ctx: &TraceContext) -> Span {
    set_parent(&span, ctx);
    span
}

/// The W3C context of `span`, when it is exported.
pub fn context_of(span: &Span) -> Option<TraceContext> {
    if !crate::otel_active() || span.is_disabled() {
        return None;
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut map: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut map);
    let traceparent = map.remove("traceparent")?;
    Some(TraceContext {
        traceparent: Some(traceparent),
        tracestate: map.remove("tracestate").filter(|s| !s.is_empty()),
    })
}

/// The context to send on the next hop from inside `span`, which handles a message that
/// arrived with `incoming`: the span's own context, or (export off) a child of `incoming`.
pub fn outgoing(span: &Span, incoming: &TraceContext) -> TraceContext {
    context_of(span).unwrap_or_else(|| next_hop(incoming))
}

/// The context of the current span, or none (for hops that have no incoming context).
pub fn current() -> TraceContext {
    context_of(&Span::current()).unwrap_or_default()
}

/// Spans that live as long as a request does in one process (engine-core's request span),
/// keyed by request id, so that batched messages can carry each request's own context.
/// A `static` per crate: `static SPANS: RequestSpans = RequestSpans::new();`.
#[derive(Debug)]
pub struct RequestSpans(Mutex<BTreeMap<String, Span>>);

/// Bound on open request spans per registry: beyond it new requests are served untraced
/// rather than letting a leak (a request never closed) grow without limit.
const MAX_OPEN_SPANS: usize = 65_536;

impl Default for RequestSpans {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestSpans {
    pub const fn new() -> Self {
        Self(Mutex::new(BTreeMap::new()))
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Span>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keep `span`, made a child of `parent`, open for `request_id` until [`Self::close`].
    /// Does nothing without export (the span would never be seen).
    pub fn open(&self, request_id: &str, span: Span, parent: &TraceContext) {
        if !crate::otel_active() || span.is_disabled() {
            return;
        }
        set_parent(&span, parent);
        let mut map = self.map();
        if map.len() < MAX_OPEN_SPANS || map.contains_key(request_id) {
            map.insert(request_id.to_string(), span);
        }
    }

    /// The span of `request_id` (a disabled span if there is none).
    pub fn get(&self, request_id: &str) -> Span {
        self.map().get(request_id).cloned().unwrap_or_else(Span::none)
    }

    /// End the span of `request_id` (it is exported once every clone is dropped).
    pub fn close(&self, request_id: &str) -> Option<Span> {
        self.map().remove(request_id)
    }

    /// The contexts of these requests' spans, for [`pdmesh_protocol::Envelope::with_traces`].
    pub fn contexts<'a>(&self, ids: impl Iterator<Item = &'a str>) -> BTreeMap<String, TraceContext> {
        if !crate::otel_active() {
            return BTreeMap::new();
        }
        let map = self.map();
        ids.filter_map(|id| Some((id.to_string(), map.get(id).and_then(context_of)?))).collect()
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }
}

/// Contexts remembered per request for events that happen later and outside any message of
/// that request (P freeing held blocks after D's read). Bounded like [`RequestSpans`].
#[derive(Debug)]
pub struct RequestContexts(Mutex<BTreeMap<String, TraceContext>>);

impl Default for RequestContexts {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestContexts {
    pub const fn new() -> Self {
        Self(Mutex::new(BTreeMap::new()))
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, TraceContext>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn remember(&self, request_id: &str, ctx: TraceContext) {
        if ctx.traceparent.is_none() {
            return;
        }
        let mut map = self.map();
        if map.len() < MAX_OPEN_SPANS || map.contains_key(request_id) {
            map.insert(request_id.to_string(), ctx);
        }
    }

    pub fn take(&self, request_id: &str) -> Option<TraceContext> {
        self.map().remove(request_id)
    }
}

/// `tracing` target of [`notice_hop`]'s events.
pub const NOTICE_HOP_TARGET: &str = "pdmesh_notice";

/// A debug event for one hop of a rule-R1 rejection notice on its way to P: `hop`, P's
/// request id and `age_us`, the time since D refused the request (its timestamp travels with
/// the notice). `RUST_LOG=warn,pdmesh_notice=debug` shows where notices spend their time
/// without the rest of the debug output (`pdmesh-load rejections --hops` sums it up).
pub fn notice_hop(hop: &'static str, p_request_id: &str, rejected_at_unix_us: Option<u64>) {
    if let Some(at) = rejected_at_unix_us {
        tracing::debug!(target: NOTICE_HOP_TARGET, hop, id = p_request_id,
            age_us = pdmesh_protocol::micros_since(at), "notice hop");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_child() {
        let v = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let p = TraceParent::parse(v).unwrap();
        assert_eq!(p.header_value(), v);
        let c = p.child();
        assert_eq!(c.trace_id, p.trace_id);
        assert_ne!(c.span_id, p.span_id);
        assert!(TraceParent::parse("garbage").is_none());
        assert!(TraceParent::parse("00-00000000000000000000000000000000-b7ad6b7169203331-01").is_none());
        let hop = next_hop(&TraceContext { traceparent: Some(v.into()), tracestate: None });
        assert_eq!(trace_id(&hop), "0af7651916cd43dd8448eb211c80319c");
        let root = next_hop(&TraceContext::default());
        assert_eq!(trace_id(&root).len(), 32);
    }
}
