//! Repair: brings this replica of a chunk up to date by pulling from a peer replica
//! (URSA section 4.2.1). Incremental when the peer's journal lite reaches back to
//! this replica's version: only the ranges changed since are copied. Otherwise (the
//! peer restarted, or this replica fell far behind) the two compare a fingerprint of
//! each 4 KiB block and only the blocks that differ are copied; the whole chunk when
//! the replica has none to compare (version 0) or holds data where the peer holds a
//! hole. Either way the changes made during the copy are then pulled incrementally
//! on top.
//!
//! While a repair runs the replica refuses changes. Data read from a source while
//! changes land there may hold one newer than the version the source reported, which
//! the chunk's history may yet leave out; a copy therefore ends only when a round
//! finds the source unchanged with nothing in flight. An incremental repair's data
//! goes to a staging chunk laid over the replica once complete, a whole copy's to one
//! that replaces it ([`crate::staging`]): a failure part-way leaves the replica as it
//! was.
//!
//! The replica's retained blocks (what snapshots read, `floe_chunkstore::retained`)
//! come along: an incremental repair drops those it retained above its version (for
//! changes the history may leave out) and takes the source's retained since; a
//! compared or whole copy takes the source's set in place of its own. Blocks the
//! source freed meanwhile (their snapshots deleted) are skipped.

use crate::replica::merge;
use crate::staging::{self, Staged};
use crate::{ChunkServer, Slot};
use bytes::Bytes;
use floe_chunkstore::block_sums::BLOCK_BYTES;
use floe_chunkstore::store::CHUNK_BYTES_MAX;
use floe_chunkstore::{ChunkMeta, RetainedBlock, RetainedEntry, StoreError};
use floe_protocol::connection::CallError;
use floe_protocol::{
    ChunkId, RepairKind, ReplicaRequest, ReplicaResponse, Request, Response, RetainedInfo, Status,
};
use std::time::Duration;
use tokio::time::Instant;

