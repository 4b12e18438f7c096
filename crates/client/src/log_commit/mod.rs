//! Blizzard's log-commit write mode (NSDI'14 section 2.5.3, "out-of-order commits with
//! fast acks"), a layer over the volume.
//!
//! Writes (and zeroes and trims) are acknowledged at once and issued at once: each
//! 4 KiB block goes to the next position of a log that a deterministic permutation
//! scatters over the volume's chunks ([`permutation`]), as an expanded block with its
//! block number, log position, epoch and CRC ([`slot`]). Writes may land in any
//! order; a block's place moves to its new slot only once every earlier position is
//! durable, so the block map (kept in memory, written to one of two checkpoint
//! regions now and then, [`checkpoint`]) always describes a prefix of the
//! acknowledged writes. After a crash, [`recovery`] loads the newest checkpoint and
//! rolls the permutation forward over the slots written since, up to the first that
//! did not land: the volume holds a prefix of the acknowledged writes, with less at
//! risk than flush-epoch (which issues one epoch at a time). The allocation rule that
//! makes roll-forward walk exactly the writer's positions is in [`state`].
//!
//! - Reads see the latest acknowledged write: unretired writes first, then the map.
//!   A slot read back is checked (CRC, block number) before its data is returned.
//! - A FLUSH is acknowledged at once: an ordering point (positions follow
//!   acknowledgement order, so epochs too). A FUA write answers once it and every
//!   earlier write are durable.
//! - Costs: every write writes twice its bytes (a header page per block); a write not
//!   4 KiB-aligned first reads the rest of its first and last blocks (read-before-
//!   write, done again if the block changed meanwhile); a zeroes or trim of whole
//!   blocks is one header page. Blocks land in scattered slots: a large write becomes
//!   many 8 KiB writes, a large read many 8 KiB reads.
//! - At most `limit` bytes (a block per slot write) are unretired; beyond, a write
//!   waits. Writes wait in memory, unissued, while a checkpoint is written.
//! - A slot write or flush below that fails breaks the layer (fail-stop): positions
//!   after it cannot retire, so the next FLUSH, FUA write and change fail, and every
//!   later one, until the volume is reopened, which recovers the prefix.
//! - Dropped (the last NBD connection closed), the layer goes on until every write is
//!   retired and checkpointed; [`crate::draining`] counts it.

mod checkpoint;
mod permutation;
mod recovery;
mod slot;
mod state;
#[cfg(test)]
mod tests;

use crate::draining::Live;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use checkpoint::Checkpoint;
use floe_blockdev::{check_range, BlockDevice, Extent, IoError};
use floe_protocol::log_commit::{Layout, BLOCK_BYTES, SLOT_BYTES};
use futures::StreamExt;
use permutation::Permutation;
use state::{Content, Log, Source};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// A block the map says reads as zeroes.
const ZEROES: u32 = u32::MAX;
const BLOCK: usize = BLOCK_BYTES as usize;
/// Slot reads of one request in flight at once.
const READS_IN_FLIGHT: usize = 64;
/// Blocks one `extents` call describes at most.
const EXTENT_BLOCKS_MAX: u64 = 1 << 16;

/// Knobs a test sets small.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    pub(crate) limit_bytes: u64,
    /// Slot writes between checkpoints: half the spare slots, so a checkpoint comes
    /// well before the log's position could pass the last one's + P.
    pub(crate) checkpoint_every: u64,
}

impl Tuning {
    fn of(layout: &Layout, limit_bytes: u64) -> Tuning {
        Tuning {
            limit_bytes,
            checkpoint_every: ((layout.slots - layout.blocks) / 2).max(1),
        }
    }
}

struct Shared {
    inner: Arc<dyn BlockDevice>,
    layout: Layout,
    log: Mutex<Log>,
    changed: Notify,
    limit: u64,
}

pub struct LogCommit {
    shared: Arc<Shared>,
    size: u64,
    writable: bool,
}

