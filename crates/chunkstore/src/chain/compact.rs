//! Compact-in-body cleaning (the thesis's alternative to move-to-tail): the head
//! segment's live blocks go to dead positions in the log's body instead of the tail,
//! so the tail disk writes only client data. The cleaner's walk over the head
//! ([`super::gc`]) is the same; only where a live block lands differs, and with no
//! hole left it goes to the tail as move-to-tail would.
//!
//! A hole is taken from the map as last saved, not the live one: a position dead
//! now but live in the saved map may still be read after a power cut (the saved map
//! points there and the log replays the later change on top, a partial one by
//! reading it), so it must keep its bytes until a save no longer names it. Holes
//! found at a save stay dead until filled: the tail writes only past itself, and
//! only this module writes into the body. They are used from the newest down (data
//! moved far from the head is not moved again soon), never on the tail's disk (its
//! arm stays on sequential writes) nor in the head segment being cleaned.

use super::disks::SEGMENT_BLOCKS;
use super::map::BlockKey;
use super::State;
use std::io;
use std::sync::atomic::Ordering::Relaxed;

/// How the cleaner frees the head segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Gc {
    /// Live blocks copied to the tail (the thesis's default).
    #[default]
    MoveToTail,
    /// Live blocks copied into dead positions of the body, the tail only when none.
    CompactInBody,
}

/// Holes kept at most, as a fraction (1/N) of the chain: a bound on the list's RAM
/// (8 bytes a hole) that still lets a save's worth of cleaning find room.
const HOLES_DIVISOR: u64 = 8;

/// Dead positions of the body as of the last map save, ascending.
#[derive(Default)]
pub(crate) struct Holes {
    positions: Vec<u64>,
}

impl State {
    /// Rebuilds the hole list from the map just saved (call right after a save):
    /// the body's dead positions past the head segment, up to the bound.
    pub(crate) fn find_holes(&mut self) {
        if self.gc != Gc::CompactInBody {
            return;
        }
        let holes_max = (self.disks.total_blocks() / HOLES_DIVISOR) as usize;
        let first = (self.head_segment + 1) * SEGMENT_BLOCKS;
        let mut positions: Vec<u64> = (first..self.tail)
            .rev()
            .filter(|&p| self.maps.at(p).is_none())
            .take(holes_max)
            .collect();
        positions.reverse();
        self.holes.positions = positions;
    }

    /// Puts a live block the cleaner moves in a hole of the body; `false` when
    /// there is none to take (the caller appends it at the tail).
    pub(crate) fn compact(&mut self, key: BlockKey, block: &[u8], crc: u32) -> io::Result<bool> {
        let tail_disk = self.disks.place(self.tail).0;
        let Some(position) = self.take_hole(tail_disk) else {
            return Ok(false);
        };
        assert!(
            self.maps.at(position).is_none(),
            "a hole of the saved map was filled behind the cleaner"
        );
        self.disks.write(position, block)?;
        // The caches hold the position's old (dead) bytes if it is recent, and so
        // may the head the cleaner read ahead.
        self.cache.forget(position);
        self.flash.forget(position);
        self.patch_read_ahead(position, block);
        self.maps.set(key, super::map::Slot { position, crc });
        self.counters.gc_compacted_blocks.fetch_add(1, Relaxed);
        Ok(true)
    }

    /// The newest hole past the head segment and off the tail's disk; holes now in
    /// or behind the head segment are dropped.
    fn take_hole(&mut self, tail_disk: usize) -> Option<u64> {
        let body_start = (self.head_segment + 1) * SEGMENT_BLOCKS;
        let positions = &mut self.holes.positions;
        let first = positions.partition_point(|&p| p < body_start);
        positions.drain(..first);
        let at = positions
            .iter()
            .rposition(|&p| self.disks.place(p).0 != tail_disk)?;
        Some(positions.remove(at))
    }
}

#[cfg(test)]
mod tests {
    use super::super::gc::tests::{options, write, CHUNK};
    use super::super::{Chain, Layout};
    use super::Gc;
    use crate::SimDisk;

