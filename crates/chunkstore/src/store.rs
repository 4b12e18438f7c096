//! The chunk store: group-committed write-ahead log + sparse chunk files.

use crate::meta::{self, ChunkMeta, Metas};
use crate::wal::{self, HeaderError, Kind, RecordHeader, RECORD_HEADER_BYTES};
use bytes::{Bytes, BytesMut};
use floe_protocol::ChunkId;
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
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
struct Queue {
    changes: Mutex<Vec<Change>>,
    wake: Notify,
}

/// Chunk files and their durable replication state, shared by readers and the
/// committer.
struct Files {
    dir: PathBuf,
    open: Mutex<HashMap<ChunkId, Arc<File>>>,
    /// Updated as log records are applied: the state of what is durable.
    metas: Mutex<Metas>,
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
    fn get(&self, chunk: ChunkId, create: bool) -> io::Result<Option<Arc<File>>> {
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

    fn forget_volume(&self, volume_id: u64) {
        self.open
            .lock()
            .unwrap()
            .retain(|c, _| c.volume_id != volume_id);
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
    /// Opens (creating if needed) the store in `dir`, replaying the log first. Must be
    /// called inside a tokio runtime: the committer runs on it.
    ///
    /// The committer commits on the event loop itself, blocking it for the append and
    /// fdatasync (Vitastor's habit): no thread hand-off and wake-up per batch, and the
    /// requests that arrive meanwhile wait in the socket buffers and form the next
    /// batch.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        std::fs::create_dir_all(dir.join("chunks"))?;
        let files = Arc::new(Files {
            dir: dir.to_path_buf(),
            open: Mutex::default(),
            metas: Mutex::new(meta::load(&dir.join("meta"))?),
        });
        let log = Log::open(&dir.join("wal"), files.clone())?;
        let queue = Arc::new(Queue::default());
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

    /// Reads a range; parts never written read as zeroes. Runs on the caller's thread:
    /// chunk files are in the page cache for hot data, and a pread is cheaper than a
    /// hop to another thread.
    pub fn read(&self, chunk: ChunkId, offset: u64, length: u32) -> Result<Bytes, StoreError> {
        check_range(offset, length as u64)?;
        if length > READ_BYTES_MAX {
            return Err(StoreError::OutOfRange {
                offset,
                length: length as u64,
            });
        }
        let mut out = BytesMut::zeroed(length as usize);
        if let Some(file) = self.files.get(chunk, false)? {
            let mut done = 0;
            while done < out.len() {
                match file.read_at(&mut out[done..], offset + done as u64) {
                    Ok(0) => break, // past the end of a sparse file: zeroes
                    Ok(n) => done += n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(out.freeze())
    }

    /// The ranges of the chunk that hold data, as (offset, length); the rest are holes.
    pub fn extents(&self, chunk: ChunkId) -> Result<Vec<(u64, u64)>, StoreError> {
        let Some(file) = self.files.get(chunk, false)? else {
            return Ok(Vec::new());
        };
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

    /// crc32c of the chunk's first `length` bytes, holes and the part past the end of
    /// the file read as zeroes.
    pub fn checksum(&self, chunk: ChunkId, length: u64) -> Result<u32, StoreError> {
        check_range(0, length)?;
        let mut crc = 0;
        let mut at = 0;
        while at < length {
            let n = (length - at).min(READ_BYTES_MAX as u64 / 8) as u32;
            crc = crc32c::crc32c_append(crc, &self.read(chunk, at, n)?);
            at += n as u64;
        }
        Ok(crc)
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

/// The log and everything only the committer touches.
struct Log {
    file: File,
    files: Arc<Files>,
    /// Where the next batch is appended.
    position: u64,
    /// Sequence number of the next record.
    next_seq: u64,
    /// Chunk files and directories changed since the last checkpoint.
    dirty_files: HashSet<ChunkId>,
    dirty_dirs: HashSet<PathBuf>,
    buffer: Vec<u8>,
    /// Set when the log can no longer be written safely; every change then fails.
    failed: Option<String>,
}

impl Log {
    fn open(path: &Path, files: Arc<Files>) -> Result<Log, StoreError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let mut head = vec![0u8; wal::HEADER_BYTES as usize];
        let read = file.read_at(&mut head, 0)?;
        let start_seq = match wal::decode_header(&head[..read]) {
            Ok(seq) => seq,
            Err(_) if read == 0 => 1,
            Err(HeaderError::NotALog) => {
                return Err(StoreError::Io(format!(
                    "{} is not a Floe write-ahead log (bad header); refusing to overwrite it",
                    path.display()
                )))
            }
            Err(HeaderError::Format(version)) => {
                return Err(StoreError::Io(format!(
                    "{} is a write-ahead log of format {version}, which this Floe cannot read; \
                     start the chunk server of the Floe version that wrote it to drain it",
                    path.display()
                )))
            }
        };
        let mut log = Log {
            file,
            files,
            position: wal::HEADER_BYTES,
            next_seq: start_seq,
            dirty_files: HashSet::new(),
            dirty_dirs: HashSet::new(),
            buffer: Vec::new(),
            failed: None,
        };
        let replayed = log.replay()?;
        if replayed > 0 {
            tracing::info!(records = replayed, "replayed write-ahead log");
        }
        log.checkpoint()?;
        Ok(log)
    }

    /// Re-applies every valid record after the header, stopping at the first record
    /// that is torn, stale or absent.
    fn replay(&mut self) -> Result<u64, StoreError> {
        let mut replayed = 0;
        let mut raw = [0u8; RECORD_HEADER_BYTES];
        let mut data = Vec::new();
        loop {
            if !read_exact_at(&self.file, &mut raw, self.position)? {
                break;
            }
            let Some((header, crc)) = RecordHeader::decode(&raw, self.next_seq) else {
                break;
            };
            data.resize(header.data_len(), 0);
            let data_at = self.position + RECORD_HEADER_BYTES as u64;
            if !read_exact_at(&self.file, &mut data, data_at)?
                || !RecordHeader::check(&raw, &data, crc)
            {
                break;
            }
            self.apply(&header, &data)?;
            self.position = data_at + data.len() as u64;
            self.next_seq += 1;
            replayed += 1;
        }
        Ok(replayed)
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
                if batch.is_empty() {
                    break;
                }
                for (done, result) in self.commit(&mut batch) {
                    let _ = done.send(result);
                }
                if self.position >= WAL_BYTES_CHECKPOINT {
                    if let Err(e) = self.checkpoint() {
                        tracing::error!("checkpoint failed, will retry: {e}");
                    }
                }
            }
        }
    }

    /// Appends the batch as one write and one fdatasync, then applies it.
    fn commit(&mut self, batch: &mut Vec<Change>) -> Completions {
        if let Some(failed) = &self.failed {
            let error = StoreError::Io(failed.clone());
            return batch
                .drain(..)
                .map(|c| (c.done, Err(error.clone())))
                .collect();
        }
        self.buffer.clear();
        for change in batch.iter_mut() {
            change.header.seq = self.next_seq;
            self.next_seq += 1;
            change.header.encode(&change.data, &mut self.buffer);
        }
        let durable = self
            .file
            .write_all_at(&self.buffer, self.position)
            .and_then(|_| self.file.sync_data());
        if let Err(e) = durable {
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
            return batch
                .drain(..)
                .map(|change| {
                    let error = if e.raw_os_error() == Some(libc::ENOSPC) {
                        StoreError::NoSpace(message.clone())
                    } else {
                        StoreError::Io(message.clone())
                    };
                    (change.done, Err(error))
                })
                .collect();
        }
        self.position += self.buffer.len() as u64;
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

    fn apply(&mut self, header: &RecordHeader, data: &[u8]) -> Result<(), StoreError> {
        let chunk = header.chunk;
        if header.kind == Kind::DeleteVolume {
            self.files.forget_volume(chunk.volume_id);
            self.files
                .metas
                .lock()
                .unwrap()
                .retain(|c, _| c.volume_id != chunk.volume_id);
            self.dirty_files.retain(|c| c.volume_id != chunk.volume_id);
            match std::fs::remove_dir_all(self.files.volume_dir(chunk.volume_id)) {
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(e.into()),
                _ => {}
            }
            self.dirty_dirs.insert(self.files.dir.join("chunks"));
            return Ok(());
        }
        self.files.metas.lock().unwrap().insert(
            chunk,
            ChunkMeta {
                view: header.view,
                version: header.version,
            },
        );
        if header.kind == Kind::Stamp {
            return Ok(());
        }
        let existed =
            self.files.open.lock().unwrap().contains_key(&chunk) || self.files.path(chunk).exists();
        let file = self
            .files
            .get(chunk, true)?
            .expect("get with create returns a file");
        if !existed {
            self.dirty_dirs
                .insert(self.files.volume_dir(chunk.volume_id));
            self.dirty_dirs.insert(self.files.dir.join("chunks"));
        }
        self.dirty_files.insert(chunk);
        match header.kind {
            Kind::Write => file.write_all_at(data, header.offset)?,
            Kind::Zero | Kind::Punch => zero_range(&file, header)?,
            Kind::DeleteVolume | Kind::Stamp => unreachable!("handled above"),
        }
        Ok(())
    }

    /// Makes chunk files durable, then restarts the log after everything applied.
    /// On error the dirty sets are kept, so a later checkpoint syncs them all again.
    fn checkpoint(&mut self) -> Result<(), StoreError> {
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
        // The log is about to forget the records that carry replication state.
        let metas = self.files.metas.lock().unwrap().clone();
        meta::save(&self.files.dir.join("meta"), &metas)?;
        self.file
            .write_all_at(&wal::encode_header(self.next_seq), 0)?;
        self.file.sync_data()?;
        self.position = wal::HEADER_BYTES;
        Ok(())
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
