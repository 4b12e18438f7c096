//! Opening a log: the newest whole checkpoint, then roll-forward (Blizzard 2.5.3).
//!
//! From the checkpoint's position the permutation is walked as the writer walked it:
//! a slot the checkpoint's map uses is skipped (the writer never writes one, see
//! `state`'s allocation rule); any other slot must hold a whole slot written at
//! exactly this position, or the log ends here. Each applied slot maps its block (or
//! its range to zeroes). Since positions were handed out in acknowledgement order, the
//! result is the checkpoint's state plus a prefix of the writes acknowledged after it.

use super::checkpoint::Checkpoint;
use super::permutation::{Cursor, Permutation};
use super::slot::{self, Header, Kind};
use super::ZEROES;
use floe_blockdev::{BlockDevice, IoError};
use floe_protocol::log_commit::{Layout, SLOT_BYTES};
use futures::StreamExt;

/// Slots roll-forward reads at once.
const READS_IN_FLIGHT: usize = 64;

/// The state of a log as found.
#[derive(Debug)]
pub(super) struct Recovered {
    /// The checkpoint it started from (sequence 0 and an empty map for a new volume).
    pub(super) checkpoint: Checkpoint,
    /// The checkpoint's map and the slots rolled forward.
    pub(super) map: Vec<u32>,
    /// Where the log ended: the first position not applied.
    pub(super) end: Cursor,
    /// The newest epoch found.
    pub(super) epoch: u64,
    /// Slots applied.
    pub(super) rolled: u64,
}

/// The slots a map uses, as a bitmap.
pub(super) fn used_slots(map: &[u32], slots: u64) -> Vec<u64> {
    let mut used = vec![0u64; slots.div_ceil(64) as usize];
    for (block, &slot) in map.iter().enumerate() {
        if slot == ZEROES {
            continue;
        }
        let (word, bit) = (slot as usize / 64, slot % 64);
        assert!(
            used[word] & (1 << bit) == 0,
            "slot {slot} mapped twice (block {block})"
        );
        used[word] |= 1 << bit;
    }
    used
}

pub(super) fn is_used(used: &[u64], slot: u64) -> bool {
    used[slot as usize / 64] & (1 << (slot % 64)) != 0
}

pub(super) async fn recover(
    inner: &dyn BlockDevice,
    layout: &Layout,
    permutation: &Permutation,
) -> Result<Recovered, IoError> {
    let (zero, zero_written) = Checkpoint::read(inner, layout, 0).await?;
    let (one, one_written) = Checkpoint::read(inner, layout, 1).await?;
    let checkpoint = match (zero, one) {
        (Some(a), Some(b)) => {
            if a.sequence > b.sequence {
                a
            } else {
                b
            }
        }
        (Some(c), None) | (None, Some(c)) => c,
        // The first checkpoint is written before any slot; only a tear of that one
        // leaves a region written with neither whole.
        (None, None) if !(zero_written && one_written) => Checkpoint {
            sequence: 0,
            cursor: permutation.start(),
            epoch: 0,
            map: vec![ZEROES; layout.blocks as usize],
        },
        (None, None) => {
            return Err(IoError::Io(
                "log-commit volume: neither checkpoint region holds a whole checkpoint".into(),
            ))
        }
    };
    let used = used_slots(&checkpoint.map, layout.slots);
    let mut map = checkpoint.map.clone();
    let mut epoch = checkpoint.epoch;
    let mut cursor = checkpoint.cursor;
    let end = permutation.cycle_later(cursor).position;
    let mut rolled = 0;
    'log: loop {
        // The next batch of positions the writer may have written.
        let mut batch = Vec::new();
        while batch.len() < READS_IN_FLIGHT && cursor.position < end {
            if !is_used(&used, cursor.slot) {
                batch.push(cursor);
            }
            cursor = permutation.next(cursor);
        }
        if batch.is_empty() {
            break;
        }
        let reads = futures::stream::iter(
            batch
                .clone()
                .into_iter()
                .map(|at| inner.read(layout.slot_offset(at.slot), SLOT_BYTES as u32)),
        )
        .buffered(READS_IN_FLIGHT)
        .collect::<Vec<_>>()
        .await;
        for (at, read) in batch.into_iter().zip(reads) {
            let found = slot::decode(&read?).filter(|h| h.position == at.position);
            let Some(header) = found.filter(|h| fits(h, layout)) else {
                cursor = at;
                break 'log;
            };
            if header.epoch < epoch {
                return Err(IoError::Io(format!(
                    "log-commit volume: position {} holds epoch {} after epoch {epoch}",
                    at.position, header.epoch
                )));
            }
            epoch = header.epoch;
            apply(&mut map, &header, at.slot);
            rolled += 1;
        }
    }
    Ok(Recovered {
        checkpoint,
        map,
        end: cursor,
        epoch,
        rolled,
    })
}

/// Whether a whole slot's blocks lie in the volume (always, for a slot this layer
/// wrote with this layout).
fn fits(header: &Header, layout: &Layout) -> bool {
    let count = match header.kind {
        Kind::Data => 1,
        Kind::Zeroes { count } => count,
    };
    header
        .block
        .checked_add(count)
        .is_some_and(|end| end <= layout.blocks)
}

/// Maps what a retired (or rolled forward) slot holds.
pub(super) fn apply(map: &mut [u32], header: &Header, slot: u64) {
    let first = header.block as usize;
    match header.kind {
        Kind::Data => map[first] = slot as u32,
        Kind::Zeroes { count } => map[first..first + count as usize].fill(ZEROES),
    }
}
