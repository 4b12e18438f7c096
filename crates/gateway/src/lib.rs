//! The gateway: exports Floe volumes over NBD. Each export name is a volume name
//! (or one of its read-only forms, see `export_name`); a volume opened by several
//! NBD connections at once is one shared client stack, so every connection sees the
//! same chunk allocations. Every stack is measured on top (`measured`: the
//! per-volume request metrics `/metrics` serves). With TLS, NBD clients may start TLS
//! (and must, unless on loopback or plain NBD is allowed), and an access list says
//! who opens what. A gateway upgrades in place without dropping its clients
//! (`upgrade`).

mod access;
mod export_name;
pub mod measured;
pub mod upgrade;

pub use access::AccessList;
use export_name::ExportName;
pub use floe_nbd::{Parked, PskKeys, Stop};

use async_trait::async_trait;
use floe_blockdev::BlockDevice;
use floe_client::master::MasterClient;
use floe_nbd::{Client, Exports, Refusal, Security};
use floe_protocol::tls::Identity;
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use tokio::net::TcpListener;
use tokio::sync::Mutex;

struct VolumeExports {
    master: Arc<MasterClient>,
    /// Lease holder name shown to a second gateway; `None`: read-only, no leases.
    holder: Option<String>,
    /// Bytes of writes acknowledged early a volume may hold unretired.
    unretired_limit: u64,
    /// Stale reads' bound (read-only gateways).
    staleness: Option<std::time::Duration>,
    /// Who may open what; `None`: anyone the transport lets in, writable.
    access: Option<AccessList>,
    /// Open exports (name, writable); held weakly so a volume closes with its last
    /// connection.
    open: Mutex<BTreeMap<(String, bool), Weak<dyn BlockDevice>>>,
}

