//! Target `side_channel`: a session of frames through P's side channel — the agent's own
//! decode, mesh authentication and dispatch (`handle_frame`, what its ROUTER loop calls per
//! frame, with the agent's real per-peer handshake state) — against a real `HoldTable` holding
//! three requests under capability tokens, with the agent's faults chosen by the second byte.
//!
//! The first byte picks who sends the frames ([`Mode`]): a decode node that ran the real
//! handshake with the mesh secret first (so the frames reach the lease and notice handlers),
//! a peer that never authenticated or failed with another mesh's secret (the surface a foreign
//! peer sees), or an authenticated node and a foreign peer taking turns.
//!
//! Must hold, for every frame:
//! - an undecodable frame gets no answer and is counted;
//! - a decodable one gets exactly one answer (none only when `handshake_timeout` withholds a
//!   metadata answer), which decodes (unless `undecodable_metadata` cut it) and carries the
//!   request's correlation and request id;
//! - a peer that has not completed the handshake gets a challenge to a good hello and an
//!   `Unauthenticated` refusal to anything else, and nothing it sends reaches the policy (no
//!   lease, notice or metadata counter moves; every held request stays held); every refusal is
//!   counted;
//! - an `auth_hello` or `auth_proof` on an authenticated session ends it (a fuzzer cannot
//!   forge a proof), so the peer's next frames are refused;
//! - from an authenticated peer, the answer is of a kind that answers the request; a lease,
//!   read done, give up or heartbeat entry that names a held request with a wrong (or missing)
//!   token is refused exactly as for an unknown request, counted, and leaves the request held;
//!   only the right token gets a lease granted or a read done acknowledged;
//! - a lease for a request P does not hold may be parked (no answer yet: its hold may still
//!   register, D65); once its wait ends it gets exactly one answer, a refusal, to its peer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pdmesh_kv_transfer::fuzzing::{capability_of, held_requests, AgentHarness};
use pdmesh_kv_transfer::{AgentStats, CapabilityCheck, FaultConfig, MeshSecret};
use pdmesh_protocol::{
    AuthHello, AuthProof, Envelope, ErrorClass, LeaseRefusalReason, Message, XferGiveUp, XferHeartbeat,
    XferLeaseRequest, XferReadDone,
};

/// The ROUTER routing ids of the two peers (P assigns real ones at random; any bytes do).
/// Routing ids as P's ROUTER names connections (16 random bytes, shaped as a UUID v4): P
/// authenticates no connection whose peer chose its own identity (D96).
const NODE: &[u8] = b"\x11\x22\x33\x44\x55\x66\x47\x77\x88\x99\xaa\xbb\xcc\xdd\xee\xff";
const FOREIGN: &[u8] = b"\xf1\xe2\xd3\xc4\xb5\xa6\x47\x97\xa8\x79\x6a\x5b\x4c\x3d\x2e\x1f";

/// Who sends an input's frames (its first byte, modulo 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A decode node that completed the handshake with the mesh secret.
    Authenticated,
    /// A peer that never sent a hello.
    Unauthenticated,
    /// A peer whose handshake with another mesh's secret P refused.
    WrongSecret,
    /// The authenticated node and a foreign peer (never authenticated) send alternate frames.
    Interleaved,
}

impl Mode {
    pub fn from_byte(b: u8) -> Self {
        match b % 4 {
            0 => Mode::Authenticated,
            1 => Mode::Unauthenticated,
            2 => Mode::WrongSecret,
            _ => Mode::Interleaved,
        }
    }

    pub fn byte(self) -> u8 {
        match self {
            Mode::Authenticated => 0,
            Mode::Unauthenticated => 1,
            Mode::WrongSecret => 2,
            Mode::Interleaved => 3,
        }
    }
}

/// The agent, built once per process (its region file lives in the temp directory).
pub struct Harness {
    agent: AgentHarness,
    /// Another mesh's secret, for [`Mode::WrongSecret`].
    other_mesh: MeshSecret,
}

