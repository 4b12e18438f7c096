//! Block checksums: every 4 KiB block of a chunk file has a crc32c, kept in a file
//! beside it (`chunks/VOLUME/INDEX.sums`, 4 bytes per block), written with the data
//! (in plain mode kept in memory until the next checkpoint: see
//! [`crate::sums_cache`]) and checked on every read, so bit rot is found before a
//! client gets it. 0 means no
//! checksum (a hole, or a range zeroed whole): such a block reads as whatever it
//! holds.
//!
//! A partial write reads the rest of its block first and checks it: a corrupt block
//! stays marked corrupt ("poisoned", a checksum its data does not match) instead of
//! getting a fresh checksum over bad bytes; a repair rewrites it whole.
//!
//! After a crash a block may hold data and checksum out of step (either write may
//! have reached the disk without the other). Recovery puts them back in step before
//! anything reads them, trusting the data ([`Merge::Trust`]): plain mode's log replay
//! rewrites every block changed since the last checkpoint; hybrid mode rehashes the
//! ranges of its last batch's chunk-file changes, which it logs as intents first
//! ([`crate::wal::Kind::Intent`]), and leaves unchecked the blocks that still have
//! data in a journal (a replay may have been copying them; it rewrites them).

use crate::disk::{self, FileRef};
use crate::error::StoreError;
use crate::sums_cache::{SumsCache, PAGE_SUMS};
use bytes::{Buf, BufMut};
use floe_protocol::ChunkId;
use std::io;
use std::sync::Arc;

/// The checksummed unit.
pub const BLOCK_BYTES: u64 = 4096;
const ENTRY_BYTES: u64 = 4;
/// A mismatch is read again before it is believed: a read racing a write of the same
/// block may see the data of one and the checksum of the other.
const READ_ATTEMPTS: u32 = 3;
const POISON: u32 = 0x5a5a_5a5a;
/// The largest single write to a chunk file. ext4 caches a file in folios as large as
/// the writes that made them, and each later 4 KiB overwrite walks every buffer of
/// its folio (`ext4_block_write_begin`, and again at writeback). After a 1 MiB fill
/// that walk took a fifth of the CPU of 4k random writes; written in 16 KiB pieces,
/// they ran 1.23x the IOPS, and 1 MiB writes no slower (docs/ARCHITECTURE.md,
/// Performance notes).
const WRITE_PIECE_BYTES: usize = 16 << 10;

/// 0 means "no checksum"; a block whose crc is 0 keeps a checksum of 1, which it never
/// matches: one block in 2^32 reads as corrupt once and is rewritten by a repair.
fn checksum(block: &[u8]) -> u32 {
    crc32c::crc32c(block).max(1)
}

fn accepts(sum: u32, block: &[u8]) -> bool {
    sum == 0 || sum == checksum(block)
}

/// A repair's fingerprint of a block's bytes, to find the blocks two replicas hold
/// differently without moving them: 64 bits, so that two different blocks passing
/// for the same is not a risk worth naming; never 0, which stands for a hole.
pub fn fingerprint(block: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(block).max(1)
}

/// Checksums as the checksum file holds them.
fn encode(sums: &[u32]) -> Vec<u8> {
    let mut raw = Vec::with_capacity(sums.len() * ENTRY_BYTES as usize);
    for sum in sums {
        raw.put_u32_le(*sum);
    }
    raw
}

/// A checksum no block of checksum `sum` matches.
fn poisoned(sum: u32) -> u32 {
    (sum ^ POISON).max(1)
}

/// How a partly covered block's other bytes are taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Merge {
    /// Checked against the block's checksum: a bad block stays marked corrupt.
    Check,
    /// As they are: recovery, where data and checksum may be out of step and the
    /// data is right (or about to be rewritten).
    Trust,
}

/// What a change puts in the range it covers.
pub(crate) enum Fill<'a> {
    Data(&'a [u8]),
    Zero { length: u64, punch: bool },
}

impl Fill<'_> {
    fn len(&self) -> u64 {
        match self {
            Fill::Data(data) => data.len() as u64,
            Fill::Zero { length, .. } => *length,
        }
    }
}

/// A chunk file and its checksums.
#[derive(Clone)]
pub(crate) struct ChunkFile {
    pub(crate) chunk: ChunkId,
    pub(crate) data: FileRef,
    pub(crate) sums: FileRef,
    pub(crate) cache: Arc<SumsCache>,
}

