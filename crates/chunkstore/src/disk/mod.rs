//! The file system under the store: every file and directory operation the store does
//! goes through [`Disk`], so the same store runs on
//! - [`RealDisk`]: the host's file system, the same syscalls as a direct caller;
//! - [`hdd::HddDisk`]: a decorator that paces chunk-file and hdd-journal access as a
//!   7200 rpm disk would (an emulation for machines with only ssds);
//! - [`SimDisk`]: an in-memory disk that keeps written-but-unsynced data apart from
//!   durable data, and loses an arbitrary part of it at a simulated power cut.
//!
//! The store opens its files once and keeps them ([`FileRef`]): the hot path is one
//! virtual call per syscall, no allocation or lock added.

pub mod hdd;
mod real;
mod sim;

pub use real::RealDisk;
pub use sim::SimDisk;

use std::io::{self, ErrorKind};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// An open file, shared by whoever reads or writes it.
pub type FileRef = Arc<dyn DiskFile>;

/// File-system operations on paths.
pub trait Disk: Send + Sync {
    /// Opens a regular file for reading and writing; `create` makes an empty one if
    /// it does not exist, else that is `NotFound`. Never truncates.
    fn open(&self, path: &Path, create: bool) -> io::Result<FileRef>;
    /// Opens an existing file again, for writes that bypass the page cache
    /// (`O_DIRECT`): whole 512-byte sectors at sector offsets, from page-aligned
    /// memory. `None` where the file system has no such writes. A disk without a
    /// page cache opens it as [`Disk::open`] does.
    fn open_direct(&self, path: &Path) -> io::Result<Option<FileRef>> {
        self.open(path, false).map(Some)
    }
    /// Creates a directory and its missing parents (their entries are not durable
    /// until the parents are synced).
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Makes a directory's entries (files created, renamed or removed in it) durable.
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
    /// Replaces `to` by `from` atomically.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    fn remove_dir_all(&self, path: &Path) -> io::Result<()>;
    fn exists(&self, path: &Path) -> io::Result<bool>;
    /// Names of a directory's entries, in no particular order.
    fn read_dir(&self, path: &Path) -> io::Result<Vec<String>>;
    /// Bytes a file occupies on the device (allocated blocks).
    fn allocated_bytes(&self, path: &Path) -> io::Result<u64>;
    /// The file system holding `path`: its size, what is free, and which it is.
    fn space(&self, path: &Path) -> io::Result<FsSpace>;
}

/// A file system's size and free space, as `statvfs` reports them to an
/// unprivileged writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// Tells file systems apart: chunk servers sharing one report the same.
    pub device: u64,
}

/// Operations on an open file. Positioned I/O only: handles are shared by threads.
pub trait DiskFile: Send + Sync {
    /// Reads at `offset` into `buf`; returns the bytes read, 0 at or past the end.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    /// Makes the file's data (and its size) durable: fdatasync.
    fn sync_data(&self) -> io::Result<()>;
    /// Starts writing the file's dirty pages out without waiting for them, so a later
    /// [`DiskFile::sync_data`] has less to wait for: a range of `range` bytes at a
    /// time, `pause` after each, so the device keeps serving other writes meanwhile.
    /// Promises nothing about durability; a disk without a page cache does nothing.
    fn start_writeback(&self, _range: u64, _pause: Duration) -> io::Result<()> {
        Ok(())
    }
    /// Zeroes `[offset, offset + length)` without changing the size; `punch` frees
    /// the space, otherwise it stays allocated.
    fn zero_range(&self, offset: u64, length: u64, punch: bool) -> io::Result<()>;
    fn set_len(&self, length: u64) -> io::Result<()>;
    /// Allocates the first `length` bytes (growing the file to at least that size),
    /// so writes below it never fail for space. Data already there is kept.
    fn allocate(&self, length: u64) -> io::Result<()>;
    /// The file size in bytes.
    fn size(&self) -> io::Result<u64>;
    /// The ranges that hold data (SEEK_DATA / SEEK_HOLE), as (offset, length), sorted.
    fn extents(&self) -> io::Result<Vec<(u64, u64)>>;
    /// Takes an exclusive advisory lock without waiting; false when another holds it.
    fn try_lock(&self) -> io::Result<bool>;
}

/// Fills `buf` from `offset`; past the end of the file reads as zeroes (sparse files).
pub(crate) fn read_at(file: &dyn DiskFile, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fills `buf` from `offset`; `false` if the file ends first.
pub(crate) fn read_exact_at(file: &dyn DiskFile, buf: &mut [u8], offset: u64) -> io::Result<bool> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => return Ok(false),
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Makes the entries of `dir` and of every directory above it durable: what a store
/// created there on its first open (its directories, log and journal files) must not
/// vanish in a power cut once a write is acknowledged. A few syncs per open.
pub(crate) fn sync_dir_and_parents(disk: &dyn Disk, dir: &Path) -> io::Result<()> {
    for dir in dir.ancestors() {
        // A relative path's last ancestor is empty: the working directory.
        let dir = match dir.as_os_str().is_empty() {
            true => Path::new("."),
            false => dir,
        };
        disk.sync_dir(dir)?;
    }
    Ok(())
}

/// The whole file at `path`; `None` if there is none.
pub(crate) fn read_file(disk: &dyn Disk, path: &Path) -> io::Result<Option<Vec<u8>>> {
    let file = match disk.open(path, false) {
        Ok(file) => file,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut out = vec![0; file.size()? as usize];
    read_at(&*file, &mut out, 0)?;
    Ok(Some(out))
}
