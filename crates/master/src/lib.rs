//! The master: cluster membership, volumes and chunk allocation. Never on the data
//! path: a gateway asks it for a volume's map once and for a chunk's placement on the
//! chunk's first write.
//!
//! State lives in the metadata store (embedded redb or etcd) under these keys, with an
//! in-memory copy for reads:
//! ```text
//! server/ID               ServerInfo (JSON)
//! volume/NAME             Volume (JSON)
//! chunk/VOLUME/INDEX      replica server ids, primary first (JSON; hex ids)
//! deleted/VOLUME          tombstone: chunk servers drop this volume's chunks
//! counter/server, counter/volume   last id handed out
//! ```

use floe_metadata::{MetaStore, Op};
use floe_protocol::server::{self, Handler};
use floe_protocol::{
    ChunkId, ChunkPlacement, ClusterStatus, ControlRequest, ControlResponse, Request, Response,
    ServerId, ServerInfo, Status, Volume, VolumeMap, VolumeSpec,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::Mutex;

/// A chunk server silent for this long is considered down.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

struct State {
    servers: BTreeMap<ServerId, ServerInfo>,
    last_heartbeat: HashMap<ServerId, Instant>,
    volumes: BTreeMap<String, Volume>,
    chunks: HashMap<u64, BTreeMap<u64, Vec<ServerId>>>,
    deleted_volumes: Vec<u64>,
    last_server_id: u64,
    last_volume_id: u64,
}

pub struct Master {
    store: Box<dyn MetaStore>,
    /// One lock for all state: control requests are rare, and serialising them keeps
    /// allocation and id assignment trivially race-free.
    state: Mutex<State>,
}

type Reply = Result<ControlResponse, (Status, String)>;

fn json<T: serde::Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("metadata serializes")
}

fn chunk_key(volume_id: u64, index: u64) -> String {
    format!("chunk/{volume_id:016x}/{index:016x}")
}

fn store_failed(e: floe_metadata::MetaError) -> (Status, String) {
    (Status::Unavailable, e.to_string())
}

