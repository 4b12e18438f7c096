//! Repair: brings this replica of a chunk up to date by pulling from a peer replica
//! (URSA section 4.2.1). Incremental when the peer's journal lite reaches back to
//! this replica's version: only the ranges changed since are copied. Otherwise the
//! whole chunk is copied, then the changes made during the copy are pulled
//! incrementally on top.
//!
//! While a repair runs the replica refuses changes. An incremental repair's data
//! carries the replica's old version and the new one is stamped only at the end; a
//! whole copy goes to a staging chunk that replaces the replica once complete
//! ([`crate::staging`]). Either way a failure part-way leaves a replica that claims no
//! more than it holds, and it is simply repaired again.

use crate::replica::merge;
use crate::staging;
use crate::{ChunkServer, Slot};
use bytes::Bytes;
use floe_chunkstore::store::CHUNK_BYTES_MAX;
use floe_chunkstore::{ChunkMeta, StoreError};
use floe_protocol::connection::CallError;
use floe_protocol::{ChunkId, ReplicaRequest, ReplicaResponse, Request, Response, Status};
use std::time::Duration;
use tokio::time::Instant;

/// Bytes per read from the source.
const PIECE_BYTES: u64 = 1 << 20;
/// Changed ranges closer than this are copied as one.
const GAP_BYTES: u64 = 128 << 10;
pub(crate) const REPAIRING: &str = "being repaired";
/// How long a repair waits for changes already accepted to become durable.
const SETTLE_WAIT: Duration = Duration::from_secs(5);

type Failure = (Status, String);

fn io(e: StoreError) -> Failure {
    (Status::Io, e.to_string())
}

fn failed(e: CallError) -> Failure {
    let status = match &e {
        CallError::Remote { status, .. } => *status,
        _ => Status::Unavailable,
    };
    (status, format!("repair source: {e}"))
}

/// Paces the copy to a byte rate (0: unlimited).
struct Throttle {
    bytes_per_second: u64,
    start: Instant,
    bytes: u64,
}

impl Throttle {
    async fn account(&mut self, bytes: u64) {
        self.bytes += bytes;
        if self.bytes_per_second == 0 {
            return;
        }
        let due = Duration::from_secs_f64(self.bytes as f64 / self.bytes_per_second as f64);
        if let Some(wait) = due.checked_sub(self.start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}

struct Pull<'a> {
    server: &'a ChunkServer,
    chunk: ChunkId,
    source: &'a str,
    throttle: Throttle,
}

impl Pull<'_> {
    async fn ask(&self, request: ReplicaRequest) -> Result<ReplicaResponse, CallError> {
        match self
            .server
            .peers
            .call(self.source, Request::Replica(request))
            .await?
        {
            Response::Replica(reply) => Ok(reply),
            other => Err(CallError::BadReply {
                address: self.source.to_string(),
                reason: format!("{other:?}"),
            }),
        }
    }

    /// The source's ranges for `request` (LogSince or Extents) and their version.
    async fn ranges(&self, request: ReplicaRequest) -> Result<(u64, Vec<(u64, u64)>), CallError> {
        match self.ask(request).await? {
            ReplicaResponse::Ranges { version, ranges } => Ok((version, ranges)),
            other => Err(CallError::BadReply {
                address: self.source.to_string(),
                reason: format!("{other:?}"),
            }),
        }
    }

    /// Copies `ranges` of the source's replica into local chunk `into` (the replica or
    /// its staging chunk), stamped `meta`. Ranges with small gaps between them are
    /// copied as one: fewer, larger reads, and the source's data in a gap is as new as
    /// anything the replica holds there.
    async fn copy(
        &mut self,
        into: ChunkId,
        ranges: &[(u64, u64)],
        meta: ChunkMeta,
    ) -> Result<u64, Failure> {
        let mut copied = 0;
        for (offset, length) in merge(&mut ranges.to_vec(), GAP_BYTES) {
            let end = offset
                .checked_add(length)
                .filter(|end| *end <= CHUNK_BYTES_MAX)
                .ok_or((
                    Status::BadRequest,
                    format!("source sent range {offset}+{length}"),
                ))?;
            let mut at = offset;
            while at < end {
                let n = (end - at).min(PIECE_BYTES);
                let read = Request::Read {
                    chunk: self.chunk,
                    offset: at,
                    length: n as u32,
                    min_version: 0,
                };
                let data: Bytes = match self.server.peers.call(self.source, read).await {
                    Ok(Response::Data(data)) if data.len() as u64 == n => data,
                    Ok(other) => return Err((Status::Io, format!("source answered {other:?}"))),
                    Err(e) => return Err(failed(e)),
                };
                self.server
                    .store
                    .write(into, at, data, meta)
                    .await
                    .map_err(io)?;
                at += n;
                copied += n;
                self.throttle.account(n).await;
            }
        }
        Ok(copied)
    }

