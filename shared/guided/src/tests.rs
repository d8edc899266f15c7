use super::*;
use pdmesh_protocol::SamplingParams;

fn chunk(id: &str, spec: GuidedSpec, output: &[u32]) -> ScheduledChunk {
    ScheduledChunk {
        request_id: id.into(),
        token_ids: vec![1],
        start_pos: 0,
        block_ids: vec![0],
        sample: true,
        sampling: SamplingParams { guided: Some(spec), ..SamplingParams::default() },
        output_index: output.len() as u32,
        guided_output: output.to_vec(),
        history: None,
    }
}

/// Drive a single-byte guide to the end, always taking the allowed token `pick` chooses.
fn generate(guide: &mut Guide, spec: GuidedSpec, pick: impl Fn(&[u32]) -> u32) -> String {
    let mut out = Vec::new();
    for _ in 0..400 {
        let Some(Mask::Allowed(allowed)) = guide.mask(&chunk("r", spec.clone(), &out)) else { panic!("no mask") };
        let ids: Vec<u32> = allowed.iter().enumerate().filter(|(_, a)| **a).map(|(i, _)| i as u32).collect();
        assert!(!ids.is_empty());
        let t = if ids.contains(&256) { 256 } else { pick(&ids) };
        guide.commit("r", t);
        if t == 256 {
            break;
        }
        out.push(t);
    }
    String::from_utf8(out.iter().map(|&t| t as u8).collect()).unwrap()
}

#[test]
fn bad_specs_are_named_and_good_ones_compile() {
    assert!(validate(&GuidedSpec::JsonObject).is_ok());
    assert!(
        validate(&GuidedSpec::JsonSchema(r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#.into())).is_ok()
    );
    assert!(validate(&GuidedSpec::Regex("[a-z]+@[a-z]+\\.com".into())).is_ok());
    assert!(validate(&GuidedSpec::Choice(vec!["yes".into(), "no \"quoted\"".into()])).is_ok());
    assert!(validate(&GuidedSpec::Lark("start: \"a\"+".into())).is_ok());
    let e = validate(&GuidedSpec::JsonSchema("{not json".into())).unwrap_err();
    assert!(e.to_string().contains("not valid JSON"), "{e}");
    let e = validate(&GuidedSpec::JsonSchema(r#"{"type":"objekt"}"#.into())).unwrap_err();
    assert!(e.to_string().contains("objekt"), "{e}");
    assert!(validate(&GuidedSpec::JsonSchema("[1]".into())).is_err());
    assert!(validate(&GuidedSpec::Regex("(unclosed".into())).is_err());
    assert!(validate(&GuidedSpec::Choice(vec![])).is_err());
    assert!(validate(&GuidedSpec::Lark("start: undefined_rule".into())).is_err());
}

/// A spec that compiles but admits no output (found by the `guided` fuzz target: a `$ref`
/// pointing at itself) is refused by [`validate`], naming why, and never reaches an executor.
#[test]
fn a_spec_with_no_possible_output_is_refused_up_front() {
    let cycle = json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}).to_string();
    let e = validate(&GuidedSpec::JsonSchema(cycle.clone())).unwrap_err();
    assert!(matches!(e, GuidedError::Invalid(_)) && e.to_string().contains("admits no output"), "{e}");
    // what the executor would have met: a compiled matcher with no first token
    let mut guide = Guide::single_byte(256);
    assert!(matches!(guide.mask(&chunk("c", GuidedSpec::JsonSchema(cycle), &[])), Some(Mask::Fail(_))));
    // the same shape with something at the end of the chain is fine
    let ok = json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}}});
    assert!(validate(&GuidedSpec::JsonSchema(ok.to_string())).is_ok());
}

#[test]
fn masks_keep_the_output_in_the_grammar_and_end_it() {
    let mut g = Guide::single_byte(256);
    // the highest allowed byte: far from what the grammar "wants", still valid
    let s = generate(&mut g, GuidedSpec::Regex("(cat|dog)-[0-9]{2}".into()), |ids| *ids.last().unwrap());
    assert!(s == "dog-99", "{s}");
    let s = generate(&mut g, GuidedSpec::Choice(vec!["alpha".into(), "beta".into()]), |ids| ids[0]);
    assert_eq!(s, "alpha");
    let schema = r#"{"type":"object","properties":{"n":{"type":"integer"},"tag":{"enum":["x","y"]}},"required":["n","tag"],"additionalProperties":false}"#;
    let s = generate(&mut g, GuidedSpec::JsonSchema(schema.into()), |ids| ids[0]);
    let v: Value = serde_json::from_str(&s).unwrap();
    assert!(v["n"].as_f64().is_some_and(|f| f.fract() == 0.0) && (v["tag"] == "x" || v["tag"] == "y"), "{s}");
}

