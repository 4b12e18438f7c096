//! View changes that bring chunks back to full redundancy after failures (URSA
//! section 4.2.2) and move them to where the cluster map places them (Strata's
//! rebalance: add the new replica, resync it, switch, remove the old one), and scrub.
//!
//! Every second the master looks for degraded chunks: a replica on a chunk server that
//! stopped heartbeating (or was marked lost), or a replica a writer reported lagging;
//! then, with what is left of the move budget, for healthy chunks the map places
//! elsewhere (after `floe cluster expand` in crush mode, a remap, shrink or merge, or
//! when a failed server returns). Repairs go fewest good replicas first
//! ([`plan::repairs_due`]). For each, at most [`Limits::concurrency`] at a time:
//! 1. the map gives the new replica set, around servers that are down or lost, and
//!    every target (new replicas, laggards) that needs a copy (whole, or of the blocks
//!    that differ) makes it from the most recent good replica while writes continue,
//!    all at once, each at most
//!    [`Limits::bytes_per_second`] (a prefetch: it counts only if the source held
//!    still at its end, since data read while changes land may hold one the chunk's
//!    history leaves out);
//! 2. the replicas are moved to view + 1 (they then refuse the writer's changes until
//!    it refreshes its map) and report their versions; with a majority answering, the
//!    highest version is the chunk's state;
//! 3. every replica of the new set below it catches up from a replica at that version,
//!    which now holds still: incrementally when its journal lite reaches back (a
//!    laggard's few changes), whole otherwise (little is left after step 1); the new
//!    replica set and view are stored. The writer then resends what was refused, and
//!    replicas skip what they already hold;
//! 4. replicas left out of the new set free their data.
//!
//! When fewer than a majority of a chunk's replicas answer, the highest version seen
//! might miss acknowledged writes, so the chunk waits for an operator to declare
//! failed servers lost (`floe chunkserver mark-lost`); lost replicas then no longer
//! count towards the majority.
//!
//! [`plan`] makes these decisions as pure functions; [`view_change`] makes the calls
//! between them; [`peers`] bounds each call; `scrub` checks replicas block by block
//! and compares them, [`integrity`] runs it where reads found bad blocks and in the
//! background; [`audit`] finds replicas a writer that died without releasing its
//! lease left behind.

mod audit;
mod integrity;
mod peers;
mod plan;
mod scrub;
mod view_change;

pub(crate) use integrity::Integrity;
pub use integrity::{background as background_scrub, heal_reported, ScrubSettings};
pub(crate) use plan::desired;
pub(crate) use scrub::scrub;

use crate::state::State;
use crate::Master;
use floe_protocol::{RebalanceStatus, RecoveryStatus, ServerId};
use plan::{health, Health};
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};

/// How hard recovery may work: it shares disks, network and CPU with client I/O.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Chunks repaired at once.
    pub concurrency: usize,
    /// Copy rate of one chunk repair (0: unlimited).
    pub bytes_per_second: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            concurrency: 2,
            bytes_per_second: 200 << 20,
        }
    }
}

impl Limits {
    /// Moves are not urgent: they yield more to client I/O than repairs do.
    pub const MOVES: Limits = Limits {
        concurrency: 1,
        bytes_per_second: 50 << 20,
    };
}
const SCAN_INTERVAL: Duration = Duration::from_secs(1);
/// Window over which the copy rate is reported.
const RATE_WINDOW: Duration = Duration::from_secs(10);

pub(crate) struct Progress {
    limits: Limits,
    counters: std::sync::Mutex<Counters>,
}

#[derive(Default)]
struct Counters {
    in_progress: BTreeSet<(u64, u64)>,
    /// Healthy chunks the map places elsewhere (moves only), and the state they were
    /// computed for: (map epoch, placement changes, servers up).
    misplaced: Vec<(u64, u64)>,
    misplaced_for: Option<(u64, u64, Vec<ServerId>)>,
    repaired: u64,
    incremental: u64,
    compared: u64,
    full: u64,
    bytes: u64,
    /// (when, bytes) of finished copies, for the rate.
    recent: VecDeque<(Instant, u64)>,
    busy_seconds: f64,
    last_error: Option<String>,
}

