//! Every message that crosses a process boundary in pdmesh.
//!
//! This crate owns the wire: one [`Envelope`] type that carries a protocol version, the W3C
//! trace context, the request id a message concerns and a correlation id for request/reply,
//! around one [`Message`] body. Bodies are plain serde types encoded as MessagePack with named
//! fields (`rmp_serde::to_vec_named`), so readers can tolerate appended fields (see
//! `docs/PROTOCOL.md`). There is no I/O here: sockets live in `pdmesh-transport`.
//!
//! Map of the modules:
//! - [`envelope`]: the envelope, the version check and the codec (`encode` / `decode`).
//! - [`engine`]: frontend ⇄ dp-lb ⇄ engine-core: add request, abort, outputs, load reports.
//! - [`step`]: engine-core ⇄ connector-worker: the per-step schedule and its model output.
//! - [`connector`]: engine-core ⇄ connector-scheduler: the KV connector calls.
//! - [`kv`]: `kv_transfer_params` and KV accounting shared by the others.
//! - [`transfer`]: the KV transfer agent's side channel and TCP data-plane framing.
//! - [`node_http`]: the HTTP contract between the P/D router and the nodes' frontends.
//! - [`prefix`]: the prefix cache's block hashes and the summary a node publishes of them.

pub mod connector;
pub mod engine;
pub mod envelope;
pub mod kv;
pub mod node_http;
pub mod prefix;
pub mod step;
pub mod transfer;

/// Microseconds since the Unix epoch (0 if the clock is before it): timestamps that cross
/// processes, e.g. a rejection's time carried to P.
pub fn unix_micros() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

/// Microseconds from `at` (Unix µs) until now; 0 when `at` lies ahead (clocks of two nodes).
pub fn micros_since(at: u64) -> u64 {
    unix_micros().saturating_sub(at)
}

pub use connector::*;
pub use engine::*;
pub use envelope::*;
pub use kv::*;
pub use node_http::NodeLoad;
pub use prefix::PrefixSummary;
pub use step::*;
pub use transfer::*;

use serde::{Deserialize, Serialize};

/// The body of an [`Envelope`]. Externally tagged (`{"AddRequest": {...}}`) so a reader that
/// meets a kind it does not know gets a typed decode error instead of a wrong value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    // ---- frontend -> dp-lb -> engine-core
    /// A new request for an engine.
    AddRequest(EngineRequest),
    /// Abort these requests (client disconnect, stop string reached in the frontend, ...).
    Abort(AbortRequests),
    /// A process introduces itself on a connection (engine rank to dp-lb, frontend to dp-lb).
    Hello(Hello),
    /// Ask for current statistics (frontend -> dp-lb, dp-lb -> each engine rank).
    StatsQuery,
    /// Answer to [`Message::StatsQuery`].
    StatsReply(MeshStats),
    /// Can this node serve? (frontend -> dp-lb, for the frontend's `/health`). Answered from
    /// the dp-lb's own view of its ranks, without asking them: a busy rank must not look down.
    ReadinessQuery,
    /// Answer to [`Message::ReadinessQuery`].
    Readiness(NodeReadiness),

    // ---- engine-core -> dp-lb -> frontend
    /// Outputs of one engine step, streamed.
    EngineOutputs(EngineOutputBatch),
    /// A rank's load, reported after steps (dp-lb scores ranks with it).
    LoadReport(EngineLoadReport),

    // ---- engine-core <-> connector-worker
    /// Ask the worker for its KV cache geometry and model facts.
    WorkerInfoQuery,
    /// Answer to [`Message::WorkerInfoQuery`].
    WorkerInfo(WorkerInfo),
    /// Run one engine step.
    ExecuteStep(SchedulerOutput),
    /// The result of one engine step.
    StepResult(ModelRunnerOutput),

    // ---- engine-core <-> connector-scheduler
    /// A batch of connector calls, answered in order by [`Message::ConnectorReplies`].
    ConnectorCalls(Vec<ConnectorCall>),
    /// Answers to [`Message::ConnectorCalls`], one per call, same order.
    ConnectorReplies(Vec<ConnectorReply>),

    // ---- generic
    /// A call was accepted (e.g. the dp-lb forwarded an `AddRequest` to a live rank).
    Ack,
    /// Liveness probe; answered with [`Message::Pong`].
    Ping,
    /// Answer to [`Message::Ping`].
    Pong,
    /// A request could not be served; carries a class that crosses processes.
    Error(WireError),

    // ---- KV transfer agent: D's connector-worker -> P's side channel (see [`transfer`])
    /// Ask a producer agent for its [`AgentMetadata`] (the handshake).
    XferGetMetadata,
    /// Answer to [`Message::XferGetMetadata`].
    XferMetadata(AgentMetadata),
    /// Ask for a read lease on one request's held blocks.
    XferLease(XferLeaseRequest),
    /// The lease is granted.
    XferLeaseGranted(XferLeaseGranted),
    /// The lease (or a TCP block read) is refused.
    XferLeaseRefused(XferLeaseRefused),
    /// Reading under a lease is done; answered with [`Message::Ack`] while the lease held.
    XferReadDone(XferReadDone),
    /// Keep these held requests alive; answered with [`Message::Ack`].
    XferHeartbeat(XferHeartbeat),
    /// The consumer will never read this request; answered with [`Message::Ack`].
    XferGiveUp(XferGiveUp),
    /// TCP data plane: read blocks under a lease.
    XferReadBlocks(XferReadBlocks),
    /// TCP data plane: the raw block bytes follow.
    XferReadReady(XferReadReady),

    // ---- rule R1: D refused a remote-prefill request before admission
    /// frontend → dp-lb → engine-core rank(s): P's blocks for these params will never be read.
    RejectionNotice(RejectionNotice),
    /// engine-core → connector-worker: connector metadata to act on now, outside a step
    /// (the notify-only receives of rejections; answered with `Ack`).
    ConnectorMetadata(KvConnectorMetadata),

    // ---- mesh authentication (docs/SECURITY.md): first on every side channel, `tcp` data
    // plane and `tcp` internal connection
    /// Client → server: the client's fresh nonce.
    AuthHello(AuthHello),
    /// Server → client: the server's nonce and its proof of the mesh secret.
    AuthChallenge(AuthChallenge),
    /// Client → server: the client's proof; answered with [`Message::Ack`] or an
    /// `unauthenticated` [`Message::Error`].
    AuthProof(AuthProof),
}

