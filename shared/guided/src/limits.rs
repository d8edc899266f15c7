//! What one structured-output spec may cost, checked before llguidance sees it (D90).
//!
//! llguidance compiles a JSON schema by recursion: every `$ref` it resolves is compiled
//! inside the one that named it, so a chain of 300 refs needs a stack far deeper than an
//! async worker's 2 MiB and the process dies on a stack overflow (which no `catch_unwind`
//! can catch). Its own limits (`ParserLimits`) bound grammar size and lexer work, not
//! recursion or wall time, and a 100k-alternative `choice` took 29 s to refuse. So every
//! spec is measured here first with iterative walks (no recursion of our own): its bytes,
//! its number of choices, the length of its longest `$ref` chain. A spec over a limit is
//! refused with a message naming the limit; one within them is compiled on the big-stack
//! pool ([`crate::pool`]) under a time budget.

use std::collections::{HashMap, HashSet};
use std::sync::RwLock;
use std::time::Duration;

use pdmesh_protocol::GuidedSpec;
use serde_json::Value;

use crate::GuidedError;

/// The bounds on one spec. Defaults are generous for real schemas (the largest public tool
/// schemas are tens of KiB with ref chains under 20) and far below what breaks the compiler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuidedLimits {
    /// Bytes of a schema, regex or grammar; for `choice`, of all choices together.
    pub max_spec_bytes: usize,
    /// Alternatives in a `choice`.
    pub max_choices: usize,
    /// Longest chain of `$ref`s a JSON schema may make the compiler follow.
    pub max_ref_depth: usize,
    /// Wall time one compilation may take before the request is refused.
    pub compile_timeout: Duration,
    /// llguidance's bound on the grammar's size (symbols in productions).
    pub max_grammar_size: usize,
    /// llguidance's bound on lexer states (each costs 1–2 KiB of memory).
    pub max_lexer_states: usize,
}

impl Default for GuidedLimits {
    fn default() -> Self {
        Self {
            max_spec_bytes: 256 * 1024,
            max_choices: 1024,
            max_ref_depth: 64,
            compile_timeout: Duration::from_secs(10),
            max_grammar_size: 250_000,
            max_lexer_states: 50_000,
        }
    }
}

static LIMITS: RwLock<Option<GuidedLimits>> = RwLock::new(None);

/// Set the process's limits (a service does it once at start from its configuration).
pub fn set_limits(limits: GuidedLimits) {
    if let Ok(mut l) = LIMITS.write() {
        *l = Some(limits);
    }
}

/// The process's limits: those set by [`set_limits`], else the defaults.
pub fn limits() -> GuidedLimits {
    LIMITS.read().ok().and_then(|l| l.clone()).unwrap_or_default()
}

fn over(what: &str, got: usize, limit: usize, key: &str) -> GuidedError {
    GuidedError::Limit(format!("{what} is {got}, over the limit of {limit} (`limits.{key}`)"))
}

/// Refuse a spec over `limits` before any compilation (cheap: linear in its size).
pub fn check(spec: &GuidedSpec, limits: &GuidedLimits) -> Result<(), GuidedError> {
    let bytes = match spec {
        GuidedSpec::JsonSchema(t) | GuidedSpec::Regex(t) | GuidedSpec::Lark(t) => t.len(),
        GuidedSpec::JsonObject => 0,
        GuidedSpec::Choice(c) => {
            if c.len() > limits.max_choices {
                return Err(over("the number of choices", c.len(), limits.max_choices, "guided_max_choices"));
            }
            c.iter().map(String::len).sum()
        }
    };
    if bytes > limits.max_spec_bytes {
        return Err(over("the spec's size in bytes", bytes, limits.max_spec_bytes, "guided_max_spec_bytes"));
    }
    if let GuidedSpec::JsonSchema(text) = spec {
        // Malformed JSON is left to the compile step's message.
        if let Ok(schema) = serde_json::from_str::<Value>(text) {
            let depth = ref_depth(&schema, limits.max_ref_depth);
            if depth > limits.max_ref_depth {
                return Err(GuidedError::Limit(format!(
                    "the schema's `$ref` chain is deeper than the limit of {} (`limits.guided_max_ref_depth`)",
                    limits.max_ref_depth
                )));
            }
        }
    }
    Ok(())
}

/// Every `$ref` string in `v`'s subtree (iteratively: the tree may be as deep as
/// serde_json's recursion limit allows, and this runs on any thread).
fn refs_in(v: &Value) -> Vec<&str> {
    let mut out = Vec::new();
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(map) => {
                for (k, child) in map {
                    match (k.as_str(), child) {
                        ("$ref", Value::String(r)) => out.push(r.as_str()),
                        _ => stack.push(child),
                    }
                }
            }
            Value::Array(items) => stack.extend(items.iter()),
            _ => {}
        }
    }
    out
}

/// The subschema a local reference (`#`, `#/$defs/a`) points at; `None` for anything else
/// (the compiler resolves no remote references and fails on them itself).
fn resolve<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    if pointer.is_empty() {
        return Some(root);
    }
    // JSON pointers in a URI fragment may be percent-encoded; the common `%24defs` spelling
    // is the only one real schemas use.
    root.pointer(&pointer.replace("%24", "$"))
}

/// The longest chain of `$ref`s the compiler follows from the root, counting up to `cap + 1`
/// (beyond it the answer is only "too deep"). A ref back into a chain already being followed
/// is a recursive schema, which the compiler handles without going deeper, so it ends the
/// chain. Depth-first with an explicit stack and memoised per reference, so the work is
/// linear in the number of distinct references however they fan out.
pub fn ref_depth(root: &Value, cap: usize) -> usize {
    // refs reachable directly (not through another ref) from each reference's target
    let mut edges: HashMap<&str, Vec<&str>> = HashMap::new();
    let top = refs_in(root);
    let mut todo: Vec<&str> = top.clone();
    while let Some(r) = todo.pop() {
        if edges.contains_key(r) {
            continue;
        }
        let next = resolve(root, r).map(refs_in).unwrap_or_default();
        todo.extend(next.iter().copied());
        edges.insert(r, next);
    }
    // depth(r) = 1 + max depth over its edges; 0 for a ref on the current path (a cycle)
    let mut done: HashMap<&str, usize> = HashMap::new();
    let mut on_path: HashSet<&str> = HashSet::new();
    let mut best = 0;
    for start in top {
        // (reference, index of the next edge to visit, deepest edge so far)
        let mut stack: Vec<(&str, usize, usize)> = vec![(start, 0, 0)];
        on_path.insert(start);
        while let Some(&(r, next, deepest)) = stack.last() {
            if stack.len() > cap + 1 {
                return cap + 1;
            }
            if done.contains_key(r) {
                stack.pop();
                on_path.remove(r);
                continue;
            }
            let children = edges.get(r).map(Vec::as_slice).unwrap_or(&[]);
            match children.get(next) {
                Some(&child) => {
                    let child_depth = done.get(child).copied();
                    if let Some(frame) = stack.last_mut() {
                        frame.1 += 1;
                        if let Some(d) = child_depth {
                            frame.2 = deepest.max(d);
                        }
                    }
                    if child_depth.is_none() && !on_path.contains(child) {
                        on_path.insert(child);
                        stack.push((child, 0, 0));
                    }
                }
                None => {
                    let d = deepest + 1;
                    done.insert(r, d);
                    on_path.remove(r);
                    stack.pop();
                    if let Some(parent) = stack.last_mut() {
                        parent.2 = parent.2.max(d);
                    }
                    best = best.max(d);
                }
            }
        }
    }
    best
}
