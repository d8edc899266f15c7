//! The `cuda` backend between two real processes on one GPU.
//! - The data path: P exports its device KV region, D maps it and copies leased blocks
//!   device-to-device into its own region; every float is checked, and the read is timed
//!   against a same-process device copy of the same bytes.
//! - The agent: P's transfer agent serves its exported region (`TransferAgent::start_device`);
//!   D's client, whose cache is a GPU region too, handshakes, leases, reads into blocks checked
//!   out of its region and confirms `read done`; a stale block generation is refused.
//!
//! Needs an NVIDIA GPU: without a CUDA driver each test says so and returns (the feature must
//! build everywhere). The P process is this test binary re-run with `PDMESH_CUDA_IPC_ROLE`.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: fail loudly

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_kv_transfer::cuda::{
    block_offset, local_copy, mapping_users, open_device, DeviceKvRegion, IpcHandle, RemoteDeviceKv,
};
use pdmesh_kv_transfer::{
    ClientConfig, CompatInputs, DeviceBlockWriter, HandshakeError, LocalKv, TransferClient, TransferError,
};
use pdmesh_model_api::KvCacheSpec;

/// Without a GPU the tests say so and pass, unless `PDMESH_REQUIRE_GPU=1` (set by
/// scripts/gpu-check.sh): then they fail, so a GPU check cannot pass by skipping.
fn skip_without_gpu(test: &str, why: &dyn std::fmt::Display) {
    assert!(std::env::var("PDMESH_REQUIRE_GPU").as_deref() != Ok("1"), "PDMESH_REQUIRE_GPU=1, but no GPU: {why}");
    eprintln!("no GPU here ({why}): skipping {test} (built with the cuda feature)");
}

/// SmolLM2-135M's cache geometry: 30 layers, 3 KV heads of 64, blocks of 16 (737 KB a block).
fn spec(num_blocks: u32) -> KvCacheSpec {
    KvCacheSpec { num_layers: 30, num_blocks, block_size: 16, num_kv_heads: 3, head_dim: 64 }
}
const P_BLOCKS: u32 = 512;
const D_BLOCKS: u32 = 300;

/// Every float of P's `remote[i]` landed in D's `local[i]`, every layer side, and D's block
/// `untouched` is still zero.
fn assert_blocks_copied(local: &DeviceKvRegion, remote: &[u32], local_ids: &[u32], untouched: u32) {
    let p = spec(P_BLOCKS);
    for layer in 0..p.num_layers as usize {
        for side in 0..2usize {
            for (&r, &l) in remote.iter().zip(local_ids) {
                let got = local.read_block(layer, side, l).unwrap();
                let src = block_offset(&p, layer, side, r);
                for (j, x) in got.iter().enumerate() {
                    assert_eq!(*x, pattern(src + j), "layer {layer} side {side} block {r}->{l} float {j}");
                }
            }
            assert!(local.read_block(layer, side, untouched).unwrap().iter().all(|&x| x == 0.0), "untouched block");
        }
    }
}

/// The value P writes at float `i` of its region: unique per position, exact in f32.
fn pattern(i: usize) -> f32 {
    ((i % 8_388_593) as f32) * 0.5 + 1.0
}

/// P: allocate, fill, export, wait until D says it is done.
#[test]
#[ignore = "run by cuda_ipc_reads_p_blocks_from_another_process as the P process"]
fn p_process() {
    if std::env::var("PDMESH_CUDA_IPC_ROLE").as_deref() != Ok("p") {
        return;
    }
    eprintln!("P: opening the GPU");
    let ctx = open_device(0).unwrap();
    let region = DeviceKvRegion::new(ctx, spec(P_BLOCKS)).unwrap();
    eprintln!("P: region allocated");
    let data: Vec<f32> = (0..region.spec().total_floats()).map(pattern).collect();
    region.upload(&data).unwrap();
    println!("HANDLE {}", region.export().unwrap().to_hex());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
}

