//! Authentication metrics, shared by every channel that authenticates (one registration).

use pdmesh_telemetry::metrics::{counter, counter_vec};
use prometheus::{IntCounter, IntCounterVec};
use std::sync::LazyLock;

/// Connections or messages refused because the peer had not (or could not) prove knowledge of
/// the mesh secret, by channel (`side_channel`, `tcp_data`, `internal`).
pub static UNAUTHENTICATED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "pdmesh_kv_side_channel_unauthenticated_total",
        "Messages or connections refused for want of mesh authentication, by channel",
        &["channel"],
    )
});

/// Leases, reads and notices refused because they carried the wrong capability token for a
/// held request (answered exactly like an unknown request).
pub static CAPABILITY_REFUSED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_kv_capability_refused_total",
        "Leases, reads, heartbeats and notices refused for a wrong capability token",
    )
});

/// Count a refusal on `channel`.
pub fn unauthenticated(channel: crate::Channel) {
    UNAUTHENTICATED.with_label_values(&[channel.label()]).inc();
}
