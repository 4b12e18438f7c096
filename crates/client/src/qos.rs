//! Rate limits (URSA section 3.2): the layer in front of the stripe layer that holds a
//! volume's I/O to the limits the master hands out with each lease renewal, so an
//! operator's change, or the master's back-pressure from nearly full journals, reaches
//! a running gateway within a renewal period.
//!
//! Token buckets, one for requests and one for bytes, over all I/O (the operator's
//! limits), and another pair over writes only (journal back-pressure). Each allows a
//! burst of a tenth of a second of its rate. Requests wait in order of arrival: only
//! the first sleeps, the rest queue behind it on a FIFO lock.

use async_trait::async_trait;
use bytes::Bytes;
use floe_blockdev::{BlockDevice, Extent, IoError};
use floe_protocol::{QosLimits, VolumeLimits};
use tokio::sync::{watch, Mutex};
use tokio::time::{Duration, Instant};

/// A bucket holds this many seconds of its rate: enough to absorb the jitter of a
/// queue of requests, too little to let a client exceed its rate noticeably.
const BURST_SECONDS: f64 = 0.1;

/// Tokens accrue at `rate` per second up to a tenth of a second's worth. A request
/// costing more than that waits for a full bucket and leaves it in debt, so the
/// long-run rate holds for requests of any size.
#[derive(Debug)]
pub struct TokenBucket {
    /// Tokens per second; 0: unlimited.
    rate: u64,
    tokens: f64,
    updated: Instant,
}

impl TokenBucket {
    pub fn new(rate: u64, now: Instant) -> TokenBucket {
        let mut bucket = TokenBucket {
            rate,
            tokens: 0.0,
            updated: now,
        };
        bucket.tokens = bucket.burst();
        bucket
    }

    fn burst(&self) -> f64 {
        (self.rate as f64 * BURST_SECONDS).max(1.0)
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate as f64).min(self.burst());
        self.updated = now;
    }

    /// Changes the rate, keeping the tokens earned so far; a bucket that was unlimited
    /// starts full.
    pub fn set_rate(&mut self, rate: u64, now: Instant) {
        if rate == self.rate {
            return;
        }
        self.refill(now);
        let was_unlimited = self.rate == 0;
        self.rate = rate;
        self.tokens = if was_unlimited {
            self.burst()
        } else {
            self.tokens.min(self.burst())
        };
    }

    /// How long until `cost` tokens may be taken; zero: now.
    pub fn wait(&mut self, cost: u64, now: Instant) -> Duration {
        if self.rate == 0 {
            return Duration::ZERO;
        }
        self.refill(now);
        let need = (cost as f64).min(self.burst());
        if self.tokens >= need {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((need - self.tokens) / self.rate as f64)
        }
    }

    /// Takes `cost` tokens (after [`TokenBucket::wait`] said zero).
    pub fn take(&mut self, cost: u64) {
        if self.rate != 0 {
            self.tokens -= cost as f64;
        }
    }
}

/// A request and a byte bucket.
#[derive(Debug)]
struct Pair {
    requests: TokenBucket,
    bytes: TokenBucket,
}

impl Pair {
    fn new(limits: QosLimits, now: Instant) -> Pair {
        Pair {
            requests: TokenBucket::new(limits.iops, now),
            bytes: TokenBucket::new(limits.bytes_per_second, now),
        }
    }

    fn set(&mut self, limits: QosLimits, now: Instant) {
        self.requests.set_rate(limits.iops, now);
        self.bytes.set_rate(limits.bytes_per_second, now);
    }

    fn wait(&mut self, bytes: u64, now: Instant) -> Duration {
        self.requests.wait(1, now).max(self.bytes.wait(bytes, now))
    }

    fn take(&mut self, bytes: u64) {
        self.requests.take(1);
        self.bytes.take(bytes);
    }
}

/// The buckets, and the limits as the master last sent them; behind the FIFO lock.
struct Pacer {
    all: Pair,
    writes: Pair,
    limits: watch::Receiver<VolumeLimits>,
}

