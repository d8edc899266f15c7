//! P's record of blocks held for remote readers, and the read-lease rules (LIFECYCLE.md R2, R5).
//!
//! The side channel asks a [`LeasePolicy`] whether D may read; the connector-worker decides.
//! [`HoldTable`] is the implementation the worker uses: it knows which requests P holds
//! (`hold`), hands out at most one read lease per request, and releases each request exactly
//! once — on `read done`, `give up` or `abort` (at once when no lease is active, otherwise when
//! the lease ends), or when its hold deadline or lease deadline passes (`expire`). Released
//! requests are reported once through [`HoldTable::take_finished_sending`]; only then does the
//! scheduler free their blocks, so a block is never freed twice and never freed while leased.
//!
//! Every method takes `now` (or a deadline) instead of reading a clock, so tests drive time.
//! Unknown, duplicate or late notices are counted in [`HoldCounters`], never a panic.
//!
//! P answers in the step that finishes its prefill, one step before its worker registers the
//! hold (docs/DECISIONS.md D65), so a reader can be early. A lease asked for a request the table
//! does not know is *parked* ([`LeasePolicy::grant_or_park`]) and answered by
//! [`LeasePolicy::take_parked_answers`] once the hold registers (through the normal checks) or
//! when [`HoldTableConfig::early_wait`] ends ("not held", as before). A give-up for a request
//! the table does not know leaves a *tombstone* keyed by the request's capability token: a hold
//! that registers later under that token is released at once (R4) instead of at its deadline.
//! Both are bounded in count and in time, so a peer cannot grow P's memory with them.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_protocol::LeaseRefusalReason;
use tokio::sync::Notify;

/// A granted read lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseGrant {
    pub lease_id: u64,
    /// Time left on the lease from the moment of the grant.
    pub ttl: Duration,
}

/// Why a lease (or a read under one) is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("lease refused ({reason:?}): {detail}")]
pub struct LeaseRefusal {
    pub reason: LeaseRefusalReason,
    pub detail: String,
}

impl LeaseRefusal {
    pub fn new(reason: LeaseRefusalReason, detail: impl Into<String>) -> Self {
        Self { reason, detail: detail.into() }
    }

    /// The refusal of a lease for a request P does not hold. A wrong capability token gets this
    /// very refusal, so a prober cannot tell a held request from an unknown one.
    pub fn not_held(p_request_id: &str) -> Self {
        Self::new(LeaseRefusalReason::Gone, format!("request {p_request_id} is not held"))
    }

    /// The refusal of a read under a lease that is not the request's active lease (also what a
    /// wrong capability token gets).
    pub fn not_active_lease(p_request_id: &str, lease_id: u64) -> Self {
        Self::new(
            LeaseRefusalReason::LeaseInvalid,
            format!("lease {lease_id} is not an active lease of {p_request_id}"),
        )
    }
}

/// What a lease request got from [`LeasePolicy::grant_or_park`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseDecision {
    Granted(LeaseGrant),
    Refused(LeaseRefusal),
    /// The request is not held yet: the request waits under this ticket for the hold to
    /// register; [`LeasePolicy::take_parked_answers`] answers it.
    Parked(u64),
}

impl From<Result<LeaseGrant, LeaseRefusal>> for LeaseDecision {
    fn from(r: Result<LeaseGrant, LeaseRefusal>) -> Self {
        match r {
            Ok(g) => Self::Granted(g),
            Err(e) => Self::Refused(e),
        }
    }
}

/// The answer to a parked lease request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedAnswer {
    pub ticket: u64,
    pub p_request_id: String,
    pub result: Result<LeaseGrant, LeaseRefusal>,
    /// The hold registered under another capability token than the one the request presented:
    /// refused exactly as an unknown request, and counted as a capability refusal.
    pub capability_refused: bool,
}

/// Whether a message may touch a held request: does it carry the request's capability token?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapabilityCheck {
    /// The token matches the one the request is held under.
    Match,
    /// The request is held, and the token is wrong (or the hold has none): refuse exactly as
    /// for an unknown request, and count.
    Mismatch,
    /// The request is not held: the policy's own unknown-request answer applies.
    NotHeld,
}

/// What became of a `read done`, `give up` or `abort`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoticeOutcome {
    /// The request was released now (it is in the next `take_finished_sending`).
    Released,
    /// An active lease protects the blocks; the request is released when that lease ends.
    Deferred,
    /// The request was already released: a duplicate or late notice (counted).
    AlreadyReleased,
    /// The request is not known here (never held, or released long ago) (counted).
    Unknown,
    /// The request is held, but the notice names a lease that is not its active lease; nothing
    /// changes (counted). For `read done` this means the read cannot be trusted.
    StaleLease,
    /// The request was already aborted and waits for its lease to end (counted).
    AlreadyAborted,
}