    /// Cold data at the head, then 3x the chain written as random 16 KiB overwrites
    /// of 3 hot MiB: compacting keeps every block, reclaims the space, and puts most
    /// moved blocks in holes of the body rather than at the tail (holes show up only
    /// at a map save, and only off the tail's disk).
    #[test]
    fn compacting_keeps_the_data_and_spares_the_tail() {
        const HOT_BYTES: u64 = 3 << 20;
        const PIECE_BYTES: u64 = 16 << 10;
        let sim = SimDisk::new();
        let mut options = options(Layout::Chained);
        options.gc = Gc::CompactInBody;
        let chain = Chain::open(sim.mount(), &options).unwrap();
        let cold: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        write(&chain, 8 << 20, &cold);
        let mut hot = vec![0u8; HOT_BYTES as usize];
        let mut seed = 7u64;
        for round in 0..27 * (1 << 20) / PIECE_BYTES {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let at = (seed >> 33) % (HOT_BYTES / PIECE_BYTES) * PIECE_BYTES;
            let piece = &mut hot[at as usize..(at + PIECE_BYTES) as usize];
            piece.fill(round as u8);
            write(&chain, at, piece);
        }
        let stats = chain.stats();
        assert!(stats.gc_freed_segments >= 18, "{stats:?}");
        assert!(
            stats.gc_compacted_blocks > stats.gc_moved_blocks,
            "the moved blocks went to the body: {stats:?}"
        );
        let check = |chain: &Chain| {
            let mut out = vec![0; cold.len()];
            chain.read(CHUNK, 8 << 20, &mut out, true).unwrap();
            assert!(out == cold);
            let mut out = vec![0; hot.len()];
            chain.read(CHUNK, 0, &mut out, true).unwrap();
            assert!(out == hot);
        };
        check(&chain);
        chain.persist().unwrap();
        drop(chain);
        sim.power_cut(5);
        check(&Chain::open(sim.mount(), &options).unwrap());
    }

    /// The saved map's blocks keep their bytes until the next save, holes or not: C
    /// is overwritten after a save, so its old positions are dead but still where
    /// the saved map points; the cleaner compacting the head into them before the
    /// next save would leave a crash (every write kept) reading another block there.
    #[test]
    fn holes_are_dead_in_the_saved_map() {
        let sim = SimDisk::new();
        let mut options = options(Layout::Chained);
        options.gc = Gc::CompactInBody;
        let chain = Chain::open(sim.mount(), &options).unwrap();
        let (a, c) = (vec![0xaau8; 1 << 20], vec![0xccu8; 1 << 20]);
        // Segments 0, 1, 2 on disk 0: A at the head, then C, then B.
        write(&chain, 0, &a);
        write(&chain, 16 << 20, &c);
        write(&chain, 8 << 20, &[0xbb; 1 << 20]);
        chain.persist().unwrap();
        // C again (segment 3, disk 1), then up to the cleaning mark (a disk and a
        // segment, 1024 of 2304, free), and one block past it: the cleaner takes 2
        // of A's blocks.
        write(&chain, 16 << 20, &[0xdd; 1 << 20]);
        write(&chain, 32 << 20, &[0xee; 1 << 20]);
        write(&chain, 48 << 20, &[0xff; 4096]);
        let stats = chain.stats();
        assert_eq!(
            stats.gc_moved_blocks + stats.gc_compacted_blocks,
            2,
            "{stats:?}"
        );
        assert_eq!(stats.map_saves, 1, "{stats:?}");
        drop(chain);
        sim.crash();
        let chain = Chain::open(sim.mount(), &options).unwrap();
        let mut out = vec![0; 1 << 20];
        chain.read(CHUNK, 16 << 20, &mut out, true).unwrap();
        assert!(out == c, "C as saved");
        chain.read(CHUNK, 0, &mut out, true).unwrap();
        assert!(out == a);
    }
}
