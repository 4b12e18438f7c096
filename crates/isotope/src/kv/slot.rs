//! One entry of the table: a 256-byte slot, 16 to a block, so that transactions
//! touching different keys of one block touch different 16-byte fragments.
//!
//! `[state u8][key length u8][value length u16 LE][key: 60][value: 192]`

use crate::BLOCK_BYTES;

pub const SLOT_BYTES: usize = 256;
pub const SLOTS_PER_BLOCK: usize = BLOCK_BYTES / SLOT_BYTES;
pub const KEY_BYTES_MAX: usize = 60;
pub const VALUE_BYTES_MAX: usize = SLOT_BYTES - 4 - KEY_BYTES_MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Never used: a lookup that meets one stops.
    Empty,
    Used,
    /// Deleted: reusable, but lookups go on past it.
    Deleted,
}

pub fn state(block: &[u8], slot: usize) -> State {
    match block[slot * SLOT_BYTES] {
        0 => State::Empty,
        1 => State::Used,
        2 => State::Deleted,
        other => panic!("slot {slot} holds state {other}: the table is corrupt"),
    }
}

pub fn key(block: &[u8], slot: usize) -> &[u8] {
    let at = slot * SLOT_BYTES;
    &block[at + 4..at + 4 + block[at + 1] as usize]
}

pub fn value(block: &[u8], slot: usize) -> &[u8] {
    let at = slot * SLOT_BYTES;
    let length = u16::from_le_bytes([block[at + 2], block[at + 3]]) as usize;
    assert!(
        length <= VALUE_BYTES_MAX,
        "slot {slot}: a value of {length} bytes"
    );
    &block[at + 4 + KEY_BYTES_MAX..at + 4 + KEY_BYTES_MAX + length]
}

pub fn set(block: &mut [u8], slot: usize, key: &[u8], value: &[u8]) {
    assert!(key.len() <= KEY_BYTES_MAX && value.len() <= VALUE_BYTES_MAX);
    let at = slot * SLOT_BYTES;
    block[at..at + SLOT_BYTES].fill(0);
    block[at] = 1;
    block[at + 1] = key.len() as u8;
    block[at + 2..at + 4].copy_from_slice(&(value.len() as u16).to_le_bytes());
    block[at + 4..at + 4 + key.len()].copy_from_slice(key);
    block[at + 4 + KEY_BYTES_MAX..at + 4 + KEY_BYTES_MAX + value.len()].copy_from_slice(value);
}

pub fn delete(block: &mut [u8], slot: usize) {
    let at = slot * SLOT_BYTES;
    block[at..at + SLOT_BYTES].fill(0);
    block[at] = 2;
}
