//! `PdConnector`: the scheduler side of pdmesh's P/D connector (vLLM's
//! `NixlConnectorScheduler` semantics, across a process boundary).
//!
//! vLLM mutates the request's `kv_transfer_params` in place (e.g. clears `do_remote_prefill`
//! the first time it is acted on). Here the params travel by value on every call, so the
//! connector keeps its own per-request record of what it already acted on; that record is
//! dropped in `request_finished`, which the engine calls exactly once per request.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Id prefix of the notify-only receives made from rejection notices (never reported to the
/// scheduler, which does not know them).
const REJECTED_PREFIX: &str = "rejected:";

use pdmesh_protocol::{
    FinishedStatus, KvConnectorMetadata, KvConnectorOutput, KvTransferParams, RecvRequest, SendRequest,
};

use crate::connector::KvConnectorScheduler;

/// Where P's blocks can be read from: what goes into the params P returns.
#[derive(Debug, Clone)]
pub struct ProducerIdentity {
    pub engine_id: String,
    pub side_channel_host: String,
    pub side_channel_port: u16,
    pub dp_rank: u32,
}

/// Counters for the connector's decisions (exported as metrics by the service).
#[derive(Debug, Default, Clone)]
pub struct PdCounters {
    pub remote_prefills: u64,
    pub notify_only_recvs: u64,
    pub invalid_params: u64,
    pub holds_started: u64,
    pub not_processed: u64,
    pub rejection_notices: u64,
    /// Heartbeats asked for (one per waiting request per interval).
    pub heartbeats: u64,
    /// Give-ups not sent because `give_up_notices` is off (P frees at its deadline).
    pub give_ups_suppressed: u64,
}

#[derive(Debug, Default)]
struct ReqState {
    params: Option<KvTransferParams>,
    /// `do_remote_prefill` was acted on (a receive was enqueued): never again.
    remote_prefill_consumed: bool,
}

#[derive(Debug)]
pub struct PdConnector {
    producer: Option<ProducerIdentity>,
    consumer: bool,
    hold: Duration,
    reqs: HashMap<String, ReqState>,
    need_recv: Vec<RecvRequest>,
    need_send: Vec<SendRequest>,
    in_batch: Vec<String>,
    not_processed: Vec<String>,
    /// When D last asked its worker to heartbeat the requests it keeps P holding for.
    last_heartbeat: std::time::Instant,
    /// D: params of requests taken in since the last step (`reqs_referenced`).
    referenced: Vec<KvTransferParams>,
    /// D: tell P when a request ends before its receive (R4); off only for the deadline-only
    /// baseline (`kv_transfer.give_up_notices`).
    give_up_notices: bool,
    pub counters: PdCounters,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Params a consumer can act on: every `remote_*` field that a read needs is present.
pub fn params_complete(p: &KvTransferParams) -> bool {
    p.remote_engine_id.is_some()
        && p.remote_request_id.is_some()
        && p.remote_block_ids.is_some()
        && p.remote_host.is_some()
        && p.remote_port.is_some()
}

impl PdConnector {
    /// `producer`: set on P (and `kv_both`); `consumer`: D (and `kv_both`); `hold`: the hold
    /// deadline P starts with.
    pub fn new(producer: Option<ProducerIdentity>, consumer: bool, hold: Duration) -> Self {
        Self {
            producer,
            consumer,
            hold,
            reqs: HashMap::new(),
            need_recv: Vec::new(),
            need_send: Vec::new(),
            in_batch: Vec::new(),
            not_processed: Vec::new(),
            last_heartbeat: std::time::Instant::now(),
            referenced: Vec::new(),
            give_up_notices: true,
            counters: PdCounters::default(),
        }
    }

    /// `kv_transfer.give_up_notices`: with `false`, a request that ends on D before its receive
    /// leaves P to free at its deadline, and the worker is not told what D references.
    pub fn set_give_up_notices(&mut self, on: bool) {
        self.give_up_notices = on;
    }

