//! The executor thread: owns the KV cache and the model.

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use pdmesh_model_api::{Executor, ExecutorError, KvCache};
use pdmesh_protocol::{KvConnectorOutput, ModelRunnerOutput, OffloadMetadata, SchedulerOutput};

use crate::metrics as m;

/// The executor, handed over to the executor thread once (`SyncArbiter` wants a factory).
pub type ExecutorFactory = Arc<dyn Fn() -> Result<Box<dyn Executor>, String> + Send + Sync>;

/// A factory that hands over one already-built executor (a model is loaded once, before the
/// service binds its socket, so a load error fails start-up with a clear message).
pub fn once(executor: Box<dyn Executor>) -> ExecutorFactory {
    let slot = std::sync::Mutex::new(Some(executor));
    Arc::new(move || match slot.lock() {
        Ok(mut s) => s.take().ok_or_else(|| "executor already taken (executor thread restarted)".to_string()),
        Err(_) => Err("executor slot poisoned".to_string()),
    })
}

/// The product's fault injection for the executor (`model.fault_injection`,
/// `PDMESH_EXECUTOR_FAULT`): drills the worker's handling of failed forward passes on any
/// model, the CPU ones included, without a broken GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecutorFaults {
    /// Every N-th forward pass fails with a model error (the step's requests fail; the worker
    /// serves on).
    pub step_error_every: Option<u64>,
    /// The N-th forward pass and every later one fail as a lost accelerator.
    pub device_lost_at_step: Option<u64>,
    /// Every forward pass takes N more milliseconds (a slow or throttled device): drills
    /// load-aware routing around a slow node (D55).
    pub step_delay_ms: Option<u64>,
}

impl ExecutorFaults {
    /// Parse a comma list such as `"step_error_every=5"`; empty means none.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut f = Self::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, value) = item.split_once('=').unwrap_or((item, ""));
            let n = value
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{item:?}: expected {name}=N with N a step count of 1 or more"))?;
            match name {
                "step_error_every" => f.step_error_every = Some(n),
                "device_lost_at_step" => f.device_lost_at_step = Some(n),
                "step_delay_ms" => f.step_delay_ms = Some(n),
                other => {
                    return Err(format!(
                        "unknown executor fault {other:?} (known: step_error_every=N, device_lost_at_step=N, step_delay_ms=N)"
                    ))
                }
            }
        }
        Ok(f)
    }

    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The injected failure of forward pass number `n` (counted from 1), if any.
    fn failure(&self, n: u64) -> Option<ExecutorError> {
        if self.device_lost_at_step.is_some_and(|at| n >= at) {
            return Some(ExecutorError::DeviceLost(format!("injected fault device_lost_at_step (forward pass {n})")));
        }
        if self.step_error_every.is_some_and(|every| n.is_multiple_of(every)) {
            return Some(ExecutorError::Model(format!("injected fault step_error_every (forward pass {n})")));
        }
        None
    }
}

/// Run one step.
#[derive(Message)]
#[rtype(result = "Result<ModelRunnerOutput, ExecutorError>")]
pub struct RunStep(pub SchedulerOutput);

/// Owns the KV cache memory (allocated and touched at start) and the model.
pub struct ExecutorActor {
    executor: Option<Box<dyn Executor>>,
    kv: KvCache,
    load_error: Option<String>,
    faults: ExecutorFaults,
    /// Forward passes run so far (what the faults count).
    forward_passes: u64,
    /// Set once the accelerator is lost: every later step fails with it, unrun.
    lost: Option<String>,
    /// The host-memory offload store, when the node runs the `OffloadConnector`: it lives on
    /// this thread because the copies touch the KV cache the forward pass uses.
    offload: Option<crate::offload::OffloadStore>,
}

/// Apply a step's offload copies, before that step's [`RunStep`] (the thread handles its
/// messages in order, so the forward pass sees the loaded blocks). Answers the offload
/// child's connector output.
#[derive(Message)]
#[rtype(result = "KvConnectorOutput")]
pub struct ApplyOffload(pub OffloadMetadata);

impl Handler<ApplyOffload> for ExecutorActor {
    type Result = MessageResult<ApplyOffload>;

