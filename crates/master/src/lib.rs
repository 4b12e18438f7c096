//! The master: cluster membership, volumes, chunk allocation, volume leases, and
//! failure handling (see [`recovery`]). Never on the data path: a gateway asks it for
//! a volume's map once, for a chunk's placement on the chunk's first write, and again
//! only when a replica fails.
//!
//! State lives in the metadata store (embedded redb or etcd) under these keys, with an
//! in-memory copy for reads:
//! ```text
//! server/ID               ServerInfo (JSON)
//! volume/NAME             Volume (JSON)
//! chunk/VOLUME/INDEX      ChunkPlacement: replicas (primary first), view, stale replicas
//! lease/VOLUME            the volume's last lease: generation and holder
//! deleted/VOLUME          tombstone: chunk servers drop this volume's chunks
//! map                     the cluster map (see [`map`])
//! counter/server, counter/volume, counter/lease   last id handed out
//! ```

mod map;
pub mod qos;
pub mod recovery;

use floe_metadata::{MetaStore, Op};
use floe_protocol::server::{self, Handler};
use floe_protocol::{
    ChunkPlacement, ClusterMap, ClusterStatus, ConnectionPool, ControlRequest, ControlResponse,
    JournalUsage, PlacementMode, Proposal, Request, Response, ServerId, ServerInfo, Status, Volume,
    VolumeMap, VolumeSpec,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::time::Instant;

/// A chunk server silent for this long is considered down.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);
/// A volume lease lasts this long unless renewed; holders renew every third of it.
pub const LEASE_TERM: Duration = Duration::from_secs(5);

/// A volume's single-writer lease.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Lease {
    generation: u32,
    holder: String,
    #[serde(skip)]
    expires: Option<Instant>,
}

pub(crate) struct State {
    pub(crate) servers: BTreeMap<ServerId, ServerInfo>,
    last_heartbeat: HashMap<ServerId, Instant>,
    /// From heartbeats; not stored.
    journals: HashMap<ServerId, JournalUsage>,
    volumes: BTreeMap<String, Volume>,
    pub(crate) chunks: HashMap<u64, BTreeMap<u64, ChunkPlacement>>,
    /// By volume id.
    leases: HashMap<u64, Lease>,
    /// The volume whose new lease is being stored: its old lease is not renewed
    /// meanwhile.
    lease_in_flight: Option<u64>,
    deleted_volumes: Vec<u64>,
    last_server_id: u64,
    last_volume_id: u64,
    last_lease: u64,
    map: map::MapState,
    /// Bumped by every stored placement: cached views of the placements compare it.
    placement_changes: u64,
}

/// How the master places chunks and how hard it may work at moving them.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Repairs after failures.
    pub recovery: recovery::Limits,
    /// Moves to where the cluster map places chunks (after an expansion or a remap).
    pub moves: recovery::Limits,
    /// For a new cluster; an existing one keeps the mode its map has.
    pub placement: PlacementMode,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            recovery: recovery::Limits::default(),
            moves: recovery::Limits::MOVES,
            placement: PlacementMode::default(),
        }
    }
}

pub struct Master {
    store: Box<dyn MetaStore>,
    /// Serialises changes to the stored state and is held across the store write, so
    /// each change is decided from what every earlier one left: ids, allocations and
    /// lease generations are handed out once. Control requests that change the store
    /// are rare; heartbeats and reads never take it.
    changes: tokio::sync::Mutex<()>,
    /// Everything the master knows, stored or not (heartbeats, lease terms). Held for
    /// work in memory only, never across a store write or a call to a chunk server
    /// (a std mutex: a guard held over an await does not compile where it is
    /// spawned), so a slow metadata store never delays a heartbeat.
    state: Mutex<State>,
    /// Connections to chunk servers, for recovery and scrub.
    peers: ConnectionPool,
    recovery: recovery::Progress,
    moves: recovery::Progress,
}

pub(crate) type Failure = (Status, String);
pub(crate) type Reply = Result<ControlResponse, Failure>;

pub(crate) fn json<T: serde::Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("metadata serializes")
}

fn chunk_key(volume_id: u64, index: u64) -> String {
    format!("chunk/{volume_id:016x}/{index:016x}")
}

fn lease_key(volume_id: u64) -> String {
    format!("lease/{volume_id:016x}")
}

fn server_key(id: ServerId) -> String {
    format!("server/{id:08}")
}

