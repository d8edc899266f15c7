//! Transfer bandwidth of the `shm` and `tcp` backends against their physical limits, measured
//! side by side in one run (interleaved per repetition, median reported). D's cache lives on
//! its own shared-memory region and reads land in blocks checked out of it, as in the worker:
//! - `shm` (D copies leased blocks out of P's mapping into its blocks) vs a plain
//!   `copy_from_slice` of the same number of bytes between two heap buffers;
//! - `staged` : the path the worker used before reads landed in place — a fresh heap cache of
//!   the request's blocks, the `shm` read into it, then a copy into D's blocks;
//! - `tcp` (lease-checked request, P streams from its mapping, D receives into its blocks) vs
//!   raw loopback TCP: a tokio `TcpStream` request/response moving the same byte count into a
//!   plain buffer, on a kept-alive connection, like ours.
//!
//! Ratios are the median of per-repetition ratios; caches are flushed before every measurement.
//!
//! Geometry: SmolLM2-135M (30 layers, 3 KV heads, head dim 64, block size 16: 737,280
//! bytes per block). Run:
//!
//! ```text
//! cargo run --release -p pdmesh-kv-transfer --example bandwidth -- [--reps 15] [--blocks 1,16,32,256] [--scatter] [--dir /dev/shm]
//! ```

use std::error::Error;
use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_kv_transfer::{
    AgentConfig, BackendConfig, ClientConfig, CompatInputs, FaultConfig, HoldTable, HoldTableConfig, KvBlockWriter,
    Lease, MeshSecret, RemoteAgent, SharedPolicy, ShmRegion, TransferAgent, TransferClient,
};
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{KvCache, KvCacheSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Res<T> = Result<T, Box<dyn Error>>;

const GB: f64 = 1e9;

/// Push every measured buffer out of the caches (the host's L3 is 105 MiB, larger than a
/// 32-block transfer's source plus destination), so each measurement starts cold: what a
/// transfer of blocks written some time ago meets, and the same start for every method.
fn evict(scratch: &mut [u8]) {
    for line in scratch.chunks_mut(64) {
        line[0] = line[0].wrapping_add(1);
    }
    black_box(scratch);
}

/// `len` bytes of `buf` starting at a page boundary (`buf` has a page to spare).
fn page_aligned(buf: &mut [u8], len: usize) -> &mut [u8] {
    let off = buf.as_ptr().align_offset(4096).min(buf.len());
    let end = (off + len).min(buf.len());
    &mut buf[off..end]
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs.get(xs.len() / 2).copied().unwrap_or_default()
}

/// A raw TCP server: for each 8-byte request `n`, write `n` bytes from one buffer.
async fn raw_server(listener: TcpListener, payload: Arc<Vec<u8>>) {
    while let Ok((mut s, _)) = listener.accept().await {
        let _ = s.set_nodelay(true);
        let payload = payload.clone();
        tokio::spawn(async move {
            let mut req = [0u8; 8];
            while s.read_exact(&mut req).await.is_ok() {
                let n = (u64::from_le_bytes(req) as usize).min(payload.len());
                if s.write_all(&payload[..n]).await.is_err() {
                    return;
                }
            }
        });
    }
}

async fn raw_read(s: &mut TcpStream, buf: &mut [u8]) -> Res<()> {
    s.write_all(&(buf.len() as u64).to_le_bytes()).await?;
    s.read_exact(buf).await?;
    Ok(())
}

/// The command line: `--reps`, `--blocks`, `--scatter`, `--dir`.
struct Args {
    reps: usize,
    sizes: Vec<u32>,
    scatter: bool,
    dir: Option<String>,
}

fn parse_args() -> Res<Args> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let reps: usize = arg("--reps").map(|s| s.parse()).transpose()?.unwrap_or(15);
    let sizes: Vec<u32> = arg("--blocks")
        .unwrap_or_else(|| "1,16,32,256".into())
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let scatter = args.iter().any(|a| a == "--scatter");
    Ok(Args { reps, sizes, scatter, dir: arg("--dir") })
}

