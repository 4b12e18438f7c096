//! The single-writer lease of a volume (URSA section 4.1): taken from the master before
//! the first write, renewed in the background, released when the volume closes. Its
//! generation goes into every change's version, so chunk servers refuse a writer whose
//! lease was taken over (fencing) even if it never notices itself.
//!
//! The holder also fences itself: it takes no write, and acknowledges none, once its
//! term may have run out: the term is timed from the *send* of the last grant or
//! renewal the master answered (the master's own term starts later, when it answers),
//! less [`DRIFT_MARGIN`]. A renewal that succeeds later, for the same generation,
//! makes the lease valid again: the master then has given the volume to no one else.

use crate::master::MasterClient;
use floe_blockdev::IoError;
use floe_protocol::connection::CallError;
use floe_protocol::{MasterRequest, MasterResponse, SnapshotEpochs, Status, VolumeLimits};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// How long opening a volume waits for another holder's lease to end (the master's
/// term and its drift margin).
const BUSY_WAIT_MAX: Duration = Duration::from_secs(6);
const BUSY_RETRY: Duration = Duration::from_millis(250);
/// The holder stops writing this long before its term ends by its own clock, for
/// clock drift and the time a write takes from the check to its acknowledgement.
pub const DRIFT_MARGIN: Duration = Duration::from_millis(500);
/// How long a write waits for a master that does not answer (restarting, or cut
/// off) before it fails: for its lease to be renewed, or for a chunk's allocation.
pub const MASTER_WAIT: Duration = Duration::from_secs(60);
/// How often a waiting write looks again.
const MASTER_RETRY: Duration = Duration::from_millis(100);

pub struct Lease {
    master: Arc<MasterClient>,
    volume: String,
    generation: u32,
    /// Until when writes may be issued and acknowledged; extended by each renewal.
    valid_until: Arc<Mutex<Instant>>,
    /// Why the lease was lost for good, once it is.
    lost: Arc<Mutex<Option<String>>>,
    /// The volume's rate limits as of the last grant or renewal.
    limits: watch::Receiver<VolumeLimits>,
    /// The volume's snapshot epochs as of the last grant or renewal.
    snapshots: watch::Receiver<SnapshotEpochs>,
    renewer: tokio::task::JoinHandle<()>,
    /// A change ended unsettled (failed or cancelled after it was sent): it may have
    /// left replicas unequal, so the lease is not released at close.
    unsettled: AtomicBool,
    /// Writes wait for a renewal (logged once a lapse).
    waiting: AtomicBool,
}

/// A change sent under a lease. Unless it ends [`InFlight::settled`] (committed, and
/// the replicas that missed it reported), the lease is not released at close but runs
/// out at the master, which then compares the volume's replicas.
pub struct InFlight<'a> {
    lease: &'a Lease,
    settled: bool,
}

impl InFlight<'_> {
    pub fn settled(mut self) {
        self.settled = true;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.lease.unsettled.store(true, Ordering::Relaxed);
        }
    }
}

impl Lease {
    /// Takes the lease of `volume` for `holder` (a name an operator can recognise in
    /// the refusal another gateway gets).
    pub async fn acquire(
        master: Arc<MasterClient>,
        volume: &str,
        holder: &str,
    ) -> Result<Lease, CallError> {
        let sent = Instant::now();
        let reply = master
            .call(MasterRequest::AcquireLease {
                name: volume.to_string(),
                holder: holder.to_string(),
                attempt: next_attempt(),
            })
            .await?;
        let MasterResponse::Lease {
            generation,
            term_ms,
            limits,
            snapshots,
        } = reply
        else {
            return Err(CallError::BadReply {
                address: master.address(),
                reason: format!("{reply:?}"),
            });
        };
        let valid_for = Duration::from_millis(term_ms).saturating_sub(DRIFT_MARGIN);
        let valid_until = Arc::new(Mutex::new(sent + valid_for));
        let lost = Arc::new(Mutex::new(None));
        let (limits_sender, limits) = watch::channel(limits);
        let (snapshots_sender, snapshots) = watch::channel(snapshots);
        let renewer = tokio::spawn(renew(
            Renewal {
                master: master.clone(),
                name: volume.to_string(),
                generation,
                every: Duration::from_millis(term_ms / 3),
                valid_for,
                valid_until: valid_until.clone(),
                lost: lost.clone(),
            },
            limits_sender,
            snapshots_sender,
        ));
        tracing::info!(volume, generation, limits = ?*limits.borrow(), "lease acquired");
        Ok(Lease {
            master,
            volume: volume.to_string(),
            generation,
            valid_until,
            lost,
            limits,
            snapshots,
            renewer,
            unsettled: AtomicBool::new(false),
            waiting: AtomicBool::new(false),
        })
    }

    /// Marks a change as sent: see [`InFlight`].
    pub fn change_in_flight(&self) -> InFlight<'_> {
        InFlight {
            lease: self,
            settled: false,
        }
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

