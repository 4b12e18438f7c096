//! The workload's ledger: which write each block should hold. Every block written
//! carries its writer's id, so a read names the write it returns.
//!
//! One operation at a time per block (the ledger locks blocks), so a block's history
//! is a sequence: the last acknowledged write, then writes that failed or never
//! returned (they may or may not have landed). A read must return the last
//! acknowledged write or one of those after it; anything else lost an acknowledged
//! write or brought a superseded one back.
//!
//! Write-back (`WriteMode::WriteBack`): an acknowledged write that is not FUA survives
//! a kill -9 but not necessarily a power cut, until a FLUSH that began after its
//! acknowledgment completed (on the device that acknowledged it). So each block also
//! has a *floor*: the last write known durable (FUA, a zero, or the latest write a
//! completed FLUSH covers), and every write after it (acknowledged or not). Until a
//! power cut the strict rule holds; once one happened, a block whose last
//! acknowledgment came before it may hold its floor or any write after it. In
//! write-through every acknowledged write is durable: floor and last acknowledged
//! write are one, and the rule is the strict one.

use bytes::{BufMut, Bytes, BytesMut};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const BLOCK_BYTES: u64 = 4096;

#[derive(Default)]
struct History {
    /// Content id of the last acknowledged write (0: zeroes, never written).
    acked: u64,
    /// When it began (the ledger's sequence, see [`Inner::seq`]).
    acked_began: u64,
    /// Content ids of later writes that failed or never returned.
    uncertain: Vec<u64>,
    /// Content id of the last write known durable: a power cut cannot take it.
    floor: u64,
    /// Writes after the floor, oldest first.
    after_floor: Vec<Later>,
    busy: bool,
    /// Content id of the write in progress, if any.
    in_flight: Option<u64>,
    /// Every write begun, in order, with when it was acknowledged (stale reads).
    log: Vec<Logged>,
}

/// A write in a block's log.
#[derive(Clone, Copy, Debug)]
struct Logged {
    id: u64,
    acked_at: Option<Duration>,
}

/// A write after a block's floor.
#[derive(Clone, Copy, Debug)]
struct Later {
    id: u64,
    /// Acknowledged (not durably) to this device, at this sequence number.
    acked: Option<(u64, u64)>,
}

/// An acknowledged write, for the split-brain check.
#[derive(Debug, Clone)]
pub struct Ack {
    pub at: Duration,
    pub gateway: String,
    pub write: u64,
}

#[derive(Default)]
struct Inner {
    blocks: BTreeMap<u64, History>,
    /// Orders acknowledgments, FLUSHes and power cuts: each takes the next number.
    seq: u64,
    /// The sequence number of the last power cut (0: none yet).
    power_cut: u64,
    next_write: u64,
    acks: Vec<Ack>,
    reads_checked: u64,
    flushes: u64,
    violations: Vec<String>,
    snapshots: Vec<SnapshotCheck>,
    snapshot_reads: u64,
    /// Per block, the acknowledged writes the stale reader has seen (a rank: how
    /// many of the block's acknowledged writes its read held).
    stale_seen: BTreeMap<u64, usize>,
    stale_reads: u64,
}

/// What a snapshot may hold: per block, the writes acknowledged or in doubt when its
/// creation began, and every write begun until its creation returned (`open` until
/// then).
struct SnapshotCheck {
    name: String,
    allowed: BTreeMap<u64, Vec<u64>>,
    open: bool,
}

#[derive(Clone, Default)]
pub struct Ledger {
    inner: Arc<Mutex<Inner>>,
}

/// The bytes of `block` as write `id` leaves it (zeroes for id 0).
pub fn pattern(id: u64, block: u64) -> Bytes {
    let mut out = BytesMut::with_capacity(BLOCK_BYTES as usize);
    if id == 0 {
        out.put_bytes(0, BLOCK_BYTES as usize);
    } else {
        for _ in 0..BLOCK_BYTES / 16 {
            out.put_u64_le(id);
            out.put_u64_le(block);
        }
    }
    out.freeze()
}

