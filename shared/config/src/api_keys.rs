//! API keys: which bearer tokens a frontend accepts, and what the router presents upstream.
//!
//! Keys never live in the topology file: `pdmesh up` copies that file into `run_dir` and every
//! process reads it. They come from `PDMESH_API_KEY` (a comma list) or `--api-key`, from
//! `PDMESH_API_KEY_FILE` or `--api-key-file` (one per line), and the mesh's internal
//! credential only from `PDMESH_INTERNAL_API_KEY` (docs/SECURITY.md, "API keys").
//!
//! - A node frontend (colocated, prefill, decode) accepts the client keys and the internal key
//!   (an internal key alone closes the node to everyone but the router).
//! - The router accepts the client keys only, and presents the internal key to P and D.
//! - No key anywhere: nothing is required (vLLM's default).

use std::path::Path;

use crate::{env, ConfigError};

/// The resolved keys of one process. `Debug` shows counts, never a key.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ApiKeySettings {
    /// Keys clients may present (`Authorization: Bearer <key>`).
    pub client: Vec<String>,
    /// The mesh's internal credential (router → P and D).
    pub internal: Option<String>,
}

impl std::fmt::Debug for ApiKeySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeySettings")
            .field("client_keys", &self.client.len())
            .field("internal_key", &self.internal.is_some())
            .finish()
    }
}

impl ApiKeySettings {
    /// Resolve the keys from a comma list (`--api-key` / `PDMESH_API_KEY`), a key file
    /// (`--api-key-file` / `PDMESH_API_KEY_FILE`) and the internal key. A key file that cannot
    /// be read or holds no key, and a key with whitespace or control characters, are errors:
    /// a mistyped setting must not leave a server open.
    pub fn resolve(list: Option<&str>, file: Option<&Path>, internal: Option<&str>) -> Result<Self, ConfigError> {
        let mut client = Vec::new();
        if let Some(list) = list {
            client.extend(list.split(',').map(str::trim).filter(|k| !k.is_empty()).map(str::to_string));
        }
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                ConfigError::Invalid(format!("{}: cannot read {}: {e}", env::API_KEY_FILE, path.display()))
            })?;
            let before = client.len();
            client.extend(
                text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_string),
            );
            if client.len() == before {
                return Err(ConfigError::Invalid(format!(
                    "{}: {} holds no key (one key per line)",
                    env::API_KEY_FILE,
                    path.display()
                )));
            }
        }
        let internal = internal.map(str::trim).filter(|k| !k.is_empty()).map(str::to_string);
        for key in client.iter().chain(internal.iter()) {
            check_key(key)?;
        }
        Ok(Self { client, internal })
    }

    /// Resolve from the environment alone: `PDMESH_API_KEY`, `PDMESH_API_KEY_FILE`,
    /// `PDMESH_INTERNAL_API_KEY`.
    pub fn from_env() -> Result<Self, ConfigError> {
        let file = env::get(env::API_KEY_FILE).map(std::path::PathBuf::from);
        Self::resolve(env::get(env::API_KEY).as_deref(), file.as_deref(), env::get(env::INTERNAL_API_KEY).as_deref())
    }

    /// What the router accepts from its clients: the client keys only (the internal key opens
    /// the nodes behind it, not the router itself).
    pub fn router_keys(&self) -> Vec<&str> {
        self.client.iter().map(String::as_str).collect()
    }
}

/// A key is a bearer token: visible ASCII, no spaces (RFC 6750's `b64token` is narrower still).
fn check_key(key: &str) -> Result<(), ConfigError> {
    if key.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(())
    } else {
        // Never echo the key itself.
        Err(ConfigError::Invalid(format!(
            "an API key of {} characters holds a space, a control or a non-ASCII character; keys are visible ASCII",
            key.chars().count()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_comma_list_and_a_file_add_up() {
        let dir = std::env::temp_dir().join(format!("pdmesh-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "# operators\nsk-file-1\n\n  sk-file-2  \n").unwrap();
        let k = ApiKeySettings::resolve(Some(" sk-a, ,sk-b"), Some(&file), Some("internal")).unwrap();
        assert_eq!(k.client, ["sk-a", "sk-b", "sk-file-1", "sk-file-2"]);
        assert_eq!(k.internal.as_deref(), Some("internal"));
        assert_eq!(k.router_keys().len(), 4, "the router does not take the internal key from clients");
        let shown = format!("{k:?}");
        assert!(!shown.contains("sk-a") && !shown.contains("internal\""), "{shown}");

        std::fs::write(&file, "# nothing here\n\n").unwrap();
        let e = ApiKeySettings::resolve(None, Some(&file), None).unwrap_err().to_string();
        assert!(e.contains("holds no key"), "{e}");
        let e = ApiKeySettings::resolve(None, Some(&dir.join("missing")), None).unwrap_err().to_string();
        assert!(e.contains("cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_setting_means_no_key_and_bad_keys_are_refused() {
        let none = ApiKeySettings::resolve(None, None, Some("  ")).unwrap();
        assert!(none.client.is_empty() && none.internal.is_none(), "a blank internal key is no key");
        let e = ApiKeySettings::resolve(Some("sk a"), None, None).unwrap_err().to_string();
        assert!(e.contains("visible ASCII") && !e.contains("sk a"), "{e}");
        assert!(ApiKeySettings::resolve(None, None, Some("tab\there")).is_err());
        assert!(ApiKeySettings::resolve(Some("clé"), None, None).is_err());
    }
}