    /// The volume's snapshot epochs, updated at each renewal.
    pub fn snapshots(&self) -> watch::Receiver<SnapshotEpochs> {
        self.snapshots.clone()
    }

    pub fn volume(&self) -> &str {
        &self.volume
    }

    pub fn master(&self) -> &Arc<MasterClient> {
        &self.master
    }

    /// Fails once the lease is known lost, and while it may have run out (until a
    /// renewal succeeds). Called before a write is issued and again before it is
    /// acknowledged.
    pub fn check(&self) -> Result<(), IoError> {
        if let Some(why) = &*self.lost.lock().unwrap() {
            return Err(IoError::Io(why.clone()));
        }
        let valid_until = *self.valid_until.lock().unwrap();
        let now = Instant::now();
        if now >= valid_until {
            return Err(IoError::Io(format!(
                "volume {}: lease generation {} ran out {:.1} s ago: the master has not renewed it (unreachable?) and may give the volume to another gateway; writes resume if a renewal succeeds",
                self.volume,
                self.generation,
                (now - valid_until).as_secs_f64()
            )));
        }
        Ok(())
    }

    /// [`Lease::check`], but while the lease has only run out (the master did not
    /// answer its renewals: a renewal may still succeed, as after a master restart),
    /// waits for one, up to [`MASTER_WAIT`]. For a change that has not taken its
    /// version yet: nothing of it is sent while it waits.
    pub async fn wait_valid(&self) -> Result<(), IoError> {
        let deadline = Instant::now() + MASTER_WAIT;
        loop {
            match self.check() {
                Ok(()) => {
                    if self.waiting.swap(false, Ordering::Relaxed) {
                        tracing::info!(volume = %self.volume, "lease renewed: writes go on");
                    }
                    return Ok(());
                }
                Err(e) if self.lost.lock().unwrap().is_some() || Instant::now() >= deadline => {
                    return Err(e)
                }
                // Logged once per lapse, not once per waiting write.
                Err(_) if !self.waiting.swap(true, Ordering::Relaxed) => tracing::warn!(
                    volume = %self.volume,
                    generation = self.generation,
                    "the lease ran out: the master has not renewed it (unreachable?); writes wait for a renewal (at most {MASTER_WAIT:?})"
                ),
                Err(_) => {}
            }
            tokio::time::sleep(MASTER_RETRY).await;
        }
    }

    /// Records that a chunk server fenced us off.
    pub fn fenced(&self, why: &str) -> IoError {
        self.give_up(format!(
            "volume {}: lease generation {} was taken over by another gateway: {why}",
            self.volume, self.generation
        ))
    }

    /// Gives the lease up for good: a change was abandoned in flight when the lease
    /// ran out, so later changes of this generation would follow a version no
    /// replica may hold. Reopening the volume takes a new generation.
    pub fn abandon(&self, why: IoError) -> IoError {
        self.give_up(format!(
            "{why}; a change was in flight, so this volume must be reopened to write again"
        ))
    }

    fn give_up(&self, message: String) -> IoError {
        // No more renewals: the lease runs out at the master, which then audits the
        // replicas and lets another gateway have the volume.
        self.renewer.abort();
        let mut lost = self.lost.lock().unwrap();
        if lost.is_none() {
            tracing::error!("{message}");
            *lost = Some(message.clone());
        }
        IoError::Io(message)
    }
}

/// What the renewer needs of its lease.
struct Renewal {
    master: Arc<MasterClient>,
    name: String,
    generation: u32,
    every: Duration,
    /// The term less the drift margin.
    valid_for: Duration,
    valid_until: Arc<Mutex<Instant>>,
    lost: Arc<Mutex<Option<String>>>,
}

