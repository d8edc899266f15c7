//! `pdmesh-load topology`: print a topology of the load-test scenarios (loadtest/scenarios),
//! built by pdmesh-test-support's typed builders (the tests' own), so a scenario's mesh cannot
//! drift from the config schema; `normalize` prints any topology file as pdmesh reads it, for
//! comparing two.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use pdmesh_test_support::topology::{
    self, HoldMode, KvLoadFailurePolicy, KvRole, LimitsConfig, NodeConfig, NodeExt as _, RouterConfig, RoutingPolicy,
    Topology, TopologyExt as _, TransferBackendKind,
};

#[derive(Subcommand)]
pub enum TopologyCmd {
    /// The scenarios' P/D mesh (lib.sh's `write_topology`): router on HTTP (base BASE), P on
    /// HTTP+1 (BASE+200), D on HTTP+2 (BASE+400); P's side channel SIDE (block server +2), D's
    /// SIDE+5 (+7).
    Pd(PdArgs),
    /// One colocated node (pd-vs-colocated.sh, ttft-breakdown.sh).
    Colocated(ColocatedArgs),
    /// slow-decode.sh's mesh: 2 P and 2 D nodes (tcp KV backend) behind three routers,
    /// `least_loaded` on HTTP, `round_robin` on HTTP+5, `power_of_two` on HTTP+6; P on
    /// HTTP+1/+2, D on HTTP+3/+4; decode-b's executor delayed by `--delay-ms`.
    SlowDecode(SlowDecodeArgs),
    /// Read a topology file as pdmesh does (defaults filled in, validated) and print it back:
    /// two files that print the same are the same mesh.
    Normalize { file: PathBuf },
}

/// The model of a node.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// `synthetic`, `gguf` (the real model: `$PDMESH_MODEL_PATH`, else the fetch cache, when
    /// the mesh starts) or the path of a GGUF file.
    #[arg(long, default_value = "synthetic")]
    model: String,
    /// Synthetic executor: microseconds of compute per token.
    #[arg(long, default_value_t = 20)]
    cost_us: u64,
    /// Synthetic executor: microseconds of compute per step.
    #[arg(long, default_value_t = 0)]
    step_us: u64,
    /// Synthetic executor: the model name served.
    #[arg(long)]
    model_name: Option<String>,
    /// Real model: `model.cpu_nice` of every node (default: the config's).
    #[arg(long)]
    cpu_nice: Option<u8>,
}

impl ModelArgs {
    fn gguf(&self) -> bool {
        self.model != "synthetic"
    }

    /// The model on `n`, with `threads` forward-pass threads (real model; 0: the default).
    fn apply(&self, n: NodeConfig, threads: Option<u32>) -> NodeConfig {
        if !self.gguf() {
            let name = self.model_name.clone();
            return n.synthetic(self.cost_us).model(|m| {
                m.per_step_cost_us = self.step_us;
                if let Some(name) = name {
                    m.name = name;
                }
            });
        }
        let path = if self.model == "gguf" { String::new() } else { self.model.clone() };
        n.gguf(path).model(|m| {
            if let Some(t) = threads {
                m.threads = t;
            }
            if let Some(nice) = self.cpu_nice {
                m.cpu_nice = nice;
            }
        })
    }
}

