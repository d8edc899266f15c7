//! Issue 40, defect 6: what a mesh writes on its host is its user's alone. A P/D mesh started
//! by `pdmesh up` (from a test process whose file-creation mask is the usual 022, in a run dir
//! the test made 0755 beforehand) leaves P's KV region in /dev/shm at 0600, the run dir and
//! every directory in it at 0700, and every file and socket in it without group or other
//! access (docs/SECURITY.md, "Same-host access").
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::topo::TransferBackendKind::Shm;
use common::Mesh;

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o777
}

/// Every entry under `dir` (recursively) with its mode.
fn walk(dir: &Path, out: &mut Vec<(std::path::PathBuf, u32, bool)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let path = e.path();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        out.push((path.clone(), meta.permissions().mode() & 0o777, meta.is_dir()));
        if meta.is_dir() {
            walk(&path, out);
        }
    }
}

#[test]
fn kv_region_run_dir_logs_and_sockets_are_owner_only() {
    let mesh =
        Mesh::start_nodes(|h, b| common::pd_topology(h, b, Shm, 1, common::blocks(4, 64)), |h| vec![h + 1, h + 2]);
    // The launcher made the run dir with the test's mask (0755): `pdmesh up` narrowed it.
    assert_eq!(mode(&mesh.run_dir), 0o700, "run dir {}", mesh.run_dir.display());
    let up_log = std::fs::read_to_string(mesh.run_dir.join("up.log")).unwrap_or_default();
    assert!(up_log.contains("made it 0700"), "pdmesh up says it narrowed the run dir:\n{up_log}");

    let worker = mesh.pid_on("p", "connector-worker", 0);
    let region = Path::new("/dev/shm").join(format!("pdmesh-p-0-{worker}"));
    assert!(region.exists(), "P's KV region {}", region.display());
    assert_eq!(mode(&region), 0o600, "P's KV region {}", region.display());

    let mut entries = Vec::new();
    walk(&mesh.run_dir, &mut entries);
    // The launcher's own files (the topology it wrote, up.log) are the test's, not the mesh's.
    let ours = |p: &Path| {
        let name = p.file_name().unwrap().to_string_lossy();
        name != "test-topology.toml" && name != "up.log"
    };
    let mut checked = (0, 0, 0);
    for (path, m, is_dir) in entries.iter().filter(|(p, ..)| ours(p)) {
        assert_eq!(m & 0o077, 0, "{} is open to other users: {m:o}", path.display());
        if *is_dir {
            checked.0 += 1;
        } else if path.extension().is_some_and(|e| e == "log") {
            checked.1 += 1;
        } else if path.extension().is_some_and(|e| e == "sock") {
            checked.2 += 1;
        }
    }
    assert!(checked.0 >= 3 && checked.1 >= 8 && checked.2 >= 4, "dirs, logs and sockets checked: {checked:?}");
    assert!(mesh.stop().success());
}
