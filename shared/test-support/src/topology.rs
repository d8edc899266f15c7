//! Typed topology builders: every topology a test, a load test or a scenario starts is a
//! [`Topology`] value built here and written with [`Topology::to_toml`], so a builder cannot
//! drift from the config schema (a renamed or removed key fails to compile, a default changed in
//! `pdmesh-config` is the builders' default too).
//!
//! The pieces: [`colocated`], [`prefill`], [`decode`] and [`router`] nodes, [`kv`] sections,
//! the chainable setters of [`NodeExt`] and [`KvExt`] (with [`NodeExt::with`] as the escape
//! hatch for any other field), and the named shapes the tests share: the P/D test shape
//! ([`pd`]), the scale-out shape ([`scaleout`]) and the one-node shape ([`one_node`]).

use std::path::Path;

pub use pdmesh_config::{
    EngineConfig, HoldMode, KvLoadFailurePolicy, KvRole, KvTransferConfig, LimitsConfig, ModelConfig, ModelKind,
    NodeConfig, NodeRole, RouterConfig, RoutingPolicy, SocketTransport, Topology, TransferBackendKind,
};

/// The schema's own defaults: a topology of one node named `n` (with `kv` as its
/// `kv_transfer` table, when given), read by `pdmesh-config`'s parser.
fn parsed_default(kv: Option<&str>) -> Topology {
    let kv = kv.map(|role| format!("kv_transfer = {{ kv_role = \"{role}\" }}\n")).unwrap_or_default();
    Topology::from_toml(&format!("[[nodes]]\nname = \"n\"\n{kv}"))
        .unwrap_or_else(|e| panic!("the schema's defaults do not parse: {e}"))
}

/// A node named `name` on `http_port` and `base_port` with `role`, every other setting at the
/// schema's default (no KV transfer, the synthetic model, ipc transport, 127.0.0.1).
pub fn node(name: &str, role: NodeRole, http_port: u16, base_port: u16) -> NodeConfig {
    let mut n = parsed_default(None).nodes.remove(0);
    n.name = name.to_string();
    n.role = role;
    n.http_port = http_port;
    n.base_port = base_port;
    n
}

/// A colocated node (prefill and decode, no KV transfer).
pub fn colocated(name: &str, http_port: u16, base_port: u16) -> NodeConfig {
    node(name, NodeRole::Colocated, http_port, base_port)
}

/// A prefill node; give it a producer's [`kv`] section with [`NodeExt::kv`].
pub fn prefill(name: &str, http_port: u16, base_port: u16) -> NodeConfig {
    node(name, NodeRole::Prefill, http_port, base_port)
}

/// A decode node; give it a consumer's [`kv`] section with [`NodeExt::kv`].
pub fn decode(name: &str, http_port: u16, base_port: u16) -> NodeConfig {
    node(name, NodeRole::Decode, http_port, base_port)
}

/// A router over the frontends at `prefill` and `decode` (URLs, see [`url`]).
pub fn router(name: &str, http_port: u16, base_port: u16, prefill: &[String], decode: &[String]) -> NodeConfig {
    let mut n = node(name, NodeRole::Router, http_port, base_port);
    n.router.prefill = prefill.to_vec();
    n.router.decode = decode.to_vec();
    n
}

/// `http://127.0.0.1:<port>`: a node's frontend as a router's upstream.
pub fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

/// A KV transfer section with `role` and every other setting at the schema's default
/// (`PdConnector`, shm, the default side-channel and data ports).
pub fn kv_defaults(role: KvRole) -> KvTransferConfig {
    let mut kv =
        parsed_default(Some("kv_both")).nodes.remove(0).kv_transfer.unwrap_or_else(|| panic!("no kv_transfer"));
    kv.kv_role = role;
    kv
}

/// A KV transfer section (`PdConnector`) with `role` and `backend`, its side channel on
/// `side_channel_port` and its block server (tcp) on `side_channel_port + 2`, every other
/// setting at the schema's default.
pub fn kv(role: KvRole, backend: TransferBackendKind, side_channel_port: u16) -> KvTransferConfig {
    let mut kv = kv_defaults(role);
    kv.backend = backend;
    kv.side_channel_port = side_channel_port;
    kv.data_port = side_channel_port + 2;
    kv
}