/// Counters of what reached the policy and the dispatch behind authentication.
fn reached(stats: &AgentStats) -> u64 {
    let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
    c(&stats.metadata_requests)
        + c(&stats.leases_granted)
        + c(&stats.leases_refused)
        + c(&stats.read_done)
        + c(&stats.read_done_rejected)
        + c(&stats.heartbeats)
        + c(&stats.give_ups)
        + c(&stats.unexpected_messages)
}

impl Harness {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("pdmesh-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let agent = AgentHarness::new(&dir.join("side-channel.kv")).expect("harness region");
        let other_mesh = MeshSecret::parse("another-mesh-secret-of-at-least-32-bytes").expect("a secret");
        Self { agent, other_mesh }
    }

    /// One input: a mode byte, a fault byte, then frames ([`crate::split_frames`]).
    pub fn check(&mut self, data: &[u8]) {
        let [mode, fault_bits, rest @ ..] = data else { return };
        let mode = Mode::from_byte(*mode);
        let faults = faults(*fault_bits);
        self.agent.reset(faults.clone());
        let mut node_authed = false;
        match mode {
            Mode::Authenticated | Mode::Interleaved => {
                assert!(self.agent.side_channel_handshake(NODE, &AgentHarness::secret()), "the handshake succeeds");
                node_authed = true;
            }
            Mode::WrongSecret => {
                assert!(!self.agent.side_channel_handshake(NODE, &self.other_mesh), "another mesh's proof is refused");
                assert_eq!(self.agent.stats().unauthenticated.load(Ordering::Relaxed), 1, "the refusal is counted");
            }
            Mode::Unauthenticated => {}
        }
        let refusals_before = self.agent.stats().unauthenticated.load(Ordering::Relaxed);
        let mut undecodable = 0;
        let mut refused = 0;
        let mut reached_expected = 0;
        let mut pings = 0;
        for (i, frame) in crate::split_frames(rest).into_iter().enumerate() {
            let foreign = mode == Mode::Interleaved && i % 2 == 1;
            let (peer, authed) = if foreign { (FOREIGN, false) } else { (NODE, node_authed) };
            let Ok(req) = Envelope::decode(frame) else {
                undecodable += 1;
                assert!(self.agent.side_channel_frame(peer, frame).is_none(), "an undecodable frame is dropped");
                continue;
            };
            let kind = req.body.kind();
            let before = self.observe(&req.body);
            let reached_before = reached(self.agent.stats());
            let reply = self.agent.side_channel_frame(peer, frame);
            let reply = reply.map(|r| Envelope::decode(&r));
            match &req.body {
                Message::AuthHello(hello) => {
                    let answer = reply.expect("a hello is answered").expect("the answer decodes");
                    assert_eq!(answer.corr, req.corr);
                    if hello_ok(hello) {
                        assert!(matches!(answer.body, Message::AuthChallenge(_)), "a good hello is challenged");
                    } else {
                        assert!(is_refusal(&answer.body), "a bad hello is refused: {:?}", answer.body);
                        refused += 1;
                    }
                    if !foreign {
                        node_authed = false;
                    }
                }
                Message::AuthProof(AuthProof { .. }) => {
                    let answer = reply.expect("a proof is answered").expect("the answer decodes");
                    assert!(is_refusal(&answer.body), "a proof nobody could compute is refused: {:?}", answer.body);
                    refused += 1;
                    if !foreign {
                        node_authed = false;
                    }
                }
                _ if !authed => {
                    let answer = reply.expect("an unauthenticated peer is answered").expect("the refusal decodes");
                    assert_eq!(answer.corr, req.corr);
                    assert_eq!(answer.request_id, None, "a refusal echoes nothing the peer sent");
                    assert!(is_refusal(&answer.body), "{kind} before the handshake got {:?}", answer.body);
                    refused += 1;
                }
                _ => {
                    reached_expected += 1;
                    if matches!(req.body, Message::Ping) {
                        pings += 1;
                    }
                    let Some(reply) = reply else {
                        if let Message::XferLease(lease) = &req.body {
                            self.check_parked(peer, &req, lease, &before);
                            continue;
                        }
                        assert!(
                            matches!(req.body, Message::XferGetMetadata) && faults.handshake_timeout,
                            "{kind} went unanswered"
                        );
                        continue;
                    };
                    let answer = match reply {
                        Ok(answer) => answer,
                        Err(e) => {
                            assert!(
                                matches!(req.body, Message::XferGetMetadata) && faults.undecodable_metadata,
                                "the answer to {kind} does not decode: {e}"
                            );
                            continue;
                        }
                    };
                    assert_eq!(answer.corr, req.corr, "the answer to {kind} carries its correlation id");
                    assert_eq!(answer.request_id, echoed(&req), "the answer to {kind} carries its (short) request id");
                    assert!(!is_refusal(&answer.body), "an authenticated peer's {kind} was refused as unauthenticated");
                    assert!(answers(&req.body, &answer.body), "{} is no answer to {kind}", answer.body.kind());
                    self.check_capabilities(&req.body, &answer.body, &before, &faults);
                    continue;
                }
            }
            // Refused or a handshake step: nothing reached the policy.
            assert_eq!(reached(self.agent.stats()), reached_before, "{kind} from an unauthenticated peer reached P");
            assert_eq!(self.observe(&req.body).refused, before.refused, "no capability was checked for {kind}");
        }
        let stats = self.agent.stats();
        assert_eq!(stats.decode_errors.load(Ordering::Relaxed), undecodable, "every undecodable frame is counted");
        let refusals = stats.unauthenticated.load(Ordering::Relaxed) - refusals_before;
        assert_eq!(refusals, refused, "every refusal of an unauthenticated peer is counted");
        assert_eq!(reached(stats) + pings, reached_expected, "only authenticated frames reach the handlers");
        if reached_expected == 0 {
            for (id, ..) in held_requests() {
                let held = self.agent.capability_check(id, "");
                assert_eq!(held, CapabilityCheck::Mismatch, "{id} is still held: nothing authenticated touched it");
            }
        }
    }