/// P: its cache on a shm region, every block held for request "bench", one agent per backend.
struct Producer {
    p_kv: KvCache,
    path: std::path::PathBuf,
    shm_agent: TransferAgent,
    tcp_agent: TransferAgent,
    hash: String,
    secret: MeshSecret,
    /// Every block of the cache, all held.
    all: Vec<u32>,
}

/// Start P; `dir` puts the region in another tmpfs (e.g. one mounted with `huge=always`).
async fn start_producer(spec: KvCacheSpec, dir: Option<String>) -> Res<Producer> {
    let name = format!("pdmesh-bench-{}", std::process::id());
    let region = match dir {
        Some(dir) => ShmRegion::create_at(&std::path::Path::new(&dir).join(name), spec.total_floats() * 4)?,
        None => ShmRegion::create_for_spec(&name, &spec)?,
    };
    let path = region.path().to_path_buf();
    let mut p_kv = region.into_kv_cache(spec).map_err(|e| e.to_string())?;
    for (i, x) in p_kv.as_mut_slice().iter_mut().enumerate() {
        *x = i as f32;
    }
    let table = Arc::new(Mutex::new(HoldTable::new(HoldTableConfig {
        lease_ttl: Duration::from_secs(3600),
        ..Default::default()
    })));
    let all: Vec<u32> = (0..spec.num_blocks).collect();
    table.lock().map_err(|e| e.to_string())?.hold_with_capability(
        "bench",
        all.clone(),
        vec![1; all.len()],
        Instant::now() + Duration::from_secs(3600),
        "bench-capability".into(),
    );
    let secret = MeshSecret::generate();
    let hash = CompatInputs::for_spec("bench", &spec).hash();
    let start = |backend| {
        let policy: SharedPolicy = table.clone();
        let config = AgentConfig {
            engine_id: "p".into(),
            rank: 0,
            side_channel: "tcp://127.0.0.1:0".into(),
            backend,
            compat_hash: hash.clone(),
            faults: FaultConfig::default(),
            mesh_secret: secret.clone(),
        };
        TransferAgent::start(config, &path, spec, policy)
    };
    let shm_agent = start(BackendConfig::Shm).await?;
    let tcp_agent = start(BackendConfig::Tcp { bind: "127.0.0.1:0".into(), advertise_host: None }).await?;
    Ok(Producer { p_kv, path, shm_agent, tcp_agent, hash, secret, all })
}

/// D: connected to both of P's agents, leased every block on each, its cache on its own
/// region (the executor's view) with the writer reads land through.
struct Consumer {
    shm: RemoteAgent,
    tcp: RemoteAgent,
    shm_lease: Lease,
    tcp_lease: Lease,
    writer: Arc<KvBlockWriter>,
    d_kv: KvCache,
}

async fn start_consumer(p: &Producer, spec: KvCacheSpec) -> Res<Consumer> {
    let client = TransferClient::new(ClientConfig::new("bench-d", spec, p.hash.clone(), p.secret.clone()));
    let shm = client.handshake(p.shm_agent.side_channel_endpoint(), "p").await?;
    let tcp = client.handshake(p.tcp_agent.side_channel_endpoint(), "p").await?;
    let gens = vec![1; p.all.len()];
    // One lease, granted to our consumer: both agents share the table, so ask once.
    let shm_lease = shm.lease("bench", "bench-capability", &p.all, &gens).await?;
    let tcp_lease = tcp.lease("bench", "bench-capability", &p.all, &gens).await?;
    let d_region = ShmRegion::create_for_spec(&format!("pdmesh-bench-d-{}", std::process::id()), &spec)?;
    let writer = Arc::new(KvBlockWriter::open(d_region.path(), spec)?);
    let d_kv = d_region.into_kv_cache(spec).map_err(|e| e.to_string())?;
    Ok(Consumer { shm, tcp, shm_lease, tcp_lease, writer, d_kv })
}

