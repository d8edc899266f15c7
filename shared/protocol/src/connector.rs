//! The KV connector surface between engine-core and connector-scheduler (vLLM's
//! `KVConnectorBase_V1` scheduler side), and the per-step metadata/output that flows through
//! the worker.

use serde::{Deserialize, Serialize};

use crate::envelope::TraceContext;
use crate::kv::KvTransferParams;

/// Status of a request when it finished, as the connector needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishedStatus {
    Stopped,
    LengthCapped,
    Aborted,
    Ignored,
    Error,
}

/// One connector call. Calls are batched per step phase to keep round trips low.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ConnectorCall {
    /// How many prompt tokens beyond `num_computed_tokens` can come from outside, and whether
    /// they load asynchronously.
    GetNumNewMatchedTokens {
        request_id: String,
        num_prompt_tokens: u32,
        num_computed_tokens: u32,
        kv_transfer_params: Option<KvTransferParams>,
        /// The prompt's token ids, for connectors that find KV by content (the offload
        /// connector hashes them block by block). Empty from an engine that does not send them:
        /// such a connector then matches nothing.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        prompt_token_ids: Vec<u32>,
    },
    /// Blocks were allocated for the request; `num_external_tokens` of them will be loaded.
    UpdateStateAfterAlloc { request_id: String, block_ids: Vec<u32>, num_external_tokens: u32 },
    /// Build the metadata for the step about to run (exactly once per step).
    BuildConnectorMeta { step_id: u64 },
    /// The request finished; may the scheduler free its blocks now?
    RequestFinished {
        request_id: String,
        status: FinishedStatus,
        block_ids: Vec<u32>,
        kv_transfer_params: Option<KvTransferParams>,
        /// Generation of each block (bumped on every free), so P can hand readers references
        /// that are refused once the blocks were reused.
        #[serde(default)]
        block_generations: Vec<u64>,
    },
    /// The worker's connector output of the last step.
    UpdateConnectorOutput(KvConnectorOutput),
    /// The notify-only receives of rejections queued so far, taken out of the connector at
    /// once rather than with the next step's metadata, so that a notice never waits for a
    /// step. The connector-scheduler hands them straight to its rank's worker when its link is
    /// up and answers `Meta` with those the worker did not take (normally none); engine-core
    /// pushes whatever comes back itself.
    TakeRejectionRecvs,
    /// Rule R1: a request with these params was refused before admission; tell P.
    RequestRejectedBeforeAdmission {
        params: KvTransferParams,
        /// When D refused it (Unix µs), carried to P for the rejection → free histogram.
        #[serde(default)]
        rejected_at_unix_us: Option<u64>,
        /// The refused request's trace, passed on to the notify-only receive.
        #[serde(default)]
        trace: TraceContext,
    },
}

impl ConnectorCall {
    /// The request a call concerns, if it concerns exactly one (for per-request tracing).
    pub fn request_id(&self) -> Option<&str> {
        match self {
            ConnectorCall::GetNumNewMatchedTokens { request_id, .. }
            | ConnectorCall::UpdateStateAfterAlloc { request_id, .. }
            | ConnectorCall::RequestFinished { request_id, .. } => Some(request_id),
            ConnectorCall::BuildConnectorMeta { .. }
            | ConnectorCall::UpdateConnectorOutput(_)
            | ConnectorCall::TakeRejectionRecvs
            | ConnectorCall::RequestRejectedBeforeAdmission { .. } => None,
        }
    }

    /// A short static name for span names and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ConnectorCall::GetNumNewMatchedTokens { .. } => "get_num_new_matched_tokens",
            ConnectorCall::UpdateStateAfterAlloc { .. } => "update_state_after_alloc",
            ConnectorCall::BuildConnectorMeta { .. } => "build_connector_meta",
            ConnectorCall::RequestFinished { .. } => "request_finished",
            ConnectorCall::UpdateConnectorOutput(_) => "update_connector_output",
            ConnectorCall::RequestRejectedBeforeAdmission { .. } => "request_rejected_before_admission",
            ConnectorCall::TakeRejectionRecvs => "take_rejection_recvs",
        }
    }
}

/// The answer to one [`ConnectorCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ConnectorReply {
    /// `None` count: cannot decide yet; try again next step.
    MatchedTokens {
        count: Option<u32>,
        load_async: bool,
    },
    Meta(KvConnectorMetadata),
    Finished {
        delay_free: bool,
        kv_transfer_params: Option<KvTransferParams>,
    },
    Ack,
    /// The call could not be applied (logged and counted by the connector).
    Rejected {
        reason: String,
    },
}

