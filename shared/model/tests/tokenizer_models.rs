//! The tokenizers and chat templates of the models users bring besides SmolLM2: Gemma 3
//! (SentencePiece, BOS required, no chat template in the base file) and Qwen2.5 (byte-level
//! BPE, ChatML template that renders tools).
//!
//! The files come from `scripts/fetch-model.sh gemma3-270m` / `qwen2.5-0.5b`; scripts/test.sh
//! exports their paths as `PDMESH_GEMMA3_PATH` and `PDMESH_QWEN25_PATH`. Without the variable a
//! test says it skips; with it, a missing file fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: fail loudly

use pdmesh_model::{GgufTextCodec, ModelOptions};
use pdmesh_model_api::{ChatMessage, TextCodec, TextError};
use serde_json::json;

fn codec(var: &str) -> Option<GgufTextCodec> {
    let Some(path) = std::env::var_os(var) else {
        eprintln!("{var} is unset: skipping (scripts/fetch-model.sh fetches the model; scripts/test.sh sets it)");
        return None;
    };
    Some(GgufTextCodec::load(&path, &ModelOptions::default()).unwrap())
}

fn gemma() -> Option<GgufTextCodec> {
    codec("PDMESH_GEMMA3_PATH")
}

fn qwen() -> Option<GgufTextCodec> {
    codec("PDMESH_QWEN25_PATH")
}

const MULTILINGUAL: &[&str] = &[
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Français : où est la bibliothèque ? Déjà vu, crème brûlée, garçon.",
    "Deutsch: Grüße aus München, die Straße ist schön.",
    "Русский: Съешь же ещё этих мягких французских булок.",
    "中文：我爱自然语言处理。",
    "日本語：吾輩は猫である。名前はまだ無い。カタカナ",
    "العربية: مرحبا بالعالم",
    "emoji: 🦀🚀 👩‍💻 👨‍👩‍👧",
    "fn main() {\n\tlet x = 1;\n    println!(\"{x}\");\n}\n",
    "  multiple   spaces  and\ttabs\t\tand\n\n\nnewlines ",
    "\u{10FFFD} private use, \u{378} unassigned",
];

#[test]
fn gemma_round_trips_a_multilingual_sample() {
    let Some(c) = gemma() else { return };
    assert_eq!(c.vocab_size(), 262_144);
    for text in MULTILINGUAL {
        let ids = c.encode(text).unwrap();
        assert!(!ids.is_empty());
        assert_eq!(c.decode(&ids).unwrap(), *text, "{ids:?}");
        assert_eq!(c.tokenizer_decode(&ids).unwrap(), *text, "the reference decoder agrees");
    }
}

/// Ids checked against the vocabulary's pieces: `Hello` 9259 and `▁world` 1902 (no prefix
/// space: `add_space_prefix = false`), the control tokens matched whole, the user-defined
/// whitespace runs (`"  "` is 138), and a character the vocabulary lacks as byte-fallback
/// tokens (U+10FFFD = F4 8F BF BD: `<0xF4>` 482, `<0x8F>` 381, `<0xBF>` 429, `<0xBD>` 427).
#[test]
fn gemma_ids_are_the_vocabularys() {
    let Some(c) = gemma() else { return };
    assert_eq!(c.encode("Hello world").unwrap(), vec![9259, 1902]);
    assert_eq!(c.encode(" Hello").unwrap(), vec![26352]);
    assert_eq!(c.encode("<start_of_turn>user\nHi<end_of_turn>").unwrap()[0], 105);
    assert_eq!(*c.encode("<start_of_turn>user\nHi<end_of_turn>").unwrap().last().unwrap(), 106);
    assert_eq!(c.encode("a  b").unwrap()[1], 138, "{:?}", c.encode("a  b").unwrap());
    assert_eq!(c.encode("\u{10FFFD}").unwrap(), vec![482, 381, 429, 427]);
    assert_eq!(c.encode("").unwrap(), Vec::<u32>::new());
    // control tokens are skipped in user-visible text, shown by name for logprobs
    assert_eq!(c.decode(&[2, 9259, 1902, 1]).unwrap(), "Hello world");
    assert_eq!(c.token_text(105), "<start_of_turn>");
    assert_eq!(c.token_text(1902), " world");
    assert_eq!(c.eos_token_ids()[0], 1);
}

