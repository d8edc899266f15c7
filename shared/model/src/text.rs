//! [`GgufTextCodec`]: the tokenizer and chat template stored in a GGUF file's metadata.
//!
//! The tokenizer is rebuilt from `tokenizer.ggml.*` (see `DEPENDENCIES.md` §4): a byte-level BPE
//! from `tokens` + `merges`, the pre-tokenizer chosen by `tokenizer.ggml.pre` (`smollm` =
//! individual digits then the GPT-2 byte-level regex; `gpt2` = byte-level only; anything else is
//! refused, because a wrong pre-tokenizer silently changes the ids of numbers), a byte-level
//! decoder, and the control tokens (`token_type` 3) registered as special so that
//! `<|im_start|>` in rendered chat text is one token and is skipped when decoding.
//!
//! The chat template (`tokenizer.chat_template`) is rendered with minijinja configured like
//! Hugging Face's jinja2 environment: `trim_blocks`, `lstrip_blocks`, Python string methods
//! (pycompat) and `raise_exception`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use pdmesh_model_api::{ChatMessage, DecodeStream, TextCodec, TextError};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::ModelError;
use crate::executor::effective_max_len;
use crate::gguf::{check_architecture, md_bool_opt, md_int_array, md_str, md_str_array, md_u32, md_u32_opt, GgufFile};
use crate::ModelOptions;

/// GGUF `token_type` of control tokens (`<|im_start|>`, `<|endoftext|>`, ...).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF `token_type` of user-defined tokens: matched whole, but not skipped on decode.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

const TEMPLATE_NAME: &str = "chat";