#[test]
fn a_matcher_is_rebuilt_from_the_chunk_tokens_when_the_cache_lacks_it() {
    let spec = GuidedSpec::Regex("ab[0-9]".into());
    let mut g = Guide::single_byte(256);
    // a fresh guide (another worker, D, a restart) at output "ab": only digits allowed
    let Some(Mask::Allowed(a)) = g.mask(&chunk("x", spec.clone(), b"ab".map(u32::from).as_slice())) else { panic!() };
    assert!(a[usize::from(b'7')] && !a[usize::from(b'a')] && !a[256]);
    // a recompute that diverged from the cached tokens rebuilds too
    let Some(Mask::Allowed(a)) = g.mask(&chunk("x", spec.clone(), &[u32::from(b'a')])) else { panic!() };
    assert!(a[usize::from(b'b')] && !a[usize::from(b'7')]);
    // tokens the grammar could not have produced fail the request instead of freeing it
    assert!(matches!(g.mask(&chunk("y", spec, &[u32::from(b'z')])), Some(Mask::Fail(_))));
    g.release(&["x".into(), "y".into()]);
    assert_eq!(g.cached(), 0);
    // no grammar, no mask
    let mut plain = chunk("z", GuidedSpec::JsonObject, &[]);
    plain.sampling.guided = None;
    assert!(g.mask(&plain).is_none());
}

#[test]
fn byte_level_tokens_decode_to_bytes() {
    let toks = vec!["Ġhello".to_string(), "<|im_end|>".to_string(), "Ċ".to_string(), "{\"".to_string()];
    let b = byte_level_token_bytes(&toks, &[false, true, false, false]);
    assert_eq!(b[0], b" hello");
    assert_eq!(b[1][0], TokTrie::SPECIAL_TOKEN_MARKER);
    assert_eq!(b[2], b"\n");
    assert_eq!(b[3], b"{\"");
}

#[test]
fn apply_mask_blocks_everything_not_allowed() {
    let mut l = vec![1.0, 2.0, 3.0, 4.0];
    apply_mask(&[true, false, true], &mut l);
    assert_eq!(l[0], 1.0);
    assert!(l[1].is_infinite() && l[3].is_infinite());
}

/// A schema whose root is a chain of `depth` `$ref`s, each an object whose one property is
/// the next (the shape that overflowed a 2 MiB stack at 300), the last an integer.
fn ref_chain(depth: usize) -> GuidedSpec {
    let mut defs = serde_json::Map::new();
    for i in 0..depth {
        let next = if i + 1 == depth {
            json!({"type": "integer"})
        } else {
            json!({"type": "object", "properties": {"x": {"$ref": format!("#/$defs/a{}", i + 1)}}, "required": ["x"]})
        };
        defs.insert(format!("a{i}"), next);
    }
    GuidedSpec::JsonSchema(json!({"$ref": "#/$defs/a0", "$defs": defs}).to_string())
}

/// Issue 40, defect 1: a 300-step `$ref` chain overflowed the compiling thread's stack and
/// aborted the process. Now it is refused, naming the limit, and a chain within the limit
/// still compiles.
#[test]
fn deep_ref_chain_is_refused_naming_the_limit() {
    let e = validate(&ref_chain(300)).unwrap_err();
    assert!(matches!(e, GuidedError::Limit(_)), "{e:?}");
    assert!(e.to_string().contains("guided_max_ref_depth"), "{e}");
    assert!(validate(&ref_chain(40)).is_ok());
    // the executor side refuses it the same way (a request ends; the worker lives)
    let mut guide = Guide::single_byte(256);
    assert!(matches!(guide.mask(&chunk("deep", ref_chain(300), &[])), Some(Mask::Fail(_))));
}

/// The compile threads' stack holds chains far past the limit: a limit raised by an operator
/// cannot bring the crash back.
#[test]
fn compile_threads_survive_chains_past_the_limit() {
    let limits = GuidedLimits { max_ref_depth: 10_000, ..GuidedLimits::default() };
    let factory = validation_factory().unwrap();
    for depth in [300, 3000] {
        let r = compile_within(factory.clone(), &ref_chain(depth), limits.clone(), Ok);
        assert!(r.is_ok(), "depth {depth}: {:?}", r.err());
    }
}

#[test]
fn ref_depth_counts_chains_cycles_and_fanout() {
    let chain = |spec: GuidedSpec| match spec {
        GuidedSpec::JsonSchema(t) => serde_json::from_str::<Value>(&t).unwrap(),
        _ => unreachable!(),
    };
    assert_eq!(limits::ref_depth(&chain(ref_chain(5)), 100), 5);
    assert_eq!(limits::ref_depth(&chain(ref_chain(500)), 100), 101);
    // a recursive schema (a tree) is one step deep, not infinite
    let tree = json!({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}});
    assert_eq!(limits::ref_depth(&tree, 100), 1);
    // a wide diamond lattice: 40 levels of two refs each to both nodes of the next level
    // (2^40 paths) is measured in linear time
    let mut defs = serde_json::Map::new();
    for i in 0..40 {
        let next = json!({"anyOf": [{"$ref": format!("#/$defs/l{}", i + 1)}, {"$ref": format!("#/$defs/r{}", i + 1)}]});
        defs.insert(format!("l{i}"), next.clone());
        defs.insert(format!("r{i}"), next);
    }
    defs.insert("l40".into(), json!({"type": "null"}));
    defs.insert("r40".into(), json!({"type": "null"}));
    assert_eq!(limits::ref_depth(&json!({"$ref": "#/$defs/l0", "$defs": defs}), 100), 41);
}