/// The decision P's side channel delegates to the connector-worker. Calls come from the side
/// channel's tasks, under a mutex ([`SharedPolicy`]), so they must be quick and never block.
pub trait LeasePolicy: Send {
    /// May `consumer` read these blocks (ids and generations as P handed them out: all of the
    /// held blocks, or a tail of them when D has the rest in its prefix cache)?
    fn grant(
        &mut self,
        p_request_id: &str,
        block_ids: &[u32],
        generations: &[u64],
        consumer: &str,
        now: Instant,
    ) -> Result<LeaseGrant, LeaseRefusal>;

    /// Is a read of `block_ids` under `lease_id` allowed right now? (The TCP backend asks
    /// before it streams a single byte.)
    fn check_read(
        &self,
        p_request_id: &str,
        lease_id: u64,
        block_ids: &[u32],
        now: Instant,
    ) -> Result<(), LeaseRefusal>;

    /// The consumer finished reading under `lease_id`. [`NoticeOutcome::Released`] means the
    /// lease held until now, so what was read is what P held.
    fn read_done(&mut self, p_request_id: &str, lease_id: u64, consumer: &str, now: Instant) -> NoticeOutcome;

    /// The consumer will never read `p_request_id`.
    fn give_up(&mut self, p_request_id: &str, lease_id: Option<u64>, consumer: &str, now: Instant) -> NoticeOutcome;

    /// The consumer still intends to read these requests. Returns how many were extended.
    fn heartbeat(&mut self, p_request_ids: &[String], now: Instant) -> usize;

    /// Does `presented` match the capability token `p_request_id` is held under (compared in
    /// constant time)? The side channel and the block server ask before every other call for
    /// a request, under the same lock, so a message without the token never reaches the
    /// lease rules.
    fn capability(&self, p_request_id: &str, presented: &str) -> CapabilityCheck;

    /// [`Self::grant`], except that a request the policy does not know (yet) may be parked
    /// until its hold registers. `capability` is the token the request presented (already
    /// checked against a held request's by the caller); a parked request's answer checks it
    /// against the hold that registers. A policy without parking only grants or refuses.
    #[allow(clippy::too_many_arguments)] // the lease request's fields, each used once
    fn grant_or_park(
        &mut self,
        p_request_id: &str,
        block_ids: &[u32],
        generations: &[u64],
        consumer: &str,
        capability: &str,
        now: Instant,
    ) -> LeaseDecision {
        let _ = capability;
        self.grant(p_request_id, block_ids, generations, consumer, now).into()
    }

    /// The answers of parked lease requests that can be answered at `now`: their hold
    /// registered (granted or refused by the normal checks), or their wait ended ("not held").
    fn take_parked_answers(&mut self, now: Instant) -> Vec<ParkedAnswer> {
        let _ = now;
        Vec::new()
    }

    /// When the oldest parked lease request's wait ends (the side channel answers it then).
    fn next_parked_deadline(&self) -> Option<Instant> {
        None
    }

    /// Signalled when a hold registers for a parked lease request, so the side channel answers
    /// it at once (a permit is kept if nobody waits, so no signal is lost).
    fn parked_wakeup(&self) -> Option<Arc<Notify>> {
        None
    }

    /// [`Self::give_up`] with the capability token the give-up presented: a policy that parks
    /// may remember a give-up for a request it does not hold yet, so that the hold is released
    /// as soon as it registers under that token.
    fn give_up_with_capability(
        &mut self,
        p_request_id: &str,
        lease_id: Option<u64>,
        consumer: &str,
        capability: &str,
        now: Instant,
    ) -> NoticeOutcome {
        let _ = capability;
        self.give_up(p_request_id, lease_id, consumer, now)
    }
}

/// How the side channel shares the policy with its owner.
pub type SharedPolicy = Arc<Mutex<dyn LeasePolicy>>;

/// Timing knobs of a [`HoldTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldTableConfig {
    /// How long a lease lasts; a reader that neither finishes nor gives up within it loses the
    /// blocks (they are released on the next `expire`).
    pub lease_ttl: Duration,
    /// A heartbeat sets the hold deadline to at least `now + heartbeat_extension`
    /// (vLLM's `kv_lease_duration`, 30 s).
    pub heartbeat_extension: Duration,
    /// How long a lease request for a request not held yet waits for its hold to register
    /// (P answers one step before its worker registers the hold, D65), and how long a give-up
    /// for such a request is remembered. Zero: neither waits (refused as "not held" at once).
    pub early_wait: Duration,
}

/// [`HoldTableConfig::early_wait`] unless configured (`kv_transfer.kv_early_lease_wait_ms`).
pub const DEFAULT_EARLY_WAIT: Duration = Duration::from_secs(1);

