//! The socket side of the frontend: one actor that owns the DEALER link to the dp-lb and the
//! table of requests in flight.
//!
//! Requests go out as `AddRequest` calls on the link; their outputs come back on the
//! frontend's PULL socket (or, tolerated, on the link) as `EngineOutputs` batches, and each
//! [`EngineOutput`] is routed by request id to the channel its HTTP handler reads. The actor
//! guarantees that no handler waits forever: a refused or failed submit is answered at once,
//! a lost link ends every request in flight with an `unavailable` error output, and a handler
//! that went away (client disconnect) gets its engine request aborted.
//!
//! Each submission carries a *ticket* (a process-unique number). Aborts and cleanups name
//! the ticket as well as the id, so a late abort of a finished request never hits a newer
//! request that reuses the same client-chosen id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix::prelude::*;
use pdmesh_protocol::{
    AbortRequests, EngineOutput, EngineRequest, Envelope, FinishReason, Hello, MeshStats, Message as WireMessage,
    NodeReadiness, ServiceKind, TraceContext,
};
use pdmesh_transport::{connect_dealer, LinkConfig, LinkEvent, LinkHandle, PullEvent, TransportError};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::metrics::{ABORTS_SENT_TOTAL, LINK_UP, UNEXPECTED_MESSAGES_TOTAL, UNKNOWN_OUTPUTS};

/// How long the dp-lb has to accept or refuse a request.
pub const SUBMIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the dp-lb has to answer a statistics query.
pub const STATS_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the dp-lb has to answer a readiness query (it answers from its own state, so a
/// slow answer means the dp-lb itself is in trouble).
pub const READINESS_TIMEOUT: Duration = Duration::from_secs(2);
/// How often requests whose handler is gone are looked for (a safety net; handlers abort
/// their own requests when dropped).
const SWEEP_INTERVAL: Duration = Duration::from_secs(2);
/// ZeroMQ identity of the frontend on the dp-lb's ROUTER.
pub const LINK_IDENTITY: &str = "frontend";

static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);

/// A process-unique number for one submission.
pub fn next_ticket() -> u64 {
    NEXT_TICKET.fetch_add(1, Ordering::Relaxed)
}

/// The receiving end of one request's outputs (bounded by `limits.output_buffer`).
pub type OutputReceiver = mpsc::Receiver<EngineOutput>;

/// One line a second about requests cut off because their client does not read.
static OVERFLOW_LOG: pdmesh_telemetry::log_limit::LogLimiter =
    pdmesh_telemetry::log_limit::LogLimiter::new(Duration::from_secs(1));

/// Why the frontend aborts an engine request (label of `pdmesh_frontend_aborts_sent_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortReason {
    /// The HTTP client went away (SSE body dropped, handler cancelled).
    ClientDisconnect,
    /// A stop string was reached in the frontend; the engine does not know.
    StopString,
    /// Outputs arrived for a handler that no longer listens.
    ReceiverGone,
    /// The dp-lb did not answer the submit in time; it may still have accepted it.
    SubmitTimeout,
    /// The frontend could not turn the outputs into a response (e.g. detokenisation failed).
    OutputError,
    /// The request's output buffer is full: its client stopped reading (`limits.output_buffer`).
    OutputOverflow,
}

impl AbortReason {
    pub fn as_str(self) -> &'static str {
        match self {
            AbortReason::ClientDisconnect => "client_disconnect",
            AbortReason::StopString => "stop_string",
            AbortReason::ReceiverGone => "receiver_gone",
            AbortReason::SubmitTimeout => "submit_timeout",
            AbortReason::OutputError => "output_error",
            AbortReason::OutputOverflow => "output_overflow",
        }
    }
}

/// Send a request to the engine. Answers with the channel its outputs will arrive on, or
/// why the mesh refused it.
#[derive(Debug, Message)]
#[rtype(result = "Result<OutputReceiver, ApiError>")]
pub struct Submit {
    pub request: EngineRequest,
    pub trace: TraceContext,
    pub ticket: u64,
}

