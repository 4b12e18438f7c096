//! Blizzard's flush-epoch write mode (NSDI'14 section 2.5.2), a layer over the volume.
//!
//! Writes (and zeroes and trims) are acknowledged at once and reach the volume below
//! in epoch order: a FLUSH closes the current epoch, and no change of a later epoch is
//! issued before every change of the earlier ones is durable. A crash of the gateway
//! (or of every server) therefore leaves the volume holding a prefix of the epochs:
//! all up to some R, part of R+1, nothing later. Within an epoch changes go out
//! concurrently; one that overlaps an earlier change still in flight waits for it, so
//! the later one wins.
//!
//! The volume below writes unsynced (see `replicated::write_back`): a change is done
//! when the replicas logged it, and retires once a FLUSH of the volume below, begun
//! after it was done, returned. One such flush at a time covers every change done
//! before it: the replicas sync in groups, not per write.
//!
//! - Reads see the latest acknowledged write: unretired changes overlay the volume.
//! - A FUA write is durable before its reply (a file system's commit record relies on
//!   it), after every earlier epoch.
//! - At most `limit` bytes of changes are unretired; beyond that a write waits.
//! - A change that fails after it was acknowledged fails the next FLUSH or FUA write:
//!   the error is never lost.
//! - Dropped (the last NBD connection closed), the layer goes on until every change
//!   is retired; [`crate::draining::drained`] waits for every such layer of the
//!   process.

use crate::draining::Live;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use floe_blockdev::{check_range, BlockDevice, Extent, IoError};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::sync::{oneshot, Notify};

#[derive(Debug, Clone)]
enum What {
    Write(Bytes),
    Zero { length: u64, may_punch: bool },
    Trim { length: u64 },
}

impl What {
    fn length(&self) -> u64 {
        match self {
            What::Write(data) => data.len() as u64,
            What::Zero { length, .. } | What::Trim { length } => *length,
        }
    }
}

struct Change {
    id: u64,
    epoch: u64,
    offset: u64,
    what: What,
    issued: bool,
    /// Its result from the volume below, once it has one; it then waits for a flush.
    done: Option<Result<(), IoError>>,
    /// A FUA write's reply, sent once it is durable.
    durable: Option<oneshot::Sender<Result<(), IoError>>>,
}

impl Change {
    fn overlaps(&self, offset: u64, length: u64) -> bool {
        self.offset < offset + length && offset < self.offset + self.what.length()
    }
}

#[derive(Default)]
struct Queue {
    epoch: u64,
    next_id: u64,
    /// Unretired changes in acknowledgement order (epochs never decrease).
    changes: VecDeque<Change>,
    bytes: u64,
    /// The first failure since the last FLUSH that reported one.
    failed: Option<IoError>,
    /// The layer was dropped: retire what is left, then stop.
    closing: bool,
    /// A flush of the volume below is under way.
    flushing: bool,
}

impl Queue {
    /// Marks as issued, and returns, every change that may go now: of the oldest
    /// epoch still unretired, overlapping no earlier change still in flight.
    fn issuable(&mut self) -> Vec<(u64, u64, What)> {
        let Some(oldest) = self.changes.front().map(|c| c.epoch) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for i in 0..self.changes.len() {
            let change = &self.changes[i];
            if change.epoch != oldest {
                break;
            }
            let (offset, length) = (change.offset, change.what.length());
            let blocked = self
                .changes
                .iter()
                .take(i)
                .any(|earlier| earlier.done.is_none() && earlier.overlaps(offset, length));
            if !change.issued && !blocked {
                let change = &mut self.changes[i];
                change.issued = true;
                out.push((change.id, change.offset, change.what.clone()));
            }
        }
        out
    }

    fn position(&self, id: u64) -> usize {
        self.changes
            .iter()
            .position(|c| c.id == id)
            .expect("an issued change is unretired until it is flushed")
    }

    /// The volume below answered an issued change.
    fn done(&mut self, id: u64, result: Result<(), IoError>) {
        let at = self.position(id);
        let change = &mut self.changes[at];
        assert!(change.issued && change.done.is_none(), "answered once");
        change.done = Some(result);
    }

    /// Marks a flush under way and returns the changes it covers: every one done.
    fn flush_due(&mut self) -> Vec<u64> {
        if self.flushing {
            return Vec::new();
        }
        let ids: Vec<u64> = self
            .changes
            .iter()
            .filter(|c| c.done.is_some())
            .map(|c| c.id)
            .collect();
        self.flushing = !ids.is_empty();
        ids
    }

