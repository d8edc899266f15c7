//! Sealed `tcp://` links (docs/DECISIONS.md D45) over real sockets, with the key installed the
//! way a service installs it ([`seal_tcp_links`]) and the plain functions every service calls.
//! Foreign peers are raw `zeromq` sockets: one without the secret (plain Envelopes), one with
//! another secret, and a recorder that replays a genuine frame or forges an old one.
//!
//! These tests fail if a socket delivers (or answers) a frame that is unsealed, sealed under
//! another key, replayed or stale; if a refusal is not counted, or counted more than once; if a
//! sealed link stops working after foreign frames; or if frames leave a `tcp://` socket unsealed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Once;
use std::time::Duration;

use actix::prelude::*;
use pdmesh_mesh_auth::frame::{unix_ms_now, Direction, FrameOpener, FrameSealer, LinkBinding, FRESHNESS_WINDOW};
use pdmesh_mesh_auth::MeshSecret;
use pdmesh_protocol::{Envelope, Message};
use pdmesh_transport::*;
use tokio::sync::mpsc;
use zeromq::{DealerSocket, PullSocket, PushSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const SECRET: &str = "transport-seal-test-secret-0123456789abcdef";
const NODE: &str = "p";

fn key() -> LinkKey {
    LinkKey::derive(&MeshSecret::parse(SECRET).unwrap(), NODE)
}

fn foreign_key() -> LinkKey {
    LinkKey::derive(&MeshSecret::parse("another-mesh-secret-0123456789abcdefghij").unwrap(), NODE)
}

/// The process-wide installation a service makes at start-up (once per test binary).
fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| seal_tcp_links(key()).unwrap());
    assert!(tcp_links_sealed());
    assert_eq!(seal_tcp_links(key()), Err(AlreadySealed), "one key per process");
}

/// Records every message a ROUTER or PULL delivers, and answers Ping with Pong.
struct Sink {
    router: Option<RouterHandle>,
    seen: mpsc::UnboundedSender<String>,
}
impl Actor for Sink {
    type Context = Context<Self>;
}
struct SetRouter(RouterHandle);
impl actix::Message for SetRouter {
    type Result = ();
}
impl Handler<SetRouter> for Sink {
    type Result = ();
    fn handle(&mut self, m: SetRouter, _: &mut Context<Self>) {
        self.router = Some(m.0);
    }
}
impl Handler<RouterEvent> for Sink {
    type Result = ();
    fn handle(&mut self, ev: RouterEvent, _: &mut Context<Self>) {
        if let RouterEvent::Message { peer, envelope } = ev {
            let _ = self.seen.send(label(&envelope));
            if let (Message::Ping, Some(r)) = (&envelope.body, &self.router) {
                let _ = r.send(&peer, envelope.reply(Message::Pong));
            }
        }
    }
}
impl Handler<PullEvent> for Sink {
    type Result = ();
    fn handle(&mut self, ev: PullEvent, _: &mut Context<Self>) {
        let _ = self.seen.send(label(&ev.envelope));
    }
}
impl Handler<LinkEvent> for Sink {
    type Result = ();
    fn handle(&mut self, _: LinkEvent, _: &mut Context<Self>) {}
}

/// A message is told apart by its request id (the tests name each one).
fn label(e: &Envelope) -> String {
    format!("{}:{}", e.body.kind(), e.request_id.as_deref().unwrap_or("-"))
}

fn named(body: Message, id: &str) -> Envelope {
    let mut e = Envelope::new(body);
    e.request_id = Some(id.to_string());
    e
}

fn bytes(e: &Envelope) -> Vec<u8> {
    e.encode().unwrap()
}

async fn next(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("a delivered message").unwrap()
}

