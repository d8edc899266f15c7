//! Cache-aware routing (D59) on the scale-out shape: a router over 2 P and 2 D nodes
//! (synthetic executor, prefix caching on, blocks of 4 tokens). Three multi-turn conversations
//! run interleaved, one request at a time; each turn's prompt is the previous turn's prompt,
//! its answer and a new question.
//!
//! With `policy = "cache_aware"` every follow-up turn lands on the P and the D that hold its
//! conversation: the prefix-cache hits of the four engines grow, on each follow-up, by at least
//! the previous turn's full blocks on P and on D. With `round_robin` (three conversations over
//! two nodes, so a conversation changes node every turn) the hits are clearly lower. Greedy
//! answers are the same under both policies.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::topo::{NodeConfig, RoutingPolicy};
use common::{metric, reserve_ports, start_scaleout, topo, TopologyExt};

const BLOCK: u64 = 4;
/// Every node: the synthetic model at 200 µs a token, blocks of 4 tokens.
fn settings(n: &mut NodeConfig) {
    n.model.per_token_cost_us = 200;
    n.engine.block_size = 4;
    n.engine.num_blocks = 1024;
}
const CONVERSATIONS: usize = 3;
const TURNS: usize = 4;

/// Prefix-cache hit tokens of the P engines and of the D engines.
fn hits(p_bases: [u16; 2], d_bases: [u16; 2]) -> (f64, f64) {
    let sum = |bases: [u16; 2]| {
        bases.iter().map(|b| metric(b + 110, "pdmesh_engine_prefix_cache_hits_total", "")).sum::<f64>()
    };
    (sum(p_bases), sum(d_bases))
}

/// What one policy gave: every answer, and per follow-up turn whether P and D hit at least the
/// previous prompt's full blocks; the total hits on P and D.
struct Outcome {
    answers: Vec<String>,
    followups_on_holders: usize,
    hits: (f64, f64),
}

fn run(policy: RoutingPolicy) -> Outcome {
    let (r1, r2) = (reserve_ports(), reserve_ports());
    let run_dir = common::failover::fresh_run_dir("pdmesh-cacheroute", r1.0);
    let (t, ports) = topo::scaleout(r1, r2);
    let t = t.all_nodes(settings).with_node("router", |n| {
        n.router.policy = policy;
        n.router.load_poll_ms = 50;
    });
    let ready: Vec<u16> = ports.p.iter().chain(&ports.d).copied().collect();
    let mesh = start_scaleout(&run_dir, t, ports.router, r1.1, &ready);
    let (p_bases, d_bases) = ([r1.1 + 20, r2.1 + 20], [r1.1 + 160, r2.1 + 160]);
    let url = format!("http://127.0.0.1:{}/v1/completions", ports.router);
    let mut prompts: Vec<String> =
        (0..CONVERSATIONS).map(|c| format!("conversation {c} opens with its own long preamble, number {c}.")).collect();
    let mut outcome = Outcome { answers: Vec::new(), followups_on_holders: 0, hits: (0.0, 0.0) };
    let mut previous = [0u64; CONVERSATIONS];
    for turn in 0..TURNS {
        for (c, prompt) in prompts.iter_mut().enumerate() {
            prompt.push_str(&format!(" Question {turn} of {c}?"));
            let before = hits(p_bases, d_bases);
            let answer = common::complete(&url, prompt, false);
            let after = hits(p_bases, d_bases);
            if turn > 0 {
                // the previous turn's prompt, its full blocks but the last (one token a byte)
                let held = (previous[c] / BLOCK).saturating_sub(1) * BLOCK;
                let (p_hit, d_hit) = (after.0 - before.0, after.1 - before.1);
                eprintln!("{policy:?}: conversation {c} turn {turn}: {held} held, P hit {p_hit}, D hit {d_hit}");
                outcome.followups_on_holders += usize::from(p_hit >= held as f64 && d_hit >= held as f64);
            }
            previous[c] = prompt.len() as u64;
            prompt.push_str(&answer);
            outcome.answers.push(answer);
        }
        // the router's next /load poll publishes what this turn cached
        std::thread::sleep(Duration::from_millis(500));
    }
    outcome.hits = hits(p_bases, d_bases);
    let picks = metric(ports.router, "pdmesh_router_cache_aware_picks_total", "reason=\"overlap\"");
    eprintln!(
        "{policy:?}: {} of {} follow-ups on the holders, hits P {} D {}, overlap picks {picks}",
        outcome.followups_on_holders,
        CONVERSATIONS * (TURNS - 1),
        outcome.hits.0,
        outcome.hits.1
    );
    assert!(!mesh.logs().contains("panicked"));
    drop(mesh);
    let _ = std::fs::remove_dir_all(&run_dir);
    outcome
}

