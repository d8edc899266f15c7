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

/// Side channel frames P could not decode (not an envelope of this protocol): counted, and
/// logged at most once a second (D99).
pub static UNDECODABLE_FRAMES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_kv_side_channel_undecodable_frames_total",
        "Side channel frames dropped because they did not decode",
    )
});

/// Side channel connections P dropped: over their allowance before the handshake, evicted for
/// a newcomer, expired, refused their proof, or not reading their answers (D95, D96).
pub static SIDE_CHANNEL_PEERS_DROPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "pdmesh_kv_side_channel_peers_dropped_total",
        "Side channel connections dropped by P (pre-handshake allowance, eviction, expiry, failed proof, not reading)",
    )
});

/// Count a refusal on `channel`.
pub fn unauthenticated(channel: crate::Channel) {
    UNAUTHENTICATED.with_label_values(&[channel.label()]).inc();
}
