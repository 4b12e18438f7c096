//! The committer: the task that takes every queued change, appends them to the log
//! (or a journal) in one write and one fdatasync (group commit), applies them, and
//! completes them. Plain mode's commit is in [`crate::plain_commit`], hybrid mode's in
//! [`crate::hybrid_commit`]; this file holds what both share.

use crate::block_sums::{Fill, Merge};
use crate::chunk_files::Files;
use crate::disk::hdd;
use crate::error::StoreError;
use crate::journal::Journals;
use crate::layout;
use crate::log_file::{assert_in_chunk, LogFile};
use crate::meta::ChunkMeta;
use crate::retained::capture::Retain;
use crate::space::Reservation;
use crate::unsynced::Unsynced;
use crate::wal::{Kind, RecordHeader, RECORD_HEADER_BYTES, SECTOR_BYTES};
use bytes::Bytes;
use floe_protocol::frame::PAYLOAD_BYTES_MAX;
use floe_protocol::ChunkId;
use std::collections::BTreeSet;
use std::io::{self, ErrorKind};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, Notify};

/// Log bytes gathered into one append + fdatasync.
const BATCH_BYTES_MAX: usize = 16 << 20;
/// Room a log keeps allocated past its quota: the largest batch, which is one
/// change when that alone is larger than [`BATCH_BYTES_MAX`] (a request's payload).
pub(crate) const BATCH_ROOM_BYTES: u64 = (PAYLOAD_BYTES_MAX as u64) + (1 << 20);
/// Records in one append. Bounds the records a crash can leave intact past a torn
/// one: those of the last batch, never synced, with sequence numbers up to this many
/// past the last valid record.
pub(crate) const BATCH_RECORDS_MAX: usize = 4096;

pub(crate) type Done = oneshot::Sender<Result<(), StoreError>>;

pub(crate) struct Change {
    pub(crate) header: RecordHeader,
    pub(crate) data: Bytes,
    pub(crate) done: Done,
    /// Acknowledged only once durable; an unsynced write (`false`) once logged (see
    /// [`crate::unsynced`]).
    pub(crate) sync: bool,
    /// The snapshot epoch whose old blocks this change retains (see
    /// [`crate::retained`]).
    pub(crate) retain: Option<u32>,
    /// Held until the change is in the chunk file (or the journal: see
    /// [`crate::space`]), then dropped with the change.
    pub(crate) _reservation: Reservation,
}

pub(crate) type Completions = Vec<(Done, Result<(), StoreError>)>;

/// Changes waiting for the next commit. Submitters are bounded upstream: each
/// connection has a fixed number of requests in flight.
#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) changes: Mutex<Vec<Change>>,
    /// Waiting for every change acknowledged before them to be durable.
    pub(crate) syncs: Mutex<Vec<Done>>,
    pub(crate) wake: Notify,
}

/// The log (or the journals) and everything only the committer touches.
pub(crate) struct Committer {
    /// The data directory's log alone; in hybrid mode the journals (the hdd's own
    /// last).
    pub(crate) logs: Vec<LogFile>,
    /// The log the next batch goes to.
    pub(crate) active: usize,
    pub(crate) files: Arc<Files>,
    /// Sequence number of the next record, global across the logs.
    pub(crate) next_seq: u64,
    /// Chunk files and directories changed since they were last synced; ordered, so
    /// they are synced in the same order each run (a simulation replays exactly).
    pub(crate) dirty_files: BTreeSet<ChunkId>,
    pub(crate) dirty_dirs: BTreeSet<PathBuf>,
    /// Sidecars of retained blocks changed since they were last synced.
    pub(crate) dirty_retained: BTreeSet<(ChunkId, u32)>,
    pub(crate) buffer: Vec<u8>,
    /// Set when the log can no longer be written safely; every change then fails.
    pub(crate) failed: Option<String>,
    /// Changes acknowledged before their record was synced, in log order.
    pub(crate) unsynced: Vec<Unsynced>,
    /// How long unsynced changes may wait for a sync when nothing else comes.
    pub(crate) sync_interval: Duration,
    /// Starts the chunk files' writeback early (see [`crate::writeback`]).
    pub(crate) writeback: crate::writeback::Writeback,
    /// Each log fdatasync's latency, for `/metrics` (a group commit's cost).
    fsync_duration: metrics::Histogram,
}

/// Latency of the group commits' log fdatasyncs (data directory or journal).
const FSYNC_DURATION: &str = "floe_chunkstore_fsync_duration_seconds";

