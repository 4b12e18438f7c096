//! The audit after a lease ended unreleased (it ran out, or another writer took the
//! volume over). Its holder may have died, or given up, between a change reaching a
//! majority of a chunk's replicas and its report of the replica that missed it; a new
//! writer finds such replicas only in chunks it touches. So the master compares every
//! chunk's replicas once: one below the newest version among a majority is marked
//! stale (and repaired), as a writer would report it, and so is one that does not
//! answer.

use super::plan::quorum;
use crate::Master;
use floe_protocol::{generation_of, ChunkId, ChunkPlacement, ReplicaRequest, ServerId};
use futures::StreamExt;

/// Chunks compared at once.
const AUDIT_CONCURRENCY: usize = 16;

impl Master {
    /// Compares the replicas of every chunk of `volume_id` that no writer after lease
    /// generation `last` has written; false if some chunk could not be compared yet.
    pub(super) async fn audit(&self, volume_id: u64, last: u32) -> bool {
        let chunks: Vec<ChunkPlacement> = {
            let state = self.state();
            let chunks = state.chunks.get(&volume_id);
            chunks.map_or_else(Vec::new, |c| c.values().cloned().collect())
        };
        let compared: Vec<bool> = futures::stream::iter(chunks)
            .map(|placement| self.audit_chunk(volume_id, placement, last))
            .buffered(AUDIT_CONCURRENCY)
            .collect()
            .await;
        compared.into_iter().all(|done| done)
    }

    async fn audit_chunk(&self, volume_id: u64, placement: ChunkPlacement, last: u32) -> bool {
        let chunk = ChunkId {
            volume_id,
            index: placement.index,
        };
        let (members, quorum, lost) = {
            let state = self.state();
            let lost: Vec<ServerId> = placement
                .replicas
                .iter()
                .copied()
                .filter(|id| state.servers.get(id).is_none_or(|s| s.lost))
                .collect();
            let members: Vec<_> = placement
                .replicas
                .iter()
                .filter(|id| !placement.stale.contains(id))
                .filter_map(|id| state.servers.get(id).filter(|s| s.up && !s.lost))
                .cloned()
                .collect();
            (members, quorum(&placement, &state.servers), lost)
        };
        // Generation 0: the master fences no writer.
        let request = ReplicaRequest::ChunkInfo {
            chunk,
            generation: 0,
        };
        let replies = futures::future::join_all(
            members
                .iter()
                .map(|server| self.replica_state(server, request.clone())),
        )
        .await;
        let versions: Vec<(ServerId, u64)> = members
            .iter()
            .zip(replies)
            .filter_map(|(server, reply)| reply.ok().map(|(_, version)| (server.id, version)))
            .collect();
        if versions.len() < quorum {
            return false;
        }
        // A later writer has written here: it learned the chunk's version from a
        // majority first, and reported whoever was behind.
        if versions
            .iter()
            .any(|(_, version)| generation_of(*version) > last)
        {
            return true;
        }
        let newest = versions.iter().map(|(_, v)| *v).max().expect("a quorum");
        let behind = versions
            .iter()
            .filter(|(_, v)| *v < newest)
            .map(|(server, version)| {
                (
                    *server,
                    format!("replica holds {version:#x}, others {newest:#x}"),
                )
            });
        // One that did not answer (down, or cut off) may have missed the last change
        // as well; it would come back counted current. A repair vouches for it then
        // (incremental: nothing to copy if it missed nothing).
        let silent = placement
            .replicas
            .iter()
            .filter(|id| {
                !placement.stale.contains(id)
                    && !lost.contains(id)
                    && !versions.iter().any(|(server, _)| server == *id)
            })
            .map(|id| (*id, "replica did not answer".to_string()));
        for (server, why) in behind.chain(silent).collect::<Vec<_>>() {
            tracing::warn!(
                volume_id,
                index = chunk.index,
                server,
                "audit after a lease ended unreleased: {why}; marked stale"
            );
            if self
                .report_laggard(volume_id, chunk.index, server, None)
                .await
                .is_err()
            {
                return false;
            }
        }
        true
    }
}
