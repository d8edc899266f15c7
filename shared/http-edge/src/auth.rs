//! API keys on every frontend, the router included (vLLM's `--api-key`).
//!
//! With keys configured, every route but the probes (`/health`, `/live`, `/metrics`) needs
//! `Authorization: Bearer <key>`: the OpenAI API, `POST /v1/kv/release`, and the debug routes,
//! which reveal request ids. Anything else, unknown routes included, is refused with 401 before
//! routing, so a route added later is closed until it is listed as open. Without keys nothing
//! is checked. Keys are kept as SHA-256 digests and compared in constant time ([`subtle`]), so
//! neither the time an answer takes nor the process memory gives a key away.
//! docs/SECURITY.md, "API keys".
//!
//! The check also says *which* client key matched, as its position in the configured list
//! ([`ClientKey`], put in the request's extensions), so that the per-key bound on requests in
//! flight ([`crate::overload::KeyLimit`]) can count per client without ever keeping or logging
//! the key itself. The position is selected in constant time as well.

use std::sync::Arc;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderMap, AUTHORIZATION, WWW_AUTHENTICATE};
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage, ResponseError};
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::error::ApiError;
use crate::metrics::{AUTHORIZED_TOTAL, REQUEST_ERRORS_TOTAL, UNAUTHORIZED_TOTAL};

/// Routes open without a key: probes that orchestrators and Prometheus call.
pub const OPEN_PATHS: [&str; 3] = ["/health", "/live", "/metrics"];

/// The keys a frontend accepts, as digests, each marked client or internal. Cheap to clone;
/// `Debug` shows only how many.
#[derive(Clone, Default)]
pub struct ApiKeys {
    digests: Arc<[([u8; 32], Credential)]>,
}

/// Which kind of key a request presented (the `credential` label of
/// `pdmesh_frontend_authorized_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential {
    /// One of the client keys.
    Client,
    /// The mesh's internal key: the router calling this node.
    Internal,
}

impl Credential {
    pub fn label(self) -> &'static str {
        match self {
            Credential::Client => "client",
            Credential::Internal => "internal",
        }
    }
}

/// Which client key a request presented: its position in the configured list of keys (never
/// the key nor its digest). Inserted into the request's extensions by [`require_api_key`] for
/// client keys only: the internal key aggregates every client of the router, so a per-client
/// bound must not apply to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientKey(usize);

impl ClientKey {
    /// The key's position in the list the frontend was started with.
    pub fn slot(self) -> usize {
        self.0
    }
}

/// What a valid key turned out to be: its kind and its position in the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyMatch {
    pub credential: Credential,
    slot: usize,
}

impl KeyMatch {
    /// The per-client identity of a client key; `None` for the internal key.
    pub fn client_key(self) -> Option<ClientKey> {
        (self.credential == Credential::Client).then_some(ClientKey(self.slot))
    }
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeys").field("keys", &self.digests.len()).finish()
    }
}

/// Why a request was refused (the `reason` label of the metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization` header.
    Missing,
    /// A header that is not `Bearer <token>`.
    Malformed,
    /// A bearer token that matches no key.
    Invalid,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Malformed => "malformed",
            Refusal::Invalid => "invalid",
        }
    }

    fn message(self) -> &'static str {
        match self {
            Refusal::Missing => "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
            Refusal::Malformed => "The Authorization header must be `Bearer <key>`.",
            Refusal::Invalid => "Incorrect API key provided.",
        }
    }
}

impl ApiKeys {
    /// Accept exactly these client keys; none: accept everything (no key required).
    pub fn new<I, S>(keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::with_internal(keys, None)
    }

