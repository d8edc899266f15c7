//! A tiny persistent thread pool for the forward pass.
//!
//! Why not `std::thread::scope` per matmul: a decode step runs ~250 parallel regions
//! (7 matmuls and attention in each of 30 layers); spawning and joining threads for each costs
//! tens of microseconds, a sizeable share of a ~6 ms step. Here `n - 1` workers live as long as
//! the executor, spin briefly after each job (the next region usually follows within
//! microseconds) and then sleep on a condvar, so an idle worker burns no CPU.
//!
//! The calling thread takes part as thread 0. A job is a borrowed closure; the pool hands it to
//! the workers by erasing its lifetime, which is sound because [`Pool::run`] does not return
//! until every worker has finished with it (that is the one `unsafe` idea here).

#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins for the next job before it sleeps.
const SPIN: Duration = Duration::from_micros(300);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// The current job, valid while `pending > 0` for the workers' epoch.
    job: UnsafeCell<Option<*const Job>>,
    epoch: AtomicUsize,
    pending: AtomicUsize,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    panicked: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the owning thread while no worker reads it (between jobs,
// when `pending == 0`), and read by workers only after observing the new epoch (Acquire),
// which happens-after the write (Release/SeqCst on `epoch`). The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// How [`Pool::par_chunks_mut`] assigns chunks to threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Thread `i` gets the `i`-th contiguous range of chunks (uniform work; no false sharing).
    Contiguous,
    /// Chunk `c` goes to thread `c % n` (work that grows along the data, like causal attention).
    Interleaved,
}

/// A fixed set of threads that run one job at a time.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
    /// Serialises `run` (the pool is shared by reference; one job at a time).
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

impl Pool {
    /// A pool of `n_threads` (the caller counts as one; at least 1). If a worker thread cannot
    /// be spawned the pool simply runs with fewer threads.
    pub fn new(n_threads: usize) -> Self {
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            epoch: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = Vec::new();
        for tid in 1..n_threads.max(1) {
            let s = Arc::clone(&shared);
            match std::thread::Builder::new().name(format!("pdmesh-model-{tid}")).spawn(move || worker(&s, tid)) {
                Ok(h) => workers.push(h),
                Err(e) => {
                    tracing::warn!(error = %e, "could not spawn model worker thread; running with fewer threads");
                    break;
                }
            }
        }
        let n_threads = workers.len() + 1;
        Self { shared, workers, n_threads, run_lock: Mutex::new(()) }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Run `f(thread_index)` on every thread of the pool (the caller is thread 0) and wait for
    /// all of them. Returns false if `f` panicked on some thread.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) -> bool {
        if self.workers.is_empty() {
            return catch_unwind(AssertUnwindSafe(|| f(0))).is_ok();
        }
        let _one_at_a_time = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        // SAFETY: erase the borrow's lifetime so workers can see it. No worker touches it after
        // `pending` reaches 0, and we do not return before that, so it never outlives `f`.
        let erased: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        // SAFETY: no job is in flight (pending == 0, see the wait below), so no worker reads `job`.
        unsafe { *s.job.get() = Some(erased) };
        s.pending.store(self.workers.len(), Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        let ok_here = catch_unwind(AssertUnwindSafe(|| f(0))).is_ok();
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) > 0 {
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: every worker finished the job (pending == 0).
        unsafe { *s.job.get() = None };
        let ok_workers = !s.panicked.swap(false, Ordering::SeqCst);
        ok_here && ok_workers
    }

    /// Split `data` into chunks of `chunk` elements (the last may be shorter) and call
    /// `f(chunk_index, chunk)` for each, in parallel. Returns false if `f` panicked.
    pub fn par_chunks_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        schedule: Schedule,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) -> bool {
        let chunk = chunk.max(1);
        let len = data.len();
        let n_chunks = len.div_ceil(chunk);
        let nt = self.n_threads.min(n_chunks).max(1);
        let base = SendPtr(data.as_mut_ptr());
        let body = |tid: usize| {
            if tid >= nt {
                return;
            }
            let mut each = |c: usize| {
                let start = c * chunk;
                let end = (start + chunk).min(len);
                // SAFETY: chunk `c` covers `start..end`, inside `data` (end ≤ len), and every
                // chunk index is visited by exactly one thread, so the slices are disjoint;
                // `data` is exclusively borrowed for the whole call.
                let part = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
                f(c, part);
            };
            match schedule {
                Schedule::Contiguous => (n_chunks * tid / nt..n_chunks * (tid + 1) / nt).for_each(&mut each),
                Schedule::Interleaved => (tid..n_chunks).step_by(nt).for_each(&mut each),
            }
        };
        self.run(&body)
    }
}

struct SendPtr<T>(*mut T);
impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}
// SAFETY: the pointer is only used to build disjoint sub-slices of a `&mut [T]` with `T: Send`.
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(s: &Shared, tid: usize) {
    let mut seen = s.epoch.load(Ordering::SeqCst);
    loop {
        // Spin a little: the next job usually follows within microseconds.
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen {
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 && start.elapsed() > SPIN {
                let mut g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                while s.epoch.load(Ordering::SeqCst) == seen {
                    g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            std::hint::spin_loop();
        }
        seen = s.epoch.load(Ordering::Acquire);
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: a new epoch with pending > 0 means `job` holds a live pointer until we
        // decrement `pending` (see `Pool::run`).
        let job = unsafe { *s.job.get() };
        if let Some(job) = job {
            // SAFETY: as above, the closure outlives this call.
            let f = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| f(tid))).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_once() {
        let pool = Pool::new(3);
        for schedule in [Schedule::Contiguous, Schedule::Interleaved] {
            for len in [0usize, 1, 7, 64, 1000] {
                let mut v = vec![0u32; len];
                assert!(pool.par_chunks_mut(&mut v, 7, schedule, |c, part| {
                    for (i, x) in part.iter_mut().enumerate() {
                        *x += (c * 7 + i) as u32 + 1;
                    }
                }));
                assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32 + 1));
            }
        }
        // many small jobs in a row (the decode pattern)
        let mut v = vec![0u64; 64];
        for _ in 0..2000 {
            pool.par_chunks_mut(&mut v, 8, Schedule::Contiguous, |_, p| p.iter_mut().for_each(|x| *x += 1));
        }
        assert!(v.iter().all(|&x| x == 2000));
    }

    #[test]
    fn a_panicking_job_is_reported() {
        let pool = Pool::new(2);
        let ok = pool.run(&|tid| {
            if tid == 1 {
                std::panic::panic_any("boom");
            }
        });
        assert!(!ok);
        // and the pool keeps working
        assert!(pool.run(&|_| {}));
    }
}
