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

/// A `tcp` agent on loopback serving a shared-memory cache of `spec`, with block 1 held for
/// request "r" under capability "cap"; its cache (kept alive by the caller) and compat hash.
async fn start_agent(
    spec: KvCacheSpec,
    secret: &MeshSecret,
) -> Result<(TransferAgent, KvCache, String), Box<dyn Error>> {
    let region = ShmRegion::create_for_spec(&format!("pdmesh-auth-cost-{}", std::process::id()), &spec)?;
    let path = region.path().to_path_buf();
    let p_kv = region.into_kv_cache(spec)?;
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
    Ok((agent, p_kv, hash))
}

/// Where the agent answers: its side channel endpoint (`tcp://…`), that endpoint's address,
/// and its block server's address.
struct Addresses {
    endpoint: String,
    side: String,
    data: String,
}

/// The time of each new connection of each kind, one per round.
#[derive(Default)]
struct ConnectionTimes {
    side_before: Vec<Duration>,
    side_after: Vec<Duration>,
    data_before: Vec<Duration>,
    data_after: Vec<Duration>,
}

/// A side channel connection as every handshake was before D40: probe, connect, one request
/// answered.
async fn side_channel_before_d40(at: &Addresses) -> Result<Duration, Box<dyn Error>> {
    let t = Instant::now();
    drop(TcpStream::connect(&at.side).await?);
    let mut s = DealerSocket::new();
    s.connect(&at.endpoint).await?;
    s.send(ZmqMessage::from(Envelope::new(Message::XferGetMetadata).encode()?)).await?;
    s.recv().await?;
    Ok(t.elapsed())
}

/// A data plane connection as before D40 (`secret` None: connect, one frame answered) or now
/// (connect, authenticate, one frame answered).
async fn data_plane_connection(at: &Addresses, secret: Option<&MeshSecret>) -> Result<Duration, Box<dyn Error>> {
    let t = Instant::now();
    let mut s = TcpStream::connect(&at.data).await?;
    s.set_nodelay(true)?;
    if let Some(secret) = secret {
        let (c, hello) = ClientHello::new(Channel::TcpData);
        let Message::AuthChallenge(ch) = frame_call(&mut s, Message::AuthHello(hello)).await? else {
            return Err("no challenge".into());
        };
        let proof = c.answer(secret, &ch)?;
        frame_call(&mut s, Message::AuthProof(proof)).await?;
    }
    frame_call(&mut s, Message::Ping).await?;
    Ok(t.elapsed())
}

/// `n` rounds of the four kinds of new connection, alternating so that both variants of each
/// pair see the same machine noise.
async fn time_connections(
    n: usize,
    client: &TransferClient,
    at: &Addresses,
    secret: &MeshSecret,
) -> Result<ConnectionTimes, Box<dyn Error>> {
    let mut times = ConnectionTimes::default();
    for _ in 0..n {
        times.side_before.push(side_channel_before_d40(at).await?);
        // side channel now: the whole handshake, authentication included
        let t = Instant::now();
        let remote = client.handshake(&at.endpoint, "p").await?;
        times.side_after.push(t.elapsed());
        drop(remote);
        times.data_before.push(data_plane_connection(at, None).await?);
        times.data_after.push(data_plane_connection(at, Some(secret)).await?);
    }
    Ok(times)
}

/// A read on an established connection: lease once, read one block `n` times.
async fn time_pooled_reads(
    n: usize,
    client: &TransferClient,
    endpoint: &str,
    spec: KvCacheSpec,
) -> Result<Vec<Duration>, Box<dyn Error>> {
    let remote = client.handshake(endpoint, "p").await?;
    let lease = remote.lease("r", "cap", &[1], &[1]).await?;
    let mut local = KvCache::new_heap(spec);
    remote.read_blocks(&lease, &[1], &mut local, &[0]).await?;
    let mut reads = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        remote.read_blocks(&lease, &[1], &mut local, &[0]).await?;
        reads.push(t.elapsed());
    }
    Ok(reads)
}

/// The cryptography of one handshake, both sides, in microseconds.
fn handshake_crypto_us(secret: &MeshSecret) -> Result<f64, Box<dyn Error>> {
    let rounds = 20_000;
    let t = Instant::now();
    for _ in 0..rounds {
        let (c, hello) = ClientHello::new(Channel::SideChannel);
        let (server, ch) = ServerChallenge::answer(secret, Channel::SideChannel, &hello)?;
        let proof = c.answer(secret, &ch)?;
        server.verify(secret, &proof)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / rounds as f64)
}

/// The results as a markdown table.
fn print_table(n: usize, spec: KvCacheSpec, times: ConnectionTimes, reads: Vec<Duration>, crypto_us: f64) {
    let (sb, sb90) = stats(times.side_before);
    let (sa, sa90) = stats(times.side_after);
    let (db, db90) = stats(times.data_before);
    let (da, da90) = stats(times.data_after);
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
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn Error>> {
    let n: usize = arg("--n").and_then(|s| s.parse().ok()).unwrap_or(300);
    let spec = KvCacheSpec { num_layers: 30, num_blocks: 64, block_size: 16, num_kv_heads: 3, head_dim: 64 };
    let secret = MeshSecret::generate();
    let (agent, _p_kv, hash) = start_agent(spec, &secret).await?;
    let endpoint = agent.side_channel_endpoint().to_string();
    let side = endpoint.trim_start_matches("tcp://").to_string();
    let TransferBackend::Tcp { host, port } = &agent.metadata().backend else { return Err("not tcp".into()) };
    let at = Addresses { data: format!("{host}:{port}"), endpoint, side };
    let client = TransferClient::new(ClientConfig::new("bench-d", spec, hash, secret.clone()));

    // warm-up
    for _ in 0..20 {
        client.handshake(&at.endpoint, "p").await?;
    }
    let times = time_connections(n, &client, &at, &secret).await?;
    let reads = time_pooled_reads(n, &client, &at.endpoint, spec).await?;
    let crypto_us = handshake_crypto_us(&secret)?;
    print_table(n, spec, times, reads, crypto_us);
    drop(agent);
    Ok(())
}
