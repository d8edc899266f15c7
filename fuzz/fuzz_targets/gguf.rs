//! Any bytes as a GGUF model file (see `pdmesh_fuzz::gguf`).
#![no_main]
pdmesh_fuzz::fuzz_with_harness!(pdmesh_fuzz::gguf::Harness, pdmesh_fuzz::gguf::seeds);
