//! What the master knows: the stored cluster state (its in-memory copy) and what
//! only heartbeats tell (liveness, journal fill, lease terms), and how it is stored.
//!
//! Keys in the metadata store:
//! ```text
//! server/ID               ServerInfo (JSON)
//! volume/NAME             Volume (JSON)
//! chunk/VOLUME/INDEX      ChunkPlacement: replicas (primary first), view, stale replicas
//! lease/VOLUME            the volume's last lease: generation and holder
//! deleted/VOLUME          tombstone: chunk servers drop this volume's chunks
//! freed/VOLUME/INDEX      a forgotten delta chunk: servers (JSON) yet to drop it
//! map                     the cluster map (see [`crate::map`])
//! counter/server, counter/volume, counter/lease   last id handed out
//! ```

use crate::lease::{Lease, LEASE_TERM};
use crate::{map, Failure, Settings};
use floe_metadata::{MetaStore, Op};
use floe_protocol::{
    ChunkPlacement, ClusterMap, JournalUsage, ServerId, ServerInfo, Status, Volume,
};
use serde::Serialize;
use std::collections::BTreeMap;
use tokio::time::Instant;

pub(crate) struct State {
    pub(crate) servers: BTreeMap<ServerId, ServerInfo>,
    pub(crate) last_heartbeat: BTreeMap<ServerId, Instant>,
    /// From heartbeats; not stored.
    pub(crate) journals: BTreeMap<ServerId, JournalUsage>,
    pub(crate) volumes: BTreeMap<String, Volume>,
    pub(crate) chunks: BTreeMap<u64, BTreeMap<u64, ChunkPlacement>>,
    /// By volume id.
    pub(crate) leases: BTreeMap<u64, Lease>,
    /// The volume whose new lease is being stored: its old lease is not renewed
    /// meanwhile.
    pub(crate) lease_in_flight: Option<u64>,
    /// Volumes whose writer changed without releasing its lease, and the new
    /// generation: their replicas are compared (see `recovery::audit`).
    pub(crate) audits: BTreeMap<u64, u32>,
    pub(crate) deleted_volumes: Vec<u64>,
    /// Delta chunks forgotten (no snapshot reads them) whose replicas the servers
    /// listed have not dropped yet, by (volume id, index); see `crate::reclaim`.
    pub(crate) freed: BTreeMap<(u64, u64), Vec<ServerId>>,
    /// The snapshot epoch each volume's writer last confirmed; not stored (a master
    /// that restarted frees no delta a live writer may still preserve into).
    pub(crate) writer_epochs: BTreeMap<u64, u32>,
    pub(crate) last_server_id: u64,
    pub(crate) last_volume_id: u64,
    pub(crate) last_lease: u64,
    pub(crate) map: map::MapState,
    /// Bumped by every stored placement: cached views of the placements compare it.
    pub(crate) placement_changes: u64,
}

pub(crate) fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("metadata serializes")
}

/// Stores `value` under `key`.
pub(crate) fn put(key: String, value: &impl Serialize) -> Op {
    Op::Put {
        key,
        value: json(value),
    }
}

pub(crate) fn server_key(id: ServerId) -> String {
    format!("server/{id:08}")
}

pub(crate) fn volume_key(name: &str) -> String {
    format!("volume/{name}")
}

pub(crate) fn chunk_key(volume_id: u64, index: u64) -> String {
    format!("chunk/{volume_id:016x}/{index:016x}")
}

pub(crate) fn freed_key(volume_id: u64, index: u64) -> String {
    format!("freed/{volume_id:016x}/{index:016x}")
}

/// Stores a chunk's placement.
pub(crate) fn chunk_op(volume_id: u64, placement: &ChunkPlacement) -> Op {
    put(chunk_key(volume_id, placement.index), placement)
}

pub(crate) fn store_failed(e: floe_metadata::MetaError) -> Failure {
    (Status::Unavailable, e.to_string())
}

