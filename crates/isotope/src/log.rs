//! The redo log: a committed transaction's merged blocks are appended as one record
//! (durable, FUA) before any of them is written in place, so a crash at any moment
//! leaves each transaction either wholly in the log or absent from it. Replay at open
//! writes every record from the applied pointer on, in version order; it is
//! idempotent (records hold whole new blocks, not changes), so a crash during replay
//! or during an apply is repaired by the next open.
//!
//! The applied pointer (the superblock) moves only when the ring wraps: the appender
//! sees to it that every record before then is applied ([`Log::fits`]), and the wrap
//! flushes them, so replay reads at most one ring.

use crate::layout::{self, Superblock, BLOCK_BYTES, RING_BYTES, RING_OFFSET};
use bytes::Bytes;
use floe_blockdev::{BlockDevice, IoError};
use std::sync::Arc;

pub struct Log {
    device: Arc<dyn BlockDevice>,
    superblock: Superblock,
    /// Where the next record goes, in bytes into the ring.
    position: u64,
    /// The version of the last record appended or replayed.
    last: u64,
}

impl Log {
    /// Reads the superblock (formatting a volume that reads as zeroes there) and
    /// replays the records past it into the data blocks.
    pub async fn open(device: Arc<dyn BlockDevice>) -> Result<Log, String> {
        let head = device
            .read(0, 2 * BLOCK_BYTES as u32)
            .await
            .map_err(|e| format!("reading the superblocks: {e}"))?;
        let copies = [&head[..BLOCK_BYTES], &head[BLOCK_BYTES..]];
        let valid = copies.iter().filter_map(|c| Superblock::decode(c));
        let superblock = match valid.max_by_key(|s| s.count) {
            Some(found) => found,
            None if head.iter().all(|b| *b == 0) => {
                let fresh = Superblock {
                    count: 1,
                    applied: 0,
                    position: 0,
                };
                write_superblock(&device, fresh).await?;
                tracing::info!("formatted a transaction log");
                fresh
            }
            None => {
                return Err(
                    "it holds data that is not a Floe transaction log (use a new volume for \
                     transactions)"
                        .into(),
                )
            }
        };
        let mut log = Log {
            device,
            superblock,
            position: superblock.position,
            last: superblock.applied,
        };
        let replayed = log.replay().await?;
        if replayed > 0 {
            tracing::info!(
                records = replayed,
                version = log.last,
                "replayed the transaction log"
            );
        }
        Ok(log)
    }

    pub fn last_version(&self) -> u64 {
        self.last
    }

    /// Whether `bytes` of records fit before the ring's end: if not, appending them
    /// wraps, which requires every record before to be applied in place.
    pub fn fits(&self, bytes: u64) -> bool {
        self.position + bytes <= RING_BYTES
    }

    async fn replay(&mut self) -> Result<u64, String> {
        let mut replayed = 0;
        while self.position + BLOCK_BYTES as u64 <= RING_BYTES {
            let at = RING_OFFSET + self.position;
            let header = self
                .device
                .read(at, BLOCK_BYTES as u32)
                .await
                .map_err(|e| format!("reading the log at {at}: {e}"))?;
            let Some((version, blocks)) = layout::decode_header(&header) else {
                break;
            };
            let length = layout::record_bytes(blocks.len());
            if version != self.last + 1 || self.position + length > RING_BYTES {
                break;
            }
            let record = self
                .device
                .read(at, length as u32)
                .await
                .map_err(|e| format!("reading the log at {at}: {e}"))?;
            // A torn record was never acknowledged: the log ends before it.
            if !layout::record_intact(&record) {
                break;
            }
            let writes = blocks.iter().enumerate().map(|(i, block)| {
                let data = record.slice(BLOCK_BYTES * (1 + i)..BLOCK_BYTES * (2 + i));
                self.device.write(layout::data_offset(*block), data, false)
            });
            for written in futures::future::join_all(writes).await {
                written.map_err(|e| format!("replaying version {version}: {e}"))?;
            }
            self.last = version;
            self.position += length;
            replayed += 1;
        }
        self.device
            .flush()
            .await
            .map_err(|e| format!("flushing the replayed log: {e}"))?;
        Ok(replayed)
    }

    /// Appends the records of a group of commits, versions in order, durably, in one
    /// write. Their blocks are not yet applied.
    pub async fn append(&mut self, records: &[(u64, Vec<(u64, Bytes)>)]) -> Result<(), IoError> {
        let mut bytes = Vec::new();
        for (i, (version, blocks)) in records.iter().enumerate() {
            assert_eq!(
                *version,
                self.last + 1 + i as u64,
                "commit versions go up one at a time"
            );
            bytes.extend_from_slice(&layout::encode_record(*version, blocks));
        }
        let length = bytes.len() as u64;
        assert!(length <= RING_BYTES / 4, "a group of {length} bytes");
        if !self.fits(length) {
            // Everything before is applied (the caller's duty): flush it, then move the pointer to the
            // ring's start so replay never reads the records about to be overwritten.
            self.device.flush().await?;
            let moved = Superblock {
                count: self.superblock.count + 1,
                applied: self.last,
                position: 0,
            };
            write_superblock(&self.device, moved)
                .await
                .map_err(IoError::Io)?;
            self.superblock = moved;
            self.position = 0;
        }
        self.device
            .write(RING_OFFSET + self.position, Bytes::from(bytes), true)
            .await?;
        self.position += length;
        self.last = records.last().expect("a group has records").0;
        Ok(())
    }
}

async fn write_superblock(
    device: &Arc<dyn BlockDevice>,
    superblock: Superblock,
) -> Result<(), String> {
    device
        .write(superblock.slot_offset(), superblock.encode(), true)
        .await
        .map_err(|e| format!("writing the superblock: {e}"))
}
