//! `MultiConnector`: several connectors behind one (vLLM's `MultiConnector` semantics), e.g.
//! P/D transfer and host-memory offload on the same node.
//!
//! - `get_num_new_matched_tokens` asks every child in order (each may keep per-request
//!   state); the first that has external tokens for the request loads them and is remembered
//!   for it; a child that cannot decide yet makes the whole answer "not yet".
//! - `update_state_after_alloc` goes to that child; the others get no blocks and zero
//!   external tokens.
//! - `request_finished` asks every child; the blocks are held while any child delays them,
//!   and when more than one does, the step's metadata tells the worker how many
//!   `finished_sending` beyond the first to swallow (`extra_async_saves`): the engine frees on
//!   the first report it gets, so the worker reports the request once, after the last child.
//! - A rejection notice (rule R1) goes to the first child that accepts it.
//! - `kv_transfer_params` come from the one child that produces them (the P/D child).

use std::collections::{BTreeMap, HashMap};

use pdmesh_protocol::{
    FinishedStatus, KvConnectorMetadata, KvConnectorOutput, KvTransferParams, RecvRequest, TraceContext,
};

use crate::connector::KvConnectorScheduler;

/// Several connectors asked in order.
pub struct MultiConnector {
    children: Vec<Box<dyn KvConnectorScheduler>>,
    /// The child that loads each request's external tokens (by index).
    loader: HashMap<String, usize>,
    /// Requests more than one child delays, with the extra `finished_sending` count, until
    /// the next metadata carries them to the worker.
    extra_async_saves: BTreeMap<String, u32>,
    /// Times two children returned params for one request (the first is kept).
    pub conflicting_params: u64,
}

impl MultiConnector {
    /// `children` in the order they are asked.
    pub fn new(children: Vec<Box<dyn KvConnectorScheduler>>) -> Self {
        Self { children, loader: HashMap::new(), extra_async_saves: BTreeMap::new(), conflicting_params: 0 }
    }

    /// Which child loads `request_id`'s external tokens, if one does.
    pub fn loader_of(&self, request_id: &str) -> Option<usize> {
        self.loader.get(request_id).copied()
    }
}

/// Append `from`'s per-step work to `into`.
fn merge_meta(into: &mut KvConnectorMetadata, from: KvConnectorMetadata) {
    into.reqs_to_recv.extend(from.reqs_to_recv);
    into.reqs_to_send.extend(from.reqs_to_send);
    into.reqs_in_batch.extend(from.reqs_in_batch);
    into.reqs_not_processed.extend(from.reqs_not_processed);
    into.reqs_aborted_after_finish.extend(from.reqs_aborted_after_finish);
    into.reqs_to_heartbeat.extend(from.reqs_to_heartbeat);
    into.reqs_referenced.extend(from.reqs_referenced);
    into.offload.loads.extend(from.offload.loads);
    into.offload.saves.extend(from.offload.saves);
    for (id, n) in from.extra_async_saves {
        *into.extra_async_saves.entry(id).or_default() += n;
    }
}

impl KvConnectorScheduler for MultiConnector {
    fn observe_prompt(&mut self, request_id: &str, prompt_token_ids: &[u32]) {
        for c in &mut self.children {
            c.observe_prompt(request_id, prompt_token_ids);
        }
    }

    fn get_num_new_matched_tokens(
        &mut self,
        request_id: &str,
        num_prompt_tokens: u32,
        num_computed_tokens: u32,
        params: Option<&KvTransferParams>,
    ) -> (Option<u32>, bool) {
        let mut answer = (Some(0), false);
        let mut chosen = None;
        let mut undecided = false;
        for (i, c) in self.children.iter_mut().enumerate() {
            match c.get_num_new_matched_tokens(request_id, num_prompt_tokens, num_computed_tokens, params) {
                (None, _) => undecided = true,
                (Some(n), load_async) if n > 0 && chosen.is_none() => {
                    chosen = Some(i);
                    answer = (Some(n), load_async);
                }
                _ => {}
            }
        }
        if undecided {
            return (None, false);
        }
        match chosen {
            Some(i) => {
                self.loader.insert(request_id.to_string(), i);
            }
            None => {
                self.loader.remove(request_id);
            }
        }
        answer
    }