/// Bytes per read from the source.
const PIECE_BYTES: u64 = 1 << 20;
/// Changed ranges closer than this are copied as one.
const GAP_BYTES: u64 = 128 << 10;
pub(crate) const REPAIRING: &str = "being repaired";
/// How long a repair waits for changes already accepted to become durable.
const SETTLE_WAIT: Duration = Duration::from_secs(5);
/// Rounds of copying what changed meanwhile before a copy gives up on the source
/// holding still, and the pause after a round that found changes in flight.
const CONVERGE_ROUNDS: u32 = 20;
const CONVERGE_PAUSE: Duration = Duration::from_millis(5);
const SOURCE_KEPT_CHANGING: &str =
    "the source kept changing during the copy; a view change's freeze makes it hold still";

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
    /// The replica's version when the repair began.
    since: u64,
    /// Every change the replica had accepted was durable when the repair began: a
    /// scan of the replica then sees all it will hold.
    settled: bool,
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
            other => Err(self.bad_reply(other)),
        }
    }

    fn bad_reply(&self, reply: impl std::fmt::Debug) -> CallError {
        CallError::BadReply {
            address: self.source.to_string(),
            reason: format!("{reply:?}"),
        }
    }

    /// The source's ranges for `request` (LogSince or Extents), their version, and
    /// whether later changes are in flight there.
    async fn ranges(&self, request: ReplicaRequest) -> Result<Ranges, CallError> {
        match self.ask(request).await? {
            ReplicaResponse::Ranges {
                version,
                ranges,
                pending,
            } => Ok(Ranges {
                version,
                ranges,
                pending,
            }),
            other => Err(self.bad_reply(other)),
        }
    }

    /// Copies `ranges` of the source's replica into local chunk `into` (the replica or
    /// its staging chunk), stamped `meta`. Ranges with small gaps between them are
    /// read as one (fewer, larger reads); only the ranges are written.
    async fn copy(
        &mut self,
        into: ChunkId,
        ranges: &[(u64, u64)],
        meta: ChunkMeta,
    ) -> Result<u64, Failure> {
        let mut copied = 0;
        // Whole blocks, so an overlay's extents are exactly what it holds; the
        // source's data around a range is as new as anything the replica holds there.
        let mut aligned = Vec::with_capacity(ranges.len());
        for &(offset, length) in ranges {
            let start = offset - offset % staging::ALIGN_BYTES;
            let end = offset
                .checked_add(length)
                .filter(|end| *end <= CHUNK_BYTES_MAX)
                .and_then(|end| end.checked_next_multiple_of(staging::ALIGN_BYTES))
                .ok_or((
                    Status::BadRequest,
                    format!("source sent range {offset}+{length}"),
                ))?;
            aligned.push((start, end - start));
        }
        let held = aligned.clone();
        for (offset, length) in merge(&mut aligned, GAP_BYTES) {
            let end = offset + length;
            assert!(end <= CHUNK_BYTES_MAX, "merged ranges end past the chunk");
            let mut at = offset;
            while at < end {
                let n = (end - at).min(PIECE_BYTES);
                let read = Request::Read {
                    chunk: self.chunk,
                    offset: at,
                    length: n as u32,
                    min_version: 0,
                    max_version: u64::MAX,
                };
                let data: Bytes = match self.server.peers.call(self.source, read).await {
                    Ok(Response::Data(data)) if data.len() as u64 == n => data,
                    Ok(other) => return Err((Status::Io, format!("source answered {other:?}"))),
                    Err(e) => return Err(failed(e)),
                };
                // Only what the source holds: a gap read as zeroes stays a hole, so
                // the copy's extents are the source's (snapshot deltas and clones
                // take a chunk's extents for the blocks it holds).
                for (from, to) in within(&held, at, at + n) {
                    let piece = data.slice((from - at) as usize..(to - at) as usize);
                    self.server
                        .store
                        .write(into, from, piece, meta)
                        .await
                        .map_err(io)?;
                }
                at += n;
                copied += n;
                self.throttle.account(n).await;
            }
        }
        Ok(copied)
    }

    /// Copies the source's blocks retained by changes from `from` (exclusive) to
    /// `to` into local chunk `into`; returns the bytes copied.
    async fn copy_retained(&mut self, into: ChunkId, from: u64, to: u64) -> Result<u64, Failure> {
        let listed = ReplicaRequest::RetainedSince {
            chunk: self.chunk,
            since: from,
        };
        let blocks = match self.ask(listed).await.map_err(failed)? {
            ReplicaResponse::Retained { blocks, .. } => blocks,
            other => return Err(failed(self.bad_reply(other))),
        };
        let mut copied = 0;
        // Blocks of changes above `to` belong to changes the copy does not hold.
        for info in blocks.into_iter().filter(|info| info.tag <= to) {
            let RetainedInfo {
                epoch,
                offset,
                tag,
                zeroes,
            } = info;
            let block = if zeroes {
                RetainedBlock::Zeroes
            } else {
                let read = Request::ReadRetained {
                    chunk: self.chunk,
                    epoch,
                    offset,
                };
                match self.server.peers.call(self.source, read).await {
                    Ok(Response::Data(data)) if data.len() as u64 == BLOCK_BYTES => {
                        RetainedBlock::Data(data)
                    }
                    // Freed since it was listed: no snapshot reads it any more.
                    Err(CallError::Remote {
                        status: Status::NotFound,
                        ..
                    }) => continue,
                    Ok(other) => return Err((Status::Io, format!("source answered {other:?}"))),
                    Err(e) => return Err(failed(e)),
                }
            };
            let entry = RetainedEntry {
                epoch,
                offset,
                tag,
                zeroes,
            };
            self.server
                .store
                .install_retained(into, entry, block)
                .await
                .map_err(io)?;
            copied += BLOCK_BYTES;
            self.throttle.account(BLOCK_BYTES).await;
        }
        Ok(copied)
    }

    /// Copies again what the source changed after `version` until a round finds it
    /// unchanged with nothing in flight: everything read before that round is then
    /// the source's state at `version`. Returns the version, or None if the source
    /// kept changing.
    async fn converge(
        &mut self,
        into: ChunkId,
        mut version: u64,
        meta: ChunkMeta,
        bytes: &mut u64,
    ) -> Result<Option<u64>, Failure> {
        for _ in 0..CONVERGE_ROUNDS {
            let since = ReplicaRequest::LogSince {
                chunk: self.chunk,
                since: version,
            };
            let now = self.ranges(since).await.map_err(failed)?;
            if now.version == version && !now.pending {
                return Ok(Some(version));
            }
            *bytes += self.copy(into, &now.ranges, meta).await?;
            version = now.version;
            if now.pending {
                tokio::time::sleep(CONVERGE_PAUSE).await;
            }
        }
        Ok(None)
    }

    /// Returns (version reached, how, bytes copied).
    async fn run(
        &mut self,
        view: u64,
        since: u64,
        kind: RepairKind,
    ) -> Result<(u64, How, u64), Failure> {
        // At version 0 a replica may hold anything (a repair that failed part-way
        // left it so), not nothing: only a whole copy makes it exact.
        if kind != RepairKind::Whole && since > 0 {
            let log = ReplicaRequest::LogSince {
                chunk: self.chunk,
                since,
            };
            match self.ranges(log).await {
                // Small: done under the view change's freeze, where the source holds
                // still.
                Ok(_) if kind == RepairKind::Prefetch => return Ok((since, How::Log, 0)),
                Ok(changed) => return self.incremental(view, changed).await,
                Err(CallError::Remote {
                    status: Status::NotFound,
                    ..
                }) => return self.differing(view, since, kind).await,
                Err(e) => return Err(failed(e)),
            }
        }
        self.whole(view, since, kind).await
    }

    /// Copies the blocks whose fingerprints differ from the source's into an overlay,
    /// laid over the replica once the copy converged at a version no lower than the
    /// replica's. An overlay cannot take data away: where the source holds a hole and
    /// the replica data (a write the others never got), the whole chunk is copied;
    /// so it is from a source too old to list its blocks.
    async fn differing(
        &mut self,
        view: u64,
        since: u64,
        kind: RepairKind,
    ) -> Result<(u64, How, u64), Failure> {
        // A change still landing here could add a block after the scan, one the
        // source may never get (its writer died): the overlay would keep it.
        if !self.settled {
            return self.whole(view, since, kind).await;
        }
        let (version, theirs, pending) = match self
            .ask(ReplicaRequest::BlockSums { chunk: self.chunk })
            .await
        {
            Ok(ReplicaResponse::BlockSums {
                version,
                sums,
                pending,
            }) => (version, sums, pending),
            Ok(other) => return Err(failed(self.bad_reply(other))),
            Err(CallError::Remote {
                status: Status::BadRequest,
                ..
            }) => return self.whole(view, since, kind).await,
            Err(e) => return Err(failed(e)),
        };
        let store = &self.server.store;
        store.sync().await.map_err(io)?;
        let ours = store.block_sums(self.chunk).await.map_err(io)?;
        // Both scans read the chunk: they count against the copy rate.
        let scanned = (theirs.len() + ours.len()) as u64 * BLOCK_BYTES;
        self.throttle.account(scanned).await;
        let mut differ = Vec::new();
        for block in 0..theirs.len().max(ours.len()) {
            let theirs = theirs.get(block).copied().unwrap_or(0);
            let ours = ours.get(block).copied().unwrap_or(Some(0));
            if ours == Some(theirs) {
                continue;
            }
            if theirs == 0 {
                return self.whole(view, since, kind).await;
            }
            differ.push((block as u64 * BLOCK_BYTES, BLOCK_BYTES));
        }
        let changed = Ranges {
            version,
            ranges: merge(&mut differ, 0),
            pending,
        };
        let outcome = self.staged(view, Staged::Compared, changed, since).await?;
        settled(outcome, How::Compared, kind, since)
    }

    /// Copies the ranges changed since the replica's version into an overlay, laid
    /// over the replica once the copy converged.
    async fn incremental(
        &mut self,
        view: u64,
        changed: Ranges,
    ) -> Result<(u64, How, u64), Failure> {
        // The source's log reaches back to this replica's version: it holds at
        // least that much, and an overlay only adds to it.
        match self.staged(view, Staged::Overlay, changed, 0).await? {
            Outcome::Reached(version, bytes) => Ok((version, How::Log, bytes)),
            Outcome::Unsettled(_) | Outcome::Behind(..) => {
                Err((Status::Busy, SOURCE_KEPT_CHANGING.into()))
            }
        }
    }

    /// Copies the whole chunk into the staging chunk, which replaces the replica once
    /// the copy converged; a prefetch that did not converge leaves the replica as it
    /// was.
    async fn whole(
        &mut self,
        view: u64,
        since: u64,
        kind: RepairKind,
    ) -> Result<(u64, How, u64), Failure> {
        let extents = self
            .ranges(ReplicaRequest::Extents { chunk: self.chunk })
            .await
            .map_err(failed)?;
        let outcome = self.staged(view, Staged::Whole, extents, since).await?;
        settled(outcome, How::Whole, kind, since)
    }

    /// Copies `first` into a fresh staging chunk of `kind`, then what changed
    /// meanwhile, and applies it to the replica once the copy converged at a version
    /// no lower than `floor` (the replica's own, for a copy that replaces it).
    async fn staged(
        &mut self,
        view: u64,
        kind: Staged,
        first: Ranges,
        floor: u64,
    ) -> Result<Outcome, Failure> {
        let store = &self.server.store;
        let staging = staging::begin(store, self.chunk, kind, view)
            .await
            .map_err(io)?;
        let copying = ChunkMeta { view, version: 0 };
        let mut bytes = self.copy(staging, &first.ranges, copying).await?;
        let reached = self
            .converge(staging, first.version, copying, &mut bytes)
            .await?;
        let Some(version) = reached else {
            return Ok(Outcome::Unsettled(bytes));
        };
        // A source behind this replica (a change reached the replica before it, or it
        // missed one) would take back changes the replica acknowledged, which a
        // majority may count on: the replica stays as it is.
        if version < floor {
            return Ok(Outcome::Behind(version, bytes));
        }
        let from = match kind {
            Staged::Overlay => self.since,
            Staged::Whole | Staged::Compared => 0,
        };
        bytes += self.copy_retained(staging, from, version).await?;
        if kind == Staged::Overlay {
            // Retained for changes above the replica's version, which the history may
            // leave out: the source's since then replace them. Nothing is lost if the
            // copy stops here: the replica claims no more than it kept.
            store
                .trim_retained(self.chunk, self.since)
                .await
                .map_err(io)?;
        }
        let whole = ChunkMeta { view, version };
        staging::complete(&self.server.store, self.chunk, kind, whole)
            .await
            .map_err(io)?;
        Ok(Outcome::Reached(version, bytes))
    }
}