impl Default for HoldTableConfig {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(10),
            heartbeat_extension: Duration::from_secs(30),
            early_wait: DEFAULT_EARLY_WAIT,
        }
    }
}

/// Counts of everything that happened, including the anomalies R2 asks to count, not crash on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HoldCounters {
    pub holds: u64,
    pub duplicate_holds: u64,
    pub leases_granted: u64,
    pub lease_regrants: u64,
    pub leases_refused: u64,
    pub reads_refused: u64,
    pub read_done: u64,
    pub duplicate_read_done: u64,
    pub unknown_read_done: u64,
    pub stale_read_done: u64,
    pub aborts: u64,
    pub aborts_deferred: u64,
    pub duplicate_aborts: u64,
    pub unknown_aborts: u64,
    pub give_ups: u64,
    pub give_ups_deferred: u64,
    pub duplicate_give_ups: u64,
    pub unknown_give_ups: u64,
    pub heartbeats: u64,
    pub unknown_heartbeats: u64,
    pub expired_holds: u64,
    pub expired_leases: u64,
    pub released: u64,
    /// Lease requests for a request not held yet, parked until its hold registers (D65).
    pub leases_parked: u64,
    /// Parked lease requests answered after their hold registered (granted or refused).
    pub parked_answered: u64,
    /// Parked lease requests whose wait ended without a hold: refused as not held.
    pub parked_timed_out: u64,
    /// Lease requests not parked because the parking bounds were reached (refused as not held).
    pub parked_full: u64,
    /// Give-ups for a request not held (yet), remembered until a hold registers or the wait ends.
    pub tombstones: u64,
    /// Holds released as they registered, by a remembered give-up under their token (R4).
    pub tombstone_releases: u64,
    /// Give-ups not remembered because the bounds were reached (the hold deadline frees).
    pub tombstones_dropped: u64,
    /// Block-milliseconds held, by what released the hold (R1/R2/R4 measure: what a deadline
    /// strands is the `expired` share; notices move it to `given_up`/`aborted`).
    pub held_block_ms: HeldBlockMs,
}

/// Block-milliseconds of released holds, by release cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldBlockMs {
    /// Released on `read done` (the normal path).
    pub read_done: u64,
    /// Released on D's `give up` (rejection, abort, failed load, shutdown).
    pub given_up: u64,
    /// Released on an abort on P.
    pub aborted: u64,
    /// Released at the hold or lease deadline.
    pub expired: u64,
}

/// One held request, for the debug endpoint and metrics (R5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldInfo {
    pub request_id: String,
    pub blocks: usize,
    pub age: Duration,
    pub leased: bool,
    pub aborted: bool,
}

#[derive(Debug, Clone)]
struct ActiveLease {
    lease_id: u64,
    consumer: String,
    deadline: Instant,
}

#[derive(Debug, Clone)]
struct Hold {
    seq: u64,
    block_ids: Vec<u32>,
    generations: Vec<u64>,
    deadline: Instant,
    held_since: Instant,
    lease: Option<ActiveLease>,
    /// Aborted or given up while someone else's lease was active: no new lease, released when
    /// the lease ends.
    aborted: bool,
    /// The capability token D must present (empty: none was given, and no remote message can
    /// touch the hold).
    capability: String,
}

/// How many released ids are remembered to tell a duplicate notice from an unknown one.
const RECENT_RELEASED: usize = 16_384;

/// At most this many lease requests wait for their hold at once; beyond, a lease for an unknown
/// request is refused at once, as before parking existed.
pub const MAX_PARKED: usize = 1024;
/// At most this many blocks named by waiting lease requests together (a request names up to a
/// whole prompt's blocks; this bounds the memory a peer can make P keep, ~3 MiB).
pub const MAX_PARKED_BLOCKS: usize = 262_144;
/// At most this many remembered give-ups; beyond, the oldest is forgotten (its hold, if it
/// ever registers, is freed by its deadline instead).
pub const MAX_TOMBSTONES: usize = 1024;
/// Request ids, capability tokens and consumer names longer than this are never parked or
/// remembered (real ones are far shorter).
const MAX_PARKED_STR: usize = 256;

/// A lease request waiting for its hold to register.
#[derive(Debug, Clone)]
struct ParkedLease {
    ticket: u64,
    request_id: String,
    block_ids: Vec<u32>,
    generations: Vec<u64>,
    consumer: String,
    capability: String,
    until: Instant,
}

/// A give-up for a request not held when it arrived.
#[derive(Debug, Clone)]
struct Tombstone {
    request_id: String,
    capability: String,
    until: Instant,
}

