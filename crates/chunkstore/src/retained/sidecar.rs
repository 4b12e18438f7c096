//! One chunk's retained blocks of one snapshot epoch: a data file of 4 KiB slots and
//! an index file of fixed entries, both appended in the order the blocks were
//! retained (entry `k` describes slot `k`).
//!
//! ```text
//! index entry (32 bytes): block u32 | flags u32 | tag u64 | data crc u32 | zero [8] | crc u32
//! ```
//! `block` is the block's number in the chunk, `tag` the version of the change that
//! retained it, `flags` bit 0 "the block was all zeroes" (its slot is never written),
//! bit 1 "dropped": a tombstone for the block's earlier entry (a repair trimmed it;
//! its slot is never written). The crc covers the entry's first 28 bytes.
//!
//! Crash safety comes from the log: every block retained since the last checkpoint
//! has its `Retain` record there. Its data goes to its slot at once (readers want
//! it), its index entry only at the checkpoint ([`Sidecar::save`], one write for all
//! of them), which syncs both files before the log forgets. Opening keeps the entries
//! up to the first one that does not check (a checkpoint cut short may leave a torn
//! tail); replaying the log then writes each record again, in place where its entry
//! survived, appended where not, so every block gets back the slot it had.

use crate::disk::{self, Disk, FileRef};
use bytes::{Buf, BufMut};
use std::collections::BTreeMap;
use std::io;
use std::path::Path;

use super::BLOCK_BYTES;

const ENTRY_BYTES: u64 = 32;

/// Bytes the index entries of `blocks` new slots may allocate (a partial page at
/// each end).
pub(crate) fn index_needs(blocks: u64) -> u64 {
    ((blocks * ENTRY_BYTES).div_ceil(BLOCK_BYTES) + 1) * BLOCK_BYTES
}
const ZEROES: u32 = 1;
const DROPPED: u32 = 2;

/// Where a retained block is, and what it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub(crate) ordinal: u32,
    pub(crate) tag: u64,
    /// crc32c of the block's bytes (0 for zeroes).
    pub(crate) crc: u32,
    pub(crate) zeroes: bool,
}

pub(crate) struct Sidecar {
    data: FileRef,
    index: FileRef,
    /// Block number -> slot.
    pub(crate) slots: BTreeMap<u32, Slot>,
    /// Slots taken.
    count: u32,
    /// Entries in the index file: those of slots from here on are in `unsaved`, a
    /// block and its slot (`None`: a tombstone).
    saved: u32,
    unsaved: Vec<(u32, Option<Slot>)>,
    /// The checksum of the last saved entry, which the next one's chains from.
    chain: u32,
}

impl Sidecar {
    /// Opens (creating with `create`) the two files and keeps the index entries up to
    /// the first that does not check. Each entry's checksum chains from the one
    /// before, so entries a torn save left past a hole never pass for ones written
    /// since over the hole.
    pub(crate) fn open(
        disk: &dyn Disk,
        data: &Path,
        index: &Path,
        create: bool,
    ) -> io::Result<Sidecar> {
        let index = disk.open(index, create)?;
        let data = disk.open(data, create)?;
        let mut raw = vec![0u8; index.size()? as usize];
        disk::read_at(&*index, &mut raw, 0)?;
        let mut sidecar = Sidecar {
            data,
            index,
            slots: BTreeMap::new(),
            count: 0,
            saved: 0,
            unsaved: Vec::new(),
            chain: 0,
        };
        for entry in raw.chunks_exact(ENTRY_BYTES as usize) {
            let Some((block, slot)) = decode(entry, sidecar.count, sidecar.chain) else {
                break;
            };
            sidecar.chain = (&entry[28..]).get_u32_le();
            match slot {
                None => {
                    sidecar.slots.remove(&block);
                }
                // A block has one live entry: this is a tail from before, past a torn
                // one.
                Some(_) if sidecar.slots.contains_key(&block) => break,
                Some(slot) => {
                    sidecar.slots.insert(block, slot);
                }
            }
            sidecar.count += 1;
        }
        sidecar.saved = sidecar.count;
        Ok(sidecar)
    }

