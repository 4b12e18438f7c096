//! A snapshot as a read-only chunk layer (`VOLUME@SNAPSHOT` exports).
//!
//! Block `b` of chunk `i` in snapshot `s` comes from the delta of the lowest epoch
//! `t >= s` that holds it (the block as it was before epoch `t` first overwrote it;
//! no write of epochs `s..t` touched it), else from the live chunk, which no write
//! of epoch `s` or later has touched there. The writer preserves a block durably
//! before it overwrites it, so the reader learns the live chunk's version `v` first,
//! then the deltas' blocks, and reads the live chunk only from a replica that has
//! taken nothing past `v`, or nothing past `v` in the range read (its journal lite
//! says which ranges changed); otherwise it learns again.
//!
//! A snapshot of a clone reads through to the clone's parent snapshot where the clone
//! had not written when it was taken: a chunk born at or after the snapshot, and
//! a block that no delta holds and the live chunk does not own (the clone's first
//! write over a block preserves the parent's contents, as its read then showed,
//! before copying it up; ownership only grows, and is learned after the deltas).

use super::blocks::Blocks;
use crate::replicated::ReplicatedChunks;
use crate::stripe::ChunkIo;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use floe_blockdev::IoError;
use floe_protocol::snapshot::{delta_index, SNAPSHOT_BLOCK_BYTES};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// How long a read keeps learning again while the live chunk keeps moving on.
const READ_DEADLINE: Duration = Duration::from_secs(60);
/// Reads of a live range as of newer versions before the reader learns again.
const LIVE_READ_TRIES: usize = 8;

/// What the reader knows of one chunk: the live version and, as of it, the blocks
/// each delta at or past the snapshot's epoch holds, lowest epoch first.
struct Known {
    version: u64,
    deltas: Vec<(u32, Blocks)>,
    /// A clone's: the blocks its live chunk owns (the rest read through).
    owned: Option<Blocks>,
}

pub struct SnapshotChunks {
    chunks: ReplicatedChunks,
    epoch: u32,
    /// A clone's parent snapshot.
    parent: Option<Box<SnapshotChunks>>,
    known: Mutex<BTreeMap<u64, Arc<Known>>>,
}

/// Where a run of a read comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    Live,
    Delta(u32),
    Parent,
}

impl SnapshotChunks {
    /// Snapshot of `epoch` over the volume's chunks (opened read-only); a clone's
    /// reads through to `parent`.
    pub fn new(
        chunks: ReplicatedChunks,
        epoch: u32,
        parent: Option<SnapshotChunks>,
    ) -> SnapshotChunks {
        SnapshotChunks {
            chunks,
            epoch,
            parent: parent.map(Box::new),
            known: Mutex::default(),
        }
    }

    async fn learn(&self, index: u64) -> Result<Arc<Known>, IoError> {
        let version = self.chunks.current_version(index).await?;
        // Deltas allocated since the map was read.
        self.chunks.refresh().await;
        let mut deltas = Vec::new();
        for epoch in self.chunks.delta_epochs(index, self.epoch) {
            let extents = self.chunks.extents(delta_index(epoch, index)).await?;
            deltas.push((epoch, Blocks::from_extents(&extents)));
        }
        let owned = match self.parent {
            Some(_) => Some(Blocks::from_extents(&self.chunks.extents(index).await?)),
            None => None,
        };
        let known = Arc::new(Known {
            version,
            deltas,
            owned,
        });
        self.known.lock().unwrap().insert(index, known.clone());
        Ok(known)
    }

    /// Whether chunk `index` was allocated before the snapshot was taken.
    fn existed(&self, index: u64) -> bool {
        self.chunks
            .born(index)
            .is_some_and(|born| born < self.epoch)
    }

    /// The runs of `offset..offset + length` by where they come from.
    fn plan(known: &Known, offset: u64, length: u64) -> Vec<(Source, u64, u64)> {
        let mut runs: Vec<(Source, u64, u64)> = Vec::new();
        let end = offset + length;
        let mut at = offset;
        while at < end {
            let block = at / SNAPSHOT_BLOCK_BYTES;
            let next = ((block + 1) * SNAPSHOT_BLOCK_BYTES).min(end);
            let through = |owned: &Blocks| !owned.contains(block);
            let source = match known.deltas.iter().find(|(_, b)| b.contains(block)) {
                Some((epoch, _)) => Source::Delta(*epoch),
                None if known.owned.as_ref().is_some_and(through) => Source::Parent,
                None => Source::Live,
            };
            match runs.last_mut() {
                Some((s, _, len)) if *s == source => *len += next - at,
                _ => runs.push((source, at, next - at)),
            }
            at = next;
        }
        runs
    }

