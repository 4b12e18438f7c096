//! Retained blocks: what a block of a chunk held before the first change of a
//! snapshot epoch overwrote it, kept by the replica itself so a snapshot costs the
//! writer no copy (docs/ARCHITECTURE.md, Snapshots; docs/replica-retention-review.md).
//!
//! - A change submitted with `retain: Some(t)` retains, for each 4 KiB block it
//!   touches that epoch `t` has not retained yet, the block as it was just before the
//!   change. The committer finds it ([`capture`]) in queue order, from the batch's
//!   earlier changes, the held unsynced ones, or the chunk file, and logs it as a
//!   `Retain` record *before* the change: a power cut keeps a prefix of the log, so
//!   a change that survives has its old blocks.
//! - Applying a `Retain` record appends the block to the chunk's sidecar for that
//!   epoch ([`sidecar`]): `chunks/VOLUME/INDEX.rEPOCH` (data) and `.iEPOCH` (index).
//!   Checkpoints write the index entries and sync the sidecars before the log
//!   forgets their records.
//! - A `Release` record drops a chunk's sidecars of a range of epochs (a replica
//!   dropped, or epochs no snapshot reads); deleting a volume drops its sidecars with
//!   its chunk files.
//!
//! Every store retains. A chained log reads the old block from the chain and keeps
//! it in the same sidecars, in its data directory (re-keying the chain's own slot
//! would copy nothing: a later step). A hybrid store logs no `Retain` record: it
//! puts the old blocks in their sidecars, durably, before the change overwrites the
//! chunk file or is journaled (`crate::hybrid_commit`).

pub(crate) mod capture;
mod sidecar;

use crate::disk::Disk;
use crate::error::StoreError;
use crate::layout;
use bytes::Bytes;
use floe_protocol::ChunkId;
use sidecar::Sidecar;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, ErrorKind};
use std::ops::RangeInclusive;
use std::path::Path;
use std::sync::Mutex;

pub(crate) use crate::block_sums::BLOCK_BYTES;

/// The largest change that may retain: its old blocks are logged with it, and a
/// batch's records must fit the log's spare room (`committer::BATCH_ROOM_BYTES`).
pub const RETAIN_CHANGE_BYTES_MAX: u64 = 8 << 20;

/// What a retained block held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetainedBlock {
    Zeroes,
    Data(Bytes),
}

/// One retained block of a chunk, as [`crate::Store::retained`] lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RetainedEntry {
    pub epoch: u32,
    /// The block's offset in the chunk.
    pub offset: u64,
    /// The version of the change that retained it.
    pub tag: u64,
    pub zeroes: bool,
}

/// Every sidecar of the store, open.
///
/// A sidecar's index file is what makes it exist: dropping one removes the index
/// only, and its data file once that removal is durable ([`Retained::unlink_dropped`]),
/// so a crash that keeps some directory changes and not others never leaves an index
/// without its data. A data file without an index is removed when the store opens.
#[derive(Default)]
pub(crate) struct Retained {
    sidecars: Mutex<BTreeMap<(ChunkId, u32), Sidecar>>,
    /// Dropped sidecars whose data files go once their indexes' removal is durable.
    dropped: Mutex<BTreeSet<(ChunkId, u32)>>,
}

impl Retained {
    /// Opens every sidecar under the data directory `dir`.
    pub(crate) fn load(disk: &dyn Disk, dir: &Path) -> io::Result<Retained> {
        let mut sidecars = BTreeMap::new();
        let chunks = layout::chunks_dir(dir);
        for volume in disk.read_dir(&chunks)? {
            let Some(volume_id) = layout::parse_hex(&volume) else {
                continue;
            };
            let names = disk.read_dir(&chunks.join(&volume))?;
            for name in &names {
                if let Some((index, epoch)) = layout::retained_index_of(name) {
                    let chunk = ChunkId { volume_id, index };
                    let sidecar = open(disk, dir, chunk, epoch)?;
                    sidecars.insert((chunk, epoch), sidecar);
                }
            }
            for name in &names {
                if let Some((index, epoch)) = layout::retained_data_of(name) {
                    let chunk = ChunkId { volume_id, index };
                    if !sidecars.contains_key(&(chunk, epoch)) {
                        remove(disk, &layout::retained_data_path(dir, chunk, epoch))?;
                    }
                }
            }
        }
        Ok(Retained {
            sidecars: Mutex::new(sidecars),
            dropped: Mutex::default(),
        })
    }

