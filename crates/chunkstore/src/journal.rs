//! Hybrid mode (URSA §3.2-3.3): journals on ssds in front of an hdd's chunk files.
//!
//! The store's log becomes a set of journals: one file in each `--journal` directory
//! (ssds of the same host) and one in the hdd's data directory (the last resort). A
//! write of at most [`JOURNAL_WRITE_BYTES_MAX`] (or [`JOURNAL_LARGE_WRITE_BYTES_MAX`]
//! while an ssd journal is at most half full) whose offset and length are whole
//! sectors is acknowledged once its record is durable in a journal, and recorded in its
//! chunk's [`JournalIndex`]; it is not applied to the chunk file at commit. Every other
//! change (larger or unaligned writes, zeroes, deletes) goes to the chunk file, durably,
//! *before* its record is logged, and erases what the index holds for its range: its
//! record (a `Bypass` record for a write, without data) carries the chunk's view and
//! version, so the replica never claims a version whose data it lacks.
//!
//! The replay worker (one thread per store, so per hdd) copies live journal data into
//! the chunk files in elevator order, syncs them, and only then drops the index
//! entries. The committer resets a journal (frees its space) once nothing in the index
//! points into it and no journal that stays holds an older record: after a crash the
//! journals are scanned in sequence order and the index rebuilt, so a dropped record
//! must never have been the one that superseded a record that is replayed again.
//!
//! Overflow: a batch goes to the active ssd journal while it fits its quota, else to
//! the least-filled other ssd journal, else to the hdd's own journal, which is replayed
//! only while the hdd is idle (or the ssd journals, which cannot be freed while it holds
//! older records, are more than half full); when none has room, writes bypass.
//!
//! The commit is in [`crate::hybrid_commit`], the replay worker in [`crate::replay`].

use crate::block_sums::{ChunkFile, Fill, Merge, BLOCK_BYTES};
use crate::chunk_files::Files;
use crate::disk::{self, Disk, FileRef};
use crate::error::StoreError;
use crate::journal_index::{JournalIndex, Piece};
use crate::layout::{self, CHUNK_BYTES_MAX};
use crate::log_file::LogFile;
use crate::wal::SECTOR_BYTES;
use floe_protocol::ChunkId;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// URSA's T_j: larger writes bypass the journal...
pub const JOURNAL_WRITE_BYTES_MAX: u64 = 64 << 10;
/// ...except while the ssd journals are at most half full: then writes up to this
/// size are journaled too. A volume's large writes are striped, so they reach an hdd
/// as seeks between chunk files, not the sequential stream T_j assumes (a 1 MiB
/// sequential write ran at 0.17 x ssd with every large write bypassing).
pub const JOURNAL_LARGE_WRITE_BYTES_MAX: u64 = 1 << 20;
/// The journal file inside each `--journal` directory (its first segment; the others
/// add `.1`, `.2`, ...).
const FILE_IN_DIR: &str = "floe-journal";
/// Each `--journal` directory's quota is split over this many files, written in turn.
/// A journal is freed only once nothing in it is left to replay, and one file taking
/// every write never got there: under a stream of writes its newest records always
/// waited for replay, so it filled up (sequential 1 MiB writes reached half of a
/// 1 GiB quota in 6 s, and larger writes then bypassed it to the hdd). Segments the
/// writes have moved past are freed as soon as replay has copied them.
const SEGMENTS_PER_DIR: u64 = 4;
/// ...when each segment gets at least this much (a batch of changes is at most 16 MiB
/// of data); smaller quotas keep one file.
const SEGMENT_BYTES_MIN: u64 = 64 << 20;
/// Index positions are global across journals: journal `j` owns sectors
/// `[j << SPAN_BITS, (j + 1) << SPAN_BITS)`, 64 GiB each.
const SPAN_BITS: u32 = 27;
const SPAN_BYTES: u64 = (1 << SPAN_BITS) * SECTOR_BYTES;
/// Spans that fit below the index's journal limit (2^32 - 1 sectors).
const JOURNALS_MAX: usize = 31;
pub(crate) const CHUNK_SECTORS: u64 = CHUNK_BYTES_MAX / SECTOR_BYTES;