/// P's held requests and their leases. See the module doc for the rules.
#[derive(Debug)]
pub struct HoldTable {
    config: HoldTableConfig,
    holds: HashMap<String, Hold>,
    /// Insertion order, for the oldest-first sweep.
    order: BTreeMap<u64, String>,
    /// Active lease id → request id.
    leases: HashMap<u64, String>,
    next_seq: u64,
    next_lease_id: u64,
    finished: Vec<String>,
    /// Why each of `finished` was released (same order): `read_done`, `given_up`, `aborted`,
    /// `expired` — for the release's trace event and logs.
    finished_causes: Vec<&'static str>,
    recent: VecDeque<String>,
    recent_set: HashSet<String>,
    counters: HoldCounters,
    /// Lease requests waiting for their hold, oldest first.
    parked: VecDeque<ParkedLease>,
    parked_blocks: usize,
    next_ticket: u64,
    /// Give-ups that arrived before their hold, oldest first.
    tombstones: VecDeque<Tombstone>,
    wakeup: Arc<Notify>,
}

/// Why a request was released (for logs).
#[derive(Debug, Clone, Copy)]
enum Cause {
    ReadDone,
    GiveUp,
    Abort,
    HoldExpired,
    LeaseExpired,
}

impl HoldTable {
    pub fn new(config: HoldTableConfig) -> Self {
        Self {
            config,
            holds: HashMap::new(),
            order: BTreeMap::new(),
            leases: HashMap::new(),
            next_seq: 0,
            // A random base: a lease id from before a restart never names a lease of this
            // incarnation (a read also names its request, checked too).
            next_lease_id: (rand::random::<u64>() >> 16).max(1),
            finished: Vec::new(),
            finished_causes: Vec::new(),
            recent: VecDeque::new(),
            recent_set: HashSet::new(),
            counters: HoldCounters::default(),
            parked: VecDeque::new(),
            parked_blocks: 0,
            next_ticket: 1,
            tombstones: VecDeque::new(),
            wakeup: Arc::new(Notify::new()),
        }
    }

    pub fn config(&self) -> &HoldTableConfig {
        &self.config
    }

    /// Record that P holds `block_ids` (with their `generations`) of `request_id` for a remote
    /// reader until `deadline` (extended by heartbeats). Returns false (and counts) when the
    /// request is already held: `request_finished` runs once per request, so that is a bug
    /// upstream, and the first hold stands.
    ///
    /// A hold made here has no capability token, so no remote message can touch it (only P's own
    /// abort and expiry end it); the worker holds with [`Self::hold_with_capability`].
    pub fn hold(&mut self, request_id: &str, block_ids: Vec<u32>, generations: Vec<u64>, deadline: Instant) -> bool {
        self.hold_with_capability(request_id, block_ids, generations, deadline, String::new())
    }