    /// Writes block `block` as retained by the change of version `tag`. `None` data:
    /// all zeroes. An entry not saved yet is rewritten in place; one saved the same (a
    /// replay) keeps its entry and gets its bytes again; one saved otherwise gets a
    /// tombstone and the block a new slot, so a crash never pairs a saved entry with
    /// other bytes half written.
    /// Its index entry waits for [`Sidecar::save`].
    pub(crate) fn put(&mut self, block: u32, tag: u64, data: Option<&[u8]>) -> io::Result<()> {
        let (crc, zeroes) = (data.map_or(0, crc32c::crc32c), data.is_none());
        let old = self.slots.get(&block).copied();
        let saved = |s: &Slot| s.ordinal < self.saved;
        if let Some(same) =
            old.filter(|s| saved(s) && s.tag == tag && s.crc == crc && s.zeroes == zeroes)
        {
            // Its bytes again: a log replayed over a crash that tore them mends them.
            if let Some(data) = data {
                self.data
                    .write_all_at(data, same.ordinal as u64 * BLOCK_BYTES)?;
            }
            return Ok(());
        }
        let in_place = old.filter(|s| !saved(s)).map(|s| s.ordinal);
        let replaced = old.is_some() && in_place.is_none();
        let slot = Slot {
            ordinal: in_place.unwrap_or(self.count + replaced as u32),
            tag,
            crc,
            zeroes,
        };
        // Nothing changes in memory until the write succeeded.
        if let Some(data) = data {
            assert_eq!(data.len() as u64, BLOCK_BYTES, "retained blocks are whole");
            self.data
                .write_all_at(data, slot.ordinal as u64 * BLOCK_BYTES)?;
        }
        if replaced {
            self.count = self.count.checked_add(1).expect("slots fit in u32");
            self.unsaved.push((block, None));
        }
        match in_place {
            None => {
                self.count = self.count.checked_add(1).expect("slots fit in u32");
                self.unsaved.push((block, Some(slot)));
            }
            Some(ordinal) => {
                let unsaved = self
                    .unsaved
                    .iter_mut()
                    .find(|(_, s)| s.is_some_and(|s| s.ordinal == ordinal))
                    .expect("an unsaved slot has an unsaved entry");
                unsaved.1 = Some(slot);
            }
        }
        self.slots.insert(block, slot);
        Ok(())
    }

    /// Drops the blocks tagged above `above`, a tombstone each (their slots stay
    /// taken until the sidecar is released).
    pub(crate) fn trim(&mut self, above: u64) {
        let doomed: Vec<u32> = self
            .slots
            .iter()
            .filter(|(_, slot)| slot.tag > above)
            .map(|(&block, _)| block)
            .collect();
        for block in doomed {
            self.drop_block(block);
        }
    }

    /// Drops one block, a tombstone (its slot stays taken until the sidecar is
    /// released); false if it held none.
    pub(crate) fn drop_block(&mut self, block: u32) -> bool {
        if self.slots.remove(&block).is_none() {
            return false;
        }
        self.count = self.count.checked_add(1).expect("slots fit in u32");
        self.unsaved.push((block, None));
        true
    }

    /// Makes the data durable, then writes the index entries not yet saved and makes
    /// them durable: an entry on disk always has its bytes (hybrid mode replays no
    /// log into sidecars).
    pub(crate) fn save(&mut self) -> io::Result<()> {
        let mut entries = Vec::with_capacity(self.unsaved.len() * ENTRY_BYTES as usize);
        let mut chain = self.chain;
        for (block, slot) in &self.unsaved {
            let entry = encode(*block, slot.as_ref(), chain);
            chain = (&entry[28..]).get_u32_le();
            entries.extend_from_slice(&entry);
        }
        self.data.sync_data()?;
        self.index
            .write_all_at(&entries, self.saved as u64 * ENTRY_BYTES)?;
        self.index.sync_data()?;
        self.saved = self.count;
        self.unsaved.clear();
        self.chain = chain;
        Ok(())
    }

