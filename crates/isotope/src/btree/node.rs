//! One B-tree node in one block: `[kind u8][count u16 LE][pad 13]` then `count`
//! entries of [`ENTRY_BYTES`], sorted by key: `[key length u8][key 32][value length
//! u8][value 64]`. A leaf's values are the values; an internal node's are child block
//! numbers (u64 LE), entry `i`'s child holding the keys from its key up to entry
//! `i + 1`'s (entry 0's key is the smallest the subtree was ever given).

use crate::BLOCK_BYTES;
use bytes::{Bytes, BytesMut};

pub const KEY_BYTES_MAX: usize = 32;
pub const VALUE_BYTES_MAX: usize = 64;
const ENTRY_BYTES: usize = 2 + KEY_BYTES_MAX + VALUE_BYTES_MAX;
const HEADER_BYTES: usize = 16;
/// Entries a node holds; a full one splits before an insert goes through it.
pub const ENTRIES_MAX: usize = (BLOCK_BYTES - HEADER_BYTES) / ENTRY_BYTES;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub leaf: bool,
    pub entries: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Node {
    pub fn decode(block: &[u8]) -> Node {
        let leaf = match block[0] {
            1 => true,
            2 => false,
            other => panic!("a B-tree node of kind {other}: the tree is corrupt"),
        };
        let count = u16::from_le_bytes([block[1], block[2]]) as usize;
        assert!(count <= ENTRIES_MAX, "a node of {count} entries");
        let entries = (0..count)
            .map(|i| {
                let at = HEADER_BYTES + i * ENTRY_BYTES;
                let key_length = block[at] as usize;
                let value_at = at + 1 + KEY_BYTES_MAX;
                let value_length = block[value_at] as usize;
                assert!(key_length <= KEY_BYTES_MAX && value_length <= VALUE_BYTES_MAX);
                let key = block[at + 1..at + 1 + key_length].to_vec();
                (
                    key,
                    block[value_at + 1..value_at + 1 + value_length].to_vec(),
                )
            })
            .collect();
        Node { leaf, entries }
    }

    pub fn encode(&self) -> Bytes {
        assert!(self.entries.len() <= ENTRIES_MAX);
        let mut out = BytesMut::zeroed(BLOCK_BYTES);
        out[0] = if self.leaf { 1 } else { 2 };
        out[1..3].copy_from_slice(&(self.entries.len() as u16).to_le_bytes());
        for (i, (key, value)) in self.entries.iter().enumerate() {
            let at = HEADER_BYTES + i * ENTRY_BYTES;
            out[at] = key.len() as u8;
            out[at + 1..at + 1 + key.len()].copy_from_slice(key);
            let value_at = at + 1 + KEY_BYTES_MAX;
            out[value_at] = value.len() as u8;
            out[value_at + 1..value_at + 1 + value.len()].copy_from_slice(value);
        }
        out.freeze()
    }

    /// The entry whose subtree holds `key` (internal nodes).
    pub fn child_for(&self, key: &[u8]) -> usize {
        let after = self.entries.partition_point(|(k, _)| k.as_slice() <= key);
        after.saturating_sub(1)
    }

    pub fn child(&self, entry: usize) -> u64 {
        u64::from_le_bytes(
            self.entries[entry].1[..8]
                .try_into()
                .expect("a child pointer"),
        )
    }

    pub fn full(&self) -> bool {
        self.entries.len() == ENTRIES_MAX
    }

    /// Moves the upper half of the entries to a new node, returned.
    pub fn split(&mut self) -> Node {
        let upper = self.entries.split_off(self.entries.len() / 2);
        Node {
            leaf: self.leaf,
            entries: upper,
        }
    }
}
