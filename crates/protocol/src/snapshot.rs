//! Snapshots as every process sees them (the layers are `floe_client::snapshot`).
//!
//! A volume's writer stamps each write with the volume's snapshot *epoch*: the epoch
//! of the newest snapshot taken (0: none yet). Snapshot `s` is the volume as it was
//! after every write of an epoch below `s`. The first write of epoch `t` over a block
//! of chunk `i` first copies the block as it was into the *delta chunk*
//! [`delta_index`]`(t, i)`, an ordinary chunk of the same volume (replicated,
//! repaired, moved and scrubbed like any other, and placed with chunk `i`). A reader
//! of snapshot `s` takes each block from the delta of the lowest epoch `t >= s` that
//! holds it, else from the live chunk.

use serde::{Deserialize, Serialize};

/// Delta chunks keep the epoch in the bits from here up, the live chunk's index below.
pub const SNAPSHOT_TAG_SHIFT: u32 = 40;
/// The highest snapshot epoch: delta indexes stay below [`crate::CHUNK_INDEX_LIMIT`].
pub const SNAPSHOT_EPOCH_MAX: u32 = (1 << (62 - SNAPSHOT_TAG_SHIFT)) - 1;
/// Blocks are preserved whole, at this size.
pub const SNAPSHOT_BLOCK_BYTES: u64 = 4096;
/// How long creating a snapshot waits for the volume's writer to switch epochs
/// (longer than a lease term: a writer that stopped answering loses its lease).
pub const SNAPSHOT_CONFIRM_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The delta chunk of live chunk `index` for snapshot epoch `epoch`.
pub fn delta_index(epoch: u32, index: u64) -> u64 {
    assert!(
        (1..=SNAPSHOT_EPOCH_MAX).contains(&epoch) && index < 1 << SNAPSHOT_TAG_SHIFT,
        "delta of chunk {index} at epoch {epoch}"
    );
    (epoch as u64) << SNAPSHOT_TAG_SHIFT | index
}

/// (epoch, live chunk index) of a chunk index; epoch 0 for a live chunk.
pub fn split_index(index: u64) -> (u32, u64) {
    (
        (index >> SNAPSHOT_TAG_SHIFT) as u32,
        index & ((1 << SNAPSHOT_TAG_SHIFT) - 1),
    )
}

/// One snapshot of a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub name: String,
    pub epoch: u32,
    /// Milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// The volume's size when it was taken.
    pub size_bytes: u64,
    /// The writer holding the volume's lease switched to this epoch (or none held
    /// it): the snapshot no longer changes, and can be read.
    pub ready: bool,
}

/// The snapshot a clone reads through to where it has not written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parent {
    pub volume: String,
    pub snapshot: String,
    pub epoch: u32,
}

/// What a volume's writer needs to know of its snapshots, with each lease grant and
/// renewal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotEpochs {
    /// The epoch to stamp writes with.
    pub epoch: u32,
    /// Some snapshot exists: overwritten blocks are preserved (none when every
    /// snapshot was deleted).
    pub preserving: bool,
}

/// A volume's snapshots as its chunk servers need them to free retained blocks
/// (`floe_chunkstore::retained`), sent with each heartbeat acknowledgment. Snapshot
/// `s` reads blocks retained for epochs `s` and up, the lowest first, so blocks
/// retained for epoch `t` are read only if some snapshot is at or below `t`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotReaders {
    pub volume_id: u64,
    /// The volume's snapshot epoch when sent. A snapshot taken since has a higher
    /// one, so blocks retained above it are kept whatever the list says.
    pub epoch: u32,
    /// The epochs of the volume's snapshots, pending ones included.
    pub snapshots: Vec<u32>,
}

impl SnapshotReaders {
    /// The volume's as it stands.
    pub fn of(volume: &crate::Volume) -> SnapshotReaders {
        SnapshotReaders {
            volume_id: volume.id,
            epoch: volume.snapshot_epoch,
            snapshots: volume.snapshots.iter().map(|s| s.epoch).collect(),
        }
    }