fn port_of(endpoint: &str) -> u16 {
    endpoint.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// `pdmesh_transport_frames_refused_total{endpoint,reason}` now.
fn refused(endpoint: &str, reason: &str) -> u64 {
    prometheus::gather()
        .iter()
        .filter(|f| f.name() == "pdmesh_transport_frames_refused_total")
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| {
            let has = |n: &str, v: &str| m.get_label().iter().any(|l| l.name() == n && l.value() == v);
            has("endpoint", endpoint) && has("reason", reason)
        })
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

fn unauthenticated_internal() -> u64 {
    pdmesh_mesh_auth::metrics::UNAUTHENTICATED.with_label_values(&["internal"]).get()
}

#[actix_rt::test]
async fn sealed_links_round_trip_and_put_only_sealed_frames_on_the_wire() {
    install();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let sink = Sink { router: None, seen: seen_tx }.start();
    let router = bind_router("tcp://127.0.0.1:0", sink.clone().recipient()).await.unwrap();
    sink.send(SetRouter(router.clone())).await.unwrap();
    let link = connect_dealer(LinkConfig::new(router.endpoint()).identity("engine-0"), sink.clone().recipient());
    assert!(LinkConfig::new(router.endpoint()).seal.is_sealed());
    assert!(!LinkConfig::new("ipc:///tmp/x.sock").seal.is_sealed(), "ipc stays plain");
    for i in 0..50 {
        let reply = loop {
            match link.call(named(Message::Ping, &format!("c{i}")), Duration::from_secs(5)).await {
                Err(TransportError::Unavailable(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
                other => break other.unwrap(),
            }
        };
        assert_eq!(reply.body, Message::Pong);
        assert_eq!(next(&mut seen).await, format!("ping:c{i}"));
    }

    // PUSH -> PULL, 200 messages in order.
    let pull = bind_pull("tcp://127.0.0.1:0", sink.clone().recipient()).await.unwrap();
    let push = connect_push(&pull);
    for i in 0..200 {
        push.send(named(Message::Pong, &format!("s{i}"))).unwrap();
    }
    for i in 0..200 {
        assert_eq!(next(&mut seen).await, format!("pong:s{i}"));
    }

    // What a PUSH puts on the wire is sealed for its link: a raw PULL sees the marker, and the
    // opener of that port and direction, with the node's key, opens it into the Envelope.
    let mut raw = PullSocket::new();
    let raw_ep = raw.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let push = connect_push(&raw_ep);
    push.send(named(Message::Pong, "wire")).unwrap();
    let frame = tokio::time::timeout(Duration::from_secs(10), raw.recv()).await.unwrap().unwrap();
    let frame = frame.into_vec().pop().unwrap();
    assert_eq!(frame[0], 0xC1, "sealed frames start with the marker");
    assert!(Envelope::decode(&frame).is_err(), "a sealed frame is not an Envelope");
    let mut opener = FrameOpener::new(key(), LinkBinding::new(port_of(&raw_ep), Direction::ToBound));
    let env = Envelope::decode(opener.open(&frame).unwrap()).unwrap();
    assert_eq!(label(&env), "pong:wire");
}

#[actix_rt::test]
async fn foreign_unsealed_forged_replayed_and_stale_frames_reach_nobody() {
    install();
    let before = unauthenticated_internal();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let sink = Sink { router: None, seen: seen_tx }.start();
    let router = bind_router("tcp://127.0.0.1:0", sink.clone().recipient()).await.unwrap();
    sink.send(SetRouter(router.clone())).await.unwrap();
    let ep = router.endpoint().to_string();
    let port = port_of(&ep);
    let to_router = LinkBinding::new(port, Direction::ToBound);

    // ---- ROUTER: a raw DEALER sends, in order on one connection, an unsealed Envelope, one
    // sealed under another secret, one sealed for the reply direction (reflected), then a
    // genuine frame (as a member would), that same frame again, and a genuine but stale one.
    let mut dealer = DealerSocket::new();
    dealer.connect(&ep).await.unwrap();
    let mut member = FrameSealer::new(key(), to_router);
    let mut stranger = FrameSealer::new(foreign_key(), to_router);
    let mut reflected = FrameSealer::new(key(), LinkBinding::new(port, Direction::FromBound));
    let genuine = member.seal(&bytes(&named(Message::Ping, "genuine")));
    let stale = member
        .seal_at(&bytes(&named(Message::Ping, "stale")), unix_ms_now() - FRESHNESS_WINDOW.as_millis() as u64 - 60_000);
    for frame in [
        bytes(&named(Message::Ping, "unsealed")),
        stranger.seal(&bytes(&named(Message::Ping, "foreign-key"))),
        reflected.seal(&bytes(&named(Message::Ping, "reflected"))),
        genuine.clone(),
        genuine.clone(),
        stale,
    ] {
        dealer.send(ZmqMessage::from(frame)).await.unwrap();
    }
    // Only the genuine frame is delivered, once, and answered (sealed for the way back).
    assert_eq!(next(&mut seen).await, "ping:genuine");
    let reply = tokio::time::timeout(Duration::from_secs(5), dealer.recv()).await.unwrap().unwrap();
    let reply = reply.into_vec().pop().unwrap();
    let mut back = FrameOpener::new(key(), LinkBinding::new(port, Direction::FromBound));
    assert_eq!(Envelope::decode(back.open(&reply).unwrap()).unwrap().body, Message::Pong);
    // A sentinel after them: once it arrives every earlier frame was handled (one connection,
    // one socket task, in order), so nothing else can still be delivered or answered.
    dealer.send(ZmqMessage::from(member.seal(&bytes(&named(Message::Ping, "sentinel"))))).await.unwrap();
    assert_eq!(next(&mut seen).await, "ping:sentinel");
    let reply = tokio::time::timeout(Duration::from_secs(5), dealer.recv()).await.unwrap().unwrap();
    let reply = Envelope::decode(back.open(&reply.into_vec().pop().unwrap()).unwrap()).unwrap();
    assert_eq!(reply.body, Message::Pong, "the refused pings got no answer: the next reply answers the sentinel");
    assert_eq!(refused(&ep, "unsealed"), 1);
    assert_eq!(refused(&ep, "bad_tag"), 2, "another secret; the reply direction");
    assert_eq!(refused(&ep, "replayed"), 1);
    assert_eq!(refused(&ep, "stale"), 1);

    // ---- PULL: the same from a raw PUSH.
    let pull = bind_pull("tcp://127.0.0.1:0", sink.clone().recipient()).await.unwrap();
    let to_pull = LinkBinding::new(port_of(&pull), Direction::ToBound);
    let mut push = PushSocket::new();
    push.connect(&pull).await.unwrap();
    let mut member = FrameSealer::new(key(), to_pull);
    let mut stranger = FrameSealer::new(foreign_key(), to_pull);
    // A genuine frame of the ROUTER's link is worth nothing on this one (another port).
    let mut other_link = FrameSealer::new(key(), to_router);
    let genuine = member.seal(&bytes(&named(Message::Pong, "genuine")));
    let stale = member.seal_at(&bytes(&named(Message::Pong, "stale")), unix_ms_now() + 10 * 60_000);
    for frame in [
        bytes(&named(Message::Pong, "unsealed")),
        stranger.seal(&bytes(&named(Message::Pong, "foreign-key"))),
        other_link.seal(&bytes(&named(Message::Pong, "other-link"))),
        genuine.clone(),
        genuine,
        stale,
        member.seal(&bytes(&named(Message::Pong, "sentinel"))),
    ] {
        push.send(ZmqMessage::from(frame)).await.unwrap();
    }
    assert_eq!(next(&mut seen).await, "pong:genuine");
    assert_eq!(next(&mut seen).await, "pong:sentinel", "nothing refused was delivered in between");
    assert_eq!(refused(&pull, "unsealed"), 1);
    assert_eq!(refused(&pull, "bad_tag"), 2, "another secret; another link");
    assert_eq!(refused(&pull, "replayed"), 1);
    assert_eq!(refused(&pull, "stale"), 1);

    // Every refusal counted once under the mesh's unauthenticated counter (no other test of
    // this binary sends a frame that is refused).
    assert_eq!(unauthenticated_internal() - before, 10);

    // The sealed sockets still serve their own peers afterwards.
    let link = connect_dealer(LinkConfig::new(&ep), sink.clone().recipient());
    let reply = loop {
        match link.call(named(Message::Ping, "after"), Duration::from_secs(5)).await {
            Err(TransportError::Unavailable(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
            other => break other.unwrap(),
        }
    };
    assert_eq!(reply.body, Message::Pong);
    assert_eq!(next(&mut seen).await, "ping:after");
    connect_push(&pull).send(named(Message::Pong, "after")).unwrap();
    assert_eq!(next(&mut seen).await, "pong:after");
}

/// On a sealed link the DEALER claims no routing id, so a stranger that connects claiming the
/// same id cannot take over its route (the zeromq crate's ROUTER gives an id to whichever
/// connection claimed it last and drops the earlier one): the member's link stays up and its
/// replies keep reaching it. Fails if the DEALER sets its identity on a sealed link.
#[actix_rt::test]
async fn a_stranger_claiming_a_members_identity_gets_none_of_its_traffic() {
    install();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let sink = Sink { router: None, seen: seen_tx }.start();
    let router = bind_router("tcp://127.0.0.1:0", sink.clone().recipient()).await.unwrap();
    sink.send(SetRouter(router.clone())).await.unwrap();
    let link = connect_dealer(LinkConfig::new(router.endpoint()).identity("engine-0"), sink.clone().recipient());
    let call = |id: &'static str| {
        let link = link.clone();
        async move {
            loop {
                match link.call(named(Message::Ping, id), Duration::from_secs(5)).await {
                    Err(TransportError::Unavailable(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
                    other => break other,
                }
            }
        }
    };
    assert_eq!(call("first").await.unwrap().body, Message::Pong);
    assert_eq!(next(&mut seen).await, "ping:first");

    let mut options = zeromq::SocketOptions::default();
    options.peer_identity("engine-0".parse().unwrap());
    let mut impostor = DealerSocket::with_options(options);
    impostor.connect(router.endpoint()).await.unwrap();
    // Wait until the ROUTER holds the impostor's connection: a frame of it is delivered (the
    // test holds the key, so the frame passes; a stranger's would be dropped, which changes
    // nothing about routing). Not a Ping, so nothing is answered to "engine-0".
    let port = port_of(router.endpoint());
    let mut sealer = FrameSealer::new(key(), LinkBinding::new(port, Direction::ToBound));
    impostor.send(ZmqMessage::from(sealer.seal(&bytes(&named(Message::Pong, "impostor"))))).await.unwrap();
    assert_eq!(next(&mut seen).await, "pong:impostor");
    // The member's next call is answered, to the member, at once: with the id claimed by the
    // impostor, the ROUTER would have dropped the member's connection (its frames unread, the
    // link down until it reconnects and claims the id back).
    let reply = link.call(named(Message::Ping, "second"), Duration::from_secs(5)).await;
    assert_eq!(reply.map(|r| r.body), Ok(Message::Pong));
    assert_eq!(next(&mut seen).await, "ping:second");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), impostor.recv()).await.is_err(),
        "the impostor received the member's reply"
    );
}
