//! The chunk store: group-committed write-ahead log + sparse chunk files, and in
//! hybrid mode ssd journals in front of an hdd's chunk files (see [`crate::journal`]).

use crate::hdd::Hdd;
use crate::journal::{self, JournalDir, Journals, JOURNAL_WRITE_BYTES_MAX};
use crate::meta::{self, ChunkMeta, Metas};
use crate::wal::{self, HeaderError, Kind, RecordHeader, RECORD_HEADER_BYTES, SECTOR_BYTES};
use bytes::{Bytes, BytesMut};
use floe_protocol::ChunkId;
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{oneshot, Notify};

/// Largest chunk a replica may be asked to hold; offsets beyond are rejected.
pub const CHUNK_BYTES_MAX: u64 = 1 << 30;
/// Largest single read: bounds the buffer a peer can make us allocate.
pub const READ_BYTES_MAX: u32 = 32 << 20;
/// Log bytes after which the committer checkpoints (syncs chunk files, reuses log).
const WAL_BYTES_CHECKPOINT: u64 = 256 << 20;
/// Log bytes gathered into one append + fdatasync.
const BATCH_BYTES_MAX: usize = 16 << 20;
/// Open chunk files kept cached.
const OPEN_FILES_MAX: usize = 4096;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("range {offset}+{length} is outside a chunk (max {CHUNK_BYTES_MAX} bytes)")]
    OutOfRange { offset: u64, length: u64 },
    #[error("disk full: {0}")]
    NoSpace(String),
    #[error("disk error: {0}")]
    Io(String),
    #[error("store is shut down")]
    ShutDown,
}

impl From<io::Error> for StoreError {
    fn from(e: io::Error) -> Self {
        if e.raw_os_error() == Some(libc::ENOSPC) {
            StoreError::NoSpace(e.to_string())
        } else {
            StoreError::Io(e.to_string())
        }
    }
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
    /// Emulate a hard disk's service times on chunk-file access (see [`crate::hdd`]).
    pub emulate_hdd: bool,
}

type Done = oneshot::Sender<Result<(), StoreError>>;

struct Change {
    header: RecordHeader,
    data: Bytes,
    done: Done,
}

type Completions = Vec<(Done, Result<(), StoreError>)>;

/// Changes waiting for the next commit. Submitters are bounded upstream: each
/// connection has a fixed number of requests in flight.
#[derive(Default)]
pub(crate) struct Queue {
    changes: Mutex<Vec<Change>>,
    pub(crate) wake: Notify,
}

/// Chunk files and their durable replication state, shared by readers, the committer
/// and the replay worker.
pub(crate) struct Files {
    dir: PathBuf,
    open: Mutex<HashMap<ChunkId, Arc<File>>>,
    /// Updated as log records commit: the state of what is durable.
    metas: Mutex<Metas>,
    pub(crate) hdd: Option<Hdd>,
    pub(crate) journals: Option<Journals>,
}

impl Files {
    fn path(&self, chunk: ChunkId) -> PathBuf {
        self.volume_dir(chunk.volume_id)
            .join(format!("{:016x}", chunk.index))
    }

    fn volume_dir(&self, volume_id: u64) -> PathBuf {
        self.dir.join("chunks").join(format!("{volume_id:016x}"))
    }