impl Master {
    /// Loads the cluster state from the metadata store.
    pub async fn load(store: Box<dyn MetaStore>) -> Result<Master, String> {
        let corrupt =
            |key: &str, e: serde_json::Error| format!("metadata key {key} is corrupt: {e}");
        let mut state = State {
            servers: BTreeMap::new(),
            last_heartbeat: HashMap::new(),
            volumes: BTreeMap::new(),
            chunks: HashMap::new(),
            deleted_volumes: Vec::new(),
            last_server_id: 0,
            last_volume_id: 0,
        };
        let scan = |prefix: &'static str| store.scan_prefix(prefix);
        for (key, value) in scan("server/").await.map_err(|e| e.to_string())? {
            let mut server: ServerInfo =
                serde_json::from_slice(&value).map_err(|e| corrupt(&key, e))?;
            server.up = false;
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
            let replicas = serde_json::from_slice(&value).map_err(|e| corrupt(&key, e))?;
            state
                .chunks
                .entry(volume_id)
                .or_default()
                .insert(index, replicas);
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
                _ => {}
            }
        }
        Ok(Master {
            store,
            state: Mutex::new(state),
        })
    }

    async fn control(&self, request: ControlRequest) -> Reply {
        let mut state = self.state.lock().await;
        state.refresh_liveness();
        match request {
            ControlRequest::Register {
                uuid,
                address,
                host,
                class,
                capacity_bytes,
            } => {
                let existing = state
                    .servers
                    .values()
                    .find(|s| s.uuid == uuid)
                    .map(|s| s.id);
                let mut ops = Vec::new();
                let id = match existing {
                    Some(id) => id,
                    None => {
                        state.last_server_id += 1;
                        ops.push(Op::Put {
                            key: "counter/server".into(),
                            value: json(&state.last_server_id),
                        });
                        state.last_server_id as ServerId
                    }
                };
                let server = ServerInfo {
                    id,
                    uuid,
                    address,
                    host,
                    class,
                    capacity_bytes,
                    used_bytes: 0,
                    up: true,
                };
                ops.push(Op::Put {
                    key: format!("server/{id:08}"),
                    value: json(&server),
                });
                self.store.apply(ops).await.map_err(store_failed)?;
                tracing::info!(id, address = %server.address, host = %server.host, class = %server.class, "chunk server registered");
                state.servers.insert(id, server);
                state.last_heartbeat.insert(id, Instant::now());
                Ok(ControlResponse::Registered { id })
            }
            ControlRequest::Heartbeat { id, used_bytes } => {
                let Some(server) = state.servers.get_mut(&id) else {
                    return Err((
                        Status::NotFound,
                        format!("chunk server {id} is not registered"),
                    ));
                };
                server.used_bytes = used_bytes;
                server.up = true;
                state.last_heartbeat.insert(id, Instant::now());
                Ok(ControlResponse::HeartbeatAck {
                    deleted_volumes: state.deleted_volumes.clone(),
                })
            }
            ControlRequest::CreateVolume(spec) => self.create_volume(&mut state, spec).await,
            ControlRequest::ListVolumes => Ok(ControlResponse::Volumes {
                volumes: state.volume_list(),
            }),
            ControlRequest::GetVolumeMap { name } => {
                let volume = state.volume(&name)?;
                let chunks = state
                    .chunks
                    .get(&volume.id)
                    .into_iter()
                    .flatten()
                    .map(|(index, replicas)| ChunkPlacement {
                        index: *index,
                        replicas: replicas.clone(),
                    })
                    .collect();
                Ok(ControlResponse::VolumeMap(VolumeMap {
                    volume,
                    chunks,
                    servers: state.servers.values().cloned().collect(),
                }))
            }
            ControlRequest::ResizeVolume { name, size_bytes } => {
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
                self.store
                    .apply(vec![Op::Put {
                        key: format!("volume/{name}"),
                        value: json(&volume),
                    }])
                    .await
                    .map_err(store_failed)?;
                state.volumes.insert(name, volume.clone());
                Ok(ControlResponse::Volume(volume))
            }
            ControlRequest::DeleteVolume { name } => {
                let volume = state.volume(&name)?;
                self.store
                    .apply(vec![
                        Op::Delete {
                            key: format!("volume/{name}"),
                        },
                        Op::DeletePrefix {
                            prefix: format!("chunk/{:016x}/", volume.id),
                        },
                        Op::Put {
                            key: format!("deleted/{:016x}", volume.id),
                            value: Vec::new(),
                        },
                    ])
                    .await
                    .map_err(store_failed)?;
                state.volumes.remove(&name);
                state.chunks.remove(&volume.id);
                state.deleted_volumes.push(volume.id);
                tracing::info!(%name, "volume deleted");
                Ok(ControlResponse::Done)
            }
            ControlRequest::AllocateChunk { volume_id, index } => {
                self.allocate_chunk(&mut state, volume_id, index).await
            }
            ControlRequest::Status => Ok(ControlResponse::Status(ClusterStatus {
                servers: state.servers.values().cloned().collect(),
                volumes: state.volume_list(),
            })),
        }
    }

    async fn create_volume(&self, state: &mut State, spec: VolumeSpec) -> Reply {
        spec.validate().map_err(|e| (Status::BadRequest, e))?;
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
        };
        self.store
            .apply(vec![
                Op::Put {
                    key: "counter/volume".into(),
                    value: json(&id),
                },
                Op::Put {
                    key: format!("volume/{}", volume.spec.name),
                    value: json(&volume),
                },
            ])
            .await
            .map_err(store_failed)?;
        state.last_volume_id = id;
        state
            .volumes
            .insert(volume.spec.name.clone(), volume.clone());
        tracing::info!(name = %volume.spec.name, size = volume.spec.size_bytes, "volume created");
        Ok(ControlResponse::Volume(volume))
    }

    async fn allocate_chunk(&self, state: &mut State, volume_id: u64, index: u64) -> Reply {
        let Some(volume) = state.volumes.values().find(|v| v.id == volume_id).cloned() else {
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
        let existing = state
            .chunks
            .get(&volume_id)
            .and_then(|c| c.get(&index))
            .cloned();
        let replicas = match existing {
            Some(replicas) => replicas,
            None => {
                let live: Vec<ServerInfo> =
                    state.servers.values().filter(|s| s.up).cloned().collect();
                let chunk = ChunkId { volume_id, index };
                let replicas = floe_placement::place(chunk, &live, volume.spec.replicas as usize)
                    .map_err(|e| (Status::NoSpace, e.to_string()))?;
                self.store
                    .apply(vec![Op::Put {
                        key: chunk_key(volume_id, index),
                        value: json(&replicas),
                    }])
                    .await
                    .map_err(store_failed)?;
                state
                    .chunks
                    .entry(volume_id)
                    .or_default()
                    .insert(index, replicas.clone());
                replicas
            }
        };
        let servers = replicas
            .iter()
            .filter_map(|id| state.servers.get(id).cloned())
            .collect();
        Ok(ControlResponse::Chunk {
            placement: ChunkPlacement { index, replicas },
            servers,
        })
    }
}

impl State {
    fn refresh_liveness(&mut self) {
        let now = Instant::now();
        for server in self.servers.values_mut() {
            server.up = self
                .last_heartbeat
                .get(&server.id)
                .is_some_and(|t| now.duration_since(*t) < HEARTBEAT_TIMEOUT);
        }
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

    fn volume(&self, name: &str) -> Result<Volume, (Status, String)> {
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

/// Serves the master on `listener` over the metadata store at `metadata` (see
/// `floe_metadata::open`).
pub async fn run(listener: TcpListener, metadata: &str) -> Result<(), String> {
    let store = floe_metadata::open(metadata)
        .await
        .map_err(|e| e.to_string())?;
    let master = Arc::new(Master::load(store).await?);
    tracing::info!(address = %listener.local_addr().map_err(|e| e.to_string())?, %metadata, "master serving");
    server::serve(listener, master)
        .await
        .map_err(|e| format!("accept failed: {e}"))
}