    /// A lease the policy parked (it arrived before its hold registered, D65): only a request
    /// P does not hold is parked, and once its wait ends it gets exactly one answer, to its
    /// peer, with its correlation and request id: a refusal, since no hold registers here.
    fn check_parked(&mut self, peer: &[u8], req: &Envelope, lease: &XferLeaseRequest, before: &Observed) {
        assert_eq!(
            before.checks.first(),
            Some(&CapabilityCheck::NotHeld),
            "a lease for {} was parked though P holds it",
            lease.p_request_id
        );
        let answers = self.agent.parked_answers_at(Instant::now() + Duration::from_secs(3600));
        assert_eq!(answers.len(), 1, "a parked lease is answered once its wait ends");
        let (to, bytes) = &answers[0];
        assert_eq!(to.as_slice(), peer, "a parked lease's answer goes to the peer that asked");
        let answer = Envelope::decode(bytes).expect("a parked lease's answer decodes");
        assert_eq!(answer.corr, req.corr, "a parked lease's answer carries its correlation id");
        assert_eq!(answer.request_id, echoed(req), "a parked lease's answer carries its (short) request id");
        assert!(
            matches!(answer.body, Message::XferLeaseRefused(_)),
            "a lease for a hold that never registered got {:?}",
            answer.body
        );
    }

    /// The capability state of the requests `msg` names, and the refusal counter, before it.
    fn observe(&self, msg: &Message) -> Observed {
        let entries: Vec<(String, String)> = match msg {
            Message::XferLease(r) => vec![(r.p_request_id.clone(), r.capability.clone())],
            Message::XferReadDone(n) => vec![(n.p_request_id.clone(), n.capability.clone())],
            Message::XferGiveUp(g) => vec![(g.p_request_id.clone(), g.capability.clone())],
            Message::XferHeartbeat(h) => h
                .p_request_ids
                .iter()
                .enumerate()
                .map(|(i, id)| (id.clone(), h.capabilities.get(i).cloned().unwrap_or_default()))
                .collect(),
            _ => Vec::new(),
        };
        let checks = entries.iter().map(|(id, token)| self.agent.capability_check(id, token)).collect();
        Observed { entries, checks, refused: self.agent.stats().capability_refused.load(Ordering::Relaxed) }
    }

