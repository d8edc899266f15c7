//! The continuous-batching scheduler of one engine rank (vLLM V1's `Scheduler`), as a pure
//! state machine: no I/O, no clock beyond `Instant` for ages, so every race window can be
//! driven from unit and property tests.
//!
//! One engine step, as the engine actor drives it:
//! 1. [`Scheduler::add_request`] / [`Scheduler::abort_requests`] for the inputs that arrived.
//! 2. [`Scheduler::match_queries`] → connector `get_num_new_matched_tokens` →
//!    [`Scheduler::apply_match`].
//! 3. [`Scheduler::schedule`]: running requests first (decode and chunked prefill), then
//!    waiting ones, under the token budget; preemption (recompute) when blocks run out.
//! 4. The worker runs the step → [`Scheduler::update_from_output`] (stop checks).
//! 5. [`Scheduler::finishing_calls`] → connector `request_finished` (exactly once per
//!    request) → [`Scheduler::apply_finished`]: free now, or hold for a remote reader.
//! 6. [`Scheduler::update_from_kv_output`]: `finished_sending` frees held blocks,
//!    `finished_recving` promotes requests waiting for remote KV.
//!
//! Ids that the scheduler does not track (late aborts, duplicate notices) are counted, never
//! asserted (rule R2).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use pdmesh_protocol::{
    ConnectorCall, EngineOutput, EngineRequest, EngineStats, HeldRequest, KvConnectorMetadata, KvConnectorOutput,
    KvTransferParams, KvUsage, ModelRunnerOutput, ScheduledChunk,
};

use crate::block_pool::{block_hash, extend_hashes, root_hash, BlockHash, BlockPool};
use crate::request::{ConnectorMatch, Request, RequestStatus};

/// Sizing of one rank's scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub block_size: u32,
    pub num_blocks: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub max_model_len: u32,
}

/// Why a request was refused at admission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("request id {0:?} is already in use")]
    DuplicateId(String),
    #[error("prompt is empty")]
    EmptyPrompt,
    #[error("prompt of {prompt} tokens does not fit max_model_len {max}")]
    TooLong { prompt: u32, max: u32 },
    #[error("prompt needs {needed} KV blocks but the cache has {total}")]
    TooManyBlocks { needed: u32, total: u32 },
    #[error("refused by fault injection (engine.fault_injection = refuse_admission_every={0})")]
    Injected(u32),
    /// Overload: the waiting queue holds `max_waiting` requests.
    #[error("overloaded: the waiting queue is full ({waiting} requests, engine.max_waiting = {max})")]
    WaitingQueueFull { waiting: u32, max: u32 },
    /// Overload (prefill nodes): the blocks held for remote decoders, plus those promised to
    /// remote-decode requests not finished yet, plus this one's would exceed
    /// `max_held_fraction` of the pool.
    #[error(
        "overloaded: KV blocks held for remote decoders would exceed their share of the pool \
         ({committed} held or promised + {needed} needed > {cap} of {total}, engine.max_held_fraction)"
    )]
    HeldBlocksFull { committed: u32, needed: u32, cap: u32, total: u32 },
}

/// The engine's own fault injection (`engine.fault_injection`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineFaults {
    /// Refuse every N-th admission.
    pub refuse_admission_every: Option<u32>,
}

impl EngineFaults {
    /// Parse `refuse_admission_every=N` (empty: none). Unknown names are errors, so a typo
    /// never silently turns a drill off.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut f = Self::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item.split_once('=') {
                Some(("refuse_admission_every", n)) => match n.trim().parse::<u32>() {
                    Ok(n) if n > 0 => f.refuse_admission_every = Some(n),
                    _ => return Err(format!("refuse_admission_every needs a positive count, not {n:?}")),
                },
                _ => return Err(format!("unknown engine fault {item:?} (known: refuse_admission_every=N)")),
            }
        }
        Ok(f)
    }
}

impl AdmissionError {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            AdmissionError::DuplicateId(_) => "duplicate_id",
            AdmissionError::EmptyPrompt => "empty_prompt",
            AdmissionError::TooLong { .. } => "too_long",
            AdmissionError::TooManyBlocks { .. } => "too_many_blocks",
            AdmissionError::Injected(_) => "injected",
            AdmissionError::WaitingQueueFull { .. } => "waiting_queue_full",
            AdmissionError::HeldBlocksFull { .. } => "held_blocks_full",
        }
    }

    /// Whether the refusal is about load (the client may retry later: 503 with
    /// `Retry-After`) rather than about the request itself.
    pub fn is_overload(&self) -> bool {
        matches!(self, AdmissionError::WaitingQueueFull { .. } | AdmissionError::HeldBlocksFull { .. })
    }

    /// The error text of the request's error output. The frontend maps a text starting with
    /// `overloaded` to 503 + `Retry-After`, anything else here to an error of the request.
    pub fn output_message(&self) -> String {
        if self.is_overload() {
            self.to_string()
        } else {
            format!("invalid request: {self}")
        }
    }
}

/// Overload bounds checked at admission (see [`AdmissionError`]); the defaults bound nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionLimits {
    /// Requests in the waiting queue (0: no bound).
    pub max_waiting: u32,
    /// Share of the pool that held and promised-to-be-held blocks may take (1.0: no bound).
    pub max_held_fraction: f64,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        Self { max_waiting: 0, max_held_fraction: 1.0 }
    }
}

/// What one call to [`Scheduler::schedule`] produced.
#[derive(Debug, Default)]
pub struct Schedule {
    pub chunks: Vec<ScheduledChunk>,
    /// `update_state_after_alloc` calls for requests that got blocks this step.
    pub alloc_calls: Vec<ConnectorCall>,
    pub finished_request_ids: Vec<String>,
    pub num_scheduled_tokens: u32,
}

/// Counters exported as metrics and in [`EngineStats`].
#[derive(Debug, Default, Clone)]
pub struct SchedulerCounters {
    pub steps: u64,
    pub finished_requests: u64,
    pub request_finished_calls: u64,
    pub unknown_ids: u64,
    pub preemptions: u64,
    pub duplicate_aborts: u64,
    /// Aborts of finished requests whose blocks the connector holds (passed on to it).
    pub aborts_after_finish: u64,
    /// KV loads that failed and were recomputed locally (`recompute` policy).
    pub kv_loads_recomputed: u64,
    /// Prompt tokens that a failed load left to prefill locally.
    pub recomputed_tokens: u64,
    /// Requests ended with `error` because their load failed (`fail` policy).
    pub kv_loads_failed_by_policy: u64,
    /// Connector-worker restarts seen (its KV state was lost).
    pub worker_restarts: u64,
    /// Holds and offload saves the connector queued for blocks this engine no longer holds
    /// for that request (a worker restart freed them): dropped, never passed on.
    pub stale_sends_dropped: u64,
    /// Prompt tokens looked up in the prefix cache (vLLM's `prefix_cache_queries`).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found cached (vLLM's `prefix_cache_hits`).
    pub prefix_cache_hits: u64,
}

