//! `pdmesh-otlp-sink`: the OTLP receiver of `pdmesh_otlp_sink` as a process, answering on
//! Jaeger all-in-one's ports so it can stand in for it (the compose test):
//! OTLP/gRPC on 4317, OTLP/HTTP on 4318, and the span query API (`GET /api/spans`) on 4318 and
//! 16686. Ports can be changed with `--grpc ADDR --http ADDR --query ADDR`.

use anyhow::Context as _;
use pdmesh_otlp_sink::{serve_grpc, serve_http, SpanStore};

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| default.to_string())
}

fn main() -> anyhow::Result<()> {
    pdmesh_telemetry::init("otlp-sink");
    let args: Vec<String> = std::env::args().collect();
    let grpc = arg(&args, "--grpc", "0.0.0.0:4317");
    let http = arg(&args, "--http", "0.0.0.0:4318");
    let query = arg(&args, "--query", "0.0.0.0:16686");
    let store = SpanStore::new();
    actix_web::rt::System::new().block_on(async move {
        let grpc_listener = tokio::net::TcpListener::bind(&grpc).await.with_context(|| format!("binding {grpc}"))?;
        let http_listener = std::net::TcpListener::bind(&http).with_context(|| format!("binding {http}"))?;
        let query_listener = std::net::TcpListener::bind(&query).with_context(|| format!("binding {query}"))?;
        tracing::info!(%grpc, %http, %query, "OTLP sink listening");
        let grpc_task = actix_web::rt::spawn(serve_grpc(grpc_listener, store.clone()));
        let server = serve_http(vec![http_listener, query_listener], store)?;
        tokio::select! {
            r = server => r.context("http server")?,
            r = grpc_task => r.context("grpc task")?.context("grpc server")?,
            _ = shutdown_signal() => tracing::info!("OTLP sink stopping"),
        }
        Ok(())
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
