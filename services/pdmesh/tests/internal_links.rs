//! A node's internal ZeroMQ links over `transport = "tcp"` against foreign peers, on a real
//! mesh started by `pdmesh up` (docs/SECURITY.md "Internal links of a node", D45).
//!
//! A raw ZeroMQ DEALER connects to the dp-lb's frontend port and pushes a well-formed
//! `AddRequest` unsealed and one sealed under another secret; a raw PUSH socket sends
//! well-formed engine outputs, unsealed, to the frontend's output PULL. None of it is
//! served: the dp-lb routes nothing, no engine schedules a token, the DEALER gets no answer,
//! and each frame counts once in `pdmesh_kv_side_channel_unauthenticated_total{channel="internal"}`
//! of the process that refused it. A real request through the frontend is then answered (its
//! frames pass every sealed link) and is refused nowhere.
//!
//! The test fails if an unsealed or wrongly sealed frame is decoded and served (the routed or
//! scheduled counters move, or the DEALER gets an `Ack`), if a refusal is not counted where it
//! happened, if the mesh's own traffic is refused (the counters move past the foreign frames,
//! or the request gets no answer), or if a service on tcp starts without a mesh secret.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{complete, wait_for, Mesh, UpOptions};
use pdmesh_mesh_auth::frame::{Direction, FrameSealer, LinkBinding};
use pdmesh_mesh_auth::{LinkKey, MeshSecret};
use pdmesh_protocol::{EngineOutput, EngineOutputBatch, EngineRequest, Envelope, Message, SamplingParams};
use zeromq::{DealerSocket, PushSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const SECRET: &str = "internal-links-test-secret-0123456789abcdef";

/// The sum of the samples of `name` (a full series name, labels included) on `url`; 0 when
/// the series does not exist yet.
fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::blocking::get(url).unwrap().text().unwrap();
    text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok()).sum()
}

fn unauth(url: &str) -> f64 {
    metric(url, "pdmesh_kv_side_channel_unauthenticated_total{channel=\"internal\"}")
}

fn add_request(id: &str) -> Envelope {
    let mut e = Envelope::new(Message::AddRequest(EngineRequest {
        request_id: id.to_string(),
        client_request_id: None,
        prompt_token_ids: vec![1, 2, 3, 4, 5, 6, 7, 8],
        sampling: SamplingParams::default(),
        eos_token_ids: vec![],
        arrival_unix_ms: 0,
        kv_transfer_params: None,
        data_parallel_rank: None,
    }));
    e.request_id = Some(id.to_string());
    e
}

fn outputs(id: &str) -> Envelope {
    let mut o = EngineOutput::failed(id, "");
    o.finish_reason = None;
    o.error = None;
    o.new_token_ids = vec![42];
    Envelope::new(Message::EngineOutputs(EngineOutputBatch { engine_rank: 0, outputs: vec![o] }))
}

