//! P's KV side channel and `tcp` data plane against foreign peers, on a real P/D mesh started
//! by `pdmesh up` (docs/SECURITY.md): while P really holds a prefilled request for D, a raw
//! ZeroMQ DEALER and raw TCP connections with no secret, with a wrong secret, and with the
//! right secret but a wrong capability token get no metadata and no block bytes, cannot lease,
//! heartbeat, give up, read done or release the request, and are counted. P's blocks stay held
//! and the real decode leg then reads them and answers exactly what a colocated node answers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::topo::{
    NodeConfig,
    TransferBackendKind::{Shm, Tcp},
};
use common::{complete, pd_engines, Mesh, TopologyExt};
use pdmesh_kv_transfer::{ClientConfig, HandshakeError, MeshSecret, TransferClient};
use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::{
    Envelope, ErrorClass, LeaseRefusalReason, Message, XferGiveUp, XferLeaseRequest, XferReadBlocks,
};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// P, D and the reference: 512 blocks of 4 tokens.
fn engine(n: &mut NodeConfig) {
    n.engine.block_size = 4;
    n.engine.num_blocks = 512;
}

/// The secret the test's mesh runs with (given to `pdmesh up` in its environment, as an
/// operator would); every test of this file uses the same one.
const SECRET: &str = "security-test-mesh-secret-0123456789abcdef";

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap()
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).json(body).send().unwrap();
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::blocking::get(url).unwrap().text().unwrap();
    text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok()).sum()
}

/// The synthetic model's cache geometry, as D sees it (only for the compatibility hash a real
/// D would present; a foreign peer is refused before it matters).
fn any_spec() -> KvCacheSpec {
    KvCacheSpec { num_layers: 2, num_blocks: 8, block_size: 4, num_kv_heads: 2, head_dim: 8 }
}

async fn ask(s: &mut DealerSocket, body: Message) -> Message {
    s.send(ZmqMessage::from(Envelope::new(body).encode().unwrap())).await.unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(5), s.recv()).await.expect("an answer").unwrap();
    Envelope::decode(&msg.into_vec().pop().unwrap()).unwrap().body
}

async fn tcp_call(s: &mut tokio::net::TcpStream, body: Message) -> Option<Message> {
    let bytes = Envelope::new(body).encode().unwrap();
    s.write_all(&(bytes.len() as u32).to_be_bytes()).await.ok()?;
    s.write_all(&bytes).await.ok()?;
    let mut len = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut len)).await.ok()?.ok()?;
    let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut buf).await.ok()?;
    Some(Envelope::decode(&buf).unwrap().body)
}

