//! Entry points of the fuzz targets (`fuzz/`, `docs/SECURITY.md`), compiled only with the
//! `fuzzing` feature. Each drives the agent's own code, not a copy of it:
//! - [`AgentHarness::side_channel_frame`]: one frame from one peer through the side channel's
//!   decode, mesh authentication and dispatch ([`crate::agent`]'s `handle_frame`, which the
//!   socket loop calls per frame), with the agent's real per-peer handshake state;
//! - [`AgentHarness::block_server_session`]: a byte stream through the tcp block server's
//!   connection loop (its handshake, then request parsing, capability and lease check, framing
//!   of the answer), over an in-memory stream, with or without the client's side of the
//!   handshake first;
//! - [`block_read`]: D's tcp reader (its handshake, reply parsing, receive into local runs)
//!   against a loopback socket whose peer answers with the fuzzer's bytes;
//! - [`authenticate_to_block_server`] / [`answer_block_server_handshake`]: the two sides of the
//!   data plane's handshake, for a harness that plays the other end.
//!
//! Every harness speaks the real mesh handshake with [`AgentHarness::secret`], and every held
//! request is held under a capability token ([`held_requests`]), so that fuzzed input reaches
//! the code behind both checks; inputs that skip the handshake, or carry a wrong or missing
//! token, exercise the refusals.
//!
//! Lease ids are drawn at random by [`HoldTable`] (a restarted P must not reuse them), which
//! would make a fuzzer's inputs irreproducible; [`SequentialLeases`] numbers them 1, 2, 3, …
//! on the wire and maps them back, so an input replays the same way every time.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_mesh_auth::{Channel, MeshSecret};
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{KvCache, KvCacheSpec};
use pdmesh_protocol::{
    AgentMetadata, Envelope, Message, TransferBackend, XferReadBlocks, KV_DTYPE_F32, KV_LAYOUT, TRANSFER_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::agent::{AgentStats, Served, Sessions};
use crate::backend::tcp::{authenticate_peer, authenticate_to, serve_connection, TcpReader};
use crate::error::{AgentError, TransferError};
use crate::fault::FaultConfig;
use crate::hold::{
    CapabilityCheck, HoldTable, LeaseDecision, LeaseGrant, LeasePolicy, LeaseRefusal, NoticeOutcome, ParkedAnswer,
    SharedPolicy,
};
use crate::region::{ShmReadOnly, ShmRegion};

/// Bytes of one run (one block of one layer side) of `spec`: the unit of a tcp read.
pub fn run_bytes(spec: &KvCacheSpec) -> usize {
    crate::layout::run_bytes(spec)
}

/// A [`LeasePolicy`] that gives out lease ids 1, 2, 3, … in grant order and translates them
/// to the wrapped policy's ids; an id it never gave out is passed through unchanged (and is
/// refused as unknown by any policy whose ids are random).
#[derive(Debug)]
pub struct SequentialLeases<P> {
    inner: P,
    /// Wire id → inner id.
    to_inner: HashMap<u64, u64>,
    /// Inner id → wire id (a re-grant of the same lease keeps its wire id).
    to_wire: HashMap<u64, u64>,
}

impl<P: LeasePolicy> SequentialLeases<P> {
    pub fn new(inner: P) -> Self {
        Self { inner, to_inner: HashMap::new(), to_wire: HashMap::new() }
    }

    pub fn inner(&self) -> &P {
        &self.inner
    }

    fn inner_id(&self, wire: u64) -> u64 {
        self.to_inner.get(&wire).copied().unwrap_or(wire)
    }

    fn wire_grant(&mut self, grant: LeaseGrant) -> LeaseGrant {
        let next = self.to_wire.len() as u64 + 1;
        let wire = *self.to_wire.entry(grant.lease_id).or_insert(next);
        self.to_inner.insert(wire, grant.lease_id);
        LeaseGrant { lease_id: wire, ttl: grant.ttl }
    }
}

impl<P: LeasePolicy> LeasePolicy for SequentialLeases<P> {
    fn grant(
        &mut self,
        p_request_id: &str,
        block_ids: &[u32],
        generations: &[u64],
        consumer: &str,
        now: Instant,
    ) -> Result<LeaseGrant, LeaseRefusal> {
        let grant = self.inner.grant(p_request_id, block_ids, generations, consumer, now)?;
        Ok(self.wire_grant(grant))
    }

    fn check_read(
        &self,
        p_request_id: &str,
        lease_id: u64,
        block_ids: &[u32],
        now: Instant,
    ) -> Result<(), LeaseRefusal> {
        self.inner.check_read(p_request_id, self.inner_id(lease_id), block_ids, now)
    }

    fn read_done(&mut self, p_request_id: &str, lease_id: u64, consumer: &str, now: Instant) -> NoticeOutcome {
        let id = self.inner_id(lease_id);
        self.inner.read_done(p_request_id, id, consumer, now)
    }

    fn give_up(&mut self, p_request_id: &str, lease_id: Option<u64>, consumer: &str, now: Instant) -> NoticeOutcome {
        let id = lease_id.map(|l| self.inner_id(l));
        self.inner.give_up(p_request_id, id, consumer, now)
    }

    fn heartbeat(&mut self, p_request_ids: &[String], now: Instant) -> usize {
        self.inner.heartbeat(p_request_ids, now)
    }

    fn capability(&self, p_request_id: &str, presented: &str) -> CapabilityCheck {
        self.inner.capability(p_request_id, presented)
    }

    fn grant_or_park(
        &mut self,
        p_request_id: &str,
        block_ids: &[u32],
        generations: &[u64],
        consumer: &str,
        capability: &str,
        now: Instant,
    ) -> LeaseDecision {
        match self.inner.grant_or_park(p_request_id, block_ids, generations, consumer, capability, now) {
            LeaseDecision::Granted(g) => LeaseDecision::Granted(self.wire_grant(g)),
            other => other,
        }
    }

    fn take_parked_answers(&mut self, now: Instant) -> Vec<ParkedAnswer> {
        let mut answers = self.inner.take_parked_answers(now);
        for a in &mut answers {
            if let Ok(g) = a.result {
                a.result = Ok(self.wire_grant(g));
            }
        }
        answers
    }

    fn next_parked_deadline(&self) -> Option<Instant> {
        self.inner.next_parked_deadline()
    }

    fn parked_wakeup(&self) -> Option<Arc<tokio::sync::Notify>> {
        self.inner.parked_wakeup()
    }

    fn give_up_with_capability(
        &mut self,
        p_request_id: &str,
        lease_id: Option<u64>,
        consumer: &str,
        capability: &str,
        now: Instant,
    ) -> NoticeOutcome {
        let id = lease_id.map(|l| self.inner_id(l));
        self.inner.give_up_with_capability(p_request_id, id, consumer, capability, now)
    }
}

/// A request P holds in a fresh [`AgentHarness`]: id, blocks, generations, capability token.
pub type HeldRequest = (&'static str, Vec<u32>, Vec<u64>, &'static str);

/// The requests every [`AgentHarness::new_policy`] holds, so that seeds can lease and read
/// them: `req-0` holds blocks 1 and 2, `req-1` block 5, `req-2` blocks 0, 3 and 7; each under
/// its own capability token (fixed, so inputs replay; real tokens come from a CSPRNG).
pub fn held_requests() -> Vec<HeldRequest> {
    vec![
        ("req-0", vec![1, 2], vec![1, 1], "00000000000000000000000000000c00"),
        ("req-1", vec![5], vec![3], "11111111111111111111111111111c01"),
        ("req-2", vec![0, 3, 7], vec![1, 2, 3], "22222222222222222222222222222c02"),
    ]
}

/// The capability token `p_request_id` is held under in a fresh harness (empty: not held).
pub fn capability_of(p_request_id: &str) -> &'static str {
    held_requests().into_iter().find(|h| h.0 == p_request_id).map_or("", |h| h.3)
}

