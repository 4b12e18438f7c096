//! The chained-log engine (Gecko, the thesis's chapter 3): chunk data lives in one
//! log chained across several disks instead of in chunk files. Writes go only to
//! the log's tail, on one disk at a time; when that disk's part fills, the tail moves
//! on to the next; the head is cleaned by moving its live blocks to the tail. Reads
//! of recent data come from a RAM tail cache, so the tail disk does sequential
//! writes only, and reads of older data go to the other (body) disks.
//!
//! - [`disks`]: the chain of disks and its circular address space.
//! - [`map`]: the forward map (chunk block -> position) and the inverse map.
//! - [`pages`]: the inverse map saved on the cache (flash) directory; recovery.
//! - [`tail_cache`]: the recent blocks in RAM.
//! - [`flash_cache`]: more recent blocks in a ring file on the cache directory.
//! - [`gc`]: move-to-tail cleaning, throttled against client writes.
//! - [`compact`]: compact-in-body cleaning, the same walk into holes of the body.
//! - [`cost`]: GetCost, what reading a block costs now (for a replica choice).
//! - [`placement`]: the chain's layout of the log over the disks, or the striped
//!   one of the benchmark's RAID-0 baseline.
//!
//! The write-ahead log still orders and makes durable every change (data and replica
//! state): the chain replaces the chunk files, not the log. A change is applied to
//! the chain after its record is synced; the map is saved (after the disks are
//! synced) at each log checkpoint and whenever cleaning needs freed segments back.
//! After a power cut the saved map is the chain's state, and replaying the log from
//! its checkpoint redoes every later change on top: changes are idempotent, so one
//! already in the saved map is simply written again.

mod compact;
mod cost;
mod disks;
mod flash_cache;
mod gc;
mod map;
mod pages;
mod placement;
mod tail_cache;

use crate::block_sums::BLOCK_BYTES;
use crate::disk::Disk;
use crate::error::StoreError;
use crate::wal::{Kind, RecordHeader};
use disks::{Disks, SEGMENT_BLOCKS};
use flash_cache::FlashCache;
use floe_protocol::ChunkId;
use map::{BlockKey, Maps, Slot};
use pages::Geometry;
use std::collections::VecDeque;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};
use tail_cache::TailCache;

pub use compact::Gc;
pub use cost::ReadCost;
pub(crate) use disks::LOG_FILE;
pub use placement::Layout;

/// Segments kept free for the cleaner's own moves: client writes stop short of them.
const RESERVE_SEGMENTS: u64 = 2;
/// The smallest chain: the reserve, and room to write and clean beside it.
const CHAIN_SEGMENTS_MIN: u64 = 4 * RESERVE_SEGMENTS;
/// Fraction of the log (1/N) below which free space starts the cleaner, unless a
/// disk's worth is more (see [`State::low_water`]).
const LOW_WATER_DIVISOR: u64 = 4;
/// Freed segments (1/N of the log) that make the map be saved to hand them back.
const SAVE_FREED_DIVISOR: u64 = 16;
/// A crc that can never match: a block written over a corrupt one keeps failing.
const POISON: u32 = 0x5a5a_5a5a;

/// Where a chain lives and how big it is.
#[derive(Debug, Clone)]
pub struct ChainOptions {
    /// The disks' directories, in chain order (each holds `chain.log`).
    pub disks: Vec<PathBuf>,
    /// The flash directory holding the saved map (`chain.map`).
    pub cache_dir: PathBuf,
    /// Bytes of each disk's log, allocated when the store opens.
    pub disk_bytes: u64,
    /// Bytes of the RAM tail cache.
    pub cache_bytes: u64,
    /// Bytes of the flash tail cache in `cache_dir` (0: none).
    pub flash_cache_bytes: u64,
    /// Chained (the engine) or striped (the benchmark's RAID-0 baseline only).
    pub layout: Layout,
    /// Where the cleaner puts the head's live blocks.
    pub gc: Gc,
}

/// What the chain did since it opened, and how full it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChainStats {
    pub capacity_blocks: u64,
    /// The position the tail writes next: positions count up from 0 and never
    /// wrap, a position's block is `position % capacity_blocks`.
    pub tail: u64,
    pub live_blocks: u64,
    /// Blocks the tail may write before it must wait for cleaning.
    pub free_blocks: u64,
    /// Live blocks the cleaner moved to the tail, and into holes of the body.
    pub gc_moved_blocks: u64,
    pub gc_compacted_blocks: u64,
    pub gc_freed_segments: u64,
    pub map_saves: u64,
    pub reads_cache: u64,
    pub reads_flash_cache: u64,
    pub reads_tail_disk: u64,
    pub reads_body_disk: u64,
    /// Blocks the cleaner read from the tail's disk and from the others.
    pub gc_reads_tail_disk: u64,
    pub gc_reads_body_disk: u64,
}

