//! The layer's state in memory: the unretired writes in acknowledgement order (what
//! reads look in first), the retired block map, and the log's allocation rule.
//!
//! **Allocation.** Log positions go to writes in acknowledgement order; position `p`
//! writes slot `perm(p)` unless the last durable checkpoint's map uses that slot, and
//! then `p` is skipped. The rule consults the *checkpoint's* map, never the live one:
//! roll-forward only has the checkpoint, and must skip exactly the positions the
//! writer skipped, or it stops early (a slot freed since the checkpoint that the
//! writer skipped reads as garbage) or overwrites a block the checkpoint still maps
//! (a freed slot the writer reused while the checkpoint maps it; the paper's
//! allocation from the live bitmap). A slot freed since the checkpoint is reused only
//! after the next one. Positions stay below the checkpoint's position + P, so no slot
//! is written twice before roll-forward could see both.
//!
//! **Retirement.** A write is done when the volume below took it (unsynced); a FLUSH
//! below, begun once it was done, makes it durable; it retires (updates the map) once
//! every earlier position retired. A FUA write answers when it retires.
//!
//! **Checkpoints** are taken quiescent: issuing stops, the issued writes retire, the
//! retired state goes to disk at the next position, and issuing goes on under the
//! new checkpoint's map. Writes acknowledged meanwhile wait in memory. Quiescence
//! keeps every slot header on disk at a position below the checkpoint's, so
//! roll-forward from it cannot take an older write for a newer one.

use super::checkpoint::Checkpoint;
use super::permutation::{Cursor, Permutation};
use super::recovery::{apply, is_used, used_slots};
use super::slot::{Header, Kind};
use super::ZEROES;
use bytes::Bytes;
use floe_blockdev::IoError;
use floe_protocol::log_commit::{Layout, BLOCK_BYTES};
use std::collections::VecDeque;
use tokio::sync::oneshot;

/// Slot writes in flight below at once. Unretired writes beyond wait in memory:
/// thousands of 8 KiB writes queued on the chunk servers at once (a 64 MiB limit is
/// 16,384 blocks) kept a FLUSH's sync waiting past its timeout, and the layer broke.
const IN_FLIGHT_MAX: usize = 256;

/// What one log position writes.
#[derive(Debug, Clone)]
pub(super) enum Content {
    /// One whole block.
    Data(Bytes),
    /// `count` blocks read as zeroes.
    Zeroes { count: u64 },
}

/// Where a block's latest acknowledged content is.
#[derive(Debug, Clone)]
pub(super) enum Source {
    /// An unretired write.
    Data(Bytes),
    Zeroes,
    /// A retired write, in this slot.
    Slot(u64),
}

struct Entry {
    id: u64,
    block: u64,
    content: Content,
    epoch: u64,
    /// Its position, once issued.
    at: Option<Cursor>,
    done: bool,
    durable: bool,
    /// A FUA write's reply, on the last entry of its change.
    reply: Option<oneshot::Sender<Result<(), IoError>>>,
}

impl Entry {
    fn covers(&self, block: u64) -> bool {
        match self.content {
            Content::Data(_) => self.block == block,
            Content::Zeroes { count } => self.block <= block && block < self.block + count,
        }
    }
}

/// A slot write to send.
pub(super) struct Issue {
    pub(super) id: u64,
    pub(super) slot: u64,
    pub(super) header: Header,
    pub(super) data: Option<Bytes>,
}

pub(super) struct Log {
    layout: Layout,
    permutation: Permutation,
    /// The retired state: each block's slot, or [`ZEROES`].
    map: Vec<u32>,
    /// The slots the last durable checkpoint's map uses.
    used: Vec<u64>,
    sequence: u64,
    /// The next position to hand out.
    next: Cursor,
    /// The checkpoint's position + P: the next checkpoint comes before it.
    limit: u64,
    /// Positions handed out since the checkpoint after which one is taken.
    checkpoint_every: u64,
    allocated: u64,
    /// The client's FLUSH count, the epoch new writes get.
    epoch: u64,
    /// The epoch of the last retired write (what a checkpoint records).
    retired_epoch: u64,
    /// Unretired entries in acknowledgement order; ids are consecutive.
    queue: VecDeque<Entry>,
    next_id: u64,
    /// The id of the first entry not yet issued.
    next_issue: u64,
    last_issued: Option<Cursor>,
    last_retired: Option<u64>,
    /// Entries done since the last flush below began: the next one covers them.
    done_unflushed: Vec<u64>,
    /// Bytes of the queue's entries (a block each).
    pub(super) bytes: u64,
    /// Slot writes issued and not yet answered, at most [`IN_FLIGHT_MAX`].
    in_flight: usize,
    /// No new issues: a checkpoint is due.
    checkpointing: bool,
    flushing: bool,
    /// A write or flush below failed: nothing after it can be made durable; every
    /// later FLUSH, FUA write and change fails. Reopening recovers the prefix.
    pub(super) broken: Option<IoError>,
    /// The layer was dropped: retire what is left, checkpoint, stop.
    pub(super) closing: bool,
}

