//! Request bodies through the frontend's decode and validation (see `pdmesh_fuzz::http`).
#![no_main]
pdmesh_fuzz::fuzz_with_harness!(pdmesh_fuzz::http::Harness, pdmesh_fuzz::http::seeds);
