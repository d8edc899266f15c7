//! Fail fast (docs/SECURITY.md, "Fail fast"): a child of `pdmesh up` that exits on a
//! configuration error stops the whole mesh, with the child's error on `pdmesh up`'s terminal
//! and a non-zero exit, instead of being restarted forever; and log files carry no terminal
//! colour codes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use common::{pdmesh_bin, reserve_ports, topo, Mesh};

/// The configuration-error exit status (`pdmesh_config::EXIT_CONFIG`).
const EXIT_CONFIG: i32 = 78;

struct Outcome {
    status: ExitStatus,
    stderr: String,
    stdout: String,
    run_dir: PathBuf,
}

/// Run `pdmesh up` on a one-node topology (`node_extra` appended to the node) with `env`, and
/// wait for it to exit: a restart loop never exits, so a bounded wait tells the two apart.
fn up_until_exit(node_extra: impl FnOnce(&mut topo::NodeConfig), env: &[(&str, &str)]) -> Outcome {
    let (http, base) = reserve_ports();
    let (run_dir, topology) = common::one_node_run_dir("pdmesh-failfast", http, base, node_extra);
    let (out, err) = (run_dir.join("up.out"), run_dir.join("up.err"));
    let mut up = Command::new(pdmesh_bin())
        .arg("up")
        .arg("--topology")
        .arg(&topology)
        .envs(env.iter().copied())
        .env("PDMESH_RUN_DIR", &run_dir)
        .env("RUST_LOG", "info")
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = up.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(up.id() as i32), nix::sys::signal::Signal::SIGTERM);
            let _ = up.wait();
            panic!(
                "pdmesh up was still running after 90 s (restarting a misconfigured child?); stderr:\n{}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stderr = std::fs::read_to_string(&err).unwrap();
    let stdout = std::fs::read_to_string(&out).unwrap();
    Outcome { status, stderr, stdout, run_dir }
}