#[derive(Args)]
pub struct PdArgs {
    #[arg(long)]
    run_dir: PathBuf,
    #[arg(long)]
    http_port: u16,
    #[arg(long)]
    base_port: u16,
    #[arg(long)]
    side_port: u16,
    #[command(flatten)]
    model: ModelArgs,
    /// KV transfer backend of P and D.
    #[arg(long, default_value = "shm")]
    backend: String,
    /// Real model: forward-pass threads of P's and D's workers.
    #[arg(long)]
    p_threads: Option<u32>,
    #[arg(long)]
    d_threads: Option<u32>,
    /// KV blocks of P and D (default: 4096, or 512 with the real model).
    #[arg(long)]
    p_blocks: Option<u32>,
    #[arg(long)]
    d_blocks: Option<u32>,
    #[arg(long, default_value_t = 8192)]
    p_max_len: u32,
    #[arg(long, default_value_t = 2048)]
    d_max_len: u32,
    #[arg(long, default_value_t = 1)]
    d_ranks: u32,
    /// P's hold: `lease` (extended by D's heartbeats) or `fixed` (`--hold-s`).
    #[arg(long, default_value = "lease")]
    hold_mode: String,
    #[arg(long, default_value_t = 5)]
    lease_s: u64,
    #[arg(long, default_value_t = 480)]
    hold_s: u64,
    /// D's rejection notices (rule R1).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    notices: bool,
    /// D's `kv_load_failure_policy`: `fail` or `recompute`.
    #[arg(long, default_value = "fail")]
    policy: String,
    /// Fault injection of P's and of D's transfer agent.
    #[arg(long, default_value = "")]
    p_fault: String,
    #[arg(long, default_value = "")]
    d_fault: String,
    /// More keys of the router's `router` table, as TOML (`give_up_notices = false, ...`).
    #[arg(long, default_value = "")]
    router_extra: String,
    /// Keys of every node's `limits` table, as TOML (`request_deadline_s = 60, ...`).
    #[arg(long, default_value = "")]
    limits: String,
}

#[derive(Args)]
pub struct ColocatedArgs {
    #[arg(long)]
    run_dir: PathBuf,
    #[arg(long, default_value = "colocated")]
    name: String,
    #[arg(long)]
    http_port: u16,
    #[arg(long)]
    base_port: u16,
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    #[arg(long, default_value_t = 512)]
    blocks: u32,
    #[arg(long, default_value_t = 8192)]
    max_len: u32,
    #[arg(long, default_value_t = 128)]
    max_num_seqs: u32,
}

#[derive(Args)]
pub struct SlowDecodeArgs {
    #[arg(long)]
    run_dir: PathBuf,
    #[arg(long)]
    http_port: u16,
    #[arg(long)]
    base_port: u16,
    /// Synthetic executor: microseconds of compute per step (per token: 100).
    #[arg(long, default_value_t = 8000)]
    step_us: u64,
    /// Milliseconds added to every step of decode-b (0: not slowed).
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
}

pub fn run(cmd: TopologyCmd) -> anyhow::Result<()> {
    let topo = match cmd {
        TopologyCmd::Pd(a) => pd(&a)?,
        TopologyCmd::Colocated(a) => colocated(&a),
        TopologyCmd::SlowDecode(a) => slow_decode(&a),
        TopologyCmd::Normalize { file } => Topology::load(&file)?,
    };
    print!("{}", topo.to_toml()?);
    Ok(())
}

/// `section` with the keys of `extra` (TOML, the inside of an inline table) set on it, read
/// back through the schema: an unknown key or a wrong type is an error.
fn merged<T: serde::Serialize + serde::de::DeserializeOwned>(
    section: &T,
    extra: &str,
    what: &str,
) -> anyhow::Result<T> {
    if extra.trim().is_empty() {
        return Ok(toml::Value::try_from(section)?.try_into()?);
    }
    let mut table = toml::Value::try_from(section)?;
    let extra: toml::Table = toml::from_str(&format!("x = {{ {extra} }}"))?;
    if let (Some(t), Some(toml::Value::Table(e))) = (table.as_table_mut(), extra.get("x")) {
        for (k, v) in e {
            t.insert(k.clone(), v.clone());
        }
    }
    table.try_into().map_err(|e| anyhow::anyhow!("{what} {{ {extra} }}: {e}"))
}

fn backend(name: &str) -> anyhow::Result<TransferBackendKind> {
    TransferBackendKind::parse(name).ok_or_else(|| anyhow::anyhow!("unknown backend {name:?} (shm, tcp, cuda)"))
}

