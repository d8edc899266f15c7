//! The state every handler shares (one instance for all HTTP workers), below the modules that
//! use it: generation, validation and the handlers take it from here, and `server` builds it.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix::Addr;
use pdmesh_model_api::TextCodec;
use pdmesh_transport::LinkHandle;

use crate::auth::ApiKeys;
use crate::engine_client::EngineClient;
use crate::overload::{InFlightLimit, KeyLimit};
use crate::validation::ModelLimits;
use crate::FrontendOptions;

/// What every handler needs; one instance shared by all HTTP workers.
pub struct AppState {
    pub client: Addr<EngineClient>,
    /// The DEALER link, read by `/health`.
    pub link: LinkHandle,
    pub codec: Arc<dyn TextCodec>,
    pub options: FrontendOptions,
    /// Unix seconds at start (`created` of `/v1/models`).
    pub started: u64,
    /// Stored responses of the Responses API (`store: true`).
    pub responses: Arc<crate::response_store::ResponseStore>,
    /// The API keys clients must present (none: no key required); [`crate::auth`].
    pub api_keys: ApiKeys,
    /// The bound on generation requests in flight (`limits.max_in_flight`).
    pub in_flight: InFlightLimit,
    /// The bound per client API key (`limits.max_in_flight_per_key`); sized by `api_keys`.
    pub key_limit: KeyLimit,
    /// Set draining when the frontend stops: `/health` then answers 503.
    pub readiness: pdmesh_telemetry::ops::Health,
    /// Decode legs waiting for their params (D66).
    pub parked: crate::parked::Parked,
    /// How long a client may take to send a body (`limits.body_timeout_s`, D93).
    pub body_timeout: std::time::Duration,
}

impl AppState {
    pub fn new(
        client: Addr<EngineClient>,
        link: LinkHandle,
        codec: Arc<dyn TextCodec>,
        options: FrontendOptions,
        in_flight: InFlightLimit,
    ) -> Self {
        Self {
            client,
            link,
            codec,
            options,
            started: unix_now(),
            responses: Arc::new(crate::response_store::ResponseStore::default()),
            api_keys: ApiKeys::default(),
            in_flight,
            key_limit: KeyLimit::disabled("frontend"),
            readiness: Default::default(),
            parked: Default::default(),
            body_timeout: crate::body_timeout::DEFAULT,
        }
    }

    /// The vocabulary size used to bound token ids: the configured one, else the codec's.
    pub fn vocab_size(&self) -> u32 {
        if self.options.vocab_size > 0 {
            self.options.vocab_size
        } else {
            self.codec.vocab_size()
        }
    }
}

impl<'a> From<&'a AppState> for ModelLimits<'a> {
    fn from(state: &'a AppState) -> Self {
        Self { options: &state.options, codec: &*state.codec, vocab_size: state.vocab_size() }
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
