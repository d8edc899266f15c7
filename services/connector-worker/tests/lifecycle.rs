//! The KV-block lifecycle as a property (LIFECYCLE.md R1, R2, R4, R5).
//!
//! A P and a D engine in one process: on each side the engine's own step machine
//! (`pdmesh_engine_core::step::EngineStep`, the code `engine-core` runs over its sockets) with
//! the real `Scheduler`, block pool and `MultiConnector(PdConnector, OffloadConnector)`
//! answering its connector calls, and the worker's own offload store (`OffloadStore`, saves and
//! loads of real bytes in a real `KvCache`) and output merge (`OutputMerge`); on P the
//! real `HoldTable`, driven through the worker's own step functions (`producer_start_step`,
//! `producer_finish_step`) and, as P's side channel would, through its `LeasePolicy`; on D the
//! worker's own receive machine (`consumer::Consumer`, D107), which decides what each step's
//! receives do, how a lease, READ or `read done` is judged, when D gives P its blocks back and
//! what the next step reports, the test only performing the actions it names. The test
//! plays the router, D's READs and the side-channel messages between the nodes, and interleaves
//! everything at random: new requests, reused request ids (refused while they still name
//! blocks, admitted again after), P and D steps, hand-offs, refusals inside D's engine (its
//! fault injection refuses every 7th admission, and hand-offs under an id D already runs are
//! refused as duplicates; each sends the engine's rejection notice), rejections before
//! admission (the notice's fast path, or with the next step), releases by the router, lost
//! hand-offs, aborts on either side (before, at and after finish, unknown ids), lease requests,
//! READ progress (one-sided shm or checked tcp), `read done`, duplicate `read done`, transfer
//! failures, failed forward passes, heartbeats, delayed or lost give-ups, worker restarts on
//! either side (below), and time. Steps skip
//! the connector round when it has nothing to say, as the engine does (D64); time passing
//! forces the next one, as the engine's clock does.
//!
//! P answers in the step that runs `request_finished`, and its worker registers the hold in the
//! next step (D65), so D can ask for a lease, or give up, before P's hold table knows the
//! request: the lease waits (parked) and is answered at a later lease event — granted or
//! refused through the normal checks once the hold registered, refused once its wait ended —
//! and the give-up is remembered and frees the hold as it registers.
//!
//! A worker restart (a crashed connector-worker, or a tensor-parallel group that failed as one,
//! D111) replaces P's or D's worker process by a new one with nothing of the old state: its KV
//! bytes, offload store, and P's hold table (leases, parked requests) or D's receive machine
//! (READs in flight) are gone, while the engine and its connector-scheduler live on. D's READs
//! under a dead P worker's lease go on copying whatever P's memory now holds; only a `read done`
//! the new table confirms could count them, and it confirms none. The engine learns of the
//! restart from its `WorkerInfo` query (`Ev::WorkerSeen`) and starts no step before (D113); a
//! step it built for the old process that reaches the new one is refused by the worker's own
//! check (`refuse_stale_step`). Holds and offload saves the connector-scheduler queued before
//! the restart, for blocks the engine then freed, are dropped by the engine
//! (`Scheduler::retain_held_metadata`). Mutations kept as checks (D113): let the engine step
//! before it knew (the gate and the worker's check both off), and the default run fails at once
//! with "P's hold table is not empty" (a hold the new process registered, on blocks the engine
//! then freed as the old process's); pass the queued metadata on unfiltered, and a later request
//! loads from the offload store the zeros the new worker saved under the old request's stamp
//! ("the KV of position 0 (block 0) is not its token's").
//!
//! Every prompt is a prefix of one of three token sequences, so later requests find earlier
//! ones' blocks in the offload store (a store smaller than the prompts sent, so it also evicts). The test's
//! model writes each token's KV as a value naming its position and token, and reads the KV of
//! every position before each chunk it runs: whether computed there, loaded from the offload
//! store, or copied from P's blocks by D's READ, it must be that request's own.
//!
//! After every event: no block is freed twice; no block P lent under a lease is freed or reused
//! while the lease is active; no block of D's that a READ may still write is freed or reused;
//! a READ that P confirms (`read done` answered `Released`) saw only the blocks P handed out;
//! `request_finished` ran at most once per admission. At quiescence, once every deadline has
//! passed (undelivered notices dropped or delivered, the router's last hand-offs lost): every
//! block of P and D is free, P's hold table is empty, and `request_finished` ran exactly once
//! per admission of every request id.
//!
//! Both engines cache prefixes (D51): the shared token sequence makes later requests hit blocks
//! that earlier ones computed, loaded or read — blocks that P may hold for D at that very
//! moment, shared by several holds, or evicted by pressure on the small pools — and D, asked to
//! read a prompt whose start it has cached, reads only the tail of P's blocks it lacks (a
//! partial read), or nothing when it has every block but the last token's (P is told at once).
//! The model's read-back of every earlier position is what proves a shared or cached block
//! held the right KV.
//!
//! Cases: `PDMESH_LIFECYCLE_CASES` (default 2048). The benchmark-style run in docs/benchmarks.md
//! sets it to 100000.
//!
//! It fails when a rule is broken on purpose. Mutation kept as a check (docs/LIFECYCLE.md):
//! let `Scheduler::id_in_use` look at live requests only (the code before D38), and a reused id
//! that reaches P while the first request's blocks are held overwrites the held entry — both
//! tests fail within the first cases with "P still owns blocks at quiescence"
//! (`used_blocks: 1, held_blocks: 0`: the leak the issue reported on the real mesh).
//! A second: let `MultiConnector::request_finished` never send `extra_async_saves` (free on the
//! first child's `finished_sending`), and a request P holds for D while the offload child saves
//! it is freed on the save's report: the property test fails ("P's hold table is not empty"
//! at quiescence, its blocks having gone back while D could still read them).
//! A third (D51): let `BlockPool::touch` leave a hit block in the free queue (a cached block P
//! holds for D, hit by a new request, stays evictable): the default run fails at once, minimal
//! case "abort on P, a P step, the id reused", with P at `free 39 + used 0 + held 2` of 40
//! blocks — a held block counted free, there for the next allocation to take and rewrite.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdmesh_connector_scheduler::{
    dispatch, KvConnectorScheduler, MultiConnector, OffloadConnector, PdConnector, ProducerIdentity,
};
use pdmesh_connector_worker::consumer::{Action, Consumer, Ended, FailureKind, Next, ReadFailure, RecvId};
use pdmesh_connector_worker::multi::OutputMerge;
use pdmesh_connector_worker::offload::OffloadStore;
use pdmesh_connector_worker::pd::{producer_finish_step, producer_start_step};
use pdmesh_connector_worker::refuse_stale_step;
use pdmesh_engine_core::scheduler::{EngineFaults, Scheduler, SchedulerConfig};
use pdmesh_engine_core::step::{
    notice_calls, notice_receives, EngineState, EngineStep, StepDone, StepIo, WorkerAnswer, WorkerChange,
};
use pdmesh_kv_transfer::{
    CapabilityCheck, HoldTable, HoldTableConfig, LeaseDecision, LeasePolicy, LeaseRefusal, NoticeOutcome, TransferError,
};
use pdmesh_model_api::kv_cache::KvSide;
use pdmesh_model_api::{KvCache, KvCacheSpec};
use pdmesh_protocol::{
    ConnectorCall, ConnectorReply, EngineRequest, ErrorClass, KvConnectorMetadata, KvConnectorOutput, KvTransferParams,
    ModelRunnerOutput, RejectionNotice, SampledToken, SamplingParams, SchedulerOutput, TraceContext, WireError,
};
use proptest::prelude::*;

const BS: u32 = 4;
const P_BLOCKS: u32 = 40;
const D_BLOCKS: u32 = 28;
/// P's hold deadline after `request_finished`.
const HOLD: Duration = Duration::from_millis(1000);
const LEASE_TTL: Duration = Duration::from_millis(300);
const HEARTBEAT_EXTENSION: Duration = Duration::from_millis(1000);
/// How long a lease asked before its hold registered waits for it (D65).
const EARLY_WAIT: Duration = Duration::from_millis(400);
const EOS: u32 = 2;
const TOKEN: u32 = 7;
/// Slots of each node's host-memory offload store: fewer than the blocks of the prompts a
/// case sends, so the store evicts, and entries a load pinned are tested against eviction.
const OFFLOAD_SLOTS: u32 = 12;