fn put(key: String, value: &impl Serialize) -> Op {
    Op::Put {
        key,
        value: json(value),
    }
}

pub(crate) fn store_failed(e: floe_metadata::MetaError) -> Failure {
    (Status::Unavailable, e.to_string())
}

fn not_registered(id: ServerId) -> Failure {
    (
        Status::NotFound,
        format!("chunk server {id} is not registered"),
    )
}

impl Master {
    /// Loads the cluster state from the metadata store; calls to chunk servers go
    /// through `peers`.
    pub async fn load(
        store: Box<dyn MetaStore>,
        settings: Settings,
        peers: ConnectionPool,
    ) -> Result<Master, String> {
        let corrupt =
            |key: &str, e: serde_json::Error| format!("metadata key {key} is corrupt: {e}");
        let mut state = State {
            servers: BTreeMap::new(),
            last_heartbeat: HashMap::new(),
            journals: HashMap::new(),
            volumes: BTreeMap::new(),
            chunks: HashMap::new(),
            leases: HashMap::new(),
            lease_in_flight: None,
            deleted_volumes: Vec::new(),
            last_server_id: 0,
            last_volume_id: 0,
            last_lease: 0,
            map: map::MapState::load(None, settings.placement)?,
            placement_changes: 0,
        };
        let scan = |prefix: &'static str| store.scan_prefix(prefix);
        for (key, value) in scan("server/").await.map_err(|e| e.to_string())? {
            let server: ServerInfo =
                serde_json::from_slice(&value).map_err(|e| corrupt(&key, e))?;
            // Every server gets a heartbeat timeout from now to check in: declaring
            // them down at once would start repairs around servers that are fine.
            state.last_heartbeat.insert(server.id, Instant::now());
            state.servers.insert(server.id, server);
        }
        for (key, value) in scan("volume/").await.map_err(|e| e.to_string())? {
            let volume: Volume = serde_json::from_slice(&value).map_err(|e| corrupt(&key, e))?;
            state.volumes.insert(volume.spec.name.clone(), volume);
        }
        for (key, value) in scan("chunk/").await.map_err(|e| e.to_string())? {
            let mut parts = key.split('/').skip(1).map(|p| u64::from_str_radix(p, 16));
            let (Some(Ok(volume_id)), Some(Ok(index))) = (parts.next(), parts.next()) else {
                return Err(format!("metadata key {key} is malformed"));
            };
            let placement: ChunkPlacement =
                serde_json::from_slice(&value).map_err(|e| corrupt(&key, e))?;
            if placement.index != index {
                return Err(format!(
                    "metadata key {key} holds chunk {}",
                    placement.index
                ));
            }
            state
                .chunks
                .entry(volume_id)
                .or_default()
                .insert(index, placement);
        }
        // A lease alive when the master stopped may still be in use: it gets a whole
        // term from now before anyone else can take the volume.
        for (key, value) in scan("lease/").await.map_err(|e| e.to_string())? {
            let Ok(volume_id) = u64::from_str_radix(&key["lease/".len()..], 16) else {
                return Err(format!("metadata key {key} is malformed"));
            };
            let mut lease: Lease = serde_json::from_slice(&value).map_err(|e| corrupt(&key, e))?;
            lease.expires = Some(Instant::now() + LEASE_TERM);
            state.leases.insert(volume_id, lease);
        }
        for (key, _) in scan("deleted/").await.map_err(|e| e.to_string())? {
            if let Ok(id) = u64::from_str_radix(&key["deleted/".len()..], 16) {
                state.deleted_volumes.push(id);
            }
        }
        for (key, value) in scan("counter/").await.map_err(|e| e.to_string())? {
            let n: u64 = serde_json::from_slice(&value).map_err(|e| corrupt(&key, e))?;
            match key.as_str() {
                "counter/server" => state.last_server_id = n,
                "counter/volume" => state.last_volume_id = n,
                "counter/lease" => state.last_lease = n,
                _ => {}
            }
        }
        if let Some(raw) = store.get(map::MAP_KEY).await.map_err(|e| e.to_string())? {
            let stored: ClusterMap =
                serde_json::from_slice(&raw).map_err(|e| corrupt(map::MAP_KEY, e))?;
            state.map = map::MapState::load(Some(stored), settings.placement)?;
        }
        let has_chunks = !state.chunks.is_empty();
        let master = Master {
            store,
            changes: tokio::sync::Mutex::new(()),
            state: Mutex::new(state),
            peers,
            recovery: recovery::Progress::new(settings.recovery),
            moves: recovery::Progress::new(settings.moves),
        };
        // Chunks allocated before the cluster map existed belong to its first layer.
        if has_chunks {
            master.bootstrap_map().await.map_err(|(_, e)| e)?;
        }
        Ok(master)
    }

