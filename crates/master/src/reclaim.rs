//! Space held by deleted snapshots comes back in the background, throttled: deleting a
//! snapshot only drops its record, and every second this frees at most
//! [`ReclaimSettings::chunks_per_second`] of the delta chunks no snapshot reads
//! (`State::unread_deltas`). A snapshot held on a large volume frees thousands of
//! delta chunks; dropping them all in the delete request would load every chunk server
//! at once (ceph's snaptrim is the cautionary tale).
//!
//! Each replica drops its data, then the chunk is forgotten. A chunk with a replica on
//! a server that is down (not marked lost) waits for that server, so no file is left
//! behind; one in a repair or move waits for it to end.

use crate::state::{chunk_key, State};
use crate::Master;
use floe_metadata::Op;
use floe_protocol::{ChunkId, ReclaimStatus, ReplicaRequest};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};

const SCAN_INTERVAL: Duration = Duration::from_secs(1);
/// Window over which the freeing rate is reported.
const RATE_WINDOW: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy)]
pub struct ReclaimSettings {
    /// Delta chunks freed per second (0: unlimited).
    pub chunks_per_second: u32,
}

impl Default for ReclaimSettings {
    fn default() -> ReclaimSettings {
        ReclaimSettings {
            chunks_per_second: 8,
        }
    }
}

pub(crate) struct Reclaim {
    settings: ReclaimSettings,
    counters: Mutex<Counters>,
}

#[derive(Default)]
struct Counters {
    freed: u64,
    /// When each chunk of the last `RATE_WINDOW` was freed.
    recent: VecDeque<Instant>,
    /// Why the last chunk that could not be freed waits.
    waiting: Option<String>,
}

impl Reclaim {
    pub(crate) fn new(settings: ReclaimSettings) -> Reclaim {
        Reclaim {
            settings,
            counters: Mutex::default(),
        }
    }

    /// Chunks freed per scan.
    fn budget(&self) -> usize {
        match self.settings.chunks_per_second {
            0 => usize::MAX,
            n => n as usize,
        }
    }

    pub(crate) fn status(&self, state: &State) -> ReclaimStatus {
        let (chunks_left, bytes_left) = state
            .volumes
            .values()
            .map(|v| {
                let n = state.unread_deltas(v).len() as u64;
                (n, n * v.spec.chunk_bytes)
            })
            .fold((0, 0), |(c, b), (n, m)| (c + n, b + m));
        let mut c = self.counters.lock().unwrap();
        let now = Instant::now();
        while c
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) >= RATE_WINDOW)
        {
            c.recent.pop_front();
        }
        let per_second = c.recent.len() as f64 / RATE_WINDOW.as_secs_f64();
        ReclaimStatus {
            chunks_left,
            bytes_left,
            chunks_freed: c.freed,
            chunks_per_second: per_second.ceil() as u64,
            limit_per_second: self.settings.chunks_per_second,
            eta_seconds: (chunks_left > 0 && per_second > 0.0)
                .then(|| (chunks_left as f64 / per_second).ceil() as u64),
            waiting: if chunks_left > 0 {
                c.waiting.clone()
            } else {
                None
            },
        }
    }
}

/// Frees delta chunks no snapshot reads, at the configured rate, forever.
pub async fn run(master: Arc<Master>) {
    let mut tick = tokio::time::interval(SCAN_INTERVAL);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let jobs: Vec<(u64, u64)> = {
            let state = master.state();
            let busy = master.chunks_in_recovery();
            state
                .volumes
                .values()
                .flat_map(|v| state.unread_deltas(v).into_iter().map(|i| (v.id, i)))
                .filter(|job| !busy.contains(job))
                .take(master.reclaim.budget())
                .collect()
        };
        for (volume_id, index) in jobs {
            let freed = master.free_delta(volume_id, index).await;
            let mut c = master.reclaim.counters.lock().unwrap();
            match freed {
                Ok(()) => {
                    c.freed += 1;
                    c.recent.push_back(Instant::now());
                    c.waiting = None;
                }
                Err(why) => {
                    tracing::info!(volume_id, index, "delta chunk not freed yet: {why}");
                    c.waiting = Some(why);
                }
            }
        }
    }
}

impl Master {
    /// Drops delta chunk `index` of volume `volume_id` on each of its replicas, then
    /// forgets it; `Err` says why it is kept for now.
    async fn free_delta(&self, volume_id: u64, index: u64) -> Result<(), String> {
        let chunk = ChunkId { volume_id, index };
        let (placement, servers) = {
            let state = self.state();
            let placement = state
                .placement(volume_id, index)
                .ok_or_else(|| format!("{chunk:?} is gone"))?;
            let servers = state.servers_of(&placement);
            (placement, servers)
        };
        for server in servers.iter().filter(|s| !s.lost) {
            if !server.up {
                return Err(format!(
                    "delta chunk {index:#x} of volume {volume_id} waits for chunk server {} ({}), which is down",
                    server.id, server.address
                ));
            }
            let request = ReplicaRequest::DropChunk {
                chunk,
                view: placement.view + 1,
            };
            self.ask(&server.address, request).await.map_err(|e| {
                format!(
                    "delta chunk {index:#x} of volume {volume_id}: chunk server {} ({}) did not drop it: {e}",
                    server.id, server.address
                )
            })?;
        }
        self.change(
            |_| {
                let key = chunk_key(volume_id, index);
                Ok((vec![Op::Delete { key }], ()))
            },
            |state, ()| state.remove_placement(volume_id, index),
        )
        .await
        .map_err(|(_, e)| {
            format!("delta chunk {index:#x} of volume {volume_id} not forgotten: {e}")
        })
    }
}