/// Which write's content `data` (one block) is, if it is one whole.
fn content_of(data: &[u8], block: u64) -> Option<u64> {
    let id = u64::from_le_bytes(data[..8].try_into().unwrap());
    (data == pattern(id, block).as_ref()).then_some(id)
}

/// Blocks an operation holds; dropped unfinished (its gateway died), its write's
/// outcome is unknown.
pub struct Held {
    ledger: Ledger,
    pub first: u64,
    pub count: u64,
    /// Content id of the write in progress (0 for a zero), if a write.
    write: Option<u64>,
    /// When the write began (the ledger's sequence).
    began: u64,
    finished: bool,
}

/// What an acknowledgment promises.
#[derive(Debug, Clone, Copy)]
pub enum Durability {
    /// Durable once acknowledged: write-through, FUA, a zero.
    Durable,
    /// Durable once a FLUSH of this device (an id per opened device), begun after
    /// the acknowledgment, completed (write-back).
    UntilFlushOf(u64),
}

impl Ledger {
    pub fn add_blocks(&self, blocks: impl IntoIterator<Item = u64>) {
        let mut inner = self.inner.lock().unwrap();
        for block in blocks {
            inner.blocks.entry(block).or_default();
        }
    }

    /// Locks `count` blocks from `first` if all are known and free.
    pub fn try_hold(&self, first: u64, count: u64) -> Option<Held> {
        let mut inner = self.inner.lock().unwrap();
        for block in first..first + count {
            if inner.blocks.get(&block).is_none_or(|h| h.busy) {
                return None;
            }
        }
        for block in first..first + count {
            inner.blocks.get_mut(&block).unwrap().busy = true;
        }
        Some(Held {
            ledger: self.clone(),
            first,
            count,
            write: None,
            began: 0,
            finished: false,
        })
    }

    /// A new write's content id; `zero` writes zeroes (content 0).
    pub fn begin_write(&self, held: &mut Held, zero: bool) -> u64 {
        let mut inner = self.inner.lock().unwrap();
        inner.next_write += 1;
        let id = if zero { 0 } else { inner.next_write };
        held.write = Some(id);
        held.began = inner.next_seq();
        for block in held.first..held.first + held.count {
            let history = inner.blocks.get_mut(&block).unwrap();
            history.in_flight = Some(id);
            history.log.push(Logged { id, acked_at: None });
            for snapshot in inner.snapshots.iter_mut().filter(|s| s.open) {
                snapshot.allowed.entry(block).or_default().push(id);
            }
        }
        id
    }

    /// A snapshot's creation begins: every block's acknowledged write, the writes in
    /// doubt and those in flight may be in it, and any write begun until
    /// [`Ledger::snapshot_taken`].
    pub fn begin_snapshot(&self, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        let allowed = inner
            .blocks
            .iter()
            .map(|(block, h)| {
                let ids = std::iter::once(h.acked).chain(h.uncertain.iter().copied());
                (*block, ids.chain(h.in_flight).collect())
            })
            .collect();
        inner.snapshots.push(SnapshotCheck {
            name: name.to_string(),
            allowed,
            open: true,
        });
    }

    /// The snapshot's creation returned: writes begun from here on are not in it.
    pub fn snapshot_taken(&self, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        if let Some(snapshot) = inner.snapshots.iter_mut().find(|s| s.name == name) {
            snapshot.open = false;
        }
    }

    /// Blocks of snapshots read and checked.
    pub fn snapshot_reads(&self) -> u64 {
        self.inner.lock().unwrap().snapshot_reads
    }

    /// Snapshots begun, by name.
    pub fn snapshots(&self) -> Vec<String> {
        let inner = self.inner.lock().unwrap();
        inner.snapshots.iter().map(|s| s.name.clone()).collect()
    }

