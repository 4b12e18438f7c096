//! The set of 4 KiB blocks of a delta chunk that hold preserved data.

use floe_protocol::snapshot::SNAPSHOT_BLOCK_BYTES;

#[derive(Debug, Default, Clone)]
pub struct Blocks {
    words: Vec<u64>,
}

impl Blocks {
    /// From a chunk's extents (offset, length): every block they touch (blocks are
    /// only ever preserved whole).
    pub fn from_extents(extents: &[(u64, u64)]) -> Blocks {
        let mut blocks = Blocks::default();
        for &(offset, length) in extents {
            let end = (offset + length).div_ceil(SNAPSHOT_BLOCK_BYTES);
            blocks.insert(offset / SNAPSHOT_BLOCK_BYTES..end);
        }
        blocks
    }

    pub fn contains(&self, block: u64) -> bool {
        let word = (block / 64) as usize;
        self.words
            .get(word)
            .is_some_and(|w| w & (1 << (block % 64)) != 0)
    }

    pub fn insert(&mut self, blocks: std::ops::Range<u64>) {
        for block in blocks {
            let word = (block / 64) as usize;
            if word >= self.words.len() {
                self.words.resize(word + 1, 0);
            }
            self.words[word] |= 1 << (block % 64);
        }
    }

    pub fn remove(&mut self, blocks: std::ops::Range<u64>) {
        for block in blocks {
            if let Some(word) = self.words.get_mut((block / 64) as usize) {
                *word &= !(1 << (block % 64));
            }
        }
    }

    /// Adds every block of `other`.
    pub fn extend(&mut self, other: &Blocks) {
        if other.words.len() > self.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (word, theirs) in self.words.iter_mut().zip(&other.words) {
            *word |= theirs;
        }
    }

    /// The runs of blocks in the set, in order.
    pub fn runs(&self) -> impl Iterator<Item = std::ops::Range<u64>> + '_ {
        let mut runs: Vec<std::ops::Range<u64>> = Vec::new();
        let blocks = (0..self.words.len() as u64 * 64).filter(|b| self.contains(*b));
        for block in blocks {
            match runs.last_mut() {
                Some(run) if run.end == block => run.end += 1,
                _ => runs.push(block..block + 1),
            }
        }
        runs.into_iter()
    }

    /// The runs of blocks in `range` not in the set.
    pub fn missing(&self, range: std::ops::Range<u64>) -> Vec<std::ops::Range<u64>> {
        let mut runs: Vec<std::ops::Range<u64>> = Vec::new();
        for block in range.filter(|b| !self.contains(*b)) {
            match runs.last_mut() {
                Some(run) if run.end == block => run.end += 1,
                _ => runs.push(block..block + 1),
            }
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_mark_the_blocks_they_touch_and_missing_runs_are_the_rest() {
        let b = SNAPSHOT_BLOCK_BYTES;
        let blocks = Blocks::from_extents(&[(b, 2 * b), (70 * b, 1)]);
        assert!(!blocks.contains(0) && blocks.contains(1) && blocks.contains(2));
        assert!(blocks.contains(70) && !blocks.contains(71) && !blocks.contains(1000));
        assert_eq!(blocks.missing(0..5), vec![0..1, 3..5]);
        assert_eq!(blocks.missing(1..3), Vec::<std::ops::Range<u64>>::new());
        let mut more = Blocks::from_extents(&[(3 * b, b)]);
        more.extend(&blocks);
        assert_eq!(more.runs().collect::<Vec<_>>(), vec![1..4, 70..71]);
        more.remove(2..3);
        assert_eq!(more.runs().collect::<Vec<_>>(), vec![1..2, 3..4, 70..71]);
    }
}