impl ChainStats {
    /// The share of the cleaned segments' blocks that were live (moved or
    /// compacted). Move-to-tail writes those again at the tail, so the clients get
    /// at most the rest of the tail disk (the thesis's Figure 3.3).
    pub fn gc_live_share(&self) -> f64 {
        let cleaned = self.gc_freed_segments * disks::SEGMENT_BLOCKS;
        let live = self.gc_moved_blocks + self.gc_compacted_blocks;
        match cleaned {
            0 => 0.0,
            _ => live as f64 / cleaned as f64,
        }
    }
}

#[derive(Default)]
struct Counters {
    gc_moved_blocks: AtomicU64,
    gc_compacted_blocks: AtomicU64,
    gc_freed_segments: AtomicU64,
    map_saves: AtomicU64,
    reads_cache: AtomicU64,
    reads_flash_cache: AtomicU64,
    reads_tail_disk: AtomicU64,
    reads_body_disk: AtomicU64,
    gc_reads_tail_disk: AtomicU64,
    gc_reads_body_disk: AtomicU64,
}

pub(crate) struct Chain {
    state: RwLock<State>,
}

pub(crate) struct State {
    /// Where the map is saved.
    disk: Arc<dyn Disk>,
    cache_dir: PathBuf,
    disks: Disks,
    maps: Maps,
    /// The oldest segment still in the log's body.
    head_segment: u64,
    /// The head as of the last saved map: the tail stops before this segment's lap.
    durable_head_segment: u64,
    /// The next position the cleaner looks at, in the head segment.
    gc_cursor: u64,
    /// The head the cleaner read ahead, oldest first (see [`gc::HeadRead`]).
    gc_reads: VecDeque<gc::HeadRead>,
    /// The next position written.
    tail: u64,
    /// Blocks appended and not yet written: one write per segment's worth.
    run: Vec<u8>,
    gc: compact::Gc,
    /// Compact-in-body's free positions, as of the last map save.
    holes: compact::Holes,
    cache: TailCache,
    flash: FlashCache,
    counters: Counters,
}

impl Chain {
    /// Opens the chain, rebuilding its maps from the last saved map.
    pub(crate) fn open(disk: Arc<dyn Disk>, options: &ChainOptions) -> Result<Chain, StoreError> {
        let disks = Disks::open(&*disk, &options.disks, options.disk_bytes, options.layout)?;
        let total = disks.total_blocks();
        if disks.count() == 0 || total < CHAIN_SEGMENTS_MIN * SEGMENT_BLOCKS {
            return Err(StoreError::Io(format!(
                "a chain needs at least {CHAIN_SEGMENTS_MIN} MiB of disk in all, has {} MiB on {} disks",
                (total * BLOCK_BYTES) >> 20,
                disks.count()
            )));
        }
        disk.create_dir_all(&options.cache_dir)?;
        crate::disk::sync_dir_and_parents(&*disk, &options.cache_dir)?;
        let geometry = Geometry::of(&disks);
        let mut maps = Maps::new(total);
        let (head_segment, tail) = match pages::load(&*disk, &options.cache_dir, geometry)? {
            Some(saved) => {
                for (position, key, crc) in saved.entries {
                    assert!(
                        position < saved.tail && position / SEGMENT_BLOCKS >= saved.head_segment,
                        "a saved block outside the body"
                    );
                    assert!(maps.get(key).is_none(), "a block saved twice");
                    maps.set(key, Slot { position, crc });
                }
                saved.chunks.into_iter().for_each(|c| maps.touch(c));
                (saved.head_segment, saved.tail)
            }
            None => (0, 0),
        };
        tracing::info!(
            disks = disks.count(),
            capacity_mib = (total * BLOCK_BYTES) >> 20,
            live_mib = (maps.live_blocks() * BLOCK_BYTES) >> 20,
            "chain opened"
        );
        let flash = FlashCache::open(&*disk, &options.cache_dir, options.flash_cache_bytes)?;
        let mut state = State {
            disk,
            cache_dir: options.cache_dir.clone(),
            disks,
            maps,
            head_segment,
            durable_head_segment: head_segment,
            gc_cursor: head_segment * SEGMENT_BLOCKS,
            gc_reads: VecDeque::new(),
            tail,
            run: Vec::new(),
            cache: TailCache::new(options.cache_bytes),
            flash,
            counters: Counters::default(),
            gc: options.gc,
            holes: Default::default(),
        };
        state.find_holes();
        Ok(Chain {
            state: RwLock::new(state),
        })
    }

