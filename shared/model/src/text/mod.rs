//! [`GgufTextCodec`]: the tokenizer and chat template stored in a GGUF file's metadata.
//!
//! The tokenizer is rebuilt from `tokenizer.ggml.*` (see `DEPENDENCIES.md` §4 and
//! docs/MODEL.md "Tokenizers"), by `tokenizer.ggml.model`:
//! - `gpt2`: byte-level BPE from `tokens` + `merges` with the pre-tokenizer named by
//!   `tokenizer.ggml.pre` ([`bpe`]: `gpt2`, `smollm`, `qwen2`, `llama-bpe`; anything else is
//!   refused, because a wrong pre-tokenizer silently changes the ids);
//! - `llama`: SentencePiece from `tokens` + `scores` ([`spm`]), as llama.cpp runs it.
//!
//! Control tokens (`token_type` 3) are matched whole in text and skipped when decoding, so
//! `<|im_start|>` in rendered chat text is one token. `add_bos_token` is honoured by
//! [`TextCodec::encode_prompt`]. The chat template is [`template`]'s.

mod bpe;
mod decode;
mod spm;
mod template;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use pdmesh_model_api::{ChatMessage, DecodeStream, TextCodec, TextError};
use tokenizers::Tokenizer;

use crate::error::ModelError;
use crate::executor::effective_max_len;
use crate::gguf::{md_bool_opt, md_get, md_int_array, md_str, md_str_array, md_u32, md_u32_opt, GgufFile};
use crate::ModelOptions;
use decode::TokenBytes;

/// GGUF `token_type` of ordinary tokens.
const TOKEN_TYPE_NORMAL: i64 = 1;
/// GGUF `token_type` of the unknown token (`<unk>`).
const TOKEN_TYPE_UNKNOWN: i64 = 2;
/// GGUF `token_type` of control tokens (`<|im_start|>`, `<|endoftext|>`, ...).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF `token_type` of user-defined tokens: matched whole, but not skipped on decode.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
/// GGUF `token_type` of SentencePiece's byte-fallback tokens `<0xXX>`.
const TOKEN_TYPE_BYTE: i64 = 6;

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

/// The model's context length, `{general.architecture}.context_length` (any architecture: the
/// executor decides which ones load).
pub(crate) fn context_length(md: &HashMap<String, Value>) -> Result<u32, ModelError> {
    let arch = md_str(md, "general.architecture")?;
    md_u32(md, &format!("{arch}.context_length"))
}

/// The tokenizer proper, by kind.
enum Encoder {
    Bpe(Box<Tokenizer>),
    Spm(Box<spm::Spm>),
}

/// Tokenizer plus chat template of a GGUF model.
pub struct GgufTextCodec {
    encoder: Encoder,
    /// The compiled chat template (`None`: the file has none and none was configured).
    template: Option<template::ChatTemplate>,
    bos_token: String,
    eos_token: String,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
    /// Whether a prompt begins with BOS (`tokenizer.ggml.add_bos_token`, else the kind's
    /// default as llama.cpp has it); never without a BOS id.
    add_bos: bool,
    max_model_len: u32,
    vocab_size: u32,
    /// What each token id decodes to, as bytes ([`TokenBytes`]): the streamed text is cut
    /// from these without the tokenizer.
    token_bytes: TokenBytes,
}

