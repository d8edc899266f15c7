//! Who may talk to a pdmesh node, and who may touch a request's held KV blocks.
//!
//! Three mechanisms (docs/SECURITY.md, docs/DECISIONS.md D40, D45):
//! - [`MeshSecret`]: one secret per mesh. Every connection to P's KV side channel and to its
//!   `tcp` block server proves knowledge of it with a mutual HMAC-SHA256 challenge-response
//!   ([`server_proof`], [`client_proof`]) before anything else is served. Both sides
//!   contribute a fresh 256-bit nonce, and the proofs name the role and the channel, so a
//!   proof is good for one connection, one direction and one channel only: it can be neither
//!   replayed on another connection nor reflected.
//! - [`frame`]: a node's internal ZeroMQ links over `tcp` carry a MAC on every frame instead
//!   (a PUSH stream has no reply path for a challenge), under a key derived from the secret.
//! - Capability tokens ([`new_capability`], [`capability_matches`]): P puts an unguessable
//!   token into the `kv_transfer_params` it returns; every lease, read and notice for that
//!   request must carry it, so knowing a request id is not enough to touch its blocks.
//!
//! Nonces, secrets and tokens come from the operating system's CSPRNG; every comparison of a
//! secret value is constant-time.

pub mod frame;
pub mod handshake;
pub mod metrics;

pub use frame::{Direction, FrameOpener, FrameRefusal, FrameSealer, LinkBinding, LinkKey};
pub use handshake::{refusal, AuthFailure, ClientHello, ServerChallenge};

use std::fmt;
use std::path::Path;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// The environment variable that carries the mesh secret (to child processes of `pdmesh up`,
/// and in containers). Never a command-line flag: process arguments are world-readable.
pub const MESH_SECRET_ENV: &str = pdmesh_config::env::MESH_SECRET;

/// The least secret length accepted, in bytes of its text (a generated secret is 64 hex
/// digits, 256 bits).
pub const MIN_SECRET_LEN: usize = 32;

/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;

/// Bytes of an HMAC-SHA256 proof.
pub const PROOF_LEN: usize = 32;

/// Bytes of randomness in a capability token (hex-encoded to twice as many characters).
pub const CAPABILITY_BYTES: usize = 16;

/// What can be wrong with a mesh secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error(
        "the mesh secret is {len} bytes long; at least {MIN_SECRET_LEN} are required (e.g. `openssl rand -hex 32`)"
    )]
    TooShort { len: usize },
    #[error("cannot read the mesh secret file {path}: {reason}")]
    File { path: String, reason: String },
}

/// The secret every member of one mesh shares. Its `Debug` never shows it.
#[derive(Clone)]
pub struct MeshSecret {
    text: String,
}

impl fmt::Debug for MeshSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MeshSecret(<redacted>)")
    }
}

impl MeshSecret {
    /// A fresh secret: 256 bits from the OS CSPRNG, as 64 hex digits.
    pub fn generate() -> Self {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        Self { text: hex::encode(bytes) }
    }

    /// A secret given as text (surrounding whitespace, e.g. a file's trailing newline, is
    /// ignored). The text itself is the key, whatever its alphabet.
    pub fn parse(text: &str) -> Result<Self, SecretError> {
        let text = text.trim();
        if text.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort { len: text.len() });
        }
        Ok(Self { text: text.to_string() })
    }

    /// Read a secret file (as written by `openssl rand -hex 32 > file`).
    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| SecretError::File { path: path.display().to_string(), reason: e.to_string() })?;
        Self::parse(&text)
    }

    /// The secret in [`MESH_SECRET_ENV`], if set and not empty.
    pub fn from_env() -> Result<Option<Self>, SecretError> {
        match std::env::var(MESH_SECRET_ENV) {
            Ok(v) if !v.trim().is_empty() => Self::parse(&v).map(Some),
            _ => Ok(None),
        }
    }

    /// This process's mesh secret: [`MESH_SECRET_ENV`] if set, else the topology's
    /// `mesh_secret_file`, else none (`pdmesh up` then generates one; a P/D service, or a service
    /// of a node on `tcp` transport, refuses to start).
    pub fn resolve(file: Option<&Path>) -> Result<Option<Self>, SecretError> {
        if let Some(secret) = Self::from_env()? {
            return Ok(Some(secret));
        }
        file.map(Self::from_file).transpose()
    }

    /// The text to hand to a child process through [`MESH_SECRET_ENV`].
    pub fn expose_text(&self) -> &str {
        &self.text
    }

    fn mac(&self) -> Hmac<Sha256> {
        hmac_with_key(self.text.as_bytes())
    }
}

