//! Plain mode: every change is logged to the data directory's write-ahead log, then
//! applied to the chunk files at commit; a checkpoint makes the chunk files durable
//! and restarts the log.

use crate::block_sums::Merge;
use crate::chunk_files::Files;
use crate::committer::{Change, Committer, Completions, BATCH_ROOM_BYTES};
use crate::error::{io_error, StoreError};
use crate::layout;
use crate::log_file::LogFile;
use crate::meta;
use crate::wal::{self, RecordHeader};
use std::path::Path;
use std::sync::Arc;

impl Committer {
    /// The plain log: re-applies every valid record after the header, then
    /// checkpoints.
    pub(crate) fn open_direct(
        path: &Path,
        files: Arc<Files>,
        checkpoint_bytes: u64,
    ) -> Result<Committer, StoreError> {
        let mut file = LogFile::open(&*files.disk, path, false, checkpoint_bytes)?;
        file.allocate(BATCH_ROOM_BYTES)?;
        let mut log = Committer::new(Vec::new(), files);
        log.adopt_unsynced_dirs()?;
        let mut replayed = 0;
        // Chunk files may hold data and checksums out of step since the last
        // checkpoint; replaying every change since restores both.
        file.scan(|header, _, data| {
            replayed += 1;
            log.apply(header, data, Merge::Trust)
        })?;
        log.next_seq = file.next_seq();
        log.skip_unsynced_seqs();
        log.logs.push(file);
        if replayed > 0 {
            tracing::info!(records = replayed, "replayed write-ahead log");
        }
        log.checkpoint()?;
        log.logs[0].write_directly(&*log.files.disk)?;
        Ok(log)
    }

    /// Plain mode: appends the batch, then applies it to the chunk files. With
    /// `may_defer`, a batch of unsynced writes is acknowledged unsynced (see
    /// [`crate::unsynced`]).
    pub(crate) fn commit(&mut self, batch: &mut Vec<Change>, may_defer: bool) -> Completions {
        if let Some(failed) = &self.failed {
            return Committer::fail_all(batch, StoreError::Io(failed.clone()));
        }
        // Appends stay in the log's allocated space: a full file system never fails
        // one, so a delete or trim always gets logged.
        let log = &self.logs[0];
        // A direct log pads its last sector (see `crate::direct_log`).
        if log.position + Committer::batch_bytes(batch) + wal::SECTOR_BYTES > log.allocated
            && log.position > wal::HEADER_BYTES
        {
            if let Err(e) = self.checkpoint() {
                tracing::error!("checkpoint failed: {e}");
                return Committer::fail_all(batch, e);
            }
        }
        let defer = may_defer && self.may_leave_unsynced(batch);
        if let Err(e) = self.append(batch, !defer) {
            // Nothing of the batch was acknowledged, but parts of it may be on disk
            // with valid checksums. A checkpoint moves the start sequence past them so
            // replay can never apply them; the sequence numbers are never reused. If
            // even that fails, the store stops taking changes (fail-stop).
            let mut message = format!("write-ahead log append failed: {e}");
            if let Err(c) = self.checkpoint() {
                message = format!("{message}; checkpoint failed too ({c}): restart the chunk server once the disk is fixed");
                self.failed = Some(message.clone());
            }
            tracing::error!("{message}");
            return Committer::fail_all(batch, io_error(&e, message));
        }
        if defer {
            return self.keep_unsynced(batch);
        }
        // The sync just made covers the unsynced changes logged before the batch.
        if let Err(e) = self.apply_unsynced() {
            return Committer::fail_all(batch, e);
        }
        self.synced();
        batch
            .drain(..)
            .map(|change| {
                let result = self.apply(&change.header, &change.data, Merge::Check);
                if let Err(e) = &result {
                    tracing::error!(chunk = ?change.header.chunk, "applying a logged change failed: {e}");
                }
                (change.done, result)
            })
            .collect()
    }

    /// A record's effect on the replica's state and its chunk file.
    fn apply(
        &mut self,
        header: &RecordHeader,
        data: &[u8],
        merge: Merge,
    ) -> Result<(), StoreError> {
        self.apply_meta(header);
        self.apply_file(header, data, merge)
    }

    /// Makes chunk files durable, then restarts the log after everything applied.
    pub(crate) fn checkpoint(&mut self) -> Result<(), StoreError> {
        // The log is about to forget them: into the chunk files, synced below.
        self.apply_unsynced()?;
        self.sync_dirty()?;
        if let Some(chain) = &self.files.chain {
            chain.persist()?;
        }
        // The log is about to forget the records that carry replication state.
        let metas = self.files.metas.lock().unwrap().clone();
        meta::save(
            &*self.files.disk,
            &self.files.dir.join(layout::META),
            &metas,
        )?;
        let next_seq = self.next_seq;
        self.logs[0].reset(next_seq)?;
        self.writeback.restarted();
        self.synced();
        Ok(())
    }
}
