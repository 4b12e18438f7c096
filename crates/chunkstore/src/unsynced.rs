//! Writes acknowledged before their log record is synced (the write-back and fast
//! write modes: the chunk server groups the fdatasync, and a sync request covers
//! everything acknowledged before it).
//!
//! Plain mode: a batch of nothing but unsynced writes is appended to the log
//! without an fdatasync and acknowledged; its records are kept here, with their
//! space reservations, and reach the chunk files only once the log is synced past
//! them: a chunk file never holds bytes whose record a power cut may drop, so after a
//! cut replay restores a prefix of the log and each replica is exactly its version. A
//! read of a chunk with unsynced writes syncs first (reads come from the chunk files).
//! The next durable change, a [`crate::Store::sync`], a checkpoint, or the interval
//! (see [`crate::Tuning::sync_interval`]) syncs them all.
//!
//! Hybrid mode: a batch of nothing but unsynced writes that all go to the journal is
//! appended there without an fdatasync and indexed at once (reads take journal data
//! in place). Replay leaves their journal data alone until it is synced
//! (`Journals::durable`); unsynced records live in one journal at a time (a batch
//! bound elsewhere, or one that must be durable in another journal, syncs them
//! first); the meta file is saved only after they are synced.
//!
//! Bounds: at most [`UNSYNCED_BYTES_MAX`] of data, and no more records than one batch
//! may hold ([`BATCH_RECORDS_MAX`]), so a crash leaves intact records past a torn one
//! only within the sequence numbers [`Committer::skip_unsynced_seqs`] skips.

use crate::block_sums::Merge;
use crate::committer::{Change, Committer, Completions, BATCH_RECORDS_MAX};
use crate::error::StoreError;
use crate::retained::capture::Retain;
use crate::space::Reservation;
use crate::wal::{Kind, RecordHeader};
use bytes::Bytes;
use floe_protocol::ChunkId;
use std::collections::BTreeSet;
use std::sync::Mutex;

/// Data held unsynced before the committer syncs regardless.
pub(crate) const UNSYNCED_BYTES_MAX: usize = 32 << 20;

/// A change in the log, not yet synced nor in its chunk file.
pub(crate) struct Unsynced {
    header: RecordHeader,
    data: Bytes,
    _reservation: Reservation,
}

/// Chunks with unsynced changes: what a read asks before it trusts a chunk file.
#[derive(Default)]
pub(crate) struct UnsyncedChunks(Mutex<BTreeSet<ChunkId>>);

impl UnsyncedChunks {
    pub(crate) fn holds(&self, chunk: ChunkId) -> bool {
        self.0.lock().unwrap().contains(&chunk)
    }

    pub(crate) fn any(&self) -> bool {
        !self.0.lock().unwrap().is_empty()
    }

    fn add(&self, chunk: ChunkId) {
        self.0.lock().unwrap().insert(chunk);
    }

    fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
}

impl Committer {
    /// Whether `batch` (with the old blocks it retains) may be appended without a
    /// sync: only unsynced writes, and within the bounds of what may stay unsynced.
    pub(crate) fn may_leave_unsynced(&self, batch: &[Change], retains: &[Vec<Retain>]) -> bool {
        let retains = retains.iter().flatten();
        let bytes: usize = self.unsynced.iter().map(|u| u.data.len()).sum::<usize>()
            + batch.iter().map(|c| c.data.len()).sum::<usize>()
            + retains.clone().map(|r| r.data.len()).sum::<usize>();
        batch
            .iter()
            .all(|c| !c.sync && c.header.kind == Kind::Write)
            && self.unsynced.len() + batch.len() + retains.count() <= BATCH_RECORDS_MAX
            && bytes <= UNSYNCED_BYTES_MAX
    }

    /// Acknowledges a batch just appended without a sync: the replicas' versions
    /// move on now, the chunk files and retained blocks once the log is synced.
    pub(crate) fn keep_unsynced(
        &mut self,
        batch: &mut Vec<Change>,
        retains: Vec<Vec<Retain>>,
    ) -> Completions {
        batch
            .drain(..)
            .zip(retains)
            .map(|(change, retains)| {
                for retain in retains {
                    self.hold_unsynced(retain.header, retain.data, Reservation::none());
                }
                self.apply_meta(&change.header);
                self.hold_unsynced(change.header, change.data, change._reservation);
                (change.done, Ok(()))
            })
            .collect()
    }

    /// The changes held unsynced, in log order.
    pub(crate) fn held_unsynced(&self) -> impl Iterator<Item = (&RecordHeader, &Bytes)> {
        self.unsynced.iter().map(|u| (&u.header, &u.data))
    }

    /// Keeps an acknowledged, unsynced change until the next sync.
    pub(crate) fn hold_unsynced(
        &mut self,
        header: RecordHeader,
        data: Bytes,
        reservation: Reservation,
    ) {
        self.files.unsynced.add(header.chunk);
        self.unsynced.push(Unsynced {
            header,
            data,
            _reservation: reservation,
        });
    }

    /// Syncs the log, then applies the unsynced changes to their chunk files.
    pub(crate) fn sync_unsynced(&mut self) -> Result<(), StoreError> {
        if let Some(failed) = &self.failed {
            return Err(StoreError::Io(failed.clone()));
        }
        // Not `self.unsynced`: a checkpoint that failed may have applied them to
        // chunk files it could not sync; the log still holds them.
        if !self.files.unsynced.any() {
            return Ok(());
        }
        let log = match self.hybrid() {
            true => self.journals().unsynced_journal(),
            false => Some(0),
        };
        if let Some(log) = log {
            if let Err(e) = self.logs[log].file.sync_data() {
                // Which of the acknowledged records the disk kept is unknown: stop
                // taking changes (fail-stop); a restart replays what the log holds.
                return Err(self.fail(format!("syncing the write-ahead log failed: {e}")));
            }
        }
        self.apply_unsynced()?;
        self.synced();
        Ok(())
    }

    /// Applies the unsynced changes to their chunk files; the caller makes them
    /// durable (a log sync before, or a checkpoint's sync of the files after) and
    /// then calls [`Committer::synced`].
    pub(crate) fn apply_unsynced(&mut self) -> Result<(), StoreError> {
        let unsynced = std::mem::take(&mut self.unsynced);
        if self.hybrid() {
            // Indexed at commit, read from the journals in place: replay applies them.
            return Ok(());
        }
        for change in unsynced {
            if let Err(e) = self.apply_file(&change.header, &change.data, Merge::Check) {
                // Acknowledged and in the log: a restart replays it.
                return Err(self.fail(format!(
                    "applying a synced change to chunk {:?} failed: {e}",
                    change.header.chunk
                )));
            }
        }
        Ok(())
    }

    /// Every change acknowledged so far is durable. Until then reads of their chunks
    /// and [`crate::Store::sync`] ask the committer (which fails once the store has
    /// failed), rather than trust chunk files.
    pub(crate) fn synced(&self) {
        self.files.unsynced.clear();
        if let Some(journals) = &self.files.journals {
            journals.all_synced();
        }
    }

    /// Stops the store taking changes, with `message` as every later change's error.
    fn fail(&mut self, message: String) -> StoreError {
        let message = format!("{message}: restart the chunk server once the disk is fixed");
        tracing::error!("{message}");
        self.failed = Some(message.clone());
        StoreError::Io(message)
    }
}