    /// Whether no snapshot, now or later, reads blocks retained for `epoch`.
    pub fn unread(&self, epoch: u32) -> bool {
        epoch <= self.epoch && self.snapshots.iter().all(|&s| s > epoch)
    }

    /// The snapshot that reads blocks retained for `epoch` where no epoch from it up
    /// to `epoch` retained them too: the newest at or below `epoch`. `None` when none
    /// is, or when `epoch` is above the epoch sent (a snapshot taken since may read
    /// it).
    pub fn reader_of(&self, epoch: u32) -> Option<u32> {
        if epoch > self.epoch {
            return None;
        }
        self.snapshots.iter().copied().filter(|&s| s <= epoch).max()
    }
}

impl SnapshotEpochs {
    /// The newer of two answers: a reply sent before a snapshot was taken may arrive
    /// after one sent later (renewals and long-polls race), and epochs never go back.
    /// At one epoch `preserving` only turns off (the last snapshot deleted), and a
    /// stale `true` costs a needless copy, never a lost block.
    pub fn later(self, other: SnapshotEpochs) -> SnapshotEpochs {
        if other.epoch >= self.epoch {
            other
        } else {
            self
        }
    }
}

/// Checks a snapshot name (the part after `@` in `VOLUME@SNAPSHOT`).
pub fn check_snapshot_name(name: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    if name.is_empty() || name.len() > 128 || !name.chars().all(allowed) {
        return Err(format!(
            "snapshot name {name:?} must be 1-128 characters of letters, digits, '-', '_' or '.'"
        ));
    }
    Ok(())
}

/// Splits `VOLUME@SNAPSHOT`; `None` for a plain volume name.
pub fn split_snapshot(name: &str) -> Option<(&str, &str)> {
    name.split_once('@')
}

/// Why a clone with snapshots is not flattened: they read, wherever the clone had
/// not written when they were taken, through to its parent, which a flatten forgets.
pub fn flatten_refused_for_snapshots(name: &str, snapshot: &str) -> String {
    format!(
        "volume {name} has snapshots ({name}@{snapshot}...), which read through to its \
         parent: delete them before flattening it"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_indexes_split_back_and_stay_on_the_wire() {
        let index = delta_index(SNAPSHOT_EPOCH_MAX, (1 << SNAPSHOT_TAG_SHIFT) - 1);
        assert!(index < crate::CHUNK_INDEX_LIMIT);
        assert_eq!(
            split_index(index),
            (SNAPSHOT_EPOCH_MAX, (1 << SNAPSHOT_TAG_SHIFT) - 1)
        );
        assert_eq!(split_index(7), (0, 7));
    }

    #[test]
    fn retained_blocks_are_unread_below_every_snapshot_and_never_above_the_epoch_sent() {
        let readers = SnapshotReaders {
            volume_id: 1,
            epoch: 6,
            snapshots: vec![3, 5],
        };
        let unread: Vec<u32> = (0..9).filter(|&t| readers.unread(t)).collect();
        // Snapshot 3 reads epochs 3 and up; 7 and 8 may belong to a newer snapshot.
        assert_eq!(unread, vec![0, 1, 2]);
        let none_left = SnapshotReaders {
            snapshots: Vec::new(),
            ..readers
        };
        let unread: Vec<u32> = (0..9).filter(|&t| none_left.unread(t)).collect();
        assert_eq!(unread, (0..=6).collect::<Vec<u32>>());
    }

    #[test]
    fn snapshot_names_refuse_separators() {
        assert!(check_snapshot_name("nightly-1.a_b").is_ok());
        for bad in ["", "a@b", "a/b", "a b", &"x".repeat(129)] {
            assert!(check_snapshot_name(bad).is_err(), "{bad:?}");
        }
    }
}
