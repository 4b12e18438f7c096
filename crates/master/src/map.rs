//! The cluster map (DESIGN.md section 6): the devices by layer, the placement groups'
//! layers, the placement mode, under one epoch. The master is the only writer; it
//! hands the map to gateways with each volume map, and places chunks with it. Kept
//! in the metadata store under `map`.
//!
//! Servers that register join the map only through `floe cluster expand` (a new MAPX
//! layer: nothing existing moves), except when the map is still empty: the first
//! chunk allocation puts every registered server into layer 0.

use crate::state::{put, State};
use crate::{recovery, Failure, Master, Reply};
use floe_metadata::Op;
use floe_placement::cluster::Placer;
use floe_protocol::{
    ChunkId, ChunkPlacement, ClusterMap, ClusterMapInfo, MapChange, MapDevice, MasterRequest,
    MasterResponse, PlacementMode, ServerId, ServerInfo, Status,
};
use std::sync::Arc;

pub(crate) const MAP_KEY: &str = "map";
/// Placement groups per layer (MAPX's INIT_PG_NUM), or in all (crush): enough to
/// spread chunks evenly over a few dozen servers.
const PGS_PER_LAYER: u32 = 256;

/// The map and its ready-to-use form.
pub(crate) struct MapState {
    pub(crate) map: ClusterMap,
    pub(crate) placer: Arc<Placer>,
}

impl MapState {
    /// The stored map, or an empty one in `mode`. A stored map keeps its mode: changing
    /// it would move every chunk.
    pub(crate) fn load(stored: Option<ClusterMap>, mode: PlacementMode) -> Result<Self, String> {
        let map = match stored {
            Some(map) if map.epoch > 0 && map.mode != mode => {
                return Err(format!(
                    "the cluster map is in placement mode {} (epoch {}); starting the master with --placement {mode} would move every chunk. Start it with --placement {}",
                    map.mode, map.epoch, map.mode
                ))
            }
            Some(map) => map,
            None => ClusterMap {
                epoch: 0,
                mode,
                pgs_per_layer: PGS_PER_LAYER,
                changes: Vec::new(),
                out: Vec::new(),
            },
        };
        let placer = Arc::new(Placer::new(&map).map_err(|e| e.to_string())?);
        Ok(MapState { map, placer })
    }
}

/// How a server joins the map: CRUSH weight 1.0 per TiB, as Ceph does.
fn map_device(server: &ServerInfo) -> MapDevice {
    MapDevice {
        id: server.id,
        host: server.host.clone(),
        class: server.class,
        weight: (server.capacity_bytes >> 24).clamp(1, u32::MAX as u64) as u32,
    }
}

impl State {
    /// Registered servers the map does not hold yet.
    pub(crate) fn pending_servers(&self) -> Vec<ServerInfo> {
        self.servers
            .values()
            .filter(|s| !s.lost && !self.map.placer.contains(s.id))
            .cloned()
            .collect()
    }

    /// Where the map places `placement`'s chunk now, around servers that are down or
    /// lost.
    pub(crate) fn desired(
        &self,
        volume_id: u64,
        placement: &ChunkPlacement,
    ) -> Result<Vec<ServerId>, Failure> {
        let volume = self
            .volumes
            .values()
            .find(|v| v.id == volume_id)
            .ok_or((Status::NotFound, format!("volume id {volume_id} is gone")))?;
        let chunk = ChunkId {
            volume_id,
            index: placement.index,
        };
        let placer = &self.map.placer;
        let current: Vec<ServerId> = placement
            .replicas
            .iter()
            .copied()
            .filter(|id| !placement.stale.contains(id))
            .collect();
        recovery::desired(
            placer,
            &self.servers,
            chunk,
            placement.layer,
            &volume.spec,
            &current,
        )
    }
}

impl MapState {
    /// Stores the map.
    pub(crate) fn op(&self) -> Op {
        put(MAP_KEY.into(), &self.map)
    }
}

impl State {
    /// The map with `change` applied as the next epoch, checked to still place.
    pub(crate) fn next_map(
        &self,
        change: impl FnOnce(&mut ClusterMap),
    ) -> Result<MapState, Failure> {
        let mut map = self.map.map.clone();
        change(&mut map);
        map.epoch += 1;
        let placer = Placer::new(&map).map_err(|e| (Status::BadRequest, e.to_string()))?;
        Ok(MapState {
            map,
            placer: Arc::new(placer),
        })
    }

