//! Volume leases: one writer per volume (`AcquireLease`, `RenewLease`,
//! `ReleaseLease`). A lease's generation is stored with the lease counter, so no two
//! grants share one, and chunk servers learn it with heartbeats to fence older
//! writers; its term is kept in memory only.

use crate::state::{put, State};
use crate::{Master, Reply};
use floe_protocol::{MasterResponse, Status, Volume};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::time::Instant;

/// A volume lease lasts this long unless renewed; holders renew every third of it.
pub const LEASE_TERM: Duration = Duration::from_secs(5);
/// Another gateway gets an unreleased lease only this long after its term ran out
/// here: the holder times its term from before it sent the renewal, so this covers
/// clock drift and pauses between the two processes (the holder keeps a margin too).
pub const LEASE_DRIFT_MARGIN: Duration = Duration::from_millis(500);

/// A volume's single-writer lease.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Lease {
    pub(crate) generation: u32,
    pub(crate) holder: String,
    /// The holder's name for the request that took it (0: none given).
    #[serde(default)]
    pub(crate) attempt: u64,
    #[serde(skip)]
    pub(crate) expires: Option<Instant>,
    /// Its running out unreleased queued an audit already.
    #[serde(skip)]
    pub(crate) audited: bool,
    /// It ran out while snapshots waited for its holder, which were then taken
    /// without it: renewing it would let the holder write on in an older epoch.
    #[serde(default)]
    pub(crate) revoked: bool,
}

pub(crate) fn lease_key(volume_id: u64) -> String {
    format!("lease/{volume_id:016x}")
}

fn granted(volume: &Volume, generation: u32, state: &State) -> Reply {
    Ok(MasterResponse::Lease {
        generation,
        term_ms: LEASE_TERM.as_millis() as u64,
        limits: state.limits(volume).0,
        snapshots: State::snapshot_epochs(volume),
    })
}

impl State {
    /// The live lease this very attempt already took (its request came again), if
    /// any: its term starts again.
    fn granted_before(&mut self, name: &str, holder: &str, attempt: u64) -> Option<Reply> {
        let volume = self.volume(name).ok()?;
        let lease = self.leases.get_mut(&volume.id)?;
        let alive = !lease.revoked && lease.expires.is_some_and(|e| e > Instant::now());
        if !alive || attempt == 0 || (lease.holder.as_str(), lease.attempt) != (holder, attempt) {
            return None;
        }
        lease.expires = Some(Instant::now() + LEASE_TERM);
        let generation = lease.generation;
        Some(granted(&volume, generation, self))
    }

    /// A new lease of volume `name` for `holder`, unless another holder's is alive.
    fn grant_lease(
        &self,
        name: &str,
        holder: String,
        attempt: u64,
    ) -> Result<(Volume, Lease), crate::Failure> {
        let volume = self.volume(name)?;
        if let Some(lease) = self.leases.get(&volume.id) {
            // The same gateway process may take its own lease again: it reopened the
            // volume after closing it, and the new generation fences the old stack.
            let alive = lease
                .expires
                .filter(|_| !lease.revoked)
                .and_then(|e| (e + LEASE_DRIFT_MARGIN).checked_duration_since(Instant::now()));
            if let Some(left) = alive.filter(|_| lease.holder != holder) {
                return Err((
                    Status::Busy,
                    format!(
                        "volume {name} is in use by {} (lease generation {}); it becomes free when that gateway closes it or {:.1} s after its last renewal",
                        lease.holder,
                        lease.generation,
                        left.as_secs_f64()
                    ),
                ));
            }
        }
        let generation = self.last_lease + 1;
        if generation > u32::MAX as u64 {
            return Err((Status::Io, "lease generations exhausted".into()));
        }
        let lease = Lease {
            generation: generation as u32,
            holder,
            attempt,
            expires: None,
            audited: false,
            revoked: false,
        };
        Ok((volume, lease))
    }

    /// Whether a new lease of volume `name` is being stored.
    fn lease_being_granted(&self, name: &str) -> bool {
        let volume = self.volumes.get(name);
        volume.is_some_and(|v| self.lease_in_flight == Some(v.id))
    }

