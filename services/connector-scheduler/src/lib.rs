//! connector-scheduler: the scheduler side of the KV connector (vLLM's
//! `KVConnectorBase_V1` scheduler role), in its own process.
//!
//! engine-core sends batches of [`ConnectorCall`]s each step and gets one
//! [`ConnectorReply`] per call. The decisions live behind the [`KvConnectorScheduler`] trait:
//! [`NoopConnector`] for colocated serving (no KV transfer); the P/D connector implements the
//! same trait.

pub mod connector;
pub mod pd;

pub use connector::{KvConnectorScheduler, NoopConnector};
pub use pd::{PdConnector, ProducerIdentity};

use actix::prelude::*;
use pdmesh_config::{Service, Topology};
use pdmesh_protocol::{ConnectorCall, ConnectorReply, Message};
use pdmesh_transport::{bind_router, RouterEvent, RouterHandle};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConnectorSchedulerError {
    #[error("config: {0}")]
    Config(#[from] pdmesh_config::ConfigError),
    #[error("rank {rank} is outside dp_size {dp_size}")]
    BadRank { rank: u32, dp_size: u32 },
    #[error("transport: {0}")]
    Transport(#[from] pdmesh_transport::TransportError),
    #[error("ops server: {0}")]
    Ops(String),
}

/// The actor answering connector calls for one engine rank.
pub struct ConnectorSchedulerActor {
    connector: Box<dyn KvConnectorScheduler>,
    router: Option<RouterHandle>,
}

impl Actor for ConnectorSchedulerActor {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
struct SetRouter(RouterHandle);

impl Handler<SetRouter> for ConnectorSchedulerActor {
    type Result = ();
    fn handle(&mut self, m: SetRouter, _: &mut Context<Self>) {
        self.router = Some(m.0);
    }
}

impl Handler<RouterEvent> for ConnectorSchedulerActor {
    type Result = ();
    fn handle(&mut self, ev: RouterEvent, _: &mut Context<Self>) {
        let RouterEvent::Message { peer, envelope } = ev else { return };
        let reply = match &envelope.body {
            Message::ConnectorCalls(calls) => Message::ConnectorReplies(
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
                    .collect(),
            ),
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

/// Apply one call to the connector.
pub fn dispatch(c: &mut dyn KvConnectorScheduler, call: ConnectorCall) -> ConnectorReply {
    match call {
        ConnectorCall::GetNumNewMatchedTokens {
            request_id,
            num_prompt_tokens,
            num_computed_tokens,
            kv_transfer_params,
        } => {
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
            match c.request_rejected_before_admission_traced(&params, rejected_at_unix_us, trace) {
                Ok(()) => ConnectorReply::Ack,
                Err(reason) => ConnectorReply::Rejected { reason },
            }
        }
    }
}

/// Start the connector-scheduler of `rank` on `node` inside the current actix System.
pub async fn run(
    topology: &Topology,
    node_name: &str,
    rank: u32,
) -> Result<Addr<ConnectorSchedulerActor>, ConnectorSchedulerError> {
    let node = topology.node(node_name)?;
    if rank >= node.dp_size {
        return Err(ConnectorSchedulerError::BadRank { rank, dp_size: node.dp_size });
    }
    let eps = node.endpoints(&topology.run_dir);
    let Some(ep) = eps.connector_scheduler.get(rank as usize) else {
        return Err(ConnectorSchedulerError::BadRank { rank, dp_size: node.dp_size });
    };
    let health = pdmesh_telemetry::ops::Health::default();
    let port = node.metrics_port(Service::ConnectorScheduler, rank);
    pdmesh_telemetry::ops::spawn_ops_server(&node.bind_host, port, health.clone())
        .map_err(|e| ConnectorSchedulerError::Ops(format!("port {port}: {e}")))?;
    let connector: Box<dyn KvConnectorScheduler> = match &node.kv_transfer {
        None => Box::new(NoopConnector::default()),
        Some(kv) => {
            let producer = kv.kv_role.produces().then(|| ProducerIdentity {
                engine_id: if kv.engine_id.is_empty() { node.name.clone() } else { kv.engine_id.clone() },
                side_channel_host: kv.side_channel_host.clone(),
                side_channel_port: kv.side_channel_port.saturating_add(rank as u16),
                dp_rank: rank,
            });
            let mut c = PdConnector::new(producer, kv.kv_role.consumes(), kv.hold_duration());
            c.set_give_up_notices(kv.give_up_notices);
            if !kv.give_up_notices {
                tracing::warn!(
                    "give-up notices are off (kv_transfer.give_up_notices = false): P frees at its deadline"
                );
            }
            Box::new(c)
        }
    };
    let actor = ConnectorSchedulerActor { connector, router: None }.start();
    let router = bind_router(&ep.bind, actor.clone().recipient()).await?;
    actor.do_send(SetRouter(router));
    health.set_ready(true);
    tracing::info!(endpoint = %ep.bind, rank, "connector-scheduler ready");
    Ok(actor)
}
