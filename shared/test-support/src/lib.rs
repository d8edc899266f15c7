//! Test support shared by pdmesh's integration tests (`services/pdmesh/tests`), the load tests
//! (`pdmesh-load`) and the load-test scenarios (through `pdmesh-load topology`).
//!
//! Why a crate: topologies used to be written as `format!`-ed TOML in a dozen places, and two
//! launchers (the tests' and the load tests') each had their own spawning, ports and readiness
//! checks. Here a topology is a typed [`pdmesh_config::Topology`] built by [`topology`]'s
//! builders and written with `Topology::to_toml`, so it cannot drift from the schema, and
//! [`launcher`] is the one way a mesh is started, waited for and stopped (docs/DECISIONS.md
//! D110).
// Test support: a failed setup is a failed test, as in the tests themselves, so unwrap, expect
// and panic are the way to report it (the launcher's `Mesh::launch` returns errors instead,
// for the load tests).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod launcher;
pub mod topology;

pub use launcher::{fresh_run_dir, pdmesh_bin, ports, reserve_ports, Launch, LaunchError, Mesh, Ready, UpOptions};
pub use topology::{KvExt, NodeExt, TopologyExt};