impl LogCommit {
    /// Opens the log of volume `volume` (`size` bytes) kept in `inner` (the volume's
    /// chunks, [`Layout::backing_bytes`] of them), holding at most `limit` unretired
    /// bytes. `writable`: recovers, writes a checkpoint and takes writes (the caller
    /// holds the lease); otherwise reads the state as found.
    pub async fn open(
        volume: &str,
        inner: Arc<dyn BlockDevice>,
        size: u64,
        writable: bool,
        limit: u64,
    ) -> Result<LogCommit, IoError> {
        let layout = Layout::of(size);
        LogCommit::open_with(
            volume,
            inner,
            size,
            layout,
            writable,
            Tuning::of(&layout, limit),
        )
        .await
    }

    pub(crate) async fn open_with(
        volume: &str,
        inner: Arc<dyn BlockDevice>,
        size: u64,
        layout: Layout,
        writable: bool,
        tuning: Tuning,
    ) -> Result<LogCommit, IoError> {
        assert!(size <= layout.blocks * BLOCK_BYTES);
        assert!(
            inner.size() >= layout.backing_bytes(),
            "the volume below holds the log"
        );
        let permutation = Permutation::new(layout.slots);
        let found = recovery::recover(&*inner, &layout, &permutation).await?;
        tracing::info!(
            volume,
            checkpoint = found.checkpoint.sequence,
            from = found.checkpoint.cursor.position,
            rolled = found.rolled,
            end = found.end.position,
            "log-commit: recovered"
        );
        // A whole cycle on: every slot header on disk, even past where the log ended,
        // names a position below the new checkpoint's, so none passes for a later
        // write at roll-forward.
        let checkpoint = Checkpoint {
            sequence: found.checkpoint.sequence + 1,
            cursor: permutation.cycle_later(found.end),
            epoch: found.epoch,
            map: found.map,
        };
        if writable {
            // Before any write: roll-forward must start from the new position.
            checkpoint.write(&*inner, &layout).await?;
        }
        let shared = Arc::new(Shared {
            inner,
            layout,
            log: Mutex::new(Log::new(
                layout,
                permutation,
                checkpoint,
                tuning.checkpoint_every,
            )),
            changed: Notify::new(),
            limit: tuning.limit_bytes,
        });
        if writable {
            tokio::spawn(dispatch(shared.clone(), Live::new(volume)));
        }
        Ok(LogCommit {
            shared,
            size,
            writable,
        })
    }

    /// Slot `slot`'s data if it still holds block `block` (it may have been reused
    /// since the map was read).
    async fn fetch(&self, block: u64, slot: u64) -> Result<Option<Bytes>, IoError> {
        let offset = self.shared.layout.slot_offset(slot);
        let bytes = self.shared.inner.read(offset, SLOT_BYTES as u32).await?;
        let header = slot::decode(&bytes);
        Ok(header
            .filter(|h| h.kind == slot::Kind::Data && h.block == block)
            .map(|_| bytes.slice(BLOCK..)))
    }

    /// Block `block`'s latest acknowledged content.
    async fn block(&self, block: u64, mut source: Source) -> Result<Bytes, IoError> {
        loop {
            match source {
                Source::Data(data) => return Ok(data),
                Source::Zeroes => return Ok(Bytes::from_static(&[0; BLOCK])),
                Source::Slot(slot) => {
                    if let Some(data) = self.fetch(block, slot).await? {
                        return Ok(data);
                    }
                    let now = self.shared.log.lock().unwrap().lookup(block);
                    if matches!(now, Source::Slot(s) if s == slot) {
                        return Err(IoError::Io(format!(
                            "log-commit: slot {slot} does not hold block {block} as the map says"
                        )));
                    }
                    source = now;
                }
            }
        }
    }

