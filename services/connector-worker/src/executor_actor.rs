//! The executor thread: owns the KV cache and the model.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use pdmesh_model_api::{Executor, ExecutorError, KvCache};
use pdmesh_protocol::{
    KvConnectorOutput, ModelRunnerOutput, OffloadMetadata, SampledToken, ScheduledChunk, SchedulerOutput,
};

use crate::metrics as m;
use crate::pd::ReceiveView;

/// The executor, handed over to the executor thread once (`SyncArbiter` wants a factory).
pub type ExecutorFactory = Arc<dyn Fn() -> Result<Box<dyn Executor>, String> + Send + Sync>;

/// A factory that hands over one already-built executor (a model is loaded once, before the
/// service binds its socket, so a load error fails start-up with a clear message).
pub fn once(executor: Box<dyn Executor>) -> ExecutorFactory {
    let slot = std::sync::Mutex::new(Some(executor));
    Arc::new(move || match slot.lock() {
        Ok(mut s) => s.take().ok_or_else(|| "executor already taken (executor thread restarted)".to_string()),
        Err(_) => Err("executor slot poisoned".to_string()),
    })
}

/// The product's fault injection for the executor (`model.fault_injection`,
/// `PDMESH_EXECUTOR_FAULT`): drills the worker's handling of failed forward passes on any
/// model, the CPU ones included, without a broken GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecutorFaults {
    /// Every N-th forward pass fails with a model error (the step's requests fail; the worker
    /// serves on).
    pub step_error_every: Option<u64>,
    /// The N-th forward pass and every later one fail as a lost accelerator.
    pub device_lost_at_step: Option<u64>,
    /// Every forward pass takes N more milliseconds (a slow or throttled device): drills
    /// load-aware routing around a slow node (D55).
    pub step_delay_ms: Option<u64>,
    /// `step_delay_ms` applies only while this file exists (checked before every forward
    /// pass): a node that turns slow, and fast again, at a moment a test chooses (a stream
    /// started on a fast node that then slows mid-stream, D104), which no step count can pick
    /// when probes and other requests share the node's passes.
    pub step_delay_while: Option<std::path::PathBuf>,
}

impl ExecutorFaults {
    /// Parse a comma list such as `"step_error_every=5"`; empty means none. A bad item is an
    /// error naming it (the node refuses to start), never a fault silently left out.
    pub fn parse(s: &str) -> Result<Self, String> {
        const KNOWN: &str =
            "known: step_error_every=N, device_lost_at_step=N, step_delay_ms=N, step_delay_while=/absolute/path";
        let mut f = Self::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, value) = item.split_once('=').map_or((item, ""), |(n, v)| (n.trim(), v.trim()));
            if name == "step_delay_while" {
                let path = std::path::Path::new(value);
                if !path.is_absolute() {
                    return Err(format!("{item:?}: expected step_delay_while=PATH with PATH absolute"));
                }
                f.step_delay_while = Some(path.to_path_buf());
                continue;
            }
            let n = value
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{item:?}: expected {name}=N with N a step count of 1 or more"))?;
            match name {
                "step_error_every" => f.step_error_every = Some(n),
                "device_lost_at_step" => f.device_lost_at_step = Some(n),
                "step_delay_ms" => f.step_delay_ms = Some(n),
                other => return Err(format!("unknown executor fault {other:?} ({KNOWN})")),
            }
        }
        if f.step_delay_while.is_some() && f.step_delay_ms.is_none() {
            return Err("step_delay_while needs step_delay_ms=N (the delay it switches on)".into());
        }
        Ok(f)
    }

    /// The delay to add to the next forward pass, if any: `step_delay_ms`, while
    /// `step_delay_while`'s file exists when it names one.
    fn delay(&self) -> Option<std::time::Duration> {
        let ms = self.step_delay_ms?;
        if self.step_delay_while.as_ref().is_some_and(|p| !p.exists()) {
            return None;
        }
        Some(std::time::Duration::from_millis(ms))
    }

    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The injected failure of forward pass number `n` (counted from 1), if any.
    fn failure(&self, n: u64) -> Option<ExecutorError> {
        if self.device_lost_at_step.is_some_and(|at| n >= at) {
            return Some(ExecutorError::DeviceLost(format!("injected fault device_lost_at_step (forward pass {n})")));
        }
        if self.step_error_every.is_some_and(|every| n.is_multiple_of(every)) {
            return Some(ExecutorError::Model(format!("injected fault step_error_every (forward pass {n})")));
        }
        None
    }
}

