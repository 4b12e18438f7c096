//! The expanded block (Blizzard's term): what one log position writes into its slot.
//!
//! A slot is a 4 KiB header page and a 4 KiB data page. The header page names what
//! the position holds, where it stands in the log and a crc32c; the rest of the page
//! is zeroes and covered by the CRC too, so any corrupted byte is caught:
//!
//! ```text
//! 0  magic   u64  "FLOELCSL"
//! 8  kind    u8   1: block `block` holds the data page; 2: blocks
//!                 [block, block + count) read as zeroes (the data page is not written)
//! 9  block   u64
//! 17 count   u64  1 for data
//! 25 position u64 the log position that wrote the slot
//! 33 epoch   u64  the client's FLUSH count when the write was acknowledged
//! 41 crc32c  u32  over the header page (these 4 bytes as zero) and, for data, the
//!                 data page
//! ```
//! All little-endian.

use bytes::{BufMut, Bytes, BytesMut};
use floe_protocol::log_commit::{BLOCK_BYTES, SLOT_BYTES};

const MAGIC: u64 = u64::from_le_bytes(*b"FLOELCSL");
const PAGE: usize = BLOCK_BYTES as usize;
const CRC_AT: usize = 41;

/// What a slot says it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// The data page is block `block`.
    Data,
    /// `count` blocks from `block` read as zeroes.
    Zeroes { count: u64 },
}

/// A slot's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) kind: Kind,
    pub(super) block: u64,
    pub(super) position: u64,
    pub(super) epoch: u64,
}

/// The bytes to write at the slot's offset: both pages for data (`data` is one
/// block), the header page alone for zeroes.
pub(super) fn encode(header: &Header, data: Option<&[u8]>) -> Bytes {
    let (kind, count) = match header.kind {
        Kind::Data => (1u8, 1),
        Kind::Zeroes { count } => (2u8, count),
    };
    assert_eq!(
        data.map(|d| d.len()),
        (header.kind == Kind::Data).then_some(PAGE),
        "a data slot carries one block, a zeroes slot none"
    );
    let mut out = BytesMut::with_capacity(SLOT_BYTES as usize);
    out.put_u64_le(MAGIC);
    out.put_u8(kind);
    out.put_u64_le(header.block);
    out.put_u64_le(count);
    out.put_u64_le(header.position);
    out.put_u64_le(header.epoch);
    out.put_u32_le(0);
    out.resize(PAGE, 0);
    let mut crc = crc32c::crc32c(&out);
    if let Some(data) = data {
        crc = crc32c::crc32c_append(crc, data);
        out.extend_from_slice(data);
    }
    out[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    let out = out.freeze();
    debug_assert_eq!(decode(&pad(&out)), Some(*header), "pair assertion");
    out
}

/// A slot's header, if the slot (both pages, as read) is one this layer wrote whole.
pub(super) fn decode(slot: &[u8]) -> Option<Header> {
    assert_eq!(slot.len(), SLOT_BYTES as usize);
    let (page, data) = slot.split_at(PAGE);
    let u64_at = |at: usize| u64::from_le_bytes(page[at..at + 8].try_into().unwrap());
    if u64_at(0) != MAGIC {
        return None;
    }
    let kind = match page[8] {
        1 if u64_at(17) == 1 => Kind::Data,
        2 => Kind::Zeroes { count: u64_at(17) },
        _ => return None,
    };
    let stored = u32::from_le_bytes(page[CRC_AT..CRC_AT + 4].try_into().unwrap());
    let mut crc = crc32c::crc32c(&page[..CRC_AT]);
    crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc = crc32c::crc32c_append(crc, &page[CRC_AT + 4..]);
    if kind == Kind::Data {
        crc = crc32c::crc32c_append(crc, data);
    }
    (crc == stored).then_some(Header {
        kind,
        block: u64_at(9),
        position: u64_at(25),
        epoch: u64_at(33),
    })
}

/// An encoded slot as a whole slot read back (a zeroes slot's data page unknown).
fn pad(encoded: &[u8]) -> Vec<u8> {
    let mut slot = encoded.to_vec();
    slot.resize(SLOT_BYTES as usize, 0xa5);
    slot
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(kind: Kind) -> impl Strategy<Value = Header> {
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(move |(block, position, epoch)| {
            Header {
                kind,
                block,
                position,
                epoch,
            }
        })
    }

    proptest! {
        #[test]
        fn a_data_slot_round_trips_and_any_corrupted_byte_is_refused(
            header in header(Kind::Data),
            data in proptest::collection::vec(any::<u8>(), PAGE),
            at in 0..SLOT_BYTES as usize,
            flip in 1u8..=255,
        ) {
            let slot = encode(&header, Some(&data));
            prop_assert_eq!(slot.len(), SLOT_BYTES as usize);
            prop_assert_eq!(&slot[PAGE..], &data[..]);
            prop_assert_eq!(decode(&slot), Some(header));
            let mut bad = slot.to_vec();
            bad[at] ^= flip;
            prop_assert_eq!(decode(&bad), None);
        }

        #[test]
        fn a_zeroes_slot_round_trips_whatever_its_data_page_holds(
            header in header(Kind::Zeroes { count: 7 }),
            garbage in any::<u8>(),
            at in 0..PAGE,
            flip in 1u8..=255,
        ) {
            let page = encode(&header, None);
            prop_assert_eq!(page.len(), PAGE);
            let mut slot = page.to_vec();
            slot.resize(SLOT_BYTES as usize, garbage);
            prop_assert_eq!(decode(&slot), Some(header));
            slot[at] ^= flip;
            prop_assert_eq!(decode(&slot), None);
        }
    }

    #[test]
    fn zeroes_and_never_written_slots_are_not_slots() {
        assert_eq!(decode(&[0; SLOT_BYTES as usize]), None);
    }
}
