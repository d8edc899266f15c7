//! The worker's one failure handler, after vLLM's failure-mode tests (handshake failure,
//! transfer setup failure, transfer failed, transfer exception): the request is reported in
//! `finished_recving` in the same step as its local blocks in `invalid_block_ids`. A P and a D
//! runtime talk over a real side channel and shared memory, with the product's fault injection;
//! a successful receive lands P's bytes in D's own cache region, in place, and an engine-core
//! restart cancels a READ in flight before it writes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdmesh_connector_worker::pd::{PdMemory, PdRuntime, PdSetup};
use pdmesh_kv_transfer::{
    compat_hash, AgentConfig, BackendConfig, CompatInputs, FaultConfig, HoldTable, HoldTableConfig, MeshSecret,
    SharedPolicy, ShmRegion, TransferAgent,
};
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{KvCache, KvCacheSpec};
use pdmesh_protocol::{KvConnectorMetadata, KvConnectorOutput, KvTransferParams, RecvRequest, SendRequest};

fn spec() -> KvCacheSpec {
    KvCacheSpec { num_layers: 2, num_blocks: 8, block_size: 4, num_kv_heads: 1, head_dim: 4 }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn setup(name: &str, produces: bool, port: u16, faults: &str) -> PdSetup {
    PdSetup {
        engine_id: name.into(),
        rank: 0,
        produces,
        consumes: !produces,
        side_channel_bind: format!("tcp://127.0.0.1:{port}"),
        backend: BackendConfig::Shm,
        weights_id: "test-weights".into(),
        hold: Duration::from_secs(30),
        hold_table: HoldTableConfig::default(),
        remote_agent_idle: Duration::from_secs(600),
        faults: FaultConfig::parse(faults).unwrap(),
        give_up_notices: true,
        mesh_secret: secret(),
    }
}

/// The mesh secret both nodes of these tests share.
fn secret() -> MeshSecret {
    MeshSecret::parse("pdmesh-failures-test-mesh-secret-0123456789").unwrap()
}

const CAPABILITY: &str = "0123456789abcdef0123456789abcdef";

/// P holds blocks 1 and 2 of `req-p`; D receives them into its blocks 3 and 4.
fn metas(port: u16) -> (KvConnectorMetadata, KvConnectorMetadata) {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let p = KvConnectorMetadata {
        reqs_to_send: vec![SendRequest {
            request_id: "req-p".into(),
            block_ids: vec![1, 2],
            block_generations: vec![1, 1],
            deadline_unix_ms: now_ms + 30_000,
            capability: CAPABILITY.into(),
        }],
        ..Default::default()
    };
    let params = KvTransferParams {
        do_remote_prefill: Some(true),
        remote_engine_id: Some("p".into()),
        remote_request_id: Some("req-p".into()),
        remote_block_ids: Some(vec![1, 2]),
        remote_block_generations: Some(vec![1, 1]),
        remote_host: Some("127.0.0.1".into()),
        remote_port: Some(port),
        remote_capability: Some(CAPABILITY.into()),
        ..Default::default()
    };
    let d = KvConnectorMetadata {
        reqs_to_recv: vec![RecvRequest {
            request_id: "req-d".into(),
            local_block_ids: vec![3, 4],
            params,
            rejected_at_unix_us: None,
            trace: Default::default(),
        }],
        ..Default::default()
    };
    (p, d)
}

/// Step D (and P, as its engine would) until D reports the receive; returns D's step output
/// and whether P released the hold in that time.
async fn run_until_settled(p: &PdRuntime, d: &PdRuntime) -> (KvConnectorOutput, bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut p_released = false;
    loop {
        let p_out = p.finish_step();
        p_released |= p_out.finished_sending.iter().any(|id| id == "req-p");
        let out = d.finish_step();
        if !out.finished_recving.is_empty() {
            // Give P's give-up a moment to land (it is sent before the receive settles).
            for _ in 0..50 {
                let p_out = p.finish_step();
                p_released |= p_out.finished_sending.iter().any(|id| id == "req-p");
                if p_released {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            return (out, p_released);
        }
        assert!(Instant::now() < deadline, "the receive never settled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A P and a D runtime over their own cache regions; P's blocks 1 and 2 hold known values.
struct Pair {
    p: PdRuntime,
    d: PdRuntime,
    /// D's cache (what its executor would own), to look at what the receive wrote.
    d_kv: KvCache,
    _p_kv: KvCache,
    port: u16,
}

/// The value every float of P's block `b`, layer `l`, side `s` holds.
fn p_value(b: u32, l: usize, s: KvSide) -> f32 {
    (b * 100 + l as u32 * 10 + s as u32) as f32 + 0.5
}

async fn pair(p_faults: &str, d_faults: &str) -> Pair {
    pair_with(p_faults, d_faults, Duration::from_secs(600)).await
}

/// [`pair`] with D forgetting a prefill engine's handshake after `d_idle` unused.
async fn pair_with(p_faults: &str, d_faults: &str, d_idle: Duration) -> Pair {
    let port = free_port();
    let d_setup = PdSetup { remote_agent_idle: d_idle, ..setup("d", false, free_port(), d_faults) };
    pair_from(setup("p", true, port, p_faults), d_setup, port).await
}

/// A pair from full setups; `port` is P's side-channel port.
async fn pair_from(p_setup: PdSetup, d_setup: PdSetup, port: u16) -> Pair {
    let tag = format!("{}-{port}", std::process::id());
    let p_region = ShmRegion::create_for_spec(&format!("pdmesh-failtest-p-{tag}"), &spec()).unwrap();
    let d_region = ShmRegion::create_for_spec(&format!("pdmesh-failtest-d-{tag}"), &spec()).unwrap();
    let p_memory = PdMemory::Host(p_region.path().to_path_buf());
    let d_memory = PdMemory::Host(d_region.path().to_path_buf());
    let p = PdRuntime::start(p_setup, spec(), p_memory).await.unwrap();
    let d = PdRuntime::start(d_setup, spec(), d_memory).await.unwrap();
    let mut p_kv = p_region.into_kv_cache(spec()).unwrap();
    for b in [1, 2] {
        for l in 0..spec().num_layers as usize {
            for s in [KvSide::Key, KvSide::Value] {
                p_kv.block_mut(l, s, b).unwrap().fill(p_value(b, l, s));
            }
        }
    }
    Pair { p, d, d_kv: d_region.into_kv_cache(spec()).unwrap(), _p_kv: p_kv, port }
}

/// Start P with `p_faults` and D with `d_faults`, run one receive, return D's step output and
/// its cache.
fn one_receive(p_faults: &str, d_faults: &str) -> (KvConnectorOutput, bool, KvCache) {
    let system = actix::System::new();
    system.block_on(async {
        let pair = pair(p_faults, d_faults).await;
        let (p_meta, d_meta) = metas(pair.port);
        pair.p.start_step(&p_meta, &Default::default());
        let _ = pair.p.finish_step();
        pair.d.start_step(&d_meta, &Default::default());
        let (out, released) = run_until_settled(&pair.p, &pair.d).await;
        (out, released, pair.d_kv)
    })
}

/// `kv_read_lease_s` reaches P's hold table: a read stalled (by D's own fault injection)
/// longer than P's read lease loses its blocks — P releases them when the lease ends and
/// refuses D's `read done`, so D reports the load failed — while the same stall under the
/// default lease loads. Before the setting was honoured, every P used the default lease.
#[test]
fn ps_read_lease_setting_bounds_how_long_a_reader_keeps_the_blocks() {
    let receive_with_lease = |lease: Duration| {
        let system = actix::System::new();
        system.block_on(async {
            let port = free_port();
            let p_setup = PdSetup {
                hold_table: HoldTableConfig { lease_ttl: lease, ..Default::default() },
                ..setup("p", true, port, "")
            };
            let pair = pair_from(p_setup, setup("d", false, free_port(), "delay_transfer_ms=600"), port).await;
            let (p_meta, d_meta) = metas(pair.port);
            pair.p.start_step(&p_meta, &Default::default());
            let _ = pair.p.finish_step();
            pair.d.start_step(&d_meta, &Default::default());
            run_until_settled(&pair.p, &pair.d).await
        })
    };
    let (out, p_released) = receive_with_lease(Duration::from_millis(100));
    assert_failed_in_one_step(&out);
    assert!(p_released, "P released the hold when the short lease ended");
    let (out, p_released) = receive_with_lease(HoldTableConfig::default().lease_ttl);
    assert!(out.invalid_block_ids.is_empty(), "under the default lease the stalled read still loads: {out:?}");
    assert!(p_released);
}

fn assert_failed_in_one_step(out: &KvConnectorOutput) {
    assert_eq!(out.finished_recving, vec!["req-d".to_string()], "reported in done receiving");
    assert_eq!(out.invalid_block_ids, vec![3, 4], "its local blocks are invalid, in the same step");
}

/// Whether every float of D's blocks `blocks` is 0 (never written).
fn untouched(kv: &KvCache, blocks: &[u32]) -> bool {
    blocks.iter().all(|&b| {
        (0..spec().num_layers as usize).all(|l| {
            [KvSide::Key, KvSide::Value].into_iter().all(|s| kv.block(l, s, b).unwrap().iter().all(|x| *x == 0.0))
        })
    })
}

#[test]
fn a_successful_receive_is_loaded_in_place_and_p_releases() {
    let (out, p_released, d_kv) = one_receive("", "");
    assert_eq!(out.finished_recving, vec!["req-d".to_string()]);
    assert!(out.invalid_block_ids.is_empty());
    assert!(p_released, "read done released P's hold");
    // P's blocks 1 and 2 are in D's blocks 3 and 4, every layer and side; nothing else moved.
    for (p_block, d_block) in [(1, 3), (2, 4)] {
        for l in 0..spec().num_layers as usize {
            for s in [KvSide::Key, KvSide::Value] {
                let got = d_kv.block(l, s, d_block).unwrap();
                assert!(got.iter().all(|x| *x == p_value(p_block, l, s)), "D block {d_block}, layer {l}, {s:?}");
            }
        }
    }
    assert!(untouched(&d_kv, &[0, 1, 2, 5, 6, 7]));
}

/// D forgets a prefill engine nobody asked for during `remote_agent_idle_s`, unmapping P's
/// cache, and the next request for it handshakes again and loads as before.
#[test]
fn an_idle_prefill_engine_is_unmapped_and_handshaken_again_when_needed() {
    let system = actix::System::new();
    system.block_on(async {
        let idle = Duration::from_millis(50);
        let pair = pair_with("", "", idle).await;
        let p_path = format!("pdmesh-failtest-p-{}-{}", std::process::id(), pair.port);
        let mappings = || {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            maps.lines().filter(|l| l.contains(&p_path)).count()
        };
        let p_own = mappings();
        for round in 0..2 {
            let (p_meta, d_meta) = metas(pair.port);
            pair.p.start_step(&p_meta, &Default::default());
            let _ = pair.p.finish_step();
            pair.d.start_step(&d_meta, &Default::default());
            let (out, released) = run_until_settled(&pair.p, &pair.d).await;
            assert_eq!(out.finished_recving, vec!["req-d".to_string()], "round {round}");
            assert!(out.invalid_block_ids.is_empty(), "round {round}: loaded");
            assert!(released, "round {round}");
            assert_eq!(mappings(), p_own + 1, "round {round}: D maps P's cache");
            tokio::time::sleep(idle * 2).await;
            assert_eq!(pair.d.evict_idle_agents(), 1, "round {round}: unused for longer than the idle time");
            assert_eq!(mappings(), p_own, "round {round}: unmapped");
            assert_eq!(pair.d.evict_idle_agents(), 0);
        }
        assert_eq!(pair.p.evict_idle_agents(), 0, "P caches no handshakes");
    });
}

#[test]
fn handshake_failure_fails_the_request() {
    let (out, _, d_kv) = one_receive("compat_mismatch", "");
    assert_failed_in_one_step(&out);
    assert!(untouched(&d_kv, &[3, 4]), "nothing was read");
}

#[test]
fn transfer_setup_failure_fails_the_request_and_p_frees_at_once() {
    let (out, p_released, _) = one_receive("", "transfer_setup_error");
    assert_failed_in_one_step(&out);
    assert!(p_released, "D gave up, so P released at once (R4)");
}

#[test]
fn transfer_failed_midway_fails_the_request_and_p_frees_at_once() {
    let (out, p_released, _) = one_receive("", "transfer_midway");
    assert_failed_in_one_step(&out);
    assert!(p_released);
}

#[test]
fn transfer_exception_fails_the_request_and_p_frees_at_once() {
    let (out, p_released, _) = one_receive("", "transfer_exception");
    assert_failed_in_one_step(&out);
    assert!(p_released);
}

/// P's cache is GPU memory (the `cuda` backend) and D's is in host memory: D cannot read it,
/// so the handshake refuses it and the request follows the load-failure policy like any
/// handshake failure — reported with its blocks invalid in one step, nothing written.
#[test]
fn a_producer_on_another_backend_fails_the_request_at_handshake() {
    let system = actix::System::new();
    system.block_on(async {
        let port = free_port();
        let p_config = AgentConfig {
            engine_id: "p".into(),
            rank: 0,
            side_channel: format!("tcp://127.0.0.1:{port}"),
            backend: BackendConfig::Cuda,
            compat_hash: compat_hash(&CompatInputs::for_spec("test-weights".to_string(), &spec())),
            faults: FaultConfig::default(),
            mesh_secret: secret(),
        };
        // P holds the request's blocks, so only the handshake can stop D from leasing them.
        let table = std::sync::Arc::new(std::sync::Mutex::new(HoldTable::new(Default::default())));
        let deadline = Instant::now() + Duration::from_secs(60);
        assert!(table.lock().unwrap().hold_with_capability(
            "req-p",
            vec![1, 2],
            vec![1, 1],
            deadline,
            CAPABILITY.into()
        ));
        let policy: SharedPolicy = table.clone();
        let p_agent = TransferAgent::start_device(p_config, "ab".repeat(64), spec(), policy).await.unwrap();
        let d_region =
            ShmRegion::create_for_spec(&format!("pdmesh-failtest-d-{}-{port}", std::process::id()), &spec()).unwrap();
        let d_memory = PdMemory::Host(d_region.path().to_path_buf());
        let d = PdRuntime::start(setup("d", false, free_port(), ""), spec(), d_memory).await.unwrap();
        let d_kv = d_region.into_kv_cache(spec()).unwrap();
        let (_, d_meta) = metas(port);
        d.start_step(&d_meta, &Default::default());
        let deadline = Instant::now() + Duration::from_secs(15);
        let out = loop {
            let out = d.finish_step();
            if !out.finished_recving.is_empty() {
                break out;
            }
            assert!(Instant::now() < deadline, "the receive never settled");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert_failed_in_one_step(&out);
        assert!(untouched(&d_kv, &[3, 4]), "nothing was read");
        let stats = p_agent.stats();
        let leases = stats.leases_granted.load(std::sync::atomic::Ordering::Relaxed)
            + stats.leases_refused.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(leases, 0, "D asked for no lease: the handshake refused P");
        assert!(p_agent.stats().metadata_requests.load(std::sync::atomic::Ordering::Relaxed) >= 1, "D asked P");
    });
}

#[test]
fn lease_refusal_fails_the_request() {
    let (out, _, d_kv) = one_receive("lease_refused", "");
    assert_failed_in_one_step(&out);
    assert!(untouched(&d_kv, &[3, 4]));
}

/// The engine-core restarts while D's READ waits to copy (the `delay_transfer_ms` fault holds
/// it after the lease): the new engine may give blocks 3 and 4 to another request, so the READ
/// is cancelled and never writes them; the receive still ends towards P (a give-up frees P's
/// hold at once) and is not reported to the new engine.
#[test]
fn an_engine_restart_cancels_a_read_in_flight_before_it_writes() {
    let system = actix::System::new();
    system.block_on(async {
        let pair = pair("", "delay_transfer_ms=400").await;
        let (p_meta, d_meta) = metas(pair.port);
        pair.p.start_step(&p_meta, &Default::default());
        let _ = pair.p.finish_step();
        pair.d.start_step(&d_meta, &Default::default());
        // Wait until P has granted the lease: the READ is now in its delay.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pair.p.finish_step().leased_request_ids.iter().any(|id| id == "req-p") {
            assert!(Instant::now() < deadline, "no lease granted");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        pair.d.engine_restarted();
        // The cancelled READ gives P's blocks back: P releases them, long before its deadline.
        let mut released = false;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !released {
            assert!(Instant::now() < deadline, "P never released the hold");
            released = pair.p.finish_step().finished_sending.iter().any(|id| id == "req-p");
            assert!(pair.d.finish_step().finished_recving.is_empty(), "nothing is reported to the new engine");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Only two things release P here: the cancelled READ's give-up, or — had it gone on —
        // its `read done`, which follows its copy. So the blocks must be untouched now.
        assert!(untouched(&pair.d_kv, &[3, 4]), "a cancelled READ wrote into the new engine's blocks");
        assert!(pair.d.finish_step().finished_recving.is_empty());
    });
}

/// A scheduler invariant broken on purpose: two receives name the same local block (4). The
/// second READ cannot check it out while the first writes (held there by `delay_transfer_ms`),
/// so it fails as `local_blocks` without writing a byte — reported with its blocks invalid in
/// the same step, and P, told by a give-up, frees its hold at once; the first lands in place.
#[test]
fn a_receive_whose_blocks_another_is_writing_fails_without_writing() {
    let system = actix::System::new();
    system.block_on(async {
        let pair = pair("", "delay_transfer_ms=300").await;
        let (mut p_meta, mut d_meta) = metas(pair.port);
        let mut send2 = p_meta.reqs_to_send[0].clone();
        send2.request_id = "req-p2".into();
        send2.block_ids = vec![5, 6];
        p_meta.reqs_to_send.push(send2);
        let mut recv2 = d_meta.reqs_to_recv[0].clone();
        recv2.request_id = "req-d2".into();
        recv2.local_block_ids = vec![4, 5];
        recv2.params.remote_request_id = Some("req-p2".into());
        recv2.params.remote_block_ids = Some(vec![5, 6]);
        d_meta.reqs_to_recv.push(recv2);
        pair.p.start_step(&p_meta, &Default::default());
        let _ = pair.p.finish_step();
        pair.d.start_step(&d_meta, &Default::default());

        let (mut loaded, mut failed) = (Vec::new(), Vec::new());
        let mut released = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        while loaded.len() + failed.len() < 2 || released.len() < 2 {
            assert!(Instant::now() < deadline, "loaded {loaded:?}, failed {failed:?}, P released {released:?}");
            let out = pair.d.finish_step();
            for id in out.finished_recving {
                let blocks = if id == "req-d" { vec![3, 4] } else { vec![4, 5] };
                if blocks.iter().all(|b| out.invalid_block_ids.contains(b)) {
                    failed.push((id, blocks));
                } else {
                    loaded.push((id, blocks));
                }
            }
            released.extend(pair.p.finish_step().finished_sending);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!((loaded.len(), failed.len()), (1, 1), "one loads, the other fails: {loaded:?} {failed:?}");
        // The winner's bytes are P's, in its blocks.
        let (winner, blocks) = &loaded[0];
        let p_blocks: [u32; 2] = if winner == "req-d" { [1, 2] } else { [5, 6] };
        for (p_block, d_block) in p_blocks.into_iter().zip(blocks.iter().copied()) {
            let got = pair.d_kv.block(0, KvSide::Key, d_block).unwrap();
            assert!(got.iter().all(|x| *x == p_value(p_block, 0, KvSide::Key)), "{winner}: D block {d_block}");
        }
        // The loser wrote nothing: its block that is not shared is untouched.
        let loser_only = if winner == "req-d" { 5 } else { 3 };
        assert!(untouched(&pair.d_kv, &[loser_only]));
        released.sort();
        assert_eq!(released, vec!["req-p".to_string(), "req-p2".to_string()], "P freed both holds");
    });
}