/// Run one step and answer on `reply`. The answer goes out before the handler returns: with
/// `engine.async_scheduling` the thread goes on at once to the next decode step (D67), while
/// the answer travels to engine-core.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RunStep {
    pub step: SchedulerOutput,
    pub reply: tokio::sync::oneshot::Sender<Result<ModelRunnerOutput, ExecutorError>>,
}

/// Owns the KV cache memory (allocated and touched at start) and the model.
pub struct ExecutorActor {
    executor: Option<Box<dyn Executor>>,
    kv: KvCache,
    load_error: Option<String>,
    faults: ExecutorFaults,
    /// Forward passes run so far (what the faults count).
    forward_passes: u64,
    /// Set once the accelerator is lost: every later step fails with it, unrun.
    lost: Option<String>,
    /// The host-memory offload store, when the node runs the `OffloadConnector`: it lives on
    /// this thread because the copies touch the KV cache the forward pass uses.
    offload: Option<crate::offload::OffloadStore>,
    /// The last forward pass whose results were used: the next pass that runs one of its
    /// requests again observes the idle time between them ([`m::STEP_GAP_SECONDS`]).
    last_pass: Option<LastPass>,
    /// Whether to run each step's next decode step ahead of the engine (D67,
    /// `engine.async_scheduling`; off on offloading nodes and with executor faults).
    speculate: bool,
    /// The next decode step planned by the last step, run once its answer is out.
    planned: Option<Vec<ScheduledChunk>>,
    /// Its results, waiting for the engine's step.
    speculation: Option<Speculation>,
    /// This node's receives (a node that consumes KV): the step run ahead claims the blocks
    /// it writes where they write, and waits while one is pending (D68).
    receives: Option<ReceiveView>,
}

/// When a forward pass ended and which requests it ran.
struct LastPass {
    ended: Instant,
    ids: HashSet<String>,
}

/// A decode step run before the engine asked for it (D67).
struct Speculation {
    chunks: Vec<ScheduledChunk>,
    sampled: Vec<SampledToken>,
    elapsed: std::time::Duration,
    /// The idle time before it, observed only if its results are used.
    gap: Option<std::time::Duration>,
    /// The last used pass before it, restored if it is wasted.
    before: Option<LastPass>,
}

/// Apply a step's offload copies, before that step's [`RunStep`] (the thread handles its
/// messages in order, so the forward pass sees the loaded blocks). Answers the offload
/// child's connector output.
#[derive(Message)]
#[rtype(result = "KvConnectorOutput")]
pub struct ApplyOffload(pub OffloadMetadata);

impl Handler<ApplyOffload> for ExecutorActor {
    type Result = MessageResult<ApplyOffload>;

    fn handle(&mut self, msg: ApplyOffload, _: &mut SyncContext<Self>) -> Self::Result {
        MessageResult(match self.offload.as_mut() {
            Some(store) => store.apply(&mut self.kv, &msg.0),
            None => {
                // Not configured here: settle everything so nothing waits for ever; a load
                // that cannot happen is refused block for block.
                tracing::warn!("offload copies asked of a worker without an offload store");
                KvConnectorOutput {
                    finished_sending: msg.0.saves.iter().map(|t| t.request_id.clone()).collect(),
                    finished_recving: msg.0.loads.iter().map(|t| t.request_id.clone()).collect(),
                    invalid_block_ids: msg.0.loads.iter().flat_map(|t| t.block_ids.iter().copied()).collect(),
                    ..Default::default()
                }
            }
        })
    }
}