    /// The chunk's file; `None` when it does not exist and `create` is false.
    pub(crate) fn get(&self, chunk: ChunkId, create: bool) -> io::Result<Option<Arc<File>>> {
        if let Some(f) = self.open.lock().unwrap().get(&chunk) {
            return Ok(Some(f.clone()));
        }
        let path = self.path(chunk);
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound && create => {
                std::fs::create_dir_all(path.parent().expect("chunk path has a parent"))?;
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&path)?
            }
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let file = Arc::new(file);
        let mut open = self.open.lock().unwrap();
        if open.len() >= OPEN_FILES_MAX {
            open.clear();
        }
        Ok(Some(open.entry(chunk).or_insert(file).clone()))
    }

    /// The directories whose entries a new file of `chunk` adds to.
    pub(crate) fn dirs_of(&self, chunk: ChunkId) -> [PathBuf; 2] {
        [self.volume_dir(chunk.volume_id), self.dir.join("chunks")]
    }

    fn forget_volume(&self, volume_id: u64) {
        self.open
            .lock()
            .unwrap()
            .retain(|c, _| c.volume_id != volume_id);
    }

    /// Reserves the emulated disk for a chunk-file access; the instant it completes.
    pub(crate) fn pace(
        &self,
        chunk: ChunkId,
        offset: u64,
        length: u64,
        foreground: bool,
    ) -> Option<Instant> {
        self.hdd
            .as_ref()
            .map(|hdd| hdd.reserve(chunk, offset, length, foreground))
    }

    /// Reserves the emulated disk for an access to its own journal at byte `at`.
    pub(crate) fn pace_journal(&self, at: u64, length: u64, foreground: bool) -> Option<Instant> {
        self.hdd
            .as_ref()
            .map(|hdd| hdd.reserve_journal(at, length, foreground))
    }
}

