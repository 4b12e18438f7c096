//! Per-chunk journal index (URSA, EuroSys'19, §3.3): maps ranges of a chunk to the
//! journal positions holding their newest data, so a backup can read the newest
//! bytes of a range (journal pieces plus holes served by the chunk file) and a large
//! write that bypasses the journal can invalidate the stale journal appends it covers.
//!
//! All quantities are in *sectors*; the caller picks the sector size (512 B or 4 KiB)
//! and the index never sees bytes.
//!
//! Keys are composite `{offset, length}` ranges mapped to the journal position of
//! their first sector. Live entries never overlap, so ordering them by offset is a
//! total order and a range query is one `O(log n)` search followed by a scan.
//!
//! Storage is two-level, as in the paper: new entries go into a small write-optimised
//! `BTreeSet` (first level), which [`JournalIndex::merge`] folds into a compact sorted
//! array (second level); a merge also runs automatically once the first level holds
//! more than [`JournalIndex::with_merge_threshold`] entries. Unlike the paper, an
//! insert erases what it overlaps in *both* levels at once (array entries are trimmed
//! in place or tombstoned), so the levels are always disjoint: queries and merges are
//! plain two-way merges with no shadowing rules.
//!
//! # Packing
//!
//! Every entry, in both levels, is one `u64`:
//!
//! ```text
//! bits 63..43  offset      21 bits  first chunk sector
//! bits 42..32  length - 1  11 bits  1..=2048 sectors
//! bits 31..0   journal     32 bits  journal sector of the first chunk sector
//! ```
//!
//! The offset is in the top bits, so ordering packed entries as integers orders them
//! by offset. Limits:
//! - chunk size up to 2^21 sectors ([`MAX_CHUNK_SECTORS`]): 1 GiB at 512 B sectors,
//!   8 GiB at 4 KiB;
//! - journal positions below 2^32 - 1 sectors ([`JOURNAL_SECTORS`]): 2 TiB at 512 B,
//!   16 TiB at 4 KiB; the all-ones position marks an erased array entry;
//! - an entry covers at most 2048 sectors ([`MAX_ENTRY_SECTORS`]): 1 MiB at 512 B,
//!   8 MiB at 4 KiB; longer inserts are stored as several entries. Writes that large
//!   normally bypass the journal anyway (URSA's threshold is 64 KiB).
//!
//! Ranges outside these limits are rejected with an [`IndexError`].

use std::collections::BTreeSet;

const OFFSET_BITS: u32 = 21;
const LEN_BITS: u32 = 11;
const JOURNAL_BITS: u32 = 32;
const LEN_SHIFT: u32 = JOURNAL_BITS;
const OFFSET_SHIFT: u32 = JOURNAL_BITS + LEN_BITS;
const JOURNAL_MASK: u64 = (1 << JOURNAL_BITS) - 1;
const LEN_MASK: u64 = (1 << LEN_BITS) - 1;
/// Journal field of an array entry erased by a later insert; dropped by the next merge.
const TOMBSTONE: u64 = JOURNAL_MASK;

/// Largest chunk the index can describe, in sectors.
pub const MAX_CHUNK_SECTORS: u64 = 1 << OFFSET_BITS;
/// Journal positions must lie below this, in sectors (the top value is the tombstone).
pub const JOURNAL_SECTORS: u64 = TOMBSTONE;
/// Longest range one packed entry covers, in sectors.
pub const MAX_ENTRY_SECTORS: u64 = 1 << LEN_BITS;
/// Default first-level size that triggers an automatic merge.
pub const DEFAULT_MERGE_THRESHOLD: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    #[error("chunk of {0} sectors exceeds the index limit of {MAX_CHUNK_SECTORS}")]
    ChunkTooLarge(u64),
    #[error("range {offset}+{len} ends past the chunk end {chunk_sectors}")]
    OutOfChunk {
        offset: u64,
        len: u64,
        chunk_sectors: u64,
    },
    #[error("journal range {journal}+{len} ends past the index limit {JOURNAL_SECTORS}")]
    JournalTooFar { journal: u64, len: u64 },
}

/// One piece of a range query, in chunk order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// `len` sectors at chunk `offset` are in the journal from sector `journal` on.
    Journal { offset: u64, len: u64, journal: u64 },
    /// `len` sectors at chunk `offset` are not in the journal: read the chunk file.
    Hole { offset: u64, len: u64 },
}

