//! The single-writer lease of a volume (URSA section 4.1): taken from the master before
//! the first write, renewed in the background, released when the volume closes. Its
//! generation goes into every change's version, so chunk servers refuse a writer whose
//! lease was taken over (fencing) even if it never notices itself.

use crate::master::MasterClient;
use floe_blockdev::IoError;
use floe_protocol::connection::CallError;
use floe_protocol::{ControlRequest, ControlResponse, Status, VolumeLimits};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// How long opening a volume waits for another holder's lease to end.
const BUSY_WAIT_MAX: Duration = Duration::from_secs(6);
const BUSY_RETRY: Duration = Duration::from_millis(250);

pub struct Lease {
    master: Arc<MasterClient>,
    volume: String,
    generation: u32,
    /// Why the lease was lost, once it is.
    lost: Arc<Mutex<Option<String>>>,
    /// The volume's rate limits as of the last grant or renewal.
    limits: watch::Receiver<VolumeLimits>,
    renewer: tokio::task::JoinHandle<()>,
}

impl Lease {
    /// Takes the lease of `volume` for `holder` (a name an operator can recognise in
    /// the refusal another gateway gets).
    pub async fn acquire(
        master: Arc<MasterClient>,
        volume: &str,
        holder: &str,
    ) -> Result<Lease, CallError> {
        let reply = master
            .call(ControlRequest::AcquireLease {
                name: volume.to_string(),
                holder: holder.to_string(),
            })
            .await?;
        let ControlResponse::Lease {
            generation,
            term_ms,
            limits,
        } = reply
        else {
            return Err(CallError::BadReply {
                address: master.address().to_string(),
                reason: format!("{reply:?}"),
            });
        };
        let lost = Arc::new(Mutex::new(None));
        let (limits_sender, limits) = watch::channel(limits);
        let renewer = tokio::spawn(renew(
            master.clone(),
            volume.to_string(),
            generation,
            Duration::from_millis(term_ms / 3),
            lost.clone(),
            limits_sender,
        ));
        tracing::info!(volume, generation, limits = ?*limits.borrow(), "lease acquired");
        Ok(Lease {
            master,
            volume: volume.to_string(),
            generation,
            lost,
            limits,
            renewer,
        })
    }

    /// Like [`Lease::acquire`], but waits out a lease that is about to expire (its
    /// holder was killed, or the master restarted and gives old leases a last term)
    /// for up to a term before giving up with the holder's name.
    pub async fn acquire_waiting(
        master: Arc<MasterClient>,
        volume: &str,
        holder: &str,
    ) -> Result<Lease, String> {
        let give_up = tokio::time::Instant::now() + BUSY_WAIT_MAX;
        loop {
            match Lease::acquire(master.clone(), volume, holder).await {
                Ok(lease) => return Ok(lease),
                Err(CallError::Remote {
                    status: Status::Busy,
                    ..
                }) if tokio::time::Instant::now() < give_up => tokio::time::sleep(BUSY_RETRY).await,
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// The volume's rate limits, updated at each renewal.
    pub fn limits(&self) -> watch::Receiver<VolumeLimits> {
        self.limits.clone()
    }

    /// Fails once the lease is known lost.
    pub fn check(&self) -> Result<(), IoError> {
        match &*self.lost.lock().unwrap() {
            None => Ok(()),
            Some(why) => Err(IoError::Io(why.clone())),
        }
    }

    /// Records that a chunk server fenced us off.
    pub fn fenced(&self, why: &str) -> IoError {
        let message = format!(
            "volume {}: lease generation {} was taken over by another gateway: {why}",
            self.volume, self.generation
        );
        let mut lost = self.lost.lock().unwrap();
        if lost.is_none() {
            tracing::error!("{message}");
            *lost = Some(message.clone());
        }
        IoError::Io(message)
    }
}

async fn renew(
    master: Arc<MasterClient>,
    name: String,
    generation: u32,
    every: Duration,
    lost: Arc<Mutex<Option<String>>>,
    limits: watch::Sender<VolumeLimits>,
) {
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        let request = ControlRequest::RenewLease {
            name: name.clone(),
            generation,
        };
        match master.call(request).await {
            Ok(ControlResponse::Lease { limits: new, .. }) => {
                let changed =
                    limits.send_if_modified(|current| std::mem::replace(current, new) != new);
                if changed {
                    tracing::info!(volume = %name, limits = ?new, "rate limits changed");
                }
            }
            Ok(other) => tracing::warn!(volume = %name, "unexpected renewal reply {other:?}"),
            Err(CallError::Remote {
                status: Status::Fenced | Status::NotFound,
                message,
            }) => {
                tracing::error!(volume = %name, generation, "lease lost: {message}");
                *lost.lock().unwrap() = Some(message);
                return;
            }
            // The master may be restarting; chunk servers still fence us if another
            // writer takes over meanwhile.
            Err(e) => tracing::warn!(volume = %name, "cannot renew the lease: {e}"),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.renewer.abort();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let master = self.master.clone();
        let request = ControlRequest::ReleaseLease {
            name: self.volume.clone(),
            generation: self.generation,
        };
        runtime.spawn(async move {
            if let Err(e) = master.call(request).await {
                tracing::warn!("releasing a lease failed (it expires by itself): {e}");
            }
        });
    }
}
