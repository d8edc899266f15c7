//! Targets `tcp_server` and `tcp_client`: the two ends of the `tcp` data plane.
//!
//! `tcp_server`: the bytes a reader sends go through the block server's connection loop over
//! an in-memory stream, against a real `HoldTable` holding three requests under capability
//! tokens, with two active leases (1 on `req-0`, blocks 1 and 2; 2 on `req-2`, blocks 0, 3 and
//! 7). The first byte picks the reader: even, one that first ran the real handshake with the
//! mesh secret (so the bytes reach request parsing, the capability and lease check and the
//! answer framing); odd, a foreign peer whose bytes meet the handshake itself.
//! Must hold, authenticated: every request frame the server can read gets exactly one answer
//! frame; a `XferReadReady` comes only for the request's right capability token, announces
//! exactly the requested blocks' bytes and is followed by exactly those bytes, in wire order
//! (each float names its run); a wrong or missing token is refused like an inactive lease and
//! counted; a frame that is not a read gets an `Error` and the connection ends; nothing else
//! is written. Unauthenticated: the server writes at most a challenge (to a good hello) and
//! one `Unauthenticated` refusal, never a block byte, and counts the connection as refused.
//!
//! `tcp_client`: the bytes a block server answers with go to D's reader over a real loopback
//! socket. The first byte picks the server: even, one that runs the real handshake (server
//! side, with the mesh secret) and then answers the read with the rest of the input; odd, an
//! impostor whose answer to D's hello is the rest of the input. Must hold: with the real
//! server, D's request carries the request's capability token, and the read succeeds exactly
//! when the answer is a `XferReadReady` of the expected size followed by that many bytes, and
//! then the local runs hold those bytes; with the impostor, the read fails, D sends it nothing
//! after its hello (no proof, no request, no token) and leaves the local runs untouched.

use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::Ordering;

use pdmesh_kv_transfer::fuzzing::{answer_block_server_handshake, block_read, capability_of, run_bytes, AgentHarness};
use pdmesh_kv_transfer::FaultConfig;
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_protocol::{
    AuthHello, AuthProof, Envelope, ErrorClass, LeaseRefusalReason, Message, XferReadBlocks, XferReadReady,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The block server's largest request frame (`tcp.rs`'s `MAX_FRAME`).
const MAX_FRAME: usize = 16 << 20;
/// The largest frame read before a connection authenticated (`tcp.rs`'s `MAX_AUTH_FRAME`).
const MAX_AUTH_FRAME: usize = 4096;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

/// A length-prefixed frame as the data plane writes it.
pub fn framed(env: &Envelope) -> Vec<u8> {
    let bytes = env.encode().expect("a seed encodes");
    let mut out = (bytes.len() as u32).to_be_bytes().to_vec();
    out.extend(bytes);
    out
}

/// The next frame of `data`: `Some((envelope or error, rest))`, `None` when the reader would
/// stop (end of stream, a cut or oversized frame).
fn next_frame(data: &[u8]) -> Option<(Option<Envelope>, &[u8])> {
    next_frame_limited(data, MAX_FRAME)
}

fn next_frame_limited(data: &[u8], max: usize) -> Option<(Option<Envelope>, &[u8])> {
    let len = u32::from_be_bytes(data.get(..4)?.try_into().ok()?) as usize;
    if len > max {
        return None;
    }
    let body = data.get(4..4 + len)?;
    Some((Envelope::decode(body).ok(), &data[4 + len..]))
}

