//! A tiny persistent thread pool for the forward pass.
//!
//! Why not `std::thread::scope` per matmul: a decode step runs ~150 parallel regions (four
//! matmuls and attention in each of 30 layers); spawning and joining threads for each costs
//! tens of microseconds, a sizeable share of a ~6 ms step. Here `n - 1` workers live as long as
//! the executor, spin briefly after each job (the next region usually follows within
//! microseconds) and then sleep on a condvar, so an idle worker burns no CPU.
//!
//! Work is claimed dynamically (an atomic counter over work items) and a worker only *joins* a
//! job while it is still open. So when the machine is oversubscribed and a worker is not
//! scheduled in time, the calling thread (thread 0) simply does all the items itself and never
//! waits for a worker that has not started; it waits only for items a worker actually claimed.
//! Results never depend on which thread ran an item.
//!
//! The pool's threads, the calling one included, may run at a lower CPU priority (`nice`,
//! D71): on a host whose cores the forward pass fills, the serving processes' short wake-ups
//! (relaying a token, admitting a request) then take a core at once instead of queueing behind
//! a pass's time slice.
//!
//! A job is a borrowed closure; the pool shows it to the workers by erasing its lifetime,
//! which is sound because [`Pool::for_each`] does not return before the job is closed and no
//! worker that joined it is still running (that is the one `unsafe` idea here).

#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins for the next job before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

/// `state` layout: job sequence number in the high 32 bits, an "open" flag at bit 31, and the
/// number of workers inside the job in the low 31 bits.
const OPEN: u64 = 1 << 31;
const ACTIVE_MASK: u64 = OPEN - 1;

type Job = dyn Fn() + Sync;

struct Shared {
    /// The current job; valid while the state says "open" or any worker is active.
    job: UnsafeCell<Option<*const Job>>,
    state: AtomicU64,
    sleepers: AtomicUsize,
    /// Set by [`Pool::rest`]: spinning workers go to sleep now instead of at the end of `SPIN`.
    resting: AtomicBool,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the pool's owner while no worker can read it (no job is
// open and no worker is active), and read by a worker only after it joined an open job, which
// the owner waits for before touching `job` again. The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// Claim the next run of consecutive items of `0..n_items`, or `None` when all are claimed.
///
/// Claims shrink as the job drains (guided scheduling): each takes a `1 / (2·threads)` share of
/// what is left, so the first claims are large (few atomics) and the last ones a single item.
/// Why: with equal claims (an eighth of a thread's share each) the thread that took the last
/// one ran alone for up to a whole claim while the others waited at the job's end — measured
/// ~3.7 ms at the end of each gate/up matmul of a 512-token Qwen2.5-1.5B prefill.
fn claim(next: &AtomicUsize, n_items: usize, threads: usize) -> Option<std::ops::Range<usize>> {
    let mut start = next.load(Ordering::Relaxed);
    loop {
        if start >= n_items {
            return None;
        }
        let unit = ((n_items - start) / (2 * threads)).max(1);
        match next.compare_exchange_weak(start, start + unit, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(start..start + unit),
            Err(now) => start = now,
        }
    }
}

/// A fixed set of threads that run one job at a time.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
    /// Niceness of the pool's threads (0: left as they are); a calling thread takes it on its
    /// first job.
    nice: i32,
    /// The niceness each worker runs at, as it read it back once started.
    worker_nice: Vec<Option<i32>>,
    /// Serialises jobs (the pool is used through `&self`).
    run_lock: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("n_threads", &self.n_threads).finish()
    }
}