impl Committer {
    pub(crate) fn new(logs: Vec<LogFile>, files: Arc<Files>) -> Committer {
        let next_seq = logs.iter().map(LogFile::next_seq).max().unwrap_or(1);
        Committer {
            logs,
            active: 0,
            files,
            next_seq,
            dirty_files: BTreeSet::new(),
            dirty_dirs: BTreeSet::new(),
            dirty_retained: BTreeSet::new(),
            buffer: Vec::new(),
            failed: None,
            unsynced: Vec::new(),
            sync_interval: Duration::MAX,
            writeback: crate::writeback::Writeback::default(),
            fsync_duration: metrics::histogram!(FSYNC_DURATION),
        }
    }

    pub(crate) fn hybrid(&self) -> bool {
        self.files.journals.is_some()
    }

    pub(crate) fn journals(&self) -> &Journals {
        self.files
            .journals
            .as_ref()
            .expect("hybrid mode has journals")
    }

    pub(crate) async fn run(mut self, queue: Arc<Queue>) {
        let mut batch: Vec<Change> = Vec::new();
        loop {
            let woken = queue.wake.notified();
            // A failed store syncs nothing more: no timer, or it would retry forever.
            if self.unsynced.is_empty() || self.failed.is_some() {
                woken.await;
            } else if tokio::time::timeout(self.sync_interval, woken)
                .await
                .is_err()
            {
                if let Err(e) = self.sync_unsynced() {
                    tracing::error!("syncing unsynced writes failed: {e}");
                }
                continue;
            }
            // Let every task that is ready (requests just read off sockets) queue its
            // change first, so they share this commit.
            tokio::task::yield_now().await;
            loop {
                {
                    let mut changes = queue.changes.lock().unwrap();
                    let (mut records, mut bytes) = (0, 0);
                    let take = changes
                        .iter()
                        .take_while(|c| {
                            let (n, b) = c.log_bound();
                            (records, bytes) = (records + n, bytes + b);
                            records <= BATCH_RECORDS_MAX && bytes <= BATCH_BYTES_MAX
                        })
                        .count()
                        .max(1)
                        .min(changes.len());
                    batch.extend(changes.drain(..take));
                }
                let syncs = std::mem::take(&mut *queue.syncs.lock().unwrap());
                if self.hybrid() && self.journals().replayed.swap(false, Ordering::Acquire) {
                    if let Err(e) = self.reclaim() {
                        tracing::error!("resetting replayed journals failed, will retry: {e}");
                    }
                }
                if batch.is_empty() && syncs.is_empty() {
                    break;
                }
                let mut completions = if batch.is_empty() {
                    Vec::new()
                } else if self.hybrid() {
                    self.commit_journaled(&mut batch, syncs.is_empty())
                } else {
                    // A sync is due anyway: sync this batch with everything before it.
                    self.commit(&mut batch, syncs.is_empty())
                };
                if !syncs.is_empty() {
                    let synced = self.sync_unsynced();
                    completions.extend(syncs.into_iter().map(|done| (done, synced.clone())));
                }
                if let Some(at) = hdd::take_paced_until() {
                    tokio::time::sleep_until(at.into()).await;
                }
                for (done, result) in completions {
                    let _ = done.send(result);
                }
                if !self.hybrid() && self.files.chain.is_none() {
                    self.kick_writeback();
                }
                if !self.hybrid() && self.logs[0].position >= self.logs[0].quota {
                    if let Err(e) = self.checkpoint() {
                        tracing::error!("checkpoint failed, will retry: {e}");
                    }
                }
            }
        }
    }

    /// Log bytes a batch takes, sector padding aside.
    pub(crate) fn batch_bytes(batch: &[Change]) -> u64 {
        batch
            .iter()
            .map(|c| (RECORD_HEADER_BYTES + c.header.data_len()) as u64)
            .sum()
    }

    pub(crate) fn fail_all(batch: &mut Vec<Change>, error: StoreError) -> Completions {
        batch
            .drain(..)
            .map(|c| (c.done, Err(error.clone())))
            .collect()
    }

    /// Appends the batch to `self.logs[self.active]` as one write and one fdatasync.
    pub(crate) fn append(&mut self, batch: &mut [Change], sync: bool) -> io::Result<()> {
        let records = batch.iter_mut().map(|change| {
            let data = if change.header.kind == Kind::Write {
                &change.data[..]
            } else {
                &[]
            };
            (&mut change.header, data)
        });
        self.append_records(records, sync)
    }