#[test]
fn cuda_ipc_reads_p_blocks_from_another_process() {
    let ctx = match open_device(0) {
        Ok(c) => c,
        Err(e) => return skip_without_gpu("the CUDA IPC test", &e),
    };
    let mut p = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "p_process", "--nocapture", "--test-threads=1"])
        .env("PDMESH_CUDA_IPC_ROLE", "p")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    eprintln!("D: P started");
    let mut out = BufReader::new(p.stdout.take().unwrap());
    let handle = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "P exited before exporting its region");
        // the harness may print "test p_process ... " on the same line first
        if let Some(i) = line.find("HANDLE ") {
            break IpcHandle::from_hex(&line[i + 7..]).unwrap();
        }
    };

    eprintln!("D: got P's handle");
    // garbage is refused cleanly
    let garbage = IpcHandle([7u8; 64]);
    assert!(RemoteDeviceKv::open(ctx.clone(), &garbage, spec(P_BLOCKS)).is_err());
    assert_eq!(mapping_users(&ctx, &garbage), 0, "a refused handle leaves no mapping");
    let remote = RemoteDeviceKv::open(ctx.clone(), &handle, spec(P_BLOCKS)).unwrap();
    // A second open in the same context (a re-handshake while reads through the first are in
    // flight) shares the mapping; dropping it leaves the first one readable.
    let again = RemoteDeviceKv::open(ctx.clone(), &handle, spec(P_BLOCKS)).unwrap();
    assert_eq!(mapping_users(&ctx, &handle), 2, "one mapping per handle and context");
    drop(again);
    assert_eq!(mapping_users(&ctx, &handle), 1);
    eprintln!("D: opened P's region");
    // D's region has another block count than P's, so each side's pitch is its own.
    let local = DeviceKvRegion::new(ctx.clone(), spec(D_BLOCKS)).unwrap();
    let (rb, lb) = (vec![3u32, 7, 8, 9, 100, 511], vec![0u32, 1, 2, 3, 4, 299]);
    let bytes = remote.read_blocks(&rb, &local, &lb).unwrap();
    assert_eq!(bytes, 6 * spec(P_BLOCKS).bytes_per_block());
    assert_blocks_copied(&local, &rb, &lb, 6);

    // The fallback (a copy per row) moves the same bytes, into other blocks.
    let (rb2, lb2) = (vec![10u32, 11, 12, 40], vec![150u32, 151, 152, 7]);
    remote.read_blocks_row_by_row(&rb2, &local, &lb2).unwrap();
    assert_blocks_copied(&local, &rb2, &lb2, 6);

    // out-of-range and mismatched requests are errors, not faults
    assert!(remote.read_blocks(&[P_BLOCKS], &local, &[0]).is_err());
    assert!(remote.read_blocks(&[0], &local, &[D_BLOCKS]).is_err());
    assert!(remote.read_blocks(&[1, 2], &local, &[0]).is_err());

    // Bandwidth: IPC read of n contiguous blocks vs a device copy of as many bytes within this
    // process, interleaved, median of 20 each.
    let other = DeviceKvRegion::new(ctx.clone(), spec(D_BLOCKS)).unwrap();
    eprintln!("| blocks | bytes | IPC read GB/s | same-process copy GB/s | ratio |");
    for n in [1u32, 16, 256] {
        let blocks: Vec<u32> = (0..n).collect();
        let nbytes = n as usize * spec(P_BLOCKS).bytes_per_block() as usize;
        let (mut ipc, mut base) = (Vec::new(), Vec::new());
        for _ in 0..20 {
            let t = Instant::now();
            remote.read_blocks(&blocks, &local, &blocks).unwrap();
            ipc.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            local_copy(&other, &local, nbytes).unwrap();
            base.push(t.elapsed().as_secs_f64());
        }
        ipc.sort_by(f64::total_cmp);
        base.sort_by(f64::total_cmp);
        let (gi, gb) = (nbytes as f64 / ipc[10] / 1e9, nbytes as f64 / base[10] / 1e9);
        eprintln!("| {n} | {nbytes} | {gi:.1} | {gb:.1} | {:.2} |", gi / gb);
    }
    drop(remote);
    assert_eq!(mapping_users(&ctx, &handle), 0, "the last user closed the mapping");
    writeln!(p.stdin.take().unwrap()).unwrap();
    assert!(p.wait().unwrap().success());
}

/// P's process and the rest of its stdout. The pipe stays open until P is waited for: P's
/// test harness prints its verdict there when P ends, and a closed pipe would fail P.
struct PProcess {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl PProcess {
    /// Close P's stdin (its cue to finish), read what it prints until it exits, and return
    /// whether it succeeded.
    fn finish(mut self) -> bool {
        drop(self.child.stdin.take());
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut self.out, &mut rest);
        self.child.wait().is_ok_and(|s| s.success())
    }
}

