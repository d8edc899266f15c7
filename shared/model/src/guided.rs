//! Structured outputs in the model executors (D53): the vocabulary as llguidance sees it, and
//! sampling one row under a grammar mask.

use pdmesh_guided::{apply_mask, byte_level_token_bytes, Guide, Mask};
use pdmesh_model_api::sampling::{self, Sampled, SamplingError};
use pdmesh_protocol::ScheduledChunk;

use crate::gguf::{md_int_array, md_str_array, GgufFile};

/// GGUF `token_type` of control tokens (never produced as grammar text).
const TOKEN_TYPE_CONTROL: i64 = 3;

/// The grammar guide of a GGUF model: its byte-level vocabulary (`tokenizer.ggml.tokens`) with
/// the control tokens marked special; a grammar that completes allows the first EOS id.
pub(crate) fn guide_from_gguf(g: &GgufFile, vocab_size: usize, eos_token_ids: &[u32]) -> Guide {
    let md = g.metadata();
    let tokens: Vec<String> = md_str_array(md, "tokenizer.ggml.tokens")
        .map(|t| t.iter().map(|s| s.to_string()).collect())
        .unwrap_or_default();
    let types = md_int_array(md, "tokenizer.ggml.token_type").unwrap_or_default();
    let special: Vec<bool> = (0..tokens.len()).map(|i| types.get(i) == Some(&TOKEN_TYPE_CONTROL)).collect();
    let words = byte_level_token_bytes(&tokens, &special);
    Guide::new(words, vocab_size, eos_token_ids.first().copied().unwrap_or(0))
}

/// Sample one row under `mask`: disallowed ids get `-inf`; logprobs stay those of the raw
/// logits (as for unconstrained requests). A failed matcher ends the request with `eos`.
pub(crate) fn sample_masked(
    row: &[f32],
    c: &ScheduledChunk,
    mask: Option<&Mask>,
    eos: u32,
) -> Result<Sampled, SamplingError> {
    let allowed = match mask {
        None => return sampling::sample(row, &c.sampling, c.output_index, c.history.as_ref()),
        Some(Mask::Fail(_)) => {
            let logprobs = c.sampling.logprobs.map(|n| sampling::token_logprobs(row, eos, n as usize));
            return Ok(Sampled { token_id: eos, logprobs });
        }
        Some(Mask::Allowed(a)) => a,
    };
    let mut masked = row.to_vec();
    apply_mask(allowed, &mut masked);
    let mut s = sampling::sample(&masked, &c.sampling, c.output_index, c.history.as_ref())?;
    if !allowed.get(s.token_id as usize).copied().unwrap_or(false) {
        // every allowed logit was -inf (or NaN): take the lowest allowed id
        s.token_id = allowed.iter().position(|&a| a).map_or(eos, |i| i as u32);
    }
    s.logprobs = c.sampling.logprobs.map(|n| sampling::token_logprobs(row, s.token_id, n as usize));
    Ok(s)
}

/// The masks of a step's sampling chunks (computed in order on the executor thread; each
/// costs tens of microseconds), logging any matcher failure.
pub(crate) fn masks(guide: &mut Guide, chunks: &[&ScheduledChunk]) -> Vec<Option<Mask>> {
    chunks
        .iter()
        .map(|c| {
            let m = guide.mask(c);
            if let Some(Mask::Fail(why)) = &m {
                tracing::warn!(request_id = %c.request_id, error = %why, "structured output: grammar failed, ending the request");
            }
            m
        })
        .collect()
}
