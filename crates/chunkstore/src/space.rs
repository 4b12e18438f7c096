//! Space on the data directory's file system, accounted before anything is written.
//!
//! A change that may allocate space reserves it before the replica takes its version
//! (see [`crate::Store::reserve_write`]): a full file system refuses the change up
//! front with [`StoreError::NoSpace`], the replica untouched, instead of failing it
//! after it was logged (which would leave the replica missing a change it claims).
//! Reservations are held until the change is in the chunk file; journaled data not
//! yet replayed counts as held too, since replay will need room for it.
//!
//! A floor is never reserved: what frees space or must not fail when the disk is
//! full runs in it (deletes, trims, checkpoints, checksum-file updates).

use crate::block_sums::BLOCK_BYTES;
use crate::disk::{Disk, FsSpace};
use crate::error::StoreError;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// The floor: this share of the file system, within the bounds below.
const FLOOR_SHARE: u64 = 64;
const FLOOR_MIN: u64 = 4 << 20;
const FLOOR_MAX: u64 = 1 << 30;
const FS_READ_EVERY: Duration = Duration::from_millis(100);
/// A server that refused a reservation this recently reports itself short of space
/// (tokio's clock: a simulation runs it virtually).
const SHORT_FOR: Duration = Duration::from_secs(10);

pub(crate) struct Space {
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Bytes reserved by changes not yet in the chunk files.
    held: u64,
    refused_at: Option<Instant>,
    /// The file system as last read, and when: read again at most every
    /// [`FS_READ_EVERY`] (one statvfs per write would be a syscall per request), and
    /// before any refusal.
    read: Option<(FsSpace, Instant)>,
    /// Bytes of reservations given back since that read: taken as spent.
    spent: u64,
}

impl State {
    /// The file system now: the last read less what was spent since, or a new read.
    fn fs(&mut self, space: &Space, fresh: bool) -> Result<FsSpace, StoreError> {
        match self.read {
            Some((fs, at)) if !fresh && at.elapsed() < FS_READ_EVERY => Ok(FsSpace {
                free_bytes: fs.free_bytes.saturating_sub(self.spent),
                ..fs
            }),
            _ => {
                let fs = space.disk.space(&space.dir)?;
                self.read = Some((fs, Instant::now()));
                self.spent = 0;
                Ok(fs)
            }
        }
    }
}

/// Which room a change may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// Free space above the floor.
    Normal,
    /// A change the other replicas took, sent again to one that refused it: it may
    /// use half the floor, so replicas that fill at about the same rate stay equal
    /// (one left behind would need a repair, with no room for it).
    CatchUp,
}

/// What the chunk server reports to the master about its file system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpaceReport {
    pub fs: FsSpace,
    /// What new writes may still reserve.
    pub writable_bytes: u64,
    /// A write was refused for space lately, or little is left: new chunks go
    /// elsewhere.
    pub short: bool,
}

/// Space reserved for one change; given back when dropped (once the change is in
/// the chunk file, or failed).
pub struct Reservation {
    space: Option<Arc<Space>>,
    bytes: u64,
}

impl Reservation {
    /// For a change that allocates nothing.
    pub fn none() -> Reservation {
        Reservation {
            space: None,
            bytes: 0,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(space) = &self.space {
            let mut state = space.state.lock().unwrap();
            assert!(
                state.held >= self.bytes,
                "reservation of {} bytes released with {} held",
                self.bytes,
                state.held
            );
            state.held -= self.bytes;
            state.spent += self.bytes;
        }
    }
}

/// Bytes a write of `length` at `offset` may allocate: its blocks and their
/// checksums' pages (a new chunk file's first page included).
pub(crate) fn write_needs(offset: u64, length: u64) -> u64 {
    if length == 0 {
        return 0;
    }
    let blocks = (offset + length).div_ceil(BLOCK_BYTES) - offset / BLOCK_BYTES;
    let sums_pages = (blocks * 4).div_ceil(BLOCK_BYTES) + 1;
    (blocks + sums_pages) * BLOCK_BYTES
}

impl Space {
    pub(crate) fn new(disk: Arc<dyn Disk>, dir: &Path) -> Arc<Space> {
        Arc::new(Space {
            disk,
            dir: dir.to_path_buf(),
            state: Mutex::default(),
        })
    }