    /// Extends the term of `name`'s lease at `generation`.
    fn renew_lease(&mut self, name: &str, generation: u32) -> Reply {
        let volume = self.volume(name)?;
        match self.leases.get_mut(&volume.id) {
            Some(lease) if lease.generation == generation && !lease.revoked => {
                lease.expires = Some(Instant::now() + LEASE_TERM);
                // Renewed after it ran out (its holder was cut off): it writes on, and
                // may again leave a replica behind unreported if it runs out again.
                lease.audited = false;
                granted(&volume, generation, self)
            }
            other => Err((
                Status::Fenced,
                format!(
                    "the lease of volume {name} (generation {generation}) was lost{}",
                    other.map_or(String::new(), |l| if l.generation == generation {
                        " (it ran out, and snapshots were taken without its holder)".into()
                    } else {
                        format!(" to {} (generation {})", l.holder, l.generation)
                    })
                ),
            )),
        }
    }
}

impl State {
    /// Queues an audit of each volume whose lease ran out unreleased: its holder may
    /// have died, or given up, between a change reaching a majority and its report
    /// of the replica that missed it.
    pub(crate) fn audit_lapsed_leases(&mut self) {
        let now = Instant::now();
        for (volume_id, lease) in &mut self.leases {
            let lapsed = lease.expires.is_some_and(|e| e + LEASE_DRIFT_MARGIN < now);
            if lapsed && !lease.audited {
                lease.audited = true;
                // An audit queued for an older writer (a restarted master queues
                // one) would skip the chunks this one wrote: audit up to the newest.
                let queued = self.audits.entry(*volume_id).or_insert(lease.generation);
                *queued = (*queued).max(lease.generation);
            }
        }
    }
}

impl Master {
    pub(crate) async fn acquire_lease(&self, name: &str, holder: String, attempt: u64) -> Reply {
        // Not `change`: the grant must also stop renewals of the old lease while it is
        // being stored.
        let _serial = self.changes.lock().await;
        let (volume, lease, unreleased) = {
            let mut state = self.state();
            if let Some(again) = state.granted_before(name, &holder, attempt) {
                return again;
            }
            // A volume moving to another gateway is that gateway's alone.
            self.sessions.lock().unwrap().admit(&state, name, &holder)?;
            let (volume, lease) = state.grant_lease(name, holder, attempt)?;
            state.lease_in_flight = Some(volume.id);
            // A holder that never released may have died mid-change.
            let unreleased = state
                .leases
                .get(&volume.id)
                .is_some_and(|l| l.expires.is_some());
            (volume, lease, unreleased)
        };
        let stored = self
            .store(vec![
                put("counter/lease".into(), &(lease.generation as u64)),
                put(lease_key(volume.id), &lease),
            ])
            .await;
        let mut state = self.state();
        state.lease_in_flight = None;
        stored?;
        let generation = lease.generation;
        // Generations fence older writers: one handed out again would let two write.
        assert!(
            generation as u64 > state.last_lease,
            "lease generation {generation} handed out after {}",
            state.last_lease
        );
        state.last_lease = generation as u64;
        tracing::info!(volume = %name, generation, holder = %lease.holder, "lease granted");
        self.sessions
            .lock()
            .unwrap()
            .granted(volume.id, &lease.holder, generation);
        self.sessions_changed.notify_waiters();
        if unreleased {
            state.audits.insert(volume.id, generation - 1);
        }
        // The term runs from now, when the grant is stored: never shorter than the
        // holder, which counts from its request, believes.
        state.leases.insert(
            volume.id,
            Lease {
                expires: Some(Instant::now() + LEASE_TERM),
                ..lease
            },
        );
        granted(&volume, generation, &state)
    }

    pub(crate) async fn renew_lease(&self, name: &str, generation: u32) -> Reply {
        {
            let mut state = self.state();
            if !state.lease_being_granted(name) {
                return state.renew_lease(name, generation);
            }
        }
        // A new lease of this volume is being stored: renewing the old one meanwhile
        // would let two holders believe they hold it. A grant holds the changes until
        // it is stored or failed, so once they are ours none is in flight (one
        // cancelled midway may have left its mark).
        let _serial = self.changes.lock().await;
        let mut state = self.state();
        state.lease_in_flight = None;
        state.renew_lease(name, generation)
    }

    pub(crate) fn release_lease(&self, name: &str, generation: u32) -> Reply {
        let mut state = self.state();
        let volume = state.volume(name)?;
        if let Some(lease) = state.leases.get_mut(&volume.id) {
            if lease.generation == generation {
                // The generation stays known (chunk servers keep fencing older
                // writers); only the term ends.
                lease.expires = None;
                tracing::info!(volume = %name, generation, "lease released");
                self.sessions_changed.notify_waiters();
            }
        }
        Ok(MasterResponse::Done)
    }
}
