//! The replay worker of hybrid mode (see [`crate::journal`]): copies live journal data
//! into the chunk files in elevator order, syncs them, then drops the index entries
//! that still point where it copied from. One thread per store (so per hdd), or, for
//! a simulation that decides when replay happens, [`crate::Store::replay_sweep`].

use crate::block_sums::{Fill, Merge, BLOCK_BYTES};
use crate::chunk_files::Files;
use crate::committer::Queue;
use crate::disk;
use crate::disk::hdd::{self, device_position};
use crate::error::StoreError;
use crate::journal::{index_error, locate, CHUNK_SECTORS};
use crate::journal_index::Piece;
use crate::wal::SECTOR_BYTES;
use floe_protocol::ChunkId;
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Journal bytes one replay sweep copies before it syncs and frees them.
const REPLAY_BATCH_BYTES: u64 = 4 << 20;
/// How often an idle replay worker looks for work.
const REPLAY_POLL: Duration = Duration::from_millis(20);
/// Foreground quiet time after which the hdd counts as idle (for its own journal).
const HDD_IDLE: Duration = Duration::from_millis(200);
/// How far replay's copies may run ahead of an idle emulated disk: a disk queue, so
/// the thread's journal reads and copies overlap the disk's writing (one after the
/// other, they held a sequential stream's replay near 70 MB/s on a 150 MB/s disk).
/// While the hdd serves foreground accesses, replay goes a piece at a time, so they
/// wait behind at most one of its pieces (queued ahead, replay's random pieces
/// halved a bypassing 1 MiB stream).
const REPLAY_AHEAD: Duration = Duration::from_millis(20);