    /// Accept these client keys and the mesh's internal key (a node behind a router).
    pub fn with_internal<I, S>(keys: I, internal: Option<&str>) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let client = keys.into_iter().map(|k| (digest(k.as_ref()), Credential::Client));
        let internal = internal.map(|k| (digest(k), Credential::Internal));
        Self { digests: client.chain(internal).collect() }
    }

    /// Whether a key is required at all.
    pub fn enabled(&self) -> bool {
        !self.digests.is_empty()
    }

    /// How many keys there are (client and internal): the slots a per-key count needs.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether no key is configured (same as `!enabled()`).
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// Which kind of key `token` is, if any (see [`ApiKeys::identify`]).
    pub fn accepts(&self, token: &str) -> Option<Credential> {
        self.identify(token).map(|m| m.credential)
    }

    /// Which key `token` is, if any: its kind and its position. Every key is compared, each in
    /// constant time, and the matching position is taken with a constant-time select, so the
    /// answer takes as long for a near miss as for a far one, for either kind and whichever
    /// position matches. (A key listed twice matches at its last position.)
    pub fn identify(&self, token: &str) -> Option<KeyMatch> {
        let presented = digest(token);
        let (mut client, mut internal) = (subtle::Choice::from(0), subtle::Choice::from(0));
        let mut slot = 0u64;
        for (i, (d, kind)) in self.digests.iter().enumerate() {
            let equal = d.ct_eq(&presented);
            let is_internal = subtle::Choice::from(u8::from(*kind == Credential::Internal));
            client |= equal & !is_internal;
            internal |= equal & is_internal;
            slot.conditional_assign(&(i as u64), equal);
        }
        let slot = slot as usize;
        if bool::from(internal) {
            Some(KeyMatch { credential: Credential::Internal, slot })
        } else if bool::from(client) {
            Some(KeyMatch { credential: Credential::Client, slot })
        } else {
            None
        }
    }

    /// Check a request's headers for path `path`: `Ok(None)` when no key is needed,
    /// `Ok(Some(match))` when a valid key is present.
    pub fn check(&self, path: &str, headers: &HeaderMap) -> Result<Option<KeyMatch>, Refusal> {
        if !self.enabled() || OPEN_PATHS.contains(&path) {
            return Ok(None);
        }
        let Some(value) = headers.get(AUTHORIZATION) else { return Err(Refusal::Missing) };
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty())
            .ok_or(Refusal::Malformed)?;
        self.identify(token).map(Some).ok_or(Refusal::Invalid)
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The 401 answer: an OpenAI error body (`code: "invalid_api_key"`) and a `WWW-Authenticate`
/// challenge (RFC 6750). Counted and logged here, once; the key presented is never logged.
pub fn refuse(refusal: Refusal, path: &str, peer: Option<std::net::SocketAddr>) -> actix_web::HttpResponse {
    UNAUTHORIZED_TOTAL.with_label_values(&[refusal.label()]).inc();
    let error = ApiError::Unauthorized(refusal.message().to_string());
    REQUEST_ERRORS_TOTAL.with_label_values(&[error.kind()]).inc();
    tracing::warn!(status = 401, reason = refusal.label(), path, peer = ?peer, "request refused: no valid API key");
    let mut response = error.error_response();
    response.headers_mut().insert(WWW_AUTHENTICATE, actix_web::http::header::HeaderValue::from_static("Bearer"));
    response
}