/// The two tests of this binary run one after the other: each starts a five-node mesh, and
/// cache-aware routing weighs each node's measured latency, which the other mesh's load on two
/// cores would skew (a follow-up sent to the node not holding its prefix because the holder
/// looked slow: a flake seen once beside the other test, never alone).
static ONE_MESH_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn cache_aware_sends_each_follow_up_to_the_nodes_holding_its_prefix() {
    let _alone = ONE_MESH_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let aware = run(RoutingPolicy::CacheAware);
    let rr = run(RoutingPolicy::RoundRobin);
    assert_eq!(aware.answers, rr.answers, "greedy answers do not depend on the route");
    assert_eq!(aware.followups_on_holders, CONVERSATIONS * (TURNS - 1), "every follow-up hit its prefix on P and D");
    assert!(rr.followups_on_holders < CONVERSATIONS * (TURNS - 1), "round-robin moves conversations");
    assert!(rr.hits.0 < 0.8 * aware.hits.0, "P hits: round-robin {} vs cache-aware {}", rr.hits.0, aware.hits.0);
    assert!(rr.hits.1 < 0.8 * aware.hits.1, "D hits: round-robin {} vs cache-aware {}", rr.hits.1, aware.hits.1);
}

/// The sum of `name` over the engines whose node base ports are `bases`.
fn engines(bases: [u16; 2], name: &str) -> f64 {
    bases.iter().map(|b| metric(b + 110, name, "")).sum()
}