    /// A logged change's effect on the chain; returns the offsets of blocks found
    /// corrupt when a partial write read them.
    pub(crate) fn apply(&self, header: &RecordHeader, data: &[u8]) -> Result<Vec<u64>, StoreError> {
        let mut state = self.state.write().unwrap();
        let chunk = header.chunk;
        let fill = match header.kind {
            Kind::Stamp | Kind::Intent => return Ok(Vec::new()),
            Kind::DeleteVolume => {
                state.maps.delete_volume(chunk.volume_id);
                return Ok(Vec::new());
            }
            Kind::Write | Kind::Bypass => Some(data),
            Kind::Zero | Kind::Punch => None,
            Kind::Retain | Kind::Release | Kind::Trim | Kind::Forget => {
                unreachable!("retained blocks live in sidecars beside the chain")
            }
        };
        state.maps.touch(chunk);
        let before = state.tail;
        let corrupt = state.write_range(chunk, header.offset, header.length, fill)?;
        let written = state.tail - before;
        state.clean_behind(written)?;
        Ok(corrupt)
    }

    /// Makes everything applied so far durable (a log checkpoint).
    pub(crate) fn persist(&self) -> Result<(), StoreError> {
        self.state.write().unwrap().save()
    }

    /// Reads `out.len()` bytes at `offset`; blocks never written read as zeroes.
    pub(crate) fn read(
        &self,
        chunk: ChunkId,
        offset: u64,
        out: &mut [u8],
        check: bool,
    ) -> Result<(), StoreError> {
        let state = self.state.read().unwrap();
        let end = offset + out.len() as u64;
        let mut block = vec![0u8; BLOCK_BYTES as usize];
        let mut at = offset;
        while at < end {
            let block_start = at / BLOCK_BYTES * BLOCK_BYTES;
            let upto = end.min(block_start + BLOCK_BYTES);
            let part = &mut out[(at - offset) as usize..(upto - offset) as usize];
            let key = BlockKey {
                chunk,
                block: block_start / BLOCK_BYTES,
            };
            match state.maps.get(key) {
                None => part.fill(0),
                Some(slot) => {
                    state.read_block(slot.position, &mut block)?;
                    if check && crc32c::crc32c(&block) != slot.crc {
                        return Err(StoreError::Corrupt {
                            chunk,
                            offset: block_start,
                            place: "chain",
                        });
                    }
                    let from = (at - block_start) as usize;
                    part.copy_from_slice(&block[from..from + part.len()]);
                }
            }
            at = upto;
        }
        Ok(())
    }

    /// The chunk's ranges that hold data, sorted and disjoint.
    pub(crate) fn extents(&self, chunk: ChunkId) -> Vec<(u64, u64)> {
        let state = self.state.read().unwrap();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (&block, _) in state.maps.blocks(chunk) {
            let at = block * BLOCK_BYTES;
            match out.last_mut() {
                Some((o, l)) if *o + *l == at => *l += BLOCK_BYTES,
                _ => out.push((at, BLOCK_BYTES)),
            }
        }
        out
    }

    pub(crate) fn chunks(&self) -> Vec<ChunkId> {
        let state = self.state.read().unwrap();
        state.maps.chunks.iter().copied().collect()
    }

    pub(crate) fn stats(&self) -> ChainStats {
        let state = self.state.read().unwrap();
        let c = &state.counters;
        ChainStats {
            capacity_blocks: state.disks.total_blocks(),
            tail: state.tail,
            live_blocks: state.maps.live_blocks(),
            free_blocks: state.room(),
            gc_moved_blocks: c.gc_moved_blocks.load(Relaxed),
            gc_compacted_blocks: c.gc_compacted_blocks.load(Relaxed),
            gc_freed_segments: c.gc_freed_segments.load(Relaxed),
            map_saves: c.map_saves.load(Relaxed),
            reads_cache: c.reads_cache.load(Relaxed),
            reads_flash_cache: c.reads_flash_cache.load(Relaxed),
            reads_tail_disk: c.reads_tail_disk.load(Relaxed),
            reads_body_disk: c.reads_body_disk.load(Relaxed),
            gc_reads_tail_disk: c.gc_reads_tail_disk.load(Relaxed),
            gc_reads_body_disk: c.gc_reads_body_disk.load(Relaxed),
        }
    }
}

