//! `floe nfs`: the cluster's volumes over NFSv3 (Strata, FAST'14 sections 4 and 6),
//! for hypervisors that keep disks on NFS datastores. One directory, the export `/floe`,
//! holds every volume as an image file of its size, and every snapshot as a
//! read-only `VOLUME@SNAPSHOT`.
//!
//! - `listing`: the directory, from the master's volume list (cached briefly: NFS
//!   clients ask for attributes all the time), with file ids that survive restarts.
//! - `files`: the `nfs3_server` file system over it: volumes open on first I/O through
//!   the gateway's [`floe_gateway::Volumes`] (the NBD gateway's leases, write modes
//!   and metrics), and close, releasing their leases, when idle or at exit.
//!
//! NFSv3 has no real authentication (AUTH_UNIX trusts what the client says), so the
//! CLI serves beyond loopback only when told to.

mod files;
mod listing;

use floe_client::master::MasterClient;
use nfs3_server::tcp::{NFSTcp, NFSTcpListener};
use std::sync::Arc;
use std::time::Duration;

/// The one export's path: `mount -t nfs HOST:/floe`, `nfs://HOST/floe/VOLUME`.
pub const EXPORT: &str = "/floe";

/// How the NFS front end serves its volumes.
pub struct Options {
    /// Bytes of writes acknowledged early (flush-epoch, log-commit) a volume may hold
    /// unretired; beyond, writes wait.
    pub unretired_limit: u64,
    /// A volume no request touched for this long is closed and its lease released.
    pub idle_close: Duration,
}

/// Serves NFSv3 (and its mount protocol, on the same port) on `listen` for the
/// volumes of the master at `master` until `shutdown`, then flushes and closes every
/// open volume.
pub async fn run(
    listen: &str,
    master: &str,
    options: Options,
    shutdown: impl std::future::Future,
) -> Result<(), String> {
    let master = Arc::new(MasterClient::new(master));
    let holder = format!("nfs {listen} (pid {})", std::process::id());
    let volumes =
        floe_gateway::Volumes::new(master.clone(), Some(holder), options.unretired_limit, None);
    let files = files::Files::new(listing::Listing::new(master), volumes);
    let closer = files.clone();
    let idle_close = options.idle_close;
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(idle_close / 4).await;
            closer.close_idle(idle_close).await;
        }
    });
    let mut listener = NFSTcpListener::bind(listen, files.clone())
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    // Not `/`: URL clients (libnfs, QEMU) split `nfs://HOST/EXPORT/FILE` at its last
    // slash, and a file at the root would leave them no export to mount.
    listener.with_export_name(EXPORT.trim_start_matches('/'));
    tracing::info!(
        listen,
        port = listener.get_listen_port(),
        export = EXPORT,
        "serving NFSv3 (mount and nfs on this port)"
    );
    tokio::select! {
        result = listener.handle_forever() => {
            result.map_err(|e| format!("NFS server on {listen} failed: {e}"))?;
        }
        _ = shutdown => {}
    }
    drop(listener);
    files.close_all().await;
    // Writes acknowledged early (flush-epoch and log-commit volumes) reach the
    // replicas before the process exits.
    floe_client::draining::drained().await;
    // A dropped lease is released by a call its drop spawned: answered, it spares
    // the next gateway waiting out the lease's term.
    floe_client::lease::releases_answered().await;
    Ok(())
}
