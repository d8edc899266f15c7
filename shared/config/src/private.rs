//! Same-host confidentiality (docs/SECURITY.md, "Same-host access"): what a mesh writes on its
//! host — the run dir with its `ipc` sockets, logs, the topology copy and process table, P's KV
//! region in `/dev/shm` — is readable by the mesh's own user only.
//!
//! Two layers: every pdmesh process starts with the file-creation mask [`PRIVATE_UMASK`], so
//! whatever it or a library creates (a ZeroMQ `ipc` socket, a log) is owner-only; and the
//! places that matter set their mode explicitly and are checked at start ([`private_dir`]),
//! so code used outside the binary keeps the rule too.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

use crate::ConfigError;

/// The file-creation mask of every pdmesh process: no group or other bits, ever.
pub const PRIVATE_UMASK: u32 = 0o077;
/// Mode of a private directory (run dir, logs, a node's socket dir).
pub const DIR_MODE: u32 = 0o700;
/// Mode of a private file (logs, the topology copy, the process table, KV regions).
pub const FILE_MODE: u32 = 0o600;

/// What [`private_dir`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrivateDir {
    /// It did not exist; it was created owner-only.
    Created,
    /// It was ours and owner-only already.
    Private,
    /// It was ours but open to the group or others (this mode): it was made owner-only.
    Tightened(u32),
}

/// The uid this process runs as (the owner of what it creates).
fn own_uid() -> Result<u32, ConfigError> {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .map_err(|e| ConfigError::Invalid(format!("cannot tell this process's user (/proc/self): {e}")))
}

/// Make `dir` (and any missing parent) exist, owned by this user, with mode 0700.
///
/// Decision (D97): a directory of ours that group or others can enter is tightened, not
/// refused — the mesh made it before this rule (0755) and nothing else of ours may rely on
/// the wider mode; the change is reported. A directory owned by another user is refused:
/// that user controls what is in it (a planted socket or symlink) and can read what we write.
pub fn private_dir(dir: &Path) -> Result<PrivateDir, ConfigError> {
    let invalid = |why: String| ConfigError::Invalid(format!("run dir {}: {why}", dir.display()));
    let created = match std::fs::symlink_metadata(dir) {
        Ok(_) => false,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(DIR_MODE)
                .create(dir)
                .map_err(|e| invalid(format!("cannot create it: {e}")))?;
            true
        }
        Err(e) => return Err(invalid(format!("cannot inspect it: {e}"))),
    };
    let meta = std::fs::symlink_metadata(dir).map_err(|e| invalid(format!("cannot inspect it: {e}")))?;
    if !meta.is_dir() {
        return Err(invalid("is not a directory (a symlink or a file)".into()));
    }
    let uid = own_uid()?;
    if meta.uid() != uid {
        return Err(invalid(format!(
            "is owned by uid {}, not by this user (uid {uid}); use a run dir of your own (run_dir or PDMESH_RUN_DIR)",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 == 0 {
        return Ok(if created { PrivateDir::Created } else { PrivateDir::Private });
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(DIR_MODE))
        .map_err(|e| invalid(format!("is open to other users (mode {mode:o}) and cannot be made private: {e}")))?;
    Ok(if created { PrivateDir::Created } else { PrivateDir::Tightened(mode) })
}

/// Make an existing file of ours owner-only (a log or state file left by an older run with a
/// wider mode).
pub fn make_private_file(path: &Path) -> std::io::Result<()> {
    let meta = std::fs::metadata(path)?;
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(FILE_MODE))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_dir_is_created_private_and_an_open_one_of_ours_is_tightened() {
        let base = std::env::temp_dir().join(format!("pdmesh-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let dir = base.join("a/b");
        assert_eq!(private_dir(&dir).unwrap(), PrivateDir::Created);
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert_eq!(private_dir(&dir).unwrap(), PrivateDir::Private);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(private_dir(&dir).unwrap(), PrivateDir::Tightened(0o755));
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        let file = dir.join("x.log");
        std::fs::write(&file, "x").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        make_private_file(&file).unwrap();
        assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o777, 0o600);
        std::os::unix::fs::symlink(&dir, base.join("link")).unwrap();
        assert!(private_dir(&base.join("link")).is_err(), "a symlink is not a run dir");
        let _ = std::fs::remove_dir_all(&base);
    }

    /// A directory owned by another user is refused: one chowned to `nobody` when the test
    /// runs as root, else root's `/`.
    #[test]
    fn a_run_dir_of_another_user_is_refused() {
        let dir = std::env::temp_dir().join(format!("pdmesh-private-other-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (target, owner) = if std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).is_ok() {
            (dir.clone(), 65534)
        } else {
            (std::path::PathBuf::from("/"), 0)
        };
        let err = private_dir(&target).unwrap_err().to_string();
        assert!(err.contains(&format!("owned by uid {owner}")), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