    /// [`Self::hold`] under the capability token P handed out in the request's
    /// `kv_transfer_params`: every lease, read and notice for the request must carry it.
    pub fn hold_with_capability(
        &mut self,
        request_id: &str,
        block_ids: Vec<u32>,
        generations: Vec<u64>,
        deadline: Instant,
        capability: String,
    ) -> bool {
        if self.holds.contains_key(request_id) {
            self.counters.duplicate_holds += 1;
            tracing::warn!(request_id, "request already held; keeping the first hold");
            return false;
        }
        if self.recent_set.remove(request_id) {
            self.recent.retain(|r| r != request_id);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order.insert(seq, request_id.to_string());
        self.holds.insert(
            request_id.to_string(),
            Hold {
                seq,
                block_ids,
                generations,
                deadline,
                held_since: Instant::now(),
                lease: None,
                aborted: false,
                capability,
            },
        );
        self.counters.holds += 1;
        self.on_registered(request_id);
        true
    }

    /// A hold just registered: a give-up that came first under its token releases it now (R4:
    /// no lease can exist yet, so freeing is safe, R5); a lease request that came first is
    /// signalled to the side channel, which answers it through the normal checks.
    fn on_registered(&mut self, request_id: &str) {
        let Some(capability) = self.holds.get(request_id).map(|h| h.capability.clone()) else { return };
        let remembered = self.tombstones.iter().position(|t| {
            t.request_id == request_id && pdmesh_mesh_auth::capability_matches(&capability, &t.capability)
        });
        if let Some(pos) = remembered {
            self.tombstones.remove(pos);
            self.counters.give_ups += 1;
            self.counters.tombstone_releases += 1;
            tracing::debug!(request_id, "hold released as it registered: its reader gave up first");
            self.release(request_id, Cause::GiveUp, Instant::now());
        }
        if self.parked.iter().any(|p| p.request_id == request_id) {
            self.wakeup.notify_one();
        }
    }

    /// Lease requests waiting for their hold.
    pub fn parked_len(&self) -> usize {
        self.parked.len()
    }

    /// Give-ups remembered for holds not registered yet.
    pub fn tombstones_len(&self) -> usize {
        self.tombstones.len()
    }

    /// Forget remembered give-ups whose wait ended.
    fn prune_tombstones(&mut self, now: Instant) {
        self.tombstones.retain(|t| t.until > now);
    }

    /// Remember a give-up for a request not held (yet), within the bounds.
    fn remember_give_up(&mut self, request_id: &str, capability: &str, now: Instant) {
        if self.config.early_wait.is_zero()
            || capability.is_empty()
            || request_id.len() > MAX_PARKED_STR
            || capability.len() > MAX_PARKED_STR
        {
            return;
        }
        let until = now + self.config.early_wait;
        if let Some(t) = self.tombstones.iter_mut().find(|t| t.request_id == request_id && t.capability == capability) {
            t.until = until; // a duplicate (another rank's copy of the same notice)
            return;
        }
        self.prune_tombstones(now);
        if self.tombstones.len() >= MAX_TOMBSTONES {
            self.tombstones.pop_front();
            self.counters.tombstones_dropped += 1;
        }
        self.tombstones.push_back(Tombstone {
            request_id: request_id.to_string(),
            capability: capability.to_string(),
            until,
        });
        self.counters.tombstones += 1;
    }

    /// The request was aborted on P (R2): released at once when no lease is active, else when
    /// the lease ends (read done or expiry). A later lease request is refused.
    pub fn abort(&mut self, request_id: &str) -> NoticeOutcome {
        let Some(hold) = self.holds.get_mut(request_id) else {
            return self.not_held(request_id, "abort");
        };
        if hold.aborted {
            self.counters.duplicate_aborts += 1;
            return NoticeOutcome::AlreadyAborted;
        }
        self.counters.aborts += 1;
        if hold.lease.is_some() {
            hold.aborted = true;
            self.counters.aborts_deferred += 1;
            NoticeOutcome::Deferred
        } else {
            self.release(request_id, Cause::Abort, Instant::now());
            NoticeOutcome::Released
        }
    }

    /// Release every hold whose deadline passed (no active lease) and every request whose
    /// lease deadline passed, oldest hold first. Returns how many were released.
    pub fn expire(&mut self, now: Instant) -> usize {
        self.prune_tombstones(now);
        let due: Vec<(String, Cause)> = self
            .order
            .values()
            .filter_map(|id| {
                let hold = self.holds.get(id)?;
                match &hold.lease {
                    Some(lease) if lease.deadline <= now => Some((id.clone(), Cause::LeaseExpired)),
                    Some(_) => None,
                    None if hold.deadline <= now => Some((id.clone(), Cause::HoldExpired)),
                    None => None,
                }
            })
            .collect();
        for (id, cause) in &due {
            match cause {
                Cause::LeaseExpired => self.counters.expired_leases += 1,
                _ => self.counters.expired_holds += 1,
            }
            self.release(id, *cause, now);
        }
        due.len()
    }

    /// The engine that owned every held block is gone (it restarted: its block pool starts
    /// empty and may hand these blocks to new requests at once). Release every hold now,
    /// leased ones included — a reader's later `read done` is then refused as stale, so D never
    /// uses bytes the new engine may have overwritten — and forget the releases not yet
    /// reported: no engine knows those requests any more. Returns how many were released.
    pub fn release_all(&mut self, now: Instant) -> usize {
        let ids: Vec<String> = self.order.values().cloned().collect();
        for id in &ids {
            self.counters.aborts += 1;
            self.release(id, Cause::Abort, now);
        }
        self.finished.clear();
        ids.len()
    }

    /// Requests released since the last call, each exactly once, in release order.
    pub fn take_finished_sending(&mut self) -> Vec<String> {
        self.finished_causes.clear();
        std::mem::take(&mut self.finished)
    }

    /// [`Self::take_finished_sending`] with why each was released (`read_done`, `given_up`,
    /// `aborted` or `expired`).
    pub fn take_finished_sending_with_causes(&mut self) -> Vec<(String, &'static str)> {
        let causes = std::mem::take(&mut self.finished_causes);
        std::mem::take(&mut self.finished).into_iter().zip(causes).collect()
    }

    pub fn counters(&self) -> &HoldCounters {
        &self.counters
    }

    pub fn is_held(&self, request_id: &str) -> bool {
        self.holds.contains_key(request_id)
    }

    /// The active lease of a held request.
    pub fn lease_of(&self, request_id: &str) -> Option<u64> {
        self.holds.get(request_id).and_then(|h| h.lease.as_ref()).map(|l| l.lease_id)
    }

    /// Number of held requests (leased or not).
    pub fn len(&self) -> usize {
        self.holds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.holds.is_empty()
    }

    /// Blocks held for remote readers, leased ones included.
    pub fn held_blocks(&self) -> usize {
        self.holds.values().map(|h| h.block_ids.len()).sum()
    }

    /// Blocks under an active lease.
    pub fn leased_blocks(&self) -> usize {
        self.holds.values().filter(|h| h.lease.is_some()).map(|h| h.block_ids.len()).sum()
    }

    /// Held requests, oldest first.
    pub fn held_requests(&self, now: Instant) -> Vec<HeldInfo> {
        self.order
            .values()
            .filter_map(|id| {
                let h = self.holds.get(id)?;
                Some(HeldInfo {
                    request_id: id.clone(),
                    blocks: h.block_ids.len(),
                    age: now.saturating_duration_since(h.held_since),
                    leased: h.lease.is_some(),
                    aborted: h.aborted,
                })
            })
            .collect()
    }

    fn not_held(&mut self, request_id: &str, what: &'static str) -> NoticeOutcome {
        let late = self.recent_set.contains(request_id);
        let c = &mut self.counters;
        let (dup, unknown) = match what {
            "read_done" => (&mut c.duplicate_read_done, &mut c.unknown_read_done),
            "give_up" => (&mut c.duplicate_give_ups, &mut c.unknown_give_ups),
            _ => (&mut c.duplicate_aborts, &mut c.unknown_aborts),
        };
        if late {
            *dup += 1;
            tracing::debug!(request_id, what, "notice for an already released request");
            NoticeOutcome::AlreadyReleased
        } else {
            *unknown += 1;
            tracing::warn!(request_id, what, "notice for an unknown request");
            NoticeOutcome::Unknown
        }
    }

    fn release(&mut self, request_id: &str, cause: Cause, now: Instant) {
        let Some(hold) = self.holds.remove(request_id) else { return };
        let block_ms = now.saturating_duration_since(hold.held_since).as_millis() as u64 * hold.block_ids.len() as u64;
        let acc = &mut self.counters.held_block_ms;
        let (slot, label) = match cause {
            Cause::ReadDone => (&mut acc.read_done, "read_done"),
            Cause::GiveUp => (&mut acc.given_up, "given_up"),
            Cause::Abort => (&mut acc.aborted, "aborted"),
            Cause::HoldExpired | Cause::LeaseExpired => (&mut acc.expired, "expired"),
        };
        *slot = slot.saturating_add(block_ms);
        self.order.remove(&hold.seq);
        if let Some(lease) = &hold.lease {
            self.leases.remove(&lease.lease_id);
        }
        tracing::debug!(request_id, ?cause, blocks = hold.block_ids.len(), "held blocks released");
        self.counters.released += 1;
        self.finished.push(request_id.to_string());
        self.finished_causes.push(label);
        if self.recent_set.insert(request_id.to_string()) {
            self.recent.push_back(request_id.to_string());
            if self.recent.len() > RECENT_RELEASED {
                if let Some(old) = self.recent.pop_front() {
                    self.recent_set.remove(&old);
                }
            }
        }
    }

    fn refuse(&mut self, reason: LeaseRefusalReason, detail: String) -> Result<LeaseGrant, LeaseRefusal> {
        self.counters.leases_refused += 1;
        Err(LeaseRefusal::new(reason, detail))
    }
}

impl Default for HoldTable {
    fn default() -> Self {
        Self::new(HoldTableConfig::default())
    }
}

impl LeasePolicy for HoldTable {
    fn grant(
        &mut self,
        p_request_id: &str,
        block_ids: &[u32],
        generations: &[u64],
        consumer: &str,
        now: Instant,
    ) -> Result<LeaseGrant, LeaseRefusal> {
        let gone = |what: &str| format!("request {p_request_id} is {what}");
        let Some(hold) = self.holds.get(p_request_id) else {
            if self.recent_set.contains(p_request_id) {
                return self.refuse(LeaseRefusalReason::Gone, gone("already released"));
            }
            self.counters.leases_refused += 1;
            return Err(LeaseRefusal::not_held(p_request_id));
        };
        if hold.aborted {
            return self.refuse(LeaseRefusalReason::Aborted, gone("aborted"));
        }
        // D may ask for a tail of the held blocks: the blocks before it are in its own prefix
        // cache (a partial local hit), so it reads only what it lacks.
        let tail = hold.block_ids.len().checked_sub(block_ids.len()).filter(|_| !block_ids.is_empty());
        let Some(off) = tail.filter(|&off| hold.block_ids.get(off..) == Some(block_ids)) else {
            let detail = format!("held blocks {:?}, asked {:?}", hold.block_ids, block_ids);
            return self.refuse(LeaseRefusalReason::BlockMismatch, detail);
        };
        if hold.generations.get(off..) != Some(generations) {
            let detail = format!("held generations {:?}, asked {:?}", hold.generations, generations);
            return self.refuse(LeaseRefusalReason::GenerationMismatch, detail);
        }
        if let Some(lease) = &hold.lease {
            if lease.consumer == consumer && lease.deadline > now {
                // The same reader asking again (its first answer was lost): same lease.
                let grant = LeaseGrant { lease_id: lease.lease_id, ttl: lease.deadline - now };
                self.counters.lease_regrants += 1;
                return Ok(grant);
            }
            let detail = format!("leased to {}", lease.consumer);
            return self.refuse(LeaseRefusalReason::AlreadyLeased, detail);
        }
        if hold.deadline <= now {
            return self.refuse(LeaseRefusalReason::Gone, gone("past its hold deadline"));
        }
        let lease_id = self.next_lease_id;
        self.next_lease_id = self.next_lease_id.wrapping_add(1).max(1);
        let ttl = self.config.lease_ttl;
        if let Some(hold) = self.holds.get_mut(p_request_id) {
            hold.lease = Some(ActiveLease { lease_id, consumer: consumer.to_string(), deadline: now + ttl });
        }
        self.leases.insert(lease_id, p_request_id.to_string());
        self.counters.leases_granted += 1;
        Ok(LeaseGrant { lease_id, ttl })
    }

