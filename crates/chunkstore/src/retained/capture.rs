//! The committer's side of retaining: the old blocks each change of a batch retains,
//! found in queue order before the batch is logged.
//!
//! A block's state just before change `i` of a batch is the chunk file's block with,
//! on top and in order, the held unsynced changes (plain mode keeps them out of the
//! chunk files until a sync) and the batch's changes before `i` (applied only after
//! the append). Reading at submit time instead would be wrong on a lagging replica,
//! whose earlier changes are still queued.

use super::{block_of, BLOCK_BYTES};
use crate::committer::{Change, Committer, Completions};
use crate::error::StoreError;
use crate::wal::{Kind, RecordHeader};
use bytes::Bytes;
use floe_protocol::ChunkId;
use std::collections::{BTreeMap, BTreeSet};

/// A `Retain` record: `offset` the block's, `length` [`BLOCK_BYTES`] or 0 (the block
/// was all zeroes, no data), `view` the epoch, `version` the retaining change's.
pub(crate) struct Retain {
    pub(crate) header: RecordHeader,
    pub(crate) data: Bytes,
}

impl Retain {
    pub(crate) fn epoch(header: &RecordHeader) -> u32 {
        u32::try_from(header.view).expect("a retain record's epoch fits in u32")
    }
}

impl Change {
    /// Records this change may log (itself and an old block per block it touches),
    /// and their data bytes: the batch bounds count these.
    pub(crate) fn log_bound(&self) -> (usize, usize) {
        let blocks = match self.retain {
            Some(_) => blocks(self.header.offset, self.header.length).count(),
            None => 0,
        };
        (1 + blocks, self.data.len() + blocks * BLOCK_BYTES as usize)
    }
}

/// The offsets of the blocks a range touches.
fn blocks(offset: u64, length: u64) -> impl Iterator<Item = u64> {
    let start = offset - offset % BLOCK_BYTES;
    (start..offset + length).step_by(BLOCK_BYTES as usize)
}

impl Committer {
    /// The `Retain` records each change of the batch logs before itself, in batch
    /// order. A change whose old block cannot be read (it fails its checksum, say)
    /// fails, with every later change of its chunk in the batch: those would retain
    /// blocks as if it had been applied. Failed changes leave the batch.
    pub(crate) fn capture(&self, batch: &mut Vec<Change>) -> (Vec<Vec<Retain>>, Completions) {
        // The common batch retains nothing: no lookups on the commit path.
        if batch.iter().all(|c| c.retain.is_none()) {
            return (batch.iter().map(|_| Vec::new()).collect(), Vec::new());
        }
        let mut taken: Taken = self
            .held_unsynced()
            .filter(|(header, _)| header.kind == Kind::Retain)
            .map(|(h, _)| ((h.chunk, Retain::epoch(h), block_of(h.offset)), h.version))
            .collect();
        let mut retains = Vec::with_capacity(batch.len());
        let mut failed: Vec<Option<StoreError>> = Vec::with_capacity(batch.len());
        let mut failed_chunks = BTreeSet::new();
        let mut forgotten = Vec::new();
        for i in 0..batch.len() {
            let change = &batch[i];
            let chunk = change.header.chunk;
            if let Some(forget) = Forget::of(&change.header) {
                taken.retain(|&(c, epoch, block), &mut tag| !forget.covers(c, epoch, block, tag));
                forgotten.push(forget);
            }
            // A block a repair installs.
            if change.header.kind == Kind::Retain {
                let h = &change.header;
                taken.insert((chunk, Retain::epoch(h), block_of(h.offset)), h.version);
            }
            if failed_chunks.contains(&chunk) {
                retains.push(Vec::new());
                failed.push(Some(StoreError::Io(
                    "an earlier change of this chunk failed in the same batch".into(),
                )));
                continue;
            }
            match self.retains_of(batch, i, &mut taken, &forgotten) {
                Ok(records) => {
                    retains.push(records);
                    failed.push(None);
                }
                Err(e) => {
                    failed_chunks.insert(chunk);
                    retains.push(Vec::new());
                    failed.push(Some(e));
                }
            }
        }
        if failed_chunks.is_empty() {
            return (retains, Vec::new());
        }
        let mut completions = Vec::new();
        let mut kept = Vec::new();
        let mut kept_retains = Vec::new();
        for ((change, records), failure) in batch.drain(..).zip(retains).zip(failed) {
            match failure {
                Some(e) => completions.push((change.done, Err(e))),
                None => {
                    kept.push(change);
                    kept_retains.push(records);
                }
            }
        }
        *batch = kept;
        (kept_retains, completions)
    }

