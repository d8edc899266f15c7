//! Unit and property tests of the hold table: LIFECYCLE.md R2 (aborts and notices never race
//! into an unsafe free) and R5 (one owner per block).

use super::*;
use proptest::prelude::*;

const MS: Duration = Duration::from_millis(1);

fn table() -> (HoldTable, Instant) {
    let cfg = HoldTableConfig { lease_ttl: 500 * MS, heartbeat_extension: 1000 * MS, early_wait: 300 * MS };
    (HoldTable::new(cfg), Instant::now())
}

fn held(t: &mut HoldTable, id: &str, blocks: &[u32], now: Instant) {
    assert!(t.hold(id, blocks.to_vec(), vec![1; blocks.len()], now + 1000 * MS));
}

fn lease(
    t: &mut HoldTable,
    id: &str,
    blocks: &[u32],
    consumer: &str,
    now: Instant,
) -> Result<LeaseGrant, LeaseRefusal> {
    t.grant(id, blocks, &vec![1; blocks.len()], consumer, now)
}

#[test]
fn lease_then_read_done_releases_exactly_once() {
    let (mut t, now) = table();
    held(&mut t, "a", &[3, 4], now);
    let g = lease(&mut t, "a", &[3, 4], "d", now).unwrap();
    assert_eq!(g.ttl, 500 * MS);
    assert_eq!(t.lease_of("a"), Some(g.lease_id));
    assert_eq!(t.leased_blocks(), 2);
    assert!(t.check_read("a", g.lease_id, &[4], now).is_ok());
    assert_eq!(t.read_done("a", g.lease_id, "d", now), NoticeOutcome::Released);
    assert_eq!(t.take_finished_sending(), vec!["a".to_string()]);
    assert!(t.take_finished_sending().is_empty());
    // A second read done is a counted duplicate, not a second release.
    assert_eq!(t.read_done("a", g.lease_id, "d", now), NoticeOutcome::AlreadyReleased);
    assert!(t.take_finished_sending().is_empty());
    assert_eq!(t.counters().duplicate_read_done, 1);
    assert_eq!(t.counters().released, 1);
    assert!(t.is_empty());
}

/// D with a partial prefix-cache hit reads only the tail of the held blocks it lacks (D51): a
/// tail with its own generations is leased; a head, an empty list or stale generations are not.
#[test]
fn a_tail_of_the_held_blocks_can_be_leased() {
    let (mut t, now) = table();
    assert!(t.hold("a", vec![4, 5, 6], vec![1, 2, 3], now + 1000 * MS));
    let head = t.grant("a", &[4, 5], &[1, 2], "d", now).unwrap_err();
    assert_eq!(head.reason, LeaseRefusalReason::BlockMismatch, "a head is not a tail");
    let empty = t.grant("a", &[], &[], "d", now).unwrap_err();
    assert_eq!(empty.reason, LeaseRefusalReason::BlockMismatch);
    let stale = t.grant("a", &[5, 6], &[2, 4], "d", now).unwrap_err();
    assert_eq!(stale.reason, LeaseRefusalReason::GenerationMismatch);
    let g = t.grant("a", &[5, 6], &[2, 3], "d", now).unwrap();
    assert!(t.check_read("a", g.lease_id, &[5, 6], now).is_ok());
    assert_eq!(t.read_done("a", g.lease_id, "d", now), NoticeOutcome::Released);
}

#[test]
fn lease_refusals_name_the_reason() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1, 2], now);
    let unknown = lease(&mut t, "zzz", &[1, 2], "d", now).unwrap_err();
    assert_eq!(unknown.reason, LeaseRefusalReason::Gone);
    let blocks = lease(&mut t, "a", &[2, 1], "d", now).unwrap_err();
    assert_eq!(blocks.reason, LeaseRefusalReason::BlockMismatch);
    let partial = lease(&mut t, "a", &[1], "d", now).unwrap_err();
    assert_eq!(partial.reason, LeaseRefusalReason::BlockMismatch);
    let stale = t.grant("a", &[1, 2], &[1, 2], "d", now).unwrap_err();
    assert_eq!(stale.reason, LeaseRefusalReason::GenerationMismatch);
    assert_eq!(t.counters().leases_refused, 4);
    // Already freed: refused as gone, and the detail says so.
    assert_eq!(t.abort("a"), NoticeOutcome::Released);
    let freed = lease(&mut t, "a", &[1, 2], "d", now).unwrap_err();
    assert_eq!(freed.reason, LeaseRefusalReason::Gone);
    assert!(freed.detail.contains("already released"), "{}", freed.detail);
}