    fn check_read(
        &self,
        p_request_id: &str,
        lease_id: u64,
        block_ids: &[u32],
        now: Instant,
    ) -> Result<(), LeaseRefusal> {
        let invalid = |detail: String| Err(LeaseRefusal::new(LeaseRefusalReason::LeaseInvalid, detail));
        if self.leases.get(&lease_id).map(String::as_str) != Some(p_request_id) {
            return Err(LeaseRefusal::not_active_lease(p_request_id, lease_id));
        }
        let Some(hold) = self.holds.get(p_request_id) else {
            return invalid(format!("request {p_request_id} is not held"));
        };
        match &hold.lease {
            Some(l) if l.lease_id == lease_id && l.deadline > now => {}
            _ => return invalid(format!("lease {lease_id} has expired")),
        }
        if let Some(b) = block_ids.iter().find(|b| !hold.block_ids.contains(b)) {
            return invalid(format!("block {b} is not covered by lease {lease_id}"));
        }
        Ok(())
    }

    fn read_done(&mut self, p_request_id: &str, lease_id: u64, consumer: &str, now: Instant) -> NoticeOutcome {
        let Some(hold) = self.holds.get(p_request_id) else {
            return self.not_held(p_request_id, "read_done");
        };
        if hold.lease.as_ref().map(|l| l.lease_id) != Some(lease_id) {
            self.counters.stale_read_done += 1;
            tracing::warn!(p_request_id, lease_id, consumer, "read done under a lease that is not active");
            return NoticeOutcome::StaleLease;
        }
        self.counters.read_done += 1;
        self.release(p_request_id, Cause::ReadDone, now);
        NoticeOutcome::Released
    }