    fn update_state_after_alloc(&mut self, request_id: &str, block_ids: &[u32], num_external_tokens: u32) {
        let chosen = self.loader.get(request_id).copied();
        for (i, c) in self.children.iter_mut().enumerate() {
            if Some(i) == chosen {
                c.update_state_after_alloc(request_id, block_ids, num_external_tokens);
            } else {
                c.update_state_after_alloc(request_id, &[], 0);
            }
        }
    }

    fn build_connector_meta(&mut self, step_id: u64) -> KvConnectorMetadata {
        let mut meta = KvConnectorMetadata {
            extra_async_saves: std::mem::take(&mut self.extra_async_saves),
            ..Default::default()
        };
        for c in &mut self.children {
            merge_meta(&mut meta, c.build_connector_meta(step_id));
        }
        meta
    }

    fn request_finished(
        &mut self,
        request_id: &str,
        status: FinishedStatus,
        block_ids: &[u32],
        block_generations: &[u64],
        params: Option<&KvTransferParams>,
    ) -> (bool, Option<KvTransferParams>) {
        self.loader.remove(request_id);
        let mut delaying = 0u32;
        let mut out_params = None;
        for c in &mut self.children {
            let (delay, p) = c.request_finished(request_id, status, block_ids, block_generations, params);
            delaying += u32::from(delay);
            match (p, &out_params) {
                (Some(p), None) => out_params = Some(p),
                (Some(_), Some(_)) => {
                    self.conflicting_params += 1;
                    tracing::error!(request_id, "two connectors returned kv_transfer_params; the first is kept");
                }
                (None, _) => {}
            }
        }
        if delaying > 1 {
            self.extra_async_saves.insert(request_id.to_string(), delaying - 1);
        }
        (delaying > 0, out_params)
    }

    fn update_connector_output(&mut self, output: &KvConnectorOutput) {
        for c in &mut self.children {
            c.update_connector_output(output);
        }
    }

    fn take_rejection_recvs(&mut self) -> Vec<RecvRequest> {
        self.children.iter_mut().flat_map(|c| c.take_rejection_recvs()).collect()
    }

    fn request_rejected_before_admission(
        &mut self,
        params: &KvTransferParams,
        rejected_at_unix_us: Option<u64>,
        trace: TraceContext,
    ) -> Result<(), String> {
        let mut reasons = Vec::new();
        for c in &mut self.children {
            match c.request_rejected_before_admission(params, rejected_at_unix_us, trace.clone()) {
                Ok(()) => return Ok(()),
                Err(why) => reasons.push(why),
            }
        }
        Err(reasons.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::offload::OffloadConnector;
    use crate::pd::{PdConnector, ProducerIdentity};

    fn producer_with_offload() -> MultiConnector {
        let pd = PdConnector::new(
            Some(ProducerIdentity {
                engine_id: "p0".into(),
                side_channel_host: "127.0.0.1".into(),
                side_channel_port: 5600,
                dp_rank: 0,
            }),
            false,
            Duration::from_secs(30),
        );
        MultiConnector::new(vec![Box::new(pd), Box::new(OffloadConnector::new(2, 16, "m"))])
    }

    fn consumer_with_offload() -> MultiConnector {
        let pd = PdConnector::new(None, true, Duration::from_secs(30));
        MultiConnector::new(vec![Box::new(pd), Box::new(OffloadConnector::new(2, 16, "m"))])
    }

    fn remote(id: &str) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: Some(true),
            remote_engine_id: Some("p0".into()),
            remote_request_id: Some(id.into()),
            remote_block_ids: Some(vec![4, 5, 6]),
            remote_host: Some("127.0.0.1".into()),
            remote_port: Some(5600),
            ..Default::default()
        }
    }

