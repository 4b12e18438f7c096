//! Emulated hard disk (an emulation, for measuring hybrid mode and the chained log on
//! machines with only ssds): [`HddDisk`] wraps another disk and makes every access to
//! a chunk file or to the hdd's own journal (or, for a chain, to each disk's log, one
//! emulated hdd per disk) take the service time a 7200 rpm disk would.
//!
//! The model: one head, so accesses are served one after another (first come, first
//! served); a seek whose time grows with the square root of the distance from the
//! head's previous position (0.5 ms track-to-track, 8 ms full stroke); a rotational
//! latency uniform in [0, 8.33 ms) from a seeded generator, so runs are repeatable;
//! transfer at 150 MB/s. An access that starts where the previous one ended pays only
//! the transfer. Time is reserved, not slept under a lock: an access does the real I/O
//! and reserves its slot; the thread waits for the slot's end at its next
//! [`take_paced_until`] (the committer before it acknowledges, a reader before it
//! answers, the replay worker after each piece), so an event loop awaits it instead
//! of blocking.

use super::{Disk, DiskFile, FileRef, FsSpace};
use crate::layout::{self, CHUNK_BYTES_MAX};
use floe_protocol::ChunkId;
use std::cell::Cell;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Emulated device size: chunks are spread over it by a hash of their id.
pub const DEVICE_BYTES: u64 = 4 << 40;
const SEEK_TRACK_TO_TRACK: Duration = Duration::from_micros(500);
const SEEK_FULL_STROKE: Duration = Duration::from_millis(8);
/// One revolution at 7200 rpm.
const ROTATION: Duration = Duration::from_micros(8333);
const TRANSFER_BYTES_PER_SECOND: u64 = 150_000_000;
/// A chain disk's writes are write-behind (the page cache: the write-ahead log on
/// flash already holds the data): a writer waits only for what is queued beyond
/// this much of the disk's time. Its reads go ahead of that backlog, as Linux's
/// mq-deadline serves reads first on an hdd: the read's seek there and back delays
/// every queued write.
const CHAIN_WRITE_BEHIND: Duration = Duration::from_millis(100);

/// Where `offset` of `chunk` lies on the emulated device: the chunk's slot (a hash of
/// its id) times the chunk size, plus the offset.
pub fn device_position(chunk: ChunkId, offset: u64) -> u64 {
    let slots = DEVICE_BYTES / CHUNK_BYTES_MAX;
    let slot = splitmix64(chunk.volume_id ^ splitmix64(chunk.index)) % slots;
    slot * CHUNK_BYTES_MAX + offset
}

/// Where the hdd's own journal (the last overflow of hybrid mode) lies on the emulated
/// device: mid-disk, like a file system's journal.
const JOURNAL_POSITION: u64 = DEVICE_BYTES / 2;

/// Service time of an access of `length` bytes at `position` with the head at `head`
/// (where the previous access ended); `random` draws the rotational latency.
pub fn service_time(head: u64, position: u64, length: u64, random: u64) -> Duration {
    let transfer =
        Duration::from_nanos(length.saturating_mul(1_000_000_000) / TRANSFER_BYTES_PER_SECOND);
    if position == head {
        return transfer;
    }
    let fraction = (head.abs_diff(position) as f64 / DEVICE_BYTES as f64).min(1.0);
    let seek =
        SEEK_TRACK_TO_TRACK + (SEEK_FULL_STROKE - SEEK_TRACK_TO_TRACK).mul_f64(fraction.sqrt());
    let rotation = ROTATION.mul_f64((random >> 11) as f64 / (1u64 << 53) as f64);
    seek + rotation + transfer
}

pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct Head {
    position: u64,
    /// When the last reserved access completes.
    busy_until: Instant,
    /// When the last read served ahead of queued writes completes.
    reads_until: Instant,
    /// Rotational latency generator state.
    random: u64,
    /// When a foreground (not replay) access last completed.
    foreground_until: Instant,
}

/// One emulated disk, shared by everything that touches its chunk files.
pub struct Hdd {
    head: Mutex<Head>,
}

impl Default for Hdd {
    fn default() -> Self {
        let now = Instant::now();
        Hdd {
            head: Mutex::new(Head {
                position: 0,
                busy_until: now,
                reads_until: now,
                random: 1,
                foreground_until: now,
            }),
        }
    }
}