/// What the test's model writes as the KV of the token `token` at position `pos` (every prompt
/// is a prefix of one of three token sequences with tokens of their own, so position and token
/// name the KV exactly). Exact in `f32` for the positions and tokens the test uses.
fn kv_value(pos: u32, token: u32) -> f32 {
    (pos * 1000 + token) as f32
}

/// D's engine refuses every 7th request it is handed (its own fault injection).
fn d_engine_faults() -> EngineFaults {
    EngineFaults { refuse_admission_every: Some(7) }
}

fn cases() -> u32 {
    std::env::var("PDMESH_LIFECYCLE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2048)
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[derive(Debug, Clone)]
enum Ev {
    /// The router sends a new request to P (P's leg: `max_tokens = 1`, `do_remote_decode`).
    New {
        prompt: u32,
        max_tokens: u32,
        /// A reused request id (a client's or proxy's retry reaching the engine unchanged):
        /// an earlier id with its prompt. P's scheduler refuses it while the id still names
        /// blocks, and admits it again once it does not.
        reuse: Option<usize>,
    },
    /// A step; with `fails`, its forward pass fails (the step's requests fail, and the
    /// worker's connector output of that step is still applied, as the engine does).
    PStep {
        fails: bool,
    },
    DStep {
        fails: bool,
    },
    /// The router hands P's answer to D, under P's id or (`dup`) under an earlier id, which
    /// D's scheduler refuses while a live request has it: a refusal inside D's engine, which
    /// must free P at once (R1) as D's engine also does for its injected refusals.
    Forward {
        i: usize,
        dup: Option<usize>,
    },
    /// D refuses the hand-off before admission (R1): through the step, or the fast path.
    Reject {
        i: usize,
        fast: bool,
    },
    /// The client went away between the legs: the router's `/v1/kv/release` on P.
    Release {
        i: usize,
    },
    /// The router loses the hand-off without a word (only P's deadline can free).
    Lose {
        i: usize,
    },
    AbortP {
        i: usize,
    },
    AbortD {
        i: usize,
    },
    /// D's worker asks P for a read lease for one of its receives.
    Lease {
        k: usize,
    },
    /// Part of a READ: one-sided (shm) or checked by P first (tcp).
    Read {
        k: usize,
        tcp: bool,
    },
    ReadDone {
        k: usize,
    },
    /// The READ fails (setup, midway, timeout), or the handshake before a lease.
    TransferFail {
        k: usize,
    },
    /// A `read done` repeated after it was answered.
    DupReadDone {
        i: usize,
    },
    /// D's worker delivers the heartbeats its connector last asked for.
    Heartbeat,
    /// One delayed give-up reaches P.
    Deliver {
        i: usize,
    },
    Advance {
        ms: u64,
    },
    /// P's (`p`) or D's worker process dies and its supervisor starts a new one (a crash, or
    /// a tensor-parallel group failing as one, D111): its KV cache, offload store, hold table
    /// or receives are gone. With `stale_step`, a step the engine built before it knew is
    /// on its way and reaches the new process, which must refuse it.
    WorkerLost {
        p: bool,
        stale_step: bool,
    },
    /// The engine's `WorkerInfo` query answers (its link to the worker came back): a new
    /// incarnation fails what lived in the old one and frees its blocks; until then the
    /// engine starts no step.
    WorkerSeen {
        p: bool,
    },
}

/// How the worker answers a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// The forward pass runs.
    Runs,
    /// The forward pass fails (the connector output still goes back).
    Fails,
    /// The step was built for the worker's previous incarnation: the new process refuses it.
    Stale,
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        // `prompt` names one of three token sequences and a length (see `Ev::New`'s apply).
        12 => (1u32..120, 1u32..5).prop_map(|(prompt, max_tokens)| Ev::New { prompt, max_tokens, reuse: None }),
        3 => any::<usize>().prop_map(|i| Ev::New { prompt: 1, max_tokens: 1, reuse: Some(i) }),
        18 => Just(Ev::PStep { fails: false }),
        18 => Just(Ev::DStep { fails: false }),
        3 => Just(Ev::PStep { fails: true }),
        3 => Just(Ev::DStep { fails: true }),
        12 => any::<usize>().prop_map(|i| Ev::Forward { i, dup: None }),
        3 => (any::<usize>(), any::<usize>()).prop_map(|(i, d)| Ev::Forward { i, dup: Some(d) }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(i, fast)| Ev::Reject { i, fast }),
        3 => any::<usize>().prop_map(|i| Ev::Release { i }),
        3 => any::<usize>().prop_map(|i| Ev::Lose { i }),
        6 => any::<usize>().prop_map(|i| Ev::AbortP { i }),
        6 => any::<usize>().prop_map(|i| Ev::AbortD { i }),
        9 => any::<usize>().prop_map(|k| Ev::Lease { k }),
        9 => (any::<usize>(), any::<bool>()).prop_map(|(k, tcp)| Ev::Read { k, tcp }),
        9 => any::<usize>().prop_map(|k| Ev::ReadDone { k }),
        3 => any::<usize>().prop_map(|k| Ev::TransferFail { k }),
        3 => any::<usize>().prop_map(|i| Ev::DupReadDone { i }),
        3 => Just(Ev::Heartbeat),
        6 => any::<usize>().prop_map(|i| Ev::Deliver { i }),
        6 => (0u64..250).prop_map(|ms| Ev::Advance { ms }),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(p, stale_step)| Ev::WorkerLost { p, stale_step }),
        3 => any::<bool>().prop_map(|p| Ev::WorkerSeen { p }),
    ]
}

/// One engine rank: the engine's own step state (scheduler, inbox) and a
/// real connector, driven by the engine's own [`EngineStep`].
struct Node {
    state: EngineState,
    /// `MultiConnector(P/D transfer, host-memory offload)`, as a node with
    /// `kv_connector = "MultiConnector"` runs it.
    conn: Box<dyn KvConnectorScheduler>,
    /// The worker's KV cache (one layer, one value per token), its offload store and its
    /// merge of the two children's outputs: the worker's own types.
    kv: KvCache,
    store: OffloadStore,
    merge: OutputMerge,
    /// `extra_async_saves` the connector sent (a request two children delayed).
    extra_saves: u64,
    /// Blocks the worker loaded from its offload store and the model then read as right.
    offload_blocks_checked: u64,
    /// The prompt of each request id this engine runs, from the engine's own connector query
    /// (on D an id may carry another request's prompt: a hand-off under an earlier id).
    prompts: HashMap<String, Vec<u32>>,
    /// Blocks the offload store loaded that no pass has read or written since.
    loaded_unread: std::collections::HashSet<u32>,
    /// How many times each id was admitted (an id may come back once its request is gone).
    admitted: HashMap<String, u32>,
    finished_calls: HashMap<String, u32>,
    /// Requests the engine refused at admission.
    refused: u64,
    /// The worker process's incarnation (the `WorkerInfo` name a restart changes).
    incarnation: String,
    restarts: u32,
}

impl Node {
    fn new(pd: PdConnector, num_blocks: u32, recompute: bool, faults: EngineFaults) -> Self {
        let spec = KvCacheSpec { num_layers: 1, num_blocks, block_size: BS, num_kv_heads: 1, head_dim: 1 };
        let offload = OffloadConnector::new(BS, OFFLOAD_SLOTS, "test-model");
        let conn: Box<dyn KvConnectorScheduler> = Box::new(MultiConnector::new(vec![Box::new(pd), Box::new(offload)]));
        let mut sched = Scheduler::new(SchedulerConfig {
            block_size: BS,
            num_blocks,
            max_num_seqs: 6,
            max_num_batched_tokens: 48,
            max_model_len: 256,
        });
        sched.set_recompute_load_failures(recompute);
        sched.set_faults(faults);
        Self {
            state: EngineState::new(0, sched),
            conn,
            kv: KvCache::new_heap(spec),
            store: OffloadStore::new(spec, OFFLOAD_SLOTS),
            merge: OutputMerge::default(),
            extra_saves: 0,
            offload_blocks_checked: 0,
            prompts: HashMap::new(),
            loaded_unread: Default::default(),
            admitted: HashMap::new(),
            finished_calls: HashMap::new(),
            refused: 0,
            incarnation: String::new(),
            restarts: 0,
        }
    }