/// A block device held to the limits in a watch channel (the lease's renewals).
pub struct Qos<D> {
    inner: D,
    /// For the unlimited fast path, without the lock.
    limits: watch::Receiver<VolumeLimits>,
    /// tokio's mutex hands itself over in order of arrival, so waiting requests are
    /// served first come, first served, and only the one at the head sleeps.
    pacer: Mutex<Pacer>,
}

impl<D: BlockDevice> Qos<D> {
    pub fn new(inner: D, limits: watch::Receiver<VolumeLimits>) -> Qos<D> {
        let now = Instant::now();
        let current = *limits.borrow();
        Qos {
            inner,
            pacer: Mutex::new(Pacer {
                all: Pair::new(current.all, now),
                writes: Pair::new(current.writes, now),
                limits: limits.clone(),
            }),
            limits,
        }
    }

    /// Waits until a request moving `bytes` may go.
    async fn admit(&self, write: bool, bytes: u64) {
        // Reads skip the queue when only writes are limited (journal pressure), rather
        // than wait behind throttled writes.
        let free = {
            let limits = self.limits.borrow();
            limits.all.is_unlimited() && (!write || limits.writes.is_unlimited())
        };
        if free {
            return;
        }
        let mut pacer = self.pacer.lock().await;
        let pacer = &mut *pacer;
        loop {
            let limits = *pacer.limits.borrow_and_update();
            let now = Instant::now();
            pacer.all.set(limits.all, now);
            pacer.writes.set(limits.writes, now);
            let mut wait = pacer.all.wait(bytes, now);
            if write {
                wait = wait.max(pacer.writes.wait(bytes, now));
            }
            if wait.is_zero() {
                break;
            }
            // A change of limits (a cleared one) must not leave the queue asleep on the
            // old rate. Once the lease is gone, `changed` fails and only the timer runs.
            tokio::select! {
                biased; // the simulator replays a seed exactly
                _ = tokio::time::sleep(wait) => {}
                Ok(()) = pacer.limits.changed() => {}
            }
        }
        pacer.all.take(bytes);
        if write {
            pacer.writes.take(bytes);
        }
    }
}

#[async_trait]
impl<D: BlockDevice> BlockDevice for Qos<D> {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError> {
        self.admit(false, length as u64).await;
        self.inner.read(offset, length).await
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        self.admit(true, data.len() as u64).await;
        self.inner.write(offset, data, fua).await
    }

    /// Free here (no rate limit): what it costs is below (write-back syncs replicas).
    async fn flush(&self) -> Result<(), IoError> {
        self.inner.flush().await
    }

    /// One request; no data moves.
    async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError> {
        self.admit(true, 0).await;
        self.inner.trim(offset, length).await
    }

    async fn write_zeroes(&self, offset: u64, length: u64, may_punch: bool) -> Result<(), IoError> {
        self.admit(true, 0).await;
        self.inner.write_zeroes(offset, length, may_punch).await
    }

    /// Free: answered from the chunk map, no chunk server is asked.
    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        self.inner.extents(offset, length).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_blockdev::MemoryDevice;
    use std::sync::Arc;