/// Start this test binary as P running `test`, and read the line P prints after `marker`.
/// The caller finishes P; a failed assert ends this process, which closes P's stdin and so
/// ends P too.
#[allow(clippy::zombie_processes)]
fn start_p(test: &str, role: &str, marker: &str) -> (PProcess, String) {
    let mut p = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", test, "--nocapture", "--test-threads=1"])
        .env("PDMESH_CUDA_IPC_ROLE", role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(p.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "P exited before printing {marker}");
        // the harness may print "test NAME ... " on the same line first
        if let Some(i) = line.find(marker) {
            let found = line[i + marker.len()..].trim().to_string();
            return (PProcess { child: p, out }, found);
        }
    }
}

const AGENT_BLOCKS: u32 = 256;
/// Block counts the agent path is timed at, and the timed reads of each.
const BW_BLOCKS: [u32; 3] = [1, 16, 256];
const BW_READS: usize = 20;

/// The requests P holds for the timed reads: `BW_READS` per size, each over blocks `0..n`.
fn bw_requests() -> Vec<(String, u32)> {
    BW_BLOCKS.iter().flat_map(|&n| (0..BW_READS).map(move |i| (format!("bw-{n}-{i}"), n))).collect()
}
const WEIGHTS: &str = "sha256:cuda-agent-test";

fn compat(spec: &KvCacheSpec) -> String {
    CompatInputs::for_spec(WEIGHTS, spec).hash()
}

/// P with a transfer agent: its GPU region holds `pattern`, request `req-p` holds blocks 3, 4
/// and 9 (generation 1), the timed reads' requests hold theirs, and the agent serves the region
/// until D closes P's stdin.
#[test]
#[ignore = "run by cuda_backend_leases_reads_and_confirms_between_processes as the P process"]
fn p_agent_process() {
    if std::env::var("PDMESH_CUDA_IPC_ROLE").as_deref() != Ok("agent") {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let spec = spec(AGENT_BLOCKS);
        let region = DeviceKvRegion::new(open_device(0).unwrap(), spec).unwrap();
        let data: Vec<f32> = (0..spec.total_floats()).map(pattern).collect();
        region.upload(&data).unwrap();
        let handle = region.export().unwrap().to_hex();
        let (agent, table) = common::device_agent("p-gpu", handle, spec, compat(&spec)).await;
        let deadline = Instant::now() + Duration::from_secs(120);
        {
            let mut t = table.lock().unwrap();
            assert!(t.hold_with_capability("req-p", vec![3, 4, 9], vec![1, 1, 1], deadline, common::cap("req-p")));
            for (id, n) in bw_requests() {
                assert!(t.hold_with_capability(&id, (0..n).collect(), vec![1; n as usize], deadline, common::cap(&id)));
            }
        }
        println!("SIDE_CHANNEL {}", agent.side_channel_endpoint());
        std::io::stdout().flush().unwrap();
        tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new())).await.unwrap().unwrap();
        // D confirmed every read: each hold was released by its `read done`.
        let mut finished = table.lock().unwrap().take_finished_sending();
        finished.sort();
        let mut expected: Vec<String> = bw_requests().into_iter().map(|(id, _)| id).collect();
        expected.push("req-p".into());
        expected.sort();
        assert_eq!(finished, expected);
        drop(region);
    });
}

