//! Engine outputs → user-visible text: incremental detokenisation, stop strings, logprobs.
//!
//! [`OutputProcessor`] is the per-request state machine (vLLM's `OutputProcessor` +
//! `IncrementalDetokenizer` + `StopChecker`): feed it each [`EngineOutput`] of one request and
//! it returns the [`Delta`] the client may see now. Stop strings are the frontend's business
//! (the engine only knows stop token ids): text is cut at the earliest occurrence of any stop
//! string, the stop string itself is not shown (unless `include_stop_str_in_output`), and while
//! streaming, text that could still turn out to be the start of a stop string is held back.

use pdmesh_model_api::{DecodeStream, TextCodec};
use pdmesh_protocol::{EngineOutput, FinishReason, KvTransferParams};
use serde_json::Value;

use crate::error::ApiError;
use crate::openai::{ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs};

/// Floor for logprobs in responses: `-inf` is not JSON (vLLM clamps the same way).
const MIN_LOGPROB: f32 = -9999.0;

/// Why a request's output ended, as the client sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum Finish {
    /// EOS, a stop token id or a stop string.
    Stop(Option<StopReason>),
    /// `max_tokens` or the context length.
    Length,
    /// The mesh aborted the request.
    Abort,
    /// The mesh failed the request; the engine's message.
    Error(Option<String>),
}

/// What ended a request that finished with "stop", when it was not EOS.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    String(String),
    TokenId(u32),
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Finish::Stop(_) => "stop",
            Finish::Length => "length",
            Finish::Abort => "abort",
            Finish::Error(_) => "error",
        }
    }

    /// vLLM's `stop_reason`: the stop string or stop token id, null otherwise.
    pub fn stop_reason(&self) -> Option<Value> {
        match self {
            Finish::Stop(Some(StopReason::String(s))) => Some(Value::String(s.clone())),
            Finish::Stop(Some(StopReason::TokenId(t))) => Some(Value::from(*t)),
            _ => None,
        }
    }
}

/// The logprob information of one generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    /// The token's own text (`codec.token_text`), not the detokenised delta.
    pub token: String,
    /// `None` when the engine sent no logprobs for this position.
    pub logprob: Option<f32>,
    /// `(text, logprob)` of the most likely tokens, most likely first.
    pub top: Vec<(String, f32)>,
    /// Character offset of the token's text in the completion text.
    pub text_offset: u32,
}

/// What one engine output adds to the response.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// Text the client may see now.
    pub text: String,
    /// One entry per new token, when logprobs were requested.
    pub logprobs: Vec<TokenLogprob>,
    /// Tokens the engine produced in this output (counted for usage even past a stop string).
    pub new_tokens: u32,
    /// Their ids, up to the one that ended the request (a stream tells the router, D56).
    pub token_ids: Vec<u32>,
    /// Set once: the request is over for the client.
    pub finish: Option<Finish>,
    /// Whether the engine considers the request finished; when `finish` is set and this is
    /// not, the frontend ended it (stop string) and must abort the engine request.
    pub engine_finished: bool,
    /// The engine's final `kv_transfer_params` (P's answer for the decode side).
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// Finds stop strings in text and decides how much text must be held back.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    max_len: usize,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        let max_len = stops.iter().map(String::len).max().unwrap_or(0);
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), max_len }
    }

    /// The earliest occurrence of any stop string: `(byte start, index of the stop string)`.
    /// On a tie, the stop string listed first wins.
    pub fn find(&self, text: &str) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| text.find(s.as_str()).map(|pos| (pos, i)))
            .min_by_key(|&(pos, i)| (pos, i))
    }

    /// Byte length of the longest suffix of `text` that is a proper prefix of a stop string:
    /// the text that must not be shown yet because the next tokens may complete a stop string.
    pub fn holdback(&self, text: &str) -> usize {
        if self.stops.is_empty() {
            return 0;
        }
        let earliest = text.len().saturating_sub(self.max_len.saturating_sub(1));
        text.char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= earliest)
            .find(|&i| {
                let suffix = &text[i..];
                self.stops.iter().any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            })
            .map_or(0, |i| text.len() - i)
    }

    pub fn stop(&self, index: usize) -> Option<&str> {
        self.stops.get(index).map(String::as_str)
    }
}

