//! `--metrics-listen` of the server processes: where each serves Prometheus metrics
//! (`floe_metrics`), on by default at its own address with the port + 10, so the
//! demo's and the tests' port layouts (a block of ten, then its metrics) never meet.

use std::net::{SocketAddr, ToSocketAddrs};

/// A process's default metrics port is its listen port plus this.
pub const PORT_OFFSET: u16 = 10;

#[derive(clap::Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics, or `off`. Default: the listen
    /// address with its port + 10 (skipped, with a warning, if that port is taken).
    #[arg(long, value_name = "ADDR|off")]
    metrics_listen: Option<String>,
}

/// The default metrics address of a process listening on `listen`.
pub fn default_address(listen: &str) -> Option<SocketAddr> {
    let mut address = listen.to_socket_addrs().ok()?.next()?;
    address.set_port(address.port().checked_add(PORT_OFFSET)?);
    Some(address)
}

impl MetricsArgs {
    /// Starts serving metrics for a process listening on `listen`. An address given
    /// and not served fails the process; the default one only warns: metrics are
    /// not worth a storage server that does not start.
    pub async fn start(&self, listen: &str) -> Result<(), String> {
        let address = match self.metrics_listen.as_deref() {
            Some("off") => return Ok(()),
            Some(given) => {
                let address = given
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or_else(|| format!("--metrics-listen {given}: not an address"))?;
                return serve(address).await;
            }
            None => default_address(listen),
        };
        let served = match address {
            Some(address) => serve(address).await,
            None => Err(format!("no metrics port follows {listen}")),
        };
        if let Err(e) = served {
            tracing::warn!("{e}; running without metrics (see --metrics-listen)");
        }
        Ok(())
    }
}

async fn serve(address: SocketAddr) -> Result<(), String> {
    floe_metrics::exporter::serve(address).await?;
    tracing::info!("metrics at http://{address}/metrics");
    Ok(())
}