/// Conditional disaggregation (D69, `local_prefill_max_tokens`): a prompt the chosen decode node
/// already holds all but a few tokens of is prefilled there, without asking P; a prompt with
/// more new tokens than that still goes through P. The answers are the same either way, and P
/// ends holding nothing.
#[test]
fn a_prompt_the_decode_node_holds_skips_the_prefill_node() {
    let _alone = ONE_MESH_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (r1, r2) = (reserve_ports(), reserve_ports());
    let run_dir = common::failover::fresh_run_dir("pdmesh-localprefill", r1.0);
    let (t, ports) = topo::scaleout(r1, r2);
    let t = t.all_nodes(settings).with_node("router", |n| {
        n.router.policy = RoutingPolicy::CacheAware;
        n.router.load_poll_ms = 50;
        n.router.local_prefill_max_tokens = 8;
    });
    let ready: Vec<u16> = ports.p.iter().chain(&ports.d).copied().collect();
    let mesh = start_scaleout(&run_dir, t, ports.router, r1.1, &ready);
    let (p_bases, d_bases) = ([r1.1 + 20, r2.1 + 20], [r1.1 + 160, r2.1 + 160]);
    let url = format!("http://127.0.0.1:{}/v1/completions", ports.router);
    let placed = |placement: &str| {
        metric(ports.router, "pdmesh_router_prefill_placement_total", &format!("placement=\"{placement}\""))
    };
    let p_requests = || engines(p_bases, "pdmesh_engine_requests_finished_total");
    // Until the router's polls of both decode nodes after `since` answered, it routes on an
    // older view of their caches.
    let decode_polls =
        || metric(ports.router, "pdmesh_router_load_polls_total", "outcome=\"answered\",role=\"decode\"");
    let wait_for_decode_polls = |since: f64| {
        common::wait_for("two more polls of the decode nodes", || decode_polls() >= since + 4.0);
    };

    // 1. A new prompt (one token a byte): nothing of it is cached anywhere: P.
    let prompt = "a prompt nobody has sent before, long enough to fill a dozen blocks.";
    let first = common::complete(&url, prompt, false);
    assert_eq!((placed("remote"), placed("local")), (1.0, 0.0));
    common::wait_for("P prefilled the new prompt", || p_requests() == 1.0);

    // 2. The same prompt once the router has seen the decode node cache it: D holds every full
    // block, so less than a block (4 tokens) is left to compute: D prefills it, P is not asked.
    let published = || {
        ports
            .d
            .iter()
            .any(|&d| common::failover::load_of(d)["prefix"]["blocks"].as_array().is_some_and(|b| !b.is_empty()))
    };
    common::wait_for("the decode node publishes the prompt's blocks", published);
    wait_for_decode_polls(decode_polls());
    let hits_before = engines(d_bases, "pdmesh_engine_prefix_cache_hits_total");
    let again = common::complete(&url, prompt, false);
    let streamed = common::complete(&url, prompt, true);
    assert_eq!((placed("remote"), placed("local")), (1.0, 2.0));
    assert_eq!(p_requests(), 1.0, "P was not asked again");
    assert_eq!(again, first, "the local prefill answers as P/D did");
    assert_eq!(streamed, first, "and so does its stream");
    let hits = engines(d_bases, "pdmesh_engine_prefix_cache_hits_total") - hits_before;
    let held = ((prompt.len() as f64 - 1.0) / BLOCK as f64).floor() * BLOCK as f64;
    assert!(hits >= 2.0 * held, "D computed only the tail of each prompt ({hits} tokens hit, {held} held)");

    // 2b. A chat request: the router renders and tokenises it for the decision and sends the
    // ids (D72); P or D takes them instead of rendering again. The answer is the one a node
    // gives rendering the messages itself (each decode node's own port, no router).
    let chat = |port: u16, text: &str| {
        let body = serde_json::json!({"messages": [{"role": "user", "content": text}], "max_tokens": 12,
                                      "temperature": 0});
        let r = reqwest::blocking::Client::new()
            .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .json(&body)
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "chat on port {port}");
        let v: serde_json::Value = r.json().unwrap();
        v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string()
    };
    let tokenised_before = metric(ports.router, "pdmesh_router_prompt_tokenize_seconds_count", "");
    let routed = chat(ports.router, prompt);
    assert_eq!(metric(ports.router, "pdmesh_router_prompt_tokenize_seconds_count", ""), tokenised_before + 1.0);
    for &d in &ports.d {
        assert_eq!(chat(d, prompt), routed, "decode node on port {d} rendering the chat itself");
    }
    let (remote, local) = (placed("remote"), placed("local"));
    assert_eq!(remote + local, 4.0, "the chat request was placed too");

    // 3. The prompt followed by more new tokens than the threshold: through P again.
    let longer = format!("{prompt} And then it goes on for a while with words not seen before.");
    let answer = common::complete(&url, &longer, false);
    assert!(!answer.is_empty());
    assert_eq!((placed("remote"), placed("local")), (remote + 1.0, local));
    common::wait_for("P prefilled the new part", || p_requests() == remote + 1.0);

    // Nothing is left held on P.
    common::wait_for("P's holds released", || engines(p_bases, "pdmesh_engine_kv_held_blocks") == 0.0);
    assert!(!mesh.logs().contains("panicked"));
    drop(mesh);
    let _ = std::fs::remove_dir_all(&run_dir);
}
