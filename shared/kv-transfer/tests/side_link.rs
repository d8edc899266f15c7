//! D's side channel link to one producer is shared by every request to it, and its calls are
//! multiplexed: a rejection's give-up (rule R1) is answered while another request's lease is
//! still waiting for P, and many concurrent calls each get their own answer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use pdmesh_kv_transfer::*;
use pdmesh_mesh_auth::{Channel, ServerChallenge};
use pdmesh_protocol::{Envelope, Message, XferLeaseGranted};
use tokio::sync::mpsc;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// A producer's side channel that answers the handshake with a real agent's metadata and
/// hands every later message to the test, which answers when and in what order it likes.
async fn held_back_side_channel(
    metadata: pdmesh_protocol::AgentMetadata,
) -> (String, mpsc::UnboundedReceiver<(bytes::Bytes, Envelope)>, mpsc::UnboundedSender<(bytes::Bytes, Envelope)>) {
    let mut socket = RouterSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let (to_test, from_p) = mpsc::unbounded_channel();
    let (answer, mut answers) = mpsc::unbounded_channel::<(bytes::Bytes, Envelope)>();
    tokio::spawn(async move {
        let mut challenge = None;
        loop {
            tokio::select! {
                msg = socket.recv() => {
                    let Ok(msg) = msg else { return };
                    let mut frames = msg.into_vec();
                    let peer = frames.remove(0);
                    let env = Envelope::decode(frames.last().unwrap()).unwrap();
                    // The mesh handshake and the metadata are answered at once, as P does.
                    let now = match &env.body {
                        Message::XferGetMetadata => Some(Message::XferMetadata(metadata.clone())),
                        Message::AuthHello(h) => {
                            let (c, reply) = ServerChallenge::answer(&secret(), Channel::SideChannel, h).unwrap();
                            challenge = Some(c);
                            Some(Message::AuthChallenge(reply))
                        }
                        Message::AuthProof(proof) => {
                            challenge.take().unwrap().verify(&secret(), proof).unwrap();
                            Some(Message::Ack)
                        }
                        _ => None,
                    };
                    if let Some(body) = now {
                        let mut out = ZmqMessage::from(env.reply(body).encode().unwrap());
                        out.push_front(peer);
                        socket.send(out).await.unwrap();
                    } else {
                        let _ = to_test.send((peer, env));
                    }
                }
                a = answers.recv() => {
                    let Some((peer, env)) = a else { return };
                    let mut out = ZmqMessage::from(env.encode().unwrap());
                    out.push_front(peer);
                    socket.send(out).await.unwrap();
                }
            }
        }
    });
    (endpoint, from_p, answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_up_is_answered_while_a_lease_waits_on_the_same_link() {
    let p = producer(BackendConfig::Shm, "", 8).await;
    let metadata = p.agent.metadata().clone();
    let (endpoint, mut from_p, answer) = held_back_side_channel(metadata.clone()).await;
    let agent = Arc::new(client_for(spec(4), "").handshake(&endpoint, "p-0").await.unwrap());

    // A lease for one request goes out first; P holds its answer back.
    let lease = tokio::spawn({
        let agent = agent.clone();
        async move { agent.lease("accepted", &cap("accepted"), &[1, 2], &[1, 1]).await }
    });
    let (lease_peer, lease_req) = tokio::time::timeout(Duration::from_secs(10), from_p.recv()).await.unwrap().unwrap();
    assert!(matches!(lease_req.body, Message::XferLease(_)), "{:?}", lease_req.body);

    // Another request's rejection notice on the same link reaches P and is answered at once.
    let give_up = tokio::spawn({
        let agent = agent.clone();
        async move { agent.give_up_at("rejected", &cap("rejected"), "rejected before admission", None, Some(1)).await }
    });
    let (peer, req) = tokio::time::timeout(Duration::from_secs(10), from_p.recv())
        .await
        .expect("the give-up reached P while the lease was unanswered")
        .unwrap();
    let Message::XferGiveUp(g) = &req.body else { panic!("{:?}", req.body) };
    assert_eq!(g.p_request_id, "rejected");
    answer.send((peer, req.reply(Message::Ack))).unwrap();
    tokio::time::timeout(Duration::from_secs(10), give_up).await.expect("give-up answered").unwrap().unwrap();
    assert!(!lease.is_finished(), "the lease still waits for its own answer");

    // Then the lease's answer arrives and goes to the lease, not to anyone else.
    let granted = XferLeaseGranted { lease_id: 77, lease_ttl_ms: 5_000, agent_name: metadata.agent_name.clone() };
    answer.send((lease_peer, lease_req.reply(Message::XferLeaseGranted(granted)))).unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(10), lease).await.unwrap().unwrap().unwrap();
    assert_eq!((lease.lease_id(), lease.p_request_id(), lease.block_ids()), (77, "accepted", &[1u32, 2][..]));
    assert!(agent.is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_on_one_link_each_get_their_own_answer() {
    const N: u32 = 48;
    let p = producer(BackendConfig::Shm, "", N).await;
    for b in 0..N {
        p.hold(&format!("r{b}"), &[b]);
    }
    let agent = Arc::new(client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap());
    // Every request at once: a lease and a read done for even ones, a give-up for odd ones.
    let tasks: Vec<_> = (0..N)
        .map(|b| {
            let agent = agent.clone();
            tokio::spawn(async move {
                let id = format!("r{b}");
                if b % 2 == 1 {
                    return agent.give_up(&id, &cap(&id), "rejected", None).await.map(|()| None);
                }
                let lease = agent.lease(&id, &cap(&id), &[b], &[1]).await?;
                assert_eq!((lease.p_request_id(), lease.block_ids()), (id.as_str(), &[b][..]));
                let mut local = local_cache(spec(4), 0.0);
                agent.read_blocks(&lease, &[b], &mut local, &[0]).await?;
                agent.read_done(&lease).await?;
                Ok::<_, TransferError>(Some(local))
            })
        })
        .collect();
    for (b, t) in tasks.into_iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(30), t).await.unwrap().unwrap().unwrap();
        if let Some(local) = got {
            assert_blocks_moved(&local, &[b as u32], &[0], 0.0);
        }
    }
    let mut finished = p.finished();
    finished.sort();
    let mut want: Vec<String> = (0..N).map(|b| format!("r{b}")).collect();
    want.sort();
    assert_eq!(finished, want, "every request released exactly once");
    assert!(agent.is_healthy());
}
