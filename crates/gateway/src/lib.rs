//! The gateway: exports Floe volumes over NBD. Each export name is a volume name
//! (or one of its read-only forms, see `export_name`); a volume opened by several
//! NBD connections at once is one shared client stack, so every connection sees the
//! same chunk allocations. Every stack is measured on top (`measured`: the
//! per-volume request metrics `/metrics` serves). With TLS, NBD clients may start TLS
//! (and must, unless on loopback or plain NBD is allowed), and an access list says
//! who opens what. [`Volumes`] opens and shares the stacks; the NFS front end
//! (`floe-nfs`) opens volumes through it too. A gateway upgrades in place without
//! dropping its clients (`upgrade`), and hands a volume's session to another
//! gateway, or takes one, when the master says so (`sessions`). With a transaction
//! listener it runs block transactions for clients in other processes
//! (`transactions`), on volumes it then holds alone.

mod access;
mod export_name;
pub mod measured;
mod sessions;
mod transactions;
pub mod upgrade;
mod volumes;

pub use access::AccessList;
use export_name::ExportName;
pub use floe_nbd::{Parked, PskKeys, Stop};
pub use volumes::Volumes;

use async_trait::async_trait;
use floe_blockdev::BlockDevice;
use floe_client::master::MasterClient;
use floe_nbd::{Client, Closing, Exports, Refusal, Security};
use floe_protocol::tls::Identity;
use std::sync::Arc;
use tokio::net::TcpListener;

struct VolumeExports {
    volumes: Arc<Volumes>,
    /// Who may open what; `None`: anyone the transport lets in, writable.
    access: Option<AccessList>,
}

impl VolumeExports {
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
        self.volumes.names().await
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
            floe_client::snapshot::diff::changed(self.volumes.master.clone(), volume, since, until);
        match changed.await {
            Ok(ranges) => Some(ranges),
            Err(e) => {
                tracing::warn!(export, context, "meta context refused: {e}");
                None
            }
        }
    }

    async fn open(&self, name: &str, client: &Client) -> Result<Arc<dyn BlockDevice>, Refusal> {
        let writable = self.grant(&ExportName::parse(name)?, client)?;
        // The NBD client sees only "export not available": the reason goes here.
        self.volumes.open(name, writable).await.map_err(|e| {
            tracing::warn!(export = name, "cannot open the export: {e}");
            Refusal::from(e)
        })
    }

    fn closing(&self) -> Closing {
        self.volumes.closing.clone()
    }
}

/// The meta context naming what changed since a snapshot (like QEMU's
/// `qemu:dirty-bitmap:NAME`): state 1 where the volume changed.
const CHANGED_SINCE: &str = "floe:changed-since:";

/// How a gateway serves its volumes.
pub struct Options {
    /// This gateway's name at the master (`floe volume move-session --to NAME`).
    pub name: String,
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
    /// Where to serve block transactions (`floe_protocol::transaction`), if anywhere.
    pub tx_listener: Option<TcpListener>,
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
        name,
        read_only,
        unretired_limit,
        staleness,
        access,
        psk,
        allow_plain,
        tx_listener,
    } = options;
    let address = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let holder = format!("gateway {name} ({address}, pid {})", std::process::id());
    let volumes = Arc::new(Volumes::new(
        Arc::new(MasterClient::new(master)),
        (!read_only).then(|| holder.clone()),
        unretired_limit,
        staleness,
    ));
    let transactions = tx_listener.map(|listener| {
        let service = transactions::Transactions::new(volumes.clone(), access.clone());
        tokio::spawn(service.clone().serve(listener));
        service
    });
    let exports = Arc::new(VolumeExports {
        volumes: volumes.clone(),
        access,
    });
    let security = Security {
        tls: floe_protocol::tls::installed().map(|tls| tls.nbd.clone()),
        psk,
        allow_plain,
    };
    let (tls, psk) = (security.tls.is_some(), security.psk.is_some());
    tracing::info!(%name, %address, master, read_only, ?staleness, tls, psk, allow_plain, "gateway serving NBD");
    loop {
        // A read-only gateway holds no leases: no session moves to or from it.
        let sessions = (!read_only).then(|| {
            let me = sessions::Identity {
                name: name.clone(),
                address: address.clone(),
                holder: holder.clone(),
            };
            tokio::spawn(sessions::follow(volumes.clone(), transactions.clone(), me))
        });
        let served = floe_nbd::serve(
            listener,
            exports.clone(),
            security.clone(),
            std::mem::take(&mut resumed),
            stop(),
        );
        let served = served.await;
        // Moves under way are abandoned: the next image polls again.
        if let Some(task) = sessions {
            task.abort();
        }
        let Some(handover) = served else { break };
        // The next image opens the volumes again: each must be closed first, its
        // acknowledged writes retired and its lease released. Transactions end
        // (their connections drop with the old image).
        if let Some(transactions) = &transactions {
            transactions
                .give_up_all("the gateway upgrades in place")
                .await;
        }
        exports.volumes.all_closed().await;
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
    if let Some(transactions) = &transactions {
        transactions.give_up_all("the gateway stops").await;
    }
    // Writes acknowledged early (flush-epoch and log-commit volumes) reach the
    // replicas first; then the leases are released.
    floe_client::draining::drained().await;
    floe_client::lease::releases_answered().await;
}