    /// D: every third of the hold duration, P's params of the requests D has seen but not
    /// started to receive (queued for KV space or a sequence slot), so that P's holds outlive
    /// the queueing.
    fn due_heartbeats(&mut self) -> Vec<KvTransferParams> {
        if !self.consumer || self.last_heartbeat.elapsed() < self.hold / 3 {
            return Vec::new();
        }
        self.last_heartbeat = std::time::Instant::now();
        let due: Vec<KvTransferParams> = self
            .reqs
            .keys()
            .filter_map(|id| self.wants_remote_prefill(id))
            .filter(|p| params_complete(p))
            .cloned()
            .collect();
        self.counters.heartbeats += due.len() as u64;
        due
    }

    fn wants_remote_prefill(&self, id: &str) -> Option<&KvTransferParams> {
        let st = self.reqs.get(id)?;
        let p = st.params.as_ref()?;
        (self.consumer && p.wants_remote_prefill() && !st.remote_prefill_consumed).then_some(p)
    }
}

impl KvConnectorScheduler for PdConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        request_id: &str,
        num_prompt_tokens: u32,
        num_computed_tokens: u32,
        params: Option<&KvTransferParams>,
    ) -> (Option<u32>, bool) {
        let st = self.reqs.entry(request_id.to_string()).or_default();
        if st.params.is_none() {
            st.params = params.cloned();
            // D takes a reference to P's blocks: its worker keeps it until the receive ends.
            if let Some(p) = params.filter(|p| self.consumer && self.give_up_notices && p.wants_remote_prefill()) {
                if params_complete(p) {
                    self.referenced.push(p.clone());
                }
            }
        }
        let Some(p) = self.wants_remote_prefill(request_id) else { return (Some(0), false) };
        if !params_complete(p) {
            self.counters.invalid_params += 1;
            tracing::warn!(request_id, "do_remote_prefill without the remote_* fields: computing locally");
            return (Some(0), false);
        }
        // The last prompt token is always computed locally (it yields the first logits); the
        // engine enforces that when the load completes.
        let count = num_prompt_tokens.saturating_sub(num_computed_tokens);
        if count == 0 {
            return (Some(0), false);
        }
        (Some(count), true)
    }

    fn update_state_after_alloc(&mut self, request_id: &str, block_ids: &[u32], num_external_tokens: u32) {
        if let Some(p) = self.wants_remote_prefill(request_id).cloned() {
            if params_complete(&p) {
                self.counters.remote_prefills += 1;
                let local = if num_external_tokens > 0 { block_ids.to_vec() } else { Vec::new() };
                self.need_recv.push(RecvRequest {
                    request_id: request_id.to_string(),
                    local_block_ids: local,
                    params: p,
                    rejected_at_unix_us: None,
                    trace: Default::default(),
                });
            }
            if let Some(st) = self.reqs.get_mut(request_id) {
                st.remote_prefill_consumed = true;
            }
        }
        let decode_remotely = self
            .reqs
            .get(request_id)
            .and_then(|s| s.params.as_ref())
            .is_some_and(KvTransferParams::wants_remote_decode);
        if self.producer.is_some() && decode_remotely {
            self.in_batch.push(request_id.to_string());
        }
    }

    fn take_rejection_recvs(&mut self) -> Vec<RecvRequest> {
        let (taken, kept): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.need_recv).into_iter().partition(|r| r.request_id.starts_with(REJECTED_PREFIX));
        self.need_recv = kept;
        taken
    }

    fn build_connector_meta(&mut self, _step_id: u64) -> KvConnectorMetadata {
        KvConnectorMetadata {
            reqs_to_recv: std::mem::take(&mut self.need_recv),
            reqs_to_send: std::mem::take(&mut self.need_send),
            reqs_in_batch: std::mem::take(&mut self.in_batch),
            reqs_not_processed: std::mem::take(&mut self.not_processed),
            reqs_aborted_after_finish: Vec::new(),
            reqs_to_heartbeat: self.due_heartbeats(),
            reqs_referenced: std::mem::take(&mut self.referenced),
            ..Default::default()
        }
    }

    fn request_finished(
        &mut self,
        request_id: &str,
        status: FinishedStatus,
        block_ids: &[u32],
        block_generations: &[u64],
        params: Option<&KvTransferParams>,
    ) -> (bool, Option<KvTransferParams>) {
        let st = self.reqs.remove(request_id).unwrap_or_default();
        let Some(p) = st.params.or_else(|| params.cloned()) else { return (false, None) };

        // D: finished before the receive was ever enqueued (abort while waiting, or a
        // rejection): tell P it can free, with a notify-only receive (no local blocks).
        if self.consumer && p.wants_remote_prefill() && !st.remote_prefill_consumed {
            if !self.give_up_notices {
                self.counters.give_ups_suppressed += 1;
                tracing::debug!(request_id, "give-up notices are off: P frees at its deadline");
            } else if params_complete(&p) {
                self.counters.notify_only_recvs += 1;
                self.need_recv.push(RecvRequest {
                    request_id: request_id.to_string(),
                    local_block_ids: Vec::new(),
                    params: p,
                    rejected_at_unix_us: None,
                    trace: Default::default(),
                });
            } else {
                self.counters.invalid_params += 1;
            }
            return (false, None);
        }
        if !p.wants_remote_decode() {
            return (false, None);
        }
        let Some(producer) = &self.producer else { return (false, None) };
        // P: only a normal end of prefill hands blocks to a reader.
        if !matches!(status, FinishedStatus::LengthCapped | FinishedStatus::Stopped) {
            self.counters.not_processed += 1;
            self.not_processed.push(request_id.to_string());
            return (false, None);
        }
        let delay = !block_ids.is_empty();
        // The capability for the held blocks: only whoever holds these params may lease, read
        // or release them; the request id alone is not enough (docs/SECURITY.md). The one who
        // asked for the prefill may have chosen it (the router, to release before P answers);
        // it is theirs to share, and anyone else still cannot guess it.
        let capability = p
            .remote_capability
            .clone()
            .filter(|c| pdmesh_mesh_auth::is_capability(c))
            .unwrap_or_else(pdmesh_mesh_auth::new_capability);
        if delay {
            self.counters.holds_started += 1;
            self.need_send.push(SendRequest {
                request_id: request_id.to_string(),
                block_ids: block_ids.to_vec(),
                block_generations: block_generations.to_vec(),
                deadline_unix_ms: now_ms() + self.hold.as_millis() as u64,
                capability: capability.clone(),
            });
        }
        let out = KvTransferParams {
            do_remote_prefill: Some(true),
            do_remote_decode: Some(false),
            remote_engine_id: Some(producer.engine_id.clone()),
            remote_request_id: Some(request_id.to_string()),
            remote_block_ids: Some(block_ids.to_vec()),
            remote_host: Some(producer.side_channel_host.clone()),
            remote_port: Some(producer.side_channel_port),
            tp_size: Some(1),
            remote_block_generations: Some(block_generations.to_vec()),
            remote_dp_rank: Some(producer.dp_rank),
            remote_capability: Some(capability),
        };
        (delay, Some(out))
    }

    fn update_connector_output(&mut self, _output: &KvConnectorOutput) {}

    fn request_rejected_before_admission(
        &mut self,
        params: &KvTransferParams,
        rejected_at_unix_us: Option<u64>,
        trace: pdmesh_protocol::TraceContext,
    ) -> Result<(), String> {
        if !self.consumer {
            return Err("not a consumer".into());
        }
        if !params.wants_remote_prefill() || !params_complete(params) {
            self.counters.invalid_params += 1;
            tracing::warn!(?params, "rejection notice without complete remote_* params ignored");
            return Err("params lack do_remote_prefill or a remote_* field".into());
        }
        // A receive with no local blocks: the worker only tells P to free. Keyed by P's id,
        // and never reported to the scheduler as a finished receive.
        let p_id = params.remote_request_id.clone().unwrap_or_default();
        self.counters.rejection_notices += 1;
        self.need_recv.push(RecvRequest {
            request_id: format!("{REJECTED_PREFIX}{p_id}"),
            local_block_ids: Vec::new(),
            params: params.clone(),
            rejected_at_unix_us,
            trace,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn producer() -> PdConnector {
        PdConnector::new(
            Some(ProducerIdentity {
                engine_id: "p0".into(),
                side_channel_host: "10.0.0.1".into(),
                side_channel_port: 5600,
                dp_rank: 0,
            }),
            false,
            Duration::from_secs(30),
        )
    }

    fn consumer() -> PdConnector {
        PdConnector::new(None, true, Duration::from_secs(30))
    }

    fn remote_params() -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: Some(true),
            remote_engine_id: Some("p0".into()),
            remote_request_id: Some("req-1".into()),
            remote_block_ids: Some(vec![4, 5, 6]),
            remote_host: Some("10.0.0.1".into()),
            remote_port: Some(5600),
            ..Default::default()
        }
    }

    #[test]
    fn consumer_loads_async_once_then_reads_into_allocated_blocks() {
        let mut c = consumer();
        let p = remote_params();
        assert_eq!(c.get_num_new_matched_tokens("r", 40, 0, Some(&p)), (Some(40), true));
        c.update_state_after_alloc("r", &[1, 2, 3], 40);
        let meta = c.build_connector_meta(1);
        assert_eq!(meta.reqs_to_recv.len(), 1);
        assert_eq!(meta.reqs_to_recv[0].local_block_ids, vec![1, 2, 3]);
        // acted on once: a second query (e.g. after preemption) computes locally
        assert_eq!(c.get_num_new_matched_tokens("r", 40, 0, Some(&p)), (Some(0), false));
        assert!(c.build_connector_meta(2).reqs_to_recv.is_empty(), "metadata is drained each step");
        // normal D finish after the transfer: no params, no delay, no extra receive
        assert_eq!(c.request_finished("r", FinishedStatus::Stopped, &[1, 2, 3], &[], Some(&p)), (false, None));
        assert!(c.build_connector_meta(3).is_empty());
    }

    #[test]
    fn abort_before_scheduling_enqueues_a_notify_only_receive() {
        let mut c = consumer();
        let p = remote_params();
        assert_eq!(c.get_num_new_matched_tokens("r", 40, 0, Some(&p)), (Some(40), true));
        // aborted while still waiting: never allocated
        assert_eq!(c.request_finished("r", FinishedStatus::Aborted, &[], &[], Some(&p)), (false, None));
        let meta = c.build_connector_meta(1);
        assert_eq!(meta.reqs_to_recv.len(), 1);
        assert!(meta.reqs_to_recv[0].local_block_ids.is_empty(), "notify only, with P's request id");
        assert_eq!(meta.reqs_to_recv[0].params.remote_request_id.as_deref(), Some("req-1"));
    }

    #[test]
    fn consumer_tells_the_worker_once_what_it_references() {
        let mut c = consumer();
        let p = remote_params();
        c.get_num_new_matched_tokens("r", 40, 0, Some(&p));
        c.get_num_new_matched_tokens("r", 40, 0, Some(&p));
        assert_eq!(c.build_connector_meta(1).reqs_referenced, vec![p.clone()]);
        assert!(c.build_connector_meta(2).reqs_referenced.is_empty(), "once per request");
        // incomplete params are no reference
        let mut bad = remote_params();
        bad.remote_port = None;
        c.get_num_new_matched_tokens("s", 40, 0, Some(&bad));
        assert!(c.build_connector_meta(3).reqs_referenced.is_empty());
    }

    #[test]
    fn without_give_up_notices_an_early_finish_leaves_p_to_its_deadline() {
        let mut c = consumer();
        c.set_give_up_notices(false);
        let p = remote_params();
        assert_eq!(c.get_num_new_matched_tokens("r", 40, 0, Some(&p)), (Some(40), true));
        assert_eq!(c.request_finished("r", FinishedStatus::Aborted, &[], &[], Some(&p)), (false, None));
        let meta = c.build_connector_meta(1);
        assert!(meta.reqs_to_recv.is_empty() && meta.reqs_referenced.is_empty(), "{meta:?}");
        assert_eq!(c.counters.give_ups_suppressed, 1);
        // rejection notices have their own switch and still go out
        assert!(c.request_rejected_before_admission(&p, Some(1), Default::default()).is_ok());
        assert_eq!(c.build_connector_meta(2).reqs_to_recv.len(), 1);
    }

    #[test]
    fn missing_remote_fields_are_ignored_and_counted() {
        let mut c = consumer();
        let mut p = remote_params();
        p.remote_block_ids = None;
        assert_eq!(c.get_num_new_matched_tokens("r", 40, 0, Some(&p)), (Some(0), false));
        c.update_state_after_alloc("r", &[1], 0);
        assert!(c.build_connector_meta(1).reqs_to_recv.is_empty());
        assert_eq!(c.counters.invalid_params, 1);
    }

    #[test]
    fn rejection_before_admission_enqueues_an_empty_receive_with_ps_request_id() {
        let mut c = consumer();
        assert!(c.request_rejected_before_admission(&remote_params(), Some(1), Default::default()).is_ok());
        let meta = c.build_connector_meta(1);
        assert_eq!(meta.reqs_to_recv.len(), 1);
        assert!(meta.reqs_to_recv[0].local_block_ids.is_empty());
        assert_eq!(meta.reqs_to_recv[0].params.remote_request_id.as_deref(), Some("req-1"));
        // missing metadata: ignored, counted, nothing enqueued, params untouched
        let mut p = remote_params();
        p.remote_host = None;
        let before = p.clone();
        assert!(c.request_rejected_before_admission(&p, None, Default::default()).is_err());
        assert_eq!(p, before);
        assert!(c.build_connector_meta(2).reqs_to_recv.is_empty());
        assert_eq!(c.counters.invalid_params, 1);
    }

    #[test]
    fn producer_holds_blocks_and_returns_the_params_d_needs() {
        let mut c = producer();
        let p = KvTransferParams { do_remote_decode: Some(true), ..Default::default() };
        assert_eq!(c.get_num_new_matched_tokens("r", 40, 0, Some(&p)), (Some(0), false));
        c.update_state_after_alloc("r", &[7, 8, 9], 0);
        assert_eq!(c.build_connector_meta(1).reqs_in_batch, vec!["r".to_string()]);
        let (delay, out) = c.request_finished("r", FinishedStatus::LengthCapped, &[7, 8, 9], &[], Some(&p));
        assert!(delay);
        let out = out.unwrap();
        assert_eq!(out.do_remote_prefill, Some(true));
        assert_eq!(out.remote_block_ids, Some(vec![7, 8, 9]));
        assert_eq!(out.remote_request_id.as_deref(), Some("r"));
        assert_eq!(out.remote_port, Some(5600));
        let meta = c.build_connector_meta(2);
        assert_eq!(meta.reqs_to_send.len(), 1);
        assert!(meta.reqs_to_send[0].deadline_unix_ms > now_ms() + 25_000, "hold deadline = now + lease");
        assert_eq!(meta.reqs_to_send[0].block_ids, vec![7, 8, 9]);
        // The capability D must present is the one the hold is registered with, unguessable.
        let token = out.remote_capability.clone().unwrap();
        assert_eq!(token.len(), 32);
        assert!(token.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(meta.reqs_to_send[0].capability, token);
        c.update_state_after_alloc("r2", &[1], 0);
        let (_, out2) = c.request_finished("r2", FinishedStatus::LengthCapped, &[1], &[], Some(&p));
        assert_ne!(out2.unwrap().remote_capability.unwrap(), token, "one token per request");
        // A token chosen by whoever asked for the prefill (the router) is adopted when it is a
        // real one; anything else gets a fresh token.
        let chosen = pdmesh_mesh_auth::new_capability();
        for (offered, adopted) in [(chosen.clone(), true), ("weak".to_string(), false)] {
            let asked = KvTransferParams { remote_capability: Some(offered.clone()), ..p.clone() };
            c.update_state_after_alloc("r3", &[2], 0);
            let (_, out3) = c.request_finished("r3", FinishedStatus::LengthCapped, &[2], &[], Some(&asked));
            let got = out3.unwrap().remote_capability.unwrap();
            assert_eq!(got == offered, adopted, "{offered}");
            assert!(pdmesh_mesh_auth::is_capability(&got));
        }
    }

    #[test]
    fn producer_abort_before_finish_frees_now() {
        let mut c = producer();
        let p = KvTransferParams { do_remote_decode: Some(true), ..Default::default() };
        c.get_num_new_matched_tokens("r", 40, 0, Some(&p));
        c.update_state_after_alloc("r", &[7], 0);
        assert_eq!(c.request_finished("r", FinishedStatus::Aborted, &[7], &[], Some(&p)), (false, None));
        let meta = c.build_connector_meta(1);
        assert_eq!(meta.reqs_not_processed, vec!["r".to_string()]);
        assert!(meta.reqs_to_send.is_empty());
    }
}