impl Actor for ExecutorActor {
    type Context = SyncContext<Self>;
}

impl Handler<RunStep> for ExecutorActor {
    type Result = ();

    fn handle(&mut self, msg: RunStep, _: &mut SyncContext<Self>) {
        let result = self.run_step(msg.step);
        // The engine may be gone (restarting): the step ran all the same.
        let _ = msg.reply.send(result);
        if let Some(next) = self.planned.take() {
            self.speculate(next);
        }
    }
}

impl ExecutorActor {
    fn run_step(&mut self, step: SchedulerOutput) -> Result<ModelRunnerOutput, ExecutorError> {
        // A speculation serves only the step right after the one it continues: later steps
        // may have changed the KV it read.
        let speculation = self.speculation.take();
        self.planned = None;
        let Some(executor) = self.executor.as_mut() else {
            return Err(self.not_loaded());
        };
        if !step.finished_request_ids.is_empty() {
            executor.release(&step.finished_request_ids);
        }
        if let (false, Some(why)) = (step.chunks.is_empty(), &self.lost) {
            return Err(ExecutorError::DeviceLost(why.clone()));
        }
        let (ready, ahead) = match speculation {
            Some(spec) => self.rows_from_speculation(spec, &step.chunks),
            None => (vec![None; step.chunks.len()], std::time::Duration::ZERO),
        };
        let rest: Vec<ScheduledChunk> =
            step.chunks.iter().zip(&ready).filter(|(_, r)| r.is_none()).map(|(c, _)| c.clone()).collect();
        let started = Instant::now();
        let computed = if rest.is_empty() { Vec::new() } else { self.forward(&rest, step.step_id, started)? };
        let elapsed = started.elapsed() + ahead;
        m::EXECUTE_SECONDS.observe(elapsed.as_secs_f64());
        let sampled = merge_rows(&step.chunks, ready, computed);
        if !step.chunks.is_empty() {
            self.pass_done(&step.chunks, &sampled, rest.is_empty());
        }
        m::TOKENS_COMPUTED.inc_by(step.chunks.iter().map(|c| c.token_ids.len() as u64).sum());
        Ok(ModelRunnerOutput {
            step_id: step.step_id,
            sampled,
            kv_connector_output: Default::default(),
            execute_us: elapsed.as_micros() as u64,
            failure: None,
        })
    }

    /// What a step gets when the model did not load.
    fn not_loaded(&self) -> ExecutorError {
        ExecutorError::Model(format!("model not loaded: {}", self.load_error.clone().unwrap_or_default()))
    }

    /// The rows the speculation `spec` computed exactly as `chunks` asks for them (same
    /// request, token, position, blocks and sampling), one slot per chunk: their results stand
    /// as they are, since a row's result does not depend on the batch it ran in. Also the
    /// time the speculation ran, when any row of it is used (it counts into the step's).
    fn rows_from_speculation(
        &mut self,
        spec: Speculation,
        chunks: &[ScheduledChunk],
    ) -> (Vec<Option<SampledToken>>, std::time::Duration) {
        let block_size = self.kv.spec().block_size;
        let mut ready: Vec<Option<SampledToken>> = vec![None; chunks.len()];
        let mut results: HashMap<String, SampledToken> =
            spec.sampled.into_iter().map(|t| (t.request_id.clone(), t)).collect();
        let ran: HashMap<&str, &ScheduledChunk> = spec.chunks.iter().map(|c| (c.request_id.as_str(), c)).collect();
        for (slot, chunk) in ready.iter_mut().zip(chunks) {
            if ran.get(chunk.request_id.as_str()).is_some_and(|r| computes_the_same(r, chunk, block_size)) {
                *slot = results.remove(&chunk.request_id);
            }
        }
        let used = ready.iter().flatten().count();
        m::SPECULATIVE_ROWS.with_label_values(&["used"]).inc_by(used as u64);
        m::SPECULATIVE_ROWS.with_label_values(&["discarded"]).inc_by((spec.chunks.len() - used) as u64);
        if used == 0 {
            // Wasted: the idle time before the next pass counts from the pass before it.
            self.last_pass = spec.before;
            return (ready, std::time::Duration::ZERO);
        }
        if let Some(gap) = spec.gap {
            m::STEP_GAP_SECONDS.observe(gap.as_secs_f64());
        }
        (ready, spec.elapsed)
    }