#[test]
fn foreign_frames_on_a_tcp_node_are_refused_counted_and_the_mesh_still_serves() {
    let options = UpOptions { env: vec![("PDMESH_MESH_SECRET".into(), SECRET.into())], ..Default::default() };
    let mesh = Mesh::start_one_with(|n| n.transport = common::topo::SocketTransport::Tcp, &options);
    let base = mesh.base_port;
    let dplb_metrics = format!("http://127.0.0.1:{}/metrics", base + 100);
    let engine_metrics = format!("http://127.0.0.1:{}/metrics", base + 110);
    let frontend_metrics = mesh.url("/metrics");
    let routed = || metric(&dplb_metrics, "pdmesh_dplb_requests_routed_total");
    let scheduled = || metric(&engine_metrics, "pdmesh_engine_scheduled_tokens_total");

    // Every service of the node (frontend, dp-lb, and rank 0's three) sealed its links.
    let logs: Vec<_> = std::fs::read_dir(mesh.run_dir.join("logs")).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(logs.len(), 5, "{logs:?}");
    for log in &logs {
        let text = std::fs::read_to_string(log).unwrap();
        assert!(text.contains("internal tcp links are sealed"), "{}: {text}", log.display());
    }
    assert_eq!(unauth(&dplb_metrics), 0.0, "the mesh's own traffic is never refused");
    let (routed_before, scheduled_before) = (routed(), scheduled());

    let rt = tokio::runtime::Runtime::new().unwrap();
    let (mut dealer, _push) = rt.block_on(async {
        // The dp-lb's ROUTER for the frontend: an AddRequest without the secret, and one
        // sealed as a member of another mesh would (right format, right link, wrong key).
        let mut dealer = DealerSocket::new();
        dealer.connect(&format!("tcp://127.0.0.1:{base}")).await.unwrap();
        dealer.send(ZmqMessage::from(add_request("foreign-unsealed").encode().unwrap())).await.unwrap();
        let other = LinkKey::derive(&MeshSecret::parse("another-mesh-secret-0123456789abcdefgh").unwrap(), "main");
        let mut sealer = FrameSealer::new(other, LinkBinding::new(base, Direction::ToBound));
        let forged = sealer.seal(&add_request("foreign-forged").encode().unwrap());
        dealer.send(ZmqMessage::from(forged)).await.unwrap();
        // The frontend's PULL for engine outputs (the engines push there, D75).
        // The socket stays open until the test ends: dropping it may discard its queue.
        let mut push = PushSocket::new();
        push.connect(&format!("tcp://127.0.0.1:{}", base + 3)).await.unwrap();
        push.send(ZmqMessage::from(outputs("foreign-output").encode().unwrap())).await.unwrap();
        (dealer, push)
    });

    // Refused where they arrived: two frames on the dp-lb, one on the frontend.
    wait_for("the dp-lb counts two refusals", || unauth(&dplb_metrics) == 2.0);
    wait_for("the frontend counts one refusal", || unauth(&frontend_metrics) == 1.0);
    // A refused frame is never decoded, so nothing of it can still happen later.
    assert_eq!(routed(), routed_before, "the dp-lb routed a foreign AddRequest");
    assert_eq!(scheduled(), scheduled_before, "an engine scheduled a foreign request");
    let dplb_text = reqwest::blocking::get(&dplb_metrics).unwrap().text().unwrap();
    assert!(
        dplb_text.contains(&format!(
            "pdmesh_transport_frames_refused_total{{endpoint=\"tcp://127.0.0.1:{base}\",reason=\"unsealed\"}} 1"
        )),
        "{dplb_text}"
    );
    assert!(dplb_text.contains("reason=\"bad_tag\"} 1"), "{dplb_text}");
    assert!(mesh.logs().contains("refused a frame on an internal link"), "a refusal is logged");

    // The real path still serves: the request's frames pass every sealed link.
    let text = complete(&mesh.url("/v1/completions"), "Hello internal links", false);
    assert!(!text.is_empty());
    assert_eq!(routed(), routed_before + 1.0, "exactly the real request was routed");
    assert!(scheduled() > scheduled_before);
    assert_eq!(unauth(&dplb_metrics), 2.0, "the real request was refused nowhere");
    assert_eq!(unauth(&frontend_metrics), 1.0);
    assert_eq!(unauth(&engine_metrics), 0.0);
    // The foreign DEALER never got an answer (an Ack would have come long before the real
    // request's answer).
    let answer = rt.block_on(async { tokio::time::timeout(Duration::from_millis(500), dealer.recv()).await });
    assert!(answer.is_err(), "a refused frame was answered: {answer:?}");
}

/// A service of a tcp node started on its own (as compose and Kubernetes start them) without
/// a mesh secret refuses to start with a configuration error, instead of serving its ports to
/// anyone.
#[test]
fn a_tcp_node_service_without_a_mesh_secret_does_not_start() {
    let (http, base) = common::reserve_ports();
    let (dir, topology) =
        common::one_node_run_dir("pdmesh-links", http, base, |n| n.transport = common::topo::SocketTransport::Tcp);
    for service in ["dp-lb", "engine-core"] {
        let out = std::process::Command::new(common::pdmesh_bin())
            .args([service, "--node", "main", "--topology"])
            .arg(&topology)
            .env_remove("PDMESH_MESH_SECRET")
            .env("PDMESH_RUN_DIR", &dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{service}: {stderr}");
        assert!(stderr.contains("PDMESH_MESH_SECRET"), "{service}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