/// Pids of live processes whose environment names `run_dir` (children of that mesh).
fn processes_of(run_dir: &Path) -> Vec<String> {
    let needle = format!("PDMESH_RUN_DIR={}", run_dir.display());
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
        .filter(|e| {
            std::fs::read(e.path().join("environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

fn assert_stopped_on_config_error(o: &Outcome, service: &str, error: &str) {
    assert_eq!(o.status.code(), Some(EXIT_CONFIG), "exit status; stderr:\n{}", o.stderr);
    assert!(o.stderr.contains(&format!("main.{service}")), "the child is named:\n{}", o.stderr);
    assert!(o.stderr.contains("configuration error"), "{}", o.stderr);
    assert!(o.stderr.contains(error), "the child's own error reaches the terminal:\n{}", o.stderr);
    assert!(!o.stdout.contains("restarted"), "a misconfigured child is not restarted:\n{}", o.stdout);
    assert!(processes_of(&o.run_dir).is_empty(), "every child of the mesh is stopped");
    assert!(!o.stdout.contains('\u{1b}') && !o.stderr.contains('\u{1b}'), "no colour codes in up's own output");
    let _ = std::fs::remove_dir_all(&o.run_dir);
}

#[test]
fn an_unknown_transfer_fault_stops_the_mesh_with_the_childs_error() {
    let o = up_until_exit(
        |n| {
            let mut kv = topo::kv_defaults(topo::KvRole::KvBoth);
            kv.side_channel_port = 0;
            n.kv_transfer = Some(kv);
        },
        &[("PDMESH_FAULT", "no_such_fault")],
    );
    assert_stopped_on_config_error(&o, "connector-worker.0", "unknown fault \"no_such_fault\"");
}

#[test]
fn a_missing_model_file_stops_the_mesh_with_the_childs_error() {
    let o = up_until_exit(
        |n| {
            n.model.kind = topo::ModelKind::Gguf;
            n.model.path = "/nonexistent/pdmesh-test.gguf".into();
        },
        &[],
    );
    assert_eq!(o.status.code(), Some(EXIT_CONFIG), "stderr:\n{}", o.stderr);
    assert!(o.stderr.contains("/nonexistent/pdmesh-test.gguf") && o.stderr.contains("not found"), "{}", o.stderr);
    // Either the frontend (tokenizer) or the worker (weights) reports it first.
    let service = if o.stderr.contains("main.frontend (pid") { "frontend" } else { "connector-worker.0" };
    assert_stopped_on_config_error(&o, service, "not found");
}

/// A tensor-parallel size the model cannot be split by (SmolLM2: 9 attention heads) stops
/// the mesh at start, naming the count, with the configuration status (D111).
#[test]
fn a_tensor_parallel_size_the_heads_do_not_divide_stops_the_mesh_naming_them() {
    let Some(model) = common::model_path() else { return };
    let o = up_until_exit(
        |n| {
            n.model.kind = topo::ModelKind::Gguf;
            n.model.path = model.display().to_string();
            n.tensor_parallel_size = 2;
        },
        &[],
    );
    assert_stopped_on_config_error(
        &o,
        "connector-worker.0",
        "9 attention heads, not a multiple of tensor_parallel_size 2",
    );
}

#[test]
fn a_bad_key_file_stops_up_before_any_child_starts() {
    let o = up_until_exit(|_| {}, &[("PDMESH_API_KEY_FILE", "/nonexistent/pdmesh-keys")]);
    assert_eq!(o.status.code(), Some(EXIT_CONFIG), "stderr:\n{}", o.stderr);
    assert!(o.stderr.contains("/nonexistent/pdmesh-keys"), "{}", o.stderr);
    assert!(!o.run_dir.join("logs").exists() || processes_of(&o.run_dir).is_empty());
    let _ = std::fs::remove_dir_all(&o.run_dir);
}

#[test]
fn log_files_carry_no_colour_codes() {
    let mesh = Mesh::start_one(|_| {});
    let r = reqwest::blocking::Client::new()
        .post(mesh.url("/v1/completions"))
        .json(&serde_json::json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let logs = mesh.logs();
    assert!(logs.contains("INFO"), "the logs were written: {logs}");
    assert!(!logs.contains('\u{1b}'), "an escape code in a log file: {logs}");
    assert!(mesh.stop().success());
}

/// Issue 40: a mesh secret that is too short is a configuration error of `pdmesh up` itself
/// (exit 78, as docs/SECURITY.md promises), not a failure (exit 1), and nothing starts.
#[test]
fn a_short_mesh_secret_stops_up_with_the_configuration_status() {
    let o = up_until_exit(|_| {}, &[("PDMESH_MESH_SECRET", "short")]);
    assert_eq!(o.status.code(), Some(EXIT_CONFIG), "stderr:\n{}", o.stderr);
    assert!(o.stderr.contains("configuration error"), "{}", o.stderr);
    assert!(processes_of(&o.run_dir).is_empty(), "no child of the mesh runs");
    let _ = std::fs::remove_dir_all(&o.run_dir);
}

/// Issue 40: a topology whose side-channel port is one of the node's own `/metrics` ports
/// (`base_port` + 100, the dp-lb's) is refused before anything starts, naming both uses,
/// instead of starting a worker that cannot bind and is restarted in a loop.
#[test]
fn a_topology_whose_ports_collide_is_refused_naming_both_uses() {
    let (http, base) = reserve_ports();
    let (run_dir, topology) = common::one_node_run_dir("pdmesh-portclash", http, base, |n| {
        let mut kv = topo::kv_defaults(topo::KvRole::KvBoth);
        kv.side_channel_port = base + 100;
        n.kv_transfer = Some(kv);
    });
    let o = Command::new(pdmesh_bin())
        .arg("up")
        .arg("--topology")
        .arg(&topology)
        .env("PDMESH_RUN_DIR", &run_dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(EXIT_CONFIG), "stderr:\n{stderr}");
    assert!(
        stderr.contains(&format!("port {}", base + 100))
            && stderr.contains("dp-lb metrics")
            && stderr.contains("KV side channel of rank 0"),
        "both uses are named:\n{stderr}"
    );
    assert!(!run_dir.join("logs").exists(), "nothing started");
    let _ = std::fs::remove_dir_all(&run_dir);
}
