//! Any text through the topology parser and validator (see `pdmesh_fuzz::topology`).
#![no_main]
pdmesh_fuzz::fuzz_with_harness!(pdmesh_fuzz::topology::Harness, pdmesh_fuzz::topology::seeds);
