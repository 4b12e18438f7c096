//! Frees retained blocks no snapshot reads (`floe_chunkstore::retained`): the master
//! sends each volume's snapshots with every heartbeat acknowledgment, and the server
//! drops, a bounded number per heartbeat, the epochs of its replicas below every
//! snapshot (deleted ones, or the epochs a writer retained for before the oldest),
//! and the blocks a snapshot no longer reads because an older epoch it reads kept
//! them too (a snapshot deleted between two others: its epochs' blocks are read by
//! the one before, which finds some in an older epoch). An epoch above the one the
//! master sent is kept whole: a snapshot taken since may read it. Staging chunks are
//! left to their repair, which moves or drops them.

use crate::ChunkServer;
use floe_chunkstore::block_sums::BLOCK_BYTES;
use floe_chunkstore::RetainedEntry;
use floe_protocol::{ChunkId, SnapshotReaders, CHUNK_INDEX_LIMIT};
use std::collections::BTreeMap;

/// (chunk, epoch) pairs released, and single blocks forgotten, per heartbeat at most:
/// deleting many snapshots frees their space in the background without holding up
/// the heartbeat.
const RELEASES_PER_HEARTBEAT: usize = 256;
const FORGETS_PER_HEARTBEAT: usize = 4096;
/// Heartbeats between scans while the snapshots stay as they were: a scan walks every
/// retained block of the volumes listed, and new garbage then comes only from a writer
/// still retaining for an epoch no snapshot reads.
const RESCAN_HEARTBEATS: u32 = 10;

/// When the heartbeat loop scans for blocks to free: at once when the snapshots
/// changed, again while the last scan stopped at its bounds, else every
/// [`RESCAN_HEARTBEATS`].
#[derive(Default)]
pub(crate) struct Schedule {
    last: Vec<SnapshotReaders>,
    beats: u32,
    more: bool,
}

impl Schedule {
    /// Whether this heartbeat, which brought `readers`, scans.
    pub(crate) fn due(&mut self, readers: &[SnapshotReaders]) -> bool {
        self.beats += 1;
        let due = self.more || readers != self.last || self.beats >= RESCAN_HEARTBEATS;
        if due {
            self.beats = 0;
            self.last = readers.to_vec();
        }
        due
    }

    /// What the scan freed: at its bounds, more may be left.
    pub(crate) fn scanned(&mut self, freed: Freed) {
        self.more = freed.epochs == RELEASES_PER_HEARTBEAT || freed.blocks == FORGETS_PER_HEARTBEAT;
    }
}

/// What one round freed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Freed {
    /// (chunk, epoch) pairs released.
    pub(crate) epochs: usize,
    /// Single blocks forgotten.
    pub(crate) blocks: usize,
    pub(crate) bytes: u64,
}

impl ChunkServer {
    /// Releases up to [`RELEASES_PER_HEARTBEAT`] epochs and forgets up to
    /// [`FORGETS_PER_HEARTBEAT`] blocks no snapshot of `readers` reads; a volume not
    /// listed keeps everything.
    pub(crate) async fn free_unread(&self, readers: &[SnapshotReaders]) -> Freed {
        let mut freed = Freed::default();
        for volume in readers {
            let mut chunks: Vec<ChunkId> = Vec::new();
            for (chunk, epoch, bytes) in self.store.retained_epochs(volume.volume_id) {
                if chunk.index >= CHUNK_INDEX_LIMIT {
                    continue;
                }
                if chunks.last() != Some(&chunk) {
                    chunks.push(chunk);
                }
                if !volume.unread(epoch) || freed.epochs == RELEASES_PER_HEARTBEAT {
                    continue;
                }
                if let Err(e) = self.store.release_retained(chunk, epoch..=epoch).await {
                    tracing::error!(?chunk, epoch, "freeing retained blocks failed: {e}");
                    return freed;
                }
                freed.epochs += 1;
                freed.bytes += bytes;
            }
            for chunk in chunks {
                let room = FORGETS_PER_HEARTBEAT - freed.blocks;
                for (epoch, offsets) in shadowed(&self.store.retained(chunk), volume, room) {
                    if let Err(e) = self.store.forget_retained(chunk, epoch, &offsets).await {
                        tracing::error!(?chunk, epoch, "freeing retained blocks failed: {e}");
                        return freed;
                    }
                    freed.blocks += offsets.len();
                    freed.bytes += offsets.len() as u64 * BLOCK_BYTES;
                }
                if freed.blocks == FORGETS_PER_HEARTBEAT {
                    return freed;
                }
            }
        }
        freed
    }
}

/// Up to `room` of a chunk's retained blocks (`entries`, by epoch and offset) no
/// snapshot reads though their epoch is read: the snapshot reading epoch `t` finds
/// the block in an older epoch at or above itself first. By epoch, their offsets.
fn shadowed(
    entries: &[RetainedEntry],
    readers: &SnapshotReaders,
    room: usize,
) -> BTreeMap<u32, Vec<u64>> {
    // Each block's epochs, oldest first.
    let mut epochs: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for entry in entries {
        epochs.entry(entry.offset).or_default().push(entry.epoch);
    }
    let mut dead: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    let mut found = 0;
    for (offset, epochs) in epochs {
        for (i, &epoch) in epochs.iter().enumerate() {
            let Some(reader) = readers.reader_of(epoch) else {
                continue;
            };
            if found < room && epochs[..i].iter().any(|&older| older >= reader) {
                dead.entry(epoch).or_default().push(offset);
                found += 1;
            }
        }
    }
    dead
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_follow_changed_snapshots_and_unfinished_scans_and_else_wait() {
        let readers = |snapshots| SnapshotReaders {
            volume_id: 7,
            epoch: 3,
            snapshots,
        };
        let mut schedule = Schedule::default();
        assert!(schedule.due(&[readers(vec![1])]), "new snapshots");
        assert!(!schedule.due(&[readers(vec![1])]));
        assert!(schedule.due(&[readers(vec![])]), "one deleted");
        schedule.scanned(Freed {
            epochs: RELEASES_PER_HEARTBEAT,
            ..Freed::default()
        });
        assert!(
            schedule.due(&[readers(vec![])]),
            "the last scan stopped short"
        );
        schedule.scanned(Freed::default());
        let waited = (0..RESCAN_HEARTBEATS).filter(|_| schedule.due(&[readers(vec![])]));
        assert_eq!(waited.count(), 1, "once in {RESCAN_HEARTBEATS} heartbeats");
    }

    #[test]
    fn a_block_an_older_epoch_a_snapshot_reads_also_kept_is_read_by_none() {
        let entry = |epoch, block| RetainedEntry {
            epoch,
            offset: block * BLOCK_BYTES,
            tag: 1,
            zeroes: false,
        };
        // Snapshots 1 and 3 (2 deleted between them); epoch 5 may be a new one's.
        let readers = SnapshotReaders {
            volume_id: 7,
            epoch: 4,
            snapshots: vec![1, 3],
        };
        let mut entries = vec![
            entry(1, 0),
            entry(1, 1),
            entry(2, 0),
            entry(2, 2),
            entry(3, 0),
            entry(4, 0),
            entry(5, 0),
        ];
        entries.sort();
        let dead = shadowed(&entries, &readers, usize::MAX);
        // Snapshot 1 reads block 0 from epoch 1, so never from 2; snapshot 3 reads it
        // from 3, so never from 4. Block 2 of epoch 2 is snapshot 1's.
        let expected = BTreeMap::from([(2, vec![0]), (4, vec![0])]);
        assert_eq!(dead, expected);
        assert_eq!(shadowed(&entries, &readers, 1).len(), 1);
    }
}