    /// The worker process died and a new one runs in its place, with nothing of the old
    /// one's state: a fresh KV cache (its bytes are not the old ones'), an empty offload
    /// store and merge. The engine is not told here; it learns at [`Ev::WorkerSeen`].
    fn new_worker_process(&mut self, side: Side) {
        self.restarts += 1;
        self.incarnation = format!("{side:?}-{}", self.restarts);
        let spec = *self.kv.spec();
        self.kv = KvCache::new_heap(spec);
        self.store = OffloadStore::new(spec, OFFLOAD_SLOTS);
        self.merge = OutputMerge::default();
        self.loaded_unread.clear();
    }

    fn sched(&self) -> &Scheduler {
        &self.state.sched
    }

    /// Connector calls, checking that `request_finished` runs at most once per admission.
    fn call(&mut self, calls: Vec<ConnectorCall>) -> Result<Vec<ConnectorReply>, TestCaseError> {
        let mut replies = Vec::with_capacity(calls.len());
        for c in calls {
            // The admitted request's prompt, as the engine asks the connector about it.
            if let ConnectorCall::GetNumNewMatchedTokens { request_id, prompt_token_ids, .. } = &c {
                self.prompts.insert(request_id.clone(), prompt_token_ids.clone());
            }
            if let ConnectorCall::RequestFinished { request_id, .. } = &c {
                let n = self.finished_calls.entry(request_id.clone()).or_insert(0);
                *n += 1;
                let admitted = self.admitted.get(request_id).copied().unwrap_or(0);
                prop_assert!(
                    *n <= admitted,
                    "request_finished called {} times for {} admitted {} times",
                    n,
                    request_id,
                    admitted
                );
            }
            replies.push(dispatch(self.conn.as_mut(), c));
        }
        Ok(replies)
    }

    /// The adds this step will apply: counted as admitted unless the step refuses them.
    fn count_adds(&mut self) {
        for r in &self.state.inbox.adds {
            *self.admitted.entry(r.request_id.clone()).or_insert(0) += 1;
        }
    }

    fn uncount_refused(&mut self, done: &StepDone) {
        self.refused += done.refusals.len() as u64;
        for (id, _) in &done.refusals {
            if let Some(n) = self.admitted.get_mut(id) {
                *n -= 1;
            }
        }
    }

    /// `EngineCore::notice_now`: a rejection notice straight to the connector; the notify-only
    /// receives it makes, for the worker.
    fn notice(&mut self, notice: RejectionNotice) -> Result<Option<KvConnectorMetadata>, TestCaseError> {
        let calls = notice_calls(&mut self.state, notice);
        let replies = self.call(calls)?;
        Ok(notice_receives(&replies).1)
    }

    /// The offload child's copies of a step, before its forward pass (`ApplyOffload`), and the
    /// merged connector output the worker answers with (`OutputMerge`), as the worker does.
    fn offload_and_merge(&mut self, meta: &KvConnectorMetadata, pd_out: KvConnectorOutput) -> KvConnectorOutput {
        self.merge.expect(&meta.extra_async_saves);
        self.extra_saves += meta.extra_async_saves.values().map(|&n| u64::from(n)).sum::<u64>();
        let offload_out = self.store.apply(&mut self.kv, &meta.offload);
        for t in &meta.offload.loads {
            let refused = t.block_ids.iter().position(|b| offload_out.invalid_block_ids.contains(b));
            self.loaded_unread.extend(&t.block_ids[..refused.unwrap_or(t.block_ids.len())]);
        }
        self.merge.merge([pd_out, offload_out])
    }

    /// The model's pass over `step`: every chunk reads the KV of the positions before it, which
    /// must be its own tokens' (computed here, loaded from the offload store, or read from P),
    /// and writes its tokens' KV unless the pass fails.
    fn model_pass(&mut self, step: &SchedulerOutput, fails: bool) -> Result<(), TestCaseError> {
        for c in &step.chunks {
            let prompt = self.prompts.get(&c.request_id).map(Vec::as_slice).unwrap_or(&[]);
            for pos in 0..c.start_pos {
                let want = prompt.get(pos as usize).copied().unwrap_or(TOKEN);
                let block = c.block_ids.get((pos / BS) as usize).copied().unwrap_or(u32::MAX);
                let got = self.kv.block(0, KvSide::Key, block).ok().and_then(|b| b.get((pos % BS) as usize).copied());
                prop_assert_eq!(
                    got,
                    Some(kv_value(pos, want)),
                    "{}: the KV of position {} (block {}) is not its token's",
                    &c.request_id,
                    pos,
                    block
                );
                if pos % BS == BS - 1 && self.loaded_unread.remove(&block) {
                    self.offload_blocks_checked += 1;
                }
            }
            if fails {
                continue;
            }
            for (i, &token) in c.token_ids.iter().enumerate() {
                let pos = c.start_pos + i as u32;
                let Some(&block) = c.block_ids.get((pos / BS) as usize) else { continue };
                self.loaded_unread.remove(&block);
                for side in [KvSide::Key, KvSide::Value] {
                    if let Some(v) = self.kv.block_mut(0, side, block).ok().and_then(|b| b.get_mut((pos % BS) as usize))
                    {
                        *v = kv_value(pos, token);
                    }
                }
            }
        }
        Ok(())
    }

    fn quiet(&self) -> bool {
        !self.sched().has_requests() && self.state.inbox.is_empty()
    }
}