/// Stop ids of the model: `tokenizer.ggml.eos_token_id`, plus `eot_token_id` / `eom_token_id`
/// when the file declares them (llama.cpp stops on those too). Nothing else is added: for
/// SmolLM2 this is `[2]` (`<|im_end|>`), and `<|endoftext|>` (0) is *not* a stop id because
/// the file does not say so.
pub(crate) fn eos_token_ids(md: &HashMap<String, Value>) -> Result<Vec<u32>, ModelError> {
    let mut ids = vec![md_u32(md, "tokenizer.ggml.eos_token_id")?];
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = md_u32_opt(md, key)? {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// Tokenizer plus chat template of a GGUF model.
pub struct GgufTextCodec {
    tokenizer: Tokenizer,
    /// Environment holding the compiled chat template (`None`: the file has none).
    env: Option<minijinja::Environment<'static>>,
    bos_token: String,
    eos_token: String,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
    max_model_len: u32,
    vocab_size: u32,
    /// What each token id decodes to, as bytes ([`TokenBytes`]): the streamed text is cut
    /// from these without the tokenizer.
    token_bytes: TokenBytes,
}

impl std::fmt::Debug for GgufTextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufTextCodec")
            .field("vocab_size", &self.vocab_size)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("max_model_len", &self.max_model_len)
            .field("has_chat_template", &self.env.is_some())
            .finish_non_exhaustive()
    }
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl GgufTextCodec {
    /// Build the codec from the GGUF file at `path` (reads only the header, not the weights).
    pub fn load(path: impl AsRef<Path>, options: &ModelOptions) -> Result<Self, ModelError> {
        let g = GgufFile::open(path.as_ref())?;
        Self::from_gguf(&g, options)
    }

    pub(crate) fn from_gguf(g: &GgufFile, options: &ModelOptions) -> Result<Self, ModelError> {
        let md = g.metadata();
        check_architecture(md)?;
        let model = md_str(md, "tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(ModelError::UnsupportedTokenizer(format!(
                "tokenizer.ggml.model = {model:?}; only \"gpt2\" (byte-level BPE) is supported"
            )));
        }
        let pre = md_str(md, "tokenizer.ggml.pre").unwrap_or("gpt2");
        let tokens = md_str_array(md, "tokenizer.ggml.tokens")?;
        let merges = md_str_array(md, "tokenizer.ggml.merges")?;
        let token_types = if md.contains_key("tokenizer.ggml.token_type") {
            md_int_array(md, "tokenizer.ggml.token_type")?
        } else {
            Vec::new()
        };

        let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge {m:?}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
        let mut tokenizer = Tokenizer::new(bpe);

        let byte_level = ByteLevel::default().add_prefix_space(false).use_regex(true).trim_offsets(false);
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
            "gpt2" => byte_level.into(),
            other => {
                return Err(ModelError::UnsupportedTokenizer(format!(
                    "tokenizer.ggml.pre = {other:?}; only \"smollm\" and \"gpt2\" are supported"
                )))
            }
        };
        tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

        let added: Vec<AddedToken> = token_types
            .iter()
            .zip(&tokens)
            .filter_map(|(&ty, &tok)| match ty {
                TOKEN_TYPE_CONTROL => Some(AddedToken::from(tok, true)),
                TOKEN_TYPE_USER_DEFINED => Some(AddedToken::from(tok, false)),
                _ => None,
            })
            .collect();
        if !added.is_empty() {
            tokenizer.add_special_tokens(added).map_err(tok_err)?;
        }

        let id_text = |key: &str| -> Result<(Option<u32>, String), ModelError> {
            match md_u32_opt(md, key)? {
                Some(id) => Ok((Some(id), tokens.get(id as usize).map(|s| s.to_string()).unwrap_or_default())),
                None => Ok((None, String::new())),
            }
        };
        let (bos_token_id, bos_token) = id_text("tokenizer.ggml.bos_token_id")?;
        let (_, eos_token) = id_text("tokenizer.ggml.eos_token_id")?;
        if md_bool_opt(md, "tokenizer.ggml.add_bos_token") == Some(true) {
            // We never prepend BOS (the chat template emits what the model needs); say so once.
            tracing::warn!("GGUF asks for add_bos_token; pdmesh encodes without adding BOS");
        }

        let env = match md_str(md, "tokenizer.chat_template") {
            Ok(src) => Some(chat_environment(src.to_string())?),
            Err(ModelError::MissingMetadata { .. }) => None,
            Err(e) => return Err(e),
        };
        let context_length = crate::arch::context_length(md)?;
        let vocab_size = tokens.len() as u32;
        let token_bytes = TokenBytes::of(&tokenizer, vocab_size);
        Ok(Self {
            token_bytes,
            tokenizer,
            env,
            bos_token,
            eos_token,
            eos_token_ids: eos_token_ids(md)?,
            bos_token_id,
            max_model_len: effective_max_len(context_length, options),
            vocab_size,
        })
    }

    /// Ids that end generation: `tokenizer.ggml.eos_token_id`, plus `eot_token_id` /
    /// `eom_token_id` when the file declares them (SmolLM2: `[2]`, `<|im_end|>`).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// `tokenizer.ggml.bos_token_id`, if any (never prepended by [`TextCodec::encode`]).
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The model's context length, capped by [`ModelOptions::max_model_len`].
    pub fn max_model_len(&self) -> u32 {
        self.max_model_len
    }

    /// Whether the file carries a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.env.is_some()
    }

    /// `ids` decoded by the tokenizer itself, as [`TextCodec::decode`] did before it cut the
    /// text from [`TokenBytes`]: the reference the tests hold the fast path to.
    #[doc(hidden)]
    pub fn tokenizer_decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.tokenizer.decode(ids, true).map_err(text_err)
    }
}

/// The bytes each token id decodes to, all in one buffer.
///
/// The tokenizer's byte-level decoder turns a token into bytes by mapping each character back
/// through GPT-2's byte-to-unicode table (a token with a character outside the table, an added
/// token, gives its UTF-8 bytes as they are), skips special tokens, and converts the whole
/// sequence's bytes to text, lossily. Those bytes depend on the token alone, so they are
/// computed once here, and decoding becomes a concatenation and one UTF-8 check: what
/// `Tokenizer::decode(ids, true)` returns, without its per-call token strings, map lookups and
/// allocations, which were most of the frontend's detokenising cost per streamed token
/// (tested equal to the tokenizer over the whole vocabulary and random sequences).
struct TokenBytes {
    bytes: Vec<u8>,
    /// `bytes[ends[id - 1]..ends[id]]` is token `id`'s (empty for a special token).
    ends: Vec<u32>,
}

