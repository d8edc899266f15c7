//! A reader's byte stream through P's tcp block server (see `pdmesh_fuzz::tcp`).
#![no_main]
use std::sync::Mutex;

static HARNESS: Mutex<Option<pdmesh_fuzz::tcp::ServerHarness>> = Mutex::new(None);

libfuzzer_sys::fuzz_target!(
    init: pdmesh_fuzz::write_seeds_if_asked(pdmesh_fuzz::tcp::server_seeds),
    |data: &[u8]| {
        let mut harness = HARNESS.lock().unwrap_or_else(|p| p.into_inner());
        harness.get_or_insert_with(Default::default).check(data)
    }
);
