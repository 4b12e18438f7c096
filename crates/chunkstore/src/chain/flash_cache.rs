//! The flash half of the tail cache (the thesis's SSD tail cache): every segment the
//! tail writes is also written to a ring file in the cache (flash) directory, so
//! reads of recent data the RAM cache has evicted still miss the tail disk.
//!
//! The ring holds the last `blocks` positions written: a position's slot is
//! `position % blocks`, and a slot's owner is kept in RAM only. After a restart or
//! a power cut the ring starts empty (its file is cut to nothing and regrown), so
//! it never serves bytes written before the cut: the recovered tail writes those
//! positions again with other data. A position compaction rewrites behind the tail
//! is dropped ([`FlashCache::forget`]).

use super::disks::SEGMENT_BLOCKS;
use crate::block_sums::BLOCK_BYTES;
use crate::disk::{self, Disk, FileRef};
use std::io;
use std::path::Path;

/// The ring file in the cache directory.
const FILE: &str = "chain.tail-cache";

pub(crate) struct FlashCache {
    /// `None` when the flash cache is off (no bytes for it).
    file: Option<FileRef>,
    /// Each slot's position plus one; 0 for an empty slot.
    owners: Vec<u64>,
}

impl FlashCache {
    /// The ring of `bytes` (whole segments) in `dir`, empty; off below a segment.
    pub(crate) fn open(disk: &dyn Disk, dir: &Path, bytes: u64) -> io::Result<FlashCache> {
        let blocks = bytes / BLOCK_BYTES / SEGMENT_BLOCKS * SEGMENT_BLOCKS;
        let path = dir.join(FILE);
        if blocks == 0 {
            if disk.exists(&path)? {
                disk.remove_file(&path)?;
            }
            return Ok(FlashCache {
                file: None,
                owners: Vec::new(),
            });
        }
        let file = disk.open(&path, true)?;
        // Drops what an earlier run left: nothing in it is known to be current.
        file.set_len(0)?;
        file.set_len(blocks * BLOCK_BYTES)?;
        Ok(FlashCache {
            file: Some(file),
            owners: vec![0; blocks as usize],
        })
    }

    /// Keeps whole blocks the tail wrote from `position` (within one segment, so
    /// contiguous in the ring).
    pub(crate) fn write(&mut self, position: u64, data: &[u8]) -> io::Result<()> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let slots = self.owners.len() as u64;
        let blocks = data.len() as u64 / BLOCK_BYTES;
        let slot = position % slots;
        assert!(slot + blocks <= slots, "a run crosses the ring's end");
        file.write_all_at(data, slot * BLOCK_BYTES)?;
        for (i, owner) in self.owners[slot as usize..(slot + blocks) as usize]
            .iter_mut()
            .enumerate()
        {
            *owner = position + i as u64 + 1;
        }
        Ok(())
    }

    /// The block at `position` if the ring holds it.
    pub(crate) fn read(&self, position: u64, out: &mut [u8]) -> io::Result<bool> {
        let Some(file) = &self.file else {
            return Ok(false);
        };
        if !self.holds(position) {
            return Ok(false);
        }
        let slot = position % self.owners.len() as u64;
        disk::read_at(&**file, out, slot * BLOCK_BYTES)?;
        Ok(true)
    }

    /// The ring holds `position`'s block.
    pub(crate) fn holds(&self, position: u64) -> bool {
        !self.owners.is_empty()
            && self.owners[(position % self.owners.len() as u64) as usize] == position + 1
    }

    /// Drops a position rewritten behind the tail.
    pub(crate) fn forget(&mut self, position: u64) {
        if self.file.is_some() {
            let slot = position % self.owners.len() as u64;
            if self.owners[slot as usize] == position + 1 {
                self.owners[slot as usize] = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::gc::tests::{options, write, CHUNK};
    use super::super::{Chain, Gc, Layout};
    use crate::SimDisk;

    /// 1 MiB of RAM cache, 2 of flash: reads of the last 2 MiB written miss the tail
    /// disk; after a power cut the ring is empty, and the tail writing the lost
    /// positions again with other data reads back the new data, not the ring's.
    #[test]
    fn recent_data_reads_from_flash_and_a_cut_empties_it() {
        let sim = SimDisk::new();
        let mut options = options(Layout::Chained);
        options.cache_bytes = 1 << 20;
        options.flash_cache_bytes = 2 << 20;
        let chain = Chain::open(sim.mount(), &options).unwrap();
        let old: Vec<u8> = (0..2 << 20).map(|i| (i % 253) as u8).collect();
        write(&chain, 0, &old);
        chain.persist().unwrap();
        let lost = vec![0x11u8; 2 << 20];
        write(&chain, 4 << 20, &lost);
        let mut out = vec![0; 2 << 20];
        chain.read(CHUNK, 4 << 20, &mut out, true).unwrap();
        assert!(out == lost);
        let stats = chain.stats();
        assert_eq!(stats.reads_tail_disk, 0, "{stats:?}");
        assert!(stats.reads_flash_cache >= 256, "{stats:?}");
        drop(chain);
        // The map saved before `lost`: the tail writes its positions again.
        sim.power_cut(1);
        let chain = Chain::open(sim.mount(), &options).unwrap();
        let new = vec![0x22u8; 2 << 20];
        write(&chain, 8 << 20, &new);
        chain.read(CHUNK, 8 << 20, &mut out, true).unwrap();
        assert!(out == new);
        chain.read(CHUNK, 4 << 20, &mut out, true).unwrap();
        assert!(out.iter().all(|&b| b == 0), "the lost write stays lost");
        let mut back = vec![0; old.len()];
        chain.read(CHUNK, 0, &mut back, true).unwrap();
        assert!(back == old);
    }

    /// Compaction writing into a hole the ring still holds: the ring must drop it,
    /// or reads of the moved block get the hole's old bytes. A 8 MiB ring holds every
    /// position of this run; A at the head, C's old copy a hole of the saved map.
    #[test]
    fn a_position_compaction_rewrites_leaves_the_ring() {
        let sim = SimDisk::new();
        let mut options = options(Layout::Chained);
        options.gc = Gc::CompactInBody;
        options.flash_cache_bytes = 8 << 20;
        let chain = Chain::open(sim.mount(), &options).unwrap();
        let a = vec![0xaau8; 1 << 20];
        write(&chain, 0, &a);
        write(&chain, 16 << 20, &[0xcc; 1 << 20]);
        write(&chain, 8 << 20, &[0xbb; 1 << 20]);
        write(&chain, 16 << 20, &[0xdd; 1 << 20]);
        chain.persist().unwrap();
        // Up to the cleaning mark (a disk and a segment free: the tail at 1280, on
        // disk 1), and one block past it: 2 of A's blocks compacted.
        write(&chain, 32 << 20, &[0xee; 1 << 20]);
        write(&chain, 48 << 20, &[0xff; 4096]);
        let stats = chain.stats();
        assert_eq!(stats.gc_compacted_blocks, 2, "{stats:?}");
        let mut out = vec![0; 1 << 20];
        chain.read(CHUNK, 0, &mut out, true).unwrap();
        assert!(out == a);
    }
}