impl Message {
    /// A short static name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::AddRequest(_) => "add_request",
            Message::Abort(_) => "abort",
            Message::Hello(_) => "hello",
            Message::StatsQuery => "stats_query",
            Message::StatsReply(_) => "stats_reply",
            Message::ReadinessQuery => "readiness_query",
            Message::Readiness(_) => "readiness",
            Message::EngineOutputs(_) => "engine_outputs",
            Message::LoadReport(_) => "load_report",
            Message::WorkerInfoQuery => "worker_info_query",
            Message::WorkerInfo(_) => "worker_info",
            Message::ExecuteStep(_) => "execute_step",
            Message::StepResult(_) => "step_result",
            Message::ConnectorCalls(_) => "connector_calls",
            Message::ConnectorReplies(_) => "connector_replies",
            Message::Ack => "ack",
            Message::Ping => "ping",
            Message::Pong => "pong",
            Message::Error(_) => "error",
            Message::XferGetMetadata => "xfer_get_metadata",
            Message::XferMetadata(_) => "xfer_metadata",
            Message::XferLease(_) => "xfer_lease",
            Message::XferLeaseGranted(_) => "xfer_lease_granted",
            Message::XferLeaseRefused(_) => "xfer_lease_refused",
            Message::XferReadDone(_) => "xfer_read_done",
            Message::XferHeartbeat(_) => "xfer_heartbeat",
            Message::XferGiveUp(_) => "xfer_give_up",
            Message::XferReadBlocks(_) => "xfer_read_blocks",
            Message::XferReadReady(_) => "xfer_read_ready",
            Message::RejectionNotice(_) => "rejection_notice",
            Message::ConnectorMetadata(_) => "connector_metadata",
            Message::AuthHello(_) => "auth_hello",
            Message::AuthChallenge(_) => "auth_challenge",
            Message::AuthProof(_) => "auth_proof",
        }
    }
}

/// Which kind of process is on the other end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceKind {
    Frontend,
    DpLb,
    EngineCore,
    ConnectorScheduler,
    ConnectorWorker,
}

/// First message on a connection, so the bound side knows who connected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub service: ServiceKind,
    /// Data-parallel rank for engine-side services; 0 otherwise.
    #[serde(default)]
    pub rank: u32,
    /// Process id, so operators can match a connection to a process.
    #[serde(default)]
    pub pid: u32,
}

/// D refused a request carrying `do_remote_prefill` before its engine admitted it (rule R1).
/// Without a rank the dp-lb broadcasts it to every rank; with one, only that rank gets it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RejectionNotice {
    /// The raw `kv_transfer_params` of the refused request.
    pub params: KvTransferParams,
    /// The client's `X-data-parallel-rank`, if any.
    #[serde(default)]
    pub data_parallel_rank: Option<u32>,
    /// When D refused the request (Unix µs): P measures rejection → free from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected_at_unix_us: Option<u64>,
    /// The refused request's trace (engine-core fills it from the Envelope it arrived in): the
    /// notice to P, and P's release, join the request's trace.
    #[serde(default)]
    pub trace: TraceContext,
}

/// The error classes that cross process boundaries. The frontend maps them to HTTP statuses
/// in one place; everyone else only propagates them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// The caller sent something invalid (400).
    InvalidRequest,
    /// The named thing does not exist (404).
    NotFound,
    /// A process the request needs is down or restarting (503).
    Unavailable,
    /// A bug or an unexpected failure inside the mesh (500).
    Internal,
    /// The request ran past a deadline (504).
    Timeout,
    /// A mesh peer did not prove knowledge of the mesh secret (or its handshake failed): the
    /// answer to every message on a connection that is not authenticated (docs/SECURITY.md).
    Unauthenticated,
    /// A bounded queue is full: the caller should come back later (503 with `Retry-After`).
    /// Appended after the others, so the encoding of the older classes does not change.
    Overloaded,
}

/// An error answer on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireError {
    pub class: ErrorClass,
    pub message: String,
}

impl WireError {
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        Self { class, message: message.into() }
    }
}
