//! Hybrid mode's commit (see [`crate::journal`]): small aligned writes go to a journal
//! only; every other change goes to the chunk files first, durably, then its record
//! to the journal. Journals nothing points into any more are reset here too.
//!
//! Old blocks a change retains for a snapshot (`crate::retained`) go to their
//! sidecars with the chunk-file changes, in batch order (after a release or a
//! volume's deletion earlier in the batch), and durably before the change itself
//! overwrites the chunk file (a crash between the two would otherwise leave the
//! replica without the old block, and a resent change would retain the new one) or
//! its record is journaled. So, unlike plain mode, no `Retain` record is journaled;
//! nor are a repair's `Retain`, `Release`, `Trim` and `Forget` changes replayed:
//! like chunk-file changes they are applied, durably, before their records.

use crate::block_sums::Merge;
use crate::chunk_files::Files;
use crate::committer::{Change, Committer, Completions};
use crate::error::{io_error, StoreError};
use crate::journal::{Journals, JOURNAL_LARGE_WRITE_BYTES_MAX, JOURNAL_WRITE_BYTES_MAX};
use crate::layout;
use crate::log_file::LogFile;
use crate::meta;
use crate::retained::capture::Retain;
use crate::wal::{self, Kind, RecordHeader, RECORD_HEADER_BYTES, SECTOR_BYTES};
use floe_protocol::ChunkId;
use std::sync::Arc;

impl Committer {
    /// The journals: scans them all, applies their records in sequence order to the
    /// index and the replicas' states, and resets the ones with nothing left to replay.
    pub(crate) fn open_journals(
        mut logs: Vec<LogFile>,
        files: Arc<Files>,
    ) -> Result<Committer, StoreError> {
        // Records older than any header's start were reclaimed (see
        // `journals_to_reset`), even where a crash cut the resets short.
        let floor = logs
            .iter()
            .filter_map(|log| log.start_seq)
            .max()
            .unwrap_or(1);
        let mut records = Vec::new();
        let journals = files.journals.as_ref().expect("hybrid mode has journals");
        for (j, log) in logs.iter_mut().enumerate() {
            log.scan(|header, data_at, data| {
                if header.seq >= floor {
                    records.push((*header, j, data_at));
                    if header.kind == Kind::Write {
                        // The record's checksum just verified the data.
                        journals.note_sums(j, data_at, data);
                    }
                }
                Ok(())
            })?;
        }
        records.sort_by_key(|(header, _, _)| header.seq);
        assert!(
            records.windows(2).all(|w| w[0].0.seq < w[1].0.seq),
            "a sequence number is in two journals"
        );
        let mut log = Committer::new(logs, files);
        log.adopt_unsynced_dirs()?;
        log.skip_unsynced_seqs();
        log.active = records.last().map_or(0, |&(_, j, _)| j);
        for (header, j, data_at) in &records {
            log.record_effects(header, *j, *data_at)?;
        }
        log.rehash_cut_short(&records)?;
        if !records.is_empty() {
            tracing::info!(
                records = records.len(),
                "scanned the journals; replay resumes"
            );
        }
        for j in 0..log.logs.len() {
            if log.logs[j].start_seq.is_none() {
                // Not the next sequence: a start above other journals' records would
                // make the next scan skip them.
                log.logs[j].reset(floor)?;
            }
            let used = log.logs[j].position - wal::HEADER_BYTES;
            log.journals().set_used(j, used);
            // Synced batches bypass the page cache (see `crate::direct_log`); replay
            // and reads then take journal data from the device.
            log.logs[j].write_directly(&*log.files.disk)?;
        }
        log.reclaim()?;
        Ok(log)
    }

    /// The chunk-file changes of the batch a crash cut short (its intents are newer
    /// than every other record) may have left data and checksums out of step:
    /// rehashed from the data, durably, before anything reads them.
    fn rehash_cut_short(
        &mut self,
        records: &[(RecordHeader, usize, u64)],
    ) -> Result<(), StoreError> {
        let newest = records
            .iter()
            .filter(|(h, ..)| h.kind != Kind::Intent)
            .map(|(h, ..)| h.seq)
            .max()
            .unwrap_or(0);
        let cut_short: Vec<&RecordHeader> = records
            .iter()
            .map(|(h, ..)| h)
            .filter(|h| h.kind == Kind::Intent && h.seq > newest)
            .collect();
        for header in &cut_short {
            self.rehash(header);
        }
        if !cut_short.is_empty() {
            tracing::info!(
                changes = cut_short.len(),
                "rehashed the chunk-file changes a stop cut short"
            );
        }
        self.sync_dirty()
    }

