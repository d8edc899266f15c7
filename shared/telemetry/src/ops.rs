//! The small HTTP server every non-frontend service runs for operators: `/metrics` and
//! `/health`. (The frontend serves both on its API port.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use actix_web::{web, App, HttpResponse, HttpServer};

/// Readiness flag shared between a service and its `/health` route.
#[derive(Debug, Clone, Default)]
pub struct Health(Arc<AtomicBool>);

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

async fn health(h: web::Data<Health>) -> HttpResponse {
    if h.is_ready() {
        HttpResponse::Ok().content_type("application/json").body("{\"status\":\"ok\"}")
    } else {
        HttpResponse::ServiceUnavailable().content_type("application/json").body("{\"status\":\"starting\"}")
    }
}

/// Start the ops server on `host:port` inside the current actix System. Errors (port in use)
/// are returned so the service can fail its start-up with a clear message.
pub fn spawn_ops_server(host: &str, port: u16, health_flag: Health) -> std::io::Result<()> {
    let data = web::Data::new(health_flag);
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .route("/metrics", web::get().to(crate::metrics::metrics_handler))
            .route("/health", web::get().to(health))
    })
    .workers(1)
    .disable_signals()
    .bind((host, port))?
    .run();
    actix_web::rt::spawn(server);
    Ok(())
}
