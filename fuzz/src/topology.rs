//! Target `topology`: any text through `Topology::from_toml`, the parser and validator every
//! service runs on its topology file at start.
//!
//! Must hold: every text is answered (a topology or a configuration error), never a panic; a
//! topology it accepts gives every node's socket endpoints, and writes back to TOML that
//! reads back (`pdmesh serve` hands its children the topology that way).

use pdmesh_config::Topology;

/// The target's harness (it keeps no state).
#[derive(Debug, Default)]
pub struct Harness;

impl Harness {
    pub fn check(&mut self, data: &[u8]) {
        let Ok(text) = std::str::from_utf8(data) else { return };
        let Ok(topo) = Topology::from_toml(text) else { return };
        for node in &topo.nodes {
            let _ = node.endpoints(&topo.run_dir);
        }
        let written = topo.to_toml().expect("an accepted topology writes as TOML");
        if let Err(e) = Topology::from_toml(&written) {
            panic!("an accepted topology does not read back: {e}\n{written}");
        }
    }
}

/// Seeds: the topologies the repository ships.
pub fn seeds() -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/topology");
    let mut seeds: Vec<Vec<u8>> = vec![pdmesh_config::DEFAULT_TOPOLOGY.as_bytes().to_vec()];
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.path().extension().is_some_and(|x| x == "toml") {
                if let Ok(bytes) = std::fs::read(e.path()) {
                    seeds.push(bytes);
                }
            }
        }
    }
    seeds
}