impl ChunkFile {
    /// Makes data and checksums durable, the checksums kept in memory first written.
    pub(crate) fn sync(&self) -> io::Result<()> {
        self.cache.flush(|page, sums| {
            self.sums
                .write_all_at(&encode(sums), page * PAGE_SUMS * ENTRY_BYTES)
        })?;
        self.sums.sync_data()?;
        self.data.sync_data()
    }

    fn sums(&self, first: u64, count: u64) -> io::Result<Vec<u32>> {
        let mut out = vec![0u32; count as usize];
        let mut at = first;
        while at < first + count {
            let (page, within) = (at / PAGE_SUMS, at % PAGE_SUMS);
            let n = (PAGE_SUMS - within).min(first + count - at);
            let part = &mut out[(at - first) as usize..(at - first + n) as usize];
            self.cache.read(page, within as usize, part, || {
                let mut raw = vec![0u8; (PAGE_SUMS * ENTRY_BYTES) as usize];
                disk::read_at(&*self.sums, &mut raw, page * PAGE_SUMS * ENTRY_BYTES)?;
                Ok(raw.chunks_exact(4).map(|mut e| e.get_u32_le()).collect())
            })?;
            at += n;
        }
        Ok(out)
    }

    fn put_sums(&self, first: u64, sums: &[u32]) -> io::Result<()> {
        self.cache.write(first, sums, || {
            self.sums.write_all_at(&encode(sums), first * ENTRY_BYTES)
        })
    }

    /// Changes `[offset, offset + fill.len())` and its blocks' checksums (not yet
    /// durable). `poison` marks every block it touches corrupt (the data came from a
    /// journal sector that failed its own checksum). Returns the offsets of blocks
    /// found corrupt on the way (partly covered ones, with [`Merge::Check`]), kept
    /// marked corrupt.
    pub(crate) fn write(
        &self,
        offset: u64,
        fill: Fill,
        merge: Merge,
        poison: bool,
    ) -> io::Result<Vec<u64>> {
        let end = offset + fill.len();
        if end == offset {
            return Ok(Vec::new());
        }
        let first = offset / BLOCK_BYTES;
        let last = (end - 1) / BLOCK_BYTES;
        let mut bad = Vec::new();
        let seal = |sum: u32, good: bool| if good && !poison { sum } else { poisoned(sum) };
        // A partly covered block: its other bytes as they are, under the change's.
        let mut merged = |block: u64, old: u32| -> io::Result<u32> {
            let start = block * BLOCK_BYTES;
            let mut bytes = [0u8; BLOCK_BYTES as usize];
            disk::read_at(&*self.data, &mut bytes, start)?;
            let good = merge == Merge::Trust || accepts(old, &bytes);
            let (from, to) = (offset.max(start), end.min(start + BLOCK_BYTES));
            let part = &mut bytes[(from - start) as usize..(to - start) as usize];
            match &fill {
                Fill::Data(data) => {
                    part.copy_from_slice(&data[(from - offset) as usize..(to - offset) as usize])
                }
                Fill::Zero { .. } => part.fill(0),
            }
            if !good {
                bad.push(start);
            }
            Ok(seal(checksum(&bytes), good))
        };
        let whole = |block: u64| block * BLOCK_BYTES >= offset && (block + 1) * BLOCK_BYTES <= end;
        match &fill {
            Fill::Data(data) => {
                let mut sums = self.sums(first, last - first + 1)?;
                for (block, sum) in (first..=last).zip(sums.iter_mut()) {
                    *sum = if whole(block) {
                        let at = (block * BLOCK_BYTES - offset) as usize;
                        seal(checksum(&data[at..at + BLOCK_BYTES as usize]), true)
                    } else {
                        merged(block, *sum)?
                    };
                }
                self.put_sums(first, &sums)?;
                for (i, piece) in data.chunks(WRITE_PIECE_BYTES).enumerate() {
                    let at = offset + (i * WRITE_PIECE_BYTES) as u64;
                    self.data.write_all_at(piece, at)?;
                }
            }
            &Fill::Zero { length, punch } => {
                // Whole blocks lose their checksums (a range zeroed whole reads as
                // zeroes however it is kept); only the edges are merged.
                let edges = if first == last {
                    vec![first]
                } else {
                    vec![first, last]
                };
                for block in edges {
                    if !whole(block) {
                        let sum = merged(block, self.sums(block, 1)?[0])?;
                        self.put_sums(block, &[sum])?;
                    }
                }
                let whole_from = offset.div_ceil(BLOCK_BYTES);
                let whole_to = end / BLOCK_BYTES;
                if whole_to > whole_from {
                    let count = whole_to - whole_from;
                    self.cache.zero(whole_from, count, || {
                        self.sums
                            .zero_range(whole_from * ENTRY_BYTES, count * ENTRY_BYTES, true)
                    })?;
                }
                self.data.zero_range(offset, length, punch)?;
            }
        }
        Ok(bad)
    }

