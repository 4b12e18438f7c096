//! Frees retained blocks no snapshot reads (`floe_chunkstore::retained`): the master
//! sends each volume's snapshots with every heartbeat acknowledgment, and the server
//! drops, a bounded number per heartbeat, the epochs of its replicas below every
//! snapshot (deleted ones, or the epochs a writer retained for before the oldest).
//! An epoch above the one the master sent is kept: a snapshot taken since may read
//! it. Staging chunks are left to their repair, which moves or drops them.

use crate::ChunkServer;
use floe_protocol::{SnapshotReaders, CHUNK_INDEX_LIMIT};

/// (chunk, epoch) pairs freed per heartbeat at most: deleting many snapshots frees
/// their space in the background without holding up the heartbeat.
const RELEASES_PER_HEARTBEAT: usize = 256;

/// What one round freed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Freed {
    /// (chunk, epoch) pairs released.
    pub(crate) epochs: usize,
    pub(crate) bytes: u64,
}

impl ChunkServer {
    /// Releases up to [`RELEASES_PER_HEARTBEAT`] epochs no snapshot of `readers`
    /// reads; a volume not listed keeps everything.
    pub(crate) async fn free_unread(&self, readers: &[SnapshotReaders]) -> Freed {
        let mut freed = Freed::default();
        for volume in readers {
            for (chunk, epoch, bytes) in self.store.retained_epochs(volume.volume_id) {
                if freed.epochs == RELEASES_PER_HEARTBEAT {
                    return freed;
                }
                if chunk.index >= CHUNK_INDEX_LIMIT || !volume.unread(epoch) {
                    continue;
                }
                if let Err(e) = self.store.release_retained(chunk, epoch..=epoch).await {
                    tracing::error!(?chunk, epoch, "freeing retained blocks failed: {e}");
                    return freed;
                }
                freed.epochs += 1;
                freed.bytes += bytes;
            }
        }
        freed
    }
}
