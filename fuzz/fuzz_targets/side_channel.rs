//! Sessions of frames through P's side channel (see `pdmesh_fuzz::side_channel`).
#![no_main]
use std::sync::Mutex;

static HARNESS: Mutex<Option<pdmesh_fuzz::side_channel::Harness>> = Mutex::new(None);

libfuzzer_sys::fuzz_target!(
    init: pdmesh_fuzz::write_seeds_if_asked(pdmesh_fuzz::side_channel::seeds),
    |data: &[u8]| {
        let mut harness = HARNESS.lock().unwrap_or_else(|p| p.into_inner());
        harness.get_or_insert_with(Default::default).check(data)
    }
);
