//! Write-ahead log records.
//!
//! ```text
//! header (offset 0, 4 KiB): magic u32 | version u32 | start_seq u64 | crc u32
//! record:  magic u32 | crc u32 | seq u64 | kind u8 | pad [3] | volume_id u64 |
//!          index u64 | offset u64 | length u64 | view u64 | version u64 |
//!          data (length bytes, writes only)
//! ```
//! A record is valid when its magic and crc check and its `seq` is above the previous
//! record's (at least `start_seq` for the first). The header's `start_seq` moves
//! forward at each checkpoint, past every sequence number ever used, so records left
//! over from before it can never be mistaken for new ones, and the log is reused from
//! the start without being truncated or zeroed. Sequence numbers are global across
//! the journals of one store (see `store`), so a file's records may skip numbers.
//!
//! Format 6 (the log in the data directory; 2 before retained blocks) packs records
//! back to back. Format 5 (a
//! journal) pads before the data so it starts on a [`SECTOR_BYTES`] boundary: the
//! journal index addresses journal data in sectors. `view` and `version` are the
//! chunk's replication state once the record is applied, so the state is durable in
//! the same write as the data it describes.

use bytes::{Buf, BufMut};
use floe_protocol::ChunkId;

pub const HEADER_BYTES: u64 = 4096;
pub const RECORD_HEADER_BYTES: usize = 68;
const HEADER_MAGIC: u32 = 0x464c_5748; // "FLWH"
const RECORD_MAGIC: u32 = 0x464c_5752; // "FLWR"
/// Format 6 adds `Retain`, `Release` and `Trim` records, which an older reader would
/// take for a torn tail and drop with everything after: it is refused by them. Format
/// 8 (7 is the journals') adds `Forget`. Formats 2 (none of them) and 6 are still read.
const FORMAT_PACKED: u32 = 8;
const FORMAT_PACKED_READ: [u32; 3] = [2, 6, FORMAT_PACKED];
/// Format 4: a header's start sequence also voids older records in the other journals
/// (format 3 journals lack that rule and are refused, to be drained by the old version).
/// Format 5 adds `Intent` records, which a format 4 reader would take for a torn tail:
/// 4 is still read (it has no intents). Format 7 (6 is the packed logs') adds a
/// repair's `Retain` (without its data), `Release`, `Trim` and `Forget` records,
/// which a format 5 reader cannot apply: journals are written as 7, and 4 and 5 are
/// still read. The two kinds never share a number, so neither reads the other's.
const FORMAT_ALIGNED: u32 = 7;
const FORMAT_ALIGNED_READ: [u32; 3] = [4, 5, FORMAT_ALIGNED];
/// Alignment of journal data (formats 4 and 5), the journal index's unit.
pub const SECTOR_BYTES: u64 = 512;
/// No single record may carry more than this, so replay can bound its buffer.
pub const RECORD_DATA_BYTES_MAX: u64 = 64 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Write = 1,
    /// Zero a range, keeping it allocated.
    Zero = 2,
    /// Zero a range and free its space.
    Punch = 3,
    /// Drop every chunk of `volume_id`.
    DeleteVolume = 4,
    /// Only set the chunk's view and version.
    Stamp = 5,
    /// A write whose data went straight to the chunk file (durably, before this
    /// record): the record carries no data; it supersedes older journaled data.
    Bypass = 6,
    /// Hybrid mode, before a batch's chunk-file changes: the range one is about to
    /// change (no data, no state). The scan after a crash rehashes the ranges of the
    /// intents newer than every other record, the batch it cut short (see
    /// [`crate::block_sums`]).
    Intent = 7,
    /// Plain mode, before the change that overwrites it: a block as it was, retained
    /// for a snapshot epoch (`offset` the block's, `view` the epoch, `version` the
    /// change's; no data when it was all zeroes). See [`crate::retained`].
    Retain = 8,
    /// Drops a chunk's retained blocks of epochs `offset..=length` (no data, no
    /// state).
    Release = 9,
    /// Drops a chunk's retained blocks tagged above `version` (a repair replacing
    /// what the replica took past it; no data, no state).
    Trim = 10,
    /// Drops one retained block, the one at `offset` of epoch `view`: no snapshot
    /// reads it, though others of its epoch are read (no data, no state).
    Forget = 11,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Write,
            2 => Kind::Zero,
            3 => Kind::Punch,
            4 => Kind::DeleteVolume,
            5 => Kind::Stamp,
            6 => Kind::Bypass,
            7 => Kind::Intent,
            8 => Kind::Retain,
            9 => Kind::Release,
            10 => Kind::Trim,
            11 => Kind::Forget,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub seq: u64,
    pub kind: Kind,
    pub chunk: ChunkId,
    pub offset: u64,
    pub length: u64,
    pub view: u64,
    pub version: u64,
}

impl RecordHeader {
    /// Bytes of data following the header.
    pub fn data_len(&self) -> usize {
        match self.kind {
            Kind::Write | Kind::Retain => self.length as usize,
            _ => 0,
        }
    }

    /// Appends the record to `out`, whose first byte goes to file position `base`.
    pub fn encode(&self, data: &[u8], out: &mut Vec<u8>, base: u64, aligned: bool) {
        debug_assert_eq!(data.len(), self.data_len());
        let start = out.len();
        out.put_u32_le(RECORD_MAGIC);
        out.put_u32_le(0); // crc, filled below
        out.put_u64_le(self.seq);
        out.put_u8(self.kind as u8);
        out.put_slice(&[0; 3]);
        out.put_u64_le(self.chunk.volume_id);
        out.put_u64_le(self.chunk.index);
        out.put_u64_le(self.offset);
        out.put_u64_le(self.length);
        out.put_u64_le(self.view);
        out.put_u64_le(self.version);
        let crc = crc32c::crc32c_append(crc32c::crc32c(&out[start + 8..]), data);
        out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
        let data_at = self.data_at(base + start as u64, aligned);
        out.resize((data_at - base) as usize, 0);
        out.extend_from_slice(data);
    }

