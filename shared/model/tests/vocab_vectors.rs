//! llama.cpp's tokenizer test vectors (`tests/test-tokenizer-0.cpp`): for each vocabulary, the
//! ids llama.cpp gives a set of hard texts (runs of spaces and newlines, digits, apostrophes,
//! emoji, CJK, code), encoded without adding special tokens. Our ids must be those, token for
//! token, and decode back to the text.
//!
//! The files come from `scripts/fetch-vocab-vectors.sh` (scripts/test.sh runs it and exports
//! `PDMESH_VOCAB_DIR`). Without the variable a test says it skips; with it, a missing file
//! fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: fail loudly

use std::path::PathBuf;

use pdmesh_model::{GgufTextCodec, ModelOptions};
use pdmesh_model_api::TextCodec;

/// Texts and the ids llama.cpp gives them.
type Vectors = Vec<(String, Vec<u32>)>;

/// `name`'s vocabulary and its vectors, or `None` when `PDMESH_VOCAB_DIR` is unset.
fn vectors(name: &str) -> Option<(GgufTextCodec, Vectors)> {
    let Some(dir) = std::env::var_os("PDMESH_VOCAB_DIR") else {
        eprintln!("PDMESH_VOCAB_DIR is unset: skipping the {name} vectors (run scripts/fetch-vocab-vectors.sh)");
        return None;
    };
    let base = PathBuf::from(dir).join(format!("ggml-vocab-{name}.gguf"));
    let read = |ext: &str| {
        let p = base.with_extension(format!("gguf{ext}"));
        std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-vocab-vectors.sh)", p.display()))
    };
    let (inp, out) = (read(".inp"), read(".out"));
    // test-tokenizer-0.cpp: texts separated by this line, one line of ids per text
    // (the file ends with a separator, after which there is no text)
    let sep = "\n__ggml_vocab_test__\n";
    let texts: Vec<&str> = inp.strip_suffix(sep).unwrap_or(&inp).split(sep).collect();
    let ids: Vec<Vec<u32>> = out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(texts.len(), ids.len(), "{name}: texts and id lines differ in number");
    assert!(texts.len() > 30, "{name}: {} vectors", texts.len());
    let codec = GgufTextCodec::load(&base, &ModelOptions::default()).unwrap();
    Some((codec, texts.into_iter().map(str::to_string).zip(ids).collect()))
}

/// Every vector's ids, and the text back from them (SentencePiece drops the prefix space it
/// adds, as llama.cpp's detokenizer does for a text that did not start with one).
fn check(name: &str) {
    let Some((codec, vectors)) = vectors(name) else { return };
    let mut failures = Vec::new();
    for (text, expected) in &vectors {
        let ids = codec.encode(text).unwrap();
        if &ids != expected {
            failures.push(format!("{text:?}\n  ours:     {ids:?}\n  llama.cpp: {expected:?}"));
            continue;
        }
        let back = codec.decode(&ids).unwrap();
        let back = match name {
            "llama-spm" => back.strip_prefix(' ').map(str::to_string).unwrap_or(back),
            _ => back,
        };
        assert_eq!(&back, text, "{name}: decode of {ids:?}");
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} vectors differ:\n{}",
        failures.len(),
        vectors.len(),
        failures.join("\n")
    );
}

#[test]
fn qwen2_ids_are_llama_cpps() {
    check("qwen2");
}

#[test]
fn llama_bpe_ids_are_llama_cpps() {
    check("llama-bpe");
}

/// SentencePiece with `add_space_prefix` (Llama 2's vocabulary): the score-ordered merges, the
/// prefix space and byte fallback, against llama.cpp.
#[test]
fn llama_spm_ids_are_llama_cpps() {
    check("llama-spm");
}

/// BOS: the Llama 3 and Llama 2 vocabularies ask for it (Qwen's does not), and a prompt gets
/// exactly one, whether or not the text already begins with it.
#[test]
fn prompts_begin_with_bos_when_the_vocabulary_asks() {
    for (name, bos) in [("llama-bpe", Some(128000u32)), ("llama-spm", Some(1)), ("qwen2", None)] {
        let Some((codec, _)) = vectors(name) else { return };
        let plain = codec.encode("Hello world").unwrap();
        let prompt = codec.encode_prompt("Hello world").unwrap();
        match bos {
            Some(bos) => {
                assert!(codec.adds_bos(), "{name}");
                assert_eq!(prompt[0], bos, "{name}");
                assert_eq!(&prompt[1..], &plain[..], "{name}");
                let bos_text = codec.token_text(bos);
                let again = codec.encode_prompt(&format!("{bos_text}Hello world")).unwrap();
                assert_eq!(again, prompt, "{name}: a text that begins with BOS gets no second one");
            }
            None => {
                assert!(!codec.adds_bos(), "{name}");
                assert_eq!(prompt, plain, "{name}");
            }
        }
    }
}