/// A finished request whose blocks the connector holds for a remote reader.
#[derive(Debug)]
struct Held {
    blocks: Vec<u32>,
    since: Instant,
    /// The capability token handed out with the request's params: a release from outside
    /// (`POST /v1/kv/release`) must carry it.
    capability: String,
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    requests: HashMap<String, Request>,
    waiting: VecDeque<String>,
    running: Vec<String>,
    /// Finished, `request_finished` not called yet.
    finishing: Vec<String>,
    /// Finished; the connector owns the blocks until `finished_sending`.
    held: HashMap<String, Held>,
    /// Aborted while a remote READ may still write into its blocks: freed on
    /// `finished_recving`.
    free_on_recv: HashMap<String, Vec<u32>>,
    finished_recving: HashSet<String>,
    /// Held requests under a read lease, as of the worker's last step.
    leased: HashSet<String>,
    /// Held requests aborted after finish, to tell the connector (drained per step).
    aborted_held: Vec<String>,
    /// Finished requests aborted before `request_finished` was answered.
    abort_when_held: HashSet<String>,
    /// Ids whose abort-after-finish was taken (a second one is a duplicate).
    abort_after_finish_sent: HashSet<String>,
    finished_since_last_step: Vec<String>,
    outputs: Vec<EngineOutput>,
    counters: SchedulerCounters,
    /// `kv_load_failure_policy = recompute` (else `fail`, vLLM's default).
    recompute_load_failures: bool,
    faults: EngineFaults,
    /// Admissions asked for (for `refuse_admission_every`).
    admissions: u64,
    limits: AdmissionLimits,
    /// Root of every request's block-hash chain (salted with the model).
    root: BlockHash,
    /// Give a request that goes on after a step the block of its next position in that step
    /// already (D78), for a worker that runs the next decode step ahead.
    reserve_next_block: bool,
}