    /// Where the data of a record starting at `position` begins.
    pub fn data_at(&self, position: u64, aligned: bool) -> u64 {
        let at = position + RECORD_HEADER_BYTES as u64;
        if aligned && self.data_len() > 0 {
            at.next_multiple_of(SECTOR_BYTES)
        } else {
            at
        }
    }

    /// Parses a record header; `None` if it is not a plausible record with a
    /// sequence number of at least `seq`. The crc is checked by [`RecordHeader::check`] once the
    /// data has been read.
    pub fn decode(raw: &[u8; RECORD_HEADER_BYTES], seq: u64) -> Option<(RecordHeader, u32)> {
        let mut r = &raw[..];
        if r.get_u32_le() != RECORD_MAGIC {
            return None;
        }
        let crc = r.get_u32_le();
        let header = RecordHeader {
            seq: r.get_u64_le(),
            kind: Kind::from_u8(r.get_u8())?,
            chunk: {
                r.advance(3);
                ChunkId {
                    volume_id: r.get_u64_le(),
                    index: r.get_u64_le(),
                }
            },
            offset: r.get_u64_le(),
            length: r.get_u64_le(),
            view: r.get_u64_le(),
            version: r.get_u64_le(),
        };
        if header.seq < seq || header.data_len() as u64 > RECORD_DATA_BYTES_MAX {
            return None;
        }
        Some((header, crc))
    }

    pub fn check(raw: &[u8; RECORD_HEADER_BYTES], data: &[u8], crc: u32) -> bool {
        crc32c::crc32c_append(crc32c::crc32c(&raw[8..]), data) == crc
    }
}

/// A log header; `aligned` selects the journals' format (data on sector boundaries).
pub fn encode_header(start_seq: u64, aligned: bool) -> [u8; HEADER_BYTES as usize] {
    let mut out = [0u8; HEADER_BYTES as usize];
    let mut w = &mut out[..];
    w.put_u32_le(HEADER_MAGIC);
    w.put_u32_le(if aligned {
        FORMAT_ALIGNED
    } else {
        FORMAT_PACKED
    });
    w.put_u64_le(start_seq);
    let crc = crc32c::crc32c(&out[..16]);
    out[16..20].copy_from_slice(&crc.to_le_bytes());
    out
}

#[derive(Debug, PartialEq, Eq)]
pub enum HeaderError {
    NotALog,
    /// A log of another format version (the version it has).
    Format(u32),
}

/// The start sequence number of a log header of the expected format.
pub fn decode_header(raw: &[u8], aligned: bool) -> Result<u64, HeaderError> {
    if raw.len() < 20 || crc32c::crc32c(&raw[..16]) != (&raw[16..20]).get_u32_le() {
        return Err(HeaderError::NotALog);
    }
    let mut r = raw;
    if r.get_u32_le() != HEADER_MAGIC {
        return Err(HeaderError::NotALog);
    }
    match r.get_u32_le() {
        format if aligned && FORMAT_ALIGNED_READ.contains(&format) => Ok(r.get_u64_le()),
        format if !aligned && FORMAT_PACKED_READ.contains(&format) => Ok(r.get_u64_le()),
        other => Err(HeaderError::Format(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trip_and_torn_detection() {
        let header = RecordHeader {
            seq: 5,
            kind: Kind::Write,
            chunk: ChunkId {
                volume_id: 1,
                index: 2,
            },
            offset: 4096,
            length: 3,
            view: 4,
            version: 1 << 32 | 9,
        };
        let mut out = Vec::new();
        header.encode(b"abc", &mut out, 0, false);
        let raw: [u8; RECORD_HEADER_BYTES] = out[..RECORD_HEADER_BYTES].try_into().unwrap();
        let (back, crc) = RecordHeader::decode(&raw, 5).unwrap();
        assert_eq!(back, header);
        assert!(RecordHeader::check(&raw, b"abc", crc));
        assert!(
            !RecordHeader::check(&raw, b"abd", crc),
            "torn data detected"
        );
        assert!(
            RecordHeader::decode(&raw, 6).is_none(),
            "stale sequence rejected"
        );
        assert!(RecordHeader::decode(&raw, 4).is_some(), "numbers may skip");
        assert_eq!(header.data_at(100, false), 168);
        assert_eq!(header.data_at(100, true), 512);
        assert_eq!(decode_header(&encode_header(77, false), false), Ok(77));
        assert_eq!(
            decode_header(&encode_header(77, true), false),
            Err(HeaderError::Format(FORMAT_ALIGNED))
        );
        assert_eq!(decode_header(&[0u8; 4096], true), Err(HeaderError::NotALog));
        // Format 4 and 5 journals (before intents, before retained blocks) are still
        // read, and so are format 2 and 6 logs (before retained blocks, before
        // `Forget`); the kinds never read each other's.
        let reformatted = |aligned: bool, format: u32| {
            let mut old = encode_header(78, aligned);
            old[4..8].copy_from_slice(&format.to_le_bytes());
            let crc = crc32c::crc32c(&old[..16]);
            old[16..20].copy_from_slice(&crc.to_le_bytes());
            old
        };
        for (aligned, format) in [(true, 4), (true, 5), (false, 2), (false, 6)] {
            assert_eq!(
                decode_header(&reformatted(aligned, format), aligned),
                Ok(78)
            );
            let other = decode_header(&reformatted(aligned, format), !aligned);
            assert_eq!(other, Err(HeaderError::Format(format)));
        }
    }
}
