//! Structured outputs: grammar-constrained sampling with llguidance (D53).
//!
//! The only crate that links llguidance, so its build cost and API stay in one place. Two uses:
//!
//! - [`validate`]: the frontend compiles a request's [`GuidedSpec`] before any engine work, so
//!   a schema, regex or grammar that cannot be compiled is a 400 naming the problem. It compiles
//!   against a one-byte-per-token vocabulary: whether a grammar compiles does not depend on the
//!   model's tokenizer, and the frontend then needs no vocabulary.
//! - [`Guide`]: the worker's executor masks each sampled row of logits for the requests that
//!   carry a grammar. A matcher per request is kept as a *cache*: every sampling chunk carries
//!   the tokens generated so far (`ScheduledChunk::guided_output`), and a matcher that has not
//!   consumed exactly those (worker restart, recompute after preemption, another rank) is
//!   rebuilt from the spec and fed them, so the step stays self-contained.
//!
//! When the grammar is complete, only EOS is allowed, so the request ends with
//! `finish_reason: "stop"` and the text parses.
//!
//! Both uses compile under the same bounds (D90, [`limits`]): a spec is measured first, then
//! compiled on a big-stack thread of [`pool`] under a time budget, so no spec can overflow a
//! stack or hold a thread that serves anything else. The frontend's verdicts are cached by
//! content ([`cache`]), so a spec sent again costs a hash.

pub mod cache;
pub mod limits;
pub mod pool;

pub use limits::{limits, set_limits, GuidedLimits};

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use llguidance::api::{GrammarInit, ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::Logger;
use llguidance::{Matcher, ParserFactory};
use pdmesh_protocol::{GuidedSpec, ScheduledChunk};
use serde_json::{json, Value};
use thiserror::Error;

/// At most this many matchers are cached per executor; beyond it the least recently used go
/// (a request whose matcher was dropped rebuilds it from its tokens at its next step).
const MAX_CACHED: usize = 4096;

/// Why a spec could not be turned into a matcher.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GuidedError {
    /// The spec is malformed (bad JSON schema, regex or grammar): the message names the problem.
    #[error("{0}")]
    Invalid(String),
    /// The spec is over one of the [`GuidedLimits`]: the message names the limit.
    #[error("{0}")]
    Limit(String),
    /// Every compile thread is busy and the queue is full: try again.
    #[error("the grammar compiler is busy")]
    Busy,
    /// The compiler failed inside (a panic): the detail ([`GuidedError::detail`]) is for the
    /// log, never for the client (it may carry a backtrace with build paths).
    #[error("the grammar compiler failed on this spec")]
    Compiler(String),
    /// The vocabulary could not be turned into a token trie.
    #[error("structured outputs unavailable: {0}")]
    Unavailable(String),
}

impl GuidedError {
    /// Everything known about the failure, for the log.
    pub fn detail(&self) -> String {
        match self {
            GuidedError::Compiler(d) => d.clone(),
            other => other.to_string(),
        }
    }

    /// An llguidance error message as an error: a caught panic (which carries a backtrace)
    /// becomes [`GuidedError::Compiler`]; anything else keeps its first lines, so a client
    /// sees what is wrong with its spec and never a page of compiler state.
    fn from_compiler(message: String) -> Self {
        if message.starts_with("panic:") || message.contains("<backtrace>") {
            return GuidedError::Compiler(message);
        }
        const MAX_CHARS: usize = 500;
        let short: String = message.lines().take(3).collect::<Vec<_>>().join(" ").chars().take(MAX_CHARS).collect();
        GuidedError::Invalid(short)
    }
}

