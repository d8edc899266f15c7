//! A request inside the engine, with vLLM's status names.

use std::time::Instant;

use pdmesh_protocol::{
    EngineRequest, FinishReason, FinishedStatus, KvTransferParams, SamplingHistory, SamplingParams, TokenLogprobs,
};

/// vLLM's `RequestStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    WaitingForRemoteKvs,
    Running,
    Preempted,
    FinishedStopped,
    FinishedLengthCapped,
    FinishedAborted,
    FinishedIgnored,
    FinishedError,
}

impl RequestStatus {
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            RequestStatus::FinishedStopped
                | RequestStatus::FinishedLengthCapped
                | RequestStatus::FinishedAborted
                | RequestStatus::FinishedIgnored
                | RequestStatus::FinishedError
        )
    }

    pub fn finish_reason(self) -> Option<FinishReason> {
        match self {
            RequestStatus::FinishedStopped => Some(FinishReason::Stop),
            RequestStatus::FinishedLengthCapped | RequestStatus::FinishedIgnored => Some(FinishReason::Length),
            RequestStatus::FinishedAborted => Some(FinishReason::Abort),
            RequestStatus::FinishedError => Some(FinishReason::Error),
            _ => None,
        }
    }

    pub fn finished_status(self) -> Option<FinishedStatus> {
        match self {
            RequestStatus::FinishedStopped => Some(FinishedStatus::Stopped),
            RequestStatus::FinishedLengthCapped => Some(FinishedStatus::LengthCapped),
            RequestStatus::FinishedAborted => Some(FinishedStatus::Aborted),
            RequestStatus::FinishedIgnored => Some(FinishedStatus::Ignored),
            RequestStatus::FinishedError => Some(FinishedStatus::Error),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RequestStatus::Waiting => "waiting",
            RequestStatus::WaitingForRemoteKvs => "waiting_for_remote_kvs",
            RequestStatus::Running => "running",
            RequestStatus::Preempted => "preempted",
            RequestStatus::FinishedStopped => "finished_stopped",
            RequestStatus::FinishedLengthCapped => "finished_length_capped",
            RequestStatus::FinishedAborted => "finished_aborted",
            RequestStatus::FinishedIgnored => "finished_ignored",
            RequestStatus::FinishedError => "finished_error",
        }
    }
}

/// The connector's answer to `get_num_new_matched_tokens`, cached until the request is
/// scheduled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectorMatch {
    pub external_tokens: u32,
    pub load_async: bool,
}

#[derive(Debug)]
pub struct Request {
    pub id: String,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    pub output_logprobs: Vec<TokenLogprobs>,
    pub sampling: SamplingParams,
    pub eos_token_ids: Vec<u32>,
    pub kv_transfer_params: Option<KvTransferParams>,
    pub status: RequestStatus,
    pub num_computed_tokens: u32,
    pub block_ids: Vec<u32>,
    pub num_preemptions: u32,
    pub connector_match: Option<ConnectorMatch>,
    pub num_external_tokens: u32,
    pub stop_token_id: Option<u32>,
    pub error: Option<String>,
    pub arrived: Instant,
    /// When the request finished (for held-block age).
    pub finished_at: Option<Instant>,
    /// Index into `output` of the first token not yet sent to the client.
    pub emitted: usize,
    /// Prefix-cache hashes of the request's full blocks, as far as computed (the chain only
    /// grows: tokens are never taken back, so they stay valid across preemptions).
    pub block_hashes: Vec<crate::block_pool::BlockHash>,
    /// Leading blocks of `block_ids` already registered in the prefix cache (or hit in it).
    pub num_cached_blocks: u32,
    /// Prompt tokens the prefix cache supplied when the request was first scheduled
    /// (OpenAI's `usage.prompt_tokens_details.cached_tokens`); `None` before that.
    pub num_cached_tokens: Option<u32>,
    /// The step's [`SamplingHistory`] without the output, fixed at arrival: the prompt's
    /// distinct ids (repetition penalty only) and the ids `min_tokens` holds back. Built once
    /// here so a sampling step only appends the output (empty unless the request needs it).
    history_base: SamplingHistory,
}

