//! Target `side_channel`: a session of frames through P's side channel — the agent's own
//! decode and dispatch (`handle_frame`, what its ROUTER loop calls per frame) — against a real
//! `HoldTable` holding three requests, with the agent's faults chosen by the first byte.
//!
//! Must hold: an undecodable frame gets no answer and is counted; a decodable one gets exactly
//! one answer (none only when `handshake_timeout` withholds a handshake's), which decodes
//! (unless `undecodable_metadata` cut it), carries the request's correlation and request id,
//! and is of a kind that answers the request (or an `Error`).

use std::sync::atomic::Ordering;

use pdmesh_kv_transfer::fuzzing::AgentHarness;
use pdmesh_kv_transfer::FaultConfig;
use pdmesh_protocol::{Envelope, Message, XferGiveUp, XferHeartbeat, XferLeaseRequest, XferReadDone};

/// The agent, built once per process (its region file lives in the temp directory).
pub struct Harness {
    agent: AgentHarness,
}

impl Harness {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("pdmesh-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let agent = AgentHarness::new(&dir.join("side-channel.kv")).expect("harness region");
        Self { agent }
    }

    /// One input: a fault byte, then frames ([`crate::split_frames`]).
    pub fn check(&mut self, data: &[u8]) {
        let Some((&fault_bits, rest)) = data.split_first() else { return };
        let faults = faults(fault_bits);
        self.agent.reset(faults.clone());
        let mut undecodable = 0;
        for frame in crate::split_frames(rest) {
            let reply = self.agent.side_channel_frame(frame);
            let Ok(req) = Envelope::decode(frame) else {
                undecodable += 1;
                assert!(reply.is_none(), "an undecodable frame is dropped, not answered");
                continue;
            };
            let kind = req.body.kind();
            let Some(reply) = reply else {
                assert!(
                    matches!(req.body, Message::XferGetMetadata) && faults.handshake_timeout,
                    "{kind} went unanswered"
                );
                continue;
            };
            let answer = match Envelope::decode(&reply) {
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
            assert_eq!(answer.request_id, req.request_id, "the answer to {kind} carries its request id");
            assert!(answers(&req.body, &answer.body), "{} is no answer to {kind}", answer.body.kind());
        }
        let counted = self.agent.stats().decode_errors.load(Ordering::Relaxed);
        assert_eq!(counted, undecodable, "every undecodable frame is counted");
    }
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
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
            Message::XferMetadata(_) | Message::XferLeaseGranted(_) | Message::XferLeaseRefused(_) | Message::Pong
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

fn lease(id: u64, p_request_id: &str, block_ids: Vec<u32>, generations: Vec<u64>, consumer: &str) -> Vec<u8> {
    let req = XferLeaseRequest {
        p_request_id: p_request_id.into(),
        block_ids,
        block_generations: generations,
        consumer: consumer.into(),
    };
    frame(id, Message::XferLease(req))
}

fn read_done(id: u64, p_request_id: &str, lease_id: u64) -> Vec<u8> {
    frame(
        id,
        Message::XferReadDone(XferReadDone { p_request_id: p_request_id.into(), lease_id, consumer: "d-0".into() }),
    )
}

fn give_up(id: u64, p_request_id: &str, lease_id: Option<u64>, rejected: bool) -> Vec<u8> {
    frame(
        id,
        Message::XferGiveUp(XferGiveUp {
            p_request_id: p_request_id.into(),
            reason: "rejected".into(),
            consumer: "d-0".into(),
            lease_id,
            rejected_at_unix_us: rejected.then_some(1),
        }),
    )
}

/// Real sessions of a decode node (handshake, lease, read done, heartbeat, give up, in the
/// orders D sends them and out of order), every message once on its own, and garbage; each
/// without faults and under each fault.
pub fn seeds() -> Vec<Vec<u8>> {
    let heartbeat = |id: u64, ids: &[&str]| {
        let ids = ids.iter().map(|s| s.to_string()).collect();
        frame(id, Message::XferHeartbeat(XferHeartbeat { p_request_ids: ids, consumer: "d-0".into() }))
    };
    let sessions: Vec<Vec<Vec<u8>>> = vec![
        vec![frame(1, Message::XferGetMetadata)],
        vec![
            frame(1, Message::XferGetMetadata),
            lease(2, "req-0", vec![1, 2], vec![1, 1], "d-0"),
            read_done(3, "req-0", 1),
            read_done(4, "req-0", 1),
        ],
        vec![
            lease(1, "req-1", vec![5], vec![3], "d-0"),
            heartbeat(2, &["req-1", "req-9"]),
            give_up(3, "req-1", Some(1), false),
            lease(4, "req-1", vec![5], vec![3], "d-0"),
        ],
        vec![
            lease(1, "req-2", vec![0, 3], vec![1, 2], "d-0"),
            lease(2, "req-2", vec![0, 3, 7], vec![1, 2, 4], "d-0"),
            lease(3, "req-2", vec![0, 3, 7], vec![1, 2, 3], "d-0"),
            lease(4, "req-2", vec![0, 3, 7], vec![1, 2, 3], "d-0"),
            lease(5, "req-2", vec![0, 3, 7], vec![1, 2, 3], "d-1"),
            give_up(6, "req-2", None, true),
            read_done(7, "req-2", 1),
        ],
        vec![give_up(1, "req-0", None, true), give_up(2, "req-0", None, true), heartbeat(3, &["req-0"])],
        vec![frame(1, Message::Ping), b"\x92\x01\x02".to_vec(), Vec::new(), frame(2, Message::Ack)],
    ];
    let mut seeds = Vec::new();
    for session in &sessions {
        for fault_bits in [0u8, 0xe0 | 1, 0xe0 | 2, 0xe0 | 4, 0xe0 | 8, 0xe0 | 16] {
            let mut seed = vec![fault_bits];
            seed.extend(crate::join_frames(session));
            seeds.push(seed);
        }
    }
    for (i, body) in crate::every_message().into_iter().enumerate() {
        let mut seed = vec![0];
        seed.extend(crate::join_frames(&[frame(i as u64 + 1, body)]));
        seeds.push(seed);
    }
    seeds
}