/// P's side of the transfer agent, without sockets: the state the side channel and the block
/// server share ([`Served`]) and a small KV region with a known byte pattern.
pub struct AgentHarness {
    served: Arc<Served>,
    /// The side channel's per-peer handshake state, as its socket loop keeps it.
    sessions: Sessions,
    spec: KvCacheSpec,
    region: Arc<ShmReadOnly>,
    /// Owns the writable mapping (its drop removes the file).
    _cache: KvCache,
}

impl std::fmt::Debug for AgentHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentHarness").field("spec", &self.spec).finish_non_exhaustive()
    }
}

impl AgentHarness {
    /// The mesh secret of the harness's mesh (a test secret; a real one is 256 random bits).
    pub const SECRET: &'static str = "pdmesh-fuzz-test-mesh-secret-0123456789abcdef";

    /// [`Self::SECRET`] as the agent holds it.
    pub fn secret() -> MeshSecret {
        MeshSecret::parse(Self::SECRET).unwrap_or_else(|_| MeshSecret::generate())
    }

    /// The geometry of the harness's cache: 2 layers, 8 blocks, 16-byte runs.
    pub const SPEC: KvCacheSpec =
        KvCacheSpec { num_layers: 2, num_blocks: 8, block_size: 2, num_kv_heads: 1, head_dim: 2 };

