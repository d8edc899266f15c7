//! The compatibility hash and the handshake's geometry check.
//!
//! Two agents may exchange KV blocks only if the bytes mean the same thing on both sides: same
//! weights, dtype, layer count, KV heads, head dim, block size, layout, and protocol versions.
//! As in vLLM's NIXL connector (`compatibility_hash`), both sides hash these facts and D
//! refuses a P whose hash differs; the geometry in [`AgentMetadata`] is then checked field by
//! field so a mismatch says *what* differs.

use pdmesh_model_api::KvCacheSpec;
use pdmesh_protocol::{AgentMetadata, KV_DTYPE_F32, KV_LAYOUT, PROTOCOL_VERSION, TRANSFER_VERSION};
use sha2::{Digest, Sha256};

/// The facts the compatibility hash covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompatInputs {
    /// Identity of the weights (e.g. sha256 of the GGUF file), `ModelFacts::weights_id`.
    pub model_weights_id: String,
    pub dtype: String,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub layout: String,
    /// Envelope protocol version ([`PROTOCOL_VERSION`]).
    pub protocol_version: u16,
    /// Transfer protocol version ([`TRANSFER_VERSION`]).
    pub transfer_version: u32,
}

impl CompatInputs {
    /// The inputs for a cache of `spec` in this build (f32, [`KV_LAYOUT`], current versions).
    pub fn for_spec(model_weights_id: impl Into<String>, spec: &KvCacheSpec) -> Self {
        Self {
            model_weights_id: model_weights_id.into(),
            dtype: KV_DTYPE_F32.to_string(),
            num_layers: spec.num_layers,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            block_size: spec.block_size,
            layout: KV_LAYOUT.to_string(),
            protocol_version: PROTOCOL_VERSION,
            transfer_version: TRANSFER_VERSION,
        }
    }

    /// Hex sha256 of the inputs.
    pub fn hash(&self) -> String {
        compat_hash(self)
    }
}

/// Hex sha256 over `key=value` lines of `inputs`, in a fixed order. Named keys (rather than
/// bare concatenation) keep `("ab", "c")` and `("a", "bc")` apart.
pub fn compat_hash(inputs: &CompatInputs) -> String {
    let canonical = format!(
        "pdmesh-kv-compat\nmodel_weights_id_len={}\ndtype={}\nnum_layers={}\nnum_kv_heads={}\nhead_dim={}\n\
         block_size={}\nlayout={}\nprotocol_version={}\ntransfer_version={}\n",
        inputs.model_weights_id.len(),
        inputs.dtype,
        inputs.num_layers,
        inputs.num_kv_heads,
        inputs.head_dim,
        inputs.block_size,
        inputs.layout,
        inputs.protocol_version,
        inputs.transfer_version,
    );
    let mut hasher = Sha256::new();
    hasher.update(canonical.as_bytes());
    // The weights id is free text: hashed after its length so no value can forge a line.
    hasher.update(inputs.model_weights_id.as_bytes());
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Check a remote agent's geometry against the local cache, beyond the hash: the hash could
/// be disabled or collide in a test setup, and a wrong size here would read wrong bytes.
/// Returns what differs.
pub fn check_geometry(remote: &AgentMetadata, local: &KvCacheSpec) -> Result<(), String> {
    let mut diffs = Vec::new();
    let mut cmp = |what: &str, r: u64, l: u64| {
        if r != l {
            diffs.push(format!("{what}: remote {r}, local {l}"));
        }
    };
    cmp("num_layers", remote.num_layers.into(), local.num_layers.into());
    cmp("block_size", remote.block_size.into(), local.block_size.into());
    cmp("num_kv_heads", remote.num_kv_heads.into(), local.num_kv_heads.into());
    cmp("head_dim", remote.head_dim.into(), local.head_dim.into());
    cmp("bytes_per_block", remote.bytes_per_block, local.bytes_per_block());
    let remote_spec = KvCacheSpec { num_blocks: remote.num_blocks, ..*local };
    if remote.bytes_per_block != remote_spec.bytes_per_block() {
        diffs.push(format!(
            "remote bytes_per_block {} does not follow from its own geometry ({})",
            remote.bytes_per_block,
            remote_spec.bytes_per_block()
        ));
    }
    if remote.layout != KV_LAYOUT {
        diffs.push(format!("layout: remote {:?}, local {KV_LAYOUT:?}", remote.layout));
    }
    if remote.dtype != KV_DTYPE_F32 {
        diffs.push(format!("dtype: remote {:?}, local {KV_DTYPE_F32:?}", remote.dtype));
    }
    if remote.protocol_version != TRANSFER_VERSION {
        diffs.push(format!("transfer version: remote {}, local {TRANSFER_VERSION}", remote.protocol_version));
    }
    if remote.num_blocks == 0 {
        diffs.push("remote has no blocks".to_string());
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(diffs.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> KvCacheSpec {
        KvCacheSpec { num_layers: 30, num_blocks: 64, block_size: 16, num_kv_heads: 3, head_dim: 64 }
    }

    #[test]
    fn hash_is_stable_hex_and_sensitive_to_every_input() {
        let base = CompatInputs::for_spec("w1", &spec());
        let h = base.hash();
        assert_eq!(h.len(), 64);
        assert!(h.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(h, CompatInputs::for_spec("w1", &spec()).hash());
        // num_blocks is deliberately not an input: P and D size their caches independently.
        assert_eq!(h, CompatInputs::for_spec("w1", &KvCacheSpec { num_blocks: 7, ..spec() }).hash());
        let variants = [
            CompatInputs { model_weights_id: "w2".into(), ..base.clone() },
            CompatInputs { dtype: "f16".into(), ..base.clone() },
            CompatInputs { num_layers: 31, ..base.clone() },
            CompatInputs { num_kv_heads: 4, ..base.clone() },
            CompatInputs { head_dim: 32, ..base.clone() },
            CompatInputs { block_size: 32, ..base.clone() },
            CompatInputs { layout: "nhd".into(), ..base.clone() },
            CompatInputs { protocol_version: base.protocol_version + 1, ..base.clone() },
            CompatInputs { transfer_version: base.transfer_version + 1, ..base.clone() },
        ];
        for v in variants {
            assert_ne!(v.hash(), h, "{v:?}");
        }
    }

    #[test]
    fn geometry_check_names_each_difference() {
        let local = spec();
        let mut meta = AgentMetadata {
            engine_id: "p".into(),
            agent_name: "a".into(),
            rank: 0,
            backend: pdmesh_protocol::TransferBackend::Tcp { host: "h".into(), port: 1 },
            layout: KV_LAYOUT.into(),
            num_layers: 30,
            num_blocks: 128,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
            dtype: KV_DTYPE_F32.into(),
            bytes_per_block: local.bytes_per_block(),
            compat_hash: String::new(),
            protocol_version: TRANSFER_VERSION,
        };
        assert_eq!(check_geometry(&meta, &local), Ok(()));
        meta.head_dim = 32;
        meta.layout = "nhd".into();
        let err = check_geometry(&meta, &local).unwrap_err();
        assert!(err.contains("head_dim") && err.contains("layout"), "{err}");
    }
}
