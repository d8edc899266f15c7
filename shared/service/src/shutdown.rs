//! One shutdown signal and one deadline for every service (after mini-redis's `shutdown.rs`
//! and linkerd's `signal` crate).
//!
//! A [`ShutdownTrigger`] starts the shutdown once; every clone of the [`Shutdown`] handle then
//! resolves. The handle also carries the deadline, so that a service sizing a drain of its
//! own (the frontend's HTTP drain, the worker's give-ups) sizes it from the same number the
//! shell enforces.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

/// How long a service has, from the moment its shutdown begins, to stop: readiness 503,
/// in-flight work drained, P's blocks given back. `PDMESH_SHUTDOWN_DEADLINE_S` overrides it.
pub const DEFAULT_SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

/// Exit status of a service whose graceful stop overran the deadline (what `timeout(1)`
/// exits with): it stopped, but something was cut short. 0 is a clean stop, 1 a failure,
/// [`pdmesh_config::EXIT_CONFIG`] a configuration error.
pub const EXIT_SHUTDOWN_TIMEOUT: u8 = 124;

/// The deadline of this process: `PDMESH_SHUTDOWN_DEADLINE_S` (whole seconds, at least 1),
/// else [`DEFAULT_SHUTDOWN_DEADLINE`]. A value that is not a positive number is a
/// configuration error.
pub fn deadline_from_env() -> Result<Duration, pdmesh_config::ConfigError> {
    let name = pdmesh_config::env::SHUTDOWN_DEADLINE_S;
    match pdmesh_config::env::get(name) {
        None => Ok(DEFAULT_SHUTDOWN_DEADLINE),
        Some(text) => match text.trim().parse::<u64>() {
            Ok(s) if s > 0 => Ok(Duration::from_secs(s)),
            _ => Err(pdmesh_config::ConfigError::Invalid(format!(
                "{name} = {text:?}: expected a whole number of seconds, at least 1"
            ))),
        },
    }
}

/// Starts the shutdown. Dropping it starts the shutdown too: a service whose trigger is gone
/// could never be stopped otherwise.
#[derive(Debug)]
pub struct ShutdownTrigger(watch::Sender<bool>);

impl ShutdownTrigger {
    /// Start the shutdown (again: no effect).
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

/// Resolves when the shutdown begins; clone it for every task that must stop.
#[derive(Debug, Clone)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
    deadline: Duration,
}

/// A trigger and the handle it resolves, with the deadline the stop is held to.
pub fn shutdown_channel(deadline: Duration) -> (ShutdownTrigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (ShutdownTrigger(tx), Shutdown { rx, deadline })
}

impl Shutdown {
    /// Resolve once the shutdown has begun (at once if it already has).
    pub async fn started(&self) {
        let mut rx = self.rx.clone();
        // An error means the trigger is gone: that starts the shutdown too.
        let _ = rx.wait_for(|begun| *begun).await;
    }

    /// Whether the shutdown has begun.
    pub fn is_started(&self) -> bool {
        *self.rx.borrow() || self.rx.has_changed().is_err()
    }

    /// The time the stop is allowed, counted from the moment the shutdown begins.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }
}

/// How often [`drain`] looks again.
const DRAIN_POLL: Duration = Duration::from_millis(20);

