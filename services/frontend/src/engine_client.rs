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
//! Outputs reach their handlers through the *inbox* of the thread the handler was submitted
//! from (D77): a task on each HTTP worker thread that takes one batch of outputs per engine
//! step and hands each to its request's channel. The actor thus wakes each worker thread once
//! per step, however many of its streams the step served; handing every output to its
//! channel from here woke a worker for each output it had gone back to sleep before.
//!
//! Each submission carries a *ticket* (a process-unique number). Aborts and cleanups name
//! the ticket as well as the id, so a late abort of a finished request never hits a newer
//! request that reuses the same client-chosen id.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use pdmesh_protocol::{
    AbortRequests, EngineOutput, EngineRequest, Envelope, Hello, MeshStats, Message as WireMessage, NodeReadiness,
    ServiceKind, TraceContext,
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

/// A socket-level failure talking to the dp-lb: the engine is unreachable (503).
pub fn engine_unavailable(err: &TransportError) -> ApiError {
    ApiError::Unavailable(format!("engine unavailable: {err}"))
}

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
    /// The request ran past its deadline (`limits.request_deadline_s`, D92).
    Deadline,
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
            AbortReason::Deadline => "deadline",
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
    /// The submitting thread's inbox ([`thread_inbox`]); without one the actor hands each
    /// output to the request's channel itself.
    pub inbox: Option<Inbox>,
}

/// One output on its way to its request's channel.
struct Delivery {
    tx: mpsc::Sender<EngineOutput>,
    ticket: u64,
    output: EngineOutput,
}

/// Where the outputs of the requests submitted from one thread go (D77): the sending side of
/// a task on that thread that hands each output to its request's channel.
#[derive(Debug, Clone)]
pub struct Inbox {
    id: u64,
    tx: mpsc::UnboundedSender<Batch>,
}

/// One engine client's outputs of one step for one inbox. The client comes along because a
/// thread may serve the handlers of more than one (tests start several in one process), and
/// what the inbox reports back must reach the one following the request.
struct Batch {
    client: Addr<EngineClient>,
    deliveries: Vec<Delivery>,
}

static NEXT_INBOX: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static INBOX: RefCell<Option<Inbox>> = const { RefCell::new(None) };
}

/// The inbox of the calling thread, started on first use; `None` outside an actix arbiter
/// (no local task set to run it on). A thread whose arbiter stopped gets a new one.
pub fn thread_inbox() -> Option<Inbox> {
    actix::Arbiter::try_current()?;
    INBOX.with(|slot| {
        let mut slot = slot.borrow_mut();
        if let Some(inbox) = slot.as_ref().filter(|i| !i.tx.is_closed()) {
            return Some(inbox.clone());
        }
        let (tx, rx) = mpsc::unbounded_channel();
        actix::spawn(deliver_batches(rx));
        let inbox = Inbox { id: NEXT_INBOX.fetch_add(1, Ordering::Relaxed), tx };
        *slot = Some(inbox.clone());
        Some(inbox)
    })
}

/// Tickets of requests cut off (a full buffer, a handler gone) that an inbox remembers: enough
/// for the few batches already on their way when the actor learns of it.
const CUT_OFF_REMEMBERED: usize = 64;

/// The inbox task: hand each output to its request's channel, on the request's own thread. A
/// request whose handler is gone or no longer reads is reported to the actor as an [`Abort`],
/// which stops following it; later outputs of a request cut off here are dropped, so its
/// client never gets a stream with a hole in it.
async fn deliver_batches(mut rx: mpsc::UnboundedReceiver<Batch>) {
    let mut cut_off: VecDeque<u64> = VecDeque::with_capacity(CUT_OFF_REMEMBERED);
    while let Some(Batch { client, deliveries }) = rx.recv().await {
        for Delivery { tx, ticket, output } in deliveries {
            if cut_off.contains(&ticket) {
                continue;
            }
            let finished = output.finish_reason.is_some();
            let (reason, request_id) = match put(&tx, output) {
                Handed::Queued => continue,
                Handed::Gone(id) => (AbortReason::ReceiverGone, id),
                Handed::Overflow(id) => (AbortReason::OutputOverflow, id),
            };
            // Reported once: the request's later outputs on their way are dropped here.
            if cut_off.len() == CUT_OFF_REMEMBERED {
                cut_off.pop_front();
            }
            cut_off.push_back(ticket);
            if !finished {
                client.do_send(Abort { request_id, ticket, reason });
            }
        }
    }
}

/// What putting one output in its request's channel came to; the request's id where it did
/// not go in.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Handed {
    Queued,
    /// The handler is gone without aborting (it was cancelled mid-submit).
    Gone(String),
    /// The client stopped reading and the request's buffer is full.
    Overflow(String),
}