/// What the transfers are measured against: heap buffers for memcpy, a raw TCP server and a
/// kept-alive connection to it, and the scratch that evicts the caches. Page-aligned, like the
/// regions: a 16-byte offset between source and destination halves memcpy's speed on some
/// CPUs (AMD's `rep movsb`), which would flatter every ratio against it.
struct Baselines {
    /// The largest transfer's byte count; each buffer has a page to spare beyond it.
    len: usize,
    src_buf: Vec<u8>,
    dst_buf: Vec<u8>,
    raw_vec: Vec<u8>,
    raw: TcpStream,
    scratch: Vec<u8>,
}

async fn start_baselines(len: usize) -> Res<Baselines> {
    let mut src_buf = vec![1u8; len + 4096];
    let src = page_aligned(&mut src_buf, len);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let raw_addr = listener.local_addr()?;
    tokio::spawn(raw_server(listener, Arc::new(src.to_vec())));
    let raw = TcpStream::connect(raw_addr).await?;
    raw.set_nodelay(true)?;
    Ok(Baselines {
        len,
        src_buf,
        dst_buf: vec![0u8; len + 4096],
        raw_vec: vec![0u8; len + 4096],
        raw,
        scratch: vec![0u8; 256 << 20],
    })
}

/// The time of each method for one repetition of an `n`-block transfer.
struct RepTimes {
    mem: Duration,
    shm: Duration,
    staged: Duration,
    raw: Duration,
    tcp: Duration,
}

/// The path the worker used before reads landed in place: a fresh heap cache of the request's
/// blocks, the `shm` read into it, then a copy into D's blocks `local_ids`.
async fn staged_read(d: &mut Consumer, spec: KvCacheSpec, remote: &[u32], local_ids: &[u32]) -> Res<Duration> {
    let n = remote.len() as u32;
    let t = Instant::now();
    let mut staged = KvCache::new_heap(KvCacheSpec { num_blocks: n, ..spec });
    let staged_ids: Vec<u32> = (0..n).collect();
    d.shm.read_blocks(&d.shm_lease, remote, &mut staged, &staged_ids).await?;
    for (i, &dst) in local_ids.iter().enumerate() {
        for layer in 0..spec.num_layers as usize {
            for side in [KvSide::Key, KvSide::Value] {
                d.d_kv.block_mut(layer, side, dst)?.copy_from_slice(staged.block(layer, side, i as u32)?);
            }
        }
    }
    let elapsed = t.elapsed();
    drop(staged);
    Ok(elapsed)
}

/// One repetition of every method on `remote` (P's blocks) into `local_ids` (D's), each from
/// cold caches.
async fn one_rep(
    d: &mut Consumer,
    b: &mut Baselines,
    spec: KvCacheSpec,
    remote: &[u32],
    local_ids: &[u32],
) -> Res<RepTimes> {
    let bytes = remote.len() * spec.bytes_per_block() as usize;
    let len = b.len;
    evict(&mut b.scratch);
    let (src, dst) = (page_aligned(&mut b.src_buf, len), page_aligned(&mut b.dst_buf, len));
    let t = Instant::now();
    dst[..bytes].copy_from_slice(&src[..bytes]);
    black_box(&mut *dst);
    let mem = t.elapsed();

    evict(&mut b.scratch);
    let mut blocks = d.writer.checkout(local_ids)?;
    let shm = d.shm.read_blocks_into(&d.shm_lease, remote, &mut blocks).await?.elapsed;
    drop(blocks);

    evict(&mut b.scratch);
    let staged = staged_read(d, spec, remote, local_ids).await?;

    evict(&mut b.scratch);
    let raw_buf = page_aligned(&mut b.raw_vec, len);
    let t = Instant::now();
    raw_read(&mut b.raw, &mut raw_buf[..bytes]).await?;
    black_box(&mut *raw_buf);
    let raw = t.elapsed();

    evict(&mut b.scratch);
    let mut blocks = d.writer.checkout(local_ids)?;
    let tcp = d.tcp.read_blocks_into(&d.tcp_lease, remote, &mut blocks).await?.elapsed;
    drop(blocks);
    Ok(RepTimes { mem, shm, staged, raw, tcp })
}