    /// The capability rules (module doc) for an authenticated peer's `request`, answered with
    /// `answer`, given what held before it.
    fn check_capabilities(&self, request: &Message, answer: &Message, before: &Observed, faults: &FaultConfig) {
        let mismatches = before.checks.iter().filter(|c| **c == CapabilityCheck::Mismatch).count() as u64;
        let kind = request.kind();
        let checked = !(matches!(request, Message::XferLease(_)) && faults.lease_refused);
        let refused_now = self.agent.stats().capability_refused.load(Ordering::Relaxed) - before.refused;
        assert_eq!(refused_now, if checked { mismatches } else { 0 }, "wrong tokens counted for {kind}");
        if checked {
            for ((id, _), check) in before.entries.iter().zip(&before.checks) {
                if *check == CapabilityCheck::Mismatch {
                    let held = self.agent.capability_check(id, "");
                    assert_eq!(held, CapabilityCheck::Mismatch, "{kind} with a wrong token released {id}");
                }
            }
        }
        let single = before.checks.first().copied();
        match (request, answer) {
            (Message::XferLease(_), Message::XferLeaseGranted(_)) => {
                assert_eq!(single, Some(CapabilityCheck::Match), "a lease granted without the right token");
            }
            (Message::XferLease(_), Message::XferLeaseRefused(r)) if checked && mismatches > 0 => {
                assert_eq!(r.reason, LeaseRefusalReason::Gone, "a wrong token is refused as an unknown request");
            }
            (Message::XferReadDone(_), Message::Ack) => {
                assert_eq!(single, Some(CapabilityCheck::Match), "a read done acknowledged without the right token");
            }
            _ => {}
        }
    }
}

