//! What the mesh handshake (docs/SECURITY.md, D40) adds, side by side in one run.
//!
//! ```text
//! cargo run --release -p pdmesh-kv-transfer --example auth_cost [-- --n 300]
//! ```
//!
//! Against one real agent (`tcp` backend, loopback), alternating the two variants of each pair
//! so that both see the same machine noise:
//! - side channel: a connection with one round trip, as every handshake was before D40 (TCP
//!   probe, DEALER connect, one request answered) vs. `TransferClient::handshake` now (the same
//!   plus the two authentication round trips and four HMACs, then the metadata checks);
//! - data plane: a new connection with one round trip (TCP connect, one frame answered) vs. a
//!   new connection that authenticates first (two more round trips);
//! - a block read on an established (pooled) connection, which the handshake does not touch;
//! - the CPU cost of one handshake's cryptography (two nonces, four HMAC-SHA256).

use std::error::Error;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_kv_transfer::{
    AgentConfig, BackendConfig, ClientConfig, CompatInputs, FaultConfig, HoldTable, HoldTableConfig, MeshSecret,
    SharedPolicy, ShmRegion, TransferAgent, TransferClient,
};
use pdmesh_mesh_auth::{Channel, ClientHello, ServerChallenge};
use pdmesh_model_api::{KvCache, KvCacheSpec};
use pdmesh_protocol::{Envelope, Message, TransferBackend};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// Median and 90th percentile, in microseconds.
fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let at = |q: f64| v.get(((v.len() as f64 - 1.0) * q).round() as usize).map_or(0.0, |d| d.as_secs_f64() * 1e6);
    (at(0.5), at(0.9))
}

async fn frame_call(s: &mut TcpStream, body: Message) -> Result<Message, Box<dyn Error>> {
    let bytes = Envelope::new(body).encode()?;
    s.write_all(&(bytes.len() as u32).to_be_bytes()).await?;
    s.write_all(&bytes).await?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut buf).await?;
    Ok(Envelope::decode(&buf)?.body)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn Error>> {
    let n: usize = arg("--n").and_then(|s| s.parse().ok()).unwrap_or(300);
    let spec = KvCacheSpec { num_layers: 30, num_blocks: 64, block_size: 16, num_kv_heads: 3, head_dim: 64 };
    let region = ShmRegion::create_for_spec(&format!("pdmesh-auth-cost-{}", std::process::id()), &spec)?;
    let path = region.path().to_path_buf();
    let _p_kv = region.into_kv_cache(spec)?;
    let secret = MeshSecret::generate();
    let table = Arc::new(Mutex::new(HoldTable::new(HoldTableConfig {
        lease_ttl: Duration::from_secs(3600),
        ..Default::default()
    })));
    let deadline = Instant::now() + Duration::from_secs(3600);
    table.lock().map_err(|e| e.to_string())?.hold_with_capability("r", vec![1], vec![1], deadline, "cap".into());
    let hash = CompatInputs::for_spec("bench", &spec).hash();
    let policy: SharedPolicy = table.clone();
    let agent = TransferAgent::start(
        AgentConfig {
            engine_id: "p".into(),
            rank: 0,
            side_channel: "tcp://127.0.0.1:0".into(),
            backend: BackendConfig::Tcp { bind: "127.0.0.1:0".into(), advertise_host: None },
            compat_hash: hash.clone(),
            faults: FaultConfig::default(),
            mesh_secret: secret.clone(),
        },
        &path,
        spec,
        policy,
    )
    .await?;
    let endpoint = agent.side_channel_endpoint().to_string();
    let side_addr = endpoint.trim_start_matches("tcp://").to_string();
    let TransferBackend::Tcp { host, port } = &agent.metadata().backend else { return Err("not tcp".into()) };
    let data_addr = format!("{host}:{port}");
    let client = TransferClient::new(ClientConfig::new("bench-d", spec, hash, secret.clone()));

    // warm-up
    for _ in 0..20 {
        client.handshake(&endpoint, "p").await?;
    }
    let (mut side_before, mut side_after, mut data_before, mut data_after) = (vec![], vec![], vec![], vec![]);
    for _ in 0..n {
        // side channel, before D40: probe, connect, one request answered
        let t = Instant::now();
        drop(TcpStream::connect(&side_addr).await?);
        let mut s = DealerSocket::new();
        s.connect(&endpoint).await?;
        s.send(ZmqMessage::from(Envelope::new(Message::XferGetMetadata).encode()?)).await?;
        s.recv().await?;
        side_before.push(t.elapsed());
        drop(s);
        // side channel now: the whole handshake, authentication included
        let t = Instant::now();
        let remote = client.handshake(&endpoint, "p").await?;
        side_after.push(t.elapsed());
        drop(remote);
        // data plane, before: connect and one frame answered
        let t = Instant::now();
        let mut s = TcpStream::connect(&data_addr).await?;
        s.set_nodelay(true)?;
        frame_call(&mut s, Message::Ping).await?;
        data_before.push(t.elapsed());
        drop(s);
        // data plane now: connect, authenticate, one frame answered
        let t = Instant::now();
        let mut s = TcpStream::connect(&data_addr).await?;
        s.set_nodelay(true)?;
        let (c, hello) = ClientHello::new(Channel::TcpData);
        let Message::AuthChallenge(ch) = frame_call(&mut s, Message::AuthHello(hello)).await? else {
            return Err("no challenge".into());
        };
        let proof = c.answer(&secret, &ch)?;
        frame_call(&mut s, Message::AuthProof(proof)).await?;
        frame_call(&mut s, Message::Ping).await?;
        data_after.push(t.elapsed());
    }

    // A read on an established connection: lease once, read one block n times.
    let remote = client.handshake(&endpoint, "p").await?;
    let lease = remote.lease("r", "cap", &[1], &[1]).await?;
    let mut local = KvCache::new_heap(spec);
    remote.read_blocks(&lease, &[1], &mut local, &[0]).await?;
    let mut reads = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        remote.read_blocks(&lease, &[1], &mut local, &[0]).await?;
        reads.push(t.elapsed());
    }

    // The cryptography of one handshake, both sides.
    let rounds = 20_000;
    let t = Instant::now();
    for _ in 0..rounds {
        let (c, hello) = ClientHello::new(Channel::SideChannel);
        let (server, ch) = ServerChallenge::answer(&secret, Channel::SideChannel, &hello)?;
        let proof = c.answer(&secret, &ch)?;
        server.verify(&secret, &proof)?;
    }
    let crypto_us = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;

    let (sb, sb90) = stats(side_before);
    let (sa, sa90) = stats(side_after);
    let (db, db90) = stats(data_before);
    let (da, da90) = stats(data_after);
    let (rd, rd90) = stats(reads);
    println!(
        "| what (n = {n}, loopback) | before D40: p50 / p90 µs | with the mesh handshake: p50 / p90 µs | ratio (p50) |"
    );
    println!("|---|---|---|---|");
    println!(
        "| side channel: new connection ready for requests | {sb:.0} / {sb90:.0} | {sa:.0} / {sa90:.0} | {:.2} |",
        sa / sb
    );
    println!(
        "| data plane: new connection, first frame answered | {db:.0} / {db90:.0} | {da:.0} / {da90:.0} | {:.2} |",
        da / db
    );
    println!("| data plane: 1-block read ({} KiB) on a pooled connection | — | {rd:.0} / {rd90:.0} | unchanged (no handshake) |", spec.bytes_per_block() / 1024);
    println!("| CPU: one handshake's nonces and 4 HMAC-SHA256, both sides | — | {crypto_us:.1} | — |");
    drop(agent);
    Ok(())
}
