//! Host-memory KV offload (`OffloadConnector`, and `MultiConnector(PdConnector,
//! OffloadConnector)` on a P/D pair): a prompt is served, its blocks go back to the device
//! pool and are reused by other traffic, and a revisit loads the prompt's full blocks from the
//! CPU store instead of prefilling them. The synthetic executor derives every token from the KV
//! it reads, so identical greedy output proves the right bytes came back.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::topo::{self, KvRole, NodeConfig, TransferBackendKind::Shm};
use common::{complete, pd_engines, Mesh, TopologyExt};

/// Block size 4; a 40-token prompt has 9 loadable full blocks (36 tokens: the last prompt
/// token is always computed locally).
const PROMPT: &str = "offload me: the quick brown fox jumps ov";
const LOADABLE_TOKENS: f64 = 36.0;
/// Other traffic, none sharing the prompt's first block.
const OTHERS: [&str; 4] = [
    "another prompt that takes the same blocks",
    "yet another one, long enough to need many",
    "and a fourth request to churn the pool ok",
    "a fifth, so every block was reused once!",
];

fn metric(port: u16, name: &str) -> f64 {
    let text = reqwest::blocking::get(format!("http://127.0.0.1:{port}/metrics")).unwrap().text().unwrap();
    text.lines()
        .filter(|l| l.split([' ', '{']).next() == Some(name))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum::<f64>()
        + 0.0
}