impl Hdd {
    /// Reserves the head for an access at `position` on the device; returns when it
    /// completes.
    fn reserve(&self, position: u64, length: u64, foreground: bool) -> Instant {
        let mut head = self.head.lock().unwrap();
        head.random = splitmix64(head.random);
        let time = service_time(head.position, position, length, head.random);
        let start = head.busy_until.max(Instant::now());
        head.busy_until = start + time;
        head.position = position + length;
        if foreground {
            head.foreground_until = head.busy_until;
        }
        head.busy_until
    }

    /// Reserves a read that goes ahead of queued writes (see [`CHAIN_WRITE_BEHIND`]):
    /// served after the reads before it, it pushes the queued writes back by its own
    /// time and the seek back to where they continue; returns when it completes.
    /// With only reads queued (a body disk's), it is served after them from where
    /// the last one left the head, with no seek back: no write waits.
    fn reserve_read_first(&self, position: u64, length: u64) -> Instant {
        let now = Instant::now();
        let mut head = self.head.lock().unwrap();
        if head.busy_until <= now.max(head.reads_until) {
            drop(head);
            let done = self.reserve(position, length, true);
            self.head.lock().unwrap().reads_until = done;
            return done;
        }
        head.random = splitmix64(head.random);
        let there = service_time(head.position, position, length, head.random);
        head.random = splitmix64(head.random);
        let back = service_time(position + length, head.position, 0, head.random);
        let done = head.reads_until.max(now) + there;
        head.reads_until = done;
        head.busy_until += there + back;
        head.foreground_until = head.busy_until;
        done
    }

    /// True when no foreground access ran in the last `quiet`.
    pub fn idle(&self, quiet: Duration) -> bool {
        self.head.lock().unwrap().foreground_until + quiet <= Instant::now()
    }
}