    /// The state, with liveness judged as of now.
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        let mut state = self.state.lock().unwrap();
        state.refresh_liveness();
        state
    }

    /// Stores `ops` (none: nothing to store).
    async fn store(&self, ops: Vec<Op>) -> Result<(), Failure> {
        if ops.is_empty() {
            return Ok(());
        }
        self.store.apply(ops).await.map_err(store_failed)
    }

    /// One change to the stored state: `decide` sees the state with every earlier
    /// change applied and none in flight, and returns what to store and what `apply`
    /// needs; `apply` updates the memory once the store has it, so a failed write
    /// leaves the memory as it was.
    pub(crate) async fn change<P, T>(
        &self,
        decide: impl FnOnce(&State) -> Result<(Vec<Op>, P), Failure>,
        apply: impl FnOnce(&mut State, P) -> T,
    ) -> Result<T, Failure> {
        let _serial = self.changes.lock().await;
        let (ops, decided) = decide(&self.state())?;
        self.store(ops).await?;
        Ok(apply(&mut self.state(), decided))
    }

    async fn control(&self, request: ControlRequest) -> Reply {
        match request {
            ControlRequest::Scrub { name } => recovery::scrub(self, &name)
                .await
                .map(ControlResponse::Scrub),
            ControlRequest::Register {
                uuid,
                address,
                host,
                class,
                emulated,
                capacity_bytes,
            } => {
                let id = self
                    .change(
                        |state| {
                            // A server that registers again (restarted) keeps its id.
                            let existing = state.servers.values().find(|s| s.uuid == uuid);
                            let (id, new_id) = match existing {
                                Some(server) => (server.id, None),
                                None => {
                                    let id = state.last_server_id + 1;
                                    (id as ServerId, Some(id))
                                }
                            };
                            let server = ServerInfo {
                                id,
                                uuid,
                                address,
                                host,
                                class,
                                emulated,
                                capacity_bytes,
                                used_bytes: 0,
                                up: true,
                                lost: false,
                            };
                            let mut ops = vec![put(server_key(id), &server)];
                            ops.extend(new_id.map(|n| put("counter/server".into(), &n)));
                            Ok((ops, (server, new_id)))
                        },
                        |state, (server, new_id)| {
                            tracing::info!(id = server.id, address = %server.address, host = %server.host, class = %server.device(), "chunk server registered");
                            state.last_server_id = new_id.unwrap_or(state.last_server_id);
                            state.last_heartbeat.insert(server.id, Instant::now());
                            let id = server.id;
                            state.servers.insert(id, server);
                            id
                        },
                    )
                    .await?;
                Ok(ControlResponse::Registered { id })
            }
            ControlRequest::Heartbeat {
                id,
                used_bytes,
                journal_used_bytes,
                journal_quota_bytes,
            } => {
                let mut state = self.state();
                let server = state
                    .servers
                    .get_mut(&id)
                    .ok_or_else(|| not_registered(id))?;
                server.used_bytes = used_bytes;
                server.up = true;
                state.last_heartbeat.insert(id, Instant::now());
                let journal = JournalUsage {
                    used_bytes: journal_used_bytes,
                    quota_bytes: journal_quota_bytes,
                };
                state.journals.insert(id, journal);
                Ok(ControlResponse::HeartbeatAck {
                    deleted_volumes: state.deleted_volumes.clone(),
                    leases: state
                        .leases
                        .iter()
                        .map(|(volume_id, lease)| (*volume_id, lease.generation))
                        .collect(),
                })
            }
            ControlRequest::CreateVolume(spec) => self.create_volume(spec).await,
            ControlRequest::ListVolumes => Ok(ControlResponse::Volumes {
                volumes: self.state().volume_list(),
            }),
            ControlRequest::GetVolumeMap { name } => {
                let state = self.state();
                let volume = state.volume(&name)?;
                let chunks = state
                    .chunks
                    .get(&volume.id)
                    .into_iter()
                    .flat_map(|c| c.values().cloned())
                    .collect();
                Ok(ControlResponse::VolumeMap(VolumeMap {
                    volume,
                    chunks,
                    servers: state.servers.values().cloned().collect(),
                    cluster: state.map.map.clone(),
                }))
            }
            ControlRequest::ResizeVolume { name, size_bytes } => {
                let volume = self
                    .put_volume(|state| {
                        let mut volume = state.volume(&name)?;
                        if size_bytes < volume.spec.size_bytes {
                            return Err((
                                Status::BadRequest,
                                format!(
                                    "volume {name} is {} bytes; shrinking is not supported (it would discard data)",
                                    volume.spec.size_bytes
                                ),
                            ));
                        }
                        volume.spec.size_bytes = size_bytes;
                        volume
                            .spec
                            .validate()
                            .map_err(|e| (Status::BadRequest, e))?;
                        Ok(volume)
                    })
                    .await?;
                Ok(ControlResponse::Volume(volume))
            }
            ControlRequest::SetQos {
                name,
                iops,
                bytes_per_second,
            } => self.set_qos(&name, iops, bytes_per_second).await,
            ControlRequest::DeleteVolume { name } => {
                self.change(
                    |state| {
                        let volume = state.volume(&name)?;
                        let ops = vec![
                            Op::Delete {
                                key: format!("volume/{name}"),
                            },
                            Op::DeletePrefix {
                                prefix: format!("chunk/{:016x}/", volume.id),
                            },
                            Op::Delete {
                                key: lease_key(volume.id),
                            },
                            Op::Put {
                                key: format!("deleted/{:016x}", volume.id),
                                value: Vec::new(),
                            },
                        ];
                        Ok((ops, volume.id))
                    },
                    |state, id| {
                        state.volumes.remove(&name);
                        state.chunks.remove(&id);
                        state.leases.remove(&id);
                        state.deleted_volumes.push(id);
                        tracing::info!(%name, "volume deleted");
                    },
                )
                .await?;
                Ok(ControlResponse::Done)
            }
            ControlRequest::AllocateChunk {
                volume_id,
                index,
                proposal,
            } => self.allocate_chunk(volume_id, index, proposal).await,
            request @ (ControlRequest::GetClusterMap
            | ControlRequest::ExpandCluster { .. }
            | ControlRequest::RemapPg { .. }
            | ControlRequest::ShrinkLayer { .. }
            | ControlRequest::MergeLayers { .. }) => self.map_request(request).await,
            ControlRequest::Status => {
                let state = self.state();
                Ok(ControlResponse::Status(Box::new(ClusterStatus {
                    servers: state.servers.values().cloned().collect(),
                    volumes: state.volume_list(),
                    recovery: self.recovery.status(&state),
                    rebalance: recovery::rebalance_status(self, &state),
                    qos: state.qos_status(),
                })))
            }
            ControlRequest::AcquireLease { name, holder } => {
                self.acquire_lease(&name, holder).await
            }
            ControlRequest::RenewLease { name, generation } => {
                if let Some(reply) = self.state().renew_lease(&name, generation) {
                    return reply;
                }
                // A new lease of this volume is being stored: renewing the old one
                // meanwhile would let two holders believe they hold it. Changes wait
                // for none, so once they are ours the grant has finished.
                let _serial = self.changes.lock().await;
                self.state()
                    .renew_lease(&name, generation)
                    .expect("no lease grant is in flight while changes are held")
            }
            ControlRequest::ReleaseLease { name, generation } => {
                let mut state = self.state();
                let volume = state.volume(&name)?;
                if let Some(lease) = state.leases.get_mut(&volume.id) {
                    if lease.generation == generation {
                        // The generation stays known (chunk servers keep fencing older
                        // writers); only the term ends.
                        lease.expires = None;
                        tracing::info!(volume = %name, generation, "lease released");
                    }
                }
                Ok(ControlResponse::Done)
            }
            ControlRequest::ReportLaggard {
                volume_id,
                index,
                server,
            } => {
                let placement = self
                    .change(
                        |state| {
                            let Some(mut placement) = state.placement(volume_id, index) else {
                                return Err((
                                    Status::NotFound,
                                    format!("chunk {volume_id}/{index} is not allocated"),
                                ));
                            };
                            if !placement.replicas.contains(&server)
                                || placement.stale.contains(&server)
                            {
                                return Ok((Vec::new(), None));
                            }
                            placement.stale.push(server);
                            Ok((vec![chunk_op(volume_id, &placement)], Some(placement)))
                        },
                        |state, marked| {
                            if let Some(placement) = marked {
                                tracing::warn!(
                                    volume_id,
                                    index,
                                    server,
                                    "replica reported lagging: marked stale"
                                );
                                state.insert_placement(volume_id, placement);
                            }
                            state.placement(volume_id, index).expect("checked above")
                        },
                    )
                    .await?;
                Ok(ControlResponse::Chunk {
                    servers: self.state().servers_of(&placement),
                    placement,
                })
            }
            ControlRequest::MarkLost { id } => {
                self.change(
                    |state| {
                        let mut server = state.servers.get(&id).cloned().ok_or_else(|| not_registered(id))?;
                        if server.up {
                            return Err((
                                Status::BadRequest,
                                format!("chunk server {id} is up (heartbeating); only a failed server can be marked lost"),
                            ));
                        }
                        server.lost = true;
                        let mut ops = vec![put(server_key(id), &server)];
                        // Out of the map: CRUSH places its share elsewhere for good.
                        let map = if state.map.placer.contains(id) && !state.map.map.out.contains(&id) {
                            let map = state.next_map(|map| map.out.push(id))?;
                            ops.push(map.op());
                            Some(map)
                        } else {
                            None
                        };
                        Ok((ops, map))
                    },
                    |state, map| {
                        tracing::warn!(id, "chunk server marked lost by an operator");
                        if let Some(server) = state.servers.get_mut(&id) {
                            server.lost = true;
                        }
                        if let Some(map) = map {
                            state.set_map(map);
                        }
                    },
                )
                .await?;
                Ok(ControlResponse::Done)
            }
            ControlRequest::ChunkInfo { .. }
            | ControlRequest::SetView { .. }
            | ControlRequest::LogSince { .. }
            | ControlRequest::Extents { .. }
            | ControlRequest::Repair { .. }
            | ControlRequest::Checksum { .. }
            | ControlRequest::DropChunk { .. } => Err((
                Status::BadRequest,
                "this is the master; replica requests go to chunk servers".into(),
            )),
        }
    }

    async fn acquire_lease(&self, name: &str, holder: String) -> Reply {
        let _serial = self.changes.lock().await;
        let (volume, lease) = {
            let mut state = self.state();
            let granted = state.grant_lease(name, holder)?;
            state.lease_in_flight = Some(granted.0.id);
            granted
        };
        let stored = self
            .store(vec![
                put("counter/lease".into(), &(lease.generation as u64)),
                put(lease_key(volume.id), &lease),
            ])
            .await;
        let mut state = self.state();
        state.lease_in_flight = None;
        stored?;
        let generation = lease.generation;
        state.last_lease = generation as u64;
        tracing::info!(volume = %name, generation, holder = %lease.holder, "lease granted");
        // The term runs from now, when the grant is stored: never shorter than the
        // holder, which counts from its request, believes.
        state.leases.insert(
            volume.id,
            Lease {
                expires: Some(Instant::now() + LEASE_TERM),
                ..lease
            },
        );
        Ok(ControlResponse::Lease {
            generation,
            term_ms: LEASE_TERM.as_millis() as u64,
            limits: state.limits(&volume).0,
        })
    }

    /// Stores the volume `decide` returns, then updates the in-memory copy.
    pub(crate) async fn put_volume(
        &self,
        decide: impl FnOnce(&State) -> Result<Volume, Failure>,
    ) -> Result<Volume, Failure> {
        self.change(
            |state| {
                let volume = decide(state)?;
                let op = put(format!("volume/{}", volume.spec.name), &volume);
                Ok((vec![op], volume))
            },
            |state, volume| {
                state
                    .volumes
                    .insert(volume.spec.name.clone(), volume.clone());
                volume
            },
        )
        .await
    }

    async fn create_volume(&self, spec: VolumeSpec) -> Reply {
        spec.validate().map_err(|e| (Status::BadRequest, e))?;
        let volume = self
            .change(
                |state| {
                    if state.volumes.contains_key(&spec.name) {
                        return Err((
                            Status::AlreadyExists,
                            format!("volume {} already exists", spec.name),
                        ));
                    }
                    let hosts = state.live_hosts();
                    if hosts < spec.replicas as usize {
                        return Err((
                            Status::NoSpace,
                            format!(
                                "{} replicas need {} hosts with live chunk servers; {hosts} are up",
                                spec.replicas, spec.replicas
                            ),
                        ));
                    }
                    let id = state.last_volume_id + 1;
                    let volume = Volume {
                        id,
                        spec,
                        chunks_allocated: 0,
                        qos: Default::default(),
                    };
                    let ops = vec![
                        put("counter/volume".into(), &id),
                        put(format!("volume/{}", volume.spec.name), &volume),
                    ];
                    Ok((ops, volume))
                },
                |state, volume| {
                    state.last_volume_id = volume.id;
                    state
                        .volumes
                        .insert(volume.spec.name.clone(), volume.clone());
                    tracing::info!(name = %volume.spec.name, size = volume.spec.size_bytes, "volume created");
                    volume
                },
            )
            .await?;
        Ok(ControlResponse::Volume(volume))
    }

    async fn allocate_chunk(
        &self,
        volume_id: u64,
        index: u64,
        proposal: Option<Proposal>,
    ) -> Reply {
        // The first chunk of a cluster puts every registered server into the map.
        if self.state().map.map.epoch == 0 {
            self.bootstrap_map().await?;
        }
        let placement = self
            .change(
                |state| {
                    let Some(volume) = state.volumes.values().find(|v| v.id == volume_id) else {
                        return Err((
                            Status::NotFound,
                            format!("volume id {volume_id} does not exist"),
                        ));
                    };
                    if index >= volume.spec.chunk_count() {
                        return Err((
                            Status::BadRequest,
                            format!(
                                "chunk {index} is past the end of volume {}",
                                volume.spec.name
                            ),
                        ));
                    }
                    // Allocation is idempotent: writers race for a chunk's first write.
                    if let Some(placement) = state.placement(volume_id, index) {
                        return Ok((Vec::new(), (placement, false)));
                    }
                    let layer = state.map.placer.newest_layer().ok_or((
                        Status::NoSpace,
                        "every layer of the cluster map was shrunk away".to_string(),
                    ))?;
                    let mut placement = ChunkPlacement {
                        index,
                        replicas: Vec::new(),
                        view: 0,
                        stale: Vec::new(),
                        layer,
                    };
                    placement.replicas = state.desired(volume_id, &placement)?;
                    // A writer on the same epoch computes the same; one that differs
                    // holds an older map (or saw other servers down) and refreshes it.
                    if let Some(p) = proposal.filter(|p| p.epoch == state.map.map.epoch) {
                        if (p.layer, &p.replicas) != (layer, &placement.replicas) {
                            tracing::debug!(
                                volume_id,
                                index,
                                ?p,
                                ?placement,
                                "writer placed the chunk differently"
                            );
                        }
                    }
                    Ok((vec![chunk_op(volume_id, &placement)], (placement, true)))
                },
                |state, (placement, new)| {
                    if new {
                        state.insert_placement(volume_id, placement.clone());
                    }
                    placement
                },
            )
            .await?;
        Ok(ControlResponse::Chunk {
            servers: self.state().servers_of(&placement),
            placement,
        })
    }
}

