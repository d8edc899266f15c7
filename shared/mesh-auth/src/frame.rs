//! Per-frame MACs for a node's internal ZeroMQ links over `tcp` (docs/DECISIONS.md D45).
//!
//! A PUSH → PULL stream has no reply path, so a challenge-response like the side channel's
//! cannot authenticate it; every frame carries its own proof instead. A sealed frame is
//!
//! ```text
//! 0      1        2            18        26           34          66
//! | 0xC1 | version | session id | counter | unix ms    | HMAC tag  | payload (one Envelope) …
//!   u8     u8=1      16 bytes     u64 BE    u64 BE       32 bytes
//! ```
//!
//! `tag = HMAC-SHA256(link key, header[0..34] | link port u16 BE | direction u8 | payload)`.
//! The marker `0xC1` is the one byte MessagePack never uses, so a sealed frame can never be
//! read as an unsealed Envelope nor the other way round. The link key ([`LinkKey`]) is derived
//! from the mesh secret with its own label and the node's name, so it is worthless as a
//! side-channel proof and a frame of one node is worthless on another; the port of the bound
//! socket and the direction (towards the bound side or away from it) are covered by the tag
//! without travelling, so a frame is good on one link, one way. A receiver ([`FrameOpener`])
//! checks, in this order and before anything decodes the payload: the marker and length, the
//! version, the tag (constant time), the timestamp (within [`FRESHNESS_WINDOW`] of its own
//! clock), and that the counter is above the last one it accepted from that session. Only a
//! frame that passed the tag touches the session table, so a stranger cannot fill it.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::{Channel, MeshSecret};

/// First byte of every sealed frame: MessagePack's "never used" code.
pub const FRAME_MARKER: u8 = 0xC1;
/// Version of the sealed-frame layout.
pub const FRAME_VERSION: u8 = 1;
/// Bytes of a sender's session id.
pub const SESSION_LEN: usize = 16;
/// Bytes of the HMAC-SHA256 tag.
pub const TAG_LEN: usize = 32;
/// Bytes before the tag: marker, version, session, counter, timestamp.
const AUTHED_HEADER_LEN: usize = 2 + SESSION_LEN + 8 + 8;
/// Bytes a sealed frame adds to its payload.
pub const HEADER_LEN: usize = AUTHED_HEADER_LEN + TAG_LEN;
/// How far a frame's timestamp may be from the receiver's clock. A frame of a session the
/// receiver has forgotten (it restarted, or dropped the session) can be replayed only inside
/// this window; beyond it, it is stale.
pub const FRESHNESS_WINDOW: Duration = Duration::from_secs(120);
/// Sessions one receiver remembers. Only senders that hold the key create sessions, so the
/// bound matters for memory hygiene, not against strangers.
pub const MAX_SESSIONS: usize = 4096;

/// Which way a frame travels on its link. Part of the tag, so a frame cannot be reflected
/// back to the side that sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From a connecting socket (DEALER, PUSH) to the bound one (ROUTER, PULL).
    ToBound,
    /// From the bound ROUTER to a connected DEALER.
    FromBound,
}

/// The link a frame belongs to: the port of the bound socket (0 for a non-tcp endpoint) and
/// the direction. Both ends know it without sending it; the topology gives the bind side and
/// the connect side the same port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkBinding {
    pub port: u16,
    pub direction: Direction,
}

impl LinkBinding {
    pub fn new(port: u16, direction: Direction) -> Self {
        Self { port, direction }
    }

    fn bytes(self) -> [u8; 3] {
        let [a, b] = self.port.to_be_bytes();
        let d = match self.direction {
            Direction::ToBound => 1,
            Direction::FromBound => 2,
        };
        [a, b, d]
    }
}

/// The key of a node's internal links, derived from the mesh secret:
/// `HMAC-SHA256(secret, "pdmesh-mesh-auth/1" | "frame-key" | "internal" | node)`, every part
/// length-prefixed as in the handshake proofs (whose role part is `server` or `client`, so no
/// proof input equals this one). Its `Debug` never shows it.
#[derive(Clone)]
pub struct LinkKey {
    /// HMAC keyed once; cloned per frame (saves hashing the key pads every time).
    mac: Hmac<Sha256>,
}

impl fmt::Debug for LinkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LinkKey(<redacted>)")
    }
}

