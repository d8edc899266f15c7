//! vLLM's operator vocabulary: `pdmesh serve` twice (a producer and a consumer, real model,
//! `--kv-transfer-config` JSON) and `pdmesh proxy` with vLLM's proxy flags serve P/D with
//! nothing but vLLM's flags; a flag pdmesh does not honour is refused by name.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A `pdmesh serve`/`pdmesh proxy` process, stopped with SIGTERM (then killed) on drop.
struct Proc(Child, &'static str);

impl Drop for Proc {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("{} did not stop in 20 s; killing", self.1);
        let _ = self.0.kill();
    }
}

fn model_path() -> Option<String> {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping");
        return None;
    }
    let p = pdmesh_model::default_model_path();
    assert!(p.is_file(), "model {} missing: run scripts/fetch-model.sh", p.display());
    Some(p.display().to_string())
}

const SECRET: &str = "0123456789abcdef0123456789abcdef-vllm-cli-test";

fn pdmesh(run_dir: &std::path::Path, log: &str, args: &[&str], env: &[(&str, String)]) -> Child {
    Command::new(common::pdmesh_bin())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("PDMESH_RUN_DIR", run_dir)
        .env("PDMESH_MESH_SECRET", SECRET)
        .env_remove("PDMESH_TOPOLOGY")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(run_dir.join(log)).unwrap())
        .spawn()
        .unwrap()
}

fn as_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

