//! The worker's one failure handler, after vLLM's failure-mode tests (handshake failure,
//! transfer setup failure, transfer failed, transfer exception): the request is reported in
//! `finished_recving` in the same step as its local blocks in `invalid_block_ids`, and no
//! staged load is returned (post-processing, the copy into the cache, never runs). A P and a D
//! runtime talk over a real side channel and shared memory, with the product's fault injection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdmesh_connector_worker::pd::{PdRuntime, PdSetup, StagedLoad};
use pdmesh_kv_transfer::{BackendConfig, FaultConfig, ShmRegion};
use pdmesh_model_api::KvCacheSpec;
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
        faults: FaultConfig::parse(faults).unwrap(),
        give_up_notices: true,
    }
}

/// P holds blocks 1 and 2 of `req-p`; D receives them into its blocks 3 and 4.
fn metas(port: u16) -> (KvConnectorMetadata, KvConnectorMetadata) {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let p = KvConnectorMetadata {
        reqs_to_send: vec![SendRequest {
            request_id: "req-p".into(),
            block_ids: vec![1, 2],
            block_generations: vec![1, 1],
            deadline_unix_ms: now_ms + 30_000,
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
async fn run_until_settled(p: &PdRuntime, d: &PdRuntime) -> (Vec<StagedLoad>, KvConnectorOutput, bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut p_released = false;
    loop {
        let (_, p_out) = p.finish_step();
        p_released |= p_out.finished_sending.iter().any(|id| id == "req-p");
        let (loads, out) = d.finish_step();
        if !out.finished_recving.is_empty() {
            // Give P's give-up a moment to land (it is sent before the receive settles).
            for _ in 0..50 {
                let (_, p_out) = p.finish_step();
                p_released |= p_out.finished_sending.iter().any(|id| id == "req-p");
                if p_released {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            return (loads, out, p_released);
        }
        assert!(Instant::now() < deadline, "the receive never settled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Start P with `p_faults` and D with `d_faults`, run one receive, return D's step output.
fn one_receive(p_faults: &str, d_faults: &str) -> (Vec<StagedLoad>, KvConnectorOutput, bool) {
    let system = actix::System::new();
    system.block_on(async {
        let port = free_port();
        let tag = format!("{}-{port}", std::process::id());
        let p_region = ShmRegion::create_for_spec(&format!("pdmesh-failtest-p-{tag}"), &spec()).unwrap();
        let d_region = ShmRegion::create_for_spec(&format!("pdmesh-failtest-d-{tag}"), &spec()).unwrap();
        let p = PdRuntime::start(setup("p", true, port, p_faults), spec(), p_region.path()).await.unwrap();
        let d = PdRuntime::start(setup("d", false, free_port(), d_faults), spec(), d_region.path()).await.unwrap();
        let (p_meta, d_meta) = metas(port);
        p.start_step(&p_meta, &Default::default());
        let _ = p.finish_step();
        d.start_step(&d_meta, &Default::default());
        run_until_settled(&p, &d).await
    })
}

fn assert_failed_in_one_step(loads: &[StagedLoad], out: &KvConnectorOutput) {
    assert_eq!(out.finished_recving, vec!["req-d".to_string()], "reported in done receiving");
    assert_eq!(out.invalid_block_ids, vec![3, 4], "its local blocks are invalid, in the same step");
    assert!(loads.is_empty(), "no KV post-processing (copy into the cache) for a failed load");
}

#[test]
fn a_successful_receive_is_loaded_and_p_releases() {
    let (loads, out, p_released) = one_receive("", "");
    assert_eq!(out.finished_recving, vec!["req-d".to_string()]);
    assert!(out.invalid_block_ids.is_empty());
    assert_eq!(loads.len(), 1);
    assert_eq!(loads[0].local_block_ids, vec![3, 4]);
    assert!(p_released, "read done released P's hold");
}

#[test]
fn handshake_failure_fails_the_request() {
    let (loads, out, _) = one_receive("compat_mismatch", "");
    assert_failed_in_one_step(&loads, &out);
}

#[test]
fn transfer_setup_failure_fails_the_request_and_p_frees_at_once() {
    let (loads, out, p_released) = one_receive("", "transfer_setup_error");
    assert_failed_in_one_step(&loads, &out);
    assert!(p_released, "D gave up, so P released at once (R4)");
}

#[test]
fn transfer_failed_midway_fails_the_request_and_p_frees_at_once() {
    let (loads, out, p_released) = one_receive("", "transfer_midway");
    assert_failed_in_one_step(&loads, &out);
    assert!(p_released);
}

#[test]
fn transfer_exception_fails_the_request_and_p_frees_at_once() {
    let (loads, out, p_released) = one_receive("", "transfer_exception");
    assert_failed_in_one_step(&loads, &out);
    assert!(p_released);
}

#[test]
fn lease_refusal_fails_the_request() {
    let (loads, out, _) = one_receive("lease_refused", "");
    assert_failed_in_one_step(&loads, &out);
}