    /// Checks a snapshot's block as read; the violation, if any.
    pub fn check_snapshot_read(&self, name: &str, block: u64, data: &[u8]) -> Option<String> {
        let mut inner = self.inner.lock().unwrap();
        inner.snapshot_reads += 1;
        let snapshot = inner.snapshots.iter().find(|s| s.name == name)?;
        let allowed = snapshot
            .allowed
            .get(&block)
            .map_or(&[0][..], |a| a.as_slice());
        if allowed.iter().any(|id| pattern(*id, block) == data) {
            return None;
        }
        let held = data.get(..16).unwrap_or_default();
        Some(format!(
            "snapshot {name}, block {block}: holds none of writes {allowed:?} (begins {held:02x?})"
        ))
    }

    /// A FLUSH begins; pass the number returned to [`Ledger::flushed`] if it succeeds.
    pub fn begin_flush(&self) -> u64 {
        self.inner.lock().unwrap().next_seq()
    }

    /// A FLUSH of `device` that began at `began` (see [`Ledger::begin_flush`])
    /// succeeded: every write that device acknowledged before it began is durable, so
    /// each block's latest such write becomes its floor.
    pub fn flushed(&self, device: u64, began: u64) {
        let mut inner = self.inner.lock().unwrap();
        inner.flushes += 1;
        for history in inner.blocks.values_mut() {
            let covered = history.after_floor.iter().rposition(|later| {
                later
                    .acked
                    .is_some_and(|(by, at)| by == device && at < began)
            });
            if let Some(i) = covered {
                history.floor = history.after_floor[i].id;
                history.after_floor.drain(..=i);
            }
        }
    }

    /// The power of some servers was cut: writes begun before may be lost unless
    /// durable.
    pub fn power_cut(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.power_cut = inner.next_seq();
    }

    pub fn acks(&self) -> Vec<Ack> {
        self.inner.lock().unwrap().acks.clone()
    }

    pub fn violations(&self) -> Vec<String> {
        self.inner.lock().unwrap().violations.clone()
    }

    pub fn reads_checked(&self) -> u64 {
        self.inner.lock().unwrap().reads_checked
    }

    /// FLUSHes that succeeded.
    pub fn flushes(&self) -> u64 {
        self.inner.lock().unwrap().flushes
    }

    pub fn writes_acked(&self) -> usize {
        self.inner.lock().unwrap().acks.len()
    }

    pub fn blocks(&self) -> Vec<u64> {
        self.inner.lock().unwrap().blocks.keys().copied().collect()
    }

    /// Checks `data`, read from block `first` on, against the histories.
    pub fn check_read(&self, first: u64, data: &[u8], at: Duration, what: &str) {
        let mut inner = self.inner.lock().unwrap();
        inner.reads_checked += 1;
        for (i, block_data) in data.chunks(BLOCK_BYTES as usize).enumerate() {
            let block = first + i as u64;
            let history = &inner.blocks[&block];
            let found = content_of(block_data, block);
            // No power cut since the last acknowledged write began: nothing
            // acknowledged may be lost (kill -9 keeps the page cache).
            let strict = inner.power_cut == 0 || history.acked_began > inner.power_cut;
            let allowed = found.is_some_and(|id| {
                if strict {
                    id == history.acked || history.uncertain.contains(&id)
                } else {
                    id == history.floor || history.after_floor.iter().any(|l| l.id == id)
                }
            });
            if !allowed {
                let found = found.map_or("torn or foreign data".to_string(), |id| {
                    format!("write {id}")
                });
                let message = if strict {
                    format!(
                        "{what} at {at:?}: block {block} holds {found} but the last \
                         acknowledged write is {} (unacknowledged since: {:?})",
                        history.acked, history.uncertain
                    )
                } else {
                    format!(
                        "{what} at {at:?}: block {block} holds {found} but, after a power \
                         cut, the last durable write is {} (since: {:?}; the last \
                         acknowledged is {}, unacknowledged since: {:?})",
                        history.floor, history.after_floor, history.acked, history.uncertain
                    )
                };
                inner.violations.push(message);
            }
        }
    }
}