/// A topology of `nodes` (run dir: the schema's default; the launcher sets its own).
pub fn topology(nodes: impl IntoIterator<Item = NodeConfig>) -> Topology {
    let mut t = parsed_default(None);
    t.nodes = nodes.into_iter().collect();
    t
}

/// Chainable setters of a node.
pub trait NodeExt: Sized {
    /// The escape hatch: change any field.
    fn with(self, f: impl FnOnce(&mut NodeConfig)) -> Self;
    /// Engine ranks behind the node's dp-lb.
    fn dp_size(self, n: u32) -> Self {
        self.with(|c| c.dp_size = n)
    }
    /// The synthetic executor at `per_token_cost_us` of simulated compute per token.
    fn synthetic(self, per_token_cost_us: u64) -> Self {
        self.with(|c| {
            c.model.kind = ModelKind::Synthetic;
            c.model.per_token_cost_us = per_token_cost_us;
        })
    }
    /// A GGUF model at `path` (empty: `PDMESH_MODEL_PATH`, then the fetch cache).
    fn gguf(self, path: impl AsRef<Path>) -> Self {
        let path = path.as_ref().display().to_string();
        self.with(|c| {
            c.model.kind = ModelKind::Gguf;
            c.model.path = path;
        })
    }
    /// Change the model settings.
    fn model(self, f: impl FnOnce(&mut ModelConfig)) -> Self {
        self.with(|c| f(&mut c.model))
    }
    /// Change the engine settings.
    fn engine(self, f: impl FnOnce(&mut EngineConfig)) -> Self {
        self.with(|c| f(&mut c.engine))
    }
    /// The KV pool: blocks of `block_size` tokens, `num_blocks` of them.
    fn blocks(self, block_size: u32, num_blocks: u32) -> Self {
        self.engine(|e| {
            e.block_size = block_size;
            e.num_blocks = num_blocks;
        })
    }
    /// Change the queue bounds (`limits`).
    fn limits(self, f: impl FnOnce(&mut LimitsConfig)) -> Self {
        self.with(|c| f(&mut c.limits))
    }
    /// The KV transfer section.
    fn kv(self, kv: KvTransferConfig) -> Self {
        self.with(|c| c.kv_transfer = Some(kv))
    }
    /// Change the KV transfer section; panics when the node has none.
    fn kv_with(self, f: impl FnOnce(&mut KvTransferConfig)) -> Self {
        self.with(|c| {
            let name = c.name.clone();
            f(c.kv_transfer.as_mut().unwrap_or_else(|| panic!("node {name:?} has no kv_transfer")))
        })
    }
    /// The address the node's services (and its KV listeners) bind.
    fn bind_host(self, host: &str) -> Self {
        self.with(|c| c.bind_host = host.to_string())
    }
    /// The address the node's frontend binds.
    fn http_host(self, host: &str) -> Self {
        self.with(|c| c.http_host = host.to_string())
    }
    /// tcp links between the node's services (instead of ipc sockets).
    fn tcp_transport(self) -> Self {
        self.with(|c| c.transport = SocketTransport::Tcp)
    }
    /// Router: how it picks a node of each role.
    fn policy(self, policy: RoutingPolicy) -> Self {
        self.with(|c| c.router.policy = policy)
    }
    /// Change the router settings.
    fn router_with(self, f: impl FnOnce(&mut RouterConfig)) -> Self {
        self.with(|c| f(&mut c.router))
    }
}

impl NodeExt for NodeConfig {
    fn with(mut self, f: impl FnOnce(&mut NodeConfig)) -> Self {
        f(&mut self);
        self
    }
}