#[test]
fn foreign_peers_get_nothing_from_p_and_the_real_request_completes() {
    // `pdmesh up` (and so every process of the mesh) gets the secret from its environment.
    std::env::set_var("PDMESH_MESH_SECRET", SECRET);
    let mesh = Mesh::start_nodes(|h, b| common::pd_topology(h, b, Tcp, 1, engine), pd_engines);
    let (p, d, c) = (mesh.http_port + 1, mesh.http_port + 2, mesh.http_port + 3);
    let side = common::side_ports(mesh.http_port);
    let side_channel = format!("tcp://127.0.0.2:{side}");
    let data_plane = format!("127.0.0.2:{}", side + 2);
    let p_worker = format!("http://127.0.0.2:{}/metrics", mesh.base_port + 20 + 112);
    let unauth = |channel: &str| {
        metric(&p_worker, &format!("pdmesh_kv_side_channel_unauthenticated_total{{channel=\"{channel}\"}}"))
    };
    // The worker refuses forged leases, reads and notices; P's engine forged releases.
    let p_engine = format!("http://127.0.0.2:{}/metrics", mesh.base_port + 20 + 110);
    let refused = || {
        metric(&p_worker, "pdmesh_kv_capability_refused_total")
            + metric(&p_engine, "pdmesh_kv_capability_refused_total")
    };

    // P's leg, as the router runs it: P prefills and holds the blocks for D (hold deadline
    // 480 s: only a read done, a give-up or a release can free them).
    let prompt = "the quick brown fox jumps over the lazy dog";
    let (s, p_answer) = post(
        &mesh.url_on(p, "/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}),
    );
    assert_eq!(s, 200, "{p_answer}");
    let params = p_answer["kv_transfer_params"].clone();
    let p_id = params["remote_request_id"].as_str().unwrap().to_string();
    let token = params["remote_capability"].as_str().unwrap().to_string();
    assert_eq!(token.len(), 32, "a 128-bit capability in the params: {params}");
    let blocks: Vec<u32> = serde_json::from_value(params["remote_block_ids"].clone()).unwrap();
    let gens: Vec<u64> = serde_json::from_value(params["remote_block_generations"].clone()).unwrap();
    mesh.wait_kv_on(p, "P holds the prefilled blocks", |kv| kv["held_blocks"].as_u64().unwrap_or(0) > 0);
    let held = mesh.kv_on(p)["held_blocks"].clone();

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // 1. No secret: a raw DEALER gets a refusal for everything, the real token included.
        let mut raw = DealerSocket::new();
        raw.connect(&side_channel).await.unwrap();
        let lease = Message::XferLease(XferLeaseRequest {
            p_request_id: p_id.clone(),
            block_ids: blocks.clone(),
            block_generations: gens.clone(),
            consumer: "intruder".into(),
            capability: token.clone(),
        });
        let give_up = |capability: &str| {
            Message::XferGiveUp(XferGiveUp {
                p_request_id: p_id.clone(),
                reason: "intruder".into(),
                consumer: "intruder".into(),
                lease_id: None,
                rejected_at_unix_us: None,
                capability: capability.into(),
            })
        };
        for m in [Message::XferGetMetadata, lease.clone(), give_up(&token)] {
            match ask(&mut raw, m).await {
                Message::Error(e) => assert_eq!(e.class, ErrorClass::Unauthenticated, "{e:?}"),
                other => panic!("a peer without the secret got {other:?}"),
            }
        }
        // ... and on the data plane, a read request (real id, real token) is refused and the
        // connection closed, before any byte of KV.
        let mut tcp = tokio::net::TcpStream::connect(&data_plane).await.unwrap();
        let read = |capability: &str| {
            Message::XferReadBlocks(XferReadBlocks {
                p_request_id: p_id.clone(),
                lease_id: 1,
                block_ids: blocks.clone(),
                capability: capability.into(),
            })
        };
        match tcp_call(&mut tcp, read(&token)).await {
            Some(Message::Error(e)) => assert_eq!(e.class, ErrorClass::Unauthenticated),
            other => panic!("an unauthenticated read got {other:?}"),
        }
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut rest)).await;
        assert!(rest.is_empty(), "{} bytes after the refusal", rest.len());

        // 2. A wrong secret: the handshake fails both ways (P does not prove itself to it, and
        // P refuses it), so it never even gets to ask for metadata.
        let wrong = MeshSecret::parse("a-wrong-secret-for-this-mesh-0123456789ab").unwrap();
        let hash = "not-needed-before-authentication";
        let intruder = TransferClient::new(ClientConfig::new("intruder", any_spec(), hash, wrong));
        match intruder.handshake(&side_channel, "p").await {
            Err(HandshakeError::Unauthenticated(_)) => {}
            other => panic!("a wrong secret got past the handshake: {other:?}"),
        }

        // 3. The right secret (an insider of the mesh) without the request's capability: the
        // lease is refused exactly as for a request P never held; a give-up, a heartbeat and a
        // data-plane read change nothing.
        let insider =
            TransferClient::new(ClientConfig::new("insider", any_spec(), hash, MeshSecret::parse(SECRET).unwrap()));
        // The compatibility hash differs (the insider is not a real D), so the handshake ends
        // after authentication with a typed mismatch: P served the metadata to a mesh member.
        match insider.handshake(&side_channel, "p").await {
            Err(HandshakeError::CompatMismatch { .. }) => {}
            other => panic!("{other:?}"),
        }
        let mut member = DealerSocket::new();
        member.connect(&side_channel).await.unwrap();
        let secret = MeshSecret::parse(SECRET).unwrap();
        let (hello_state, hello) = pdmesh_mesh_auth::ClientHello::new(pdmesh_mesh_auth::Channel::SideChannel);
        let Message::AuthChallenge(ch) = ask(&mut member, Message::AuthHello(hello)).await else { panic!() };
        let proof = hello_state.answer(&secret, &ch).unwrap();
        assert_eq!(ask(&mut member, Message::AuthProof(proof)).await, Message::Ack);
        let forged = pdmesh_mesh_auth::new_capability();
        let forged_lease = Message::XferLease(XferLeaseRequest {
            p_request_id: p_id.clone(),
            block_ids: blocks.clone(),
            block_generations: gens.clone(),
            consumer: "insider".into(),
            capability: forged.clone(),
        });
        let unknown_lease = Message::XferLease(XferLeaseRequest {
            p_request_id: "never-held".into(),
            block_ids: blocks.clone(),
            block_generations: gens.clone(),
            consumer: "insider".into(),
            capability: forged.clone(),
        });
        let (a, b) = match (ask(&mut member, forged_lease).await, ask(&mut member, unknown_lease).await) {
            (Message::XferLeaseRefused(a), Message::XferLeaseRefused(b)) => (a, b),
            other => panic!("{other:?}"),
        };
        assert_eq!(a.reason, LeaseRefusalReason::Gone);
        assert_eq!((a.reason, a.detail.replace(&p_id, "X")), (b.reason, b.detail.replace("never-held", "X")));
        assert_eq!(ask(&mut member, give_up(&forged)).await, Message::Ack, "acknowledged like an unknown id");
        let mut tcp = tokio::net::TcpStream::connect(&data_plane).await.unwrap();
        let (hello_state, hello) = pdmesh_mesh_auth::ClientHello::new(pdmesh_mesh_auth::Channel::TcpData);
        let Some(Message::AuthChallenge(ch)) = tcp_call(&mut tcp, Message::AuthHello(hello)).await else { panic!() };
        let proof = hello_state.answer(&secret, &ch).unwrap();
        assert_eq!(tcp_call(&mut tcp, Message::AuthProof(proof)).await, Some(Message::Ack));
        match tcp_call(&mut tcp, read(&forged)).await {
            Some(Message::XferLeaseRefused(r)) => assert_eq!(r.reason, LeaseRefusalReason::LeaseInvalid),
            other => panic!("a read without the capability got {other:?}"),
        }
    });

    // The router's release endpoint on P: a request id without its token releases nothing,
    // and params without any token are refused outright.
    let mut forged_params = params.clone();
    forged_params["remote_capability"] = json!(pdmesh_mesh_auth::new_capability());
    let (s, _) = post(&mesh.url_on(p, "/v1/kv/release"), &json!({"kv_transfer_params": forged_params}));
    assert_eq!(s, 202, "accepted like any release (no oracle)");
    let mut tokenless = params.clone();
    tokenless.as_object_mut().unwrap().remove("remote_capability");
    let (s, v) = post(&mesh.url_on(p, "/v1/kv/release"), &json!({"kv_transfer_params": tokenless}));
    assert_eq!(s, 400, "{v}");

    // Counted: refusals on both channels, and every wrong token.
    assert!(unauth("side_channel") >= 3.0, "{}", unauth("side_channel"));
    assert!(unauth("tcp_data") >= 1.0, "{}", unauth("tcp_data"));
    let wait = std::time::Instant::now() + Duration::from_secs(10);
    while refused() < 4.0 && std::time::Instant::now() < wait {
        std::thread::sleep(Duration::from_millis(50)); // the engine's release check runs after the reply
    }
    assert!(refused() >= 4.0, "lease, give-up, read and release with a wrong token: {}", refused());

    // P's blocks are untouched: still held, unleased.
    let kv = mesh.kv_on(p);
    assert_eq!(kv["held_blocks"], held, "{kv}");
    assert_eq!(kv["leased_blocks"].as_u64().unwrap_or(0), 0, "{kv}");

    // The real decode leg reads them and answers what a colocated node answers.
    let expected = complete(&mesh.url_on(c, "/v1/completions"), prompt, false);
    let (s, d_answer) = post(
        &mesh.url_on(d, "/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "kv_transfer_params": params}),
    );
    assert_eq!(s, 200, "{d_answer}");
    assert_eq!(d_answer["choices"][0]["text"].as_str().unwrap(), expected);
    mesh.wait_kv_on(p, "P freed by D's read done", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);

    // `pdmesh up` handed the secret to its children in their environment, never on a command
    // line (which every user of the host can read), and no log line shows it.
    for proc in mesh.processes() {
        let pid = proc["pid"].as_i64().unwrap();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(!String::from_utf8_lossy(&cmdline).contains(SECRET), "secret in the command line of {proc}");
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        assert!(String::from_utf8_lossy(&environ).contains(SECRET), "{proc} did not get the secret");
    }
    assert!(!mesh.logs().contains(SECRET), "the secret was logged");
    assert!(!mesh.logs().contains("panicked"));
}

/// A P/D connector-worker started on its own (not by `pdmesh up`) without a mesh secret does
/// not start at all: it would otherwise serve its side channel to anyone, or be unable to read.
/// It is a configuration error (exit status 78), so `pdmesh up` stops instead of restarting it.
#[test]
fn a_pd_worker_without_a_mesh_secret_refuses_to_start() {
    let dir = std::env::temp_dir().join(format!("pdmesh-nosecret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let topo = dir.join("topology.toml");
    let mut t = common::pd_topology(18990, 31000, Shm, 1, engine);
    t.run_dir = dir.clone();
    let text = t.text();
    std::fs::write(&topo, text).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pdmesh"))
        .args(["connector-worker", "--topology"])
        .arg(&topo)
        .args(["--node", "p", "--rank", "0"])
        .env_remove("PDMESH_MESH_SECRET")
        .env("PDMESH_RUN_DIR", &dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started without a secret: {stderr}");
    assert_eq!(out.status.code(), Some(78), "a configuration error: {stderr}");
    assert!(stderr.contains("PDMESH_MESH_SECRET"), "the error says what to set: {stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
