//! Nodes found by DNS (D61): [`discover`] re-resolves a role's name every
//! `router.dns_refresh_ms` and [`Pool::sync_discovered`] applies the difference; a node that
//! left keeps its id (and its requests finish on it), one that comes back gets its id again.

use super::*;

impl Pool {
    /// Make the DNS-discovered part of the pool `urls` (what the name resolves to now); the
    /// static part stays. A node that is no longer listed gets no new request, and its
    /// requests in flight finish on it (they hold it); a new node starts unproven, like a
    /// configured one: no latency, no load until its first `/load` poll.
    pub fn sync_discovered(&self, urls: &[String]) -> Diff {
        let current = self.nodes();
        let wanted: Vec<&str> = urls.iter().map(|u| u.trim_end_matches('/')).collect();
        let mut diff = Diff::default();
        let mut next: Vec<Arc<Upstream>> = Vec::with_capacity(current.len() + wanted.len());
        for u in &current {
            let keep = u.source == Source::Static || wanted.contains(&u.url.as_str());
            if keep {
                next.push(u.clone());
            } else {
                diff.removed.push(u.url.clone());
            }
        }
        for url in wanted {
            if !next.iter().any(|u| u.url == url) {
                next.push(self.make_node(url, Source::Dns));
                diff.added.push(url.to_string());
            }
        }
        if diff != Diff::default() {
            self.replace_nodes(next);
            for url in &diff.removed {
                // Not ejected any more, just gone; the counters keep their history.
                let _ = EJECTED_GAUGE.remove_label_values(&[self.role, url]);
                let _ = SLOW_GAUGE.remove_label_values(&[self.role, url]);
            }
        }
        diff
    }
}

/// The upstream URLs `name` (`host:port`, e.g. a headless Service's name) resolves to now:
/// `http://addr:port` per A/AAAA record, sorted, without duplicates.
pub async fn resolve(name: &str, timeout: Duration) -> Result<Vec<String>, String> {
    let found = tokio::time::timeout(timeout, tokio::net::lookup_host(name))
        .await
        .map_err(|_| format!("no answer within {} ms", timeout.as_millis()))?
        .map_err(|e| e.to_string())?;
    let mut addrs: Vec<std::net::SocketAddr> = found.collect();
    addrs.sort();
    addrs.dedup();
    Ok(addrs.into_iter().map(|a| format!("http://{a}")).collect())
}

/// Keep `pool`'s discovered part equal to what `name` resolves to, re-resolving every
/// `period` until the task is dropped. A failed lookup keeps the set as it was (a DNS hiccup
/// must not empty the pool; nodes that are really gone fail their `/load` polls and calls,
/// which keeps them out of the rotation).
pub async fn discover(pool: std::sync::Arc<Pool>, name: String, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = period.max(Duration::from_secs(1));
    loop {
        tick.tick().await;
        match resolve(&name, timeout).await {
            Ok(urls) => {
                let diff = pool.sync_discovered(&urls);
                if !diff.added.is_empty() || !diff.removed.is_empty() {
                    tracing::info!(role = pool.role, dns = %name, added = ?diff.added, removed = ?diff.removed,
                        upstreams = pool.len(), "upstream set changed");
                }
            }
            Err(e) => {
                DISCOVERY_ERRORS_TOTAL.with_label_values(&[pool.role]).inc();
                tracing::warn!(role = pool.role, dns = %name, error = %e, "upstream name did not resolve; keeping the current set");
            }
        }
    }
}
