//! Slow nodes (D55, D104): the latency the router observes per node, leaving a much slower
//! node out of the rotation, probes that bring it back, and the references a stream's speed is
//! judged against when it may move.

use super::*;

impl Pool {
    /// One latency sample (seconds) of node `i`.
    pub fn observe_latency(&self, i: usize, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        self.with_state(i, |s| {
            s.latency = Some(match s.latency {
                Some(l) if seconds < l => l + EWMA_ALPHA * (seconds - l),
                _ => seconds,
            });
            s.latency_at = Some(Instant::now());
            s.speed = Some(s.speed.map_or(seconds, |v| v + SPEED_ALPHA * (seconds - v)));
            s.speed_samples = s.speed_samples.saturating_add(1);
        });
        if self.probed() {
            self.reassess();
        }
    }

    /// What a probe of node `i` measured: the median gap between its tokens (seconds), or
    /// `None` when the probe got no usable answer. The measurement replaces what the router
    /// knew of the node's speed (it is the node as it is now); a left-out node whose probe is
    /// within `slow_ratio` of the fastest other node is back in rotation. Returns whether the
    /// node is in rotation now (within `slow_ratio` / `RECOVERY_MARGIN` for a left-out node).
    pub fn probe_result(&self, i: usize, gap: Option<f64>) -> bool {
        let Some(u) = self.node(i) else { return false };
        let Some(gap) = gap.filter(|g| g.is_finite() && *g >= 0.0) else {
            u.lock().probing = false;
            PROBES_TOTAL.with_label_values(&[self.role, "failed"]).inc();
            return !u.lock().left_out;
        };
        let reference = self.reference(i, Reference::Fastest);
        let back = {
            let mut s = u.lock();
            s.probing = false;
            s.latency = Some(gap);
            s.latency_at = Some(Instant::now());
            s.speed = Some(gap);
            s.speed_samples = MIN_SPEED_SAMPLES;
            let recovered = (self.slow_ratio / RECOVERY_MARGIN).max(1.0);
            let fast = reference.is_none_or(|r| gap <= recovered * r);
            let back = s.left_out && fast;
            if back {
                s.left_out = false;
            }
            back
        };
        if back {
            SLOW_GAUGE.with_label_values(&[self.role, &u.url]).set(0);
            tracing::info!(role = self.role, upstream = %u.url, probe_gap_ms = gap * 1e3,
                fastest_ms = reference.map(|r| r * 1e3), "probe: the slow upstream is fast again; back in rotation");
        }
        self.reassess();
        let in_rotation = !u.lock().left_out;
        PROBES_TOTAL.with_label_values(&[self.role, if in_rotation { "fast" } else { "slow" }]).inc();
        in_rotation
    }

    /// Leave node `i` out of the rotation as slow (a stream on it was found slow, D104) while
    /// another node is in rotation; only a probe brings it back. Returns whether it is out.
    pub fn leave_out(&self, i: usize, why: &str) -> bool {
        if !self.probed() {
            return false;
        }
        let others = self.nodes().iter().any(|u| u.id != i && !u.lock().left_out);
        if !others {
            return false;
        }
        let Some(u) = self.node(i) else { return false };
        self.mark_left_out(&u, why);
        true
    }

    fn mark_left_out(&self, u: &Upstream, why: &str) {
        let newly = {
            let mut s = u.lock();
            let newly = !s.left_out;
            s.left_out = true;
            newly
        };
        if newly {
            SLOW_GAUGE.with_label_values(&[self.role, &u.url]).set(1);
            LEFT_OUT_TOTAL.with_label_values(&[self.role, &u.url]).inc();
            tracing::warn!(role = self.role, upstream = %u.url, reason = why,
                "upstream left out of the rotation as slow; probes decide when it is back");
        }
    }

    /// Leave out every node whose smoothed latency is above `slow_ratio` × the fastest other
    /// node in rotation, the slowest first (so two slow nodes are not each other's reference),
    /// never the last node in rotation.
    fn reassess(&self) {
        if !self.probed() {
            return;
        }
        let nodes = self.nodes();
        let mut judged: Vec<(Arc<Upstream>, f64)> = nodes
            .iter()
            .filter_map(|u| {
                let s = u.lock();
                let speed = s.speed.filter(|_| !s.left_out && s.speed_samples >= MIN_SPEED_SAMPLES)?;
                Some((u.clone(), speed))
            })
            .collect();
        judged.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (k, (u, speed)) in judged.iter().enumerate() {
            // The fastest of the nodes still in rotation after this one (sorted slowest first).
            let Some(fastest) = judged[k + 1..].iter().map(|(_, v)| *v).reduce(f64::min) else { break };
            if *speed > self.slow_ratio * fastest {
                self.mark_left_out(u, "slower than the other nodes");
            }
        }
    }

    /// What node `i`'s latency is compared with: the other nodes in rotation that have a
    /// smoothed latency, `Fastest` (leave-out and probes) or their `Median` (a slow stream,
    /// D104). `None` when no other node is measured.
    pub fn reference(&self, i: usize, how: Reference) -> Option<f64> {
        let mut others: Vec<f64> = self
            .nodes()
            .iter()
            .filter(|u| u.id != i)
            .filter_map(|u| {
                let s = u.lock();
                s.speed.filter(|_| !s.left_out)
            })
            .collect();
        if others.is_empty() {
            return None;
        }
        others.sort_by(f64::total_cmp);
        Some(match how {
            Reference::Fastest => others[0],
            Reference::Median => {
                let n = others.len();
                if n % 2 == 1 {
                    others[n / 2]
                } else {
                    (others[n / 2 - 1] + others[n / 2]) / 2.0
                }
            }
        })
    }

    /// Whether a node other than `i` could take a request now (in rotation, not ejected,
    /// ready): a slow stream on `i` only moves if one can.
    pub fn has_alternative(&self, i: usize) -> bool {
        let now = Instant::now();
        self.nodes().iter().any(|u| u.id != i && Self::eligible(u, now))
    }

    /// The nodes a probe is owed now (D104): left out as slow, or never measured; not already
    /// being probed, and answering their `/load` polls (an ejected or unreachable node is the
    /// breaker's). Each returned node is marked as being probed until its
    /// [`Pool::probe_result`].
    pub fn probes_due(&self) -> Vec<(usize, String)> {
        if !self.probed() {
            return Vec::new();
        }
        let now = Instant::now();
        self.nodes()
            .iter()
            .filter_map(|u| {
                let mut s = u.lock();
                let ejected = s.ejected_until.is_some_and(|t| now < t);
                let ready = !s.unreachable && s.load.as_ref().is_none_or(|l| l.ready);
                let owed = s.left_out || s.speed.is_none();
                if !owed || s.probing || ejected || !ready {
                    return None;
                }
                s.probing = true;
                Some((u.id, u.url.clone()))
            })
            .collect()
    }
}