    /// Recovery: the checksums of the blocks of `[offset, offset + length)` made those
    /// of the data they hold (a change there was cut short; see the module doc).
    pub(crate) fn rehash(&self, offset: u64, length: u64) -> io::Result<()> {
        const PIECE_BLOCKS: u64 = 256;
        let first = offset / BLOCK_BYTES;
        let end = (offset + length).div_ceil(BLOCK_BYTES);
        let mut block = first;
        while block < end {
            let count = (end - block).min(PIECE_BLOCKS);
            let mut bytes = vec![0u8; (count * BLOCK_BYTES) as usize];
            disk::read_at(&*self.data, &mut bytes, block * BLOCK_BYTES)?;
            let sums: Vec<u32> = bytes
                .chunks_exact(BLOCK_BYTES as usize)
                .map(checksum)
                .collect();
            self.put_sums(block, &sums)?;
            block += count;
        }
        Ok(())
    }

    /// Reads whole blocks from `start` (a block boundary) into `out` (whole blocks),
    /// checking each except those `unchecked` names; returns the offsets of the
    /// blocks that fail.
    fn read_blocks(
        &self,
        out: &mut [u8],
        start: u64,
        unchecked: &dyn Fn(u64) -> bool,
    ) -> io::Result<Vec<u64>> {
        assert!(
            start.is_multiple_of(BLOCK_BYTES) && (out.len() as u64).is_multiple_of(BLOCK_BYTES),
            "block reads cover whole blocks"
        );
        disk::read_at(&*self.data, out, start)?;
        let sums = self.sums(start / BLOCK_BYTES, out.len() as u64 / BLOCK_BYTES)?;
        let mut bad = Vec::new();
        for (i, (bytes, sum)) in out
            .chunks_exact_mut(BLOCK_BYTES as usize)
            .zip(sums)
            .enumerate()
        {
            let at = start + i as u64 * BLOCK_BYTES;
            if unchecked(at) {
                continue;
            }
            let mut sum = sum;
            let mut attempts = 1;
            while !accepts(sum, bytes) {
                if attempts == READ_ATTEMPTS {
                    bad.push(at);
                    break;
                }
                attempts += 1;
                disk::read_at(&*self.data, bytes, at)?;
                sum = self.sums(at / BLOCK_BYTES, 1)?[0];
            }
        }
        Ok(bad)
    }