/// llguidance's own bounds, from ours: no grammar text in error messages.
fn parser_limits(limits: &GuidedLimits) -> ParserLimits {
    ParserLimits {
        max_grammar_size: limits.max_grammar_size,
        max_lexer_states: limits.max_lexer_states,
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// Compile `grammar` with `factory` under `limits` (on the calling thread: callers are the
/// pool's jobs).
fn compile(factory: &ParserFactory, grammar: TopLevelGrammar, limits: &GuidedLimits) -> Result<Matcher, GuidedError> {
    let parser = factory.create_parser_from_init_ext(
        GrammarInit::Serialized(grammar),
        Logger::new(0, 0),
        llguidance::toktrie::InferenceCapabilities::default(),
        parser_limits(limits),
    );
    let matcher = Matcher::new(parser);
    match matcher.get_error() {
        Some(e) => Err(GuidedError::from_compiler(e)),
        None => Ok(matcher),
    }
}

/// [`compile`] on a compile thread, under the limits' time budget, after [`limits::check`].
fn compile_bounded(factory: Arc<ParserFactory>, spec: &GuidedSpec) -> Result<Matcher, GuidedError> {
    compile_within(factory, spec, limits(), Ok)
}

/// [`compile_bounded`], then the first mask, as [`validate`] needs it: a spec can compile and
/// still admit no output at all (a `$ref` that points at itself and nothing else, a grammar
/// rule with no finite derivation), which llguidance reports only when the first token is
/// masked. Found at the frontend, that is a 400; found by the executor, it would end a request
/// the client was told was accepted.
fn check_bounded(factory: Arc<ParserFactory>, spec: &GuidedSpec) -> Result<(), GuidedError> {
    compile_within(factory, spec, limits(), |mut matcher| match matcher.compute_mask() {
        Ok(_) => Ok(()),
        Err(e) => {
            let why = e.to_string();
            let first = why.lines().next().unwrap_or_default().chars().take(200).collect::<String>();
            Err(GuidedError::Invalid(format!("the spec admits no output: no first token is possible ({first})")))
        }
    })
}

/// Compile `spec` on a compile thread under `limits` (after [`limits::check`]) and hand the
/// matcher to `then` there, so that whatever `then` does is under the same time budget.
fn compile_within<T: Send + 'static>(
    factory: Arc<ParserFactory>,
    spec: &GuidedSpec,
    limits: GuidedLimits,
    then: impl FnOnce(Matcher) -> Result<T, GuidedError> + Send + 'static,
) -> Result<T, GuidedError> {
    limits::check(spec, &limits)?;
    let spec = spec.clone();
    let budget = limits.compile_timeout;
    pool::run(budget, move || {
        let matcher = match compile(&factory, grammar(&spec)?, &limits) {
            // as vLLM does: a JSON schema that fails strictly is tried once more leniently
            // (unknown `format` values and keywords llguidance does not implement are ignored,
            // as JSON Schema allows); if that fails too, its error is the answer
            Err(GuidedError::Invalid(_)) if matches!(spec, GuidedSpec::JsonSchema(_)) => {
                compile(&factory, grammar_with(&spec, true)?, &limits)?
            }
            other => other?,
        };
        then(matcher)
    })?
}

/// JSON compile options a schema's own `x-guidance` does not set: no free whitespace (a small
/// model given the choice fills the output with newlines) but readable separators, and `oneOf`
/// read as `anyOf` (as vLLM sets llguidance: `oneOf` is how OpenAI-style schemas spell unions,
/// and llguidance cannot enforce "exactly one"). `lenient` is the second attempt's.
fn default_json_options(lenient: bool) -> serde_json::Map<String, Value> {
    let mut options = serde_json::Map::new();
    options.insert("whitespace_flexible".into(), json!(false));
    options.insert("item_separator".into(), json!(", "));
    options.insert("key_separator".into(), json!(": "));
    options.insert("coerce_one_of".into(), json!(true));
    if lenient {
        options.insert("lenient".into(), json!(true));
    }
    options
}

/// The llguidance grammar of a spec (JSON schemas strict: see [`compile_within`]).
pub fn grammar(spec: &GuidedSpec) -> Result<TopLevelGrammar, GuidedError> {
    grammar_with(spec, false)
}

fn grammar_with(spec: &GuidedSpec, lenient: bool) -> Result<TopLevelGrammar, GuidedError> {
    let json_schema = |mut schema: Value| {
        if let Value::Object(map) = &mut schema {
            let options = map.entry("x-guidance").or_insert_with(|| json!({}));
            if let Value::Object(options) = options {
                for (key, value) in default_json_options(lenient) {
                    options.entry(key).or_insert(value);
                }
            }
        }
        TopLevelGrammar::from_json_schema(schema)
    };
    Ok(match spec {
        GuidedSpec::JsonSchema(text) => {
            let schema: Value = serde_json::from_str(text)
                .map_err(|e| GuidedError::Invalid(format!("the JSON schema is not valid JSON: {e}")))?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(GuidedError::Invalid("a JSON schema must be an object or a boolean".into()));
            }
            json_schema(schema)
        }
        GuidedSpec::JsonObject => json_schema(json!({"type": "object"})),
        GuidedSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        GuidedSpec::Choice(choices) => {
            if choices.is_empty() {
                return Err(GuidedError::Invalid("`choice` must name at least one string".into()));
            }
            // Lark string literals take JSON's escapes.
            let alts: Vec<String> = choices.iter().map(|c| Value::String(c.clone()).to_string()).collect();
            TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
        }
        GuidedSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
    })
}