#[test]
fn lease_past_the_hold_deadline_is_refused() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1], now);
    let late = lease(&mut t, "a", &[1], "d", now + 1000 * MS).unwrap_err();
    assert_eq!(late.reason, LeaseRefusalReason::Gone);
}

#[test]
fn abort_without_lease_frees_at_once() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1], now);
    assert_eq!(t.abort("a"), NoticeOutcome::Released);
    assert_eq!(t.take_finished_sending(), vec!["a".to_string()]);
    assert_eq!(t.abort("a"), NoticeOutcome::AlreadyReleased);
    assert_eq!(t.abort("never"), NoticeOutcome::Unknown);
    assert_eq!(t.counters().duplicate_aborts, 1);
    assert_eq!(t.counters().unknown_aborts, 1);
    assert!(t.take_finished_sending().is_empty());
}

#[test]
fn abort_with_active_lease_waits_for_read_done() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1, 2], now);
    let g = lease(&mut t, "a", &[1, 2], "d", now).unwrap();
    assert_eq!(t.abort("a"), NoticeOutcome::Deferred);
    assert!(t.take_finished_sending().is_empty(), "never freed while leased");
    assert_eq!(t.abort("a"), NoticeOutcome::AlreadyAborted);
    // No new lease for an aborted request, not even for the same reader.
    assert_eq!(lease(&mut t, "a", &[1, 2], "d", now).unwrap_err().reason, LeaseRefusalReason::Aborted);
    // The read in flight may finish.
    assert!(t.check_read("a", g.lease_id, &[1, 2], now).is_ok());
    assert_eq!(t.read_done("a", g.lease_id, "d", now), NoticeOutcome::Released);
    assert_eq!(t.take_finished_sending(), vec!["a".to_string()]);
}

#[test]
fn abort_with_active_lease_frees_on_lease_expiry() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1], now);
    let g = lease(&mut t, "a", &[1], "d", now).unwrap();
    assert_eq!(t.abort("a"), NoticeOutcome::Deferred);
    assert_eq!(t.expire(now + 499 * MS), 0);
    assert!(t.take_finished_sending().is_empty());
    assert_eq!(t.expire(now + 500 * MS), 1);
    assert_eq!(t.take_finished_sending(), vec!["a".to_string()]);
    assert_eq!(t.counters().expired_leases, 1);
    // The reader's late read done cannot be trusted: the blocks may be reused already.
    assert_eq!(t.read_done("a", g.lease_id, "d", now), NoticeOutcome::AlreadyReleased);
    assert!(t.take_finished_sending().is_empty());
}

#[test]
fn a_lease_outlives_the_hold_deadline_but_not_its_own() {
    let (mut t, now) = table();
    t.hold("a", vec![1], vec![1], now + 100 * MS);
    let g = lease(&mut t, "a", &[1], "d", now).unwrap();
    assert_eq!(t.expire(now + 200 * MS), 0, "the lease protects the blocks past the hold deadline");
    assert!(t.check_read("a", g.lease_id, &[1], now + 200 * MS).is_ok());
    assert!(t.check_read("a", g.lease_id, &[1], now + 500 * MS).is_err(), "expired lease reads nothing");
    assert_eq!(t.expire(now + 500 * MS), 1);
}