    /// A flush of the volume below that began after changes `ids` were done returned
    /// `flushed`: they retire.
    fn flushed(&mut self, ids: &[u64], flushed: Result<(), IoError>) {
        assert!(self.flushing);
        self.flushing = false;
        for &id in ids {
            let at = self.position(id);
            let result = self.changes[at].done.take().expect("done before the flush");
            self.retire(at, result.and(flushed.clone()));
        }
    }

    fn retire(&mut self, at: usize, result: Result<(), IoError>) {
        let change = self.changes.remove(at).expect("found");
        self.bytes -= change.what.length();
        if let Err(e) = &result {
            tracing::error!(
                offset = change.offset,
                length = change.what.length(),
                "an acknowledged write failed; the next FLUSH reports it: {e}"
            );
            self.failed.get_or_insert_with(|| e.clone());
        }
        if let Some(reply) = change.durable {
            let _ = reply.send(result);
        }
    }
}

struct Shared {
    inner: Arc<dyn BlockDevice>,
    queue: Mutex<Queue>,
    changed: Notify,
    limit: u64,
}

pub struct FlushEpoch {
    shared: Arc<Shared>,
    size: u64,
}

impl FlushEpoch {
    /// Over volume `volume`'s `inner`, holding at most `limit` unretired bytes.
    pub fn new(volume: &str, inner: Arc<dyn BlockDevice>, limit: u64) -> FlushEpoch {
        let size = inner.size();
        let shared = Arc::new(Shared {
            inner,
            queue: Mutex::default(),
            changed: Notify::new(),
            limit,
        });
        tokio::spawn(dispatch(shared.clone(), Live::new(volume)));
        FlushEpoch { shared, size }
    }

    /// Acknowledges a change once it is queued (waiting while the queue is full);
    /// `fua`: once it is durable.
    async fn change(&self, offset: u64, what: What, fua: bool) -> Result<(), IoError> {
        check_range(self.size, offset, what.length())?;
        let length = what.length();
        let durable = loop {
            let room = self.shared.changed.notified();
            {
                let mut queue = self.shared.queue.lock().unwrap();
                // A change larger than the limit goes alone.
                if queue.bytes == 0 || queue.bytes + length <= self.shared.limit {
                    let (reply, durable) = match fua {
                        true => {
                            let (reply, durable) = oneshot::channel();
                            (Some(reply), Some(durable))
                        }
                        false => (None, None),
                    };
                    let (id, epoch) = (queue.next_id, queue.epoch);
                    queue.next_id += 1;
                    queue.bytes += length;
                    queue.changes.push_back(Change {
                        id,
                        epoch,
                        offset,
                        what,
                        issued: false,
                        done: None,
                        durable: reply,
                    });
                    break durable;
                }
            }
            room.await;
        };
        self.shared.changed.notify_waiters();
        match durable {
            None => Ok(()),
            Some(durable) => {
                durable
                    .await
                    .map_err(|_| IoError::Io("the volume closed before a FUA write".into()))??;
                self.take_failure()
            }
        }
    }