/// Stop following a request and abort it in the engine if it is still running there. A
/// no-op when the request already finished (or the ticket is not the current one).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Abort {
    pub request_id: String,
    pub ticket: u64,
    pub reason: AbortReason,
}

/// Ask the dp-lb for the statistics of every rank.
#[derive(Debug, Message)]
#[rtype(result = "Result<MeshStats, ApiError>")]
pub struct Stats;

/// Ask the dp-lb how many of its engine ranks are connected (for `/health`).
#[derive(Debug, Message)]
#[rtype(result = "Result<NodeReadiness, ApiError>")]
pub struct Readiness;

/// How many requests are in flight (for tests and debugging).
#[derive(Debug, Message)]
#[rtype(result = "usize")]
pub struct InFlightCount;

struct InFlight {
    ticket: u64,
    tx: mpsc::Sender<EngineOutput>,
}

/// The actor (see the module docs).
pub struct EngineClient {
    link: LinkHandle,
    in_flight: HashMap<String, InFlight>,
    /// Capacity of each request's output channel.
    output_buffer: usize,
}

impl EngineClient {
    /// Start the actor and its DEALER link to the dp-lb at `endpoint` (which reconnects by
    /// itself). Each request's outputs are buffered up to `output_buffer` (at least 1); a
    /// request whose handler falls that far behind is aborted. The returned handle tells
    /// whether the link is up (for `/health`).
    pub fn start(endpoint: String, output_buffer: usize) -> (Addr<Self>, LinkHandle) {
        let ctx = Context::<Self>::new();
        let hello = Envelope::new(WireMessage::Hello(Hello {
            service: ServiceKind::Frontend,
            rank: 0,
            pid: std::process::id(),
        }));
        let config = LinkConfig::new(endpoint).identity(LINK_IDENTITY).hello(hello);
        let link = connect_dealer(config, ctx.address().recipient());
        let output_buffer = output_buffer.max(1);
        let addr = ctx.run(EngineClient { link: link.clone(), in_flight: HashMap::new(), output_buffer });
        (addr, link)
    }

    /// Route one output to its handler.
    fn dispatch(&mut self, output: EngineOutput) {
        let finished = output.finish_reason.is_some();
        let Some(entry) = self.in_flight.get(&output.request_id) else {
            UNKNOWN_OUTPUTS.inc();
            tracing::debug!(request_id = %output.request_id, "output for a request nobody waits for");
            return;
        };
        let request_id = output.request_id.clone();
        match entry.tx.try_send(output) {
            Ok(()) if finished => {
                self.in_flight.remove(&request_id);
            }
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => {
                // The handler is gone without aborting (it was cancelled mid-submit).
                self.in_flight.remove(&request_id);
                if !finished {
                    self.send_abort(vec![request_id], AbortReason::ReceiverGone);
                }
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                // The client stopped reading: do not buffer its output without bound. Dropping
                // the sender ends the handler's stream after what it has buffered (an error for
                // the client), and the engine stops generating.
                self.in_flight.remove(&request_id);
                if let Some(suppressed) = OVERFLOW_LOG.check() {
                    tracing::warn!(%request_id, buffer = self.output_buffer, suppressed,
                        "output buffer full (client not reading); aborting the request");
                }
                if !finished {
                    self.send_abort(vec![request_id], AbortReason::OutputOverflow);
                }
            }
        }
    }

    fn handle_envelope(&mut self, envelope: Envelope) {
        match envelope.body {
            WireMessage::EngineOutputs(batch) => {
                for output in batch.outputs {
                    self.dispatch(output);
                }
            }
            other => {
                UNEXPECTED_MESSAGES_TOTAL.with_label_values(&[other.kind()]).inc();
                tracing::debug!(kind = other.kind(), "ignoring unexpected message from the dp-lb");
            }
        }
    }

