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
    let user = [ChatMessage::text("user", "What is the capital of France?")];
    let s = c.render_chat(&user).unwrap();
    assert!(s.starts_with("<|im_start|>system\n"), "{s:?}");
    assert!(s.contains("SmolLM"), "default system prompt: {s:?}");
    assert!(
        s.ends_with("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
        "{s:?}"
    );

    let with_system = [ChatMessage::text("system", "You are a concise assistant."), user[0].clone()];
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

/// A small deterministic generator (xorshift) for the sequences below.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Decoding cuts the text from each token's bytes, computed once (`TokenBytes`): it must give
/// what the tokenizer's own decoder gives, for every token alone (special tokens included:
/// nothing) and for random sequences, which split multi-byte characters, mix in special
/// tokens and leave stray bytes. Fails on the first id or sequence that differs.
#[test]
fn decoding_from_token_bytes_equals_the_tokenizer() {
    let Some(c) = codec() else { return };
    for id in 0..c.vocab_size() {
        assert_eq!(c.decode(&[id]).unwrap(), c.tokenizer_decode(&[id]).unwrap(), "token {id}");
    }
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for round in 0..3000 {
        let len = 1 + (next(&mut state) % 12) as usize;
        let ids: Vec<u32> = (0..len)
            .map(|_| match next(&mut state) % 8 {
                // Special tokens, and the byte tokens that split characters, over-represented.
                0 => (next(&mut state) % 17) as u32,
                1 => 17 + (next(&mut state) % 256) as u32,
                _ => (next(&mut state) % u64::from(c.vocab_size())) as u32,
            })
            .collect();
        assert_eq!(c.decode(&ids).unwrap(), c.tokenizer_decode(&ids).unwrap(), "round {round}: {ids:?}");
    }
}

/// The streamed pieces are those of tokenizers' `DecodeStream` algorithm (decode a window of
/// ids with the tokenizer, emit the new suffix once it does not end in U+FFFD), which the
/// stream computed before it cut its text from the token bytes: the same piece at every step,
/// on the random sequences above and on text with split emoji. Fails on the first piece that
/// differs.
#[test]
fn the_decode_stream_emits_what_the_windowed_tokenizer_algorithm_emits() {
    let Some(c) = codec() else { return };
    /// The windowed algorithm over the tokenizer itself (the stream's previous implementation).
    struct Windowed<'a> {
        c: &'a GgufTextCodec,
        ids: Vec<u32>,
        prefix: String,
        prefix_index: usize,
    }
    impl Windowed<'_> {
        fn step(&mut self, id: u32) -> String {
            if self.prefix.is_empty() && !self.ids.is_empty() {
                let p = self.c.tokenizer_decode(&self.ids).unwrap();
                if !p.ends_with('\u{FFFD}') {
                    self.prefix = p;
                    self.prefix_index = self.ids.len();
                }
            }
            self.ids.push(id);
            let text = self.c.tokenizer_decode(&self.ids).unwrap();
            if text.len() <= self.prefix.len() || text.ends_with('\u{FFFD}') {
                return String::new();
            }
            let new_text = match text.get(self.prefix.len()..) {
                Some(t) if text.starts_with(&self.prefix) => t.to_string(),
                _ => text.clone(),
            };
            let keep_from = self.prefix_index.min(self.ids.len());
            self.ids.drain(..keep_from);
            self.prefix = self.c.tokenizer_decode(&self.ids).unwrap();
            self.prefix_index = self.ids.len();
            new_text
        }
    }
    let mut sequences = vec![c.encode("Crab 🦀, rocket 🚀, family 👨‍👩‍👧 and 日本語 — done.").unwrap()];
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..1000 {
        let len = 1 + (next(&mut state) % 24) as usize;
        sequences.push(
            (0..len)
                .map(|_| match next(&mut state) % 4 {
                    0 => 17 + (next(&mut state) % 256) as u32,
                    1 => (next(&mut state) % 17) as u32,
                    _ => (next(&mut state) % u64::from(c.vocab_size())) as u32,
                })
                .collect(),
        );
    }
    for ids in &sequences {
        let mut stream = c.decode_stream();
        let mut reference = Windowed { c: &c, ids: Vec::new(), prefix: String::new(), prefix_index: 0 };
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(stream.step(id).unwrap(), reference.step(id), "piece {i} of {ids:?}");
        }
    }
}