    fn take_failure(&self) -> Result<(), IoError> {
        match self.shared.queue.lock().unwrap().failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for FlushEpoch {
    fn drop(&mut self) {
        self.shared.queue.lock().unwrap().closing = true;
        self.shared.changed.notify_waiters();
    }
}

/// Issues changes as their epoch comes, until the layer is dropped and empty.
async fn dispatch(shared: Arc<Shared>, live: Live) {
    let _live = live;
    loop {
        let changed = shared.changed.notified();
        let (issue, flush) = {
            let mut queue = shared.queue.lock().unwrap();
            if queue.closing && queue.changes.is_empty() {
                break;
            }
            (queue.issuable(), queue.flush_due())
        };
        if !flush.is_empty() {
            let shared = shared.clone();
            tokio::spawn(async move {
                let flushed = shared.inner.flush().await;
                shared.queue.lock().unwrap().flushed(&flush, flushed);
                shared.changed.notify_waiters();
            });
        }
        for (id, offset, what) in issue {
            let shared = shared.clone();
            tokio::spawn(async move {
                let inner = &shared.inner;
                let result = match what {
                    What::Write(data) => inner.write(offset, data, false).await,
                    What::Zero { length, may_punch } => {
                        inner.write_zeroes(offset, length, may_punch).await
                    }
                    What::Trim { length } => inner.trim(offset, length).await,
                };
                shared.queue.lock().unwrap().done(id, result);
                shared.changed.notify_waiters();
            });
        }
        changed.await;
    }
}

#[async_trait]
impl BlockDevice for FlushEpoch {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError> {
        check_range(self.size, offset, length as u64)?;
        let overlays: Vec<(u64, What)> = {
            let queue = self.shared.queue.lock().unwrap();
            queue
                .changes
                .iter()
                .filter(|c| c.overlaps(offset, length as u64))
                .map(|c| (c.offset, c.what.clone()))
                .collect()
        };
        let base = self.shared.inner.read(offset, length).await?;
        if overlays.is_empty() {
            return Ok(base);
        }
        let mut out = BytesMut::from(&base[..]);
        let end = offset + length as u64;
        for (at, what) in overlays {
            let from = at.max(offset);
            let to = (at + what.length()).min(end);
            let range = (from - offset) as usize..(to - offset) as usize;
            match what {
                What::Write(data) => {
                    out[range].copy_from_slice(&data[(from - at) as usize..(to - at) as usize])
                }
                What::Zero { .. } | What::Trim { .. } => out[range].fill(0),
            }
        }
        Ok(out.freeze())
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        self.change(offset, What::Write(data), fua).await
    }

    /// An ordering point, not a durability point: acknowledged at once. Reports a
    /// change that failed since the last FLUSH.
    async fn flush(&self) -> Result<(), IoError> {
        let mut queue = self.shared.queue.lock().unwrap();
        queue.epoch += 1;
        match queue.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError> {
        self.change(offset, What::Trim { length }, false).await
    }

    async fn write_zeroes(&self, offset: u64, length: u64, may_punch: bool) -> Result<(), IoError> {
        self.change(offset, What::Zero { length, may_punch }, false)
            .await
    }

    /// A range an unretired change touches is data (its chunks may not exist yet).
    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        let pending = {
            let queue = self.shared.queue.lock().unwrap();
            queue.changes.iter().any(|c| c.overlaps(offset, length))
        };
        if pending {
            check_range(self.size, offset, length)?;
            return Ok(vec![Extent {
                length,
                hole: false,
            }]);
        }
        self.shared.inner.extents(offset, length).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_blockdev::MemoryDevice;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use tokio::sync::Semaphore;

    const SIZE: u64 = 1 << 20;

    /// A device that records the writes it is given and completes each only when
    /// the test lets one through (or fails them all, once `broken`).
    struct Gated {
        inner: MemoryDevice,
        issued: Mutex<Vec<u8>>,
        gate: Semaphore,
        broken: std::sync::atomic::AtomicBool,
        /// A flush takes a permit (plenty unless a test holds them) and is counted.
        flush_gate: Semaphore,
        flushes: AtomicUsize,
    }

    impl Gated {
        fn new() -> Arc<Gated> {
            Arc::new(Gated {
                inner: MemoryDevice::new(SIZE),
                issued: Mutex::default(),
                gate: Semaphore::new(0),
                broken: Default::default(),
                flush_gate: Semaphore::new(Semaphore::MAX_PERMITS),
                flushes: AtomicUsize::new(0),
            })
        }

        /// The first byte of every write issued so far, in issue order.
        fn issued(&self) -> Vec<u8> {
            self.issued.lock().unwrap().clone()
        }
    }

    #[async_trait]
    impl BlockDevice for Gated {
        fn size(&self) -> u64 {
            SIZE
        }
        async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError> {
            self.inner.read(offset, length).await
        }
        async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
            self.issued.lock().unwrap().push(data[0]);
            self.gate.acquire().await.unwrap().forget();
            if self.broken.load(Ordering::Relaxed) {
                return Err(IoError::NoSpace("full".into()));
            }
            self.inner.write(offset, data, fua).await
        }
        async fn flush(&self) -> Result<(), IoError> {
            self.flush_gate.acquire().await.unwrap().forget();
            self.flushes.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError> {
            self.inner.trim(offset, length).await
        }
        async fn write_zeroes(&self, offset: u64, length: u64, p: bool) -> Result<(), IoError> {
            self.inner.write_zeroes(offset, length, p).await
        }
        async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
            self.inner.extents(offset, length).await
        }
    }

    fn block(byte: u8) -> Bytes {
        Bytes::from(vec![byte; 4096])
    }

    /// Lets the dispatcher and the writes it spawned run.
    async fn settle() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    #[tokio::test]
    async fn writes_are_acknowledged_at_once_and_issued_in_epoch_order() {
        let gated = Gated::new();
        let layer = FlushEpoch::new("v", gated.clone(), crate::UNRETIRED_LIMIT_DEFAULT);
        layer.write(0, block(1), false).await.unwrap();
        layer.write(4096, block(2), false).await.unwrap();
        layer.flush().await.unwrap();
        layer.write(8192, block(3), false).await.unwrap();
        // Read back before anything reached the device.
        assert_eq!(layer.read(4096, 4096).await.unwrap(), block(2));
        settle().await;
        let mut first = gated.issued();
        first.sort_unstable();
        assert_eq!(first, vec![1, 2], "epoch 1 goes out at once, epoch 2 waits");
        gated.gate.add_permits(1);
        settle().await;
        assert_eq!(
            gated.issued().len(),
            2,
            "not before all of epoch 1 is durable"
        );
        gated.gate.add_permits(2);
        settle().await;
        assert_eq!(gated.issued().last(), Some(&3));
        assert_eq!(gated.inner.read(8192, 4096).await.unwrap(), block(3));
    }

    /// The volume below acknowledges unsynced: an epoch retires, and the next goes out,
    /// only once a flush below returned; one flush covers many writes.
    #[tokio::test]
    async fn the_next_epoch_waits_for_a_flush_below_that_covers_the_last() {
        let gated = Gated::new();
        gated.flush_gate.forget_permits(Semaphore::MAX_PERMITS);
        let layer = Arc::new(FlushEpoch::new(
            "v",
            gated.clone(),
            crate::UNRETIRED_LIMIT_DEFAULT,
        ));
        for i in 0..8u8 {
            layer
                .write(u64::from(i) * 4096, block(i), false)
                .await
                .unwrap();
        }
        layer.flush().await.unwrap();
        let fua = tokio::spawn({
            let layer = layer.clone();
            async move { layer.write(65536, block(9), true).await }
        });
        gated.gate.add_permits(8);
        settle().await;
        assert_eq!(gated.issued().len(), 8, "epoch 2 waits for a flush below");
        assert!(!fua.is_finished(), "a FUA write waits for its flush");
        gated.flush_gate.add_permits(1);
        settle().await;
        assert_eq!(gated.issued().len(), 9, "one flush retired all of epoch 1");
        gated.gate.add_permits(1);
        gated.flush_gate.add_permits(1);
        fua.await.unwrap().unwrap();
        assert_eq!(gated.flushes.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn an_overlapping_write_waits_so_the_later_one_wins() {
        let gated = Gated::new();
        gated.gate.add_permits(16);
        let layer = FlushEpoch::new("v", gated.clone(), crate::UNRETIRED_LIMIT_DEFAULT);
        for byte in 1..=5 {
            layer.write(0, block(byte), false).await.unwrap();
        }
        assert_eq!(layer.read(0, 4096).await.unwrap(), block(5));
        settle().await;
        assert_eq!(gated.issued(), vec![1, 2, 3, 4, 5]);
        assert_eq!(gated.inner.read(0, 4096).await.unwrap(), block(5));
    }

    #[tokio::test]
    async fn a_fua_write_is_durable_before_its_reply() {
        let gated = Gated::new();
        let layer = Arc::new(FlushEpoch::new(
            "v",
            gated.clone(),
            crate::UNRETIRED_LIMIT_DEFAULT,
        ));
        let fua = tokio::spawn({
            let layer = layer.clone();
            async move { layer.write(0, block(7), true).await }
        });
        settle().await;
        assert!(!fua.is_finished(), "answered before the device had it");
        gated.gate.add_permits(1);
        fua.await.unwrap().unwrap();
        assert_eq!(gated.inner.read(0, 4096).await.unwrap(), block(7));
    }

    #[tokio::test]
    async fn a_write_that_fails_after_its_ack_fails_the_next_flush() {
        let gated = Gated::new();
        gated.broken.store(true, Ordering::Relaxed);
        gated.gate.add_permits(1);
        let layer = FlushEpoch::new("v", gated.clone(), crate::UNRETIRED_LIMIT_DEFAULT);
        layer.write(0, block(1), false).await.unwrap();
        settle().await;
        assert!(matches!(layer.flush().await, Err(IoError::NoSpace(_))));
        assert!(layer.flush().await.is_ok(), "reported once");
    }

    #[tokio::test]
    async fn writes_past_the_limit_wait_and_a_dropped_layer_drains() {
        let gated = Gated::new();
        let layer = Arc::new(FlushEpoch::new("v", gated.clone(), 8192));
        layer.write(0, block(1), false).await.unwrap();
        layer.write(4096, block(2), false).await.unwrap();
        let third = tokio::spawn({
            let layer = layer.clone();
            async move { layer.write(8192, block(3), false).await }
        });
        settle().await;
        assert!(
            !third.is_finished(),
            "a third block past an 8 KiB limit waits"
        );
        gated.gate.add_permits(1);
        third.await.unwrap().unwrap();
        drop(layer);
        gated.gate.add_permits(2);
        tokio::time::timeout(Duration::from_secs(5), crate::draining::drained())
            .await
            .expect("the dropped layer retires what it acknowledged");
        assert_eq!(gated.inner.read(8192, 4096).await.unwrap(), block(3));
    }
}