    /// One forward pass over `rest`, started at `started`, under the configured faults; a
    /// lost accelerator is remembered, so later steps fail at once.
    fn forward(
        &mut self,
        rest: &[ScheduledChunk],
        step_id: u64,
        started: Instant,
    ) -> Result<Vec<SampledToken>, ExecutorError> {
        if let Some(gap) = gap_before(&self.last_pass, rest, started) {
            m::STEP_GAP_SECONDS.observe(gap.as_secs_f64());
        }
        self.forward_passes += 1;
        m::FORWARD_PASSES.inc();
        if let Some(delay) = self.faults.delay() {
            std::thread::sleep(delay);
        }
        let result = match (self.faults.failure(self.forward_passes), self.executor.as_mut()) {
            (Some(injected), _) => Err(injected),
            (None, Some(executor)) => executor.execute(&mut self.kv, rest),
            (None, None) => Err(self.not_loaded()),
        };
        result.map_err(|e| {
            m::EXECUTE_ERRORS.inc();
            tracing::error!(error = %e, step_id, "step failed");
            if let ExecutorError::DeviceLost(why) = &e {
                self.lost = Some(why.clone());
            }
            e
        })
    }

    /// After a step with rows: remember its pass (when it ran one, `reused_only` false, it
    /// ended now) and, when steps run ahead, plan the next decode step of its requests.
    fn pass_done(&mut self, chunks: &[ScheduledChunk], sampled: &[SampledToken], reused_only: bool) {
        let ended = match (&self.last_pass, reused_only) {
            (Some(p), true) => p.ended,
            _ => Instant::now(),
        };
        self.last_pass = Some(LastPass { ended, ids: chunks.iter().map(|c| c.request_id.clone()).collect() });
        if self.speculate {
            let next = next_decode_step(chunks, sampled, self.kv.spec().block_size);
            if !next.is_empty() {
                // Run once this answer is out, ahead of any step the engine sends later.
                self.planned = Some(next);
            }
        }
    }
}

/// The step's tokens in chunk order: each chunk's row from the speculation (`ready`) or, where
/// it has none, from this step's pass (`computed`).
fn merge_rows(
    chunks: &[ScheduledChunk],
    ready: Vec<Option<SampledToken>>,
    mut computed: Vec<SampledToken>,
) -> Vec<SampledToken> {
    if ready.iter().all(Option::is_none) {
        return computed;
    }
    let mut by_id: HashMap<String, SampledToken> = computed.drain(..).map(|t| (t.request_id.clone(), t)).collect();
    chunks.iter().zip(ready).filter_map(|(c, r)| r.or_else(|| by_id.remove(&c.request_id))).collect()
}

/// The executor's idle time before a pass starting at `at`, when the pass continues a request
/// of `last`, the last pass whose results were used (a decode chain, not a pause between
/// bursts).
fn gap_before(last: &Option<LastPass>, chunks: &[ScheduledChunk], at: Instant) -> Option<std::time::Duration> {
    let last = last.as_ref()?;
    chunks.iter().any(|c| last.ids.contains(&c.request_id)).then(|| at.duration_since(last.ended))
}

