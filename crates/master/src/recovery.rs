//! View changes that bring chunks back to full redundancy after failures (URSA
//! section 4.2.2) and move them to where the cluster map places them (Strata's
//! rebalance: add the new replica, resync it, switch, remove the old one), and scrub.
//!
//! Every second the master looks for degraded chunks: a replica on a chunk server that
//! stopped heartbeating (or was marked lost), or a replica a writer reported lagging;
//! then, with what is left of the move budget, for healthy chunks the map places
//! elsewhere (after `floe cluster expand` in crush mode, a remap, shrink or merge, or
//! when a failed server returns). For each, at most [`Limits::concurrency`] at a time:
//! 1. the map gives the new replica set, around servers that are down or lost, and
//!    every target (new replicas, laggards) pulls from the most recent good replica
//!    while writes continue: incremental when the source's journal lite reaches back,
//!    a whole copy otherwise, at most [`Limits::bytes_per_second`];
//! 2. the replicas are moved to view + 1 (they then refuse the writer's changes until
//!    it refreshes its map) and report their versions; with a majority answering, the
//!    highest version is the chunk's state;
//! 3. every replica of the new set below it catches up incrementally (little is left
//!    after step 1), and the new replica set and view are stored. The writer then
//!    resends what was refused, and replicas skip what they already hold;
//! 4. replicas left out of the new set free their data.
//!
//! When fewer than a majority of a chunk's replicas answer, the highest version seen
//! might miss acknowledged writes, so the chunk waits for an operator to declare
//! failed servers lost (`floe chunkserver mark-lost`); lost replicas then no longer
//! count towards the majority.

use crate::state::{chunk_op, State};
use crate::Master;
use floe_protocol::connection::CallError;
use floe_protocol::{
    ChunkId, ChunkPlacement, ControlRequest, ControlResponse, RebalanceStatus, RecoveryStatus,
    Request, Response, ScrubReport, ServerId, ServerInfo, Status,
};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

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
/// Bounds on one request to a chunk server; a repair copies up to a whole chunk.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);
const REPAIR_TIMEOUT: Duration = Duration::from_secs(120);
/// Window over which the copy rate is reported.
const RATE_WINDOW: Duration = Duration::from_secs(10);

type Failure = (Status, String);

pub(crate) struct Progress {
    limits: Limits,
    counters: std::sync::Mutex<Counters>,
}

#[derive(Default)]
struct Counters {
    in_progress: HashSet<(u64, u64)>,
    /// Healthy chunks the map places elsewhere (moves only), and the state they were
    /// computed for: (map epoch, placement changes, servers up).
    misplaced: Vec<(u64, u64)>,
    misplaced_for: Option<(u64, u64, Vec<ServerId>)>,
    repaired: u64,
    incremental: u64,
    full: u64,
    bytes: u64,
    /// (when, bytes) of finished copies, for the rate.
    recent: VecDeque<(Instant, u64)>,
    busy_seconds: f64,
    last_error: Option<String>,
}

enum Health {
    Healthy,
    Degraded,
    NeedsOperator,
}

fn health(state: &State, placement: &ChunkPlacement) -> Health {
    let server = |id: &ServerId| state.servers.get(id);
    let lost = placement
        .replicas
        .iter()
        .filter(|id| server(id).is_none_or(|s| s.lost))
        .count();
    let up = |id: &ServerId| server(id).is_some_and(|s| s.up && !s.lost);
    if placement.stale.is_empty() && placement.replicas.iter().all(up) {
        return Health::Healthy;
    }
    let voters = placement.replicas.iter().filter(|id| up(id)).count();
    if voters < majority(placement.replicas.len() - lost) {
        Health::NeedsOperator
    } else {
        Health::Degraded
    }
}

fn majority(n: usize) -> usize {
    n / 2 + 1
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
            match health(state, placement) {
                Health::Healthy => {}
                Health::Degraded => status.degraded_chunks += 1,
                Health::NeedsOperator => {
                    status.degraded_chunks += 1;
                    status.waiting_for_operator += 1;
                }
            }
        }
        let c = self.counters.lock().unwrap();
        status.in_progress = c.in_progress.len() as u64;
        status.repaired_chunks = c.repaired;
        status.incremental_repairs = c.incremental;
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
enum Kind {
    Repair,
    Move,
}