/// HMAC-SHA256 keyed with `key`. HMAC accepts keys of any length; `new_from_slice` cannot fail.
fn hmac_with_key(key: &[u8]) -> Hmac<Sha256> {
    <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable_mac())
}

#[allow(clippy::panic)] // HMAC takes a key of any length: this is never reached
fn unreachable_mac() -> Hmac<Sha256> {
    panic!("HMAC-SHA256 refused a key")
}

/// Which link a handshake authenticates: part of every proof, so a proof for one channel is
/// worth nothing on another (and the label of `pdmesh_kv_side_channel_unauthenticated_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    /// P's KV side channel (ZeroMQ ROUTER; handshake, leases, notices).
    SideChannel,
    /// P's `tcp` block server.
    TcpData,
    /// A node's internal ZeroMQ links over `transport = "tcp"`.
    Internal,
}

impl Channel {
    pub fn label(self) -> &'static str {
        match self {
            Channel::SideChannel => "side_channel",
            Channel::TcpData => "tcp_data",
            Channel::Internal => "internal",
        }
    }

    pub fn from_label(label: &str) -> Option<Self> {
        [Channel::SideChannel, Channel::TcpData, Channel::Internal].into_iter().find(|c| c.label() == label)
    }
}

/// A fresh handshake nonce from the OS CSPRNG.
pub fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// Domain separation: protocol version, role, channel, then both nonces (fixed lengths, so the
/// concatenation is unambiguous).
fn proof(secret: &MeshSecret, role: &str, channel: Channel, client_nonce: &[u8], server_nonce: &[u8]) -> Vec<u8> {
    let mut mac = secret.mac();
    for part in [b"pdmesh-mesh-auth/1".as_slice(), role.as_bytes(), channel.label().as_bytes()] {
        mac.update(&(part.len() as u32).to_be_bytes());
        mac.update(part);
    }
    mac.update(&(client_nonce.len() as u32).to_be_bytes());
    mac.update(client_nonce);
    mac.update(&(server_nonce.len() as u32).to_be_bytes());
    mac.update(server_nonce);
    mac.finalize().into_bytes().to_vec()
}

/// The server's proof for this connection: shows the client it talks to a member of the mesh
/// (the client's fresh nonce makes it unreplayable).
pub fn server_proof(secret: &MeshSecret, channel: Channel, client_nonce: &[u8], server_nonce: &[u8]) -> Vec<u8> {
    proof(secret, "server", channel, client_nonce, server_nonce)
}

/// The client's proof for this connection (the server's fresh nonce makes it unreplayable;
/// the role label makes a server proof useless as a client proof).
pub fn client_proof(secret: &MeshSecret, channel: Channel, client_nonce: &[u8], server_nonce: &[u8]) -> Vec<u8> {
    proof(secret, "client", channel, client_nonce, server_nonce)
}

/// Constant-time equality of two proofs (or any two secret byte strings); different lengths
/// are unequal.
pub fn proofs_match(expected: &[u8], presented: &[u8]) -> bool {
    expected.len() == presented.len() && bool::from(expected.ct_eq(presented))
}

/// Whether both nonces have the right length (a short nonce would weaken freshness).
pub fn nonce_ok(n: &[u8]) -> bool {
    n.len() == NONCE_LEN
}