/// Chainable setters of a KV transfer section.
pub trait KvExt: Sized {
    /// The escape hatch: change any field.
    fn with(self, f: impl FnOnce(&mut KvTransferConfig)) -> Self;
    /// The address peers reach the side channel at.
    fn side_host(self, host: &str) -> Self {
        self.with(|k| k.side_channel_host = host.to_string())
    }
    /// The tcp backend's block-read port of rank 0.
    fn data_port(self, port: u16) -> Self {
        self.with(|k| k.data_port = port)
    }
    /// What D does when a load fails.
    fn failure_policy(self, policy: KvLoadFailurePolicy) -> Self {
        self.with(|k| k.kv_load_failure_policy = policy)
    }
    /// How P holds blocks for a reader.
    fn hold_mode(self, mode: HoldMode) -> Self {
        self.with(|k| k.hold_mode = mode)
    }
    /// The engine's identity for remote peers.
    fn engine_id(self, id: &str) -> Self {
        self.with(|k| k.engine_id = id.to_string())
    }
    /// The transfer agent's fault injection (`transfer_midway`, ...).
    fn fault(self, faults: &str) -> Self {
        self.with(|k| k.fault_injection = faults.to_string())
    }
}

impl KvExt for KvTransferConfig {
    fn with(mut self, f: impl FnOnce(&mut KvTransferConfig)) -> Self {
        f(&mut self);
        self
    }
}

/// Finding and changing nodes of a built topology.
pub trait TopologyExt: Sized {
    /// The node named `name`; panics when there is none.
    fn node_mut(&mut self, name: &str) -> &mut NodeConfig;
    /// Change the node named `name`.
    fn with_node(mut self, name: &str, f: impl FnOnce(&mut NodeConfig)) -> Self {
        f(self.node_mut(name));
        self
    }
    /// Change every node that runs engines (every node but routers).
    fn engine_nodes(self, f: impl FnMut(&mut NodeConfig)) -> Self;
    /// Change every node.
    fn all_nodes(self, f: impl FnMut(&mut NodeConfig)) -> Self;
    /// Add a node.
    fn push(self, node: NodeConfig) -> Self;
    /// Leave out the node named `name`.
    fn without(self, name: &str) -> Self;
    /// The TOML text `pdmesh up` reads, checked to read back (validation included).
    fn text(&self) -> String;
}

impl TopologyExt for Topology {
    fn node_mut(&mut self, name: &str) -> &mut NodeConfig {
        self.nodes.iter_mut().find(|n| n.name == name).unwrap_or_else(|| panic!("no node {name:?} in the topology"))
    }
    fn engine_nodes(mut self, mut f: impl FnMut(&mut NodeConfig)) -> Self {
        self.nodes.iter_mut().filter(|n| n.role != NodeRole::Router).for_each(&mut f);
        self
    }
    fn all_nodes(mut self, f: impl FnMut(&mut NodeConfig)) -> Self {
        self.nodes.iter_mut().for_each(f);
        self
    }
    fn push(mut self, node: NodeConfig) -> Self {
        self.nodes.push(node);
        self
    }
    fn without(mut self, name: &str) -> Self {
        self.nodes.retain(|n| n.name != name);
        self
    }
    fn text(&self) -> String {
        let text = self.to_toml().unwrap_or_else(|e| panic!("topology not writable: {e}"));
        if let Err(e) = Topology::from_toml(&text) {
            panic!("the built topology is invalid: {e}\n{text}");
        }
        text
    }
}

/// A side-channel port range of the P/D and scale-out shapes (8 ports), derived from the mesh's
/// first HTTP port (18000..19600, see [`crate::launcher::ports`]) and apart from the HTTP and
/// base ranges.
pub fn side_ports(http_port: u16) -> u16 {
    61000 + (http_port.wrapping_sub(18000).wrapping_mul(2)) % 4000
}

/// The P/D test shape, on HTTP ports `http..http+3` and base ports `base`, `base+20`, `base+40`,
/// `base+60`: a router `router` over P `p` (`http+1`) and D `d` (`http+2`, `d_ranks` ranks), and
/// a colocated reference node `c` (`http+3`). P and D share `backend`, D's load-failure policy
/// `fail` (see [`pd_with_policy`]) and the fixed hold; their side channels are
/// [`side_ports`]`(http)` (P) and `+4` (D), block servers 2 above. On `tcp`, P binds
/// 127.0.0.2 (its side channel there too) while D stays on 127.0.0.1, as a second host would
/// be. Settings shared by P, D and the reference go on with [`TopologyExt::engine_nodes`].
pub fn pd(http: u16, base: u16, backend: TransferBackendKind, d_ranks: u32) -> Topology {
    pd_with_policy(http, base, backend, d_ranks, KvLoadFailurePolicy::Fail)
}