/// The table row of an `n`-block transfer: the median bandwidth of each method over `reps`
/// repetitions (after two warm-up ones) and the ratios against the baselines.
async fn measure_row(
    d: &mut Consumer,
    b: &mut Baselines,
    spec: KvCacheSpec,
    n: u32,
    reps: usize,
    scatter: bool,
) -> Res<()> {
    let bytes = n as usize * spec.bytes_per_block() as usize;
    let remote: Vec<u32> = (0..n).collect();
    // Fresh D caches hand out ascending blocks (spans coalesce); `--scatter` reverses them,
    // the worst case for the shm copy (one 12 KiB memcpy per run).
    let local_ids: Vec<u32> = if scatter { (0..n).rev().collect() } else { (0..n).collect() };
    let (mut t_mem, mut t_shm, mut t_raw, mut t_tcp, mut t_stage) = (vec![], vec![], vec![], vec![], vec![]);
    for rep in 0..reps + 2 {
        let t = one_rep(d, b, spec, &remote, &local_ids).await?;
        if rep >= 2 {
            t_mem.push(t.mem);
            t_shm.push(t.shm);
            t_stage.push(t.staged);
            t_raw.push(t.raw);
            t_tcp.push(t.tcp);
        }
    }
    let bw = |d: &[Duration]| bytes as f64 / median(d.to_vec()).as_secs_f64().max(1e-12) / GB;
    // Ratios are taken per repetition (the two measurements ran back to back, under the
    // same load), then the median: robust on a shared machine.
    let ratio = |ours: &[Duration], base: &[Duration]| {
        let mut r: Vec<f64> =
            ours.iter().zip(base).map(|(o, b)| b.as_secs_f64() / o.as_secs_f64().max(1e-12)).collect();
        r.sort_by(f64::total_cmp);
        r.get(r.len() / 2).copied().unwrap_or_default()
    };
    let (mem, s, st, r, c) = (bw(&t_mem), bw(&t_shm), bw(&t_stage), bw(&t_raw), bw(&t_tcp));
    let (rs, rst, rt) = (ratio(&t_shm, &t_mem), ratio(&t_stage, &t_mem), ratio(&t_tcp, &t_raw));
    println!("| {n} | {bytes} | {mem:.2} | {s:.2} | {rs:.2} | {st:.2} | {rst:.2} | {r:.2} | {c:.2} | {rt:.2} |");
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Res<()> {
    let Args { reps, sizes, scatter, dir } = parse_args()?;
    let max = sizes.iter().copied().max().unwrap_or(1);
    let spec = KvCacheSpec { num_layers: 30, num_blocks: max, block_size: 16, num_kv_heads: 3, head_dim: 64 };
    let bpb = spec.bytes_per_block() as usize;
    let p = start_producer(spec, dir).await?;
    let mut d = start_consumer(&p, spec).await?;
    let mut b = start_baselines(max as usize * bpb).await?;

    println!(
        "geometry: 30 layers x 3 kv heads x 64 dims x 16 slots = {bpb} bytes/block; reps {reps} (median); local ids {}; region {}",
        if scatter { "reversed (--scatter)" } else { "ascending" },
        p.path.display()
    );
    println!(
        "| blocks | bytes | memcpy GB/s | shm GB/s | shm/memcpy | staged GB/s | staged/memcpy | raw TCP GB/s | tcp GB/s | tcp/raw |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for &n in &sizes {
        measure_row(&mut d, &mut b, spec, n, reps, scatter).await?;
    }
    d.shm.read_done(&d.shm_lease).await.ok();
    drop(p.p_kv);
    drop(d.d_kv);
    Ok(())
}