/// Stores a chunk's placement.
pub(crate) fn chunk_op(volume_id: u64, placement: &ChunkPlacement) -> Op {
    put(chunk_key(volume_id, placement.index), placement)
}

impl State {
    pub(crate) fn refresh_liveness(&mut self) {
        let now = Instant::now();
        for server in self.servers.values_mut() {
            server.up = self
                .last_heartbeat
                .get(&server.id)
                .is_some_and(|t| now.duration_since(*t) < HEARTBEAT_TIMEOUT);
        }
    }

    /// A new lease of volume `name` for `holder`, unless another holder's is alive.
    fn grant_lease(&self, name: &str, holder: String) -> Result<(Volume, Lease), Failure> {
        let volume = self.volume(name)?;
        if let Some(lease) = self.leases.get(&volume.id) {
            // The same gateway process may take its own lease again: it reopened the
            // volume after closing it, and the new generation fences the old stack.
            let alive = lease
                .expires
                .and_then(|e| e.checked_duration_since(Instant::now()));
            if let Some(left) = alive.filter(|_| lease.holder != holder) {
                return Err((
                    Status::Busy,
                    format!(
                        "volume {name} is in use by {} (lease generation {}); it becomes free when that gateway closes it or {:.1} s after its last renewal",
                        lease.holder,
                        lease.generation,
                        left.as_secs_f64()
                    ),
                ));
            }
        }
        let generation = self.last_lease + 1;
        if generation > u32::MAX as u64 {
            return Err((Status::Io, "lease generations exhausted".into()));
        }
        let lease = Lease {
            generation: generation as u32,
            holder,
            expires: None,
        };
        Ok((volume, lease))
    }

