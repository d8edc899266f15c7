//! The executor thread: owns the KV cache and the model.

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use pdmesh_model_api::{Executor, KvCache};
use pdmesh_protocol::{ModelRunnerOutput, SchedulerOutput};

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

/// Run one step.
#[derive(Message)]
#[rtype(result = "Result<ModelRunnerOutput, String>")]
pub struct RunStep(pub SchedulerOutput);

/// Owns the KV cache memory (allocated and touched at start) and the model.
pub struct ExecutorActor {
    executor: Option<Box<dyn Executor>>,
    kv: KvCache,
    load_error: Option<String>,
}

impl Actor for ExecutorActor {
    type Context = SyncContext<Self>;
}

impl Handler<RunStep> for ExecutorActor {
    type Result = Result<ModelRunnerOutput, String>;

    fn handle(&mut self, msg: RunStep, _: &mut SyncContext<Self>) -> Self::Result {
        let step = msg.0;
        let Some(executor) = self.executor.as_mut() else {
            return Err(format!("model not loaded: {}", self.load_error.clone().unwrap_or_default()));
        };
        let started = Instant::now();
        let sampled = if step.chunks.is_empty() {
            Vec::new()
        } else {
            executor.execute(&mut self.kv, &step.chunks).map_err(|e| {
                m::EXECUTE_ERRORS.inc();
                tracing::error!(error = %e, step_id = step.step_id, "step failed");
                e.to_string()
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
        })
    }
}

/// Start the executor thread over `kv` (heap, or shared memory for P/D).
pub fn start(factory: ExecutorFactory, kv: KvCache) -> Addr<ExecutorActor> {
    let spec = *kv.spec();
    let slot = std::sync::Mutex::new(Some(kv));
    SyncArbiter::start(1, move || {
        let kv = slot.lock().ok().and_then(|mut s| s.take()).unwrap_or_else(|| KvCache::new_heap(spec));
        let (executor, load_error) = match factory() {
            Ok(e) => (Some(e), None),
            Err(e) => {
                tracing::error!(error = %e, "model failed to load");
                (None, Some(e))
            }
        };
        ExecutorActor { executor, kv, load_error }
    })
}