impl ExecutorActor {
    /// Run the next decode step ahead (D67): the requests of the step just answered go on
    /// while that answer travels to engine-core and the engine schedules.
    fn speculate(&mut self, mut chunks: Vec<ScheduledChunk>) {
        let Some(executor) = self.executor.as_mut() else { return };
        if self.lost.is_some() {
            return;
        }
        if let Some(view) = &self.receives {
            if view.pending.load(Ordering::Acquire) > 0 {
                // A receive is under way: its request joins the next step, which then needs
                // one pass for all its rows rather than this one plus another for the newcomer.
                m::SPECULATIVE_ROWS.with_label_values(&["skipped"]).inc_by(chunks.len() as u64);
                return;
            }
        }
        // On a node that receives KV, a block this step writes may since have been freed and
        // given to a request whose receive writes it now: claim each row's block first, leave
        // out the rows whose block a receive holds, and make receives wait for the rest.
        let block_size = self.kv.spec().block_size.max(1);
        let claim = self.receives.as_ref().map(|view| {
            let writes: Vec<u32> = chunks.iter().filter_map(|c| written_block(c, block_size)).collect();
            view.writer.claim_step_writes(&writes)
        });
        if let Some(claim) = &claim {
            let before = chunks.len();
            chunks.retain(|c| written_block(c, block_size).is_some_and(|b| claim.holds(b)));
            if chunks.len() < before {
                m::SPECULATIVE_ROWS.with_label_values(&["skipped"]).inc_by((before - chunks.len()) as u64);
            }
        }
        if chunks.is_empty() {
            return;
        }
        let started = Instant::now();
        let gap = gap_before(&self.last_pass, &chunks, started);
        m::FORWARD_PASSES.inc();
        let result = executor.execute(&mut self.kv, &chunks);
        // The pass wrote its blocks: receives waiting for them go on.
        drop(claim);
        match result {
            Ok(sampled) => {
                let ended = Instant::now();
                let ids = chunks.iter().map(|c| c.request_id.clone()).collect();
                let before = self.last_pass.replace(LastPass { ended, ids });
                self.speculation = Some(Speculation { chunks, sampled, elapsed: ended - started, gap, before });
            }
            Err(e) => {
                // Nothing was promised: the engine's step computes these rows itself.
                m::SPECULATIVE_ROWS.with_label_values(&["discarded"]).inc_by(chunks.len() as u64);
                tracing::debug!(error = %e, "decode step run ahead failed");
                if let ExecutorError::DeviceLost(why) = &e {
                    self.lost = Some(why.clone());
                }
            }
        }
    }
}

/// Whether the row run ahead, `ran`, computed what the engine's chunk `asked` asks for: every
/// field equal, except that the block tables need only agree on the blocks the chunk reads and
/// writes. The engine gives a request the block of its next position a step early (D78), so
/// its chunk may carry one block more than the row planned from the step before; a row's
/// result does not depend on blocks past its position.
fn computes_the_same(ran: &ScheduledChunk, asked: &ScheduledChunk, block_size: u32) -> bool {
    // Destructured whole, so a field added to the chunk has to be placed here.
    let ScheduledChunk {
        request_id,
        token_ids,
        start_pos,
        block_ids,
        sample,
        sampling,
        output_index,
        guided_output,
        history,
    } = asked;
    let touched = (u64::from(*start_pos) + token_ids.len() as u64).div_ceil(u64::from(block_size.max(1)));
    let touched = usize::try_from(touched).unwrap_or(usize::MAX);
    ran.request_id == *request_id
        && ran.token_ids == *token_ids
        && ran.start_pos == *start_pos
        && ran.sample == *sample
        && ran.sampling == *sampling
        && ran.output_index == *output_index
        && ran.guided_output == *guided_output
        && ran.history == *history
        && ran.block_ids.get(..touched).is_some_and(|b| Some(b) == block_ids.get(..touched))
}