impl State {
    /// The throttled cleaning after a client write of `written` blocks.
    fn clean_behind(&mut self, written: u64) -> Result<(), StoreError> {
        if self.cleaning_due() {
            self.clean(written * gc::MOVES_PER_WRITTEN_BLOCK, u64::MAX)?;
        }
        let freed = self.head_segment - self.durable_head_segment;
        if freed > 0 && (freed >= self.save_batch_segments() || self.room() < self.low_water() / 2)
        {
            self.save()?;
        }
        Ok(())
    }

    /// Free blocks below which the cleaner runs: a quarter of the chain, or, with
    /// several disks, a whole disk and a segment, whichever is more. The disk's worth
    /// keeps the head (the oldest live data) off the tail's disk (the thesis's
    /// chain: the tail disk holds only what the tail wrote since it got there, all
    /// of it in the tail caches when they are a disk big): the cleaner's reads and
    /// reads of old data go to the body's disks and never seek the tail's arm away
    /// from its writes. A quarter of three disks left the head on the tail's disk a
    /// quarter of the time. The segment is the cleaner's slack: it runs once below
    /// the mark and frees whole segments.
    fn low_water(&self) -> u64 {
        let quarter = self.disks.total_blocks() / LOW_WATER_DIVISOR;
        match self.disks.count() {
            1 => quarter,
            _ => quarter.max(self.disks.blocks_per_disk() + SEGMENT_BLOCKS),
        }
    }

    /// Whether the cleaner runs (throttled): blocks from the tail to the head, freed
    /// or not yet handed back by a map save, are below the low-water mark. Counted to
    /// the head, not the durable head ([`State::room`]): the map saves that hand
    /// freed segments back come in batches, and cleaning until they do would run the
    /// head a batch further than the mark.
    fn cleaning_due(&self) -> bool {
        let ahead = self.head_segment * SEGMENT_BLOCKS + self.disks.total_blocks() - self.tail;
        ahead < self.low_water()
    }

    /// Segments cleaned between two map saves when space is short.
    fn save_batch_segments(&self) -> u64 {
        (self.disks.total_blocks() / SEGMENT_BLOCKS / SAVE_FREED_DIVISOR).max(1)
    }

    /// Writes what is pending, syncs the disks, then saves the map: the segments
    /// cleaned so far become writable.
    fn save(&mut self) -> Result<(), StoreError> {
        self.flush()?;
        self.disks.sync()?;
        let geometry = Geometry::of(&self.disks);
        pages::save(
            &*self.disk,
            &self.cache_dir,
            geometry,
            self.head_segment,
            self.tail,
            &self.maps,
        )?;
        self.durable_head_segment = self.head_segment;
        self.find_holes();
        self.counters.map_saves.fetch_add(1, Relaxed);
        // What an operator (and the e2e test) reads to see the cleaner at work.
        tracing::info!(
            live_mib = (self.maps.live_blocks() * BLOCK_BYTES) >> 20,
            free_mib = (self.room() * BLOCK_BYTES) >> 20,
            gc_moved_blocks = self.counters.gc_moved_blocks.load(Relaxed),
            gc_compacted_blocks = self.counters.gc_compacted_blocks.load(Relaxed),
            gc_freed_segments = self.counters.gc_freed_segments.load(Relaxed),
            "chain map saved"
        );
        Ok(())
    }

    /// Free blocks the tail may still write: up to the durable head's next lap.
    fn room(&self) -> u64 {
        self.durable_head_segment * SEGMENT_BLOCKS + self.disks.total_blocks() - self.tail
    }

    /// Writes (`Some`) or zeroes (`None`) a range block by block; a partial block is
    /// read, checked and merged first.
    fn write_range(
        &mut self,
        chunk: ChunkId,
        offset: u64,
        length: u64,
        data: Option<&[u8]>,
    ) -> Result<Vec<u64>, StoreError> {
        let end = offset + length;
        let mut corrupt = Vec::new();
        let mut block = vec![0u8; BLOCK_BYTES as usize];
        let mut at = offset;
        while at < end {
            let block_start = at / BLOCK_BYTES * BLOCK_BYTES;
            let upto = end.min(block_start + BLOCK_BYTES);
            let key = BlockKey {
                chunk,
                block: block_start / BLOCK_BYTES,
            };
            let whole = at == block_start && upto == block_start + BLOCK_BYTES;
            let old = self.maps.get(key);
            let mut poisoned = false;
            match (old, whole, data) {
                (_, true, None) | (None, false, None) => {
                    self.maps.remove(key);
                    at = upto;
                    continue;
                }
                (Some(slot), false, _) => {
                    self.read_block(slot.position, &mut block)?;
                    if crc32c::crc32c(&block) != slot.crc {
                        corrupt.push(block_start);
                        poisoned = true;
                    }
                }
                _ => block.fill(0),
            }
            let part = &mut block[(at - block_start) as usize..(upto - block_start) as usize];
            match data {
                Some(data) => {
                    part.copy_from_slice(&data[(at - offset) as usize..(upto - offset) as usize])
                }
                None => part.fill(0),
            }
            let mut crc = crc32c::crc32c(&block);
            if poisoned {
                crc = POISON ^ (crc == POISON) as u32;
            }
            self.make_room()?;
            self.append(key, &block, crc)?;
            at = upto;
        }
        Ok(corrupt)
    }

