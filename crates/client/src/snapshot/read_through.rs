//! A clone's chunk layer: each 4 KiB block comes from the clone's own chunk once the
//! clone wrote it, else from the parent snapshot (same layout, chunk for chunk).
//!
//! A block the clone writes for the first time is copied up first, whole (the
//! parent's block written into the clone's chunk), so a chunk's blocks are either
//! the parent's or the clone's, never a hole standing for both; the blocks a chunk
//! holds are learned from its extents once, then kept. Zeroing writes zeroes (a
//! punched hole would read the parent again). The writer knows every block it
//! wrote; a read-only attach reads the clone's chunk as of the version its blocks
//! were learned at, and learns again when the writer moved past it.
//!
//! `floe volume flatten` copies up what the clone still reads from the parent
//! ([`flatten`](super::flatten)), after which the master forgets the parent.

use super::blocks::Blocks;
use super::reader::SnapshotChunks;
use crate::replicated::ReplicatedChunks;
use crate::stripe::ChunkIo;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use floe_blockdev::IoError;
use floe_protocol::snapshot::SNAPSHOT_BLOCK_BYTES;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Zeroes written per request.
const ZERO_PIECE_BYTES: u64 = 1 << 20;

/// The blocks of one of the clone's chunks, as of `version` of it (read-only).
struct Known {
    version: u64,
    blocks: Blocks,
}

/// What is known of a chunk; its lock is held by copy-ups, not by reads.
#[derive(Default)]
struct Written {
    known: Option<Arc<Known>>,
}

pub struct ReadThrough {
    /// Shared with the snapshot layer above a writer's (its delta chunks).
    chunks: Arc<ReplicatedChunks>,
    parent: SnapshotChunks,
    /// Opened for writing: this layer makes every change, so what it knows is
    /// current.
    writer: bool,
    written: Mutex<BTreeMap<u64, Arc<tokio::sync::Mutex<Written>>>>,
}

impl ReadThrough {
    pub fn new(chunks: Arc<ReplicatedChunks>, parent: SnapshotChunks, writer: bool) -> ReadThrough {
        ReadThrough {
            chunks,
            parent,
            writer,
            written: Mutex::default(),
        }
    }

    fn cell(&self, index: u64) -> Arc<tokio::sync::Mutex<Written>> {
        let mut written = self.written.lock().unwrap();
        written.entry(index).or_default().clone()
    }

    /// The chunk's blocks, learned again when `stale`. Only a read-only attach asks
    /// for the version: the writer's own versions must not be learned again while
    /// its changes are in flight.
    async fn learn(
        &self,
        index: u64,
        state: &mut Written,
        stale: bool,
    ) -> Result<Arc<Known>, IoError> {
        if let Some(known) = state.known.as_ref().filter(|_| !stale) {
            return Ok(known.clone());
        }
        let version = match self.writer {
            true => 0,
            false => self.chunks.current_version(index).await?,
        };
        let extents = self.chunks.extents(index).await?;
        let known = Arc::new(Known {
            version,
            blocks: Blocks::from_extents(&extents),
        });
        state.known = Some(known.clone());
        Ok(known)
    }

    /// Copies up the parent's blocks under `offset..offset + length` not yet written.
    async fn copy_up(&self, index: u64, offset: u64, length: u64) -> Result<(), IoError> {
        self.copy_missing(index, offset, length, true).await?;
        Ok(())
    }

    /// Copies the parent's blocks under `offset..offset + length` the clone still
    /// reads from there into the clone's chunk, but for zeroes (read as zeroes once
    /// the parent is gone); returns the bytes copied. For `floe volume flatten`.
    pub async fn own(&self, index: u64, offset: u64, length: u64) -> Result<u64, IoError> {
        self.copy_missing(index, offset, length, false).await
    }

    /// Whether the parent snapshot holds data in chunk `index`.
    pub fn parent_holds(&self, index: u64) -> bool {
        self.parent.is_allocated(index)
    }

