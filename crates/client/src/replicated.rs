//! The chunk layer: the writer's side of the replication protocol (URSA section 4).
//!
//! Each chunk has replicas on several chunk servers, primary first. The writer (the
//! volume's lease holder) learns a chunk's version from its replicas the first time it
//! touches the chunk, then numbers every change (see [`floe_protocol::Stamp`]).
//! - Changes up to 8 KiB go from the client to every replica at once (client-directed
//!   replication); larger ones to the primary, which forwards them to the backups,
//!   and, when that fails, to every replica directly (replicas skip what they hold).
//! - A change commits when every replica has it durable; a replica that fails or
//!   does not answer within [`REPLICA_TIMEOUT`] is left behind when a majority has it:
//!   the master is told, marks the replica stale and repairs it, and until then this
//!   writer neither writes to nor reads from it.
//! - Reads go to the first good replica holding at least the last committed version,
//!   falling back to the others (primary switching without reconfiguration).
//! - A refused view means the master changed the replica set: the map is refreshed
//!   and the change resent. A refused lease generation fails the write for good; a
//!   lease that may have run out (see [`crate::lease`]) fails it before it is stamped,
//!   or, once sent, before it is acknowledged.
//! - Learning a chunk's version sends the lease generation: replicas fence older
//!   writers before they answer, so a takeover never follows a version that an old
//!   writer's late change then overtakes.
//! - A chunk's first write places it from the cluster map this writer holds; the
//!   master records that placement (checked against the same map) and the writer
//!   refreshes its map when the master's answer differs.

mod write_back;

