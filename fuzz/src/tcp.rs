//! Targets `tcp_server` and `tcp_client`: the two ends of the `tcp` data plane.
//!
//! `tcp_server`: the bytes a reader sends go through the block server's connection loop (its
//! request parsing, lease check and answer framing) over an in-memory stream, against a real
//! `HoldTable` with two active leases (1 on `req-0`, blocks 1 and 2; 2 on `req-2`, blocks 0, 3
//! and 7). Must hold: every request frame the server can read gets exactly one answer frame;
//! a `XferReadReady` announces exactly the requested blocks' bytes and is followed by exactly
//! those bytes, in wire order (each float names its run); a frame that is not a read gets an
//! `Error` and the connection ends; nothing else is written.
//!
//! `tcp_client`: the bytes a block server answers with go to D's reader over a real loopback
//! socket. Must hold: the read succeeds exactly when the answer is a `XferReadReady` of the
//! expected size followed by that many bytes, and then the local runs hold those bytes.

use std::sync::Arc;
use std::time::Duration;

use pdmesh_kv_transfer::fuzzing::{block_read, run_bytes, AgentHarness};
use pdmesh_kv_transfer::FaultConfig;
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_protocol::{Envelope, Message, XferReadBlocks, XferReadReady};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The block server's largest request frame (`tcp.rs`'s `MAX_FRAME`).
const MAX_FRAME: usize = 16 << 20;

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
    let len = u32::from_be_bytes(data.get(..4)?.try_into().ok()?) as usize;
    if len > MAX_FRAME {
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

    pub fn check(&mut self, data: &[u8]) {
        self.agent.reset(FaultConfig::none());
        assert_eq!(self.agent.grant("req-0", "d-0"), Some(1));
        assert_eq!(self.agent.grant("req-2", "d-0"), Some(2));
        let out = self.rt.block_on(self.agent.block_server_session(data));
        let mut requests = data;
        let mut answers = out.as_slice();
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
            match answer.body {
                Message::XferReadReady(XferReadReady { blocks, bytes }) => {
                    assert_eq!(blocks as usize, read.block_ids.len());
                    let expected = expected_bytes(&read.block_ids);
                    assert_eq!(bytes, expected.len() as u64, "announced bytes");
                    let (sent, rest) = answers.split_at_checked(expected.len()).expect("the announced bytes follow");
                    assert!(sent == expected.as_slice(), "the blocks' bytes in wire order");
                    answers = rest;
                }
                Message::XferLeaseRefused(_) => {}
                other => panic!("{} answers a read", other.kind()),
            }
        }
        assert!(answers.is_empty(), "{} bytes written that answer nothing", answers.len());
    }
}

impl Default for ServerHarness {
    fn default() -> Self {
        Self::new()
    }
}

/// Reads a reader sends, and the ways they go wrong.
pub fn server_seeds() -> Vec<Vec<u8>> {
    let read = |corr: u64, p: &str, lease_id: u64, block_ids: Vec<u32>| {
        framed(
            &Envelope::new(Message::XferReadBlocks(XferReadBlocks { p_request_id: p.into(), lease_id, block_ids }))
                .with_corr(corr)
                .with_trace(crate::envelope::trace(corr)),
        )
    };
    let concat = |frames: Vec<Vec<u8>>| frames.concat();
    vec![
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
    ]
}

/// D's reader against a loopback "block server" that answers with the fuzzer's bytes.
pub struct ClientHarness {
    rt: tokio::runtime::Runtime,
    listener: Arc<TcpListener>,
    port: u16,
}

/// The read every input answers: `req-0`'s blocks 1 and 2 under lease 1.
fn client_request() -> XferReadBlocks {
    XferReadBlocks { p_request_id: "req-0".into(), lease_id: 1, block_ids: vec![1, 2] }
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

    pub fn check(&mut self, data: &[u8]) {
        let req = client_request();
        let run = run_bytes(&AgentHarness::SPEC);
        let total = client_read_bytes();
        let mut local = vec![0xAAu8; total];
        let listener = self.listener.clone();
        let answer = data.to_vec();
        let result = self.rt.block_on(async {
            let server = tokio::spawn(async move {
                let (mut stream, _) = listener.accept().await.expect("accept");
                // The reader's request frame first, as a block server would.
                let mut len = [0u8; 4];
                stream.read_exact(&mut len).await.expect("request length");
                let mut request = vec![0u8; u32::from_be_bytes(len) as usize];
                stream.read_exact(&mut request).await.expect("request");
                let _ = stream.write_all(&answer).await;
                let _ = stream.shutdown().await;
                let mut sink = Vec::new();
                let _ = stream.read_to_end(&mut sink).await;
                // No TIME_WAIT left behind per input: a long campaign opens millions.
                #[allow(deprecated)]
                let _ = stream.set_linger(Some(Duration::ZERO));
            });
            let mut runs: Vec<&mut [u8]> = local.chunks_mut(run).collect();
            let result = block_read("127.0.0.1", self.port, &req, &mut runs, None).await;
            tokio::time::timeout(Duration::from_secs(10), server).await.expect("the answering side ends").ok();
            result
        });
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

/// What block servers answer: the blocks, refusals, errors, and answers that lie about the
/// size or stop short.
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
    vec![
        [ready(total as u64), payload.clone()].concat(),
        [ready(total as u64), payload[..total / 2].to_vec()].concat(),
        [ready(total as u64 + 16), payload.clone()].concat(),
        [ready(16), payload.clone()].concat(),
        framed(&Envelope::new(refused)),
        framed(&Envelope::new(error)),
        framed(&Envelope::new(Message::Ack)),
        ready(total as u64)[..6].to_vec(),
        Vec::new(),
    ]
}
