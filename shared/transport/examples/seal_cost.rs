//! What sealing a node's internal `tcp://` links (docs/DECISIONS.md D45) costs, side by side
//! in one run.
//!
//! ```text
//! cargo run --release -p pdmesh-transport --example seal_cost [-- --rounds 10 --calls 2000 --pushes 20000]
//! ```
//!
//! Two pairs of real sockets on loopback, one plain and one sealed, used in alternating rounds
//! so both see the same machine noise:
//! - request/reply: a DEALER calls, a ROUTER answers (`Ping` → `Pong`, the smallest frames, so
//!   the largest relative cost), one call at a time;
//! - stream: a PUSH sends engine output batches (32 requests, one token each, as a decode step
//!   of 32 sequences) to a PULL, as fast as it can; timed until the last one is delivered;
//! - the CPU cost of sealing and opening one frame of 64 B, 1 KiB and 16 KiB.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench code: fail loudly

use std::time::{Duration, Instant};

use actix::prelude::*;
use pdmesh_mesh_auth::frame::{Direction, FrameOpener, FrameSealer, LinkBinding};
use pdmesh_mesh_auth::MeshSecret;
use pdmesh_protocol::{EngineOutput, EngineOutputBatch, Envelope, Message};
use pdmesh_transport::*;
use tokio::sync::mpsc;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Answers Ping with Pong on its ROUTER; counts what its PULL delivers.
struct Echo {
    router: Option<RouterHandle>,
    pulled: mpsc::UnboundedSender<()>,
}
impl Actor for Echo {
    type Context = Context<Self>;
}
struct SetRouter(RouterHandle);
impl actix::Message for SetRouter {
    type Result = ();
}
impl Handler<SetRouter> for Echo {
    type Result = ();
    fn handle(&mut self, m: SetRouter, _: &mut Context<Self>) {
        self.router = Some(m.0);
    }
}
impl Handler<RouterEvent> for Echo {
    type Result = ();
    fn handle(&mut self, ev: RouterEvent, _: &mut Context<Self>) {
        if let (RouterEvent::Message { peer, envelope }, Some(r)) = (ev, &self.router) {
            let _ = r.send(&peer, envelope.reply(Message::Pong));
        }
    }
}
impl Handler<PullEvent> for Echo {
    type Result = ();
    fn handle(&mut self, _: PullEvent, _: &mut Context<Self>) {
        let _ = self.pulled.send(());
    }
}
impl Handler<LinkEvent> for Echo {
    type Result = ();
    fn handle(&mut self, _: LinkEvent, _: &mut Context<Self>) {}
}

struct Pair {
    link: LinkHandle,
    push: PushHandle,
    pulled: mpsc::UnboundedReceiver<()>,
}

async fn pair(seal: Seal) -> Pair {
    let (tx, pulled) = mpsc::unbounded_channel();
    let echo = Echo { router: None, pulled: tx }.start();
    let router = bind_router_with("tcp://127.0.0.1:0", echo.clone().recipient(), seal.clone()).await.expect("bind");
    echo.send(SetRouter(router.clone())).await.expect("actor");
    let pull = bind_pull_with("tcp://127.0.0.1:0", echo.clone().recipient(), seal.clone()).await.expect("bind");
    let link = connect_dealer(LinkConfig::new(router.endpoint()).seal(seal.clone()), echo.recipient());
    let push = connect_push_with(&pull, seal);
    while !link.is_up() || !push.is_up() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Pair { link, push, pulled }
}

fn batch() -> Envelope {
    let outputs = (0..32)
        .map(|i| {
            let mut o = EngineOutput::failed(format!("cmpl-{i:032x}-0"), "");
            o.finish_reason = None;
            o.error = None;
            o.new_token_ids = vec![1234 + i];
            o
        })
        .collect();
    Envelope::new(Message::EngineOutputs(EngineOutputBatch { engine_rank: 0, outputs }))
}

async fn calls(p: &Pair, n: usize) -> Duration {
    let t = Instant::now();
    for _ in 0..n {
        let r = p.link.call(Envelope::new(Message::Ping), Duration::from_secs(5)).await.expect("answered");
        assert_eq!(r.body, Message::Pong);
    }
    t.elapsed()
}

async fn pushes(p: &mut Pair, n: usize) -> Duration {
    let env = batch();
    let t = Instant::now();
    for _ in 0..n {
        p.push.send(env.clone()).expect("queued");
    }
    for _ in 0..n {
        p.pulled.recv().await.expect("delivered");
    }
    t.elapsed()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds = arg("--rounds", 10);
    let n_calls = arg("--calls", 2000);
    let n_pushes = arg("--pushes", 20000);
    let key = LinkKey::derive(&MeshSecret::generate(), "bench");
    let frame_len = batch().encode().map(|b| b.len()).unwrap_or(0);
    let bench_key = key.clone();
    System::new().block_on(async move {
        let key = bench_key;
        let mut plain = pair(Seal::none()).await;
        let mut sealed = pair(Seal::with_key(key.clone())).await;
        // warm-up
        calls(&plain, 200).await;
        calls(&sealed, 200).await;
        let (mut rt, mut st) = ((vec![], vec![]), (vec![], vec![]));
        for _ in 0..rounds {
            rt.0.push(calls(&plain, n_calls).await.as_secs_f64() * 1e6 / n_calls as f64);
            rt.1.push(calls(&sealed, n_calls).await.as_secs_f64() * 1e6 / n_calls as f64);
            st.0.push(n_pushes as f64 / pushes(&mut plain, n_pushes).await.as_secs_f64());
            st.1.push(n_pushes as f64 / pushes(&mut sealed, n_pushes).await.as_secs_f64());
        }
        let (rp, rs) = (median(rt.0), median(rt.1));
        let (sp, ss) = (median(st.0), median(st.1));
        println!("{rounds} rounds, medians; plain and sealed alternate within each round");
        println!("request/reply (Ping/Pong), µs per call: plain {rp:.1}  sealed {rs:.1}  ratio {:.3}", rs / rp);
        println!(
            "stream ({frame_len} B output batches), batches/s: plain {sp:.0}  sealed {ss:.0}  ratio {:.3}",
            ss / sp
        );
    });

    // CPU cost per frame, sealing and opening.
    let link = LinkBinding::new(7100, Direction::ToBound);
    for size in [64usize, 1024, 16 * 1024] {
        let payload = vec![0x5au8; size];
        let mut sealer = FrameSealer::new(key.clone(), link);
        let mut opener = FrameOpener::new(key.clone(), link);
        let n = 5_000;
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(sealer.seal(std::hint::black_box(&payload)));
        }
        let seal_ns = t.elapsed().as_nanos() as f64 / n as f64;
        let frames: Vec<Vec<u8>> = (0..n).map(|_| sealer.seal(&payload)).collect();
        let t = Instant::now();
        for f in &frames {
            std::hint::black_box(opener.open(f).expect("opens"));
        }
        let open_ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!("{size:>6} B payload: seal {seal_ns:.0} ns, open {open_ns:.0} ns per frame");
    }
}