/// The block a one-token decode chunk writes its KV into.
fn written_block(chunk: &ScheduledChunk, block_size: u32) -> Option<u32> {
    chunk.block_ids.get((chunk.start_pos / block_size) as usize).copied()
}

/// The decode step that follows `chunks` if every request in it goes on: each sampling chunk
/// continues with the token it sampled, at the next position, in the blocks it already has.
/// Requests that stop here (their length, or a stop token) are left out. Empty when a request
/// goes on in a way that cannot be run ahead: a prefill continuing in its next chunk, a
/// structured output (the grammar matcher would advance), a next position that needs a new
/// block (the engine chooses it; since D78 it gives it a step early where it has a free one,
/// so this is left for a full pool). The engine's next step would then hold a row the step run
/// ahead lacks, and one pass for all of them costs less than two: a pass's fixed cost (the
/// weights read once) outweighs a few rows.
fn next_decode_step(chunks: &[ScheduledChunk], sampled: &[SampledToken], block_size: u32) -> Vec<ScheduledChunk> {
    let tokens: HashMap<&str, u32> = sampled.iter().map(|t| (t.request_id.as_str(), t.token_id)).collect();
    let mut next = Vec::with_capacity(chunks.len());
    for c in chunks {
        let Some(&token) = tokens.get(c.request_id.as_str()).filter(|_| c.sample) else {
            return Vec::new();
        };
        let (Some(pos), Some(generated)) =
            (c.start_pos.checked_add(c.token_ids.len() as u32), c.output_index.checked_add(1))
        else {
            return Vec::new();
        };
        if generated >= c.sampling.max_tokens || c.sampling.stop_token_ids.contains(&token) {
            continue;
        }
        let fits = u64::from(pos) < c.block_ids.len() as u64 * u64::from(block_size);
        if c.sampling.guided.is_some() || !c.guided_output.is_empty() || !fits {
            return Vec::new();
        }
        next.push(ScheduledChunk {
            request_id: c.request_id.clone(),
            token_ids: vec![token],
            start_pos: pos,
            block_ids: c.block_ids.clone(),
            sample: true,
            sampling: c.sampling.clone(),
            output_index: generated,
            guided_output: Vec::new(),
            // the engine's next chunk carries the history with this token appended
            history: c.history.clone().map(|mut h| {
                h.output_token_ids.push(token);
                h
            }),
        });
    }
    next
}

