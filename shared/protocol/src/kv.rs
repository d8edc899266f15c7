//! KV transfer parameters and KV-block accounting.

use serde::{Deserialize, Serialize};

/// `kv_transfer_params` as vLLM's NIXL connector defines them, passed through the OpenAI API
/// body, the engine request, and back in P's answer. Every field is optional so that a D can
/// recognise (and count) params with fields missing instead of failing to decode them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTransferParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_prefill: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_decode: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    /// Beyond vLLM: the generation of each remote block, so that a reference to blocks that
    /// were freed and reused is refused instead of read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_generations: Option<Vec<u64>>,
    /// Beyond vLLM: the data-parallel rank on P that holds the blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_dp_rank: Option<u32>,
    /// Beyond vLLM: the capability token for the held blocks (128 bits from a CSPRNG, 32 hex
    /// digits). P hands it out with the params; every lease, read, heartbeat, `read done`,
    /// `give up` and release of the request must carry it (docs/SECURITY.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_capability: Option<String>,
}

impl KvTransferParams {
    pub fn wants_remote_prefill(&self) -> bool {
        self.do_remote_prefill.unwrap_or(false)
    }
    pub fn wants_remote_decode(&self) -> bool {
        self.do_remote_decode.unwrap_or(false)
    }
}

/// Who owns the blocks of one engine rank's KV cache, at one moment. Every block is in
/// exactly one of: free, used by a live request, held for a remote reader
/// (`free + used + held = total`); `leased` counts the held blocks a remote READ is under a
/// lease for right now (a subset of `held`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvUsage {
    pub total_blocks: u32,
    pub free_blocks: u32,
    pub used_blocks: u32,
    #[serde(default)]
    pub held_blocks: u32,
    #[serde(default)]
    pub leased_blocks: u32,
    /// Blocks registered in the prefix cache (in use or free; free ones are evicted when
    /// allocation needs them, so they also count in `free_blocks`).
    #[serde(default)]
    pub cached_blocks: u32,
}

/// A request whose blocks are held for (or by) the connector.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeldRequest {
    pub request_id: String,
    pub blocks: u32,
    pub age_s: f64,
    pub state: String,
}
