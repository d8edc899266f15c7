//! What every HTTP service of the mesh does alike: routes that answer 404/405 with the OpenAI
//! error body, the error response carrying the request id, the body limit, and the graceful
//! stop (draining `/health`, in-flight requests finish within the shell's deadline).

use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::{web, HttpResponse, ResponseError};
use pdmesh_protocol::node_http::REQUEST_ID_HEADER;
use pdmesh_service::{ServiceContext, Shutdown};

use crate::error::{ApiError, FrontendError};

/// Largest accepted request body (413 above).
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// actix-web's own drain limit, in seconds, for a stop whose deadline is `deadline`: one
/// second past it, so that the shell's deadline is the one that ends an overrunning drain
/// (and the stop is reported as a timeout, not cut silently by actix-web).
pub fn drain_timeout_s(deadline: std::time::Duration) -> u64 {
    deadline.as_secs().saturating_add(1)
}

/// `/health` of a frontend that is stopping: 503, so load balancers stop sending it work
/// while it drains what it has.
pub fn stopping() -> HttpResponse {
    let e = ApiError::Unavailable("shutting down: this frontend is draining its requests".into());
    HttpResponse::ServiceUnavailable().json(e.body())
}

/// Render an error as the response to a request (counted and logged once, here).
pub fn error_response(error: ApiError, request_id: &str) -> HttpResponse {
    error.record();
    let mut response = error.error_response();
    set_request_id(&mut response, request_id);
    response
}

/// Put `X-Request-Id` on a response.
pub fn set_request_id(response: &mut HttpResponse, request_id: &str) {
    if let Ok(value) = HeaderValue::from_str(request_id) {
        response.headers_mut().insert(HeaderName::from_static(REQUEST_ID_HEADER), value);
    }
}

/// Unknown routes: the OpenAI error body with 404, counted and logged like every refusal
/// (node frontends and the router alike).
pub async fn not_found(req: actix_web::HttpRequest) -> HttpResponse {
    let e = ApiError::NotFound(format!("no route for {} {}", req.method(), req.path()));
    e.record();
    actix_web::ResponseError::error_response(&e)
}

/// The default service of a known path: its methods are `allow` (the `Allow` header), so
/// any other is a 405 with the OpenAI error body, counted and logged like every refusal.
pub fn method_not_allowed(allow: &'static str) -> actix_web::Route {
    web::to(move |req: actix_web::HttpRequest| async move {
        let e = ApiError::MethodNotAllowed { method: req.method().to_string(), path: req.path().to_string(), allow };
        e.record();
        actix_web::ResponseError::error_response(&e)
    })
}

/// `web::resource(path)` serving `GET` with `handler` and a 405 for every other method.
pub fn get_only<F, Args>(path: &str, handler: F) -> actix_web::Resource
where
    F: actix_web::Handler<Args>,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    web::resource(path).route(web::get().to(handler)).default_service(method_not_allowed("GET"))
}

/// `web::resource(path)` serving `POST` with `handler` and a 405 for every other method.
pub fn post_only<F, Args>(path: &str, handler: F) -> actix_web::Resource
where
    F: actix_web::Handler<Args>,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    web::resource(path).route(web::post().to(handler)).default_service(method_not_allowed("POST"))
}

/// Serve `server` until `shutdown` begins, then mark the service draining (`/health` 503) and
/// stop the server gracefully: no new connections, in-flight requests finish.
pub async fn serve_until_shutdown(
    ctx: &ServiceContext,
    server: actix_web::dev::Server,
    shutdown: Shutdown,
) -> Result<(), FrontendError> {
    let handle = server.handle();
    let mut server = std::pin::pin!(server);
    tokio::select! {
        res = &mut server => return res.map_err(FrontendError::Server),
        () = shutdown.started() => {}
    }
    ctx.begin_drain();
    let stopping = handle.stop(true);
    let (res, ()) = tokio::join!(server, stopping);
    res.map_err(FrontendError::Server)
}
