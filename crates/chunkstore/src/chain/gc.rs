//! Move-to-tail cleaning (the thesis's GC for a chain): the head segment's live
//! blocks are copied to the tail, then the segment is free. The walk over the head
//! is also compact-in-body's ([`super::compact`]), which puts the blocks in holes
//! of the body instead. It runs inside the
//! committer's apply, throttled against client writes: below a low-water mark of
//! free space it moves at most [`MOVES_PER_WRITTEN_BLOCK`] blocks per block a client
//! wrote, so cleaning takes a bounded share of the tail disk's bandwidth; only when
//! the log is about to run out does it clean without a bound.
//!
//! The head is read ahead of the cleaner, [`READ_AHEAD_BLOCKS`] at a time from the
//! first live block it needs to the last live one of that window (one read per
//! disk piece), not block by block: on an hdd every skipped dead block would cost a
//! seek. [`READ_AHEAD_WINDOWS`] windows are kept issued, and the
//! committer, which runs the cleaner, waits for a window only when it needs its
//! data and the disk has not delivered it yet: the head's disk reads while the
//! tail's writes go on (the thesis's point: cleaning reads the body, not the tail
//! disk). A window is big so that reads of other data on the head's disk (a
//! reader's) cost a seek per window, not per segment.
//!
//! A freed segment is not written again until the map is saved (see
//! [`super::pages`]): until then the saved map may still point into it, and a power
//! cut would bring those pointers back.

use super::compact::Gc;
use super::disks::SEGMENT_BLOCKS;
use super::State;
use crate::block_sums::BLOCK_BYTES;
use crate::disk::hdd;
use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// Blocks the cleaner may move per block of client data, under the low-water mark.
pub(crate) const MOVES_PER_WRITTEN_BLOCK: u64 = 2;
/// Blocks of the head one read ahead covers (8 MiB).
const READ_AHEAD_BLOCKS: u64 = 8 * SEGMENT_BLOCKS;
/// Windows read ahead at most, the one in use included: those beyond it are in
/// the disk's queue while the cleaner works through it.
const READ_AHEAD_WINDOWS: usize = 3;

/// Head data the cleaner read ahead: the window `[.., window_end)` of the log, of
/// which `data` holds the blocks from `from` (its first live block) to its last
/// live one, delivered by the disk at `ready`. Valid until the cleaner passes it:
/// the tail writes a position once per lap, after the head has passed it, and a
/// compaction into a hole of the window updates `data` ([`State::patch_read_ahead`]).
pub(crate) struct HeadRead {
    from: u64,
    data: Vec<u8>,
    window_end: u64,
    ready: Option<Instant>,
}

impl HeadRead {
    fn holds(&self, position: u64) -> bool {
        (self.from..self.from + self.data.len() as u64 / BLOCK_BYTES).contains(&position)
    }
}

impl State {
    /// Cleans from the head: moves up to `moves` live blocks to the tail and frees
    /// up to `segments_max` segments, never touching the tail's own segment, and
    /// never starting (or going on with) a segment whose live blocks might not fit
    /// before the durable head.
    pub(crate) fn clean(&mut self, moves: u64, segments_max: u64) -> io::Result<()> {
        let mut moves = moves;
        let mut freed = 0;
        let mut block = vec![0u8; BLOCK_BYTES as usize];
        loop {
            let segment_end = (self.head_segment + 1) * SEGMENT_BLOCKS;
            if segment_end > self.tail
                || freed == segments_max
                || self.room() < self.live_between(self.gc_cursor, segment_end)
            {
                break;
            }
            while self.gc_cursor < segment_end && moves > 0 {
                let position = self.gc_cursor;
                if let Some((key, crc)) = self.maps.at(position) {
                    // The crc moves unchanged: a corrupt block stays corrupt.
                    self.read_to_move(position, &mut block)?;
                    if !(self.gc == Gc::CompactInBody && self.compact(key, &block, crc)?) {
                        self.append(key, &block, crc)?;
                        self.counters.gc_moved_blocks.fetch_add(1, Relaxed);
                    }
                    moves -= 1;
                }
                self.gc_cursor += 1;
            }
            if self.gc_cursor < segment_end {
                break;
            }
            self.head_segment += 1;
            self.counters.gc_freed_segments.fetch_add(1, Relaxed);
            freed += 1;
        }
        Ok(())
    }

