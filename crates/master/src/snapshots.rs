//! Snapshots (see `floe_protocol::snapshot`): create, confirm, delete, and which delta
//! chunks no snapshot reads any more (`reclaim` frees them).
//!
//! Creating a snapshot hands out the volume's next epoch. While a writer holds the
//! volume's lease the snapshot is *pending* until that writer has switched to the
//! epoch (it learns it with its next renewal, waits for its older writes to end, and
//! confirms): only then does the snapshot stop changing, and it can be read.

use crate::lease::{lease_key, LEASE_DRIFT_MARGIN};
use crate::state::{put, volume_key, State};
use crate::{Failure, Master, Reply};
use floe_protocol::snapshot::{
    check_snapshot_name, split_index, SNAPSHOT_CONFIRM_WAIT, SNAPSHOT_EPOCH_MAX,
};
use floe_protocol::{MasterResponse, Snapshot, SnapshotEpochs, SnapshotReaders, Status, Volume};
use std::time::Duration;
use tokio::time::Instant;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl State {
    /// The generation of the volume's lease while it is alive.
    pub(crate) fn live_lease(&self, volume_id: u64) -> Option<u32> {
        let lease = self.leases.get(&volume_id).filter(|l| !l.revoked)?;
        let expires = lease.expires?;
        (expires + LEASE_DRIFT_MARGIN > Instant::now()).then_some(lease.generation)
    }

    /// The generation of the volume's lease while its holder may still write: one
    /// neither released nor revoked. A lease that ran out counts, as its holder may
    /// renew it and write on (in the epoch it last knew).
    pub(crate) fn writing_lease(&self, volume_id: u64) -> Option<u32> {
        let lease = self.leases.get(&volume_id).filter(|l| !l.revoked)?;
        lease.expires.map(|_| lease.generation)
    }

    /// Whether lease `generation` of the volume is the one its writer holds.
    fn holds(&self, volume_id: u64, generation: u32) -> bool {
        self.leases
            .get(&volume_id)
            .is_some_and(|l| l.generation == generation && !l.revoked)
    }

    /// Volumes with a snapshot still waiting for a writer whose lease ran out.
    fn lapsed_with_pending_snapshots(&self) -> Vec<String> {
        let now = Instant::now();
        self.volumes
            .values()
            .filter(|v| v.snapshots.iter().any(|s| !s.ready))
            .filter(|v| {
                self.leases.get(&v.id).is_some_and(|l| {
                    !l.revoked && l.expires.is_some_and(|e| e + LEASE_DRIFT_MARGIN < now)
                })
            })
            .map(|v| v.spec.name.clone())
            .collect()
    }

    /// What the volume's writer stamps and preserves.
    pub(crate) fn snapshot_epochs(volume: &Volume) -> SnapshotEpochs {
        SnapshotEpochs {
            epoch: volume.snapshot_epoch,
            preserving: !volume.snapshots.is_empty(),
        }
    }

    /// What chunk servers free retained blocks by: every volume that ever had a
    /// snapshot (the others retained nothing).
    pub(crate) fn snapshot_readers(&self) -> Vec<SnapshotReaders> {
        self.volumes
            .values()
            .filter(|volume| volume.snapshot_epoch > 0)
            .map(SnapshotReaders::of)
            .collect()
    }

    fn snapshot_of<'a>(volume: &'a Volume, snapshot: &str) -> Result<&'a Snapshot, Failure> {
        volume
            .snapshots
            .iter()
            .find(|s| s.name == snapshot)
            .ok_or_else(|| {
                (
                    Status::NotFound,
                    format!("volume {} has no snapshot {snapshot:?}", volume.spec.name),
                )
            })
    }

    /// Snapshot `snapshot` of volume `name`, ready to read: a pending one whose
    /// writer is gone (released, or revoked when it ran out) no longer changes either.
    pub(crate) fn readable_snapshot(
        &self,
        name: &str,
        snapshot: &str,
    ) -> Result<Snapshot, Failure> {
        let volume = self.volume(name)?;
        let found = State::snapshot_of(&volume, snapshot)?;
        if !found.ready && self.writing_lease(volume.id).is_some() {
            return Err((
                Status::Busy,
                format!(
                    "snapshot {name}@{snapshot} is not taken yet: the gateway writing the \
                     volume has not switched to it"
                ),
            ));
        }
        Ok(found.clone())
    }

    /// Delta chunks no snapshot reads: those of epochs below the oldest snapshot (a
    /// reader of snapshot `s` reads epochs `s` and up), all of them once none is
    /// left, but none a live writer may still preserve into: from the epoch it last
    /// confirmed on (all, if it confirmed none since this master started).
    pub(crate) fn unread_deltas(&self, volume: &Volume) -> Vec<u64> {
        let oldest = volume.snapshots.iter().map(|s| s.epoch).min();
        let writing = self
            .writing_lease(volume.id)
            .map(|_| self.writer_epochs.get(&volume.id).copied().unwrap_or(0));
        let Some(chunks) = self.chunks.get(&volume.id) else {
            return Vec::new();
        };
        chunks
            .keys()
            .copied()
            .filter(|index| {
                let (epoch, _) = split_index(*index);
                epoch > 0 && oldest.is_none_or(|o| epoch < o) && writing.is_none_or(|w| epoch < w)
            })
            .collect()
    }
}

