//! Transport metrics.

use pdmesh_telemetry::metrics::counter_vec;
use prometheus::IntCounterVec;
use std::sync::LazyLock;

/// Frames that could not be decoded, by endpoint.
pub(crate) static DECODE_ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec("pdmesh_transport_decode_errors_total", "Inbound frames that failed to decode", &["endpoint"])
});

/// Messages sent, by endpoint.
pub(crate) static SENT: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec("pdmesh_transport_messages_sent_total", "Messages sent", &["endpoint"]));

/// Messages received, by endpoint.
pub(crate) static RECEIVED: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec("pdmesh_transport_messages_received_total", "Messages received", &["endpoint"]));

/// Connect-side sockets that lost their peer and reconnected, by endpoint.
pub(crate) static RECONNECTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "pdmesh_transport_reconnects_total",
        "Connect-side sockets that lost their peer and reconnected",
        &["endpoint"],
    )
});

/// Sends that failed (peer unknown or gone), by endpoint.
pub(crate) static SEND_ERRORS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter_vec("pdmesh_transport_send_errors_total", "Sends that failed", &["endpoint"]));

/// Frames a sealed (`tcp://`) socket refused before decoding them, by endpoint and reason
/// (`unsealed`, `malformed`, `bad_tag`, `stale`, `replayed`; docs/SECURITY.md).
pub(crate) static REFUSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "pdmesh_transport_frames_refused_total",
        "Inbound frames refused by the per-frame MAC check of a sealed link, by reason",
        &["endpoint", "reason"],
    )
});