/// Gemma needs BOS: a completions prompt gets it, once, and rendered chat whose template
/// writes `{{ bos_token }}` keeps exactly one. The base file has no template: chat is refused
/// until one is configured, and then renders.
#[test]
fn gemma_prompts_begin_with_one_bos() {
    let Some(c) = gemma() else { return };
    assert!(c.adds_bos());
    assert_eq!(c.bos_token_id(), Some(2));
    assert_eq!(c.encode_prompt("Hello world").unwrap(), vec![2, 9259, 1902]);
    assert_eq!(c.encode_prompt("<bos>Hello world").unwrap(), vec![2, 9259, 1902]);

    assert!(!c.has_chat_template());
    let user = [ChatMessage::text("user", "Hi")];
    assert!(matches!(c.render_chat(&user), Err(TextError::NoChatTemplate)));
    let template = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n\
                    {% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";
    let c = c.with_chat_template(template.to_string()).unwrap();
    let text = c.render_chat(&user).unwrap();
    assert_eq!(text, "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
    let ids = c.encode_prompt(&text).unwrap();
    assert_eq!(&ids[..2], &[2, 105]);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1, "{ids:?}");
    assert!(matches!(
        GgufTextCodec::load(std::env::var_os("PDMESH_GEMMA3_PATH").unwrap(), &ModelOptions::default())
            .unwrap()
            .with_chat_template("{% for %}".into()),
        Err(pdmesh_model::ModelError::ChatTemplate(_))
    ));
}

/// A small deterministic generator (xorshift).
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Gemma's byte-fallback tokens: `<0x00>` is 238.
const GEMMA_BYTE0: u32 = 238;

/// Random valid-UTF-8 id sequences over Gemma's vocabulary: any token (control tokens
/// over-represented), and characters written as byte-fallback runs. Valid UTF-8 because the reference
/// decoder (`tokenizers`' ByteFallback) writes one U+FFFD per stray byte where the lossy
/// conversion writes one per invalid sequence; stray bytes are checked apart.
fn gemma_sequences(c: &GgufTextCodec, count: usize, max_len: u64, seed: u64) -> Vec<Vec<u32>> {
    let mut state = seed;
    (0..count)
        .map(|_| {
            let len = 1 + next(&mut state) % max_len;
            let mut ids = Vec::new();
            for _ in 0..len {
                match next(&mut state) % 4 {
                    0 => {
                        let ch = char::from_u32((next(&mut state) % 0x1_0000) as u32).unwrap_or('\u{1F980}');
                        let mut buf = [0u8; 4];
                        ids.extend(ch.encode_utf8(&mut buf).bytes().map(|b| GEMMA_BYTE0 + u32::from(b)));
                    }
                    // the control and user-defined tokens before the byte tokens
                    1 => ids.push((next(&mut state) % u64::from(GEMMA_BYTE0)) as u32),
                    // any other token (a byte token alone could be a stray byte)
                    _ => match (next(&mut state) % u64::from(c.vocab_size())) as u32 {
                        id if (GEMMA_BYTE0..GEMMA_BYTE0 + 256).contains(&id) => ids.push(id + 256),
                        id => ids.push(id),
                    },
                }
            }
            ids
        })
        .collect()
}

/// The fast decode path ([`TextCodec::decode`], cut from each token's bytes) gives what
/// `tokenizers`' SentencePiece decoder (`▁` → space, byte fallback, fuse) gives: every token
/// of the vocabulary alone, and random sequences. Fails on the first that differs.
#[test]
fn gemma_decoding_from_token_bytes_equals_the_reference_decoder() {
    let Some(c) = gemma() else { return };
    for id in 0..c.vocab_size() {
        assert_eq!(c.decode(&[id]).unwrap(), c.tokenizer_decode(&[id]).unwrap(), "token {id}");
    }
    for ids in gemma_sequences(&c, 3000, 12, 0x9E37_79B9_7F4A_7C15) {
        assert_eq!(c.decode(&ids).unwrap(), c.tokenizer_decode(&ids).unwrap(), "{ids:?}");
    }
    // a stray byte reads as one U+FFFD, as the byte-level BPE path does
    assert_eq!(c.decode(&[GEMMA_BYTE0 + 0xE6, 9259]).unwrap(), "\u{FFFD}Hello");
}

/// The incremental decoder's pieces are those of the windowed algorithm (decode a window of
/// ids with the reference decoder, emit the new suffix once it does not end in U+FFFD), and
/// never split a character.
#[test]
fn gemma_decode_stream_emits_what_the_windowed_algorithm_emits() {
    let Some(c) = gemma() else { return };
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
    let mut sequences: Vec<Vec<u32>> = MULTILINGUAL.iter().map(|t| c.encode(t).unwrap()).collect();
    sequences.extend(gemma_sequences(&c, 1000, 24, 0x2545_F491_4F6C_DD1D));
    for ids in &sequences {
        let mut stream = c.decode_stream();
        let mut reference = Windowed { c: &c, ids: Vec::new(), prefix: String::new(), prefix_index: 0 };
        let mut out = String::new();
        for (i, &id) in ids.iter().enumerate() {
            let piece = stream.step(id).unwrap();
            assert_eq!(piece, reference.step(id), "piece {i} of {ids:?}");
            out.push_str(&piece);
        }
        assert_eq!(out, c.decode(ids).unwrap(), "{ids:?}");
    }
}

#[test]
fn qwen_encodes_known_ids_without_bos() {
    let Some(c) = qwen() else { return };
    assert_eq!(c.encode("Hello world").unwrap(), vec![9707, 1879]);
    assert_eq!(c.encode("12345").unwrap().len(), 5, "qwen2 splits digits one by one");
    assert!(!c.adds_bos());
    assert_eq!(c.encode_prompt("Hello world").unwrap(), vec![9707, 1879]);
    assert_eq!(c.eos_token_ids(), &[151645]);
    assert_eq!(c.max_model_len(), 32768, "qwen2.context_length");
    for text in MULTILINGUAL {
        assert_eq!(c.decode(&c.encode(text).unwrap()).unwrap(), *text);
    }
}

fn weather_tool() -> serde_json::Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

/// Qwen's template renders tools itself: given `tools`, the prompt holds its `# Tools` block
/// with each definition as Python's `json.dumps` writes it, and the `<tool_call>` format the
/// frontend parses; history calls and tool results render as the template writes them.
#[test]
fn qwen_template_renders_tools_and_tool_history() {
    let Some(c) = qwen() else { return };
    assert!(c.template_renders_tools());
    let tools = [weather_tool()];
    let user = [ChatMessage::text("user", "Weather in Paris?")];
    let text = c.render_chat_with_tools(&user, Some(&tools)).unwrap();
    assert!(text.starts_with("<|im_start|>system\n"), "{text}");
    assert!(text.contains("# Tools"), "{text}");
    assert!(
        text.contains(
            r#"<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>"#
        ),
        "{text}"
    );
    assert!(
        text.contains("<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"),
        "{text}"
    );
    assert!(text.ends_with("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"), "{text}");
    // without tools the template's plain system turn
    let plain = c.render_chat(&user).unwrap();
    assert!(!plain.contains("# Tools") && plain.contains("You are Qwen"), "{plain}");

    let call =
        json!({"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}});
    let history = [
        user[0].clone(),
        ChatMessage { role: "assistant".into(), tool_calls: Some(vec![call]), ..Default::default() },
        ChatMessage {
            role: "tool".into(),
            content: "18°C, sunny".into(),
            tool_call_id: Some("c1".into()),
            ..Default::default()
        },
    ];
    let text = c.render_chat_with_tools(&history, Some(&tools)).unwrap();
    assert!(
        text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>"),
        "{text}"
    );
    assert!(text.contains("<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response><|im_end|>"), "{text}");
    // the rendered control tokens are single ids
    let ids = c.encode_prompt(&text).unwrap();
    assert_eq!(ids[0], 151644, "<|im_start|>");
}