/// Journal files as the store opens them: directory and quota in bytes.
#[derive(Debug, Clone)]
pub struct JournalDir {
    pub dir: PathBuf,
    pub quota_bytes: u64,
}

/// The journals' shared state: readers, the committer and the replay worker use it.
pub(crate) struct Journals {
    pub(crate) files: Vec<FileRef>,
    quotas: Vec<u64>,
    /// Bytes appended to each journal since its last reset.
    used: Vec<AtomicU64>,
    pub(crate) index: Mutex<BTreeMap<ChunkId, JournalIndex>>,
    /// Held by whoever writes chunk files while looking at the index (the committer
    /// for a batch, the replay worker for one piece), so replay never writes stale
    /// journal data over a newer bypass write.
    pub(crate) chunk_writes: Mutex<()>,
    /// Set by the replay worker when it freed index entries: the committer may reset.
    pub(crate) replayed: AtomicBool,
    /// Where the next replay sweep starts, a position on the disk.
    pub(crate) replay_cursor: Mutex<u64>,
    /// The crc32c of every sector written to each journal since its reset, by
    /// position (0: none): what a read or a replay checks journal data against, as a
    /// record's own checksum covers the whole record and they take pieces of it.
    /// Filled at commit and by the scan at open; 4 bytes of memory per 512 in use.
    sector_sums: Vec<Mutex<Vec<u32>>>,
    /// The journal holding records appended without a sync (one at most: see
    /// `crate::unsynced`), and the byte where the first starts. Replay leaves data
    /// from there on alone: a chunk file must never hold bytes whose record a power
    /// cut may drop.
    unsynced_from: Mutex<Option<(usize, u64)>>,
}

/// The files of a `--journal` directory, with their quotas: [`SEGMENTS_PER_DIR`] of
/// them when each gets at least [`SEGMENT_BYTES_MIN`], else one. Segments a larger
/// quota made earlier are opened too, with no quota: their records are scanned and
/// replayed (a smaller quota must not lose them), and nothing new goes there.
fn segments(disk: &dyn Disk, dir: &JournalDir) -> Result<Vec<(PathBuf, u64)>, StoreError> {
    let count = match dir.quota_bytes >= SEGMENTS_PER_DIR * SEGMENT_BYTES_MIN {
        true => SEGMENTS_PER_DIR,
        false => 1,
    };
    let mut files = Vec::new();
    for s in 0..SEGMENTS_PER_DIR {
        let path = match s {
            0 => dir.dir.join(FILE_IN_DIR),
            s => dir.dir.join(format!("{FILE_IN_DIR}.{s}")),
        };
        if s < count {
            files.push((path, dir.quota_bytes / count));
        } else if disk.exists(&path)? {
            files.push((path, 0));
        }
    }
    Ok(files)
}

fn sectors(offset: u64, length: u64) -> (u64, u64) {
    let first = offset / SECTOR_BYTES;
    (first, (offset + length).div_ceil(SECTOR_BYTES) - first)
}

/// Index position of journal `journal`'s byte `at`.
fn position(journal: usize, at: u64) -> u64 {
    assert!(
        at < SPAN_BYTES,
        "journal {journal} byte {at} is past its span"
    );
    ((journal as u64) << SPAN_BITS) | (at / SECTOR_BYTES)
}

/// Journal number and byte offset of an index position.
pub(crate) fn locate(position: u64) -> (usize, u64) {
    (
        (position >> SPAN_BITS) as usize,
        (position & ((1 << SPAN_BITS) - 1)) * SECTOR_BYTES,
    )
}

