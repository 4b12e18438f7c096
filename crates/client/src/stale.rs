//! Stale reads (Yogurt, thesis chapter 5): a read-only attach that reads each chunk
//! from the replica of least estimated cost instead of the primary, returning data
//! at most `staleness` old, with monotonic reads.
//!
//! Per chunk the layer keeps a *floor* version and the replica it reads from. At
//! least every `staleness` (and after a failed read) it asks the good replicas their
//! versions, once the chunk's reads in flight have ended: the floor rises to the
//! acknowledged floor (no lower than any change acknowledged before the question,
//! so a read is at most `staleness` behind the volume) and to the version the
//! replica it read from answers (a replica's versions only grow: nothing read from
//! it so far is newer). It then takes, among the replicas at or past the floor, the
//! one of least cost (GetCost: the expected time of a read there, timed or guessed
//! from the device class, raised by what the replica's store says a read of the
//! block asked for costs it now (a chained log: cache, idle body disk, body disk
//! being cleaned, tail disk), times one plus the reads in flight there; ties spread
//! over chunks), and each read asks that replica for at least the floor. So a
//! read never returns less than an earlier one, across switches of replica too, but
//! for a change only a replica that died held (never acknowledged).
//!
//! A chunk the map shows unallocated reads as zeroes while the map was read less
//! than `staleness` ago; past that, it is read again first, and while the master
//! cannot answer, the read waits (and fails after a while): zeroes then could hide
//! writes acknowledged longer ago than the bound (simulator seed 1023).

use crate::replicated::{ReplicaAt, ReplicatedChunks};
use crate::stripe::ChunkIo;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use floe_blockdev::IoError;
use floe_protocol::{DeviceClass, ReadCost, ServerId};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::RwLock;
use tokio::time::Instant;

/// How long a read keeps trying replicas before it fails.
const READ_DEADLINE: Duration = Duration::from_secs(30);
/// A read's expected time at a server not yet timed, by device class: an hdd seeks.
const SSD_READ: Duration = Duration::from_micros(200);
const HDD_READ: Duration = Duration::from_millis(8);
/// What a read costs beyond its expected time where the store says the block sits
/// on a body disk being cleaned (it competes with the cleaner) or on the tail's disk
/// (it breaks the log's sequential writes there, which the chain exists to keep).
const CLEANING_READ: Duration = HDD_READ;
const TAIL_READ: Duration = Duration::from_millis(24);
/// Costs are counted in these: servers this close in expected time tie.
const COST_UNIT: Duration = Duration::from_micros(100);
/// Weight of a new timing in a server's running average.
const TIMING_WEIGHT: f64 = 0.05;
/// Pause before asking the replicas again when none could serve.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// What a chunk's reads go by.
struct Reading {
    /// Every read of the chunk gets at least this version.
    floor: u64,
    /// The replica reads go to; `None` until chosen.
    from: Option<ReplicaAt>,
    /// When the replicas were last asked.
    asked_at: Option<Instant>,
    /// A replica whose read failed: the next choice passes it over if it can.
    avoid: Option<ServerId>,
}

/// A read counted in flight at a server until dropped (a cancelled read too).
struct Queued<'a> {
    counts: &'a Mutex<BTreeMap<ServerId, u64>>,
    server: ServerId,
}

impl<'a> Queued<'a> {
    fn on(counts: &'a Mutex<BTreeMap<ServerId, u64>>, server: ServerId) -> Queued<'a> {
        *counts.lock().unwrap().entry(server).or_default() += 1;
        Queued { counts, server }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap();
        let count = counts.get_mut(&self.server).expect("counted when queued");
        *count -= 1;
    }
}

pub struct StaleReads {
    chunks: ReplicatedChunks,
    staleness: Duration,
    reading: Mutex<BTreeMap<u64, Arc<RwLock<Reading>>>>,
    in_flight: Mutex<BTreeMap<ServerId, u64>>,
    /// Running average of a read's time per server, in seconds.
    timed: Mutex<BTreeMap<ServerId, f64>>,
    /// When this layer last asked for the volume map (`None`: never; the map read
    /// while opening is of an unknown moment before).
    map_read_at: tokio::sync::Mutex<Option<Instant>>,
}

impl StaleReads {
    pub fn new(chunks: ReplicatedChunks, staleness: Duration) -> StaleReads {
        StaleReads {
            chunks,
            staleness,
            reading: Mutex::default(),
            in_flight: Mutex::default(),
            timed: Mutex::default(),
            map_read_at: tokio::sync::Mutex::default(),
        }
    }

