//! Slow request bodies end with a 408 (D93).
//!
//! actix-web times out a client that is slow to send its *headers*
//! (`client_request_timeout`); nothing bounds the body. A client that sends headers and then
//! trickles the body a byte at a time held a worker's connection (and its buffers) for as
//! long as it liked. [`limit`] wraps every request's payload in [`TimedBody`]: once the
//! headers are in, the whole body must arrive within the limit, or the payload ends with a
//! `TimedOut` error, which the body extractors turn into a 408
//! ([`crate::error::ApiError::from_payload_error`]). A body read before the limit is
//! untouched, and the response (a stream too) is not timed.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::dev::{Payload, ServiceRequest};
use actix_web::error::PayloadError;
use actix_web::web::Bytes;
use actix_web::HttpMessage;
use futures::Stream;

/// A request payload that fails with `TimedOut` once its time is up.
pub struct TimedBody {
    inner: Payload,
    timer: Pin<Box<tokio::time::Sleep>>,
    limit: Duration,
    done: bool,
    /// Set when the timer ran out.
    fired: Rc<Cell<bool>>,
}

impl TimedBody {
    pub fn new(inner: Payload, limit: Duration) -> Self {
        Self { inner, timer: Box::pin(tokio::time::sleep(limit)), limit, done: false, fired: Rc::default() }
    }
}

impl Stream for TimedBody {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(chunk)) => Poll::Ready(Some(chunk)),
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.done = true;
                    this.fired.set(true);
                    let why = format!(
                        "the request body did not arrive within {} s (`limits.body_timeout_s`)",
                        this.limit.as_secs()
                    );
                    Poll::Ready(Some(Err(PayloadError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, why)))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

/// Put `req`'s payload under a timer of `limit` (zero: no timer). The flag turns true if
/// the timer runs out before the body is read.
pub fn limit(req: &mut ServiceRequest, limit: Duration) -> Rc<Cell<bool>> {
    if limit.is_zero() {
        return Rc::default();
    }
    let payload = req.take_payload();
    let timed = TimedBody::new(payload, limit);
    let fired = timed.fired.clone();
    let timed: Pin<Box<dyn Stream<Item = Result<Bytes, PayloadError>>>> = Box::pin(timed);
    req.set_payload(Payload::from(timed));
    fired
}

/// The body limit of an app (its `app_data`); absent: [`DEFAULT`].
#[derive(Debug, Clone, Copy)]
pub struct BodyTimeout(pub Duration);

/// `limits.body_timeout_s`'s default.
pub const DEFAULT: Duration = Duration::from_secs(30);

/// The middleware (`.wrap(from_fn(body_timeout::middleware))`): the payload under its timer,
/// and a 408 (connection closed) for a request whose body ran out of time, whatever the
/// handler or extractor made of the failed read.
pub async fn middleware(
    mut req: ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody + 'static>,
) -> Result<actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>, actix_web::Error> {
    use actix_web::ResponseError;
    let limit_of = req.app_data::<BodyTimeout>().map_or(DEFAULT, |b| b.0);
    let fired = self::limit(&mut req, limit_of);
    let res = next.call(req).await?;
    if !fired.get() {
        return Ok(res.map_into_left_body());
    }
    let error = crate::error::ApiError::BodyTimeout(format!(
        "the request body did not arrive within {} s (`limits.body_timeout_s`)",
        limit_of.as_secs()
    ));
    error.record();
    let mut response = error.error_response();
    response.head_mut().set_connection_type(actix_web::http::ConnectionType::Close);
    Ok(res.into_response(response).map_into_right_body())
}
