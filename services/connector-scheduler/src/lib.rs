//! connector-scheduler: the scheduler side of the KV connector (vLLM's
//! `KVConnectorBase_V1` scheduler role), in its own process.
//!
//! engine-core sends batches of [`ConnectorCall`]s each step and gets one
//! [`ConnectorReply`] per call. The decisions live behind the [`KvConnectorScheduler`] trait:
//! [`NoopConnector`] for colocated serving (no KV transfer); the P/D connector implements the
//! same trait.
//!
//! On a consumer (D) it also holds a link to its rank's connector-worker: the notify-only
//! receives of rule R1 go from here straight to the worker (see [`ConnectorCall::TakeRejectionRecvs`]),
//! one process hop less than through engine-core on a notice's way to P.

pub mod connector;
pub mod multi;
pub mod offload;
pub mod pd;

pub use connector::{KvConnectorScheduler, NoopConnector};
pub use multi::MultiConnector;
pub use offload::{OffloadConnector, OffloadIndex};
pub use pd::{PdConnector, ProducerIdentity};

use std::time::Duration;

use actix::prelude::*;
use pdmesh_config::ConnectorKind;
use pdmesh_protocol::{ConnectorCall, ConnectorReply, Envelope, Hello, KvConnectorMetadata, Message, ServiceKind};
use pdmesh_service::{ServiceContext, Shutdown};
use pdmesh_transport::{bind_router, connect_dealer, LinkConfig, LinkEvent, LinkHandle, RouterEvent, RouterHandle};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConnectorSchedulerError {
    #[error("config: {0}")]
    Config(#[from] pdmesh_config::ConfigError),
    #[error("transport: {0}")]
    Transport(#[from] pdmesh_transport::TransportError),
    #[error("kv_transfer: {0}")]
    Connector(String),
}

/// The P/D connector of `rank` on `node`.
fn pd_connector(node: &pdmesh_config::NodeConfig, kv: &pdmesh_config::KvTransferConfig, rank: u32) -> PdConnector {
    let producer = kv.kv_role.produces().then(|| ProducerIdentity {
        engine_id: if kv.engine_id.is_empty() { node.name.clone() } else { kv.engine_id.clone() },
        side_channel_host: kv.side_channel_host.clone(),
        side_channel_port: kv.side_channel_port.saturating_add(rank as u16),
        dp_rank: rank,
    });
    let mut c = PdConnector::new(producer, kv.kv_role.consumes(), kv.hold_duration());
    c.set_give_up_notices(kv.give_up_notices);
    if !kv.give_up_notices {
        tracing::warn!("give-up notices are off (kv_transfer.give_up_notices = false): P frees at its deadline");
    }
    c
}

/// What roots the offload connector's hash chains: blocks computed by another model (or the
/// same file under another configuration) never match.
fn offload_identity(node: &pdmesh_config::NodeConfig) -> String {
    let m = &node.model;
    format!("kind={:?}|name={}|path={}|device={}", m.kind, m.name, m.path, m.device)
}

/// Time allowed for the worker to take notify-only receives handed to it directly.
const WORKER_PUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// The actor answering connector calls for one engine rank.
pub struct ConnectorSchedulerActor {
    connector: Box<dyn KvConnectorScheduler>,
    router: Option<RouterHandle>,
    /// D only: the rank's connector-worker, for notify-only receives (rule R1).
    worker: Option<LinkHandle>,
}

impl Actor for ConnectorSchedulerActor {
    type Context = Context<Self>;
}

/// The worker link's events: nothing to do but log (answers to our pushes come back to the
/// pushing call; nothing else is sent here).
impl Handler<LinkEvent> for ConnectorSchedulerActor {
    type Result = ();
    fn handle(&mut self, ev: LinkEvent, _: &mut Context<Self>) {
        match ev {
            LinkEvent::Up { endpoint } => tracing::info!(%endpoint, "connected to the worker"),
            LinkEvent::Down { endpoint } => tracing::warn!(%endpoint, "worker link down"),
            LinkEvent::Message { envelope, .. } => {
                tracing::debug!(kind = envelope.body.kind(), "unexpected message from the worker")
            }
        }
    }
}

impl ConnectorSchedulerActor {
    /// Rule R1: hand the notify-only receives that `TakeRejectionRecvs` took (its answer at
    /// `at` in `replies`) straight to the worker, then answer engine-core with the ones the
    /// worker did not take (none, normally; engine-core pushes those itself). `false` when
    /// there is nothing to hand over or no worker link: answer as usual.
    fn push_rejection_recvs(
        &mut self,
        at: usize,
        mut replies: Vec<ConnectorReply>,
        reply_to: (pdmesh_transport::PeerId, Envelope),
        ctx: &mut Context<Self>,
    ) -> Result<(), Vec<ConnectorReply>> {
        let (Some(worker), Some(router)) = (self.worker.clone().filter(LinkHandle::is_up), self.router.clone()) else {
            return Err(replies);
        };
        let recvs = match replies.get_mut(at) {
            Some(ConnectorReply::Meta(meta)) if !meta.reqs_to_recv.is_empty() => std::mem::take(&mut meta.reqs_to_recv),
            _ => return Err(replies),
        };
        for r in &recvs {
            let id = r.params.remote_request_id.as_deref().unwrap_or("");
            pdmesh_telemetry::trace::notice_hop("connector_scheduler.push", id, r.rejected_at_unix_us);
        }
        let push = Envelope::new(Message::ConnectorMetadata(KvConnectorMetadata {
            reqs_to_recv: recvs.clone(),
            ..Default::default()
        }));
        let (peer, envelope) = reply_to;
        ctx.spawn(
            async move {
                match worker.call(push, WORKER_PUSH_TIMEOUT).await {
                    Ok(Envelope { body: Message::Ack, .. }) => {}
                    other => {
                        tracing::warn!(answer = ?other.map(|e| e.body.kind()), "worker did not take the rejection receives; engine-core pushes them");
                        if let Some(ConnectorReply::Meta(meta)) = replies.get_mut(at) {
                            meta.reqs_to_recv = recvs;
                        }
                    }
                }
                let _ = router.send(&peer, envelope.reply(Message::ConnectorReplies(replies)));
            }
            .into_actor(self),
        );
        Ok(())
    }
}

impl Handler<RouterEvent> for ConnectorSchedulerActor {
    type Result = ();
    fn handle(&mut self, ev: RouterEvent, ctx: &mut Context<Self>) {
        let RouterEvent::Message { peer, envelope } = ev else { return };
        if let Message::ConnectorCalls(calls) = &envelope.body {
            if let Some(at) = calls.iter().position(|c| matches!(c, ConnectorCall::TakeRejectionRecvs)) {
                let replies = self.answer(calls, &envelope);
                let replies = match self.push_rejection_recvs(at, replies, (peer.clone(), envelope.clone()), ctx) {
                    Ok(()) => return,
                    Err(replies) => replies,
                };
                if let Some(r) = &self.router {
                    let _ = r.send(&peer, envelope.reply(Message::ConnectorReplies(replies)));
                }
                return;
            }
        }
        let reply = match &envelope.body {
            Message::ConnectorCalls(calls) => Message::ConnectorReplies(self.answer(calls, &envelope)),
            Message::Ping => Message::Pong,
            Message::Hello(h) => {
                tracing::info!(service = ?h.service, rank = h.rank, pid = h.pid, "peer connected");
                return;
            }
            other => {
                tracing::warn!(kind = other.kind(), "unexpected message");
                return;
            }
        };
        if let Some(r) = &self.router {
            let _ = r.send(&peer, envelope.reply(reply));
        }
    }
}

impl ConnectorSchedulerActor {
    /// Apply a batch of calls, one answer per call.
    fn answer(&mut self, calls: &[ConnectorCall], envelope: &Envelope) -> Vec<ConnectorReply> {
        calls
            .iter()
            .cloned()
            .map(|c| {
                // A span per call that concerns one request, in that request's trace.
                let span = match c.request_id().and_then(|id| envelope.traces.get(id).map(|t| (id, t))) {
                    Some((id, trace)) => pdmesh_telemetry::trace::child_of(
                        tracing::info_span!("connector.call", otel.kind = "server",
                            otel.name = %format_args!("connector.{}", c.kind()), request_id = %id, call = c.kind()),
                        trace,
                    ),
                    None => tracing::Span::none(),
                };
                let _entered = span.enter();
                let reply = dispatch(self.connector.as_mut(), c);
                if !span.is_disabled() {
                    tracing::info!(reply = ?reply, "connector answered");
                }
                reply
            })
            .collect()
    }
}

/// Apply one call to the connector.
pub fn dispatch(c: &mut dyn KvConnectorScheduler, call: ConnectorCall) -> ConnectorReply {
    match call {
        ConnectorCall::GetNumNewMatchedTokens {
            request_id,
            num_prompt_tokens,
            num_computed_tokens,
            kv_transfer_params,
            prompt_token_ids,
        } => {
            if !prompt_token_ids.is_empty() {
                c.observe_prompt(&request_id, &prompt_token_ids);
            }
            let (count, load_async) = c.get_num_new_matched_tokens(
                &request_id,
                num_prompt_tokens,
                num_computed_tokens,
                kv_transfer_params.as_ref(),
            );
            ConnectorReply::MatchedTokens { count, load_async }
        }
        ConnectorCall::UpdateStateAfterAlloc { request_id, block_ids, num_external_tokens } => {
            c.update_state_after_alloc(&request_id, &block_ids, num_external_tokens);
            ConnectorReply::Ack
        }
        ConnectorCall::BuildConnectorMeta { step_id } => ConnectorReply::Meta(c.build_connector_meta(step_id)),
        ConnectorCall::TakeRejectionRecvs => ConnectorReply::Meta(pdmesh_protocol::KvConnectorMetadata {
            reqs_to_recv: c.take_rejection_recvs(),
            ..Default::default()
        }),
        ConnectorCall::RequestFinished { request_id, status, block_ids, kv_transfer_params, block_generations } => {
            let (delay_free, kv_transfer_params) =
                c.request_finished(&request_id, status, &block_ids, &block_generations, kv_transfer_params.as_ref());
            ConnectorReply::Finished { delay_free, kv_transfer_params }
        }
        ConnectorCall::UpdateConnectorOutput(out) => {
            c.update_connector_output(&out);
            ConnectorReply::Ack
        }
        ConnectorCall::RequestRejectedBeforeAdmission { params, rejected_at_unix_us, trace } => {
            let id = params.remote_request_id.as_deref().unwrap_or("");
            pdmesh_telemetry::trace::notice_hop("connector_scheduler", id, rejected_at_unix_us);
            match c.request_rejected_before_admission(&params, rejected_at_unix_us, trace) {
                Ok(()) => ConnectorReply::Ack,
                Err(reason) => ConnectorReply::Rejected { reason },
            }
        }
    }
}

/// Run the connector-scheduler of `ctx`'s rank inside the current actix System until
/// `shutdown` begins, then stop: readiness goes 503 and the ops server stops. It holds no
/// in-flight work of its own (each call is answered as it comes), so there is nothing to drain.
pub async fn run(mut ctx: ServiceContext, shutdown: Shutdown) -> Result<(), ConnectorSchedulerError> {
    let _actor = start(&ctx).await?;
    ctx.drain_on_shutdown(&shutdown, "nothing", || std::future::ready(Some(0))).await;
    Ok(())
}

/// Start the connector-scheduler of `ctx`'s rank inside the current actix System.
pub async fn start(ctx: &ServiceContext) -> Result<Addr<ConnectorSchedulerActor>, ConnectorSchedulerError> {
    let (node, rank, ep) = (&ctx.node, ctx.rank, &ctx.connector_scheduler);
    let consumes = node.kv_transfer.as_ref().is_some_and(|kv| kv.uses_pd() && kv.kv_role.consumes());
    let connector: Box<dyn KvConnectorScheduler> = match &node.kv_transfer {
        None => Box::new(NoopConnector::default()),
        Some(kv) => {
            let kinds = kv.connectors().map_err(ConnectorSchedulerError::Connector)?;
            let mut children: Vec<Box<dyn KvConnectorScheduler>> = kinds
                .iter()
                .map(|kind| -> Box<dyn KvConnectorScheduler> {
                    match kind {
                        ConnectorKind::Pd => Box::new(pd_connector(node, kv, rank)),
                        ConnectorKind::Offload => Box::new(OffloadConnector::new(
                            node.engine.block_size,
                            kv.offload.cpu_blocks,
                            &offload_identity(node),
                        )),
                    }
                })
                .collect();
            match (kv.kv_connector == "MultiConnector", children.pop()) {
                (false, Some(only)) if children.is_empty() => only,
                (_, last) => {
                    children.extend(last);
                    Box::new(MultiConnector::new(children))
                }
            }
        }
    };
    let worker_ep = consumes.then(|| ctx.connector_worker.connect.clone());
    // The mailbox exists before the actor runs, so its sockets are bound with its address and
    // handed to it whole; what arrives meanwhile waits in the mailbox.
    let mailbox = Context::<ConnectorSchedulerActor>::new();
    let worker = worker_ep.map(|endpoint| {
        let hello = Envelope::new(Message::Hello(Hello {
            service: ServiceKind::ConnectorScheduler,
            rank,
            pid: std::process::id(),
        }));
        connect_dealer(
            LinkConfig::new(endpoint).identity(format!("connector-scheduler-{rank}")).hello(hello),
            mailbox.address().recipient(),
        )
    });
    let router = bind_router(&ep.bind, mailbox.address().recipient()).await?;
    let actor = mailbox.run(ConnectorSchedulerActor { connector, router: Some(router), worker });
    ctx.health.set_ready(true);
    tracing::info!(endpoint = %ep.bind, rank, "connector-scheduler ready");
    Ok(actor)
}