    /// The tag of block `block` of the chunk if epoch `epoch` retained it.
    pub(crate) fn tag_of(&self, chunk: ChunkId, epoch: u32, block: u32) -> Option<u64> {
        let sidecars = self.sidecars.lock().unwrap();
        Some(sidecars.get(&(chunk, epoch))?.slots.get(&block)?.tag)
    }

    /// Applies a `Retain` record; true when it made the sidecar's files (their
    /// directory entries want a sync).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn put(
        &self,
        disk: &dyn Disk,
        dir: &Path,
        chunk: ChunkId,
        epoch: u32,
        block: u32,
        tag: u64,
        data: Option<&[u8]>,
    ) -> io::Result<bool> {
        let mut sidecars = self.sidecars.lock().unwrap();
        let created = !sidecars.contains_key(&(chunk, epoch));
        if created {
            // Made again where one was dropped: its data file is this one's now.
            self.dropped.lock().unwrap().remove(&(chunk, epoch));
            // Its chunk may have no file yet (retained holes), nor a directory.
            disk.create_dir_all(&layout::volume_dir(dir, chunk.volume_id))?;
            let sidecar = open(disk, dir, chunk, epoch)?;
            sidecars.insert((chunk, epoch), sidecar);
        }
        let sidecar = sidecars.get_mut(&(chunk, epoch)).expect("opened above");
        sidecar.put(block, tag, data)?;
        Ok(created)
    }

    /// The block at `offset` as epoch `epoch` retained it; `None` if it did not.
    pub(crate) fn read(
        &self,
        chunk: ChunkId,
        epoch: u32,
        offset: u64,
    ) -> Result<Option<RetainedBlock>, StoreError> {
        let block = block_of(offset);
        let sidecars = self.sidecars.lock().unwrap();
        let Some(sidecar) = sidecars.get(&(chunk, epoch)) else {
            return Ok(None);
        };
        let Some(slot) = sidecar.slots.get(&block) else {
            return Ok(None);
        };
        if slot.zeroes {
            return Ok(Some(RetainedBlock::Zeroes));
        }
        match sidecar.read(slot)? {
            Some(data) => Ok(Some(RetainedBlock::Data(data.into()))),
            None => Err(StoreError::Corrupt {
                chunk,
                offset: block as u64 * BLOCK_BYTES,
                place: "retained block",
            }),
        }
    }

    /// The block at `offset` as snapshot `epoch` has it, if some epoch from `epoch` on
    /// retained it: the lowest such epoch's copy, the block as that epoch first found
    /// it, which no epoch between `epoch` and it changed.
    pub(crate) fn as_of(
        &self,
        chunk: ChunkId,
        epoch: u32,
        offset: u64,
    ) -> Result<Option<RetainedBlock>, StoreError> {
        let block = block_of(offset);
        let lowest = {
            let sidecars = self.sidecars.lock().unwrap();
            sidecars
                .range((chunk, epoch)..=(chunk, u32::MAX))
                .find(|(_, sidecar)| sidecar.slots.contains_key(&block))
                .map(|(&(_, epoch), _)| epoch)
        };
        match lowest {
            Some(lowest) => self.read(chunk, lowest, offset),
            None => Ok(None),
        }
    }

    /// The chunk's retained blocks, ordered by epoch and offset.
    pub(crate) fn entries(&self, chunk: ChunkId) -> Vec<RetainedEntry> {
        let sidecars = self.sidecars.lock().unwrap();
        let mut entries: Vec<RetainedEntry> = sidecars
            .range((chunk, 0)..=(chunk, u32::MAX))
            .flat_map(|(&(_, epoch), sidecar)| {
                sidecar
                    .slots
                    .iter()
                    .map(move |(&block, slot)| RetainedEntry {
                        epoch,
                        offset: block as u64 * BLOCK_BYTES,
                        tag: slot.tag,
                        zeroes: slot.zeroes,
                    })
            })
            .collect();
        entries.sort_unstable();
        entries
    }

    /// Applies a `Release` record: drops the chunk's sidecars of `epochs`.
    pub(crate) fn release(
        &self,
        disk: &dyn Disk,
        dir: &Path,
        chunk: ChunkId,
        epochs: RangeInclusive<u32>,
    ) -> io::Result<()> {
        let mut sidecars = self.sidecars.lock().unwrap();
        let doomed: Vec<u32> = sidecars
            .range((chunk, *epochs.start())..=(chunk, *epochs.end()))
            .map(|(&(_, epoch), _)| epoch)
            .collect();
        for epoch in doomed {
            sidecars.remove(&(chunk, epoch));
            remove(disk, &layout::retained_index_path(dir, chunk, epoch))?;
            self.dropped.lock().unwrap().insert((chunk, epoch));
        }
        Ok(())
    }

    /// Removes the data files of dropped sidecars: their indexes' removal is durable
    /// (a directory sync just made it so).
    pub(crate) fn unlink_dropped(&self, disk: &dyn Disk, dir: &Path) -> io::Result<()> {
        let dropped = std::mem::take(&mut *self.dropped.lock().unwrap());
        for (chunk, epoch) in dropped {
            remove(disk, &layout::retained_data_path(dir, chunk, epoch))?;
        }
        Ok(())
    }

    /// Applies a `Trim` record: drops the chunk's blocks tagged above `above`; the
    /// epochs of the sidecars it changed (they want a save).
    pub(crate) fn trim(&self, chunk: ChunkId, above: u64) -> Vec<u32> {
        let mut sidecars = self.sidecars.lock().unwrap();
        let mut trimmed = Vec::new();
        for (&(_, epoch), sidecar) in sidecars.range_mut((chunk, 0)..=(chunk, u32::MAX)) {
            if sidecar.slots.values().any(|slot| slot.tag > above) {
                sidecar.trim(above);
                trimmed.push(epoch);
            }
        }
        trimmed
    }

    /// Applies a `Forget` record: drops one block of the chunk's sidecar of `epoch`;
    /// true when it held it (the sidecar wants a save).
    pub(crate) fn forget(&self, chunk: ChunkId, epoch: u32, block: u32) -> bool {
        let mut sidecars = self.sidecars.lock().unwrap();
        sidecars
            .get_mut(&(chunk, epoch))
            .is_some_and(|sidecar| sidecar.drop_block(block))
    }

    /// Forgets a deleted volume's sidecars (their files went with its directory).
    pub(crate) fn forget_volume(&self, volume_id: u64) {
        self.sidecars
            .lock()
            .unwrap()
            .retain(|(chunk, _), _| chunk.volume_id != volume_id);
        self.dropped
            .lock()
            .unwrap()
            .retain(|(chunk, _)| chunk.volume_id != volume_id);
    }

    /// Saves the named sidecars' index entries and makes them durable (a checkpoint);
    /// released ones are gone already.
    pub(crate) fn save(&self, dirty: &BTreeSet<(ChunkId, u32)>) -> io::Result<()> {
        let mut sidecars = self.sidecars.lock().unwrap();
        for key in dirty {
            if let Some(sidecar) = sidecars.get_mut(key) {
                sidecar.save()?;
            }
        }
        Ok(())
    }

    /// The volume's sidecars: (chunk, epoch, bytes of data).
    pub(crate) fn sidecars_of(&self, volume_id: u64) -> Vec<(ChunkId, u32, u64)> {
        let first = ChunkId {
            volume_id,
            index: 0,
        };
        let last = ChunkId {
            volume_id,
            index: u64::MAX,
        };
        let sidecars = self.sidecars.lock().unwrap();
        sidecars
            .range((first, 0)..=(last, u32::MAX))
            .map(|(&(chunk, epoch), sidecar)| (chunk, epoch, sidecar.data_bytes()))
            .collect()
    }

    /// Bytes of retained data held, every chunk.
    pub(crate) fn bytes(&self) -> u64 {
        let sidecars = self.sidecars.lock().unwrap();
        sidecars.values().map(Sidecar::data_bytes).sum()
    }
}