/// A handle to the store; cheap to clone. A process that stops at any moment
/// (SIGTERM, kill -9) replays the log at the next open.
#[derive(Clone)]
pub struct Store {
    files: Arc<Files>,
    queue: Arc<Queue>,
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
        std::fs::create_dir_all(dir.join("chunks"))?;
        let hybrid = !options.journal_dirs.is_empty();
        let local_journal = dir.join(journal::LOCAL_FILE);
        if !hybrid && local_journal.exists() {
            return Err(StoreError::Io(format!(
                "{} exists: this data directory was run with --journal; start it with the \
                 same journal directories so their data is replayed",
                local_journal.display()
            )));
        }
        let mut files = Files {
            dir: dir.to_path_buf(),
            open: Mutex::default(),
            metas: Mutex::new(meta::load(&dir.join("meta"))?),
            hdd: options.emulate_hdd.then(Hdd::default),
            journals: None,
        };
        let queue = Arc::new(Queue::default());
        let log = if hybrid {
            let wal = dir.join("wal");
            if wal.exists() {
                // Drain a log from a run without journals into the chunk files first.
                let shared = Arc::new(files);
                drop(Log::open_direct(&wal, shared.clone())?);
                std::fs::remove_file(&wal)?;
                files = Arc::try_unwrap(shared)
                    .unwrap_or_else(|_| unreachable!("the draining log was dropped"));
            }
            let (journals, logs) = Journals::open(
                dir,
                &options.journal_dirs,
                options.local_journal_quota_bytes,
            )?;
            files.journals = Some(journals);
            let files = Arc::new(files);
            let log = Log::open_journals(logs, files.clone())?;
            journal::spawn_replay(Arc::downgrade(&files), queue.clone());
            log
        } else {
            Log::open_direct(&dir.join("wal"), Arc::new(files))?
        };
        let files = log.files.clone();
        tokio::spawn(log.run(queue.clone()));
        Ok(Store { files, queue })
    }

    /// Writes `data` at `offset`, leaving the chunk in state `meta`; resolves once
    /// durable. Changes to one chunk are logged and applied in submission order.
    pub async fn write(
        &self,
        chunk: ChunkId,
        offset: u64,
        data: Bytes,
        meta: ChunkMeta,
    ) -> Result<(), StoreError> {
        let length = data.len() as u64;
        self.submit(Kind::Write, chunk, offset, length, meta, data)
            .await
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
        let kind = if punch { Kind::Punch } else { Kind::Zero };
        self.submit(kind, chunk, offset, length, meta, Bytes::new())
            .await
    }

    /// Sets the chunk's view and version only. Resolves once durable.
    pub async fn set_meta(&self, chunk: ChunkId, meta: ChunkMeta) -> Result<(), StoreError> {
        self.submit(Kind::Stamp, chunk, 0, 0, meta, Bytes::new())
            .await
    }

    /// The chunk's durable view and version (zeroes for a chunk never written).
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
        self.submit(
            Kind::DeleteVolume,
            chunk,
            0,
            0,
            ChunkMeta::default(),
            Bytes::new(),
        )
        .await
    }

    async fn submit(
        &self,
        kind: Kind,
        chunk: ChunkId,
        offset: u64,
        length: u64,
        meta: ChunkMeta,
        data: Bytes,
    ) -> Result<(), StoreError> {
        if kind != Kind::DeleteVolume {
            check_range(offset, length)?;
        }
        let (done, result) = oneshot::channel();
        let header = RecordHeader {
            seq: 0, // assigned by the committer, in log order
            kind,
            chunk,
            offset,
            length,
            view: meta.view,
            version: meta.version,
        };
        self.queue
            .changes
            .lock()
            .unwrap()
            .push(Change { header, data, done });
        self.queue.wake.notify_one();
        result.await.map_err(|_| StoreError::ShutDown)?
    }

    /// Reads a range; parts never written read as zeroes. Journaled data comes from the
    /// journals, the rest from the chunk file. Runs on the caller's thread: chunk files
    /// are in the page cache for hot data, and a pread is cheaper than a hop to another
    /// thread (an emulated disk only makes the caller wait afterwards).
    pub async fn read(
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
        let mut out = BytesMut::zeroed(length as usize);
        let mut done_at = None;
        let holes = match &self.files.journals {
            Some(journals) => {
                let (holes, from_hdd_journal) = journals.read(chunk, offset, &mut out)?;
                for (at, len) in from_hdd_journal {
                    done_at = done_at.max(self.files.pace_journal(at, len, true));
                }
                holes
            }
            None => vec![(offset, length as u64)],
        };
        if let Some(file) = self.files.get(chunk, false)? {
            for (at, len) in holes {
                let from = (at - offset) as usize;
                read_at(&file, &mut out[from..from + len as usize], at)?;
                done_at = done_at.max(self.files.pace(chunk, at, len, true));
            }
        }
        if let Some(at) = done_at {
            tokio::time::sleep_until(at.into()).await;
        }
        Ok(out.freeze())
    }

    /// The ranges of the chunk that hold data, as (offset, length), sorted and
    /// disjoint; the rest are holes. Journaled ranges count as data.
    pub fn extents(&self, chunk: ChunkId) -> Result<Vec<(u64, u64)>, StoreError> {
        let mut out = match self.files.get(chunk, false)? {
            Some(file) => file_extents(&file)?,
            None => Vec::new(),
        };
        if let Some(journals) = &self.files.journals {
            out.extend(journals.extents(chunk));
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
    /// the file read as zeroes.
    pub async fn checksum(&self, chunk: ChunkId, length: u64) -> Result<u32, StoreError> {
        check_range(0, length)?;
        let mut crc = 0;
        let mut at = 0;
        while at < length {
            let n = (length - at).min(READ_BYTES_MAX as u64 / 8) as u32;
            crc = crc32c::crc32c_append(crc, &self.read(chunk, at, n).await?);
            at += n as u64;
        }
        Ok(crc)
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

    /// Bytes of chunk data on disk (allocated blocks).
    pub fn used_bytes(&self) -> u64 {
        fn walk(path: &Path) -> u64 {
            use std::os::unix::fs::MetadataExt;
            let Ok(entries) = std::fs::read_dir(path) else {
                return 0;
            };
            entries
                .flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => walk(&e.path()),
                    Ok(m) => m.blocks() * 512,
                    Err(_) => 0,
                })
                .sum()
        }
        walk(&self.files.dir.join("chunks"))
    }

    /// Every chunk replica stored here.
    pub fn chunks(&self) -> Vec<ChunkId> {
        let mut out = Vec::new();
        let Ok(volumes) = std::fs::read_dir(self.files.dir.join("chunks")) else {
            return out;
        };
        for volume in volumes.flatten() {
            let Some(volume_id) = parse_hex(&volume.file_name()) else {
                continue;
            };
            for chunk in std::fs::read_dir(volume.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                if let Some(index) = parse_hex(&chunk.file_name()) {
                    out.push(ChunkId { volume_id, index });
                }
            }
        }
        out.sort();
        out
    }
}

fn parse_hex(name: &std::ffi::OsStr) -> Option<u64> {
    u64::from_str_radix(name.to_str()?, 16).ok()
}