    /// Cleans without a bound when client writes reach the reserve, a batch of
    /// segments and a map save at a time (the save hands the freed segments back);
    /// `NoSpace` when a whole lap of cleaning leaves no room. One batch is not enough:
    /// the head's segments may be all live (cold data, or a recovery's replay that
    /// rewrote everything since the checkpoint), so cleaning them gains nothing and
    /// the garbage lies further on.
    fn make_room(&mut self) -> Result<(), StoreError> {
        let reserve = RESERVE_SEGMENTS * SEGMENT_BLOCKS;
        let lap = self.disks.total_blocks() / SEGMENT_BLOCKS;
        let first = self.head_segment;
        while self.room() <= reserve && self.head_segment - first < lap {
            let before = self.head_segment;
            self.clean(u64::MAX, self.save_batch_segments())?;
            if self.head_segment > self.durable_head_segment {
                self.save()?;
            }
            if self.head_segment == before {
                break;
            }
        }
        if self.room() > reserve {
            return Ok(());
        }
        Err(StoreError::NoSpace(format!(
            "the chain is full: {} MiB live of {} MiB",
            (self.maps.live_blocks() * BLOCK_BYTES) >> 20,
            (self.disks.total_blocks() * BLOCK_BYTES) >> 20
        )))
    }

    /// Puts a block at the tail.
    fn append(&mut self, key: BlockKey, block: &[u8], crc: u32) -> io::Result<()> {
        assert!(self.room() > 0, "the tail ran into the durable head");
        let position = self.tail;
        self.run.extend_from_slice(block);
        self.cache.insert(position, block);
        self.maps.set(key, Slot { position, crc });
        self.tail += 1;
        if self.tail.is_multiple_of(SEGMENT_BLOCKS) {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the pending run (it ends at the tail, within one segment).
    fn flush(&mut self) -> io::Result<()> {
        if self.run.is_empty() {
            return Ok(());
        }
        let start = self.tail - self.run.len() as u64 / BLOCK_BYTES;
        self.disks.write(start, &self.run)?;
        self.flash.write(start, &self.run)?;
        self.run.clear();
        Ok(())
    }

    /// A block's data: from the tail cache, else its disk (counted as the tail's or
    /// the body's, the reads a chain keeps off the tail disk).
    fn read_block(&self, position: u64, out: &mut [u8]) -> io::Result<()> {
        if let Some(block) = self.cache.get(position) {
            out.copy_from_slice(block);
            self.counters.reads_cache.fetch_add(1, Relaxed);
            return Ok(());
        }
        if self.flash.read(position, out)? {
            self.counters.reads_flash_cache.fetch_add(1, Relaxed);
            return Ok(());
        }
        let c = &self.counters;
        self.read_blocks(position, out, [&c.reads_tail_disk, &c.reads_body_disk])
    }

    /// Whole blocks from the disks (written, not in the pending run), counted per
    /// disk in `[tail's, body's]`: the reads a chain keeps off the tail disk.
    fn read_blocks(
        &self,
        position: u64,
        out: &mut [u8],
        counters: [&AtomicU64; 2],
    ) -> io::Result<()> {
        let blocks = out.len() as u64 / BLOCK_BYTES;
        assert!(
            position + blocks + (self.run.len() as u64 / BLOCK_BYTES) <= self.tail,
            "an unwritten block is read from disk"
        );
        // Striped, the "tail disk" is the one the next stripe unit goes to.
        let tail_disk = self.disks.place(self.tail).0;
        for (disk, blocks) in self.disks.read(position, out)? {
            counters[(disk != tail_disk) as usize].fetch_add(blocks, Relaxed);
        }
        Ok(())
    }
}