    /// Abort requests in the engine (best effort: when the link is down, the dp-lb has lost
    /// them anyway).
    fn send_abort(&self, request_ids: Vec<String>, reason: AbortReason) {
        let n = request_ids.len() as u64;
        match self.link.send(Envelope::new(WireMessage::Abort(AbortRequests { request_ids }))) {
            Ok(()) => ABORTS_SENT_TOTAL.with_label_values(&[reason.as_str()]).inc_by(n),
            Err(e) => tracing::debug!(error = %e, reason = reason.as_str(), "abort not sent"),
        }
    }

    /// End every request in flight with an error output (the link to the dp-lb is gone).
    fn fail_all(&mut self, message: &str) {
        let n = self.in_flight.len();
        for (request_id, entry) in self.in_flight.drain() {
            // A full buffer gets no error output, but the dropped sender ends the stream.
            let _ = entry.tx.try_send(EngineOutput {
                request_id,
                new_token_ids: Vec::new(),
                new_logprobs: None,
                finish_reason: Some(FinishReason::Error),
                stop_token_id: None,
                kv_transfer_params: None,
                num_external_tokens: 0,
                num_cached_tokens: 0,
                error: Some(message.to_string()),
            });
        }
        if n > 0 {
            tracing::warn!(requests = n, "failed every request in flight: {message}");
        }
    }

    /// Forget requests whose handler is gone and abort them.
    fn sweep(&mut self) {
        let gone: Vec<String> =
            self.in_flight.iter().filter(|(_, e)| e.tx.is_closed()).map(|(id, _)| id.clone()).collect();
        if gone.is_empty() {
            return;
        }
        for id in &gone {
            self.in_flight.remove(id);
        }
        self.send_abort(gone, AbortReason::ReceiverGone);
    }

    fn remove_if_current(&mut self, request_id: &str, ticket: u64) -> bool {
        if self.in_flight.get(request_id).is_some_and(|e| e.ticket == ticket) {
            self.in_flight.remove(request_id);
            true
        } else {
            false
        }
    }
}

impl Actor for EngineClient {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // Handlers on every HTTP worker submit here; don't make them queue behind 16 slots.
        ctx.set_mailbox_capacity(4096);
        ctx.run_interval(SWEEP_INTERVAL, |act, _| act.sweep());
        LINK_UP.set(0);
    }
}

impl Handler<LinkEvent> for EngineClient {
    type Result = ();

    fn handle(&mut self, event: LinkEvent, _ctx: &mut Self::Context) {
        match event {
            LinkEvent::Up { endpoint } => {
                LINK_UP.set(1);
                tracing::info!(%endpoint, "connected to the dp-lb");
            }
            LinkEvent::Down { endpoint } => {
                LINK_UP.set(0);
                tracing::warn!(%endpoint, in_flight = self.in_flight.len(), "lost the link to the dp-lb");
                self.fail_all(&format!("unavailable: lost the connection to the dp-lb ({endpoint})"));
            }
            LinkEvent::Message { envelope, .. } => self.handle_envelope(envelope),
        }
    }
}

impl Handler<PullEvent> for EngineClient {
    type Result = ();

    fn handle(&mut self, event: PullEvent, _ctx: &mut Self::Context) {
        self.handle_envelope(event.envelope);
    }
}

impl Handler<Submit> for EngineClient {
    type Result = ResponseActFuture<Self, Result<OutputReceiver, ApiError>>;

