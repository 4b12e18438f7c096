//! The order in which the log visits its slots: a deterministic permutation of
//! `[0, P)`, stored in O(1) space (Blizzard's linear congruential generator).
//!
//! An LCG `x -> (a x + c) mod m` with `m` a power of two, `c` odd and `a = 1 mod 4`
//! has full period `m` (Hull-Dobell). With `m` the least power of two `>= P`, values
//! `>= P` are walked past (cycle walking, fewer than two steps on average), so any `P`
//! consecutive positions visit every slot exactly once, and position `p + P` has the
//! slot of position `p`. The large multiplier scatters consecutive positions over the
//! volume's chunks, as nested striping would.

/// The permutation of `slots` slots.
#[derive(Debug, Clone, Copy)]
pub(super) struct Permutation {
    slots: u64,
    mask: u64,
    a: u64,
    c: u64,
}

/// A log position and the slot it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cursor {
    pub(super) position: u64,
    pub(super) slot: u64,
}

impl Permutation {
    pub(super) fn new(slots: u64) -> Permutation {
        assert!(slots > 0);
        let mask = slots.next_power_of_two().max(4) - 1;
        Permutation {
            slots,
            mask,
            // Knuth's MMIX multiplier and increment, cut to m, made 1 mod 4 and odd.
            a: (6364136223846793005 & mask & !3) | 1,
            c: (1442695040888963407 & mask) | 1,
        }
    }

    /// Position 0 writes slot 0.
    pub(super) fn start(&self) -> Cursor {
        Cursor {
            position: 0,
            slot: 0,
        }
    }

    /// The position after `cursor`.
    pub(super) fn next(&self, cursor: Cursor) -> Cursor {
        assert!(
            cursor.slot < self.slots,
            "slot {} of {}",
            cursor.slot,
            self.slots
        );
        let mut x = cursor.slot;
        loop {
            x = x.wrapping_mul(self.a).wrapping_add(self.c) & self.mask;
            if x < self.slots {
                return Cursor {
                    position: cursor.position + 1,
                    slot: x,
                };
            }
        }
    }

    /// `cursor` a whole cycle later: the same slot, `P` positions on.
    pub(super) fn cycle_later(&self, cursor: Cursor) -> Cursor {
        Cursor {
            position: cursor.position + self.slots,
            slot: cursor.slot,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn walk(permutation: &Permutation, from: Cursor, steps: u64) -> Vec<u64> {
        let mut cursor = from;
        let mut out = Vec::new();
        for _ in 0..steps {
            out.push(cursor.slot);
            cursor = permutation.next(cursor);
        }
        assert_eq!(cursor.position, from.position + steps);
        out
    }

    proptest! {
        /// Any P consecutive positions visit every slot once, and the walk repeats
        /// with period P.
        #[test]
        fn every_window_of_p_positions_is_a_bijection(slots in 1u64..5000, skip in 0u64..3000) {
            let permutation = Permutation::new(slots);
            let mut start = permutation.start();
            for _ in 0..skip {
                start = permutation.next(start);
            }
            let cycle = walk(&permutation, start, slots);
            let mut seen = vec![false; slots as usize];
            for &slot in &cycle {
                prop_assert!(slot < slots);
                prop_assert!(!seen[slot as usize], "slot {} twice", slot);
                seen[slot as usize] = true;
            }
            let mut after = start;
            for _ in 0..slots {
                after = permutation.next(after);
            }
            prop_assert_eq!(after, permutation.cycle_later(start));
        }
    }

    #[test]
    fn large_logs_are_bijections_too() {
        for slots in [294_912, 1 << 20, (1 << 20) + 1] {
            let permutation = Permutation::new(slots);
            let cycle = walk(&permutation, permutation.start(), slots);
            let mut sorted = cycle.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len() as u64, slots);
        }
    }

    #[test]
    fn consecutive_positions_scatter() {
        let permutation = Permutation::new(294_912);
        let cycle = walk(&permutation, permutation.start(), 1000);
        let adjacent = cycle
            .windows(2)
            .filter(|w| w[0].abs_diff(w[1]) < 16)
            .count();
        assert!(
            adjacent < 10,
            "{adjacent} of 1000 steps stay within 16 slots"
        );
    }
}
