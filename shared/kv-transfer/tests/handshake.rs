//! Handshake over P's real side channel: success and every failure kind, each reached for real
//! (fault injection on P, or a genuinely different D).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use pdmesh_kv_transfer::*;
use pdmesh_protocol::{TransferBackend, KV_LAYOUT, TRANSFER_VERSION};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_ok_shm_and_tcp() {
    for backend in [BackendConfig::Shm, tcp_backend()] {
        let p = producer(backend.clone(), "", 8).await;
        let d = client_for(spec(4), "");
        let remote = d.handshake(&p.endpoint(), "p-0").await.unwrap();
        let meta = remote.metadata();
        assert_eq!(meta, p.agent.metadata());
        assert_eq!(meta.engine_id, "p-0");
        assert_eq!(meta.num_blocks, 8);
        assert_eq!(meta.layout, KV_LAYOUT);
        assert_eq!(meta.protocol_version, TRANSFER_VERSION);
        assert_eq!(meta.bytes_per_block, spec(8).bytes_per_block());
        match (&backend, &meta.backend) {
            (BackendConfig::Shm, TransferBackend::Shm { path }) => assert!(std::path::Path::new(path).exists()),
            (BackendConfig::Tcp { .. }, TransferBackend::Tcp { host, port }) => {
                assert_eq!(host, "127.0.0.1");
                assert_ne!(*port, 0);
            }
            other => panic!("backend {other:?}"),
        }
        assert!(remote.is_healthy());
        assert_eq!(p.agent.stats().metadata_requests.load(std::sync::atomic::Ordering::Relaxed), 1);
    }
}