    fn handle(&mut self, msg: Submit, _ctx: &mut Self::Context) -> Self::Result {
        let Submit { request, trace, ticket } = msg;
        let request_id = request.request_id.clone();
        if self.in_flight.contains_key(&request_id) {
            return Box::pin(fut::ready(Err(ApiError::DuplicateRequestId(request_id))));
        }
        if !self.link.is_up() {
            let e = TransportError::Unavailable(self.link.endpoint().to_string());
            return Box::pin(fut::ready(Err(ApiError::from_transport(&e))));
        }
        // Register before sending: the first output may overtake the Ack (they travel on
        // different sockets).
        let (tx, rx) = mpsc::channel(self.output_buffer);
        self.in_flight.insert(request_id.clone(), InFlight { ticket, tx });
        let envelope =
            Envelope::new(WireMessage::AddRequest(request)).with_request_id(request_id.clone()).with_trace(trace);
        let link = self.link.clone();
        let call = async move { link.call(envelope, SUBMIT_TIMEOUT).await };
        Box::pin(call.into_actor(self).map(move |reply, act, _ctx| {
            let refusal = match reply {
                Ok(Envelope { body: WireMessage::Ack, .. }) => return Ok(rx),
                Ok(Envelope { body: WireMessage::Error(e), .. }) => ApiError::from_wire(e),
                Ok(other) => ApiError::Internal(format!(
                    "the dp-lb answered a request with an unexpected `{}` message",
                    other.body.kind()
                )),
                Err(e @ TransportError::Timeout(..)) => {
                    // It may have been accepted after all: make sure it does not run unheard.
                    if act.remove_if_current(&request_id, ticket) {
                        act.send_abort(vec![request_id.clone()], AbortReason::SubmitTimeout);
                    }
                    ApiError::from_transport(&e)
                }
                Err(e) => ApiError::from_transport(&e),
            };
            act.remove_if_current(&request_id, ticket);
            Err(refusal)
        }))
    }
}

impl Handler<Abort> for EngineClient {
    type Result = ();

    fn handle(&mut self, msg: Abort, _ctx: &mut Self::Context) {
        if self.remove_if_current(&msg.request_id, msg.ticket) {
            tracing::debug!(request_id = %msg.request_id, reason = msg.reason.as_str(), "aborting");
            self.send_abort(vec![msg.request_id], msg.reason);
        }
    }
}

impl Handler<Stats> for EngineClient {
    type Result = ResponseFuture<Result<MeshStats, ApiError>>;

    fn handle(&mut self, _msg: Stats, _ctx: &mut Self::Context) -> Self::Result {
        let link = self.link.clone();
        Box::pin(query(link, WireMessage::StatsQuery, STATS_TIMEOUT, "a statistics query", |m| match m {
            WireMessage::StatsReply(stats) => Some(stats),
            _ => None,
        }))
    }
}

/// Ask the dp-lb `body` and take the answer `pick` accepts; an error answer, another message
/// or a transport failure is an [`ApiError`] naming `what` was asked.
async fn query<T>(
    link: LinkHandle,
    body: WireMessage,
    timeout: Duration,
    what: &'static str,
    pick: fn(WireMessage) -> Option<T>,
) -> Result<T, ApiError> {
    match link.call(Envelope::new(body), timeout).await {
        Ok(Envelope { body: WireMessage::Error(e), .. }) => Err(ApiError::from_wire(e)),
        Ok(envelope) => {
            let kind = envelope.body.kind();
            pick(envelope.body).ok_or_else(|| {
                ApiError::Internal(format!("the dp-lb answered {what} with an unexpected `{kind}` message"))
            })
        }
        Err(e) => Err(ApiError::from_transport(&e)),
    }
}

impl Handler<Readiness> for EngineClient {
    type Result = ResponseFuture<Result<NodeReadiness, ApiError>>;

    fn handle(&mut self, _msg: Readiness, _ctx: &mut Self::Context) -> Self::Result {
        let link = self.link.clone();
        Box::pin(query(link, WireMessage::ReadinessQuery, READINESS_TIMEOUT, "a readiness query", |m| match m {
            WireMessage::Readiness(r) => Some(r),
            _ => None,
        }))
    }
}

impl Handler<InFlightCount> for EngineClient {
    type Result = usize;

    fn handle(&mut self, _msg: InFlightCount, _ctx: &mut Self::Context) -> usize {
        self.in_flight.len()
    }
}