    /// Extends the term of `name`'s lease at `generation`; `None` while a new lease of
    /// the volume is being stored.
    fn renew_lease(&mut self, name: &str, generation: u32) -> Option<Reply> {
        let volume = match self.volume(name) {
            Ok(volume) => volume,
            Err(e) => return Some(Err(e)),
        };
        if self.lease_in_flight == Some(volume.id) {
            return None;
        }
        Some(match self.leases.get_mut(&volume.id) {
            Some(lease) if lease.generation == generation => {
                lease.expires = Some(Instant::now() + LEASE_TERM);
                Ok(ControlResponse::Lease {
                    generation,
                    term_ms: LEASE_TERM.as_millis() as u64,
                    limits: self.limits(&volume).0,
                })
            }
            other => Err((
                Status::Fenced,
                format!(
                    "the lease of volume {name} (generation {generation}) was lost{}",
                    other.map_or(String::new(), |l| format!(
                        " to {} (generation {})",
                        l.holder, l.generation
                    ))
                ),
            )),
        })
    }

    /// Records a stored placement in memory.
    pub(crate) fn insert_placement(&mut self, volume_id: u64, placement: ChunkPlacement) {
        self.chunks
            .entry(volume_id)
            .or_default()
            .insert(placement.index, placement);
        self.placement_changes += 1;
    }