impl Master {
    pub(crate) async fn create_snapshot(&self, name: &str, snapshot: &str) -> Reply {
        check_snapshot_name(snapshot).map_err(|e| (Status::BadRequest, e))?;
        let volume = self
            .put_volume(|state| {
                let mut volume = state.volume(name)?;
                if volume.snapshots.iter().any(|s| s.name == snapshot) {
                    return Err((
                        Status::AlreadyExists,
                        format!("snapshot {name}@{snapshot} already exists"),
                    ));
                }
                if volume.snapshot_epoch >= SNAPSHOT_EPOCH_MAX {
                    return Err((
                        Status::NoSpace,
                        format!("volume {name} used up its {SNAPSHOT_EPOCH_MAX} snapshot epochs"),
                    ));
                }
                volume.snapshot_epoch += 1;
                volume.snapshots.push(Snapshot {
                    name: snapshot.to_string(),
                    epoch: volume.snapshot_epoch,
                    created_ms: now_ms(),
                    size_bytes: volume.spec.size_bytes,
                    ready: state.writing_lease(volume.id).is_none(),
                });
                Ok(volume)
            })
            .await?;
        tracing::info!(volume = %name, snapshot, epoch = volume.snapshot_epoch, "snapshot created");
        self.snapshots_changed.notify_waiters();
        let deadline = Instant::now() + SNAPSHOT_CONFIRM_WAIT;
        loop {
            let confirmed = self.snapshot_confirmed.notified();
            match self.state().readable_snapshot(name, snapshot) {
                Ok(taken) => return Ok(MasterResponse::Snapshot(taken)),
                Err((Status::Busy, message)) if Instant::now() < deadline => {
                    tracing::debug!("{message}");
                }
                Err(e) => return Err(e),
            }
            let _ = tokio::time::timeout_at(deadline, confirmed).await;
        }
    }

    /// Takes the snapshots that wait for a writer whose lease ran out: the lease is
    /// revoked with them (stored together), so its holder, if alive, can neither
    /// renew it nor write on in the epoch before them.
    pub(crate) async fn take_lapsed_snapshots(&self) {
        let lapsed = self.state().lapsed_with_pending_snapshots();
        for name in lapsed {
            let taken = self
                .change(
                    |state| {
                        if !state.lapsed_with_pending_snapshots().contains(&name) {
                            return Err((Status::Busy, "taken meanwhile".into()));
                        }
                        let mut volume = state.volume(&name)?;
                        let mut lease = state.leases[&volume.id].clone();
                        lease.revoked = true;
                        for snapshot in &mut volume.snapshots {
                            snapshot.ready = true;
                        }
                        let ops = vec![
                            put(lease_key(volume.id), &lease),
                            put(volume_key(&name), &volume),
                        ];
                        Ok((ops, (volume, lease)))
                    },
                    |state, (volume, lease)| {
                        state.leases.insert(volume.id, lease);
                        state.volumes.insert(name.clone(), volume);
                    },
                )
                .await;
            match taken {
                Ok(()) => {
                    tracing::warn!(volume = %name, "lease revoked: it ran out while snapshots waited for its writer, which were taken without it");
                    self.snapshot_confirmed.notify_waiters();
                }
                Err((Status::Busy, _)) => {}
                Err((_, e)) => {
                    tracing::warn!(volume = %name, "taking snapshots whose writer is gone: {e}")
                }
            }
        }
    }

    /// The volume's snapshot epochs once they differ from `known`, or after `wait`.
    pub(crate) async fn watch_snapshot_epochs(
        &self,
        name: &str,
        generation: u32,
        known: SnapshotEpochs,
        wait: Duration,
    ) -> Reply {
        let epochs = crate::long_poll(&self.snapshots_changed, wait, || {
            let state = self.state();
            let volume = state.volume(name)?;
            if !state.holds(volume.id, generation) {
                return Err((
                    Status::Fenced,
                    format!("the lease of volume {name} (generation {generation}) was lost"),
                ));
            }
            let now = State::snapshot_epochs(&volume);
            Ok((now, now != known))
        });
        Ok(MasterResponse::SnapshotEpochs(epochs.await?))
    }

    /// The writer of lease `generation` stamps `epoch`: every snapshot up to it is
    /// taken.
    pub(crate) async fn confirm_snapshot_epoch(
        &self,
        name: &str,
        generation: u32,
        epoch: u32,
    ) -> Reply {
        let volume = self
            .put_volume(|state| {
                let mut volume = state.volume(name)?;
                if !state.holds(volume.id, generation) {
                    return Err((
                        Status::Fenced,
                        format!("the lease of volume {name} (generation {generation}) was lost"),
                    ));
                }
                if epoch > volume.snapshot_epoch {
                    return Err((
                        Status::BadRequest,
                        format!(
                        "epoch {epoch} of volume {name} was never handed out (the newest is {})",
                        volume.snapshot_epoch
                    ),
                    ));
                }
                for snapshot in &mut volume.snapshots {
                    snapshot.ready |= snapshot.epoch <= epoch;
                }
                Ok(volume)
            })
            .await?;
        self.state().writer_epochs.insert(volume.id, epoch);
        self.snapshot_confirmed.notify_waiters();
        Ok(MasterResponse::Done)
    }

    pub(crate) async fn delete_snapshot(&self, name: &str, snapshot: &str) -> Reply {
        self.put_volume(|state| {
            let mut volume = state.volume(name)?;
            State::snapshot_of(&volume, snapshot)?;
            if let Some(clone) = state.clone_of(name, Some(snapshot)) {
                return Err((
                    Status::Busy,
                    format!("snapshot {name}@{snapshot} is the parent of clone {clone}"),
                ));
            }
            volume.snapshots.retain(|s| s.name != snapshot);
            Ok(volume)
        })
        .await?;
        tracing::info!(volume = %name, snapshot, "snapshot deleted");
        self.snapshots_changed.notify_waiters();
        // Its delta chunks are freed in the background (`reclaim`).
        Ok(MasterResponse::Done)
    }
}
