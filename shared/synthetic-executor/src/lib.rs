//! A synthetic model for tests and load tests: deterministic tokens, a configurable cost, and
//! a real dependence on the KV cache.
//!
//! It is never an acceptance claim about a model. What it guarantees is what the control plane
//! needs: outputs are a pure function of the prompt, they do not depend on batching or chunking,
//! and they are computed *from the KV cache*: every token's K entry holds a chained hash of the
//! sequence so far, and the next token is derived from the entry of the previous position as
//! read back from its block. A KV block that was not written, was transferred wrong, or was
//! read from a reused block therefore changes the output, so P/D tests with the synthetic
//! executor still prove that the right bytes moved.
//!
//! Text: one token per byte (ids 0..=255) plus `<|eos|>` = 256, and a minimal chat format.

use std::time::Duration;

use pdmesh_guided::{Guide, Mask};
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{ChatMessage, DecodeStream, Executor, ExecutorError, KvCache, ModelFacts, TextCodec, TextError};
use pdmesh_protocol::{SampledToken, ScheduledChunk};

/// End-of-sequence id of the synthetic vocabulary.
pub const EOS: u32 = 256;
/// Vocabulary size: 256 bytes + EOS.
pub const VOCAB: u32 = 257;
/// Chain hashes are kept below 2^24 so that f32 stores them exactly.
const HASH_MASK: u32 = (1 << 24) - 1;
/// Letters the synthetic model "writes" (readable streams in demos and logs).
const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz ";

/// Cost model and identity of the synthetic executor.
#[derive(Debug, Clone)]
pub struct SyntheticConfig {
    pub name: String,
    pub max_model_len: u32,
    /// Simulated compute per scheduled token.
    pub per_token_cost: Duration,
    /// Simulated compute per step.
    pub per_step_cost: Duration,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            name: "pdmesh-synthetic".into(),
            max_model_len: 4096,
            per_token_cost: Duration::ZERO,
            per_step_cost: Duration::ZERO,
        }
    }
}

/// The synthetic executor.
#[derive(Debug)]
pub struct SyntheticExecutor {
    facts: ModelFacts,
    config: SyntheticConfig,
    /// Grammar matchers of structured-output requests (D53), over the one-byte vocabulary.
    guide: Guide,
}

impl SyntheticExecutor {
    pub fn new(config: SyntheticConfig) -> Self {
        let facts = ModelFacts {
            name: config.name.clone(),
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 8,
            vocab_size: VOCAB,
            max_model_len: config.max_model_len,
            eos_token_ids: vec![EOS],
            weights_id: "synthetic-v1".into(),
        };
        Self { facts, config, guide: Guide::single_byte(EOS) }
    }
}

/// The synthetic model's choice under a grammar: EOS as soon as the grammar may end (outputs
/// stay short), else its own token when allowed, else an allowed byte picked by the hash.
fn guided_token(mask: &Mask, h: u32) -> u32 {
    let Mask::Allowed(allowed) = mask else { return EOS };
    if allowed.get(EOS as usize).copied().unwrap_or(false) {
        return EOS;
    }
    let natural = next_token(h);
    if allowed.get(natural as usize).copied().unwrap_or(false) {
        return natural;
    }
    let ids: Vec<u32> = allowed.iter().enumerate().filter(|(_, &a)| a).map(|(i, _)| i as u32).collect();
    if ids.is_empty() {
        return EOS;
    }
    ids.get(h.wrapping_mul(2_654_435_761) as usize % ids.len()).copied().unwrap_or(EOS)
}