#[test]
fn check_read_refuses_everything_not_covered() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1, 2], now);
    held(&mut t, "b", &[5], now);
    let g = lease(&mut t, "a", &[1, 2], "d", now).unwrap();
    let gb = lease(&mut t, "b", &[5], "d", now).unwrap();
    let reason = |r: Result<(), LeaseRefusal>| r.unwrap_err().reason;
    assert_eq!(reason(t.check_read("a", g.lease_id + 1000, &[1], now)), LeaseRefusalReason::LeaseInvalid);
    assert_eq!(reason(t.check_read("a", g.lease_id, &[3], now)), LeaseRefusalReason::LeaseInvalid);
    assert_eq!(reason(t.check_read("a", gb.lease_id, &[1], now)), LeaseRefusalReason::LeaseInvalid);
    assert_eq!(reason(t.check_read("b", g.lease_id, &[5], now)), LeaseRefusalReason::LeaseInvalid);
    assert_eq!(reason(t.check_read("zzz", g.lease_id, &[], now)), LeaseRefusalReason::LeaseInvalid);
    assert!(t.check_read("a", g.lease_id, &[2, 1, 2], now).is_ok());
    t.read_done("a", g.lease_id, "d", now);
    assert_eq!(reason(t.check_read("a", g.lease_id, &[1], now)), LeaseRefusalReason::LeaseInvalid);
}

#[test]
fn same_reader_gets_its_lease_again_others_are_refused() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1], now);
    let g = lease(&mut t, "a", &[1], "d0", now).unwrap();
    let again = lease(&mut t, "a", &[1], "d0", now + 100 * MS).unwrap();
    assert_eq!(again.lease_id, g.lease_id);
    assert_eq!(again.ttl, 400 * MS, "the deadline is not extended by asking again");
    assert_eq!(lease(&mut t, "a", &[1], "d1", now).unwrap_err().reason, LeaseRefusalReason::AlreadyLeased);
    assert_eq!(t.counters().lease_regrants, 1);
}

#[test]
fn stale_read_done_does_not_release() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1], now);
    assert_eq!(t.read_done("a", 42, "d", now), NoticeOutcome::StaleLease, "no lease at all");
    let g = lease(&mut t, "a", &[1], "d", now).unwrap();
    assert_eq!(t.read_done("a", g.lease_id + 1, "d", now), NoticeOutcome::StaleLease);
    assert!(t.take_finished_sending().is_empty());
    assert_eq!(t.counters().stale_read_done, 2);
    assert_eq!(t.read_done("zzz", 1, "d", now), NoticeOutcome::Unknown);
    assert_eq!(t.counters().unknown_read_done, 1);
}

#[test]
fn release_all_drops_leased_holds_too_and_reports_nothing() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1, 2], now);
    held(&mut t, "b", &[3], now);
    let g = lease(&mut t, "b", &[3], "d", now).unwrap();
    assert_eq!(t.abort("gone"), NoticeOutcome::Unknown);
    assert_eq!(t.release_all(now + 10 * MS), 2);
    assert_eq!((t.len(), t.held_blocks(), t.leased_blocks()), (0, 0, 0));
    // The engine that owned them is gone: nothing to report to the new one.
    assert!(t.take_finished_sending().is_empty());
    // A reader that copied under the dropped lease is told its bytes are not safe.
    assert_eq!(t.read_done("b", g.lease_id, "d", now + 20 * MS), NoticeOutcome::AlreadyReleased);
    assert!(t.check_read("b", g.lease_id, &[3], now + 20 * MS).is_err());
    assert!(lease(&mut t, "a", &[1, 2], "d", now + 20 * MS).is_err());
    // Counted as released by an abort (block-ms from when each hold began), never as expired.
    let ms = t.counters().held_block_ms;
    assert!(ms.aborted > 0 && ms.expired == 0 && ms.read_done == 0, "{ms:?}");
}

#[test]
fn give_up_frees_unless_another_reader_holds_the_lease() {
    let (mut t, now) = table();
    held(&mut t, "free", &[1], now);
    held(&mut t, "own", &[2], now);
    held(&mut t, "other", &[3], now);
    assert_eq!(t.give_up("free", None, "d", now), NoticeOutcome::Released);
    let own = lease(&mut t, "own", &[2], "d", now).unwrap();
    assert_eq!(t.give_up("own", Some(own.lease_id), "d", now), NoticeOutcome::Released);
    lease(&mut t, "other", &[3], "d0", now).unwrap();
    assert_eq!(t.give_up("other", None, "d1", now), NoticeOutcome::Deferred);
    assert_eq!(t.give_up("other", None, "d2", now), NoticeOutcome::AlreadyAborted);
    assert_eq!(t.take_finished_sending(), vec!["free".to_string(), "own".to_string()]);
    assert_eq!(t.give_up("free", None, "d", now), NoticeOutcome::AlreadyReleased);
    assert_eq!(t.give_up("nope", None, "d", now), NoticeOutcome::Unknown);
    let c = t.counters();
    assert_eq!((c.give_ups, c.give_ups_deferred, c.duplicate_give_ups, c.unknown_give_ups), (3, 1, 2, 1));
    assert_eq!(t.expire(now + 500 * MS), 1);
    assert_eq!(t.take_finished_sending(), vec!["other".to_string()]);
}

