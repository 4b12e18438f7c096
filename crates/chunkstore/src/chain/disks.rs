//! The chain of disks: one preallocated log file per disk, laid end to end into one
//! circular address space of 4 KiB blocks. A position is monotonic (it never wraps);
//! its block on disk is `position % total_blocks`, so the disk a position lands on
//! is the chain's order: the tail fills disk 0, then disk 1, ..., then disk 0 again
//! once the head has been cleaned past it.

use crate::block_sums::BLOCK_BYTES;
use crate::disk::{self, Disk, FileRef};
use std::io;
use std::path::PathBuf;

/// Blocks in a segment, the unit the cleaner frees (1 MiB).
pub(crate) const SEGMENT_BLOCKS: u64 = 256;
/// The log file in each disk's directory.
const LOG_FILE: &str = "chain.log";

pub(crate) struct Disks {
    files: Vec<FileRef>,
    blocks_per_disk: u64,
}

impl Disks {
    /// Opens (creating) each disk's log of `disk_bytes`, rounded down to whole
    /// segments. Sparse, not allocated up front: the tail writes it a segment at a
    /// time in order, so the file system lays it out sequentially anyway, and a demo
    /// of many chains takes only what it writes.
    pub(crate) fn open(disk: &dyn Disk, dirs: &[PathBuf], disk_bytes: u64) -> io::Result<Disks> {
        let blocks_per_disk = disk_bytes / BLOCK_BYTES / SEGMENT_BLOCKS * SEGMENT_BLOCKS;
        let mut files = Vec::with_capacity(dirs.len());
        for dir in dirs {
            disk.create_dir_all(dir)?;
            let file = disk.open(&dir.join(LOG_FILE), true)?;
            file.set_len(blocks_per_disk * BLOCK_BYTES)?;
            file.sync_data()?;
            disk::sync_dir_and_parents(disk, dir)?;
            files.push(file);
        }
        Ok(Disks {
            files,
            blocks_per_disk,
        })
    }

    pub(crate) fn count(&self) -> usize {
        self.files.len()
    }

    pub(crate) fn blocks_per_disk(&self) -> u64 {
        self.blocks_per_disk
    }

    pub(crate) fn total_blocks(&self) -> u64 {
        self.blocks_per_disk * self.files.len() as u64
    }

    /// The disk holding `position`, and the byte offset in its log.
    pub(crate) fn place(&self, position: u64) -> (usize, u64) {
        let block = position % self.total_blocks();
        (
            (block / self.blocks_per_disk) as usize,
            (block % self.blocks_per_disk) * BLOCK_BYTES,
        )
    }

    /// Writes whole blocks starting at `position`; the caller keeps a run within
    /// one segment, so within one disk.
    pub(crate) fn write(&self, position: u64, data: &[u8]) -> io::Result<()> {
        assert_eq!(data.len() as u64 % BLOCK_BYTES, 0, "whole blocks only");
        let blocks = data.len() as u64 / BLOCK_BYTES;
        assert!(
            blocks <= SEGMENT_BLOCKS - position % SEGMENT_BLOCKS,
            "a run crosses a segment"
        );
        let (disk, offset) = self.place(position);
        self.files[disk].write_all_at(data, offset)
    }

    pub(crate) fn read(&self, position: u64, out: &mut [u8]) -> io::Result<()> {
        let (disk, offset) = self.place(position);
        disk::read_at(&*self.files[disk], out, offset)
    }

    pub(crate) fn sync(&self) -> io::Result<()> {
        self.files.iter().try_for_each(|f| f.sync_data())
    }
}
