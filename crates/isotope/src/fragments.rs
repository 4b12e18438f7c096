//! Which 16-byte fragments of a 4 KiB block a transaction touched (thesis 4.2: a
//! 256-bit map per block, kept in memory only, for the life of the transaction).

use crate::BLOCK_BYTES;

/// Conflict detection's grain: two transactions touching different fragments of one
/// block do not conflict.
pub const FRAGMENT_BYTES: usize = 16;
const WORDS: usize = BLOCK_BYTES / FRAGMENT_BYTES / 64;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fragments([u64; WORDS]);

impl Fragments {
    pub const ALL: Fragments = Fragments([u64::MAX; WORDS]);

    /// The fragments that `[offset, offset + length)` of a block touches; the caller
    /// checked that the range lies inside the block and is not empty.
    pub fn covering(offset: usize, length: usize) -> Fragments {
        assert!(
            length > 0 && offset + length <= BLOCK_BYTES,
            "range checked"
        );
        let mut out = Fragments::default();
        for fragment in offset / FRAGMENT_BYTES..=(offset + length - 1) / FRAGMENT_BYTES {
            out.0[fragment / 64] |= 1 << (fragment % 64);
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }

    pub fn add(&mut self, other: Fragments) {
        for (w, o) in self.0.iter_mut().zip(other.0) {
            *w |= o;
        }
    }

    pub fn overlaps(&self, other: &Fragments) -> bool {
        self.0.iter().zip(other.0).any(|(w, o)| w & o != 0)
    }

    /// Copies the fragments of `from` this set holds over `into`.
    pub fn overlay(&self, from: &[u8], into: &mut [u8]) {
        for fragment in 0..BLOCK_BYTES / FRAGMENT_BYTES {
            if self.0[fragment / 64] & (1 << (fragment % 64)) != 0 {
                let at = fragment * FRAGMENT_BYTES;
                into[at..at + FRAGMENT_BYTES].copy_from_slice(&from[at..at + FRAGMENT_BYTES]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_covers_the_fragments_it_touches() {
        let a = Fragments::covering(0, 16);
        let b = Fragments::covering(16, 16);
        let c = Fragments::covering(15, 2);
        assert!(!a.overlaps(&b));
        assert!(c.overlaps(&a) && c.overlaps(&b));
        assert!(Fragments::covering(4080, 16).overlaps(&Fragments::ALL));
        assert!(!Fragments::covering(4080, 16).overlaps(&a));
    }

    #[test]
    fn overlay_copies_only_the_marked_fragments() {
        let from = vec![1u8; BLOCK_BYTES];
        let mut into = vec![0u8; BLOCK_BYTES];
        Fragments::covering(32, 1).overlay(&from, &mut into);
        assert_eq!(into.iter().filter(|b| **b == 1).count(), FRAGMENT_BYTES);
        assert_eq!(into[32..48], [1; 16]);
    }
}