    /// Makes the checksums of an intent's range those of the data there.
    fn rehash(&mut self, intent: &RecordHeader) {
        let rehashed = self
            .files
            .get(intent.chunk, false)
            .and_then(|file| match file {
                Some(file) => file.rehash(intent.offset, intent.length),
                None => Ok(()),
            });
        match rehashed {
            Ok(()) => {
                self.dirty_files.insert(intent.chunk);
            }
            // Left out of step, the blocks read as corrupt here and are healed from
            // other replicas.
            Err(e) => tracing::error!(chunk = ?intent.chunk, "rehashing a change failed: {e}"),
        }
    }

    /// The journal a batch of `bytes` goes to: the active ssd journal if it fits, else
    /// the least-filled ssd journal that fits, else the hdd's own.
    fn choose_journal(&self, bytes: u64) -> Option<usize> {
        let local = self.logs.len() - 1;
        let fits = |j: usize| self.logs[j].position + bytes <= self.logs[j].quota;
        if self.active != local && fits(self.active) {
            return Some(self.active);
        }
        (0..local)
            .filter(|&j| fits(j))
            .min_by_key(|&j| self.logs[j].position)
            .or_else(|| fits(local).then_some(local))
    }

    /// Small aligned writes go to a journal only; every other change goes to the
    /// chunk files first, durably, then its record to the journal. With `may_defer`,
    /// a batch of unsynced writes that all go to the journal is acknowledged unsynced
    /// (see [`crate::unsynced`]).
    pub(crate) fn commit_journaled(
        &mut self,
        batch: &mut Vec<Change>,
        may_defer: bool,
    ) -> Completions {
        if let Some(failed) = &self.failed {
            return Committer::fail_all(batch, StoreError::Io(failed.clone()));
        }
        let (retains, mut completions) = self.capture(batch);
        completions.extend(self.commit_retaining(batch, retains, may_defer));
        completions
    }