/// The bytes of `block_ids` in wire order, as [`AgentHarness`] fills its region.
fn expected_bytes(block_ids: &[u32]) -> Vec<u8> {
    let spec = AgentHarness::SPEC;
    let floats = run_bytes(&spec) / 4;
    let mut out = Vec::new();
    for &block in block_ids {
        for layer in 0..spec.num_layers {
            for side in [KvSide::Key, KvSide::Value] {
                let v = AgentHarness::run_value(layer, side, block);
                for _ in 0..floats {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    out
}

/// P's block server, fed by the fuzzer.
pub struct ServerHarness {
    agent: AgentHarness,
    rt: tokio::runtime::Runtime,
}

impl ServerHarness {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("pdmesh-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let agent = AgentHarness::new(&dir.join("tcp-server.kv")).expect("harness region");
        Self { agent, rt: runtime() }
    }

    /// One input: a mode byte (even: authenticated reader), then the reader's bytes.
    pub fn check(&mut self, data: &[u8]) {
        let Some((&mode, data)) = data.split_first() else { return };
        self.agent.reset(FaultConfig::none());
        assert_eq!(self.agent.grant("req-0", "d-0"), Some(1));
        assert_eq!(self.agent.grant("req-2", "d-0"), Some(2));
        let authenticate = mode % 2 == 0;
        let out = self.rt.block_on(self.agent.block_server_session(data, authenticate));
        let out = out.expect("the reader's handshake with the mesh secret succeeds");
        let stats = self.agent.stats();
        if !authenticate {
            check_unauthenticated(data, &out);
            assert_eq!(stats.tcp_unauthenticated.load(Ordering::Relaxed), 1, "the refused connection is counted");
            assert_eq!(stats.tcp_reads.load(Ordering::Relaxed), 0, "no read before the handshake");
            return;
        }
        assert_eq!(stats.tcp_unauthenticated.load(Ordering::Relaxed), 0, "the reader authenticated");
        let mut requests = data;
        let mut answers = out.as_slice();
        let mut wrong_tokens = 0;
        while let Some((request, rest)) = next_frame(requests) {
            requests = rest;
            let Some(request) = request else { break };
            let (answer, rest) = next_frame(answers).expect("a request frame gets an answer frame");
            answers = rest;
            let answer = answer.expect("the answer decodes");
            assert_eq!(answer.corr, request.corr);
            let Message::XferReadBlocks(read) = &request.body else {
                assert!(matches!(answer.body, Message::Error(_)), "a frame that is not a read gets an Error");
                break;
            };
            let spec = AgentHarness::SPEC;
            let in_cache =
                read.block_ids.len() <= spec.num_blocks as usize && read.block_ids.iter().all(|b| *b < spec.num_blocks);
            let expected = capability_of(&read.p_request_id);
            let wrong_token = !expected.is_empty() && read.capability != expected;
            if in_cache && wrong_token {
                wrong_tokens += 1;
            }
            match answer.body {
                Message::XferReadReady(XferReadReady { blocks, bytes }) => {
                    assert!(!wrong_token, "blocks served for a wrong capability token");
                    assert_eq!(blocks as usize, read.block_ids.len());
                    let expected = expected_bytes(&read.block_ids);
                    assert_eq!(bytes, expected.len() as u64, "announced bytes");
                    let (sent, rest) = answers.split_at_checked(expected.len()).expect("the announced bytes follow");
                    assert!(sent == expected.as_slice(), "the blocks' bytes in wire order");
                    answers = rest;
                }
                Message::XferLeaseRefused(r) => {
                    if wrong_token {
                        assert_eq!(
                            r.reason,
                            LeaseRefusalReason::LeaseInvalid,
                            "a wrong token reads as an inactive lease"
                        );
                    }
                }
                other => panic!("{} answers a read", other.kind()),
            }
        }
        assert!(answers.is_empty(), "{} bytes written that answer nothing", answers.len());
        let counted = stats.capability_refused.load(Ordering::Relaxed);
        assert_eq!(counted, wrong_tokens, "every read with a wrong token is counted");
    }
}

/// What the block server may write to a peer that has not authenticated, given what it sent:
/// a challenge to a good first hello, then (or instead) one refusal, and nothing else.
fn check_unauthenticated(sent: &[u8], out: &[u8]) {
    let mut expected: Vec<(u64, bool)> = Vec::new(); // (corr, is the challenge)
    if let Some((Some(first), rest)) = next_frame_limited(sent, MAX_AUTH_FRAME) {
        match &first.body {
            Message::AuthHello(h) if h.channel == "tcp_data" && h.client_nonce.len() == 32 => {
                expected.push((first.corr, true));
                if let Some((Some(second), _)) = next_frame_limited(rest, MAX_AUTH_FRAME) {
                    expected.push((second.corr, false));
                }
            }
            _ => expected.push((first.corr, false)),
        }
    }
    let mut answers = out;
    for (corr, challenge) in expected {
        let (answer, rest) = next_frame(answers).expect("the handshake step is answered");
        answers = rest;
        let answer = answer.expect("the answer decodes");
        assert_eq!(answer.corr, corr);
        if challenge {
            assert!(matches!(answer.body, Message::AuthChallenge(_)), "a good hello is challenged: {:?}", answer.body);
        } else {
            let refused = matches!(&answer.body, Message::Error(e) if e.class == ErrorClass::Unauthenticated);
            assert!(refused, "an unauthenticated peer is refused: {:?}", answer.body);
        }
    }
    assert!(answers.is_empty(), "{} bytes written to an unauthenticated peer beyond the handshake", answers.len());
}

impl Default for ServerHarness {
    fn default() -> Self {
        Self::new()
    }
}

/// Reads a reader sends (with the right, a wrong and no capability token), and the ways they
/// go wrong; each after the handshake, and each from a foreign peer, with handshake frames of
/// such a peer (good and bad hellos, a forged proof).
pub fn server_seeds() -> Vec<Vec<u8>> {
    let read_as = |corr: u64, p: &str, lease_id: u64, block_ids: Vec<u32>, capability: String| {
        framed(
            &Envelope::new(Message::XferReadBlocks(XferReadBlocks {
                p_request_id: p.into(),
                lease_id,
                block_ids,
                capability,
            }))
            .with_corr(corr)
            .with_trace(crate::envelope::trace(corr)),
        )
    };
    let read = |corr: u64, p: &str, lease_id: u64, block_ids: Vec<u32>| {
        read_as(corr, p, lease_id, block_ids, capability_of(p).into())
    };
    let concat = |frames: Vec<Vec<u8>>| frames.concat();
    let hello = |corr: u64, channel: &str, nonce: usize| {
        framed(
            &Envelope::new(Message::AuthHello(AuthHello { channel: channel.into(), client_nonce: vec![3; nonce] }))
                .with_corr(corr),
        )
    };
    let proof =
        |corr: u64| framed(&Envelope::new(Message::AuthProof(AuthProof { client_proof: vec![5; 32] })).with_corr(corr));
    let streams = vec![
        read(1, "req-0", 1, vec![1, 2]),
        read(1, "req-0", 1, vec![2]),
        read(1, "req-2", 2, vec![7, 0, 3]),
        concat(vec![read(1, "req-0", 1, vec![1, 2]), read(2, "req-2", 2, vec![3]), read(3, "req-0", 1, vec![2, 1])]),
        read(1, "req-0", 2, vec![1, 2]),
        read(1, "req-0", 1, vec![5]),
        read(1, "req-0", 1, vec![9]),
        read(1, "req-1", 1, vec![5]),
        read(1, "req-0", 1, vec![1; 9]),
        concat(vec![read(1, "req-0", 1, vec![1]), framed(&Envelope::new(Message::Ping).with_corr(2))]),
        concat(vec![read(1, "req-0", 1, vec![1]), vec![0, 0, 0, 3, 1, 2, 3]]),
        concat(vec![read(1, "req-0", 1, vec![1]), (MAX_FRAME as u32 + 1).to_be_bytes().to_vec()]),
        read(1, "req-0", 1, vec![1, 2])[..10].to_vec(),
        read_as(1, "req-0", 1, vec![1, 2], "ffffffffffffffffffffffffffffffff".into()),
        read_as(1, "req-2", 2, vec![0], String::new()),
        read_as(1, "req-2", 2, vec![3], capability_of("req-0").into()),
        concat(vec![read_as(1, "req-0", 1, vec![1], String::new()), read(2, "req-0", 1, vec![1, 2])]),
        concat(vec![hello(1, "tcp_data", 32), proof(2), read(3, "req-0", 1, vec![1])]),
        concat(vec![hello(1, "side_channel", 32), read(2, "req-0", 1, vec![1])]),
        concat(vec![hello(1, "tcp_data", 4), proof(2)]),
        proof(1),
    ];
    let mut seeds = Vec::new();
    for stream in streams {
        for mode in [0u8, 1] {
            seeds.push([vec![mode], stream.clone()].concat());
        }
    }
    seeds
}

/// D's reader against a loopback "block server" that answers with the fuzzer's bytes.
pub struct ClientHarness {
    rt: tokio::runtime::Runtime,
    listener: Arc<TcpListener>,
    port: u16,
}

/// The read every input answers: `req-0`'s blocks 1 and 2 under lease 1, with its token.
fn client_request() -> XferReadBlocks {
    XferReadBlocks {
        p_request_id: "req-0".into(),
        lease_id: 1,
        block_ids: vec![1, 2],
        capability: capability_of("req-0").into(),
    }
}

/// Bytes of the read [`client_request`] asks for.
fn client_read_bytes() -> usize {
    client_request().block_ids.len() * 2 * AgentHarness::SPEC.num_layers as usize * run_bytes(&AgentHarness::SPEC)
}

impl ClientHarness {
    pub fn new() -> Self {
        let rt = runtime();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).expect("bind loopback");
        let port = listener.local_addr().expect("bound address").port();
        Self { rt, listener: Arc::new(listener), port }
    }

    /// One input: a mode byte (even: a real block server; odd: an impostor), then the answer.
    pub fn check(&mut self, data: &[u8]) {
        let Some((&mode, data)) = data.split_first() else { return };
        let impostor = mode % 2 == 1;
        let req = client_request();
        let run = run_bytes(&AgentHarness::SPEC);
        let total = client_read_bytes();
        let mut local = vec![0xAAu8; total];
        let listener = self.listener.clone();
        let answer = data.to_vec();
        let (result, received) = self.rt.block_on(async {
            let server = tokio::spawn(async move {
                let (mut stream, _) = listener.accept().await.expect("accept");
                let mut request = None;
                if impostor {
                    // A server without the secret reads D's hello and answers anything.
                    let hello = read_raw_frame(&mut stream).await.expect("D's hello");
                    let hello = Envelope::decode(&hello).expect("D's hello decodes");
                    assert!(matches!(hello.body, Message::AuthHello(_)), "D starts with a hello");
                } else {
                    // The block server's own side of the handshake, then the reader's request
                    // frame, as a block server would.
                    answer_block_server_handshake(&mut stream, &AgentHarness::secret())
                        .await
                        .expect("D proves the mesh secret");
                    request = Some(read_raw_frame(&mut stream).await.expect("D's request"));
                }
                let _ = stream.write_all(&answer).await;
                let _ = stream.shutdown().await;
                let mut rest = Vec::new();
                let _ = stream.read_to_end(&mut rest).await;
                // No TIME_WAIT left behind per input: a long campaign opens millions.
                #[allow(deprecated)]
                let _ = stream.set_linger(Some(Duration::ZERO));
                (request, rest)
            });
            let mut runs: Vec<&mut [u8]> = local.chunks_mut(run).collect();
            let result = block_read("127.0.0.1", self.port, &AgentHarness::secret(), &req, &mut runs, None).await;
            let received =
                tokio::time::timeout(Duration::from_secs(10), server).await.expect("the answering side ends");
            (result, received.expect("the answering side does not panic"))
        });
        let (request, after) = received;
        if impostor {
            assert!(result.is_err(), "a read from a server that did not prove the mesh secret succeeded");
            assert!(local.iter().all(|b| *b == 0xAA), "an impostor's bytes reached the local runs");
            assert!(after.is_empty(), "D sent an impostor {} bytes after its hello", after.len());
            return;
        }
        let request = request.expect("the real server read the request");
        let request = Envelope::decode(&request).expect("D's request decodes");
        assert_eq!(request.body, Message::XferReadBlocks(req.clone()), "D asks for the read, with its token");
        let expect_ok = match next_frame(data) {
            Some((Some(Envelope { body: Message::XferReadReady(r), .. }), rest)) => {
                r.bytes == total as u64 && rest.len() >= total
            }
            _ => false,
        };
        match result {
            Ok(n) => {
                assert!(expect_ok, "the read succeeded on an answer that does not deliver the blocks");
                assert_eq!(n, total as u64);
                let (_, rest) = next_frame(data).expect("checked above");
                assert!(local.as_slice() == &rest[..total], "the local runs hold the bytes sent");
            }
            Err(e) => assert!(!expect_ok, "the read failed on a complete answer: {e}"),
        }
    }
}

impl Default for ClientHarness {
    fn default() -> Self {
        Self::new()
    }
}

/// One length-prefixed frame's bytes, as read from a socket.
async fn read_raw_frame<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other("oversized frame"));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf).await?;
    Ok(buf)
}