impl LinkKey {
    /// The key for the internal links of node `node` of the mesh with `secret`.
    pub fn derive(secret: &MeshSecret, node: &str) -> Self {
        let mut mac = secret.mac();
        for part in
            [b"pdmesh-mesh-auth/1".as_slice(), b"frame-key", Channel::Internal.label().as_bytes(), node.as_bytes()]
        {
            mac.update(&(part.len() as u32).to_be_bytes());
            mac.update(part);
        }
        let key = mac.finalize().into_bytes();
        Self { mac: crate::hmac_with_key(&key) }
    }

    fn tag(&self, header: &[u8], link: LinkBinding, payload: &[u8]) -> [u8; TAG_LEN] {
        let mut mac = self.mac.clone();
        mac.update(header);
        mac.update(&link.bytes());
        mac.update(payload);
        mac.finalize().into_bytes().into()
    }
}

/// Milliseconds since the Unix epoch by this host's clock (0 before 1970).
pub fn unix_ms_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The sending half: one per socket, with a random session id and a counter that only grows.
pub struct FrameSealer {
    key: LinkKey,
    link: LinkBinding,
    session: [u8; SESSION_LEN],
    counter: u64,
}

impl fmt::Debug for FrameSealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrameSealer").field("link", &self.link).field("counter", &self.counter).finish()
    }
}

impl FrameSealer {
    /// A sealer with a fresh 128-bit session id from the OS CSPRNG.
    pub fn new(key: LinkKey, link: LinkBinding) -> Self {
        Self { key, link, session: fresh_session(), counter: 0 }
    }

    pub fn session(&self) -> [u8; SESSION_LEN] {
        self.session
    }

    /// Seal `payload` stamped with this host's clock.
    pub fn seal(&mut self, payload: &[u8]) -> Vec<u8> {
        self.seal_at(payload, unix_ms_now())
    }

    /// Seal `payload` with the timestamp `unix_ms` (tests and tools forge old frames with it).
    pub fn seal_at(&mut self, payload: &[u8], unix_ms: u64) -> Vec<u8> {
        if self.counter == u64::MAX {
            // 2^64 frames: start a new session rather than ever repeat a counter.
            self.session = fresh_session();
            self.counter = 0;
        }
        self.counter += 1;
        let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
        frame.push(FRAME_MARKER);
        frame.push(FRAME_VERSION);
        frame.extend_from_slice(&self.session);
        frame.extend_from_slice(&self.counter.to_be_bytes());
        frame.extend_from_slice(&unix_ms.to_be_bytes());
        let tag = self.key.tag(&frame, self.link, payload);
        frame.extend_from_slice(&tag);
        frame.extend_from_slice(payload);
        frame
    }
}

fn fresh_session() -> [u8; SESSION_LEN] {
    let mut s = [0u8; SESSION_LEN];
    rand::rngs::OsRng.fill_bytes(&mut s);
    s
}

/// Why a frame was refused. Apart from [`FrameRefusal::Unsealed`] and
/// [`FrameRefusal::Malformed`], nothing of the frame was looked at beyond its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameRefusal {
    #[error("the frame is not sealed (a peer without the mesh secret, or of an older version)")]
    Unsealed,
    #[error("the frame is sealed but too short or of an unknown version")]
    Malformed,
    #[error("the frame's tag does not match (another mesh secret, another node or link, or forged)")]
    BadTag,
    #[error("the frame's timestamp is outside the freshness window (an old frame replayed, or clocks apart)")]
    Stale,
    #[error("the frame's counter is not above the last one accepted from its session (replayed)")]
    Replayed,
}

impl FrameRefusal {
    /// Label of `pdmesh_transport_frames_refused_total{reason}`.
    pub fn label(self) -> &'static str {
        match self {
            FrameRefusal::Unsealed => "unsealed",
            FrameRefusal::Malformed => "malformed",
            FrameRefusal::BadTag => "bad_tag",
            FrameRefusal::Stale => "stale",
            FrameRefusal::Replayed => "replayed",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Session {
    last_counter: u64,
    /// Timestamp of the last accepted frame: a session whose last frame is older than the
    /// window can be forgotten safely (every frame of it is stale by now).
    last_ms: u64,
}

/// The receiving half: one per socket, remembering the senders' sessions.
pub struct FrameOpener {
    key: LinkKey,
    link: LinkBinding,
    window_ms: u64,
    max_sessions: usize,
    sessions: HashMap<[u8; SESSION_LEN], Session>,
}

impl fmt::Debug for FrameOpener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrameOpener").field("link", &self.link).field("sessions", &self.sessions.len()).finish()
    }
}

