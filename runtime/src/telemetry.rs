//! `/metrics` (Prometheus text format, prometheus-client) and `/healthz` for the operator and the
//! agent. Health is "the loop has completed a pass recently": a stuck reconcile loop fails the
//! liveness probe and gets restarted.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

/// What the endpoints serve.
#[derive(Clone)]
pub struct Telemetry {
    registry: Arc<Mutex<Registry>>,
    last_pass: Arc<AtomicI64>,
    /// Unhealthy when no pass completed for this long.
    stale_after: Duration,
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl Telemetry {
    pub fn new(registry: Registry, stale_after: Duration) -> Telemetry {
        Telemetry {
            registry: Arc::new(Mutex::new(registry)),
            last_pass: Arc::new(AtomicI64::new(now())),
            stale_after,
        }
    }

    /// Records that the loop completed a pass.
    pub fn pass_done(&self) {
        self.last_pass.store(now(), Ordering::Relaxed);
    }

    /// Serves `/metrics` and `/healthz` on `addr` in the background.
    pub async fn serve(&self, addr: SocketAddr) -> std::io::Result<()> {
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind(addr).await?;
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!("metrics server stopped: {e}");
            }
        });
        Ok(())
    }
}

async fn metrics(State(t): State<Telemetry>) -> impl IntoResponse {
    let mut text = String::new();
    let encoded = {
        let registry = t.registry.lock().unwrap_or_else(|p| p.into_inner());
        prometheus_client::encoding::text::encode(&mut text, &registry)
    };
    match encoded {
        Ok(()) => (
            StatusCode::OK,
            [(
                "content-type",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "text/plain")],
            e.to_string(),
        ),
    }
}

async fn healthz(State(t): State<Telemetry>) -> impl IntoResponse {
    let age = now() - t.last_pass.load(Ordering::Relaxed);
    if age <= t.stale_after.as_secs() as i64 {
        (StatusCode::OK, "ok".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no pass completed for {age} s"),
        )
    }
}