fn pd(a: &PdArgs) -> anyhow::Result<Topology> {
    let (http, base, side) = (a.http_port, a.base_port, a.side_port);
    let backend = backend(&a.backend)?;
    // 720 KiB per block for SmolLM2-135M: 512 blocks (8192 tokens) is 360 MiB per rank.
    let blocks = if a.model.gguf() { 512 } else { 4096 };
    let limits: LimitsConfig = merged(&LimitsConfig::default(), &a.limits, "limits")?;
    let hold_mode = match a.hold_mode.as_str() {
        "lease" => HoldMode::Lease,
        "fixed" => HoldMode::Fixed,
        other => anyhow::bail!("unknown hold mode {other:?} (lease, fixed)"),
    };
    let policy = match a.policy.as_str() {
        "fail" => KvLoadFailurePolicy::Fail,
        "recompute" => KvLoadFailurePolicy::Recompute,
        other => anyhow::bail!("unknown kv_load_failure_policy {other:?} (fail, recompute)"),
    };
    let mut router = topology::router("router", http, base, &[topology::url(http + 1)], &[topology::url(http + 2)]);
    router.router = merged::<RouterConfig>(&router.router, &a.router_extra, "router")?;
    let mut p_kv = topology::kv(KvRole::KvProducer, backend, side);
    p_kv.hold_mode = hold_mode;
    p_kv.kv_lease_duration_s = a.lease_s;
    p_kv.abort_request_timeout_s = a.hold_s;
    p_kv.fault_injection = a.p_fault.clone();
    let mut d_kv = topology::kv(KvRole::KvConsumer, backend, side + 5);
    d_kv.kv_load_failure_policy = policy;
    d_kv.rejection_notices = a.notices;
    d_kv.fault_injection = a.d_fault.clone();
    let engine = |blocks: u32, max_len: u32| {
        move |e: &mut topology::EngineConfig| {
            e.block_size = 16;
            e.num_blocks = blocks;
            e.max_model_len = max_len;
            e.max_num_seqs = 128;
        }
    };
    let p = a
        .model
        .apply(topology::prefill("p", http + 1, base + 200), a.p_threads)
        .engine(engine(a.p_blocks.unwrap_or(blocks), a.p_max_len))
        .kv(p_kv);
    let d = a
        .model
        .apply(topology::decode("d", http + 2, base + 400), a.d_threads)
        .dp_size(a.d_ranks)
        .engine(engine(a.d_blocks.unwrap_or(blocks), a.d_max_len))
        .kv(d_kv);
    let mut t = topology::topology([router, p, d]).all_nodes(|n| n.limits = limits.clone());
    t.run_dir = a.run_dir.clone();
    Ok(t)
}

fn colocated(a: &ColocatedArgs) -> Topology {
    let node = a.model.apply(topology::colocated(&a.name, a.http_port, a.base_port), None).engine(|e| {
        e.block_size = a.block_size;
        e.num_blocks = a.blocks;
        e.max_model_len = a.max_len;
        e.max_num_seqs = a.max_num_seqs;
    });
    let mut t = topology::topology([node]);
    t.run_dir = a.run_dir.clone();
    t
}

