//! The start-up and shutdown shell every pdmesh service shares (docs/DECISIONS.md, D47).
//!
//! Each service crate exposes `run(ctx, …, shutdown)`: it starts from a [`ServiceContext`],
//! serves until its [`Shutdown`] resolves, then stops gracefully — readiness to 503 first
//! ([`pdmesh_telemetry::ops::Health::begin_drain`]), in-flight work drained, what it holds
//! for others given back — and returns. `pdmesh <service>` (services/pdmesh/src/main.rs) is
//! the one place that feeds the [`Shutdown`] (SIGINT, SIGTERM, its parent `pdmesh up` gone)
//! and enforces the one deadline around the stop with [`stop_within_deadline`]; tests start
//! the same `run` in-process and stop it through a [`ShutdownTrigger`].
//!
//! - [`shutdown`]: the shutdown handle, its trigger and the deadline.
//! - [`context`]: what every service computes at start-up (its node, a rank checked against
//!   `dp_size`, endpoints, readiness, the ops server).

pub mod context;
pub mod shutdown;

pub use context::{ServiceContext, StartError, Unfinished};
pub use shutdown::{
    deadline_from_env, drain, shutdown_channel, stop_within_deadline, DeadlineExceeded, Shutdown, ShutdownTrigger,
    DEFAULT_SHUTDOWN_DEADLINE, EXIT_SHUTDOWN_TIMEOUT,
};
