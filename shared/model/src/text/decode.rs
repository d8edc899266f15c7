//! Decoding ids to text without the tokenizer: [`TokenBytes`] and the incremental
//! [`GgufDecodeStream`], shared by both tokenizer kinds.

use std::collections::HashMap;

use pdmesh_model_api::{DecodeStream, TextError};

/// The bytes each token id decodes to, all in one buffer.
///
/// What a token decodes to depends on the token alone: for byte-level BPE its characters
/// mapped back through GPT-2's byte-to-unicode table, for SentencePiece its piece with `▁` read
/// as a space or, for a byte-fallback token `<0xXX>`, that one byte; nothing for a control
/// token. So those bytes are computed once at load, and decoding becomes a concatenation and
/// one lossy UTF-8 conversion: what the tokenizer's own decoder returns (tested equal over the
/// whole vocabulary and random sequences), without its per-call token strings, map lookups and
/// allocations, which were most of the frontend's detokenising cost per streamed token.
pub(super) struct TokenBytes {
    bytes: Vec<u8>,
    /// `bytes[ends[id - 1]..ends[id]]` is token `id`'s (empty for a special token).
    ends: Vec<u32>,
}

impl TokenBytes {
    /// The table of `vocab_size` tokens, `of(id)` giving each one's bytes.
    pub(super) fn build(vocab_size: u32, mut of: impl FnMut(u32) -> Vec<u8>) -> Self {
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(vocab_size as usize);
        for id in 0..vocab_size {
            bytes.extend_from_slice(&of(id));
            ends.push(bytes.len() as u32);
        }
        Self { bytes, ends }
    }

    /// Token `id`'s bytes (empty for an id outside the vocabulary).
    pub(super) fn get(&self, id: u32) -> &[u8] {
        let i = id as usize;
        let start = i.checked_sub(1).and_then(|p| self.ends.get(p)).copied().unwrap_or(0);
        let end = self.ends.get(i).copied().unwrap_or(start);
        self.bytes.get(start as usize..end as usize).unwrap_or(&[])
    }

    fn vocab_size(&self) -> u32 {
        self.ends.len() as u32
    }

    fn check(&self, id: u32) -> Result<(), TextError> {
        if id >= self.vocab_size() {
            return Err(TextError::Tokenizer(format!(
                "token id {id} is outside the vocabulary ({})",
                self.vocab_size()
            )));
        }
        Ok(())
    }

    /// `ids` as text, lossily (an invalid UTF-8 sequence reads as U+FFFD).
    pub(super) fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        ids.iter().try_for_each(|&id| self.check(id))?;
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.get(id)).copied().collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    pub(super) fn stream(&self) -> GgufDecodeStream<'_> {
        GgufDecodeStream { table: self, pending: Vec::new() }
    }
}

/// GPT-2's byte-to-unicode table, reversed: the printable bytes stand for themselves, the
/// other 68 for the characters from U+0100 on, in byte order.
pub(super) fn unicode_to_byte() -> HashMap<char, u8> {
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

/// Incremental detokenizer: the bytes of the tokens not shown yet are held until they read as
/// text that does not end in an incomplete UTF-8 sequence (which the lossy conversion renders
/// as U+FFFD), then shown whole. This is what tokenizers' `DecodeStream` algorithm (decode a
/// short window of ids, emit the new suffix) yields, cut from [`TokenBytes`] instead of
/// decoding the window twice per token; a stray byte that can never complete is shown as
/// U+FFFD once text follows it, as there.
pub(super) struct GgufDecodeStream<'a> {
    table: &'a TokenBytes,
    pending: Vec<u8>,
}

impl DecodeStream for GgufDecodeStream<'_> {
    fn step(&mut self, token_id: u32) -> Result<String, TextError> {
        self.table.check(token_id)?;
        self.pending.extend_from_slice(self.table.get(token_id));
        let text = match String::from_utf8_lossy(&self.pending) {
            text if text.ends_with(char::REPLACEMENT_CHARACTER) => return Ok(String::new()),
            text => text.into_owned(),
        };
        self.pending.clear();
        Ok(text)
    }
}
