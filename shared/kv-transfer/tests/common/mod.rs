//! Fixtures: a producer (P) with its KV cache on a real shm region, its hold table and a
//! running agent; a consumer (D) client; a block pattern that names every float.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_kv_transfer::*;
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{KvCache, KvCacheSpec};

pub const WEIGHTS: &str = "sha256:test-weights";

/// The mesh secret every fixture of these tests shares.
pub fn secret() -> MeshSecret {
    MeshSecret::parse("pdmesh-test-mesh-secret-0123456789abcdef").unwrap()
}

/// The capability token the fixtures hold `request_id` under (tests need not guess it).
pub fn cap(request_id: &str) -> String {
    format!("cap-{request_id}")
}

/// Small but real geometry (3 layers, 16 slots, 3 heads, 64 dims = 12 KiB runs).
pub fn spec(num_blocks: u32) -> KvCacheSpec {
    KvCacheSpec { num_layers: 3, num_blocks, block_size: 16, num_kv_heads: 3, head_dim: 64 }
}

pub fn hash_of(spec: &KvCacheSpec) -> String {
    CompatInputs::for_spec(WEIGHTS, spec).hash()
}

/// The float P stores at `idx` of `(layer, side, block)`: a finite value in ±[1, 2) whose
/// bits depend on every coordinate, so a misplaced run or float is caught.
pub fn pattern(layer: usize, side: KvSide, block: u32, idx: usize) -> f32 {
    let mut h = (block as u64) << 40 ^ (layer as u64) << 32 ^ (side as u64) << 28 ^ idx as u64;
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 29;
    let bits = 0x3F80_0000u32 | (h as u32 & 0x007F_FFFF) | ((h >> 40) as u32 & 1) << 31;
    f32::from_bits(bits)
}

pub fn fill_pattern(kv: &mut KvCache) {
    let spec = *kv.spec();
    for layer in 0..spec.num_layers as usize {
        for side in [KvSide::Key, KvSide::Value] {
            for b in 0..spec.num_blocks {
                for (i, x) in kv.block_mut(layer, side, b).unwrap().iter_mut().enumerate() {
                    *x = pattern(layer, side, b, i);
                }
            }
        }
    }
}

/// Every float of every layer/side of `local[local_ids[i]]` equals P's `remote_ids[i]`, and
/// every other local block is untouched (still `untouched`).
pub fn assert_blocks_moved(local: &KvCache, remote_ids: &[u32], local_ids: &[u32], untouched: f32) {
    let spec = *local.spec();
    for layer in 0..spec.num_layers as usize {
        for side in [KvSide::Key, KvSide::Value] {
            for b in 0..spec.num_blocks {
                let got = local.block(layer, side, b).unwrap();
                match local_ids.iter().position(|l| *l == b) {
                    Some(i) => {
                        for (k, x) in got.iter().enumerate() {
                            let want = pattern(layer, side, remote_ids[i], k);
                            assert_eq!(x.to_bits(), want.to_bits(), "layer {layer} {side:?} local {b} float {k}");
                        }
                    }
                    None => assert!(got.iter().all(|x| *x == untouched), "local block {b} was touched"),
                }
            }
        }
    }
}

pub fn local_cache(spec: KvCacheSpec, fill: f32) -> KvCache {
    let mut kv = KvCache::new_heap(spec);
    kv.as_mut_slice().fill(fill);
    kv
}

pub struct Producer {
    pub agent: TransferAgent,
    pub table: Arc<Mutex<HoldTable>>,
    pub kv: KvCache,
    pub spec: KvCacheSpec,
    /// The file behind P's cache.
    pub region: std::path::PathBuf,
}

pub fn tcp_backend() -> BackendConfig {
    BackendConfig::Tcp { bind: "127.0.0.1:0".into(), advertise_host: None }
}

pub async fn producer(backend: BackendConfig, faults: &str, num_blocks: u32) -> Producer {
    producer_with(backend, faults, num_blocks, HoldTableConfig::default()).await
}

pub async fn producer_with(backend: BackendConfig, faults: &str, num_blocks: u32, cfg: HoldTableConfig) -> Producer {
    let spec = spec(num_blocks);
    let name = format!("pdmesh-test-{}", uuid::Uuid::new_v4());
    let region = ShmRegion::create_for_spec(&name, &spec).unwrap();
    let path = region.path().to_path_buf();
    let mut kv = region.into_kv_cache(spec).unwrap();
    fill_pattern(&mut kv);
    let table = Arc::new(Mutex::new(HoldTable::new(cfg)));
    let config = AgentConfig {
        engine_id: "p-0".into(),
        rank: 0,
        side_channel: "tcp://127.0.0.1:0".into(),
        backend,
        compat_hash: hash_of(&spec),
        faults: FaultConfig::parse(faults).unwrap(),
        mesh_secret: secret(),
    };
    let policy: SharedPolicy = table.clone();
    let agent = TransferAgent::start(config, &path, spec, policy).await.unwrap();
    Producer { agent, table, kv, spec, region: path }
}

/// P's agent serving a GPU region exported as `ipc_handle` (the `cuda` backend), with an empty
/// hold table. The agent makes no CUDA call, so it runs on any machine.
pub async fn device_agent(
    engine_id: &str,
    ipc_handle: String,
    spec: KvCacheSpec,
    compat_hash: String,
) -> (TransferAgent, Arc<Mutex<HoldTable>>) {
    let table = Arc::new(Mutex::new(HoldTable::new(HoldTableConfig::default())));
    let config = AgentConfig {
        engine_id: engine_id.into(),
        rank: 0,
        side_channel: "tcp://127.0.0.1:0".into(),
        backend: BackendConfig::Cuda,
        compat_hash,
        faults: FaultConfig::default(),
        mesh_secret: secret(),
    };
    let policy: SharedPolicy = table.clone();
    let agent = TransferAgent::start_device(config, ipc_handle, spec, policy).await.unwrap();
    (agent, table)
}

/// A producer whose cache is GPU memory, as the `cuda` backend advertises it. No region stands
/// behind the handle; a consumer must refuse it before opening anything.
pub async fn device_producer(ipc_handle: &str, num_blocks: u32) -> (TransferAgent, Arc<Mutex<HoldTable>>) {
    device_agent("p-0", ipc_handle.to_string(), spec(num_blocks), hash_of(&spec(num_blocks))).await
}

impl Producer {
    pub fn endpoint(&self) -> String {
        self.agent.side_channel_endpoint().to_string()
    }

    /// Hold `blocks` for `request_id` (generation 1 each) for a minute, under [`cap`].
    pub fn hold(&self, request_id: &str, blocks: &[u32]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut table = self.table.lock().unwrap();
        assert!(table.hold_with_capability(
            request_id,
            blocks.to_vec(),
            vec![1; blocks.len()],
            deadline,
            cap(request_id)
        ));
    }

    pub fn finished(&self) -> Vec<String> {
        self.table.lock().unwrap().take_finished_sending()
    }
}

pub fn client_for(local: KvCacheSpec, faults: &str) -> TransferClient {
    let mut config = ClientConfig::new("d-0/0", local, hash_of(&local), secret());
    config.handshake_timeout = Duration::from_millis(1500);
    config.call_timeout = Duration::from_secs(2);
    config.faults = FaultConfig::parse(faults).unwrap();
    TransferClient::new(config)
}