impl Log {
    /// Under `checkpoint`, durable (or, read-only, as recovered).
    pub(super) fn new(
        layout: Layout,
        permutation: Permutation,
        checkpoint: Checkpoint,
        checkpoint_every: u64,
    ) -> Log {
        assert!(checkpoint_every > 0);
        Log {
            used: used_slots(&checkpoint.map, layout.slots),
            layout,
            permutation,
            map: checkpoint.map,
            sequence: checkpoint.sequence,
            next: checkpoint.cursor,
            limit: permutation.cycle_later(checkpoint.cursor).position,
            checkpoint_every,
            allocated: 0,
            epoch: checkpoint.epoch,
            retired_epoch: checkpoint.epoch,
            queue: VecDeque::new(),
            next_id: 0,
            next_issue: 0,
            last_issued: None,
            last_retired: None,
            done_unflushed: Vec::new(),
            bytes: 0,
            in_flight: 0,
            checkpointing: false,
            flushing: false,
            broken: None,
            closing: false,
        }
    }

    /// A client FLUSH: later writes are of the next epoch.
    pub(super) fn flush(&mut self) -> Result<(), IoError> {
        self.epoch += 1;
        self.broken.clone().map_or(Ok(()), Err)
    }

    pub(super) fn lookup(&self, block: u64) -> Source {
        if let Some(entry) = self.queue.iter().rev().find(|e| e.covers(block)) {
            return match &entry.content {
                Content::Data(data) => Source::Data(data.clone()),
                Content::Zeroes { .. } => Source::Zeroes,
            };
        }
        match self.map[block as usize] {
            ZEROES => Source::Zeroes,
            slot => Source::Slot(slot.into()),
        }
    }

    /// Whether any unretired entry touches blocks `[first, end)`.
    pub(super) fn pending(&self, first: u64, end: u64) -> bool {
        self.queue.iter().any(|e| {
            let count = match e.content {
                Content::Data(_) => 1,
                Content::Zeroes { count } => count,
            };
            e.block < end && first < e.block + count
        })
    }

    /// Acknowledges a change: its entries, in order; `fua`: the receiver answers once
    /// the last (and so all) retired.
    pub(super) fn push(
        &mut self,
        entries: Vec<(u64, Content)>,
        fua: bool,
    ) -> Option<oneshot::Receiver<Result<(), IoError>>> {
        assert!(!entries.is_empty());
        let count = entries.len();
        let mut receiver = None;
        for (i, (block, content)) in entries.into_iter().enumerate() {
            let reply = (fua && i + 1 == count).then(|| {
                let (reply, answer) = oneshot::channel();
                receiver = Some(answer);
                reply
            });
            self.queue.push_back(Entry {
                id: self.next_id,
                block,
                content,
                epoch: self.epoch,
                at: None,
                done: false,
                durable: false,
                reply,
            });
            self.next_id += 1;
            self.bytes += BLOCK_BYTES;
        }
        receiver
    }

    fn entry(&mut self, id: u64) -> &mut Entry {
        let front = self.queue.front().expect("an unretired entry").id;
        let entry = &mut self.queue[(id - front) as usize];
        assert_eq!(entry.id, id);
        entry
    }

    /// Hands positions to waiting entries, in order, and returns their slot writes.
    /// Stops where a checkpoint is due.
    pub(super) fn issuable(&mut self) -> Vec<Issue> {
        let mut out = Vec::new();
        while self.next_issue < self.next_id
            && self.in_flight < IN_FLIGHT_MAX
            && !self.checkpointing
            && self.broken.is_none()
        {
            if self.allocated >= self.checkpoint_every {
                self.checkpointing = true;
                break;
            }
            // The allocation rule: skip the slots the durable checkpoint uses.
            while self.next.position < self.limit && is_used(&self.used, self.next.slot) {
                self.next = self.permutation.next(self.next);
            }
            if self.next.position >= self.limit {
                self.checkpointing = true;
                break;
            }
            let at = self.next;
            self.next = self.permutation.next(at);
            self.allocated += 1;
            self.in_flight += 1;
            let id = self.next_issue;
            self.next_issue += 1;
            let entry = self.entry(id);
            assert!(entry.at.is_none(), "issued once");
            entry.at = Some(at);
            let (block, epoch, content) = (entry.block, entry.epoch, entry.content.clone());
            if let Some(last) = self.last_issued {
                assert!(at.position > last.position, "positions go up");
            }
            self.last_issued = Some(at);
            let (kind, data) = match content {
                Content::Data(data) => (Kind::Data, Some(data)),
                Content::Zeroes { count } => (Kind::Zeroes { count }, None),
            };
            out.push(Issue {
                id,
                slot: at.slot,
                header: Header {
                    kind,
                    block,
                    position: at.position,
                    epoch,
                },
                data,
            });
        }
        out
    }