/// The per-request output state machine (see the module docs).
pub struct OutputProcessor<'a> {
    codec: &'a dyn TextCodec,
    decoder: Box<dyn DecodeStream + 'a>,
    stops: StopMatcher,
    include_stop_str_in_output: bool,
    eos_token_ids: Vec<u32>,
    /// Top alternatives per token to report; `None`: no logprobs.
    logprobs: Option<u32>,
    /// Decoded text not shown yet (a possible stop-string prefix).
    pending: String,
    /// Characters decoded so far (shown or pending), for `text_offset`.
    decoded_chars: u32,
    completion_tokens: u32,
    /// vLLM's `min_tokens`: stop strings are looked for only in text decoded after this many
    /// tokens (the engine's sampler holds back stop ids until then).
    min_tokens: u32,
    /// Prompt tokens the engine took from its prefix cache (reported on its outputs).
    cached_tokens: u32,
    finished: bool,
}

impl<'a> OutputProcessor<'a> {
    pub fn new(
        codec: &'a dyn TextCodec,
        stops: Vec<String>,
        include_stop_str_in_output: bool,
        eos_token_ids: Vec<u32>,
        logprobs: Option<u32>,
    ) -> Self {
        Self {
            codec,
            decoder: codec.decode_stream(),
            stops: StopMatcher::new(stops),
            include_stop_str_in_output,
            eos_token_ids,
            logprobs,
            pending: String::new(),
            decoded_chars: 0,
            completion_tokens: 0,
            min_tokens: 0,
            cached_tokens: 0,
            finished: false,
        }
    }

    /// Look for stop strings only once more than `min_tokens` tokens were generated (vLLM).
    pub fn with_min_tokens(mut self, min_tokens: u32) -> Self {
        self.min_tokens = min_tokens;
        self
    }

    /// Tokens generated so far (usage `completion_tokens`).
    pub fn completion_tokens(&self) -> u32 {
        self.completion_tokens
    }

    /// Prompt tokens reused from the engine's prefix cache (usage `cached_tokens`).
    pub fn cached_tokens(&self) -> u32 {
        self.cached_tokens
    }

    /// Whether the request is over for the client; later outputs are ignored.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Consume one engine output of this request.
    pub fn process(&mut self, out: &EngineOutput) -> Result<Delta, ApiError> {
        let mut delta = Delta::default();
        if self.finished {
            return Ok(delta);
        }
        self.cached_tokens = self.cached_tokens.max(out.num_cached_tokens);
        let n = out.new_token_ids.len();
        // vLLM does not show the text of the stop token that ended a request.
        let skip_last_text = out.finish_reason == Some(FinishReason::Stop)
            && out.stop_token_id.is_some()
            && out.stop_token_id == out.new_token_ids.last().copied()
            && !self.include_stop_str_in_output;
        for (i, &token_id) in out.new_token_ids.iter().enumerate() {
            self.completion_tokens = self.completion_tokens.saturating_add(1);
            delta.new_tokens += 1;
            delta.token_ids.push(token_id);
            let piece = if skip_last_text && i + 1 == n {
                String::new()
            } else {
                self.decoder
                    .step(token_id)
                    .map_err(|e| ApiError::Internal(format!("cannot detokenise the output: {e}")))?
            };
            if let Some(k) = self.logprobs {
                let lp = out.new_logprobs.as_ref().and_then(|v| v.get(i));
                delta.logprobs.push(TokenLogprob {
                    token_id,
                    token: self.codec.token_text(token_id),
                    logprob: lp.map(|l| l.logprob),
                    top: lp
                        .map(|l| l.top.iter().take(k as usize).map(|&(id, p)| (self.codec.token_text(id), p)).collect())
                        .unwrap_or_default(),
                    text_offset: self.decoded_chars,
                });
            }
            if piece.is_empty() {
                continue;
            }
            self.decoded_chars = self.decoded_chars.saturating_add(piece.chars().count() as u32);
            self.pending.push_str(&piece);
            if self.completion_tokens <= self.min_tokens {
                // text before `min_tokens` can never end the request: show it as it comes
                delta.text.push_str(&self.pending);
                self.pending.clear();
                continue;
            }
            if let Some((start, index)) = self.stops.find(&self.pending) {
                let stop = self.stops.stop(index).unwrap_or_default().to_string();
                let end = if self.include_stop_str_in_output { start + stop.len() } else { start };
                delta.text.push_str(&self.pending[..end]);
                self.pending.clear();
                self.finished = true;
                delta.finish = Some(Finish::Stop(Some(StopReason::String(stop))));
                delta.engine_finished = out.finish_reason.is_some();
                delta.kv_transfer_params = out.kv_transfer_params.clone();
                return Ok(delta);
            }
        }
        match out.finish_reason {
            Some(reason) => {
                self.finished = true;
                delta.engine_finished = true;
                delta.kv_transfer_params = out.kv_transfer_params.clone();
                delta.finish = Some(match reason {
                    FinishReason::Stop => Finish::Stop(
                        out.stop_token_id.filter(|t| !self.eos_token_ids.contains(t)).map(StopReason::TokenId),
                    ),
                    FinishReason::Length => Finish::Length,
                    FinishReason::Abort => Finish::Abort,
                    FinishReason::Error => Finish::Error(out.error.clone()),
                });
                if reason != FinishReason::Error {
                    // The request is over: nothing can complete a stop string any more.
                    delta.text.push_str(&self.pending);
                }
                self.pending.clear();
            }
            None => {
                let release = self.pending.len() - self.stops.holdback(&self.pending);
                delta.text.push_str(&self.pending[..release]);
                self.pending.drain(..release);
            }
        }
        Ok(delta)
    }
}