    /// Appends records, numbering them, to `self.logs[self.active]` as one write and,
    /// if `sync`, one fdatasync; the log's position moves past them once that
    /// succeeded.
    pub(crate) fn append_records<'a>(
        &mut self,
        records: impl Iterator<Item = (&'a mut RecordHeader, &'a [u8])>,
        sync: bool,
    ) -> io::Result<()> {
        let records: Vec<_> = records.collect();
        let log = &mut self.logs[self.active];
        // With the sector padding before an aligned record's data: a direct batch's
        // buffer must not grow while it is encoded.
        let padding = match log.aligned {
            true => SECTOR_BYTES as usize,
            false => 0,
        };
        let bytes = records
            .iter()
            .map(|(_, data)| RECORD_HEADER_BYTES + data.len() + padding)
            .sum();
        let batch = log.start_batch(&mut self.buffer, bytes);
        let mut seqs = None;
        for (header, data) in records {
            header.seq = self.next_seq;
            self.next_seq += 1;
            assert_in_chunk(header);
            header.encode(data, &mut self.buffer, batch.base, log.aligned);
            let first = seqs.map_or(header.seq, |(first, _)| first);
            seqs = Some((first, header.seq));
        }
        log.write_batch(&mut self.buffer, batch, sync)?;
        if sync {
            let started = std::time::Instant::now();
            log.file.sync_data()?;
            self.fsync_duration.record(started.elapsed());
        }
        log.batch_written(&self.buffer, batch);
        if let Some((first, last)) = seqs {
            log.appended(first, last);
        }
        Ok(())
    }

    /// After the logs were scanned: the next sequence number skips every one the
    /// records never synced before the crash may have used: the unsynced writes (at
    /// most a batch's worth, see [`crate::unsynced`]) and the last batch. Records past
    /// a torn one may still be intact; a new batch appended at the tear that ended
    /// exactly where one of them begins would otherwise make the next scan read on
    /// into it and apply an unacknowledged, superseded change.
    pub(crate) fn skip_unsynced_seqs(&mut self) {
        self.next_seq += 2 * BATCH_RECORDS_MAX as u64;
    }

    /// Makes the chunk files and directories changed so far durable. On error the
    /// dirty sets are kept, so a later call syncs them all again.
    pub(crate) fn sync_dirty(&mut self) -> Result<(), StoreError> {
        for chunk in &self.dirty_files {
            if let Some(file) = self.files.get(*chunk, false)? {
                file.sync()?;
            }
        }
        // Directories first: a new sidecar's two files must both be there before its
        // index holds an entry, and a dropped one's index gone before its data goes.
        for dir in &self.dirty_dirs {
            self.files.sync_dir(dir)?;
        }
        self.files.retained.save(&self.dirty_retained)?;
        let (disk, dir) = (&*self.files.disk, &self.files.dir);
        self.files.retained.unlink_dropped(disk, dir)?;
        self.dirty_files.clear();
        self.dirty_dirs.clear();
        self.dirty_retained.clear();
        Ok(())
    }

    /// Marks every chunk directory for the next sync. A predecessor killed before its
    /// checkpoint leaves entries for the files it created in the page cache only;
    /// replay finds those files present, so nothing else would sync their entries
    /// before the first checkpoint lets the log forget them.
    pub(crate) fn adopt_unsynced_dirs(&mut self) -> Result<(), StoreError> {
        let chunks = layout::chunks_dir(&self.files.dir);
        // The chunks directory holds only volume directories.
        for volume in self.files.disk.read_dir(&chunks)? {
            self.dirty_dirs.insert(chunks.join(volume));
        }
        self.dirty_dirs.insert(chunks);
        Ok(())
    }

    pub(crate) fn apply_meta(&self, header: &RecordHeader) {
        let chunk = header.chunk;
        assert_ne!(
            header.kind,
            Kind::Intent,
            "an intent changes no replica's state"
        );
        if matches!(
            header.kind,
            Kind::Retain | Kind::Release | Kind::Trim | Kind::Forget
        ) {
            return;
        }
        let mut metas = self.files.metas.lock().unwrap();
        if header.kind == Kind::DeleteVolume {
            metas.retain(|c, _| c.volume_id != chunk.volume_id);
        } else {
            metas.insert(
                chunk,
                ChunkMeta {
                    view: header.view,
                    version: header.version,
                },
            );
        }
    }

    /// A `Retain` record into its sidecar (not yet durable: see
    /// [`Committer::sync_dirty`]).
    fn apply_retain(&mut self, header: &RecordHeader, data: &[u8]) -> Result<(), StoreError> {
        let epoch = Retain::epoch(header);
        let data = (header.length > 0).then_some(data);
        let (disk, dir) = (&*self.files.disk, &self.files.dir);
        let block = crate::retained::block_of(header.offset);
        let created =
            self.files
                .retained
                .put(disk, dir, header.chunk, epoch, block, header.version, data)?;
        if created {
            self.dirty_dirs.extend(self.files.dirs_of(header.chunk));
        }
        self.dirty_retained.insert((header.chunk, epoch));
        Ok(())
    }

    /// A change's effect on the chunk files (not yet durable: see
    /// [`Committer::sync_dirty`]).
    pub(crate) fn apply_file(
        &mut self,
        header: &RecordHeader,
        data: &[u8],
        merge: Merge,
    ) -> Result<(), StoreError> {
        let chunk = header.chunk;
        match header.kind {
            Kind::Retain => return self.apply_retain(header, data),
            Kind::Release => {
                let epochs = header.offset as u32..=header.length as u32;
                let (disk, dir) = (&*self.files.disk, &self.files.dir);
                self.files.retained.release(disk, dir, chunk, epochs)?;
                self.dirty_dirs
                    .insert(layout::volume_dir(&self.files.dir, chunk.volume_id));
                return Ok(());
            }
            Kind::Trim => {
                for epoch in self.files.retained.trim(chunk, header.version) {
                    self.dirty_retained.insert((chunk, epoch));
                }
                return Ok(());
            }
            Kind::Forget => {
                let epoch = crate::retained::capture::Retain::epoch(header);
                let block = crate::retained::block_of(header.offset);
                if self.files.retained.forget(chunk, epoch, block) {
                    self.dirty_retained.insert((chunk, epoch));
                }
                return Ok(());
            }
            _ => {}
        }
        // The chain takes the data instead of chunk files; a deleted volume's
        // retained blocks are in sidecars beside it (below).
        if let Some(chain) = &self.files.chain {
            for offset in chain.apply(header, data)? {
                self.files.found_corrupt(chunk, offset, "chain");
            }
            if header.kind != Kind::DeleteVolume {
                return Ok(());
            }
        }
        match header.kind {
            Kind::Stamp | Kind::Intent => return Ok(()),
            Kind::DeleteVolume => {
                self.files.forget_volume(chunk.volume_id);
                self.files.retained.forget_volume(chunk.volume_id);
                self.dirty_retained
                    .retain(|(c, _)| c.volume_id != chunk.volume_id);
                self.dirty_files.retain(|c| c.volume_id != chunk.volume_id);
                let volume = layout::volume_dir(&self.files.dir, chunk.volume_id);
                match self.files.disk.remove_dir_all(&volume) {
                    Err(e) if e.kind() != ErrorKind::NotFound => return Err(e.into()),
                    _ => {}
                }
                self.dirty_dirs.insert(layout::chunks_dir(&self.files.dir));
                return Ok(());
            }
            Kind::Write | Kind::Bypass | Kind::Zero | Kind::Punch => {}
            Kind::Retain | Kind::Release | Kind::Trim | Kind::Forget => {
                unreachable!("handled above")
            }
        }
        assert_in_chunk(header);
        let existed = self.files.exists(chunk)?;
        let file = self
            .files
            .get(chunk, true)?
            .expect("get with create returns a file");
        if !existed {
            self.dirty_dirs.extend(self.files.dirs_of(chunk));
        }
        self.dirty_files.insert(chunk);
        let mut merge = merge;
        if let Some(journals) = &self.files.journals {
            journals.copy_edges(&self.files, &file, header.offset, header.length)?;
            // Blocks with journaled data may be half copied by a replay cut short.
            if !journals
                .in_flux(chunk, header.offset, header.length)
                .is_empty()
            {
                merge = Merge::Trust;
            }
        }
        let fill = match header.kind {
            Kind::Write | Kind::Bypass => Fill::Data(data),
            kind => Fill::Zero {
                length: header.length,
                punch: kind == Kind::Punch,
            },
        };
        for offset in file.write(header.offset, fill, merge, false)? {
            self.files.found_corrupt(chunk, offset, "chunk file");
        }
        Ok(())
    }
}