/// Starts the replay worker; it stops once the store is gone.
pub(crate) fn spawn_replay(files: Weak<Files>, queue: Arc<Queue>) {
    std::thread::Builder::new()
        .name("journal-replay".into())
        .spawn(move || loop {
            let Some(files) = files.upgrade() else { return };
            match replay(&files, &queue) {
                Ok(0) => {}
                Ok(sectors) => {
                    // A full sweep means a backlog: go on at once. A partial one
                    // caught up; the next waits a poll, so a trickle of writes is
                    // replayed in batches, each with its syncs, not one by one.
                    if sectors >= REPLAY_BATCH_BYTES / SECTOR_BYTES {
                        continue;
                    }
                }
                Err(e) => {
                    tracing::error!("journal replay failed, will retry: {e}");
                    drop(files);
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
            }
            drop(files);
            std::thread::sleep(REPLAY_POLL);
        })
        .expect("spawning the replay thread");
}

/// One sweep; when it freed index entries, wakes the committer to reset the journals
/// nothing points into any more. Returns the sectors copied.
pub(crate) fn replay(files: &Files, queue: &Queue) -> Result<u64, StoreError> {
    let journals = files.journals.as_ref().expect("replay runs with journals");
    let mut cursor = journals.replay_cursor.lock().unwrap();
    let sectors = hdd::background(|| replay_sweep(files, &mut cursor))?;
    if sectors > 0 {
        journals.replayed.store(true, Ordering::Release);
        queue.wake.notify_one();
    }
    Ok(sectors)
}

/// Sleeps until the emulated hdd is at most `ahead` from completing this thread's
/// accesses so far.
fn wait_for_hdd(ahead: Duration) {
    if let Some(done) = hdd::take_paced_until() {
        let until = done.checked_sub(ahead).unwrap_or(done);
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
        if done > Instant::now() {
            hdd::pace_until(done);
        }
    }
}

/// One elevator sweep: copies up to [`REPLAY_BATCH_BYTES`] of live journal data into
/// the chunk files, going up from `cursor` (a position on the disk, as
/// [`device_position`] lays chunks out: the emulated hdd's, and an order as good as any
/// on a real one) and wrapping around, syncs them, then drops the index entries that
/// still point where they were copied from. Returns the sectors copied.
fn replay_sweep(files: &Files, cursor: &mut u64) -> Result<u64, StoreError> {
    let journals = files.journals.as_ref().expect("replay runs with journals");
    let local = journals.files.len() - 1;
    // The hdd's own journal waits for an idle hdd, unless the ssd journals are more
    // than half full: they cannot be freed while it holds older records.
    let (ssd_used, ssd_quota) = journals.ssd_usage();
    let replay_local =
        ssd_used * 2 > ssd_quota || files.hdd.as_ref().is_none_or(|hdd| hdd.idle(HDD_IDLE));
    let position = |chunk: ChunkId, sector: u64| device_position(chunk, sector * SECTOR_BYTES);
    // (chunk, sector, sectors, journal position), in disk order.
    let mut pieces = Vec::new();
    {
        let index = journals.index.lock().unwrap();
        let mut chunks: Vec<_> = index.keys().copied().collect();
        chunks.sort_unstable_by_key(|&chunk| (position(chunk, 0), chunk));
        for chunk in chunks {
            for piece in index[&chunk].query(0, CHUNK_SECTORS).unwrap_or_default() {
                if let Piece::Journal {
                    offset,
                    len,
                    journal,
                } = piece
                {
                    if (replay_local || locate(journal).0 != local)
                        && journals.durable(journal, len)
                    {
                        pieces.push((chunk, offset, len, journal));
                    }
                }
            }
        }
    }
    let start = pieces.partition_point(|p| position(p.0, p.1) < *cursor);
    pieces.rotate_left(start);
    let mut budget = REPLAY_BATCH_BYTES / SECTOR_BYTES;
    let mut copied = Vec::new();
    let mut touched = BTreeSet::new();
    let mut created = BTreeSet::new();
    let mut data = Vec::new();
    for (chunk, sector, len, journal) in pieces {
        if budget == 0 {
            break;
        }
        let len = len.min(budget);
        budget -= len;
        // The emulated disk's time for the pieces before, spent before the locks are
        // taken.
        let idle = files.hdd.as_ref().is_some_and(|hdd| hdd.idle(HDD_IDLE));
        wait_for_hdd(if idle { REPLAY_AHEAD } else { Duration::ZERO });
        let _writes = journals.chunk_writes.lock().unwrap();
        let index = journals.index.lock().unwrap();
        let Some(entry) = index.get(&chunk) else {
            continue; // the volume was deleted meanwhile
        };
        for piece in entry.query(sector, len).map_err(index_error)? {
            // Only what still points where this sweep found it: newer data superseded
            // the rest.
            let Piece::Journal {
                offset,
                len,
                journal: now,
            } = piece
            else {
                continue;
            };
            if now != journal + (offset - sector) {
                continue;
            }
            let (j, at) = locate(now);
            data.resize((len * SECTOR_BYTES) as usize, 0);
            disk::read_at(&*journals.files[j], &mut data, at)?;
            // Journal data that fails its checksum still goes to the file (so the
            // journal can be freed), with its blocks marked corrupt until repaired.
            let bad = journals.bad_sectors(now, &data);
            for sector in &bad {
                let at = (offset + sector) * SECTOR_BYTES;
                files.found_corrupt(chunk, at - at % BLOCK_BYTES, "journal");
            }
            let file = match files.get(chunk, false)? {
                Some(file) => file,
                None => {
                    created.insert(chunk);
                    files
                        .get(chunk, true)?
                        .expect("get with create returns a file")
                }
            };
            // The blocks are in flux until the index drops these pieces: trusted.
            let poison = !bad.is_empty();
            for at in file.write(
                offset * SECTOR_BYTES,
                Fill::Data(&data),
                Merge::Trust,
                poison,
            )? {
                files.found_corrupt(chunk, at, "chunk file");
            }
            touched.insert(chunk);
            copied.push((chunk, offset, len, now));
        }
        *cursor = position(chunk, sector + len);
    }
    if copied.is_empty() {
        wait_for_hdd(Duration::ZERO);
        *cursor = 0;
        return Ok(0);
    }
    let mut dirs = BTreeSet::new();
    for chunk in &touched {
        if let Some(file) = files.get(*chunk, false)? {
            file.sync()?;
        }
    }
    // Only a file this sweep created added directory entries.
    for chunk in &created {
        dirs.extend(files.dirs_of(*chunk));
    }
    for dir in dirs {
        files.sync_dir(&dir)?;
    }
    // A sync completes once the disk has written everything before it.
    wait_for_hdd(Duration::ZERO);
    let mut index = journals.index.lock().unwrap();
    let mut sectors = 0;
    for (chunk, offset, len, journal) in copied {
        let Some(entry) = index.get_mut(&chunk) else {
            continue;
        };
        for piece in entry.query(offset, len).map_err(index_error)? {
            if let Piece::Journal {
                offset: o,
                len: l,
                journal: now,
            } = piece
            {
                if now == journal + (o - offset) {
                    entry.remove(o, l).map_err(index_error)?;
                    sectors += l;
                }
            }
        }
        entry.merge();
        if entry.tree_len() + entry.array_len() == 0 {
            index.remove(&chunk);
        }
    }
    Ok(sectors)
}