    /// [`Committer::commit_journaled`] with the old blocks each change retains.
    fn commit_retaining(
        &mut self,
        batch: &mut Vec<Change>,
        retains: Vec<Vec<Retain>>,
        may_defer: bool,
    ) -> Completions {
        // Kept blocks are synced with the batch, never left for later.
        let may_defer = may_defer && retains.iter().all(Vec::is_empty);
        let local = self.logs.len() - 1;
        let (ssd_used, ssd_quota) = self.journals().ssd_usage();
        let journal_max = match ssd_used * 2 <= ssd_quota {
            true => JOURNAL_LARGE_WRITE_BYTES_MAX,
            false => JOURNAL_WRITE_BYTES_MAX,
        };
        let journaled = |h: &RecordHeader| {
            h.kind == Kind::Write
                && h.length <= journal_max
                && h.offset.is_multiple_of(SECTOR_BYTES)
                && h.length.is_multiple_of(SECTOR_BYTES)
        };
        // Upper bounds: a header and its padding per record, an intent per record,
        // plus the data.
        let headers = (batch.len() as u64) * (2 * RECORD_HEADER_BYTES as u64 + SECTOR_BYTES);
        let data: u64 = batch
            .iter()
            .filter(|c| journaled(&c.header))
            .map(|c| c.header.length)
            .sum();
        let (target, to_journal) = match self.choose_journal(headers + data) {
            Some(j) => (j, true),
            // No room for the data anywhere: everything bypasses; the hdd's own
            // journal takes the records past its quota if it must.
            None => (self.choose_journal(headers).unwrap_or(local), false),
        };
        if target != self.active {
            let (from, to) = (&self.logs[self.active].path, &self.logs[target].path);
            match target == local {
                true => tracing::info!(
                    from = %from.display(),
                    to = %to.display(),
                    "journal overflow: the ssd journals are full, switching to the hdd's own"
                ),
                // Segments of a journal directory take writes in turn (routine).
                false => {
                    tracing::debug!(from = %from.display(), to = %to.display(), "switching journals")
                }
            }
            self.active = target;
        }
        for change in batch.iter_mut() {
            if change.header.kind == Kind::Write && !(to_journal && journaled(&change.header)) {
                change.header.kind = Kind::Bypass;
            }
        }
        bypass_under_later_edges(batch);
        let unsynced_in = self.journals().unsynced_journal();
        let defer = may_defer
            && to_journal
            && unsynced_in.is_none_or(|j| j == target)
            && self.may_leave_unsynced(batch, &[]);
        // This batch's records must not outlive unsynced ones a power cut may drop
        // from another journal: the scan would apply them over the gap.
        if !defer && unsynced_in.is_some_and(|j| j != target) {
            if let Err(e) = self.sync_unsynced() {
                return Committer::fail_all(batch, e);
            }
        }
        let mut intents: Vec<RecordHeader> = batch
            .iter()
            .filter(|c| matches!(c.header.kind, Kind::Bypass | Kind::Zero | Kind::Punch))
            .map(|c| RecordHeader {
                kind: Kind::Intent,
                view: 0,
                version: 0,
                ..c.header
            })
            .collect();
        if !intents.is_empty() {
            if let Err(e) = self.append_records(intents.iter_mut().map(|h| (h, &[][..])), true) {
                let message = format!("journal append failed: {e}");
                tracing::error!("{message}");
                return Committer::fail_all(batch, io_error(&e, message));
            }
            let used = self.logs[target].position - wal::HEADER_BYTES;
            self.journals().set_used(target, used);
        }
        let files = self.files.clone();
        let journals = files.journals.as_ref().expect("hybrid mode has journals");
        let _writes = journals.chunk_writes.lock().unwrap();
        // After a crash nothing re-applies these to the chunk files (a newer write
        // may have bypassed to the same range), so they must be durable before their
        // records are. Each drops the journal data it supersedes at once, so a later
        // change of the batch does not copy that data back into the file as the
        // edges of its range (the record drops it again, in order among the
        // batch's journaled writes).
        let applied = batch
            .iter()
            .zip(&retains)
            .try_for_each(|(c, retains)| {
                // A sidecar dropped earlier in the batch (released, its volume
                // deleted) may be made again at its path: no log replays either here,
                // so the drop is made durable first.
                let puts = !retains.is_empty() || c.header.kind == Kind::Retain;
                if puts && !self.dirty_dirs.is_empty() {
                    self.sync_dirty()?;
                }
                self.keep(retains, &c.header)?;
                if matches!(c.header.kind, Kind::Write | Kind::Stamp) {
                    return Ok(());
                }
                self.apply_file(&c.header, &c.data, Merge::Check)?;
                drop_superseded(journals, &c.header)
            })
            .and_then(|()| self.sync_dirty());
        if let Err(e) = applied {
            tracing::error!("applying changes to chunk files failed: {e}");
            // A change may have stopped between data and checksums; later batches
            // make its intent look finished, so it is put in step now.
            for intent in &intents {
                self.rehash(intent);
            }
            return Committer::fail_all(batch, e);
        }
        // A repair's retained block is in its sidecar, durably, already: its record
        // keeps only its place in the sequence, as a bypass's does.
        for change in batch.iter_mut().filter(|c| c.header.kind == Kind::Retain) {
            change.header.length = 0;
            change.data = bytes::Bytes::new();
        }
        let start = self.logs[target].position;
        if let Err(e) = self.append(batch, !defer) {
            // Records of the batch left on disk are older than any later record at
            // the same place, so the scan after a crash stops before them.
            let message = format!("journal append failed: {e}");
            tracing::error!("{message}");
            return Committer::fail_all(batch, io_error(&e, message));
        }
        journals.set_used(target, self.logs[target].position - wal::HEADER_BYTES);
        match defer {
            // Before the index points at them, so replay never sees them durable.
            true => journals.unsynced_at(target, start),
            // The sync just made covers the unsynced records of this journal.
            false => {
                self.unsynced.clear();
                self.synced();
            }
        }
        let mut at = start;
        batch
            .drain(..)
            .map(|change| {
                let data_at = change.header.data_at(at, true);
                at = data_at + change.header.data_len() as u64;
                if change.header.kind == Kind::Write {
                    journals.note_sums(target, data_at, &change.data);
                }
                let result = self.record_effects(&change.header, target, data_at);
                if defer && result.is_ok() {
                    self.hold_unsynced(change.header, change.data, change._reservation);
                }
                (change.done, result)
            })
            .collect()
    }

    /// Puts the old blocks `change` retains into their sidecars; durably at once if
    /// the change is about to overwrite the chunk file.
    fn keep(&mut self, retains: &[Retain], change: &RecordHeader) -> Result<(), StoreError> {
        if retains.is_empty() {
            return Ok(());
        }
        for retain in retains {
            self.apply_file(&retain.header, &retain.data, Merge::Check)?;
        }
        match change.kind {
            Kind::Bypass | Kind::Zero | Kind::Punch => self.sync_dirty(),
            // A journaled write: synced with the batch, before its record.
            _ => Ok(()),
        }
    }