/// An unpacked entry: chunk sectors `[offset, offset + len)` start at `journal`.
#[derive(Debug, Clone, Copy)]
struct Entry {
    offset: u64,
    len: u64,
    journal: u64,
}

impl Entry {
    fn end(&self) -> u64 {
        self.offset + self.len
    }

    /// Packs an entry that is already within the limits (checked on insert).
    fn pack(&self) -> u64 {
        debug_assert!(self.len >= 1 && self.len <= MAX_ENTRY_SECTORS);
        debug_assert!(self.end() <= MAX_CHUNK_SECTORS && self.journal < TOMBSTONE);
        (self.offset << OFFSET_SHIFT) | ((self.len - 1) << LEN_SHIFT) | self.journal
    }

    fn unpack(v: u64) -> Self {
        Entry {
            offset: v >> OFFSET_SHIFT,
            len: ((v >> LEN_SHIFT) & LEN_MASK) + 1,
            journal: v & JOURNAL_MASK,
        }
    }

    /// The part of this entry inside `[from, to)`; the caller ensures they intersect.
    fn clip(&self, from: u64, to: u64) -> Entry {
        let start = self.offset.max(from);
        Entry {
            offset: start,
            len: self.end().min(to) - start,
            journal: self.journal + (start - self.offset),
        }
    }
}

fn is_tombstone(v: u64) -> bool {
    v & JOURNAL_MASK == TOMBSTONE
}

/// Appends `v` to a sorted run, extending the last entry instead if `v` continues it
/// both in the chunk and in the journal and the sum still fits one entry.
fn push_joined(run: &mut Vec<u64>, v: u64) {
    let e = Entry::unpack(v);
    if let Some(last) = run.last_mut() {
        let l = Entry::unpack(*last);
        if l.end() == e.offset
            && l.journal + l.len == e.journal
            && l.len + e.len <= MAX_ENTRY_SECTORS
        {
            *last = Entry {
                len: l.len + e.len,
                ..l
            }
            .pack();
            return;
        }
    }
    run.push(v);
}

/// Smallest packed value with the given offset: the search key for "offset >= o".
/// Only for offsets below [`MAX_CHUNK_SECTORS`]; range ends use [`offset_of`] instead.
fn key(offset: u64) -> u64 {
    debug_assert!(offset < MAX_CHUNK_SECTORS);
    offset << OFFSET_SHIFT
}

fn offset_of(v: u64) -> u64 {
    v >> OFFSET_SHIFT
}

/// The journal index of one chunk.
#[derive(Debug, Clone)]
pub struct JournalIndex {
    chunk_sectors: u64,
    merge_threshold: usize,
    /// First level: recent entries, cheap to insert into and erase from.
    tree: BTreeSet<u64>,
    /// Second level: sorted by offset (tombstones included), disjoint from `tree`.
    array: Vec<u64>,
}

impl JournalIndex {
    /// An empty index for a chunk of `chunk_sectors` sectors.
    pub fn new(chunk_sectors: u64) -> Result<Self, IndexError> {
        if chunk_sectors > MAX_CHUNK_SECTORS {
            return Err(IndexError::ChunkTooLarge(chunk_sectors));
        }
        Ok(JournalIndex {
            chunk_sectors,
            merge_threshold: DEFAULT_MERGE_THRESHOLD,
            tree: BTreeSet::new(),
            array: Vec::new(),
        })
    }

    /// Merges automatically once the first level holds more than `threshold` entries.
    pub fn with_merge_threshold(mut self, threshold: usize) -> Self {
        self.merge_threshold = threshold;
        self
    }

    /// Entries in the first level.
    pub fn tree_len(&self) -> usize {
        self.tree.len()
    }

    /// Slots in the second level, erased ones included until the next merge.
    pub fn array_len(&self) -> usize {
        self.array.len()
    }

