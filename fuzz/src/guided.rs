//! Target `guided`: a structured-output spec through the grammar compiler, as the frontend
//! checks it (`pdmesh_guided::validate`, D90) and as a worker's executor compiles it
//! (`Guide::mask`). The first byte picks the kind (JSON schema, regex, choice, Lark grammar,
//! JSON object); the rest is its text (for a choice, its strings split at NUL bytes).
//!
//! Must hold: every spec is answered, none crashes the process (a stack overflow aborts it,
//! which libFuzzer reports) or runs past the time budget; a refusal carries no backtrace; a
//! spec the frontend accepted also gives the executor a mask, never a failure to compile.

use std::time::Duration;

use pdmesh_guided::{validate, Guide, GuidedError, GuidedLimits, Mask};
use pdmesh_protocol::{GuidedSpec, SamplingParams, ScheduledChunk};
use serde_json::json;

pub struct Harness {
    guide: Guide,
}

impl Default for Harness {
    fn default() -> Self {
        // A budget well inside libFuzzer's per-input limit: an input that outlives it is a
        // refusal, not a hang.
        pdmesh_guided::set_limits(GuidedLimits { compile_timeout: Duration::from_secs(2), ..GuidedLimits::default() });
        Self { guide: Guide::single_byte(256) }
    }
}

/// The spec an input stands for.
pub fn spec(data: &[u8]) -> Option<GuidedSpec> {
    let (&kind, rest) = data.split_first()?;
    let text = String::from_utf8_lossy(rest).into_owned();
    Some(match kind % 5 {
        0 => GuidedSpec::JsonSchema(text),
        1 => GuidedSpec::Regex(text),
        2 => GuidedSpec::Choice(text.split('\0').map(str::to_string).collect()),
        3 => GuidedSpec::Lark(text),
        _ => GuidedSpec::JsonObject,
    })
}

impl Harness {
    pub fn check(&mut self, data: &[u8]) {
        let Some(spec) = spec(data) else { return };
        match validate(&spec) {
            Ok(()) => {
                let chunk = ScheduledChunk {
                    request_id: "fuzz".into(),
                    token_ids: vec![1],
                    start_pos: 0,
                    block_ids: vec![0],
                    sample: true,
                    sampling: SamplingParams { guided: Some(spec), ..SamplingParams::default() },
                    output_index: 0,
                    guided_output: Vec::new(),
                    history: None,
                };
                match self.guide.mask(&chunk) {
                    Some(Mask::Allowed(allowed)) => assert_eq!(allowed.len(), 257),
                    // the worker's compile has the same budget; a busy pool is not the spec's fault
                    Some(Mask::Fail(why)) => assert!(why.contains("busy") || why.contains("limit"), "{why}"),
                    None => panic!("a guided chunk gave no mask"),
                }
                self.guide.release(&["fuzz".into()]);
            }
            Err(e) => {
                let message = e.to_string();
                // A refusal may quote the spec (a grammar's offending line), so a marker counts
                // only when the spec itself does not carry it.
                let sent = String::from_utf8_lossy(data);
                for marker in ["<backtrace>", "stack backtrace", "panicked at", "panic:"] {
                    assert!(!message.contains(marker) || sent.contains(marker), "{message}");
                }
                if let GuidedError::Compiler(detail) = &e {
                    // a compiler panic is a finding in llguidance: report it
                    panic!("the grammar compiler panicked: {detail}");
                }
            }
        }
    }
}

/// Seeds: each kind, and the specs issue 40 found (a deep `$ref` chain, a huge choice).
pub fn seeds() -> Vec<Vec<u8>> {
    let with = |kind: u8, text: &str| {
        let mut v = vec![kind];
        v.extend_from_slice(text.as_bytes());
        v
    };
    let mut defs = serde_json::Map::new();
    for i in 0..300 {
        defs.insert(format!("a{i}"), json!({"$ref": format!("#/$defs/a{}", i + 1)}));
    }
    defs.insert("a300".into(), json!({"type": "integer"}));
    let deep = json!({"$ref": "#/$defs/a0", "$defs": defs}).to_string();
    let choices: Vec<String> = (0..2000).map(|i| format!("c{i}")).collect();
    vec![
        with(
            0,
            r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name"]}"#,
        ),
        with(
            0,
            r##"{"$ref":"#/$defs/n","$defs":{"n":{"type":"object","properties":{"kids":{"type":"array","items":{"$ref":"#/$defs/n"}}}}}}"##,
        ),
        with(0, &deep),
        with(1, "[a-z]+@[a-z]+\\.(com|org)"),
        with(2, "yes\0no\0maybe"),
        with(2, &choices.join("\0")),
        with(3, "start: \"a\" b\nb: \"b\"+"),
        with(4, ""),
    ]
}
