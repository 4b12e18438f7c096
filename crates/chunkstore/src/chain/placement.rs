//! Where a block of the log's circular address space lies: the chain's placement
//! (each disk a contiguous part, so the tail is on one disk at a time) or, for the
//! benchmark's baseline only, a log-structured RAID-0 (stripe units dealt round the
//! disks, so the tail, the head and every read touch all of them). The engine is
//! the same; only this mapping differs.

/// Blocks in a RAID-0 stripe unit (64 KiB).
const STRIPE_BLOCKS: u64 = 16;

/// How the log's blocks are laid over the disks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Layout {
    /// Gecko: disk 0 holds the first part of the log, disk 1 the next, ...
    #[default]
    Chained,
    /// The baseline of the thesis's experiment: the log striped over the disks.
    Striped,
}

impl Layout {
    /// The disk and the block within it of the log's `block` (`block < disks *
    /// blocks_per_disk`), and how many blocks from there on stay contiguous on it.
    pub(crate) fn place(self, block: u64, disks: u64, blocks_per_disk: u64) -> (usize, u64, u64) {
        assert!(block < disks * blocks_per_disk, "a block past the chain");
        match self {
            Layout::Chained => (
                (block / blocks_per_disk) as usize,
                block % blocks_per_disk,
                blocks_per_disk - block % blocks_per_disk,
            ),
            Layout::Striped => {
                let unit = block / STRIPE_BLOCKS;
                let within = block % STRIPE_BLOCKS;
                (
                    (unit % disks) as usize,
                    unit / disks * STRIPE_BLOCKS + within,
                    STRIPE_BLOCKS - within,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both layouts map the log one to one onto the disks' blocks.
    #[test]
    fn every_disk_block_is_used_once() {
        for layout in [Layout::Chained, Layout::Striped] {
            let (disks, per_disk) = (3, 4 * STRIPE_BLOCKS);
            let mut seen = vec![false; (disks * per_disk) as usize];
            for block in 0..disks * per_disk {
                let (disk, at, run) = layout.place(block, disks, per_disk);
                assert!(at < per_disk && run >= 1);
                let slot = &mut seen[disk * per_disk as usize + at as usize];
                assert!(!*slot, "{layout:?}: block {block} lands on a used one");
                *slot = true;
            }
        }
        assert_eq!(Layout::Striped.place(STRIPE_BLOCKS, 3, 64), (1, 0, 16));
        assert_eq!(Layout::Chained.place(70, 3, 64), (1, 6, 58));
    }
}