/// A receive the worker must perform (D side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecvRequest {
    pub request_id: String,
    pub local_block_ids: Vec<u32>,
    pub params: KvTransferParams,
    /// Notify-only receives of a rejection: when D refused the request (Unix µs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected_at_unix_us: Option<u64>,
    /// Notify-only receives: the refused request's trace, so the notice joins it on P.
    #[serde(default)]
    pub trace: TraceContext,
}

/// A request whose blocks P now holds for a remote reader (P side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SendRequest {
    pub request_id: String,
    pub block_ids: Vec<u32>,
    #[serde(default)]
    pub block_generations: Vec<u64>,
    /// Hold deadline, milliseconds since the Unix epoch.
    pub deadline_unix_ms: u64,
    /// The capability token P handed out in the request's `kv_transfer_params`; the hold
    /// table serves the blocks only to messages that carry it.
    #[serde(default)]
    pub capability: String,
}

/// Per-step connector metadata (vLLM's `NixlConnectorMetadata`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvConnectorMetadata {
    #[serde(default)]
    pub reqs_to_recv: Vec<RecvRequest>,
    /// P's newly held requests, with their blocks and hold deadline.
    #[serde(default)]
    pub reqs_to_send: Vec<SendRequest>,
    #[serde(default)]
    pub reqs_in_batch: Vec<String>,
    #[serde(default)]
    pub reqs_not_processed: Vec<String>,
    /// P: held requests aborted after finish (beyond vLLM): released at once when no read
    /// lease is active, else when it ends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reqs_aborted_after_finish: Vec<String>,
    /// D: P's params of requests that wait on D before their receive starts; the worker sends
    /// P heartbeats for them so P's hold outlives the queueing (lease mode).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reqs_to_heartbeat: Vec<KvTransferParams>,
    /// D: P's params of requests D took in since the last step. The worker keeps each until
    /// its receive ends (read, or given up), so that a graceful shutdown can give back every
    /// reference it still has, queued requests included (R4).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reqs_referenced: Vec<KvTransferParams>,
    /// Host-memory offload: block copies between the device cache and the worker's CPU store
    /// (docs/KV_TRANSFER.md, "Offload").
    #[serde(default, skip_serializing_if = "OffloadMetadata::is_empty")]
    pub offload: OffloadMetadata,
    /// MultiConnector: requests whose blocks more than one child delays, with how many
    /// `finished_sending` beyond the first the worker must see before it reports the request
    /// (vLLM's `extra_async_saves`). The engine frees on the first report it gets.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub extra_async_saves: std::collections::BTreeMap<String, u32>,
}

/// One request's copy between device blocks and CPU store slots: `block_ids[i]` ↔
/// `slots[i]`, the slot stamped `stamps[i]` (the block's content hash, truncated), so that a
/// load from a slot that does not hold that content (a restarted worker's empty store) is
/// refused instead of copied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadTransfer {
    pub request_id: String,
    pub block_ids: Vec<u32>,
    pub slots: Vec<u32>,
    pub stamps: Vec<u64>,
}

/// The offload connector's part of a step's metadata. The worker applies the saves first,
/// then the loads, before the forward pass: a request may hit blocks another request saves in
/// the same step; a load from a slot a save of this step re-used is refused by its stamp.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadMetadata {
    /// Store → device: the request then waits for its `finished_recving`.
    #[serde(default)]
    pub loads: Vec<OffloadTransfer>,
    /// Device → store, of a finished request whose blocks the engine keeps until the
    /// request's `finished_sending`.
    #[serde(default)]
    pub saves: Vec<OffloadTransfer>,
}

impl OffloadMetadata {
    pub fn is_empty(&self) -> bool {
        self.loads.is_empty() && self.saves.is_empty()
    }
}

impl KvConnectorMetadata {
    pub fn is_empty(&self) -> bool {
        self.offload.is_empty()
            && self.extra_async_saves.is_empty()
            && self.reqs_to_recv.is_empty()
            && self.reqs_to_send.is_empty()
            && self.reqs_aborted_after_finish.is_empty()
            && self.reqs_in_batch.is_empty()
            && self.reqs_not_processed.is_empty()
            && self.reqs_referenced.is_empty()
    }
}

/// What the worker's connector reports after a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvConnectorOutput {
    #[serde(default)]
    pub finished_sending: Vec<String>,
    #[serde(default)]
    pub finished_recving: Vec<String>,
    #[serde(default)]
    pub invalid_block_ids: Vec<u32>,
    /// P: held requests under an active read lease right now (for KV accounting and
    /// `/debug/kv`; not a lifecycle event).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub leased_request_ids: Vec<String>,
}

impl KvConnectorOutput {
    pub fn is_empty(&self) -> bool {
        self.finished_sending.is_empty() && self.finished_recving.is_empty() && self.invalid_block_ids.is_empty()
    }
}
