//! The conflict window (thesis 4.2.1): the transactions committed since the oldest
//! open transaction began, newest last, with what each wrote (at fragment grain) and
//! each written block's contents just before and just after it (so a transaction that
//! began earlier still reads its snapshot once the block is overwritten in place, and a
//! commit merges onto the newest contents without reading them back).

use crate::fragments::Fragments;
use bytes::Bytes;
use std::collections::{BTreeMap, VecDeque};

pub struct Written {
    pub fragments: Fragments,
    /// The block as of the version before this one.
    pub before: Bytes,
    /// The block as of this version (shares its bytes with the next commit's
    /// `before`).
    pub after: Bytes,
}

pub struct Committed {
    pub version: u64,
    pub blocks: BTreeMap<u64, Written>,
}

#[derive(Default)]
pub struct Window {
    committed: VecDeque<Committed>,
    /// Before-images held, over all of `committed`.
    blocks: usize,
}

impl Window {
    pub fn push(&mut self, committed: Committed) {
        if let Some(last) = self.committed.back() {
            assert!(
                committed.version > last.version,
                "commit versions go backwards: {} after {}",
                committed.version,
                last.version
            );
        }
        self.blocks += committed.blocks.len();
        self.committed.push_back(committed);
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// The lowest version such that the commits after it hold at most `blocks_max`
    /// before-images.
    pub fn floor_for(&self, blocks_max: usize) -> u64 {
        let mut held = 0;
        for c in self.committed.iter().rev() {
            held += c.blocks.len();
            if held > blocks_max {
                return c.version;
            }
        }
        0
    }

    /// Whether a transaction committed after `start` wrote a fragment of `touched`.
    pub fn conflicts(&self, start: u64, touched: &BTreeMap<u64, Fragments>) -> bool {
        self.after(start).any(|c| {
            c.blocks.iter().any(|(block, written)| {
                touched
                    .get(block)
                    .is_some_and(|f| f.overlaps(&written.fragments))
            })
        })
    }

    /// `block` as of version `start`, if a later transaction overwrote it (else the
    /// block in place is that).
    pub fn as_of(&self, start: u64, block: u64) -> Option<Bytes> {
        self.after(start)
            .find_map(|c| c.blocks.get(&block).map(|w| w.before.clone()))
    }

    /// `block` as of the newest commit here that wrote it, if any did (else the block
    /// in place is older than every commit here).
    pub fn newest(&self, block: u64) -> Option<Bytes> {
        let mut newest_first = self.committed.iter().rev();
        newest_first.find_map(|c| c.blocks.get(&block).map(|w| w.after.clone()))
    }

    /// Forgets what no open transaction can read or conflict with: the versions at or
    /// below the oldest open one's start (every version, when none is open).
    pub fn prune(&mut self, oldest_start: Option<u64>) {
        while let Some(first) = self.committed.front() {
            match oldest_start {
                Some(start) if first.version > start => break,
                _ => {
                    self.blocks -= first.blocks.len();
                    self.committed.pop_front();
                }
            };
        }
    }

    fn after(&self, start: u64) -> impl Iterator<Item = &Committed> {
        self.committed.iter().filter(move |c| c.version > start)
    }
}