fn quiet_factory(env: &TokEnv) -> Result<ParserFactory, GuidedError> {
    let mut factory = ParserFactory::new_simple(env).map_err(|e| GuidedError::Unavailable(e.to_string()))?;
    factory.set_stderr_log_level(0);
    factory.set_buffer_log_level(0);
    Ok(factory)
}

/// A parser factory over one token per byte, shared by every [`validate`] call.
fn validation_factory() -> Result<Arc<ParserFactory>, GuidedError> {
    static FACTORY: OnceLock<Result<Arc<ParserFactory>, GuidedError>> = OnceLock::new();
    FACTORY.get_or_init(|| quiet_factory(&ApproximateTokEnv::single_byte_env()).map(Arc::new)).clone()
}

/// Check that `spec` compiles within the [`GuidedLimits`] (the frontend's 400 before any
/// engine work). Safe to call from any thread: the compilation runs on [`pool`], and the
/// caller only waits, at most the time budget. Verdicts are cached by content, failures
/// included, so a spec sent again (an attacker's too) costs a hash.
pub fn validate(spec: &GuidedSpec) -> Result<(), GuidedError> {
    if let Some(verdict) = cache::get(spec) {
        return verdict;
    }
    let verdict = validation_factory().and_then(|factory| check_bounded(factory, spec));
    // a busy pool says nothing about the spec
    if !matches!(verdict, Err(GuidedError::Busy | GuidedError::Unavailable(_))) {
        cache::put(spec, verdict.clone());
    }
    verdict
}

/// The bytes of each token of a byte-level BPE vocabulary (GPT-2 style, as GGUF's
/// `tokenizer.ggml.tokens` stores them: each byte as one printable character). Special tokens
/// (`special[i]`) get llguidance's marker byte so a grammar never produces them as text.
pub fn byte_level_token_bytes(tokens: &[String], special: &[bool]) -> Vec<Vec<u8>> {
    // GPT-2's byte <-> unicode table: printable bytes map to themselves, the rest to 256+i.
    let mut char_to_byte: HashMap<char, u8> = HashMap::new();
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{0}');
            next += 1;
            c
        };
        char_to_byte.insert(c, b);
    }
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if special.get(i).copied().unwrap_or(false) {
                let mut v = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                v.extend_from_slice(t.as_bytes());
                v
            } else {
                // a character outside the table (not byte-level): its UTF-8 bytes
                let mut v = Vec::with_capacity(t.len());
                for c in t.chars() {
                    match char_to_byte.get(&c) {
                        Some(&b) => v.push(b),
                        None => v.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes()),
                    }
                }
                v
            }
        })
        .collect()
}

/// What one [`Guide::mask`] call decided for a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mask {
    /// The allowed tokens (one bool per vocabulary id).
    Allowed(Vec<bool>),
    /// The matcher failed (a bug, or tokens the grammar could not have produced): the request
    /// is ended with EOS rather than let free text through.
    Fail(String),
}

struct Entry {
    matcher: Matcher,
    consumed: Vec<u32>,
    last_used: u64,
}

/// The grammar matchers of one executor, over its model's vocabulary.
pub struct Guide {
    words: Vec<Vec<u8>>,
    eos: u32,
    vocab_size: usize,
    factory: Option<Result<Arc<ParserFactory>, GuidedError>>,
    matchers: HashMap<String, Entry>,
    tick: u64,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").field("vocab_size", &self.vocab_size).field("cached", &self.matchers.len()).finish()
    }
}

impl Guide {
    /// A guide over `words` (the bytes of each token id, see [`byte_level_token_bytes`]),
    /// padded to `vocab_size`; `eos` is the id a finished grammar allows. Nothing is compiled
    /// until the first request with a grammar (a token trie of a large vocabulary costs tens of
    /// milliseconds).
    pub fn new(mut words: Vec<Vec<u8>>, vocab_size: usize, eos: u32) -> Self {
        if words.len() < vocab_size {
            words.resize(vocab_size, Vec::new());
        }
        Self { words, eos, vocab_size, factory: None, matchers: HashMap::new(), tick: 0 }
    }

