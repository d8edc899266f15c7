//! engine-core: one data-parallel rank's scheduler and step loop (vLLM's `EngineCore`).
//!
//! - [`scheduler`]: the continuous-batching scheduler over a paged block pool (pure state
//!   machine, unit- and property-tested).
//! - [`block_pool`], [`request`]: blocks with generations; requests with vLLM's statuses.
//! - [`step`]: one engine step as a sans-IO state machine (the only copy of the step
//!   sequence: the actor, the lifecycle property test and the in-process benchmark drive it).
//! - [`engine`]: the actor that owns the scheduler, takes requests and aborts from the dp-lb,
//!   calls the connector-scheduler and connector-worker over ZeroMQ each step, and streams
//!   outputs back.

pub mod block_pool;
pub mod engine;
pub mod metrics;
pub mod request;
pub mod scheduler;
pub mod step;

pub use engine::{run, EngineError};
