//! Leases and block reads over both backends, on real sockets and real /dev/shm files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use pdmesh_kv_transfer::*;
use pdmesh_protocol::LeaseRefusalReason;

const UNTOUCHED: f32 = -7.5;

fn backends() -> [(&'static str, BackendConfig); 2] {
    [("shm", BackendConfig::Shm), ("tcp", tcp_backend())]
}

/// P holds `n` scattered blocks of a 300-block cache; D reads them into other local ids and
/// every float of every layer and side is compared.
async fn read_n_blocks(backend: BackendConfig, n: u32) {
    let p = producer(backend, "", 300).await;
    // Remote ids: a stride through P's cache, in a shuffled-looking order.
    let remote: Vec<u32> = (0..n).map(|i| (i * 7 + 3) % 300).rev().collect();
    p.hold("req-1", &remote);
    let d = client_for(spec(n + 10), "");
    let agent = d.handshake(&p.endpoint(), "p-0").await.unwrap();
    let lease = agent.lease("req-1", &cap("req-1"), &remote, &vec![1; n as usize]).await.unwrap();
    let mut local = local_cache(spec(n + 10), UNTOUCHED);
    let local_ids: Vec<u32> = (0..n).map(|i| n + 9 - i).collect();
    let stats = agent.read_blocks(&lease, &remote, &mut local, &local_ids).await.unwrap();
    assert_eq!(stats.blocks, n);
    assert_eq!(stats.bytes, n as u64 * spec(1).bytes_per_block());
    assert_blocks_moved(&local, &remote, &local_ids, UNTOUCHED);
    agent.read_done(&lease).await.unwrap();
    assert_eq!(p.finished(), vec!["req-1".to_string()]);
    assert!(p.table.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_reads_exact_bytes_1_16_256_blocks() {
    for n in [1, 16, 256] {
        read_n_blocks(BackendConfig::Shm, n).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_reads_exact_bytes_1_16_256_blocks() {
    for n in [1, 16, 256] {
        read_n_blocks(tcp_backend(), n).await;
    }
}

/// D's production path: its cache lives on its own region, and the read lands in blocks
/// checked out of a second mapping of it — what the executor's view then sees, in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_land_in_place_in_blocks_checked_out_of_ds_own_region() {
    for (name, backend) in backends() {
        let p = producer(backend, "", 64).await;
        let remote = [9, 10, 11, 40, 2];
        p.hold("req-1", &remote);
        let d = client_for(spec(16), "");
        let agent = d.handshake(&p.endpoint(), "p-0").await.unwrap();
        let region = ShmRegion::create_for_spec(&format!("pdmesh-test-d-{}", uuid::Uuid::new_v4()), &spec(16)).unwrap();
        let writer = std::sync::Arc::new(KvBlockWriter::open(region.path(), spec(16)).unwrap());
        let mut kv = region.into_kv_cache(spec(16)).unwrap();
        kv.as_mut_slice().fill(UNTOUCHED);
        let local_ids = [3, 4, 5, 15, 0];
        let lease = agent.lease("req-1", &cap("req-1"), &remote, &[1; 5]).await.unwrap();
        let mut blocks = writer.checkout(&local_ids).unwrap();
        let stats = agent.read_blocks_into(&lease, &remote, &mut blocks).await.unwrap();
        assert_eq!(stats.bytes, 5 * spec(1).bytes_per_block(), "{name}");
        drop(blocks);
        assert_eq!(writer.checked_out(), 0);
        assert_blocks_moved(&kv, &remote, &local_ids, UNTOUCHED);
        agent.read_done(&lease).await.unwrap();
        // A read outside the lease is refused before a byte moves.
        let mut blocks = writer.checkout(&[7]).unwrap();
        assert!(agent.read_blocks_into(&lease, &[9], &mut blocks).await.is_err(), "{name}: lease is done");
        assert!(kv.block(0, pdmesh_model_api::kv_cache::KvSide::Key, 7).unwrap().iter().all(|x| *x == UNTOUCHED));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_read_under_a_lease_and_connection_reuse() {
    let p = producer(tcp_backend(), "", 32).await;
    p.hold("r", &[4, 5, 6, 7]);
    let d = client_for(spec(8), "");
    let agent = d.handshake(&p.endpoint(), "p-0").await.unwrap();
    let lease = agent.lease("r", &cap("r"), &[4, 5, 6, 7], &[1; 4]).await.unwrap();
    let mut local = local_cache(spec(8), UNTOUCHED);
    // Prefix hit on D: only the last two blocks are read, in two reads on one connection.
    agent.read_blocks(&lease, &[6], &mut local, &[0]).await.unwrap();
    agent.read_blocks(&lease, &[7], &mut local, &[1]).await.unwrap();
    assert_blocks_moved(&local, &[6, 7], &[0, 1], UNTOUCHED);
    assert_eq!(p.agent.stats().tcp_reads.load(Ordering::Relaxed), 2);
    agent.read_done(&lease).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_refused_unknown_stale_freed_and_injected() {
    for (name, backend) in backends() {
        let p = producer(backend, "", 16).await;
        p.hold("held", &[1, 2]);
        let d = client_for(spec(4), "");
        let agent = d.handshake(&p.endpoint(), "p-0").await.unwrap();
        let reason = |r: Result<Lease, TransferError>| match r {
            Err(TransferError::LeaseRefused { reason, .. }) => reason,
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!(reason(agent.lease("unknown", &cap("unknown"), &[1, 2], &[1, 1]).await), LeaseRefusalReason::Gone);
        assert_eq!(
            reason(agent.lease("held", &cap("held"), &[1, 2], &[1, 2]).await),
            LeaseRefusalReason::GenerationMismatch
        );
        assert_eq!(
            reason(agent.lease("held", &cap("held"), &[1, 3], &[1, 1]).await),
            LeaseRefusalReason::BlockMismatch
        );
        // Freed on P (aborted there): a later lease is refused, nothing is read.
        assert_eq!(p.table.lock().unwrap().abort("held"), NoticeOutcome::Released);
        assert_eq!(reason(agent.lease("held", &cap("held"), &[1, 2], &[1, 1]).await), LeaseRefusalReason::Gone);
        assert_eq!(p.agent.stats().leases_refused.load(Ordering::Relaxed), 4);
    }
    let p = producer(BackendConfig::Shm, "lease_refused", 16).await;
    p.hold("held", &[1]);
    let agent = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
    match agent.lease("held", &cap("held"), &[1], &[1]).await {
        Err(TransferError::LeaseRefused { reason: LeaseRefusalReason::FaultInjected, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(p.table.lock().unwrap().is_held("held"), "an injected refusal leaves the hold to its deadline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_outside_a_valid_lease_are_refused_and_touch_nothing() {
    for (name, backend) in backends() {
        let p = producer_with(
            backend,
            "",
            16,
            HoldTableConfig { lease_ttl: Duration::from_millis(300), ..Default::default() },
        )
        .await;
        p.hold("r", &[1, 2]);
        let agent = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
        let mut local = local_cache(spec(4), UNTOUCHED);
        let lease = agent.lease("r", &cap("r"), &[1, 2], &[1, 1]).await.unwrap();
        // A block the lease does not cover, and an out-of-range local block.
        let err = agent.read_blocks(&lease, &[3], &mut local, &[0]).await.unwrap_err();
        assert!(matches!(err, TransferError::LeaseInvalid(_)), "{name}: {err:?}");
        let err = agent.read_blocks(&lease, &[1], &mut local, &[4]).await.unwrap_err();
        assert!(matches!(err, TransferError::BlockOutOfRange { which: "local", .. }), "{name}: {err:?}");
        let err = agent.read_blocks(&lease, &[1, 2], &mut local, &[0]).await.unwrap_err();
        assert!(matches!(err, TransferError::BadRequest(_)), "{name}: {err:?}");
        let err = agent.read_blocks(&lease, &[1, 2], &mut local, &[3, 3]).await.unwrap_err();
        assert!(matches!(err, TransferError::BadRequest(_)), "{name}: {err:?}");
        // Expired: the reader's own clock refuses first.
        tokio::time::sleep(Duration::from_millis(350)).await;
        let err = agent.read_blocks(&lease, &[1], &mut local, &[0]).await.unwrap_err();
        assert!(matches!(err, TransferError::LeaseInvalid(_)), "{name}: {err:?}");
        assert!(local.as_slice().iter().all(|x| *x == UNTOUCHED), "{name}: nothing written");
        // P's sweep frees the request; the late read done is told the lease was lost.
        assert_eq!(p.table.lock().unwrap().expire(Instant::now()), 1);
        assert!(matches!(agent.read_done(&lease).await, Err(TransferError::LeaseLost(_))), "{name}");
        // A stale reference (blocks reused with a new generation) never gets a lease.
        let deadline = Instant::now() + Duration::from_secs(9);
        p.table.lock().unwrap().hold_with_capability("r2", vec![1, 2], vec![2, 2], deadline, cap("r2"));
        let err = agent.lease("r2", &cap("r2"), &[1, 2], &[1, 1]).await.unwrap_err();
        assert!(
            matches!(err, TransferError::LeaseRefused { reason: LeaseRefusalReason::GenerationMismatch, .. }),
            "{name}: {err:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_after_read_done_is_refused() {
    for (name, backend) in backends() {
        let p = producer(backend, "", 16).await;
        p.hold("r", &[1]);
        let agent = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
        let lease = agent.lease("r", &cap("r"), &[1], &[1]).await.unwrap();
        let mut local = local_cache(spec(4), UNTOUCHED);
        agent.read_blocks(&lease, &[1], &mut local, &[0]).await.unwrap();
        agent.read_done(&lease).await.unwrap();
        let err = agent.read_blocks(&lease, &[1], &mut local, &[1]).await.unwrap_err();
        assert!(matches!(err, TransferError::LeaseInvalid(_)), "{name}: {err:?}");
        // A duplicate read done is refused by P (and counted), never a second release.
        assert!(matches!(agent.read_done(&lease).await, Err(TransferError::LeaseLost(_))), "{name}");
        assert_eq!(p.finished(), vec!["r".to_string()]);
        assert_eq!(p.table.lock().unwrap().counters().duplicate_read_done, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_side_release_is_detected_shm_at_read_done_tcp_at_read() {
    // P released the request while D still believed its lease valid (P's clock ran ahead).
    // shm is one-sided: the copy happens, but read done reports the lease lost, so D never
    // trusts those bytes. tcp: P refuses to stream at all.
    for (name, backend) in backends() {
        let p = producer(backend, "", 16).await;
        p.hold("r", &[1]);
        let agent = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
        let lease = agent.lease("r", &cap("r"), &[1], &[1]).await.unwrap();
        assert_eq!(p.table.lock().unwrap().expire(Instant::now() + Duration::from_secs(3600)), 1);
        let mut local = local_cache(spec(4), UNTOUCHED);
        let read = agent.read_blocks(&lease, &[1], &mut local, &[0]).await;
        if name == "tcp" {
            match read {
                Err(TransferError::LeaseRefused { reason: LeaseRefusalReason::LeaseInvalid, .. }) => {}
                other => panic!("tcp: {other:?}"),
            }
            assert!(local.as_slice().iter().all(|x| *x == UNTOUCHED));
            assert_eq!(p.agent.stats().tcp_reads_refused.load(Ordering::Relaxed), 1);
        } else {
            assert!(read.is_ok());
        }
        assert!(matches!(agent.read_done(&lease).await, Err(TransferError::LeaseLost(_))), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn give_up_and_heartbeat_reach_the_hold_table() {
    let p = producer(BackendConfig::Shm, "", 16).await;
    p.hold("waiting", &[1]);
    p.hold("rejected", &[2]);
    p.hold("failed", &[3]);
    let agent = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
    agent.heartbeat(&[("waiting".into(), cap("waiting")), ("ghost".into(), cap("ghost"))]).await.unwrap();
    assert_eq!(p.table.lock().unwrap().counters().unknown_heartbeats, 1);
    // R1/R4: D gives up without a lease -> P frees at once.
    agent.give_up("rejected", &cap("rejected"), "rejected before admission", None).await.unwrap();
    // R4: a load failure after a lease -> giving up under it ends the lease and frees.
    let lease = agent.lease("failed", &cap("failed"), &[3], &[1]).await.unwrap();
    agent.give_up("failed", &cap("failed"), "transfer failed", Some(&lease)).await.unwrap();
    let mut local = local_cache(spec(4), UNTOUCHED);
    assert!(agent.read_blocks(&lease, &[3], &mut local, &[0]).await.is_err(), "a given-up lease reads nothing");
    assert_eq!(p.finished(), vec!["rejected".to_string(), "failed".to_string()]);
    // Duplicates (e.g. every DP rank forwarding the same rejection) are counted, not errors.
    agent.give_up("rejected", &cap("rejected"), "again", None).await.unwrap();
    assert_eq!(p.table.lock().unwrap().counters().duplicate_give_ups, 1);
    assert!(p.table.lock().unwrap().is_held("waiting"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_transfer_setup_error_touches_nothing() {
    for (name, backend) in backends() {
        let p = producer(backend, "", 16).await;
        p.hold("r", &[1, 2]);
        let agent = client_for(spec(4), "transfer_setup_error").handshake(&p.endpoint(), "p-0").await.unwrap();
        let lease = agent.lease("r", &cap("r"), &[1, 2], &[1, 1]).await.unwrap();
        let mut local = local_cache(spec(4), UNTOUCHED);
        let err = agent.read_blocks(&lease, &[1, 2], &mut local, &[0, 1]).await.unwrap_err();
        assert!(matches!(err, TransferError::Setup(_)), "{name}: {err:?}");
        assert!(!err.local_blocks_touched());
        assert!(local.as_slice().iter().all(|x| *x == UNTOUCHED));
        agent.give_up("r", &cap("r"), "load failed", Some(&lease)).await.unwrap();
        assert_eq!(p.finished(), vec!["r".to_string()]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_transfer_midway_writes_about_half() {
    for (name, backend) in backends() {
        let p = producer(backend, "", 16).await;
        p.hold("r", &[1, 2, 3, 4]);
        let agent = client_for(spec(4), "transfer_midway").handshake(&p.endpoint(), "p-0").await.unwrap();
        let lease = agent.lease("r", &cap("r"), &[1, 2, 3, 4], &[1; 4]).await.unwrap();
        let mut local = local_cache(spec(4), UNTOUCHED);
        let err = agent.read_blocks(&lease, &[1, 2, 3, 4], &mut local, &[0, 1, 2, 3]).await.unwrap_err();
        let total = 4 * spec(1).bytes_per_block();
        match &err {
            TransferError::Midway { bytes_done, .. } => {
                assert!(*bytes_done > 0 && *bytes_done <= total / 2, "{name}: {bytes_done} of {total}")
            }
            other => panic!("{name}: {other:?}"),
        }
        assert!(err.local_blocks_touched());
        // The first blocks arrived, the last did not.
        assert_blocks_moved_prefix(&local);
        agent.give_up("r", &cap("r"), "load failed", Some(&lease)).await.unwrap();
        assert_eq!(p.finished(), vec!["r".to_string()]);
        if name == "tcp" {
            // P really saw the reader go away mid-stream.
            let deadline = Instant::now() + Duration::from_secs(5);
            while p.agent.stats().tcp_errors.load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(p.agent.stats().tcp_errors.load(Ordering::Relaxed), 1);
        }
    }
}

fn assert_blocks_moved_prefix(local: &pdmesh_model_api::KvCache) {
    use pdmesh_model_api::kv_cache::KvSide;
    let first = local.block(0, KvSide::Key, 0).unwrap();
    assert_eq!(first[0].to_bits(), pattern(0, KvSide::Key, 1, 0).to_bits());
    let last = local.block(2, KvSide::Value, 3).unwrap();
    assert!(last.iter().all(|x| *x == UNTOUCHED));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_drop_read_done_leaves_p_to_expire_the_lease() {
    let p = producer_with(
        BackendConfig::Shm,
        "",
        16,
        HoldTableConfig { lease_ttl: Duration::from_millis(200), ..Default::default() },
    )
    .await;
    p.hold("r", &[1]);
    let agent = client_for(spec(4), "drop_read_done").handshake(&p.endpoint(), "p-0").await.unwrap();
    let lease = agent.lease("r", &cap("r"), &[1], &[1]).await.unwrap();
    let mut local = local_cache(spec(4), UNTOUCHED);
    agent.read_blocks(&lease, &[1], &mut local, &[0]).await.unwrap();
    agent.read_done(&lease).await.unwrap();
    assert!(p.table.lock().unwrap().is_held("r"), "P never heard read done");
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(p.table.lock().unwrap().expire(Instant::now()), 1);
    assert_eq!(p.finished(), vec!["r".to_string()]);
    assert_eq!(p.table.lock().unwrap().counters().expired_leases, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_delay_transfer() {
    for (name, backend) in backends() {
        let p = producer(backend, "", 16).await;
        p.hold("r", &[1]);
        let agent = client_for(spec(4), "delay_transfer_ms=200").handshake(&p.endpoint(), "p-0").await.unwrap();
        let lease = agent.lease("r", &cap("r"), &[1], &[1]).await.unwrap();
        let mut local = local_cache(spec(4), UNTOUCHED);
        let stats = agent.read_blocks(&lease, &[1], &mut local, &[0]).await.unwrap();
        assert!(stats.elapsed >= Duration::from_millis(200), "{name}: {stats:?}");
        assert_blocks_moved(&local, &[1], &[0], UNTOUCHED);
        agent.read_done(&lease).await.unwrap();
    }
}

#[test]
fn works_inside_an_actix_system() {
    // connector-workers are actix actors: a current-thread runtime plus a LocalSet.
    actix_rt::System::new().block_on(async {
        for (_, backend) in backends() {
            let p = producer(backend, "", 16).await;
            p.hold("r", &[5, 6]);
            let agent = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
            let lease = agent.lease("r", &cap("r"), &[5, 6], &[1, 1]).await.unwrap();
            let mut local = local_cache(spec(4), UNTOUCHED);
            agent.read_blocks(&lease, &[5, 6], &mut local, &[2, 0]).await.unwrap();
            assert_blocks_moved(&local, &[5, 6], &[2, 0], UNTOUCHED);
            agent.read_done(&lease).await.unwrap();
            assert_eq!(p.finished(), vec!["r".to_string()]);
        }
    });
}