#[test]
fn expire_sweeps_oldest_first_and_heartbeats_extend() {
    let (mut t, now) = table();
    t.hold("old", vec![1], vec![1], now + 100 * MS);
    t.hold("mid", vec![2], vec![1], now + 300 * MS);
    t.hold("new", vec![3], vec![1], now + 200 * MS);
    t.hold("kept", vec![4], vec![1], now + 100 * MS);
    assert_eq!(t.heartbeat(&["kept".into(), "ghost".into()], now), 1);
    assert_eq!(t.counters().unknown_heartbeats, 1);
    // A heartbeat never shortens a deadline.
    t.hold("long", vec![5], vec![1], now + 5000 * MS);
    t.heartbeat(&["long".into()], now);
    assert_eq!(t.expire(now + 99 * MS), 0);
    assert_eq!(t.expire(now + 1000 * MS), 4);
    assert_eq!(t.take_finished_sending(), vec!["old", "mid", "new", "kept"]);
    assert!(t.is_held("long"));
    assert_eq!(t.counters().expired_holds, 4);
    assert_eq!(t.expire(now + 5000 * MS), 1);
    assert!(t.is_empty());
}

#[test]
fn duplicate_hold_keeps_the_first() {
    let (mut t, now) = table();
    held(&mut t, "a", &[1], now);
    assert!(!t.hold("a", vec![9], vec![9], now));
    assert_eq!(t.counters().duplicate_holds, 1);
    assert!(lease(&mut t, "a", &[1], "d", now).is_ok());
    assert_eq!(t.held_blocks(), 1);
    let info = t.held_requests(now);
    assert_eq!(info.len(), 1);
    assert!(info[0].leased && !info[0].aborted && info[0].blocks == 1);
}

// ---- property test: random interleavings, checked after every event -------------------------

#[derive(Debug, Clone)]
enum Ev {
    Hold { blocks: usize, deadline_ms: u64 },
    Lease { req: usize, consumer: u8, stale: bool },
    ReadDone { req: usize, own_lease: bool },
    Abort { req: usize },
    GiveUp { req: usize, own_lease: bool },
    Heartbeat { reqs: Vec<usize> },
    Advance { ms: u64 },
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        3 => (1usize..4, 0u64..2000).prop_map(|(blocks, deadline_ms)| Ev::Hold { blocks, deadline_ms }),
        4 => (0usize..12, 0u8..2, proptest::bool::weighted(0.2))
            .prop_map(|(req, consumer, stale)| Ev::Lease { req, consumer, stale }),
        3 => (0usize..12, proptest::bool::weighted(0.8)).prop_map(|(req, own_lease)| Ev::ReadDone { req, own_lease }),
        2 => (0usize..12).prop_map(|req| Ev::Abort { req }),
        2 => (0usize..12, any::<bool>()).prop_map(|(req, own_lease)| Ev::GiveUp { req, own_lease }),
        1 => proptest::collection::vec(0usize..12, 0..4).prop_map(|reqs| Ev::Heartbeat { reqs }),
        3 => (0u64..800).prop_map(|ms| Ev::Advance { ms }),
    ]
}

/// P's block manager as the scheduler would run it: blocks go to a request on `hold` and come
/// back when the table reports the request in `finished_sending`.
struct Harness {
    t: HoldTable,
    now: Instant,
    free: Vec<u32>,
    generation: HashMap<u32, u64>,
    ids: Vec<String>,
    held: HashMap<String, (Vec<u32>, Vec<u64>)>,
    /// Leases the harness saw granted and not yet ended: id -> (lease id, deadline).
    leases: HashMap<String, (u64, Instant)>,
    released: HashSet<String>,
}

impl Harness {
    fn new() -> Self {
        let (t, now) = table();
        Self {
            t,
            now,
            free: (0..24).collect(),
            generation: HashMap::new(),
            ids: vec!["never-held".into()],
            held: HashMap::new(),
            leases: HashMap::new(),
            released: HashSet::new(),
        }
    }