    /// Takes a stored map.
    pub(crate) fn set_map(&mut self, next: MapState) {
        // Gateways and chunk servers keep the map with the highest epoch they saw.
        assert!(
            next.map.epoch > self.map.map.epoch,
            "cluster map epoch {} stored over epoch {}",
            next.map.epoch,
            self.map.map.epoch
        );
        tracing::info!(epoch = next.map.epoch, change = ?next.map.changes.last(), "cluster map changed");
        self.map = next;
    }

    fn mapx_only(&self, what: &str) -> Result<(), Failure> {
        if self.map.map.mode == PlacementMode::Crush {
            return Err((
                Status::BadRequest,
                format!("{what} needs placement mode mapx; this cluster places with plain crush"),
            ));
        }
        Ok(())
    }
}

impl Master {
    /// Stores the change `decide` returns (none: the map stays) as the next epoch.
    async fn change_map(
        &self,
        decide: impl FnOnce(&State) -> Result<Option<MapChange>, Failure>,
    ) -> Result<(), Failure> {
        self.change(
            |state| {
                let Some(change) = decide(state)? else {
                    return Ok((Vec::new(), None));
                };
                let next = state.next_map(|map| map.changes.push(change))?;
                Ok((vec![next.op()], Some(next)))
            },
            |state, next| {
                if let Some(next) = next {
                    state.set_map(next);
                }
            },
        )
        .await
    }

    /// `change`, which only layers have (`what` names it for the error).
    async fn change_mapx(&self, what: &str, change: MapChange) -> Result<(), Failure> {
        self.change_map(|state| {
            state.mapx_only(what)?;
            Ok(Some(change))
        })
        .await
    }

    /// Puts every registered server into the first layer, once.
    pub(crate) async fn bootstrap_map(&self) -> Result<(), Failure> {
        self.change_map(|state| {
            if state.map.map.epoch > 0 {
                return Ok(None);
            }
            let devices: Vec<MapDevice> = state.pending_servers().iter().map(map_device).collect();
            if devices.is_empty() {
                return Err((
                    Status::NoSpace,
                    "no chunk server has registered: start chunk servers first".into(),
                ));
            }
            Ok(Some(MapChange::Expand { devices }))
        })
        .await
    }

    /// `floe cluster map|expand`, `floe pg remap`, `floe layer shrink|merge`.
    pub(crate) async fn map_request(&self, request: MasterRequest) -> Reply {
        match request {
            MasterRequest::GetClusterMap => {}
            MasterRequest::ExpandCluster { hosts } => {
                self.change_map(|state| {
                    let devices: Vec<MapDevice> = state
                        .pending_servers()
                        .iter()
                        .filter(|s| hosts.is_empty() || hosts.contains(&s.host))
                        .map(map_device)
                        .collect();
                    if devices.is_empty() {
                        return Err((
                            Status::BadRequest,
                            if hosts.is_empty() {
                                "every registered chunk server is already in the cluster map: start the new servers first".to_string()
                            } else {
                                format!(
                                    "no registered chunk server outside the map is on hosts {hosts:?}"
                                )
                            },
                        ));
                    }
                    Ok(Some(MapChange::Expand { devices }))
                })
                .await?;
            }
            MasterRequest::RemapPg { pg, layer } => {
                self.change_mapx("pg remap", MapChange::Remap { pg, layer })
                    .await?
            }
            MasterRequest::ShrinkLayer { layer } => {
                self.change_mapx("layer shrink", MapChange::Shrink { layer })
                    .await?
            }
            MasterRequest::MergeLayers { a, b } => {
                self.change_mapx("layer merge", MapChange::Merge { a, b })
                    .await?
            }
            other => unreachable!("not a map request: {other:?}"),
        }
        let state = self.state();
        Ok(MasterResponse::ClusterMap(Box::new(ClusterMapInfo {
            map: state.map.map.clone(),
            pending: state.pending_servers(),
            layers: state.map.placer.layers(),
        })))
    }
}