fn slow_decode(a: &SlowDecodeArgs) -> Topology {
    let (http, base) = (a.http_port, a.base_port);
    let p_urls = [topology::url(http + 1), topology::url(http + 2)];
    let d_urls = [topology::url(http + 3), topology::url(http + 4)];
    let routers = [
        ("router-ll", http, base, RoutingPolicy::LeastLoaded),
        ("router-rr", http + 5, base + 20, RoutingPolicy::RoundRobin),
        ("router-p2", http + 6, base + 40, RoutingPolicy::PowerOfTwo),
    ]
    .map(|(name, h, b, policy)| topology::router(name, h, b, &p_urls, &d_urls).policy(policy));
    let engine = |name: &str, role, h: u16, b: u16, kv_role, side: u16| {
        let mut kv = topology::kv(kv_role, TransferBackendKind::Tcp, side);
        kv.engine_id = name.to_string();
        topology::node(name, role, h, b)
            .synthetic(100)
            .model(|m| m.per_step_cost_us = a.step_us)
            .engine(|e| {
                e.block_size = 16;
                e.num_blocks = 1024;
                e.max_num_seqs = 64;
            })
            .kv(kv)
    };
    use topology::NodeRole::{Decode, Prefill};
    let mut t = topology::topology(routers.into_iter().chain([
        engine("prefill-a", Prefill, http + 1, base + 200, KvRole::KvProducer, http + 5000),
        engine("prefill-b", Prefill, http + 2, base + 400, KvRole::KvProducer, http + 5010),
        engine("decode-a", Decode, http + 3, base + 600, KvRole::KvConsumer, http + 5020),
        engine("decode-b", Decode, http + 4, base + 800, KvRole::KvConsumer, http + 5030),
    ]));
    if a.delay_ms > 0 {
        t = t.with_node("decode-b", |n| n.model.fault_injection = format!("step_delay_ms={}", a.delay_ms));
    }
    t.run_dir = a.run_dir.clone();
    t
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: TopologyCmd,
    }

    fn built(args: &[&str]) -> Topology {
        let cli = Cli::try_parse_from(std::iter::once("topology").chain(args.iter().copied())).unwrap();
        let t = match cli.cmd {
            TopologyCmd::Pd(a) => pd(&a).unwrap(),
            TopologyCmd::Colocated(a) => colocated(&a),
            TopologyCmd::SlowDecode(a) => slow_decode(&a),
            TopologyCmd::Normalize { .. } => unreachable!(),
        };
        Topology::from_toml(&t.to_toml().unwrap()).unwrap()
    }

    #[test]
    fn the_scenario_pd_shape_has_the_knobs_asked_for() {
        let t = built(&[
            "pd",
            "--run-dir",
            "/tmp/x",
            "--http-port",
            "13000",
            "--base-port",
            "20000",
            "--side-port",
            "18000",
            "--hold-mode",
            "fixed",
            "--hold-s",
            "480",
            "--notices",
            "false",
            "--policy",
            "recompute",
            "--d-ranks",
            "2",
            "--router-extra",
            "give_up_notices = false",
            "--limits",
            "request_deadline_s = 60",
        ]);
        let names: Vec<_> = t.nodes.iter().map(|n| (n.name.as_str(), n.http_port, n.base_port)).collect();
        assert_eq!(names, [("router", 13000, 20000), ("p", 13001, 20200), ("d", 13002, 20400)]);
        let r = &t.nodes[0].router;
        assert_eq!((r.prefill[0].as_str(), r.decode[0].as_str()), ("http://127.0.0.1:13001", "http://127.0.0.1:13002"));
        assert!(!r.give_up_notices);
        assert!(t.nodes.iter().all(|n| n.limits.request_deadline_s == 60));
        let (p, d) = (t.nodes[1].kv_transfer.as_ref().unwrap(), t.nodes[2].kv_transfer.as_ref().unwrap());
        assert_eq!((p.kv_role, p.side_channel_port, p.data_port), (KvRole::KvProducer, 18000, 18002));
        assert_eq!((d.kv_role, d.side_channel_port, d.data_port), (KvRole::KvConsumer, 18005, 18007));
        assert_eq!((p.hold_mode, p.abort_request_timeout_s), (HoldMode::Fixed, 480));
        assert_eq!((d.kv_load_failure_policy, d.rejection_notices), (KvLoadFailurePolicy::Recompute, false));
        assert_eq!((t.nodes[2].dp_size, t.nodes[1].engine.num_blocks), (2, 4096));
        assert_eq!(t.nodes[1].model.per_token_cost_us, 20);
    }

    #[test]
    fn an_unknown_router_key_is_refused() {
        let cli = Cli::try_parse_from([
            "topology",
            "pd",
            "--run-dir",
            "/tmp/x",
            "--http-port",
            "13000",
            "--base-port",
            "20000",
            "--side-port",
            "18000",
            "--router-extra",
            "no_such_key = 1",
        ])
        .unwrap();
        let TopologyCmd::Pd(a) = cli.cmd else { unreachable!() };
        assert!(pd(&a).is_err());
    }

    #[test]
    fn the_slow_decode_shape_slows_only_decode_b() {
        let t = built(&[
            "slow-decode",
            "--run-dir",
            "/tmp/x",
            "--http-port",
            "13200",
            "--base-port",
            "22000",
            "--delay-ms",
            "30",
        ]);
        assert_eq!(t.nodes.len(), 7);
        for n in &t.nodes {
            let want = if n.name == "decode-b" { "step_delay_ms=30" } else { "" };
            assert_eq!(n.model.fault_injection, want, "{}", n.name);
        }
    }
}