    #[test]
    fn bucket_allows_a_tenth_of_a_second_then_the_rate() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(100, start);
        for _ in 0..10 {
            assert_eq!(bucket.wait(1, start), Duration::ZERO, "burst of 10");
            bucket.take(1);
        }
        assert_eq!(bucket.wait(1, start), Duration::from_millis(10));
        // Over one simulated second of eager requests: the burst plus the rate.
        let mut now = start;
        let mut taken = 0;
        while now < start + Duration::from_secs(1) {
            let wait = bucket.wait(1, now);
            if wait.is_zero() {
                bucket.take(1);
                taken += 1;
            } else {
                now += wait;
            }
        }
        assert!((99..=101).contains(&taken), "{taken}");
    }

    #[test]
    fn requests_above_the_burst_go_into_debt() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(1 << 20, start); // 1 MiB/s, burst 102 KiB
        assert_eq!(bucket.wait(4 << 20, start), Duration::ZERO, "full bucket");
        bucket.take(4 << 20);
        let wait = bucket.wait(4 << 20, start);
        assert!(
            wait.abs_diff(Duration::from_secs(4)) < Duration::from_millis(1),
            "4 MiB of debt, refilled at 1 MiB/s: {wait:?}"
        );
    }

    #[test]
    fn unlimited_and_changed_rates() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(0, start);
        bucket.take(1 << 40);
        assert_eq!(bucket.wait(1 << 40, start), Duration::ZERO, "unlimited");
        bucket.set_rate(10, start);
        assert_eq!(bucket.wait(1, start), Duration::ZERO, "starts full");
        bucket.take(1);
        assert_eq!(bucket.wait(1, start), Duration::from_millis(100));
        bucket.set_rate(1000, start);
        assert_eq!(
            bucket.wait(1, start),
            Duration::from_millis(1),
            "faster now"
        );
        bucket.set_rate(0, start);
        assert_eq!(bucket.wait(1, start), Duration::ZERO, "cleared");
    }

    fn limits(iops: u64, bytes_per_second: u64, write_iops: u64) -> VolumeLimits {
        VolumeLimits {
            all: QosLimits {
                iops,
                bytes_per_second,
            },
            writes: QosLimits {
                iops: write_iops,
                bytes_per_second: 0,
            },
        }
    }

    /// Requests completed by many concurrent clients in `seconds` of paused time.
    async fn completed(device: &Arc<Qos<MemoryDevice>>, write: bool, seconds: u64) -> u64 {
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let clients: Vec<_> = (0..16)
            .map(|_| {
                let (device, done) = (device.clone(), done.clone());
                tokio::spawn(async move {
                    loop {
                        if write {
                            device.write(0, Bytes::from(vec![1; 4096]), false).await
                        } else {
                            device.read(0, 4096).await.map(drop)
                        }
                        .unwrap();
                        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        for client in clients {
            client.abort();
        }
        done.load(std::sync::atomic::Ordering::Relaxed)
    }

    #[tokio::test(start_paused = true)]
    async fn layer_holds_the_rate_and_follows_changes() {
        let (sender, receiver) = watch::channel(limits(200, 0, 0));
        let device = Arc::new(Qos::new(MemoryDevice::new(1 << 20), receiver));
        let reads = completed(&device, false, 5).await;
        assert!((1000..=1021).contains(&reads), "200 IOPS for 5 s: {reads}");
        // Journal pressure slows writes only.
        sender.send(limits(200, 0, 50)).unwrap();
        let writes = completed(&device, true, 4).await;
        assert!(
            (200..=206).contains(&writes),
            "50 write IOPS for 4 s: {writes}"
        );
        let reads = completed(&device, false, 1).await;
        assert!(reads >= 195, "reads still at 200 IOPS: {reads}");
        // Bytes: 64 KiB/s of 4 KiB reads is 16 IOPS.
        sender.send(limits(0, 64 << 10, 0)).unwrap();
        let reads = completed(&device, false, 4).await;
        assert!((64..=67).contains(&reads), "64 KiB/s for 4 s: {reads}");
    }

    /// A queue asleep on a low rate wakes when the limit is cleared.
    #[tokio::test(start_paused = true)]
    async fn clearing_a_limit_releases_the_queue() {
        let (sender, receiver) = watch::channel(limits(1, 0, 0));
        let device = Arc::new(Qos::new(MemoryDevice::new(1 << 20), receiver));
        device.read(0, 512).await.unwrap(); // the burst of one
        let waiting = tokio::spawn({
            let device = device.clone();
            async move { device.read(0, 512).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "waits about a second at 1 IOPS");
        sender.send(VolumeLimits::default()).unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(waiting.is_finished(), "released by the change");
    }

    /// Journal pressure queues writes; reads go past them.
    #[tokio::test(start_paused = true)]
    async fn reads_pass_writes_slowed_by_pressure() {
        let (_sender, receiver) = watch::channel(limits(0, 0, 1));
        let device = Arc::new(Qos::new(MemoryDevice::new(1 << 20), receiver));
        let write = || {
            let device = device.clone();
            async move { device.write(0, Bytes::from(vec![1; 512]), false).await }
        };
        write().await.unwrap(); // the burst of one
        let waiting = tokio::spawn(write());
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            !waiting.is_finished(),
            "waits about a second at 1 write IOPS"
        );
        let started = Instant::now();
        device.read(0, 512).await.unwrap();
        assert_eq!(started.elapsed(), Duration::ZERO, "the read waited");
    }
}