    /// Acknowledges a change of `[offset, offset + length)` to `data` (zeroes if
    /// `None`) once queued; `fua`: once retired.
    async fn change(
        &self,
        offset: u64,
        length: u64,
        data: Option<Bytes>,
        fua: bool,
    ) -> Result<(), IoError> {
        if !self.writable {
            return Err(IoError::ReadOnly);
        }
        check_range(self.size, offset, length)?;
        if length == 0 {
            return Ok(());
        }
        let first = offset / BLOCK_BYTES;
        let end = (offset + length).div_ceil(BLOCK_BYTES);
        let partial = |block: u64| {
            let start = block * BLOCK_BYTES;
            offset > start || offset + length < start + BLOCK_BYTES
        };
        let mut partials = vec![first, end - 1];
        partials.dedup();
        partials.retain(|&b| partial(b));
        // Bookend blocks read from their slots: (slot, data).
        let mut read: BTreeMap<u64, (u64, Bytes)> = BTreeMap::new();
        let answer = loop {
            let room = self.shared.changed.notified();
            let mut missing = Vec::new();
            {
                let mut log = self.shared.log.lock().unwrap();
                if let Some(e) = &log.broken {
                    return Err(e.clone());
                }
                let mut bases = BTreeMap::new();
                for &block in &partials {
                    let base = match log.lookup(block) {
                        Source::Data(data) => data,
                        Source::Zeroes => Bytes::from_static(&[0; BLOCK]),
                        Source::Slot(slot) => match read.get(&block) {
                            Some((s, data)) if *s == slot => data.clone(),
                            _ => {
                                missing.push((block, slot));
                                continue;
                            }
                        },
                    };
                    bases.insert(block, base);
                }
                if missing.is_empty() {
                    let entries = entries(offset, length, first, end, data.as_ref(), &bases);
                    let bytes = entries.len() as u64 * BLOCK_BYTES;
                    // A change larger than the limit goes alone.
                    if log.bytes == 0 || log.bytes + bytes <= self.shared.limit {
                        break log.push(entries, fua);
                    }
                }
            }
            if missing.is_empty() {
                room.await;
            }
            // Read-before-write; if a bookend changed meanwhile, the next turn sees it.
            for (block, slot) in missing {
                if let Some(data) = self.fetch(block, slot).await? {
                    read.insert(block, (slot, data));
                }
            }
        };
        self.shared.changed.notify_waiters();
        match answer {
            None => Ok(()),
            Some(answer) => answer
                .await
                .map_err(|_| IoError::Io("the volume closed before a FUA write".into()))?,
        }
    }
}

/// The log entries of a change: a block per written block, the bookends merged into
/// `bases`; zeroes of whole blocks as one entry.
fn entries(
    offset: u64,
    length: u64,
    first: u64,
    end: u64,
    data: Option<&Bytes>,
    bases: &BTreeMap<u64, Bytes>,
) -> Vec<(u64, Content)> {
    let mut out = Vec::new();
    let mut zeroes_from = None;
    for block in first..end {
        let start = block * BLOCK_BYTES;
        let from = offset.max(start);
        let to = (offset + length).min(start + BLOCK_BYTES);
        let whole = from == start && to == start + BLOCK_BYTES;
        if data.is_none() && whole {
            zeroes_from.get_or_insert(block);
            continue;
        }
        if let Some(zeroes) = zeroes_from.take() {
            out.push((
                zeroes,
                Content::Zeroes {
                    count: block - zeroes,
                },
            ));
        }
        let content = match (data, whole) {
            (Some(data), true) => data.slice((start - offset) as usize..(to - offset) as usize),
            _ => {
                let mut merged = BytesMut::from(&bases[&block][..]);
                let range = (from - start) as usize..(to - start) as usize;
                match data {
                    Some(data) => merged[range]
                        .copy_from_slice(&data[(from - offset) as usize..(to - offset) as usize]),
                    None => merged[range].fill(0),
                }
                merged.freeze()
            }
        };
        assert_eq!(content.len(), BLOCK);
        out.push((block, Content::Data(content)));
    }
    if let Some(zeroes) = zeroes_from {
        out.push((
            zeroes,
            Content::Zeroes {
                count: end - zeroes,
            },
        ));
    }
    out
}

