//! A volume opened for transactions: the version counter, the open transactions, the
//! conflict window, and the commit path (decide, merge, log, hand over to the
//! [`crate::applier`]), one group of commits at a time.

use crate::applier::{Applier, DIRTY_BLOCKS_MAX};
use crate::layout::{self, BLOCK_BYTES};
use crate::log::Log;
use crate::transaction::{Body, Transaction};
use crate::window::{Committed, Window, Written};
use crate::{Isolation, Outcome, TxError};
use bytes::{Bytes, BytesMut};
use floe_blockdev::BlockDevice;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Open transactions (released ones included) at most: each pins the conflict
/// window's before-images until it ends.
pub const OPEN_MAX: usize = 1024;
/// Before-images the conflict window holds at most (64 MiB): past it, the
/// transactions that began longest ago are aborted (thesis 4.1's preemptive abort),
/// so one left open cannot pin every later commit's blocks in memory.
pub const WINDOW_BLOCKS_MAX: usize = 16384;
/// Records one group commit writes at most: a quarter of the ring, so that a group
/// always fits once the ring wrapped.
const GROUP_BYTES_MAX: u64 = layout::RING_BYTES / 4;
/// Blocks one group writes at most (records hold a header block besides).
const GROUP_BLOCKS_MAX: usize = (GROUP_BYTES_MAX / BLOCK_BYTES as u64) as usize;
const _: () = assert!(GROUP_BLOCKS_MAX < DIRTY_BLOCKS_MAX);

struct Unfinished<'a>(&'a Inner, bool);

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0
                .stop("a commit group was cancelled mid-way; reopening replays the log".into());
        }
    }
}

/// A commit waiting for the log.
struct Pending {
    body: Body,
    done: tokio::sync::oneshot::Sender<Result<Outcome, TxError>>,
}

#[derive(Clone)]
pub struct TxVolume {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    device: Arc<dyn BlockDevice>,
    data_blocks: u64,
    isolation: Isolation,
    state: Mutex<State>,
    /// Held across a whole group commit: versions, appends and applies go in one
    /// order.
    log: tokio::sync::Mutex<Log>,
    pending: Mutex<std::collections::VecDeque<Pending>>,
    /// Writes committed blocks in place after their members were answered.
    applier: Arc<Applier>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.applier.close();
    }
}

struct State {
    /// The newest version committed (logged, and in place or in the applier's dirty
    /// map): what a transaction beginning now sees.
    version: u64,
    /// Start versions of the open transactions, with their counts.
    open: BTreeMap<u64, usize>,
    window: Window,
    released: BTreeMap<u64, Body>,
    next_handle: u64,
    stopped: Option<String>,
    /// Transactions that began below this version were preempted.
    floor: u64,
}

impl State {
    /// Forgets the commits no open, unpreempted transaction can read or conflict with.
    fn prune(&mut self) {
        let oldest = self
            .open
            .keys()
            .next()
            .map(|start| (*start).max(self.floor));
        self.window.prune(oldest);
    }
}

impl TxVolume {
    /// Opens `device` for transactions with `isolation` by default: replays its log
    /// before anything reads it, formatting it first if it reads as zeroes.
    pub async fn open(
        device: Arc<dyn BlockDevice>,
        isolation: Isolation,
    ) -> Result<TxVolume, String> {
        let data_blocks = layout::data_blocks(device.size());
        if data_blocks == 0 {
            return Err(format!(
                "the volume is too small for transactions: the log takes its first {} MiB",
                layout::LOG_REGION_BYTES >> 20
            ));
        }
        let log = Log::open(device.clone()).await?;
        let applier = Applier::start(device.clone(), log.last_version());
        let state = State {
            version: log.last_version(),
            open: BTreeMap::new(),
            window: Window::default(),
            released: BTreeMap::new(),
            next_handle: 1,
            stopped: None,
            floor: 0,
        };
        Ok(TxVolume {
            inner: Arc::new(Inner {
                device,
                data_blocks,
                isolation,
                state: Mutex::new(state),
                log: tokio::sync::Mutex::new(log),
                pending: Mutex::new(Default::default()),
                applier,
            }),
        })
    }

    /// The volume below, for a caller that stops using transactions on it.
    pub fn device(&self) -> Arc<dyn BlockDevice> {
        self.inner.device.clone()
    }

    /// Waits until every committed block is written in place, and flushes: for a
    /// caller about to let the volume go, so that a plain reader of it (NBD) sees
    /// every commit without replaying the log.
    pub async fn settle(&self) -> Result<(), TxError> {
        self.inner.applier.drain().await.map_err(TxError::Stopped)?;
        self.inner.device.flush().await.map_err(TxError::Io)
    }

    /// Blocks a transaction may address.
    pub fn data_blocks(&self) -> u64 {
        self.inner.data_blocks
    }

    /// The newest committed version.
    pub fn version(&self) -> u64 {
        self.inner.state.lock().unwrap().version
    }

