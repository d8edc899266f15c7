//! Tensor parallelism across worker processes (D111).
//!
//! A node with `tensor_parallel_size = N` runs N worker processes per engine rank. TP rank 0
//! is the rank's connector-worker, the one engine-core talks to; ranks 1..N are its peers,
//! which it starts (the `pdmesh` binary spawns them) and reaches over their own sockets. Each
//! step the engine sends is handed to every peer as it arrives and runs on all N executors at
//! once; their forward passes meet in the shared-memory gathers of `pdmesh-model`'s `tp`
//! module, and only rank 0 samples. The step is answered once every rank has answered.
//!
//! The ranks share one KV cache: TP rank 0 creates the rank's region in shared memory with
//! every KV head and each peer maps it, so the transfer agent (P) and the receives (D) of
//! rank 0 serve and fill whole blocks exactly as without TP, and a P and a D of different TP
//! sizes exchange the same blocks.
//!
//! The group fails as one: a peer whose process or socket is gone, or which fails a step that
//! rank 0 computed, leaves the group's gathers out of step, so rank 0 poisons the group (any
//! rank waiting in a gather fails at once instead of hanging), fails the step through the
//! lost-accelerator path (the engine fails that step's requests), and exits so that its
//! supervisor starts the whole group afresh (vLLM likewise takes its engine down when one TP
//! worker dies). A step every rank refuses alike (bad input, checked before the first gather)
//! fails that step only.

use std::sync::Arc;
use std::time::Duration;

use pdmesh_protocol::{Envelope, ErrorClass, Message, ModelRunnerOutput, WireError};
use pdmesh_transport::{LinkHandle, TransportError};

/// The KV region of a tensor-parallel rank (a shared-memory file with every head).
pub use pdmesh_kv_transfer::ShmRegion as KvRegion;

/// Create the KV region of `node`'s engine rank `rank` for its TP group, in shared memory
/// (regions and group files left by dead processes are removed first), for a model of
/// `layers` layers of `kv_heads` KV heads of `head_dim`. Named as a P/D worker names its
/// region, with this process's pid, so a restarted group never reuses an old file.
pub fn create_rank_region(
    node: &pdmesh_config::NodeConfig,
    rank: u32,
    (layers, kv_heads, head_dim): (u32, u32, u32),
) -> Result<KvRegion, crate::WorkerError> {
    crate::sweep_stale_shm();
    let name = format!("pdmesh-{}-{rank}-{}", node.name, std::process::id());
    KvRegion::create_for_spec(&name, &crate::kv_spec_of(node, layers, kv_heads, head_dim))
        .map_err(|e| crate::WorkerError::Model(format!("the rank's KV region: {e}")))
}

/// Where the TP group file of `node`'s engine rank `rank` goes: beside the KV regions, named
/// with this process's pid like them, so the same sweep removes one left by a dead process.
pub fn group_file(node: &str, rank: u32) -> std::path::PathBuf {
    pdmesh_kv_transfer::region::default_shm_dir().join(format!("pdmesh-tp-{node}-{rank}-{}", std::process::id()))
}

/// What TP rank 0 is given of its peers.
pub struct TpPeers {
    /// The socket of each peer, TP rank 1 first.
    pub endpoints: Vec<String>,
    /// Poison the group's gathers (pdmesh-model's `GroupPoison`).
    pub poison: Arc<dyn Fn() + Send + Sync>,
    /// How long a peer may take over one step (the engine's step timeout).
    pub step_timeout: Duration,
    /// The rank's KV cache, every head of it, in shared memory: each TP rank's executor
    /// writes and reads its own heads, and the transfer agent and D's reads see it whole, so
    /// P/D works between any TP sizes with no per-rank transfer (D111). Taken by the worker.
    pub region: Option<KvRegion>,
    /// Resolves (with the reason) when a peer process exits; the worker then stops as when its
    /// accelerator is lost (its give-ups to P included, R4). Taken by [`crate::run`].
    pub exited: Option<std::pin::Pin<Box<dyn std::future::Future<Output = String>>>>,
}

impl std::fmt::Debug for TpPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpPeers").field("endpoints", &self.endpoints).finish_non_exhaustive()
    }
}

/// Rank 0's links to its peers, and which of them are up.
pub(crate) struct TpLinks {
    pub(crate) peers: TpPeers,
    pub(crate) links: Vec<LinkHandle>,
    up: Vec<bool>,
}