/// Threads to use: `$PDMESH_MODEL_THREADS`, else the available parallelism.
pub fn default_threads() -> usize {
    std::env::var("PDMESH_MODEL_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

thread_local! {
    /// Whether this thread already took a pool's niceness (a job's caller, once).
    static NICED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Lower the calling thread's CPU priority to niceness `nice` (on Linux niceness belongs to
/// a thread, and threads it spawns inherit it) and return the niceness it runs at. Only ever
/// lowered, which needs no privilege: a thread already at `nice` or below keeps its own; a
/// refusal is logged and the thread runs on at its priority.
fn lower_priority(nice: i32) -> Option<i32> {
    let current = rustix::process::getpriority_process(None).ok();
    if nice <= 0 || current.is_some_and(|c| c >= nice) {
        return current;
    }
    match rustix::process::setpriority_process(None, nice) {
        Ok(()) => Some(nice),
        Err(e) => {
            tracing::warn!(error = %e, nice, "could not lower a model thread's CPU priority; it keeps the process's");
            current
        }
    }
}

impl Pool {
    /// A pool of `n_threads` (the caller counts as one; at least 1) at niceness `nice` (0:
    /// the threads keep the process's priority). If a worker thread cannot be spawned the pool
    /// simply runs with fewer threads.
    pub fn new(n_threads: usize, nice: i32) -> Self {
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            state: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            resting: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = Vec::new();
        let (started_tx, started) = std::sync::mpsc::channel();
        for tid in 1..n_threads.max(1) {
            let s = Arc::clone(&shared);
            let started_tx = started_tx.clone();
            match std::thread::Builder::new().name(format!("pdmesh-model-{tid}")).spawn(move || {
                let _ = started_tx.send(lower_priority(nice));
                drop(started_tx);
                worker(&s)
            }) {
                Ok(h) => workers.push(h),
                Err(e) => {
                    tracing::warn!(error = %e, "could not spawn model worker thread; running with fewer threads");
                    break;
                }
            }
        }
        drop(started_tx);
        // Every worker runs at its priority before the first job (a worker that died first
        // closes its sender and is simply not counted).
        let worker_nice = started.iter().take(workers.len()).collect();
        let n_threads = workers.len() + 1;
        Self { shared, workers, n_threads, nice, worker_nice, run_lock: Mutex::new(()) }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// The niceness each worker thread runs at (`None` where it could not be read).
    pub fn worker_nice(&self) -> &[Option<i32>] {
        &self.worker_nice
    }

    /// Call `f(item)` for every `item` in `0..n_items`, spread over the pool's threads in
    /// claims of consecutive items. Returns false if `f` panicked.
    pub fn for_each(&self, n_items: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        if n_items == 0 {
            return true;
        }
        if self.nice > 0 && !NICED.get() {
            NICED.set(true);
            let _ = lower_priority(self.nice);
        }
        let next = AtomicUsize::new(0);
        let panicked = AtomicBool::new(false);
        let threads = self.n_threads.max(1);
        let body = || {
            let r = catch_unwind(AssertUnwindSafe(|| {
                while let Some(items) = claim(&next, n_items, threads) {
                    for item in items {
                        f(item);
                    }
                }
            }));
            if r.is_err() {
                panicked.store(true, Ordering::Relaxed);
            }
        };
        if self.workers.is_empty() || n_items == 1 {
            body();
        } else {
            self.run(&body);
        }
        !panicked.load(Ordering::Relaxed)
    }

    /// Publish `job`, run it on this thread too, close it, and wait for the workers in it.
    fn run(&self, job: &(dyn Fn() + Sync)) {
        let _one_at_a_time = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        // SAFETY: erase the borrow's lifetime so workers can see it. Workers only read it after
        // joining the open job, and we do not return before the job is closed and no worker
        // is active, so it never outlives `job`.
        let erased: *const Job = unsafe { std::mem::transmute::<&(dyn Fn() + Sync), &'static Job>(job) };
        // SAFETY: no job is open and no worker is active (see the end of this function).
        unsafe { *s.job.get() = Some(erased) };
        s.resting.store(false, Ordering::SeqCst);
        let seq = (s.state.load(Ordering::SeqCst) >> 32).wrapping_add(1) & 0xFFFF_FFFF;
        s.state.store((seq << 32) | OPEN, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        job();
        // Close: late workers will no longer join.
        let closed = s.state.fetch_and(!OPEN, Ordering::SeqCst) & !OPEN;
        // Wait for the workers that joined (they are running items they claimed).
        let mut active = closed & ACTIVE_MASK;
        let mut spins = 0u32;
        while active > 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            active = s.state.load(Ordering::Acquire) & ACTIVE_MASK;
        }
        // SAFETY: closed and no worker active: nobody can read `job` any more.
        unsafe { *s.job.get() = None };
    }

    /// Tell idle workers that no job follows soon (a forward pass is over): they sleep now
    /// rather than spin out `SPIN`, and their core is free for whatever the pass's answer wakes
    /// — the worker's own reply, engine-core, the frontends on the same host — instead of that
    /// work taking the core of the thread that starts the next pass. The next job wakes them.
    pub fn rest(&self) {
        self.shared.resting.store(true, Ordering::SeqCst);
    }

    /// Split `data` into chunks of `chunk` elements (the last may be shorter) and call
    /// `f(chunk_index, chunk)` for each, in parallel. Returns false if `f` panicked.
    pub fn par_chunks_mut<T: Send>(&self, data: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) -> bool {
        let chunk = chunk.max(1);
        let len = data.len();
        let base = SendPtr(data.as_mut_ptr());
        self.for_each(len.div_ceil(chunk), &|c| {
            let start = c * chunk;
            let end = (start + chunk).min(len);
            // SAFETY: chunk `c` covers `start..end` inside `data` (end ≤ len); `for_each` visits
            // every chunk index exactly once, so the slices are disjoint; `data` is exclusively
            // borrowed for the whole call.
            let part = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
            f(c, part);
        })
    }
}

/// A raw pointer that may be shared between the pool's threads (each writes disjoint parts).
pub(crate) struct SendPtr<T>(pub *mut T);
impl<T> SendPtr<T> {
    pub fn get(&self) -> *mut T {
        self.0
    }
}
// SAFETY: only used to write disjoint elements of a `&mut [T]` (with `T: Send`) from the
// pool's threads while the slice is exclusively borrowed.
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        // bump the sequence so spinning workers look again
        self.shared.state.fetch_add(1 << 32, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(s: &Shared) {
    // The sequence the pool was created with: a job published before this thread first ran
    // is still joined if it is open.
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while s.state.load(Ordering::Acquire) >> 32 == seen {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && (start.elapsed() > SPIN || s.resting.load(Ordering::Relaxed)) {
                let mut g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                while s.state.load(Ordering::SeqCst) >> 32 == seen && !s.shutdown.load(Ordering::SeqCst) {
                    g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            std::hint::spin_loop();
        }
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let mut st = s.state.load(Ordering::Acquire);
        seen = st >> 32;
        // Join only if this job is still open.
        let joined = loop {
            if st >> 32 != seen || st & OPEN == 0 {
                break false;
            }
            match s.state.compare_exchange_weak(st, st + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break true,
                Err(now) => st = now,
            }
        };
        if joined {
            // SAFETY: we joined an open job; the owner keeps the closure alive and `job` set
            // until we leave (decrement below).
            if let Some(job) = unsafe { *s.job.get() } {
                // SAFETY: as above.
                let f = unsafe { &*job };
                f();
            }
            s.state.fetch_sub(1, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_cover_every_item_once_and_shrink_to_single_items() {
        for (n, threads) in [(1usize, 2usize), (7, 2), (2240, 2), (1000, 3), (5, 16)] {
            let next = AtomicUsize::new(0);
            let mut runs = Vec::new();
            while let Some(r) = claim(&next, n, threads) {
                runs.push(r);
            }
            // consecutive, disjoint, covering 0..n
            let mut at = 0;
            for r in &runs {
                assert_eq!(r.start, at, "n={n} threads={threads}: {runs:?}");
                assert!(r.end > r.start && r.end <= n);
                at = r.end;
            }
            assert_eq!(at, n);
            let lens: Vec<usize> = runs.iter().map(|r| r.len()).collect();
            assert!(lens.windows(2).all(|w| w[1] <= w[0]), "claims shrink: {lens:?}");
            assert_eq!(lens.last(), Some(&1), "the last claim is one item: {lens:?}");
            assert!(lens[0] <= n.div_ceil(2 * threads).max(1));
        }
    }

    #[test]
    fn every_chunk_once() {
        let pool = Pool::new(3, 0);
        for len in [0usize, 1, 7, 64, 1000] {
            let mut v = vec![0u32; len];
            assert!(pool.par_chunks_mut(&mut v, 7, |c, part| {
                for (i, x) in part.iter_mut().enumerate() {
                    *x += (c * 7 + i) as u32 + 1;
                }
            }));
            assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32 + 1));
        }
        // many small jobs in a row (the decode pattern)
        let mut v = vec![0u64; 64];
        for _ in 0..5000 {
            pool.par_chunks_mut(&mut v, 8, |_, p| p.iter_mut().for_each(|x| *x += 1));
        }
        assert!(v.iter().all(|&x| x == 5000));
    }

    #[test]
    fn the_pools_threads_run_at_its_niceness() {
        // On a thread of its own, which the job's first call lowers for good.
        let got = std::thread::spawn(|| {
            let before = rustix::process::getpriority_process(None).unwrap_or(0);
            let want = (before + 3).min(19);
            let pool = Pool::new(3, want);
            let workers = pool.worker_nice().to_vec();
            let caller_before = rustix::process::getpriority_process(None).ok();
            assert!(pool.for_each(16, &|_| {}));
            (before, want, workers, caller_before, rustix::process::getpriority_process(None).ok())
        })
        .join()
        .unwrap();
        let (before, want, workers, caller_before, caller_after) = got;
        assert_eq!(workers, vec![Some(want); 2], "each worker at the pool's niceness from the start");
        assert_eq!(caller_before, Some(before), "the caller keeps its priority until its first job");
        assert_eq!(caller_after, Some(want), "and runs its jobs at the pool's");
        // a pool without a niceness leaves its threads alone
        let plain = Pool::new(2, 0);
        assert_eq!(plain.worker_nice(), &[rustix::process::getpriority_process(None).ok()]);
    }

    #[test]
    fn resting_workers_sleep_and_the_next_job_wakes_them() {
        let pool = Pool::new(3, 0);
        let sum = AtomicUsize::new(0);
        for round in 0..50 {
            assert!(pool.for_each(64, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            }));
            pool.rest();
            let deadline = Instant::now() + Duration::from_secs(30);
            while pool.shared.sleepers.load(Ordering::SeqCst) < 2 {
                assert!(Instant::now() < deadline, "round {round}: the workers did not go to sleep");
                std::thread::yield_now();
            }
        }
        assert_eq!(sum.load(Ordering::Relaxed), 50 * 2016);
    }

    #[test]
    fn more_threads_than_cores_still_finish() {
        let pool = Pool::new(16, 0);
        let sum = AtomicUsize::new(0);
        for _ in 0..200 {
            assert!(pool.for_each(100, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            }));
        }
        assert_eq!(sum.load(Ordering::Relaxed), 200 * 4950);
    }

    #[test]
    fn a_panicking_item_is_reported() {
        let pool = Pool::new(2, 0);
        let ok = pool.for_each(64, &|i| {
            if i == 40 {
                std::panic::panic_any("boom");
            }
        });
        assert!(!ok);
        // and the pool keeps working
        assert!(pool.for_each(64, &|_| {}));
    }
}