    /// P with offload: both children delay the blocks; the worker is told to swallow one
    /// `finished_sending`, and the P/D child's params come back.
    #[test]
    fn blocks_two_children_delay_are_freed_after_both() {
        let mut m = producer_with_offload();
        let p = KvTransferParams { do_remote_decode: Some(true), ..Default::default() };
        let prompt = [1, 2, 3, 4, 5];
        m.observe_prompt("r", &prompt);
        assert_eq!(m.get_num_new_matched_tokens("r", 5, 0, Some(&p)), (Some(0), false));
        m.update_state_after_alloc("r", &[7, 8, 9], 0);
        let (delay, params) = m.request_finished("r", FinishedStatus::LengthCapped, &[7, 8, 9], &[1, 1, 1], Some(&p));
        assert!(delay);
        assert_eq!(params.and_then(|p| p.remote_block_ids), Some(vec![7, 8, 9]), "the P/D child's params");
        let meta = m.build_connector_meta(1);
        assert_eq!(meta.extra_async_saves, BTreeMap::from([("r".to_string(), 1)]));
        assert_eq!(meta.reqs_to_send.len(), 1, "P holds them for D");
        assert_eq!(meta.offload.saves[0].block_ids, vec![7, 8], "and offload saves the full prompt blocks");
        assert!(m.build_connector_meta(2).extra_async_saves.is_empty(), "drained");
    }

    /// Only one child delays (an aborted P request: no hold; or a colocated finish): no extra.
    #[test]
    fn one_delaying_child_needs_no_extra_count() {
        let mut m = producer_with_offload();
        let prompt = [1, 2, 3, 4, 5];
        m.observe_prompt("r", &prompt);
        m.get_num_new_matched_tokens("r", 5, 0, None);
        m.update_state_after_alloc("r", &[7, 8, 9], 0);
        assert_eq!(m.request_finished("r", FinishedStatus::Stopped, &[7, 8, 9], &[], None), (true, None));
        let meta = m.build_connector_meta(1);
        assert!(meta.extra_async_saves.is_empty() && meta.reqs_to_send.is_empty());
        assert_eq!(meta.offload.saves.len(), 1);
        // an aborted request: nobody delays
        m.observe_prompt("s", &prompt);
        m.get_num_new_matched_tokens("s", 5, 0, None);
        assert_eq!(m.request_finished("s", FinishedStatus::Aborted, &[1], &[], None), (false, None));
    }

    /// D: a remote prefill is the P/D child's load even when the offload store has the
    /// prefix; a plain request whose prefix is stored is the offload child's.
    #[test]
    fn the_first_child_with_external_tokens_loads_and_the_others_get_nothing() {
        let mut m = consumer_with_offload();
        let prompt = [1, 2, 3, 4, 5];
        m.observe_prompt("a", &prompt);
        m.get_num_new_matched_tokens("a", 5, 0, None);
        m.update_state_after_alloc("a", &[1, 2, 3], 0);
        m.request_finished("a", FinishedStatus::Stopped, &[1, 2, 3], &[], None);
        let _ = m.build_connector_meta(1);

        let p = remote("p-req");
        m.observe_prompt("b", &prompt);
        assert_eq!(m.get_num_new_matched_tokens("b", 5, 0, Some(&p)), (Some(5), true));
        assert_eq!(m.loader_of("b"), Some(0));
        m.update_state_after_alloc("b", &[4, 5, 6], 5);
        let meta = m.build_connector_meta(2);
        assert_eq!(meta.reqs_to_recv.len(), 1);
        assert!(meta.offload.loads.is_empty(), "offload got zero external tokens");

        m.observe_prompt("c", &prompt);
        assert_eq!(m.get_num_new_matched_tokens("c", 5, 0, None), (Some(4), true));
        assert_eq!(m.loader_of("c"), Some(1));
        m.update_state_after_alloc("c", &[7, 8, 9], 4);
        let meta = m.build_connector_meta(3);
        assert!(meta.reqs_to_recv.is_empty());
        assert_eq!(meta.offload.loads[0].block_ids, vec![7, 8]);
    }

    /// Rule R1: the notice goes to the child that accepts it (the offload child refuses).
    #[test]
    fn a_rejection_notice_goes_to_the_first_child_that_takes_it() {
        let mut m = MultiConnector::new(vec![
            Box::new(OffloadConnector::new(2, 4, "m")),
            Box::new(PdConnector::new(None, true, Duration::from_secs(30))),
        ]);
        assert!(m.request_rejected_before_admission(&remote("x"), Some(1), Default::default()).is_ok());
        assert_eq!(m.take_rejection_recvs().len(), 1);
        let mut offload_only = MultiConnector::new(vec![Box::new(OffloadConnector::new(2, 4, "m"))]);
        assert!(offload_only.request_rejected_before_admission(&remote("x"), None, Default::default()).is_err());
    }
}