impl Master {
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
                matches!(health(state, p), Health::Healthy)
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
    loop {
        tick.tick().await;
        let jobs: Vec<(Kind, (u64, u64))> = {
            let state = master.state();
            let busy: HashSet<(u64, u64)> = [&master.recovery, &master.moves]
                .iter()
                .flat_map(|p| p.counters.lock().unwrap().in_progress.clone())
                .collect();
            let free = |kind: Kind| {
                let progress = master.progress(kind);
                let running = progress.counters.lock().unwrap().in_progress.len();
                progress.limits.concurrency.saturating_sub(running)
            };
            let degraded = state
                .chunks
                .iter()
                .flat_map(|(volume_id, chunks)| chunks.values().map(move |p| (*volume_id, p)))
                .filter(|(_, p)| matches!(health(&state, p), Health::Degraded))
                .map(|(volume_id, p)| (volume_id, p.index))
                .filter(|job| !busy.contains(job))
                .take(free(Kind::Repair))
                .map(|job| (Kind::Repair, job));
            let moves = misplaced(&master, &state)
                .into_iter()
                .filter(|job| !busy.contains(job))
                .take(free(Kind::Move))
                .map(|job| (Kind::Move, job));
            degraded.chain(moves).collect()
        };
        for (kind, job) in jobs {
            master
                .progress(kind)
                .counters
                .lock()
                .unwrap()
                .in_progress
                .insert(job);
            let master = master.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let limits = master.progress(kind).limits;
                let result = recover(&master, job.0, job.1, limits.bytes_per_second).await;
                let mut c = master.progress(kind).counters.lock().unwrap();
                c.in_progress.remove(&job);
                match result {
                    Ok(copied) => {
                        c.repaired += 1;
                        c.busy_seconds += started.elapsed().as_secs_f64();
                        c.incremental += copied.incremental;
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

#[derive(Default)]
struct Copied {
    incremental: u64,
    full: u64,
    bytes: u64,
}

impl Master {
    /// One request to a chunk server, bounded in time: a server cut off by the
    /// network never answers, and its connection may take minutes to fail.
    async fn ask(
        &self,
        address: &str,
        request: ControlRequest,
    ) -> Result<ControlResponse, CallError> {
        let limit = match request {
            ControlRequest::Repair { .. } => REPAIR_TIMEOUT,
            _ => ASK_TIMEOUT,
        };
        match self
            .peers
            .call_within(address, Request::Control(request), limit)
            .await?
        {
            Response::Control(reply) => Ok(reply),
            other => Err(CallError::BadReply {
                address: address.to_string(),
                reason: format!("{other:?}"),
            }),
        }
    }

    /// (view, version) of the replica on `server`.
    async fn replica_state(
        &self,
        server: &ServerInfo,
        request: ControlRequest,
    ) -> Result<(u64, u64), CallError> {
        match self.ask(&server.address, request).await? {
            ControlResponse::ChunkInfo { view, version } => Ok((view, version)),
            other => Err(CallError::BadReply {
                address: server.address.clone(),
                reason: format!("{other:?}"),
            }),
        }
    }

    /// Has `target` pull the chunk from `source`.
    async fn repair_from(
        &self,
        chunk: ChunkId,
        target: &ServerInfo,
        source: &ServerInfo,
        full: bool,
        bytes_per_second: u64,
        copied: &mut Copied,
    ) -> Result<u64, Failure> {
        let request = ControlRequest::Repair {
            chunk,
            source: source.address.clone(),
            full,
            bytes_per_second,
        };
        match self.ask(&target.address, request).await {
            Ok(ControlResponse::Repaired {
                version,
                incremental,
                bytes,
            }) => {
                if incremental {
                    copied.incremental += 1;
                } else {
                    copied.full += 1;
                }
                copied.bytes += bytes;
                Ok(version)
            }
            Ok(other) => Err((
                Status::Io,
                format!("server {} answered {other:?}", target.id),
            )),
            Err(e) => Err((
                Status::Unavailable,
                format!("repair on server {}: {e}", target.id),
            )),
        }
    }
}

/// One view change for one chunk (see the module comment).
async fn recover(
    master: &Master,
    volume_id: u64,
    index: u64,
    bytes_per_second: u64,
) -> Result<Copied, Failure> {
    let chunk = ChunkId { volume_id, index };
    let (placement, servers, new_set) = {
        let state = master.state();
        let placement = state
            .placement(volume_id, index)
            .ok_or((Status::NotFound, "chunk is gone".to_string()))?;
        let new_set = state.desired(volume_id, &placement)?;
        (placement, state.servers.clone(), new_set)
    };
    let up = |id: &ServerId| servers.get(id).is_some_and(|s| s.up && !s.lost);
    let lost = placement
        .replicas
        .iter()
        .filter(|id| servers.get(id).is_none_or(|s| s.lost))
        .count();
    let quorum = majority(placement.replicas.len() - lost);
    let voters: Vec<&ServerInfo> = placement
        .replicas
        .iter()
        .filter(|id| up(id))
        .map(|id| &servers[id])
        .collect();
    let targets: Vec<&ServerInfo> = new_set
        .iter()
        .filter(|id| !placement.replicas.contains(id) || placement.stale.contains(id))
        .filter(|id| up(id))
        .map(|id| &servers[id])
        .collect();
    let mut copied = Copied::default();

    // 1. Copy while writes go on, from the most recent good replica.
    let infos = futures::future::join_all(
        voters
            .iter()
            .map(|s| master.replica_state(s, ControlRequest::ChunkInfo { chunk })),
    )
    .await;
    if let Some((target, _)) = voters
        .iter()
        .zip(&infos)
        .find(|(s, info)| info.is_err() && targets.iter().any(|t| t.id == s.id))
    {
        return Err((
            Status::Unavailable,
            format!("server {} to repair does not answer", target.id),
        ));
    }
    let source = voters
        .iter()
        .zip(&infos)
        .filter(|(s, _)| !placement.stale.contains(&s.id))
        .filter_map(|(s, info)| info.as_ref().ok().map(|(_, version)| (*version, *s)))
        .max_by_key(|(version, _)| *version)
        .map(|(_, s)| s)
        .ok_or((Status::Unavailable, "no good replica answered".to_string()))?;
    for target in &targets {
        master
            .repair_from(chunk, target, source, false, bytes_per_second, &mut copied)
            .await?;
    }

    // 2. Freeze in view + 1 and find the chunk's state from a majority.
    let seen_view = infos
        .iter()
        .flatten()
        .map(|(view, _)| *view)
        .max()
        .unwrap_or(0);
    let view = placement.view.max(seen_view) + 1;
    let mut members: Vec<&ServerInfo> = voters.clone();
    members.extend(
        targets
            .iter()
            .filter(|t| !placement.replicas.contains(&t.id)),
    );
    let frozen = futures::future::join_all(
        members
            .iter()
            .map(|s| master.replica_state(s, ControlRequest::SetView { chunk, view })),
    )
    .await;
    let answered: Vec<(&ServerInfo, u64)> = members
        .iter()
        .zip(&frozen)
        .filter_map(|(s, r)| r.as_ref().ok().map(|(_, version)| (*s, *version)))
        .collect();
    let voters_answered = answered
        .iter()
        .filter(|(s, _)| placement.replicas.contains(&s.id))
        .count();
    if voters_answered < quorum {
        return Err((
            Status::Unavailable,
            format!("only {voters_answered} replicas answered in view {view}; {quorum} needed"),
        ));
    }
    let (source, top) = answered
        .iter()
        .filter(|(s, _)| placement.replicas.contains(&s.id))
        .max_by_key(|(_, version)| *version)
        .map(|(s, v)| (*s, *v))
        .expect("a quorum answered");

    // 3. Everyone in the new set catches up to the highest version.
    for (server, version) in &answered {
        if *version < top && new_set.contains(&server.id) {
            let reached = master
                .repair_from(chunk, server, source, false, bytes_per_second, &mut copied)
                .await?;
            if reached != top {
                return Err((
                    Status::Io,
                    format!("server {} reached {reached:#x}, not {top:#x}", server.id),
                ));
            }
        }
    }
    let behind: Vec<ServerId> = new_set
        .iter()
        .filter(|id| !answered.iter().any(|(s, _)| s.id == **id))
        .copied()
        .collect();
    if !behind.is_empty() {
        return Err((
            Status::Unavailable,
            format!("servers {behind:?} of the new replica set did not answer"),
        ));
    }

    // 4. Store the new replica set and view.
    master
        .change(
            |state| {
                let current = state
                    .placement(volume_id, index)
                    .ok_or((Status::NotFound, "chunk is gone".to_string()))?;
                if current.replicas != placement.replicas {
                    return Err((Status::Unavailable, "placement changed meanwhile".into()));
                }
                let next = ChunkPlacement {
                    replicas: new_set.clone(),
                    view,
                    stale: Vec::new(),
                    ..placement.clone()
                };
                Ok((vec![chunk_op(volume_id, &next)], next))
            },
            |state, next| state.insert_placement(volume_id, next),
        )
        .await?;
    tracing::info!(
        volume_id,
        index,
        view,
        version = top,
        from = ?placement.replicas,
        to = ?new_set,
        "chunk has all its replicas where the map places them"
    );

    // 5. The replicas left out free their data (one that is down keeps it: nothing
    // reads it, as no map lists it).
    for left in placement.replicas.iter().filter(|id| !new_set.contains(id)) {
        let Some(server) = servers.get(left).filter(|s| s.up && !s.lost) else {
            continue;
        };
        if let Err(e) = master
            .ask(&server.address, ControlRequest::DropChunk { chunk, view })
            .await
        {
            tracing::warn!(
                volume_id,
                index,
                server = left,
                "replica left out not freed: {e}"
            );
        }
    }
    Ok(copied)
}

/// Compares every chunk's replicas by checksum at equal versions and repairs the
/// ones that differ from the majority (the primary breaks ties).
pub(crate) async fn scrub(master: &Master, name: &str) -> Result<ScrubReport, Failure> {
    const SETTLE_ATTEMPTS: u32 = 20;
    let (volume, placements, servers) = {
        let state = master.state();
        let volume = state.volume(name)?;
        let placements: Vec<ChunkPlacement> = state
            .chunks
            .get(&volume.id)
            .into_iter()
            .flat_map(|c| c.values().cloned())
            .collect();
        let servers = state.servers.clone();
        (volume, placements, servers)
    };
    let mut report = ScrubReport::default();
    for placement in placements {
        report.chunks += 1;
        let chunk = ChunkId {
            volume_id: volume.id,
            index: placement.index,
        };
        let members: Vec<&ServerInfo> = placement
            .replicas
            .iter()
            .filter_map(|id| servers.get(id))
            .collect();
        if !placement.stale.is_empty() || members.iter().any(|s| !s.up || s.lost) {
            report.skipped += 1;
            report.details.push(format!(
                "chunk {}: degraded, recovery pending",
                placement.index
            ));
            continue;
        }
        let checksum = ControlRequest::Checksum {
            chunk,
            length: volume.spec.chunk_bytes,
        };
        let mut sums = Vec::new();
        for _ in 0..SETTLE_ATTEMPTS {
            let replies = futures::future::join_all(
                members
                    .iter()
                    .map(|s| master.ask(&s.address, checksum.clone())),
            )
            .await;
            sums = replies
                .into_iter()
                .filter_map(|r| match r {
                    Ok(ControlResponse::Checksum { version, crc }) => Some((version, crc)),
                    _ => None,
                })
                .collect();
            if sums.len() == members.len() && sums.iter().all(|s| s.0 == sums[0].0) {
                break;
            }
            sums.clear();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if sums.is_empty() {
            report.skipped += 1;
            report.details.push(format!(
                "chunk {}: replicas unreachable or never at one version",
                placement.index
            ));
            continue;
        }
        if sums.iter().all(|s| s.1 == sums[0].1) {
            continue;
        }
        report.differences += 1;
        let votes = |crc: u32| sums.iter().filter(|s| s.1 == crc).count();
        let authority = (0..sums.len())
            .max_by_key(|i| (votes(sums[*i].1), usize::MAX - i))
            .expect("replicas answered");
        let good = sums[authority].1;
        let mut copied = Copied::default();
        let mut fixed = true;
        for (i, (_, crc)) in sums.iter().enumerate() {
            if *crc == good {
                continue;
            }
            let detail = format!(
                "chunk {}: server {} differs at version {:#x} (crc {crc:08x}, majority {good:08x})",
                placement.index, members[i].id, sums[i].0
            );
            tracing::warn!("scrub: {detail}");
            report.details.push(detail);
            let rate = master.recovery.limits.bytes_per_second;
            let repaired = master
                .repair_from(
                    chunk,
                    members[i],
                    members[authority],
                    true,
                    rate,
                    &mut copied,
                )
                .await
                .is_ok()
                && matches!(
                    master.ask(&members[i].address, checksum.clone()).await,
                    Ok(ControlResponse::Checksum { crc, .. }) if crc == good
                );
            fixed &= repaired;
        }
        if fixed {
            report.repaired += 1;
        }
    }
    Ok(report)
}
