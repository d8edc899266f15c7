//! OTLP trace export, configured by the standard OpenTelemetry environment variables.
//!
//! Export is on only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! is set, or `OTEL_TRACES_EXPORTER=otlp`; `OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true`
//! turn it off. Without it no OpenTelemetry layer is installed at all, so a mesh that does not
//! export pays nothing for spans beyond what `tracing` itself costs.
//!
//! - Protocol: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`, `grpc` or
//!   `http/protobuf` (the default, as the OpenTelemetry spec asks).
//! - Endpoint, headers, timeout: read by the exporter itself (`OTEL_EXPORTER_OTLP_*`).
//! - Sampler: `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default `parentbased_always_on`,
//!   so a client's sampled flag is honoured), read by the SDK.
//! - Batching: `OTEL_BSP_*`, read by the SDK.
//! - `service.name`: `OTEL_SERVICE_NAME`, else `pdmesh-<service>`; `OTEL_RESOURCE_ATTRIBUTES`
//!   adds attributes; `pdmesh.node`, `pdmesh.rank` and `service.instance.id` are always set.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use thiserror::Error;

/// Why OTLP export could not be set up (the service then runs without it and says so).
#[derive(Debug, Error)]
pub enum OtlpError {
    #[error("cannot start the exporter's runtime: {0}")]
    Runtime(#[from] std::io::Error),
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(String),
    #[error("unsupported OTLP protocol {0:?} (this build speaks grpc and http/protobuf)")]
    Protocol(String),
}

/// Who this process is, for the resource attributes of its spans.
#[derive(Debug, Clone)]
pub struct ServiceIdentity {
    /// The service kind: `frontend`, `router`, `dp-lb`, `engine-core`, ...
    pub service: String,
    /// Topology node name.
    pub node: String,
    /// Data-parallel rank for per-rank services.
    pub rank: Option<u32>,
}

impl ServiceIdentity {
    pub fn new(service: impl Into<String>, node: impl Into<String>, rank: Option<u32>) -> Self {
        Self { service: service.into(), node: node.into(), rank }
    }

    /// `service.name`: `OTEL_SERVICE_NAME` wins (the standard), else `pdmesh-<service>`.
    pub fn service_name(&self) -> String {
        match std::env::var("OTEL_SERVICE_NAME") {
            Ok(v) if !v.trim().is_empty() => v,
            _ => format!("pdmesh-{}", self.service),
        }
    }

    /// `service.instance.id`: node, service and rank, unique within a mesh.
    pub fn instance_id(&self) -> String {
        match self.rank {
            Some(r) => format!("{}.{}.{r}", self.node, self.service),
            None => format!("{}.{}", self.node, self.service),
        }
    }
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// Whether the environment asks for OTLP trace export.
pub fn requested() -> bool {
    if env_nonempty("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return false;
    }
    match env_nonempty("OTEL_TRACES_EXPORTER").map(|v| v.to_ascii_lowercase()) {
        Some(v) if v == "none" => false,
        Some(v) if v.split(',').any(|e| e.trim() == "otlp") => true,
        _ => {
            env_nonempty("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
                || env_nonempty("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
        }
    }
}

fn protocol() -> Result<Protocol, OtlpError> {
    let value = env_nonempty("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| env_nonempty("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "http/protobuf".into());
    match value.as_str() {
        "grpc" => Ok(Protocol::Grpc),
        "http/protobuf" => Ok(Protocol::HttpBinary),
        other => Err(OtlpError::Protocol(other.into())),
    }
}

/// A running export pipeline. [`OtlpPipeline::shutdown`] flushes what is queued; call it from
/// plain (non-async) code once the service's runtime stopped.
pub struct OtlpPipeline {
    provider: SdkTracerProvider,
    /// gRPC only: tonic's channel needs a tokio runtime that keeps running while the batch
    /// processor's own thread exports, also during shutdown after the service's actix System
    /// stopped; an actix System is single-threaded and would deadlock a blocking flush.
    runtime: Option<tokio::runtime::Runtime>,
    pub protocol: &'static str,
}

impl std::fmt::Debug for OtlpPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpPipeline").field("protocol", &self.protocol).finish_non_exhaustive()
    }
}

impl OtlpPipeline {
    /// Build the exporter, the batch processor and the provider for `id`.
    pub fn start(id: &ServiceIdentity) -> Result<Self, OtlpError> {
        let protocol = protocol()?;
        let (exporter, runtime, name) = match protocol {
            Protocol::Grpc => {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("otlp-export")
                    .enable_all()
                    .build()?;
                let exporter = {
                    let _entered = rt.enter();
                    opentelemetry_otlp::SpanExporter::builder()
                        .with_tonic()
                        .build()
                        .map_err(|e| OtlpError::Exporter(e.to_string()))?
                };
                (exporter, Some(rt), "grpc")
            }
            _ => {
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(Protocol::HttpBinary)
                    .build()
                    .map_err(|e| OtlpError::Exporter(e.to_string()))?;
                (exporter, None, "http/protobuf")
            }
        };
        let mut resource = Resource::builder()
            .with_service_name(id.service_name())
            .with_attribute(KeyValue::new("service.instance.id", id.instance_id()))
            .with_attribute(KeyValue::new("pdmesh.service", id.service.clone()))
            .with_attribute(KeyValue::new("pdmesh.node", id.node.clone()));
        if let Some(rank) = id.rank {
            resource = resource.with_attribute(KeyValue::new("pdmesh.rank", i64::from(rank)));
        }
        let provider =
            SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
        Ok(Self { provider, runtime, protocol: name })
    }

    pub fn tracer(&self) -> SdkTracer {
        self.provider.tracer("pdmesh")
    }

    /// Export what is queued and stop. Blocking; never call it from inside an async task.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("pdmesh: OTLP shutdown: {e}");
        }
        if let Some(rt) = self.runtime {
            rt.shutdown_timeout(std::time::Duration::from_secs(2));
        }
    }
}
