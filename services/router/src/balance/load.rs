//! What each node says of itself: its `GET /load`, polled every `router.load_poll_ms`
//! (readiness, queue depth, KV use, and what its prefix caches hold).

use super::*;

impl Pool {
    /// The outcome of one poll of node `i`: its load, or `None` when it did not answer.
    pub fn set_load(&self, i: usize, load: Option<NodeLoad>) {
        let outcome = if load.is_some() { "answered" } else { "failed" };
        LOAD_POLLS_TOTAL.with_label_values(&[self.role, outcome]).inc();
        self.with_state(i, |s| match load {
            Some(mut l) => {
                s.prefix = l.prefix.take().map(|p| PrefixIndex::from_summary(&p)).unwrap_or_default();
                s.load = Some(l);
                s.unreachable = false;
            }
            None => s.unreachable = true,
        });
    }
}

/// Poll every node of `pools` on `GET /load` every `period` until the task is dropped. A node
/// that answers 404 (a frontend without the endpoint) counts as ready with no load figures.
pub async fn poll_loads(
    pools: Vec<std::sync::Arc<Pool>>,
    client: reqwest::Client,
    authorization: Option<String>,
    period: Duration,
) {
    let timeout = period.max(Duration::from_millis(500));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let polls = pools.iter().flat_map(|pool| pool.nodes().into_iter().map(|u| (pool.clone(), u.id, u.url.clone())));
        let polls = polls.map(|(pool, i, url)| {
            let mut rb = client.get(format!("{url}{LOAD_PATH}")).timeout(timeout);
            if let Some(v) = &authorization {
                rb = rb.header(reqwest::header::AUTHORIZATION, v.as_str());
            }
            async move {
                let load = match rb.send().await {
                    Ok(r) if r.status().is_success() => r.json::<NodeLoad>().await.ok(),
                    Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
                        Some(NodeLoad { ready: true, ..Default::default() })
                    }
                    Ok(r) if r.status() == reqwest::StatusCode::UNAUTHORIZED => {
                        Some(NodeLoad { ready: true, ..Default::default() })
                    }
                    Ok(_) | Err(_) => None,
                };
                pool.set_load(i, load);
            }
        });
        futures::future::join_all(polls).await;
    }
}