    /// The live block at `position` of the head segment: from the tail cache, else
    /// from the head read ahead (waiting for the disk only if it has not delivered
    /// it yet), keeping the next window issued.
    fn read_to_move(&mut self, position: u64, out: &mut [u8]) -> io::Result<()> {
        if let Some(block) = self.cache.get(position) {
            out.copy_from_slice(block);
            return Ok(());
        }
        while self
            .gc_reads
            .front()
            .is_some_and(|read| read.window_end <= position)
        {
            self.gc_reads.pop_front();
        }
        if !self
            .gc_reads
            .front()
            .is_some_and(|read| read.holds(position))
        {
            // Nothing read ahead here (the first move, or the cache served the
            // window's blocks so far): read from here on.
            self.gc_reads.clear();
            let issued = self.read_ahead(position)?;
            assert!(issued, "a live block of the head is on disk");
        }
        while self.gc_reads.len() < READ_AHEAD_WINDOWS {
            let next = self.gc_reads.back().expect("one read").window_end;
            if !self.read_ahead(next)? {
                break;
            }
        }
        let read = &self.gc_reads[0];
        assert!(read.holds(position), "the block to move was read");
        if let Some(ready) = read.ready {
            hdd::pace_until(ready);
        }
        let at = ((position - read.from) * BLOCK_BYTES) as usize;
        out.copy_from_slice(&read.data[at..at + BLOCK_BYTES as usize]);
        Ok(())
    }

    /// Issues the read of the head's window from `from` (its live blocks, as one
    /// range), without waiting for the disk; up to what the tail has written and
    /// the end of the lap; `false` when `from` is there already.
    fn read_ahead(&mut self, from: u64) -> io::Result<bool> {
        let total = self.disks.total_blocks();
        let written = self.tail - self.run.len() as u64 / BLOCK_BYTES;
        let window_end = (from + READ_AHEAD_BLOCKS)
            .min(written)
            .min((from / total + 1) * total);
        if from >= window_end {
            return Ok(false);
        }
        let live = |p: &u64| self.maps.at(*p).is_some();
        let (first, last) = match (from..window_end).find(live) {
            Some(first) => (first, (first..window_end).rfind(live).expect("one is")),
            None => (window_end, window_end - 1),
        };
        let mut data = vec![0; ((last + 1 - first) * BLOCK_BYTES) as usize];
        let c = &self.counters;
        let (read, ready) = hdd::issued_ahead(|| {
            self.read_blocks(
                first,
                &mut data,
                [&c.gc_reads_tail_disk, &c.gc_reads_body_disk],
            )
        });
        read?;
        self.gc_reads.push_back(HeadRead {
            from: first,
            data,
            window_end,
            ready,
        });
        Ok(true)
    }

    /// A compaction wrote `block` at `position`: a window read ahead holding the
    /// position's old bytes takes the new ones.
    pub(crate) fn patch_read_ahead(&mut self, position: u64, block: &[u8]) {
        for read in self.gc_reads.iter_mut().filter(|r| r.holds(position)) {
            let at = ((position - read.from) * BLOCK_BYTES) as usize;
            read.data[at..at + BLOCK_BYTES as usize].copy_from_slice(block);
        }
    }