/// Wait until the frontend on `port` answers /health (and, `engines`, has its ranks connected).
fn wait_ready(port: u16, engines: bool, run_dir: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(90);
    let c = reqwest::blocking::Client::new();
    while Instant::now() < deadline {
        let healthy = c.get(format!("http://127.0.0.1:{port}/health")).send().is_ok_and(|r| r.status().is_success());
        let connected = !engines
            || c.get(format!("http://127.0.0.1:{port}/debug/engines"))
                .send()
                .ok()
                .and_then(|r| r.json::<Value>().ok())
                .is_some_and(|v| {
                    v["unreachable_ranks"].as_array().is_some_and(|a| a.is_empty())
                        && v["engines"].as_array().is_some_and(|a| !a.is_empty())
                });
        if healthy && connected {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("node on :{port} not ready in 90 s; logs in {}", run_dir.display());
}

fn post(port: u16, path: &str, body: &Value) -> Value {
    let r = client().post(format!("http://127.0.0.1:{port}{path}")).json(body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200, "{path} on :{port}");
    r.json().unwrap()
}

fn kv(port: u16) -> Value {
    reqwest::blocking::get(format!("http://127.0.0.1:{port}/debug/kv")).unwrap().json().unwrap()
}

fn metric(port: u16, name: &str) -> f64 {
    let text = reqwest::blocking::get(format!("http://127.0.0.1:{port}/metrics")).unwrap().text().unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not on :{port}/metrics"))
}

/// vLLM's P/D recipe, in pdmesh: `serve` a producer and a consumer (`kv_both`, as vLLM's NIXL
/// recipe starts both) with `--kv-transfer-config` and the NIXL side-channel variable, and a
/// `proxy` over them. Greedy completions and a chat through the proxy equal the consumer's own
/// answers to the same requests (a `kv_both` node serves a plain request locally), P's
/// connector served a handshake, and every block is given back.
#[test]
fn two_serves_and_a_proxy_do_pd_with_vllm_flags_alone() {
    let Some(model) = model_path() else { return };
    let (http, _) = common::reserve_ports();
    let side = common::side_ports(http);
    let (proxy, p, d) = (http, http + 1, http + 2);
    let run_dir = std::env::temp_dir().join(format!("pdmesh-vllm-cli-{}-{http}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).unwrap();
    let node = |port: u16, role: &str| -> Vec<String> {
        [
            model.as_str(),
            "--port",
            &port.to_string(),
            "--max-model-len",
            "1024",
            "--num-gpu-blocks-override",
            "128",
            "--served-model-name",
            "smol",
            "--kv-transfer-config",
            &format!(r#"{{"kv_connector":"NixlConnector","kv_role":"{role}"}}"#),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let args =
        |v: &[String]| -> Vec<String> { std::iter::once("serve".to_string()).chain(v.iter().cloned()).collect() };
    let p_args = args(&node(p, "kv_producer"));
    let d_args = args(&node(d, "kv_both"));
    let _p = Proc(
        pdmesh(&run_dir, "p.log", &as_refs(&p_args), &[("VLLM_NIXL_SIDE_CHANNEL_PORT", side.to_string())]),
        "serve P",
    );
    let _d = Proc(
        pdmesh(&run_dir, "d.log", &as_refs(&d_args), &[("VLLM_NIXL_SIDE_CHANNEL_PORT", (side + 4).to_string())]),
        "serve D",
    );
    let proxy_args = [
        "proxy".to_string(),
        "--port".into(),
        proxy.to_string(),
        "--prefiller-hosts".into(),
        "127.0.0.1".into(),
        "--prefiller-ports".into(),
        p.to_string(),
        "--decoder-hosts".into(),
        "127.0.0.1".into(),
        "--decoder-ports".into(),
        d.to_string(),
    ];
    let _proxy = Proc(pdmesh(&run_dir, "proxy.log", &as_refs(&proxy_args), &[]), "proxy");
    wait_ready(p, true, &run_dir);
    wait_ready(d, true, &run_dir);
    wait_ready(proxy, false, &run_dir);

    for prompt in ["The capital of France is", "Once upon a time, in a small village by the sea,", "1, 2, 3, 4,"] {
        let body = json!({"model": "smol", "prompt": prompt, "max_tokens": 16, "temperature": 0});
        let want = post(d, "/v1/completions", &body);
        let got = post(proxy, "/v1/completions", &body);
        assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"], "{prompt}");
        assert_eq!(got["model"], "smol", "--served-model-name");
    }
    let chat = json!({"model": "smol", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 16, "temperature": 0});
    let want = post(d, "/v1/chat/completions", &chat);
    let got = post(proxy, "/v1/chat/completions", &chat);
    assert_eq!(got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"]);

    // n > 1 (D58): three greedy choices, identical to the one-choice answer, on the node itself
    // and through the proxy (P prefills once with n = 1; D fans the decode leg out); usage
    // counts the prompt once and every choice's completion tokens.
    let body = json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0});
    let one = post(d, "/v1/completions", &body);
    let mut three = body.clone();
    three["n"] = json!(3);
    for port in [d, proxy] {
        let v = post(port, "/v1/completions", &three);
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3, "{v}");
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i, "{v}");
            assert_eq!(c["text"], one["choices"][0]["text"], "greedy choices are identical: {v}");
        }
        let per_choice = one["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap(), 3 * per_choice, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"], "{v}");
    }
    let mut streamed = three.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let text = client()
        .post(format!("http://127.0.0.1:{proxy}/v1/completions"))
        .json(&streamed)
        .send()
        .unwrap()
        .text()
        .unwrap();
    let mut texts = vec![String::new(); 3];
    let mut usage = Value::Null;
    for e in common::sse_events(&text).into_iter().filter(|e| e != "[DONE]") {
        let v: Value = serde_json::from_str(&e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            texts[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap_or(""));
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    assert!(texts.iter().all(|t| *t == one["choices"][0]["text"]), "streamed choices by index: {texts:?}");
    assert_eq!(usage["completion_tokens"].as_u64().unwrap(), 3 * one["usage"]["completion_tokens"].as_u64().unwrap());
    let mut chat2 = chat.clone();
    chat2["n"] = json!(2);
    let v = post(proxy, "/v1/chat/completions", &chat2);
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["choices"][1]["index"], 1);
    assert_eq!(v["choices"][1]["message"]["content"], want["choices"][0]["message"]["content"]);

    // P/D happened: P's connector-worker (base + 112, base from --port) served D's handshake.
    let p_base = 10_000 + (p % 50) * 400;
    assert!(metric(p_base + 112, "pdmesh_worker_kv_handshakes_served") >= 1.0, "D read from P");
    common::wait_for("P holds nothing once D has read", || {
        let v = kv(p);
        v["held_blocks"] == 0 && v["used_blocks"] == 0
    });
    common::wait_for("D's blocks are free", || kv(d)["used_blocks"] == 0);
    let state = run_dir.join(format!("mesh.serve-{p}.json"));
    assert!(state.is_file(), "each serve keeps its own process table: {}", state.display());
}

fn refused(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(common::pdmesh_bin())
        .args(args)
        .envs(env.iter().copied())
        .env_remove("PDMESH_MESH_SECRET")
        .env_remove("PDMESH_TOPOLOGY")
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A vLLM flag without a meaning here is refused by name with clap's usage status (2), under
/// either spelling; a P/D node started without the mesh secret is a configuration error (78)
/// that says which variable to set. Nothing is started.
#[test]
fn unsupported_flags_and_missing_secrets_are_refused_by_name() {
    let (code, err) = refused(&["serve", "/m.gguf", "--gpu-memory-utilization", "0.9"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--gpu-memory-utilization") && err.contains("not supported"), "{err}");
    let (code, err) = refused(&["serve", "/m.gguf", "--enforce_eager"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--enforce-eager") && err.contains("not supported"), "{err}");
    let (code, err) = refused(&["proxy", "--decoder-ports", "1", "--prefiller-ports", "2", "--timeout", "3"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--timeout") && err.contains("not supported"), "{err}");

    let Some(model) = model_path() else { return };
    let kv = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer"}"#;
    let (code, err) = refused(&["serve", &model, "--kv-transfer-config", kv], &[]);
    assert_eq!(code, 78, "{err}");
    assert!(err.contains("PDMESH_MESH_SECRET"), "{err}");
    let (code, err) = refused(
        &["serve", &model, "--kv-transfer-config", r#"{"kv_connector":"P2pNcclConnector","kv_role":"kv_producer"}"#],
        &[("PDMESH_MESH_SECRET", SECRET)],
    );
    assert_eq!(code, 78, "{err}");
    assert!(err.contains("\"P2pNcclConnector\" is not supported"), "{err}");
}
