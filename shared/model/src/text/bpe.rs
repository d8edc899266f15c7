//! GPT-2 byte-level BPE (`tokenizer.ggml.model = "gpt2"`), rebuilt as a `tokenizers` pipeline
//! from `tokens` + `merges`, with the pre-tokenizer `tokenizer.ggml.pre` names.
//!
//! The pre-tokenizer decides where words end before any merge, so a wrong one silently changes
//! the ids (of numbers, of runs of spaces); an unknown `pre` is refused rather than guessed.
//! The regexes are llama.cpp's (`llama-vocab.cpp`), which are those of the models'
//! `tokenizer.json` with the case-insensitive group spelled out:
//! - `gpt2` (`gpt-2`): GPT-2's regex (the byte-level pre-tokenizer's own);
//! - `smollm`: each digit alone, then GPT-2's regex;
//! - `qwen2` (`deepseek-r1-qwen`): Qwen2's regex, each digit alone;
//! - `llama-bpe` (`llama3`, `llama-v3`): Llama 3's regex, digits in groups of up to three, and
//!   `ignore_merges` (a word that is a token is that token, merges or not), as llama.cpp does.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::{decode::unicode_to_byte, TokenBytes, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};
use crate::error::ModelError;
use crate::gguf::{md_str, md_str_array};

/// Qwen2's pre-tokenizer regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's pre-tokenizer regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizers this module knows, by the `tokenizer.ggml.pre` values that name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pre {
    Gpt2,
    Smollm,
    Qwen2,
    Llama3,
}

impl Pre {
    pub(super) fn parse(pre: &str) -> Result<Self, ModelError> {
        Ok(match pre {
            "gpt2" | "gpt-2" => Pre::Gpt2,
            "smollm" => Pre::Smollm,
            "qwen2" | "deepseek-r1-qwen" => Pre::Qwen2,
            "llama-bpe" | "llama3" | "llama-v3" => Pre::Llama3,
            other => {
                return Err(ModelError::UnsupportedTokenizer(format!(
                    "tokenizer.ggml.pre = {other:?}; byte-level BPE supports \"gpt2\", \"smollm\", \"qwen2\" and \
                     \"llama-bpe\" (docs/MODEL.md)"
                )))
            }
        })
    }

    /// Whether the model adds BOS when the file does not say (llama.cpp's default for it).
    pub(super) fn default_add_bos(self) -> bool {
        self == Pre::Llama3
    }
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

/// The `tokenizers` pipeline of a byte-level BPE model.
pub(super) fn build(
    md: &HashMap<String, Value>,
    tokens: &[&str],
    token_types: &[i64],
    pre: Pre,
) -> Result<Tokenizer, ModelError> {
    let merges = md_str_array(md, "tokenizer.ggml.merges")?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge {m:?}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe =
        BPE::builder().vocab_and_merges(vocab, merges).ignore_merges(pre == Pre::Llama3).build().map_err(tok_err)?;
    let mut tokenizer = Tokenizer::new(bpe);

    let byte_level = ByteLevel::default().add_prefix_space(false).use_regex(true).trim_offsets(false);
    let split = |regex: &str| -> Result<PreTokenizerWrapper, ModelError> {
        let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(tok_err)?;
        // the regex has split the words; the byte-level step only maps bytes to characters
        let bytes = ByteLevel::default().add_prefix_space(false).use_regex(false).trim_offsets(false);
        Ok(Sequence::new(vec![split.into(), bytes.into()]).into())
    };
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        Pre::Gpt2 => byte_level.into(),
        Pre::Smollm => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
        Pre::Qwen2 => split(QWEN2_REGEX)?,
        Pre::Llama3 => split(LLAMA3_REGEX)?,
    };
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));

    let added: Vec<AddedToken> = token_types
        .iter()
        .zip(tokens)
        .filter_map(|(&ty, &tok)| match ty {
            TOKEN_TYPE_CONTROL => Some(AddedToken::from(tok, true)),
            TOKEN_TYPE_USER_DEFINED => Some(AddedToken::from(tok, false)),
            _ => None,
        })
        .collect();
    if !added.is_empty() {
        tokenizer.add_special_tokens(added).map_err(tok_err)?;
    }
    Ok(tokenizer)
}

/// `tokenizer.ggml.pre`, `gpt2` when absent (older files).
pub(super) fn pre_of(md: &HashMap<String, Value>) -> &str {
    md_str(md, "tokenizer.ggml.pre").unwrap_or("gpt2")
}

/// Each token's bytes: its characters through GPT-2's byte-to-unicode table (a token with a
/// character outside the table, an added token, gives its UTF-8 bytes as they are); nothing
/// for a special token, which the tokenizer's decoder skips.
pub(super) fn token_bytes(tokenizer: &Tokenizer, vocab_size: u32) -> TokenBytes {
    let to_byte = unicode_to_byte();
    let added = tokenizer.get_added_vocabulary();
    TokenBytes::build(vocab_size, |id| match tokenizer.id_to_token(id).filter(|t| !added.is_special_token(t)) {
        Some(token) => {
            let mapped: Option<Vec<u8>> = token.chars().map(|c| to_byte.get(&c).copied()).collect();
            mapped.unwrap_or_else(|| token.into_bytes())
        }
        None => Vec::new(),
    })
}
