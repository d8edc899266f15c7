//! The frontend's compile verdicts, by content (D90).
//!
//! A spec is keyed by a keyed hash of its text (SipHash with this process's random keys, so
//! no client can craft a collision that would pass its spec off as one already accepted).
//! Failures are cached too: the same hostile spec sent again is refused for the cost of a
//! hash, not another compilation. Bounded at [`MAX_ENTRIES`]; when full, the least recently
//! used verdict goes.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Mutex, OnceLock};

use pdmesh_protocol::GuidedSpec;

use crate::GuidedError;

/// Verdicts kept.
pub const MAX_ENTRIES: usize = 1024;

type Verdict = Result<(), GuidedError>;

#[derive(Default)]
struct Cache {
    entries: HashMap<u64, (Verdict, u64)>,
    tick: u64,
}

fn cache() -> &'static Mutex<Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

fn key(spec: &GuidedSpec) -> u64 {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    let mut h = KEYS.get_or_init(RandomState::new).build_hasher();
    match spec {
        GuidedSpec::JsonSchema(t) => ("json_schema", t).hash(&mut h),
        GuidedSpec::JsonObject => "json_object".hash(&mut h),
        GuidedSpec::Regex(t) => ("regex", t).hash(&mut h),
        GuidedSpec::Choice(c) => ("choice", c).hash(&mut h),
        GuidedSpec::Lark(t) => ("lark", t).hash(&mut h),
    }
    h.finish()
}

/// The cached verdict on `spec`, if any.
pub fn get(spec: &GuidedSpec) -> Option<Verdict> {
    let k = key(spec);
    let mut c = cache().lock().ok()?;
    c.tick += 1;
    let tick = c.tick;
    let entry = c.entries.get_mut(&k)?;
    entry.1 = tick;
    Some(entry.0.clone())
}

/// Remember the verdict on `spec`.
pub fn put(spec: &GuidedSpec, verdict: Verdict) {
    let k = key(spec);
    let Ok(mut c) = cache().lock() else { return };
    if c.entries.len() >= MAX_ENTRIES && !c.entries.contains_key(&k) {
        if let Some(oldest) = c.entries.iter().min_by_key(|(_, (_, t))| *t).map(|(k, _)| *k) {
            c.entries.remove(&oldest);
        }
    }
    c.tick += 1;
    let tick = c.tick;
    c.entries.insert(k, (verdict, tick));
}

/// Verdicts held now.
pub fn len() -> usize {
    cache().lock().map(|c| c.entries.len()).unwrap_or(0)
}
