//! GetCost (the thesis's hint for the replica choice of stale reads): what reading a
//! block would cost this chain now, cheapest first. A reader with several replicas
//! to choose from asks each and reads where it is cheapest; a block in a cache
//! costs no seek, one on an idle body disk one seek, one on the disk the cleaner is
//! reading competes with it, and one on the tail disk breaks its sequential writes.

use super::map::BlockKey;
use super::Chain;
use crate::block_sums::BLOCK_BYTES;
use floe_protocol::ChunkId;

pub use floe_protocol::ReadCost;

impl Chain {
    /// What reading the block holding byte `offset` of `chunk` costs now.
    pub(crate) fn read_cost(&self, chunk: ChunkId, offset: u64) -> ReadCost {
        let state = self.state.read().unwrap();
        let key = BlockKey {
            chunk,
            block: offset / BLOCK_BYTES,
        };
        let Some(slot) = state.maps.get(key) else {
            return ReadCost::Cache;
        };
        if state.cache.get(slot.position).is_some() || state.flash.holds(slot.position) {
            return ReadCost::Cache;
        }
        let disk = state.disks.place(slot.position).0;
        let cleaning = state.cleaning_due();
        let head = state.head_segment * super::disks::SEGMENT_BLOCKS;
        if disk == state.disks.place(state.tail).0 {
            ReadCost::TailDisk
        } else if cleaning && disk == state.disks.place(head).0 {
            ReadCost::BodyCleaning
        } else {
            ReadCost::BodyIdle
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::gc::tests::{options, write, CHUNK};
    use super::super::{Chain, Layout};
    use super::ReadCost;
    use crate::SimDisk;

    /// 3 x 3 MiB (768 blocks a disk), a RAM cache of one segment, no flash.
    #[test]
    fn costs_follow_the_cache_the_tail_and_the_cleaner() {
        let sim = SimDisk::new();
        let chain = Chain::open(sim.mount(), &options(Layout::Chained)).unwrap();
        assert_eq!(chain.read_cost(CHUNK, 0), ReadCost::Cache, "never written");
        // Positions 0-511, disk 0, the tail's; the RAM cache holds 256-511.
        write(&chain, 0, &vec![1u8; 2 << 20]);
        assert_eq!(chain.read_cost(CHUNK, 0), ReadCost::TailDisk);
        assert_eq!(chain.read_cost(CHUNK, (2 << 20) - 1), ReadCost::Cache);
        // 512-1023: the tail on disk 1.
        write(&chain, 8 << 20, &vec![2u8; 2 << 20]);
        assert_eq!(chain.read_cost(CHUNK, 0), ReadCost::BodyIdle);
        // 1024-1279, still on disk 1, up to the cleaning mark (a disk and a segment,
        // 1024 blocks, free): 768, on the tail's disk and out of the RAM cache, is a
        // seek of the tail's arm.
        write(&chain, 16 << 20, &[3u8; 1 << 20]);
        assert_eq!(chain.read_cost(CHUNK, 9 << 20), ReadCost::TailDisk);
        assert_eq!(chain.read_cost(CHUNK, 0), ReadCost::BodyIdle);
        // One block more: 1023 free, and the cleaner moves 2 blocks of the head.
        write(&chain, 32 << 20, &[4u8; 4096]);
        let stats = chain.stats();
        assert_eq!(stats.gc_moved_blocks, 2, "{stats:?}");
        assert_eq!(
            chain.read_cost(CHUNK, 0),
            ReadCost::Cache,
            "moved to the tail"
        );
        assert_eq!(chain.read_cost(CHUNK, 8 << 10), ReadCost::BodyCleaning);
    }
}
