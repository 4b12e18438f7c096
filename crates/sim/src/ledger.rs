//! The workload's ledger: which write each block should hold. Every block written
//! carries its writer's id, so a read names the write it returns.
//!
//! One operation at a time per block (the ledger locks blocks), so a block's history
//! is a sequence: the last acknowledged write, then writes that failed or never
//! returned (they may or may not have landed). A read must return the last
//! acknowledged write or one of those after it; anything else lost an acknowledged
//! write or brought a superseded one back.

use bytes::{BufMut, Bytes, BytesMut};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const BLOCK_BYTES: u64 = 4096;

#[derive(Default)]
struct History {
    /// Content id of the last acknowledged write (0: zeroes, never written).
    acked: u64,
    /// Content ids of later writes that failed or never returned.
    uncertain: Vec<u64>,
    busy: bool,
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
    next_write: u64,
    acks: Vec<Ack>,
    reads_checked: u64,
    violations: Vec<String>,
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
    finished: bool,
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
            finished: false,
        })
    }

    /// A new write's content id; `zero` writes zeroes (content 0).
    pub fn begin_write(&self, held: &mut Held, zero: bool) -> u64 {
        let mut inner = self.inner.lock().unwrap();
        inner.next_write += 1;
        let id = if zero { 0 } else { inner.next_write };
        held.write = Some(id);
        id
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
            let allowed =
                found.is_some_and(|id| id == history.acked || history.uncertain.contains(&id));
            if !allowed {
                let message = format!(
                    "{what} at {at:?}: block {block} holds {} but the last acknowledged \
                     write is {} (unacknowledged since: {:?})",
                    found.map_or("torn or foreign data".to_string(), |id| format!(
                        "write {id}"
                    )),
                    history.acked,
                    history.uncertain
                );
                inner.violations.push(message);
            }
        }
    }
}

impl Held {
    /// The write in progress finished: acknowledged by `gateway` at `at`, or failed.
    pub fn finish_write(mut self, acked: Option<(Duration, &str)>) {
        self.finished = true;
        let id = self.write.expect("a write was begun");
        let mut inner = self.ledger.inner.lock().unwrap();
        for block in self.first..self.first + self.count {
            let history = inner.blocks.get_mut(&block).unwrap();
            match acked {
                Some(_) => {
                    history.acked = id;
                    history.uncertain.clear();
                }
                None => history.uncertain.push(id),
            }
        }
        if let Some((at, gateway)) = acked {
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
            if !self.finished {
                if let Some(id) = self.write {
                    history.uncertain.push(id);
                }
            }
        }
    }
}