#[test]
fn cuda_backend_leases_reads_and_confirms_between_processes() {
    let ctx = match open_device(0) {
        Ok(c) => c,
        Err(e) => return skip_without_gpu("the cuda backend test", &e),
    };
    let (p, endpoint) = start_p("p_agent_process", "agent", "SIDE_CHANNEL ");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // D's block count differs from P's (only the geometry must match).
        let local_spec = spec(D_BLOCKS);
        // A consumer whose cache is in host memory cannot read GPU memory: refused at handshake.
        let host = TransferClient::new(ClientConfig::new("d-host/0", local_spec, compat(&local_spec), common::secret()));
        match host.handshake(&endpoint, "p-gpu").await {
            Err(HandshakeError::Incompatible(why)) => assert!(why.contains("same backend"), "{why}"),
            other => panic!("a host-memory consumer read a cuda producer: {other:?}"),
        }

        let region = Arc::new(DeviceKvRegion::new(ctx.clone(), local_spec).unwrap());
        let mut config = ClientConfig::new("d-gpu/0", local_spec, compat(&local_spec), common::secret());
        config.local_device = Some(region.clone());
        let remote = TransferClient::new(config).handshake(&endpoint, "p-gpu").await.unwrap();

        // A stale reference (another generation of the same blocks) is refused, nothing read.
        match remote.lease("req-p", &common::cap("req-p"), &[3, 4, 9], &[1, 2, 1]).await {
            Err(TransferError::LeaseRefused { .. }) => {}
            other => panic!("a stale generation was leased: {other:?}"),
        }

        let lease = remote.lease("req-p", &common::cap("req-p"), &[3, 4, 9], &[1, 1, 1]).await.unwrap();
        let local = LocalKv::Device(Arc::new(DeviceBlockWriter::new(region.clone())));
        let mut blocks = local.checkout(&[20, 21, 5]).unwrap();
        assert!(local.checkout(&[5]).is_err(), "a block being written is not handed out twice");
        let stats = remote.read_into(&lease, &[3, 4, 9], &mut blocks).await.unwrap();
        drop(blocks);
        assert_eq!(stats.bytes, 3 * local_spec.bytes_per_block());
        remote.read_done(&lease).await.unwrap();

        let p_spec = spec(AGENT_BLOCKS);
        for layer in 0..p_spec.num_layers as usize {
            for side in 0..2usize {
                for (r, l) in [(3u32, 20u32), (4, 21), (9, 5)] {
                    let got = region.read_block(layer, side, l).unwrap();
                    let src = block_offset(&p_spec, layer, side, r);
                    for (j, x) in got.iter().enumerate() {
                        assert_eq!(*x, pattern(src + j), "layer {layer} side {side} block {r}->{l} float {j}");
                    }
                }
                assert!(region.read_block(layer, side, 6).unwrap().iter().all(|&x| x == 0.0), "block 6 untouched");
            }
        }

        // Bandwidth through the agent path (lease, read into checked-out blocks, read done:
        // what a D worker does per request) against a device copy of as many bytes inside this
        // process, interleaved, medians. Printed, not asserted (docs/benchmarks.md).
        let other = DeviceKvRegion::new(ctx.clone(), local_spec).unwrap();
        eprintln!("| blocks | bytes | read_into GB/s | lease+read+done GB/s | same-process copy GB/s | read_into ratio | whole ratio |");
        for &n in &BW_BLOCKS {
            let ids: Vec<u32> = (0..n).collect();
            let generations = vec![1u64; ids.len()];
            let nbytes = n as usize * local_spec.bytes_per_block() as usize;
            let (mut read, mut whole, mut base) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..BW_READS {
                let t0 = Instant::now();
                let id = format!("bw-{n}-{i}");
                let lease = remote.lease(&id, &common::cap(&id), &ids, &generations).await.unwrap();
                let mut blocks = local.checkout(&ids).unwrap();
                let t1 = Instant::now();
                let stats = remote.read_into(&lease, &ids, &mut blocks).await.unwrap();
                let t2 = Instant::now();
                drop(blocks);
                remote.read_done(&lease).await.unwrap();
                whole.push(t0.elapsed().as_secs_f64());
                read.push((t2 - t1).as_secs_f64());
                assert_eq!(stats.bytes as usize, nbytes);
                let t = Instant::now();
                local_copy(&other, &region, nbytes).unwrap();
                base.push(t.elapsed().as_secs_f64());
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                nbytes as f64 / v[v.len() / 2] / 1e9
            };
            let (gr, gw, gb) = (median(&mut read), median(&mut whole), median(&mut base));
            eprintln!("| {n} | {nbytes} | {gr:.1} | {gw:.1} | {gb:.1} | {:.2} | {:.2} |", gr / gb, gw / gb);
        }
        // the timed reads wrote P's blocks 0..256 over the checked ones: read them back once
        let got = region.read_block(7, 1, 200).unwrap();
        let src = block_offset(&spec(AGENT_BLOCKS), 7, 1, 200);
        assert_ne!(block_offset(&local_spec, 7, 1, 200), src, "the regions' layouts differ");
        assert!(got.iter().enumerate().all(|(j, x)| *x == pattern(src + j)), "timed reads copied P's blocks");
    });
    assert!(p.finish(), "P saw its hold released by read done");
}