    fn handle(&mut self, msg: ApplyOffload, _: &mut SyncContext<Self>) -> Self::Result {
        MessageResult(match self.offload.as_mut() {
            Some(store) => store.apply(&mut self.kv, &msg.0),
            None => {
                // Not configured here: settle everything so nothing waits for ever; a load
                // that cannot happen is refused block for block.
                tracing::warn!("offload copies asked of a worker without an offload store");
                KvConnectorOutput {
                    finished_sending: msg.0.saves.iter().map(|t| t.request_id.clone()).collect(),
                    finished_recving: msg.0.loads.iter().map(|t| t.request_id.clone()).collect(),
                    invalid_block_ids: msg.0.loads.iter().flat_map(|t| t.block_ids.iter().copied()).collect(),
                    ..Default::default()
                }
            }
        })
    }
}

impl Actor for ExecutorActor {
    type Context = SyncContext<Self>;
}

impl Handler<RunStep> for ExecutorActor {
    type Result = Result<ModelRunnerOutput, ExecutorError>;

    fn handle(&mut self, msg: RunStep, _: &mut SyncContext<Self>) -> Self::Result {
        let step = msg.0;
        let Some(executor) = self.executor.as_mut() else {
            return Err(ExecutorError::Model(format!(
                "model not loaded: {}",
                self.load_error.clone().unwrap_or_default()
            )));
        };
        if !step.finished_request_ids.is_empty() {
            executor.release(&step.finished_request_ids);
        }
        let started = Instant::now();
        let sampled = if step.chunks.is_empty() {
            Vec::new()
        } else if let Some(why) = &self.lost {
            return Err(ExecutorError::DeviceLost(why.clone()));
        } else {
            self.forward_passes += 1;
            if let Some(ms) = self.faults.step_delay_ms {
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
            let result = match self.faults.failure(self.forward_passes) {
                Some(injected) => Err(injected),
                None => executor.execute(&mut self.kv, &step.chunks),
            };
            result.map_err(|e| {
                m::EXECUTE_ERRORS.inc();
                tracing::error!(error = %e, step_id = step.step_id, "step failed");
                if let ExecutorError::DeviceLost(why) = &e {
                    self.lost = Some(why.clone());
                }
                e
            })?
        };
        let elapsed = started.elapsed();
        m::EXECUTE_SECONDS.observe(elapsed.as_secs_f64());
        m::TOKENS_COMPUTED.inc_by(step.chunks.iter().map(|c| c.token_ids.len() as u64).sum());
        Ok(ModelRunnerOutput {
            step_id: step.step_id,
            sampled,
            kv_connector_output: Default::default(),
            execute_us: elapsed.as_micros() as u64,
            failure: None,
        })
    }
}

/// Start the executor thread over `kv` (heap, or shared memory for P/D), with the offload
/// store `offload` if the node offloads.
pub fn start(
    factory: ExecutorFactory,
    kv: KvCache,
    faults: ExecutorFaults,
    offload: Option<crate::offload::OffloadStore>,
) -> Addr<ExecutorActor> {
    let spec = *kv.spec();
    let slot = std::sync::Mutex::new(Some(kv));
    let offload_slot = std::sync::Mutex::new(offload);
    SyncArbiter::start(1, move || {
        let kv = slot.lock().ok().and_then(|mut s| s.take()).unwrap_or_else(|| KvCache::new_heap(spec));
        let (executor, load_error) = match factory() {
            Ok(e) => (Some(e), None),
            Err(e) => {
                tracing::error!(error = %e, "model failed to load");
                (None, Some(e))
            }
        };
        let offload = offload_slot.lock().ok().and_then(|mut s| s.take());
        ExecutorActor { executor, kv, load_error, faults, forward_passes: 0, lost: None, offload }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_and_fire_on_their_steps() {
        assert!(ExecutorFaults::parse("").unwrap().is_empty());
        let f = ExecutorFaults::parse("step_error_every=3, device_lost_at_step=7").unwrap();
        assert_eq!(f, ExecutorFaults { step_error_every: Some(3), device_lost_at_step: Some(7), step_delay_ms: None });
        assert_eq!(ExecutorFaults::parse("step_delay_ms=20").unwrap().step_delay_ms, Some(20));
        let fired: Vec<(u64, bool)> = (1..=8).filter_map(|n| f.failure(n).map(|e| (n, e.is_device_lost()))).collect();
        assert_eq!(fired, vec![(3, false), (6, false), (7, true), (8, true)]);
        for bad in ["step_error_every=0", "step_error_every", "device_lost_at_step=x", "melt=1"] {
            assert!(ExecutorFaults::parse(bad).is_err(), "{bad}");
        }
    }
}