thread_local! {
    /// Set while the thread does background work (replay), which does not keep the
    /// hdd from counting as idle.
    static BACKGROUND: Cell<bool> = const { Cell::new(false) };
    /// When the emulated disk completes the accesses the thread made since it last
    /// asked.
    static PACED_UNTIL: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Runs `work` as background work (see [`Hdd::idle`]).
pub(crate) fn background<T>(work: impl FnOnce() -> T) -> T {
    let before = BACKGROUND.replace(true);
    let result = work();
    BACKGROUND.set(before);
    result
}

/// When the emulated disk completes this thread's accesses since the last call;
/// `None` if it made none (or no disk is emulated).
pub(crate) fn take_paced_until() -> Option<Instant> {
    PACED_UNTIL.take()
}

/// Runs `io`, an access issued ahead of need (as the kernel's readahead is): the
/// thread does not wait for it now; returns its result and when the emulated disk
/// completes it (`None`: no emulated access), to wait for with [`pace_until`] once
/// the data is needed.
pub(crate) fn issued_ahead<T>(io: impl FnOnce() -> T) -> (T, Option<Instant>) {
    let before = PACED_UNTIL.take();
    let result = io();
    (result, PACED_UNTIL.replace(before))
}

/// The thread will wait until `at` (an access [`issued_ahead`] whose data it needs).
pub(crate) fn pace_until(at: Instant) {
    HddFile::wait(at);
}

/// A disk whose chunk files and own journal (in `data_dir`) lie on an emulated hdd,
/// or whose chain disks' logs each lie on their own; every other file (the log, the
/// meta file, ssd journals, the chain's saved map) is left as is.
pub struct HddDisk {
    inner: Arc<dyn Disk>,
    devices: Devices,
}

enum Devices {
    /// The files engine: one hdd under the data directory's chunk files.
    Chunks { hdd: Arc<Hdd>, data_dir: PathBuf },
    /// The chained log: each disk directory's log on its own hdd, from its start.
    Chain(Vec<(PathBuf, Arc<Hdd>)>),
}

impl HddDisk {
    pub fn new(inner: Arc<dyn Disk>, hdd: Arc<Hdd>, data_dir: &Path) -> HddDisk {
        HddDisk {
            inner,
            devices: Devices::Chunks {
                hdd,
                data_dir: data_dir.to_path_buf(),
            },
        }
    }

    /// A chain's disks, one emulated hdd each.
    pub(crate) fn chain(inner: Arc<dyn Disk>, disk_dirs: &[PathBuf]) -> HddDisk {
        let hdds = disk_dirs
            .iter()
            .map(|dir| (dir.join(crate::chain::LOG_FILE), Arc::new(Hdd::default())))
            .collect();
        HddDisk {
            inner,
            devices: Devices::Chain(hdds),
        }
    }

    /// The hdd the file at `path` lies on, where its byte 0 is and whether it is a
    /// chain disk's log (writes behind, reads first), if on one.
    fn place(&self, path: &Path) -> Option<(Arc<Hdd>, u64, bool)> {
        match &self.devices {
            Devices::Chunks { hdd, data_dir } => {
                if path == data_dir.join(layout::LOCAL_JOURNAL) {
                    return Some((hdd.clone(), JOURNAL_POSITION, false));
                }
                layout::chunk_of(data_dir, path)
                    .map(|chunk| (hdd.clone(), device_position(chunk, 0), false))
            }
            Devices::Chain(logs) => logs
                .iter()
                .find(|(log, _)| log == path)
                .map(|(_, hdd)| (hdd.clone(), 0, true)),
        }
    }
}

impl Disk for HddDisk {
    fn open(&self, path: &Path, create: bool) -> io::Result<FileRef> {
        let file = self.inner.open(path, create)?;
        Ok(match self.place(path) {
            Some((hdd, base, chain_log)) => Arc::new(HddFile {
                inner: file,
                hdd,
                base,
                chain_log,
            }),
            None => file,
        })
    }

    /// A file on an emulated hdd keeps its pacing (a buffered write there); any other
    /// gets the real direct writes.
    fn open_direct(&self, path: &Path) -> io::Result<Option<FileRef>> {
        match self.place(path) {
            Some(_) => self.open(path, false).map(Some),
            None => self.inner.open_direct(path),
        }
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        self.inner.create_dir_all(path)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.inner.sync_dir(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.inner.remove_file(path)
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        self.inner.remove_dir_all(path)
    }

    fn exists(&self, path: &Path) -> io::Result<bool> {
        self.inner.exists(path)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        self.inner.read_dir(path)
    }

    fn allocated_bytes(&self, path: &Path) -> io::Result<u64> {
        self.inner.allocated_bytes(path)
    }

    fn space(&self, path: &Path) -> io::Result<FsSpace> {
        self.inner.space(path)
    }
}

struct HddFile {
    inner: FileRef,
    hdd: Arc<Hdd>,
    /// Device position of the file's byte 0.
    base: u64,
    /// A chain disk's log: writes behind, reads first ([`CHAIN_WRITE_BEHIND`]).
    chain_log: bool,
}

impl HddFile {
    /// The thread will wait until `until` (see [`take_paced_until`]).
    fn wait(until: Instant) {
        PACED_UNTIL.set(PACED_UNTIL.get().max(Some(until)));
    }

    fn pace(&self, offset: u64, length: u64) {
        let done = self
            .hdd
            .reserve(self.base + offset, length, !BACKGROUND.get());
        HddFile::wait(done);
    }
}

impl DiskFile for HddFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let read = self.inner.read_at(buf, offset)?;
        match self.chain_log {
            true => HddFile::wait(
                self.hdd
                    .reserve_read_first(self.base + offset, buf.len() as u64),
            ),
            false => self.pace(offset, buf.len() as u64),
        }
        Ok(read)
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_all_at(data, offset)?;
        let done = self
            .hdd
            .reserve(self.base + offset, data.len() as u64, !BACKGROUND.get());
        let behind = match self.chain_log {
            true => CHAIN_WRITE_BEHIND,
            false => Duration::ZERO,
        };
        HddFile::wait(done.checked_sub(behind).unwrap_or(done));
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()
    }

    fn zero_range(&self, offset: u64, length: u64, punch: bool) -> io::Result<()> {
        self.inner.zero_range(offset, length, punch)?;
        // Metadata only: one seek.
        self.pace(offset, 0);
        Ok(())
    }

    fn set_len(&self, length: u64) -> io::Result<()> {
        self.inner.set_len(length)
    }

    fn allocate(&self, length: u64) -> io::Result<()> {
        self.inner.allocate(length)
    }

    fn size(&self) -> io::Result<u64> {
        self.inner.size()
    }

    fn extents(&self) -> io::Result<Vec<(u64, u64)>> {
        self.inner.extents()
    }

    fn try_lock(&self) -> io::Result<bool> {
        self.inner.try_lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_access_pays_only_transfer() {
        let t = service_time(1 << 30, 1 << 30, 150_000, 12345);
        assert_eq!(t, Duration::from_millis(1));
    }

    #[test]
    fn seek_grows_with_distance_and_is_bounded() {
        let no_rotation = 0;
        let near = service_time(0, 4096, 0, no_rotation);
        let far = service_time(0, DEVICE_BYTES / 2, 0, no_rotation);
        let full = service_time(0, DEVICE_BYTES, 0, no_rotation);
        assert!(near >= SEEK_TRACK_TO_TRACK && near < Duration::from_micros(600));
        assert!(far > near && far < full);
        assert_eq!(full, SEEK_FULL_STROKE);
    }

    #[test]
    fn rotation_is_below_one_revolution() {
        let most = service_time(0, 4096, 0, u64::MAX) - service_time(0, 4096, 0, 0);
        // Nanosecond rounding may reach a whole revolution; never more.
        assert!(most <= ROTATION && most > ROTATION.mul_f64(0.99));
    }

    #[test]
    fn positions_are_deterministic_and_inside_the_device() {
        let chunk = ChunkId {
            volume_id: 7,
            index: 3,
        };
        assert_eq!(device_position(chunk, 10), device_position(chunk, 10));
        assert_eq!(device_position(chunk, 10) + 5, device_position(chunk, 15));
        assert!(device_position(chunk, CHUNK_BYTES_MAX - 1) < DEVICE_BYTES);
    }

    #[test]
    fn accesses_are_served_one_after_another_and_paced_by_the_decorator() {
        let hdd = Arc::new(Hdd::default());
        let disk = HddDisk::new(
            crate::SimDisk::new().mount(),
            hdd.clone(),
            Path::new("/data"),
        );
        let chunk = ChunkId {
            volume_id: 1,
            index: 0,
        };
        disk.create_dir_all(&layout::volume_dir(Path::new("/data"), 1))
            .unwrap();
        let file = disk
            .open(&layout::chunk_path(Path::new("/data"), chunk), true)
            .unwrap();
        let other = disk.open(Path::new("/data/meta"), true).unwrap();
        assert!(take_paced_until().is_none());
        other.write_all_at(&[0; 4096], 0).unwrap();
        assert!(
            take_paced_until().is_none(),
            "only chunk files and the hdd journal"
        );
        background(|| file.write_all_at(&[0; 4096], 0)).unwrap();
        assert!(take_paced_until().is_some());
        assert!(hdd.idle(Duration::ZERO), "background work");
        file.read_at(&mut [0; 4096], 0).unwrap();
        assert!(take_paced_until().is_some());
        assert!(!hdd.idle(Duration::ZERO));
        // Sequential: the second adds exactly its transfer time after the first.
        let first = hdd.reserve(0, 1 << 20, true);
        let second = hdd.reserve(1 << 20, 1 << 20, false);
        assert_eq!(second - first, service_time(0, 0, 1 << 20, 0));
    }

    /// A chain disk's read goes ahead of a write backlog and pushes it back by the
    /// read's time and the seek back.
    #[test]
    fn a_read_goes_ahead_of_queued_writes_and_delays_them() {
        let hdd = Hdd::default();
        let backlog = hdd.reserve(0, 150 << 20, true); // a second of writes
        let read = hdd.reserve_read_first(DEVICE_BYTES / 2, 4096);
        assert!(read < backlog, "the read waited for the writes");
        let busy = hdd.head.lock().unwrap().busy_until;
        assert!(
            busy > backlog + SEEK_TRACK_TO_TRACK * 2,
            "the writes were not delayed"
        );
        // The writes go on where they were: the next one is sequential to them.
        let next = hdd.reserve(150 << 20, 1 << 20, true);
        assert_eq!(next - busy, service_time(0, 0, 1 << 20, 0));
    }

    /// Reads queued behind reads (a body disk, no writes): one after another, the
    /// next from where the last ended, no seek back to a write position.
    #[test]
    fn reads_behind_reads_queue_without_a_seek_back() {
        let hdd = Hdd::default();
        let first = hdd.reserve_read_first(DEVICE_BYTES / 2, 1 << 20);
        let second = hdd.reserve_read_first(DEVICE_BYTES / 2 + (1 << 20), 1 << 20);
        assert_eq!(second - first, service_time(0, 0, 1 << 20, 0), "sequential");
        let head = hdd.head.lock().unwrap();
        assert_eq!(head.busy_until, second, "nothing charged beyond the reads");
        assert_eq!(head.reads_until, second);
        assert_eq!(head.position, DEVICE_BYTES / 2 + (2 << 20));
    }
}
