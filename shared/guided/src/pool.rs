//! The threads grammars are compiled on (D90): few, with big stacks, under a time budget.
//!
//! A compilation never runs on the caller's thread. The caller may be an async worker
//! (2 MiB of stack; blocking it stalls every connection it serves, `/live` included) or an
//! executor thread; here it only waits on a channel, up to the budget. The pool's threads
//! have [`STACK_BYTES`] of stack (reserved, touched only as deep as a compilation goes), far
//! more than the deepest spec [`crate::limits::check`] lets through needs. Its queue is
//! bounded: a burst of expensive specs is refused as busy, not queued without end. A
//! compilation that overruns its budget cannot be interrupted (llguidance has no cancel);
//! its caller is answered at once and the thread finishes the work in the background, which
//! is bounded by llguidance's own fuel and size limits.

use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::GuidedError;

/// Stack of each compile thread.
pub const STACK_BYTES: usize = 256 * 1024 * 1024;
/// Compile threads.
const THREADS: usize = 2;
/// Compilations waiting for a thread; beyond it a request is refused as busy.
const QUEUE: usize = 32;

type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    tx: Mutex<SyncSender<Job>>,
}

fn pool() -> Result<&'static Pool, GuidedError> {
    static POOL: OnceLock<Result<Pool, String>> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = mpsc::sync_channel::<Job>(QUEUE);
        let rx = std::sync::Arc::new(Mutex::new(rx));
        for i in 0..THREADS {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("guided-compile-{i}"))
                .stack_size(STACK_BYTES)
                .spawn(move || loop {
                    let job = match rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })
                .map_err(|e| format!("cannot start a grammar compile thread: {e}"))?;
        }
        Ok(Pool { tx: Mutex::new(tx) })
    })
    .as_ref()
    .map_err(|e| GuidedError::Unavailable(e.clone()))
}

/// Run `work` on a compile thread and wait for its answer, at most `budget`. A job still
/// queued when its caller gave up is skipped.
pub fn run<T, F>(budget: Duration, work: F) -> Result<T, GuidedError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let pool = pool()?;
    let deadline = Instant::now() + budget;
    let (tx, rx) = mpsc::sync_channel::<Result<T, String>>(1);
    let job: Job = Box::new(move || {
        if Instant::now() < deadline {
            // A panic in the compiler is that spec's failure, not the thread's end.
            let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).map_err(|p| {
                p.downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".into())
            });
            // the caller may have given up meanwhile: nothing to answer then
            let _ = tx.send(answer);
        }
    });
    let sent = match pool.tx.lock() {
        Ok(sender) => sender.try_send(job),
        Err(_) => return Err(GuidedError::Unavailable("the grammar compile pool is broken".into())),
    };
    match sent {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => return Err(GuidedError::Busy),
        Err(TrySendError::Disconnected(_)) => {
            return Err(GuidedError::Unavailable("the grammar compile pool stopped".into()))
        }
    }
    match rx.recv_timeout(budget) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(panic)) => Err(GuidedError::Compiler(format!("panic: {panic}"))),
        Err(RecvTimeoutError::Timeout) => Err(GuidedError::Limit(format!(
            "compiling it took longer than the limit of {} ms (`limits.guided_compile_timeout_ms`)",
            budget.as_millis()
        ))),
        // the job was skipped: its deadline passed while it waited in the queue
        Err(RecvTimeoutError::Disconnected) => Err(GuidedError::Limit(format!(
            "it could not be compiled within the limit of {} ms (`limits.guided_compile_timeout_ms`)",
            budget.as_millis()
        ))),
    }
}