    /// A region file at `region_path` (replaced if present) whose every float names its run
    /// (`layer * 100 + side * 10 + block`), so a reader can check it got the right bytes.
    pub fn new(region_path: &Path) -> Result<Self, AgentError> {
        let spec = Self::SPEC;
        let region = ShmRegion::create_at(region_path, crate::layout::region_bytes(&spec))?;
        let readonly = ShmRegion::open_readonly(region_path)?;
        let mut cache = region.into_kv_cache(spec)?;
        for layer in 0..spec.num_layers {
            for side in crate::layout::SIDES {
                for block in 0..spec.num_blocks {
                    let value = (layer * 100 + side as u32 * 10 + block) as f32;
                    if let Ok(run) = cache.block_mut(layer as usize, side, block) {
                        run.fill(value);
                    }
                }
            }
        }
        let metadata = AgentMetadata {
            engine_id: "fuzz-p".into(),
            agent_name: "fuzz-agent".into(),
            rank: 0,
            backend: TransferBackend::Tcp { host: "127.0.0.1".into(), port: 1 },
            layout: KV_LAYOUT.into(),
            num_layers: spec.num_layers,
            num_blocks: spec.num_blocks,
            block_size: spec.block_size,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            dtype: KV_DTYPE_F32.into(),
            bytes_per_block: spec.bytes_per_block(),
            compat_hash: "fuzz".into(),
            protocol_version: TRANSFER_VERSION,
        };
        let served = Arc::new(Served {
            metadata,
            policy: Self::new_policy(),
            faults: FaultConfig::none(),
            stats: Arc::new(AgentStats::default()),
            secret: Self::secret(),
        });
        Ok(Self { served, sessions: Sessions::default(), spec, region: Arc::new(readonly), _cache: cache })
    }

    /// A fresh [`HoldTable`] holding [`held_requests`], behind [`SequentialLeases`].
    pub fn new_policy() -> SharedPolicy {
        let mut table = HoldTable::default();
        let deadline = Instant::now() + Duration::from_secs(3600);
        for (id, blocks, generations, capability) in held_requests() {
            table.hold_with_capability(id, blocks, generations, deadline, capability.to_string());
        }
        Arc::new(Mutex::new(SequentialLeases::new(table)))
    }

    /// Start over: a fresh policy (and counters) with `faults`, and no peer authenticated, so
    /// every input replays alike.
    pub fn reset(&mut self, faults: FaultConfig) {
        self.served = Arc::new(Served {
            metadata: self.served.metadata.clone(),
            policy: Self::new_policy(),
            faults,
            stats: Arc::new(AgentStats::default()),
            secret: self.served.secret.clone(),
        });
        self.sessions = Sessions::default();
    }

    /// Grant `consumer` a lease on held request `p_request_id` (with the blocks and
    /// generations P holds for it), as the side channel would; the wire lease id.
    pub fn grant(&self, p_request_id: &str, consumer: &str) -> Option<u64> {
        let (_, blocks, generations, _) = held_requests().into_iter().find(|h| h.0 == p_request_id)?;
        let grant = self.served.policy().grant(p_request_id, &blocks, &generations, consumer, Instant::now());
        grant.ok().map(|g| g.lease_id)
    }

    pub fn spec(&self) -> KvCacheSpec {
        self.spec
    }

    pub fn stats(&self) -> &AgentStats {
        &self.served.stats
    }

    /// What the policy says of `presented` for `p_request_id` right now (the check every
    /// lease, read and notice passes first); `presented = ""` tells whether it is still held.
    pub fn capability_check(&self, p_request_id: &str, presented: &str) -> CapabilityCheck {
        self.served.policy().capability(p_request_id, presented)
    }

    /// What the side channel answers to one frame from `peer` (its ROUTER routing id; `None`:
    /// it sends nothing).
    pub fn side_channel_frame(&mut self, peer: &[u8], frame: &[u8]) -> Option<Vec<u8>> {
        crate::agent::handle_frame(&self.served, &mut self.sessions, peer, frame)
    }

