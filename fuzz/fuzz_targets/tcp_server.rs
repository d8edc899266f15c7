//! A reader's byte stream through P's tcp block server (see `pdmesh_fuzz::tcp`).
#![no_main]
pdmesh_fuzz::fuzz_with_harness!(pdmesh_fuzz::tcp::ServerHarness, pdmesh_fuzz::tcp::server_seeds);
