//! The chunk store: group-committed write-ahead log + sparse chunk files, and in
//! hybrid mode ssd journals in front of an hdd's chunk files (see [`crate::journal`]).

use crate::block_sums::{fingerprint, BLOCK_BYTES};
use crate::chain::{Chain, ChainOptions, ChainStats, ReadCost};
use crate::chunk_files::Files;
use crate::committer::{Change, Committer, Queue};
use crate::disk::hdd::{self, Hdd, HddDisk};
use crate::disk::{self, Disk, RealDisk};
use crate::journal::{JournalDir, Journals};
use crate::layout;
use crate::meta::{self, ChunkMeta};
use crate::replay;
use crate::retained::{Retained, RetainedBlock, RetainedEntry, RETAIN_CHANGE_BYTES_MAX};
use crate::space::{self, Reservation, Room, Space, SpaceReport};
use crate::wal::{Kind, RecordHeader};
use bytes::{Bytes, BytesMut};
use floe_protocol::ChunkId;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

pub use crate::error::StoreError;
pub use crate::layout::CHUNK_BYTES_MAX;

/// Largest single read: bounds the buffer a peer can make us allocate.
pub const READ_BYTES_MAX: u32 = 32 << 20;
/// Log bytes after which plain mode checkpoints (syncs chunk files, reuses the log).
const WAL_BYTES_CHECKPOINT: u64 = 256 << 20;

/// Default of [`Tuning::sync_interval`]: bounds what a power cut can take of the
/// writes a fast write mode acknowledged.
const SYNC_INTERVAL: Duration = Duration::from_millis(20);

/// When a write resolves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Once durable.
    Synced,
    /// Once logged: a power cut may still take it (and every later change), never an
    /// earlier one, until the next [`Store::sync`] or durable change (see
    /// [`crate::unsynced`]). Reads see it at once.
    Unsynced,
}

/// How a store runs; the default is a plain store (log and chunk files in one
/// directory, no emulation).
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Hybrid mode: journal directories on ssds of this host, in order of preference.
    /// Small writes are acknowledged from the journal and replayed into the chunk
    /// files in the background. Empty: every change is applied at commit.
    pub journal_dirs: Vec<JournalDir>,
    /// Quota of the overflow journal in the data directory (hybrid mode only).
    pub local_journal_quota_bytes: u64,
    /// Emulate a hard disk's service times on chunk-file access, or on each chain
    /// disk's log (see [`crate::disk::hdd`]).
    pub emulate_hdd: bool,
    /// The chained-log engine: chunk data goes to a log chained across these disks
    /// (see [`crate::chain`]) instead of chunk files; the write-ahead log stays in
    /// the data directory. Not with `journal_dirs`.
    pub chain: Option<ChainOptions>,
}

/// Knobs a chunk server leaves at their defaults and a simulation sets: it decides
/// when things happen and wants them to happen often.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// Hybrid mode: start no replay thread; replay runs only in
    /// [`Store::replay_sweep`], so a simulation decides when (a thread would make
    /// the order of disk operations, and so a power cut's outcome, vary run to run).
    pub manual_replay: bool,
    /// Plain mode: log bytes after which the committer checkpoints.
    pub wal_checkpoint_bytes: u64,
    /// Reads check the blocks' checksums (writes always keep them). Off only under
    /// bench/run's hidden switch, the environment variable [`BENCH_UNCHECKED_READS`],
    /// to measure what checking costs.
    pub check_reads: bool,
    /// Longest an unsynced write waits for a sync when nothing else syncs the log;
    /// `None`: until something asks (a simulation decides when).
    pub sync_interval: Option<Duration>,
}

/// Set (to anything) in a chunk server's environment, its reads skip the block
/// checksums: for bench/run's cost measurement only.
pub const BENCH_UNCHECKED_READS: &str = "FLOE_BENCH_UNCHECKED_READS";

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            manual_replay: false,
            wal_checkpoint_bytes: WAL_BYTES_CHECKPOINT,
            check_reads: std::env::var_os(BENCH_UNCHECKED_READS).is_none(),
            sync_interval: Some(SYNC_INTERVAL),
        }
    }
}

/// A change as [`Store::submit`] queues it, its data aside.
struct Submit {
    kind: Kind,
    chunk: ChunkId,
    offset: u64,
    length: u64,
    meta: ChunkMeta,
    sync: bool,
    retain: Option<u32>,
}