/// Issue 40, defect 3: 100k choices took 29 s to refuse. Now the count is refused before
/// any work, naming the limit, and the verdict is cached.
#[test]
fn huge_choice_is_refused_before_any_work() {
    let many: Vec<String> = (0..100_000).map(|i| format!("choice number {i}")).collect();
    let e = validate(&GuidedSpec::Choice(many.clone())).unwrap_err();
    assert!(e.to_string().contains("guided_max_choices") && e.to_string().contains("100000"), "{e}");
    let long = vec!["x".repeat(300 * 1024)];
    assert!(validate(&GuidedSpec::Choice(long)).unwrap_err().to_string().contains("guided_max_spec_bytes"));
    let big_schema = format!(r#"{{"type":"string","description":"{}"}}"#, "d".repeat(300 * 1024));
    assert!(validate(&GuidedSpec::JsonSchema(big_schema)).unwrap_err().to_string().contains("guided_max_spec_bytes"));
    // within the limits a long choice list compiles
    let ok: Vec<String> = (0..1000).map(|i| format!("choice number {i}")).collect();
    assert!(validate(&GuidedSpec::Choice(ok)).is_ok());
}

/// A caught compiler panic carries a backtrace with build paths: none of it reaches the
/// message a client sees; all of it stays in the detail for the log.
#[test]
fn compiler_panics_never_reach_the_message() {
    let raw = "panic: index out of bounds\n<backtrace>\n  0: /root/.cargo/registry/src/x.rs:12\n</backtrace>";
    let e = GuidedError::from_compiler(raw.into());
    assert!(!e.to_string().contains("backtrace") && !e.to_string().contains('/'), "{e}");
    assert_eq!(e.detail(), raw);
    let long = GuidedError::from_compiler(format!("bad\nline two\nline three\nline four {}", "x".repeat(5000)));
    assert!(long.to_string().len() <= 500 && !long.to_string().contains("line four"), "{long}");
}

/// Verdicts are cached by content, refusals too.
#[test]
fn verdicts_are_cached_by_content() {
    let spec = GuidedSpec::Regex("cached-[0-9]{3}".into());
    assert_eq!(cache::get(&spec), None);
    assert!(validate(&spec).is_ok());
    assert_eq!(cache::get(&spec), Some(Ok(())));
    let bad = GuidedSpec::Regex("cached-(".into());
    let first = validate(&bad).unwrap_err();
    assert_eq!(cache::get(&bad), Some(Err(first)));
}

/// Schemas as OpenAI-style clients write them, compiled as vLLM compiles them: a `oneOf` union
/// is read as `anyOf` and still keeps the output inside the union; an unknown `format` is
/// ignored (JSON Schema allows it) rather than refused; a schema that cannot compile even
/// leniently is still refused, naming why.
#[test]
fn one_of_and_unknown_formats_compile_as_vllm_compiles_them() {
    let one_of = json!({
        "type": "object",
        "properties": {"v": {"oneOf": [{"type": "integer"}, {"enum": ["none"]}]}},
        "required": ["v"],
        "additionalProperties": false
    });
    assert!(validate(&GuidedSpec::JsonSchema(one_of.to_string())).is_ok());
    let mut g = Guide::single_byte(256);
    for pick in [|ids: &[u32]| ids[0], |ids: &[u32]| *ids.last().unwrap()] {
        let s = generate(&mut g, GuidedSpec::JsonSchema(one_of.to_string()), pick);
        let v: Value = serde_json::from_str(&s).unwrap();
        assert!(v["v"].is_i64() || v["v"] == "none", "{s}");
    }
    let html = json!({
        "type": "object",
        "properties": {"page": {"type": "string", "format": "html"}},
        "required": ["page"],
        "additionalProperties": false
    });
    assert!(validate(&GuidedSpec::JsonSchema(html.to_string())).is_ok());
    // close the string as soon as the grammar allows (the lowest byte would fill it forever)
    let s = generate(&mut g, GuidedSpec::JsonSchema(html.to_string()), |ids| {
        if ids.contains(&u32::from(b'"')) {
            u32::from(b'"')
        } else {
            ids[0]
        }
    });
    let v: Value = serde_json::from_str(&s).unwrap();
    assert!(v["page"].is_string(), "{s}");
    let e = validate(&GuidedSpec::JsonSchema(r#"{"type":"objekt","format":"html"}"#.into())).unwrap_err();
    assert!(matches!(e, GuidedError::Invalid(_)) && e.to_string().contains("objekt"), "{e}");
}
