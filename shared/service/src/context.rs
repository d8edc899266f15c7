//! What every service computes at start-up, in one place: its node of the topology, its rank
//! checked against the node's `dp_size`, the node's endpoints, its readiness flag, and its ops
//! server (`/metrics`, `/health`, `/live`) on the node's port for it.

use std::future::Future;

use actix_web::dev::ServerHandle;
use pdmesh_config::{Endpoint, NodeConfig, NodeEndpoints, Service, Topology};
use pdmesh_telemetry::ops::Health;
use thiserror::Error;

use crate::shutdown::Shutdown;

/// Why a service could not start.
#[derive(Debug, Error)]
pub enum StartError {
    /// The topology or the node name is wrong: a configuration error.
    #[error("config: {0}")]
    Config(#[from] pdmesh_config::ConfigError),
    /// A per-rank service started for a rank the node does not have: a configuration error.
    #[error("rank {rank} is outside dp_size {dp_size}")]
    BadRank { rank: u32, dp_size: u32 },
    /// The ops server could not listen (its port in use): worth a restart.
    #[error("ops server: port {port}: {source}")]
    Ops { port: u16, source: std::io::Error },
}

impl StartError {
    /// Whether starting again cannot help (`pdmesh` exits with its configuration status).
    pub fn is_config(&self) -> bool {
        matches!(self, StartError::Config(_) | StartError::BadRank { .. })
    }
}

/// Asks a service's actor how much in-flight work it still has (a draining service waits for 0).
#[derive(Debug, actix::Message)]
#[rtype(result = "usize")]
pub struct Unfinished;

/// The start-up facts of one service process, built by [`ServiceContext::start`].
#[derive(Debug)]
pub struct ServiceContext {
    pub topology: Topology,
    /// This process's node (a copy of `topology`'s).
    pub node: NodeConfig,
    pub service: Service,
    /// The data-parallel rank (checked against `dp_size` for per-rank services; 0 otherwise).
    pub rank: u32,
    /// The node's socket endpoints under the topology's `run_dir`.
    pub endpoints: NodeEndpoints,
    /// This rank's connector-scheduler endpoint (rank 0's for services that are not per rank).
    pub connector_scheduler: Endpoint,
    /// This rank's connector-worker endpoint (rank 0's for services that are not per rank).
    pub connector_worker: Endpoint,
    /// Readiness, as the ops server (or the frontend's `/health`) reports it.
    pub health: Health,
    /// The ops server, stopped by [`ServiceContext::stop_ops`].
    ops: Option<ServerHandle>,
}

impl ServiceContext {
    /// Check who this process is and, except for the frontend (which serves `/metrics`,
    /// `/health` and `/live` on its API port), start its ops server on
    /// [`NodeConfig::metrics_port`]. Must run inside an actix System.
    pub fn start(topology: Topology, node: &str, service: Service, rank: u32) -> Result<Self, StartError> {
        let node = topology.node(node)?.clone();
        let rank = if service.per_rank() {
            if rank >= node.dp_size {
                return Err(StartError::BadRank { rank, dp_size: node.dp_size });
            }
            rank
        } else {
            0
        };
        let endpoints = node.endpoints(&topology.run_dir);
        let bad_rank = || StartError::BadRank { rank, dp_size: node.dp_size };
        let connector_scheduler = endpoints.connector_scheduler.get(rank as usize).cloned().ok_or_else(bad_rank)?;
        let connector_worker = endpoints.connector_worker.get(rank as usize).cloned().ok_or_else(bad_rank)?;
        let health = Health::default();
        let ops = match service {
            Service::Frontend => None,
            _ => {
                let port = node.metrics_port(service, rank);
                let handle = pdmesh_telemetry::ops::spawn_ops_server(&node.bind_host, port, health.clone())
                    .map_err(|source| StartError::Ops { port, source })?;
                Some(handle)
            }
        };
        Ok(Self { topology, node, service, rank, endpoints, connector_scheduler, connector_worker, health, ops })
    }

    /// The stop of a service whose in-flight work `actor` counts ([`Unfinished`]): see
    /// [`ServiceContext::drain_on_shutdown`].
    pub async fn drain_actor_on_shutdown<A>(&mut self, shutdown: &Shutdown, what: &str, actor: &actix::Addr<A>)
    where
        A: actix::Actor<Context = actix::Context<A>> + actix::Handler<Unfinished>,
    {
        self.drain_on_shutdown(shutdown, what, || async { actor.send(Unfinished).await.ok() }).await;
    }

    /// The stop of a service whose in-flight work `remaining` counts (see
    /// [`crate::shutdown::drain`]): wait for `shutdown`, set readiness to 503, wait for the
    /// work to end, close the ops server. The shell holds it all to the deadline.
    pub async fn drain_on_shutdown<F, Fut>(&mut self, shutdown: &Shutdown, what: &str, remaining: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<usize>>,
    {
        shutdown.started().await;
        self.begin_drain();
        crate::shutdown::drain(what, remaining).await;
        self.stop_ops().await;
        tracing::info!(service = self.service.name(), rank = self.rank, "stopped");
    }

    /// The service is stopping: `/health` answers 503 from now on (the first step of every
    /// graceful stop, before any draining).
    pub fn begin_drain(&self) {
        self.health.begin_drain();
        tracing::info!(service = self.service.name(), "readiness is now 503; draining");
    }

    /// Stop the ops server and free its port (the last step of a graceful stop).
    pub async fn stop_ops(&mut self) {
        if let Some(ops) = self.ops.take() {
            ops.stop(true).await;
        }
    }
}