/// What a repair copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// The ranges the source's journal lite names.
    Log,
    /// The blocks whose fingerprints differ.
    Compared,
    Whole,
}

/// How a staged copy ended, with the bytes copied.
enum Outcome {
    /// Applied: the replica is at this version.
    Reached(u64, u64),
    /// The source kept changing: the replica is as it was.
    Unsettled(u64),
    /// The source settled below the replica's version: the replica is as it was.
    Behind(u64, u64),
}

/// What a copy that replaces the replica's content (not only adds to it, as the
/// journal lite's ranges do) returns: a prefetch that did not converge, or settled
/// below the replica, leaves it as it was.
fn settled(
    outcome: Outcome,
    how: How,
    kind: RepairKind,
    since: u64,
) -> Result<(u64, How, u64), Failure> {
    match outcome {
        Outcome::Reached(version, bytes) => Ok((version, how, bytes)),
        Outcome::Unsettled(bytes) | Outcome::Behind(_, bytes) if kind == RepairKind::Prefetch => {
            Ok((since, how, bytes))
        }
        Outcome::Unsettled(_) => Err((Status::Busy, SOURCE_KEPT_CHANGING.into())),
        Outcome::Behind(version, _) => Err((
            Status::Behind,
            format!("the source holds {version:#x}, this replica {since:#x}: kept"),
        )),
    }
}