    /// Records that chunk sectors `[offset, offset + len)` now live in the journal from
    /// sector `journal` on, erasing whatever the index held for them.
    pub fn insert(&mut self, offset: u64, len: u64, journal: u64) -> Result<(), IndexError> {
        let end = self.check_range(offset, len)?;
        if journal
            .checked_add(len)
            .is_none_or(|end| end > JOURNAL_SECTORS)
        {
            return Err(IndexError::JournalTooFar { journal, len });
        }
        if len == 0 {
            return Ok(());
        }
        self.erase(offset, end);
        let mut done = 0;
        while done < len {
            let piece = (len - done).min(MAX_ENTRY_SECTORS);
            let entry = Entry {
                offset: offset + done,
                len: piece,
                journal: journal + done,
            };
            self.tree.insert(entry.pack());
            done += piece;
        }
        if self.tree.len() > self.merge_threshold {
            self.merge();
        }
        Ok(())
    }

    /// Removes `[offset, offset + len)` from the index, e.g. after a write that
    /// bypassed the journal or after the range was replayed to the chunk file.
    pub fn remove(&mut self, offset: u64, len: u64) -> Result<(), IndexError> {
        let end = self.check_range(offset, len)?;
        self.erase(offset, end);
        Ok(())
    }

    /// The end of `[offset, offset + len)` if the range lies within the chunk.
    fn check_range(&self, offset: u64, len: u64) -> Result<u64, IndexError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.chunk_sectors => Ok(end),
            _ => Err(IndexError::OutOfChunk {
                offset,
                len,
                chunk_sectors: self.chunk_sectors,
            }),
        }
    }

    /// Erases `[from, to)` from both levels, trimming or splitting partial overlaps.
    fn erase(&mut self, from: u64, to: u64) {
        if from == to {
            return;
        }
        // First level: only the predecessor of `from` can overlap it from the left.
        let mut hit: Vec<u64> = self
            .tree
            .range(..key(from))
            .next_back()
            .copied()
            .filter(|&v| Entry::unpack(v).end() > from)
            .into_iter()
            .collect();
        hit.extend(
            self.tree
                .range(key(from)..)
                .take_while(|&&v| offset_of(v) < to),
        );
        for v in hit {
            self.tree.remove(&v);
            self.keep_outside(Entry::unpack(v), from, to);
        }

        // Second level: trim in place or tombstone, so no element moves; the left part
        // keeps the slot, a right part that would need a new slot goes to the tree.
        let mut i = self
            .array
            .partition_point(|&v| v < key(from))
            .saturating_sub(1);
        while let Some(&v) = self.array.get(i) {
            let e = Entry::unpack(v);
            if e.offset >= to {
                break;
            }
            if !is_tombstone(v) && e.end() > from {
                let left = e.offset < from;
                self.array[i] = if left {
                    Entry {
                        len: from - e.offset,
                        ..e
                    }
                    .pack()
                } else {
                    key(e.offset) | TOMBSTONE
                };
                if e.end() > to {
                    let right = e.clip(to, e.end());
                    if left {
                        self.tree.insert(right.pack());
                    } else {
                        // The slot is free: its offset only grows, which keeps the order.
                        self.array[i] = right.pack();
                    }
                }
            }
            i += 1;
        }
    }

    /// Puts back into the first level the parts of `e` outside `[from, to)`.
    fn keep_outside(&mut self, e: Entry, from: u64, to: u64) {
        if e.offset < from {
            self.tree.insert(e.clip(e.offset, from).pack());
        }
        if e.end() > to {
            self.tree.insert(e.clip(to, e.end()).pack());
        }
    }

    /// Folds the first level into the array, drops erased array slots and joins
    /// neighbours that continue each other in the journal (sequential writes). `O(n)`;
    /// run it when convenient (idle time), or let inserts run it past the threshold.
    pub fn merge(&mut self) {
        let mut merged = Vec::with_capacity(self.array.len() + self.tree.len());
        let mut tree = std::mem::take(&mut self.tree).into_iter().peekable();
        for &v in self.array.iter().filter(|&&v| !is_tombstone(v)) {
            while let Some(t) = tree.next_if(|&t| t < v) {
                push_joined(&mut merged, t);
            }
            push_joined(&mut merged, v);
        }
        for t in tree {
            push_joined(&mut merged, t);
        }
        self.array = merged;
    }

    /// The pieces of `[offset, offset + len)`, in chunk order: journal ranges to read
    /// and holes to read from the chunk file. Together they cover the range exactly.
    pub fn query(&self, offset: u64, len: u64) -> Result<Vec<Piece>, IndexError> {
        let end = self.check_range(offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let overlaps = |v: &u64| Entry::unpack(*v).end() > offset;
        let tree = self
            .tree
            .range(..key(offset))
            .next_back()
            .filter(|v| overlaps(v))
            .into_iter()
            .chain(
                self.tree
                    .range(key(offset)..)
                    .take_while(|&&v| offset_of(v) < end),
            )
            .copied();
        let start = self
            .array
            .partition_point(|&v| v < key(offset))
            .saturating_sub(1);
        let array = self.array[start..]
            .iter()
            .copied()
            .take_while(|&v| offset_of(v) < end)
            .filter(|&v| !is_tombstone(v) && overlaps(&v));

        // The levels are disjoint, so a two-way merge by offset gives chunk order.
        let mut tree = tree.peekable();
        let mut array = array.peekable();
        let mut pieces = Vec::new();
        let mut at = offset;
        loop {
            let next = match (tree.peek(), array.peek()) {
                (Some(&t), Some(&a)) if t < a => tree.next(),
                (Some(_), Some(_)) | (None, Some(_)) => array.next(),
                (Some(_), None) => tree.next(),
                (None, None) => None,
            };
            let Some(v) = next else { break };
            let e = Entry::unpack(v).clip(offset, end);
            if e.offset > at {
                pieces.push(Piece::Hole {
                    offset: at,
                    len: e.offset - at,
                });
            }
            pieces.push(Piece::Journal {
                offset: e.offset,
                len: e.len,
                journal: e.journal,
            });
            at = e.end();
        }
        if at < end {
            pieces.push(Piece::Hole {
                offset: at,
                len: end - at,
            });
        }
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The model: the journal position of every sector, or `None` for the chunk file.
    struct Model(Vec<Option<u64>>);

    impl Model {
        fn insert(&mut self, offset: u64, len: u64, journal: u64) {
            for i in 0..len {
                self.0[(offset + i) as usize] = Some(journal + i);
            }
        }

        fn remove(&mut self, offset: u64, len: u64) {
            self.0[offset as usize..(offset + len) as usize].fill(None);
        }
    }

    /// Checks that the pieces tile `[offset, offset + len)` in order, that no two
    /// holes touch, and that they map every sector as the model does.
    fn check(index: &JournalIndex, model: &Model, offset: u64, len: u64) {
        let pieces = index.query(offset, len).unwrap();
        let mut at = offset;
        let mut last_hole = false;
        for p in pieces {
            match p {
                Piece::Journal {
                    offset: o,
                    len: l,
                    journal,
                } => {
                    assert_eq!(o, at);
                    assert!(l > 0);
                    for i in 0..l {
                        assert_eq!(model.0[(o + i) as usize], Some(journal + i), "{o}+{i}");
                    }
                    at += l;
                    last_hole = false;
                }
                Piece::Hole { offset: o, len: l } => {
                    assert_eq!(o, at);
                    assert!(l > 0 && !last_hole);
                    for i in 0..l {
                        assert_eq!(model.0[(o + i) as usize], None, "{o}+{i}");
                    }
                    at += l;
                    last_hole = true;
                }
            }
        }
        assert_eq!(at, offset + len);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u64),
        Remove(u64, u64),
        Query(u64, u64),
        Merge,
    }

    const CHUNK: u64 = 3000;

    /// Mostly short ranges, so they overlap often; some longer than one packed entry.
    fn range() -> impl Strategy<Value = (u64, u64)> {
        prop_oneof![
            8 => (0..CHUNK, 1..=64u64),
            1 => (0..CHUNK, 0..=CHUNK),
        ]
        .prop_map(|(o, l)| (o, l.min(CHUNK - o)))
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            10 => range().prop_map(|(o, l)| Op::Insert(o, l)),
            2 => range().prop_map(|(o, l)| Op::Remove(o, l)),
            4 => range().prop_map(|(o, l)| Op::Query(o, l)),
            1 => Just(Op::Merge),
        ]
    }

    proptest! {
        #[test]
        fn matches_model(ops in prop::collection::vec(op(), 1..300), threshold in 0usize..64) {
            let mut index = JournalIndex::new(CHUNK).unwrap().with_merge_threshold(threshold);
            let mut model = Model(vec![None; CHUNK as usize]);
            let mut journal = 0;
            for op in ops {
                match op {
                    Op::Insert(o, l) => {
                        index.insert(o, l, journal).unwrap();
                        model.insert(o, l, journal);
                        journal += l;
                    }
                    Op::Remove(o, l) => {
                        index.remove(o, l).unwrap();
                        model.remove(o, l);
                    }
                    Op::Query(o, l) => check(&index, &model, o, l),
                    Op::Merge => index.merge(),
                }
                check(&index, &model, 0, CHUNK);
            }
        }
    }

    #[test]
    fn packing_round_trips_at_the_limits() {
        let e = Entry {
            offset: MAX_CHUNK_SECTORS - MAX_ENTRY_SECTORS,
            len: MAX_ENTRY_SECTORS,
            journal: JOURNAL_SECTORS - 1,
        };
        let u = Entry::unpack(e.pack());
        assert_eq!((u.offset, u.len, u.journal), (e.offset, e.len, e.journal));
        assert!(!is_tombstone(e.pack()));
    }

    #[test]
    fn rejects_what_does_not_fit() {
        assert_eq!(
            JournalIndex::new(MAX_CHUNK_SECTORS + 1).unwrap_err(),
            IndexError::ChunkTooLarge(MAX_CHUNK_SECTORS + 1)
        );
        let mut index = JournalIndex::new(MAX_CHUNK_SECTORS).unwrap();
        assert!(matches!(
            index.insert(MAX_CHUNK_SECTORS - 1, 2, 0),
            Err(IndexError::OutOfChunk { .. })
        ));
        assert!(matches!(
            index.insert(0, 1, u64::MAX),
            Err(IndexError::JournalTooFar { .. })
        ));
        assert!(matches!(
            index.insert(0, 2, JOURNAL_SECTORS - 1),
            Err(IndexError::JournalTooFar { .. })
        ));
        assert!(matches!(
            index.query(1, u64::MAX),
            Err(IndexError::OutOfChunk { .. })
        ));
        // A whole chunk fits, as several packed entries, and reads back as one range.
        index.insert(0, MAX_CHUNK_SECTORS, 7).unwrap();
        index.merge();
        assert_eq!(
            index.array_len() as u64,
            MAX_CHUNK_SECTORS / MAX_ENTRY_SECTORS
        );
        let pieces = index.query(0, MAX_CHUNK_SECTORS).unwrap();
        assert_eq!(pieces.len() as u64, MAX_CHUNK_SECTORS / MAX_ENTRY_SECTORS);
        assert_eq!(
            pieces[1],
            Piece::Journal {
                offset: MAX_ENTRY_SECTORS,
                len: MAX_ENTRY_SECTORS,
                journal: 7 + MAX_ENTRY_SECTORS,
            }
        );
    }

    #[test]
    fn merge_joins_sequential_writes() {
        let mut index = JournalIndex::new(100).unwrap();
        for i in 0..10 {
            index.insert(i * 8, 8, 500 + i * 8).unwrap();
        }
        index.insert(90, 5, 0).unwrap(); // not contiguous in the chunk
        index.merge();
        assert_eq!(index.array_len(), 2);
        assert_eq!(
            index.query(0, 80).unwrap(),
            vec![Piece::Journal {
                offset: 0,
                len: 80,
                journal: 500
            }]
        );
    }

    /// Fig. 4: a query across array entries, a tree entry and the gaps between them.
    #[test]
    fn query_splits_across_levels_and_holes() {
        let mut index = JournalIndex::new(100).unwrap();
        index.insert(10, 20, 1000).unwrap(); // [10, 30)
        index.insert(50, 10, 2000).unwrap(); // [50, 60)
        index.merge();
        index.insert(20, 35, 3000).unwrap(); // [20, 55) splits/trims both array entries
        assert_eq!(
            index.query(5, 60).unwrap(),
            vec![
                Piece::Hole { offset: 5, len: 5 },
                Piece::Journal {
                    offset: 10,
                    len: 10,
                    journal: 1000
                },
                Piece::Journal {
                    offset: 20,
                    len: 35,
                    journal: 3000
                },
                Piece::Journal {
                    offset: 55,
                    len: 5,
                    journal: 2005
                },
                Piece::Hole { offset: 60, len: 5 },
            ]
        );
    }
}