    /// A guide over one token per byte (ids 0..=255) with EOS = 256: the synthetic model.
    pub fn single_byte(eos: u32) -> Self {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(vec![TokTrie::SPECIAL_TOKEN_MARKER, b'e', b'o', b's']);
        let n = words.len().max(eos as usize + 1);
        Self::new(words, n, eos)
    }

    fn factory(&mut self) -> Result<Arc<ParserFactory>, GuidedError> {
        if self.factory.is_none() {
            let info = TokRxInfo::new(self.words.len() as u32, self.eos);
            let trie = TokTrie::from(&info, &self.words);
            let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
            self.factory = Some(quiet_factory(&env).map(Arc::new));
        }
        match &self.factory {
            Some(f) => f.clone(),
            None => Err(GuidedError::Unavailable("no parser factory".into())),
        }
    }

    /// Number of cached matchers.
    pub fn cached(&self) -> usize {
        self.matchers.len()
    }

    /// The allowed tokens for the next sample of `chunk`, or `None` when it has no grammar.
    pub fn mask(&mut self, chunk: &ScheduledChunk) -> Option<Mask> {
        let spec = chunk.sampling.guided.as_ref()?;
        self.tick += 1;
        let tick = self.tick;
        let reuse = self.matchers.get(&chunk.request_id).is_some_and(|e| chunk.guided_output.starts_with(&e.consumed));
        if !reuse {
            let matcher = match self.fresh_matcher(spec) {
                Ok(m) => m,
                Err(e) => return Some(Mask::Fail(e.to_string())),
            };
            self.evict_if_full();
            self.matchers.insert(chunk.request_id.clone(), Entry { matcher, consumed: Vec::new(), last_used: tick });
        }
        let entry = self.matchers.get_mut(&chunk.request_id)?;
        entry.last_used = tick;
        let todo = chunk.guided_output.get(entry.consumed.len()..).unwrap_or(&[]);
        if !todo.is_empty() {
            if let Err(e) = entry.matcher.consume_tokens(todo) {
                let why = format!("grammar rejected generated tokens: {e}");
                self.matchers.remove(&chunk.request_id);
                return Some(Mask::Fail(why));
            }
            entry.consumed.extend_from_slice(todo);
        }
        match entry.matcher.compute_mask_or_eos() {
            Ok(vob) => Some(Mask::Allowed(self.to_bools(&vob))),
            Err(e) => Some(Mask::Fail(format!("grammar mask failed: {e}"))),
        }
    }

    /// Record that `token` was sampled for `request_id` (so the next step reuses the matcher).
    pub fn commit(&mut self, request_id: &str, token: u32) {
        let Some(entry) = self.matchers.get_mut(request_id) else { return };
        if entry.matcher.is_stopped() {
            // EOS after the end of the grammar: nothing more to match
            entry.consumed.push(token);
            return;
        }
        if entry.matcher.consume_token(token).is_ok() {
            entry.consumed.push(token);
        } else {
            self.matchers.remove(request_id);
        }
    }

    /// Drop the matchers of requests that ended.
    pub fn release(&mut self, request_ids: &[String]) {
        for id in request_ids {
            self.matchers.remove(id);
        }
    }

    /// A matcher for `spec`, compiled under the same bounds as [`validate`] (on a compile
    /// thread: the executor's own stack is never at stake, whatever the spec).
    fn fresh_matcher(&mut self, spec: &GuidedSpec) -> Result<Matcher, GuidedError> {
        let factory = self.factory()?;
        compile_bounded(factory, spec)
    }

    fn evict_if_full(&mut self) {
        if self.matchers.len() < MAX_CACHED {
            return;
        }
        if let Some(oldest) = self.matchers.iter().min_by_key(|(_, e)| e.last_used).map(|(k, _)| k.clone()) {
            self.matchers.remove(&oldest);
        }
    }

    fn to_bools(&self, vob: &SimpleVob) -> Vec<bool> {
        let mut allowed = vec![false; self.vocab_size];
        vob.iter_set_entries(|i| {
            if let Some(a) = allowed.get_mut(i) {
                *a = true;
            }
        });
        allowed
    }
}

/// Set every logit the mask does not allow to `-inf`. A row longer than the mask (a model
/// whose output layer is padded past the vocabulary) has its extra ids disallowed too.
pub fn apply_mask(allowed: &[bool], logits: &mut [f32]) {
    for (i, l) in logits.iter_mut().enumerate() {
        if !allowed.get(i).copied().unwrap_or(false) {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests;