/// What [`Harness::observe`] saw.
struct Observed {
    entries: Vec<(String, String)>,
    checks: Vec<CapabilityCheck>,
    refused: u64,
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether P answers `hello` with a challenge (the side channel's label, a 32-byte nonce).
fn hello_ok(hello: &AuthHello) -> bool {
    hello.channel == "side_channel" && hello.client_nonce.len() == pdmesh_mesh_auth::NONCE_LEN
}

/// The request id an answer to `req` carries: the request's own when it is at most 128 bytes,
/// none otherwise (P echoes nothing long a peer sent, D95).
fn echoed(req: &Envelope) -> Option<String> {
    req.request_id.clone().filter(|id| id.len() <= 128)
}

fn is_refusal(body: &Message) -> bool {
    matches!(body, Message::Error(e) if e.class == ErrorClass::Unauthenticated)
}

/// The agent's faults from one byte (bit 0..4: handshake timeout, compat mismatch,
/// undecodable metadata, engine id mismatch, lease refused); most inputs run with none.
pub fn faults(bits: u8) -> FaultConfig {
    if bits & 0xe0 != 0xe0 {
        return FaultConfig::none();
    }
    FaultConfig {
        handshake_timeout: bits & 1 != 0,
        compat_mismatch: bits & 2 != 0,
        undecodable_metadata: bits & 4 != 0,
        engine_id_mismatch: bits & 8 != 0,
        lease_refused: bits & 16 != 0,
        ..FaultConfig::none()
    }
}

/// Whether `answer` is a possible answer to `request` (an `Error` answers anything: a
/// refusal, or a message a newer peer sent and this agent does not serve).
fn answers(request: &Message, answer: &Message) -> bool {
    if matches!(answer, Message::Error(_)) {
        return true;
    }
    match request {
        Message::XferGetMetadata => matches!(answer, Message::XferMetadata(_)),
        Message::XferLease(_) => matches!(answer, Message::XferLeaseGranted(_) | Message::XferLeaseRefused(_)),
        Message::XferReadDone(_) | Message::XferHeartbeat(_) | Message::XferGiveUp(_) => matches!(answer, Message::Ack),
        Message::Ping => matches!(answer, Message::Pong),
        // Messages the side channel does not serve today are refused with an `Error` (above);
        // any other answer to them is only checked for its framing.
        _ => !matches!(
            answer,
            Message::XferMetadata(_)
                | Message::XferLeaseGranted(_)
                | Message::XferLeaseRefused(_)
                | Message::Pong
                | Message::AuthChallenge(_)
        ),
    }
}

fn frame(id: u64, body: Message) -> Vec<u8> {
    Envelope::new(body)
        .with_corr(id)
        .with_request_id(format!("d-req-{id}"))
        .with_trace(crate::envelope::trace(id))
        .encode()
        .expect("a seed encodes")
}

/// `p_request_id`'s token, or a wrong one (`Some(false)`), or none (`None`).
fn token(p_request_id: &str, right: Option<bool>) -> String {
    match right {
        Some(true) => capability_of(p_request_id).into(),
        Some(false) => "ffffffffffffffffffffffffffffffff".into(),
        None => String::new(),
    }
}

fn lease(id: u64, p_request_id: &str, block_ids: Vec<u32>, generations: Vec<u64>, consumer: &str) -> Vec<u8> {
    lease_with(id, p_request_id, block_ids, generations, consumer, Some(true))
}

fn lease_with(
    id: u64,
    p_request_id: &str,
    block_ids: Vec<u32>,
    generations: Vec<u64>,
    consumer: &str,
    right: Option<bool>,
) -> Vec<u8> {
    let req = XferLeaseRequest {
        p_request_id: p_request_id.into(),
        block_ids,
        block_generations: generations,
        consumer: consumer.into(),
        capability: token(p_request_id, right),
    };
    frame(id, Message::XferLease(req))
}

fn read_done(id: u64, p_request_id: &str, lease_id: u64, right: Option<bool>) -> Vec<u8> {
    frame(
        id,
        Message::XferReadDone(XferReadDone {
            p_request_id: p_request_id.into(),
            lease_id,
            consumer: "d-0".into(),
            capability: token(p_request_id, right),
        }),
    )
}

fn give_up(id: u64, p_request_id: &str, lease_id: Option<u64>, rejected: bool, right: Option<bool>) -> Vec<u8> {
    frame(
        id,
        Message::XferGiveUp(XferGiveUp {
            p_request_id: p_request_id.into(),
            reason: "rejected".into(),
            consumer: "d-0".into(),
            lease_id,
            rejected_at_unix_us: rejected.then_some(1),
            capability: token(p_request_id, right),
        }),
    )
}

fn heartbeat(id: u64, ids: &[(&str, Option<bool>)]) -> Vec<u8> {
    frame(
        id,
        Message::XferHeartbeat(XferHeartbeat {
            p_request_ids: ids.iter().map(|(s, _)| s.to_string()).collect(),
            consumer: "d-0".into(),
            capabilities: ids.iter().map(|(s, right)| token(s, *right)).collect(),
        }),
    )
}

/// Real sessions of a decode node (metadata, lease, read done, heartbeat, give up, in the
/// orders D sends them and out of order), the same with wrong and missing tokens, handshake
/// frames in the middle of a session, every message once on its own, and garbage; each in
/// every [`Mode`], without faults and under each fault.
pub fn seeds() -> Vec<Vec<u8>> {
    let hello = |id: u64, channel: &str, nonce: usize| {
        frame(id, Message::AuthHello(AuthHello { channel: channel.into(), client_nonce: vec![7; nonce] }))
    };
    let proof = |id: u64| frame(id, Message::AuthProof(AuthProof { client_proof: vec![9; 32] }));
    let sessions: Vec<Vec<Vec<u8>>> = vec![
        vec![frame(1, Message::XferGetMetadata)],
        vec![
            frame(1, Message::XferGetMetadata),
            lease(2, "req-0", vec![1, 2], vec![1, 1], "d-0"),
            read_done(3, "req-0", 1, Some(true)),
            read_done(4, "req-0", 1, Some(true)),
        ],
        vec![
            lease(1, "req-1", vec![5], vec![3], "d-0"),
            heartbeat(2, &[("req-1", Some(true)), ("req-9", None)]),
            give_up(3, "req-1", Some(1), false, Some(true)),
            lease(4, "req-1", vec![5], vec![3], "d-0"),
        ],
        vec![
            lease(1, "req-2", vec![0, 3], vec![1, 2], "d-0"),
            lease(2, "req-2", vec![0, 3, 7], vec![1, 2, 4], "d-0"),
            lease(3, "req-2", vec![0, 3, 7], vec![1, 2, 3], "d-0"),
            lease(4, "req-2", vec![0, 3, 7], vec![1, 2, 3], "d-0"),
            lease(5, "req-2", vec![0, 3, 7], vec![1, 2, 3], "d-1"),
            give_up(6, "req-2", None, true, Some(true)),
            read_done(7, "req-2", 1, Some(true)),
        ],
        vec![
            give_up(1, "req-0", None, true, Some(true)),
            give_up(2, "req-0", None, true, Some(true)),
            heartbeat(3, &[("req-0", Some(true))]),
        ],
        // Wrong and missing tokens: refused as unknown, counted, nothing released.
        vec![
            lease_with(1, "req-0", vec![1, 2], vec![1, 1], "d-0", Some(false)),
            lease_with(2, "req-0", vec![1, 2], vec![1, 1], "d-0", None),
            lease(3, "req-0", vec![1, 2], vec![1, 1], "d-0"),
            read_done(4, "req-0", 1, Some(false)),
            give_up(5, "req-0", Some(1), false, None),
            heartbeat(6, &[("req-0", Some(false)), ("req-1", Some(true)), ("req-2", None)]),
            read_done(7, "req-0", 1, Some(true)),
        ],
        vec![give_up(1, "req-1", None, true, Some(false)), give_up(2, "req-2", None, false, None)],
        // Handshake frames on a session: a new hello (good or bad) or a stray proof ends it.
        vec![
            lease(1, "req-0", vec![1, 2], vec![1, 1], "d-0"),
            hello(2, "side_channel", 32),
            proof(3),
            frame(4, Message::Ping),
        ],
        vec![hello(1, "tcp_data", 32), hello(2, "side_channel", 8), frame(3, Message::XferGetMetadata)],
        vec![proof(1), lease(2, "req-1", vec![5], vec![3], "d-0")],
        vec![frame(1, Message::Ping), b"\x92\x01\x02".to_vec(), Vec::new(), frame(2, Message::Ack)],
    ];
    let modes = [Mode::Authenticated, Mode::Unauthenticated, Mode::WrongSecret, Mode::Interleaved];
    let mut seeds = Vec::new();
    for session in &sessions {
        for mode in modes {
            for fault_bits in [0u8, 0xe0 | 1, 0xe0 | 2, 0xe0 | 4, 0xe0 | 8, 0xe0 | 16] {
                if mode != Mode::Authenticated && fault_bits != 0 {
                    continue;
                }
                let mut seed = vec![mode.byte(), fault_bits];
                seed.extend(crate::join_frames(session));
                seeds.push(seed);
            }
        }
    }
    for (i, body) in crate::every_message().into_iter().enumerate() {
        for mode in [Mode::Authenticated, Mode::Unauthenticated] {
            let mut seed = vec![mode.byte(), 0];
            seed.extend(crate::join_frames(&[frame(i as u64 + 1, body.clone())]));
            seeds.push(seed);
        }
    }
    seeds
}
