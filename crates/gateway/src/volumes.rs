//! `Volumes`: opens exports by name (`VOLUME`, `VOLUME@SNAPSHOT`, `VOLUME~STALENESS`)
//! through the client crate, one shared, measured stack per open export. The NBD
//! gateway and the NFS front end (`floe-nfs`) both open volumes here, so both take
//! leases, honour write modes and count requests the same way.

use crate::export_name::ExportName;
use crate::measured;
use floe_blockdev::BlockDevice;
use floe_client::master::MasterClient;
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::Mutex;

pub struct Volumes {
    pub(crate) master: Arc<MasterClient>,
    /// Lease holder name shown to a second gateway; `None`: read-only, no leases.
    holder: Option<String>,
    /// Bytes of writes acknowledged early a volume may hold unretired.
    unretired_limit: u64,
    /// Stale reads' bound (read-only gateways).
    staleness: Option<Duration>,
    /// Open exports (name, writable); held weakly so a volume closes (and its lease
    /// is released) with its last user.
    open: Mutex<BTreeMap<(String, bool), Weak<dyn BlockDevice>>>,
    /// Exports whose NBD connections are being closed (their volume moves away).
    pub(crate) closing: floe_nbd::Closing,
    /// Volumes open for this gateway's transactions (`transactions`): no export of
    /// them opens meanwhile, since NBD writes would bypass the transactions' log and
    /// NBD reads would see a commit half applied.
    alone: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

/// A volume held for transactions alone; dropped, NBD clients may open it again.
pub(crate) struct Alone {
    volumes: Arc<Volumes>,
    volume: String,
}

impl Drop for Alone {
    fn drop(&mut self) {
        let removed = self.volumes.alone.lock().unwrap().remove(&self.volume);
        assert!(removed, "volume {} was held alone", self.volume);
    }
}

impl Volumes {
    /// `holder`: the name writable opens take leases in; `None` opens every volume
    /// read-only.
    pub fn new(
        master: Arc<MasterClient>,
        holder: Option<String>,
        unretired_limit: u64,
        staleness: Option<Duration>,
    ) -> Volumes {
        Volumes {
            master,
            holder,
            unretired_limit,
            staleness,
            open: Mutex::default(),
            closing: floe_nbd::Closing::default(),
            alone: Default::default(),
        }
    }

    /// Every export: each volume, and each of its snapshots as `VOLUME@SNAPSHOT`.
    pub async fn names(&self) -> Result<Vec<String>, String> {
        let volumes = self
            .master
            .list_volumes()
            .await
            .map_err(|e| e.to_string())?;
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

    /// Opens export `name`, writable (taking the volume's lease) if `writable` and this
    /// is not a read-only front end; an export already open is shared.
    pub async fn open(&self, name: &str, writable: bool) -> Result<Arc<dyn BlockDevice>, String> {
        let export = ExportName::parse(name)?;
        let key = (name.to_string(), writable);
        // Held across the master call so two users opening at once share a stack.
        let mut open = self.open.lock().await;
        let snapshot = matches!(export, ExportName::Snapshot { .. });
        if !snapshot && self.alone.lock().unwrap().contains(export.volume()) {
            return Err(format!(
                "volume {} serves transactions at this gateway (--tx-listen): no NBD \
                 client may open it until they end",
                export.volume()
            ));
        }
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

    /// Opens volume `name` writable for transactions alone (refused while an export
    /// of it other than a snapshot is open); no export of it opens until the
    /// returned guard is dropped.
    pub(crate) async fn open_alone(
        self: &Arc<Self>,
        name: &str,
    ) -> Result<(Arc<dyn BlockDevice>, Alone), String> {
        let Some(holder) = &self.holder else {
            return Err("this gateway is read-only: it serves no transactions".into());
        };
        let open = self.open.lock().await;
        let exported = open.iter().any(|((export, _), device)| {
            device.strong_count() > 0
                && !matches!(ExportName::parse(export), Ok(ExportName::Snapshot { .. }))
                && ExportName::parse(export).is_ok_and(|e| e.volume() == name)
        });
        if exported {
            return Err(format!(
                "volume {name} is open over NBD at this gateway: transactions need it alone"
            ));
        }
        if self.alone.lock().unwrap().contains(name) {
            return Err(format!(
                "volume {name} is closing after its transactions stopped; try again"
            ));
        }
        let access = floe_client::Access::Write {
            holder,
            unretired_limit: self.unretired_limit,
        };
        tracing::info!(volume = name, "opening a volume for transactions");
        let device = floe_client::open_volume(self.master.clone(), name, access).await?;
        let device: Arc<dyn BlockDevice> = Arc::new(measured::Measured::new(device, name));
        self.alone.lock().unwrap().insert(name.to_string());
        drop(open);
        let alone = Alone {
            volumes: self.clone(),
            volume: name.to_string(),
        };
        Ok((device, alone))
    }

    /// Takes writable export `name` out of the shared ones, if it is open: the next
    /// open of it builds a new stack (and takes a new lease), while the caller closes
    /// this one.
    pub(crate) async fn take(&self, name: &str) -> Option<Arc<dyn BlockDevice>> {
        let mut open = self.open.lock().await;
        open.remove(&(name.to_string(), true))
            .and_then(|device| device.upgrade())
    }

    /// Waits until no export is open: each one's last user is gone, and the requests
    /// it ran have let go of the volume.
    pub async fn all_closed(&self) {
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
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