impl Drop for LogCommit {
    fn drop(&mut self) {
        self.shared.log.lock().unwrap().closing = true;
        self.shared.changed.notify_waiters();
    }
}

/// Issues slot writes, flushes below, retires, checkpoints; until the layer is
/// dropped and everything retired and checkpointed.
async fn dispatch(shared: Arc<Shared>, live: Live) {
    let _live = live;
    loop {
        let changed = shared.changed.notified();
        let (issue, flush, checkpoint) = {
            let mut log = shared.log.lock().unwrap();
            if log.finished() {
                break;
            }
            (log.issuable(), log.flush_due(), log.checkpoint_due())
        };
        if !flush.is_empty() {
            let shared = shared.clone();
            tokio::spawn(async move {
                let flushed = shared.inner.flush().await;
                shared.log.lock().unwrap().flushed(&flush, flushed);
                shared.changed.notify_waiters();
            });
        }
        for issue in issue {
            let shared = shared.clone();
            tokio::spawn(async move {
                let bytes = slot::encode(&issue.header, issue.data.as_deref());
                let offset = shared.layout.slot_offset(issue.slot);
                let result = shared.inner.write(offset, bytes, false).await;
                shared.log.lock().unwrap().done(issue.id, result);
                shared.changed.notify_waiters();
            });
        }
        if let Some(checkpoint) = checkpoint {
            let result = checkpoint.write(&*shared.inner, &shared.layout).await;
            shared.log.lock().unwrap().checkpointed(checkpoint, result);
            shared.changed.notify_waiters();
            continue;
        }
        changed.await;
    }
}

#[async_trait]
impl BlockDevice for LogCommit {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError> {
        check_range(self.size, offset, length.into())?;
        if length == 0 {
            return Ok(Bytes::new());
        }
        let first = offset / BLOCK_BYTES;
        let end = (offset + u64::from(length)).div_ceil(BLOCK_BYTES);
        let sources: Vec<Source> = {
            let log = self.shared.log.lock().unwrap();
            (first..end).map(|block| log.lookup(block)).collect()
        };
        let blocks: Vec<Result<Bytes, IoError>> = futures::stream::iter(
            (first..end)
                .zip(sources)
                .map(|(block, source)| self.block(block, source)),
        )
        .buffered(READS_IN_FLIGHT)
        .collect()
        .await;
        let mut out = BytesMut::with_capacity(((end - first) * BLOCK_BYTES) as usize);
        for block in blocks {
            out.extend_from_slice(&block?);
        }
        let skip = (offset - first * BLOCK_BYTES) as usize;
        Ok(out.freeze().slice(skip..skip + length as usize))
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        self.change(offset, data.len() as u64, Some(data), fua)
            .await
    }

    /// An ordering point, not a durability point: acknowledged at once. Fails once a
    /// write below failed.
    async fn flush(&self) -> Result<(), IoError> {
        self.shared.log.lock().unwrap().flush()
    }

    async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError> {
        self.change(offset, length, None, false).await
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        _may_punch: bool,
    ) -> Result<(), IoError> {
        self.change(offset, length, None, false).await
    }

    /// Blocks the map has as zeroes (and no unretired write touches) are holes.
    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        check_range(self.size, offset, length)?;
        let log = self.shared.log.lock().unwrap();
        let mut out: Vec<Extent> = Vec::new();
        let mut at = offset;
        let end = (offset + length).min((offset / BLOCK_BYTES + EXTENT_BLOCKS_MAX) * BLOCK_BYTES);
        while at < end {
            let block = at / BLOCK_BYTES;
            let n = ((block + 1) * BLOCK_BYTES).min(end) - at;
            let hole =
                !log.pending(block, block + 1) && matches!(log.lookup(block), Source::Zeroes);
            match out.last_mut() {
                Some(last) if last.hole == hole => last.length += n,
                _ => out.push(Extent { length: n, hole }),
            }
            at += n;
        }
        Ok(out)
    }
}
