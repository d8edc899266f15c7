//! A node's internal links over `transport = "tcp"` carry a MAC on every frame under a key
//! derived from the mesh secret (docs/SECURITY.md, docs/DECISIONS.md D45). Installed once per
//! process, before its service opens a socket.

use pdmesh_config::{NodeRole, SocketTransport, Topology};
use pdmesh_mesh_auth::{LinkKey, MeshSecret, MESH_SECRET_ENV};

use crate::Misconfigured;

/// Seal this process's `tcp://` links when its node runs on tcp transport. A node on tcp
/// without a mesh secret is a configuration error: its ports would serve anyone who reaches
/// them. A router node has no internal links; an `ipc` node's are Unix sockets in `run_dir`.
pub fn seal_internal_links(topo: &Topology, node: &str) -> anyhow::Result<()> {
    let node = topo.node(node)?;
    if node.transport != SocketTransport::Tcp || node.role == NodeRole::Router {
        return Ok(());
    }
    let secret = MeshSecret::resolve(topo.mesh_secret_file.as_deref())
        .map_err(|e| anyhow::Error::from(e).context(Misconfigured("reading the mesh secret".into())))?
        .ok_or_else(|| {
            anyhow::Error::msg(Misconfigured(format!(
                "node {:?} runs its internal links over tcp, which needs a mesh secret: set {MESH_SECRET_ENV} \
                 (e.g. `openssl rand -hex 32`, the same for every service of the mesh) or the topology's \
                 mesh_secret_file",
                node.name
            )))
        })?;
    pdmesh_transport::seal_tcp_links(LinkKey::derive(&secret, &node.name))?;
    tracing::info!(node = %node.name, "internal tcp links are sealed with the mesh secret");
    Ok(())
}