/// What [`Scheduler::admit`] did with one waiting request.
enum Admit {
    /// Go on with the next waiting request.
    Next,
    /// Blocks are short: the request went back to the head of the queue; admit nothing more.
    Stop,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Self {
            pool: BlockPool::new(cfg.num_blocks),
            cfg,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finishing: Vec::new(),
            held: HashMap::new(),
            free_on_recv: HashMap::new(),
            finished_recving: HashSet::new(),
            aborted_held: Vec::new(),
            leased: HashSet::new(),
            abort_when_held: HashSet::new(),
            abort_after_finish_sent: HashSet::new(),
            finished_since_last_step: Vec::new(),
            outputs: Vec::new(),
            counters: SchedulerCounters::default(),
            recompute_load_failures: false,
            faults: EngineFaults::default(),
            admissions: 0,
            limits: AdmissionLimits::default(),
            root: root_hash(""),
            reserve_next_block: false,
        }
    }

    /// Turn automatic prefix caching on or off (`engine.enable_prefix_caching`). Takes effect
    /// on an idle scheduler only (it starts a fresh pool); returns whether it did.
    pub fn set_prefix_caching(&mut self, on: bool) -> bool {
        if self.pool.caching() == on {
            return true;
        }
        if self.pool.num_free() != self.pool.num_blocks() {
            return false;
        }
        self.pool = BlockPool::with_caching(self.cfg.num_blocks, on);
        true
    }

    pub fn prefix_caching(&self) -> bool {
        self.pool.caching()
    }

    /// Salt the block hashes with what else decides the KV (the model the worker serves).
    /// A different salt drops the cache: its blocks were computed by another model.
    pub fn set_cache_salt(&mut self, salt: &str) {
        let root = root_hash(salt);
        if root != self.root {
            self.root = root;
            self.pool.reset_cache();
            for r in self.requests.values_mut() {
                r.block_hashes.clear();
            }
        }
    }

    /// The pool's cache counters (evictions, resets).
    pub fn cache_counters(&self) -> crate::block_pool::CacheCounters {
        self.pool.counters()
    }

    /// Blocks registered in the prefix cache, and of those the ones nobody references.
    pub fn cached_blocks(&self) -> (u32, u32) {
        (self.pool.num_cached(), self.pool.num_cached_free())
    }

    /// Turn on the engine's fault injection.
    pub fn set_faults(&mut self, faults: EngineFaults) {
        self.faults = faults;
    }

    /// Set the overload bounds checked by [`Scheduler::add_request`].
    pub fn set_admission_limits(&mut self, limits: AdmissionLimits) {
        self.limits = limits;
    }

    /// `true`: a failed KV load is recomputed locally; `false`: the request fails.
    pub fn set_recompute_load_failures(&mut self, recompute: bool) {
        self.recompute_load_failures = recompute;
    }

    /// `true` where the worker runs each next decode step ahead (`engine.async_scheduling`,
    /// D67/D78): a step whose request goes on also carries the block that request's next
    /// position lands in, so the step run ahead never stops at a block boundary.
    pub fn set_reserve_next_block(&mut self, on: bool) {
        self.reserve_next_block = on;
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn counters(&self) -> &SchedulerCounters {
        &self.counters
    }

    fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Admit a request into the waiting queue.
    pub fn add_request(&mut self, req: EngineRequest) -> Result<(), AdmissionError> {
        if self.id_in_use(&req.request_id) {
            return Err(AdmissionError::DuplicateId(req.request_id));
        }
        let prompt = req.prompt_token_ids.len() as u32;
        if prompt == 0 {
            return Err(AdmissionError::EmptyPrompt);
        }
        if prompt >= self.cfg.max_model_len {
            return Err(AdmissionError::TooLong { prompt, max: self.cfg.max_model_len });
        }
        let needed = self.blocks_for(prompt + 1);
        if needed > self.pool.num_blocks() {
            return Err(AdmissionError::TooManyBlocks { needed, total: self.pool.num_blocks() });
        }
        let waiting = self.waiting.len() as u32;
        if self.limits.max_waiting > 0 && waiting >= self.limits.max_waiting {
            return Err(AdmissionError::WaitingQueueFull { waiting, max: self.limits.max_waiting });
        }
        if self.limits.max_held_fraction < 1.0
            && req.kv_transfer_params.as_ref().is_some_and(|p| p.wants_remote_decode())
        {
            let total = self.pool.num_blocks();
            let cap = (f64::from(total) * self.limits.max_held_fraction).floor() as u32;
            let committed = self.held_or_promised_blocks();
            if committed.saturating_add(needed) > cap {
                return Err(AdmissionError::HeldBlocksFull { committed, needed, cap, total });
            }
        }
        self.admissions += 1;
        if let Some(n) = self.faults.refuse_admission_every {
            if self.admissions.is_multiple_of(u64::from(n)) {
                return Err(AdmissionError::Injected(n));
            }
        }
        let id = req.request_id.clone();
        self.requests.insert(id.clone(), Request::new(req));
        self.waiting.push_back(id);
        Ok(())
    }

    /// Whether `id` still names blocks here: a live request, a finished one whose blocks are
    /// held for a remote reader, or one parked until its READ settles. Every table keyed by
    /// request id (held, parked, the connector's and the hold table's) assumes one owner per
    /// id, so a second request under a live id would alias the first one's blocks, and the
    /// first one's would leak when the second one's entry overwrote it.
    pub fn id_in_use(&self, id: &str) -> bool {
        self.requests.contains_key(id) || self.held.contains_key(id) || self.free_on_recv.contains_key(id)
    }

    /// Blocks held for remote decoders (and parked while a read may write them), plus the
    /// prompt blocks of remote-decode requests not yet handed to the connector (waiting,
    /// running, or finished before `request_finished` is answered): what P's holds will take
    /// once the requests admitted so far finish. Counting the promised ones keeps a
    /// burst from being admitted wholesale before the first of it is held.
    fn held_or_promised_blocks(&self) -> u32 {
        let promised: u32 = self
            .requests
            .values()
            .filter(|r| r.kv_transfer_params.as_ref().is_some_and(|p| p.wants_remote_decode()))
            .map(|r| self.blocks_for(r.prompt.len() as u32 + 1))
            .sum();
        self.kv_usage().held_blocks.saturating_add(promised)
    }

    /// Abort requests (client disconnect, stop string). Unknown and already-finished ids are
    /// skipped and counted (vLLM #25067): an abort never calls `request_finished` a second
    /// time and never frees blocks held for a remote reader. Returns the ids really aborted.
    pub fn abort_requests(&mut self, ids: &[String]) -> Vec<String> {
        let mut aborted = Vec::new();
        for id in ids {
            if self.held.contains_key(id) {
                // Abort after finish (beyond vLLM): the blocks are held for a reader. Tell the
                // connector once; it frees at once without an active lease, else when the
                // lease ends. The scheduler itself frees only on `finished_sending`.
                if self.abort_after_finish_sent.insert(id.clone()) {
                    self.aborted_held.push(id.clone());
                    self.counters.aborts_after_finish += 1;
                } else {
                    self.counters.duplicate_aborts += 1;
                }
                continue;
            }
            let Some(req) = self.requests.get(id) else {
                self.counters.unknown_ids += 1;
                tracing::debug!(request_id = %id, "abort for an unknown request");
                continue;
            };
            if req.status.is_finished() {
                // Finished, `request_finished` not answered yet: if the connector holds the
                // blocks, the abort goes to it as soon as they are held.
                if self.abort_after_finish_sent.insert(id.clone()) {
                    self.abort_when_held.insert(id.clone());
                    self.counters.aborts_after_finish += 1;
                    continue;
                }
                self.counters.duplicate_aborts += 1;
                tracing::debug!(request_id = %id, "abort for an already finished request ignored");
                continue;
            }
            self.finish(id, RequestStatus::FinishedAborted);
            aborted.push(id.clone());
        }
        aborted
    }

    /// Fail requests with finish reason `error` (e.g. the worker could not run their step).
    pub fn fail_requests(&mut self, ids: &[String], reason: &str) {
        for id in ids {
            if let Some(req) = self.requests.get_mut(id) {
                if !req.status.is_finished() {
                    req.error = Some(reason.to_string());
                    self.finish(id, RequestStatus::FinishedError);
                }
            }
        }
    }

    /// The connector-worker restarted: the KV it held for this engine is gone. Every request
    /// whose KV lived there (running, or waiting for remote KV whose READ died with the
    /// worker) ends with `error`; blocks held for remote readers (the new worker's hold table
    /// is empty, so no `finished_sending` will ever come) and blocks parked until a READ
    /// settles are freed now. Returns how many requests were failed.
    pub fn worker_restarted(&mut self, reason: &str) -> usize {
        let lost: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, r)| {
                !r.status.is_finished()
                    && (r.status == RequestStatus::Running
                        || r.status == RequestStatus::WaitingForRemoteKvs
                        || r.num_computed_tokens > 0)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in &lost {
            if let Some(req) = self.requests.get_mut(id) {
                req.error = Some(reason.to_string());
            }
            // The READ cannot be in flight any more: settle it so the blocks free with the request.
            self.finished_recving.insert(id.clone());
            self.finish(id, RequestStatus::FinishedError);
        }
        for (_, blocks) in self.free_on_recv.drain() {
            self.pool.free(&blocks);
        }
        let held: Vec<Held> = self.held.drain().map(|(_, h)| h).collect();
        for h in held {
            self.pool.free(&h.blocks);
        }
        // The cached KV lived in the worker too.
        self.pool.reset_cache();
        self.counters.worker_restarts += 1;
        lost.len()
    }

    /// Move a live request to a finished status and queue its `request_finished` call. The
    /// only place a status becomes finished, so the call happens exactly once.
    fn finish(&mut self, id: &str, status: RequestStatus) {
        let Some(req) = self.requests.get_mut(id) else { return };
        if req.status.is_finished() {
            return;
        }
        let was_receiving = req.status == RequestStatus::WaitingForRemoteKvs && !self.finished_recving.contains(id);
        req.status = status;
        req.finished_at = Some(Instant::now());
        self.running.retain(|r| r != id);
        self.waiting.retain(|r| r != id);
        self.finished_recving.remove(id);
        if was_receiving && !req.block_ids.is_empty() {
            // A READ may still be writing into these blocks: keep them until the worker
            // reports the receive settled.
            self.free_on_recv.insert(id.to_string(), std::mem::take(&mut req.block_ids));
        }
        self.counters.finished_requests += 1;
        self.finishing.push(id.to_string());
        self.finished_since_last_step.push(id.to_string());
    }

    /// `get_num_new_matched_tokens` calls for waiting requests the connector has not been
    /// asked about yet.
    pub fn match_queries(&self) -> Vec<ConnectorCall> {
        self.waiting
            .iter()
            .filter_map(|id| self.requests.get(id))
            .filter(|r| r.connector_match.is_none() && r.status != RequestStatus::WaitingForRemoteKvs)
            .map(|r| ConnectorCall::GetNumNewMatchedTokens {
                request_id: r.id.clone(),
                num_prompt_tokens: r.prompt.len() as u32,
                num_computed_tokens: r.num_computed_tokens,
                kv_transfer_params: r.kv_transfer_params.clone(),
                prompt_token_ids: r.prompt.clone(),
            })
            .collect()
    }

    /// Whether this request carries a remote prefill's params: its prompt's KV is held
    /// elsewhere for it, so only the connector may decide how it is loaded.
    pub fn wants_remote_prefill(&self, id: &str) -> bool {
        self.requests
            .get(id)
            .and_then(|r| r.kv_transfer_params.as_ref())
            .is_some_and(KvTransferParams::wants_remote_prefill)
    }

    /// Record the connector's answer (`count: None` = ask again next step).
    pub fn apply_match(&mut self, id: &str, count: Option<u32>, load_async: bool) {
        match self.requests.get_mut(id) {
            Some(req) if !req.status.is_finished() => {
                if let Some(c) = count {
                    // The last prompt token is always computed locally (it yields the logits).
                    let max_ext = (req.prompt.len() as u32).saturating_sub(req.num_computed_tokens);
                    req.connector_match = Some(ConnectorMatch { external_tokens: c.min(max_ext), load_async });
                }
            }
            _ => self.counters.unknown_ids += 1,
        }
    }

    /// Choose what runs in the next step.
    pub fn schedule(&mut self) -> Schedule {
        let mut out =
            Schedule { finished_request_ids: std::mem::take(&mut self.finished_since_last_step), ..Default::default() };
        let mut budget = self.cfg.max_num_batched_tokens;
        let preempted_any = self.schedule_running(&mut out, &mut budget);
        // Waiting requests only in a step that did not have to preempt.
        if !preempted_any {
            self.schedule_waiting(&mut out, &mut budget);
        }
        // Last, so that no running request is preempted and no waiting one left out for a
        // block given early.
        if self.reserve_next_block {
            self.reserve_next_blocks(&mut out);
        }
        if !out.chunks.is_empty() {
            self.counters.steps += 1;
        }
        out
    }

    /// Running requests first, in order, within `budget` tokens: each gets the blocks for its
    /// next chunk, preempting the lowest-priority running request (the last) while blocks are
    /// short. Returns whether any request was preempted.
    fn schedule_running(&mut self, out: &mut Schedule, budget: &mut u32) -> bool {
        let mut preempted_any = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i].clone();
            let Some(req) = self.requests.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let num_new = (req.num_tokens() - req.num_computed_tokens).min(*budget);
            if num_new == 0 {
                i += 1;
                continue;
            }
            let need = self.blocks_for(req.num_computed_tokens + num_new).saturating_sub(req.block_ids.len() as u32);
            let mut self_preempted = false;
            let new_blocks = loop {
                if let Some(b) = self.pool.allocate(need) {
                    break b;
                }
                // Out of blocks: preempt the lowest-priority running request (the last).
                let victim_idx = self.running.len() - 1;
                let victim = self.running[victim_idx].clone();
                self.preempt(&victim);
                preempted_any = true;
                if victim_idx == i {
                    self_preempted = true;
                    break Vec::new();
                }
            };
            if self_preempted {
                break;
            }
            let Some(req) = self.requests.get_mut(&id) else { break };
            req.block_ids.extend(new_blocks);
            let chunk = Self::chunk_for(req, num_new);
            *budget -= num_new;
            out.num_scheduled_tokens += num_new;
            out.chunks.push(chunk);
            i += 1;
        }
        preempted_any
    }

    /// Then waiting requests, in queue order, while there is room: a request whose remote KV
    /// is still in flight keeps its place; one whose KV arrived counts it as computed; a new
    /// one takes its local prefix hit and either starts an async load or runs.
    fn schedule_waiting(&mut self, out: &mut Schedule, budget: &mut u32) {
        self.hoist_loaded_requests();
        let mut skipped: VecDeque<String> = VecDeque::new();
        while let Some(id) = self.waiting.pop_front() {
            if self.running.len() as u32 >= self.cfg.max_num_seqs || *budget == 0 {
                self.waiting.push_front(id);
                break;
            }
            if let Admit::Stop = self.admit(id, out, budget, &mut skipped) {
                break;
            }
        }
        // Skipped requests keep their place at the head of the queue.
        while let Some(id) = skipped.pop_back() {
            self.waiting.push_front(id);
        }
    }

    /// One waiting request `id` (popped from the queue): admitted (running, or waiting for its
    /// remote KV), `skipped` (it keeps its place), or put back at the head when blocks are short
    /// (`Admit::Stop`: nothing behind it is admitted in this step).
    fn admit(&mut self, id: String, out: &mut Schedule, budget: &mut u32, skipped: &mut VecDeque<String>) -> Admit {
        let bs = self.cfg.block_size;
        let Some(req) = self.requests.get_mut(&id) else { return Admit::Next };
        if req.status == RequestStatus::WaitingForRemoteKvs {
            if !self.finished_recving.remove(&id) {
                skipped.push_back(id);
                return Admit::Next;
            }
            // KV arrived: count the loaded tokens as computed, except the last prompt
            // token, which is recomputed to produce logits.
            // (A local prefix hit already counts in `num_computed_tokens`.)
            let mut computed = (req.num_computed_tokens + req.num_external_tokens).min(req.num_tokens());
            if computed >= req.num_tokens() {
                computed = req.num_tokens().saturating_sub(1);
            }
            req.num_computed_tokens = computed;
            req.status = if req.num_preemptions > 0 { RequestStatus::Preempted } else { RequestStatus::Waiting };
        }
        let Some(m) = req.connector_match else {
            skipped.push_back(id);
            return Admit::Next;
        };
        let first_alloc = req.block_ids.is_empty();
        // Prefix cache: a request starting from scratch takes the cached blocks of
        // its longest cached prefix, never its last token (recomputed for logits).
        let max_hit = (req.num_tokens().saturating_sub(1) / bs) as usize;
        let hit = if first_alloc && req.num_computed_tokens == 0 && self.pool.caching() {
            if req.block_hashes.len() < max_hit {
                let tokens = req.tokens(0, max_hit as u32 * bs);
                extend_hashes(&self.root, &tokens, bs, &mut req.block_hashes);
            }
            self.pool.lookup(req.block_hashes.get(..max_hit).unwrap_or(&[]))
        } else {
            Vec::new()
        };
        // A full local hit (every block but the one holding the last prompt token)
        // leaves less than a block to compute: D reads nothing and prefills the rest
        // itself; the connector's receive without local blocks tells P at once.
        let full_hit = !hit.is_empty() && hit.len() == max_hit;
        // The connector counted its tokens from position 0 (the request had computed
        // nothing when asked); the local hit covers the first of them.
        let hit_tokens = hit.len() as u32 * bs;
        let external = if m.load_async { m.external_tokens.saturating_sub(hit_tokens) } else { 0 };
        if req.num_computed_tokens == 0 && first_alloc && external > 0 && !full_hit {
            return self.start_async_load(id, hit, external, out, skipped);
        }
        let computed = req.num_computed_tokens.max(hit_tokens);
        let num_new = (req.num_tokens() - computed).min(*budget);
        let need = (computed + num_new).div_ceil(bs).saturating_sub((req.block_ids.len() + hit.len()) as u32);
        let Some(blocks) = self.allocate_past_hit(&id, &hit, need) else { return Admit::Stop };
        let Some(req) = self.requests.get_mut(&id) else { return Admit::Stop };
        if first_alloc && self.pool.caching() {
            self.counters.prefix_cache_queries += u64::from(req.num_tokens());
            self.counters.prefix_cache_hits += u64::from(hit_tokens);
            req.num_cached_tokens.get_or_insert(hit_tokens.min(req.prompt.len() as u32));
            req.num_cached_blocks = hit.len() as u32;
        }
        req.num_computed_tokens = computed;
        req.block_ids.extend(hit);
        req.block_ids.extend(blocks);
        if first_alloc {
            out.alloc_calls.push(ConnectorCall::UpdateStateAfterAlloc {
                request_id: id.clone(),
                block_ids: req.block_ids.clone(),
                num_external_tokens: 0,
            });
        }
        req.status = RequestStatus::Running;
        let chunk = Self::chunk_for(req, num_new);
        *budget -= num_new;
        out.num_scheduled_tokens += num_new;
        out.chunks.push(chunk);
        self.running.push(id);
        Admit::Next
    }

    /// `need` new blocks for waiting request `id` past its local prefix `hit`, which is
    /// referenced first so that the allocation cannot evict it. `None` when the pool is short:
    /// the hit is let go and `id` goes back to the front of the queue (admission stops for
    /// this step), for a plain admission and an async load alike.
    fn allocate_past_hit(&mut self, id: &str, hit: &[u32], need: u32) -> Option<Vec<u32>> {
        self.pool.touch(hit);
        let blocks = self.pool.allocate(need);
        if blocks.is_none() {
            self.pool.free(hit);
            self.waiting.push_front(id.to_string());
        }
        blocks
    }

    /// Admit waiting request `id` for an async load of its remote KV (`external` tokens past
    /// its local prefix `hit`): blocks for the prompt past the hit, then it waits for the KV
    /// (`skipped`: it keeps its place); the connector loads only the tail not cached here. Only
    /// as many blocks as the remote holds: a request resumed after the token P sampled (D63) is
    /// longer than P's prompt, and the reader pairs its blocks with P's from the end; what lies
    /// past P's blocks is computed here when it runs.
    fn start_async_load(
        &mut self,
        id: String,
        hit: Vec<u32>,
        external: u32,
        out: &mut Schedule,
        skipped: &mut VecDeque<String>,
    ) -> Admit {
        let bs = self.cfg.block_size;
        let hit_tokens = hit.len() as u32 * bs;
        let Some(req) = self.requests.get(&id) else { return Admit::Next };
        let remote_blocks = req
            .kv_transfer_params
            .as_ref()
            .and_then(|p| p.remote_block_ids.as_ref())
            .map_or(u32::MAX, |b| u32::try_from(b.len()).unwrap_or(u32::MAX));
        let need = (req.prompt.len() as u32).div_ceil(bs).min(remote_blocks).saturating_sub(hit.len() as u32);
        // Never count as loaded more tokens than those blocks hold.
        let external = external.min(need * bs);
        let Some(blocks) = self.allocate_past_hit(&id, &hit, need) else { return Admit::Stop };
        let Some(req) = self.requests.get_mut(&id) else { return Admit::Stop };
        if self.pool.caching() {
            self.counters.prefix_cache_queries += u64::from(req.num_tokens());
            self.counters.prefix_cache_hits += u64::from(hit_tokens);
        }
        req.num_cached_tokens.get_or_insert(hit_tokens);
        req.num_cached_blocks = hit.len() as u32;
        req.num_computed_tokens = hit_tokens;
        req.block_ids = hit;
        req.block_ids.extend(blocks.iter().copied());
        req.num_external_tokens = external;
        req.status = RequestStatus::WaitingForRemoteKvs;
        out.alloc_calls.push(ConnectorCall::UpdateStateAfterAlloc {
            request_id: id.clone(),
            block_ids: blocks,
            num_external_tokens: external,
        });
        skipped.push_back(id);
        Admit::Next
    }

    /// Give each scheduled request its next block early where one is free (see
    /// [`Self::reserve_next_block`]), only while more blocks are free than requests run, so that
    /// one given early is never one another running request needs for its next step.
    fn reserve_next_blocks(&mut self, out: &mut Schedule) {
        for chunk in &mut out.chunks {
            if self.pool.num_free() <= self.running.len() as u32 {
                break;
            }
            if let Some(req) = self.requests.get_mut(&chunk.request_id) {
                if let Some(block) = Self::reserve_next_block(&mut self.pool, &self.cfg, req, chunk) {
                    chunk.block_ids.push(block);
                }
            }
        }
    }

    /// Requests whose remote KV arrived go to the head of the waiting queue, in queue order.
    /// They already own every block of their prompt, so they need at most one more block, and
    /// running them to completion is what gives blocks back. Left behind a request that cannot
    /// get blocks (one that preempted itself and now needs more than is free), they would hold
    /// the very blocks it waits for, and nothing would ever run again (found by the lifecycle
    /// property test; docs/DECISIONS.md D24).
    fn hoist_loaded_requests(&mut self) {
        if self.finished_recving.is_empty() {
            return;
        }
        let (requests, finished) = (&self.requests, &self.finished_recving);
        let loaded = |id: &String| {
            finished.contains(id) && requests.get(id).is_some_and(|r| r.status == RequestStatus::WaitingForRemoteKvs)
        };
        let (mut front, rest): (VecDeque<String>, VecDeque<String>) = self.waiting.drain(..).partition(loaded);
        front.extend(rest);
        self.waiting = front;
    }

    /// D78: where `chunk` samples and its request goes on after it, allocate now the block
    /// the request's next position lands in if it has none yet, and return it. The worker runs
    /// the next decode step ahead only when every row's next position has a block (it cannot
    /// choose one itself), so without this every block boundary — at 8 streams and 16-token
    /// blocks ~40 % of the steps, at 64 nearly all — stepped in turn. It moves an allocation
    /// one step earlier, nothing more: best effort (after the step's own allocations and
    /// admissions, and only while more blocks are free than requests run; else the next step
    /// allocates as before),
    /// and not for requests that end here as far as the engine knows (their length, a remote
    /// decoder's prefill) or whose next step cannot run ahead anyway (structured outputs). The
    /// block is the request's like any other: freed with it, cached only once full, and not
    /// among the blocks the connector was told of at allocation (those are the prompt's).
    fn reserve_next_block(
        pool: &mut BlockPool,
        cfg: &SchedulerConfig,
        req: &mut Request,
        chunk: &ScheduledChunk,
    ) -> Option<u32> {
        let end = chunk.start_pos.saturating_add(chunk.token_ids.len() as u32);
        let goes_on = chunk.sample
            && (req.output.len() as u32).saturating_add(1) < req.sampling.max_tokens
            && end.saturating_add(1) < cfg.max_model_len
            && req.sampling.guided.is_none()
            && !req.kv_transfer_params.as_ref().is_some_and(|p| p.wants_remote_decode());
        // The next step writes position `end`: it needs `end + 1` slots.
        if !goes_on || (end + 1).div_ceil(cfg.block_size) as usize <= req.block_ids.len() {
            return None;
        }
        let block = pool.allocate(1)?.first().copied()?;
        req.block_ids.push(block);
        Some(block)
    }

    fn chunk_for(req: &Request, num_new: u32) -> ScheduledChunk {
        let start = req.num_computed_tokens;
        let sample = start + num_new == req.num_tokens();
        ScheduledChunk {
            request_id: req.id.clone(),
            token_ids: req.tokens(start, start + num_new),
            start_pos: start,
            block_ids: req.block_ids.clone(),
            sample,
            sampling: req.sampling.clone(),
            output_index: req.output.len() as u32,
            // the grammar matcher's input (D53): only where it will mask a sample
            guided_output: if sample && req.sampling.guided.is_some() { req.output.clone() } else { Vec::new() },
            history: (sample && req.sampling.needs_history()).then(|| req.sampling_history()),
        }
    }

    /// Preempt (recompute): free the blocks and requeue at the head of the waiting queue.
    fn preempt(&mut self, id: &str) {
        self.running.retain(|r| r != id);
        if let Some(req) = self.requests.get_mut(id) {
            let blocks = std::mem::take(&mut req.block_ids);
            req.num_computed_tokens = 0;
            req.num_cached_blocks = 0;
            req.num_preemptions += 1;
            req.status = RequestStatus::Preempted;
            req.connector_match = Some(ConnectorMatch { external_tokens: 0, load_async: false });
            self.pool.free(&blocks);
            self.counters.preemptions += 1;
            self.waiting.push_front(id.to_string());
        }
    }

    /// Apply the worker's sampled tokens for the chunks of the step it ran.
    pub fn update_from_output(&mut self, scheduled: &[ScheduledChunk], output: &ModelRunnerOutput) {
        for chunk in scheduled {
            match self.requests.get_mut(&chunk.request_id) {
                Some(req) if !req.status.is_finished() => {
                    req.num_computed_tokens = chunk.start_pos + chunk.token_ids.len() as u32;
                    Self::cache_full_blocks(&mut self.pool, &self.root, self.cfg.block_size, req);
                }
                _ => {}
            }
        }
        for s in &output.sampled {
            let Some(req) = self.requests.get_mut(&s.request_id) else {
                self.counters.unknown_ids += 1;
                continue;
            };
            if req.status.is_finished() {
                self.counters.unknown_ids += 1;
                continue;
            }
            req.output.push(s.token_id);
            if let Some(lp) = &s.logprobs {
                req.output_logprobs.push(lp.clone());
            }
            let is_eos = !req.sampling.ignore_eos && req.eos_token_ids.contains(&s.token_id);
            // before `min_tokens` no stop id ends the request (vLLM's check); the sampler holds
            // them back, so this only matters for a peer's sampler that did not
            let generated = (req.output.len() as u32).saturating_add(req.sampling.output_index_offset);
            let may_stop = generated >= req.sampling.min_tokens;
            let stop = if may_stop && (is_eos || req.sampling.stop_token_ids.contains(&s.token_id)) {
                req.stop_token_id = Some(s.token_id);
                Some(RequestStatus::FinishedStopped)
            } else if req.output.len() as u32 >= req.sampling.max_tokens || req.num_tokens() >= self.cfg.max_model_len {
                Some(RequestStatus::FinishedLengthCapped)
            } else {
                None
            };
            match stop {
                Some(status) => {
                    let id = req.id.clone();
                    self.finish(&id, status);
                }
                None => {
                    let out = Self::take_new_output(req);
                    self.outputs.push(out);
                }
            }
        }
    }

    /// Register in the prefix cache every full block of `req` whose KV is computed (the step
    /// that wrote it has run), so later requests with the same prefix can share it.
    fn cache_full_blocks(pool: &mut BlockPool, root: &BlockHash, bs: u32, req: &mut Request) {
        if !pool.caching() {
            return;
        }
        let full = req.num_computed_tokens / bs;
        while req.num_cached_blocks < full {
            let i = req.num_cached_blocks as usize;
            if req.block_hashes.len() <= i {
                let parent = req.block_hashes.last().copied().unwrap_or(*root);
                let tokens = req.tokens(i as u32 * bs, (i as u32 + 1) * bs);
                req.block_hashes.push(block_hash(&parent, &tokens));
            }
            if let (Some(&b), Some(&h)) = (req.block_ids.get(i), req.block_hashes.get(i)) {
                pool.cache(b, h);
            }
            req.num_cached_blocks += 1;
        }
    }

    fn take_new_output(req: &mut Request) -> EngineOutput {
        let new_tokens = req.output.get(req.emitted..).map(<[u32]>::to_vec).unwrap_or_default();
        let new_logprobs = req.output_logprobs.get(req.emitted..).map(<[_]>::to_vec).filter(|v| !v.is_empty());
        req.emitted = req.output.len();
        EngineOutput {
            request_id: req.id.clone(),
            new_token_ids: new_tokens,
            new_logprobs,
            finish_reason: None,
            stop_token_id: None,
            kv_transfer_params: None,
            num_external_tokens: req.num_external_tokens,
            num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
            error: None,
        }
    }

    /// The `request_finished` calls owed for requests that finished since the last call.
    /// Each request appears here exactly once in its life.
    pub fn finishing_calls(&mut self) -> Vec<ConnectorCall> {
        let ids = std::mem::take(&mut self.finishing);
        let mut calls = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(req) = self.requests.get(&id) {
                self.counters.request_finished_calls += 1;
                calls.push(ConnectorCall::RequestFinished {
                    request_id: id.clone(),
                    status: req.status.finished_status().unwrap_or(pdmesh_protocol::FinishedStatus::Aborted),
                    block_ids: req.block_ids.clone(),
                    kv_transfer_params: req.kv_transfer_params.clone(),
                    block_generations: req.block_ids.iter().map(|&b| self.pool.generation(b).unwrap_or(0)).collect(),
                });
            }
        }
        calls
    }

    /// Apply the connector's answer to `request_finished`: free the blocks now, or hold them
    /// for a remote reader until `finished_sending`. Emits the request's final output.
    pub fn apply_finished(&mut self, id: &str, delay_free: bool, params: Option<KvTransferParams>) {
        let Some(mut req) = self.requests.remove(id) else {
            self.counters.unknown_ids += 1;
            return;
        };
        let mut out = Self::take_new_output(&mut req);
        out.finish_reason = req.status.finish_reason();
        out.stop_token_id = req.stop_token_id;
        let out_capability = params.as_ref().and_then(|p| p.remote_capability.clone());
        out.kv_transfer_params = params;
        out.error = req.error.clone();
        self.outputs.push(out);
        let blocks = std::mem::take(&mut req.block_ids);
        if self.free_on_recv.contains_key(id) {
            // Blocks already parked until the receive settles; keep the request record there.
            return;
        }
        let aborted = self.abort_when_held.remove(id);
        if delay_free && !blocks.is_empty() {
            let since = req.finished_at.unwrap_or_else(Instant::now);
            let capability = out_capability.unwrap_or_default();
            self.held.insert(id.to_string(), Held { blocks, since, capability });
            if aborted {
                self.aborted_held.push(id.to_string());
            }
        } else {
            self.abort_after_finish_sent.remove(id);
            self.pool.free(&blocks);
        }
    }

    /// Apply the worker's connector output.
    pub fn update_from_kv_output(&mut self, kv: &KvConnectorOutput) {
        self.leased = kv.leased_request_ids.iter().cloned().collect();
        if !kv.invalid_block_ids.is_empty() {
            self.handle_invalid_blocks(kv);
        }
        for id in &kv.finished_sending {
            match self.held.remove(id) {
                Some(h) => {
                    self.abort_after_finish_sent.remove(id);
                    self.pool.free(&h.blocks);
                }
                None => {
                    self.counters.unknown_ids += 1;
                    tracing::warn!(request_id = %id, "finished_sending for a request that holds no blocks");
                }
            }
        }
        for id in &kv.finished_recving {
            if let Some(blocks) = self.free_on_recv.remove(id) {
                self.pool.free(&blocks);
                continue;
            }
            if self.requests.get(id).is_some_and(|r| r.status == RequestStatus::FinishedError) {
                continue; // failed by policy just above; freed with its request_finished
            }
            match self.requests.get(id) {
                Some(req) if req.status == RequestStatus::WaitingForRemoteKvs => {
                    self.finished_recving.insert(id.clone());
                }
                _ => {
                    self.counters.unknown_ids += 1;
                    tracing::warn!(request_id = %id, "finished_recving for a request not waiting for KV");
                }
            }
        }
    }

    /// A load failed: its request is in `finished_recving` together with its local blocks in
    /// `invalid_block_ids` (same output). Apply `kv_load_failure_policy`.
    fn handle_invalid_blocks(&mut self, kv: &KvConnectorOutput) {
        let invalid: HashSet<u32> = kv.invalid_block_ids.iter().copied().collect();
        let bs = self.cfg.block_size;
        let mut to_fail = Vec::new();
        for id in &kv.finished_recving {
            let Some(req) = self.requests.get_mut(id) else { continue };
            if req.status != RequestStatus::WaitingForRemoteKvs {
                continue;
            }
            let Some(first_bad) = req.block_ids.iter().position(|b| invalid.contains(b)) else { continue };
            if self.recompute_load_failures {
                // Tokens from the first invalid block on count as not computed.
                // Blocks before the local prefix hit were never read, so never invalid.
                let valid =
                    req.num_external_tokens.min((first_bad as u32 * bs).saturating_sub(req.num_computed_tokens));
                self.counters.kv_loads_recomputed += 1;
                self.counters.recomputed_tokens += u64::from(req.num_external_tokens - valid);
                req.num_external_tokens = valid;
                tracing::warn!(request_id = %id, valid_tokens = req.num_external_tokens, "KV load failed; recomputing locally");
            } else {
                to_fail.push(id.clone());
            }
        }
        for id in to_fail {
            self.counters.kv_loads_failed_by_policy += 1;
            // The receive has settled, so the blocks can be freed with the request.
            self.finished_recving.insert(id.clone());
            if let Some(req) = self.requests.get_mut(&id) {
                req.error = Some("kv load failed (kv_load_failure_policy = fail)".into());
            }
            self.finish(&id, RequestStatus::FinishedError);
            tracing::warn!(request_id = %id, "KV load failed; request failed by policy");
        }
    }

    /// Whether the connector holds this finished request's blocks for a remote reader.
    pub fn holds(&self, id: &str) -> bool {
        self.held.contains_key(id)
    }

    /// Whether the connector holds this request's blocks under `capability` (compared in
    /// constant time): a release from outside the engine needs the token, not just the id.
    pub fn holds_with_capability(&self, id: &str, capability: &str) -> bool {
        self.held.get(id).is_some_and(|h| pdmesh_mesh_auth::capability_matches(&h.capability, capability))
    }

    /// Keep only what the worker may do with blocks held for a request: register a hold
    /// (`reqs_to_send`) or save them to the offload store (`offload.saves`, with their
    /// `extra_async_saves`) for a request this engine holds, on blocks it holds for it. The
    /// connector-scheduler queues both when `request_finished` answers, and the next step's
    /// metadata carries them; a worker restart in between frees the request's blocks here
    /// ([`Scheduler::worker_restarted`]) while the connector, another process, still has them
    /// queued. Passed on, the new worker would lend D blocks that the next request overwrites,
    /// or stamp its empty KV into the store as the old request's content, for a later prefix
    /// hit to load. Returns how many were dropped (counted).
    pub fn retain_held_metadata(&mut self, meta: &mut KvConnectorMetadata) -> usize {
        let before = meta.reqs_to_send.len() + meta.offload.saves.len() + meta.extra_async_saves.len();
        let held = &self.held;
        meta.reqs_to_send.retain(|s| held.get(&s.request_id).is_some_and(|h| h.blocks == s.block_ids));
        meta.offload
            .saves
            .retain(|t| held.get(&t.request_id).is_some_and(|h| t.block_ids.iter().all(|b| h.blocks.contains(b))));
        meta.extra_async_saves.retain(|id, _| held.contains_key(id));
        let after = meta.reqs_to_send.len() + meta.offload.saves.len() + meta.extra_async_saves.len();
        let dropped = before - after;
        self.counters.stale_sends_dropped += dropped as u64;
        dropped
    }

    /// Held requests aborted after finish since the last call: the connector-worker's hold
    /// table decides when their blocks can go (at once, or when the active lease ends).
    pub fn take_aborted_held(&mut self) -> Vec<String> {
        std::mem::take(&mut self.aborted_held)
    }

    /// Outputs ready for the clients.
    pub fn take_outputs(&mut self) -> Vec<EngineOutput> {
        std::mem::take(&mut self.outputs)
    }

    /// Whether the engine loop must keep ticking: live requests, owed connector calls, or
    /// blocks held or parked for the connector (whose release arrives through steps).
    pub fn has_requests(&self) -> bool {
        !self.waiting.is_empty()
            || !self.running.is_empty()
            || !self.finishing.is_empty()
            || !self.held.is_empty()
            || !self.free_on_recv.is_empty()
    }

    /// The requests waiting or running: the ones a client still waits for (finished ones,
    /// and blocks held for a remote reader, are not among them).
    pub fn live_request_ids(&self) -> Vec<String> {
        self.waiting.iter().chain(self.running.iter()).cloned().collect()
    }

    /// Whether there is compute to do (as opposed to only connector work).
    pub fn has_unfinished_requests(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn num_waiting(&self) -> u32 {
        self.waiting.len() as u32
    }

    pub fn num_running(&self) -> u32 {
        self.running.len() as u32
    }

    pub fn kv_usage(&self) -> KvUsage {
        // Distinct blocks: a cached prefix may be held for several readers at once.
        let held = self
            .held
            .values()
            .flat_map(|h| h.blocks.iter())
            .chain(self.free_on_recv.values().flatten())
            .collect::<HashSet<_>>()
            .len();
        let total = self.pool.num_blocks();
        let free = self.pool.num_free();
        KvUsage {
            total_blocks: total,
            free_blocks: free,
            used_blocks: total.saturating_sub(free).saturating_sub(held as u32),
            held_blocks: held as u32,
            cached_blocks: self.pool.num_cached(),
            leased_blocks: self
                .leased
                .iter()
                .filter_map(|id| self.held.get(id))
                .flat_map(|h| h.blocks.iter())
                .collect::<HashSet<_>>()
                .len() as u32,
        }
    }

    /// Requests whose blocks the connector holds, with their age.
    pub fn held_requests(&self) -> Vec<HeldRequest> {
        let now = Instant::now();
        let mut v: Vec<HeldRequest> = self
            .held
            .iter()
            .map(|(id, h)| HeldRequest {
                request_id: id.clone(),
                blocks: h.blocks.len() as u32,
                age_s: now.duration_since(h.since).as_secs_f64(),
                state: if self.leased.contains(id) { "leased" } else { "held" }.into(),
            })
            .chain(self.free_on_recv.iter().map(|(id, b)| HeldRequest {
                request_id: id.clone(),
                blocks: b.len() as u32,
                age_s: 0.0,
                state: "aborted_while_receiving".into(),
            }))
            .collect();
        v.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        v
    }

    pub fn stats(&self, engine_rank: u32) -> EngineStats {
        EngineStats {
            engine_rank,
            num_waiting: self.num_waiting(),
            num_running: self.num_running(),
            kv: self.kv_usage(),
            held_requests: self.held_requests(),
            steps: self.counters.steps,
            finished_requests: self.counters.finished_requests,
            request_finished_calls: self.counters.request_finished_calls,
            unknown_ids: self.counters.unknown_ids,
            preemptions: self.counters.preemptions,
            prefix: self.prefix_summary(),
        }
    }

    /// What this rank's prefix cache holds, for routing (D59); `None` with caching off.
    fn prefix_summary(&self) -> Option<pdmesh_protocol::PrefixSummary> {
        self.pool.caching().then(|| pdmesh_protocol::PrefixSummary {
            block_size: self.cfg.block_size,
            root: self.root.to_vec(),
            blocks: self.pool.cached_keys(pdmesh_protocol::prefix::MAX_PUBLISHED_BLOCKS),
        })
    }

    /// Blocks the pool refused to free twice (must stay 0; asserted in tests).
    pub fn double_frees(&self) -> u64 {
        self.pool.double_frees()
    }

    /// Whether `block` is allocated (to a request, held, or parked), and its generation (bumped
    /// on every free). Lets tests check from outside that a block handed to a reader was neither
    /// freed nor reused while the reader could still read or write it (R2, R5).
    pub fn block_state(&self, block: u32) -> (bool, Option<u64>) {
        (self.pool.is_allocated(block), self.pool.generation(block))
    }

    /// Ids of the requests in a chunk list (for failing a step).
    pub fn ids_of(chunks: &[ScheduledChunk]) -> Vec<String> {
        chunks.iter().map(|c| c.request_id.clone()).collect()
    }
}