impl Progress {
    pub(crate) fn new(limits: Limits) -> Progress {
        Progress {
            limits,
            counters: Default::default(),
        }
    }

    pub(crate) fn status(&self, state: &State) -> RecoveryStatus {
        let mut status = RecoveryStatus::default();
        for placement in state.chunks.values().flat_map(|c| c.values()) {
            match health(placement, &state.servers) {
                Health::Healthy => {}
                Health::Degraded => status.degraded_chunks += 1,
                Health::NeedsOperator => {
                    status.degraded_chunks += 1;
                    status.waiting_for_operator += 1;
                }
            }
        }
        status.volumes_to_audit = state.audits.len() as u64;
        let c = self.counters.lock().unwrap();
        status.in_progress = c.in_progress.len() as u64;
        status.repaired_chunks = c.repaired;
        status.incremental_repairs = c.incremental;
        status.compared_copies = c.compared;
        status.full_copies = c.full;
        status.bytes_copied = c.bytes;
        let now = Instant::now();
        let window: u64 = c
            .recent
            .iter()
            .filter(|(t, _)| now.duration_since(*t) < RATE_WINDOW)
            .map(|(_, b)| b)
            .sum();
        status.bytes_per_second = window / RATE_WINDOW.as_secs();
        let repairable = status.degraded_chunks - status.waiting_for_operator;
        status.last_error = c.last_error.clone();
        drop(c);
        if repairable > 0 && status.repaired_chunks > 0 {
            status.eta_seconds = Some(self.eta(repairable));
        }
        status
    }

    /// Seconds to handle `chunks` more chunks at the pace so far.
    fn eta(&self, chunks: u64) -> u64 {
        let c = self.counters.lock().unwrap();
        let per_chunk = c.busy_seconds / c.repaired.max(1) as f64;
        (per_chunk * chunks as f64 / self.limits.concurrency.max(1) as f64).ceil() as u64
    }
}

/// Which budget a job runs under.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Repair,
    Move,
}

impl Master {
    /// (volume id, chunk index) of the chunks a repair or a move works on.
    pub(crate) fn chunks_in_recovery(&self) -> BTreeSet<(u64, u64)> {
        [&self.recovery, &self.moves]
            .iter()
            .flat_map(|p| p.counters.lock().unwrap().in_progress.clone())
            .collect()
    }

    fn progress(&self, kind: Kind) -> &Progress {
        match kind {
            Kind::Repair => &self.recovery,
            Kind::Move => &self.moves,
        }
    }
}

/// The healthy chunks the map places elsewhere, recomputed only when the map, a
/// placement or the set of live servers changed.
fn misplaced(master: &Master, state: &State) -> Vec<(u64, u64)> {
    let up: Vec<ServerId> = state
        .servers
        .values()
        .filter(|s| s.up && !s.lost)
        .map(|s| s.id)
        .collect();
    let key = (state.map.map.epoch, state.placement_changes, up);
    let mut c = master.moves.counters.lock().unwrap();
    if c.misplaced_for.as_ref() != Some(&key) {
        c.misplaced = state
            .chunks
            .iter()
            .flat_map(|(volume_id, chunks)| chunks.values().map(move |p| (*volume_id, p)))
            .filter(|(volume_id, p)| {
                matches!(health(p, &state.servers), Health::Healthy)
                    && state
                        .desired(*volume_id, p)
                        .is_ok_and(|want| want != p.replicas)
            })
            .map(|(volume_id, p)| (volume_id, p.index))
            .collect();
        c.misplaced_for = Some(key);
    }
    c.misplaced.clone()
}