    async fn stamp(&self, meta: ChunkMeta) -> Result<(), Failure> {
        self.server
            .store
            .set_meta(self.chunk, meta)
            .await
            .map_err(io)
    }

    /// Returns (version reached, incremental, bytes copied).
    async fn run(
        &mut self,
        view: u64,
        since: u64,
        full: bool,
    ) -> Result<(u64, bool, u64), Failure> {
        if !full {
            match self
                .ranges(ReplicaRequest::LogSince {
                    chunk: self.chunk,
                    since,
                })
                .await
            {
                Ok((version, ranges)) => {
                    let bytes = self
                        .copy(
                            self.chunk,
                            &ranges,
                            ChunkMeta {
                                view,
                                version: since,
                            },
                        )
                        .await?;
                    self.stamp(ChunkMeta { view, version }).await?;
                    return Ok((version, true, bytes));
                }
                Err(CallError::Remote {
                    status: Status::NotFound,
                    ..
                }) => {}
                Err(e) => return Err(failed(e)),
            }
        }
        let staging = staging::begin(&self.server.store, self.chunk, view)
            .await
            .map_err(io)?;
        let empty = ChunkMeta { view, version: 0 };
        let (start, extents) = self
            .ranges(ReplicaRequest::Extents { chunk: self.chunk })
            .await
            .map_err(failed)?;
        let mut bytes = self.copy(staging, &extents, empty).await?;
        // Changes the source took during the copy; the copy may hold some of them
        // already, and copying their ranges again makes it exact.
        let (version, ranges) = self
            .ranges(ReplicaRequest::LogSince {
                chunk: self.chunk,
                since: start,
            })
            .await
            .map_err(failed)?;
        bytes += self.copy(staging, &ranges, empty).await?;
        staging::complete(&self.server.store, self.chunk, ChunkMeta { view, version })
            .await
            .map_err(io)?;
        Ok((version, false, bytes))
    }
}

pub(crate) async fn repair(
    server: &ChunkServer,
    slot: &Slot,
    chunk: ChunkId,
    source: &str,
    full: bool,
    bytes_per_second: u64,
) -> Result<ReplicaResponse, Failure> {
    {
        let mut replica = slot.replica.lock().unwrap();
        if replica.frozen == Some(REPAIRING) {
            return Err((
                Status::Unavailable,
                "a repair of this chunk is already running".into(),
            ));
        }
        replica.frozen = Some(REPAIRING);
        replica.log.clear();
    }
    slot.changed.notify_waiters();
    let settled = tokio::time::timeout(SETTLE_WAIT, slot.settled()).await;
    let (view, since) = {
        let replica = slot.replica.lock().unwrap();
        (replica.view, replica.durable)
    };
    if settled.is_err() {
        tracing::warn!(
            ?chunk,
            "changes still in flight at repair; repairing from {since:#x}"
        );
    }
    let mut pull = Pull {
        server,
        chunk,
        source,
        throttle: Throttle {
            bytes_per_second,
            start: Instant::now(),
            bytes: 0,
        },
    };
    let result = pull.run(view, since, full).await;
    let mut replica = slot.replica.lock().unwrap();
    replica.frozen = None;
    // What the store now holds: the new version, or on failure the old one (0 when a
    // staging copy's replacement failed part-way); what was copied so far is harmless
    // either way.
    let version = server.store.meta(chunk).version;
    replica.submitted = version;
    replica.durable = version;
    drop(replica);
    slot.changed.notify_waiters();
    match result {
        Ok((version, incremental, bytes)) => {
            slot.changed.notify_waiters();
            tracing::info!(
                ?chunk,
                source,
                version,
                incremental,
                bytes,
                "replica repaired"
            );
            Ok(ReplicaResponse::Repaired {
                version,
                incremental,
                bytes,
            })
        }
        Err(e) => Err(e),
    }
}
