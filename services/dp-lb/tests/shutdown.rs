//! The service shell, in-process (D47): a real dp-lb started through its `run(ctx, shutdown)`
//! on ipc sockets in a private run dir, with this test playing its engine rank and its
//! frontend over real ZeroMQ sockets, stopped through the shutdown handle.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use actix::prelude::*;
use pdmesh_config::Service;
use pdmesh_protocol::{EngineLoadReport, EngineRequest, Envelope, Hello, Message, ServiceKind};
use pdmesh_service::{shutdown_channel, ServiceContext};
use pdmesh_transport::{connect_dealer, LinkConfig, LinkEvent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What the test's peers receive is not what this test checks (the dp-lb's `Ack` says the
/// request is in its in-flight table).
struct Ignore;
impl Handler<LinkEvent> for Ignore {
    type Result = ();
    fn handle(&mut self, _: LinkEvent, _: &mut Context<Self>) {}
}
impl Actor for Ignore {
    type Context = Context<Self>;
}

/// The status of `GET path` on `127.0.0.1:port`, or `None` when nothing answers there.
async fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).await.ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).await.ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

/// Poll `what` until it holds (bounded: a broken shutdown fails instead of hanging).
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let give_up = Instant::now() + Duration::from_secs(30);
    while !check().await {
        assert!(Instant::now() < give_up, "timed out waiting for: {what}");
        actix::clock::sleep(Duration::from_millis(20)).await;
    }
}

/// A port nothing listens on now, for the ops server (`base_port + 100`).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    l.local_addr().unwrap().port()
}

/// Shutdown is a tested feature: once the handle fires, the dp-lb's readiness goes 503 at
/// once, it keeps serving the request it has in flight until its rank reports it finished,
/// and only then does `run` return and its ops port close. Fails if readiness stayed 200
/// while stopping, if `run` returned (dropping the request) before the report came, if it
/// never returned after it, or if the ops server kept its port.
#[actix_rt::test]
async fn a_dp_lb_goes_unready_drains_its_request_then_frees_its_port() {
    let run_dir = std::env::temp_dir().join(format!("pdmesh-dplb-shutdown-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    let ops_port = loop {
        let p = free_port();
        if p > 200 {
            break p;
        }
    };
    // The one-node shape on ipc links, the HTTP port the schema's default (the frontend does
    // not run here), the ops server on `ops_port`.
    let mut topo = pdmesh_test_support::topology::one_node(8000, ops_port - 100);
    topo.run_dir = run_dir.clone();
    let ctx = ServiceContext::start(topo, "main", Service::DpLb, 0).unwrap();
    let eps = ctx.endpoints.clone();
    // The deadline is the shell's business (tested in pdmesh-service); here it only must not
    // be what ends the stop.
    let (trigger, shutdown) = shutdown_channel(Duration::from_secs(3600));
    let service = actix_rt::spawn(pdmesh_dp_lb::run(ctx, shutdown));

    // This test is engine rank 0 ...
    let hello = Envelope::new(Message::Hello(Hello { service: ServiceKind::EngineCore, rank: 0, pid: 1 }));
    let engine = connect_dealer(
        LinkConfig::new(eps.dplb_engines.connect.clone()).identity("engine-core-0").hello(hello),
        Ignore.start().recipient(),
    );
    eventually("the dp-lb ready with its rank", || async { http_status(ops_port, "/health").await == Some(200) }).await;

    // ... and its frontend, with one request in flight.
    let frontend = connect_dealer(
        LinkConfig::new(eps.dplb_frontend.connect.clone()).identity("frontend"),
        Ignore.start().recipient(),
    );
    eventually("the frontend link up", || std::future::ready(frontend.is_up())).await;
    let request = EngineRequest {
        request_id: "drain-me".into(),
        prompt_token_ids: vec![5, 6],
        data_parallel_rank: Some(0),
        kv_transfer_params: None,
        client_request_id: None,
        sampling: Default::default(),
        eos_token_ids: vec![],
        arrival_unix_ms: 1,
    };
    let reply = frontend.call(Envelope::new(Message::AddRequest(request)), Duration::from_secs(30)).await.unwrap();
    assert!(matches!(reply.body, Message::Ack), "{:?}", reply.body.kind());

    trigger.trigger();
    eventually("readiness 503 while stopping", || async { http_status(ops_port, "/health").await == Some(503) }).await;
    assert_eq!(http_status(ops_port, "/live").await, Some(200), "still serving while it drains");
    assert!(!service.is_finished(), "stopped with a request in flight");

    // The engine finishes the request (its output went to the frontend; its load report
    // names it, D75): the dp-lb has nothing left in flight and stops.
    let report =
        EngineLoadReport { engine_rank: 0, finished_request_ids: vec!["drain-me".into()], ..Default::default() };
    engine.send(Envelope::new(Message::LoadReport(report))).unwrap();
    tokio::time::timeout(Duration::from_secs(30), service).await.expect("run returned").unwrap().unwrap();
    assert_eq!(http_status(ops_port, "/live").await, None, "the ops server is gone");
    std::net::TcpListener::bind(("127.0.0.1", ops_port)).expect("the ops port is free again");
    let _ = std::fs::remove_dir_all(&run_dir);
}
