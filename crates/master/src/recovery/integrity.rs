//! Integrity: chunks in which a chunk server found blocks failing their checksums (a
//! client's read, a journal replay, a write over them) are scrubbed at once, so the
//! bad blocks are rewritten from good copies; and every volume is scrubbed in the
//! background once per [`ScrubSettings::interval`], paced to a read rate so client
//! I/O keeps the disks.

use super::scrub::{check_chunk, chunks_of};
use crate::Master;
use floe_protocol::{ChunkId, ScrubReport, ScrubStatus, ServerId, VolumeScrub};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Lost blocks `floe status` names.
const LOST_NAMED: usize = 20;
/// A chunk reported again this soon after a scrub of it waits: a block with no good
/// copy is reported by every read of it, and each scrub reads the whole chunk.
const RESCRUB_AFTER: Duration = Duration::from_secs(10);

/// The background scrub.
#[derive(Debug, Clone, Copy)]
pub struct ScrubSettings {
    /// Time from the start of one pass over every volume to the next (None: off).
    pub interval: Option<Duration>,
    /// Bytes per second a pass reads, over all replicas.
    pub bytes_per_second: u64,
}

impl Default for ScrubSettings {
    fn default() -> ScrubSettings {
        ScrubSettings {
            interval: Some(Duration::from_secs(7 * 24 * 3600)),
            bytes_per_second: 50 << 20,
        }
    }
}

pub(crate) struct Integrity {
    settings: ScrubSettings,
    /// Chunks reported corrupt, not yet scrubbed.
    reported: Mutex<BTreeSet<ChunkId>>,
    /// When each chunk was last scrubbed for a report.
    scrubbed: Mutex<BTreeMap<ChunkId, Instant>>,
    wake: Notify,
    status: Mutex<ScrubStatus>,
    /// Blocks found lost so far (volume, offset): a block every later scrub finds
    /// lost again counts once.
    lost: Mutex<BTreeSet<(String, u64)>>,
    /// Operators' scrubs under way, each one's own entry (a volume may be scrubbed
    /// twice at once).
    manual: Mutex<BTreeMap<u64, VolumeScrub>>,
    next_manual: std::sync::atomic::AtomicU64,
}

/// An operator's scrub in `floe status` until dropped.
pub(crate) struct ManualScrub<'a> {
    integrity: &'a Integrity,
    id: u64,
}

impl ManualScrub<'_> {
    pub(crate) fn checked(&self, chunks: u64) {
        if let Some(entry) = self.integrity.manual.lock().unwrap().get_mut(&self.id) {
            entry.chunks_checked = chunks;
        }
    }
}

impl Drop for ManualScrub<'_> {
    fn drop(&mut self) {
        self.integrity.manual.lock().unwrap().remove(&self.id);
    }
}

impl Integrity {
    pub(crate) fn new(settings: ScrubSettings) -> Integrity {
        Integrity {
            settings,
            reported: Mutex::default(),
            scrubbed: Mutex::default(),
            wake: Notify::new(),
            status: Mutex::new(ScrubStatus {
                interval_seconds: settings.interval.map_or(0, |i| i.as_secs()),
                ..ScrubStatus::default()
            }),
            lost: Mutex::default(),
            manual: Mutex::default(),
            next_manual: Default::default(),
        }
    }

    pub(crate) fn status(&self) -> ScrubStatus {
        let mut status = self.status.lock().unwrap().clone();
        status.volumes = self.manual.lock().unwrap().values().cloned().collect();
        status
    }

    /// Shows an operator's scrub of `chunks_total` chunks of `volume` as under way.
    pub(crate) fn manual(&self, volume: &str, chunks_total: u64) -> ManualScrub<'_> {
        use std::sync::atomic::Ordering;
        let id = self.next_manual.fetch_add(1, Ordering::Relaxed);
        let entry = VolumeScrub {
            volume: volume.to_string(),
            chunks_checked: 0,
            chunks_total,
        };
        self.manual.lock().unwrap().insert(id, entry);
        ManualScrub {
            integrity: self,
            id,
        }
    }

    /// Adds what a scrub found to the totals.
    pub(crate) fn record(&self, report: &ScrubReport, volume: &str) {
        let mut status = self.status.lock().unwrap();
        status.healed_blocks += report.healed_blocks;
        let mut seen = self.lost.lock().unwrap();
        for &(at, ..) in &report.lost_blocks {
            if seen.insert((volume.to_string(), at)) {
                status.lost_blocks += 1;
                status.lost.push(format!("{volume} offset {at}"));
            }
        }
        let excess = status.lost.len().saturating_sub(LOST_NAMED);
        status.lost.drain(..excess);
    }
}