/// The parts of `ranges` (offset, length) inside `start..end`, as (from, to).
fn within(ranges: &[(u64, u64)], start: u64, end: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = ranges
        .iter()
        .map(|&(offset, length)| (offset.max(start), (offset + length).min(end)))
        .filter(|(from, to)| from < to)
        .collect();
    out.sort_unstable();
    out
}

/// The source's answer to LogSince or Extents.
struct Ranges {
    version: u64,
    ranges: Vec<(u64, u64)>,
    pending: bool,
}

pub(crate) async fn repair(
    server: &ChunkServer,
    slot: &Slot,
    chunk: ChunkId,
    source: &str,
    kind: RepairKind,
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
        settled: settled.is_ok(),
        since,
    };
    let result = pull.run(view, since, kind).await;
    let mut replica = slot.replica.lock().unwrap();
    replica.frozen = None;
    // What the store now holds: the new version, or on failure the old one (0 when a
    // staging copy's replacement failed part-way); what was copied so far is harmless
    // either way.
    let version = server.store.meta(chunk).version;
    // A repair only adds to what the replica holds; 0 is a replacement that failed
    // part-way (the replica may then hold anything and claims nothing).
    assert!(
        version >= since || version == 0,
        "a repair of {chunk:?} took the replica back from {since:#x} to {version:#x}"
    );
    replica.submitted = version;
    replica.durable = version;
    drop(replica);
    slot.changed.notify_waiters();
    match result {
        Ok((version, how, bytes)) => {
            slot.changed.notify_waiters();
            tracing::info!(?chunk, source, version, ?how, bytes, "replica repaired");
            Ok(ReplicaResponse::Repaired {
                version,
                incremental: how == How::Log,
                compared: how == How::Compared,
                bytes,
            })
        }
        Err(e) => Err(e),
    }
}
