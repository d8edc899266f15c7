//! The baseline: the engine's own step machine ([`EngineStep`]) with the same scheduler, the
//! no-op connector and the synthetic executor, called in one thread with no sockets, under the
//! same closed-loop load. The mesh runs the same step code; only the process hops differ.

use std::collections::HashMap;
use std::time::Instant;

use pdmesh_connector_scheduler::{dispatch, NoopConnector};
use pdmesh_engine_core::scheduler::{Scheduler, SchedulerConfig};
use pdmesh_engine_core::step::{EngineState, EngineStep, StepIo, WorkerAnswer};
use pdmesh_model_api::{Executor, KvCache, KvCacheSpec};
use pdmesh_protocol::{EngineRequest, ModelRunnerOutput, SamplingParams, TraceContext};
use pdmesh_synthetic_executor::{SyntheticConfig, SyntheticExecutor};

use crate::stats::{summarize, RunResult};

pub fn run(concurrency: usize, requests: usize, prompt_tokens: usize, max_tokens: u32) -> RunResult {
    let cfg = SchedulerConfig {
        block_size: 16,
        num_blocks: 16384,
        max_num_seqs: 512,
        max_num_batched_tokens: 8192,
        max_model_len: 4096,
    };
    let mut exec = SyntheticExecutor::new(SyntheticConfig::default());
    let facts = exec.facts().clone();
    let mut kv = KvCache::new_heap(KvCacheSpec {
        num_layers: facts.num_layers,
        num_blocks: cfg.num_blocks,
        block_size: cfg.block_size,
        num_kv_heads: facts.num_kv_heads,
        head_dim: facts.head_dim,
    });
    let mut state = EngineState::new(0, Scheduler::new(cfg));
    let mut connector = NoopConnector::default();
    let mut started: HashMap<String, Instant> = HashMap::new();
    let mut first: HashMap<String, Instant> = HashMap::new();
    let (mut sent, mut done) = (0usize, 0usize);
    let mut e2e = Vec::new();
    let mut ttft = Vec::new();
    let mut step_times = Vec::new();
    let mut tokens = 0u64;
    let t0 = Instant::now();
    while done < requests {
        while sent < requests && sent - done < concurrency {
            let id = format!("r{sent}");
            let prompt = (0..prompt_tokens).map(|i| (97 + (i + sent) % 26) as u32).collect();
            let req = EngineRequest {
                request_id: id.clone(),
                client_request_id: None,
                prompt_token_ids: prompt,
                sampling: SamplingParams { max_tokens, temperature: 0.0, ignore_eos: true, ..Default::default() },
                eos_token_ids: vec![],
                arrival_unix_ms: 0,
                kv_transfer_params: None,
                data_parallel_rank: None,
            };
            state.inbox.adds.push(req);
            started.insert(id, Instant::now());
            sent += 1;
        }
        let s0 = Instant::now();
        let (mut step, mut io) = EngineStep::start(&mut state, |_| TraceContext::default());
        let stepped = loop {
            io = match io {
                StepIo::Connector(calls) => {
                    let replies = calls.into_iter().map(|c| dispatch(&mut connector, c)).collect();
                    step.on_connector(&mut state, Some(replies))
                }
                StepIo::Worker(output) => {
                    let sampled = exec.execute(&mut kv, &output.chunks).unwrap_or_default();
                    let out = ModelRunnerOutput { step_id: output.step_id, sampled, ..Default::default() };
                    step.on_worker(&mut state, WorkerAnswer::Ran(out))
                }
                StepIo::Done(stepped) => break stepped,
            };
        };
        step_times.push(s0.elapsed().as_secs_f64() * 1000.0);
        let now = Instant::now();
        for o in stepped.outputs {
            tokens += o.new_token_ids.len() as u64;
            if !o.new_token_ids.is_empty() && !first.contains_key(&o.request_id) {
                if let Some(s) = started.get(&o.request_id) {
                    ttft.push(now.duration_since(*s).as_secs_f64() * 1000.0);
                }
                first.insert(o.request_id.clone(), now);
            }
            if o.finish_reason.is_some() {
                if let Some(s) = started.remove(&o.request_id) {
                    e2e.push(now.duration_since(s).as_secs_f64() * 1000.0);
                }
                first.remove(&o.request_id);
                done += 1;
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let e2e_s = summarize(&e2e);
    RunResult {
        concurrency,
        requests,
        errors: 0,
        wall_s: wall,
        requests_per_s: requests as f64 / wall,
        output_tokens_per_s: tokens as f64 / wall,
        e2e_mean_ms: e2e_s.mean_ms,
        e2e: e2e_s,
        ttft: summarize(&ttft),
        itl: Default::default(),
        step_mean_ms: step_times.iter().sum::<f64>() / step_times.len().max(1) as f64,
    }
}
