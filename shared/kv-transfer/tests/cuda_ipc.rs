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

use pdmesh_kv_transfer::cuda::{local_copy, open_device, DeviceKvRegion, IpcHandle, RemoteDeviceKv};
use pdmesh_kv_transfer::{
    ClientConfig, CompatInputs, DeviceBlockWriter, HandshakeError, LocalKv, TransferClient, TransferError,
};
use pdmesh_model_api::KvCacheSpec;

/// SmolLM2-135M's cache geometry: 30 layers, 3 KV heads of 64, blocks of 16 (737 KB a block).
fn spec(num_blocks: u32) -> KvCacheSpec {
    KvCacheSpec { num_layers: 30, num_blocks, block_size: 16, num_kv_heads: 3, head_dim: 64 }
}
const P_BLOCKS: u32 = 512;

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
        Err(e) => {
            eprintln!("no GPU here ({e}): skipping the CUDA IPC test (built with the cuda feature)");
            return;
        }
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
    assert!(RemoteDeviceKv::open(ctx.clone(), &IpcHandle([7u8; 64]), spec(P_BLOCKS)).is_err());
    let remote = RemoteDeviceKv::open(ctx.clone(), &handle, spec(P_BLOCKS)).unwrap();
    eprintln!("D: opened P's region");
    let local = DeviceKvRegion::new(ctx.clone(), spec(P_BLOCKS)).unwrap();
    let (rb, lb) = (vec![3u32, 7, 8, 9, 100, 511], vec![0u32, 1, 2, 3, 4, 5]);
    let bytes = remote.read_blocks(&rb, &local, &lb).unwrap();
    assert_eq!(bytes, 6 * spec(P_BLOCKS).bytes_per_block());
    let got = local.download().unwrap();
    let s = spec(P_BLOCKS);
    let fpb = s.floats_per_block();
    for layer in 0..30usize {
        for side in 0..2usize {
            for (&r, &l) in rb.iter().zip(&lb) {
                let src = ((layer * 2 + side) * P_BLOCKS as usize + r as usize) * fpb;
                let dst = ((layer * 2 + side) * P_BLOCKS as usize + l as usize) * fpb;
                for j in 0..fpb {
                    assert_eq!(got[dst + j], pattern(src + j), "layer {layer} side {side} block {r}->{l} float {j}");
                }
            }
            // a block nobody wrote is still zero
            let untouched = ((layer * 2 + side) * P_BLOCKS as usize + 6) * fpb;
            assert!(got[untouched..untouched + fpb].iter().all(|&x| x == 0.0));
        }
    }
    // out-of-range and mismatched requests are errors, not faults
    assert!(remote.read_blocks(&[P_BLOCKS], &local, &[0]).is_err());
    assert!(remote.read_blocks(&[1, 2], &local, &[0]).is_err());

    // Bandwidth: IPC read of n contiguous blocks vs a device copy of as many bytes within this
    // process, interleaved, median of 20 each.
    let other = DeviceKvRegion::new(ctx.clone(), spec(P_BLOCKS)).unwrap();
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
    writeln!(p.stdin.take().unwrap()).unwrap();
    assert!(p.wait().unwrap().success());
}

/// Start this test binary as P running `test`, and read the line P prints after `marker`.
/// The caller waits for P; a failed assert ends this process, which closes P's stdin and so
/// ends P too.
#[allow(clippy::zombie_processes)]
fn start_p(test: &str, role: &str, marker: &str) -> (Child, String) {
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
            return (p, line[i + marker.len()..].trim().to_string());
        }
    }
}

const AGENT_BLOCKS: u32 = 64;
const WEIGHTS: &str = "sha256:cuda-agent-test";

fn compat(spec: &KvCacheSpec) -> String {
    CompatInputs::for_spec(WEIGHTS, spec).hash()
}

/// P with a transfer agent: its GPU region holds `pattern`, request `req-p` holds blocks 3, 4
/// and 9 (generation 1), and the agent serves the region until D closes P's stdin.
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
        assert!(table.lock().unwrap().hold("req-p", vec![3, 4, 9], vec![1, 1, 1], deadline));
        println!("SIDE_CHANNEL {}", agent.side_channel_endpoint());
        std::io::stdout().flush().unwrap();
        tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new())).await.unwrap().unwrap();
        // D confirmed its read: P's hold was released by `read done`.
        assert_eq!(table.lock().unwrap().take_finished_sending(), vec!["req-p".to_string()]);
        drop(region);
    });
}

#[test]
fn cuda_backend_leases_reads_and_confirms_between_processes() {
    let ctx = match open_device(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("no GPU here ({e}): skipping the cuda backend test (built with the cuda feature)");
            return;
        }
    };
    let (mut p, endpoint) = start_p("p_agent_process", "agent", "SIDE_CHANNEL ");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let local_spec = spec(32);
        // A consumer whose cache is in host memory cannot read GPU memory: refused at handshake.
        let host = TransferClient::new(ClientConfig::new("d-host/0", local_spec, compat(&local_spec)));
        match host.handshake(&endpoint, "p-gpu").await {
            Err(HandshakeError::Incompatible(why)) => assert!(why.contains("same backend"), "{why}"),
            other => panic!("a host-memory consumer read a cuda producer: {other:?}"),
        }

        let region = Arc::new(DeviceKvRegion::new(ctx.clone(), local_spec).unwrap());
        let mut config = ClientConfig::new("d-gpu/0", local_spec, compat(&local_spec));
        config.local_device = Some(region.clone());
        let remote = TransferClient::new(config).handshake(&endpoint, "p-gpu").await.unwrap();

        // A stale reference (another generation of the same blocks) is refused, nothing read.
        match remote.lease("req-p", &[3, 4, 9], &[1, 2, 1]).await {
            Err(TransferError::LeaseRefused { .. }) => {}
            other => panic!("a stale generation was leased: {other:?}"),
        }

        let lease = remote.lease("req-p", &[3, 4, 9], &[1, 1, 1]).await.unwrap();
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
                    let src = pdmesh_kv_transfer::cuda::block_offset(&p_spec, layer, side, r);
                    for (j, x) in got.iter().enumerate() {
                        assert_eq!(*x, pattern(src + j), "layer {layer} side {side} block {r}->{l} float {j}");
                    }
                }
                assert!(region.read_block(layer, side, 6).unwrap().iter().all(|&x| x == 0.0), "block 6 untouched");
            }
        }
    });
    writeln!(p.stdin.take().unwrap()).unwrap();
    assert!(p.wait().unwrap().success(), "P saw its hold released by read done");
}