    /// Begins a transaction with the volume's isolation.
    pub fn begin(&self) -> Result<Transaction, TxError> {
        self.begin_with(self.inner.isolation)
    }

    pub fn begin_with(&self, isolation: Isolation) -> Result<Transaction, TxError> {
        let mut state = self.inner.state.lock().unwrap();
        if state.open.values().sum::<usize>() >= OPEN_MAX {
            return Err(TxError::TooManyOpen { open_max: OPEN_MAX });
        }
        let start = state.version;
        *state.open.entry(start).or_default() += 1;
        Ok(Transaction::new(
            self.inner.clone(),
            Body::new(start, isolation),
        ))
    }

    /// Takes over a transaction another task released ([`Transaction::release`]).
    pub fn take_over(&self, handle: u64) -> Result<Transaction, TxError> {
        let body = self.inner.state.lock().unwrap().released.remove(&handle);
        match body {
            Some(body) => Ok(Transaction::new(self.inner.clone(), body)),
            None => Err(TxError::UnknownHandle(handle)),
        }
    }
}

impl Inner {
    pub(crate) fn data_blocks(&self) -> u64 {
        self.data_blocks
    }

    pub(crate) fn release(&self, body: Body) -> u64 {
        let mut state = self.state.lock().unwrap();
        let handle = state.next_handle;
        state.next_handle += 1;
        state.released.insert(handle, body);
        handle
    }

    /// Forgets an ended transaction begun at `start`.
    pub(crate) fn end(&self, start: u64) {
        let mut state = self.state.lock().unwrap();
        let count = state
            .open
            .get_mut(&start)
            .expect("an open transaction is counted");
        *count -= 1;
        if *count == 0 {
            state.open.remove(&start);
        }
        state.prune();
    }

    /// `block` as of version `start`.
    pub(crate) async fn read_as_of(&self, start: u64, block: u64) -> Result<Bytes, TxError> {
        // The newest committed image: not yet in place, or in place (a block leaves the
        // dirty map only once written).
        let read = match self.applier.get(block) {
            Some(image) => image,
            None => self
                .device
                .read(layout::data_offset(block), BLOCK_BYTES as u32)
                .await
                .map_err(TxError::Io)?,
        };
        // Looked at after the read: a commit enters the window before it is logged,
        // handed over or written in place, so a block overwritten (or being
        // overwritten) since `start` is found.
        let state = self.state.lock().unwrap();
        if start < state.floor {
            return Err(TxError::Preempted {
                blocks_max: WINDOW_BLOCKS_MAX,
            });
        }
        Ok(state.window.as_of(start, block).unwrap_or(read))
    }

    /// Decides `body` and, if it commits and wrote, logs and applies its writes in a
    /// group with the other commits waiting; `body`'s transaction is still counted
    /// open.
    pub(crate) async fn commit(&self, body: Body) -> Result<Outcome, TxError> {
        if body.writes().next().is_none() {
            let state = self.state.lock().unwrap();
            if let Some(why) = &state.stopped {
                return Err(TxError::Stopped(why.clone()));
            }
            let touched = body.touched();
            let conflict = body.start < state.floor
                || body.isolation == Isolation::StrictSerializable
                    && state.window.conflicts(body.start, &touched.read);
            return Ok(if conflict {
                Outcome::Conflict
            } else {
                Outcome::Committed {
                    version: state.version,
                }
            });
        }
        let (done, mut answer) = tokio::sync::oneshot::channel();
        self.pending
            .lock()
            .unwrap()
            .push_back(Pending { body, done });
        // Whoever holds the log commits everything waiting (group commit): one log
        // write for many transactions; the applier writes their blocks in place.
        let mut log = self.log.lock().await;
        loop {
            match answer.try_recv() {
                Ok(outcome) => return outcome,
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {
                    self.commit_group(&mut log).await
                }
                // Its group's committer was cancelled mid-way, which stopped the volume.
                Err(_) => return Err(self.stop("a commit group was cancelled".into())),
            }
        }
    }

    /// Takes the oldest waiting commits, at most [`GROUP_BYTES_MAX`] of records (at
    /// least one), and answers each.
    async fn commit_group(&self, log: &mut Log) {
        // Back-pressure: the applier has room for any group before one is taken.
        if let Err(why) = self.applier.room(GROUP_BLOCKS_MAX).await {
            self.stop(why);
        }
        let group = {
            let mut pending = self.pending.lock().unwrap();
            let mut bytes = 0;
            let mut group = Vec::new();
            while let Some(next) = pending.front() {
                bytes += layout::record_bytes(next.body.writes().count());
                if !group.is_empty() && bytes > GROUP_BYTES_MAX {
                    break;
                }
                group.push(pending.pop_front().expect("present"));
            }
            group
        };
        // Cancelled mid-way (a caller's timeout), the group may be logged but not
        // applied: nothing may commit after it until a reopen replays the log.
        let mut unfinished = Unfinished(self, true);
        let bodies: Vec<&Body> = group.iter().map(|p| &p.body).collect();
        let outcomes = self.commit_bodies(log, &bodies).await;
        unfinished.1 = false;
        for (i, waiting) in group.into_iter().enumerate() {
            let outcome = outcomes.as_ref().map(|o| o[i]).map_err(Clone::clone);
            // The committer may have gone (its task was cancelled): nobody to answer.
            let _ = waiting.done.send(outcome);
        }
    }

