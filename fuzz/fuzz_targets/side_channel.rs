//! Sessions of frames through P's side channel (see `pdmesh_fuzz::side_channel`).
#![no_main]
pdmesh_fuzz::fuzz_with_harness!(pdmesh_fuzz::side_channel::Harness, pdmesh_fuzz::side_channel::seeds);