    /// Fills `out` from `offset`, every block it touches checked except those whose
    /// offsets `unchecked` names: a block that fails is never returned.
    pub(crate) fn read(
        &self,
        out: &mut [u8],
        offset: u64,
        unchecked: &dyn Fn(u64) -> bool,
    ) -> Result<(), StoreError> {
        let end = offset + out.len() as u64;
        let start = offset - offset % BLOCK_BYTES;
        let stop = end.next_multiple_of(BLOCK_BYTES);
        let bad = if start == offset && stop == end {
            self.read_blocks(out, start, unchecked)?
        } else {
            let mut blocks = vec![0u8; (stop - start) as usize];
            let bad = self.read_blocks(&mut blocks, start, unchecked)?;
            let from = (offset - start) as usize;
            out.copy_from_slice(&blocks[from..from + out.len()]);
            bad
        };
        match bad.first() {
            None => Ok(()),
            Some(&offset) => Err(StoreError::Corrupt {
                chunk: self.chunk,
                offset,
                place: "chunk file",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::{Disk, RealDisk};

    /// A chunk file as plain mode opens it (checksums written back at sync).
    fn file(dir: &std::path::Path) -> ChunkFile {
        ChunkFile {
            chunk: ChunkId {
                volume_id: 1,
                index: 2,
            },
            data: RealDisk.open(&dir.join("data"), true).unwrap(),
            sums: RealDisk.open(&dir.join("sums"), true).unwrap(),
            cache: Arc::new(SumsCache::new(Default::default(), true)),
        }
    }

    #[test]
    fn checksums_reach_the_file_at_sync() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        write(&f, 0, &[1; 4096]);
        f.sync().unwrap();
        write(&f, 0, &[2; 4096]);
        assert_eq!(read(&f, 0, 4096).unwrap(), vec![2; 4096]);
        // What a restart before the sync would find: the old checksum over new data
        // (replay rewrites it).
        assert!(read(&file(dir.path()), 0, 4096).is_err());
        f.sync().unwrap();
        assert_eq!(read(&file(dir.path()), 0, 4096).unwrap(), vec![2; 4096]);
    }

    fn read(f: &ChunkFile, offset: u64, length: usize) -> Result<Vec<u8>, StoreError> {
        let mut out = vec![0; length];
        f.read(&mut out, offset, &|_| false).map(|()| out)
    }

    fn write(f: &ChunkFile, offset: u64, data: &[u8]) -> Vec<u64> {
        f.write(offset, Fill::Data(data), Merge::Check, false)
            .unwrap()
    }

    #[test]
    fn a_write_of_many_pieces_lands_whole() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        let data: Vec<u8> = (0..3 * WRITE_PIECE_BYTES + 1000)
            .map(|i| (i % 251) as u8)
            .collect();
        assert!(write(&f, 12_288 + 7, &data).is_empty());
        assert_eq!(read(&f, 12_288 + 7, data.len()).unwrap(), data);
        let mut whole = vec![0; 12_288 + 7];
        whole.extend_from_slice(&data);
        assert_eq!(read(&f, 0, whole.len()).unwrap(), whole);
    }

    #[test]
    fn a_flipped_byte_is_found_and_never_read() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        let data: Vec<u8> = (0..3 * BLOCK_BYTES).map(|i| (i % 251) as u8).collect();
        write(&f, 1000, &data);
        assert_eq!(read(&f, 1000, data.len()).unwrap(), data);
        f.data.write_all_at(&[0xff], 5000).unwrap();
        let err = read(&f, 1000, data.len()).unwrap_err();
        assert!(
            matches!(err, StoreError::Corrupt { offset: 4096, .. }),
            "{err}"
        );
        // A read of other blocks still works; one touching the bad block does not,
        // unless it is named unchecked.
        assert!(read(&f, 0, 4096).is_ok());
        assert!(read(&f, 8191, 2).is_err());
        let mut out = [0; 2];
        f.read(&mut out, 8191, &|at| at == 4096).unwrap();
    }

    #[test]
    fn a_partial_write_over_a_corrupt_block_keeps_it_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        write(&f, 0, &[7; 8192]);
        f.data.write_all_at(&[0], 100).unwrap();
        assert_eq!(write(&f, 200, &[9; 10]), vec![0]);
        assert!(read(&f, 0, 4096).is_err(), "still corrupt after the write");
        // A whole-block write (a repair) makes it good again.
        assert!(write(&f, 0, &[3; 4096]).is_empty());
        assert_eq!(read(&f, 0, 4096).unwrap(), vec![3; 4096]);
    }

    #[test]
    fn recovery_trusts_the_data() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        write(&f, 0, &[1; 8192]);
        // A crash kept the data of a change and lost its checksums.
        f.data.write_all_at(&[2; 100], 4000).unwrap();
        assert!(read(&f, 0, 8192).is_err());
        // Log replay writes the change again, trusting the rest of the blocks.
        let replayed = f
            .write(4000, Fill::Data(&[2; 100]), Merge::Trust, false)
            .unwrap();
        assert!(replayed.is_empty());
        assert!(read(&f, 0, 8192).is_ok());
        // Or an intent's range is rehashed.
        f.data.write_all_at(&[3; 10], 10).unwrap();
        f.rehash(10, 10).unwrap();
        assert_eq!(read(&f, 0, 20).unwrap()[10..], [3; 10]);
    }

    #[test]
    fn zeroing_keeps_the_edges_checked_and_drops_whole_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        write(&f, 0, &[5; 16384]);
        let zero = Fill::Zero {
            length: 10000,
            punch: true,
        };
        assert!(f.write(2000, zero, Merge::Check, false).unwrap().is_empty());
        let mut expect = vec![5; 16384];
        expect[2000..12000].fill(0);
        assert_eq!(read(&f, 0, 16384).unwrap(), expect);
        assert_eq!(f.sums(1, 1).unwrap()[0], 0);
        f.data.write_all_at(&[1], 12500).unwrap();
        assert!(read(&f, 12288, 10).is_err(), "the edge block is checked");
    }

    #[test]
    fn poisoned_blocks_never_check() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        f.write(4096, Fill::Data(&[8; 4096]), Merge::Check, true)
            .unwrap();
        assert!(read(&f, 4096, 4096).is_err());
        assert!(read(&f, 0, 4096).is_ok(), "a hole is unchecked");
    }
}
