//! Sealed frames on `tcp://` links (docs/DECISIONS.md D45): which sockets seal, and what a
//! receiver does with a frame that fails the check.
//!
//! A process installs its node's [`LinkKey`] once at start-up ([`seal_tcp_links`]); from then
//! on every socket this crate opens on a `tcp://` endpoint seals what it sends and drops what
//! it receives unless it is sealed under that key, fresh and new ([`pdmesh_mesh_auth::frame`]).
//! `ipc://` endpoints stay unsealed: they are Unix sockets in the mesh's `run_dir`, guarded by
//! file permissions. Sockets opened before the installation stay as they were, so it belongs
//! before the first socket.
//!
//! A refused frame is never decoded and never answered (a ROUTER sends nothing back, so a
//! prober learns nothing, not even that it reached a pdmesh socket); it is counted in
//! `pdmesh_kv_side_channel_unauthenticated_total{channel="internal"}` and
//! `pdmesh_transport_frames_refused_total{endpoint,reason}`, and logged at most once a second.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pdmesh_mesh_auth::frame::{Direction, FrameOpener, FrameRefusal, FrameSealer, LinkBinding, LinkKey};
use pdmesh_mesh_auth::Channel;
use pdmesh_telemetry::log_limit::LogLimiter;

use crate::metrics::REFUSED;

/// The key this process seals its `tcp://` links with, once installed.
static TCP_KEY: OnceLock<Arc<LinkKey>> = OnceLock::new();

static REFUSAL_LOG: LogLimiter = LogLimiter::new(Duration::from_secs(1));

/// Why [`seal_tcp_links`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the links of this process are already sealed with a key")]
pub struct AlreadySealed;

/// Seal every `tcp://` socket this process opens from now on with `key` (the node's key,
/// [`LinkKey::derive`] from the mesh secret). Called once, at service start-up, before the
/// first socket; a second call is refused (a process has one node and one secret).
pub fn seal_tcp_links(key: LinkKey) -> Result<(), AlreadySealed> {
    TCP_KEY.set(Arc::new(key)).map_err(|_| AlreadySealed)
}

/// Whether [`seal_tcp_links`] was called in this process.
pub fn tcp_links_sealed() -> bool {
    TCP_KEY.get().is_some()
}

/// How one socket treats its frames: sealed under a key, or plain.
#[derive(Clone, Debug, Default)]
pub struct Seal(Option<Arc<LinkKey>>);

impl Seal {
    /// What the plain functions (`bind_router`, `connect_dealer`, …) use: sealed with the
    /// installed key on a `tcp://` endpoint, plain otherwise.
    pub fn for_endpoint(endpoint: &str) -> Self {
        match TCP_KEY.get() {
            Some(key) if endpoint.starts_with("tcp://") => Self(Some(key.clone())),
            _ => Self(None),
        }
    }

    /// Sealed with `key`, whatever the endpoint (tests and benchmarks choose per socket).
    pub fn with_key(key: LinkKey) -> Self {
        Self(Some(Arc::new(key)))
    }

    /// Plain frames, whatever the endpoint and the installed key.
    pub fn none() -> Self {
        Self(None)
    }

    pub fn is_sealed(&self) -> bool {
        self.0.is_some()
    }

    pub(crate) fn sealer(&self, port: u16, direction: Direction) -> Option<FrameSealer> {
        self.0.as_ref().map(|k| FrameSealer::new(LinkKey::clone(k), LinkBinding::new(port, direction)))
    }

    pub(crate) fn guard(&self, endpoint: &str, port: u16, direction: Direction) -> Guard {
        Guard {
            opener: self.0.as_ref().map(|k| FrameOpener::new(LinkKey::clone(k), LinkBinding::new(port, direction))),
            endpoint: endpoint.to_string(),
        }
    }
}

/// The port of a `tcp://host:port` endpoint (0 for anything else): the part of the link's
/// identity both ends know (the topology gives the bind and the connect side the same port).
pub(crate) fn endpoint_port(endpoint: &str) -> u16 {
    endpoint
        .strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or(0)
}

/// Seal `payload` when the socket seals; hand it on unchanged otherwise.
pub(crate) fn seal(sealer: &mut Option<FrameSealer>, payload: Vec<u8>) -> Vec<u8> {
    match sealer {
        Some(s) => s.seal(&payload),
        None => payload,
    }
}

/// The receiving check of one socket.
#[derive(Debug)]
pub(crate) struct Guard {
    opener: Option<FrameOpener>,
    endpoint: String,
}

impl Guard {
    /// The payload of `frame` when it may be decoded; `None` (counted, logged) when refused.
    /// `peer` names the sender in the log line where the socket knows it.
    pub(crate) fn open<'a>(&mut self, frame: &'a [u8], peer: Option<&dyn std::fmt::Display>) -> Option<&'a [u8]> {
        let Some(opener) = &mut self.opener else { return Some(frame) };
        match opener.open(frame) {
            Ok(payload) => Some(payload),
            Err(refusal) => {
                self.refused(refusal, peer);
                None
            }
        }
    }

    fn refused(&self, refusal: FrameRefusal, peer: Option<&dyn std::fmt::Display>) {
        pdmesh_mesh_auth::metrics::unauthenticated(Channel::Internal);
        REFUSED.with_label_values(&[&self.endpoint, refusal.label()]).inc();
        if let Some(suppressed) = REFUSAL_LOG.check() {
            let peer = peer.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
            tracing::warn!(
                endpoint = %self.endpoint,
                %peer,
                reason = refusal.label(),
                suppressed,
                "refused a frame on an internal link: {refusal}; check that every service of this node runs \
                 with the same mesh secret (PDMESH_MESH_SECRET)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_from_tcp_endpoints_only() {
        assert_eq!(endpoint_port("tcp://0.0.0.0:7100"), 7100);
        assert_eq!(endpoint_port("tcp://p-lb:7101"), 7101);
        assert_eq!(endpoint_port("tcp://[::1]:7102"), 7102);
        assert_eq!(endpoint_port("ipc:///tmp/pdmesh/p/x.sock"), 0);
        assert_eq!(endpoint_port("tcp://nohost"), 0);
    }
}