impl Journals {
    /// Opens the journal files: `dirs` in order, then the hdd's own in `data_dir`.
    pub(crate) fn open(
        disk: &dyn Disk,
        data_dir: &Path,
        dirs: &[JournalDir],
        local_quota_bytes: u64,
    ) -> Result<(Journals, Vec<LogFile>), StoreError> {
        let dirs_max = (JOURNALS_MAX - 1) / SEGMENTS_PER_DIR as usize;
        if dirs.len() > dirs_max {
            return Err(StoreError::Io(format!(
                "at most {dirs_max} journal directories"
            )));
        }
        let mut paths = Vec::new();
        for dir in dirs {
            paths.extend(segments(disk, dir)?);
        }
        paths.push((data_dir.join(layout::LOCAL_JOURNAL), local_quota_bytes));
        let mut logs = Vec::new();
        for (path, quota) in paths {
            disk.create_dir_all(path.parent().expect("journal path has a parent"))?;
            let mut log = LogFile::open(disk, &path, true, quota.min(SPAN_BYTES))?;
            if !log.file.try_lock()? {
                return Err(StoreError::Io(format!(
                    "journal {} is in use by another chunk server; give each hdd its own \
                     journal directories",
                    path.display()
                )));
            }
            // Records past the quota (the hdd's own journal's overflow) carry no data;
            // a direct write pads its last sector.
            log.allocate(SECTOR_BYTES)?;
            logs.push(log);
        }
        let journals = Journals {
            files: logs.iter().map(|l| l.file.clone()).collect(),
            quotas: logs.iter().map(|l| l.quota).collect(),
            used: logs.iter().map(|_| AtomicU64::new(0)).collect(),
            index: Mutex::default(),
            chunk_writes: Mutex::new(()),
            replayed: AtomicBool::new(false),
            replay_cursor: Mutex::new(0),
            sector_sums: logs.iter().map(|_| Mutex::default()).collect(),
            unsynced_from: Mutex::new(None),
        };
        Ok((journals, logs))
    }

    /// Records appended to `journal` from byte `at` on are not synced; the first such
    /// append sets where they start.
    pub(crate) fn unsynced_at(&self, journal: usize, at: u64) {
        let mut unsynced = self.unsynced_from.lock().unwrap();
        let (j, _) = *unsynced.get_or_insert((journal, at));
        assert_eq!(j, journal, "unsynced records in two journals");
    }

    /// The journal holding unsynced records, if any.
    pub(crate) fn unsynced_journal(&self) -> Option<usize> {
        self.unsynced_from.lock().unwrap().map(|(j, _)| j)
    }

    /// Every record appended so far is durable.
    pub(crate) fn all_synced(&self) {
        *self.unsynced_from.lock().unwrap() = None;
    }

    /// Whether `sectors` sectors at index position `position` are durable in their
    /// journal (replay may copy them).
    pub(crate) fn durable(&self, position: u64, sectors: u64) -> bool {
        let (j, at) = locate(position);
        match *self.unsynced_from.lock().unwrap() {
            Some((unsynced, from)) if unsynced == j => at + sectors * SECTOR_BYTES <= from,
            _ => true,
        }
    }

    /// Notes the checksums of `data`, written at byte `at` (a sector boundary) of
    /// journal `journal`.
    pub(crate) fn note_sums(&self, journal: usize, at: u64, data: &[u8]) {
        assert!(
            at.is_multiple_of(SECTOR_BYTES) && (data.len() as u64).is_multiple_of(SECTOR_BYTES),
            "journal data is whole sectors"
        );
        let first = (at / SECTOR_BYTES) as usize;
        let mut sums = self.sector_sums[journal].lock().unwrap();
        let end = first + data.len() / SECTOR_BYTES as usize;
        if sums.len() < end {
            sums.resize(end, 0);
        }
        for (sum, sector) in sums[first..end]
            .iter_mut()
            .zip(data.chunks_exact(SECTOR_BYTES as usize))
        {
            *sum = crc32c::crc32c(sector).max(1);
        }
    }

    /// The sectors of `data` (read from index position `position` on) that fail their
    /// checksums, as indexes into `data`'s sectors.
    pub(crate) fn bad_sectors(&self, position: u64, data: &[u8]) -> Vec<u64> {
        let (j, at) = locate(position);
        let first = (at / SECTOR_BYTES) as usize;
        let sums = self.sector_sums[j].lock().unwrap();
        data.chunks_exact(SECTOR_BYTES as usize)
            .enumerate()
            .filter(|&(i, sector)| {
                let sum = sums.get(first + i).copied().unwrap_or(0);
                sum != 0 && sum != crc32c::crc32c(sector).max(1)
            })
            .map(|(i, _)| i as u64)
            .collect()
    }

    /// A journal was reset: nothing reads its old positions again.
    pub(crate) fn forget_sums(&self, journal: usize) {
        *self.sector_sums[journal].lock().unwrap() = Vec::new();
    }