    /// Where an allocated chunk's replicas are.
    pub(crate) fn placement(&self, volume_id: u64, index: u64) -> Option<ChunkPlacement> {
        self.chunks.get(&volume_id)?.get(&index).cloned()
    }

    pub(crate) fn servers_of(&self, placement: &ChunkPlacement) -> Vec<ServerInfo> {
        placement
            .replicas
            .iter()
            .filter_map(|id| self.servers.get(id).cloned())
            .collect()
    }

    fn live_hosts(&self) -> usize {
        let mut hosts: Vec<&str> = self
            .servers
            .values()
            .filter(|s| s.up)
            .map(|s| s.host.as_str())
            .collect();
        hosts.sort_unstable();
        hosts.dedup();
        hosts.len()
    }

    pub(crate) fn volume(&self, name: &str) -> Result<Volume, (Status, String)> {
        let mut volume = self.volumes.get(name).cloned().ok_or_else(|| {
            (
                Status::NotFound,
                format!("volume {name} does not exist (see `floe volume list`)"),
            )
        })?;
        volume.chunks_allocated = self.chunks.get(&volume.id).map_or(0, |c| c.len() as u64);
        Ok(volume)
    }

    fn volume_list(&self) -> Vec<Volume> {
        self.volumes
            .keys()
            .filter_map(|name| self.volume(name).ok())
            .collect()
    }
}

