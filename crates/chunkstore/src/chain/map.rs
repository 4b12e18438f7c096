//! The chain's maps: forward (chunk block -> position and checksum, in memory) and
//! inverse (position -> chunk block, what the cleaner and recovery read). The
//! inverse map holds live blocks only: an overwrite, a zero or a volume delete
//! clears the old position's entry, so rebuilding the forward map from the inverse
//! one (recovery, [`crate::chain::pages`]) never resurrects a dead block.

use floe_protocol::ChunkId;
use std::collections::{BTreeMap, BTreeSet};

/// A chunk's 4 KiB block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct BlockKey {
    pub(crate) chunk: ChunkId,
    pub(crate) block: u64,
}

/// Where a block lives and the crc32c its data must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub(crate) position: u64,
    pub(crate) crc: u32,
}

pub(crate) struct Maps {
    forward: BTreeMap<ChunkId, BTreeMap<u64, Slot>>,
    /// Indexed by `position % total_blocks`: the live block there and its crc.
    inverse: Vec<Option<(BlockKey, u32)>>,
    /// Chunks written or zeroed and not deleted (a chunk zeroed whole still exists).
    pub(crate) chunks: BTreeSet<ChunkId>,
    live_blocks: u64,
}

impl Maps {
    pub(crate) fn new(total_blocks: u64) -> Maps {
        Maps {
            forward: BTreeMap::new(),
            inverse: vec![None; total_blocks as usize],
            chunks: BTreeSet::new(),
            live_blocks: 0,
        }
    }

    fn index(&self, position: u64) -> usize {
        (position % self.inverse.len() as u64) as usize
    }

    pub(crate) fn get(&self, key: BlockKey) -> Option<Slot> {
        self.forward.get(&key.chunk)?.get(&key.block).copied()
    }

    /// The live block at `position`, if any.
    pub(crate) fn at(&self, position: u64) -> Option<(BlockKey, u32)> {
        let (key, crc) = self.inverse[self.index(position)]?;
        let slot = self.get(key).expect("an inverse entry has a forward one");
        (slot.position == position).then_some((key, crc))
    }

    /// Points `key` at `slot`, freeing its old position.
    pub(crate) fn set(&mut self, key: BlockKey, slot: Slot) {
        let at = self.index(slot.position);
        assert!(
            self.inverse[at].is_none(),
            "position {} is overwritten while live",
            slot.position
        );
        self.chunks.insert(key.chunk);
        let old = self
            .forward
            .entry(key.chunk)
            .or_default()
            .insert(key.block, slot);
        match old {
            Some(old) => self.clear(old.position),
            None => self.live_blocks += 1,
        }
        self.inverse[at] = Some((key, slot.crc));
    }

    /// Drops `key` (a zeroed block): it reads as zeroes.
    pub(crate) fn remove(&mut self, key: BlockKey) {
        self.chunks.insert(key.chunk);
        let old = self
            .forward
            .get_mut(&key.chunk)
            .and_then(|blocks| blocks.remove(&key.block));
        if let Some(old) = old {
            self.clear(old.position);
            self.live_blocks -= 1;
        }
    }

    /// Marks a chunk as existing without data (a zero of nothing stored).
    pub(crate) fn touch(&mut self, chunk: ChunkId) {
        self.chunks.insert(chunk);
    }

    pub(crate) fn delete_volume(&mut self, volume_id: u64) {
        let chunks: Vec<ChunkId> = self
            .chunks
            .iter()
            .filter(|c| c.volume_id == volume_id)
            .copied()
            .collect();
        for chunk in chunks {
            self.chunks.remove(&chunk);
            for (_, slot) in self.forward.remove(&chunk).unwrap_or_default() {
                self.clear(slot.position);
                self.live_blocks -= 1;
            }
        }
    }

    fn clear(&mut self, position: u64) {
        let at = self.index(position);
        assert!(
            self.inverse[at].is_some(),
            "a live block has an inverse entry"
        );
        self.inverse[at] = None;
    }

    /// The chunk's blocks in order.
    pub(crate) fn blocks(&self, chunk: ChunkId) -> impl Iterator<Item = (&u64, &Slot)> {
        self.forward.get(&chunk).into_iter().flatten()
    }

    pub(crate) fn live_blocks(&self) -> u64 {
        self.live_blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: ChunkId = ChunkId {
        volume_id: 7,
        index: 1,
    };

    fn slot(position: u64, crc: u32) -> Slot {
        Slot { position, crc }
    }

    fn key(block: u64) -> BlockKey {
        BlockKey {
            chunk: CHUNK,
            block,
        }
    }

    #[test]
    fn an_overwrite_frees_the_old_position() {
        let mut maps = Maps::new(16);
        maps.set(key(3), slot(0, 1));
        maps.set(key(3), slot(1, 2));
        assert_eq!(maps.at(0), None);
        assert_eq!(maps.at(1), Some((key(3), 2)));
        assert_eq!(maps.live_blocks(), 1);
        // The freed position may be reused once the log wraps.
        maps.set(key(4), slot(16, 3));
        assert_eq!(maps.at(16), Some((key(4), 3)));
    }

    #[test]
    fn zeroes_and_deletes_leave_no_inverse_entry() {
        let mut maps = Maps::new(16);
        maps.set(key(0), slot(0, 1));
        maps.set(key(1), slot(1, 1));
        maps.remove(key(0));
        assert_eq!(maps.at(0), None);
        assert!(maps.chunks.contains(&CHUNK));
        maps.delete_volume(7);
        assert_eq!(maps.at(1), None);
        assert_eq!(maps.live_blocks(), 0);
        assert!(maps.chunks.is_empty());
    }

    #[test]
    #[should_panic(expected = "overwritten while live")]
    fn writing_over_a_live_position_is_a_bug() {
        let mut maps = Maps::new(4);
        maps.set(key(0), slot(0, 1));
        maps.set(key(1), slot(4, 1));
    }
}