impl State {
    /// The state as `store` holds it.
    pub(crate) async fn load(store: &dyn MetaStore, settings: Settings) -> Result<State, String> {
        let corrupt =
            |key: &str, e: serde_json::Error| format!("metadata key {key} is corrupt: {e}");
        let mut state = State {
            servers: BTreeMap::new(),
            last_heartbeat: BTreeMap::new(),
            journals: BTreeMap::new(),
            volumes: BTreeMap::new(),
            chunks: BTreeMap::new(),
            leases: BTreeMap::new(),
            lease_in_flight: None,
            audits: BTreeMap::new(),
            deleted_volumes: Vec::new(),
            freed: BTreeMap::new(),
            writer_epochs: BTreeMap::new(),
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
            // The grant of this generation may have queued an audit of the writers
            // before it (see `acquire_lease`) that the last master did not finish: the
            // queue lives in memory, and the holder may release cleanly before this
            // lease could lapse, so audit again.
            if lease.generation > 1 {
                state.audits.insert(volume_id, lease.generation - 1);
            }
            state.leases.insert(volume_id, lease);
        }
        for (key, _) in scan("deleted/").await.map_err(|e| e.to_string())? {
            if let Ok(id) = u64::from_str_radix(&key["deleted/".len()..], 16) {
                state.deleted_volumes.push(id);
            }
        }
        for (key, value) in scan("freed/").await.map_err(|e| e.to_string())? {
            let id = key["freed/".len()..].split_once('/').and_then(|(v, i)| {
                Some((
                    u64::from_str_radix(v, 16).ok()?,
                    u64::from_str_radix(i, 16).ok()?,
                ))
            });
            let Some(id) = id else {
                return Err(format!("metadata key {key} is malformed"));
            };
            let servers = serde_json::from_slice(&value).map_err(|e| corrupt(&key, e))?;
            state.freed.insert(id, servers);
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
        Ok(state)
    }

    /// Records a stored placement in memory.
    pub(crate) fn insert_placement(&mut self, volume_id: u64, placement: ChunkPlacement) {
        let old = self.placement(volume_id, placement.index);
        let chunk = format!("chunk {volume_id}/{}", placement.index);
        if let Some(old) = &old {
            // Replicas refuse older views: a view that went back would let replicas
            // replaced since serve again.
            assert!(
                placement.view >= old.view,
                "{chunk}: view {} stored over view {}",
                placement.view,
                old.view
            );
            assert!(
                placement.replicas == old.replicas || placement.view > old.view,
                "{chunk}: replica set {:?} stored over {:?} without a view change (view {})",
                placement.replicas,
                old.replicas,
                old.view
            );
        }
        assert!(
            placement
                .stale
                .iter()
                .all(|id| placement.replicas.contains(id)),
            "{chunk}: stale replicas {:?} outside the set {:?}",
            placement.stale,
            placement.replicas
        );
        if old.is_none_or(|old| old.replicas != placement.replicas) {
            self.assert_on_distinct_hosts(&chunk, &placement.replicas);
        }
        self.chunks
            .entry(volume_id)
            .or_default()
            .insert(placement.index, placement);
        self.placement_changes += 1;
    }

    /// A replica set the map just chose is on distinct hosts, as the map knows them
    /// (a server that registers again from another host keeps its old one there).
    fn assert_on_distinct_hosts(&self, chunk: &str, replicas: &[ServerId]) {
        let devices: Vec<_> = self.map.map.devices().collect();
        let mut hosts: Vec<&str> = replicas
            .iter()
            .map(|id| {
                let device = devices.iter().find(|d| d.id == *id);
                let device = device.unwrap_or_else(|| {
                    panic!("{chunk}: replica on server {id}, which the cluster map lacks")
                });
                device.host.as_str()
            })
            .collect();
        hosts.sort_unstable();
        hosts.dedup();
        assert_eq!(
            hosts.len(),
            replicas.len(),
            "{chunk}: replicas {replicas:?} share a host"
        );
    }

    /// Forgets a chunk whose stored placement was deleted (a freed delta chunk).
    pub(crate) fn remove_placement(&mut self, volume_id: u64, index: u64) {
        if let Some(chunks) = self.chunks.get_mut(&volume_id) {
            chunks.remove(&index);
        }
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

    pub(crate) fn volume(&self, name: &str) -> Result<Volume, Failure> {
        let mut volume = self.volumes.get(name).cloned().ok_or_else(|| {
            (
                Status::NotFound,
                format!("volume {name} does not exist (see `floe volume list`)"),
            )
        })?;
        volume.chunks_allocated = self.chunks.get(&volume.id).map_or(0, |c| c.len() as u64);
        Ok(volume)
    }

    pub(crate) fn volume_list(&self) -> Vec<Volume> {
        self.volumes
            .keys()
            .filter_map(|name| self.volume(name).ok())
            .collect()
    }
}