    async fn commit_bodies(&self, log: &mut Log, group: &[&Body]) -> Result<Vec<Outcome>, TxError> {
        let mut version = {
            let state = self.state.lock().unwrap();
            if let Some(why) = &state.stopped {
                return Err(TxError::Stopped(why.clone()));
            }
            assert_eq!(
                state.version,
                log.last_version(),
                "every logged version is visible"
            );
            state.version
        };
        if let Some(why) = self.applier.failed() {
            return Err(self.stop(why));
        }
        let mut outcomes = Vec::new();
        let mut records = Vec::new();
        // The group's newest image of each block it writes.
        let mut newest: BTreeMap<u64, Bytes> = BTreeMap::new();
        for body in group {
            let touched = body.touched();
            let against = match body.isolation {
                Isolation::StrictSerializable => &touched.read,
                Isolation::Snapshot => &touched.written,
            };
            let conflict = {
                let state = self.state.lock().unwrap();
                body.start < state.floor || state.window.conflicts(body.start, against)
            };
            if conflict {
                outcomes.push(Outcome::Conflict);
                continue;
            }
            version += 1;
            // Merge onto the newest contents (in place, or an earlier member's) the
            // fragments this transaction wrote, so a concurrent commit's other
            // fragments of the same block are kept (thesis 4.2.2's lost-update step).
            let mut blocks = Vec::new();
            let mut written = BTreeMap::new();
            for (block, data, base) in body.writes() {
                let before = self.newest(block, base).await?;
                let fragments = touched.written[&block];
                let mut merged = BytesMut::from(&before[..]);
                fragments.overlay(data, &mut merged);
                let merged = merged.freeze();
                newest.insert(block, merged.clone());
                blocks.push((block, merged.clone()));
                let after = merged;
                written.insert(
                    block,
                    Written {
                        fragments,
                        before,
                        after,
                    },
                );
            }
            // In the window at once: later members conflict with it, and reads of
            // open transactions take its before-images from here on.
            self.enter_window(Committed {
                version,
                blocks: written,
            });
            records.push((version, blocks));
            outcomes.push(Outcome::Committed { version });
        }
        if records.is_empty() {
            return Ok(outcomes);
        }
        let bytes = records
            .iter()
            .map(|(_, b)| layout::record_bytes(b.len()))
            .sum();
        if !log.fits(bytes) {
            // The ring wraps: the superblock may move past the records before only once
            // their blocks are in place.
            let applied = self.applier.drain().await.map_err(|why| self.stop(why))?;
            assert_eq!(
                applied,
                log.last_version(),
                "the ring wraps over unapplied records"
            );
        }
        log.append(&records).await.map_err(|e| {
            self.stop(format!(
                "appending versions up to {version} to the log: {e}"
            ))
        })?;
        // Committed: durable in the log. Reads find the blocks in the dirty map from
        // here, and only now do new transactions see the versions (no await since the
        // append, so a cancelled group stops the volume only before it).
        self.applier.hand_over(version, newest);
        self.state.lock().unwrap().version = version;
        Ok(outcomes)
    }

    /// The newest contents of `block` (committed, or an earlier group member's):
    /// the window's if a commit there wrote it; else the image the transaction read
    /// as of its start (still the newest: a later commit would be in the window, or
    /// have preempted the transaction); else the applier's image; else read from the
    /// volume.
    async fn newest(&self, block: u64, base: Option<&Bytes>) -> Result<Bytes, TxError> {
        if let Some(image) = self.state.lock().unwrap().window.newest(block) {
            return Ok(image);
        }
        if let Some(image) = base.cloned().or_else(|| self.applier.get(block)) {
            return Ok(image);
        }
        self.device
            .read(layout::data_offset(block), BLOCK_BYTES as u32)
            .await
            .map_err(|e| self.stop(format!("reading block {block} to commit: {e}")))
    }

    fn enter_window(&self, committed: Committed) {
        let mut state = self.state.lock().unwrap();
        state.window.push(committed);
        if state.window.blocks() > WINDOW_BLOCKS_MAX {
            // Down to half, so that preempting is rare.
            let floor = state.window.floor_for(WINDOW_BLOCKS_MAX / 2);
            tracing::warn!(floor, "preempting the transactions that began before version {floor}: the conflict window is full");
            state.floor = state.floor.max(floor);
            state.prune();
        }
    }

    /// Stops all later commits (fail-stop: what the failed one left is unknown until
    /// the log is replayed).
    fn stop(&self, why: String) -> TxError {
        tracing::error!("transactions stopped: {why}");
        let mut state = self.state.lock().unwrap();
        TxError::Stopped(state.stopped.get_or_insert(why).clone())
    }
}