    /// What a durable record changes in memory (the replica's state and the journal
    /// index), at commit and again when the journals are scanned.
    fn record_effects(
        &mut self,
        header: &RecordHeader,
        journal: usize,
        data_at: u64,
    ) -> Result<(), StoreError> {
        if header.kind == Kind::Intent {
            return Ok(());
        }
        self.apply_meta(header);
        let journals = self.journals();
        match header.kind {
            Kind::Write => {
                journals.insert(header.chunk, header.offset, header.length, journal, data_at)
            }
            _ => drop_superseded(journals, header),
        }
    }

    /// Resets the journals nothing in the index points into any more (see
    /// [`journals_to_reset`]).
    pub(crate) fn reclaim(&mut self) -> Result<(), StoreError> {
        let seqs: Vec<_> = self.logs.iter().map(|log| log.seqs).collect();
        let live = self.journals().live();
        let Some((reset, start_seq)) = journals_to_reset(&seqs, &live) else {
            return Ok(());
        };
        // The meta file about to be saved holds their versions.
        self.sync_unsynced()?;
        // The records about to go carry replica states and bypassed data.
        self.sync_dirty()?;
        meta::save(
            &*self.files.disk,
            &self.files.dir.join(layout::META),
            &self.files.metas.lock().unwrap().clone(),
        )?;
        for j in reset {
            assert!(!live[j], "journal {j} reset while the index points into it");
            self.logs[j].reset(start_seq)?;
            self.journals().set_used(j, 0);
            self.journals().forget_sums(j);
        }
        Ok(())
    }
}

/// Drops the journal data a change that went to the chunk file supersedes.
fn drop_superseded(journals: &Journals, header: &RecordHeader) -> Result<(), StoreError> {
    match header.kind {
        Kind::Bypass | Kind::Zero | Kind::Punch => {
            journals.erase(header.chunk, header.offset, header.length)
        }
        Kind::DeleteVolume => {
            journals.drop_volume(header.chunk.volume_id);
            Ok(())
        }
        Kind::Write | Kind::Stamp | Kind::Intent => Ok(()),
        // Retained blocks live in sidecars, outside the journals' reach.
        Kind::Retain | Kind::Release | Kind::Trim | Kind::Forget => Ok(()),
    }
}

/// Makes a journaled write bypass too when a later change of its batch that goes to
/// the chunk file only partly covers one of its sectors. That change is applied to
/// the file before any record of the batch is in the index, so the sector's other
/// bytes cannot be copied from the journal first ([`crate::journal::Journals::copy_edges`])
/// and the change's record then erases the whole sector from the index: the write's
/// bytes there would be lost. Applied to the file in batch order, they are kept.
fn bypass_under_later_edges(batch: &mut [Change]) {
    // Partly covered sectors of the file changes after the one looked at.
    let mut edges: Vec<(ChunkId, u64)> = Vec::new();
    for change in batch.iter_mut().rev() {
        let header = &mut change.header;
        let (first, end) = (header.offset / SECTOR_BYTES, header.offset + header.length);
        let last = end.div_ceil(SECTOR_BYTES);
        match header.kind {
            Kind::Write => {
                if edges.iter().any(|&(chunk, sector)| {
                    chunk == header.chunk && (first..last).contains(&sector)
                }) {
                    header.kind = Kind::Bypass;
                }
            }
            Kind::Stamp
            | Kind::DeleteVolume
            | Kind::Intent
            | Kind::Retain
            | Kind::Release
            | Kind::Trim
            | Kind::Forget => continue,
            Kind::Bypass | Kind::Zero | Kind::Punch => {}
        }
        if header.kind != Kind::Write {
            if !header.offset.is_multiple_of(SECTOR_BYTES) {
                edges.push((header.chunk, first));
            }
            if !end.is_multiple_of(SECTOR_BYTES) {
                edges.push((header.chunk, end / SECTOR_BYTES));
            }
        }
    }
}

