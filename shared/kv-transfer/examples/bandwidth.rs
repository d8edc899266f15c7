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
    MeshSecret, SharedPolicy, ShmRegion, TransferAgent, TransferClient,
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let reps: usize = arg("--reps").map(|s| s.parse()).transpose()?.unwrap_or(15);
    let sizes: Vec<u32> = arg("--blocks")
        .unwrap_or_else(|| "1,16,32,256".into())
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let scatter = args.iter().any(|a| a == "--scatter");
    let max = sizes.iter().copied().max().unwrap_or(1);
    let spec = KvCacheSpec { num_layers: 30, num_blocks: max, block_size: 16, num_kv_heads: 3, head_dim: 64 };
    let bpb = spec.bytes_per_block() as usize;

    // ---- P: cache on a shm region, every block held, one agent per backend
    // `--dir D` puts the region in another tmpfs (e.g. one mounted with `huge=always`).
    let name = format!("pdmesh-bench-{}", std::process::id());
    let region = match arg("--dir") {
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
    let all: Vec<u32> = (0..max).collect();
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

    // ---- D
    let client = TransferClient::new(ClientConfig::new("bench-d", spec, hash.clone(), secret.clone()));
    let shm = client.handshake(shm_agent.side_channel_endpoint(), "p").await?;
    let tcp = client.handshake(tcp_agent.side_channel_endpoint(), "p").await?;
    let gens = vec![1; all.len()];
    // One lease, granted to our consumer: both agents share the table, so ask once.
    let shm_lease = shm.lease("bench", "bench-capability", &all, &gens).await?;
    let tcp_lease = tcp.lease("bench", "bench-capability", &all, &gens).await?;
    // D's cache on its own region (the executor's view), and the writer reads land through.
    let d_region = ShmRegion::create_for_spec(&format!("pdmesh-bench-d-{}", std::process::id()), &spec)?;
    let writer = Arc::new(KvBlockWriter::open(d_region.path(), spec)?);
    let mut d_kv = d_region.into_kv_cache(spec).map_err(|e| e.to_string())?;

    // ---- baselines
    // Page-aligned baselines, like the regions: a 16-byte offset between source and
    // destination halves memcpy's speed on some CPUs (AMD's `rep movsb`), which would flatter
    // every ratio against it.
    let mut src_buf = vec![1u8; max as usize * bpb + 4096];
    let src = page_aligned(&mut src_buf, max as usize * bpb);
    let mut dst_buf = vec![0u8; max as usize * bpb + 4096];
    let dst = page_aligned(&mut dst_buf, max as usize * bpb);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let raw_addr = listener.local_addr()?;
    tokio::spawn(raw_server(listener, Arc::new(src.to_vec())));
    let mut raw = TcpStream::connect(raw_addr).await?;
    raw.set_nodelay(true)?;
    let mut raw_vec = vec![0u8; max as usize * bpb + 4096];
    let raw_buf = page_aligned(&mut raw_vec, max as usize * bpb);
    let mut scratch = vec![0u8; 256 << 20];

    println!(
        "geometry: 30 layers x 3 kv heads x 64 dims x 16 slots = {bpb} bytes/block; reps {reps} (median); local ids {}; region {}",
        if scatter { "reversed (--scatter)" } else { "ascending" },
        path.display()
    );
    println!(
        "| blocks | bytes | memcpy GB/s | shm GB/s | shm/memcpy | staged GB/s | staged/memcpy | raw TCP GB/s | tcp GB/s | tcp/raw |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for &n in &sizes {
        let bytes = n as usize * bpb;
        let remote: Vec<u32> = (0..n).collect();
        // Fresh D caches hand out ascending blocks (spans coalesce); `--scatter` reverses them,
        // the worst case for the shm copy (one 12 KiB memcpy per run).
        let local_ids: Vec<u32> = if scatter { (0..n).rev().collect() } else { (0..n).collect() };
        let (mut t_mem, mut t_shm, mut t_raw, mut t_tcp, mut t_stage) = (vec![], vec![], vec![], vec![], vec![]);
        for rep in 0..reps + 2 {
            evict(&mut scratch);
            let t = Instant::now();
            dst[..bytes].copy_from_slice(&src[..bytes]);
            black_box(&mut *dst);
            let mem = t.elapsed();

            evict(&mut scratch);
            let mut blocks = writer.checkout(&local_ids)?;
            let s = shm.read_blocks_into(&shm_lease, &remote, &mut blocks).await?.elapsed;
            drop(blocks);

            evict(&mut scratch);
            let t = Instant::now();
            let mut staged = KvCache::new_heap(KvCacheSpec { num_blocks: n, ..spec });
            let staged_ids: Vec<u32> = (0..n).collect();
            shm.read_blocks(&shm_lease, &remote, &mut staged, &staged_ids).await?;
            for (i, &dst) in local_ids.iter().enumerate() {
                for layer in 0..spec.num_layers as usize {
                    for side in [KvSide::Key, KvSide::Value] {
                        d_kv.block_mut(layer, side, dst)?.copy_from_slice(staged.block(layer, side, i as u32)?);
                    }
                }
            }
            let st = t.elapsed();
            drop(staged);

            evict(&mut scratch);
            let t = Instant::now();
            raw_read(&mut raw, &mut raw_buf[..bytes]).await?;
            black_box(&mut *raw_buf);
            let r = t.elapsed();

            evict(&mut scratch);
            let mut blocks = writer.checkout(&local_ids)?;
            let c = tcp.read_blocks_into(&tcp_lease, &remote, &mut blocks).await?.elapsed;
            drop(blocks);
            if rep >= 2 {
                t_mem.push(mem);
                t_shm.push(s);
                t_stage.push(st);
                t_raw.push(r);
                t_tcp.push(c);
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
    }
    shm.read_done(&shm_lease).await.ok();
    drop(p_kv);
    drop(d_kv);
    Ok(())
}