async fn renew(
    renewal: Renewal,
    limits: watch::Sender<VolumeLimits>,
    snapshots: watch::Sender<SnapshotEpochs>,
) {
    let Renewal {
        master,
        name,
        generation,
        every,
        valid_for,
        valid_until,
        lost,
    } = renewal;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let request = MasterRequest::RenewLease {
            name: name.clone(),
            generation,
        };
        let sent = Instant::now();
        // Bounded by the renewal period, so a master that stops answering is asked
        // again on schedule.
        match master.call_within(request, every).await {
            Ok(MasterResponse::Lease {
                limits: new,
                snapshots: epochs,
                ..
            }) => {
                snapshots.send_if_modified(|current| {
                    let later = current.later(epochs);
                    std::mem::replace(current, later) != later
                });
                {
                    let mut until = valid_until.lock().unwrap();
                    *until = (*until).max(sent + valid_for);
                }
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
            // The master may be restarting: writes stop when the term runs out, and
            // resume with the next renewal that succeeds.
            Err(e) => tracing::warn!(volume = %name, "cannot renew the lease: {e}"),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.renewer.abort();
        // A lease given up, or one a change ended unsettled under, is not released:
        // it runs out at the master, which then compares the replicas that change may
        // have left unequal.
        if self.lost.lock().unwrap().is_some() || self.unsettled.load(Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let master = self.master.clone();
        let request = MasterRequest::ReleaseLease {
            name: self.volume.clone(),
            generation: self.generation,
        };
        // Counted until answered, so a gateway that stops or upgrades releases its
        // leases first (`releases_answered`).
        let releasing = Releasing::new();
        runtime.spawn(async move {
            let _releasing = releasing;
            match tokio::time::timeout(RELEASE_LIMIT, master.call(request)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::warn!("releasing a lease failed (it expires by itself): {e}")
                }
                Err(_) => tracing::warn!("no answer to a lease release (it expires by itself)"),
            }
        });
    }
}

/// How long a release may wait for the master before the lease is left to expire.
const RELEASE_LIMIT: Duration = Duration::from_secs(5);

/// Releases of this process still waiting for the master's answer.
static RELEASING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static RELEASED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Counts one release while it is out.
struct Releasing;

impl Releasing {
    fn new() -> Releasing {
        RELEASING.fetch_add(1, Ordering::SeqCst);
        Releasing
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        RELEASING.fetch_sub(1, Ordering::SeqCst);
        RELEASED.notify_waiters();
    }
}

/// Waits until every lease this process dropped was released at the master (or
/// its release gave up, after `RELEASE_LIMIT`): a gateway stopping or upgrading
/// waits for this, so the next holder need not wait for the lease to run out.
pub async fn releases_answered() {
    loop {
        let released = RELEASED.notified();
        if RELEASING.load(Ordering::SeqCst) == 0 {
            return;
        }
        released.await;
    }
}

/// A name for one attempt to take a lease, unique across this process's attempts and
/// (by the clock at its first) across its restarts.
fn next_attempt() -> u64 {
    static FIRST: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let first = *FIRST.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |t| t.as_nanos() as u64)
    });
    let count = COUNT.fetch_add(1, Ordering::Relaxed);
    first.wrapping_add(count).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_protocol::transport::{CallFuture, Transport};
    use floe_protocol::{ConnectionPool, Request, Response};
    use std::sync::atomic::{AtomicBool, Ordering};

    const TERM: Duration = Duration::from_secs(5);

    /// A master that grants generation 1 and renews it, except while `cut`, when it
    /// never answers (packets dropped).
    #[derive(Default)]
    struct Master {
        cut: AtomicBool,
    }

    impl Transport for Master {
        fn call<'a>(&'a self, _address: &'a str, _request: Request) -> CallFuture<'a> {
            let cut = self.cut.load(Ordering::SeqCst);
            Box::pin(async move {
                if cut {
                    std::future::pending::<()>().await;
                }
                Ok(Response::Master(MasterResponse::Lease {
                    generation: 1,
                    term_ms: TERM.as_millis() as u64,
                    limits: VolumeLimits::default(),
                    snapshots: SnapshotEpochs::default(),
                }))
            })
        }

        fn forget(&self, _address: &str) {}
    }

    #[tokio::test(start_paused = true)]
    async fn a_holder_cut_off_from_the_master_stops_before_its_term_ends() {
        let transport = Arc::new(Master::default());
        let pool = ConnectionPool::over(transport.clone());
        let master = Arc::new(MasterClient::over("master", pool));
        let start = Instant::now();
        let lease = Lease::acquire(master, "demo", "gateway a").await.unwrap();
        transport.cut.store(true, Ordering::SeqCst);

        tokio::time::sleep_until(start + TERM - DRIFT_MARGIN - Duration::from_millis(100)).await;
        assert!(lease.check().is_ok(), "stopped early");
        tokio::time::sleep_until(start + TERM - DRIFT_MARGIN).await;
        let refused = lease.check().expect_err("wrote on after the term ran out");
        assert!(refused.to_string().contains("ran out"), "{refused}");

        // The master answers again, and has given the volume to no one else.
        transport.cut.store(false, Ordering::SeqCst);
        tokio::time::sleep(TERM / 3 * 2).await;
        assert!(lease.check().is_ok(), "a renewal did not resume writes");
    }

    /// A gateway cut off from the master refuses a new NBD connection instead of
    /// hanging it.
    #[tokio::test(start_paused = true)]
    async fn opening_fails_in_time_when_the_master_does_not_answer() {
        let transport = Arc::new(Master::default());
        transport.cut.store(true, Ordering::SeqCst);
        let master = Arc::new(MasterClient::over(
            "master",
            ConnectionPool::over(transport),
        ));
        let limit = crate::master::CALL_TIMEOUT * 2;
        let attempt = tokio::time::timeout(limit, Lease::acquire(master, "demo", "gateway a"));
        match attempt.await {
            Ok(Err(CallError::Closed(why))) => assert!(why.contains("no answer"), "{why}"),
            Ok(Err(other)) => panic!("unexpected error {other}"),
            Ok(Ok(_)) => panic!("granted by a master that does not answer"),
            Err(_) => panic!("still waiting after {limit:?}"),
        }
    }
}