    fn id(&self, i: usize) -> String {
        self.ids[i % self.ids.len()].clone()
    }

    fn apply(&mut self, ev: &Ev) -> Result<(), TestCaseError> {
        // What may legitimately end an active lease in this event.
        let mut ends_lease: Option<(String, u64)> = None;
        let mut expiry = false;
        match ev {
            Ev::Hold { blocks, deadline_ms } => {
                if self.free.len() < *blocks {
                    return Ok(());
                }
                let ids: Vec<u32> = self.free.drain(..*blocks).collect();
                let gens: Vec<u64> = ids
                    .iter()
                    .map(|b| {
                        let g = self.generation.entry(*b).or_insert(0);
                        *g += 1;
                        *g
                    })
                    .collect();
                let id = format!("req-{}", self.ids.len());
                self.ids.push(id.clone());
                prop_assert!(self.t.hold(
                    &id,
                    ids.clone(),
                    gens.clone(),
                    self.now + Duration::from_millis(*deadline_ms)
                ));
                self.held.insert(id, (ids, gens));
            }
            Ev::Lease { req, consumer, stale } => {
                let id = self.id(*req);
                let (ids, mut gens) = self.held.get(&id).cloned().unwrap_or((vec![0], vec![1]));
                if *stale {
                    gens[0] += 1;
                }
                let r = self.t.grant(&id, &ids, &gens, &format!("d{consumer}"), self.now);
                if *stale {
                    prop_assert!(r.is_err(), "stale generations must be refused");
                }
                if !self.held.contains_key(&id) {
                    prop_assert!(r.is_err(), "a request that is not held is never leased");
                }
                if let Ok(g) = r {
                    let entry = self.leases.entry(id).or_insert((g.lease_id, self.now + g.ttl));
                    prop_assert_eq!(entry.0, g.lease_id, "one lease per request at a time");
                }
            }
            Ev::ReadDone { req, own_lease } => {
                let id = self.id(*req);
                let lease_id = match self.leases.get(&id) {
                    Some((l, _)) if *own_lease => *l,
                    _ => 7,
                };
                ends_lease = Some((id.clone(), lease_id));
                self.t.read_done(&id, lease_id, "d", self.now);
            }
            Ev::Abort { req } => {
                self.t.abort(&self.id(*req));
            }
            Ev::GiveUp { req, own_lease } => {
                let id = self.id(*req);
                let lease_id = if *own_lease { self.leases.get(&id).map(|(l, _)| *l) } else { None };
                if let Some(l) = lease_id {
                    ends_lease = Some((id.clone(), l));
                }
                self.t.give_up(&id, lease_id, "d", self.now);
            }
            Ev::Heartbeat { reqs } => {
                let ids: Vec<String> = reqs.iter().map(|r| self.id(*r)).collect();
                self.t.heartbeat(&ids, self.now);
            }
            Ev::Advance { ms } => {
                self.now += Duration::from_millis(*ms);
                self.t.expire(self.now);
                expiry = true;
            }
        }
        self.settle(ends_lease, expiry)
    }

