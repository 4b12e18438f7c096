//! Space held by deleted snapshots comes back in the background, throttled: deleting a
//! snapshot only drops its record, and every second this frees at most
//! [`ReclaimSettings::chunks_per_second`] of the delta chunks no snapshot reads
//! (`State::unread_deltas`). A snapshot held on a large volume frees thousands of
//! delta chunks; dropping them all in the delete request would load every chunk server
//! at once (ceph's snaptrim is the cautionary tale).
//!
//! A chunk is freed in two steps. First its placement is forgotten and, in the same
//! metadata write, a `freed/` record keeps the servers that hold it: from then on no
//! repair, move or writer touches it (a delta no snapshot reads is never written
//! again: epochs only grow). Then each of those servers drops it, into a view no
//! placement reaches, and the record goes. A server that is down (not marked lost)
//! keeps its record waiting, so no file is left behind; one marked lost is skipped.

use crate::state::{chunk_key, freed_key, put, State};
use crate::Master;
use floe_metadata::Op;
use floe_protocol::{ChunkId, ReclaimStatus, ReplicaRequest, ServerInfo};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};

const SCAN_INTERVAL: Duration = Duration::from_secs(1);
/// The view a freed chunk's replicas are dropped into: above any a placement reaches
/// (views grow by one per change), so nothing joins it again.
const FREED_VIEW: u64 = 1 << 48;
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
        let chunk_bytes: BTreeMap<u64, u64> = state
            .volumes
            .values()
            .map(|v| (v.id, v.spec.chunk_bytes))
            .collect();
        let (chunks_left, bytes_left) = state
            .volumes
            .values()
            .flat_map(|v| state.unread_deltas(v).into_iter().map(|i| (v.id, i)))
            .chain(state.freed.keys().copied())
            .map(|(volume_id, _)| chunk_bytes.get(&volume_id).copied().unwrap_or(0))
            .fold((0, 0), |(c, b), bytes| (c + 1, b + bytes));
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
        // Chunks forgotten before first (their servers were down), then new ones.
        let jobs: Vec<(u64, u64)> = {
            let state = master.state();
            let busy = master.chunks_in_recovery();
            let unread = state
                .volumes
                .values()
                .flat_map(|v| state.unread_deltas(v).into_iter().map(|i| (v.id, i)))
                .filter(|job| !busy.contains(job));
            state
                .freed
                .keys()
                .copied()
                .chain(unread)
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
    /// Frees delta chunk `index` of volume `volume_id`: forgets it, then has each of
    /// its servers drop it; `Err` says why it waits (it is then only forgotten).
    async fn free_delta(&self, volume_id: u64, index: u64) -> Result<(), String> {
        let placement = self.state().placement(volume_id, index);
        if let Some(placement) = placement {
            let servers = placement.replicas.clone();
            self.change(
                |_| {
                    let ops = vec![
                        Op::Delete {
                            key: chunk_key(volume_id, index),
                        },
                        put(freed_key(volume_id, index), &servers),
                    ];
                    Ok((ops, ()))
                },
                |state, ()| {
                    state.remove_placement(volume_id, index);
                    state.freed.insert((volume_id, index), servers.clone());
                },
            )
            .await
            .map_err(|(_, e)| {
                format!("delta chunk {index:#x} of volume {volume_id} not forgotten: {e}")
            })?;
        }
        self.drop_freed(volume_id, index).await
    }

    /// Has each server of forgotten chunk `index` drop it, then forgets the record.
    async fn drop_freed(&self, volume_id: u64, index: u64) -> Result<(), String> {
        let chunk = ChunkId { volume_id, index };
        let servers: Vec<ServerInfo> = {
            let state = self.state();
            let Some(ids) = state.freed.get(&(volume_id, index)) else {
                return Ok(());
            };
            ids.iter()
                .filter_map(|id| state.servers.get(id).cloned())
                .collect()
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
                view: FREED_VIEW,
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
                let key = freed_key(volume_id, index);
                Ok((vec![Op::Delete { key }], ()))
            },
            |state, ()| {
                state.freed.remove(&(volume_id, index));
            },
        )
        .await
        .map_err(|(_, e)| {
            format!("delta chunk {index:#x} of volume {volume_id}: its record not removed: {e}")
        })
    }
}
