//! The fuzz targets' harnesses (`fuzz_targets/*.rs` are one line each): what every input goes
//! through, what must hold for it, and each target's seed corpus, built from real frames.
//!
//! A target fails on a panic (an assertion below, or one in the code under test), on an input
//! that runs longer than libFuzzer's `-timeout`, and on memory beyond its `-rss_limit_mb` /
//! `-malloc_limit_mb`; `scripts/fuzz.sh` sets all three. See docs/SECURITY.md, "Fuzzing".
//!
//! Seeds: started with `PDMESH_FUZZ_SEEDS=<dir>`, a target writes its seeds there and exits
//! (libFuzzer's `LLVMFuzzerInitialize` runs before any input), so the corpus always matches
//! the protocol this build speaks.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod envelope;
pub mod gguf;
pub mod guided;
pub mod http;
pub mod side_channel;
pub mod tcp;
pub mod topology;

/// The protocol's round-trip test, compiled in for its `every_message()`: one real instance
/// of every message (its tests are compiled out here).
#[path = "../../shared/protocol/tests/roundtrip.rs"]
#[allow(dead_code, unused_imports)]
mod protocol_roundtrip;

use std::path::Path;

pub use protocol_roundtrip::every_message;

/// The environment variable that turns a target into its own seed generator.
pub const SEEDS_ENV: &str = "PDMESH_FUZZ_SEEDS";

/// If [`SEEDS_ENV`] names a directory, write `seeds()` into it (one file each) and exit.
/// Called from each target's libFuzzer init.
pub fn write_seeds_if_asked(seeds: impl FnOnce() -> Vec<Vec<u8>>) {
    let Some(dir) = std::env::var_os(SEEDS_ENV) else { return };
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).expect("create the seed directory");
    let seeds = seeds();
    for (i, seed) in seeds.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:03}")), seed).expect("write a seed");
    }
    eprintln!("wrote {} seeds to {}", seeds.len(), dir.display());
    std::process::exit(0);
}

/// The input that makes every target panic (`PDMESH_FUZZ_SELFCHECK=panic`) or hang
/// (`=hang`): `scripts/fuzz.sh` feeds it to check that a campaign fails on both.
pub const SELFCHECK_INPUT: &[u8] = b"pdmesh-fuzz-selfcheck";

/// See [`SELFCHECK_INPUT`]; a no-op on every other input or without the variable.
pub fn selfcheck(data: &[u8]) {
    static MODE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if data != SELFCHECK_INPUT {
        return;
    }
    match MODE.get_or_init(|| std::env::var("PDMESH_FUZZ_SELFCHECK").ok()).as_deref() {
        Some("panic") => panic!("selfcheck: a panicking input"),
        Some("hang") => loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        },
        _ => {}
    }
}

/// A target whose harness is built once per process (a region file, a socket, a model's
/// codec) and whose seeds come from `$seeds`: `fuzz_with_harness!(tcp::ServerHarness,
/// tcp::server_seeds);` is a whole target file.
#[macro_export]
macro_rules! fuzz_with_harness {
    ($harness:ty, $seeds:path) => {
        static HARNESS: std::sync::Mutex<Option<$harness>> = std::sync::Mutex::new(None);

        libfuzzer_sys::fuzz_target!(init: $crate::write_seeds_if_asked($seeds), |data: &[u8]| {
            $crate::selfcheck(data);
            let mut harness = HARNESS.lock().unwrap_or_else(|p| p.into_inner());
            harness.get_or_insert_with(<$harness>::default).check(data)
        });
    };
}

/// Inputs that carry several frames (a side-channel session, a tcp stream's replies): each
/// frame is a little-endian `u16` length and that many bytes; a short last frame takes what is
/// left. Any byte string splits into frames, so every input means something.
pub fn split_frames(input: &[u8]) -> Vec<&[u8]> {
    let mut frames = Vec::new();
    let mut rest = input;
    while rest.len() >= 2 {
        let len = u16::from_le_bytes([rest[0], rest[1]]) as usize;
        let body = &rest[2..];
        let take = len.min(body.len());
        frames.push(&body[..take]);
        rest = &body[take..];
    }
    frames
}

/// The inverse of [`split_frames`] (for seeds; frames longer than `u16::MAX` are cut).
pub fn join_frames(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        let f = &f[..f.len().min(u16::MAX as usize)];
        out.extend_from_slice(&(f.len() as u16).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}
