//! A small OTLP trace receiver: accepts spans over gRPC (`TraceService/Export`) and
//! HTTP/protobuf (`POST /v1/traces`), keeps them in memory, and serves them as JSON
//! (`GET /api/spans`).
//!
//! It exists so that tests can check what the mesh exports without Jaeger: the process-level
//! tracing test runs it in-process, and the compose test runs its binary
//! (`pdmesh-otlp-sink`) in the container where users run `jaegertracing/all-in-one`, on the
//! same ports (4317, 4318, and the query port 16686).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use actix_web::{web, App, HttpResponse, HttpServer};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use prost::Message as _;
use serde_json::{json, Value};

/// One received span, flattened: ids in lowercase hex, attribute values as JSON scalars.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// The resource's `service.name`.
    pub service: String,
    pub resource: BTreeMap<String, Value>,
    pub attributes: BTreeMap<String, Value>,
    /// Event name and attributes, in order.
    pub events: Vec<(String, BTreeMap<String, Value>)>,
    /// When each event of `events` happened (same order): what a latency breakdown reads.
    pub event_times_unix_nano: Vec<u64>,
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
}

impl SpanRecord {
    pub fn to_json(&self) -> Value {
        json!({
            "trace_id": self.trace_id, "span_id": self.span_id, "parent_span_id": self.parent_span_id,
            "name": self.name, "service": self.service, "resource": self.resource, "attributes": self.attributes,
            "events": self.events.iter().zip(self.event_times_unix_nano.iter().copied().chain(std::iter::repeat(0)))
                .map(|((n, a), t)| json!({"name": n, "attributes": a, "time_unix_nano": t})).collect::<Vec<_>>(),
            "start_unix_nano": self.start_unix_nano, "end_unix_nano": self.end_unix_nano,
        })
    }

    /// The event names of this span.
    pub fn event_names(&self) -> Vec<&str> {
        self.events.iter().map(|(n, _)| n.as_str()).collect()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn value(v: Option<&AnyValue>) -> Value {
    match v.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => Value::String(s.clone()),
        Some(any_value::Value::BoolValue(b)) => Value::Bool(*b),
        Some(any_value::Value::IntValue(i)) => json!(i),
        Some(any_value::Value::DoubleValue(d)) => json!(d),
        Some(any_value::Value::ArrayValue(a)) => Value::Array(a.values.iter().map(|v| value(Some(v))).collect()),
        Some(other) => Value::String(format!("{other:?}")),
        None => Value::Null,
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, Value> {
    kvs.iter().map(|kv| (kv.key.clone(), value(kv.value.as_ref()))).collect()
}

/// Every span received so far, shared between the receivers and the query endpoint.
#[derive(Debug, Clone, Default)]
pub struct SpanStore(Arc<Mutex<Vec<SpanRecord>>>);

impl SpanStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<SpanRecord>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Add the spans of one export request.
    pub fn ingest(&self, req: ExportTraceServiceRequest) {
        let mut out = Vec::new();
        for rs in req.resource_spans {
            let resource = rs.resource.as_ref().map(|r| attributes(&r.attributes)).unwrap_or_default();
            let service = resource.get("service.name").and_then(Value::as_str).unwrap_or("").to_string();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.push(SpanRecord {
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        name: s.name,
                        service: service.clone(),
                        resource: resource.clone(),
                        attributes: attributes(&s.attributes),
                        events: s.events.iter().map(|e| (e.name.clone(), attributes(&e.attributes))).collect(),
                        event_times_unix_nano: s.events.iter().map(|e| e.time_unix_nano).collect(),
                        start_unix_nano: s.start_time_unix_nano,
                        end_unix_nano: s.end_time_unix_nano,
                    });
                }
            }
        }
        self.lock().extend(out);
    }

    /// A copy of every span received.
    pub fn spans(&self) -> Vec<SpanRecord> {
        self.lock().clone()
    }

    /// Spans of one trace (`trace_id` in hex).
    pub fn trace(&self, trace_id: &str) -> Vec<SpanRecord> {
        self.lock().iter().filter(|s| s.trace_id == trace_id).cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    pub fn to_json(&self, trace_id: Option<&str>) -> Value {
        let spans = self.lock();
        Value::Array(
            spans.iter().filter(|s| trace_id.is_none_or(|t| s.trace_id == t)).map(SpanRecord::to_json).collect(),
        )
    }
}

struct GrpcReceiver(SpanStore);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.ingest(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// Serve OTLP/gRPC on `listener` until the task is dropped (needs a tokio runtime).
pub async fn serve_grpc(listener: tokio::net::TcpListener, store: SpanStore) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(GrpcReceiver(store)))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await
}

async fn http_traces(body: web::Bytes, store: web::Data<SpanStore>) -> HttpResponse {
    match ExportTraceServiceRequest::decode(body.as_ref()) {
        Ok(req) => {
            store.ingest(req);
            HttpResponse::Ok()
                .content_type("application/x-protobuf")
                .body(ExportTraceServiceResponse::default().encode_to_vec())
        }
        Err(e) => HttpResponse::BadRequest().body(format!("not an OTLP protobuf export request: {e}")),
    }
}

async fn http_spans(q: web::Query<BTreeMap<String, String>>, store: web::Data<SpanStore>) -> HttpResponse {
    HttpResponse::Ok().json(store.to_json(q.get("trace_id").map(String::as_str)))
}

async fn http_health() -> HttpResponse {
    HttpResponse::Ok().content_type("application/json").body("{\"status\":\"ok\"}")
}

/// Serve OTLP/HTTP (`POST /v1/traces`, protobuf) and the query API (`GET /api/spans`,
/// `GET /health`) on each of `listeners`, inside the current actix/tokio runtime.
pub fn serve_http(listeners: Vec<std::net::TcpListener>, store: SpanStore) -> std::io::Result<actix_web::dev::Server> {
    let data = web::Data::new(store);
    let mut server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .app_data(web::PayloadConfig::new(64 << 20))
            .route("/v1/traces", web::post().to(http_traces))
            .route("/api/spans", web::get().to(http_spans))
            .route("/health", web::get().to(http_health))
            .route("/", web::get().to(http_health))
    })
    .workers(1)
    .disable_signals();
    for l in listeners {
        server = server.listen(l)?;
    }
    Ok(server.run())
}
