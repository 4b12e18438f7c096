//! Where things lie on a transactional volume, and the formats of its log: the one
//! place the storage format is written down.
//!
//! ```text
//! [superblock A 4 KiB][superblock B 4 KiB][log ring: 16 MiB - 8 KiB][data block 0][data block 1]...
//! ```
//! The log sits at the start so that growing the volume moves nothing. A superblock
//! (`FLOEISO1`, format version, update count, applied version, applied position,
//! crc32c) says from where replay starts; the two copies are written in turn, and the
//! valid one with the higher count wins, so a torn superblock write loses nothing.
//! A log record is a header block (`FLOETXR1`, commit version, block count, the block
//! numbers, crc32c over the header and the data) followed by the blocks' new contents.

use bytes::{BufMut, Bytes, BytesMut};

pub const BLOCK_BYTES: usize = 4096;
/// Superblocks and log ring; data blocks follow.
pub const LOG_REGION_BYTES: u64 = 16 << 20;
const SUPERBLOCKS_BYTES: u64 = 2 * BLOCK_BYTES as u64;
pub const RING_OFFSET: u64 = SUPERBLOCKS_BYTES;
pub const RING_BYTES: u64 = LOG_REGION_BYTES - SUPERBLOCKS_BYTES;
/// The most blocks one transaction may write: its record must fit the ring many times
/// over, and its header must list them in one block.
pub const TX_BLOCKS_MAX: usize = 256;

const SUPERBLOCK_MAGIC: &[u8; 8] = b"FLOEISO1";
const FORMAT_VERSION: u32 = 1;
const RECORD_MAGIC: &[u8; 8] = b"FLOETXR1";
/// Header: magic, version u64, count u32, 4 bytes reserved, then the block numbers.
const RECORD_FIXED_BYTES: usize = 24;
const CRC_AT: usize = BLOCK_BYTES - 4;
const _: () = assert!(RECORD_FIXED_BYTES + TX_BLOCKS_MAX * 8 <= CRC_AT);

/// The byte offset of data block `block`.
pub fn data_offset(block: u64) -> u64 {
    LOG_REGION_BYTES + block * BLOCK_BYTES as u64
}

/// Data blocks of a volume of `size_bytes`.
pub fn data_blocks(size_bytes: u64) -> u64 {
    size_bytes.saturating_sub(LOG_REGION_BYTES) / BLOCK_BYTES as u64
}

/// Replay starts at `position` (bytes into the ring) with version `applied + 1`;
/// every record before it is applied and flushed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub count: u64,
    pub applied: u64,
    pub position: u64,
}

impl Superblock {
    /// Which copy this one is written to.
    pub fn slot_offset(&self) -> u64 {
        (self.count % 2) * BLOCK_BYTES as u64
    }

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::zeroed(BLOCK_BYTES);
        let mut at = &mut out[..];
        at.put_slice(SUPERBLOCK_MAGIC);
        at.put_u32_le(FORMAT_VERSION);
        at.put_u32_le(0);
        at.put_u64_le(self.count);
        at.put_u64_le(self.applied);
        at.put_u64_le(self.position);
        let crc = crc32c::crc32c(&out[..CRC_AT]);
        out[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        out.freeze()
    }

    /// `None` for a copy that is not a valid superblock (never written, or torn).
    pub fn decode(block: &[u8]) -> Option<Superblock> {
        let crc = u32::from_le_bytes(block[CRC_AT..].try_into().unwrap());
        if &block[..8] != SUPERBLOCK_MAGIC || crc32c::crc32c(&block[..CRC_AT]) != crc {
            return None;
        }
        let u64_at = |at: usize| u64::from_le_bytes(block[at..at + 8].try_into().unwrap());
        let format = u32::from_le_bytes(block[8..12].try_into().unwrap());
        let decoded = Superblock {
            count: u64_at(16),
            applied: u64_at(24),
            position: u64_at(32),
        };
        assert_eq!(format, FORMAT_VERSION, "a superblock of an unknown format");
        assert!(
            decoded.position < RING_BYTES,
            "superblock {decoded:?} past the ring"
        );
        Some(decoded)
    }
}

