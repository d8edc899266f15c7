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
        let context_length = md_u32(md, "llama.context_length")?;
        Ok(Self {
            tokenizer,
            env,
            bos_token,
            eos_token,
            eos_token_ids: eos_token_ids(md)?,
            bos_token_id,
            max_model_len: effective_max_len(context_length, options),
            vocab_size: tokens.len() as u32,
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
        self.tokenizer.decode(ids, true).map_err(text_err)
    }

    fn decode_stream(&self) -> Box<dyn DecodeStream + '_> {
        Box::new(GgufDecodeStream { codec: self, ids: Vec::new(), prefix: String::new(), prefix_index: 0 })
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

/// Incremental detokenizer: the algorithm of tokenizers' `DecodeStream` (decode a short
/// window of ids, emit only the new suffix, hold back while the text ends in an incomplete
/// UTF-8 sequence, which byte-level decoding renders as U+FFFD), implemented here so that it
/// owns no borrow of the tokenizer's concrete type and can recover from an invalid prefix
/// instead of failing the stream.
struct GgufDecodeStream<'a> {
    codec: &'a GgufTextCodec,
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl DecodeStream for GgufDecodeStream<'_> {
    fn step(&mut self, token_id: u32) -> Result<String, TextError> {
        if token_id >= self.codec.vocab_size {
            return Err(TextError::Tokenizer(format!(
                "token id {token_id} is outside the vocabulary ({})",
                self.codec.vocab_size
            )));
        }
        let tok = &self.codec.tokenizer;
        if self.prefix.is_empty() && !self.ids.is_empty() {
            let p = tok.decode(&self.ids, true).map_err(text_err)?;
            if !p.ends_with('\u{FFFD}') {
                self.prefix = p;
                self.prefix_index = self.ids.len();
            }
        }
        self.ids.push(token_id);
        let text = tok.decode(&self.ids, true).map_err(text_err)?;
        if text.len() <= self.prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let new_text = match text.get(self.prefix.len()..) {
            Some(t) if text.starts_with(&self.prefix) => t.to_string(),
            // The window re-decoded differently (can happen around special tokens): emit the
            // whole new decode rather than fail the stream.
            _ => text.clone(),
        };
        let keep_from = self.prefix_index.min(self.ids.len());
        self.ids.drain(..keep_from);
        self.prefix = tok.decode(&self.ids, true).map_err(text_err)?;
        self.prefix_index = self.ids.len();
        Ok(new_text)
    }
}
