//! Issue 40, defect 7: undecodable side-channel frames are counted (in the agent's stats and
//! `pdmesh_kv_side_channel_undecodable_frames_total`) and logged at most once a second, with
//! the number not logged — 5,000 garbage frames are not 5,000 WARN lines. A test binary of its
//! own: it captures every log line of the process.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use pdmesh_kv_transfer::*;
use pdmesh_mesh_auth::{Channel, ClientHello};
use pdmesh_protocol::{Envelope, Message};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn ask(s: &mut DealerSocket, body: Message) -> Message {
    s.send(ZmqMessage::from(Envelope::new(body).encode().unwrap())).await.unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(10), s.recv()).await.expect("an answer").unwrap();
    Envelope::decode(&msg.into_vec().pop().unwrap()).unwrap().body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_frames_are_counted_and_logged_at_most_once_a_second() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt().with_ansi(false).with_writer(move || writer.clone()).finish(),
    )
    .unwrap();
    let p = producer(BackendConfig::Shm, "", 8).await;
    let mut s = DealerSocket::new();
    s.connect(&p.endpoint()).await.unwrap();
    let (client, hello) = ClientHello::new(Channel::SideChannel);
    let Message::AuthChallenge(challenge) = ask(&mut s, Message::AuthHello(hello)).await else {
        panic!("no challenge")
    };
    assert_eq!(ask(&mut s, Message::AuthProof(client.answer(&secret(), &challenge).unwrap())).await, Message::Ack);

    let metric_before = pdmesh_mesh_auth::metrics::UNDECODABLE_FRAMES.get();
    let started = Instant::now();
    for i in 0..5000u32 {
        s.send(ZmqMessage::from(format!("not an envelope {i}").into_bytes())).await.unwrap();
    }
    // Frames of one peer are answered in order: the Pong comes after every garbage frame.
    assert_eq!(ask(&mut s, Message::Ping).await, Message::Pong);
    let elapsed = started.elapsed().as_secs();

    assert_eq!(p.agent.stats().decode_errors.load(Ordering::Relaxed), 5000, "every frame is counted");
    assert_eq!(pdmesh_mesh_auth::metrics::UNDECODABLE_FRAMES.get() - metric_before, 5000, "and in the metric");
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let lines = text.lines().filter(|l| l.contains("undecodable frame")).count() as u64;
    assert!(lines >= 1, "the first one is logged:\n{text}");
    assert!(lines <= 1 + elapsed + 1, "{lines} log lines in {elapsed} s:\n{}", &text[..text.len().min(4000)]);
    assert!(text.contains("suppressed") || lines == 1, "{text}");
}
