//! The connector decisions, behind one trait.

use pdmesh_protocol::{FinishedStatus, KvConnectorMetadata, KvConnectorOutput, KvTransferParams};

/// vLLM's scheduler-side connector surface. Calls arrive in the order the engine makes them
/// within a step; every method is total (unknown ids are counted by the implementation, never
/// a panic).
pub trait KvConnectorScheduler: Send {
    /// The prompt's token ids, given just before the request's first
    /// [`Self::get_num_new_matched_tokens`] (a connector that finds KV by content hashes
    /// them; the others ignore them).
    fn observe_prompt(&mut self, request_id: &str, prompt_token_ids: &[u32]) {
        let _ = (request_id, prompt_token_ids);
    }
    /// `(count, load_async)`: tokens beyond `num_computed_tokens` that can come from outside;
    /// `None` = cannot decide yet.
    fn get_num_new_matched_tokens(
        &mut self,
        request_id: &str,
        num_prompt_tokens: u32,
        num_computed_tokens: u32,
        params: Option<&KvTransferParams>,
    ) -> (Option<u32>, bool);
    fn update_state_after_alloc(&mut self, request_id: &str, block_ids: &[u32], num_external_tokens: u32);
    /// Called exactly once per step; drains what the calls since the last step enqueued.
    fn build_connector_meta(&mut self, step_id: u64) -> KvConnectorMetadata;
    /// `(delay_free, params for the decode side)`; `true` hands the blocks to the connector.
    fn request_finished(
        &mut self,
        request_id: &str,
        status: FinishedStatus,
        block_ids: &[u32],
        block_generations: &[u64],
        params: Option<&KvTransferParams>,
    ) -> (bool, Option<KvTransferParams>);
    fn update_connector_output(&mut self, output: &KvConnectorOutput);
    /// Drain the notify-only receives queued by [`Self::request_rejected_before_admission`].
    fn take_rejection_recvs(&mut self) -> Vec<pdmesh_protocol::RecvRequest> {
        Vec::new()
    }
    /// Rule R1: D refused a request with these params before admission. `Err` (a reason) when
    /// the params cannot be acted on; the caller counts it, nothing else changes. `trace` is the
    /// refused request's: a consumer puts it on the notify-only receive so P joins that trace.
    fn request_rejected_before_admission(
        &mut self,
        params: &KvTransferParams,
        rejected_at_unix_us: Option<u64>,
        trace: pdmesh_protocol::TraceContext,
    ) -> Result<(), String> {
        let _ = (params, rejected_at_unix_us, trace);
        Err("this connector does not consume remote KV".into())
    }
}

/// No KV transfer: nothing comes from outside, nothing is held.
#[derive(Debug, Default)]
pub struct NoopConnector {
    calls: u64,
}

impl KvConnectorScheduler for NoopConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        _: &str,
        _: u32,
        _: u32,
        _: Option<&KvTransferParams>,
    ) -> (Option<u32>, bool) {
        self.calls += 1;
        (Some(0), false)
    }
    fn update_state_after_alloc(&mut self, _: &str, _: &[u32], _: u32) {
        self.calls += 1;
    }
    fn build_connector_meta(&mut self, _: u64) -> KvConnectorMetadata {
        self.calls += 1;
        KvConnectorMetadata::default()
    }
    fn request_finished(
        &mut self,
        _: &str,
        _: FinishedStatus,
        _: &[u32],
        _: &[u64],
        _: Option<&KvTransferParams>,
    ) -> (bool, Option<KvTransferParams>) {
        self.calls += 1;
        (false, None)
    }
    fn update_connector_output(&mut self, _: &KvConnectorOutput) {
        self.calls += 1;
    }
}
