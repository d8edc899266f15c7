//! W3C trace context: parse a client's `traceparent`, start a new trace when there is none,
//! and derive child contexts for each hop.

use pdmesh_protocol::TraceContext;
use rand::Rng;

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