/// The middleware of both apps (node frontend and router): every request but the probes needs
/// a valid key when the app holds [`ApiKeys`] that are enabled. A client key's [`ClientKey`]
/// goes into the request's extensions for the per-key bound.
pub async fn require_api_key<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Result<ServiceResponse<EitherBody<B>>, actix_web::Error> {
    let verdict = match req.app_data::<web::Data<ApiKeys>>() {
        Some(keys) => keys.check(req.path(), req.headers()),
        None => Ok(None),
    };
    match verdict {
        Ok(matched) => {
            if let Some(m) = matched {
                AUTHORIZED_TOTAL.with_label_values(&[m.credential.label()]).inc();
                if let Some(key) = m.client_key() {
                    req.extensions_mut().insert(key);
                }
            }
            next.call(req).await.map(ServiceResponse::map_into_left_body)
        }
        Err(refusal) => {
            let response = refuse(refusal, req.path(), req.peer_addr());
            Ok(req.into_response(response).map_into_right_body())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::HeaderValue;

    fn headers(auth: Option<&'static str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(AUTHORIZATION, HeaderValue::from_static(a));
        }
        h
    }

    #[test]
    fn keys_are_checked_on_everything_but_the_probes() {
        let keys = ApiKeys::new(["sk-one", "sk-two"]);
        assert!(keys.enabled());
        let client = |slot| Ok(Some(KeyMatch { credential: Credential::Client, slot }));
        assert_eq!(keys.check("/v1/completions", &headers(Some("Bearer sk-two"))), client(1));
        assert_eq!(keys.check("/v1/completions", &headers(Some("bearer  sk-one"))), client(0), "scheme is case-blind");
        assert_eq!(keys.check("/v1/completions", &headers(None)), Err(Refusal::Missing));
        assert_eq!(keys.check("/v1/completions", &headers(Some("Bearer sk-three"))), Err(Refusal::Invalid));
        assert_eq!(keys.check("/v1/completions", &headers(Some("Bearer sk-on"))), Err(Refusal::Invalid));
        assert_eq!(keys.check("/v1/completions", &headers(Some("Basic sk-one"))), Err(Refusal::Malformed));
        assert_eq!(keys.check("/v1/completions", &headers(Some("sk-one"))), Err(Refusal::Malformed));
        assert_eq!(keys.check("/v1/completions", &headers(Some("Bearer "))), Err(Refusal::Malformed));
        assert_eq!(keys.check("/debug/kv", &headers(None)), Err(Refusal::Missing));
        assert_eq!(keys.check("/anything/else", &headers(None)), Err(Refusal::Missing), "closed unless listed open");
        for open in OPEN_PATHS {
            assert_eq!(keys.check(open, &headers(None)), Ok(None), "{open}");
        }
        assert_eq!(format!("{keys:?}"), "ApiKeys { keys: 2 }");
    }

    #[test]
    fn the_internal_key_is_told_apart_from_client_keys() {
        let keys = ApiKeys::with_internal(["sk-one"], Some("mesh-internal"));
        assert_eq!(keys.accepts("sk-one"), Some(Credential::Client));
        assert_eq!(keys.accepts("mesh-internal"), Some(Credential::Internal));
        assert_eq!(keys.accepts("mesh-interna"), None);
        let router = ApiKeys::new(["sk-one"]);
        assert_eq!(router.accepts("mesh-internal"), None, "the router's clients cannot use the internal key");
        let internal_only = ApiKeys::with_internal(Vec::<String>::new(), Some("mesh-internal"));
        assert!(internal_only.enabled(), "an internal key alone closes a node");
    }

    #[test]
    fn each_client_key_is_told_apart_and_the_internal_key_has_no_client_identity() {
        let keys = ApiKeys::with_internal(["sk-a", "sk-b", "sk-c"], Some("mesh-internal"));
        assert_eq!(keys.len(), 4);
        let slot = |t: &str| keys.identify(t).and_then(KeyMatch::client_key).map(ClientKey::slot);
        assert_eq!((slot("sk-a"), slot("sk-b"), slot("sk-c")), (Some(0), Some(1), Some(2)));
        assert_eq!(slot("sk-d"), None);
        let internal = keys.identify("mesh-internal").unwrap();
        assert_eq!(internal.credential, Credential::Internal);
        assert_eq!(internal.client_key(), None, "the internal key is exempt from per-client bounds");
    }

    #[test]
    fn without_keys_nothing_is_checked() {
        let keys = ApiKeys::new(Vec::<String>::new());
        assert!(!keys.enabled());
        assert_eq!(keys.check("/v1/completions", &headers(None)), Ok(None));
        assert_eq!(keys.check("/debug/kv", &headers(Some("Bearer whatever"))), Ok(None));
    }
}
