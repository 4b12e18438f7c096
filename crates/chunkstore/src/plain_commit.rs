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
use crate::retained::capture::Retain;
use crate::wal::{self, RecordHeader, RECORD_HEADER_BYTES};
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
        let (mut retains, mut completions) = self.capture(batch);
        if batch.is_empty() {
            return completions;
        }
        // Appends stay in the log's allocated space: a full file system never fails
        // one, so a delete or trim always gets logged.
        let log = &self.logs[0];
        let retained_bytes: u64 = retains
            .iter()
            .flatten()
            .map(|r| (RECORD_HEADER_BYTES + r.header.data_len()) as u64)
            .sum();
        // A direct log pads its last sector (see `crate::direct_log`).
        if log.position + Committer::batch_bytes(batch) + retained_bytes + wal::SECTOR_BYTES
            > log.allocated
            && log.position > wal::HEADER_BYTES
        {
            if let Err(e) = self.checkpoint() {
                tracing::error!("checkpoint failed: {e}");
                completions.extend(Committer::fail_all(batch, e));
                return completions;
            }
        }
        let defer = may_defer && self.may_leave_unsynced(batch, &retains);
        if let Err(e) = self.append_retaining(batch, &mut retains, !defer) {
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
            completions.extend(Committer::fail_all(batch, io_error(&e, message)));
            return completions;
        }
        if defer {
            completions.extend(self.keep_unsynced(batch, retains));
            return completions;
        }
        // The sync just made covers the unsynced changes logged before the batch.
        if let Err(e) = self.apply_unsynced() {
            completions.extend(Committer::fail_all(batch, e));
            return completions;
        }
        self.synced();
        for (change, retains) in batch.drain(..).zip(retains) {
            let result = retains
                .iter()
                .try_for_each(|r| self.apply(&r.header, &r.data, Merge::Check))
                .and_then(|()| self.apply(&change.header, &change.data, Merge::Check));
            if let Err(e) = &result {
                tracing::error!(chunk = ?change.header.chunk, "applying a logged change failed: {e}");
            }
            completions.push((change.done, result));
        }
        completions
    }

    /// Appends the batch, each change after the old blocks it retains, as one write
    /// and (with `sync`) one fdatasync.
    fn append_retaining(
        &mut self,
        batch: &mut [Change],
        retains: &mut [Vec<Retain>],
        sync: bool,
    ) -> std::io::Result<()> {
        let mut records = Vec::new();
        for (change, retains) in batch.iter_mut().zip(retains.iter_mut()) {
            for retain in retains.iter_mut() {
                records.push((&mut retain.header, &retain.data[..]));
            }
            // Writes carry data, and so do the blocks a repair installs.
            let data = match change.header.data_len() {
                0 => &[][..],
                _ => &change.data[..],
            };
            records.push((&mut change.header, data));
        }
        self.append_records(records.into_iter(), sync)
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
