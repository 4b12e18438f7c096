//! The process-wide Prometheus recorder and its `/metrics` endpoint
//! (`metrics-exporter-prometheus`'s HTTP listener, on the process's own runtime).

use metrics_exporter_prometheus::PrometheusBuilder;
use std::net::SocketAddr;
use std::time::Duration;

/// Upper bounds (seconds) of every latency histogram's buckets: 50 µs to 10 s, six a
/// decade, so that `histogram_quantile` interpolates within at most a 1.7x step.
pub const LATENCY_BUCKETS_SECONDS: [f64; 33] = [
    50e-6, 70e-6, //
    100e-6, 150e-6, 200e-6, 300e-6, 500e-6, 700e-6, //
    1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 7e-3, //
    10e-3, 15e-3, 20e-3, 30e-3, 50e-3, 70e-3, //
    0.1, 0.15, 0.2, 0.3, 0.5, 0.7, //
    1.0, 1.5, 2.0, 3.0, 5.0, 7.0, //
    10.0,
];

/// How long a restarted process waits for its killed predecessor's metrics port.
const BIND_RETRY_FOR: Duration = Duration::from_secs(5);

/// Installs the recorder and serves `/metrics` on `address` from the current tokio
/// runtime. Call once, before the process records anything: handles taken earlier
/// stay no-ops.
pub async fn serve(address: SocketAddr) -> Result<(), String> {
    wait_until_free(address).await?;
    PrometheusBuilder::new()
        .with_http_listener(address)
        .set_buckets(&LATENCY_BUCKETS_SECONDS)
        .and_then(PrometheusBuilder::install)
        .map_err(|e| format!("cannot serve metrics on {address}: {e}"))
}

/// Waits until `address` can be bound: the exporter binds it once, without retrying.
async fn wait_until_free(address: SocketAddr) -> Result<(), String> {
    let give_up = tokio::time::Instant::now() + BIND_RETRY_FOR;
    loop {
        match std::net::TcpListener::bind(address) {
            Ok(_) => return Ok(()),
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < give_up =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => return Err(format!("cannot serve metrics on {address}: {e}")),
        }
    }
}