    /// The answers the side channel sends at `now` for lease requests the policy parked (a
    /// lease that arrived before its hold registered, D65), each with the peer it goes to.
    pub fn parked_answers_at(&mut self, now: Instant) -> Vec<(Vec<u8>, Vec<u8>)> {
        crate::agent::parked_answers(&self.served, &mut self.sessions, now)
    }

    /// The whole side channel handshake of `peer` (hello, challenge, proof, ack) with `secret`,
    /// through [`Self::side_channel_frame`] as a decode node sends it; whether P acknowledged.
    /// With another mesh's secret the proof is forged from it (P must refuse it).
    pub fn side_channel_handshake(&mut self, peer: &[u8], secret: &MeshSecret) -> bool {
        let (client, hello) = pdmesh_mesh_auth::ClientHello::new(Channel::SideChannel);
        let client_nonce = hello.client_nonce.clone();
        let Some(reply) = Envelope::new(Message::AuthHello(hello)).encode().ok() else { return false };
        let Some(answer) = self.side_channel_frame(peer, &reply).and_then(|b| Envelope::decode(&b).ok()) else {
            return false;
        };
        let Message::AuthChallenge(challenge) = answer.body else { return false };
        let proof = client.answer(secret, &challenge).unwrap_or_else(|_| pdmesh_protocol::AuthProof {
            client_proof: pdmesh_mesh_auth::client_proof(
                secret,
                Channel::SideChannel,
                &client_nonce,
                &challenge.server_nonce,
            ),
        });
        let Some(frame) = Envelope::new(Message::AuthProof(proof)).encode().ok() else { return false };
        let answer = self.side_channel_frame(peer, &frame).and_then(|b| Envelope::decode(&b).ok());
        matches!(answer, Some(Envelope { body: Message::Ack, .. }))
    }

    /// Everything the block server writes on a connection on which a reader sent `input` and
    /// then closed its sending half; with `authenticate`, the reader first runs its side of
    /// the handshake with [`Self::secret`] (what it exchanged then is not part of the answer;
    /// `None` if that handshake failed). Bounded: the server stops at the end of `input` or at
    /// its first bad frame, and answers each request with at most one cache's worth of bytes.
    pub async fn block_server_session(&self, input: &[u8], authenticate: bool) -> Option<Vec<u8>> {
        let (mut client, server) = tokio::io::duplex(64 << 10);
        let serve = serve_connection(server, "fuzz".into(), self.region.clone(), self.spec, self.served.clone());
        let session = async {
            if authenticate && authenticate_to(&mut client, &self.served.secret).await.is_err() {
                return None;
            }
            Some(Self::exchange(client, input).await)
        };
        let ((), out) = tokio::join!(serve, session);
        out
    }

    /// Send `input` and close the sending half, while reading everything the other end writes.
    async fn exchange(stream: tokio::io::DuplexStream, input: &[u8]) -> Vec<u8> {
        let (mut rx, mut tx) = tokio::io::split(stream);
        let send = async {
            // The server may stop reading early (a bad frame): the rest is refused, as a
            // closed socket would.
            let _ = tx.write_all(input).await;
            let _ = tx.shutdown().await;
        };
        let mut out = Vec::new();
        let receive = rx.read_to_end(&mut out);
        let ((), _) = tokio::join!(send, receive);
        out
    }

    /// The bytes of run `(layer, side, block)` as the harness wrote them.
    pub fn run_value(layer: u32, side: KvSide, block: u32) -> f32 {
        (layer * 100 + side as u32 * 10 + block) as f32
    }
}

/// D's tcp block read of `req` from the block server at `host:port`, received into `runs`
/// (every run of the local blocks, in wire order): exactly what a decode node's read does,
/// on a fresh connection (so after its handshake with `secret`).
pub async fn block_read(
    host: &str,
    port: u16,
    secret: &MeshSecret,
    req: &XferReadBlocks,
    runs: &mut [&mut [u8]],
    stop_after: Option<u64>,
) -> Result<u64, TransferError> {
    TcpReader::new(host, port, secret.clone()).read(req, runs, stop_after).await
}

/// D's side of the data plane handshake on `stream` (what [`block_read`] does first).
pub async fn authenticate_to_block_server<S>(stream: &mut S, secret: &MeshSecret) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    authenticate_to(stream, secret).await
}

/// P's side of the data plane handshake (the block server's own), for a harness that plays
/// the block server: `Ok` once D proved it knows `secret`.
pub async fn answer_block_server_handshake<S>(stream: &mut S, secret: &MeshSecret) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    authenticate_peer(stream, secret).await
}