    fn cell(&self, index: u64) -> Arc<RwLock<Reading>> {
        let mut reading = self.reading.lock().unwrap();
        reading
            .entry(index)
            .or_insert_with(|| {
                Arc::new(RwLock::new(Reading {
                    floor: 0,
                    from: None,
                    asked_at: None,
                    avoid: None,
                }))
            })
            .clone()
    }

    /// GetCost: a read's expected time at the replica's server (its recent reads'
    /// running average, else its device class's guess; a cache hit its ssd time, a
    /// block its store says sits on a disk being cleaned or on the tail's disk more),
    /// times one plus the reads queued there, in units of [`COST_UNIT`] so that
    /// near-equal servers tie; ties spread chunks over replicas.
    fn cost(&self, replica: &ReplicaAt, store: Option<ReadCost>, index: u64) -> (u64, u64) {
        let guess = match replica.class {
            DeviceClass::Ssd => SSD_READ,
            DeviceClass::Hdd => HDD_READ,
        };
        let expected = self
            .timed
            .lock()
            .unwrap()
            .get(&replica.id)
            .copied()
            .unwrap_or(guess.as_secs_f64());
        let expected = priced(expected, store);
        let queued = self
            .in_flight
            .lock()
            .unwrap()
            .get(&replica.id)
            .copied()
            .unwrap_or(0);
        let units = (expected / COST_UNIT.as_secs_f64()).ceil().max(1.0) as u64;
        let spread = (index ^ replica.id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
        (units * (1 + queued), spread)
    }

    /// Folds a read's time at `server` into its running average.
    fn timed(&self, server: ServerId, took: Duration) {
        let mut timed = self.timed.lock().unwrap();
        let average = timed.entry(server).or_insert(took.as_secs_f64());
        *average += TIMING_WEIGHT * (took.as_secs_f64() - *average);
    }

    /// Whether chunk `index` is allocated, as of a map read less than the staleness
    /// bound ago (read again if older, waiting while the master does not answer).
    async fn allocated(&self, index: u64) -> Result<bool, IoError> {
        let deadline = Instant::now() + READ_DEADLINE;
        loop {
            if self.chunks.is_allocated(index) {
                return Ok(true);
            }
            {
                let mut read_at = self.map_read_at.lock().await;
                if read_at.is_some_and(|at| at.elapsed() < self.staleness) {
                    return Ok(self.chunks.is_allocated(index));
                }
                let asked_at = Instant::now();
                match self.chunks.try_refresh().await {
                    Ok(()) => {
                        *read_at = Some(asked_at);
                        return Ok(self.chunks.is_allocated(index));
                    }
                    Err(e) if Instant::now() > deadline => {
                        return Err(IoError::Io(format!(
                            "chunk {index}: the volume map is older than the staleness bound \
                             and cannot be read again: {e}"
                        )))
                    }
                    Err(e) => tracing::warn!("stale reads wait for the volume map: {e}"),
                }
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// Asks the replicas again (see the module comment), and their stores' cost of
    /// reading the block at `offset`; under the chunk's write lock, so no read of it
    /// is in flight.
    async fn ask(&self, index: u64, offset: u64, reading: &mut Reading) {
        let asked_at = Instant::now();
        let (versions, costs) = tokio::join!(
            self.chunks.replica_versions(index),
            self.chunks.read_costs(index, offset)
        );
        let Some(versions) = versions else {
            // Unasked, the bound cannot be kept: no replica until asked again.
            reading.from = None;
            return;
        };
        let Some(acknowledged) = versions.acknowledged_floor() else {
            tracing::warn!(
                chunk = index,
                answered = versions.answered.len(),
                "too few replicas answered to bound staleness"
            );
            reading.from = None;
            return;
        };
        let mut floor = reading.floor.max(acknowledged);
        if let Some(from) = &reading.from {
            if let Some(now) = versions.answered.iter().find(|r| r.id == from.id) {
                floor = floor.max(now.version);
            }
        }
        let candidates: Vec<ReplicaAt> = versions
            .answered
            .into_iter()
            .filter(|r| r.version >= floor)
            .collect();
        let priced: Vec<(&ReplicaAt, Option<ReadCost>)> = candidates
            .iter()
            .map(|r| (r, costs.get(&r.id).copied()))
            .collect();
        let choice = priced
            .iter()
            .filter(|(r, _)| Some(r.id) != reading.avoid)
            .chain(priced.iter())
            .min_by_key(|(r, store)| self.cost(r, *store, index))
            .map(|(r, _)| (*r).clone());
        reading.floor = floor;
        reading.from = choice;
        reading.asked_at = Some(asked_at);
    }

    fn due(&self, reading: &Reading) -> bool {
        reading.from.is_none()
            || reading
                .asked_at
                .is_none_or(|t| t.elapsed() >= self.staleness)
    }
}

/// A read's expected time (seconds) at a server, given what its store says the block
/// costs it now.
fn priced(expected: f64, store: Option<ReadCost>) -> f64 {
    match store {
        None | Some(ReadCost::BodyIdle) => expected,
        Some(ReadCost::Cache) => expected.min(SSD_READ.as_secs_f64()),
        Some(ReadCost::BodyCleaning) => expected + CLEANING_READ.as_secs_f64(),
        Some(ReadCost::TailDisk) => expected + TAIL_READ.as_secs_f64(),
    }
}

#[async_trait]
impl ChunkIo for StaleReads {
    async fn read(&self, index: u64, offset: u64, length: u32) -> Result<Bytes, IoError> {
        if !self.allocated(index).await? {
            return Ok(BytesMut::zeroed(length as usize).freeze());
        }
        let cell = self.cell(index);
        let deadline = Instant::now() + READ_DEADLINE;
        let mut failed = None;
        // Asked this time round: read even if the bound already passed (0 s).
        let mut asked = false;
        loop {
            {
                let reading = cell.read().await;
                let usable = asked || !self.due(&reading);
                if let (true, Some(from)) = (usable, &reading.from) {
                    let queued = Queued::on(&self.in_flight, from.id);
                    let began = Instant::now();
                    let read = self
                        .chunks
                        .read_replica(&from.address, index, offset, length, reading.floor)
                        .await;
                    drop(queued);
                    match read {
                        Ok(data) => {
                            self.timed(from.id, began.elapsed());
                            return Ok(data);
                        }
                        Err(e) => failed = Some((from.id, e.to_string())),
                    }
                }
            }
            if Instant::now() > deadline {
                let why = failed.map_or("no replica at the floor".into(), |f| f.1);
                return Err(IoError::Io(format!(
                    "chunk {index}: stale read failed: {why}"
                )));
            }
            let mut reading = cell.write().await;
            if let Some((id, why)) = failed.take() {
                tracing::warn!(
                    chunk = index,
                    server = id,
                    "stale read failed, asking again: {why}"
                );
                reading.avoid = Some(id);
                reading.asked_at = None;
            }
            if self.due(&reading) {
                self.ask(index, offset, &mut reading).await;
                asked = true;
                if reading.from.is_none() {
                    drop(reading);
                    tokio::time::sleep(RETRY_PAUSE).await;
                    self.chunks.refresh().await;
                }
            }
        }
    }

    async fn write(&self, index: u64, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        self.chunks.write(index, offset, data, fua).await
    }

    async fn zero(&self, index: u64, offset: u64, length: u64, punch: bool) -> Result<(), IoError> {
        self.chunks.zero(index, offset, length, punch).await
    }

    async fn flush(&self) -> Result<(), IoError> {
        self.chunks.flush().await
    }

    fn is_allocated(&self, index: u64) -> bool {
        self.chunks.is_allocated(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Between servers equally fast so far, GetCost's order decides: a cache hit, an
    /// idle body disk, the disk the cleaner reads, the tail's disk; and a cache hit on
    /// an hdd server beats an uncached read there.
    #[test]
    fn a_stores_read_cost_orders_servers_equally_fast_so_far() {
        let hdd = HDD_READ.as_secs_f64();
        let order = [
            Some(ReadCost::Cache),
            Some(ReadCost::BodyIdle),
            Some(ReadCost::BodyCleaning),
            Some(ReadCost::TailDisk),
        ]
        .map(|store| priced(hdd, store));
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
        assert_eq!(priced(hdd, None), priced(hdd, Some(ReadCost::BodyIdle)));
        assert!(priced(SSD_READ.as_secs_f64(), Some(ReadCost::TailDisk)) > hdd);
    }
}
