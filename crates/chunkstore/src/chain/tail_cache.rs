//! The tail cache: the blocks written last, kept in RAM so reads of recent data do
//! not seek the tail disk away from its sequential writes (the thesis's tail cache).
//! Keyed by log position, evicted oldest first: a position is written once per lap
//! of the log by the tail (compact-in-body, which writes behind it, drops the
//! position first), so an entry never goes stale while it is in the cache's window.

use super::disks::SEGMENT_BLOCKS;
use crate::block_sums::BLOCK_BYTES;
use std::collections::{BTreeMap, VecDeque};

pub(crate) struct TailCache {
    blocks: BTreeMap<u64, Box<[u8]>>,
    order: VecDeque<u64>,
    blocks_max: usize,
}

impl TailCache {
    /// A cache of `bytes`, at least a segment (what a flush may leave unwritten).
    pub(crate) fn new(bytes: u64) -> TailCache {
        TailCache {
            blocks: BTreeMap::new(),
            order: VecDeque::new(),
            blocks_max: (bytes / BLOCK_BYTES).max(SEGMENT_BLOCKS) as usize,
        }
    }

    pub(crate) fn insert(&mut self, position: u64, block: &[u8]) {
        assert!(
            self.order.back().is_none_or(|&last| last < position),
            "the tail only moves forward"
        );
        if self.order.len() == self.blocks_max {
            let oldest = self.order.pop_front().expect("a full cache has blocks");
            self.blocks.remove(&oldest);
        }
        self.order.push_back(position);
        self.blocks.insert(position, block.into());
    }

    /// Drops a position's bytes: compact-in-body rewrote it behind the tail. Its
    /// place in the eviction order stays until it comes up (the bound holds).
    pub(crate) fn forget(&mut self, position: u64) {
        self.blocks.remove(&position);
    }

    pub(crate) fn get(&self, position: u64) -> Option<&[u8]> {
        self.blocks.get(&position).map(|b| &b[..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_blocks_leave_first() {
        let mut cache = TailCache::new(0);
        let block = vec![7u8; BLOCK_BYTES as usize];
        for position in 0..SEGMENT_BLOCKS + 2 {
            cache.insert(position, &block);
        }
        assert!(cache.get(0).is_none() && cache.get(1).is_none());
        assert_eq!(cache.get(2), Some(&block[..]));
        assert_eq!(cache.get(SEGMENT_BLOCKS + 1), Some(&block[..]));
    }
}