impl Submit {
    /// Its record's header (the committer assigns the sequence).
    fn header(&self) -> RecordHeader {
        RecordHeader {
            seq: 0,
            kind: self.kind,
            chunk: self.chunk,
            offset: self.offset,
            length: self.length,
            view: self.meta.view,
            version: self.meta.version,
        }
    }

    /// A change without data, synced, retaining nothing.
    fn control(kind: Kind, chunk: ChunkId, offset: u64, length: u64, meta: ChunkMeta) -> Submit {
        Submit {
            kind,
            chunk,
            offset,
            length,
            meta,
            sync: true,
            retain: None,
        }
    }
}

/// A handle to the store; cheap to clone. A process that stops at any moment
/// (SIGTERM, kill -9) replays the log at the next open.
#[derive(Clone)]
pub struct Store {
    files: Arc<Files>,
    queue: Arc<Queue>,
    space: Arc<Space>,
}

impl Store {
    /// A plain store in `dir`: see [`Store::open_with`].
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        Store::open_with(dir, &Options::default())
    }

    /// Opens (creating if needed) the store in `dir`, replaying the log (or scanning
    /// the journals and rebuilding their index) first. Must be called inside a tokio
    /// runtime: the committer runs on it.
    ///
    /// The committer commits on the event loop itself, blocking it for the append and
    /// fdatasync (Vitastor's habit): no thread hand-off and wake-up per batch, and the
    /// requests that arrive meanwhile wait in the socket buffers and form the next
    /// batch.
    pub fn open_with(dir: &Path, options: &Options) -> Result<Store, StoreError> {
        Store::open_on(Arc::new(RealDisk), dir, options, &Tuning::default())
    }

    /// [`Store::open_with`] on `disk` (a [`crate::SimDisk`]'s mount, say), tuned.
    pub fn open_on(
        disk: Arc<dyn Disk>,
        dir: &Path,
        options: &Options,
        tuning: &Tuning,
    ) -> Result<Store, StoreError> {
        // A chain emulates each of its disks (the files engine, one under its chunks).
        let hdd =
            (options.emulate_hdd && options.chain.is_none()).then(|| Arc::new(Hdd::default()));
        let disk: Arc<dyn Disk> = match (&hdd, &options.chain) {
            (Some(hdd), _) => Arc::new(HddDisk::new(disk, hdd.clone(), dir)),
            (None, Some(chain)) if options.emulate_hdd => {
                Arc::new(HddDisk::chain(disk, &chain.disks))
            }
            (None, _) => disk,
        };
        disk.create_dir_all(&layout::chunks_dir(dir))?;
        let hybrid = !options.journal_dirs.is_empty();
        let local_journal = dir.join(layout::LOCAL_JOURNAL);
        if !hybrid && disk.exists(&local_journal)? {
            return Err(StoreError::Io(format!(
                "{} exists: this data directory was run with --journal; start it with the \
                 same journal directories so their data is replayed",
                local_journal.display()
            )));
        }
        let space = Space::new(disk.clone(), dir);
        let wal_quota = space.log_quota(tuning.wal_checkpoint_bytes)?;
        let metas = meta::load(&*disk, &dir.join(layout::META))?;
        if !tuning.check_reads {
            tracing::warn!("{BENCH_UNCHECKED_READS} is set: reads skip the block checksums");
        }
        let mut files = Files::new(disk.clone(), dir, metas, hdd, tuning.check_reads);
        if let Some(chain) = &options.chain {
            if hybrid {
                return Err(StoreError::Io(
                    "the chained-log engine takes no journals: it keeps recent data in its tail cache".into(),
                ));
            }
            files.chain = Some(Chain::open(disk.clone(), chain)?);
        }
        // Sidecars of every mode; a log replayed below may add to them.
        files.retained = Retained::load(&*disk, dir)?;
        let queue = Arc::new(Queue::default());
        let wal = dir.join(layout::WAL);
        let committer = if hybrid {
            if disk.exists(&wal)? {
                // Drain a log from a run without journals into the chunk files first.
                let shared = Arc::new(files);
                drop(Committer::open_direct(&wal, shared.clone(), wal_quota)?);
                disk.remove_file(&wal)?;
                files = Arc::try_unwrap(shared)
                    .unwrap_or_else(|_| unreachable!("the draining log was dropped"));
                // Opened as plain mode opens them (checksums kept in memory until a
                // checkpoint); hybrid mode writes checksums with the data.
                files.close_all();
            }
            let (journals, logs) = Journals::open(
                &*disk,
                dir,
                &options.journal_dirs,
                options.local_journal_quota_bytes,
            )?;
            files.journals = Some(journals);
            let files = Arc::new(files);
            let committer = Committer::open_journals(logs, files.clone())?;
            if !tuning.manual_replay {
                replay::spawn_replay(Arc::downgrade(&files), queue.clone());
            }
            committer
        } else {
            Committer::open_direct(&wal, Arc::new(files), wal_quota)?
        };
        // Entries made above, a first open's, and the removal of a drained log.
        disk::sync_dir_and_parents(&*disk, &layout::chunks_dir(dir))?;
        for journal in &options.journal_dirs {
            disk::sync_dir_and_parents(&*disk, &journal.dir)?;
        }
        let mut committer = committer;
        committer.sync_interval = tuning.sync_interval.unwrap_or(Duration::MAX);
        let files = committer.files.clone();
        tokio::spawn(committer.run(queue.clone()));
        Ok(Store {
            files,
            queue,
            space,
        })
    }

    /// Reserves the space a write of `length` bytes at `offset` may allocate, before
    /// the replica takes the write's version: `NoSpace` if it does not fit in `room`.
    pub fn reserve_write(
        &self,
        offset: u64,
        length: u64,
        room: Room,
    ) -> Result<Reservation, StoreError> {
        check_range(offset, length)?;
        self.reserve(space::write_needs(offset, length), room)
    }

    /// `bytes` of room, with what the journals hold for later counted as taken.
    fn reserve(&self, bytes: u64, room: Room) -> Result<Reservation, StoreError> {
        self.space.reserve(bytes, self.journal_backlog(), room)
    }

    /// [`Store::reserve_write`] for zeroing a range: a punch frees space and needs
    /// none; zeroing that keeps the range allocated may need all of it.
    pub fn reserve_zero(
        &self,
        offset: u64,
        length: u64,
        punch: bool,
    ) -> Result<Reservation, StoreError> {
        if punch {
            check_range(offset, length)?;
            return Ok(Reservation::none());
        }
        self.reserve_write(offset, length, Room::Normal)
    }

    /// [`Store::reserve_write`] for a change that retains old blocks (`retain:
    /// Some`), write or zero: room for what it keeps as well, and refused here,
    /// before a replica takes the change's version, when it is too long to retain.
    pub fn reserve_retaining(
        &self,
        offset: u64,
        length: u64,
        room: Room,
    ) -> Result<Reservation, StoreError> {
        check_range(offset, length)?;
        self.check_retaining(length)?;
        self.reserve(crate::retained::retaining_needs(offset, length), room)
    }

    /// The data directory's file system as the master is told about it.
    pub fn space_report(&self) -> Result<SpaceReport, StoreError> {
        self.space.report(self.journal_backlog())
    }

    /// Writes `data` at `offset`, leaving the chunk in state `meta`; resolves once
    /// durable. Changes to one chunk are logged and applied in submission order.
    /// `NoSpace` before anything is logged if the data does not fit.
    pub async fn write(
        &self,
        chunk: ChunkId,
        offset: u64,
        data: Bytes,
        meta: ChunkMeta,
    ) -> Result<(), StoreError> {
        let reservation = self.reserve_write(offset, data.len() as u64, Room::Normal)?;
        let durability = Durability::Synced;
        self.write_reserved(reservation, chunk, offset, data, meta, durability, None)
            .await
    }

    /// [`Store::write`] into space reserved by [`Store::reserve_write`], resolving as
    /// `durability` says. With `retain: Some(epoch)`, the blocks it overwrites first in
    /// that snapshot epoch are kept as they were (see [`Store::read_retained`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn write_reserved(
        &self,
        reservation: Reservation,
        chunk: ChunkId,
        offset: u64,
        data: Bytes,
        meta: ChunkMeta,
        durability: Durability,
        retain: Option<u32>,
    ) -> Result<(), StoreError> {
        let change = Submit {
            kind: Kind::Write,
            chunk,
            offset,
            length: data.len() as u64,
            meta,
            sync: durability == Durability::Synced,
            retain,
        };
        self.submit(change, data, reservation).await
    }

    /// Resolves once every change acknowledged before the call is durable.
    pub async fn sync(&self) -> Result<(), StoreError> {
        // The committer acknowledges an unsynced write after marking its chunk.
        if !self.files.unsynced.any() {
            return Ok(());
        }
        let (done, result) = oneshot::channel();
        self.queue.syncs.lock().unwrap().push(done);
        self.queue.wake.notify_one();
        result.await.map_err(|_| StoreError::ShutDown)?
    }

    /// Zeroes a range; `punch` frees its space. Resolves once durable.
    pub async fn zero(
        &self,
        chunk: ChunkId,
        offset: u64,
        length: u64,
        punch: bool,
        meta: ChunkMeta,
    ) -> Result<(), StoreError> {
        let reservation = self.reserve_zero(offset, length, punch)?;
        self.zero_reserved(reservation, chunk, offset, length, punch, meta, None)
            .await
    }

    /// [`Store::zero`] into space reserved by [`Store::reserve_zero`], retaining as
    /// [`Store::write_reserved`] does.
    #[allow(clippy::too_many_arguments)]
    pub async fn zero_reserved(
        &self,
        reservation: Reservation,
        chunk: ChunkId,
        offset: u64,
        length: u64,
        punch: bool,
        meta: ChunkMeta,
        retain: Option<u32>,
    ) -> Result<(), StoreError> {
        let change = Submit {
            kind: if punch { Kind::Punch } else { Kind::Zero },
            chunk,
            offset,
            length,
            meta,
            sync: true,
            retain,
        };
        self.submit(change, Bytes::new(), reservation).await
    }

    /// Sets the chunk's view and version only. Resolves once durable.
    pub async fn set_meta(&self, chunk: ChunkId, meta: ChunkMeta) -> Result<(), StoreError> {
        let change = Submit::control(Kind::Stamp, chunk, 0, 0, meta);
        self.submit(change, Bytes::new(), Reservation::none()).await
    }

    /// Drops the chunk's retained blocks of `epochs` (every one: a replica dropped).
    /// Resolves once durable.
    pub async fn release_retained(
        &self,
        chunk: ChunkId,
        epochs: std::ops::RangeInclusive<u32>,
    ) -> Result<(), StoreError> {
        let (first, last) = (*epochs.start() as u64, *epochs.end() as u64);
        let change = Submit::control(Kind::Release, chunk, first, last, ChunkMeta::default());
        self.submit(change, Bytes::new(), Reservation::none()).await
    }

    /// The block holding `offset` as snapshot epoch `epoch` retained it; `None` if that
    /// epoch did not overwrite it. A block that fails its checksum is an error, as in
    /// [`Store::read`].
    pub async fn read_retained(
        &self,
        chunk: ChunkId,
        epoch: u32,
        offset: u64,
    ) -> Result<Option<RetainedBlock>, StoreError> {
        check_range(offset, BLOCK_BYTES)?;
        // Held unsynced records reach the sidecars only once synced.
        if self.files.unsynced.holds(chunk) {
            self.sync().await?;
        }
        self.reported(self.files.retained.read(chunk, epoch, offset))
    }

    /// `result`, a block failing its checksum logged and kept for
    /// [`Store::take_corrupt`].
    fn reported<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(StoreError::Corrupt {
            chunk,
            offset,
            place,
        }) = &result
        {
            self.files.found_corrupt(*chunk, *offset, place);
        }
        result
    }

    /// Reads a range as snapshot `epoch` has it: each 4 KiB block from the lowest
    /// epoch from `epoch` on that retained it, else from the chunk (see
    /// [`crate::retained`]). The caller keeps changes to the range out meanwhile.
    pub async fn read_as_of(
        &self,
        chunk: ChunkId,
        epoch: u32,
        offset: u64,
        length: u32,
    ) -> Result<Bytes, StoreError> {
        let live = self.read(chunk, offset, length).await?;
        let end = offset + length as u64;
        let mut out = BytesMut::from(&live[..]);
        for at in (offset - offset % BLOCK_BYTES..end).step_by(BLOCK_BYTES as usize) {
            let old = match self.reported(self.files.retained.as_of(chunk, epoch, at))? {
                Some(RetainedBlock::Data(data)) => data,
                Some(RetainedBlock::Zeroes) => Bytes::from(vec![0; BLOCK_BYTES as usize]),
                None => continue,
            };
            let (from, to) = (at.max(offset), (at + BLOCK_BYTES).min(end));
            out[(from - offset) as usize..(to - offset) as usize]
                .copy_from_slice(&old[(from - at) as usize..(to - at) as usize]);
        }
        Ok(out.freeze())
    }

    /// A digest of the chunk's retained blocks of the epochs `keep` accepts, each read
    /// and checked: crc32c over (epoch, offset, the data's crc32c; 0 for zeroes, all
    /// ones for a block that fails), in order, and the (epoch, offset) of those that
    /// fail. What scrub compares across replicas.
    pub async fn retained_checksum(
        &self,
        chunk: ChunkId,
        keep: impl Fn(u32) -> bool,
    ) -> Result<(u32, Vec<(u32, u64)>), StoreError> {
        let mut digest = 0;
        let mut bad = Vec::new();
        for entry in self.retained(chunk) {
            if !keep(entry.epoch) {
                continue;
            }
            let crc = match self.read_retained(chunk, entry.epoch, entry.offset).await {
                Ok(Some(RetainedBlock::Data(data))) => crc32c::crc32c(&data),
                Ok(Some(RetainedBlock::Zeroes)) => 0,
                // Freed since it was listed.
                Ok(None) => continue,
                Err(StoreError::Corrupt { .. }) => {
                    bad.push((entry.epoch, entry.offset));
                    u32::MAX
                }
                Err(e) => return Err(e),
            };
            let mut item = [0u8; 16];
            item[..4].copy_from_slice(&entry.epoch.to_le_bytes());
            item[4..12].copy_from_slice(&entry.offset.to_le_bytes());
            item[12..].copy_from_slice(&crc.to_le_bytes());
            digest = crc32c::crc32c_append(digest, &item);
        }
        Ok((digest, bad))
    }

    /// The chunk's retained blocks tagged above `since`, by epoch and offset: what a
    /// repair from version `since` copies.
    pub fn retained_since(&self, chunk: ChunkId, since: u64) -> Vec<RetainedEntry> {
        let mut entries = self.retained(chunk);
        entries.retain(|entry| entry.tag > since);
        entries
    }

    /// Keeps a block another replica retained, as it did (a repair's copy). Resolves
    /// once durable.
    pub async fn install_retained(
        &self,
        chunk: ChunkId,
        entry: RetainedEntry,
        block: RetainedBlock,
    ) -> Result<(), StoreError> {
        let data = match block {
            RetainedBlock::Zeroes => Bytes::new(),
            RetainedBlock::Data(data) => data,
        };
        if !entry.offset.is_multiple_of(BLOCK_BYTES)
            || ![0, BLOCK_BYTES].contains(&(data.len() as u64))
        {
            return Err(StoreError::OutOfRange {
                offset: entry.offset,
                length: data.len() as u64,
            });
        }
        // A `Retain` record names the epoch and tag where a change names its state.
        let meta = ChunkMeta {
            view: entry.epoch as u64,
            version: entry.tag,
        };
        let length = data.len() as u64;
        let change = Submit::control(Kind::Retain, chunk, entry.offset, length, meta);
        self.submit(change, data, Reservation::none()).await
    }

    /// Drops the chunk's retained blocks tagged above `above` (a repair from version
    /// `above` replaces them). Resolves once durable.
    pub async fn trim_retained(&self, chunk: ChunkId, above: u64) -> Result<(), StoreError> {
        let meta = ChunkMeta {
            view: 0,
            version: above,
        };
        let change = Submit::control(Kind::Trim, chunk, 0, 0, meta);
        self.submit(change, Bytes::new(), Reservation::none()).await
    }

    /// Which chunks of the volume retain blocks for which epochs, and the bytes each
    /// such (chunk, epoch) holds, by chunk and epoch.
    pub fn retained_epochs(&self, volume_id: u64) -> Vec<(ChunkId, u32, u64)> {
        self.files.retained.sidecars_of(volume_id)
    }

    /// Drops the blocks at `offsets` the chunk retained for `epoch` (no snapshot reads
    /// them, though others of the epoch are read). Resolves once durable.
    pub async fn forget_retained(
        &self,
        chunk: ChunkId,
        epoch: u32,
        offsets: &[u64],
    ) -> Result<(), StoreError> {
        let meta = ChunkMeta {
            view: epoch as u64,
            version: 0,
        };
        let mut results = Vec::with_capacity(offsets.len());
        for &offset in offsets {
            check_range(offset, BLOCK_BYTES)?;
            let forget = Submit::control(Kind::Forget, chunk, offset, 0, meta);
            results.push(self.enqueue(forget, Bytes::new(), Reservation::none())?);
        }
        // Woken once for them all: they commit together.
        self.queue.wake.notify_one();
        for result in results {
            result.await.map_err(|_| StoreError::ShutDown)??;
        }
        Ok(())
    }

    /// The chunk's retained blocks, by epoch and offset (those of unsynced changes
    /// once synced).
    pub fn retained(&self, chunk: ChunkId) -> Vec<RetainedEntry> {
        self.files.retained.entries(chunk)
    }

    /// The chunk's view and version as of its last acknowledged change (durable
    /// unless that was unsynced; zeroes for a chunk never written).
    pub fn meta(&self, chunk: ChunkId) -> ChunkMeta {
        self.files
            .metas
            .lock()
            .unwrap()
            .get(&chunk)
            .copied()
            .unwrap_or_default()
    }

    /// Drops every chunk of a volume. Resolves once durable.
    pub async fn delete_volume(&self, volume_id: u64) -> Result<(), StoreError> {
        let chunk = ChunkId {
            volume_id,
            index: 0,
        };
        let change = Submit::control(Kind::DeleteVolume, chunk, 0, 0, ChunkMeta::default());
        self.submit(change, Bytes::new(), Reservation::none()).await
    }

    async fn submit(
        &self,
        change: Submit,
        data: Bytes,
        reservation: Reservation,
    ) -> Result<(), StoreError> {
        let result = self.enqueue(change, data, reservation)?;
        self.queue.wake.notify_one();
        result.await.map_err(|_| StoreError::ShutDown)?
    }

    /// Checks `change` and queues it for the committer (woken by the caller); its
    /// result comes on the receiver.
    fn enqueue(
        &self,
        change: Submit,
        data: Bytes,
        reservation: Reservation,
    ) -> Result<oneshot::Receiver<Result<(), StoreError>>, StoreError> {
        if !matches!(change.kind, Kind::DeleteVolume | Kind::Release) {
            check_range(change.offset, change.length)?;
        }
        if change.retain.is_some() {
            self.check_retaining(change.length)?;
        }
        let (done, result) = oneshot::channel();
        self.queue.changes.lock().unwrap().push(Change {
            header: change.header(),
            data,
            done,
            sync: change.sync,
            retain: change.retain,
            _reservation: reservation,
        });
        Ok(result)
    }

    /// Whether this store may retain for a change of `length` bytes.
    fn check_retaining(&self, length: u64) -> Result<(), StoreError> {
        if length > RETAIN_CHANGE_BYTES_MAX {
            return Err(StoreError::Unsupported(format!(
                "a change that retains old blocks covers at most {RETAIN_CHANGE_BYTES_MAX} bytes, not {length}: split it"
            )));
        }
        Ok(())
    }

    /// Reads a range; parts never written read as zeroes. Journaled data comes from the
    /// journals, the rest from the chunk file. Runs on the caller's thread: chunk files
    /// are in the page cache for hot data, and a pread is cheaper than a hop to another
    /// thread (an emulated disk only makes the caller wait afterwards).
    ///
    /// A block that fails its checksum is never returned: the read fails with
    /// [`StoreError::Corrupt`], and the block is logged and kept for
    /// [`Store::take_corrupt`].
    pub async fn read(
        &self,
        chunk: ChunkId,
        offset: u64,
        length: u32,
    ) -> Result<Bytes, StoreError> {
        self.reported(self.read_unreported(chunk, offset, length).await)
    }

    /// [`Store::read`], leaving a corrupt block for the caller to report.
    async fn read_unreported(
        &self,
        chunk: ChunkId,
        offset: u64,
        length: u32,
    ) -> Result<Bytes, StoreError> {
        check_range(offset, length as u64)?;
        if length > READ_BYTES_MAX {
            return Err(StoreError::OutOfRange {
                offset,
                length: length as u64,
            });
        }
        // Unsynced writes reach the chunk files only once synced (hybrid mode reads
        // them from the journals in place).
        if self.files.journals.is_none() && self.files.unsynced.holds(chunk) {
            self.sync().await?;
        }
        let mut out = BytesMut::zeroed(length as usize);
        let read = self
            .files
            .read_into(chunk, offset, &mut out, self.files.check_reads);
        if let Some(at) = hdd::take_paced_until() {
            tokio::time::sleep_until(at.into()).await;
        }
        read.map(|()| out.freeze())
    }

    /// The ranges of the chunk that hold data, as (offset, length), sorted and
    /// disjoint; the rest are holes. Journaled ranges count as data, unsynced writes
    /// only once synced ([`Store::sync`] first for them).
    pub fn extents(&self, chunk: ChunkId) -> Result<Vec<(u64, u64)>, StoreError> {
        // The journals' ranges first: replay writes a range to the chunk file before it
        // drops it from the journal index, so a range replayed meanwhile is in the
        // file's extents taken after. (The other order lost such a range, and a whole
        // copy built from these extents left it out: replicas differed.)
        if let Some(chain) = &self.files.chain {
            return Ok(chain.extents(chunk));
        }
        let journaled = self.files.journals.as_ref().map(|j| j.extents(chunk));
        let mut out = match self.files.get(chunk, false)? {
            Some(file) => file.data.extents()?,
            None => Vec::new(),
        };
        if let Some(journaled) = journaled {
            out.extend(journaled);
            out.sort_unstable();
            let mut joined: Vec<(u64, u64)> = Vec::with_capacity(out.len());
            for (offset, length) in out {
                match joined.last_mut() {
                    Some((o, l)) if *o + *l >= offset => *l = (*l).max(offset + length - *o),
                    _ => joined.push((offset, length)),
                }
            }
            out = joined;
        }
        Ok(out)
    }

    /// crc32c of the chunk's first `length` bytes, holes and the part past the end of
    /// the file read as zeroes, and the offsets of the blocks that fail their
    /// checksums (read as zeroes for the crc; the caller, a scrub, reports them).
    pub async fn checksum(
        &self,
        chunk: ChunkId,
        length: u64,
    ) -> Result<(u32, Vec<u64>), StoreError> {
        check_range(0, length)?;
        let mut crc = 0;
        let mut bad = Vec::new();
        let mut at = 0;
        while at < length {
            let n = (length - at).min(SCAN_PIECE_BYTES);
            for (offset, block) in self.read_blocks(chunk, at, n).await? {
                let data = match block {
                    Block::Good(data) => data,
                    Block::Corrupt { length, .. } => {
                        bad.push(offset);
                        Bytes::from(vec![0; length as usize])
                    }
                };
                crc = crc32c::crc32c_append(crc, &data);
            }
            at += n;
        }
        Ok((crc, bad))
    }

    /// A fingerprint of each 4 KiB block of the chunk, from its start to the end of
    /// its last extent: 0 for a hole, else [`fingerprint`] of the block's bytes;
    /// `None` for a block that fails its checksum (logged and kept for
    /// [`Store::take_corrupt`], as a read's). Two replicas hold the same block where
    /// their fingerprints are equal and not `None`, so a repair copies only the blocks
    /// that differ ([`BLOCK_BYTES`] granularity; a block partly a hole counts as data).
    pub async fn block_sums(&self, chunk: ChunkId) -> Result<Vec<Option<u64>>, StoreError> {
        let extents = self.extents(chunk)?;
        let end = extents.last().map_or(0, |(offset, length)| {
            (offset + length).next_multiple_of(BLOCK_BYTES)
        });
        check_range(0, end)?;
        let mut sums = vec![Some(0); (end / BLOCK_BYTES) as usize];
        for (offset, length) in extents {
            let mut at = offset - offset % BLOCK_BYTES;
            let end = (offset + length).next_multiple_of(BLOCK_BYTES);
            while at < end {
                let n = (end - at).min(SCAN_PIECE_BYTES);
                for (offset, block) in self.read_blocks(chunk, at, n).await? {
                    sums[(offset / BLOCK_BYTES) as usize] = match block {
                        Block::Good(data) => Some(fingerprint(&data)),
                        Block::Corrupt { place, .. } => {
                            self.files.found_corrupt(chunk, offset, place);
                            None
                        }
                    };
                }
                at += n;
            }
        }
        Ok(sums)
    }

    /// Reads `length` bytes at `offset` as blocks of at most [`BLOCK_BYTES`], each with
    /// its offset; a block that fails its checksum is left for the caller to report.
    async fn read_blocks(
        &self,
        chunk: ChunkId,
        offset: u64,
        length: u64,
    ) -> Result<Vec<(u64, Block)>, StoreError> {
        let end = offset + length;
        let spans = (offset..end)
            .step_by(BLOCK_BYTES as usize)
            .map(|at| (at, (end - at).min(BLOCK_BYTES) as u32));
        match self.read_unreported(chunk, offset, length as u32).await {
            Ok(data) => Ok(spans
                .map(|(at, length)| {
                    let from = (at - offset) as usize;
                    (at, Block::Good(data.slice(from..from + length as usize)))
                })
                .collect()),
            // Block by block, to name every bad one.
            Err(StoreError::Corrupt { .. }) => {
                let mut out = Vec::new();
                for (at, length) in spans {
                    let block = match self.read_unreported(chunk, at, length).await {
                        Err(StoreError::Corrupt { place, .. }) => Block::Corrupt { length, place },
                        other => Block::Good(other?),
                    };
                    out.push((at, block));
                }
                Ok(out)
            }
            Err(e) => Err(e),
        }
    }

    /// Blocks found failing their checksums since the last call (chunk, offset), by
    /// reads, writes over them and replay; each was logged.
    pub fn take_corrupt(&self) -> Vec<(ChunkId, u64)> {
        self.files.take_corrupt()
    }

    /// Blocks found failing their checksums since the store opened.
    pub fn corrupt_found(&self) -> u64 {
        self.files.corrupt_found()
    }

    /// Bytes in use in the ssd journals and the sum of their quotas, what the master
    /// throttles writes by (the hdd's own journal only takes what they cannot); (0, 0)
    /// without journals.
    pub fn journal_usage(&self) -> (u64, u64) {
        self.files
            .journals
            .as_ref()
            .map_or((0, 0), Journals::ssd_usage)
    }

    /// Bytes in use in every journal, the hdd's own included: what replay has left.
    pub fn journal_backlog(&self) -> u64 {
        self.files.journals.as_ref().map_or(0, Journals::backlog)
    }

    /// Bytes of chunk data and their checksums on disk (allocated blocks), retained
    /// blocks included.
    pub fn used_bytes(&self) -> u64 {
        if let Some(chain) = &self.files.chain {
            return chain.stats().live_blocks * BLOCK_BYTES + self.files.retained.bytes();
        }
        let disk = &self.files.disk;
        self.files.retained.bytes()
            + self
                .chunks()
                .into_iter()
                .map(|chunk| {
                    [
                        layout::chunk_path(&self.files.dir, chunk),
                        layout::sums_path(&self.files.dir, chunk),
                    ]
                    .iter()
                    .map(|path| disk.allocated_bytes(path).unwrap_or(0))
                    .sum::<u64>()
                })
                .sum::<u64>()
    }

    /// Every chunk replica stored here.
    pub fn chunks(&self) -> Vec<ChunkId> {
        if let Some(chain) = &self.files.chain {
            return chain.chunks();
        }
        let disk = &self.files.disk;
        let chunks = layout::chunks_dir(&self.files.dir);
        let mut out = Vec::new();
        for volume in disk.read_dir(&chunks).unwrap_or_default() {
            let Some(volume_id) = layout::parse_hex(&volume) else {
                continue;
            };
            for name in disk.read_dir(&chunks.join(&volume)).unwrap_or_default() {
                if let Some(index) = layout::parse_hex(&name) {
                    out.push(ChunkId { volume_id, index });
                }
            }
        }
        out.sort();
        out
    }

    /// GetCost: what reading the block holding `offset` costs the chained-log
    /// engine now (for a replica choice); `None` for the files engine.
    pub fn read_cost(&self, chunk: ChunkId, offset: u64) -> Option<ReadCost> {
        self.files
            .chain
            .as_ref()
            .map(|chain| chain.read_cost(chunk, offset))
    }

    /// The chained-log engine's counters; `None` for the files engine.
    pub fn chain_stats(&self) -> Option<ChainStats> {
        self.files.chain.as_ref().map(Chain::stats)
    }

    /// Hybrid mode with [`Tuning::manual_replay`]: one replay sweep (up to 4 MiB of
    /// journal data copied into the chunk files, synced, then dropped from the
    /// index); the committer resets the journals it emptied at its next turn.
    /// Returns the bytes copied; 0 without journals or with nothing left to replay.
    pub fn replay_sweep(&self) -> Result<u64, StoreError> {
        if self.files.journals.is_none() {
            return Ok(0);
        }
        Ok(replay::replay(&self.files, &self.queue)? * crate::wal::SECTOR_BYTES)
    }
}

/// A block read by a scan.
enum Block {
    Good(Bytes),
    /// Fails its checksum (found in `place`: chunk file or journal).
    Corrupt {
        length: u32,
        place: &'static str,
    },
}

/// Bytes per read of a whole-chunk scan.
const SCAN_PIECE_BYTES: u64 = 4 << 20;

fn check_range(offset: u64, length: u64) -> Result<(), StoreError> {
    match offset.checked_add(length) {
        Some(end) if end <= CHUNK_BYTES_MAX => Ok(()),
        _ => Err(StoreError::OutOfRange { offset, length }),
    }
}
