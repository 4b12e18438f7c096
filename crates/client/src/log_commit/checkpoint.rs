//! Checkpoints: the retired block map and where the log goes on, written alternately
//! to two regions so that a torn one leaves the other.
//!
//! ```text
//! 0  magic     u64 "FLOELCCK"
//! 8  sequence  u64 one more than the last checkpoint's; the region is sequence % 2
//! 16 position  u64 the log position roll-forward starts at
//! 24 slot      u64 that position's slot (the permutation's state)
//! 32 epoch     u64 the client's FLUSH count
//! 40 blocks    u64 V
//! 48 slots     u64 P
//! 56 zeroes to 64
//! 64 map       V x u32: the slot of each block, u32::MAX for zeroes
//! .. crc32c    u32 over all of the above
//! ```
//! The region's tail is zeroes. A checkpoint counts once a FLUSH of the volume below
//! returned after it; what it holds was retired (durable) before it was written.

use super::permutation::Cursor;
use super::ZEROES;
use bytes::{BufMut, Bytes, BytesMut};
use floe_blockdev::{BlockDevice, IoError};
use floe_protocol::log_commit::{Layout, CHECKPOINT_HEADER_BYTES};

const MAGIC: u64 = u64::from_le_bytes(*b"FLOELCCK");
/// The largest request a checkpoint is written or read in (the volume below takes at
/// most 32 MiB at once).
const PIECE_BYTES: u64 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Checkpoint {
    pub(super) sequence: u64,
    pub(super) cursor: Cursor,
    pub(super) epoch: u64,
    pub(super) map: Vec<u32>,
}

impl Checkpoint {
    fn encode(&self, layout: &Layout) -> Bytes {
        assert_eq!(self.map.len() as u64, layout.blocks);
        let mut out = BytesMut::with_capacity(layout.checkpoint_bytes as usize);
        out.put_u64_le(MAGIC);
        out.put_u64_le(self.sequence);
        out.put_u64_le(self.cursor.position);
        out.put_u64_le(self.cursor.slot);
        out.put_u64_le(self.epoch);
        out.put_u64_le(layout.blocks);
        out.put_u64_le(layout.slots);
        out.resize(CHECKPOINT_HEADER_BYTES as usize, 0);
        for &slot in &self.map {
            assert!(slot == ZEROES || u64::from(slot) < layout.slots);
            out.put_u32_le(slot);
        }
        let crc = crc32c::crc32c(&out);
        out.put_u32_le(crc);
        out.resize(layout.checkpoint_bytes as usize, 0);
        out.freeze()
    }

    /// The checkpoint a region holds, if it holds a whole one of this layout.
    fn decode(layout: &Layout, region: &[u8]) -> Option<Checkpoint> {
        let u64_at = |at: usize| u64::from_le_bytes(region[at..at + 8].try_into().unwrap());
        if region.len() as u64 != layout.checkpoint_bytes || u64_at(0) != MAGIC {
            return None;
        }
        let end = (CHECKPOINT_HEADER_BYTES + 4 * layout.blocks) as usize;
        let stored = u32::from_le_bytes(region[end..end + 4].try_into().unwrap());
        if crc32c::crc32c(&region[..end]) != stored
            || (u64_at(40), u64_at(48)) != (layout.blocks, layout.slots)
        {
            return None;
        }
        let map = region[CHECKPOINT_HEADER_BYTES as usize..end]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        Some(Checkpoint {
            sequence: u64_at(8),
            cursor: Cursor {
                position: u64_at(16),
                slot: u64_at(24),
            },
            epoch: u64_at(32),
            map,
        })
    }

    /// Writes it to its region and flushes the volume below: it counts once this
    /// returns.
    pub(super) async fn write(
        &self,
        inner: &dyn BlockDevice,
        layout: &Layout,
    ) -> Result<(), IoError> {
        let bytes = self.encode(layout);
        let base = layout.checkpoint_offset(self.sequence % 2);
        let pieces = (0..layout.checkpoint_bytes)
            .step_by(PIECE_BYTES as usize)
            .map(|at| {
                let end = (at + PIECE_BYTES).min(layout.checkpoint_bytes);
                inner.write(base + at, bytes.slice(at as usize..end as usize), false)
            });
        for result in futures::future::join_all(pieces).await {
            result?;
        }
        inner.flush().await
    }

    /// Reads region `region`: its checkpoint if it holds a whole one, and whether it
    /// holds anything at all (a never written region reads as zeroes).
    pub(super) async fn read(
        inner: &dyn BlockDevice,
        layout: &Layout,
        region: u64,
    ) -> Result<(Option<Checkpoint>, bool), IoError> {
        let base = layout.checkpoint_offset(region);
        let pieces = (0..layout.checkpoint_bytes)
            .step_by(PIECE_BYTES as usize)
            .map(|at| {
                let length = PIECE_BYTES.min(layout.checkpoint_bytes - at);
                inner.read(base + at, length as u32)
            });
        let mut bytes = Vec::with_capacity(layout.checkpoint_bytes as usize);
        for piece in futures::future::join_all(pieces).await {
            bytes.extend_from_slice(&piece?);
        }
        let written = bytes.iter().any(|&b| b != 0);
        Ok((Checkpoint::decode(layout, &bytes), written))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_blockdev::MemoryDevice;

    fn checkpoint(layout: &Layout, sequence: u64) -> Checkpoint {
        Checkpoint {
            sequence,
            cursor: Cursor {
                position: 1234,
                slot: 17,
            },
            epoch: 9,
            map: (0..layout.blocks as u32)
                .map(|b| if b % 3 == 0 { ZEROES } else { b + 7 })
                .collect(),
        }
    }

    #[tokio::test]
    async fn checkpoints_alternate_regions_and_a_torn_one_is_refused() {
        // Over a mebibyte of map: written and read in pieces.
        let layout = Layout::of(2 << 30);
        let device = MemoryDevice::new(layout.backing_bytes());
        let first = checkpoint(&layout, 1);
        first.write(&device, &layout).await.unwrap();
        let second = checkpoint(&layout, 2);
        second.write(&device, &layout).await.unwrap();
        assert_eq!(
            Checkpoint::read(&device, &layout, 1).await.unwrap(),
            (Some(first), true)
        );
        assert_eq!(
            Checkpoint::read(&device, &layout, 0).await.unwrap(),
            (Some(second), true)
        );
        // Torn: its last piece never reached the device.
        let torn = layout.checkpoint_offset(0) + layout.checkpoint_bytes - 4096;
        device
            .write(torn, Bytes::from(vec![7; 4096]), false)
            .await
            .unwrap();
        assert_eq!(
            Checkpoint::read(&device, &layout, 0).await.unwrap(),
            (None, true)
        );
        let fresh = Layout::of(1 << 20);
        let device = MemoryDevice::new(fresh.backing_bytes());
        assert_eq!(
            Checkpoint::read(&device, &fresh, 0).await.unwrap(),
            (None, false)
        );
    }
}
