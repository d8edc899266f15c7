//! The worker side of `MultiConnector`: one connector output per step from every child's.
//!
//! The engine frees a finished request's blocks on the first `finished_sending` that names
//! it, so when more than one child delayed the request (P holding it for D while the offload
//! store copies it, say) the request must be reported once, after the last of them. The
//! scheduler side counts the delaying children and sends the count beyond one in the step's
//! metadata (`extra_async_saves`); this side swallows that many reports first (vLLM's
//! `MultiConnector.get_finished`).

use std::collections::{BTreeMap, HashMap};

use pdmesh_protocol::KvConnectorOutput;

use crate::metrics as m;

/// Merges the children's outputs, holding back `finished_sending` until the last child.
#[derive(Debug, Default)]
pub struct OutputMerge {
    /// Reports still to swallow per request.
    extra: HashMap<String, u32>,
}

impl OutputMerge {
    /// Take a step's `extra_async_saves` (before any child's output of that step).
    pub fn expect(&mut self, extra_async_saves: &BTreeMap<String, u32>) {
        for (id, n) in extra_async_saves.iter().filter(|(_, n)| **n > 0) {
            *self.extra.entry(id.clone()).or_default() += n;
        }
    }

    /// Requests with reports still to swallow.
    pub fn pending(&self) -> usize {
        self.extra.len()
    }

    /// Forget everything (the engine that finished those requests is gone).
    pub fn clear(&mut self) {
        self.extra.clear();
    }

    /// One output from the children's outputs of one step.
    pub fn merge(&mut self, outputs: impl IntoIterator<Item = KvConnectorOutput>) -> KvConnectorOutput {
        let mut out = KvConnectorOutput::default();
        for o in outputs {
            out.finished_recving.extend(o.finished_recving);
            out.invalid_block_ids.extend(o.invalid_block_ids);
            out.leased_request_ids.extend(o.leased_request_ids);
            for id in o.finished_sending {
                match self.extra.get_mut(&id) {
                    None => out.finished_sending.push(id),
                    Some(n) => {
                        m::MULTI_SWALLOWED_SENDS.inc();
                        *n -= 1;
                        if *n == 0 {
                            self.extra.remove(&id);
                        }
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sending(ids: &[&str]) -> KvConnectorOutput {
        KvConnectorOutput { finished_sending: ids.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    #[test]
    fn a_request_two_children_delay_is_reported_once_after_the_second() {
        let mut merge = OutputMerge::default();
        merge.expect(&BTreeMap::from([("r".to_string(), 1)]));
        // step 1: the offload child saved r; the P/D child still holds it for D; s is P/D only
        let out = merge.merge([sending(&["s"]), sending(&["r"])]);
        assert_eq!(out.finished_sending, vec!["s".to_string()], "r held back");
        assert_eq!(merge.pending(), 0, "r's next report is its last");
        // step 2: D read r
        let out = merge.merge([sending(&["r"]), KvConnectorOutput::default()]);
        assert_eq!(out.finished_sending, vec!["r".to_string()]);
        // both in the same step: one report
        merge.expect(&BTreeMap::from([("t".to_string(), 1)]));
        let out = merge.merge([sending(&["t"]), sending(&["t"])]);
        assert_eq!(out.finished_sending, vec!["t".to_string()]);
    }

    #[test]
    fn receives_and_invalid_blocks_pass_through() {
        let mut merge = OutputMerge::default();
        let a =
            KvConnectorOutput { finished_recving: vec!["a".into()], invalid_block_ids: vec![3], ..Default::default() };
        let b = KvConnectorOutput { finished_recving: vec!["b".into()], ..Default::default() };
        let out = merge.merge([a, b]);
        assert_eq!(out.finished_recving, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(out.invalid_block_ids, vec![3]);
    }
}