#[test]
fn a_revisited_prompt_loads_from_the_offload_store_with_identical_output() {
    assert_eq!(PROMPT.len(), 40);
    let mesh = Mesh::start_one(|n| {
        let mut kv = topo::kv_defaults(KvRole::KvBoth);
        kv.kv_connector = "OffloadConnector".into();
        kv.offload.cpu_blocks = 64;
        n.kv_transfer = Some(kv);
        n.engine.block_size = 4;
        n.engine.num_blocks = 24;
        n.engine.max_model_len = 64;
        n.engine.max_num_seqs = 2;
    });
    let url = mesh.url("/v1/completions");
    let (scheduler, worker) = (mesh.base_port + 111, mesh.base_port + 112);

    let computed_before = metric(worker, "pdmesh_worker_tokens_computed_total");
    let first = complete(&url, PROMPT, false);
    let computed_first = metric(worker, "pdmesh_worker_tokens_computed_total") - computed_before;
    assert_eq!(metric(scheduler, "pdmesh_offload_hits_total"), 0.0, "nothing stored yet");
    // Other traffic takes the 24 device blocks over and over (no prefix cache on the device).
    let others: Vec<String> = OTHERS.iter().map(|p| complete(&url, p, false)).collect();
    assert!(metric(worker, "pdmesh_offload_saves_total") >= 5.0, "every finished prompt was saved");
    assert!(metric(worker, "pdmesh_offload_stored_blocks") >= 45.0);

    let computed_before = metric(worker, "pdmesh_worker_tokens_computed_total");
    let again = complete(&url, PROMPT, false);
    let computed_again = metric(worker, "pdmesh_worker_tokens_computed_total") - computed_before;
    assert_eq!(again, first, "loaded KV gives the same greedy output");
    assert_eq!(metric(scheduler, "pdmesh_offload_hits_total"), 1.0);
    assert_eq!(metric(scheduler, "pdmesh_offload_hit_tokens_total"), LOADABLE_TOKENS);
    assert_eq!(metric(worker, "pdmesh_offload_loaded_blocks_total"), LOADABLE_TOKENS / 4.0);
    assert_eq!(computed_first - computed_again, LOADABLE_TOKENS, "the loaded tokens were not prefilled again");
    assert_eq!(metric(worker, "pdmesh_offload_load_failures_total"), 0.0);
    // the other prompts still answer as before (their stored blocks load just as well)
    for (p, expected) in OTHERS.iter().zip(&others) {
        assert_eq!(&complete(&url, p, true), expected, "{p}");
    }
    assert_eq!(metric(scheduler, "pdmesh_offload_hits_total"), 5.0);
    // Saves held the blocks only until the copy: nothing stays held.
    mesh.wait_kv("every block free", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"));
}

/// P runs `MultiConnector(PdConnector, OffloadConnector)`: a finished prefill is both held
/// for D and saved, and its blocks are freed only after both (the worker reports
/// `finished_sending` once, after the last child). A revisit loads on P from the store; D
/// reads the result from P as usual; the output equals the colocated reference.
#[test]
fn p_with_multi_connector_frees_after_both_children_and_revisits_load_from_the_store() {
    let loaded = check_multi_pd(None);
    assert_eq!(loaded, LOADABLE_TOKENS / 4.0, "one byte per token: 9 full blocks before the last token");
}

/// The same with the real model (SmolLM2 GGUF): loaded blocks give the colocated node's
/// greedy text.
#[test]
fn real_model_p_with_multi_connector_loads_revisits_from_the_store() {
    if std::env::var("PDMESH_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("PDMESH_SKIP_MODEL_TESTS=1: skipping");
        return;
    }
    let path = pdmesh_model::default_model_path();
    assert!(path.is_file(), "model {} missing: run scripts/fetch-model.sh", path.display());
    assert!(check_multi_pd(Some(&path)) >= 1.0, "at least one full block loaded");
}

/// Returns the blocks P loaded from its store for the revisit. P, D and the reference: the
/// synthetic model, or the real one at `model`; 48 blocks of 4 tokens, no prefix cache.
fn check_multi_pd(model: Option<&std::path::Path>) -> f64 {
    let settings = |n: &mut NodeConfig| {
        if let Some(path) = model {
            n.model.kind = topo::ModelKind::Gguf;
            n.model.path = path.display().to_string();
        }
        n.engine.block_size = 4;
        n.engine.num_blocks = 48;
        n.engine.max_model_len = 64;
        n.engine.enable_prefix_caching = false;
    };
    let topology = move |http: u16, base: u16| {
        common::pd_topology(http, base, Shm, 1, settings).with_node("p", |p| {
            let kv = p.kv_transfer.as_mut().unwrap();
            kv.kv_connector = "MultiConnector".into();
            kv.kv_connector_children = vec!["PdConnector".into(), "OffloadConnector".into()];
            kv.offload.cpu_blocks = 64;
        })
    };
    let mesh = Mesh::start_nodes(topology, pd_engines);
    let router = mesh.url("/v1/completions");
    let colocated = mesh.url_on(mesh.http_port + 3, "/v1/completions");
    let p_base = mesh.base_port + 20;
    let (p_scheduler, p_worker) = (p_base + 111, p_base + 112);

    let expected = complete(&colocated, PROMPT, false);
    assert_eq!(complete(&router, PROMPT, false), expected);
    for p in OTHERS {
        assert_eq!(complete(&router, p, false), complete(&colocated, p, false), "{p}");
    }
    let p = mesh.http_port + 1;
    mesh.wait_kv_on(p, "P frees once D read and the store copied", |kv| kv["held_blocks"] == 0);
    assert!(
        metric(p_worker, "pdmesh_worker_multi_held_sends_total") >= 5.0,
        "each request's first finished_sending (the save) was held back for the P/D child"
    );
    assert_eq!(complete(&router, PROMPT, true), expected, "streamed revisit");
    assert_eq!(metric(p_scheduler, "pdmesh_offload_hits_total"), 1.0);
    assert_eq!(metric(p_worker, "pdmesh_offload_load_failures_total"), 0.0);
    mesh.wait_kv_on(p, "P holds nothing", |kv| kv["held_blocks"] == 0 && kv["used_blocks"] == 0);
    mesh.wait_kv_on(mesh.http_port + 2, "D's blocks are free", |kv| kv["used_blocks"] == 0);
    assert!(!mesh.logs().contains("panicked"));
    metric(p_worker, "pdmesh_offload_loaded_blocks_total")
}