    async fn copy_missing(
        &self,
        index: u64,
        offset: u64,
        length: u64,
        with_zeroes: bool,
    ) -> Result<u64, IoError> {
        let cell = self.cell(index);
        let mut state = cell.lock().await;
        let known = self.learn(index, &mut state, false).await?;
        let blocks =
            offset / SNAPSHOT_BLOCK_BYTES..(offset + length).div_ceil(SNAPSHOT_BLOCK_BYTES);
        let missing = known.blocks.missing(blocks);
        let mut blocks = known.blocks.clone();
        let mut copied = 0;
        for run in missing {
            let (at, bytes) = (
                run.start * SNAPSHOT_BLOCK_BYTES,
                (run.end - run.start) * SNAPSHOT_BLOCK_BYTES,
            );
            let old = self.parent.read(index, at, bytes as u32).await?;
            if !with_zeroes && old.iter().all(|b| *b == 0) {
                continue;
            }
            self.chunks.write(index, at, old, false).await?;
            copied += bytes;
            blocks.insert(run);
            state.known = Some(Arc::new(Known {
                version: known.version,
                blocks: blocks.clone(),
            }));
        }
        Ok(copied)
    }

    /// Reads as of what is known of the chunk; `None` when a read-only attach finds
    /// the writer moved past it.
    async fn read_known(
        &self,
        index: u64,
        known: &Known,
        offset: u64,
        length: u32,
    ) -> Result<Option<Bytes>, IoError> {
        let blocks = &known.blocks;
        let mut out = BytesMut::with_capacity(length as usize);
        let end = offset + length as u64;
        let mut at = offset;
        // The clone's own blocks last: its guarded read also proves that nothing
        // was copied up over the parent's blocks read before it.
        let mut own = Vec::new();
        while at < end {
            let block = at / SNAPSHOT_BLOCK_BYTES;
            let mine = blocks.contains(block);
            let mut stop = ((block + 1) * SNAPSHOT_BLOCK_BYTES).min(end);
            while stop < end && blocks.contains(stop / SNAPSHOT_BLOCK_BYTES) == mine {
                stop = ((stop / SNAPSHOT_BLOCK_BYTES + 1) * SNAPSHOT_BLOCK_BYTES).min(end);
            }
            let run = (stop - at) as u32;
            if mine {
                own.push((out.len(), at, run));
                out.resize(out.len() + run as usize, 0);
            } else {
                out.extend_from_slice(&self.parent.read(index, at, run).await?);
            }
            at = stop;
        }
        let max_version = if self.writer { u64::MAX } else { known.version };
        if own.is_empty() && !self.writer {
            // Still guard the parent's blocks: one block of the clone's chunk.
            let probe = self.chunks.read_within(index, offset, 1, max_version);
            if probe.await?.is_none() {
                return Ok(None);
            }
        }
        for (into, at, run) in own {
            match self.chunks.read_within(index, at, run, max_version).await? {
                Some(data) => out[into..into + run as usize].copy_from_slice(&data),
                None => return Ok(None),
            }
        }
        Ok(Some(out.freeze()))
    }
}

#[async_trait]
impl ChunkIo for ReadThrough {
    async fn read(&self, index: u64, offset: u64, length: u32) -> Result<Bytes, IoError> {
        if !self.chunks.is_allocated(index) && self.writer {
            return self.parent.read(index, offset, length).await;
        }
        let cell = self.cell(index);
        let mut stale = false;
        loop {
            let known = self.learn(index, &mut *cell.lock().await, stale).await?;
            if let Some(data) = self.read_known(index, &known, offset, length).await? {
                return Ok(data);
            }
            stale = true;
        }
    }

    async fn write(&self, index: u64, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        self.copy_up(index, offset, data.len() as u64).await?;
        self.chunks.write(index, offset, data, fua).await
    }

    async fn zero(
        &self,
        index: u64,
        offset: u64,
        length: u64,
        _punch: bool,
    ) -> Result<(), IoError> {
        self.copy_up(index, offset, length).await?;
        let end = offset + length;
        let mut at = offset;
        while at < end {
            let n = ZERO_PIECE_BYTES.min(end - at);
            let zeroes = BytesMut::zeroed(n as usize).freeze();
            self.chunks.write(index, at, zeroes, false).await?;
            at += n;
        }
        Ok(())
    }

    async fn flush(&self) -> Result<(), IoError> {
        self.chunks.flush().await
    }

    fn is_allocated(&self, index: u64) -> bool {
        self.chunks.is_allocated(index) || self.parent.is_allocated(index)
    }
}