/// Which journals to reset, and the start sequence their new headers get, given each
/// journal's first and last record sequence (`None`: no records) and whether the index
/// still points into it. A journal goes only when nothing points into it and no
/// journal that stays holds an older record; the start is one past the newest record
/// going. So every record older than the start is in a journal of the set, and the
/// scan after a restart skips records older than the highest start of any header: a
/// crash part-way through the resets (journals written in turns interleave their
/// sequences, so no order of resets alone is safe) never replays a record whose
/// successor (a bypass, a later write) is gone.
fn journals_to_reset(seqs: &[Option<(u64, u64)>], live: &[bool]) -> Option<(Vec<usize>, u64)> {
    let mut reset: Vec<bool> = seqs
        .iter()
        .zip(live)
        .map(|(seqs, live)| !live && seqs.is_some())
        .collect();
    loop {
        let oldest_kept = (0..seqs.len())
            .filter(|&k| !reset[k])
            .filter_map(|k| seqs[k].map(|(first, _)| first))
            .min();
        let mut changed = false;
        for (seqs, reset) in seqs.iter().zip(reset.iter_mut()) {
            let newest = seqs.map_or(0, |(_, last)| last);
            if *reset && oldest_kept.is_some_and(|oldest| oldest < newest) {
                *reset = false;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let journals: Vec<usize> = (0..seqs.len()).filter(|&j| reset[j]).collect();
    let newest = journals
        .iter()
        .filter_map(|&j| seqs[j])
        .map(|s| s.1)
        .max()?;
    Some((journals, newest + 1))
}

#[cfg(test)]
mod tests {
    use super::journals_to_reset;
    use crate::meta::{self, ChunkMeta, Metas};
    use crate::wal::{self, Kind, RecordHeader};
    use crate::{JournalDir, Options, RealDisk, Store};
    use floe_protocol::ChunkId;
    use proptest::prelude::*;

    /// The disk after a crash between two resets of one reclaim: the ssd journal got
    /// its new header (start 5), the hdd's own journal still holds a small write
    /// (seq 3, version 3) that a bypass (seq 4, version 4, now gone with the ssd
    /// journal's records) superseded in the chunk file and the meta file.
    #[tokio::test]
    async fn a_crash_between_resets_does_not_bring_back_a_superseded_write() {
        let chunk = ChunkId {
            volume_id: 7,
            index: 3,
        };
        let data = tempfile::tempdir().unwrap();
        let ssd = tempfile::tempdir().unwrap();
        let volume = data.path().join("chunks/0000000000000007");
        std::fs::create_dir_all(&volume).unwrap();
        std::fs::write(volume.join("0000000000000003"), vec![0xbb; 8192]).unwrap();
        let current = ChunkMeta {
            view: 1,
            version: 4,
        };
        meta::save(
            &RealDisk,
            &data.path().join("meta"),
            &Metas::from([(chunk, current)]),
        )
        .unwrap();
        std::fs::write(ssd.path().join("floe-journal"), wal::encode_header(5, true)).unwrap();
        let mut hdd_journal = wal::encode_header(1, true).to_vec();
        let stale = RecordHeader {
            seq: 3,
            kind: Kind::Write,
            chunk,
            offset: 0,
            length: 4096,
            view: 1,
            version: 3,
        };
        stale.encode(&[0xaa; 4096], &mut hdd_journal, wal::HEADER_BYTES, true);
        std::fs::write(data.path().join("journal"), hdd_journal).unwrap();
        let options = Options {
            journal_dirs: vec![JournalDir {
                dir: ssd.path().to_path_buf(),
                quota_bytes: 1 << 20,
            }],
            local_journal_quota_bytes: 1 << 20,
            emulate_hdd: false,
            chain: None,
        };
        let store = Store::open_with(data.path(), &options).unwrap();
        assert_eq!(store.meta(chunk), current);
        assert_eq!(
            &store.read(chunk, 0, 8192).await.unwrap()[..],
            &[0xbb; 8192]
        );
    }

    proptest! {
        /// Journals written in turns by batches of consecutive sequence numbers, some
        /// still live: no live journal is reset, every record of a reset journal is
        /// below the new start and every record of a kept one at or above it, so the
        /// scan after a crash at any point of the resets (headers of some written,
        /// others not) keeps exactly the kept journals' records.
        #[test]
        fn the_new_start_separates_reclaimed_records_from_kept_ones(
            batches in proptest::collection::vec((0usize..4, 1u64..5), 0..20),
            live in proptest::collection::vec(any::<bool>(), 4),
        ) {
            let mut seqs: Vec<Option<(u64, u64)>> = vec![None; 4];
            let mut next = 1;
            for (journal, records) in batches {
                let last = next + records - 1;
                seqs[journal] = Some((seqs[journal].map_or(next, |s| s.0), last));
                next = last + 1;
            }
            let Some((reset, start)) = journals_to_reset(&seqs, &live) else {
                return Ok(());
            };
            prop_assert!(!reset.is_empty() && start <= next);
            for (j, seqs) in seqs.iter().enumerate() {
                let Some((first, last)) = *seqs else { continue };
                if reset.contains(&j) {
                    prop_assert!(!live[j] && last < start);
                } else {
                    prop_assert!(first >= start, "journal {j} {seqs:?} kept below {start}");
                }
            }
        }
    }
}
