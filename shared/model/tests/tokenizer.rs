//! The tokenizer and chat template rebuilt from GGUF metadata.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test/bench code: fail loudly

mod common;

use pdmesh_model::{GgufTextCodec, ModelOptions};
use pdmesh_model_api::{ChatMessage, TextCodec};

fn codec() -> Option<GgufTextCodec> {
    let p = common::model_path()?;
    Some(GgufTextCodec::load(&p, &ModelOptions::default()).unwrap())
}

#[test]
fn encodes_known_ids() {
    let Some(c) = codec() else { return };
    let text = "Hello, world! The capital of France is";
    let ids = c.encode(text).unwrap();
    assert_eq!(ids, vec![19556, 28, 905, 17, 378, 3575, 282, 4649, 314]);
    assert_eq!(c.decode(&ids).unwrap(), text);
    assert_eq!(c.encode("<|im_start|>user\nHi<|im_end|>").unwrap(), vec![1, 4093, 198, 26843, 2]);
    // special tokens are skipped when decoding user-visible text
    assert_eq!(c.decode(&[1, 4093, 198, 26843, 2]).unwrap(), "user\nHi");
    assert_eq!(c.vocab_size(), 49152);
    assert_eq!(c.eos_token_ids(), &[2]);
    assert_eq!(c.max_model_len(), 8192);
}

#[test]
fn digits_are_split_individually() {
    let Some(c) = codec() else { return };
    let ids = c.encode("12345").unwrap();
    assert_eq!(ids.len(), 5, "{ids:?}");
}

#[test]
fn round_trips() {
    let Some(c) = codec() else { return };
    for text in [
        " leading space",
        "tabs\tand\nnewlines\n\n",
        "accents: café, naïve, Straße",
        "CJK: 日本語のテキスト",
        "emoji: 🦀🚀 👩‍💻",
        "digits 3.14159 and 2026",
        "  multiple   spaces  ",
    ] {
        let ids = c.encode(text).unwrap();
        assert_eq!(c.decode(&ids).unwrap(), text);
    }
}

#[test]
fn chat_template_renders_default_system_turn() {
    let Some(c) = codec() else { return };
    let user = [ChatMessage { role: "user".into(), content: "What is the capital of France?".into() }];
    let s = c.render_chat(&user).unwrap();
    assert!(s.starts_with("<|im_start|>system\n"), "{s:?}");
    assert!(s.contains("SmolLM"), "default system prompt: {s:?}");
    assert!(
        s.ends_with("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
        "{s:?}"
    );

    let with_system =
        [ChatMessage { role: "system".into(), content: "You are a concise assistant.".into() }, user[0].clone()];
    let s = c.render_chat(&with_system).unwrap();
    assert_eq!(
        s,
        "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = c.encode(&s).unwrap();
    assert_eq!(ids.len(), 27);
    assert_eq!(&ids[..1], &[1]);
    assert_eq!(&ids[ids.len() - 4..], &[1, 520, 9531, 198]);
}

#[test]
fn decode_stream_never_splits_utf8() {
    let Some(c) = codec() else { return };
    let text = "Crab 🦀, rocket 🚀, family 👨‍👩‍👧 and 日本語 — done.";
    let ids = c.encode(text).unwrap();
    let mut stream = c.decode_stream();
    let mut out = String::new();
    for &id in &ids {
        let piece = stream.step(id).unwrap();
        // `piece` is a String, so it is valid UTF-8 by construction; it must also never be a
        // replacement character standing in for half an emoji
        assert!(!piece.contains('\u{FFFD}'), "broken UTF-8 piece {piece:?}");
        out.push_str(&piece);
    }
    assert_eq!(out, text);
    // an emoji split over several byte-level tokens yields nothing until it is complete
    let crab = c.encode("🦀").unwrap();
    assert!(crab.len() > 1, "{crab:?}");
    let mut s = c.decode_stream();
    let pieces: Vec<String> = crab.iter().map(|&id| s.step(id).unwrap()).collect();
    assert!(pieces[..pieces.len() - 1].iter().all(|p| p.is_empty()), "{pieces:?}");
    assert_eq!(pieces.last().unwrap(), "🦀");
    // special tokens produce no text; out-of-vocabulary ids are an error
    assert_eq!(c.decode_stream().step(2).unwrap(), "");
    assert!(c.decode_stream().step(1 << 30).is_err());
}

#[test]
fn token_text_for_logprobs() {
    let Some(c) = codec() else { return };
    assert_eq!(c.token_text(905), " world");
    assert_eq!(c.token_text(u32::MAX), "");
}