impl VolumeExports {
    /// Waits until no export is open: the last connection of each is gone, and the
    /// requests it ran have let go of the volume.
    async fn all_closed(&self) {
        loop {
            let open = self
                .open
                .lock()
                .await
                .values()
                .any(|d| d.strong_count() > 0);
            if !open {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Whether `client` may open `export`, and writable; `Err` says why not.
    fn grant(&self, export: &ExportName<'_>, client: &Client) -> Result<bool, Refusal> {
        let Some(access) = &self.access else {
            return Ok(true);
        };
        let identity = match (&client.certificate, &client.psk_identity) {
            (Some(certificate), _) => Some(Identity::of(certificate)?.name),
            (None, identity) => identity.clone(),
        };
        let who = match &identity {
            Some(name) => format!("client {name}"),
            None => "a client without a certificate or key".to_string(),
        };
        access
            .grant(identity.as_deref(), export.volume())
            .ok_or_else(|| {
                Refusal::Denied(format!(
                    "{who} may not open {} (the gateway's access list)",
                    export.volume()
                ))
            })
    }
}

#[async_trait]
impl Exports for VolumeExports {
    async fn list(&self) -> Result<Vec<String>, String> {
        let volumes = self
            .master
            .list_volumes()
            .await
            .map_err(|e| e.to_string())?;
        // Snapshots are exports of their own: VOLUME@SNAPSHOT, read-only.
        Ok(volumes
            .into_iter()
            .flat_map(|v| {
                let snapshots = v
                    .snapshots
                    .iter()
                    .map(|s| format!("{}@{}", v.spec.name, s.name));
                std::iter::once(v.spec.name.clone()).chain(snapshots.collect::<Vec<_>>())
            })
            .collect())
    }

    /// `floe:changed-since:SNAPSHOT`: what changed since the volume's snapshot, up to
    /// now (or, on a `VOLUME@LATER` export, up to that snapshot).
    async fn meta_context(&self, export: &str, context: &str) -> Option<Vec<(u64, u64)>> {
        let since = context.strip_prefix(CHANGED_SINCE)?;
        let (volume, until) = match ExportName::parse(export).ok()? {
            ExportName::Snapshot { volume, snapshot } => (volume, Some(snapshot)),
            other => (other.volume(), None),
        };
        let changed =
            floe_client::snapshot::diff::changed(self.master.clone(), volume, since, until);
        match changed.await {
            Ok(ranges) => Some(ranges),
            Err(e) => {
                tracing::warn!(export, context, "meta context refused: {e}");
                None
            }
        }
    }

    async fn open(&self, name: &str, client: &Client) -> Result<Arc<dyn BlockDevice>, Refusal> {
        let export = ExportName::parse(name)?;
        let writable = self.grant(&export, client)?;
        let key = (name.to_string(), writable);
        // Held across the master call so two connections opening at once share a stack.
        let mut open = self.open.lock().await;
        if let Some(device) = open.get(&key).and_then(Weak::upgrade) {
            return Ok(device);
        }
        let device = match export {
            ExportName::Snapshot { volume, snapshot } => {
                tracing::info!(volume, snapshot, "opening a snapshot");
                floe_client::open_snapshot(self.master.clone(), volume, snapshot).await?
            }
            ExportName::Stale { volume, staleness } => {
                tracing::info!(volume, ?staleness, "opening for stale reads");
                let access = floe_client::Access::Stale { staleness };
                floe_client::open_volume(self.master.clone(), volume, access).await?
            }
            ExportName::Volume(volume) => {
                let holder = self.holder.as_ref().filter(|_| writable);
                let access = match holder {
                    Some(holder) => floe_client::Access::Write {
                        holder,
                        unretired_limit: self.unretired_limit,
                    },
                    None => match self.staleness {
                        Some(staleness) => floe_client::Access::Stale { staleness },
                        None => floe_client::Access::Read,
                    },
                };
                tracing::info!(volume, "opening a volume");
                floe_client::open_volume(self.master.clone(), volume, access).await?
            }
        };
        let device: Arc<dyn BlockDevice> = Arc::new(measured::Measured::new(device, name));
        open.retain(|_, d| d.strong_count() > 0);
        open.insert(key, Arc::downgrade(&device));
        Ok(device)
    }
}

/// The meta context naming what changed since a snapshot (like QEMU's
/// `qemu:dirty-bitmap:NAME`): state 1 where the volume changed.
const CHANGED_SINCE: &str = "floe:changed-since:";

/// How a gateway serves its volumes.
pub struct Options {
    /// Export volumes read-only: no leases.
    pub read_only: bool,
    /// Bytes of writes acknowledged early (flush-epoch, log-commit) a volume may hold
    /// unretired; beyond, writes wait.
    pub unretired_limit: u64,
    /// Read-only exports read each chunk from the replica of least cost, at most this
    /// far behind the volume (stale reads); `None`: as a writer would.
    pub staleness: Option<std::time::Duration>,
    /// Who may open which volume over NBD; `None`: anyone the transport lets in.
    pub access: Option<AccessList>,
    /// Pre-shared keys for NBD clients that use TLS-PSK.
    pub psk: Option<Arc<PskKeys>>,
    /// Serve plain NBD to clients not on loopback (TLS is offered to all when the
    /// gateway has a certificate).
    pub allow_plain: bool,
}

/// Serves NBD on `listener` (and the connections a previous image of this process
/// handed over, `resumed`) for volumes of the master at `master`, until `stop`
/// says to shut down. A writable gateway takes each volume's lease while it has the
/// volume open, so a second gateway cannot open it for writing meanwhile; a
/// read-only one needs none. When `stop` says [`Stop::Handover`], the gateway
/// upgrades in place (see `upgrade`), and serves on if it cannot.
pub async fn run<F>(
    mut listener: TcpListener,
    mut resumed: Vec<Parked>,
    master: &str,
    options: Options,
    mut stop: impl FnMut() -> F,
) where
    F: std::future::Future<Output = Stop>,
{
    let Options {
        read_only,
        unretired_limit,
        staleness,
        access,
        psk,
        allow_plain,
    } = options;
    let address = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let exports = Arc::new(VolumeExports {
        master: Arc::new(MasterClient::new(master)),
        holder: (!read_only).then(|| format!("gateway {address} (pid {})", std::process::id())),
        unretired_limit,
        staleness,
        access,
        open: Mutex::default(),
    });
    let security = Security {
        tls: floe_protocol::tls::installed().map(|tls| tls.nbd.clone()),
        psk,
        allow_plain,
    };
    let (tls, psk) = (security.tls.is_some(), security.psk.is_some());
    tracing::info!(%address, master, read_only, ?staleness, tls, psk, allow_plain, "gateway serving NBD");
    loop {
        let served = floe_nbd::serve(
            listener,
            exports.clone(),
            security.clone(),
            std::mem::take(&mut resumed),
            stop(),
        );
        let Some(handover) = served.await else { break };
        // The next image opens the volumes again: each must be closed first, its
        // acknowledged writes retired and its lease released.
        exports.all_closed().await;
        floe_client::draining::drained().await;
        floe_client::lease::releases_answered().await;
        let error = upgrade::exec(&handover);
        tracing::error!("upgrade failed: {error}; serving on");
        listener = match TcpListener::from_std(handover.listener) {
            Ok(listener) => listener,
            Err(e) => {
                tracing::error!("cannot serve on the listening socket: {e}");
                break;
            }
        };
        resumed = handover.connections;
    }
    // Writes acknowledged early (flush-epoch and log-commit volumes) reach the
    // replicas first; then the leases are released.
    floe_client::draining::drained().await;
    floe_client::lease::releases_answered().await;
}