/// [`pd`] with D's (and P's) `kv_load_failure_policy`.
pub fn pd_with_policy(
    http: u16,
    base: u16,
    backend: TransferBackendKind,
    d_ranks: u32,
    policy: KvLoadFailurePolicy,
) -> Topology {
    let side = side_ports(http);
    let (p, d, c) = (http + 1, http + 2, http + 3);
    let kv_of = |role, port| kv(role, backend, port).failure_policy(policy).hold_mode(HoldMode::Fixed);
    let mut p_node = prefill("p", p, base + 20).kv(kv_of(KvRole::KvProducer, side));
    if backend == TransferBackendKind::Tcp {
        p_node = p_node.bind_host("127.0.0.2").kv_with(|k| k.side_channel_host = "127.0.0.2".into());
    }
    topology([
        router("router", http, base, &[url(p)], &[url(d)]),
        p_node,
        decode("d", d, base + 40).dp_size(d_ranks).kv(kv_of(KvRole::KvConsumer, side + 4)),
        colocated("c", c, base + 60),
    ])
}

/// The HTTP ports of the scale-out shape of [`scaleout`].
#[derive(Debug, Clone, Copy)]
pub struct ScaleoutPorts {
    pub router: u16,
    pub p: [u16; 2],
    pub d: [u16; 2],
}

/// The scale-out shape on two port ranges `(h1, b1)` and `(h2, b2)` of
/// [`crate::launcher::reserve_ports`]: a router (`h1`) over two P (`p-a` on `h1+1`, `p-b` on
/// `h2`) and two D (`d-a` on `h1+2`, `d-b` on `h2+1`); tcp KV backend with each engine's
/// name as its `engine_id`, load failures recomputed, side channels from [`side_ports`] of
/// each range. Settings of every node (the router's too: its tokenizer comes from `model`) go
/// on with [`TopologyExt::all_nodes`], the router's with [`TopologyExt::with_node`].
pub fn scaleout((h1, b1): (u16, u16), (h2, b2): (u16, u16)) -> (Topology, ScaleoutPorts) {
    let (s1, s2) = (side_ports(h1), side_ports(h2));
    let ports = ScaleoutPorts { router: h1, p: [h1 + 1, h2], d: [h1 + 2, h2 + 1] };
    let engine = |name: &str, role: NodeRole, http: u16, base: u16, kv_role: KvRole, side: u16| {
        node(name, role, http, base).http_host("127.0.0.1").bind_host("127.0.0.1").kv(kv(
            kv_role,
            TransferBackendKind::Tcp,
            side,
        )
        .engine_id(name)
        .side_host("127.0.0.1")
        .failure_policy(KvLoadFailurePolicy::Recompute))
    };
    let t = topology([
        router("router", h1, b1, &[url(ports.p[0]), url(ports.p[1])], &[url(ports.d[0]), url(ports.d[1])]),
        engine("p-a", NodeRole::Prefill, ports.p[0], b1 + 20, KvRole::KvProducer, s1),
        engine("d-a", NodeRole::Decode, ports.d[0], b1 + 160, KvRole::KvConsumer, s1 + 4),
        engine("p-b", NodeRole::Prefill, ports.p[1], b2 + 20, KvRole::KvProducer, s2),
        engine("d-b", NodeRole::Decode, ports.d[1], b2 + 160, KvRole::KvConsumer, s2 + 4),
    ]);
    (t, ports)
}