    pub(crate) fn set_used(&self, journal: usize, bytes: u64) {
        self.used[journal].store(bytes, Ordering::Relaxed);
    }

    /// Bytes in use and quota of the ssd journals: the hdd's own journal (the last
    /// one) is the overflow, so its use means the ssd journals are already full.
    pub(crate) fn ssd_usage(&self) -> (u64, u64) {
        let ssds = self.used.len() - 1;
        let used = self.used[..ssds].iter().map(|u| u.load(Ordering::Relaxed));
        (used.sum(), self.quotas[..ssds].iter().sum())
    }

    /// Bytes in use in all journals, the hdd's own included.
    pub(crate) fn backlog(&self) -> u64 {
        self.used.iter().map(|u| u.load(Ordering::Relaxed)).sum()
    }

    /// Records that `length` bytes at chunk `offset` live in `journal` at byte `at`.
    pub(crate) fn insert(
        &self,
        chunk: ChunkId,
        offset: u64,
        length: u64,
        journal: usize,
        at: u64,
    ) -> Result<(), StoreError> {
        debug_assert!(offset.is_multiple_of(SECTOR_BYTES) && length.is_multiple_of(SECTOR_BYTES));
        // Quotas keep new data below the span; a journal written by an older Floe
        // (256 GiB spans) may hold data past it.
        if at + length > SPAN_BYTES {
            return Err(StoreError::Io(format!(
                "journal {journal} holds data {at} bytes in, past the {SPAN_BYTES} this Floe \
                 addresses in one journal file; start the chunk server of the Floe version \
                 that wrote it to drain it"
            )));
        }
        let mut index = self.index.lock().unwrap();
        let entry = match index.entry(chunk) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(JournalIndex::new(CHUNK_SECTORS).map_err(index_error)?)
            }
        };
        entry
            .insert(
                offset / SECTOR_BYTES,
                length / SECTOR_BYTES,
                position(journal, at),
            )
            .map_err(index_error)
    }

    /// Forgets journal data for every sector a range touches. Partly covered sectors
    /// must have been copied to the chunk file first ([`Journals::copy_edges`]).
    pub(crate) fn erase(&self, chunk: ChunkId, offset: u64, length: u64) -> Result<(), StoreError> {
        let mut index = self.index.lock().unwrap();
        if let Some(entry) = index.get_mut(&chunk) {
            let (first, count) = sectors(offset, length);
            entry.remove(first, count).map_err(index_error)?;
        }
        Ok(())
    }

    pub(crate) fn drop_volume(&self, volume_id: u64) {
        self.index
            .lock()
            .unwrap()
            .retain(|c, _| c.volume_id != volume_id);
    }

    /// Before a change of `[offset, offset + length)` goes to the chunk file: copies
    /// the journaled data of the sectors it only partly covers into the chunk file, so
    /// erasing those whole sectors from the index afterwards loses nothing.
    pub(crate) fn copy_edges(
        &self,
        files: &Files,
        file: &ChunkFile,
        offset: u64,
        length: u64,
    ) -> Result<(), StoreError> {
        let chunk = file.chunk;
        let end = offset + length;
        let first = (!offset.is_multiple_of(SECTOR_BYTES)).then_some(offset / SECTOR_BYTES);
        let last = (!end.is_multiple_of(SECTOR_BYTES)).then_some(end / SECTOR_BYTES);
        // A range inside one sector has one edge, copied once.
        let last = last.filter(|&last| Some(last) != first);
        let index = self.index.lock().unwrap();
        let Some(entry) = index.get(&chunk) else {
            return Ok(());
        };
        let mut sector = [0u8; SECTOR_BYTES as usize];
        for edge in first.into_iter().chain(last) {
            if let [Piece::Journal { journal, .. }] = entry.query(edge, 1).map_err(index_error)?[..]
            {
                let (j, at) = locate(journal);
                disk::read_at(&*self.files[j], &mut sector, at)?;
                let poison = !self.bad_sectors(journal, &sector).is_empty();
                let at = edge * SECTOR_BYTES;
                if poison {
                    files.found_corrupt(chunk, at - at % BLOCK_BYTES, "journal");
                }
                // The block is in flux (it has journaled data): trusted.
                for bad in file.write(at, Fill::Data(&sector), Merge::Trust, poison)? {
                    files.found_corrupt(chunk, bad, "chunk file");
                }
            }
        }
        Ok(())
    }

    /// Fills the journaled parts of `out` (chunk bytes from `offset`) from the journals,
    /// their sectors checked if `check`; returns the rest, the (offset, length) ranges
    /// to read from the chunk file.
    pub(crate) fn read(
        &self,
        chunk: ChunkId,
        offset: u64,
        out: &mut [u8],
        check: bool,
    ) -> Result<Vec<(u64, u64)>, StoreError> {
        let end = offset + out.len() as u64;
        let index = self.index.lock().unwrap();
        let Some(entry) = index.get(&chunk) else {
            return Ok(vec![(offset, out.len() as u64)]);
        };
        let (first, count) = sectors(offset, out.len() as u64);
        let mut holes = Vec::new();
        // The index lock is held across the journal reads: a journal is reset only
        // when the index no longer points into it.
        for piece in entry.query(first, count).map_err(index_error)? {
            let (sector, len, journal) = match piece {
                Piece::Journal {
                    offset,
                    len,
                    journal,
                } => (offset, len, Some(journal)),
                Piece::Hole { offset, len } => (offset, len, None),
            };
            let from = (sector * SECTOR_BYTES).max(offset);
            let to = ((sector + len) * SECTOR_BYTES).min(end);
            match journal {
                Some(journal) => {
                    let (j, at) = locate(journal);
                    let mut sectors = vec![0u8; (len * SECTOR_BYTES) as usize];
                    disk::read_at(&*self.files[j], &mut sectors, at)?;
                    let bad = match check {
                        true => self.bad_sectors(journal, &sectors),
                        false => Vec::new(),
                    };
                    if let Some(&bad) = bad.first() {
                        let at = (sector + bad) * SECTOR_BYTES;
                        return Err(StoreError::Corrupt {
                            chunk,
                            offset: at - at % BLOCK_BYTES,
                            place: "journal",
                        });
                    }
                    let skip = (from - sector * SECTOR_BYTES) as usize;
                    let range = (from - offset) as usize..(to - offset) as usize;
                    out[range.clone()].copy_from_slice(&sectors[skip..skip + range.len()]);
                }
                None => holes.push((from, to - from)),
            }
        }
        Ok(holes)
    }

    /// Byte ranges held in the journals within the blocks `[offset, offset + length)`
    /// touches: blocks whose chunk-file copy a replay may be rewriting.
    pub(crate) fn in_flux(&self, chunk: ChunkId, offset: u64, length: u64) -> Vec<(u64, u64)> {
        let start = offset - offset % BLOCK_BYTES;
        let end = (offset + length).next_multiple_of(BLOCK_BYTES);
        let (first, count) = sectors(start, end - start);
        self.journaled(chunk, first, count)
    }

    /// Byte ranges of the chunk held in the journals.
    pub(crate) fn extents(&self, chunk: ChunkId) -> Vec<(u64, u64)> {
        self.journaled(chunk, 0, CHUNK_SECTORS)
    }

    /// Byte ranges held in the journals among `count` sectors from `first`.
    fn journaled(&self, chunk: ChunkId, first: u64, count: u64) -> Vec<(u64, u64)> {
        let index = self.index.lock().unwrap();
        let Some(entry) = index.get(&chunk) else {
            return Vec::new();
        };
        entry
            .query(first, count)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| match p {
                Piece::Journal { offset, len, .. } => {
                    Some((offset * SECTOR_BYTES, len * SECTOR_BYTES))
                }
                Piece::Hole { .. } => None,
            })
            .collect()
    }

    /// Which journals the index still points into.
    pub(crate) fn live(&self) -> Vec<bool> {
        let mut live = vec![false; self.files.len()];
        for entry in self.index.lock().unwrap().values() {
            for piece in entry.query(0, CHUNK_SECTORS).unwrap_or_default() {
                if let Piece::Journal { journal, .. } = piece {
                    live[locate(journal).0] = true;
                }
            }
        }
        live
    }
}

pub(crate) fn index_error(e: crate::journal_index::IndexError) -> StoreError {
    StoreError::Io(format!("journal index: {e}"))
}