/// Start the executor thread over `kv` (heap, or shared memory for P/D), with the offload
/// store `offload` if the node offloads; `speculate` runs each step's next decode step ahead
/// (D67: without faults, which count forward passes; on a node that receives KV, `receives`
/// is where those writes land, and the step run ahead claims its blocks there, D68).
pub fn start(
    factory: ExecutorFactory,
    kv: KvCache,
    faults: ExecutorFaults,
    offload: Option<crate::offload::OffloadStore>,
    speculate: bool,
    receives: Option<ReceiveView>,
) -> Addr<ExecutorActor> {
    let spec = *kv.spec();
    let slot = std::sync::Mutex::new(Some(kv));
    let offload_slot = std::sync::Mutex::new(offload);
    SyncArbiter::start(1, move || {
        let kv = slot.lock().ok().and_then(|mut s| s.take()).unwrap_or_else(|| KvCache::new_heap(spec));
        let (executor, load_error) = match factory() {
            Ok(e) => (Some(e), None),
            Err(e) => {
                tracing::error!(error = %e, "model failed to load");
                (None, Some(e))
            }
        };
        let offload = offload_slot.lock().ok().and_then(|mut s| s.take());
        ExecutorActor {
            executor,
            kv,
            load_error,
            faults: faults.clone(),
            forward_passes: 0,
            lost: None,
            offload,
            last_pass: None,
            speculate,
            planned: None,
            speculation: None,
            receives: receives.clone(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(id: &str, tokens: &[u32], start_pos: u32, blocks: &[u32], output_index: u32) -> ScheduledChunk {
        ScheduledChunk {
            request_id: id.into(),
            token_ids: tokens.to_vec(),
            start_pos,
            block_ids: blocks.to_vec(),
            sample: true,
            sampling: pdmesh_protocol::SamplingParams { max_tokens: 10, ..Default::default() },
            output_index,
            guided_output: Vec::new(),
            history: None,
        }
    }

    fn token(id: &str, token_id: u32) -> SampledToken {
        SampledToken { request_id: id.into(), token_id, logprobs: None }
    }

    #[test]
    fn the_step_run_ahead_continues_each_request_that_goes_on_or_none() {
        let mut stops = chunk("stops", &[5], 3, &[8], 1);
        stops.sampling.stop_token_ids = vec![99];
        let chunks = vec![
            chunk("prefilled", &[1, 2, 3], 0, &[1], 0), // last prefill chunk: decode at 3
            chunk("decoding", &[42], 5, &[2, 3], 2),
            chunk("full-block", &[42], 2, &[4], 2), // position 3 is the last slot of block 4
            chunk("last-token", &[42], 5, &[6], 9), // its 10th token: length cap reached
            stops,
        ];
        let sampled: Vec<SampledToken> = ["prefilled", "decoding", "full-block", "last-token"]
            .iter()
            .enumerate()
            .map(|(i, id)| token(id, 100 + i as u32))
            .chain([token("stops", 99)])
            .collect();
        let next = next_decode_step(&chunks, &sampled, 4);
        let got: Vec<(&str, Vec<u32>, u32, u32)> =
            next.iter().map(|c| (c.request_id.as_str(), c.token_ids.clone(), c.start_pos, c.output_index)).collect();
        assert_eq!(
            got,
            vec![("prefilled", vec![100], 3, 1), ("decoding", vec![101], 6, 3), ("full-block", vec![102], 3, 3)]
        );
        // The engine's next chunk for the same request is equal to it, field for field.
        assert_eq!(
            next[1],
            ScheduledChunk { token_ids: vec![101], start_pos: 6, output_index: 3, ..chunks[1].clone() }
        );

        // A request with penalties runs ahead too: its history gains the token it sampled,
        // as the engine's next chunk's does.
        let mut penalised = chunk("penalised", &[42], 5, &[2, 3], 2);
        penalised.sampling.frequency_penalty = 0.5;
        penalised.history =
            Some(pdmesh_protocol::SamplingHistory { output_token_ids: vec![7, 42], ..Default::default() });
        let next = next_decode_step(std::slice::from_ref(&penalised), &[token("penalised", 9)], 4);
        assert_eq!(next.len(), 1);
        assert_eq!(next[0].history.as_ref().map(|h| h.output_token_ids.clone()), Some(vec![7, 42, 9]));

        // One request that goes on in a way the worker cannot plan, and nothing is run ahead:
        // the engine's step would need a second pass for it anyway.
        let mut guided = chunk("guided", &[5], 3, &[7], 1);
        guided.sampling.guided = Some(pdmesh_protocol::GuidedSpec::JsonObject);
        let mut prefill_part = chunk("prefill-part", &[1, 2, 3, 4], 0, &[9], 0);
        prefill_part.sample = false;
        let next_block = chunk("next-block", &[42], 3, &[5], 2); // position 4 needs a new block
        for (odd, its_token) in [(guided, Some(7)), (prefill_part, None), (next_block, Some(8))] {
            let mut with = chunks.clone();
            with.push(odd.clone());
            let mut sampled = sampled.clone();
            sampled.extend(its_token.map(|t| token(&odd.request_id, t)));
            assert!(next_decode_step(&with, &sampled, 4).is_empty(), "{}", odd.request_id);
        }
    }

    #[test]
    fn a_row_run_ahead_serves_a_chunk_whose_table_grew_past_its_position() {
        // Planned at position 6 of 4-token blocks (block 3 holds it): the engine's chunk for
        // it carries block 9 as well, given early for position 8 (D78). Same work.
        let ran = chunk("r", &[101], 6, &[2, 3], 3);
        let asked = ScheduledChunk { block_ids: vec![2, 3, 9], ..ran.clone() };
        assert!(computes_the_same(&ran, &asked, 4));
        assert!(computes_the_same(&ran, &ran, 4));
        // A block the row reads or writes differs, or any other field: computed again.
        let different = [
            ScheduledChunk { block_ids: vec![2, 7, 9], ..ran.clone() },
            ScheduledChunk { block_ids: vec![5, 3], ..ran.clone() },
            ScheduledChunk { token_ids: vec![102], ..ran.clone() },
            ScheduledChunk { start_pos: 7, ..ran.clone() },
            ScheduledChunk { output_index: 4, ..ran.clone() },
            ScheduledChunk { sample: false, ..ran.clone() },
            ScheduledChunk { request_id: "other".into(), ..ran.clone() },
            ScheduledChunk { guided_output: vec![1], ..ran.clone() },
            ScheduledChunk { history: Some(Default::default()), ..ran.clone() },
            ScheduledChunk {
                sampling: pdmesh_protocol::SamplingParams { max_tokens: 11, ..ran.sampling.clone() },
                ..ran.clone()
            },
        ];
        for asked in &different {
            assert!(!computes_the_same(&ran, asked, 4), "{asked:?}");
        }
        // A row planned without the block its position needs serves nothing.
        let short = ScheduledChunk { block_ids: vec![2], ..ran.clone() };
        assert!(!computes_the_same(&short, &ran, 4));
    }

    #[test]
    fn faults_parse_and_fire_on_their_steps() {
        assert!(ExecutorFaults::parse("").unwrap().is_empty());
        let f = ExecutorFaults::parse("step_error_every=3, device_lost_at_step=7").unwrap();
        assert_eq!(
            f,
            ExecutorFaults { step_error_every: Some(3), device_lost_at_step: Some(7), ..ExecutorFaults::default() }
        );
        assert_eq!(ExecutorFaults::parse("step_delay_ms=20").unwrap().step_delay_ms, Some(20));
        let fired: Vec<(u64, bool)> = (1..=8).filter_map(|n| f.failure(n).map(|e| (n, e.is_device_lost()))).collect();
        assert_eq!(fired, vec![(3, false), (6, false), (7, true), (8, true)]);
        for bad in [
            "step_error_every=0",
            "step_error_every",
            "device_lost_at_step=x",
            "melt=1",
            "step_delay_while=/tmp/x",
            "step_delay_ms=5,step_delay_while=relative/path",
            "step_delay_ms=5,step_delay_while=",
            "step_delay_ms=5,step_delay_while",
        ] {
            assert!(ExecutorFaults::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_switched_delay_applies_only_while_its_file_exists() {
        let dir = std::env::temp_dir().join(format!("pdmesh-fault-switch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let flag = dir.join("slow");
        let _ = std::fs::remove_file(&flag);
        let f = ExecutorFaults::parse(&format!("step_delay_ms=25, step_delay_while={}", flag.display())).unwrap();
        assert_eq!(f.step_delay_while.as_deref(), Some(flag.as_path()));
        assert_eq!(f.delay(), None, "no file: full speed");
        std::fs::write(&flag, b"").unwrap();
        assert_eq!(f.delay(), Some(std::time::Duration::from_millis(25)), "file there: slowed");
        std::fs::remove_file(&flag).unwrap();
        assert_eq!(f.delay(), None, "file gone: full speed again");
        let always = ExecutorFaults::parse("step_delay_ms=7").unwrap();
        assert_eq!(always.delay(), Some(std::time::Duration::from_millis(7)));
        assert_eq!(ExecutorFaults::default().delay(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