    /// Reserves `bytes`, with `pending` more already promised (journaled data not
    /// yet replayed). Nothing to reserve always succeeds.
    pub(crate) fn reserve(
        self: &Arc<Space>,
        bytes: u64,
        pending: u64,
        room: Room,
    ) -> Result<Reservation, StoreError> {
        if bytes == 0 {
            return Ok(Reservation::none());
        }
        let mut state = self.state.lock().unwrap();
        let available = |state: &mut State, fresh: bool| -> Result<(FsSpace, u64), StoreError> {
            let fs = state.fs(self, fresh)?;
            let held = state.held + pending;
            Ok(match room {
                Room::Normal => (fs, writable(&fs, held)),
                Room::CatchUp => (fs, fs.free_bytes.saturating_sub(held + floor(&fs) / 2)),
            })
        };
        let (mut fs, mut room_left) = available(&mut state, false)?;
        if bytes > room_left {
            // Refused only on a fresh look: space may have come back since.
            (fs, room_left) = available(&mut state, true)?;
        }
        if bytes > room_left {
            state.refused_at = Some(Instant::now());
            return Err(StoreError::NoSpace(format!(
                "a {} write does not fit on the file system of {}: {} free, {} held for \
                 writes not yet in chunk files, {} kept for deletes and trims",
                mib(bytes),
                self.dir.display(),
                mib(fs.free_bytes),
                mib(state.held + pending),
                mib(floor(&fs))
            )));
        }
        state.held += bytes;
        Ok(Reservation {
            space: Some(self.clone()),
            bytes,
        })
    }

    pub(crate) fn report(&self, pending: u64) -> Result<SpaceReport, StoreError> {
        let mut state = self.state.lock().unwrap();
        let fs = state.fs(self, true)?;
        let writable_bytes = writable(&fs, state.held + pending);
        let refused_lately = state.refused_at.is_some_and(|t| t.elapsed() < SHORT_FOR);
        Ok(SpaceReport {
            fs,
            writable_bytes,
            short: refused_lately || writable_bytes < floor(&fs),
        })
    }

    /// The space the log of a file system this size may take: its checkpoint
    /// quota (after which it is reused from the start).
    pub(crate) fn log_quota(&self, wanted: u64) -> Result<u64, StoreError> {
        let total = self.disk.space(&self.dir)?.total_bytes;
        Ok(wanted.min(total / 32).max(FLOOR_MIN))
    }
}

/// Kept for what frees space or must not fail.
fn floor(fs: &FsSpace) -> u64 {
    floor_of(fs.total_bytes)
}

/// The floor kept on a file system of `total_bytes`. Only the store's own writes
/// stay above it: a restart on a disk something else filled past it may find no
/// room for its checkpoint.
pub fn floor_of(total_bytes: u64) -> u64 {
    (total_bytes / FLOOR_SHARE).clamp(FLOOR_MIN, FLOOR_MAX)
}

/// What new writes may still take, `held` being promised already.
fn writable(fs: &FsSpace, held: u64) -> u64 {
    fs.free_bytes.saturating_sub(held + floor(fs))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_needs_its_blocks_and_their_checksums() {
        assert_eq!(write_needs(0, 0), 0);
        // One block, its checksum page, a first page.
        assert_eq!(write_needs(0, 1), 3 * BLOCK_BYTES);
        // Straddling two blocks.
        assert_eq!(write_needs(4095, 2), 4 * BLOCK_BYTES);
        // 4 MiB: 1024 blocks, one page of checksums, a first page.
        assert_eq!(write_needs(0, 4 << 20), (1024 + 2) * BLOCK_BYTES);
    }
}
