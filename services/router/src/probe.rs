//! Probes of slow and unmeasured decode nodes (D104).
//!
//! A decode node left out of the rotation as slow gets no user request, so the router learns
//! its speed another way: every `router.slow_probe_ms` it sends the node a probe of its own —
//! a greedy stream of [`PROBE_TOKENS`] tokens of a two-word prompt, asking for the tokens' ids
//! like a movable stream (`pdmesh_internal.stream_token_ids`) — and measures the gaps between
//! its tokens as it measures a live stream's. The median gap is the node's speed now
//! ([`Pool::probe_result`]): within `router.slow_ratio` / 1.5 of the fastest node in rotation,
//! the node is back; above, it stays out and is probed again. A node not measured yet (at start,
//! or one that joined by DNS) is probed once the same way, so a node that is slow from the
//! start is known before a user's stream runs there. A probe is one short request on a node
//! that has nothing else to do; on P it would hold blocks for a decode leg that never comes, so
//! prefill nodes are not probed.
//!
//! Why a probe and not the node's own step time on `/load`: an idle node runs no step, so its
//! report would say only how fast it was when it last had work; and a probe is measured in the
//! unit the router compares nodes in (the gap between two tokens as the router receives them),
//! with nothing to add to the engine's protocol.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use serde_json::json;

use super::balance::Pool;
use pdmesh_http_edge::headers::REQUEST_ID;
use pdmesh_protocol::node_http::TOKEN_IDS_COMMENT;

/// Tokens of one probe: enough gaps for a median that one late token does not move.
pub const PROBE_TOKENS: u32 = 8;
/// Longest a probe may take (a node slowed a hundredfold still answers 8 tokens in it).
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Probe `pool`'s nodes that are owed one ([`Pool::probes_due`]) every `period` until the task
/// is dropped; each probe runs on its own, so a slow node never delays another's.
pub async fn run(pool: Arc<Pool>, client: reqwest::Client, authorization: Option<String>, period: Duration) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !pool.probed() {
            return; // the nodes refused the probes: nothing more to do
        }
        for (id, url) in pool.probes_due() {
            let (pool, client, authorization) = (pool.clone(), client.clone(), authorization.clone());
            let request_id = format!("probe-{}", NEXT.fetch_add(1, Ordering::Relaxed));
            actix_web::rt::spawn(async move {
                let gap = match probe(&client, &url, &request_id, authorization.as_deref()).await {
                    Ok(gap) => Some(gap),
                    Err(Failed::Refused(status)) => {
                        pool.probes_refused(status);
                        None
                    }
                    Err(e) => {
                        tracing::debug!(upstream = %url, %request_id, error = %e, "probe got no usable answer");
                        None
                    }
                };
                let in_rotation = pool.probe_result(id, gap);
                tracing::debug!(upstream = %url, %request_id, gap_ms = gap.map(|g| g * 1e3), in_rotation, "probe");
            });
        }
    }
}

/// Why a probe measured nothing.
#[derive(Debug)]
enum Failed {
    /// 401 or 403: the node wants a credential the router does not have.
    Refused(u16),
    Other(String),
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::Refused(status) => write!(f, "refused with {status}"),
            Failed::Other(why) => f.write_str(why),
        }
    }
}

/// Send one probe to the node at `url` and return the median gap between its tokens, per
/// token, in seconds.
async fn probe(
    client: &reqwest::Client,
    url: &str,
    request_id: &str,
    authorization: Option<&str>,
) -> Result<f64, Failed> {
    let other = |e: String| Failed::Other(e);
    let mut body = json!({
        "prompt": "pdmesh probe",
        "max_tokens": PROBE_TOKENS,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    });
    body[pdmesh_protocol::node_http::INTERNAL_FIELD] =
        json!({(pdmesh_protocol::node_http::internal::STREAM_TOKEN_IDS): true});
    let mut rb = client.post(format!("{url}/v1/completions")).timeout(PROBE_TIMEOUT).header(REQUEST_ID, request_id);
    if let Some(v) = authorization {
        rb = rb.header(reqwest::header::AUTHORIZATION, v);
    }
    let mut res = rb.json(&body).send().await.map_err(|e| other(e.to_string()))?;
    let status = res.status().as_u16();
    if status == 401 || status == 403 {
        return Err(Failed::Refused(status));
    }
    if !res.status().is_success() {
        return Err(other(format!("answered {status}")));
    }
    let mut gaps = Gaps::default();
    let mut buf = BytesMut::new();
    while let Some(bytes) = res.chunk().await.map_err(|e| other(e.to_string()))? {
        buf.extend_from_slice(&bytes);
        while let Some(end) = super::migrate::first_event_end(&buf) {
            let event = buf.split_to(end);
            if gaps.event(&event, Instant::now()) {
                return gaps.median().ok_or_else(|| other("too few tokens to measure".into()));
            }
        }
    }
    gaps.median().ok_or_else(|| other("the stream ended before enough tokens".into()))
}

/// The per-token gaps of one probe stream.
#[derive(Debug, Default)]
struct Gaps {
    last: Option<Instant>,
    gaps: Vec<f64>,
}

impl Gaps {
    /// Note one event received at `at`; returns true at `[DONE]`. The first token's event is
    /// not a gap (it waited for the prefill).
    fn event(&mut self, event: &[u8], at: Instant) -> bool {
        let Ok(text) = std::str::from_utf8(event) else { return false };
        if text.lines().any(|l| l.strip_prefix("data:").is_some_and(|d| d.trim() == "[DONE]")) {
            return true;
        }
        let ids = text
            .strip_prefix(TOKEN_IDS_COMMENT)
            .and_then(|rest| serde_json::from_str::<Vec<u32>>(rest.lines().next().unwrap_or("").trim()).ok())
            .map_or(0, |ids| ids.len());
        if ids == 0 {
            return false;
        }
        if let Some(last) = self.last {
            self.gaps.push(at.saturating_duration_since(last).as_secs_f64() / ids as f64);
        }
        self.last = Some(at);
        false
    }

    /// The median gap, once there are at least two.
    fn median(&self) -> Option<f64> {
        if self.gaps.len() < 2 {
            return None;
        }
        let mut g = self.gaps.clone();
        g.sort_by(f64::total_cmp);
        Some(g[g.len() / 2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probes_gap_is_the_median_per_token_gap_after_the_first_token() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut g = Gaps::default();
        assert!(!g.event(b"data: {\"choices\":[]}\n\n", at(0)), "no ids: not a token");
        assert!(!g.event(b": pdmesh_token_ids [1]\ndata: {}\n\n", at(500)), "the first token waited for prefill");
        assert_eq!(g.median(), None);
        assert!(!g.event(b": pdmesh_token_ids [2]\ndata: {}\n\n", at(510)));
        assert!(!g.event(b": pdmesh_token_ids [3,4]\ndata: {}\n\n", at(530)), "two tokens in 20 ms: 10 each");
        assert!(!g.event(b": pdmesh_token_ids [5]\ndata: {}\n\n", at(630)), "one late token");
        assert!(!g.event(b": keep-alive\n\n", at(640)));
        assert!(g.event(b"data: [DONE]\n\n", at(650)));
        let median = g.median().unwrap();
        assert!((median - 0.010).abs() < 1e-9, "{median}: the late token does not move the median");
    }
}
