//! Foreign peers against P's side channel and `tcp` block server (docs/SECURITY.md): raw
//! ZeroMQ DEALERs and raw TCP sockets with no secret, a wrong secret, a replayed proof, and the
//! right secret but a wrong capability token for a real held request. They get no metadata and
//! no block bytes, the hold stays as it was and is still served to the real reader, and every
//! refusal is counted. D, for its part, refuses a producer that cannot prove the secret.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use pdmesh_kv_transfer::*;
use pdmesh_mesh_auth::{client_proof, Channel, ClientHello, MeshSecret};
use pdmesh_protocol::{
    AuthHello, AuthProof, Envelope, ErrorClass, LeaseRefusalReason, Message, XferGiveUp, XferHeartbeat,
    XferLeaseRequest, XferReadBlocks, XferReadDone,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use zeromq::{DealerSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const UNTOUCHED: f32 = -7.0;

fn wrong_secret() -> MeshSecret {
    MeshSecret::parse("not-the-mesh-secret-but-long-enough-0000").unwrap()
}

/// A raw DEALER on P's side channel (what any host that can reach the port can open).
async fn raw_dealer(endpoint: &str) -> DealerSocket {
    let mut s = DealerSocket::new();
    s.connect(endpoint).await.unwrap();
    s
}

async fn ask(s: &mut DealerSocket, body: Message) -> Message {
    s.send(ZmqMessage::from(Envelope::new(body).encode().unwrap())).await.unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(5), s.recv()).await.expect("an answer").unwrap();
    Envelope::decode(&msg.into_vec().pop().unwrap()).unwrap().body
}

fn assert_unauthenticated(m: &Message, what: &str) {
    match m {
        Message::Error(e) => assert_eq!(e.class, ErrorClass::Unauthenticated, "{what}: {e:?}"),
        other => panic!("{what}: a foreign peer got {other:?}"),
    }
}

/// Every request kind a foreign peer might try, for the real held request `r` with its real
/// capability and a plausible lease id.
fn everything_for(id: &str, token: &str, lease_id: u64) -> Vec<Message> {
    vec![
        Message::XferGetMetadata,
        Message::XferLease(XferLeaseRequest {
            p_request_id: id.into(),
            block_ids: vec![1, 2],
            block_generations: vec![1, 1],
            consumer: "intruder".into(),
            capability: token.into(),
        }),
        Message::XferHeartbeat(XferHeartbeat {
            p_request_ids: vec![id.into()],
            consumer: "intruder".into(),
            capabilities: vec![token.into()],
        }),
        Message::XferReadDone(XferReadDone {
            p_request_id: id.into(),
            lease_id,
            consumer: "intruder".into(),
            capability: token.into(),
        }),
        Message::XferGiveUp(XferGiveUp {
            p_request_id: id.into(),
            reason: "intruder".into(),
            consumer: "intruder".into(),
            lease_id: Some(lease_id),
            rejected_at_unix_us: None,
            capability: token.into(),
        }),
        Message::Ping,
    ]
}

/// P still holds `r` exactly as before, and the real reader gets its bytes.
async fn real_reader_still_served(p: &Producer, backend: &str) {
    assert!(p.table.lock().unwrap().is_held("r"), "{backend}: the hold was disturbed");
    assert_eq!(p.table.lock().unwrap().lease_of("r"), None, "{backend}: a foreign peer took the lease");
    let agent = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
    let lease = agent.lease("r", &cap("r"), &[1, 2], &[1, 1]).await.unwrap();
    let mut local = local_cache(spec(4), UNTOUCHED);
    agent.read_blocks(&lease, &[1, 2], &mut local, &[0, 3]).await.unwrap();
    agent.read_done(&lease).await.unwrap();
    assert_blocks_moved(&local, &[1, 2], &[0, 3], UNTOUCHED);
    assert_eq!(p.finished(), vec!["r".to_string()], "{backend}: released by the real read done only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_secret_gets_only_refusals_on_the_side_channel() {
    for backend in [BackendConfig::Shm, tcp_backend()] {
        let name = format!("{backend:?}");
        let p = producer(backend, "", 8).await;
        p.hold("r", &[1, 2]);
        let counted = || p.agent.stats().unauthenticated.load(Ordering::Relaxed);

        // No handshake at all: even with the real capability token, nothing is served.
        let mut raw = raw_dealer(&p.endpoint()).await;
        for m in everything_for("r", &cap("r"), 1) {
            assert_unauthenticated(&ask(&mut raw, m).await, &name);
        }
        assert_eq!(counted(), 6, "{name}: every refusal is counted");
        // A proof without a challenge is refused too.
        assert_unauthenticated(
            &ask(&mut raw, Message::AuthProof(AuthProof { client_proof: vec![0; 32] })).await,
            &name,
        );

        // A wrong secret: P's proof does not verify for the intruder, and its own proof fails.
        let (client, hello) = ClientHello::new(Channel::SideChannel);
        let Message::AuthChallenge(challenge) = ask(&mut raw, Message::AuthHello(hello.clone())).await else {
            panic!("{name}: no challenge")
        };
        assert!(client.answer(&wrong_secret(), &challenge).is_err(), "{name}: P proved itself to the wrong secret");
        let forged = client_proof(&wrong_secret(), Channel::SideChannel, &hello.client_nonce, &challenge.server_nonce);
        assert_unauthenticated(&ask(&mut raw, Message::AuthProof(AuthProof { client_proof: forged })).await, &name);
        assert_unauthenticated(&ask(&mut raw, Message::XferGetMetadata).await, &name);

        // Replay: a good proof from one connection is worthless on another, whose challenge
        // has a fresh server nonce (even when the client nonce is repeated).
        let mut good = raw_dealer(&p.endpoint()).await;
        let Message::AuthChallenge(c1) = ask(&mut good, Message::AuthHello(hello.clone())).await else { panic!() };
        let proof = client.answer(&secret(), &c1).unwrap();
        let mut replayer = raw_dealer(&p.endpoint()).await;
        let Message::AuthChallenge(c2) = ask(&mut replayer, Message::AuthHello(hello.clone())).await else { panic!() };
        assert_ne!(c1.server_nonce, c2.server_nonce);
        assert_unauthenticated(&ask(&mut replayer, Message::AuthProof(proof.clone())).await, &name);
        assert_unauthenticated(&ask(&mut replayer, Message::XferGetMetadata).await, &name);
        // ... while on its own connection it authenticates, and only that connection is served.
        assert_eq!(ask(&mut good, Message::AuthProof(proof)).await, Message::Ack);
        assert!(matches!(ask(&mut good, Message::XferGetMetadata).await, Message::XferMetadata(_)));
        assert_unauthenticated(&ask(&mut raw, Message::XferGetMetadata).await, &name);
        // A hello for another channel gets no challenge.
        let other = AuthHello { channel: "tcp_data".into(), ..hello };
        assert_unauthenticated(&ask(&mut raw, Message::AuthHello(other)).await, &name);

        assert!(counted() >= 12, "{name}: {}", counted());
        assert_eq!(p.agent.stats().metadata_requests.load(Ordering::Relaxed), 1, "{name}: only the authenticated peer");
        assert_eq!(p.agent.stats().leases_granted.load(Ordering::Relaxed), 0);
        assert_eq!(p.agent.stats().give_ups.load(Ordering::Relaxed), 0);
        real_reader_still_served(&p, &name).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_with_the_wrong_secret_is_refused_and_refuses_an_impostor() {
    let p = producer(BackendConfig::Shm, "", 8).await;
    p.hold("r", &[1, 2]);
    let mut config = ClientConfig::new("d-0/0", spec(4), hash_of(&spec(4)), wrong_secret());
    config.handshake_timeout = Duration::from_secs(2);
    match TransferClient::new(config).handshake(&p.endpoint(), "p-0").await {
        Err(HandshakeError::Unauthenticated(why)) => assert!(why.contains("mesh"), "{why}"),
        other => panic!("handshake with a wrong secret: {other:?}"),
    }
    assert_eq!(p.agent.stats().metadata_requests.load(Ordering::Relaxed), 0);

    // An impostor P (a ROUTER that does not know the secret) answers the hello with a made-up
    // proof: D refuses it and never sends it a metadata request, let alone a lease.
    let mut fake = RouterSocket::new();
    let endpoint = fake.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let seen = tokio::spawn(async move {
        let mut kinds = Vec::new();
        while let Ok(Ok(msg)) = tokio::time::timeout(Duration::from_secs(3), fake.recv()).await {
            let mut frames = msg.into_vec();
            let peer = frames.remove(0);
            let env = Envelope::decode(&frames.pop().unwrap()).unwrap();
            kinds.push(env.body.kind());
            if let Message::AuthHello(h) = &env.body {
                let made_up =
                    pdmesh_mesh_auth::server_proof(&wrong_secret(), Channel::SideChannel, &h.client_nonce, &[9; 32]);
                let reply = env.reply(Message::AuthChallenge(pdmesh_protocol::AuthChallenge {
                    server_nonce: vec![9; 32],
                    server_proof: made_up,
                }));
                let mut out = ZmqMessage::from(reply.encode().unwrap());
                out.push_front(peer);
                fake.send(out).await.unwrap();
            }
        }
        kinds
    });
    let err = client_for(spec(4), "").handshake(&endpoint, "p-0").await.unwrap_err();
    assert!(matches!(err, HandshakeError::Unauthenticated(_)), "{err:?}");
    assert_eq!(seen.await.unwrap(), vec!["auth_hello"], "D sent the impostor nothing after its hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_right_secret_with_a_wrong_capability_is_refused_like_an_unknown_request() {
    let p = producer(tcp_backend(), "", 8).await;
    p.hold("r", &[1, 2]);
    let insider = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
    let wrong = pdmesh_mesh_auth::new_capability();

    // A lease: the same refusal, word for word, as for a request P never held.
    let refusal = |r: Result<Lease, TransferError>| match r {
        Err(TransferError::LeaseRefused { reason, detail }) => (reason, detail.replace("ghost", "r")),
        other => panic!("{other:?}"),
    };
    let forged = refusal(insider.lease("r", &wrong, &[1, 2], &[1, 1]).await);
    let unknown = refusal(insider.lease("ghost", &wrong, &[1, 2], &[1, 1]).await);
    assert_eq!(forged, unknown, "no oracle: a held request looks unknown without its token");
    assert_eq!(forged.0, LeaseRefusalReason::Gone);
    assert_eq!(refusal(insider.lease("r", "", &[1, 2], &[1, 1]).await), unknown, "no token at all");

    // Notices: a give-up and a heartbeat are acknowledged as for an unknown id, and change
    // nothing.
    let before = p.table.lock().unwrap().counters().clone();
    insider.give_up("r", &wrong, "forged", None).await.unwrap();
    insider.heartbeat(&[("r".into(), wrong.clone())]).await.unwrap();
    let after = p.table.lock().unwrap().counters().clone();
    assert_eq!(
        (after.give_ups, after.heartbeats, after.released),
        (before.give_ups, before.heartbeats, before.released)
    );
    assert!(p.table.lock().unwrap().is_held("r"));

    // The real reader leases; a forger with the lease id (but not the token) can neither read
    // on the data plane nor end the lease with a read done or a give-up.
    let reader = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
    let lease = reader.lease("r", &cap("r"), &[1, 2], &[1, 1]).await.unwrap();
    let mut stream = authenticated_tcp(&p, &secret()).await;
    let read = XferReadBlocks {
        p_request_id: "r".into(),
        lease_id: lease.lease_id(),
        block_ids: vec![1, 2],
        capability: wrong.clone(),
    };
    match tcp_call(&mut stream, Message::XferReadBlocks(read)).await {
        Message::XferLeaseRefused(r) => assert_eq!(r.reason, LeaseRefusalReason::LeaseInvalid),
        other => panic!("a forged read got {other:?}"),
    }
    let mut raw = raw_dealer(&p.endpoint()).await;
    authenticate_raw(&mut raw, &secret()).await;
    let done = XferReadDone {
        p_request_id: "r".into(),
        lease_id: lease.lease_id(),
        consumer: "x".into(),
        capability: wrong.clone(),
    };
    assert!(matches!(ask(&mut raw, Message::XferReadDone(done)).await, Message::Error(_)));
    let give_up = XferGiveUp {
        p_request_id: "r".into(),
        reason: "forged".into(),
        consumer: "x".into(),
        lease_id: Some(lease.lease_id()),
        rejected_at_unix_us: None,
        capability: wrong,
    };
    assert_eq!(ask(&mut raw, Message::XferGiveUp(give_up)).await, Message::Ack);
    assert_eq!(p.table.lock().unwrap().lease_of("r"), Some(lease.lease_id()), "the real lease stands");
    assert!(p.finished().is_empty());
    let refused = p.agent.stats().capability_refused.load(Ordering::Relaxed);
    assert_eq!(refused, 7, "every forged message is counted");

    // The real reader still gets exactly P's bytes.
    let mut local = local_cache(spec(4), UNTOUCHED);
    reader.read_blocks(&lease, &[1, 2], &mut local, &[2, 0]).await.unwrap();
    reader.read_done(&lease).await.unwrap();
    assert_blocks_moved(&local, &[1, 2], &[2, 0], UNTOUCHED);
    assert_eq!(p.finished(), vec!["r".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_server_serves_no_byte_before_the_mesh_handshake() {
    let p = producer(tcp_backend(), "", 8).await;
    p.hold("r", &[1, 2]);
    // A real reader's lease, so a read request names a live lease and the real token.
    let reader = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
    let lease = reader.lease("r", &cap("r"), &[1, 2], &[1, 1]).await.unwrap();
    let read = || XferReadBlocks {
        p_request_id: "r".into(),
        lease_id: lease.lease_id(),
        block_ids: vec![1, 2],
        capability: cap("r"),
    };
    let counted = || p.agent.stats().tcp_unauthenticated.load(Ordering::Relaxed);

    // No handshake: a read request, with every right id and the token, gets one refusal and
    // a closed connection; not a byte of KV.
    let mut s = TcpStream::connect(data_addr(&p)).await.unwrap();
    match tcp_call(&mut s, Message::XferReadBlocks(read())).await {
        Message::Error(e) => assert_eq!(e.class, ErrorClass::Unauthenticated),
        other => panic!("{other:?}"),
    }
    assert_closed(&mut s).await;
    assert_eq!(counted(), 1);

    // A wrong secret: refused and closed after the proof.
    let mut s = TcpStream::connect(data_addr(&p)).await.unwrap();
    let (client, hello) = ClientHello::new(Channel::TcpData);
    let Message::AuthChallenge(c) = tcp_call(&mut s, Message::AuthHello(hello.clone())).await else { panic!() };
    assert!(client.answer(&wrong_secret(), &c).is_err(), "P proved itself to the wrong secret");
    let forged = client_proof(&wrong_secret(), Channel::TcpData, &hello.client_nonce, &c.server_nonce);
    assert!(matches!(
        tcp_call(&mut s, Message::AuthProof(AuthProof { client_proof: forged })).await,
        Message::Error(_)
    ));
    assert_closed(&mut s).await;
    assert_eq!(counted(), 2);

    // A side-channel proof is no good on the data plane (channels are bound into the proof).
    let mut s = TcpStream::connect(data_addr(&p)).await.unwrap();
    let side_hello = AuthHello { channel: "side_channel".into(), ..hello };
    assert!(matches!(tcp_call(&mut s, Message::AuthHello(side_hello)).await, Message::Error(_)));
    assert_closed(&mut s).await;

    // A peer that opens a connection and says nothing is dropped, not served.
    let mut idle = TcpStream::connect(data_addr(&p)).await.unwrap();
    assert_closed_within(&mut idle, Duration::from_secs(10)).await;

    assert_eq!(p.agent.stats().tcp_bytes_sent.load(Ordering::Relaxed), 0, "no KV byte left P");
    assert!(counted() >= 4);
    // The real reader is served.
    let mut local = local_cache(spec(4), UNTOUCHED);
    reader.read_blocks(&lease, &[1, 2], &mut local, &[0, 1]).await.unwrap();
    reader.read_done(&lease).await.unwrap();
    assert_blocks_moved(&local, &[1, 2], &[0, 1], UNTOUCHED);
}

fn data_addr(p: &Producer) -> String {
    match &p.agent.metadata().backend {
        pdmesh_protocol::TransferBackend::Tcp { host, port } => format!("{host}:{port}"),
        other => panic!("{other:?}"),
    }
}

async fn tcp_call(s: &mut TcpStream, body: Message) -> Message {
    let bytes = Envelope::new(body).encode().unwrap();
    s.write_all(&(bytes.len() as u32).to_be_bytes()).await.unwrap();
    s.write_all(&bytes).await.unwrap();
    let mut len = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut len)).await.unwrap().unwrap();
    let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut buf).await.unwrap();
    Envelope::decode(&buf).unwrap().body
}

async fn assert_closed(s: &mut TcpStream) {
    assert_closed_within(s, Duration::from_secs(5)).await;
}

/// P closes the connection: the next read sees its end (or a reset), never data.
async fn assert_closed_within(s: &mut TcpStream, limit: Duration) {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(limit, s.read(&mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) => {}
        Ok(Ok(n)) => panic!("{n} more bytes after a refusal"),
        Err(_) => panic!("the connection stayed open"),
    }
}

/// A raw data-plane connection that completed the mesh handshake with `secret`.
async fn authenticated_tcp(p: &Producer, secret: &MeshSecret) -> TcpStream {
    let mut s = TcpStream::connect(data_addr(p)).await.unwrap();
    let (client, hello) = ClientHello::new(Channel::TcpData);
    let Message::AuthChallenge(c) = tcp_call(&mut s, Message::AuthHello(hello)).await else { panic!() };
    let proof = client.answer(secret, &c).unwrap();
    assert_eq!(tcp_call(&mut s, Message::AuthProof(proof)).await, Message::Ack);
    s
}

async fn authenticate_raw(s: &mut DealerSocket, secret: &MeshSecret) {
    let (client, hello) = ClientHello::new(Channel::SideChannel);
    let Message::AuthChallenge(c) = ask(s, Message::AuthHello(hello)).await else { panic!() };
    let proof = client.answer(secret, &c).unwrap();
    assert_eq!(ask(s, Message::AuthProof(proof)).await, Message::Ack);
}
