//! Decode legs admitted before their prefill finished (D66, SGLang's parallel dispatch).
//!
//! With `pdmesh_internal.params_follow = <token>` a decode node takes a streamed request
//! *before* P has answered: it validates, renders and tokenises it, takes its places under the
//! in-flight bounds, answers its headers, and parks the request until the router delivers P's
//! params (and P's sampled token, D63) through `POST /v1/kv/params` under the same token. The
//! router sends this leg at the same time as the prefill leg, so D's HTTP, frontend and
//! admission hop runs while P prefills, and the client gets P's token as soon as P answers:
//! nothing of D stands between P's answer and the client's first token.
//!
//! The token is the router's unguessable capability for this one request (a request id is the
//! client's and may repeat). A parked request holds no engine state and no KV: until its
//! params arrive it is only a waiting task, bounded by the in-flight bound it holds a place
//! under and by [`PARK_WAIT`]; a client (the router) that goes away drops it. Refusals after
//! the params arrived (the engine refusing it) reach the stream as an error event before any
//! token, and P is told as for any refusal before admission (rule R1).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdmesh_protocol::KvTransferParams;
use tokio::sync::oneshot;

/// How long a parked request waits for its params. P's prefill of a long prompt under load
/// can take seconds; a router that lost P gives up on D's leg long before this.
pub const PARK_WAIT: Duration = Duration::from_secs(120);

/// What the router delivers to a parked request.
#[derive(Debug)]
pub struct Delivery {
    /// P's params (`None`: P answered without blocks to read; D prefills the prompt itself).
    pub kv_transfer_params: Option<KvTransferParams>,
    /// P's sampled token(s) the client already saw (D63): D resumes after them.
    pub resume_token_ids: Vec<u32>,
}

/// The parked requests of one frontend, by token.
#[derive(Debug, Clone, Default)]
pub struct Parked {
    waiting: Arc<Mutex<HashMap<String, oneshot::Sender<Delivery>>>>,
}

/// A parked request's side: the receiver of its delivery; dropping it unparks the request.
pub struct Slot {
    parked: Parked,
    token: String,
    pub delivery: oneshot::Receiver<Delivery>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.parked.lock().remove(&self.token);
    }
}

impl Parked {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, oneshot::Sender<Delivery>>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Park under `token`; `None` when a request already waits under it (a token is one
    /// request's).
    pub fn park(&self, token: &str) -> Option<Slot> {
        let mut waiting = self.lock();
        if waiting.contains_key(token) {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        waiting.insert(token.to_string(), tx);
        Some(Slot { parked: self.clone(), token: token.to_string(), delivery: rx })
    }

    /// Hand `delivery` to the request parked under `token`. False when none waits there (it
    /// was never parked, already got its params, or is gone).
    pub fn deliver(&self, token: &str, delivery: Delivery) -> bool {
        let Some(tx) = self.lock().remove(token) else { return false };
        tx.send(delivery).is_ok()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_reaches_its_token_once_and_no_other() {
        let parked = Parked::default();
        let mut slot = parked.park("t1").expect("parked");
        assert!(parked.park("t1").is_none(), "one request per token");
        assert!(!parked.deliver("t2", Delivery { kv_transfer_params: None, resume_token_ids: vec![] }));
        assert!(parked.deliver("t1", Delivery { kv_transfer_params: None, resume_token_ids: vec![7] }));
        assert_eq!(slot.delivery.try_recv().map(|d| d.resume_token_ids).ok(), Some(vec![7]));
        assert!(!parked.deliver("t1", Delivery { kv_transfer_params: None, resume_token_ids: vec![] }));
        assert!(parked.is_empty());
    }

    #[test]
    fn a_dropped_slot_unparks() {
        let parked = Parked::default();
        let slot = parked.park("t").expect("parked");
        assert_eq!(parked.len(), 1);
        drop(slot);
        assert!(parked.is_empty());
        assert!(!parked.deliver("t", Delivery { kv_transfer_params: None, resume_token_ids: vec![] }));
    }
}