    /// The volume below answered slot write `id`.
    pub(super) fn done(&mut self, id: u64, result: Result<(), IoError>) {
        assert!(self.in_flight > 0, "an answer to a slot write in flight");
        self.in_flight -= 1;
        match result {
            Ok(()) => {
                let entry = self.entry(id);
                assert!(entry.at.is_some() && !entry.done, "answered once");
                entry.done = true;
                self.done_unflushed.push(id);
            }
            Err(e) => self.break_with(e),
        }
    }

    /// Marks a flush under way and returns the entries it covers: every one done.
    pub(super) fn flush_due(&mut self) -> Vec<u64> {
        if self.flushing || self.broken.is_some() {
            return Vec::new();
        }
        let ids = std::mem::take(&mut self.done_unflushed);
        self.flushing = !ids.is_empty();
        ids
    }

    /// A flush below, begun after entries `ids` were done, returned.
    pub(super) fn flushed(&mut self, ids: &[u64], result: Result<(), IoError>) {
        assert!(self.flushing);
        self.flushing = false;
        if let Err(e) = result {
            return self.break_with(e);
        }
        if self.broken.is_some() {
            return;
        }
        for &id in ids {
            let entry = self.entry(id);
            assert!(
                entry.done && !entry.durable,
                "flushed once, after it was done"
            );
            entry.durable = true;
        }
        while self.queue.front().is_some_and(|e| e.durable) {
            let entry = self.queue.pop_front().expect("a front");
            let at = entry.at.expect("durable entries were issued");
            if let Some(last) = self.last_retired {
                assert!(at.position > last, "retired in position order");
            }
            assert!(entry.epoch >= self.retired_epoch, "epochs retire in order");
            self.last_retired = Some(at.position);
            self.retired_epoch = entry.epoch;
            let kind = match entry.content {
                Content::Data(_) => Kind::Data,
                Content::Zeroes { count } => Kind::Zeroes { count },
            };
            let header = Header {
                kind,
                block: entry.block,
                position: at.position,
                epoch: entry.epoch,
            };
            apply(&mut self.map, &header, at.slot);
            self.bytes -= BLOCK_BYTES;
            if let Some(reply) = entry.reply {
                let _ = reply.send(Ok(()));
            }
        }
    }

    /// The checkpoint to write now, if one is due and every issued write retired.
    /// Closing, one is due once the queue is empty and anything was written.
    pub(super) fn checkpoint_due(&mut self) -> Option<Checkpoint> {
        if self.closing && self.queue.is_empty() && self.allocated > 0 {
            self.checkpointing = true;
        }
        let quiescent = self.queue.front().is_none_or(|e| e.at.is_none());
        if !self.checkpointing || !quiescent || self.broken.is_some() {
            return None;
        }
        assert!(!self.flushing, "a flush covers issued entries only");
        Some(Checkpoint {
            sequence: self.sequence + 1,
            cursor: self.next,
            epoch: self.retired_epoch,
            map: self.map.clone(),
        })
    }

    /// Checkpoint `checkpoint` was written and flushed (or failed).
    pub(super) fn checkpointed(&mut self, checkpoint: Checkpoint, result: Result<(), IoError>) {
        if let Err(e) = result {
            return self.break_with(e);
        }
        assert_eq!(checkpoint.sequence, self.sequence + 1);
        assert_eq!(checkpoint.cursor, self.next, "taken quiescent");
        self.used = used_slots(&checkpoint.map, self.layout.slots);
        self.sequence = checkpoint.sequence;
        self.limit = self.permutation.cycle_later(checkpoint.cursor).position;
        self.allocated = 0;
        self.checkpointing = false;
    }

    /// Whether the background task is done: dropped, and everything retired and
    /// checkpointed (or broken: nothing more can be).
    pub(super) fn finished(&self) -> bool {
        self.closing
            && (self.broken.is_some()
                || (self.queue.is_empty() && self.allocated == 0 && !self.flushing))
    }

    fn break_with(&mut self, e: IoError) {
        if self.broken.is_none() {
            tracing::error!(
                unretired = self.queue.len(),
                "log-commit: a write below failed; the volume keeps what was retired, later FLUSHes, FUA writes and writes fail until it is reopened: {e}"
            );
            self.broken = Some(e.clone());
        }
        for entry in &mut self.queue {
            if let Some(reply) = entry.reply.take() {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}
