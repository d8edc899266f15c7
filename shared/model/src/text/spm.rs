//! SentencePiece (`tokenizer.ggml.model = "llama"`: Llama 2, Gemma), as llama.cpp's
//! `llm_tokenizer_spm` tokenizes it.
//!
//! The text is first cut at every special token written in it (control, user-defined and
//! unknown tokens, matched leftmost-longest; `<start_of_turn>`, Gemma's `\n`-run tokens). Each
//! plain piece gets a leading space when `add_space_prefix` is set and it begins the text or
//! follows a special token, has its spaces written as `▁`, and is split into characters; then
//! the adjacent pair that forms the vocabulary's highest-scoring token is merged, again and
//! again (ties: the leftmost). A character left that is not a token is written as the
//! byte-fallback tokens `<0xXX>` of its UTF-8 bytes (the unknown token where the vocabulary
//! lacks one).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use aho_corasick::{AhoCorasick, MatchKind};

use super::{
    TokenBytes, TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED,
};
use crate::error::ModelError;

/// SentencePiece's visible space.
const SPACE: &str = "\u{2581}";

pub(super) struct Spm {
    pieces: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i64>,
    index: HashMap<String, u32>,
    byte_ids: [Option<u32>; 256],
    unk: Option<u32>,
    /// The special tokens matched in text before tokenizing, and their ids by pattern.
    specials: Option<AhoCorasick>,
    special_ids: Vec<u32>,
    add_space_prefix: bool,
}

/// A candidate merge of symbols `left` and `right`, `size` bytes long, into a token scoring
/// `score`; the heap pops the highest score, then the leftmost.
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