impl Handler for Master {
    async fn handle(self: Arc<Self>, request: Request) -> Response {
        let Request::Control(control) = request else {
            return Response::error(
                Status::BadRequest,
                "this is the master; data requests go to chunk servers",
            );
        };
        match self.control(control).await {
            Ok(reply) => Response::Control(reply),
            Err((status, message)) => Response::error(status, message),
        }
    }
}

/// Loads the master's state and starts its background work (failure detection,
/// repairs, moves); returns the request handler.
pub async fn start(
    store: Box<dyn MetaStore>,
    settings: Settings,
    peers: ConnectionPool,
) -> Result<Arc<Master>, String> {
    let master = Arc::new(Master::load(store, settings, peers).await?);
    tokio::spawn(recovery::run(master.clone()));
    Ok(master)
}

/// Serves the master on `listener` over the metadata store at `metadata` (see
/// `floe_metadata::open`), repairing and moving chunks within `settings`.
pub async fn run(listener: TcpListener, metadata: &str, settings: Settings) -> Result<(), String> {
    let store = floe_metadata::open(metadata)
        .await
        .map_err(|e| e.to_string())?;
    let master = start(store, settings, ConnectionPool::default()).await?;
    tracing::info!(address = %listener.local_addr().map_err(|e| e.to_string())?, %metadata, "master serving");
    server::serve(listener, master)
        .await
        .map_err(|e| format!("accept failed: {e}"))
}
