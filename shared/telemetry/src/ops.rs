//! The small HTTP server every non-frontend service runs for operators: `/metrics`, `/health`
//! and `/live`. (The frontend serves all three on its API port.)
//!
//! `/health` is readiness: 200 only while the service can do its job, which depends on its
//! peers (an engine-core is not ready while its worker reloads the model). `/live` is
//! liveness: 200 whenever the process answers HTTP at all. Orchestrators restart a container
//! whose liveness fails, so probing `/health` for liveness would restart a healthy dp-lb or
//! frontend whenever a worker behind it takes long to load, and cascade one slow restart into
//! many.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpResponse, HttpServer};

/// Readiness flag shared between a service and its `/health` route.
///
/// Once [`Health::begin_drain`] is called the service is stopping: `/health` answers 503 from
/// then on, whatever the service's own view of its peers says (a peer reconnecting while the
/// service drains must not make it look ready again), so load balancers and probes stop
/// sending it work first.
#[derive(Debug, Clone, Default)]
pub struct Health(Arc<Flags>);

#[derive(Debug, Default)]
struct Flags {
    ready: AtomicBool,
    draining: AtomicBool,
}

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.0.ready.store(ready, Ordering::Release);
    }
    /// Ready and not stopping.
    pub fn is_ready(&self) -> bool {
        self.0.ready.load(Ordering::Acquire) && !self.is_draining()
    }
    /// The service is stopping: readiness is 503 for good (the first step of a graceful stop).
    pub fn begin_drain(&self) {
        self.0.draining.store(true, Ordering::Release);
    }
    /// Whether [`Health::begin_drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.0.draining.load(Ordering::Acquire)
    }
}

async fn health(h: web::Data<Health>) -> HttpResponse {
    if h.is_ready() {
        HttpResponse::Ok().content_type("application/json").body("{\"status\":\"ok\"}")
    } else if h.is_draining() {
        HttpResponse::ServiceUnavailable().content_type("application/json").body("{\"status\":\"stopping\"}")
    } else {
        HttpResponse::ServiceUnavailable().content_type("application/json").body("{\"status\":\"starting\"}")
    }
}

/// `GET /live`: the process is up and serving HTTP; says nothing about its peers.
pub async fn live() -> HttpResponse {
    HttpResponse::Ok().content_type("application/json").body("{\"status\":\"alive\"}")
}

/// The ops server's routes, over the service's readiness flag.
fn routes(data: web::Data<Health>) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        cfg.app_data(data)
            .route("/metrics", web::get().to(crate::metrics::metrics_handler))
            .route("/health", web::get().to(health))
            .route("/live", web::get().to(live));
    }
}

/// Start the ops server on `host:port` inside the current actix System. Errors (port in use)
/// are returned so the service can fail its start-up with a clear message. The handle stops
/// it (and frees its port) at the end of the service's graceful stop; the process's signals
/// are the service shell's, never the ops server's.
pub fn spawn_ops_server(host: &str, port: u16, health_flag: Health) -> std::io::Result<ServerHandle> {
    let data = web::Data::new(health_flag);
    let server = HttpServer::new(move || App::new().configure(routes(data.clone())))
        .workers(1)
        .disable_signals()
        .bind((host, port))?
        .run();
    let handle = server.handle();
    actix_web::rt::spawn(server);
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test;

    #[actix_web::test]
    async fn live_answers_while_the_service_is_not_ready() {
        let flag = Health::default();
        let app = test::init_service(App::new().configure(routes(web::Data::new(flag.clone())))).await;
        let status = |path: &'static str| {
            let app = &app;
            async move { test::call_service(app, test::TestRequest::get().uri(path).to_request()).await.status() }
        };
        assert_eq!(status("/health").await, 503);
        assert_eq!(status("/live").await, 200);
        flag.set_ready(true);
        assert_eq!(status("/health").await, 200);
        assert_eq!(status("/live").await, 200);
        flag.set_ready(false);
        assert_eq!(status("/health").await, 503, "readiness follows the flag back down");
        flag.set_ready(true);
        flag.begin_drain();
        assert_eq!(status("/health").await, 503, "a stopping service is not ready");
        flag.set_ready(true);
        assert_eq!(status("/health").await, 503, "and a peer coming back does not make it ready again");
        assert_eq!(status("/live").await, 200);
    }
}