/// A span of the text being merged, in a doubly linked list of the spans left.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    pub(super) fn new(
        tokens: &[&str],
        scores: Vec<f32>,
        types: Vec<i64>,
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Result<Self, ModelError> {
        if scores.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "tokenizer.ggml.scores has {} entries for {} tokens",
                scores.len(),
                tokens.len()
            )));
        }
        let types = if types.is_empty() { vec![TOKEN_TYPE_NORMAL; tokens.len()] } else { types };
        let pieces: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
        let index: HashMap<String, u32> = pieces.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = index.get(&format!("<0x{b:02X}>")).copied();
        }
        let (patterns, special_ids): (Vec<&str>, Vec<u32>) = types
            .iter()
            .zip(&pieces)
            .enumerate()
            .filter(|(_, (ty, piece))| {
                matches!(**ty, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED | TOKEN_TYPE_UNKNOWN) && !piece.is_empty()
            })
            .map(|(i, (_, piece))| (piece.as_str(), i as u32))
            .unzip();
        let specials = if patterns.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&patterns)
                    .map_err(|e| ModelError::Tokenizer(format!("special tokens: {e}")))?,
            )
        };
        Ok(Self { pieces, scores, types, index, byte_ids, unk, specials, special_ids, add_space_prefix })
    }

    /// `text` as ids, special tokens written in it included, nothing added.
    pub(super) fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut prev_special = true;
        let mut at = 0;
        let matches = self.specials.iter().flat_map(|ac| ac.find_iter(text));
        for m in matches {
            if m.start() > at {
                self.encode_plain(&text[at..m.start()], prev_special, &mut out);
            }
            if let Some(&id) = self.special_ids.get(m.pattern().as_usize()) {
                out.push(id);
            }
            prev_special = true;
            at = m.end();
        }
        if at < text.len() {
            self.encode_plain(&text[at..], prev_special, &mut out);
        }
        out
    }

    fn encode_plain(&self, text: &str, after_special: bool, out: &mut Vec<u32>) {
        let mut s = String::with_capacity(text.len() + 3);
        if self.add_space_prefix && after_special {
            s.push_str(SPACE);
        }
        s.push_str(&text.replace(' ', SPACE));
        Session { spm: self, text: &s, symbols: Vec::new(), heap: BinaryHeap::new() }.tokenize(out);
    }

    /// Each token's bytes: a normal piece with `▁` read as a space, a user-defined one as it
    /// is, a byte token its byte; nothing for control, unknown and unused tokens (llama.cpp's
    /// `token_to_piece` without special tokens).
    pub(super) fn token_bytes(&self) -> TokenBytes {
        TokenBytes::build(self.pieces.len() as u32, |id| self.piece_bytes(id))
    }

    fn piece_bytes(&self, id: u32) -> Vec<u8> {
        let (Some(piece), Some(&ty)) = (self.pieces.get(id as usize), self.types.get(id as usize)) else {
            return Vec::new();
        };
        match ty {
            TOKEN_TYPE_NORMAL => piece.replace(SPACE, " ").into_bytes(),
            TOKEN_TYPE_USER_DEFINED => piece.clone().into_bytes(),
            TOKEN_TYPE_BYTE => byte_of(piece).map(|b| vec![b]).unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    /// The piece of `id` as the vocabulary writes it.
    pub(super) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// Whether `id` is skipped when decoding user-visible text.
    pub(super) fn is_special(&self, id: u32) -> bool {
        !matches!(self.types.get(id as usize), Some(&(TOKEN_TYPE_NORMAL | TOKEN_TYPE_USER_DEFINED | TOKEN_TYPE_BYTE)))
    }

    /// `id`'s type (`tokenizer.ggml.token_type`).
    pub(super) fn token_type(&self, id: u32) -> Option<i64> {
        self.types.get(id as usize).copied()
    }
}

/// The byte of a byte-fallback piece `<0xXX>`.
fn byte_of(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

/// One plain piece being tokenized.
struct Session<'a> {
    spm: &'a Spm,
    text: &'a str,
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Bigram>,
}

impl<'a> Session<'a> {
    fn tokenize(mut self, out: &mut Vec<u32>) {
        let chars: Vec<(usize, char)> = self.text.char_indices().collect();
        let n = chars.len();
        self.symbols = chars
            .iter()
            .enumerate()
            .map(|(i, &(start, c))| Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1).filter(|&next| next < n),
            })
            .collect();
        for i in 1..n {
            self.try_add_bigram(Some(i - 1), Some(i));
        }
        while let Some(b) = self.heap.pop() {
            let (l, r) = (self.symbols[b.left], self.symbols[b.right]);
            // one side has been merged into something else since this pair was queued
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            self.symbols[b.left].len += r.len;
            self.symbols[b.right].len = 0;
            self.symbols[b.left].next = r.next;
            if let Some(next) = r.next {
                self.symbols[next].prev = Some(b.left);
            }
            self.try_add_bigram(l.prev, Some(b.left));
            self.try_add_bigram(Some(b.left), r.next);
        }
        let mut at = (n > 0).then_some(0);
        while let Some(i) = at {
            self.emit(self.symbols[i], out);
            at = self.symbols[i].next;
        }
    }

    fn try_add_bigram(&mut self, left: Option<usize>, right: Option<usize>) {
        let (Some(left), Some(right)) = (left, right) else { return };
        let (l, r) = (self.symbols[left], self.symbols[right]);
        let Some(text) = self.text.get(l.start..l.start + l.len + r.len) else { return };
        let Some(&id) = self.spm.index.get(text) else { return };
        let score = self.spm.scores.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
        self.heap.push(Bigram { left, right, score, size: text.len() });
    }

    /// A final symbol's ids. Merges only ever form tokens, so a symbol is a token or a single
    /// character the vocabulary lacks (llama.cpp's re-split along recorded merges never
    /// applies); such a character becomes its UTF-8 bytes' byte-fallback tokens.
    fn emit(&self, s: Symbol, out: &mut Vec<u32>) {
        let text = self.text.get(s.start..s.start + s.len).unwrap_or_default();
        if let Some(&id) = self.spm.index.get(text) {
            out.push(id);
            return;
        }
        for &b in text.as_bytes() {
            if let Some(id) = self.spm.byte_ids[b as usize].or(self.spm.unk) {
                out.push(id);
            }
        }
    }
}