impl Master {
    /// A chunk server found these blocks failing their checksums.
    pub(crate) fn report_corrupt(&self, server: ServerId, blocks: &[(ChunkId, u64)]) {
        if blocks.is_empty() {
            return;
        }
        tracing::warn!(
            server,
            blocks = blocks.len(),
            "blocks fail their checksums: scrubbing their chunks"
        );
        let mut reported = self.integrity.reported.lock().unwrap();
        reported.extend(blocks.iter().map(|(chunk, _)| *chunk));
        self.integrity.wake.notify_one();
    }
}

/// Scrubs the chunks reported corrupt, as they come (a chunk scrubbed less than
/// [`RESCRUB_AFTER`] ago waits), forever.
pub async fn heal_reported(master: Arc<Master>) {
    let integrity = &master.integrity;
    loop {
        if integrity.reported.lock().unwrap().is_empty() {
            integrity.wake.notified().await;
        }
        let now = Instant::now();
        let due: Vec<ChunkId> = {
            let mut reported = integrity.reported.lock().unwrap();
            let mut scrubbed = integrity.scrubbed.lock().unwrap();
            scrubbed.retain(|_, at| now.duration_since(*at) < RESCRUB_AFTER);
            let due: Vec<ChunkId> = reported
                .iter()
                .filter(|chunk| !scrubbed.contains_key(chunk))
                .copied()
                .collect();
            for chunk in &due {
                reported.remove(chunk);
                scrubbed.insert(*chunk, now);
            }
            due
        };
        if due.is_empty() {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        for chunk in due {
            let volume = {
                let state = master.state();
                state
                    .volumes
                    .values()
                    .find(|v| v.id == chunk.volume_id)
                    .and_then(|v| state.volume(&v.spec.name).ok())
            };
            let Some(volume) = volume else {
                continue; // deleted meanwhile
            };
            let mut report = ScrubReport::default();
            check_chunk(&master, &volume, chunk.index, &mut report).await;
            master.integrity.record(&report, &volume.spec.name);
        }
    }
}

/// Scrubs every volume once per interval, paced, forever.
pub async fn background(master: Arc<Master>) {
    let settings = master.integrity.settings;
    let Some(interval) = settings.interval else {
        return;
    };
    let mut next = Instant::now() + interval;
    loop {
        tokio::time::sleep_until(next).await;
        next = Instant::now() + interval;
        pass(&master, settings.bytes_per_second).await;
    }
}

/// One pass over every chunk of every volume.
async fn pass(master: &Master, bytes_per_second: u64) {
    let volumes: Vec<_> = {
        let state = master.state();
        let names: Vec<String> = state.volumes.keys().cloned().collect();
        names
            .iter()
            .filter_map(|name| state.volume(name).ok())
            .collect()
    };
    let work: Vec<_> = volumes
        .iter()
        .map(|v| (v, chunks_of(master, v.id)))
        .collect();
    let total: u64 = work.iter().map(|(_, c)| c.len() as u64).sum();
    {
        let mut status = master.integrity.status.lock().unwrap();
        status.running = true;
        status.chunks_checked = 0;
        status.chunks_total = total;
    }
    tracing::info!(chunks = total, "background scrub: pass starts");
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut checked = 0u64;
    for (volume, chunks) in work {
        for index in chunks {
            let mut report = ScrubReport::default();
            check_chunk(master, volume, index, &mut report).await;
            master.integrity.record(&report, &volume.spec.name);
            checked += 1;
            bytes += volume.spec.chunk_bytes * volume.spec.replicas as u64;
            // Paced: the pass's reads never run ahead of the rate.
            if bytes_per_second > 0 {
                let due = Duration::from_secs_f64(bytes as f64 / bytes_per_second as f64);
                tokio::time::sleep_until(start + due).await;
            }
            let elapsed = start.elapsed().as_secs_f64().max(1e-3);
            let mut status = master.integrity.status.lock().unwrap();
            status.chunks_checked = checked;
            status.bytes_per_second = (bytes as f64 / elapsed) as u64;
            status.eta_seconds =
                Some((elapsed / checked as f64 * (total - checked) as f64).ceil() as u64);
        }
    }
    let mut status = master.integrity.status.lock().unwrap();
    status.running = false;
    status.passes += 1;
    status.eta_seconds = None;
    tracing::info!(
        chunks = checked,
        healed = status.healed_blocks,
        lost = status.lost_blocks,
        "background scrub: pass done"
    );
}
