//! Any frame through the envelope decoder (see `pdmesh_fuzz::envelope`).
#![no_main]
pdmesh_fuzz::fuzz_with_harness!(pdmesh_fuzz::envelope::Harness, pdmesh_fuzz::envelope::seeds);
