//! Write-back (the volume's [`WriteMode::WriteBack`], and below the flush-epoch and
//! log-commit layers): a write that is not FUA goes to the replicas marked unsynced, and commits as any change once every good replica
//! (or a majority, the rest left behind) logged it; the replicas sync it in groups
//! (see `floe_chunkstore`'s `unsynced`). A FLUSH asks every good replica of each chunk
//! written since the last FLUSH to sync (`ReplicaRequest::Sync` at the chunk's
//! committed version); it succeeds once a majority of each did, the others left
//! behind as for a change, so a power cut of every server afterwards keeps each
//! flushed write on a majority, where the next writer learns its version. A replica
//! that lost unsynced writes to a power cut answers `Behind`; with too few left the
//! FLUSH fails and the chunks stay unflushed for the next one.

use super::{Replicas, ReplicatedChunks};
use floe_blockdev::IoError;
use floe_protocol::connection::CallError;
use floe_protocol::{ReplicaRequest, Request, ServerId, Status, WriteMode};
use std::collections::BTreeSet;
use std::sync::Mutex;

/// Chunks written unsynced since the last FLUSH; `None` in write-through.
pub(super) struct Unflushed(Option<Noted>);

/// How long a replica may take to answer a Sync: it waits for an fdatasync of up to
/// 32 MiB of unsynced writes, longer than a change's [`super::REPLICA_TIMEOUT`] on a
/// busy server.
const SYNC_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub(super) struct Noted {
    chunks: Mutex<BTreeSet<u64>>,
    /// Held by the FLUSH under way. A FLUSH must not return while another one still
    /// syncs chunks it took from the notes: those may hold writes acknowledged
    /// before this FLUSH began.
    flushing: tokio::sync::Mutex<()>,
}

impl Unflushed {
    /// Write-back writes unsynced; so do the flush-epoch and log-commit layers, which
    /// flush before they retire changes.
    pub(super) fn new(mode: WriteMode) -> Unflushed {
        let unsynced = matches!(
            mode,
            WriteMode::WriteBack | WriteMode::FlushEpoch | WriteMode::LogCommit
        );
        Unflushed(unsynced.then(|| Noted {
            chunks: Mutex::default(),
            flushing: tokio::sync::Mutex::new(()),
        }))
    }

    /// Whether writes that are not FUA go unsynced.
    pub(super) fn enabled(&self) -> bool {
        self.0.is_some()
    }

    /// An unsynced write to chunk `index` committed: noted before its reply, so a
    /// FLUSH after the reply covers it (noted at the send, a FLUSH meanwhile would
    /// take the note before the write committed, and cover it neither then nor later).
    pub(super) fn note(&self, index: u64) {
        if let Some(noted) = &self.0 {
            noted.chunks.lock().unwrap().insert(index);
        }
    }
}

impl ReplicatedChunks {
    /// Makes every write that completed before the call durable on a majority of
    /// each chunk's replicas.
    pub(super) async fn sync_unflushed(&self) -> Result<(), IoError> {
        let Some(noted) = &self.unflushed.0 else {
            return Ok(());
        };
        let _one_at_a_time = noted.flushing.lock().await;
        let chunks = std::mem::take(&mut *noted.chunks.lock().unwrap());
        let results =
            futures::future::join_all(chunks.iter().map(|&index| self.sync_chunk(index))).await;
        let mut failed = None;
        for (index, result) in chunks.into_iter().zip(results) {
            if let Err(e) = result {
                noted.chunks.lock().unwrap().insert(index);
                failed.get_or_insert(e);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    async fn sync_chunk(&self, index: u64) -> Result<(), IoError> {
        // Every good replica holds the committed version: one that missed a change
        // was left behind before the change committed.
        let version = self.chunks.lock().unwrap()[&index].committed;
        let Replicas { good, majority, .. } = self.replicas(index).expect("allocated");
        let request = Request::Replica(ReplicaRequest::Sync {
            chunk: self.chunk_id(index),
            version,
        });
        let replies = futures::future::join_all(good.iter().map(|(_, address)| {
            self.pool
                .call_within(address, request.clone(), SYNC_TIMEOUT)
        }))
        .await;
        let failed: Vec<(ServerId, _)> = good
            .iter()
            .zip(replies)
            .filter_map(|((id, _), reply)| reply.err().map(|e| (*id, e)))
            .collect();
        // A replica saw a newer writer: this one's FLUSH promises nothing, and its
        // word must not leave a replica behind.
        let fenced = failed.iter().find_map(|(_, e)| match e {
            CallError::Remote {
                status: Status::Fenced,
                message,
            } => Some(message),
            _ => None,
        });
        if let (Some(why), Some(lease)) = (fenced, &self.lease) {
            return Err(lease.fenced(why));
        }
        if good.len() - failed.len() < majority {
            let why = failed
                .first()
                .map_or_else(|| "no good replica".to_string(), |(_, e)| e.to_string());
            return Err(IoError::Io(format!(
                "chunk {index}: the flush made {} of {} replicas durable, {majority} needed: {why}",
                good.len() - failed.len(),
                good.len()
            )));
        }
        for (id, why) in failed {
            self.leave_behind(index, id, &why).await;
        }
        Ok(())
    }
}