/// For `floe status`: the map and the moves towards it.
pub(crate) fn rebalance_status(master: &Master, state: &State) -> RebalanceStatus {
    let misplaced = misplaced(master, state).len() as u64;
    let moves = master.moves.status(state);
    let layers = state.map.placer.layers();
    RebalanceStatus {
        mode: state.map.map.mode,
        epoch: state.map.map.epoch,
        layers: layers.iter().filter(|l| !l.removed).count() as u32,
        pending_servers: state.pending_servers().len() as u32,
        misplaced_chunks: misplaced,
        moving: moves.in_progress,
        moved_chunks: moves.repaired_chunks,
        bytes_moved: moves.bytes_copied,
        bytes_per_second: moves.bytes_per_second,
        eta_seconds: (misplaced > 0 && moves.repaired_chunks > 0)
            .then(|| master.moves.eta(misplaced)),
        last_error: moves.last_error,
    }
}

/// Scans for degraded chunks and repairs them, then for misplaced ones and moves
/// them, forever.
pub async fn run(master: Arc<Master>) {
    let mut tick = tokio::time::interval(SCAN_INTERVAL);
    // After a stall, one late tick (whose lateness is the stall), not a burst.
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let due = tick.tick().await;
        let audits: Vec<(u64, u32)> = {
            let mut state = master.state();
            state.audit_lapsed_leases();
            crate::exported::sample_leases(&state);
            state.audits.clone().into_iter().collect()
        };
        master.take_lapsed_snapshots().await;
        for (volume_id, generation) in audits {
            if master.audit(volume_id, generation).await {
                let mut state = master.state();
                if state.audits.get(&volume_id) == Some(&generation) {
                    state.audits.remove(&volume_id);
                }
            }
        }
        let jobs: Vec<(Kind, (u64, u64))> = {
            let mut state = master.state();
            let late = Instant::now().saturating_duration_since(due);
            if late > SCAN_INTERVAL {
                state.excuse_stall(late);
            }
            let busy = master.chunks_in_recovery();
            let free = |kind: Kind| {
                let progress = master.progress(kind);
                let running = progress.counters.lock().unwrap().in_progress.len();
                progress.limits.concurrency.saturating_sub(running)
            };
            let chunks = state
                .chunks
                .iter()
                .flat_map(|(volume_id, chunks)| chunks.values().map(move |p| (*volume_id, p)));
            let degraded = plan::repairs_due(chunks, &state.servers, &busy, free(Kind::Repair))
                .into_iter()
                .map(|job| (Kind::Repair, job));
            let moves = misplaced(&master, &state)
                .into_iter()
                .filter(|job| !busy.contains(job))
                .take(free(Kind::Move))
                .map(|job| (Kind::Move, job));
            degraded.chain(moves).collect()
        };
        for (kind, job) in jobs {
            let mut counters = master.progress(kind).counters.lock().unwrap();
            counters.in_progress.insert(job);
            crate::exported::recoveries_running(kind, counters.in_progress.len());
            drop(counters);
            let master = master.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let limits = master.progress(kind).limits;
                let result =
                    view_change::recover(&master, job.0, job.1, limits.bytes_per_second).await;
                let bytes = result.as_ref().ok().map(|copied| copied.bytes);
                crate::exported::recovered(kind, started.elapsed(), bytes);
                let mut c = master.progress(kind).counters.lock().unwrap();
                c.in_progress.remove(&job);
                crate::exported::recoveries_running(kind, c.in_progress.len());
                match result {
                    Ok(copied) => {
                        c.repaired += 1;
                        c.busy_seconds += started.elapsed().as_secs_f64();
                        c.incremental += copied.incremental;
                        c.compared += copied.compared;
                        c.full += copied.full;
                        c.bytes += copied.bytes;
                        c.recent.push_back((Instant::now(), copied.bytes));
                        while c.recent.len() > 1024 {
                            c.recent.pop_front();
                        }
                        c.last_error = None;
                    }
                    Err((_, message)) => {
                        let message = format!("chunk {}/{}: {message}", job.0, job.1);
                        tracing::warn!("recovery: {message}");
                        c.last_error = Some(message);
                    }
                }
            });
        }
    }
}