fn put(tx: &mpsc::Sender<EngineOutput>, output: EngineOutput) -> Handed {
    match tx.try_send(output) {
        Ok(()) => Handed::Queued,
        Err(mpsc::error::TrySendError::Closed(o)) => Handed::Gone(o.request_id),
        Err(mpsc::error::TrySendError::Full(o)) => {
            let request_id = o.request_id;
            // Do not buffer a client's output without bound: the request is cut off, which
            // ends the handler's stream after what it has buffered (an error for the client),
            // and the engine stops generating.
            if let Some(suppressed) = OVERFLOW_LOG.check() {
                tracing::warn!(%request_id, buffer = tx.max_capacity(), suppressed,
                    "output buffer full (client not reading); aborting the request");
            }
            Handed::Overflow(request_id)
        }
    }
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

#[derive(Clone)]
struct InFlight {
    ticket: u64,
    tx: mpsc::Sender<EngineOutput>,
    inbox: Option<Inbox>,
    /// When the request is ended whatever the engine does (D92); `None`: never.
    expires: Option<Instant>,
}

/// The outputs of one batch, gathered per inbox: each inbox gets them in one message.
#[derive(Default)]
struct Outgoing {
    batches: Vec<(Inbox, Vec<Delivery>)>,
}

impl Outgoing {
    fn push(&mut self, inbox: &Inbox, delivery: Delivery) {
        match self.batches.iter_mut().find(|(i, _)| i.id == inbox.id) {
            Some((_, batch)) => batch.push(delivery),
            None => self.batches.push((inbox.clone(), vec![delivery])),
        }
    }
}

/// The actor (see the module docs).
pub struct EngineClient {
    link: LinkHandle,
    in_flight: HashMap<String, InFlight>,
    /// Capacity of each request's output channel.
    output_buffer: usize,
    /// This actor's own address, which its batches carry to the inboxes; weak, so that the
    /// actor still stops once nothing else holds its address.
    me: actix::WeakAddr<EngineClient>,
    /// How long a request may live from its submission (`limits.request_deadline_s`).
    deadline: Option<Duration>,
}

impl EngineClient {
    /// Start the actor and its DEALER link to the dp-lb at `endpoint` (which reconnects by
    /// itself). Each request's outputs are buffered up to `output_buffer` (at least 1); a
    /// request whose handler falls that far behind is aborted. The returned handle tells
    /// whether the link is up (for `/health`).
    pub fn start(endpoint: String, output_buffer: usize) -> (Addr<Self>, LinkHandle) {
        Self::start_with_deadline(endpoint, output_buffer, None)
    }

    /// [`EngineClient::start`], with every request ended `deadline` after its submission
    /// (D92): past it the handler gets a `timeout` error output (a 504, or an error event on
    /// a stream) and the engine an abort, which frees the request's blocks. No request, and
    /// no place under `limits.max_in_flight`, outlives it, whatever happens to the engine's
    /// outputs on their way.
    pub fn start_with_deadline(
        endpoint: String,
        output_buffer: usize,
        deadline: Option<Duration>,
    ) -> (Addr<Self>, LinkHandle) {
        let ctx = Context::<Self>::new();
        let hello = Envelope::new(WireMessage::Hello(Hello {
            service: ServiceKind::Frontend,
            rank: 0,
            pid: std::process::id(),
        }));
        let config = LinkConfig::new(endpoint).identity(LINK_IDENTITY).hello(hello);
        let link = connect_dealer(config, ctx.address().recipient());
        let output_buffer = output_buffer.max(1);
        let me = ctx.address().downgrade();
        let addr = ctx.run(EngineClient { link: link.clone(), in_flight: HashMap::new(), output_buffer, me, deadline });
        (addr, link)
    }

    /// Route one output to its handler: into its inbox's share of `outgoing`, or (a request
    /// submitted without an inbox) into its channel at once. A finished request is forgotten
    /// here: its last output is the last the engine sends.
    fn dispatch(&mut self, output: EngineOutput, outgoing: &mut Outgoing) {
        let entry = if output.finish_reason.is_some() {
            self.in_flight.remove(&output.request_id)
        } else {
            self.in_flight.get(&output.request_id).cloned()
        };
        let Some(InFlight { ticket, tx, inbox, .. }) = entry else {
            UNKNOWN_OUTPUTS.inc();
            tracing::debug!(request_id = %output.request_id, "output for a request nobody waits for");
            return;
        };
        match inbox {
            Some(inbox) => outgoing.push(&inbox, Delivery { tx, ticket, output }),
            None => self.deliver_here(Delivery { tx, ticket, output }),
        }
    }

    /// Put one output in its request's channel from this thread.
    fn deliver_here(&mut self, Delivery { tx, ticket, output }: Delivery) {
        let finished = output.finish_reason.is_some();
        let (reason, request_id) = match put(&tx, output) {
            Handed::Queued => return,
            Handed::Gone(id) => (AbortReason::ReceiverGone, id),
            Handed::Overflow(id) => (AbortReason::OutputOverflow, id),
        };
        // Dropping the request's sender ends the handler's stream after what it buffered.
        if self.remove_if_current(&request_id, ticket) && !finished {
            self.send_abort(vec![request_id], reason);
        }
    }

    /// Hand each inbox its share of a batch; the share of an inbox whose thread is gone is
    /// delivered from here.
    fn send_out(&mut self, outgoing: Outgoing) {
        for (inbox, deliveries) in outgoing.batches {
            let undelivered = match self.me.upgrade() {
                Some(client) => match inbox.tx.send(Batch { client, deliveries }) {
                    Ok(()) => continue,
                    Err(mpsc::error::SendError(batch)) => batch.deliveries,
                },
                None => deliveries,
            };
            for delivery in undelivered {
                self.deliver_here(delivery);
            }
        }
    }

    fn handle_envelope(&mut self, envelope: Envelope) {
        match envelope.body {
            WireMessage::EngineOutputs(batch) => {
                let mut outgoing = Outgoing::default();
                for output in batch.outputs {
                    self.dispatch(output, &mut outgoing);
                }
                self.send_out(outgoing);
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

    /// End every request in flight with an error output (the link to the dp-lb is gone),
    /// through the inboxes, behind the outputs already on their way.
    fn fail_all(&mut self, message: &str) {
        let n = self.in_flight.len();
        let entries: Vec<(String, InFlight)> = self.in_flight.drain().collect();
        self.fail(entries, message);
        if n > 0 {
            tracing::warn!(requests = n, "failed every request in flight: {message}");
        }
    }

    /// End the requests past their deadline: an error output to each handler, an abort to
    /// the engine.
    fn expire(&mut self, now: Instant) {
        let expired: Vec<String> = self
            .in_flight
            .iter()
            .filter(|(_, e)| e.expires.is_some_and(|t| t <= now))
            .map(|(id, _)| id.clone())
            .collect();
        if expired.is_empty() {
            return;
        }
        let entries: Vec<(String, InFlight)> =
            expired.iter().filter_map(|id| self.in_flight.remove(id).map(|e| (id.clone(), e))).collect();
        crate::metrics::DEADLINE_EXPIRED_TOTAL.inc_by(entries.len() as u64);
        let secs = self.deadline.map_or(0, |d| d.as_secs());
        tracing::warn!(requests = entries.len(), deadline_s = secs, "requests ran past their deadline; ending them");
        self.fail(
            entries,
            &format!("timeout: the request ran past its deadline of {secs} s (`limits.request_deadline_s`)"),
        );
        self.send_abort(expired, AbortReason::Deadline);
    }

    /// Hand each of `entries` an error output saying `message`.
    fn fail(&mut self, entries: Vec<(String, InFlight)>, message: &str) {
        let mut outgoing = Outgoing::default();
        for (request_id, entry) in entries {
            let output = EngineOutput::failed(request_id, message);
            match &entry.inbox {
                Some(inbox) => outgoing.push(inbox, Delivery { tx: entry.tx, ticket: entry.ticket, output }),
                // A full buffer gets no error output, but the dropped sender ends the stream.
                None => drop(entry.tx.try_send(output)),
            }
        }
        self.send_out(outgoing);
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
        ctx.run_interval(SWEEP_INTERVAL, |act, _| {
            act.sweep();
            act.expire(Instant::now());
        });
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
        let Submit { request, trace, ticket, inbox } = msg;
        let request_id = request.request_id.clone();
        if self.in_flight.contains_key(&request_id) {
            return Box::pin(fut::ready(Err(ApiError::DuplicateRequestId(request_id))));
        }
        if !self.link.is_up() {
            let e = TransportError::Unavailable(self.link.endpoint().to_string());
            return Box::pin(fut::ready(Err(engine_unavailable(&e))));
        }
        // Register before sending: the first output may overtake the Ack (they travel on
        // different sockets).
        let (tx, rx) = mpsc::channel(self.output_buffer);
        let expires = self.deadline.map(|d| Instant::now() + d);
        self.in_flight.insert(request_id.clone(), InFlight { ticket, tx, inbox, expires });
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
                    engine_unavailable(&e)
                }
                Err(e) => engine_unavailable(&e),
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
        Err(e) => Err(engine_unavailable(&e)),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_engine_link_is_a_503_naming_the_engine() {
        let e = engine_unavailable(&TransportError::PeerGone("ipc://x".into()));
        assert_eq!(actix_web::ResponseError::status_code(&e).as_u16(), 503);
        assert!(e.to_string().starts_with("engine unavailable: "), "{e}");
    }
}