/// A fresh per-request capability token: 128 bits from the OS CSPRNG, as 32 hex digits.
pub fn new_capability() -> String {
    let mut bytes = [0u8; CAPABILITY_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    hex::encode(bytes)
}

/// Whether `token` has the shape of a capability [`new_capability`] makes (32 lowercase hex
/// digits): P adopts such a token when the one asking for the prefill (the router, for its
/// prefill leg) chose it, so that it can hand the blocks back before P has answered.
pub fn is_capability(token: &str) -> bool {
    token.len() == 2 * CAPABILITY_BYTES && token.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Constant-time check of a presented capability against the one P handed out. An empty
/// expected token never matches (a hold without a token is touchable by nobody).
pub fn capability_matches(expected: &str, presented: &str) -> bool {
    !expected.is_empty() && proofs_match(expected.as_bytes(), presented.as_bytes())
}

/// Rate limit for "refused an unauthenticated peer" log lines: at most one per `period`, with
/// the count of the ones suppressed since.
#[derive(Debug)]
pub struct LogLimiter {
    period: std::time::Duration,
    last: std::sync::Mutex<(Option<std::time::Instant>, u64)>,
}

impl LogLimiter {
    pub const fn new(period: std::time::Duration) -> Self {
        Self { period, last: std::sync::Mutex::new((None, 0)) }
    }

    /// `Some(suppressed)` when a line may be logged now (with how many were suppressed since
    /// the last one), `None` when it is to be suppressed.
    pub fn allow(&self) -> Option<u64> {
        let now = std::time::Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match last.0 {
            Some(at) if now.duration_since(at) < self.period => {
                last.1 += 1;
                None
            }
            _ => {
                let suppressed = last.1;
                *last = (Some(now), 0);
                Some(suppressed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> MeshSecret {
        MeshSecret::parse(s).unwrap()
    }

    #[test]
    fn proofs_bind_secret_role_channel_and_both_nonces() {
        let k = secret(&"k".repeat(40));
        let (c, s) = (nonce(), nonce());
        let sp = server_proof(&k, Channel::SideChannel, &c, &s);
        assert_eq!(sp.len(), PROOF_LEN);
        assert!(proofs_match(&sp, &server_proof(&k, Channel::SideChannel, &c, &s)));
        assert!(!proofs_match(&sp, &client_proof(&k, Channel::SideChannel, &c, &s)), "role is bound");
        assert!(!proofs_match(&sp, &server_proof(&k, Channel::TcpData, &c, &s)), "channel is bound");
        assert!(!proofs_match(&sp, &server_proof(&k, Channel::SideChannel, &nonce(), &s)), "client nonce is bound");
        assert!(!proofs_match(&sp, &server_proof(&k, Channel::SideChannel, &c, &nonce())), "server nonce is bound");
        let other = secret(&"x".repeat(40));
        assert!(!proofs_match(&sp, &server_proof(&other, Channel::SideChannel, &c, &s)), "secret is bound");
        assert!(!proofs_match(&sp, &sp[..31]));
    }

    #[test]
    fn secrets_are_long_random_and_never_printed() {
        assert!(matches!(MeshSecret::parse("short"), Err(SecretError::TooShort { len: 5 })));
        let a = MeshSecret::generate();
        let b = MeshSecret::generate();
        assert_eq!(a.expose_text().len(), 64);
        assert_ne!(a.expose_text(), b.expose_text());
        assert!(!format!("{a:?}").contains(a.expose_text()));
        assert_eq!(MeshSecret::parse(&format!("  {}\n", a.expose_text())).unwrap().expose_text(), a.expose_text());
    }

    #[test]
    fn capabilities_are_unique_and_checked_exactly() {
        let t = new_capability();
        assert_eq!(t.len(), 2 * CAPABILITY_BYTES);
        assert!(is_capability(&t));
        assert!(
            !is_capability(&t[1..]) && !is_capability(&t.to_uppercase().replace(|c: char| c.is_ascii_digit(), "A"))
        );
        assert_ne!(t, new_capability());
        assert!(capability_matches(&t, &t));
        assert!(!capability_matches(&t, &t[..31]));
        assert!(!capability_matches(&t, &new_capability()));
        assert!(!capability_matches("", ""), "an empty token opens nothing");
    }

    #[test]
    fn log_limiter_lets_one_line_through_per_period() {
        let l = LogLimiter::new(std::time::Duration::from_secs(3600));
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
    }
}