    fn give_up(&mut self, p_request_id: &str, lease_id: Option<u64>, consumer: &str, now: Instant) -> NoticeOutcome {
        let Some(hold) = self.holds.get_mut(p_request_id) else {
            return self.not_held(p_request_id, "give_up");
        };
        match &hold.lease {
            Some(active) if Some(active.lease_id) != lease_id => {
                // Someone else's read is in flight: it must finish (or expire) before the
                // blocks go.
                if hold.aborted {
                    self.counters.duplicate_give_ups += 1;
                    return NoticeOutcome::AlreadyAborted;
                }
                hold.aborted = true;
                self.counters.give_ups += 1;
                self.counters.give_ups_deferred += 1;
                tracing::debug!(p_request_id, consumer, "give up deferred until the active lease ends");
                NoticeOutcome::Deferred
            }
            _ => {
                self.counters.give_ups += 1;
                self.release(p_request_id, Cause::GiveUp, now);
                NoticeOutcome::Released
            }
        }
    }

    fn heartbeat(&mut self, p_request_ids: &[String], now: Instant) -> usize {
        let mut extended = 0;
        for id in p_request_ids {
            match self.holds.get_mut(id) {
                Some(hold) if !hold.aborted => {
                    hold.deadline = hold.deadline.max(now + self.config.heartbeat_extension);
                    self.counters.heartbeats += 1;
                    extended += 1;
                }
                Some(_) => self.counters.heartbeats += 1,
                None => self.counters.unknown_heartbeats += 1,
            }
        }
        extended
    }