    /// Reads the runs as of `known`; `None` if the live chunk moved past it.
    async fn read_as_of(
        &self,
        known: &Known,
        index: u64,
        offset: u64,
        length: u32,
    ) -> Result<Option<Bytes>, IoError> {
        // The runs are read at once: a snapshot the writes have preserved much of
        // alternates between delta and live blocks, a request each.
        let runs = SnapshotChunks::plan(known, offset, length as u64);
        let pieces =
            futures::future::try_join_all(runs.into_iter().map(|(source, at, len)| async move {
                let data = match source {
                    // Delta blocks are written once and never change.
                    Source::Delta(epoch) => {
                        let delta = delta_index(epoch, index);
                        self.chunks.read(delta, at, len as u32).await?
                    }
                    Source::Parent => {
                        let parent = self.parent.as_ref().expect("a clone's");
                        parent.read(index, at, len as u32).await?
                    }
                    Source::Live => match self.read_live(known.version, index, at, len).await? {
                        Some(data) => data,
                        None => return Ok(None),
                    },
                };
                Ok::<_, IoError>(Some(data))
            }))
            .await?;
        let mut out = BytesMut::with_capacity(length as usize);
        for piece in pieces {
            match piece {
                Some(data) => out.extend_from_slice(&data),
                None => return Ok(None),
            }
        }
        Ok(Some(out.freeze()))
    }

    /// Reads `at..at + len` of the live chunk as of `version`; `None` once a change
    /// past it touched the range. Under steady writes a replica has nearly always
    /// taken some change past `version`, but seldom one in the range: the read then
    /// asks which ranges changed since and reads again as of the newer version
    /// (the range is as it was), instead of learning the whole chunk again.
    async fn read_live(
        &self,
        version: u64,
        index: u64,
        at: u64,
        len: u64,
    ) -> Result<Option<Bytes>, IoError> {
        let mut as_of = version;
        for _ in 0..LIVE_READ_TRIES {
            if let Some(data) = self
                .chunks
                .read_within(index, at, len as u32, as_of)
                .await?
            {
                return Ok(Some(data));
            }
            let Some((durable, ranges)) = self.chunks.changed_since(index, version).await? else {
                return Ok(None);
            };
            if ranges.iter().any(|&(o, l)| o < at + len && at < o + l) {
                return Ok(None);
            }
            // Any replica's answer will do: the range is as it was up to its version.
            as_of = durable;
        }
        Ok(None)
    }
}

#[async_trait]
impl ChunkIo for SnapshotChunks {
    async fn read(&self, index: u64, offset: u64, length: u32) -> Result<Bytes, IoError> {
        // Allocated at or after the snapshot's epoch (or not at all): it did not
        // exist when the snapshot was taken (a clone read its parent there).
        if !self.existed(index) {
            return match &self.parent {
                Some(parent) => parent.read(index, offset, length).await,
                None => Ok(BytesMut::zeroed(length as usize).freeze()),
            };
        }
        let deadline = Instant::now() + READ_DEADLINE;
        let mut known = self.known.lock().unwrap().get(&index).cloned();
        loop {
            let current = match known {
                Some(known) => known,
                None => self.learn(index).await?,
            };
            if let Some(data) = self.read_as_of(&current, index, offset, length).await? {
                return Ok(data);
            }
            if Instant::now() > deadline {
                return Err(IoError::Io(format!(
                    "chunk {index}: the volume's writes kept moving past this snapshot \
                     reader for {READ_DEADLINE:?}"
                )));
            }
            known = None;
        }
    }

    async fn write(&self, _: u64, _: u64, _: Bytes, _: bool) -> Result<(), IoError> {
        Err(IoError::ReadOnly)
    }

    async fn zero(&self, _: u64, _: u64, _: u64, _: bool) -> Result<(), IoError> {
        Err(IoError::ReadOnly)
    }

    async fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }

    fn is_allocated(&self, index: u64) -> bool {
        self.existed(index) || self.parent.as_ref().is_some_and(|p| p.is_allocated(index))
    }
}
