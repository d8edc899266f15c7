//! Structured-output specs through the grammar compiler (see `pdmesh_fuzz::guided`).
#![no_main]
pdmesh_fuzz::fuzz_with_harness!(pdmesh_fuzz::guided::Harness, pdmesh_fuzz::guided::seeds);