    /// Live blocks in `[from, to)`: the moves cleaning that range takes.
    fn live_between(&self, from: u64, to: u64) -> u64 {
        (from..to).filter(|&p| self.maps.at(p).is_some()).count() as u64
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::{Chain, ChainOptions, Layout};
    use crate::block_sums::BLOCK_BYTES;
    use crate::wal::{Kind, RecordHeader};
    use crate::SimDisk;
    use floe_protocol::ChunkId;
    use std::path::PathBuf;

    pub(in super::super) const CHUNK: ChunkId = ChunkId {
        volume_id: 1,
        index: 0,
    };

    /// 3 x 3 MiB, no cache beyond the least.
    pub(in super::super) fn options(layout: Layout) -> ChainOptions {
        ChainOptions {
            disks: ["/d0", "/d1", "/d2"].map(PathBuf::from).to_vec(),
            cache_dir: PathBuf::from("/flash"),
            disk_bytes: 3 << 20,
            cache_bytes: 0,
            flash_cache_bytes: 0,
            layout,
            gc: Default::default(),
        }
    }

    fn header(offset: u64, length: u64) -> RecordHeader {
        RecordHeader {
            seq: 0,
            kind: Kind::Write,
            chunk: CHUNK,
            offset,
            length,
            view: 0,
            version: 0,
        }
    }

    pub(in super::super) fn write(chain: &Chain, offset: u64, data: &[u8]) {
        let header = header(offset, data.len() as u64);
        assert!(chain.apply(&header, data).unwrap().is_empty());
    }

    /// 3 x 3 MiB; overwriting 1 MiB 27 times writes 3x the chain: only cleaning
    /// (and the map saves that hand segments back) lets it go on. The striped
    /// layout (the benchmark's RAID-0) is the same engine and must do the same.
    #[test]
    fn overwriting_three_times_the_chain_reclaims_and_keeps_the_data() {
        for layout in [Layout::Chained, Layout::Striped] {
            overwrite_three_times(layout);
        }
    }

    fn overwrite_three_times(layout: Layout) {
        let sim = SimDisk::new();
        let options = options(layout);
        let chain = Chain::open(sim.mount(), &options).unwrap();
        // A cold 1 MiB the cleaner must move, and a hot 1 MiB overwritten.
        let cold: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        write(&chain, 8 << 20, &cold);
        for round in 0..27u32 {
            let hot = vec![round as u8; 1 << 20];
            write(&chain, 0, &hot);
        }
        let stats = chain.stats();
        assert!(stats.gc_freed_segments >= 18, "{stats:?}");
        assert!(
            stats.gc_moved_blocks >= 256,
            "the cold data moved: {stats:?}"
        );
        assert_eq!(stats.live_blocks, 2 * (1 << 20) / BLOCK_BYTES);
        let mut out = vec![0; 1 << 20];
        chain.read(CHUNK, 8 << 20, &mut out, true).unwrap();
        assert!(out == cold);
        chain.read(CHUNK, 0, &mut out, true).unwrap();
        assert!(out.iter().all(|&b| b == 26));
        // And after a power cut, from the saved map (no log replays here).
        chain.persist().unwrap();
        drop(chain);
        sim.power_cut(3);
        let chain = Chain::open(sim.mount(), &options).unwrap();
        chain.read(CHUNK, 8 << 20, &mut out, true).unwrap();
        assert!(out == cold);
    }

    /// Cold data at the head: cleaning its segments frees nothing, so a write at the
    /// reserve must clean past them to the garbage (found by the power-cut test: a
    /// replay into a chain whose head was all live). Up to 6 MiB live of 9 MiB goes
    /// on; 7 MiB live leaves only the cleaner's reserve, and writes are refused.
    #[test]
    fn cleaning_goes_past_a_cold_head_and_refuses_only_a_full_chain() {
        for cold_mib in 1..=6u64 {
            let sim = SimDisk::new();
            let options = options(Layout::Chained);
            let chain = Chain::open(sim.mount(), &options).unwrap();
            let cold = vec![0xc0u8; (cold_mib << 20) as usize];
            write(&chain, 8 << 20, &cold);
            let mut refused = None;
            for round in 0..27u32 {
                let hot = vec![round as u8; 1 << 20];
                match chain.apply(&header(0, hot.len() as u64), &hot) {
                    Ok(_) => {}
                    Err(e) => {
                        refused = Some(e.to_string());
                        break;
                    }
                }
            }
            match cold_mib {
                6 => assert!(
                    refused
                        .as_deref()
                        .is_some_and(|e| e.contains("chain is full")),
                    "{refused:?}"
                ),
                _ => assert_eq!(refused, None, "{cold_mib} MiB cold"),
            }
            let mut out = vec![0; cold.len()];
            chain.read(CHUNK, 8 << 20, &mut out, true).unwrap();
            assert!(out == cold);
        }
    }
}