impl TokenBytes {
    fn of(tokenizer: &Tokenizer, vocab_size: u32) -> Self {
        let to_byte = unicode_to_byte();
        let added = tokenizer.get_added_vocabulary();
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(vocab_size as usize);
        for id in 0..vocab_size {
            if let Some(token) = tokenizer.id_to_token(id).filter(|t| !added.is_special_token(t)) {
                let mapped: Option<Vec<u8>> = token.chars().map(|c| to_byte.get(&c).copied()).collect();
                bytes.extend_from_slice(&mapped.unwrap_or_else(|| token.into_bytes()));
            }
            ends.push(bytes.len() as u32);
        }
        Self { bytes, ends }
    }

    /// Token `id`'s bytes (empty for an id outside the vocabulary).
    fn get(&self, id: u32) -> &[u8] {
        let i = id as usize;
        let start = i.checked_sub(1).and_then(|p| self.ends.get(p)).copied().unwrap_or(0);
        let end = self.ends.get(i).copied().unwrap_or(start);
        self.bytes.get(start as usize..end as usize).unwrap_or(&[])
    }
}

/// GPT-2's byte-to-unicode table, reversed: the printable bytes stand for themselves, the
/// other 68 for the characters from U+0100 on, in byte order.
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            let c = if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap_or(char::REPLACEMENT_CHARACTER)
            };
            (c, b)
        })
        .collect()
}

/// A minijinja environment that behaves like Hugging Face's chat-template jinja2 environment.
fn chat_environment(template: String) -> Result<minijinja::Environment<'static>, ModelError> {
    let mut env = minijinja::Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_template_owned(TEMPLATE_NAME, template).map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
    Ok(env)
}

fn text_err(e: impl std::fmt::Display) -> TextError {
    TextError::Tokenizer(e.to_string())
}

impl TextCodec for GgufTextCodec {
    /// Encode without adding any special token (special tokens written in the text, like
    /// `<|im_start|>`, still become their single ids).
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let enc = self.tokenizer.encode(text, false).map_err(text_err)?;
        Ok(enc.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        if let Some(&bad) = ids.iter().find(|&&id| id >= self.vocab_size) {
            return Err(TextError::Tokenizer(format!(
                "token id {bad} is outside the vocabulary ({})",
                self.vocab_size
            )));
        }
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.token_bytes.get(id)).copied().collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn decode_stream(&self) -> Box<dyn DecodeStream + '_> {
        Box::new(GgufDecodeStream { codec: self, pending: Vec::new() })
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TextError> {
        let env = self.env.as_ref().ok_or_else(|| TextError::Template("the model has no chat template".into()))?;
        let tmpl = env.get_template(TEMPLATE_NAME).map_err(|e| TextError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => true,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| TextError::Template(e.to_string()))
    }

    fn token_text(&self, id: u32) -> String {
        if id >= self.vocab_size {
            return String::new();
        }
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    fn vocab_size(&self) -> u32 {
        self.vocab_size
    }
}

/// Incremental detokenizer: the bytes of the tokens not shown yet are held until they read as
/// text that does not end in an incomplete UTF-8 sequence (which the lossy conversion renders
/// as U+FFFD), then shown whole. With a byte-level decoder this is what tokenizers'
/// `DecodeStream` algorithm (decode a short window of ids, emit the new suffix) yields, cut
/// from [`TokenBytes`] instead of decoding the window twice per token; a stray byte that can
/// never complete is shown as U+FFFD once text follows it, as there.
struct GgufDecodeStream<'a> {
    codec: &'a GgufTextCodec,
    pending: Vec<u8>,
}

impl DecodeStream for GgufDecodeStream<'_> {
    fn step(&mut self, token_id: u32) -> Result<String, TextError> {
        if token_id >= self.codec.vocab_size {
            return Err(TextError::Tokenizer(format!(
                "token id {token_id} is outside the vocabulary ({})",
                self.codec.vocab_size
            )));
        }
        self.pending.extend_from_slice(self.codec.token_bytes.get(token_id));
        let text = match String::from_utf8_lossy(&self.pending) {
            text if text.ends_with(char::REPLACEMENT_CHARACTER) => return Ok(String::new()),
            text => text.into_owned(),
        };
        self.pending.clear();
        Ok(text)
    }
}
