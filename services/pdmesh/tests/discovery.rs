//! Upstreams by DNS (D61): a router that names its prefill and decode nodes by `host:port`
//! (`router.prefill_dns`, `router.decode_dns`, as a Kubernetes headless Service would be named)
//! instead of URLs. Here the names are `localhost:<port>`, which the system resolver answers
//! with the loopback address the nodes listen on: the router must discover one P and one D from
//! them (`pdmesh_router_upstreams{source="dns"}`), report itself ready, serve completions
//! (plain and streamed) through them, and count its picks under the resolved URL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{complete, pd_topology, wait_for, Mesh};

const SETTINGS: &str =
    "model = { kind = \"synthetic\", per_token_cost_us = 200 }\nengine = { block_size = 4, num_blocks = 256 }";

/// The P/D mesh of the other tests, without its colocated reference node, whose router finds P
/// and D by name, re-resolving every 200 ms.
fn topology(http: u16, base: u16) -> String {
    let text = pd_topology(http, base, "shm", 1, SETTINGS);
    let by_url = format!(
        "router = {{ prefill = [\"http://127.0.0.1:{}\"], decode = [\"http://127.0.0.1:{}\"] }}",
        http + 1,
        http + 2
    );
    let by_name = format!(
        "router = {{ prefill_dns = \"localhost:{}\", decode_dns = \"localhost:{}\", dns_refresh_ms = 200 }}",
        http + 1,
        http + 2
    );
    assert!(text.contains(&by_url), "the router line of pd_topology changed: {text}");
    let text = text.replace(&by_url, &by_name);
    let reference = text.find("[[nodes]]\nname = \"c\"").expect("pd_topology has a reference node");
    text[..reference].to_string()
}

/// The samples of `name` on a Prometheus page whose labels contain every one of `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{')))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
        + 0.0
}

#[test]
fn a_router_finds_p_and_d_by_dns_name_and_serves_through_them() {
    let mesh = Mesh::start_nodes(topology, |h| vec![h + 1, h + 2]);
    let (p, d) = (mesh.http_port + 1, mesh.http_port + 2);
    wait_for("the router is ready over its discovered upstreams", || {
        mesh.get(&mesh.url("/health")).is_ok_and(|r| r.status().is_success())
    });
    let health: serde_json::Value = mesh.get(&mesh.url("/health")).unwrap().json().unwrap();
    assert_eq!((health["prefill_upstreams"].as_u64(), health["decode_upstreams"].as_u64()), (Some(1), Some(1)));

    let url = mesh.url("/v1/completions");
    assert!(!complete(&url, "The capital of France is", false).is_empty());
    assert!(!complete(&url, "Once upon a time", true).is_empty());

    let page = mesh.get(&mesh.url("/metrics")).unwrap().text().unwrap();
    eprintln!("router health: {health}");
    for l in page.lines().filter(|l| l.starts_with("pdmesh_router_upstreams") || l.starts_with("pdmesh_router_picks")) {
        eprintln!("{l}");
    }
    for role in ["prefill", "decode"] {
        let discovered = metric(&page, "pdmesh_router_upstreams", &[&format!("role=\"{role}\""), "source=\"dns\""]);
        assert_eq!(discovered, 1.0, "{role} upstreams discovered by DNS:\n{page}");
        let configured = metric(&page, "pdmesh_router_upstreams", &[&format!("role=\"{role}\""), "source=\"static\""]);
        assert_eq!(configured, 0.0, "{role}: no URL was configured");
    }
    for (role, port) in [("prefill", p), ("decode", d)] {
        let upstream = format!("upstream=\"http://127.0.0.1:{port}\"");
        let picks = metric(&page, "pdmesh_router_picks_total", &[&format!("role=\"{role}\""), &upstream]);
        assert!(picks >= 2.0, "both requests went to the {role} node found by name ({picks} picks):\n{page}");
    }
    assert_eq!(metric(&page, "pdmesh_router_discovery_errors_total", &[]), 0.0, "{page}");
    assert!(mesh.stop().success());
}