/// What block servers answer: the blocks, refusals, errors, and answers that lie about the
/// size or stop short; each after the handshake, and each as an impostor's answer to D's
/// hello, with handshake answers (a challenge with a made-up proof, a refusal).
pub fn client_seeds() -> Vec<Vec<u8>> {
    let total = client_read_bytes();
    let ready =
        |bytes: u64| framed(&Envelope::new(Message::XferReadReady(XferReadReady { blocks: 2, bytes })).with_corr(0));
    let payload = expected_bytes(&client_request().block_ids);
    let refused = Message::XferLeaseRefused(pdmesh_protocol::XferLeaseRefused {
        reason: pdmesh_protocol::LeaseRefusalReason::LeaseInvalid,
        detail: "lease 1 has expired".into(),
    });
    let error = Message::Error(pdmesh_protocol::WireError::new(pdmesh_protocol::ErrorClass::InvalidRequest, "no"));
    let challenge = framed(&Envelope::new(Message::AuthChallenge(pdmesh_protocol::AuthChallenge {
        server_nonce: vec![1; 32],
        server_proof: vec![2; 32],
    })));
    let unauthenticated = framed(&Envelope::new(Message::Error(pdmesh_protocol::WireError::new(
        ErrorClass::Unauthenticated,
        "unauthenticated: wrong mesh secret",
    ))));
    let answers = vec![
        [ready(total as u64), payload.clone()].concat(),
        [ready(total as u64), payload[..total / 2].to_vec()].concat(),
        [ready(total as u64 + 16), payload.clone()].concat(),
        [ready(16), payload.clone()].concat(),
        framed(&Envelope::new(refused)),
        framed(&Envelope::new(error)),
        framed(&Envelope::new(Message::Ack)),
        ready(total as u64)[..6].to_vec(),
        Vec::new(),
        [challenge.clone(), framed(&Envelope::new(Message::Ack))].concat(),
        [challenge, ready(total as u64), payload].concat(),
        unauthenticated,
    ];
    let mut seeds = Vec::new();
    for answer in answers {
        for mode in [0u8, 1] {
            seeds.push([vec![mode], answer.clone()].concat());
        }
    }
    seeds
}