/// A `cuda` producer (its cache in GPU memory) and a consumer whose cache is in host memory
/// cannot pair: the consumer refuses at handshake, before mapping anything, with a reason that
/// names the backends — the request then follows the load-failure policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_memory_consumer_refuses_a_cuda_producer() {
    let handle = "5a".repeat(64);
    let (agent, _table) = device_producer(&handle, 8).await;
    match &agent.metadata().backend {
        TransferBackend::Cuda { ipc_handle, host_boot_id: boot } => {
            assert_eq!(ipc_handle, &handle);
            assert_eq!(boot, &host_boot_id(), "P names its host");
        }
        other => panic!("advertised {other:?}"),
    }
    let d = client_for(spec(4), "");
    match d.handshake(agent.side_channel_endpoint(), "p-0").await {
        Err(HandshakeError::Incompatible(why)) => {
            assert!(why.contains("GPU memory") && why.contains("same backend"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(agent.stats().metadata_requests.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// The agent serves only memory its backend can: a host region is not served as `cuda`, a GPU
/// handle not as `shm` or `tcp`, and a handle that is not 64 bytes of hex not at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_refuses_memory_its_backend_cannot_serve() {
    let config = |backend: BackendConfig| AgentConfig {
        engine_id: "p-0".into(),
        rank: 0,
        side_channel: "tcp://127.0.0.1:0".into(),
        backend,
        compat_hash: hash_of(&spec(4)),
        faults: FaultConfig::default(),
        mesh_secret: secret(),
    };
    let policy = || -> SharedPolicy { std::sync::Arc::new(std::sync::Mutex::new(HoldTable::new(Default::default()))) };
    let region = ShmRegion::create_for_spec(&format!("pdmesh-test-{}", uuid::Uuid::new_v4()), &spec(4)).unwrap();
    let handle = "ab".repeat(64);
    let refused = [
        TransferAgent::start(config(BackendConfig::Cuda), region.path(), spec(4), policy()).await,
        TransferAgent::start_device(config(BackendConfig::Shm), handle.clone(), spec(4), policy()).await,
        TransferAgent::start_device(config(tcp_backend()), handle, spec(4), policy()).await,
        TransferAgent::start_device(config(BackendConfig::Cuda), "ab".repeat(63), spec(4), policy()).await,
        TransferAgent::start_device(config(BackendConfig::Cuda), "zz".repeat(64), spec(4), policy()).await,
    ];
    for (i, r) in refused.into_iter().enumerate() {
        assert!(matches!(r, Err(AgentError::Config(_))), "case {i}: {r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_timeout_when_p_does_not_answer() {
    let p = producer(BackendConfig::Shm, "handshake_timeout", 4).await;
    let d = client_for(spec(4), "");
    let started = Instant::now();
    let err = d.handshake(&p.endpoint(), "p-0").await.unwrap_err();
    assert_eq!(err, HandshakeError::Timeout(Duration::from_millis(1500)));
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(1400) && waited < Duration::from_secs(3), "{waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_compat_mismatch_injected_and_real() {
    let p = producer(BackendConfig::Shm, "compat_mismatch", 4).await;
    let d = client_for(spec(4), "");
    match d.handshake(&p.endpoint(), "p-0").await {
        Err(HandshakeError::CompatMismatch { local, remote }) => {
            assert_eq!(local, hash_of(&spec(4)));
            assert!(remote.starts_with("fault-injected-"));
        }
        other => panic!("{other:?}"),
    }
    // A D with other weights hashes differently for real.
    let p = producer(BackendConfig::Shm, "", 4).await;
    let local = spec(4);
    let other = ClientConfig::new("d", local, CompatInputs::for_spec("sha256:other-weights", &local).hash(), secret());
    let err = TransferClient::new(other).handshake(&p.endpoint(), "p-0").await.unwrap_err();
    assert!(matches!(err, HandshakeError::CompatMismatch { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_undecodable_metadata() {
    let p = producer(BackendConfig::Shm, "undecodable_metadata", 4).await;
    let d = client_for(spec(4), "");
    let err = d.handshake(&p.endpoint(), "p-0").await.unwrap_err();
    assert!(matches!(err, HandshakeError::UndecodableMetadata(_)), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_engine_id_mismatch_injected_and_real() {
    let p = producer(BackendConfig::Shm, "engine_id_mismatch", 4).await;
    let d = client_for(spec(4), "");
    let err = d.handshake(&p.endpoint(), "p-0").await.unwrap_err();
    assert_eq!(err, HandshakeError::EngineIdMismatch { expected: "p-0".into(), found: "p-0-fault-injected".into() });
    let p = producer(BackendConfig::Shm, "", 4).await;
    let err = d.handshake(&p.endpoint(), "p-7").await.unwrap_err();
    assert_eq!(err, HandshakeError::EngineIdMismatch { expected: "p-7".into(), found: "p-0".into() });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_incompatible_geometry() {
    // Same hash forced on purpose (e.g. hash enforcement off in a test setup): the geometry
    // check still refuses, naming what differs.
    let p = producer(BackendConfig::Shm, "", 4).await;
    let local = pdmesh_model_api::KvCacheSpec { head_dim: 32, ..spec(4) };
    let config = ClientConfig::new("d", local, hash_of(&spec(4)), secret());
    match TransferClient::new(config).handshake(&p.endpoint(), "p-0").await {
        Err(HandshakeError::Incompatible(why)) => assert!(why.contains("head_dim"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_unreachable_when_nothing_listens() {
    let port = free_port();
    let d = client_for(spec(4), "");
    let started = Instant::now();
    let err = d.handshake(&side_channel_endpoint("127.0.0.1", port), "p-0").await.unwrap_err();
    assert!(matches!(err, HandshakeError::Unreachable(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(1), "refused is reported at once");
    let err = d.handshake("udp://127.0.0.1:1", "p-0").await.unwrap_err();
    assert!(matches!(err, HandshakeError::Unreachable(_)), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_agents_cache_success_and_retry_failure() {
    let agents = RemoteAgents::new(client_for(spec(4), ""));
    // P not up yet: the failure is not cached...
    let port = free_port();
    let endpoint = side_channel_endpoint("127.0.0.1", port);
    assert!(matches!(agents.get("p-0", &endpoint).await, Err(HandshakeError::Unreachable(_))));
    // ...so once P is up, the next request handshakes again and succeeds.
    let p = producer(BackendConfig::Shm, "", 4).await;
    let first = agents.get("p-0", &p.endpoint()).await.unwrap();
    let again = agents.get("p-0", &p.endpoint()).await.unwrap();
    assert!(std::sync::Arc::ptr_eq(&first, &again), "one handshake per engine");
    assert_eq!(p.agent.stats().metadata_requests.load(std::sync::atomic::Ordering::Relaxed), 1);
    agents.invalidate("p-0");
    let third = agents.get("p-0", &p.endpoint()).await.unwrap();
    assert!(!std::sync::Arc::ptr_eq(&first, &third));
    // A producer that stopped answering: the call fails, the agent turns unhealthy and is
    // replaced (here by a failing handshake, reported, not cached).
    let endpoint = p.endpoint();
    drop(p);
    let err = third.heartbeat(&[("x".into(), cap("x"))]).await.unwrap_err();
    assert!(matches!(err, TransferError::Timeout(_) | TransferError::SideChannel(_)), "{err:?}");
    assert!(!third.is_healthy());
    assert!(agents.get("p-0", &endpoint).await.is_err());
}

/// An agent nobody asked for during the idle time, or whose side channel failed, is dropped
/// with its data plane: D's mapping of P's cache goes (which is what keeps a departed P's
/// pages in memory); one in use is kept whatever its age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_failed_agents_are_dropped_with_their_mapping() {
    let idle = Duration::from_secs(60);
    let agents = RemoteAgents::new(client_for(spec(4), ""));
    let p = producer(BackendConfig::Shm, "", 4).await;
    let mappings = |path: &std::path::Path| {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        // a mapping of an unlinked file ends in " (deleted)"
        maps.lines().filter(|l| l.contains(path.to_str().unwrap())).count()
    };
    let p_own = mappings(&p.region);
    let agent = agents.get("p-0", &p.endpoint()).await.unwrap();
    assert_eq!(mappings(&p.region), p_own + 1, "D maps P's cache at the handshake");
    let much_later = Instant::now() + Duration::from_secs(3600);
    assert!(agents.evict_idle(much_later, idle).is_empty(), "an agent in use is kept");
    drop(agent);
    assert!(agents.evict_idle(Instant::now(), idle).is_empty(), "a recently used agent is kept");
    assert_eq!(agents.evict_idle(much_later, idle), vec!["p-0".to_string()]);
    assert!(agents.engines().is_empty());
    assert_eq!(mappings(&p.region), p_own, "the mapping went with the agent");

    // Asked for again: a second handshake, then P goes away and a call fails.
    let agent = agents.get("p-0", &p.endpoint()).await.unwrap();
    assert_eq!(p.agent.stats().metadata_requests.load(std::sync::atomic::Ordering::Relaxed), 2);
    let region = p.region.clone();
    drop(p);
    assert!(agent.heartbeat(&[("x".into(), cap("x"))]).await.is_err());
    assert!(!agent.is_healthy());
    assert!(agents.evict_idle(Instant::now(), idle).is_empty(), "a failed agent still in use is kept");
    assert_eq!(mappings(&region), 1, "P's cache stays mapped in D after P went");
    drop(agent);
    assert_eq!(agents.evict_idle(Instant::now(), idle), vec!["p-0".to_string()], "a failed agent goes at once");
    assert_eq!(mappings(&region), 0, "nothing of the departed P stays mapped");
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}