    /// The records change `i` of the batch logs: one per block it touches that its
    /// epoch has not retained (in the store, held unsynced, or earlier in `taken`).
    fn retains_of(
        &self,
        batch: &[Change],
        i: usize,
        taken: &mut Taken,
        forgotten: &[Forget],
    ) -> Result<Vec<Retain>, StoreError> {
        let change = &batch[i];
        let Some(epoch) = change.retain else {
            return Ok(Vec::new());
        };
        let header = &change.header;
        let mut records = Vec::new();
        for at in blocks(header.offset, header.length) {
            let block = block_of(at);
            // What the store holds stands unless the batch drops it first.
            let stored = self
                .files
                .retained
                .tag_of(header.chunk, epoch, block)
                .is_some_and(|tag| {
                    let covered = |f: &Forget| f.covers(header.chunk, epoch, block, tag);
                    !forgotten.iter().any(covered)
                });
            let key = (header.chunk, epoch, block);
            if stored || taken.contains_key(&key) {
                continue;
            }
            taken.insert(key, header.version);
            let old = self.block_before(header.chunk, at, &batch[..i])?;
            let zeroes = old.iter().all(|&b| b == 0);
            records.push(Retain {
                header: RecordHeader {
                    seq: 0,
                    kind: Kind::Retain,
                    chunk: header.chunk,
                    offset: at,
                    length: if zeroes { 0 } else { BLOCK_BYTES },
                    view: epoch as u64,
                    version: header.version,
                },
                data: if zeroes { Bytes::new() } else { old.into() },
            });
        }
        Ok(records)
    }

    /// The chunk's block at `at` as the changes before `earlier`'s end leave it.
    fn block_before(
        &self,
        chunk: ChunkId,
        at: u64,
        earlier: &[Change],
    ) -> Result<Vec<u8>, StoreError> {
        let mut block = vec![0u8; BLOCK_BYTES as usize];
        if let Err(e) = self.files.read_into(chunk, at, &mut block, true) {
            if let StoreError::Corrupt { offset, place, .. } = &e {
                self.files.found_corrupt(chunk, *offset, place);
            }
            return Err(e);
        }
        // Hybrid mode reads its held unsynced writes from the journals already.
        let held = self
            .held_unsynced()
            .filter(|_| self.files.journals.is_none())
            .map(|(h, d)| (h, &d[..]));
        let batch = earlier.iter().map(|c| (&c.header, &c.data[..]));
        for (header, data) in held.chain(batch) {
            if header.kind == Kind::DeleteVolume && header.chunk.volume_id == chunk.volume_id {
                block.fill(0);
            } else if header.chunk == chunk {
                overlay(&mut block, at, header, data);
            }
        }
        Ok(block)
    }
}

/// Blocks retained by the held unsynced changes and the batch so far: (chunk, epoch,
/// block) -> tag.
type Taken = BTreeMap<(ChunkId, u32, u32), u64>;

/// A change of the batch that drops retained blocks.
enum Forget {
    Volume(u64),
    Epochs(ChunkId, std::ops::RangeInclusive<u32>),
    /// Those tagged above this version.
    Above(ChunkId, u64),
    /// One block of one epoch.
    Block(ChunkId, u32, u32),
}

impl Forget {
    fn of(header: &RecordHeader) -> Option<Forget> {
        match header.kind {
            Kind::DeleteVolume => Some(Forget::Volume(header.chunk.volume_id)),
            Kind::Release => Some(Forget::Epochs(
                header.chunk,
                header.offset as u32..=header.length as u32,
            )),
            Kind::Trim => Some(Forget::Above(header.chunk, header.version)),
            Kind::Forget => Some(Forget::Block(
                header.chunk,
                Retain::epoch(header),
                block_of(header.offset),
            )),
            _ => None,
        }
    }

    fn covers(&self, chunk: ChunkId, epoch: u32, block: u32, tag: u64) -> bool {
        match self {
            Forget::Volume(volume_id) => chunk.volume_id == *volume_id,
            Forget::Epochs(c, epochs) => *c == chunk && epochs.contains(&epoch),
            Forget::Above(c, above) => *c == chunk && tag > *above,
            Forget::Block(c, e, b) => *c == chunk && *e == epoch && *b == block,
        }
    }
}

/// Puts a change's effect on the block at `at` into `block`.
fn overlay(block: &mut [u8], at: u64, header: &RecordHeader, data: &[u8]) {
    let written = match header.kind {
        Kind::Write | Kind::Bypass => true,
        Kind::Zero | Kind::Punch => false,
        // Not the chunk's bytes (a volume's deletion is the caller's).
        Kind::Stamp
        | Kind::Retain
        | Kind::Release
        | Kind::Trim
        | Kind::Forget
        | Kind::Intent
        | Kind::DeleteVolume => return,
    };
    let start = header.offset.max(at);
    let end = (header.offset + header.length).min(at + BLOCK_BYTES);
    if start >= end {
        return;
    }
    let into = &mut block[(start - at) as usize..(end - at) as usize];
    match written {
        true => into.copy_from_slice(
            &data[(start - header.offset) as usize..(end - header.offset) as usize],
        ),
        false => into.fill(0),
    }
}