impl std::fmt::Debug for GgufTextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufTextCodec")
            .field(
                "kind",
                &match self.encoder {
                    Encoder::Bpe(_) => "bpe",
                    Encoder::Spm(_) => "spm",
                },
            )
            .field("vocab_size", &self.vocab_size)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("add_bos", &self.add_bos)
            .field("max_model_len", &self.max_model_len)
            .field("has_chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

fn text_err(e: impl std::fmt::Display) -> TextError {
    TextError::Tokenizer(e.to_string())
}

/// `key` as an array of floats (`tokenizer.ggml.scores`).
fn md_f32_array(md: &HashMap<String, Value>, key: &str) -> Result<Vec<f32>, ModelError> {
    match md_get(md, key)? {
        Value::Array(items) => items
            .iter()
            .map(|v| match v {
                Value::F32(f) => Ok(*f),
                Value::F64(f) => Ok(*f as f32),
                _ => Err(ModelError::InvalidMetadata { key: key.to_string(), reason: "not an array of floats".into() }),
            })
            .collect(),
        _ => Err(ModelError::InvalidMetadata { key: key.to_string(), reason: "not an array".into() }),
    }
}

impl GgufTextCodec {
    /// Build the codec from the GGUF file at `path` (reads only the header, not the weights).
    pub fn load(path: impl AsRef<Path>, options: &ModelOptions) -> Result<Self, ModelError> {
        let g = GgufFile::open(path.as_ref())?;
        Self::from_gguf(&g, options)
    }

    pub(crate) fn from_gguf(g: &GgufFile, options: &ModelOptions) -> Result<Self, ModelError> {
        let md = g.metadata();
        let model = md_str(md, "tokenizer.ggml.model")?;
        let tokens = md_str_array(md, "tokenizer.ggml.tokens")?;
        let token_types = if md.contains_key("tokenizer.ggml.token_type") {
            md_int_array(md, "tokenizer.ggml.token_type")?
        } else {
            Vec::new()
        };
        let vocab_size = tokens.len() as u32;
        let (encoder, token_bytes, default_add_bos) = match model {
            "gpt2" => {
                let pre = bpe::Pre::parse(bpe::pre_of(md))?;
                let tokenizer = bpe::build(md, &tokens, &token_types, pre)?;
                let token_bytes = bpe::token_bytes(&tokenizer, vocab_size);
                (Encoder::Bpe(Box::new(tokenizer)), token_bytes, pre.default_add_bos())
            }
            "llama" => {
                let scores = md_f32_array(md, "tokenizer.ggml.scores")?;
                let unk = md_u32_opt(md, "tokenizer.ggml.unknown_token_id")?;
                // llama.cpp's default for SentencePiece is a prefix space; Gemma's files say false
                let space_prefix = md_bool_opt(md, "tokenizer.ggml.add_space_prefix").unwrap_or(true);
                let spm = spm::Spm::new(&tokens, scores, token_types, unk, space_prefix)?;
                let token_bytes = spm.token_bytes();
                (Encoder::Spm(Box::new(spm)), token_bytes, true)
            }
            other => {
                return Err(ModelError::UnsupportedTokenizer(format!(
                    "tokenizer.ggml.model = {other:?}; supported: \"gpt2\" (byte-level BPE) and \"llama\" \
                     (SentencePiece)"
                )))
            }
        };

        let id_text = |key: &str| -> Result<(Option<u32>, String), ModelError> {
            match md_u32_opt(md, key)? {
                Some(id) => Ok((Some(id), tokens.get(id as usize).map(|s| s.to_string()).unwrap_or_default())),
                None => Ok((None, String::new())),
            }
        };
        let (bos_token_id, bos_token) = id_text("tokenizer.ggml.bos_token_id")?;
        let (_, eos_token) = id_text("tokenizer.ggml.eos_token_id")?;
        let add_bos = md_bool_opt(md, "tokenizer.ggml.add_bos_token").unwrap_or(default_add_bos);
        if add_bos && bos_token_id.is_none_or(|id| id >= vocab_size) {
            return Err(ModelError::InvalidMetadata {
                key: "tokenizer.ggml.bos_token_id".into(),
                reason: "add_bos_token is set but the file has no BOS token in the vocabulary".into(),
            });
        }

        let template = match md_str(md, "tokenizer.chat_template") {
            Ok(src) => Some(template::ChatTemplate::compile(src.to_string())?),
            Err(ModelError::MissingMetadata { .. }) => None,
            Err(e) => return Err(e),
        };
        Ok(Self {
            encoder,
            token_bytes,
            template,
            bos_token,
            eos_token,
            eos_token_ids: eos_token_ids(md)?,
            bos_token_id,
            add_bos,
            max_model_len: effective_max_len(context_length(md)?, options),
            vocab_size,
        })
    }

    /// Replace the file's chat template (or give one to a file without): `--chat-template`.
    /// A template that does not compile is [`ModelError::ChatTemplate`].
    pub fn with_chat_template(mut self, source: String) -> Result<Self, ModelError> {
        self.template = Some(template::ChatTemplate::compile(source)?);
        Ok(self)
    }

    /// Ids that end generation: `tokenizer.ggml.eos_token_id`, plus `eot_token_id` /
    /// `eom_token_id` when the file declares them (SmolLM2: `[2]`, `<|im_end|>`).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// `tokenizer.ggml.bos_token_id`, if any.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Whether [`TextCodec::encode_prompt`] begins a prompt with BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// The model's context length, capped by [`ModelOptions::max_model_len`].
    pub fn max_model_len(&self) -> u32 {
        self.max_model_len
    }

    /// Whether the codec has a chat template (the file's, or one configured).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// `ids` decoded by a decoder independent of [`TokenBytes`]: the `tokenizers` pipeline's
    /// own (byte-level BPE), or `tokenizers`' SentencePiece decoder chain (`▁` → space, byte
    /// fallback, fuse) over the pieces with control tokens skipped. The reference the tests
    /// hold the fast path to.
    #[doc(hidden)]
    pub fn tokenizer_decode(&self, ids: &[u32]) -> Result<String, TextError> {
        match &self.encoder {
            Encoder::Bpe(t) => t.decode(ids, true).map_err(text_err),
            Encoder::Spm(spm) => {
                use tokenizers::decoders::{
                    byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence, DecoderWrapper,
                };
                use tokenizers::normalizers::replace::Replace;
                use tokenizers::Decoder as _;
                let replace = Replace::new("\u{2581}", " ").map_err(text_err)?;
                let chain = Sequence::new(vec![
                    DecoderWrapper::Replace(replace),
                    DecoderWrapper::ByteFallback(ByteFallback::new()),
                    DecoderWrapper::Fuse(Fuse::new()),
                ]);
                let pieces: Vec<String> = ids
                    .iter()
                    .filter(|&&id| !spm.is_special(id))
                    .filter_map(|&id| spm.piece(id).map(str::to_string))
                    .collect();
                chain.decode(pieces).map_err(text_err)
            }
        }
    }
}

impl TextCodec for GgufTextCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        match &self.encoder {
            Encoder::Bpe(t) => Ok(t.encode(text, false).map_err(text_err)?.get_ids().to_vec()),
            Encoder::Spm(spm) => Ok(spm.encode(text)),
        }
    }

    /// BOS first when the model asks for it (`add_bos_token`: Gemma, Llama 3), unless the
    /// text already begins with it, as rendered chat does when its template writes
    /// `{{ bos_token }}`: one BOS either way (llama.cpp strips the template's and adds its own).
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let mut ids = self.encode(text)?;
        if let (true, Some(bos)) = (self.add_bos, self.bos_token_id) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.token_bytes.decode(ids)
    }

    fn decode_stream(&self) -> Box<dyn DecodeStream + '_> {
        Box::new(self.token_bytes.stream())
    }

    fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, TextError> {
        let template = self.template.as_ref().ok_or(TextError::NoChatTemplate)?;
        template.render(messages, tools, &self.bos_token, &self.eos_token)
    }

    fn template_renders_tools(&self) -> bool {
        self.template.as_ref().is_some_and(template::ChatTemplate::renders_tools)
    }

    fn token_text(&self, id: u32) -> String {
        if id >= self.vocab_size {
            return String::new();
        }
        match &self.encoder {
            Encoder::Bpe(t) => t.decode(&[id], false).unwrap_or_default(),
            // a control token shows as itself, any other as the text it decodes to
            Encoder::Spm(spm) if spm.token_type(id) == Some(TOKEN_TYPE_CONTROL) => {
                spm.piece(id).unwrap_or_default().to_string()
            }
            Encoder::Spm(_) => String::from_utf8_lossy(self.token_bytes.get(id)).into_owned(),
        }
    }

    fn vocab_size(&self) -> u32 {
        self.vocab_size
    }
}
