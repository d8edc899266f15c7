//! P answers before its worker registers the hold (docs/DECISIONS.md D65): over the real side
//! channel, a lease that arrives first waits for the hold and is then answered, or is refused
//! when its wait ends; a give-up that arrives first frees the hold as it registers (R4).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use pdmesh_kv_transfer::*;
use pdmesh_protocol::LeaseRefusalReason;

const UNTOUCHED: f32 = -7.5;

/// Until P's side channel has parked `n` lease requests (the state the test waits for, not a
/// time; bounded so a regression fails instead of hanging).
async fn parked(p: &Producer, n: usize) {
    for _ in 0..20_000 {
        if p.table.lock().unwrap().parked_len() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("P never parked {n} lease requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_before_the_hold_registers_is_granted_once_it_does() {
    for backend in [BackendConfig::Shm, tcp_backend()] {
        let p = producer(backend, "", 16).await;
        let agent = std::sync::Arc::new(client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap());
        let asking = {
            let agent = agent.clone();
            tokio::spawn(async move { agent.lease("early", &cap("early"), &[5, 6], &[1, 1]).await })
        };
        parked(&p, 1).await;
        assert!(!asking.is_finished(), "no answer before the hold registers");
        p.hold("early", &[5, 6]);
        let lease = asking.await.unwrap().unwrap();
        let mut local = local_cache(spec(4), UNTOUCHED);
        agent.read_blocks(&lease, &[5, 6], &mut local, &[0, 1]).await.unwrap();
        assert_blocks_moved(&local, &[5, 6], &[0, 1], UNTOUCHED);
        agent.read_done(&lease).await.unwrap();
        assert_eq!(p.finished(), vec!["early".to_string()]);
        let c = p.table.lock().unwrap().counters().clone();
        assert_eq!((c.leases_parked, c.parked_answered, c.leases_granted), (1, 1, 1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_lease_under_another_token_is_refused_as_unknown() {
    let p = producer(BackendConfig::Shm, "", 16).await;
    let agent = std::sync::Arc::new(client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap());
    let asking = {
        let agent = agent.clone();
        tokio::spawn(async move { agent.lease("r", &cap("not-r"), &[1], &[1]).await })
    };
    parked(&p, 1).await;
    p.hold("r", &[1]);
    match asking.await.unwrap() {
        Err(TransferError::LeaseRefused { reason: LeaseRefusalReason::Gone, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(p.agent.stats().capability_refused.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(p.table.lock().unwrap().leased_blocks(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_lease_is_refused_when_its_wait_ends() {
    let cfg = HoldTableConfig { early_wait: Duration::from_millis(50), ..HoldTableConfig::default() };
    let p = producer_with(BackendConfig::Shm, "", 16, cfg).await;
    let agent = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
    match agent.lease("never", &cap("never"), &[1], &[1]).await {
        Err(TransferError::LeaseRefused { reason: LeaseRefusalReason::Gone, .. }) => {}
        other => panic!("{other:?}"),
    }
    let c = p.table.lock().unwrap().counters().clone();
    assert_eq!((c.leases_parked, c.parked_timed_out), (1, 1));
    assert_eq!(p.table.lock().unwrap().parked_len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_up_before_the_hold_registers_frees_it_as_it_registers() {
    let p = producer(BackendConfig::Shm, "", 16).await;
    let agent = client_for(spec(4), "").handshake(&p.endpoint(), "p-0").await.unwrap();
    agent.give_up("gone", &cap("gone"), "rejected before admission", None).await.unwrap();
    assert_eq!(p.table.lock().unwrap().tombstones_len(), 1);
    p.hold("gone", &[3]);
    assert!(!p.table.lock().unwrap().is_held("gone"));
    assert_eq!(p.finished(), vec!["gone".to_string()]);
    // A give-up under another token leaves the hold alone.
    agent.give_up("kept", &cap("someone-else"), "stale", None).await.unwrap();
    p.hold("kept", &[4]);
    assert!(p.table.lock().unwrap().is_held("kept"));
}