fn clamp(lp: f32) -> f32 {
    if lp.is_nan() {
        MIN_LOGPROB
    } else {
        lp.max(MIN_LOGPROB)
    }
}

/// Completions-style logprobs: parallel arrays, `top_logprobs` as `{text: logprob}` maps
/// that hold the sampled token and the top alternatives (OpenAI: up to `logprobs + 1`).
pub fn completion_logprobs(entries: &[TokenLogprob]) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for e in entries {
        out.tokens.push(e.token.clone());
        out.token_logprobs.push(e.logprob.map(clamp));
        let mut top = serde_json::Map::new();
        for (text, lp) in &e.top {
            top.entry(text.clone()).or_insert_with(|| Value::from(clamp(*lp)));
        }
        if let Some(lp) = e.logprob {
            top.entry(e.token.clone()).or_insert_with(|| Value::from(clamp(lp)));
        }
        out.top_logprobs.push(top);
        out.text_offset.push(e.text_offset);
    }
    out
}

/// Chat-style logprobs: one object per token with its UTF-8 bytes and the alternatives.
pub fn chat_logprobs(entries: &[TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: entries
            .iter()
            .map(|e| ChatTokenLogprob {
                token: e.token.clone(),
                logprob: clamp(e.logprob.unwrap_or(MIN_LOGPROB)),
                bytes: e.token.as_bytes().to_vec(),
                top_logprobs: e
                    .top
                    .iter()
                    .map(|(t, lp)| ChatTopLogprob {
                        token: t.clone(),
                        logprob: clamp(*lp),
                        bytes: t.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_protocol::TokenLogprobs;
    use pdmesh_synthetic_executor::{SyntheticTextCodec, EOS};

    fn out(text: &str) -> EngineOutput {
        EngineOutput {
            request_id: "r".into(),
            new_token_ids: text.bytes().map(u32::from).collect(),
            new_logprobs: None,
            finish_reason: None,
            stop_token_id: None,
            kv_transfer_params: None,
            num_external_tokens: 0,
            num_cached_tokens: 0,
            error: None,
        }
    }

    fn finished(text: &str, reason: FinishReason) -> EngineOutput {
        EngineOutput { finish_reason: Some(reason), ..out(text) }
    }

    static CODEC: SyntheticTextCodec = SyntheticTextCodec;

    fn processor(stops: &[&str]) -> OutputProcessor<'static> {
        OutputProcessor::new(&CODEC, stops.iter().map(|s| s.to_string()).collect(), false, vec![EOS], None)
    }

    #[test]
    fn matcher_finds_the_earliest_stop() {
        let m = StopMatcher::new(vec!["world".into(), "lo".into()]);
        assert_eq!(m.find("hello world"), Some((3, 1)));
        assert_eq!(m.find("nothing"), None);
        let m = StopMatcher::new(vec!["ab".into(), "a".into()]);
        assert_eq!(m.find("xab"), Some((1, 0)));
    }

    #[test]
    fn matcher_holds_back_possible_prefixes() {
        let m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.holdback("abc E"), 1);
        assert_eq!(m.holdback("abc EN"), 2);
        assert_eq!(m.holdback("abc EX"), 0);
        assert_eq!(m.holdback(""), 0);
        let m = StopMatcher::new(vec!["x".into()]);
        assert_eq!(m.holdback("abc"), 0);
        // multi-byte characters are never split
        let m = StopMatcher::new(vec!["éé".into()]);
        assert_eq!(m.holdback("aé"), "é".len());
        assert_eq!(StopMatcher::new(vec![]).holdback("abc"), 0);
    }

    #[test]
    fn streaming_holds_back_then_cuts_at_the_stop_string() {
        let mut p = processor(&["STOP"]);
        let d = p.process(&out("hello S")).unwrap();
        assert_eq!(d.text, "hello ");
        assert!(d.finish.is_none());
        let d = p.process(&out("T")).unwrap();
        assert_eq!(d.text, "");
        // not a stop string after all: the held text is released
        let d = p.process(&out("x")).unwrap();
        assert_eq!(d.text, "STx");
        let d = p.process(&out(" more STOP and after")).unwrap();
        assert_eq!(d.text, " more ");
        assert_eq!(d.finish, Some(Finish::Stop(Some(StopReason::String("STOP".into())))));
        assert!(!d.engine_finished, "the frontend must abort the engine request");
        assert_eq!(d.finish.as_ref().unwrap().stop_reason(), Some(Value::from("STOP")));
        // later outputs are ignored
        assert_eq!(p.process(&out("zzz")).unwrap(), Delta::default());
        assert!(p.is_finished());
        // tokens past the stop string in the same output are not counted
        assert_eq!(p.completion_tokens() as usize, "hello STx more STOP".len());
    }

    #[test]
    fn stop_string_split_across_many_outputs() {
        let mut p = processor(&["\n\n"]);
        let mut text = String::new();
        let mut finish = None;
        for piece in ["a", "b", "\n", "c", "\n", "\n", "d"] {
            let d = p.process(&out(piece)).unwrap();
            text.push_str(&d.text);
            if d.finish.is_some() {
                finish = d.finish;
                break;
            }
        }
        assert_eq!(text, "ab\nc");
        assert_eq!(finish.unwrap().as_str(), "stop");
    }

    #[test]
    fn finish_flushes_held_text() {
        let mut p = processor(&["ENDING"]);
        assert_eq!(p.process(&out("abc EN")).unwrap().text, "abc ");
        let d = p.process(&finished("D", FinishReason::Length)).unwrap();
        assert_eq!(d.text, "END");
        assert_eq!(d.finish, Some(Finish::Length));
        assert!(d.engine_finished);
    }

    #[test]
    fn stop_strings_match_only_after_min_tokens() {
        // one byte a token: "b" at token 2 is before min_tokens 3, "b" at token 5 is after
        let mut p = processor(&["b"]).with_min_tokens(3);
        let d = p.process(&out("abcab")).unwrap();
        assert_eq!(d.text, "abca");
        assert_eq!(d.finish, Some(Finish::Stop(Some(StopReason::String("b".into())))));
        // without min_tokens the first "b" ends it
        assert_eq!(processor(&["b"]).process(&out("abcab")).unwrap().text, "a");
    }

    #[test]
    fn include_stop_str_in_output_keeps_it() {
        let codec = &CODEC;
        let mut p = OutputProcessor::new(codec, vec!["b".into()], true, vec![EOS], None);
        assert_eq!(p.process(&out("aabcc")).unwrap().text, "aab");
    }

    #[test]
    fn stop_tokens_are_not_shown_and_reported() {
        let codec = &CODEC;
        let mut p = OutputProcessor::new(codec, vec![], false, vec![EOS], None);
        let mut o = finished("ab!", FinishReason::Stop);
        o.stop_token_id = Some(u32::from(b'!'));
        let d = p.process(&o).unwrap();
        assert_eq!(d.text, "ab");
        assert_eq!(d.finish.unwrap().stop_reason(), Some(Value::from(33)));
        assert_eq!(p.completion_tokens(), 3);
        // EOS: stop, no stop_reason
        let mut p = OutputProcessor::new(codec, vec![], false, vec![EOS], None);
        let mut o = out("ab");
        o.new_token_ids.push(EOS);
        o.finish_reason = Some(FinishReason::Stop);
        o.stop_token_id = Some(EOS);
        let d = p.process(&o).unwrap();
        assert_eq!(d.text, "ab");
        assert_eq!(d.finish, Some(Finish::Stop(None)));
    }

    #[test]
    fn errors_and_aborts() {
        let mut p = processor(&["XYZ"]);
        p.process(&out("aX")).unwrap();
        let mut o = finished("", FinishReason::Error);
        o.error = Some("kv load failed".into());
        let d = p.process(&o).unwrap();
        assert_eq!(d.text, "");
        assert_eq!(d.finish, Some(Finish::Error(Some("kv load failed".into()))));
        let mut p = processor(&[]);
        let d = p.process(&finished("ab", FinishReason::Abort)).unwrap();
        assert_eq!((d.text.as_str(), d.finish), ("ab", Some(Finish::Abort)));
    }

    #[test]
    fn utf8_is_never_split() {
        let mut p = processor(&[]);
        let bytes = "é".as_bytes();
        let mut o1 = out("");
        o1.new_token_ids = vec![u32::from(bytes[0])];
        assert_eq!(p.process(&o1).unwrap().text, "");
        let mut o2 = out("");
        o2.new_token_ids = vec![u32::from(bytes[1])];
        assert_eq!(p.process(&o2).unwrap().text, "é");
    }

    #[test]
    fn kv_transfer_params_come_with_the_final_output() {
        let mut p = processor(&[]);
        let mut o = finished("a", FinishReason::Length);
        o.kv_transfer_params = Some(KvTransferParams { do_remote_prefill: Some(true), ..Default::default() });
        let d = p.process(&o).unwrap();
        assert!(d.kv_transfer_params.unwrap().wants_remote_prefill());
    }

    #[test]
    fn logprobs_are_formatted_both_ways() {
        let codec = &CODEC;
        let mut p = OutputProcessor::new(codec, vec![], false, vec![EOS], Some(1));
        let mut o = out("ab");
        o.new_logprobs = Some(vec![
            TokenLogprobs { logprob: -0.5, top: vec![(u32::from(b'a'), -0.5), (u32::from(b'z'), -1.0)] },
            TokenLogprobs { logprob: f32::NEG_INFINITY, top: vec![(u32::from(b'q'), -0.1)] },
        ]);
        let d = p.process(&o).unwrap();
        assert_eq!(d.logprobs.len(), 2);
        assert_eq!(d.logprobs[1].text_offset, 1);
        assert_eq!(d.logprobs[0].top.len(), 1, "truncated to the requested count");

        let c = serde_json::to_value(completion_logprobs(&d.logprobs)).unwrap();
        assert_eq!(c["tokens"], serde_json::json!(["a", "b"]));
        assert_eq!(c["token_logprobs"], serde_json::json!([-0.5, -9999.0]));
        assert_eq!(c["text_offset"], serde_json::json!([0, 1]));
        assert_eq!(c["top_logprobs"][0], serde_json::json!({"a": -0.5}));
        assert_eq!(c["top_logprobs"][1], serde_json::json!({"q": -0.1f32, "b": -9999.0}));

        let ch = serde_json::to_value(chat_logprobs(&d.logprobs)).unwrap();
        assert_eq!(ch["content"][0]["token"], "a");
        assert_eq!(ch["content"][0]["bytes"], serde_json::json!([97]));
        assert_eq!(ch["content"][0]["top_logprobs"][0]["token"], "a");
        assert_eq!(ch["content"][1]["logprob"], -9999.0);

        // no logprobs from the engine: nulls, not a failure
        let mut p = OutputProcessor::new(codec, vec![], false, vec![EOS], Some(0));
        let d = p.process(&out("a")).unwrap();
        let c = serde_json::to_value(completion_logprobs(&d.logprobs)).unwrap();
        assert_eq!(c["token_logprobs"], serde_json::json!([null]));
    }
}