    /// The bytes of a retained block, `None` when they fail their checksum.
    pub(crate) fn read(&self, slot: &Slot) -> io::Result<Option<Vec<u8>>> {
        let mut out = vec![0u8; BLOCK_BYTES as usize];
        if slot.zeroes {
            return Ok(Some(out));
        }
        disk::read_at(&*self.data, &mut out, slot.ordinal as u64 * BLOCK_BYTES)?;
        Ok((crc32c::crc32c(&out) == slot.crc).then_some(out))
    }

    /// Bytes of retained data held.
    pub(crate) fn data_bytes(&self) -> u64 {
        self.slots.values().filter(|s| !s.zeroes).count() as u64 * BLOCK_BYTES
    }
}

/// An entry after one whose checksum is `chain`; a tombstone for `None`.
fn encode(block: u32, slot: Option<&Slot>, chain: u32) -> [u8; ENTRY_BYTES as usize] {
    let mut out = [0u8; ENTRY_BYTES as usize];
    let mut w = &mut out[..];
    w.put_u32_le(block);
    let flags = match slot {
        None => DROPPED,
        Some(slot) if slot.zeroes => ZEROES,
        Some(_) => 0,
    };
    w.put_u32_le(flags);
    w.put_u64_le(slot.map_or(0, |s| s.tag));
    w.put_u32_le(slot.map_or(0, |s| s.crc));
    let crc = crc32c::crc32c_append(chain, &out[..28]);
    out[28..].copy_from_slice(&crc.to_le_bytes());
    out
}

/// An entry that checks after one whose checksum is `chain`: its block and its slot,
/// `None` for a tombstone.
fn decode(raw: &[u8], ordinal: u32, chain: u32) -> Option<(u32, Option<Slot>)> {
    if crc32c::crc32c_append(chain, &raw[..28]) != (&raw[28..]).get_u32_le() {
        return None;
    }
    let mut r = raw;
    let block = r.get_u32_le();
    let flags = r.get_u32_le();
    let slot = Slot {
        ordinal,
        tag: r.get_u64_le(),
        crc: r.get_u32_le(),
        zeroes: flags & ZEROES != 0,
    };
    Some((block, (flags & DROPPED == 0).then_some(slot)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::RealDisk;

    #[test]
    fn entries_survive_a_reopen_and_a_torn_tail_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let (data, index) = (dir.path().join("d"), dir.path().join("i"));
        let mut sidecar = Sidecar::open(&RealDisk, &data, &index, true).unwrap();
        sidecar.put(7, 100, Some(&[7u8; 4096])).unwrap();
        sidecar.put(3, 101, None).unwrap();
        sidecar.put(9, 102, Some(&[9u8; 4096])).unwrap();
        let unsaved = Sidecar::open(&RealDisk, &data, &index, false).unwrap();
        assert!(unsaved.slots.is_empty(), "entries wait for the checkpoint");
        sidecar.save().unwrap();
        // The middle entry torn: the last is forgotten with it.
        let file = RealDisk.open(&index, false).unwrap();
        file.write_all_at(&[0xff], ENTRY_BYTES + 5).unwrap();
        let mut back = Sidecar::open(&RealDisk, &data, &index, false).unwrap();
        assert_eq!(back.slots.len(), 1);
        let slot = back.slots[&7];
        assert_eq!(back.read(&slot).unwrap(), Some(vec![7u8; 4096]));
        // A replay writes them again, each into the slot it had.
        back.put(3, 101, None).unwrap();
        back.put(9, 102, Some(&[9u8; 4096])).unwrap();
        back.save().unwrap();
        let back = Sidecar::open(&RealDisk, &data, &index, false).unwrap();
        assert_eq!(back.slots[&3].ordinal, 1);
        assert_eq!(back.slots[&9].ordinal, 2);
        assert_eq!(back.read(&back.slots[&3]).unwrap(), Some(vec![0u8; 4096]));
        // A block whose bytes rotted reads as failing its checksum.
        let file = RealDisk.open(&data, false).unwrap();
        file.write_all_at(&[1], 2 * BLOCK_BYTES + 9).unwrap();
        assert_eq!(back.read(&back.slots[&9]).unwrap(), None);
        assert_eq!(back.data_bytes(), 2 * BLOCK_BYTES);
    }
}