/// The bytes of a record: its header block, then `blocks`' data in that order.
pub fn encode_record(version: u64, blocks: &[(u64, Bytes)]) -> Bytes {
    assert!(!blocks.is_empty() && blocks.len() <= TX_BLOCKS_MAX);
    let mut out = BytesMut::zeroed(BLOCK_BYTES * (1 + blocks.len()));
    {
        let mut at = &mut out[..BLOCK_BYTES];
        at.put_slice(RECORD_MAGIC);
        at.put_u64_le(version);
        at.put_u32_le(blocks.len() as u32);
        at.put_u32_le(0);
        for (block, _) in blocks {
            at.put_u64_le(*block);
        }
    }
    for (i, (_, data)) in blocks.iter().enumerate() {
        assert_eq!(data.len(), BLOCK_BYTES, "whole blocks go to the log");
        out[BLOCK_BYTES * (1 + i)..BLOCK_BYTES * (2 + i)].copy_from_slice(data);
    }
    let crc = record_crc(&out);
    out[CRC_AT..BLOCK_BYTES].copy_from_slice(&crc.to_le_bytes());
    out.freeze()
}

fn record_crc(record: &[u8]) -> u32 {
    let header = crc32c::crc32c(&record[..CRC_AT]);
    crc32c::crc32c_append(header, &record[BLOCK_BYTES..])
}

/// A record header's version and block numbers, or `None` when the block is no
/// record header (the end of the log).
pub fn decode_header(header: &[u8]) -> Option<(u64, Vec<u64>)> {
    if &header[..8] != RECORD_MAGIC {
        return None;
    }
    let u64_at = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap());
    let count = u32::from_le_bytes(header[16..20].try_into().unwrap()) as usize;
    if count == 0 || count > TX_BLOCKS_MAX {
        return None;
    }
    let blocks = (0..count).map(|i| u64_at(RECORD_FIXED_BYTES + 8 * i));
    Some((u64_at(8), blocks.collect()))
}

/// Whether a whole record (header and data) is intact.
pub fn record_intact(record: &[u8]) -> bool {
    let crc = u32::from_le_bytes(record[CRC_AT..BLOCK_BYTES].try_into().unwrap());
    record_crc(record) == crc
}

/// A record's length in the ring.
pub fn record_bytes(blocks: usize) -> u64 {
    (BLOCK_BYTES * (1 + blocks)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_any_flipped_byte_is_caught() {
        let blocks = vec![
            (7, Bytes::from(vec![1u8; BLOCK_BYTES])),
            (3, Bytes::from(vec![2u8; BLOCK_BYTES])),
        ];
        let record = encode_record(42, &blocks);
        assert_eq!(record.len() as u64, record_bytes(2));
        assert_eq!(decode_header(&record), Some((42, vec![7, 3])));
        assert!(record_intact(&record));
        for at in [9, CRC_AT - 1, BLOCK_BYTES + 5, record.len() - 1] {
            let mut torn = record.to_vec();
            torn[at] ^= 1;
            assert!(!record_intact(&torn), "a flip at {at} passed");
        }
    }

    #[test]
    fn a_superblock_round_trips_and_a_torn_one_is_invalid() {
        let sb = Superblock {
            count: 3,
            applied: 9,
            position: 8192,
        };
        let bytes = sb.encode();
        assert_eq!(Superblock::decode(&bytes), Some(sb));
        let mut torn = bytes.to_vec();
        torn[30] ^= 0x80;
        assert_eq!(Superblock::decode(&torn), None);
        assert_eq!(Superblock::decode(&[0u8; BLOCK_BYTES]), None);
    }
}