impl TpLinks {
    pub(crate) fn new(peers: TpPeers, links: Vec<LinkHandle>) -> Self {
        let up = vec![false; links.len()];
        Self { peers, links, up }
    }

    /// Every peer connected (a peer binds its socket once its slice of the model is loaded).
    pub(crate) fn all_up(&self) -> bool {
        self.up.iter().all(|&u| u)
    }

    /// A link came up or went down. Answers the TP rank of a peer that was up and is gone.
    pub(crate) fn on_link(&mut self, endpoint: &str, is_up: bool) -> Option<usize> {
        let i = self.links.iter().position(|l| l.endpoint() == endpoint)?;
        let was_up = std::mem::replace(&mut self.up[i], is_up);
        (was_up && !is_up).then_some(i + 1)
    }
}

/// The step `envelope` carries, sent to every peer; resolves with each peer's answer.
pub(crate) fn send_to_peers(
    links: &[LinkHandle],
    envelope: &Envelope,
    timeout: Duration,
) -> impl std::future::Future<Output = Vec<Result<Envelope, TransportError>>> + 'static {
    let calls: Vec<_> = links
        .iter()
        .map(|l| {
            let (l, env) = (l.clone(), Envelope { corr: 0, ..envelope.clone() });
            async move { l.call(env, timeout).await }
        })
        .collect();
    futures::future::join_all(calls)
}

/// How a step ends given rank 0's own output and its peers' answers: rank 0's output when
/// every peer computed the step too; the step's failure when every rank refused it alike;
/// otherwise a failed step and the reason the group is out of step (for the lost-accelerator
/// path).
pub(crate) fn judge(
    own: ModelRunnerOutput,
    peers: Vec<Result<Envelope, TransportError>>,
) -> (ModelRunnerOutput, Option<String>) {
    let mut broken = None;
    for (i, answer) in peers.into_iter().enumerate() {
        let rank = i + 1;
        let why = match answer {
            Ok(Envelope { body: Message::StepResult(out), .. }) => match (&out.failure, &own.failure) {
                (None, None) => continue,
                // refused alike by every rank, before any gather
                (Some(_), Some(mine)) if mine.class != ErrorClass::Unavailable => continue,
                (Some(theirs), _) => format!("TP rank {rank} failed the step: {}", theirs.message),
                (None, Some(_)) => format!("TP rank {rank} computed a step rank 0 failed"),
            },
            Ok(other) => format!("TP rank {rank} answered {}", other.body.kind()),
            Err(e) => format!("TP rank {rank}: {e}"),
        };
        broken.get_or_insert(why);
    }
    match broken {
        None => (own, None),
        Some(why) => {
            let failed = ModelRunnerOutput {
                step_id: own.step_id,
                failure: Some(WireError::new(ErrorClass::Unavailable, format!("tensor-parallel group: {why}"))),
                kv_connector_output: own.kv_connector_output,
                ..Default::default()
            };
            (failed, Some(why))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(failure: Option<WireError>) -> ModelRunnerOutput {
        ModelRunnerOutput { step_id: 7, failure, ..Default::default() }
    }

    fn answer(o: ModelRunnerOutput) -> Result<Envelope, TransportError> {
        Ok(Envelope::new(Message::StepResult(o)))
    }

    #[test]
    fn a_step_stands_only_when_every_rank_agrees() {
        // all computed: rank 0's output
        let (all, broken) = judge(out(None), vec![answer(out(None)), answer(out(None))]);
        assert!(all.failure.is_none() && broken.is_none());
        // refused alike (bad input, before any gather): the step's own failure, no restart
        let refused = || Some(WireError::new(ErrorClass::Internal, "token out of range".to_string()));
        let (same, broken) = judge(out(refused()), vec![answer(out(refused()))]);
        assert!(same.failure.is_some() && broken.is_none());
        // a peer that failed, or one that is gone: the group is out of step
        for peer in [answer(out(refused())), Err(TransportError::PeerGone("tp1".into()))] {
            let (failed, why) = judge(out(None), vec![answer(out(None)), peer]);
            let why = why.unwrap();
            assert!(why.starts_with("TP rank 2"), "{why}");
            assert_eq!(failed.failure.unwrap().class, ErrorClass::Unavailable);
        }
        // rank 0 failed part-way (its gather poisoned): out of step even if the peer answered
        let lost = Some(WireError::new(ErrorClass::Unavailable, "gather poisoned".to_string()));
        assert!(judge(out(lost), vec![answer(out(None))]).1.is_some());
    }
}