impl Request {
    pub fn new(req: EngineRequest) -> Self {
        let history_base = if req.sampling.needs_history() {
            history_base(&req.prompt_token_ids, &req.sampling, &req.eos_token_ids)
        } else {
            SamplingHistory::default()
        };
        Self {
            id: req.request_id,
            prompt: req.prompt_token_ids,
            output: Vec::new(),
            output_logprobs: Vec::new(),
            sampling: req.sampling,
            eos_token_ids: req.eos_token_ids,
            kv_transfer_params: req.kv_transfer_params,
            status: RequestStatus::Waiting,
            num_computed_tokens: 0,
            block_ids: Vec::new(),
            num_preemptions: 0,
            connector_match: None,
            num_external_tokens: 0,
            stop_token_id: None,
            error: None,
            arrived: Instant::now(),
            finished_at: None,
            emitted: 0,
            block_hashes: Vec::new(),
            num_cached_blocks: 0,
            num_cached_tokens: None,
            history_base,
        }
    }

    /// What the sampler's penalties, `min_tokens` and `bad_words` read for this request now.
    /// A request moved here (`output_index_offset`) carries the tokens it generated elsewhere
    /// at the end of its prompt: they count as output, so every node penalises the same history.
    pub fn sampling_history(&self) -> SamplingHistory {
        let moved = (self.sampling.output_index_offset as usize).min(self.prompt.len());
        let earlier = &self.prompt[self.prompt.len() - moved..];
        SamplingHistory {
            output_token_ids: earlier.iter().chain(&self.output).copied().collect(),
            ..self.history_base.clone()
        }
    }

    pub fn num_tokens(&self) -> u32 {
        (self.prompt.len() + self.output.len()) as u32
    }

    pub fn token_at(&self, pos: usize) -> Option<u32> {
        if pos < self.prompt.len() {
            self.prompt.get(pos).copied()
        } else {
            self.output.get(pos - self.prompt.len()).copied()
        }
    }

    pub fn tokens(&self, from: u32, to: u32) -> Vec<u32> {
        (from as usize..to as usize).filter_map(|p| self.token_at(p)).collect()
    }
}

/// [`Request::sampling_history`]'s fixed part: the distinct ids of the prompt proper (without
/// the tokens a moved request generated elsewhere) when a repetition penalty reads them, and
/// with `min_tokens` the ids it holds back (EOS unless `ignore_eos`, and `stop_token_ids`).
fn history_base(prompt: &[u32], sampling: &SamplingParams, eos_token_ids: &[u32]) -> SamplingHistory {
    let distinct = |ids: &mut Vec<u32>| {
        ids.sort_unstable();
        ids.dedup();
    };
    let mut prompt_token_ids = Vec::new();
    if sampling.repetition_penalty != 1.0 {
        let moved = (sampling.output_index_offset as usize).min(prompt.len());
        prompt_token_ids = prompt[..prompt.len() - moved].to_vec();
        distinct(&mut prompt_token_ids);
    }
    let mut stop_token_ids = Vec::new();
    if sampling.min_tokens > 0 {
        let eos = eos_token_ids.iter().filter(|_| !sampling.ignore_eos);
        stop_token_ids = eos.chain(&sampling.stop_token_ids).copied().collect();
        distinct(&mut stop_token_ids);
    }
    SamplingHistory { prompt_token_ids, output_token_ids: Vec::new(), stop_token_ids }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(prompt: Vec<u32>, sampling: SamplingParams) -> Request {
        Request::new(EngineRequest {
            request_id: "r".into(),
            client_request_id: None,
            prompt_token_ids: prompt,
            sampling,
            eos_token_ids: vec![0],
            arrival_unix_ms: 0,
            kv_transfer_params: None,
            data_parallel_rank: None,
        })
    }

    #[test]
    fn a_moved_requests_earlier_tokens_are_output_not_prompt() {
        // prompt 5 3 5, then 9 7 generated on another node (offset 2), then 4 here
        let sampling = SamplingParams {
            repetition_penalty: 1.2,
            min_tokens: 4,
            stop_token_ids: vec![8, 0],
            output_index_offset: 2,
            ..SamplingParams::default()
        };
        let mut req = request(vec![5, 3, 5, 9, 7], sampling);
        req.output.push(4);
        let h = req.sampling_history();
        assert_eq!(h.prompt_token_ids, vec![3, 5]);
        assert_eq!(h.output_token_ids, vec![9, 7, 4]);
        assert_eq!(h.stop_token_ids, vec![0, 8]);
        // without a repetition penalty or min_tokens, nothing but the output travels
        let mut plain = request(vec![5, 3], SamplingParams { frequency_penalty: 0.5, ..SamplingParams::default() });
        plain.output.push(6);
        assert_eq!(plain.sampling_history(), SamplingHistory { output_token_ids: vec![6], ..Default::default() });
    }
}