fn check_range(offset: u64, length: u64) -> Result<(), StoreError> {
    match offset.checked_add(length) {
        Some(end) if end <= CHUNK_BYTES_MAX => Ok(()),
        _ => Err(StoreError::OutOfRange { offset, length }),
    }
}

/// One log file: the data directory's log, or a journal.
pub(crate) struct LogFile {
    pub(crate) file: Arc<File>,
    path: PathBuf,
    /// Format 3 (journal data on sector boundaries) or 2 (packed).
    aligned: bool,
    /// Where the next batch is appended.
    position: u64,
    /// Bytes the file may fill before a checkpoint (the plain log) or an overflow.
    pub(crate) quota: u64,
    /// The header's start sequence; `None` for a new file without a header yet.
    start_seq: Option<u64>,
    /// Sequence numbers of the first and last record since the header was written.
    seqs: Option<(u64, u64)>,
}

impl LogFile {
    pub(crate) fn open(path: &Path, aligned: bool, quota: u64) -> Result<LogFile, StoreError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let mut head = vec![0u8; wal::HEADER_BYTES as usize];
        let read = file.read_at(&mut head, 0)?;
        let start_seq = match wal::decode_header(&head[..read], aligned) {
            Ok(seq) => Some(seq),
            Err(_) if read == 0 => None,
            Err(HeaderError::NotALog) => {
                return Err(StoreError::Io(format!(
                    "{} is not a Floe write-ahead log (bad header); refusing to overwrite it",
                    path.display()
                )))
            }
            Err(HeaderError::Format(version)) => {
                return Err(StoreError::Io(format!(
                    "{} is a write-ahead log of format {version}, which this Floe cannot read \
                     as a {}; start the chunk server of the Floe version (or with the journal \
                     options) that wrote it to drain it",
                    path.display(),
                    if aligned { "journal" } else { "log" }
                )))
            }
        };
        Ok(LogFile {
            file: Arc::new(file),
            path: path.to_path_buf(),
            aligned,
            position: wal::HEADER_BYTES,
            quota,
            start_seq,
            seqs: None,
        })
    }

    /// Visits every valid record after the header, in order, with the position of its
    /// data, stopping at the first that is torn, stale or absent; leaves `position`
    /// after the last.
    fn scan(
        &mut self,
        mut visit: impl FnMut(&RecordHeader, u64, &[u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut next_seq = self.start_seq.unwrap_or(1);
        let mut raw = [0u8; RECORD_HEADER_BYTES];
        let mut data = Vec::new();
        loop {
            if !read_exact_at(&self.file, &mut raw, self.position)? {
                break;
            }
            let Some((header, crc)) = RecordHeader::decode(&raw, next_seq) else {
                break;
            };
            data.resize(header.data_len(), 0);
            let data_at = header.data_at(self.position, self.aligned);
            if !read_exact_at(&self.file, &mut data, data_at)?
                || !RecordHeader::check(&raw, &data, crc)
            {
                break;
            }
            visit(&header, data_at, &data)?;
            self.position = data_at + data.len() as u64;
            self.seqs = Some((self.seqs.map_or(header.seq, |s| s.0), header.seq));
            next_seq = header.seq + 1;
        }
        Ok(())
    }

    /// The sequence number the next record needs to be at least.
    fn next_seq(&self) -> u64 {
        self.seqs
            .map_or(self.start_seq.unwrap_or(1), |(_, last)| last + 1)
    }

    /// Forgets every record: a new header whose start sequence is past all of them.
    fn reset(&mut self, next_seq: u64) -> Result<(), StoreError> {
        self.file
            .write_all_at(&wal::encode_header(next_seq, self.aligned), 0)?;
        self.file.sync_data()?;
        self.position = wal::HEADER_BYTES;
        self.start_seq = Some(next_seq);
        self.seqs = None;
        Ok(())
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

/// The log (or the journals) and everything only the committer touches.
struct Log {
    /// The data directory's log alone; in hybrid mode the journals (the hdd's own
    /// last).
    logs: Vec<LogFile>,
    /// The log the next batch goes to.
    active: usize,
    files: Arc<Files>,
    /// Sequence number of the next record, global across the logs.
    next_seq: u64,
    /// Chunk files and directories changed since they were last synced.
    dirty_files: HashSet<ChunkId>,
    dirty_dirs: HashSet<PathBuf>,
    buffer: Vec<u8>,
    /// Set when the log can no longer be written safely; every change then fails.
    failed: Option<String>,
    /// When the emulated disk completes the batch's chunk-file accesses.
    paced_until: Option<Instant>,
}

impl Log {
    fn new(logs: Vec<LogFile>, files: Arc<Files>) -> Log {
        let next_seq = logs.iter().map(LogFile::next_seq).max().unwrap_or(1);
        Log {
            logs,
            active: 0,
            files,
            next_seq,
            dirty_files: HashSet::new(),
            dirty_dirs: HashSet::new(),
            buffer: Vec::new(),
            failed: None,
            paced_until: None,
        }
    }

    fn hybrid(&self) -> bool {
        self.files.journals.is_some()
    }

    /// The plain log: re-applies every valid record after the header, then
    /// checkpoints.
    fn open_direct(path: &Path, files: Arc<Files>) -> Result<Log, StoreError> {
        let mut file = LogFile::open(path, false, WAL_BYTES_CHECKPOINT)?;
        let mut log = Log::new(Vec::new(), files);
        let mut replayed = 0;
        file.scan(|header, _, data| {
            replayed += 1;
            log.apply(header, data)
        })?;
        log.next_seq = file.next_seq();
        log.logs.push(file);
        if replayed > 0 {
            tracing::info!(records = replayed, "replayed write-ahead log");
        }
        log.checkpoint()?;
        log.paced_until = None;
        Ok(log)
    }

    /// The journals: scans them all, applies their records in sequence order to the
    /// index and the replicas' states, and resets the ones with nothing left to replay.
    fn open_journals(mut logs: Vec<LogFile>, files: Arc<Files>) -> Result<Log, StoreError> {
        // Records older than any header's start were reclaimed (see
        // `journals_to_reset`), even where a crash cut the resets short.
        let floor = logs
            .iter()
            .filter_map(|log| log.start_seq)
            .max()
            .unwrap_or(1);
        let mut records = Vec::new();
        for (j, log) in logs.iter_mut().enumerate() {
            log.scan(|header, data_at, _| {
                if header.seq >= floor {
                    records.push((*header, j, data_at));
                }
                Ok(())
            })?;
        }
        records.sort_by_key(|(header, _, _)| header.seq);
        let mut log = Log::new(logs, files);
        log.active = records.last().map_or(0, |&(_, j, _)| j);
        for (header, j, data_at) in &records {
            log.record_effects(header, *j, *data_at)?;
        }
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
        }
        log.reclaim()?;
        Ok(log)
    }

    fn journals(&self) -> &Journals {
        self.files
            .journals
            .as_ref()
            .expect("hybrid mode has journals")
    }

    async fn run(mut self, queue: Arc<Queue>) {
        let mut batch: Vec<Change> = Vec::new();
        loop {
            queue.wake.notified().await;
            // Let every task that is ready (requests just read off sockets) queue its
            // change first, so they share this commit.
            tokio::task::yield_now().await;
            loop {
                {
                    let mut changes = queue.changes.lock().unwrap();
                    let mut bytes = 0;
                    let take = changes
                        .iter()
                        .take_while(|c| {
                            bytes += c.data.len();
                            bytes <= BATCH_BYTES_MAX
                        })
                        .count()
                        .max(1)
                        .min(changes.len());
                    batch.extend(changes.drain(..take));
                }
                if self.hybrid() && self.journals().replayed.swap(false, Ordering::Acquire) {
                    if let Err(e) = self.reclaim() {
                        tracing::error!("resetting replayed journals failed, will retry: {e}");
                    }
                }
                if batch.is_empty() {
                    break;
                }
                let completions = if self.hybrid() {
                    self.commit_journaled(&mut batch)
                } else {
                    self.commit(&mut batch)
                };
                if let Some(at) = self.paced_until.take() {
                    tokio::time::sleep_until(at.into()).await;
                }
                for (done, result) in completions {
                    let _ = done.send(result);
                }
                if !self.hybrid() && self.logs[0].position >= self.logs[0].quota {
                    if let Err(e) = self.checkpoint() {
                        tracing::error!("checkpoint failed, will retry: {e}");
                    }
                }
            }
        }
    }

    fn fail_all(batch: &mut Vec<Change>, error: StoreError) -> Completions {
        batch
            .drain(..)
            .map(|c| (c.done, Err(error.clone())))
            .collect()
    }

    /// Appends the batch to `self.logs[self.active]` as one write and one fdatasync.
    fn append(&mut self, batch: &mut [Change]) -> io::Result<()> {
        let log = &mut self.logs[self.active];
        self.buffer.clear();
        for change in batch.iter_mut() {
            change.header.seq = self.next_seq;
            self.next_seq += 1;
            let data = if change.header.kind == Kind::Write {
                &change.data[..]
            } else {
                &[]
            };
            change
                .header
                .encode(data, &mut self.buffer, log.position, log.aligned);
        }
        log.file.write_all_at(&self.buffer, log.position)?;
        log.file.sync_data()?;
        if let (Some(first), Some(last)) = (batch.first(), batch.last()) {
            log.seqs = Some((log.seqs.map_or(first.header.seq, |s| s.0), last.header.seq));
        }
        Ok(())
    }

    /// Plain mode: appends the batch, then applies it to the chunk files.
    fn commit(&mut self, batch: &mut Vec<Change>) -> Completions {
        if let Some(failed) = &self.failed {
            return Log::fail_all(batch, StoreError::Io(failed.clone()));
        }
        if let Err(e) = self.append(batch) {
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
            return Log::fail_all(batch, append_error(&e, message));
        }
        self.logs[0].position += self.buffer.len() as u64;
        batch
            .drain(..)
            .map(|change| {
                let result = self.apply(&change.header, &change.data);
                if let Err(e) = &result {
                    tracing::error!(chunk = ?change.header.chunk, "applying a logged change failed: {e}");
                }
                (change.done, result)
            })
            .collect()
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

    /// Hybrid mode: small aligned writes go to a journal only; every other change
    /// goes to the chunk files first, durably, then its record to the journal.
    fn commit_journaled(&mut self, batch: &mut Vec<Change>) -> Completions {
        if let Some(failed) = &self.failed {
            return Log::fail_all(batch, StoreError::Io(failed.clone()));
        }
        let journaled = |h: &RecordHeader| {
            h.kind == Kind::Write
                && h.length <= JOURNAL_WRITE_BYTES_MAX
                && h.offset.is_multiple_of(SECTOR_BYTES)
                && h.length.is_multiple_of(SECTOR_BYTES)
        };
        // Upper bounds: a header and its padding per record, plus the data.
        let headers = (batch.len() as u64) * (RECORD_HEADER_BYTES as u64 + SECTOR_BYTES);
        let data: u64 = batch
            .iter()
            .filter(|c| journaled(&c.header))
            .map(|c| c.header.length)
            .sum();
        let local = self.logs.len() - 1;
        let (target, to_journal) = match self.choose_journal(headers + data) {
            Some(j) => (j, true),
            // No room for the data anywhere: everything bypasses; the hdd's own
            // journal takes the records past its quota if it must.
            None => (self.choose_journal(headers).unwrap_or(local), false),
        };
        if target != self.active {
            tracing::info!(
                from = %self.logs[self.active].path.display(),
                to = %self.logs[target].path.display(),
                "journal overflow: switching journals"
            );
            self.active = target;
        }
        for change in batch.iter_mut() {
            if change.header.kind == Kind::Write && !(to_journal && journaled(&change.header)) {
                change.header.kind = Kind::Bypass;
            }
        }
        let files = self.files.clone();
        let journals = files.journals.as_ref().expect("hybrid mode has journals");
        let _writes = journals.chunk_writes.lock().unwrap();
        // After a crash nothing re-applies these to the chunk files (a newer write
        // may have bypassed to the same range), so they must be durable before their
        // records are.
        let applied = batch
            .iter()
            .filter(|c| !matches!(c.header.kind, Kind::Write | Kind::Stamp))
            .try_for_each(|c| self.apply_file(&c.header, &c.data))
            .and_then(|()| self.sync_dirty());
        if let Err(e) = applied {
            tracing::error!("applying changes to chunk files failed: {e}");
            return Log::fail_all(batch, e);
        }
        let start = self.logs[target].position;
        if let Err(e) = self.append(batch) {
            // Records of the batch left on disk are older than any later record at
            // the same place, so the scan after a crash stops before them.
            let message = format!("journal append failed: {e}");
            tracing::error!("{message}");
            return Log::fail_all(batch, append_error(&e, message));
        }
        if target == local {
            let done = self
                .files
                .pace_journal(start, self.buffer.len() as u64, true);
            self.paced_until = self.paced_until.max(done);
        }
        let log = &mut self.logs[target];
        log.position += self.buffer.len() as u64;
        journals.set_used(target, log.position - wal::HEADER_BYTES);
        let mut at = start;
        batch
            .drain(..)
            .map(|change| {
                let data_at = change.header.data_at(at, true);
                at = data_at + change.header.data_len() as u64;
                let result = self.record_effects(&change.header, target, data_at);
                (change.done, result)
            })
            .collect()
    }

    /// Hybrid mode: what a durable record changes in memory (the replica's state and
    /// the journal index), at commit and again when the journals are scanned.
    fn record_effects(
        &mut self,
        header: &RecordHeader,
        journal: usize,
        data_at: u64,
    ) -> Result<(), StoreError> {
        self.apply_meta(header);
        let journals = self.journals();
        match header.kind {
            Kind::Write => {
                journals.insert(header.chunk, header.offset, header.length, journal, data_at)
            }
            Kind::Bypass | Kind::Zero | Kind::Punch => {
                journals.erase(header.chunk, header.offset, header.length)
            }
            Kind::DeleteVolume => {
                journals.drop_volume(header.chunk.volume_id);
                Ok(())
            }
            Kind::Stamp => Ok(()),
        }
    }

    /// Resets the journals nothing in the index points into any more (see
    /// [`journals_to_reset`]).
    fn reclaim(&mut self) -> Result<(), StoreError> {
        let seqs: Vec<_> = self.logs.iter().map(|log| log.seqs).collect();
        let Some((reset, start_seq)) = journals_to_reset(&seqs, &self.journals().live()) else {
            return Ok(());
        };
        // The records about to go carry replica states and bypassed data.
        self.sync_dirty()?;
        meta::save(
            &self.files.dir.join("meta"),
            &self.files.metas.lock().unwrap().clone(),
        )?;
        for j in reset {
            self.logs[j].reset(start_seq)?;
            self.journals().set_used(j, 0);
        }
        Ok(())
    }

    /// Plain mode: a record's effect on the replica's state and its chunk file.
    fn apply(&mut self, header: &RecordHeader, data: &[u8]) -> Result<(), StoreError> {
        self.apply_meta(header);
        self.apply_file(header, data)
    }

    fn apply_meta(&self, header: &RecordHeader) {
        let chunk = header.chunk;
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

    fn apply_file(&mut self, header: &RecordHeader, data: &[u8]) -> Result<(), StoreError> {
        let chunk = header.chunk;
        match header.kind {
            Kind::Stamp => return Ok(()),
            Kind::DeleteVolume => {
                self.files.forget_volume(chunk.volume_id);
                self.dirty_files.retain(|c| c.volume_id != chunk.volume_id);
                match std::fs::remove_dir_all(self.files.volume_dir(chunk.volume_id)) {
                    Err(e) if e.kind() != ErrorKind::NotFound => return Err(e.into()),
                    _ => {}
                }
                self.dirty_dirs.insert(self.files.dir.join("chunks"));
                return Ok(());
            }
            Kind::Write | Kind::Bypass | Kind::Zero | Kind::Punch => {}
        }
        let existed =
            self.files.open.lock().unwrap().contains_key(&chunk) || self.files.path(chunk).exists();
        let file = self
            .files
            .get(chunk, true)?
            .expect("get with create returns a file");
        if !existed {
            self.dirty_dirs.extend(self.files.dirs_of(chunk));
        }
        self.dirty_files.insert(chunk);
        if let Some(journals) = &self.files.journals {
            journals.copy_edges(&file, chunk, header.offset, header.length)?;
        }
        match header.kind {
            Kind::Write | Kind::Bypass => file.write_all_at(data, header.offset)?,
            _ => zero_range(&file, header)?,
        }
        let length = if header.kind == Kind::Punch || header.kind == Kind::Zero {
            0 // metadata only: one seek
        } else {
            header.length
        };
        let done = self.files.pace(chunk, header.offset, length, true);
        self.paced_until = self.paced_until.max(done);
        Ok(())
    }

    /// Makes the chunk files and directories changed so far durable. On error the
    /// dirty sets are kept, so a later call syncs them all again.
    fn sync_dirty(&mut self) -> Result<(), StoreError> {
        for chunk in &self.dirty_files {
            if let Some(file) = self.files.get(*chunk, false)? {
                file.sync_data()?;
            }
        }
        for dir in &self.dirty_dirs {
            if let Ok(d) = File::open(dir) {
                d.sync_all()?;
            }
        }
        self.dirty_files.clear();
        self.dirty_dirs.clear();
        Ok(())
    }

    /// Plain mode: makes chunk files durable, then restarts the log after everything
    /// applied.
    fn checkpoint(&mut self) -> Result<(), StoreError> {
        self.sync_dirty()?;
        // The log is about to forget the records that carry replication state.
        let metas = self.files.metas.lock().unwrap().clone();
        meta::save(&self.files.dir.join("meta"), &metas)?;
        let next_seq = self.next_seq;
        self.logs[0].reset(next_seq)
    }
}

fn append_error(e: &io::Error, message: String) -> StoreError {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        StoreError::NoSpace(message)
    } else {
        StoreError::Io(message)
    }
}

/// Zeroes `[offset, offset + length)`: a punched hole frees space; otherwise the range
/// stays allocated. Falls back to writing zeroes where fallocate is unsupported.
fn zero_range(file: &File, header: &RecordHeader) -> Result<(), StoreError> {
    let mode = libc::FALLOC_FL_KEEP_SIZE
        | if header.kind == Kind::Punch {
            libc::FALLOC_FL_PUNCH_HOLE
        } else {
            libc::FALLOC_FL_ZERO_RANGE
        };
    // SAFETY: plain syscall on an open descriptor; no memory is passed.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            mode,
            header.offset as libc::off_t,
            header.length as libc::off_t,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
        return Err(e.into());
    }
    let zeroes = vec![0u8; 1 << 20];
    let mut at = header.offset;
    let end = header.offset + header.length;
    while at < end {
        let n = (end - at).min(zeroes.len() as u64) as usize;
        file.write_all_at(&zeroes[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

/// Fills `buf` from `offset`; `false` if the file ends first.
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<bool> {
    match file.read_exact_at(buf, offset) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// Fills `buf` from `offset`; past the end of the file reads as zeroes (sparse files).
pub(crate) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The ranges of a file that hold data (SEEK_DATA / SEEK_HOLE).
fn file_extents(file: &File) -> io::Result<Vec<(u64, u64)>> {
    let seek = |offset: u64, whence| {
        // SAFETY: plain syscall on an open descriptor; no memory is passed.
        let at = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, whence) };
        if at >= 0 {
            Ok(Some(at as u64))
        } else {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENXIO) => Ok(None), // no data after `offset`
                _ => Err(e),
            }
        }
    };
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(start) = seek(at, libc::SEEK_DATA)? {
        let end = seek(start, libc::SEEK_HOLE)?.expect("a file ends in a hole");
        out.push((start, end - start));
        at = end;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{journals_to_reset, Store};
    use crate::meta::{self, ChunkMeta, Metas};
    use crate::wal::{self, Kind, RecordHeader};
    use crate::{JournalDir, Options};
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
        meta::save(&data.path().join("meta"), &Metas::from([(chunk, current)])).unwrap();
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
