//! Target `envelope`: any frame through `Envelope::decode`, the decoder of every socket in the
//! mesh. A frame that decodes must encode, and decoding that encoding must give the same
//! envelope and the same bytes again (decode∘encode is the identity on what we write).

use std::collections::{BTreeMap, HashSet};

use pdmesh_protocol::{Envelope, Message, TraceContext, PROTOCOL_VERSION};
use serde::Serialize;

/// The target's harness (it keeps no state).
#[derive(Debug, Default)]
pub struct Harness;

impl Harness {
    pub fn check(&mut self, data: &[u8]) {
        check(data)
    }
}

/// One input.
pub fn check(data: &[u8]) {
    let Ok(env) = Envelope::decode(data) else { return };
    let bytes = env.encode().expect("a decoded envelope encodes");
    let back = Envelope::decode(&bytes).expect("an encoded envelope decodes");
    let again = back.encode().expect("re-encodes");
    assert_eq!(bytes, again, "encode(decode(encode(e))) == encode(e)");
    // Floats carry NaN, which is not equal to itself: compare values only when they can be.
    #[allow(clippy::eq_op)]
    if env == env {
        assert_eq!(back, env, "decode(encode(e)) == e");
    }
}

/// A W3C context like the ones on real frames.
pub fn trace(span: u64) -> TraceContext {
    TraceContext {
        traceparent: Some(format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{span:016x}-01")),
        tracestate: Some("pdmesh=1".into()),
    }
}

/// Every message as a real frame (with request id, correlation and trace, and the per-request
/// traces of a batched step), a stub frame for any message the samples lack, and a few
/// frames that must be refused.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    let samples = crate::every_message();
    for (i, body) in samples.iter().enumerate() {
        let batched = matches!(body, Message::ExecuteStep(_) | Message::ConnectorCalls(_) | Message::StepResult(_));
        let mut env = Envelope::new(body.clone()).with_request_id(format!("cmpl-{i}")).with_corr(i as u64 + 1);
        env = env.with_trace(trace(i as u64 + 1));
        if batched {
            let traces: BTreeMap<String, TraceContext> =
                (0..3).map(|r| (format!("cmpl-{r}"), trace(100 + r as u64))).collect();
            env = env.with_traces(traces);
        }
        seeds.push(env.encode().expect("a sample encodes"));
        seeds.push(Envelope::new(body.clone()).encode().expect("a bare sample encodes"));
    }
    seeds.extend(stub_seeds(&samples));
    seeds.push(Vec::new());
    seeds.push(rmp_serde::to_vec_named(&Probe { version: PROTOCOL_VERSION + 1 }).unwrap_or_default());
    seeds
}

#[derive(Serialize)]
struct Probe {
    version: u16,
}

#[derive(Serialize)]
struct Stub<B> {
    version: u16,
    corr: u64,
    body: B,
}

/// Every variant name the decoder knows (from its own "expected one of" error), so that a
/// message added without a sample still gets a seed of its kind.
pub fn variant_names() -> Vec<String> {
    let probe =
        rmp_serde::to_vec_named(&Stub { version: PROTOCOL_VERSION, corr: 0, body: "\u{1}" }).unwrap_or_default();
    let Err(e) = Envelope::decode(&probe) else { return Vec::new() };
    let text = e.to_string();
    let Some((_, list)) = text.split_once("expected one of") else { return Vec::new() };
    list.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// The name a message is encoded under.
fn variant_of(body: &Message) -> Option<String> {
    match serde_json::to_value(body).ok()? {
        serde_json::Value::String(name) => Some(name),
        serde_json::Value::Object(map) => map.keys().next().cloned(),
        _ => None,
    }
}

/// A frame per variant that has no sample: the name with an empty body, as a unit and as a
/// struct, for the fuzzer to grow.
fn stub_seeds(samples: &[Message]) -> Vec<Vec<u8>> {
    let sampled: HashSet<String> = samples.iter().filter_map(variant_of).collect();
    let mut out = Vec::new();
    for name in variant_names().into_iter().filter(|n| !sampled.contains(n)) {
        eprintln!("envelope seeds: no sample of {name} in every_message(); seeding a stub");
        out.push(
            rmp_serde::to_vec_named(&Stub { version: PROTOCOL_VERSION, corr: 1, body: name.clone() })
                .unwrap_or_default(),
        );
        let body: BTreeMap<String, BTreeMap<String, u8>> = [(name, BTreeMap::new())].into();
        out.push(rmp_serde::to_vec_named(&Stub { version: PROTOCOL_VERSION, corr: 1, body }).unwrap_or_default());
    }
    out
}