    fn capability(&self, p_request_id: &str, presented: &str) -> CapabilityCheck {
        match self.holds.get(p_request_id) {
            None => CapabilityCheck::NotHeld,
            Some(hold) if pdmesh_mesh_auth::capability_matches(&hold.capability, presented) => CapabilityCheck::Match,
            Some(_) => CapabilityCheck::Mismatch,
        }
    }

    fn grant_or_park(
        &mut self,
        p_request_id: &str,
        block_ids: &[u32],
        generations: &[u64],
        consumer: &str,
        capability: &str,
        now: Instant,
    ) -> LeaseDecision {
        // Held, or released already (a request id is not held twice, D38): the normal answer.
        if self.holds.contains_key(p_request_id) || self.recent_set.contains(p_request_id) {
            return self.grant(p_request_id, block_ids, generations, consumer, now).into();
        }
        let fits = !self.config.early_wait.is_zero()
            && !capability.is_empty()
            && p_request_id.len() <= MAX_PARKED_STR
            && capability.len() <= MAX_PARKED_STR
            && consumer.len() <= MAX_PARKED_STR
            && block_ids.len() == generations.len();
        if !fits {
            return self.grant(p_request_id, block_ids, generations, consumer, now).into();
        }
        if self.parked.len() >= MAX_PARKED || self.parked_blocks + block_ids.len() > MAX_PARKED_BLOCKS {
            self.counters.parked_full += 1;
            tracing::warn!(
                p_request_id,
                parked = self.parked.len(),
                "lease for a hold not registered yet: no room to wait"
            );
            return self.grant(p_request_id, block_ids, generations, consumer, now).into();
        }
        let ticket = self.next_ticket;
        self.next_ticket = self.next_ticket.wrapping_add(1).max(1);
        self.parked_blocks += block_ids.len();
        self.parked.push_back(ParkedLease {
            ticket,
            request_id: p_request_id.to_string(),
            block_ids: block_ids.to_vec(),
            generations: generations.to_vec(),
            consumer: consumer.to_string(),
            capability: capability.to_string(),
            until: now + self.config.early_wait,
        });
        self.counters.leases_parked += 1;
        tracing::debug!(p_request_id, ticket, "lease for a hold not registered yet: waiting for it");
        LeaseDecision::Parked(ticket)
    }

    fn take_parked_answers(&mut self, now: Instant) -> Vec<ParkedAnswer> {
        if self.parked.is_empty() {
            return Vec::new();
        }
        let mut answers = Vec::new();
        for p in std::mem::take(&mut self.parked) {
            let (result, capability_refused) = match self.capability(&p.request_id, &p.capability) {
                CapabilityCheck::Match => {
                    self.counters.parked_answered += 1;
                    (self.grant(&p.request_id, &p.block_ids, &p.generations, &p.consumer, now), false)
                }
                CapabilityCheck::Mismatch => {
                    // Held under another token: refused exactly as an unknown request.
                    self.counters.parked_answered += 1;
                    self.counters.leases_refused += 1;
                    (Err(LeaseRefusal::not_held(&p.request_id)), true)
                }
                // Registered and released already (a give-up or abort came with it): the
                // normal answer for a released request.
                CapabilityCheck::NotHeld if self.recent_set.contains(&p.request_id) => {
                    self.counters.parked_answered += 1;
                    (self.grant(&p.request_id, &p.block_ids, &p.generations, &p.consumer, now), false)
                }
                CapabilityCheck::NotHeld if p.until <= now => {
                    self.counters.parked_timed_out += 1;
                    self.counters.leases_refused += 1;
                    (Err(LeaseRefusal::not_held(&p.request_id)), false)
                }
                CapabilityCheck::NotHeld => {
                    self.parked.push_back(p);
                    continue;
                }
            };
            self.parked_blocks = self.parked_blocks.saturating_sub(p.block_ids.len());
            answers.push(ParkedAnswer { ticket: p.ticket, p_request_id: p.request_id, result, capability_refused });
        }
        answers
    }

    fn next_parked_deadline(&self) -> Option<Instant> {
        self.parked.iter().map(|p| p.until).min()
    }

    fn parked_wakeup(&self) -> Option<Arc<Notify>> {
        Some(self.wakeup.clone())
    }

    fn give_up_with_capability(
        &mut self,
        p_request_id: &str,
        lease_id: Option<u64>,
        consumer: &str,
        capability: &str,
        now: Instant,
    ) -> NoticeOutcome {
        let outcome = self.give_up(p_request_id, lease_id, consumer, now);
        if matches!(outcome, NoticeOutcome::Unknown | NoticeOutcome::AlreadyReleased) {
            // Maybe early rather than late: P answers before its worker registers the hold.
            self.remember_give_up(p_request_id, capability, now);
        }
        outcome
    }
}

#[cfg(test)]
#[path = "hold_tests.rs"]
mod tests;
