//! A block server's answer through D's tcp reader (see `pdmesh_fuzz::tcp`).
#![no_main]
pdmesh_fuzz::fuzz_with_harness!(pdmesh_fuzz::tcp::ClientHarness, pdmesh_fuzz::tcp::client_seeds);
