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