use crate::lease::{Lease, MASTER_WAIT};
use crate::master::MasterClient;
use crate::stripe::ChunkIo;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use floe_blockdev::IoError;
use floe_placement::cluster::Placer;
use floe_protocol::connection::CallError;
use floe_protocol::snapshot::split_index;
use floe_protocol::{
    next_version, ChunkId, ChunkPlacement, ClusterMap, ConnectionPool, DeviceClass, MasterRequest,
    MasterResponse, Proposal, ReadCost, ReplicaRequest, ReplicaResponse, Request, Response,
    ServerId, ServerInfo, Stamp, Status, VolumeMap, VolumeSpec,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use write_back::Unflushed;

/// How long a replica may take before the writer commits without it.
pub const REPLICA_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one chunk request keeps retrying (view changes, no majority) before it
/// fails with an I/O error.
const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Writes up to this size are sent by the client to all replicas (URSA's T_c).
const CLIENT_DIRECTED_BYTES_MAX: usize = 8 << 10;
/// A server that failed a request is avoided for this long on other chunks too.
const SUSPECT_FOR: Duration = Duration::from_secs(10);
/// A server that refused a change for space is taken to be short of it this long.
const SHORT_FOR: Duration = Duration::from_secs(5);
/// A chunk that cannot commit for want of space looks for repairs this often.
const SHORT_REFRESH: Duration = Duration::from_secs(1);
/// How often a reader asking the replicas' versions reads the map again when one is in
/// a later view before it gives up for now.
const VIEW_RETRIES: usize = 3;

/// Where a chunk request goes.
struct Replicas {
    /// (server, address) of the good replicas, primary first, recently failed
    /// servers last.
    good: Vec<(ServerId, String)>,
    /// Replicas that must have a change for it to commit.
    majority: usize,
    /// Replicas in the placement, good or not.
    placed: usize,
    view: u64,
}

/// The versions of a chunk's good replicas, as a reader asked them.
pub struct ReplicaVersions {
    /// Replicas in the chunk's placement (good or not).
    pub replicas: usize,
    /// The good replicas that answered.
    pub answered: Vec<ReplicaAt>,
}

impl ReplicaVersions {
    /// A version no lower than that of any change acknowledged before the replicas
    /// were asked: the k-th highest answer, where k is how many of those replicas
    /// every majority of the placement includes. `None` when too few answered.
    pub fn acknowledged_floor(&self) -> Option<u64> {
        let majority = self.replicas / 2 + 1;
        let k = (majority + self.answered.len()).checked_sub(self.replicas)?;
        let mut versions: Vec<u64> = self.answered.iter().map(|r| r.version).collect();
        versions.sort_unstable_by(|a, b| b.cmp(a));
        k.checked_sub(1).and_then(|i| versions.get(i).copied())
    }
}

/// One replica's answer.
#[derive(Debug, Clone)]
pub struct ReplicaAt {
    pub id: ServerId,
    pub address: String,
    pub class: DeviceClass,
    pub version: u64,
}

struct Chunk {
    placement: ChunkPlacement,
    /// Replicas this writer left behind and reported; cleared by a view change.
    excluded: BTreeSet<ServerId>,
    /// Last version handed out; `None` until learned from the replicas.
    last: Option<u64>,
    /// Highest version known durable on every good replica.
    committed: u64,
}

impl Chunk {
    fn good(&self, id: &ServerId) -> bool {
        !self.placement.stale.contains(id) && !self.excluded.contains(id)
    }
}

pub struct ReplicatedChunks {
    master: Arc<MasterClient>,
    volume_id: u64,
    volume_name: String,
    /// `None`: opened read-only.
    lease: Option<Lease>,
    spec: VolumeSpec,
    chunks: Mutex<BTreeMap<u64, Chunk>>,
    servers: Mutex<BTreeMap<ServerId, ServerInfo>>,
    /// Servers down or lost when the map was last read: new chunks avoid them.
    unavailable: Mutex<BTreeSet<ServerId>>,
    /// The cluster map, ready to place; `None` before the first server joined it.
    placer: Mutex<Option<Arc<Placer>>>,
    /// Servers that recently failed a request, and when.
    suspects: Mutex<BTreeMap<ServerId, Instant>>,
    /// Servers short of space: those that refused a change for it here, and when;
    /// and those the master last said were.
    refused_for_space: Mutex<BTreeMap<ServerId, Instant>>,
    short_per_master: Mutex<BTreeSet<ServerId>>,
    /// When the volume map was last read.
    refreshed_at: Mutex<Option<Instant>>,
    pool: ConnectionPool,
    /// Chunks written unsynced since the last FLUSH (write-back).
    unflushed: Unflushed,
    /// The snapshot epoch of this writer's writes (see [`crate::snapshot`]).
    epoch: AtomicU32,
}

fn io_error(e: CallError) -> IoError {
    match e {
        CallError::Remote {
            status: Status::NoSpace,
            message,
        } => IoError::NoSpace(message),
        other => IoError::Io(other.to_string()),
    }
}

/// Replicas that refuse a change as from an older view while the master's map shows
/// no newer one. A view change moves the replicas first and stores the new view after;
/// one cut short by its master losing the lead (or dying) leaves them in a view no
/// map will show, and only another view change, past it, frees the chunk. Once the
/// refusals outlast [`ORPHAN_VIEW_PATIENCE`] (a view change in progress stores its
/// view well within it), one such replica is reported lagging: that starts one.
#[derive(Default)]
struct OrphanView {
    since: Option<Instant>,
    reported: bool,
}

/// How long a change may be refused for its view before it is taken for an orphan.
const ORPHAN_VIEW_PATIENCE: Duration = Duration::from_secs(5);

impl OrphanView {
    /// The replica to report, once.
    fn report(&mut self, outcomes: &[(ServerId, Outcome)]) -> Option<ServerId> {
        let refusing = outcomes
            .iter()
            .find(|(_, o)| matches!(o, Outcome::StaleView))
            .map(|(id, _)| *id);
        let Some(server) = refusing else {
            self.since = None;
            return None;
        };
        let since = *self.since.get_or_insert_with(Instant::now);
        if self.reported || since.elapsed() < ORPHAN_VIEW_PATIENCE {
            return None;
        }
        self.reported = true;
        Some(server)
    }
}

/// One replica's answer to a change.
enum Outcome {
    Done,
    Fenced(String),
    StaleView,
    /// Failed, refused as behind, or too slow.
    Lagging(CallError),
}

fn outcome(result: Result<Response, CallError>, address: &str) -> Outcome {
    match result {
        Ok(Response::Done) => Outcome::Done,
        Ok(other) => Outcome::Lagging(CallError::BadReply {
            address: address.to_string(),
            reason: format!("{other:?}"),
        }),
        Err(CallError::Remote {
            status: Status::Fenced,
            message,
        }) => Outcome::Fenced(message),
        Err(CallError::Remote {
            status: Status::StaleView,
            ..
        }) => Outcome::StaleView,
        Err(e) => Outcome::Lagging(e),
    }
}

fn is_transport(e: &CallError) -> bool {
    matches!(e, CallError::Connect { .. } | CallError::Closed(_))
}

/// A replica that refused a change for space: it does not hold the change.
fn refused_for_space(outcome: &Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Lagging(CallError::Remote {
            status: Status::NoSpace,
            ..
        })
    )
}

/// What a writer sends in place of a change every replica refused for space: a
/// write of nothing, at the change's version, so the changes stamped after it still
/// follow on every replica.
fn no_op(chunk: ChunkId, stamp: Stamp, epoch: u32) -> Request {
    Request::Write {
        chunk,
        stamp,
        offset: 0,
        epoch,
        catch_up: false,
        unsynced: false,
        retain: false,
        forward: Vec::new(),
        data: Bytes::new(),
    }
}

impl ReplicatedChunks {
    pub fn new(master: Arc<MasterClient>, map: VolumeMap, lease: Option<Lease>) -> Self {
        let chunks = ReplicatedChunks {
            pool: master.pool().clone(),
            master,
            volume_id: map.volume.id,
            volume_name: map.volume.spec.name.clone(),
            spec: map.volume.spec.clone(),
            lease,
            chunks: Mutex::default(),
            servers: Mutex::default(),
            unavailable: Mutex::default(),
            placer: Mutex::default(),
            suspects: Mutex::default(),
            refused_for_space: Mutex::default(),
            short_per_master: Mutex::default(),
            refreshed_at: Mutex::default(),
            unflushed: Unflushed::new(map.volume.spec.write_mode),
            epoch: AtomicU32::new(map.volume.snapshot_epoch),
        };
        chunks.absorb_map(map);
        chunks
    }

    /// Takes in a volume map: placements, servers and the cluster map.
    fn absorb_map(&self, map: VolumeMap) {
        *self.unavailable.lock().unwrap() = map
            .servers
            .iter()
            .filter(|s| !s.up || s.lost)
            .map(|s| s.id)
            .collect();
        *self.short_per_master.lock().unwrap() = map
            .servers
            .iter()
            .filter(|s| s.fs.is_some_and(|fs| fs.short))
            .map(|s| s.id)
            .collect();
        self.absorb_cluster(&map.cluster);
        self.absorb(map.chunks, map.servers);
    }

    fn absorb_cluster(&self, cluster: &ClusterMap) {
        let mut placer = self.placer.lock().unwrap();
        if cluster.epoch == 0 || placer.as_ref().is_some_and(|p| p.epoch() == cluster.epoch) {
            return;
        }
        match Placer::new(cluster) {
            Ok(new) => *placer = Some(Arc::new(new)),
            Err(e) => tracing::warn!(epoch = cluster.epoch, "cannot use the cluster map: {e}"),
        }
    }

    /// Where this writer's cluster map places a new chunk.
    fn propose(&self, index: u64) -> Option<Proposal> {
        let placer = self.placer.lock().unwrap().clone()?;
        let layer = placer.newest_layer()?;
        let unavailable = self.unavailable.lock().unwrap().clone();
        let chunk = ChunkId {
            volume_id: self.volume_id,
            index,
        };
        let replicas = placer
            .place(
                chunk,
                layer,
                self.spec.mode,
                self.spec.replicas as usize,
                &|id| unavailable.contains(&id),
            )
            .ok()?;
        Some(Proposal {
            epoch: placer.epoch(),
            layer,
            replicas,
        })
    }

    /// Takes in placements from the master: a newer view replaces what this writer
    /// knew; the same view may add stale replicas.
    fn absorb(&self, placements: Vec<ChunkPlacement>, servers: Vec<ServerInfo>) {
        let mut chunks = self.chunks.lock().unwrap();
        for placement in placements {
            match chunks.get_mut(&placement.index) {
                Some(chunk) if placement.view < chunk.placement.view => {}
                Some(chunk) => {
                    if placement.view > chunk.placement.view {
                        chunk.excluded.clear();
                    }
                    chunk.placement = placement;
                }
                None => {
                    chunks.insert(
                        placement.index,
                        Chunk {
                            placement,
                            excluded: BTreeSet::new(),
                            last: None,
                            committed: 0,
                        },
                    );
                }
            }
        }
        let mut known = self.servers.lock().unwrap();
        for server in servers {
            known.insert(server.id, server);
        }
    }

    fn chunk_id(&self, index: u64) -> ChunkId {
        ChunkId {
            volume_id: self.volume_id,
            index,
        }
    }

    fn address(&self, id: ServerId) -> String {
        self.servers
            .lock()
            .unwrap()
            .get(&id)
            .map(|s| s.address.clone())
            .unwrap_or_default()
    }

    fn suspected(&self, id: ServerId) -> bool {
        self.suspects
            .lock()
            .unwrap()
            .get(&id)
            .is_some_and(|t| t.elapsed() < SUSPECT_FOR)
    }

    /// The chunk's good replicas now; `None` if the chunk is not allocated.
    fn replicas(&self, index: u64) -> Option<Replicas> {
        let chunks = self.chunks.lock().unwrap();
        let chunk = chunks.get(&index)?;
        let mut good: Vec<ServerId> = chunk
            .placement
            .replicas
            .iter()
            .copied()
            .filter(|id| chunk.good(id))
            .collect();
        good.sort_by_key(|id| self.suspected(*id));
        Some(Replicas {
            good: good.into_iter().map(|id| (id, self.address(id))).collect(),
            majority: chunk.placement.replicas.len() / 2 + 1,
            placed: chunk.placement.replicas.len(),
            view: chunk.placement.view,
        })
    }

    /// Asks the master to allocate chunk `index`; while it cannot be reached (a
    /// restart), asks again for up to [`MASTER_WAIT`] rather than fail the write.
    async fn allocate(&self, index: u64) -> Result<(), IoError> {
        let proposal = self.propose(index);
        let deadline = Instant::now() + MASTER_WAIT;
        let mut logged = false;
        let reply = loop {
            let request = MasterRequest::AllocateChunk {
                volume_id: self.volume_id,
                index,
                proposal: proposal.clone(),
                epoch: self.epoch.load(Ordering::Relaxed),
                generation: self.lease.as_ref().map_or(0, Lease::generation),
            };
            match self.master.call(request).await {
                Ok(reply) => break reply,
                Err(e) if is_transport(&e) && Instant::now() < deadline => {
                    if !logged {
                        tracing::warn!(
                            chunk = index,
                            "the master cannot be reached to allocate a chunk ({e}); its writes wait (at most {MASTER_WAIT:?})"
                        );
                        logged = true;
                    }
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Err(e) => return Err(io_error(e)),
            }
        };
        let MasterResponse::Chunk { placement, servers } = reply else {
            return Err(IoError::Io(format!(
                "master answered allocation with {reply:?}"
            )));
        };
        let agreed = proposal
            .is_some_and(|p| (p.layer, &p.replicas) == (placement.layer, &placement.replicas));
        self.absorb(vec![placement], servers);
        if !agreed {
            self.refresh().await;
        }
        Ok(())
    }

    fn short_of_space(&self, id: ServerId) -> bool {
        self.short_per_master.lock().unwrap().contains(&id)
            || self
                .refused_for_space
                .lock()
                .unwrap()
                .get(&id)
                .is_some_and(|t| t.elapsed() < SHORT_FOR)
    }

    /// Why no change to chunk `index` can commit for want of space: fewer than a
    /// majority of its replicas are current, and servers short of space hold the
    /// rest (the master repairs them once they have room).
    fn blocked_for_space(&self, index: u64) -> Option<String> {
        let chunks = self.chunks.lock().unwrap();
        let chunk = chunks.get(&index)?;
        let replicas = &chunk.placement.replicas;
        let current = replicas.iter().filter(|id| chunk.good(id)).count();
        if current > replicas.len() / 2 {
            return None;
        }
        let full: Vec<ServerId> = replicas
            .iter()
            .copied()
            .filter(|id| !chunk.good(id) && self.short_of_space(*id))
            .collect();
        (!full.is_empty()).then(|| {
            format!(
                "chunk {index}: {current} of its {} replicas are current, and servers \
                 {full:?} holding the others are out of space",
                replicas.len()
            )
        })
    }

    /// Fails a change at once, before it takes a version, while the chunk cannot
    /// commit for want of space; looks for repairs at most once a [`SHORT_REFRESH`].
    async fn refuse_while_blocked(&self, index: u64) -> Result<(), IoError> {
        if self.blocked_for_space(index).is_none() {
            return Ok(());
        }
        let due = self
            .refreshed_at
            .lock()
            .unwrap()
            .is_none_or(|t| t.elapsed() >= SHORT_REFRESH);
        if due {
            self.refresh().await;
        }
        self.blocked_for_space(index)
            .map_or(Ok(()), |why| Err(IoError::NoSpace(why)))
    }

    /// Replicas that refused a write for space while others took it get it again,
    /// allowed into the room kept for catching up (see `chunkstore::space::Room`):
    /// replicas filling at about the same rate then stay equal, instead of one left
    /// behind with no room for its repair.
    async fn catch_up(
        &self,
        good: &[(ServerId, String)],
        outcomes: &mut [(ServerId, Outcome)],
        mut request: Request,
    ) {
        let Request::Write { catch_up, .. } = &mut request else {
            return;
        };
        *catch_up = true;
        let took = outcomes.iter().any(|(_, o)| matches!(o, Outcome::Done));
        if !took {
            return;
        }
        let refused: Vec<usize> = (0..outcomes.len())
            .filter(|&i| refused_for_space(&outcomes[i].1))
            .collect();
        let replies = futures::future::join_all(refused.iter().map(|&i| {
            self.pool
                .call_within(&good[i].1, request.clone(), REPLICA_TIMEOUT)
        }))
        .await;
        for (i, reply) in refused.into_iter().zip(replies) {
            outcomes[i].1 = outcome(reply, &good[i].1);
        }
    }

    /// Reads a good replica holding at least the last committed version and no
    /// change past `max_version`; `None` when one had taken a later change (a
    /// snapshot's reader then learns what that change preserved).
    pub async fn read_within(
        &self,
        index: u64,
        offset: u64,
        length: u32,
        max_version: u64,
    ) -> Result<Option<Bytes>, IoError> {
        if self.replicas(index).is_none() {
            return Ok(Some(BytesMut::zeroed(length as usize).freeze()));
        }
        self.learn_version(index).await?;
        let chunk = self.chunk_id(index);
        let deadline = Instant::now() + REQUEST_DEADLINE;
        loop {
            let good = self.replicas(index).expect("allocated").good;
            let min_version = self.chunks.lock().unwrap()[&index].committed;
            let mut last_error = None;
            // Replicas whose copy of the range fails its checksums: the read goes on
            // to the next; their servers report the blocks, and the master heals them.
            let mut corrupt = 0;
            for (id, address) in &good {
                let request = Request::Read {
                    chunk,
                    offset,
                    length,
                    min_version,
                    max_version,
                };
                let reply = self
                    .pool
                    .call_within(address, request, REPLICA_TIMEOUT)
                    .await;
                match reply {
                    Ok(Response::Data(data)) if data.len() == length as usize => {
                        return Ok(Some(data))
                    }
                    Err(CallError::Remote {
                        status: Status::Ahead,
                        ..
                    }) => return Ok(None),
                    Ok(other) => {
                        last_error = Some(IoError::Io(format!(
                            "{address} answered a read with {other:?}"
                        )))
                    }
                    Err(CallError::Remote {
                        status: Status::Corrupt,
                        message,
                    }) => {
                        tracing::warn!(
                            chunk = index,
                            address,
                            "{message}; reading another replica"
                        );
                        corrupt += 1;
                        last_error = Some(IoError::Io(message));
                    }
                    Err(e) => {
                        if is_transport(&e) {
                            self.suspects.lock().unwrap().insert(*id, Instant::now());
                        }
                        last_error = Some(io_error(e));
                    }
                }
            }
            if corrupt > 0 && corrupt == good.len() {
                // No good copy anywhere: waiting would not bring one back.
                return Err(IoError::Io(format!(
                    "chunk {index}: every replica's copy of {offset}+{length} fails its \
                     checksums (see `floe scrub`): {}",
                    last_error.map_or_else(String::new, |e| e.to_string())
                )));
            }
            if Instant::now() > deadline {
                return Err(last_error
                    .unwrap_or_else(|| IoError::Io(format!("chunk {index}: no good replica"))));
            }
            tracing::warn!(
                chunk = index,
                "no replica served a read, retrying: {last_error:?}"
            );
            tokio::time::sleep(RETRY_PAUSE).await;
            self.refresh().await;
        }
    }

    /// The snapshot epoch this writer stamps (recorded with the chunks it allocates).
    pub fn set_epoch(&self, epoch: u32) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// The snapshot epoch the chunk was allocated in; `None` if it is not.
    pub fn born(&self, index: u64) -> Option<u32> {
        let chunks = self.chunks.lock().unwrap();
        chunks.get(&index).map(|c| c.placement.born)
    }

    /// The epochs, from `from` up and in order, whose delta of live chunk `index` is
    /// allocated (see [`crate::snapshot`]).
    pub fn delta_epochs(&self, index: u64, from: u32) -> Vec<u32> {
        let chunks = self.chunks.lock().unwrap();
        let mut epochs: Vec<u32> = chunks
            .keys()
            .map(|k| split_index(*k))
            .filter(|(epoch, live)| *live == index && *epoch >= from.max(1))
            .map(|(epoch, _)| epoch)
            .collect();
        epochs.sort_unstable();
        epochs
    }

    /// The chunk's version now: the highest a majority of its good replicas holds.
    pub async fn current_version(&self, index: u64) -> Result<u64, IoError> {
        if let Some(chunk) = self.chunks.lock().unwrap().get_mut(&index) {
            chunk.last = None;
        }
        self.learn_version(index).await?;
        let chunks = self.chunks.lock().unwrap();
        Ok(chunks.get(&index).map_or(0, |c| c.committed))
    }

    /// For a reader: asks each good replica of chunk `index` its version at once,
    /// reporting nothing; `None` if the chunk is not allocated. See [`ReplicaVersions`].
    pub async fn replica_versions(&self, index: u64) -> Option<ReplicaVersions> {
        // A replica in a view past the map's: the master moved the chunk, and the
        // writer's majority may lie outside the replicas the map names. Read the map
        // again and ask again; `None` if it cannot be read.
        for _ in 0..VIEW_RETRIES {
            match self.replica_versions_in_view(index).await? {
                Ok(versions) => return Some(versions),
                Err(view) => {
                    tracing::debug!(
                        chunk = index,
                        view,
                        "a replica is in a later view: map read again"
                    );
                    self.try_refresh().await.ok()?;
                }
            }
        }
        None
    }

    /// The replicas' versions, or the later view one of them is in.
    async fn replica_versions_in_view(&self, index: u64) -> Option<Result<ReplicaVersions, u64>> {
        let Replicas {
            good,
            placed,
            view: map_view,
            ..
        } = self.replicas(index)?;
        let request = Request::Replica(ReplicaRequest::ChunkInfo {
            chunk: self.chunk_id(index),
            generation: 0,
        });
        let answers = futures::future::join_all(good.iter().map(|(_, address)| {
            self.pool
                .call_within(address, request.clone(), REPLICA_TIMEOUT)
        }))
        .await;
        let known = self.servers.lock().unwrap();
        let mut out = ReplicaVersions {
            replicas: placed,
            answered: Vec::new(),
        };
        for ((id, address), answer) in good.into_iter().zip(answers) {
            match answer {
                Ok(Response::Replica(ReplicaResponse::ChunkInfo { view, .. }))
                    if view > map_view =>
                {
                    return Some(Err(view));
                }
                Ok(Response::Replica(ReplicaResponse::ChunkInfo { version, .. })) => {
                    let Some(server) = known.get(&id) else {
                        continue;
                    };
                    out.answered.push(ReplicaAt {
                        id,
                        address,
                        class: server.class,
                        version,
                    });
                }
                Ok(_) => {}
                Err(e) => {
                    if is_transport(&e) {
                        self.suspects.lock().unwrap().insert(id, Instant::now());
                    }
                }
            }
        }
        Some(Ok(out))
    }

    /// GetCost from each good replica of chunk `index` for the block holding
    /// `offset`, to be asked alongside their versions (one round trip, not two): a
    /// replica is missing where it did not answer or its store cannot tell (the
    /// files engine).
    pub async fn read_costs(&self, index: u64, offset: u64) -> BTreeMap<ServerId, ReadCost> {
        let Some(Replicas { good, .. }) = self.replicas(index) else {
            return BTreeMap::new();
        };
        let request = Request::Replica(ReplicaRequest::ReadCost {
            chunk: self.chunk_id(index),
            offset,
        });
        let answers = futures::future::join_all(good.iter().map(|(_, address)| {
            self.pool
                .call_within(address, request.clone(), REPLICA_TIMEOUT)
        }))
        .await;
        good.iter()
            .zip(answers)
            .filter_map(|((id, _), answer)| match answer {
                Ok(Response::Replica(ReplicaResponse::ReadCost { cost })) => Some((*id, cost?)),
                _ => None,
            })
            .collect()
    }

    /// Reads from the replica at `address` if it holds at least `min_version`.
    pub async fn read_replica(
        &self,
        address: &str,
        index: u64,
        offset: u64,
        length: u32,
        min_version: u64,
    ) -> Result<Bytes, CallError> {
        let request = Request::Read {
            chunk: self.chunk_id(index),
            offset,
            length,
            min_version,
            max_version: u64::MAX,
        };
        match self
            .pool
            .call_within(address, request, REPLICA_TIMEOUT)
            .await?
        {
            Response::Data(data) if data.len() == length as usize => Ok(data),
            other => Err(CallError::BadReply {
                address: address.to_string(),
                reason: format!("{other:?}"),
            }),
        }
    }

    /// The version a good replica holds durable and the ranges its changes after
    /// `since` touched, from its journal lite; `None` when no replica's reaches
    /// back to `since`.
    pub async fn changed_since(
        &self,
        index: u64,
        since: u64,
    ) -> Result<Option<(u64, Vec<(u64, u64)>)>, IoError> {
        let Some(Replicas { good, .. }) = self.replicas(index) else {
            return Ok(None);
        };
        let request = Request::Replica(ReplicaRequest::LogSince {
            chunk: self.chunk_id(index),
            since,
        });
        for (_, address) in &good {
            if let Ok(Response::Replica(ReplicaResponse::Ranges {
                version, ranges, ..
            })) = self
                .pool
                .call_within(address, request.clone(), REPLICA_TIMEOUT)
                .await
            {
                return Ok(Some((version, ranges)));
            }
        }
        Ok(None)
    }

    /// The ranges of the chunk that hold data, from a good replica holding every
    /// committed change; none if the chunk is not allocated.
    pub async fn extents(&self, index: u64) -> Result<Vec<(u64, u64)>, IoError> {
        let Some(Replicas { good, .. }) = self.replicas(index) else {
            return Ok(Vec::new());
        };
        self.learn_version(index).await?;
        let committed = self.chunks.lock().unwrap()[&index].committed;
        let request = Request::Replica(ReplicaRequest::Extents {
            chunk: self.chunk_id(index),
        });
        let mut last_error = format!("chunk {index}: no good replica");
        for (_, address) in &good {
            match self
                .pool
                .call_within(address, request.clone(), REPLICA_TIMEOUT)
                .await
            {
                Ok(Response::Replica(ReplicaResponse::Ranges {
                    version, ranges, ..
                })) if version >= committed => return Ok(ranges),
                Ok(other) => last_error = format!("{address} answered extents with {other:?}"),
                Err(e) => last_error = format!("{address}: {e}"),
            }
        }
        Err(IoError::Io(last_error))
    }

    /// Re-reads the volume map from the master.
    pub async fn refresh(&self) {
        if let Err(e) = self.try_refresh().await {
            tracing::warn!("cannot refresh the volume map: {e}");
        }
    }

    /// Re-reads the volume map from the master; why not, if it could not.
    pub async fn try_refresh(&self) -> Result<(), String> {
        *self.refreshed_at.lock().unwrap() = Some(Instant::now());
        let map = self.master.volume_map(&self.volume_name).await;
        self.absorb_map(map.map_err(|e| e.to_string())?);
        Ok(())
    }

    /// Leaves `server` behind on chunk `index` and tells the master, which marks the
    /// replica stale and repairs it. Returns once the master knows (or, after the
    /// request deadline, gives the replica another chance so a later change reports
    /// it again): a change acknowledged without a replica must not leave the master
    /// believing that replica current.
    async fn leave_behind(&self, index: u64, server: ServerId, why: &CallError) {
        {
            let mut chunks = self.chunks.lock().unwrap();
            let Some(chunk) = chunks.get_mut(&index) else {
                return;
            };
            if chunk.excluded.insert(server) {
                tracing::warn!(chunk = index, server, "replica left behind: {why}");
            }
        }
        if is_transport(why) {
            self.suspects.lock().unwrap().insert(server, Instant::now());
        }
        let report = MasterRequest::ReportLaggard {
            volume_id: self.volume_id,
            index,
            server,
            generation: self.lease.as_ref().map_or(0, Lease::generation),
        };
        let deadline = Instant::now() + REQUEST_DEADLINE;
        loop {
            match tokio::time::timeout(REPLICA_TIMEOUT, self.master.call(report.clone())).await {
                Ok(Ok(MasterResponse::Chunk { placement, servers })) => {
                    return self.absorb(vec![placement], servers)
                }
                Ok(Ok(other)) => {
                    return tracing::warn!("master answered a laggard report with {other:?}")
                }
                // Deposed: this writer's writes fail from here on anyway.
                Ok(Err(CallError::Remote {
                    status: Status::Fenced,
                    message,
                })) => return tracing::warn!("laggard report refused: {message}"),
                failed if Instant::now() > deadline => {
                    tracing::warn!("cannot report a laggard to the master: {failed:?}");
                    if let Some(chunk) = self.chunks.lock().unwrap().get_mut(&index) {
                        chunk.excluded.remove(&server);
                    }
                    return;
                }
                _ => tokio::time::sleep(RETRY_PAUSE).await,
            }
        }
    }

    /// Learns the chunk's current version from its good replicas (once per chunk):
    /// the highest a majority reports. Replicas below it are left behind.
    async fn learn_version(&self, index: u64) -> Result<(), IoError> {
        let deadline = Instant::now() + REQUEST_DEADLINE;
        loop {
            if self
                .chunks
                .lock()
                .unwrap()
                .get(&index)
                .is_none_or(|c| c.last.is_some())
            {
                return Ok(());
            }
            let Replicas { good, majority, .. } = self.replicas(index).expect("allocated");
            // Our generation raises each replica's fence before it answers: an old
            // writer's late change cannot land after the version we learn (and then
            // make our next change diverge from the replica's history).
            let request = Request::Replica(ReplicaRequest::ChunkInfo {
                chunk: self.chunk_id(index),
                generation: self.lease.as_ref().map_or(0, Lease::generation),
            });
            let infos = futures::future::join_all(good.iter().map(|(_, address)| {
                self.pool
                    .call_within(address, request.clone(), REPLICA_TIMEOUT)
            }))
            .await;
            let mut versions = Vec::new();
            let mut failures = Vec::new();
            for ((id, address), info) in good.iter().zip(infos) {
                match info {
                    Ok(Response::Replica(ReplicaResponse::ChunkInfo { version, .. })) => {
                        versions.push((*id, version))
                    }
                    Err(e) => failures.push((*id, e)),
                    Ok(other) => failures.push((
                        *id,
                        CallError::BadReply {
                            address: address.clone(),
                            reason: format!("{other:?}"),
                        },
                    )),
                }
            }
            if versions.len() >= majority {
                let top = versions.iter().map(|v| v.1).max().expect("a majority");
                let learned = |chunks: &BTreeMap<u64, Chunk>| chunks[&index].last.is_some();
                if learned(&self.chunks.lock().unwrap()) {
                    // Another request learned it first and may have written since:
                    // these answers are out of date.
                    return Ok(());
                }
                // The master hears of replicas behind before any change of this writer
                // lands: once one has, nobody else would tell it. A reader reports
                // nothing: under a writer, replicas a change has not reached yet are
                // not laggards.
                let writer = self.lease.is_some();
                for (id, e) in failures.into_iter().filter(|_| writer) {
                    self.leave_behind(index, id, &e).await;
                }
                for (id, version) in versions.iter().filter(|v| writer && v.1 < top) {
                    let why = CallError::Remote {
                        status: Status::Behind,
                        message: format!("holds version {version:#x}, others {top:#x}"),
                    };
                    self.leave_behind(index, *id, &why).await;
                }
                let mut chunks = self.chunks.lock().unwrap();
                if !learned(&chunks) {
                    let chunk = chunks.get_mut(&index).expect("allocated");
                    chunk.last = Some(top);
                    chunk.committed = top;
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                let why = failures
                    .first()
                    .map_or("no replica".into(), |f| f.1.to_string());
                return Err(IoError::Io(format!(
                    "chunk {index}: fewer than a majority of replicas answered: {why}"
                )));
            }
            tokio::time::sleep(RETRY_PAUSE).await;
            self.refresh().await;
        }
    }

    /// Sends one change to the replicas until it commits (see the module comment).
    async fn change(
        &self,
        index: u64,
        bytes: usize,
        make: impl Fn(Stamp, Vec<String>) -> Request,
    ) -> Result<(), IoError> {
        let lease = self.lease.as_ref().ok_or(IoError::ReadOnly)?;
        lease.wait_valid().await?;
        self.learn_version(index).await?;
        self.refuse_while_blocked(index).await?;
        // Learning the version may have taken a while.
        lease.wait_valid().await?;
        let mut stamp = {
            let mut chunks = self.chunks.lock().unwrap();
            let chunk = chunks.get_mut(&index).expect("allocated");
            let prev = chunk.last.expect("learned");
            let version = next_version(prev, lease.generation());
            chunk.last = Some(version);
            Stamp {
                view: chunk.placement.view,
                prev,
                version,
            }
        };
        let in_flight = lease.change_in_flight();
        let deadline = Instant::now() + REQUEST_DEADLINE;
        // Set once every replica refused the change for space: why, and the no-op
        // sent in its place (see [`no_op`]).
        let mut refused: Option<String> = None;
        let chunk_id = self.chunk_id(index);
        let mut orphan_view = OrphanView::default();
        loop {
            // Nothing is sent while the lease may have run out, resends included:
            // another gateway may hold the volume, and chunk servers hear of its
            // generation only at their next heartbeat. A renewal of this generation
            // shows no one else got it (a master restart); without one the change
            // may have landed on some replicas or none, so this generation can write
            // no more.
            if let Err(e) = lease.wait_valid().await {
                return Err(lease.abandon(e));
            }
            let Replicas {
                good,
                majority,
                view,
                ..
            } = self.replicas(index).expect("allocated");
            stamp.view = view;
            let mut outcomes = Vec::new();
            if refused.is_none() && bytes > CLIENT_DIRECTED_BYTES_MAX && good.len() > 1 {
                let forward = good[1..].iter().map(|(_, a)| a.clone()).collect();
                let primary = &good[0].1;
                let reply = self
                    .pool
                    .call_within(primary, make(stamp, forward), REPLICA_TIMEOUT)
                    .await;
                if let Outcome::Done = outcome(reply, primary) {
                    outcomes = good.iter().map(|(id, _)| (*id, Outcome::Done)).collect();
                }
            }
            if outcomes.is_empty() {
                let request = match refused {
                    Some(_) => no_op(chunk_id, stamp, self.epoch.load(Ordering::Relaxed)),
                    None => make(stamp, Vec::new()),
                };
                let replies = futures::future::join_all(good.iter().map(|(_, address)| {
                    self.pool
                        .call_within(address, request.clone(), REPLICA_TIMEOUT)
                }))
                .await;
                outcomes = good
                    .iter()
                    .zip(replies)
                    .map(|((id, address), reply)| (*id, outcome(reply, address)))
                    .collect();
            }
            self.catch_up(&good, &mut outcomes, make(stamp, Vec::new()))
                .await;
            let done = outcomes
                .iter()
                .filter(|(_, o)| matches!(o, Outcome::Done))
                .count();
            if let Some((_, Outcome::Fenced(why))) = outcomes
                .iter()
                .find(|(_, o)| matches!(o, Outcome::Fenced(_)))
            {
                return Err(lease.fenced(why));
            }
            let mut last_error = None;
            if done >= majority {
                for (id, o) in outcomes {
                    match o {
                        Outcome::Lagging(e) => self.leave_behind(index, id, &e).await,
                        // In a view the master has not stored (a view change that
                        // failed part-way), it misses this change all the same.
                        Outcome::StaleView => {
                            let why = CallError::Remote {
                                status: Status::StaleView,
                                message: format!("in a view after {view}"),
                            };
                            self.leave_behind(index, id, &why).await
                        }
                        Outcome::Done | Outcome::Fenced(_) => {}
                    }
                }
                {
                    let mut chunks = self.chunks.lock().unwrap();
                    let chunk = chunks.get_mut(&index).expect("allocated");
                    chunk.committed = chunk.committed.max(stamp.version);
                }
                in_flight.settled();
                // Not acknowledged while the lease may have run out (until a renewal
                // shows it did not): another gateway may hold the volume by now, and
                // its writes must follow all of ours.
                lease.wait_valid().await?;
                return refused.map_or(Ok(()), |why| Err(IoError::NoSpace(why)));
            }
            let short: Vec<ServerId> = outcomes
                .iter()
                .filter(|(_, o)| refused_for_space(o))
                .map(|(id, _)| *id)
                .collect();
            if !short.is_empty() {
                let now = Instant::now();
                let mut marks = self.refused_for_space.lock().unwrap();
                marks.extend(short.iter().map(|id| (*id, now)));
            }
            let why = || {
                outcomes
                    .iter()
                    .find_map(|(_, o)| match o {
                        Outcome::Lagging(e) if refused_for_space(o) => Some(e.to_string()),
                        _ => None,
                    })
                    .unwrap_or_default()
            };
            if !short.is_empty() && short.len() == outcomes.len() && refused.is_none() {
                // No replica holds the change: it becomes a no-op, and fails.
                refused = Some(why());
                continue;
            }
            if !short.is_empty() && short.len() + done == outcomes.len() {
                // Those that refused lack the change and the others hold it: the
                // refusers are left behind (the master repairs them once they have
                // room), and the write fails as it would have on a full disk.
                let message = why();
                for (id, o) in outcomes {
                    if let Outcome::Lagging(e) = o {
                        self.leave_behind(index, id, &e).await;
                    }
                }
                in_flight.settled();
                return Err(IoError::NoSpace(message));
            }
            if let Some(server) = orphan_view.report(&outcomes) {
                let why = CallError::Remote {
                    status: Status::StaleView,
                    message: format!("in a view past {view} that the master never stored"),
                };
                self.leave_behind(index, server, &why).await;
            }
            for (id, o) in outcomes {
                if let Outcome::Lagging(e) = o {
                    if is_transport(&e) {
                        self.suspects.lock().unwrap().insert(id, Instant::now());
                    }
                    last_error = Some(e);
                }
            }
            if Instant::now() > deadline {
                return Err(last_error.map_or_else(
                    || IoError::Io(format!("chunk {index}: replica set kept changing")),
                    io_error,
                ));
            }
            tokio::time::sleep(RETRY_PAUSE).await;
            self.refresh().await;
            if let Some(why) = self.blocked_for_space(index) {
                return Err(IoError::NoSpace(why));
            }
        }
    }
}

#[async_trait]
impl ChunkIo for ReplicatedChunks {
    async fn read(&self, index: u64, offset: u64, length: u32) -> Result<Bytes, IoError> {
        let data = self.read_within(index, offset, length, u64::MAX).await?;
        Ok(data.expect("no version is past u64::MAX"))
    }

    async fn write(&self, index: u64, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        if self.replicas(index).is_none() {
            let lease = self.lease.as_ref().ok_or(IoError::ReadOnly)?;
            lease.wait_valid().await?;
            self.allocate(index).await?;
        }
        let chunk = self.chunk_id(index);
        let unsynced = !fua && self.unflushed.enabled();
        // Read under the snapshot layer's epoch lock, which the write holds.
        let epoch = self.epoch.load(Ordering::Relaxed);
        let committed = self
            .change(index, data.len(), |stamp, forward| Request::Write {
                chunk,
                stamp,
                offset,
                epoch,
                catch_up: false,
                unsynced,
                retain: false,
                forward,
                data: data.clone(),
            })
            .await;
        if unsynced && committed.is_ok() {
            self.unflushed.note(index);
        }
        committed
    }

    /// An unallocated chunk already reads as zeroes: nothing to do, as long as this
    /// writer still holds the lease (only then is no other writer allocating it).
    async fn zero(&self, index: u64, offset: u64, length: u64, punch: bool) -> Result<(), IoError> {
        if self.replicas(index).is_none() {
            return self.lease.as_ref().ok_or(IoError::ReadOnly)?.check();
        }
        let chunk = self.chunk_id(index);
        let epoch = self.epoch.load(Ordering::Relaxed);
        self.change(index, 0, |stamp, forward| Request::Zero {
            chunk,
            stamp,
            offset,
            length,
            epoch,
            punch,
            retain: false,
            forward,
        })
        .await
    }

    async fn flush(&self) -> Result<(), IoError> {
        self.sync_unflushed().await
    }

    fn is_allocated(&self, index: u64) -> bool {
        self.chunks.lock().unwrap().contains_key(&index)
    }
}
