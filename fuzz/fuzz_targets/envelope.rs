//! Any frame through the envelope decoder (see `pdmesh_fuzz::envelope`).
#![no_main]
libfuzzer_sys::fuzz_target!(
    init: pdmesh_fuzz::write_seeds_if_asked(pdmesh_fuzz::envelope::seeds),
    |data: &[u8]| pdmesh_fuzz::envelope::check(data)
);