/// Mix one token into the chain hash (FNV-1a style, truncated to 24 bits).
fn chain(prev: u32, token: u32, pos: u32) -> u32 {
    let mut h: u32 = 0x811c_9dc5 ^ prev;
    for b in token.to_le_bytes().into_iter().chain(pos.to_le_bytes()) {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h & HASH_MASK
}

/// The token that follows a sequence whose chain hash is `h`.
pub fn next_token(h: u32) -> u32 {
    let idx = (h.wrapping_mul(2_654_435_761) >> 8) as usize % ALPHABET.len();
    u32::from(ALPHABET.get(idx).copied().unwrap_or(b' '))
}

impl Executor for SyntheticExecutor {
    fn facts(&self) -> &ModelFacts {
        &self.facts
    }

    fn execute(&mut self, kv: &mut KvCache, chunks: &[ScheduledChunk]) -> Result<Vec<SampledToken>, ExecutorError> {
        let block_size = kv.spec().block_size;
        let mut n_tokens = 0usize;
        let mut out = Vec::new();
        for chunk in chunks {
            let slot_of = |pos: u32| -> Result<(u32, usize), ExecutorError> {
                let block =
                    chunk.block_ids.get((pos / block_size) as usize).copied().ok_or_else(|| {
                        ExecutorError::BlockTableTooShort { request_id: chunk.request_id.clone(), pos }
                    })?;
                Ok((block, (pos % block_size) as usize))
            };
            // The chain hash of the position before this chunk, read back from the KV cache.
            let mut h = if chunk.start_pos == 0 {
                0
            } else {
                let (block, slot) = slot_of(chunk.start_pos - 1)?;
                let stored = kv.block(0, KvSide::Key, block)?.get(slot * 8).copied().unwrap_or(0.0);
                stored as u32
            };
            for (i, &token) in chunk.token_ids.iter().enumerate() {
                if token >= VOCAB {
                    return Err(ExecutorError::TokenOutOfRange { token, vocab: VOCAB });
                }
                let pos = chunk.start_pos + i as u32;
                h = chain(h, token, pos);
                let (block, slot) = slot_of(pos)?;
                for layer in 0..kv.spec().num_layers as usize {
                    if let Some(k) = kv.block_mut(layer, KvSide::Key, block)?.get_mut(slot * 8..slot * 8 + 8) {
                        k.fill(h as f32);
                    }
                    if let Some(v) = kv.block_mut(layer, KvSide::Value, block)?.get_mut(slot * 8..slot * 8 + 8) {
                        v.fill(token as f32);
                    }
                }
            }
            n_tokens += chunk.token_ids.len();
            if chunk.sample {
                // Read the last position back from the cache rather than using `h`, so the
                // output depends on what the cache really holds.
                let last = chunk.start_pos + chunk.token_ids.len() as u32 - 1;
                let (block, slot) = slot_of(last)?;
                let stored = kv.block(0, KvSide::Key, block)?.get(slot * 8).copied().unwrap_or(0.0) as u32;
                let token_id = match self.guide.mask(chunk) {
                    None => next_token(stored),
                    Some(mask) => {
                        let t = guided_token(&mask, stored);
                        self.guide.commit(&chunk.request_id, t);
                        t
                    }
                };
                out.push(SampledToken { request_id: chunk.request_id.clone(), token_id, logprobs: None });
            }
        }
        let cost = self.config.per_step_cost + self.config.per_token_cost * n_tokens as u32;
        if !cost.is_zero() {
            std::thread::sleep(cost);
        }
        Ok(out)
    }

    fn release(&mut self, request_ids: &[String]) {
        self.guide.release(request_ids);
    }
}

/// Byte-level text codec of the synthetic model.
#[derive(Debug, Default)]
pub struct SyntheticTextCodec;

struct ByteDecodeStream {
    pending: Vec<u8>,
}

impl DecodeStream for ByteDecodeStream {
    fn step(&mut self, token_id: u32) -> Result<String, TextError> {
        if token_id >= 256 {
            return Ok(String::new());
        }
        self.pending.push(token_id as u8);
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let s = s.to_string();
                self.pending.clear();
                Ok(s)
            }
            // An incomplete character: wait for more bytes (at most 4).
            Err(e) if e.error_len().is_none() && self.pending.len() < 4 => Ok(String::new()),
            Err(_) => {
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                Ok(s)
            }
        }
    }
}