/// Bytes a retaining change of `length` at `offset` may allocate, the change and
/// the old blocks it keeps together. Where a block held data the change allocates
/// nothing in the chunk file but keeps a block in a sidecar; where it held a hole the
/// change may allocate and keeps only a mark: so the range's own bound covers both,
/// a punch included, plus the index entries.
pub(crate) fn retaining_needs(offset: u64, length: u64) -> u64 {
    if length == 0 {
        return 0;
    }
    let blocks = (offset + length).div_ceil(BLOCK_BYTES) - offset / BLOCK_BYTES;
    crate::space::write_needs(offset, length) + sidecar::index_needs(blocks)
}

/// The number of the block holding `offset` in its chunk.
pub(crate) fn block_of(offset: u64) -> u32 {
    u32::try_from(offset / BLOCK_BYTES).expect("chunks hold fewer than 2^32 blocks")
}

/// Removes a file, gone already or not.
fn remove(disk: &dyn Disk, path: &Path) -> io::Result<()> {
    match disk.remove_file(path) {
        Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn open(disk: &dyn Disk, dir: &Path, chunk: ChunkId, epoch: u32) -> io::Result<Sidecar> {
    Sidecar::open(
        disk,
        &layout::retained_data_path(dir, chunk, epoch),
        &layout::retained_index_path(dir, chunk, epoch),
        true,
    )
}