    fn settle(&mut self, ends_lease: Option<(String, u64)>, expiry: bool) -> Result<(), TestCaseError> {
        for id in self.t.take_finished_sending() {
            prop_assert!(self.released.insert(id.clone()), "{} reported in finished_sending twice", id);
            let Some((blocks, _)) = self.held.remove(&id) else {
                return Err(TestCaseError::fail(format!("{id} released but never held")));
            };
            if let Some((lease_id, deadline)) = self.leases.remove(&id) {
                let by_owner = ends_lease.as_ref() == Some(&(id.clone(), lease_id));
                let by_expiry = expiry && deadline <= self.now;
                prop_assert!(by_owner || by_expiry, "{} released while leased", id);
            }
            for b in blocks {
                prop_assert!(!self.free.contains(&b), "block {} freed twice", b);
                self.free.push(b);
            }
        }
        for id in &self.ids {
            prop_assert_eq!(self.t.is_held(id), self.held.contains_key(id), "{} held state", id);
        }
        let held_blocks: usize = self.held.values().map(|(b, _)| b.len()).sum();
        prop_assert_eq!(self.t.held_blocks(), held_blocks);
        prop_assert_eq!(self.free.len() + held_blocks, 24, "every block has one owner");
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn random_interleavings_keep_r2_and_r5(events in proptest::collection::vec(ev(), 1..120)) {
        let mut h = Harness::new();
        for e in &events {
            h.apply(e)?;
        }
        // Quiescence: once every deadline has passed, nothing is held and every request that
        // was held has been reported exactly once.
        h.now += Duration::from_secs(60);
        h.t.expire(h.now);
        h.settle(None, true)?;
        prop_assert!(h.t.is_empty());
        prop_assert!(h.held.is_empty());
        prop_assert_eq!(h.free.len(), 24);
        prop_assert_eq!(h.released.len(), h.ids.len() - 1);
        prop_assert_eq!(h.t.counters().released as usize, h.ids.len() - 1);
    }
}

#[test]
fn releases_say_why() {
    let (mut t, now) = table();
    for id in ["read", "gone", "aborted", "late"] {
        held(&mut t, id, &[1], now);
    }
    let g = lease(&mut t, "read", &[1], "d", now).unwrap();
    assert_eq!(t.read_done("read", g.lease_id, "d", now), NoticeOutcome::Released);
    assert_eq!(t.give_up("gone", None, "d", now), NoticeOutcome::Released);
    assert_eq!(t.abort("aborted"), NoticeOutcome::Released);
    assert_eq!(t.expire(now + 2000 * MS), 1);
    let got = t.take_finished_sending_with_causes();
    let want = [("read", "read_done"), ("gone", "given_up"), ("aborted", "aborted"), ("late", "expired")];
    assert_eq!(got, want.map(|(i, c)| (i.to_string(), c)).to_vec());
    assert!(t.take_finished_sending_with_causes().is_empty());
    // the plain variant drains the causes too
    held(&mut t, "x", &[2], now);
    assert_eq!(t.abort("x"), NoticeOutcome::Released);
    assert_eq!(t.take_finished_sending(), vec!["x".to_string()]);
    assert!(t.take_finished_sending_with_causes().is_empty());
}

// ---- early readers: P answers before its worker registers the hold (D65) -------------------

const TOKEN: &str = "0123456789abcdef0123456789abcdef";
const OTHER: &str = "fedcba9876543210fedcba9876543210";

fn hold_under(t: &mut HoldTable, id: &str, blocks: &[u32], token: &str, now: Instant) -> bool {
    t.hold_with_capability(id, blocks.to_vec(), vec![1; blocks.len()], now + 1000 * MS, token.to_string())
}

fn park(t: &mut HoldTable, id: &str, blocks: &[u32], token: &str, now: Instant) -> u64 {
    match t.grant_or_park(id, blocks, &vec![1; blocks.len()], "d", token, now) {
        LeaseDecision::Parked(ticket) => ticket,
        other => panic!("expected the lease to wait for its hold, got {other:?}"),
    }
}

/// Whether the table signalled a registration since the last check (a kept permit).
fn signalled(t: &HoldTable) -> bool {
    use futures::FutureExt;
    t.parked_wakeup().is_some_and(|n| n.notified().now_or_never().is_some())
}

#[test]
fn a_lease_before_registration_is_granted_when_the_hold_registers() {
    let (mut t, now) = table();
    let ticket = park(&mut t, "a", &[3, 4], TOKEN, now);
    assert_eq!(t.parked_len(), 1);
    assert_eq!(t.counters().leases_parked, 1);
    // Nothing to answer before the hold registers, and no lease exists.
    assert!(t.take_parked_answers(now + 10 * MS).is_empty());
    assert!(!signalled(&t));
    assert!(hold_under(&mut t, "a", &[3, 4], TOKEN, now + 20 * MS));
    assert!(signalled(&t), "the side channel is woken when the hold registers");
    let answers = t.take_parked_answers(now + 20 * MS);
    assert_eq!(answers.len(), 1);
    let a = &answers[0];
    assert_eq!((a.ticket, a.p_request_id.as_str(), a.capability_refused), (ticket, "a", false));
    let g = a.result.clone().unwrap();
    assert_eq!(t.lease_of("a"), Some(g.lease_id));
    assert_eq!(t.leased_blocks(), 2);
    assert_eq!(t.parked_len(), 0);
    // The lease protects the blocks as any lease does (R5): an abort waits for it.
    assert_eq!(t.abort("a"), NoticeOutcome::Deferred);
    assert_eq!(t.read_done("a", g.lease_id, "d", now + 30 * MS), NoticeOutcome::Released);
    assert_eq!(t.take_finished_sending(), vec!["a".to_string()]);
    assert_eq!(t.counters().parked_answered, 1);
}

#[test]
fn a_parked_lease_goes_through_the_normal_checks_at_registration() {
    let (mut t, now) = table();
    park(&mut t, "blocks", &[1, 2], TOKEN, now);
    park(&mut t, "token", &[5], TOKEN, now);
    park(&mut t, "gens", &[6], TOKEN, now);
    assert!(hold_under(&mut t, "blocks", &[1, 9], TOKEN, now));
    assert!(hold_under(&mut t, "token", &[5], OTHER, now));
    assert!(t.hold_with_capability("gens", vec![6], vec![2], now + 1000 * MS, TOKEN.into()));
    let answers = t.take_parked_answers(now);
    let by_id = |id: &str| answers.iter().find(|a| a.p_request_id == id).cloned().unwrap();
    assert_eq!(by_id("blocks").result.unwrap_err().reason, LeaseRefusalReason::BlockMismatch);
    assert_eq!(by_id("gens").result.unwrap_err().reason, LeaseRefusalReason::GenerationMismatch);
    // Another request's token: refused exactly as an unknown request, and flagged.
    let token = by_id("token");
    assert!(token.capability_refused);
    assert_eq!(token.result.unwrap_err(), LeaseRefusal::not_held("token"));
    assert_eq!(t.leased_blocks(), 0);
    assert_eq!(t.len(), 3, "refused leases leave the holds alone");
}

#[test]
fn a_parked_lease_is_refused_as_not_held_when_its_wait_ends() {
    let (mut t, now) = table();
    park(&mut t, "a", &[1], TOKEN, now);
    assert_eq!(t.next_parked_deadline(), Some(now + 300 * MS));
    assert!(t.take_parked_answers(now + 299 * MS).is_empty());
    let answers = t.take_parked_answers(now + 300 * MS);
    assert_eq!(answers.len(), 1);
    assert_eq!(answers[0].result.clone().unwrap_err(), LeaseRefusal::not_held("a"));
    assert_eq!(t.counters().parked_timed_out, 1);
    assert_eq!(t.next_parked_deadline(), None);
    // A hold registering afterwards is an ordinary hold: no lease appeared on it.
    assert!(hold_under(&mut t, "a", &[1], TOKEN, now + 400 * MS));
    assert_eq!(t.lease_of("a"), None);
    assert!(t.take_parked_answers(now + 400 * MS).is_empty());
}

#[test]
fn a_hold_released_as_it_registers_refuses_the_parked_lease_at_once() {
    let (mut t, now) = table();
    park(&mut t, "a", &[1], TOKEN, now);
    assert!(hold_under(&mut t, "a", &[1], TOKEN, now));
    assert_eq!(t.abort("a"), NoticeOutcome::Released); // P's own abort, in the same metadata
    let answers = t.take_parked_answers(now);
    assert_eq!(answers[0].result.clone().unwrap_err().reason, LeaseRefusalReason::Gone);
    assert_eq!(t.take_finished_sending(), vec!["a".to_string()]);
}

#[test]
fn held_or_released_requests_are_answered_at_once_not_parked() {
    let (mut t, now) = table();
    assert!(hold_under(&mut t, "a", &[1], TOKEN, now));
    assert!(matches!(t.grant_or_park("a", &[1], &[1], "d", TOKEN, now), LeaseDecision::Granted(_)));
    assert!(hold_under(&mut t, "b", &[2], TOKEN, now));
    assert_eq!(t.abort("b"), NoticeOutcome::Released);
    assert!(matches!(t.grant_or_park("b", &[2], &[1], "d", TOKEN, now), LeaseDecision::Refused(_)));
    assert_eq!(t.parked_len(), 0);
}

#[test]
fn a_give_up_before_registration_releases_the_hold_as_it_registers() {
    let (mut t, now) = table();
    assert_eq!(t.give_up_with_capability("a", None, "d", TOKEN, now), NoticeOutcome::Unknown);
    assert_eq!(t.tombstones_len(), 1);
    // A give-up under another request's token (an earlier request under a reused id) never
    // frees this one.
    assert_eq!(t.give_up_with_capability("b", None, "d", OTHER, now), NoticeOutcome::Unknown);
    assert!(hold_under(&mut t, "b", &[2], TOKEN, now));
    assert!(t.is_held("b"));
    assert!(hold_under(&mut t, "a", &[1, 3], TOKEN, now));
    assert!(!t.is_held("a"), "released as it registered (R4)");
    assert_eq!(t.take_finished_sending_with_causes(), vec![("a".to_string(), "given_up")]);
    assert_eq!(t.counters().tombstone_releases, 1);
    assert_eq!(t.tombstones_len(), 1, "b's stays until its wait ends");
    // Remembered once: the id registering again is held.
    assert!(hold_under(&mut t, "a", &[1], TOKEN, now));
    assert!(t.is_held("a"));
    // Forgotten when the wait ends.
    t.expire(now + 300 * MS);
    assert_eq!(t.tombstones_len(), 0);
    // A give-up with no token, or with the wait off, is never remembered.
    assert_eq!(t.give_up_with_capability("c", None, "d", "", now), NoticeOutcome::Unknown);
    assert_eq!(t.tombstones_len(), 0);
}

#[test]
fn with_no_early_wait_nothing_is_parked_or_remembered() {
    let cfg = HoldTableConfig { early_wait: Duration::ZERO, ..HoldTableConfig::default() };
    let mut t = HoldTable::new(cfg);
    let now = Instant::now();
    let got = t.grant_or_park("a", &[1], &[1], "d", TOKEN, now);
    assert_eq!(got, LeaseDecision::Refused(LeaseRefusal::not_held("a")));
    t.give_up_with_capability("a", None, "d", TOKEN, now);
    assert_eq!((t.parked_len(), t.tombstones_len()), (0, 0));
}

#[test]
fn parking_and_remembering_are_bounded() {
    let (mut t, now) = table();
    for i in 0..MAX_PARKED {
        park(&mut t, &format!("r{i}"), &[1], TOKEN, now);
    }
    let full = t.grant_or_park("one-more", &[1], &[1], "d", TOKEN, now);
    assert_eq!(full, LeaseDecision::Refused(LeaseRefusal::not_held("one-more")));
    assert_eq!(t.counters().parked_full, 1);
    assert_eq!(t.parked_len(), MAX_PARKED);
    // Their wait ends: all answered, room again.
    assert_eq!(t.take_parked_answers(now + 300 * MS).len(), MAX_PARKED);
    assert_eq!(t.parked_len(), 0);
    // By blocks named, too.
    let big: Vec<u32> = (0..MAX_PARKED_BLOCKS as u32).collect();
    park(&mut t, "big", &big, TOKEN, now);
    assert!(matches!(t.grant_or_park("more", &[1], &[1], "d", TOKEN, now), LeaseDecision::Refused(_)));
    // Oversized names are never parked.
    let long = "x".repeat(1000);
    assert!(matches!(t.grant_or_park(&long, &[1], &[1], "d", TOKEN, now), LeaseDecision::Refused(_)));
    assert!(matches!(t.grant_or_park("a", &[1], &[1], "d", &long, now), LeaseDecision::Refused(_)));
    // Remembered give-ups: the oldest goes.
    for i in 0..MAX_TOMBSTONES + 5 {
        t.give_up_with_capability(&format!("g{i}"), None, "d", TOKEN, now);
    }
    assert_eq!(t.tombstones_len(), MAX_TOMBSTONES);
    assert_eq!(t.counters().tombstones_dropped, 5);
    assert!(hold_under(&mut t, "g0", &[1], TOKEN, now));
    assert!(t.is_held("g0"), "the oldest was forgotten: held until its deadline");
    assert!(hold_under(&mut t, "g5", &[1], TOKEN, now));
    assert!(!t.is_held("g5"));
    t.give_up_with_capability(&long, None, "d", TOKEN, now);
    assert_eq!(t.tombstones_len(), MAX_TOMBSTONES - 1);
}
