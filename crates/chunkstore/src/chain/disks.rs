//! The chain of disks: one preallocated log file per disk, laid end to end into one
//! circular address space of 4 KiB blocks. A position is monotonic (it never wraps);
//! its block is `position % total_blocks`, placed by the [`Layout`]: chained, the
//! tail fills disk 0, then disk 1, ..., then disk 0 again once the head has been
//! cleaned past it (striped only for the benchmark's RAID-0 baseline).

use super::placement::Layout;
use crate::block_sums::BLOCK_BYTES;
use crate::disk::{self, Disk, FileRef};
use std::io;
use std::path::PathBuf;

/// Blocks in a segment, the unit the cleaner frees (1 MiB).
pub(crate) const SEGMENT_BLOCKS: u64 = 256;
/// The log file in each disk's directory.
pub(crate) const LOG_FILE: &str = "chain.log";

pub(crate) struct Disks {
    files: Vec<FileRef>,
    blocks_per_disk: u64,
    layout: Layout,
}

impl Disks {
    /// Opens (creating) each disk's log of `disk_bytes`, rounded down to whole
    /// segments. Sparse, not allocated up front: the tail writes it a segment at a
    /// time in order, so the file system lays it out sequentially anyway, and a demo
    /// of many chains takes only what it writes.
    pub(crate) fn open(
        disk: &dyn Disk,
        dirs: &[PathBuf],
        disk_bytes: u64,
        layout: Layout,
    ) -> io::Result<Disks> {
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
            layout,
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

    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }

    /// The disk holding `position`, the byte offset in its log, and the blocks from
    /// there on that stay contiguous on that disk.
    pub(crate) fn place(&self, position: u64) -> (usize, u64, u64) {
        let block = position % self.total_blocks();
        let (disk, at, run) =
            self.layout
                .place(block, self.files.len() as u64, self.blocks_per_disk);
        (disk, at * BLOCK_BYTES, run)
    }

    /// The pieces of `blocks` blocks from `position` (within one lap) that stay
    /// contiguous on one disk: (disk, byte offset there, first block of the piece
    /// counted from `position`, blocks).
    fn pieces(&self, position: u64, blocks: u64) -> Vec<(usize, u64, u64, u64)> {
        assert!(
            blocks <= self.total_blocks() - position % self.total_blocks(),
            "a run crosses the end of a lap"
        );
        let mut pieces = Vec::new();
        let mut done = 0;
        while done < blocks {
            let (disk, offset, run) = self.place(position + done);
            let piece = run.min(blocks - done);
            pieces.push((disk, offset, done, piece));
            done += piece;
        }
        pieces
    }

    /// Writes whole blocks starting at `position`, within one segment.
    pub(crate) fn write(&self, position: u64, data: &[u8]) -> io::Result<()> {
        assert_eq!(data.len() as u64 % BLOCK_BYTES, 0, "whole blocks only");
        for (disk, offset, first, blocks) in self.pieces(position, data.len() as u64 / BLOCK_BYTES)
        {
            let range = (first * BLOCK_BYTES) as usize..((first + blocks) * BLOCK_BYTES) as usize;
            self.files[disk].write_all_at(&data[range], offset)?;
        }
        Ok(())
    }

    /// Reads whole blocks starting at `position`, within one lap (the cleaner reads
    /// the head several segments at a time), one read per disk piece; returns each
    /// piece's disk and blocks (for the read counters).
    pub(crate) fn read(&self, position: u64, out: &mut [u8]) -> io::Result<Vec<(usize, u64)>> {
        assert_eq!(out.len() as u64 % BLOCK_BYTES, 0, "whole blocks only");
        let pieces = self.pieces(position, out.len() as u64 / BLOCK_BYTES);
        for &(disk, offset, first, blocks) in &pieces {
            let range = (first * BLOCK_BYTES) as usize..((first + blocks) * BLOCK_BYTES) as usize;
            disk::read_at(&*self.files[disk], &mut out[range], offset)?;
        }
        Ok(pieces
            .into_iter()
            .map(|(disk, _, _, blocks)| (disk, blocks))
            .collect())
    }

    pub(crate) fn sync(&self) -> io::Result<()> {
        self.files.iter().try_for_each(|f| f.sync_data())
    }
}