impl FrameOpener {
    pub fn new(key: LinkKey, link: LinkBinding) -> Self {
        Self::with_limits(key, link, FRESHNESS_WINDOW, MAX_SESSIONS)
    }

    pub fn with_limits(key: LinkKey, link: LinkBinding, window: Duration, max_sessions: usize) -> Self {
        Self {
            key,
            link,
            window_ms: window.as_millis() as u64,
            max_sessions: max_sessions.max(1),
            sessions: HashMap::new(),
        }
    }

    /// Sessions remembered now.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Check `frame` against this host's clock; the payload when it is authentic, fresh and new.
    pub fn open<'a>(&mut self, frame: &'a [u8]) -> Result<&'a [u8], FrameRefusal> {
        self.open_at(frame, unix_ms_now())
    }

    /// [`FrameOpener::open`] with the receiver's clock at `now_ms`.
    pub fn open_at<'a>(&mut self, frame: &'a [u8], now_ms: u64) -> Result<&'a [u8], FrameRefusal> {
        match frame.first() {
            Some(&FRAME_MARKER) => {}
            _ => return Err(FrameRefusal::Unsealed),
        }
        if frame.len() < HEADER_LEN || frame[1] != FRAME_VERSION {
            return Err(FrameRefusal::Malformed);
        }
        let (header, rest) = frame.split_at(AUTHED_HEADER_LEN);
        let (tag, payload) = rest.split_at(TAG_LEN);
        let expected = self.key.tag(header, self.link, payload);
        if !bool::from(expected.as_slice().ct_eq(tag)) {
            return Err(FrameRefusal::BadTag);
        }
        let mut session = [0u8; SESSION_LEN];
        session.copy_from_slice(&header[2..2 + SESSION_LEN]);
        let counter = be_u64(&header[2 + SESSION_LEN..10 + SESSION_LEN]);
        let sent_ms = be_u64(&header[10 + SESSION_LEN..AUTHED_HEADER_LEN]);
        if sent_ms.abs_diff(now_ms) > self.window_ms {
            return Err(FrameRefusal::Stale);
        }
        match self.sessions.get_mut(&session) {
            Some(s) if counter <= s.last_counter => return Err(FrameRefusal::Replayed),
            Some(s) => {
                s.last_counter = counter;
                s.last_ms = s.last_ms.max(sent_ms);
            }
            None => {
                self.make_room(now_ms);
                self.sessions.insert(session, Session { last_counter: counter, last_ms: sent_ms });
            }
        }
        Ok(payload)
    }

    /// Before a new session is remembered: forget the sessions whose frames are all stale by
    /// now, and if that is not enough, the one heard from least recently.
    fn make_room(&mut self, now_ms: u64) {
        if self.sessions.len() < self.max_sessions {
            return;
        }
        let window = self.window_ms;
        self.sessions.retain(|_, s| now_ms.saturating_sub(s.last_ms) <= window);
        if self.sessions.len() >= self.max_sessions {
            if let Some(oldest) = self.sessions.iter().min_by_key(|(_, s)| s.last_ms).map(|(k, _)| *k) {
                self.sessions.remove(&oldest);
            }
        }
    }
}

fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(secret: &str, node: &str) -> LinkKey {
        LinkKey::derive(&MeshSecret::parse(secret).unwrap(), node)
    }

    const K: &str = "frame-test-secret-0123456789abcdefghij";
    const LINK: LinkBinding = LinkBinding { port: 7100, direction: Direction::ToBound };

    #[test]
    fn a_sealed_frame_opens_once_on_its_own_link_only() {
        let mut tx = FrameSealer::new(key(K, "p"), LINK);
        let mut rx = FrameOpener::new(key(K, "p"), LINK);
        let frame = tx.seal(b"hello");
        assert_eq!(frame.len(), HEADER_LEN + 5);
        assert_eq!(frame[0], FRAME_MARKER);
        assert_eq!(rx.open(&frame), Ok(b"hello".as_slice()));
        assert_eq!(rx.open(&frame), Err(FrameRefusal::Replayed), "the same frame twice");
        let second = tx.seal(b"again");
        assert_eq!(rx.open(&second), Ok(b"again".as_slice()));
        assert_eq!(rx.open(&frame), Err(FrameRefusal::Replayed), "an older frame after a newer one");

        // Another secret, another node, another port, the other direction: the tag fails.
        for mut other in [
            FrameOpener::new(key("another-secret-0123456789abcdefghijkl", "p"), LINK),
            FrameOpener::new(key(K, "d"), LINK),
            FrameOpener::new(key(K, "p"), LinkBinding::new(7101, Direction::ToBound)),
            FrameOpener::new(key(K, "p"), LinkBinding::new(7100, Direction::FromBound)),
        ] {
            assert_eq!(other.open(&tx.seal(b"x")), Err(FrameRefusal::BadTag));
            assert_eq!(other.sessions(), 0, "a refused frame leaves no session behind");
        }
    }

    #[test]
    fn tampering_unsealed_malformed_and_stale_frames_are_refused() {
        let mut tx = FrameSealer::new(key(K, "p"), LINK);
        let mut rx = FrameOpener::new(key(K, "p"), LINK);
        let frame = tx.seal(b"payload");
        // Flip one bit anywhere: header, tag or payload.
        for i in 2..frame.len() {
            let mut bad = frame.clone();
            bad[i] ^= 1;
            assert_eq!(rx.open(&bad), Err(FrameRefusal::BadTag), "bit flip at {i}");
        }
        assert_eq!(rx.open(b"\x86\xa7version"), Err(FrameRefusal::Unsealed), "a plain msgpack Envelope");
        assert_eq!(rx.open(b""), Err(FrameRefusal::Unsealed));
        assert_eq!(rx.open(&frame[..HEADER_LEN - 1]), Err(FrameRefusal::Malformed));
        let mut v2 = frame.clone();
        v2[1] = 2;
        assert_eq!(rx.open(&v2), Err(FrameRefusal::Malformed));

        let now = unix_ms_now();
        let window = FRESHNESS_WINDOW.as_millis() as u64;
        let old = tx.seal_at(b"old", now - window - 1);
        assert_eq!(rx.open_at(&old, now), Err(FrameRefusal::Stale));
        let future = tx.seal_at(b"future", now + window + 1);
        assert_eq!(rx.open_at(&future, now), Err(FrameRefusal::Stale));
        let edge = tx.seal_at(b"edge", now - window);
        assert_eq!(rx.open_at(&edge, now), Ok(b"edge".as_slice()));
        // Counters 2 and 3 were refused: the counter only has to grow, gaps are fine.
        assert_eq!(rx.open_at(&edge, now), Err(FrameRefusal::Replayed));
        assert_eq!(rx.open_at(&frame, now), Err(FrameRefusal::Replayed), "counter 1 after counter 4");
    }

    #[test]
    fn the_session_table_is_bounded_and_forgets_stale_sessions_first() {
        let mut rx = FrameOpener::with_limits(key(K, "p"), LINK, Duration::from_secs(10), 2);
        let now = 1_000_000;
        let mut a = FrameSealer::new(key(K, "p"), LINK);
        let mut b = FrameSealer::new(key(K, "p"), LINK);
        let mut c = FrameSealer::new(key(K, "p"), LINK);
        let a1 = a.seal_at(b"a", now - 9_000);
        rx.open_at(&a1, now - 9_000).unwrap();
        rx.open_at(&b.seal_at(b"b", now), now).unwrap();
        // a's last frame is 11 s old at now + 2 s: forgotten first, b stays.
        rx.open_at(&c.seal_at(b"c", now + 2_000), now + 2_000).unwrap();
        assert_eq!(rx.sessions(), 2);
        let b2 = b.seal_at(b"b2", now + 2_000);
        assert_eq!(rx.open_at(&b2, now + 2_000), Ok(b"b2".as_slice()));
        assert_eq!(rx.open_at(&b2, now + 2_000), Err(FrameRefusal::Replayed), "b was remembered");
        // a's forgotten frame is stale by now, so forgetting it opened no door.
        assert_eq!(rx.open_at(&a1, now + 2_000), Err(FrameRefusal::Stale));
    }

    #[test]
    fn link_keys_depend_on_secret_and_node_and_never_print() {
        let k = key(K, "p");
        assert!(!format!("{k:?}").contains(K));
        let link = LINK;
        let mut a = FrameSealer::new(k.clone(), link);
        let frame = a.seal(b"x");
        assert_eq!(FrameOpener::new(k, link).open(&frame), Ok(b"x".as_slice()));
        assert_ne!(a.session(), FrameSealer::new(key(K, "p"), link).session(), "fresh session per sealer");
    }
}