/// The one-node shape: a colocated node `main` on `http` and `base`.
pub fn one_node(http: u16, base: u16) -> Topology {
    topology([colocated("main", http, base)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Written and read back through `pdmesh-config`.
    fn reparsed(t: &Topology) -> Topology {
        Topology::from_toml(&t.text()).unwrap()
    }

    fn named<'a>(t: &'a Topology, name: &str) -> &'a NodeConfig {
        t.nodes.iter().find(|n| n.name == name).unwrap()
    }

    #[test]
    fn a_built_topology_reads_back_with_the_roles_ports_and_kv_settings_asked_for() {
        let t = topology([
            router("r", 18100, 20100, &[url(18101)], &[url(18102)]).policy(RoutingPolicy::RoundRobin),
            prefill("p", 18101, 20120).synthetic(250).blocks(4, 512).kv(kv(
                KvRole::KvProducer,
                TransferBackendKind::Tcp,
                61010,
            )
            .side_host("127.0.0.2")
            .hold_mode(HoldMode::Fixed)
            .engine_id("p-engine")),
            decode("d", 18102, 20140).dp_size(2).bind_host("127.0.0.1").kv(kv(
                KvRole::KvConsumer,
                TransferBackendKind::Tcp,
                61014,
            )
            .failure_policy(KvLoadFailurePolicy::Recompute)),
            colocated("c", 18103, 20160).gguf("/models/x.gguf").engine(|e| e.max_model_len = 1024),
        ]);
        let back = reparsed(&t);
        let roles: Vec<_> = back.nodes.iter().map(|n| (n.name.as_str(), n.role, n.http_port, n.base_port)).collect();
        assert_eq!(
            roles,
            [
                ("r", NodeRole::Router, 18100, 20100),
                ("p", NodeRole::Prefill, 18101, 20120),
                ("d", NodeRole::Decode, 18102, 20140),
                ("c", NodeRole::Colocated, 18103, 20160)
            ]
        );
        let r = named(&back, "r");
        assert_eq!(r.router.policy, RoutingPolicy::RoundRobin);
        assert_eq!((r.router.prefill.as_slice(), r.router.decode.as_slice()), (&[url(18101)][..], &[url(18102)][..]));
        let p = named(&back, "p");
        assert_eq!((p.model.kind, p.model.per_token_cost_us), (ModelKind::Synthetic, 250));
        assert_eq!((p.engine.block_size, p.engine.num_blocks), (4, 512));
        let pk = p.kv_transfer.as_ref().unwrap();
        assert_eq!(
            (pk.kv_role, pk.backend, pk.hold_mode),
            (KvRole::KvProducer, TransferBackendKind::Tcp, HoldMode::Fixed)
        );
        assert_eq!((pk.side_channel_host.as_str(), pk.side_channel_port, pk.data_port), ("127.0.0.2", 61010, 61012));
        assert_eq!(pk.engine_id, "p-engine");
        let d = named(&back, "d");
        assert_eq!(d.dp_size, 2);
        let dk = d.kv_transfer.as_ref().unwrap();
        assert_eq!((dk.kv_role, dk.kv_load_failure_policy), (KvRole::KvConsumer, KvLoadFailurePolicy::Recompute));
        assert_eq!(dk.hold_mode, HoldMode::Lease, "the schema's default where none was asked for");
        let c = named(&back, "c");
        assert!(c.kv_transfer.is_none());
        assert_eq!(
            (c.model.kind, c.model.path.as_str(), c.engine.max_model_len),
            (ModelKind::Gguf, "/models/x.gguf", 1024)
        );
    }

    #[test]
    fn the_pd_shape_points_the_router_at_p_and_d_and_gives_them_their_kv_roles() {
        for backend in [TransferBackendKind::Shm, TransferBackendKind::Tcp] {
            let t = pd_with_policy(18040, 20800, backend, 2, KvLoadFailurePolicy::Recompute)
                .engine_nodes(|n| n.engine.block_size = 4);
            let back = reparsed(&t);
            let names: Vec<_> = back.nodes.iter().map(|n| n.name.as_str()).collect();
            assert_eq!(names, ["router", "p", "d", "c"]);
            let r = named(&back, "router");
            assert_eq!((r.role, r.http_port, r.base_port), (NodeRole::Router, 18040, 20800));
            assert_eq!(r.router.prefill, [url(18041)], "the router's P is P's port");
            assert_eq!(r.router.decode, [url(18042)], "the router's D is D's port");
            assert_eq!(r.engine.block_size, 16, "settings of the engine nodes leave the router alone");
            let (p, d, c) = (named(&back, "p"), named(&back, "d"), named(&back, "c"));
            assert_eq!((p.role, p.http_port, p.base_port), (NodeRole::Prefill, 18041, 20820));
            assert_eq!((d.role, d.http_port, d.base_port, d.dp_size), (NodeRole::Decode, 18042, 20840, 2));
            assert_eq!((c.role, c.http_port, c.base_port), (NodeRole::Colocated, 18043, 20860));
            assert!(c.kv_transfer.is_none(), "the reference node transfers nothing");
            assert!([p, d, c].iter().all(|n| n.engine.block_size == 4));
            let (pk, dk) = (p.kv_transfer.as_ref().unwrap(), d.kv_transfer.as_ref().unwrap());
            assert_eq!((pk.kv_role, dk.kv_role), (KvRole::KvProducer, KvRole::KvConsumer));
            let side = side_ports(18040);
            assert_eq!((pk.side_channel_port, pk.data_port), (side, side + 2));
            assert_eq!((dk.side_channel_port, dk.data_port), (side + 4, side + 6));
            for k in [pk, dk] {
                assert_eq!((k.backend, k.hold_mode), (backend, HoldMode::Fixed));
                assert_eq!(k.kv_load_failure_policy, KvLoadFailurePolicy::Recompute);
            }
            let p_host = if backend == TransferBackendKind::Tcp { "127.0.0.2" } else { "127.0.0.1" };
            assert_eq!((p.bind_host.as_str(), pk.side_channel_host.as_str()), (p_host, p_host));
            assert_eq!((d.bind_host.as_str(), dk.side_channel_host.as_str()), ("127.0.0.1", "127.0.0.1"));
        }
        let default_policy = pd(18040, 20800, TransferBackendKind::Shm, 1);
        assert_eq!(
            named(&default_policy, "d").kv_transfer.as_ref().unwrap().kv_load_failure_policy,
            KvLoadFailurePolicy::Fail
        );
    }

    #[test]
    fn the_scaleout_shape_has_two_of_each_role_on_their_own_ports() {
        let (t, ports) = scaleout((18080, 21000), (18084, 21320));
        let t = t
            .all_nodes(|n| n.model.per_token_cost_us = 200)
            .with_node("router", |n| n.router.policy = RoutingPolicy::RoundRobin);
        let back = reparsed(&t);
        let r = named(&back, "router");
        assert_eq!(r.http_port, ports.router);
        assert_eq!(r.router.prefill, [url(ports.p[0]), url(ports.p[1])]);
        assert_eq!(r.router.decode, [url(ports.d[0]), url(ports.d[1])]);
        assert_eq!(r.router.policy, RoutingPolicy::RoundRobin);
        for (name, role, port, kv_role) in [
            ("p-a", NodeRole::Prefill, ports.p[0], KvRole::KvProducer),
            ("p-b", NodeRole::Prefill, ports.p[1], KvRole::KvProducer),
            ("d-a", NodeRole::Decode, ports.d[0], KvRole::KvConsumer),
            ("d-b", NodeRole::Decode, ports.d[1], KvRole::KvConsumer),
        ] {
            let n = named(&back, name);
            let k = n.kv_transfer.as_ref().unwrap();
            assert_eq!((n.role, n.http_port, n.model.per_token_cost_us), (role, port, 200), "{name}");
            assert_eq!((k.kv_role, k.backend, k.engine_id.as_str()), (kv_role, TransferBackendKind::Tcp, name));
            assert_eq!(k.kv_load_failure_policy, KvLoadFailurePolicy::Recompute);
        }
        assert_eq!(ports.p, [18081, 18084]);
        assert_eq!(ports.d, [18082, 18085]);
    }

    #[test]
    fn a_topology_the_schema_refuses_is_not_written() {
        // two nodes on one HTTP port: `text` fails where `pdmesh up` would
        let t = topology([colocated("a", 18000, 20000), colocated("b", 18000, 20200)]);
        assert!(std::panic::catch_unwind(|| t.text()).is_err());
        let one = one_node(18000, 20000);
        assert_eq!(reparsed(&one).nodes[0].name, "main");
    }
}