impl Ledger {
    /// Checks a stale read of `data` from block `first` on, begun at `began` with
    /// bound `staleness`: each block holds a write (acknowledged or not) no older
    /// than the last one acknowledged before `began - staleness`, nor older than
    /// what an earlier stale read of the block held (monotonic reads). Blocks are
    /// ranked by the acknowledged writes they hold; an unacknowledged write ranks
    /// with the acknowledged one before it, and zeroes (one content, many places in
    /// a log) take their lowest rank that passes, so the check never guesses high.
    pub fn check_stale_read(&self, first: u64, data: &[u8], began: Duration, staleness: Duration) {
        let mut inner = self.inner.lock().unwrap();
        inner.stale_reads += 1;
        let due = began.saturating_sub(staleness);
        for (i, block_data) in data.chunks(BLOCK_BYTES as usize).enumerate() {
            let block = first + i as u64;
            let log = &inner.blocks[&block].log;
            // Rank of each place in the log; the block's first state (zeroes) ranks 0.
            let mut places = vec![(0u64, 0usize)];
            let mut rank = 0;
            for logged in log {
                rank += usize::from(logged.acked_at.is_some());
                places.push((logged.id, rank));
            }
            let bound = log
                .iter()
                .filter(|l| l.acked_at.is_some_and(|at| began >= staleness && at < due))
                .count();
            let seen = inner.stale_seen.get(&block).copied().unwrap_or(0);
            let floor = bound.max(seen);
            let found = content_of(block_data, block);
            let held = found.and_then(|id| {
                places
                    .iter()
                    .filter(|(place, rank)| *place == id && *rank >= floor)
                    .map(|(_, rank)| *rank)
                    .min()
            });
            match held {
                Some(rank) => {
                    inner.stale_seen.insert(block, rank);
                }
                None => {
                    let found =
                        found.map_or("torn or foreign data".into(), |id| format!("write {id}"));
                    let log: Vec<(u64, Option<f64>)> = log
                        .iter()
                        .map(|l| (l.id, l.acked_at.map(|a| a.as_secs_f64())))
                        .collect();
                    let message = format!(
                        "stale read (bound {staleness:?}) begun at {began:?}: block {block} holds \
                         {found}, older than the {floor}th acknowledged write (due by the \
                         bound: {bound}, seen before: {seen}); the block's writes (id, acked \
                         at s): {log:?}"
                    );
                    inner.violations.push(message);
                }
            }
        }
    }

    /// Blocks stale reads returned and checked.
    pub fn stale_reads(&self) -> u64 {
        self.inner.lock().unwrap().stale_reads
    }
}

impl Inner {
    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }
}

impl Held {
    /// The write in progress finished: acknowledged by `gateway` at `at` with
    /// `durability`, or failed.
    pub fn finish_write(mut self, acked: Option<(Duration, &str, Durability)>) {
        self.finished = true;
        let id = self.write.expect("a write was begun");
        let mut inner = self.ledger.inner.lock().unwrap();
        let seq = inner.next_seq();
        for block in self.first..self.first + self.count {
            let history = inner.blocks.get_mut(&block).unwrap();
            match acked {
                Some((at, _, durability)) => {
                    let logged = history.log.last_mut().expect("logged when begun");
                    assert_eq!(logged.id, id, "one write at a time per block");
                    logged.acked_at = Some(at);
                    history.acked = id;
                    history.acked_began = self.began;
                    history.uncertain.clear();
                    match durability {
                        Durability::Durable => {
                            history.floor = id;
                            history.after_floor.clear();
                        }
                        Durability::UntilFlushOf(device) => history.after_floor.push(Later {
                            id,
                            acked: Some((device, seq)),
                        }),
                    }
                }
                None => {
                    history.uncertain.push(id);
                    history.after_floor.push(Later { id, acked: None });
                }
            }
        }
        if let Some((at, gateway, _)) = acked {
            inner.acks.push(Ack {
                at,
                gateway: gateway.to_string(),
                write: id,
            });
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut inner = self.ledger.inner.lock().unwrap();
        for block in self.first..self.first + self.count {
            let history = inner.blocks.get_mut(&block).unwrap();
            history.busy = false;
            history.in_flight = None;
            if !self.finished {
                if let Some(id) = self.write {
                    history.uncertain.push(id);
                    history.after_floor.push(Later { id, acked: None });
                }
            }
        }
    }
}