/// The worker's answer to a step: the model samples `TOKEN` for every chunk that samples, or
/// (`fails`) the forward pass fails; the step's connector output goes back either way (D37).
fn model_answer(step: &SchedulerOutput, kv: KvConnectorOutput, fails: bool) -> WorkerAnswer {
    let failure = (fails && !step.chunks.is_empty()).then(|| WireError::new(ErrorClass::Internal, "injected"));
    let sampled = if failure.is_some() {
        Vec::new()
    } else {
        step.chunks
            .iter()
            .filter(|c| c.sample)
            .map(|c| SampledToken { request_id: c.request_id.clone(), token_id: TOKEN, logprobs: None })
            .collect()
    };
    WorkerAnswer::Ran(ModelRunnerOutput {
        step_id: step.step_id,
        sampled,
        kv_connector_output: kv,
        failure,
        ..Default::default()
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    P,
    D,
}

/// A receive on D's worker as the test sees it, from `reqs_to_recv` until the step that
/// reports it: what D's consumer machine asked for it, and what the test's READ saw. Every
/// decision about it is the machine's.
#[derive(Debug, Clone)]
struct Recv {
    id: RecvId,
    d_id: String,
    /// The blocks the READ writes (the machine's tail of the request's blocks).
    local: Vec<u32>,
    /// Generations of D's local blocks when the receive started.
    local_gens: Vec<u64>,
    /// The lease the machine asks for: P's request id, capability token, blocks, generations.
    p_id: String,
    token: String,
    remote: Vec<u32>,
    gens: Vec<u64>,
    /// The lease the machine reads under (its READ action).
    lease: Option<u64>,
    /// The ticket of a lease request P parked because the hold was not registered yet.
    parked: Option<u64>,
    /// What each part of the READ saw in P's pool: (block, allocated, generation).
    observed: Vec<(u32, bool, Option<u64>)>,
}

/// An active lease as the test sees it, independently of the hold table.
struct LeaseView {
    p_id: String,
    blocks: Vec<(u32, u64)>,
    deadline: Instant,
}

#[derive(Debug, Clone)]
struct GiveUp {
    p_id: String,
    lease: Option<u64>,
    token: String,
}

struct Handoff {
    id: String,
    params: KvTransferParams,
}

struct World {
    p: Node,
    d: Node,
    table: HoldTable,
    /// D's worker: its own receive machine.
    consumer: Consumer<u64>,
    now: Instant,
    next_id: u64,
    /// Every request id ever sent (aborts pick from them, finished or not).
    ids: Vec<String>,
    prompts: HashMap<String, (Vec<u32>, u32)>,
    /// P's answers the router holds, not yet sent to D.
    ready: Vec<Handoff>,
    /// D's receives the machine has not ended.
    inflight: Vec<Recv>,
    /// Receives the machine ended as loaded (`true`) or failed, not yet reported.
    settled: Vec<(Recv, bool)>,
    outbox: Vec<GiveUp>,
    heartbeat: Vec<String>,
    leases: HashMap<u64, LeaseView>,
    done_leases: Vec<(String, u64)>,
    /// New requests sent under an earlier id.
    reused_ids: u64,
    /// Give-ups refused by P because their id was reused since (the old token no longer fits).
    stale_notices_refused: u64,
    /// D receives that read only a tail of P's blocks (D had the rest in its prefix cache).
    partial_reads: u64,
    /// Parked lease requests: what each asked, to follow a lease granted after its reader went.
    parked: HashMap<u64, (String, Vec<(u32, u64)>)>,
    /// Parked lease requests granted once their hold registered, and refused.
    early_granted: u64,
    early_refused: u64,
    /// Steps a restarted worker refused (built for its predecessor), requests the engines
    /// failed on seeing a restart, and reads D had in flight from a P worker that restarted.
    stale_steps_refused: u64,
    requests_lost_to_restarts: u64,
    reads_across_p_restart: u64,
    /// The counters of hold tables that died with their P worker process.
    retired_tables: Vec<pdmesh_kv_transfer::HoldCounters>,
}

fn hold_config() -> HoldTableConfig {
    HoldTableConfig { lease_ttl: LEASE_TTL, heartbeat_extension: HEARTBEAT_EXTENSION, early_wait: EARLY_WAIT }
}

impl World {
    /// `p_caching: false` runs P without prefix caching: its own cache would then always hold
    /// what its small offload store holds, and the store's loads would never be exercised.
    /// `reserve`: both engines give a request going on its next position's block a step early
    /// (D78), as where the worker runs steps ahead.
    fn new(recompute: bool, p_caching: bool, reserve: bool) -> Self {
        let producer = ProducerIdentity {
            engine_id: "p".into(),
            side_channel_host: "127.0.0.1".into(),
            side_channel_port: 5600,
            dp_rank: 0,
        };
        let table = HoldTable::new(hold_config());
        let mut p = Node::new(PdConnector::new(Some(producer), false, HOLD), P_BLOCKS, false, EngineFaults::default());
        p.state.sched.set_prefix_caching(p_caching);
        p.state.sched.set_reserve_next_block(reserve);
        // Heartbeats due every step (a hold of zero): the test decides when they arrive.
        // D's engine refuses some hand-offs itself (rule R1 inside the engine).
        let mut d = Node::new(PdConnector::new(None, true, Duration::ZERO), D_BLOCKS, recompute, d_engine_faults());
        d.state.sched.set_reserve_next_block(reserve);
        // Both workers are up and known before the first step.
        for (n, side) in [(&mut p, Side::P), (&mut d, Side::D)] {
            n.new_worker_process(side);
            n.state.worker_seen(&n.incarnation);
        }
        Self {
            p,
            d,
            table,
            consumer: Consumer::new(true, HOLD * 2),
            now: Instant::now(),
            next_id: 0,
            ids: Vec::new(),
            prompts: HashMap::new(),
            ready: Vec::new(),
            inflight: Vec::new(),
            settled: Vec::new(),
            outbox: Vec::new(),
            heartbeat: Vec::new(),
            leases: HashMap::new(),
            done_leases: Vec::new(),
            reused_ids: 0,
            stale_notices_refused: 0,
            partial_reads: 0,
            parked: HashMap::new(),
            early_granted: 0,
            early_refused: 0,
            stale_steps_refused: 0,
            requests_lost_to_restarts: 0,
            reads_across_p_restart: 0,
            retired_tables: Vec::new(),
        }
    }

    fn node(&mut self, side: Side) -> &mut Node {
        match side {
            Side::P => &mut self.p,
            Side::D => &mut self.d,
        }
    }

    /// One engine step of `side`, through the engine's own step machine; the worker's part is
    /// P's hold table or D's receives, and the model's sampling (or a failed pass).
    fn step(&mut self, side: Side, pass: Pass) -> Result<(), TestCaseError> {
        // The engine's driver starts no step while it does not know which worker answers.
        if !self.node(side).state.can_step() {
            return Ok(());
        }
        self.node(side).count_adds();
        let (mut step, mut io) = EngineStep::start(&mut self.node(side).state, |_| TraceContext::default());
        let done = loop {
            io = match io {
                StepIo::Connector(calls) => {
                    let replies = self.node(side).call(calls)?;
                    step.on_connector(&mut self.node(side).state, Some(replies))
                }
                StepIo::Worker(output) => {
                    let answer = self.worker_pass(side, pass, &output)?;
                    step.on_worker(&mut self.node(side).state, answer)
                }
                StepIo::Done(done) => break done,
            };
        };
        self.node(side).uncount_refused(&done);
        // The engine sends a notice for every remote-prefill request it refused (R1).
        for notice in done.refused {
            if let Some(meta) = self.node(side).notice(notice)? {
                self.d_worker_start(&meta)?;
            }
        }
        if side == Side::P {
            for o in done.outputs {
                if let Some(params) = o.kv_transfer_params.filter(KvTransferParams::wants_remote_prefill) {
                    prop_assert!(o.error.is_none());
                    self.ready.push(Handoff { id: o.request_id, params });
                }
            }
        }
        Ok(())
    }

    /// The worker's part of a step: its first check (is the step built for this process?),
    /// then P's hold table or D's receives, the offload copies, and the model's pass.
    fn worker_pass(&mut self, side: Side, pass: Pass, output: &SchedulerOutput) -> Result<WorkerAnswer, TestCaseError> {
        let refusal = refuse_stale_step(output, &self.node(side).incarnation);
        if pass == Pass::Stale {
            let Some(refusal) = refusal else {
                return Err(TestCaseError::fail("a restarted worker ran a step built for the old one"));
            };
            self.stale_steps_refused += 1;
            return Ok(WorkerAnswer::Failed(refusal.message));
        }
        prop_assert!(refusal.is_none(), "a worker refused a step built for it: {:?}", refusal);
        let pd_out = match side {
            Side::P => {
                let mut kv = KvConnectorOutput::default();
                let (now, wall) = (self.now, wall_ms());
                producer_start_step(&mut self.table, &output.kv_connector_metadata, |s| {
                    now + Duration::from_millis(s.deadline_unix_ms.saturating_sub(wall))
                });
                producer_finish_step(&mut self.table, now, &mut kv);
                kv
            }
            Side::D => {
                self.d_worker_start(&output.kv_connector_metadata)?;
                self.d_worker_finish()?
            }
        };
        let fails = pass == Pass::Fails;
        let kv = self.node(side).offload_and_merge(&output.kv_connector_metadata, pd_out);
        self.node(side).model_pass(output, fails)?;
        Ok(model_answer(output, kv, fails))
    }

    /// The worker process of `side` died and a new one runs (`Ev::WorkerLost`). What lived
    /// in the old process is gone: on P the hold table with its leases and parked requests
    /// (D's READs under those leases go on, but no `read done` can be confirmed by the new
    /// table), on D the receive machine with its READs. Messages already on the wire (D's
    /// give-ups) stay there. With `stale_step`, a step the engine built for the old process
    /// reaches the new one first. The engine learns of it at `Ev::WorkerSeen`.
    fn worker_lost(&mut self, side: Side, stale_step: bool) -> Result<(), TestCaseError> {
        let engine_knew_old = self.node(side).state.can_step();
        self.node(side).new_worker_process(side);
        match side {
            Side::P => {
                let old = std::mem::replace(&mut self.table, HoldTable::new(hold_config()));
                self.retired_tables.push(old.counters().clone());
                self.leases.clear();
                self.parked.clear();
                self.reads_across_p_restart += self.inflight.iter().filter(|r| r.lease.is_some()).count() as u64;
                // Lease requests the old process had parked die with its side channel: D's
                // request fails (as a silent P does), and its machine decides what next.
                let parked: Vec<RecvId> =
                    self.inflight.iter_mut().filter_map(|r| r.parked.take().map(|_| r.id)).collect();
                for recv in parked {
                    let next = self.consumer.on_lease(recv, Err(TransferError::Timeout(LEASE_TTL)));
                    self.drive(recv, next)?;
                }
            }
            Side::D => {
                self.consumer = Consumer::new(true, HOLD * 2);
                self.inflight.clear();
                self.settled.clear();
                self.heartbeat.clear();
            }
        }
        if stale_step && engine_knew_old {
            self.step(side, Pass::Stale)?;
        }
        self.node(side).state.worker_unconfirmed();
        Ok(())
    }

    /// The engine's `WorkerInfo` answer: a new incarnation fails the requests whose KV lived
    /// in the old one and frees its blocks, held ones included, before the next step.
    fn worker_seen(&mut self, side: Side) {
        let node = self.node(side);
        let incarnation = node.incarnation.clone();
        if let WorkerChange::Restarted { lost } = node.state.worker_seen(&incarnation) {
            self.requests_lost_to_restarts += lost as u64;
        }
    }

    /// D's worker takes the step's metadata (`PdRuntime::start_step`): its consumer machine
    /// starts the receives, the test performs what it asks. Handshakes succeed at once (P is
    /// always reachable; a failed one is played by `Ev::TransferFail`).
    fn d_worker_start(&mut self, meta: &KvConnectorMetadata) -> Result<(), TestCaseError> {
        let started = self.consumer.start_step(meta, self.now);
        if !started.heartbeats.is_empty() {
            self.heartbeat =
                started.heartbeats.iter().flat_map(|b| b.requests.iter().map(|(id, _)| id.clone())).collect();
        }
        for n in started.receives {
            let Action::Handshake { recv, stale: false, .. } = n.action else {
                return Err(TestCaseError::fail(format!("a receive starts with {:?}", n.action)));
            };
            let r = &meta.reqs_to_recv[n.index];
            let local = self.consumer.local_blocks(recv).unwrap_or(&[]).to_vec();
            let remote_len = r.params.remote_block_ids.as_ref().map_or(0, Vec::len);
            if !local.is_empty() && local.len() < remote_len {
                self.partial_reads += 1;
            }
            let local_gens = local.iter().map(|b| self.d.sched().block_state(*b).1.unwrap_or(u64::MAX)).collect();
            self.inflight.push(Recv {
                id: recv,
                d_id: r.request_id.clone(),
                local,
                local_gens,
                p_id: String::new(),
                token: String::new(),
                remote: Vec::new(),
                gens: Vec::new(),
                lease: None,
                parked: None,
                observed: Vec::new(),
            });
            let next = self.consumer.on_handshake(recv, Ok(()));
            self.drive(recv, next)?;
        }
        Ok(())
    }

    /// Performs what D's machine asks for receive `recv` until it waits on P (a lease asked,
    /// a READ running) or ends. Give-ups go to the outbox, where they are delivered, delayed
    /// or lost; for the machine they were sent. A second handshake (after a stale view of P)
    /// succeeds.
    fn drive(&mut self, recv: RecvId, mut next: Next<u64>) -> Result<(), TestCaseError> {
        loop {
            let k = self.inflight.iter().position(|r| r.id == recv);
            next = match next {
                Next::Act(Action::Handshake { .. }) => self.consumer.on_handshake(recv, Ok(())),
                Next::Act(Action::GiveUp { p_req, token, lease, .. }) => {
                    self.outbox.push(GiveUp { p_id: p_req, lease, token });
                    self.consumer.on_give_up(recv, Ok(()))
                }
                Next::Act(Action::Lease { p_req, token, blocks, generations, .. }) => {
                    let Some(k) = k else { return Err(TestCaseError::fail("a lease for an unknown receive")) };
                    let r = &mut self.inflight[k];
                    (r.p_id, r.token, r.remote, r.gens) = (p_req, token, blocks, generations);
                    return Ok(()); // asked at an `Ev::Lease`
                }
                Next::Act(Action::Read { lease, remote, local, .. }) => {
                    let Some(k) = k else { return Err(TestCaseError::fail("a READ for an unknown receive")) };
                    let r = &mut self.inflight[k];
                    prop_assert_eq!((&remote, &local), (&r.remote, &r.local), "the READ moves the leased blocks");
                    r.lease = Some(lease);
                    r.parked = None;
                    return Ok(()); // runs at `Ev::Read`, `Ev::ReadDone`
                }
                Next::Ended(ended) => {
                    if let Some(k) = k {
                        let r = self.inflight.remove(k);
                        match ended {
                            Ended::Loaded => self.settled.push((r, true)),
                            Ended::Failed(_) => self.settled.push((r, false)),
                            Ended::Unreported => prop_assert!(r.local.is_empty(), "{} ended unreported", r.d_id),
                        }
                    }
                    return Ok(());
                }
            };
        }
    }

    /// D's worker reports the receives that settled (`PdRuntime::finish_step`, the machine's
    /// own): each receive the machine ended, once; a failed one's blocks invalid, a loaded
    /// one's not. Loaded bytes are copied into the request's blocks now, so those blocks must
    /// still be its own.
    fn d_worker_finish(&mut self) -> Result<KvConnectorOutput, TestCaseError> {
        let out = self.consumer.finish_step();
        let mut reported = out.finished_recving.clone();
        reported.sort();
        let mut ended = Vec::new();
        for (r, loaded) in std::mem::take(&mut self.settled) {
            for b in &r.local {
                prop_assert_eq!(out.invalid_block_ids.contains(b), !loaded, "{}: block {} invalid", &r.d_id, b);
            }
            if loaded {
                for (b, g) in r.local.iter().zip(&r.local_gens) {
                    let (alloc, gen) = self.d.sched().block_state(*b);
                    prop_assert!(
                        alloc && gen == Some(*g),
                        "D block {} of {} reused before its KV was copied",
                        b,
                        r.d_id
                    );
                }
            }
            ended.push(r.d_id);
        }
        ended.sort();
        prop_assert_eq!(reported, ended, "D reports exactly the receives that ended");
        Ok(out)
    }

    /// D's machine learns how receive `k`'s lease request went.
    fn lease_answer(&mut self, k: usize, answer: Result<u64, LeaseRefusal>) -> Result<(), TestCaseError> {
        let recv = self.inflight[k].id;
        let answer = answer.map_err(|r| TransferError::LeaseRefused { reason: r.reason, detail: r.detail });
        let next = self.consumer.on_lease(recv, answer);
        self.drive(recv, next)
    }

    /// D's machine learns how receive `k`'s READ and `read done` went.
    fn read_answer(&mut self, k: usize, failed: Option<FailureKind>) -> Result<(), TestCaseError> {
        let recv = self.inflight[k].id;
        let result = match failed {
            None => Ok(()),
            Some(kind) => Err(ReadFailure { kind, error: "played by the test".into() }),
        };
        let next = self.consumer.on_read(recv, result);
        self.drive(recv, next)
    }

    /// Whether P's side channel lets a message with this token through to the hold table:
    /// the token of the request P holds under the id (or any token for an id P does not hold,
    /// which the table then treats as unknown).
    fn p_accepts(&self, p_id: &str, token: &str) -> bool {
        self.table.capability(p_id, token) != CapabilityCheck::Mismatch
    }

    fn lease(&mut self, k: usize) -> Result<(), TestCaseError> {
        let r = &self.inflight[k];
        if r.lease.is_some() {
            return Ok(()); // the worker asks once per receive
        }
        if r.parked.is_some() {
            // P's side channel answers the parked requests it can answer now.
            return self.answer_parked();
        }
        // P's side channel checks the token first: a forged one never touches the hold, and
        // neither does D's own once P's request id was reused by a later request (its old token
        // is refused like an unknown request: the load fails, nothing to give back).
        let forged = pdmesh_mesh_auth::new_capability();
        prop_assert_ne!(self.table.capability(&r.p_id, &forged), CapabilityCheck::Match);
        if !self.p_accepts(&r.p_id, &r.token) {
            let refusal = LeaseRefusal::not_held(&r.p_id);
            return self.lease_answer(k, Err(refusal));
        }
        match self.table.grant_or_park(&r.p_id, &r.remote, &r.gens, "d/0", &r.token, self.now) {
            LeaseDecision::Granted(g) => self.leased(k, g)?,
            // Refused (gone, stale generation, aborted): the machine judges it.
            LeaseDecision::Refused(refusal) => self.lease_answer(k, Err(refusal))?,
            // Not registered yet (P answered first, D65): the answer comes later.
            LeaseDecision::Parked(ticket) => {
                let blocks = r.remote.iter().copied().zip(r.gens.iter().copied()).collect();
                self.parked.insert(ticket, (r.p_id.clone(), blocks));
                self.inflight[k].parked = Some(ticket);
            }
        }
        Ok(())
    }

    /// Receive `k` got lease `g`.
    fn leased(&mut self, k: usize, g: pdmesh_kv_transfer::LeaseGrant) -> Result<(), TestCaseError> {
        let r = &self.inflight[k];
        let blocks = r.remote.iter().copied().zip(r.gens.iter().copied()).collect();
        self.leases.insert(g.lease_id, LeaseView { p_id: r.p_id.clone(), blocks, deadline: self.now + g.ttl });
        // A lost answer: asking again gets the same lease.
        let again = self.table.grant(&r.p_id, &r.remote, &r.gens, "d/0", self.now);
        prop_assert_eq!(again.map(|a| a.lease_id).ok(), Some(g.lease_id));
        self.lease_answer(k, Ok(g.lease_id))?;
        prop_assert_eq!(self.inflight.get(k).and_then(|r| r.lease), Some(g.lease_id), "a granted lease is read under");
        Ok(())
    }

    /// P's side channel answers the parked lease requests whose hold registered or whose wait
    /// ended (`take_parked_answers`, as the agent does when woken).
    fn answer_parked(&mut self) -> Result<(), TestCaseError> {
        for a in self.table.take_parked_answers(self.now) {
            let asked = self.parked.remove(&a.ticket);
            match self.inflight.iter().position(|r| r.parked == Some(a.ticket)) {
                Some(k) => match a.result {
                    Ok(g) => {
                        self.early_granted += 1;
                        self.leased(k, g)?;
                    }
                    Err(refusal) => {
                        self.early_refused += 1;
                        self.lease_answer(k, Err(refusal))?;
                    }
                },
                // Its reader went (the READ task died): the lease, if granted, just expires.
                None => {
                    if let (Ok(g), Some((p_id, blocks))) = (a.result, asked) {
                        self.leases.insert(g.lease_id, LeaseView { p_id, blocks, deadline: self.now + g.ttl });
                    }
                }
            }
        }
        Ok(())
    }

    fn read(&mut self, k: usize, tcp: bool) -> Result<(), TestCaseError> {
        let r = &self.inflight[k];
        let Some(lease) = r.lease else { return Ok(()) };
        if tcp
            && (!self.p_accepts(&r.p_id, &r.token)
                || self.table.check_read(&r.p_id, lease, &r.remote, self.now).is_err())
        {
            return self.read_answer(k, Some(FailureKind::Read));
        }
        let seen: Vec<_> = r
            .remote
            .iter()
            .map(|&b| {
                let (alloc, gen) = self.p.sched().block_state(b);
                (b, alloc, gen)
            })
            .collect();
        // The READ's bytes: P's blocks into D's (only a read P confirms counts as loaded).
        for (&from, &to) in r.remote.iter().zip(&r.local) {
            for side in [KvSide::Key, KvSide::Value] {
                let bytes = self.p.kv.block(0, side, from).map(<[f32]>::to_vec).unwrap_or_default();
                if let Ok(dst) = self.d.kv.block_mut(0, side, to) {
                    if dst.len() == bytes.len() {
                        dst.copy_from_slice(&bytes);
                    }
                }
            }
        }
        self.inflight[k].observed.extend(seen);
        Ok(())
    }

    fn read_done(&mut self, k: usize) -> Result<(), TestCaseError> {
        let Some(lease) = self.inflight[k].lease else { return Ok(()) };
        if self.inflight[k].observed.is_empty() {
            self.read(k, false)?; // the READ ran to its end before D's worker says so
        }
        let r = &self.inflight[k];
        if !self.p_accepts(&r.p_id, &r.token) {
            // P's side channel refuses it like a `read done` for a request it does not hold.
            return self.read_answer(k, Some(FailureKind::ReadDone));
        }
        match self.table.read_done(&r.p_id, lease, "d/0", self.now) {
            NoticeOutcome::Released => {
                // P vouches for the bytes: everything the READ saw is what P handed out.
                let handed: HashMap<u32, u64> = r.remote.iter().copied().zip(r.gens.iter().copied()).collect();
                for (b, alloc, gen) in &r.observed {
                    prop_assert!(
                        *alloc && *gen == handed.get(b).copied(),
                        "{}: read done confirmed, but block {} was freed or reused during the READ",
                        r.p_id,
                        b
                    );
                }
                self.leases.remove(&lease);
                self.done_leases.push((r.p_id.clone(), lease));
                self.read_answer(k, None)
            }
            _ => self.read_answer(k, Some(FailureKind::ReadDone)),
        }
    }

    fn deliver(&mut self, i: usize) -> Result<(), TestCaseError> {
        let g = self.outbox.remove(i);
        if !self.p_accepts(&g.p_id, &g.token) {
            // A give-up for an earlier request under an id P has since reused: refused like an
            // unknown request, so it cannot free the later request's blocks.
            self.stale_notices_refused += 1;
            return Ok(());
        }
        let outcome = self.table.give_up_with_capability(&g.p_id, g.lease, "d/0", &g.token, self.now);
        if let Some(l) = g.lease {
            if outcome == NoticeOutcome::Released || self.leases.get(&l).is_some_and(|v| v.p_id == g.p_id) {
                self.leases.remove(&l);
            }
        }
        Ok(())
    }

    fn apply(&mut self, ev: &Ev) -> Result<(), TestCaseError> {
        let pick = |i: usize, n: usize| (n > 0).then(|| i % n);
        match ev {
            Ev::New { prompt, max_tokens, reuse } => {
                let (id, tokens, max_tokens) = match reuse.and_then(|i| pick(i, self.ids.len())) {
                    Some(i) => {
                        let id = self.ids[i].clone();
                        let (tokens, max_tokens) = self.prompts.get(&id).cloned().unwrap_or_default();
                        (id, tokens, max_tokens)
                    }
                    None => {
                        self.next_id += 1;
                        // Three sequences of up to 40 tokens: more distinct blocks than D's
                        // pool, so the prefix caches evict and the offload store still hits.
                        let (seq, len) = (*prompt / 40, *prompt % 40 + 1);
                        let tokens = (0..len).map(|t| 10 + t + 100 * seq).collect();
                        (format!("r{}", self.next_id - 1), tokens, *max_tokens)
                    }
                };
                self.reused_ids += u64::from(reuse.is_some());
                self.p.state.inbox.adds.push(EngineRequest {
                    request_id: id.clone(),
                    client_request_id: None,
                    prompt_token_ids: tokens.clone(),
                    sampling: SamplingParams { max_tokens: 1, temperature: 0.0, ..Default::default() },
                    eos_token_ids: vec![EOS],
                    arrival_unix_ms: 0,
                    kv_transfer_params: Some(KvTransferParams {
                        do_remote_decode: Some(true),
                        do_remote_prefill: Some(false),
                        ..Default::default()
                    }),
                    data_parallel_rank: None,
                });
                if !self.prompts.contains_key(&id) {
                    self.prompts.insert(id.clone(), (tokens, max_tokens));
                    self.ids.push(id);
                }
            }
            Ev::PStep { fails } => self.step(Side::P, if *fails { Pass::Fails } else { Pass::Runs })?,
            Ev::DStep { fails } => self.step(Side::D, if *fails { Pass::Fails } else { Pass::Runs })?,
            Ev::Forward { i, dup } => {
                if let Some(i) = pick(*i, self.ready.len()) {
                    let h = self.ready.remove(i);
                    let (tokens, max_tokens) = self.prompts.get(&h.id).cloned().unwrap_or_default();
                    let d_id = match dup.and_then(|d| pick(d, self.ids.len())) {
                        Some(d) => self.ids[d].clone(),
                        None => h.id,
                    };
                    self.d.state.inbox.adds.push(EngineRequest {
                        request_id: d_id,
                        client_request_id: None,
                        prompt_token_ids: tokens,
                        sampling: SamplingParams { max_tokens, temperature: 0.0, ..Default::default() },
                        eos_token_ids: vec![EOS],
                        arrival_unix_ms: 0,
                        kv_transfer_params: Some(h.params),
                        data_parallel_rank: None,
                    });
                }
            }
            Ev::Reject { i, fast } => {
                if let Some(i) = pick(*i, self.ready.len()) {
                    let h = self.ready.remove(i);
                    let notice = RejectionNotice {
                        params: h.params,
                        data_parallel_rank: None,
                        rejected_at_unix_us: None,
                        trace: Default::default(),
                    };
                    // `EngineCore::notice_now`: beside a running step, straight to the worker; or
                    // the worker did not take it, and it goes with the next step's metadata.
                    if let Some(meta) = self.d.notice(notice)? {
                        if *fast {
                            self.d_worker_start(&meta)?;
                        } else {
                            self.d.state.inbox.undelivered_recvs.extend(meta.reqs_to_recv);
                        }
                    }
                }
            }
            Ev::Release { i } => {
                if let Some(i) = pick(*i, self.ready.len()) {
                    let h = self.ready.remove(i);
                    // P's engine: a release of blocks it holds is an abort after finish.
                    if self.p.sched().holds(&h.id) {
                        self.p.state.inbox.aborts.push(h.id);
                    }
                }
            }
            Ev::Lose { i } => {
                if let Some(i) = pick(*i, self.ready.len()) {
                    self.ready.remove(i);
                }
            }
            Ev::AbortP { i } => {
                if let Some(i) = pick(*i, self.ids.len()) {
                    self.p.state.inbox.aborts.push(self.ids[i].clone());
                }
            }
            Ev::AbortD { i } => {
                if let Some(i) = pick(*i, self.ids.len()) {
                    self.d.state.inbox.aborts.push(self.ids[i].clone());
                }
            }
            Ev::Lease { k } => {
                if let Some(k) = pick(*k, self.inflight.len()) {
                    self.lease(k)?;
                }
            }
            Ev::Read { k, tcp } => {
                if let Some(k) = pick(*k, self.inflight.len()) {
                    self.read(k, *tcp)?;
                }
            }
            Ev::ReadDone { k } => {
                if let Some(k) = pick(*k, self.inflight.len()) {
                    self.read_done(k)?;
                }
            }
            Ev::TransferFail { k } => {
                if let Some(k) = pick(*k, self.inflight.len()) {
                    if self.inflight[k].lease.is_some() {
                        // The READ fails under the lease.
                        self.read_answer(k, Some(FailureKind::Read))?;
                    } else {
                        // The lease request goes unanswered (P's side channel went silent), and
                        // the second handshake that follows fails: P cannot be reached.
                        let recv = self.inflight[k].id;
                        let next = match self.consumer.on_lease(recv, Err(TransferError::Timeout(LEASE_TTL))) {
                            Next::Act(Action::Handshake { stale: true, .. }) => {
                                self.consumer.on_handshake(recv, Err("P unreachable".into()))
                            }
                            other => other,
                        };
                        self.drive(recv, next)?;
                    }
                }
            }
            Ev::DupReadDone { i } => {
                if let Some(i) = pick(*i, self.done_leases.len()) {
                    let (p_id, lease) = self.done_leases[i].clone();
                    let outcome = self.table.read_done(&p_id, lease, "d/0", self.now);
                    prop_assert_ne!(outcome, NoticeOutcome::Released, "a duplicate read done released {}", p_id);
                }
            }
            Ev::Heartbeat => {
                let ids = self.heartbeat.clone();
                self.table.heartbeat(&ids, self.now);
            }
            Ev::Deliver { i } => {
                if let Some(i) = pick(*i, self.outbox.len()) {
                    self.deliver(i)?;
                }
            }
            Ev::Advance { ms } => {
                self.now += Duration::from_millis(*ms);
                // The engines' clock moved: their next steps ask the connector for metadata
                // even when nothing else would (D64); in between, quiet steps skip the round.
                self.p.state.force_meta = true;
                self.d.state.force_meta = true;
            }
            Ev::WorkerLost { p, stale_step } => self.worker_lost(if *p { Side::P } else { Side::D }, *stale_step)?,
            Ev::WorkerSeen { p } => self.worker_seen(if *p { Side::P } else { Side::D }),
        }
        self.check()
    }

    /// The invariants that hold after every event.
    fn check(&self) -> Result<(), TestCaseError> {
        for (name, n) in [("P", &self.p), ("D", &self.d)] {
            prop_assert_eq!(n.sched().double_frees(), 0, "{} freed a block twice", name);
            let kv = n.sched().kv_usage();
            prop_assert_eq!(kv.free_blocks + kv.used_blocks + kv.held_blocks, kv.total_blocks, "{} {:?}", name, kv);
        }
        for (id, v) in &self.leases {
            if self.now >= v.deadline {
                continue; // P may take the blocks back at its next step
            }
            for &(b, g) in &v.blocks {
                let (alloc, gen) = self.p.sched().block_state(b);
                prop_assert!(
                    alloc && gen == Some(g),
                    "P freed or reused block {} of {} under active lease {}",
                    b,
                    v.p_id,
                    id
                );
            }
        }
        for r in self.inflight.iter().chain(self.settled.iter().map(|(r, _)| r)) {
            for (b, g) in r.local.iter().zip(&r.local_gens) {
                let (alloc, gen) = self.d.sched().block_state(*b);
                prop_assert!(
                    alloc && gen == Some(*g),
                    "D freed block {} of {} while its receive was unsettled",
                    b,
                    r.d_id
                );
            }
        }
        Ok(())
    }

    /// Stop sending, let every deadline pass, let D's READs end, step both engines until
    /// nothing is left; then everything must be free.
    fn quiesce(&mut self, deliver_notices: bool) -> Result<(), TestCaseError> {
        for _ in 0..200 {
            self.ready.clear(); // the router's last hand-offs are lost
            if deliver_notices {
                while !self.outbox.is_empty() {
                    self.deliver(0)?;
                }
            } else {
                self.outbox.clear();
            }
            self.now += HOLD + LEASE_TTL + HEARTBEAT_EXTENSION;
            let mut rounds = 0;
            while !self.inflight.is_empty() {
                rounds += 1;
                prop_assert!(rounds < 1000, "D's receive makes no progress: {:?}", self.inflight.first());
                self.lease(0)?;
                if self.inflight.first().is_some_and(|r| r.parked.is_some()) {
                    // Parked just now, and P's worker steps no more in this loop: its wait ends.
                    self.now += EARLY_WAIT;
                    self.answer_parked()?;
                }
                if self.inflight.first().is_some_and(|r| r.lease.is_some()) {
                    self.read_done(0)?;
                }
            }
            // The engines' `WorkerInfo` queries answer in the end.
            self.worker_seen(Side::P);
            self.worker_seen(Side::D);
            self.step(Side::P, Pass::Runs)?;
            self.step(Side::D, Pass::Runs)?;
            self.check()?;
            let quiet = self.p.quiet()
                && self.d.quiet()
                && self.inflight.is_empty()
                && self.settled.is_empty()
                && self.ready.is_empty()
                && self.table.is_empty();
            if quiet {
                break;
            }
        }
        for (name, n) in [("P", &self.p), ("D", &self.d)] {
            let kv = n.sched().kv_usage();
            prop_assert_eq!(kv.free_blocks, kv.total_blocks, "{} still owns blocks at quiescence: {:?}", name, kv);
            prop_assert!(!n.sched().has_requests(), "{} still has requests", name);
            for (id, admitted) in &n.admitted {
                prop_assert_eq!(
                    n.finished_calls.get(id).copied().unwrap_or(0),
                    *admitted,
                    "{}: request_finished once per admission of {}",
                    name,
                    id
                );
            }
            prop_assert_eq!(
                n.sched().counters().request_finished_calls,
                n.admitted.values().map(|&a| u64::from(a)).sum::<u64>()
            );
        }
        prop_assert!(self.table.is_empty(), "P's hold table is not empty");
        prop_assert_eq!(self.table.leased_blocks(), 0);
        prop_assert_eq!(self.consumer.receives(), 0, "D's worker still runs receives");
        prop_assert_eq!(self.consumer.pending(), 0, "D's worker still owes the engine a receive");
        // The test performed only what the machine asked, in its order.
        prop_assert_eq!(self.consumer.counters().unexpected_events, 0);
        Ok(())
    }
}

/// Runs `cases` random cases; returns how many events they applied. A failure panics with
/// proptest's minimal failing input.
fn run_cases(cases: u32) -> u64 {
    use proptest::test_runner::{Config, TestRunner};
    let applied = std::cell::Cell::new(0u64);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let strategy =
        (proptest::collection::vec(ev(), 1..160), any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>());
    let result = runner.run(&strategy, |(events, recompute, deliver_notices, p_caching, reserve)| {
        let mut w = World::new(recompute, p_caching, reserve);
        for e in &events {
            w.apply(e)?;
        }
        w.quiesce(deliver_notices)?;
        applied.set(applied.get() + events.len() as u64);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    applied.get()
}

#[test]
fn p_and_d_keep_r2_r4_r5_under_random_interleavings() {
    let cases = cases();
    let started = Instant::now();
    let events = run_cases(cases);
    eprintln!(
        "lifecycle property: {cases} cases, {events} events, every invariant held, {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// The property needs the interleavings it is about to happen: over a fixed set of cases,
/// leases are granted, confirmed reads release, aborts and give-ups meet active leases, and
/// holds expire.
#[test]
fn the_generator_reaches_the_race_windows() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]));
    let mut totals = pdmesh_kv_transfer::HoldCounters::default();
    let (mut p_finished, mut d_finished) = (0, 0);
    let (mut reused, mut refused_p, mut refused_d, mut stale) = (0, 0, 0, 0);
    let (mut saved, mut loaded, mut checked, mut extra_saves) = (0, 0, 0, 0);
    let (mut p_hits, mut d_hits, mut evictions, mut partial_reads) = (0, 0, 0, 0);
    let (mut early_granted, mut early_refused) = (0, 0);
    let (mut p_restarts, mut d_restarts, mut stale_steps, mut lost, mut reads_across) = (0, 0, 0, 0, 0);
    for case in 0..400 {
        let events = proptest::collection::vec(ev(), 1..160).new_tree(&mut runner).unwrap().current();
        let mut w = World::new(false, case % 2 == 0, case % 3 == 0);
        for e in &events {
            w.apply(e).unwrap();
        }
        w.quiesce(false).unwrap();
        for c in w.retired_tables.iter().chain([w.table.counters()]) {
            totals.leases_granted += c.leases_granted;
            totals.read_done += c.read_done;
            totals.aborts_deferred += c.aborts_deferred;
            totals.give_ups += c.give_ups;
            totals.expired_holds += c.expired_holds;
            totals.expired_leases += c.expired_leases;
            totals.stale_read_done += c.stale_read_done + c.unknown_read_done + c.duplicate_read_done;
            totals.aborts += c.aborts;
            totals.leases_parked += c.leases_parked;
            totals.parked_timed_out += c.parked_timed_out;
            totals.tombstones += c.tombstones;
            totals.tombstone_releases += c.tombstone_releases;
        }
        early_granted += w.early_granted;
        // Every node starts its first worker process as a "restart" of none.
        p_restarts += w.p.restarts - 1;
        d_restarts += w.d.restarts - 1;
        stale_steps += w.stale_steps_refused;
        lost += w.requests_lost_to_restarts;
        reads_across += w.reads_across_p_restart;
        early_refused += w.early_refused;
        p_finished += w.p.sched().counters().request_finished_calls;
        d_finished += w.d.sched().counters().request_finished_calls;
        reused += w.reused_ids;
        stale += w.stale_notices_refused;
        refused_p += w.p.refused;
        refused_d += w.d.refused;
        p_hits += w.p.sched().counters().prefix_cache_hits;
        d_hits += w.d.sched().counters().prefix_cache_hits;
        evictions += w.p.sched().cache_counters().evictions + w.d.sched().cache_counters().evictions;
        partial_reads += w.partial_reads;
        for n in [&w.p, &w.d] {
            saved += n.store.counters.blocks_saved;
            loaded += n.store.counters.blocks_loaded;
            checked += n.offload_blocks_checked;
            extra_saves += n.extra_saves;
        }
    }
    eprintln!(
        "{totals:?}; request_finished P {p_finished} D {d_finished}; reused ids {reused}, refused by P's engine \
         {refused_p}, by D's {refused_d}; stale give-ups refused by their token {stale}; offload: blocks saved \
         {saved}, loaded {loaded}, loaded and read right by the model {checked}, requests two children delayed \
         {extra_saves}; prefix cache: tokens hit on P {p_hits}, on D {d_hits}, blocks evicted {evictions}, \
         partial reads {partial_reads}; leases parked before their hold registered: granted {early_granted}, \
         refused {early_refused}; worker restarts P {p_restarts} D {d_restarts}, stale steps refused \
         {stale_steps}, requests failed by a restart {lost}, READs under a lease of a P worker that restarted \
         {reads_across}"
    );
    for (what, n) in [
        ("reused request ids", reused),
        ("refusals inside P's engine (reused ids)", refused_p),
        ("refusals inside D's engine", refused_d),
        ("give-ups for a reused id refused by their old token", stale),
        ("blocks saved to the offload store", saved),
        ("blocks loaded back from the offload store", loaded),
        ("loaded blocks the model read", checked),
        ("requests both children delayed (held for D while saved)", extra_saves),
        ("prefix-cache hits on P", p_hits),
        ("prefix-cache hits on D", d_hits),
        ("prefix-cache evictions", evictions),
        ("partial reads (D read only what its cache lacked)", partial_reads),
        ("leases granted", totals.leases_granted),
        ("confirmed reads", totals.read_done),
        ("aborts after finish", totals.aborts),
        ("aborts deferred by a lease", totals.aborts_deferred),
        ("give-ups", totals.give_ups),
        ("holds expired", totals.expired_holds),
        ("leases expired", totals.expired_leases),
        ("late or stale read done", totals.stale_read_done),
        // P answers before its worker registers the hold (D65): the windows that opens.
        ("leases asked before their hold registered", totals.leases_parked),
        ("parked leases granted once their hold registered", early_granted),
        ("parked leases refused (their wait ended, or the checks refused)", early_refused),
        ("give-ups before their hold registered, remembered", totals.tombstones),
        ("holds released as they registered, by a give-up that came first", totals.tombstone_releases),
        ("P worker restarts", u64::from(p_restarts)),
        ("D worker restarts", u64::from(d_restarts)),
        ("steps a restarted worker refused (built for the old process)", stale_steps),
        ("requests failed because their worker restarted", lost),
        ("READs in flight under a lease of a P worker that restarted", reads_across),
    ] {
        assert!(n > 0, "no {what} in 400 cases: {totals:?}");
    }
}