impl TextCodec for SyntheticTextCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        let bytes: Vec<u8> = ids.iter().filter(|&&id| id < 256).map(|&id| id as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn decode_stream(&self) -> Box<dyn DecodeStream + '_> {
        Box::new(ByteDecodeStream { pending: Vec::new() })
    }

    fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        _tools: Option<&[serde_json::Value]>,
    ) -> Result<String, TextError> {
        let mut out = String::new();
        for m in messages {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
                return Err(TextError::Template(format!("unknown role {:?}", m.role)));
            }
            out.push_str(&format!("<{}>{}\n", m.role, m.content));
        }
        out.push_str("<assistant>");
        Ok(out)
    }

    fn token_text(&self, id: u32) -> String {
        if id == EOS {
            "<|eos|>".into()
        } else {
            String::from_utf8_lossy(&[id as u8]).into_owned()
        }
    }

    fn vocab_size(&self) -> u32 {
        VOCAB
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_model_api::KvCacheSpec;
    use pdmesh_protocol::SamplingParams;

    fn chunk(id: &str, tokens: &[u32], start: u32, blocks: &[u32], sample: bool) -> ScheduledChunk {
        ScheduledChunk {
            request_id: id.into(),
            token_ids: tokens.to_vec(),
            start_pos: start,
            block_ids: blocks.to_vec(),
            sample,
            sampling: SamplingParams::default(),
            output_index: 0,
            guided_output: Vec::new(),
            history: None,
        }
    }

    fn cache() -> KvCache {
        let ex = SyntheticExecutor::new(SyntheticConfig::default());
        let f = ex.facts();
        KvCache::new_heap(KvCacheSpec {
            num_layers: f.num_layers,
            num_blocks: 16,
            block_size: 4,
            num_kv_heads: f.num_kv_heads,
            head_dim: f.head_dim,
        })
    }

    #[test]
    fn chunking_and_batching_do_not_change_tokens() {
        let prompt: Vec<u32> = b"hello synthetic world".iter().map(|&b| u32::from(b)).collect();
        let mut ex = SyntheticExecutor::new(SyntheticConfig::default());
        let mut kv = cache();
        let whole = ex.execute(&mut kv, &[chunk("a", &prompt, 0, &[0, 1, 2, 3, 4, 5], true)]).unwrap();
        let mut kv2 = cache();
        let blocks = [7, 3, 9, 1, 2, 8];
        ex.execute(&mut kv2, &[chunk("b", &prompt[..5], 0, &blocks, false), chunk("x", &[1, 2], 0, &[15], true)])
            .unwrap();
        let split = ex.execute(&mut kv2, &[chunk("b", &prompt[5..], 5, &blocks, true)]).unwrap();
        assert_eq!(whole[0].token_id, split[0].token_id);
    }

    /// Decode a request under a grammar to its end (EOS), as engine-core would schedule it.
    fn guided_run(ex: &mut SyntheticExecutor, id: &str, spec: pdmesh_protocol::GuidedSpec) -> String {
        let mut kv = cache();
        let blocks: Vec<u32> = (0..16).collect();
        let prompt: Vec<u32> = b"say:".iter().map(|&b| u32::from(b)).collect();
        let mut out: Vec<u32> = Vec::new();
        let mut next = (prompt.clone(), 0u32);
        for _ in 0..40 {
            let mut c = chunk(id, &next.0, next.1, &blocks, true);
            c.sampling.guided = Some(spec.clone());
            c.output_index = out.len() as u32;
            c.guided_output = out.clone();
            let t = ex.execute(&mut kv, &[c]).unwrap()[0].token_id;
            if t == EOS {
                break;
            }
            next = (vec![t], prompt.len() as u32 + out.len() as u32);
            out.push(t);
        }
        String::from_utf8(out.iter().map(|&t| t as u8).collect()).unwrap()
    }

    #[test]
    fn grammars_shape_the_synthetic_output_and_end_it() {
        use pdmesh_protocol::GuidedSpec;
        let mut ex = SyntheticExecutor::new(SyntheticConfig::default());
        let s = guided_run(&mut ex, "r", GuidedSpec::Regex("[a-z]{3}-[0-9]{2}".into()));
        assert_eq!(s.len(), 6, "{s:?}");
        assert!(s.as_bytes()[3] == b'-' && s[4..].bytes().all(|b| b.is_ascii_digit()), "{s:?}");
        let s = guided_run(&mut ex, "c", GuidedSpec::Choice(vec!["yes".into(), "no".into()]));
        assert!(s == "yes" || s == "no", "{s:?}");
        // a fresh executor (a restarted worker) continues where the tokens say
        let mut other = SyntheticExecutor::new(SyntheticConfig::default());
        let mut c = chunk("r2", b"n".map(u32::from).as_slice(), 4, &(0..16).collect::<Vec<_>>(), true);
        c.sampling.guided = Some(GuidedSpec::Choice(vec!["yes".into(), "no".into()]));
        c.guided_output = vec![u32::from(b'n')];
        c.output_index = 1;
        let mut kv = cache();
        let t = other.execute(&mut kv, &[c]).unwrap()[0].token_id;
        assert_eq!(t, u32::from(b'o'));
        ex.release(&["r".into(), "c".into()]);
        assert_eq!(ex.guide.cached(), 0);
    }

    #[test]
    fn output_depends_on_cache_contents() {
        let prompt: Vec<u32> = b"abcdefgh".iter().map(|&b| u32::from(b)).collect();
        let mut ex = SyntheticExecutor::new(SyntheticConfig::default());
        let mut kv = cache();
        ex.execute(&mut kv, &[chunk("a", &prompt, 0, &[0, 1, 2], false)]).unwrap();
        let good = ex.execute(&mut kv, &[chunk("a", &[b'i'.into()], 8, &[0, 1, 2], true)]).unwrap()[0].token_id;
        // corrupt the block holding position 7, then decode position 8 again
        kv.block_mut(0, KvSide::Key, 1).unwrap().fill(12345.0);
        let bad = ex.execute(&mut kv, &[chunk("a", &[b'i'.into()], 8, &[0, 1, 2], true)]).unwrap()[0].token_id;
        assert_ne!(good, bad);
    }

    #[test]
    fn bad_input_is_an_error() {
        let mut ex = SyntheticExecutor::new(SyntheticConfig::default());
        let mut kv = cache();
        assert!(ex.execute(&mut kv, &[chunk("a", &[1, 2, 3, 4, 5], 0, &[0], true)]).is_err());
        assert!(ex.execute(&mut kv, &[chunk("a", &[1], 0, &[99], true)]).is_err());
        assert!(ex.execute(&mut kv, &[chunk("a", &[999], 0, &[0], true)]).is_err());
    }

    #[test]
    fn codec_streams_utf8() {
        let c = SyntheticTextCodec;
        let ids = c.encode("héllo 🎉").unwrap();
        let mut s = c.decode_stream();
        let mut text = String::new();
        for id in &ids {
            text.push_str(&s.step(*id).unwrap());
        }
        assert_eq!(text, "héllo 🎉");
        assert!(c.render_chat(&[ChatMessage::text("wizard", "x")]).is_err());
    }
}