/// Wait until `remaining` reports no work left (`Some(0)`), or cannot tell any more (`None`: the
/// actor that owns the work is gone), looking every 20 ms. The deadline around the whole stop
/// bounds it; `what` names the work in the debug log.
pub async fn drain<F, Fut>(what: &str, mut remaining: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<usize>>,
{
    loop {
        match remaining().await {
            Some(0) | None => return,
            Some(n) => {
                tracing::debug!(remaining = n, "draining {what}");
                tokio::time::sleep(DRAIN_POLL).await;
            }
        }
    }
}

/// A stop that was still running when the deadline passed: the process exits with
/// [`EXIT_SHUTDOWN_TIMEOUT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the graceful stop overran its {0:?} deadline")]
pub struct DeadlineExceeded(pub Duration);

/// Drive `service` (a service's whole `run`: start, serve, stop) and hold its stop to the
/// deadline: once `shutdown` begins, `service` has [`Shutdown::deadline`] to return, else it
/// is dropped and the stop is reported as [`DeadlineExceeded`]. A service that returns before
/// any shutdown (a failure, a lost accelerator) returns its own result.
pub async fn stop_within_deadline<F: Future>(service: F, shutdown: &Shutdown) -> Result<F::Output, DeadlineExceeded> {
    let service = std::pin::pin!(service);
    let mut service = service;
    tokio::select! {
        out = &mut service => return Ok(out),
        () = shutdown.started() => {}
    }
    tracing::info!(deadline_s = shutdown.deadline.as_secs_f64(), "shutting down");
    match tokio::time::timeout(shutdown.deadline, service).await {
        Ok(out) => Ok(out),
        Err(_) => {
            tracing::error!(deadline_s = shutdown.deadline.as_secs_f64(), "the graceful stop overran its deadline");
            Err(DeadlineExceeded(shutdown.deadline))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    /// Fails if a clone made before (or after) the trigger missed it, or if a handle resolved
    /// before the trigger.
    #[tokio::test]
    async fn the_trigger_resolves_every_clone() {
        let (trigger, shutdown) = shutdown_channel(DEFAULT_SHUTDOWN_DEADLINE);
        let early: Vec<Shutdown> = (0..3).map(|_| shutdown.clone()).collect();
        let waiters: Vec<_> = early.into_iter().map(|s| tokio::spawn(async move { s.started().await })).collect();
        tokio::task::yield_now().await;
        assert!(!shutdown.is_started());
        assert!(waiters.iter().all(|w| !w.is_finished()), "resolved before the trigger");
        trigger.trigger();
        for w in waiters {
            w.await.unwrap();
        }
        let late = shutdown.clone();
        late.started().await;
        assert!(late.is_started(), "a clone made after the trigger sees it too");
        trigger.trigger();
        shutdown.started().await;
    }

    /// A service can never be left unstoppable: dropping the trigger counts as the trigger.
    #[tokio::test]
    async fn a_dropped_trigger_starts_the_shutdown() {
        let (trigger, shutdown) = shutdown_channel(DEFAULT_SHUTDOWN_DEADLINE);
        drop(trigger);
        assert!(shutdown.is_started());
        shutdown.started().await;
    }

    /// A stop that finishes is reported as the service's own result (clean), however long the
    /// deadline; fails if the deadline were applied before the shutdown began or the result
    /// were lost.
    #[tokio::test]
    async fn a_quick_stop_is_clean() {
        let (trigger, shutdown) = shutdown_channel(Duration::from_secs(3600));
        let s = shutdown.clone();
        let service = async move {
            s.started().await;
            "drained"
        };
        trigger.trigger();
        assert_eq!(stop_within_deadline(service, &shutdown).await, Ok("drained"));
    }

    /// A stop that never finishes is cut at the deadline and reported as a timeout; fails if
    /// the shell waited for it for ever or called it clean.
    #[tokio::test]
    async fn a_stop_past_the_deadline_is_a_timeout() {
        let deadline = Duration::from_millis(20);
        let (trigger, shutdown) = shutdown_channel(deadline);
        let s = shutdown.clone();
        let service = async move {
            s.started().await;
            std::future::pending::<()>().await;
        };
        trigger.trigger();
        assert_eq!(stop_within_deadline(service, &shutdown).await, Err(DeadlineExceeded(deadline)));
    }

    /// A drain ends when the work is done or its owner is gone, not before.
    #[tokio::test]
    async fn a_drain_waits_for_the_work_to_end() {
        let mut left = vec![None, Some(0), Some(1), Some(2)];
        let mut looked = 0;
        drain("requests", || {
            looked += 1;
            std::future::ready(left.pop().flatten())
        })
        .await;
        assert_eq!(looked, 3, "stopped at 0, not before");
        let mut gone = 0;
        drain("requests", || {
            gone += 1;
            std::future::ready(None)
        })
        .await;
        assert_eq!(gone, 1);
    }

    /// A service that ends on its own before any shutdown (a failure) returns its result;
    /// no deadline applies.
    #[tokio::test]
    async fn a_service_ending_before_shutdown_returns_its_result() {
        let (_trigger, shutdown) = shutdown_channel(Duration::from_millis(1));
        let out = stop_within_deadline(async { Err::<(), _>("device lost") }, &shutdown).await;
        assert_eq!(out, Ok(Err("device lost")));
    }

    /// The deadline setting: a number of seconds, else a configuration error naming the
    /// variable.
    #[test]
    fn the_deadline_setting_is_checked() {
        // One test touches the variable: tests of this binary run in parallel.
        let name = pdmesh_config::env::SHUTDOWN_DEADLINE_S;
        std::env::remove_var(name);
        assert_eq!(deadline_from_env().unwrap(), DEFAULT_SHUTDOWN_DEADLINE);
        std::env::set_var(name, "3");
        assert_eq!(deadline_from_env().unwrap(), Duration::from_secs(3));
        for bad in ["0", "ten", "-1"] {
            std::env::set_var(name, bad);
            let e = deadline_from_env().unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        std::env::remove_var(name);
    }
}
