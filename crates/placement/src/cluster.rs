//! Placement from the cluster map: what every process computes to find a chunk's
//! replicas (DESIGN.md sections 2 and 6).
//!
//! chunk -> placement group: MAPX eq. 2 from the chunk's creation layer (mapx), or the
//! chunk hash modulo the PG count (crush). PG -> servers: one CRUSH/MAPX map per device
//! class, built by replaying the map's changes, with a host as the failure domain; the
//! volume's mode then takes the primary and the backups from the classes it asks for,
//! filling in from the other class when one has too few hosts.

use crate::crush::{CrushError, CrushMap, Tunables, WEIGHT_ONE};
use crate::mapx::{chunk_hash, Device, LayerId, Mapx};
use crate::simulate::crush_map;
use crate::PlacementError;
use floe_protocol::{
    ChunkId, ClusterMap, DeviceClass, LayerInfo, MapChange, PlacementMode, ServerId, VolumeMode,
};
use std::collections::BTreeMap;

/// Replicas each class map is asked for: a volume's replica count plus one, so that a
/// hybrid volume still finds its backups on hosts other than its primary's.
const REPLICAS_MAX: usize = 9;
const LEVELS: [&str; 2] = ["rack", "host"];
/// One rack for now: servers do not report theirs.
const RACK: &str = "default";

enum ClassMap {
    Mapx(Box<Mapx>),
    /// None until a device of the class joins.
    Crush(Option<CrushMap>),
}

/// A cluster map made ready to place chunks.
pub struct Placer {
    epoch: u64,
    pgs_per_layer: u32,
    ssd: ClassMap,
    hdd: ClassMap,
    hosts: BTreeMap<ServerId, String>,
    out: Vec<ServerId>,
    /// Length of a reweight vector: one more than the largest device id.
    devices: usize,
    /// Live layers, oldest first, with their devices (mapx), or one (crush).
    layers: Vec<(LayerId, Vec<ServerId>)>,
}

fn crush_error(e: CrushError) -> PlacementError {
    PlacementError::Map(e.to_string())
}

fn device(d: &floe_protocol::MapDevice) -> Device {
    Device {
        id: d.id as i32,
        weight: d.weight.max(1),
        location: vec![RACK.to_string(), d.host.clone()],
    }
}

impl Placer {
    pub fn new(map: &ClusterMap) -> Result<Placer, PlacementError> {
        let new_mapx = || {
            Mapx::new(&LEVELS, "host", REPLICAS_MAX, Tunables::jewel())
                .map(|m| ClassMap::Mapx(Box::new(m)))
                .map_err(crush_error)
        };
        let (mut ssd, mut hdd) = match map.mode {
            PlacementMode::Mapx => (new_mapx()?, new_mapx()?),
            PlacementMode::Crush => (ClassMap::Crush(None), ClassMap::Crush(None)),
        };
        let pgs = map.pgs_per_layer.max(1);
        let mut layers: Vec<(LayerId, Vec<ServerId>)> = Vec::new();
        for (i, change) in map.changes.iter().enumerate() {
            let both = [(&mut ssd, DeviceClass::Ssd), (&mut hdd, DeviceClass::Hdd)];
            match change {
                MapChange::Expand { devices } => {
                    for (class_map, class) in both {
                        let joining: Vec<Device> = devices
                            .iter()
                            .filter(|d| d.class == class)
                            .map(device)
                            .collect();
                        match class_map {
                            ClassMap::Mapx(mapx) => {
                                mapx.expand(i as u64 + 1, joining, pgs)
                                    .map_err(crush_error)?;
                            }
                            ClassMap::Crush(crush) => {
                                let all: Vec<Device> = map
                                    .devices()
                                    .take_while(|d| !devices.contains(d))
                                    .chain(devices)
                                    .filter(|d| d.class == class)
                                    .map(device)
                                    .collect();
                                if !all.is_empty() {
                                    *crush = Some(crush_map(&all, "host").map_err(crush_error)?);
                                }
                            }
                        }
                    }
                    let ids = devices.iter().map(|d| d.id).collect();
                    match map.mode {
                        PlacementMode::Mapx => layers.push((layers.len() as LayerId, ids)),
                        PlacementMode::Crush if layers.is_empty() => layers.push((0, ids)),
                        PlacementMode::Crush => layers[0].1.extend(ids),
                    }
                }
                MapChange::Remap { .. } | MapChange::Shrink { .. } | MapChange::Merge { .. } => {
                    for (class_map, _) in both {
                        let ClassMap::Mapx(mapx) = class_map else {
                            return Err(PlacementError::Map(
                                "remap, shrink and merge need placement mode mapx".into(),
                            ));
                        };
                        match change {
                            MapChange::Remap { pg, layer } => mapx.remap(*pg, *layer),
                            MapChange::Shrink { layer } => mapx.shrink(*layer).map(drop),
                            MapChange::Merge { a, b } => mapx.merge(*a, *b),
                            MapChange::Expand { .. } => unreachable!("matched above"),
                        }
                        .map_err(crush_error)?;
                    }
                }
            }
        }
        Ok(Placer {
            epoch: map.epoch,
            pgs_per_layer: pgs,
            ssd,
            hdd,
            hosts: map.devices().map(|d| (d.id, d.host.clone())).collect(),
            out: map.out.clone(),
            devices: map.devices().map(|d| d.id as usize + 1).max().unwrap_or(0),
            layers,
        })
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether `server` is in the map.
    pub fn contains(&self, server: ServerId) -> bool {
        self.hosts.contains_key(&server)
    }

    /// The layer new chunks are created in: the newest live one.
    pub fn newest_layer(&self) -> Option<LayerId> {
        match &self.ssd {
            ClassMap::Mapx(mapx) => mapx.layer_at(u64::MAX),
            ClassMap::Crush(_) => (!self.hosts.is_empty()).then_some(0),
        }
    }

    /// The placement group of a chunk created in `layer`.
    pub fn pg_of(&self, chunk: ChunkId, layer: LayerId) -> u32 {
        // A snapshot's delta chunk goes where its live chunk goes: preserving a block
        // copies it between the same servers.
        let chunk = ChunkId {
            index: floe_protocol::snapshot::split_index(chunk.index).1,
            ..chunk
        };
        match &self.ssd {
            ClassMap::Mapx(mapx) => mapx.pg_of_chunk(chunk, layer),
            ClassMap::Crush(_) => chunk_hash(chunk) % self.pgs_per_layer,
        }
    }

    /// The servers of `class` for `pg`, best first, skipping `unavailable` ones.
    fn candidates(
        &self,
        class: DeviceClass,
        pg: u32,
        unavailable: &dyn Fn(ServerId) -> bool,
    ) -> Vec<ServerId> {
        let mut reweights = vec![WEIGHT_ONE; self.devices];
        for (id, weight) in reweights.iter_mut().enumerate() {
            let id = id as ServerId;
            if !self.hosts.contains_key(&id) || self.out.contains(&id) || unavailable(id) {
                *weight = 0;
            }
        }
        let picked = match if class == DeviceClass::Ssd {
            &self.ssd
        } else {
            &self.hdd
        } {
            ClassMap::Mapx(mapx) => mapx.map_pg_n(pg, REPLICAS_MAX, &reweights),
            ClassMap::Crush(Some(map)) => map.do_rule(0, pg, REPLICAS_MAX, &reweights),
            ClassMap::Crush(None) => Vec::new(),
        };
        picked.into_iter().map(|id| id as ServerId).collect()
    }

    /// The replicas of `chunk` (created in `layer`) for a volume of `mode`, primary
    /// first, on distinct hosts, none of them `unavailable`.
    pub fn place(
        &self,
        chunk: ChunkId,
        layer: LayerId,
        mode: VolumeMode,
        replicas: usize,
        unavailable: &dyn Fn(ServerId) -> bool,
    ) -> Result<Vec<ServerId>, PlacementError> {
        use DeviceClass::{Hdd, Ssd};
        let pg = self.pg_of(chunk, layer);
        // (class, at most this many from it), in order of preference.
        let preferences: &[(DeviceClass, usize)] = match mode {
            VolumeMode::Ssd => &[(Ssd, usize::MAX), (Hdd, usize::MAX)],
            VolumeMode::Hybrid => &[(Ssd, 1), (Hdd, usize::MAX), (Ssd, usize::MAX)],
            VolumeMode::Hdd => &[(Hdd, usize::MAX), (Ssd, usize::MAX)],
        };
        let mut chosen: Vec<ServerId> = Vec::with_capacity(replicas);
        for &(class, most) in preferences {
            let mut taken = 0;
            for id in self.candidates(class, pg, unavailable) {
                if chosen.len() == replicas || taken == most {
                    break;
                }
                let host = &self.hosts[&id];
                if chosen.iter().all(|c| &self.hosts[c] != host) {
                    chosen.push(id);
                    taken += 1;
                }
            }
        }
        if chosen.len() < replicas {
            let mut hosts: Vec<&String> = self
                .hosts
                .iter()
                .filter(|(id, _)| !self.out.contains(id) && !unavailable(**id))
                .map(|(_, host)| host)
                .collect();
            hosts.sort_unstable();
            hosts.dedup();
            return Err(PlacementError::NotEnoughHosts {
                replicas,
                hosts: hosts.len(),
            });
        }
        Ok(chosen)
    }

    /// The layers for `floe cluster map`.
    pub fn layers(&self) -> Vec<LayerInfo> {
        let ClassMap::Mapx(mapx) = &self.ssd else {
            return self
                .layers
                .iter()
                .map(|(id, devices)| LayerInfo {
                    id: *id,
                    devices: devices.clone(),
                    pgs_created: self.pgs_per_layer,
                    pgs_placed: self.pgs_per_layer,
                    removed: false,
                    timestamp: 1,
                })
                .collect();
        };
        self.layers
            .iter()
            .map(|(id, devices)| {
                let (timestamp, removed) = mapx.layer_state(*id);
                LayerInfo {
                    id: *id,
                    devices: devices.clone(),
                    pgs_created: mapx.layer_pgs(*id).len() as u32,
                    pgs_placed: (0..mapx.pg_count())
                        .filter(|pg| mapx.pg_layer(*pg) == *id)
                        .count() as u32,
                    removed,
                    timestamp,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_protocol::MapDevice;

    fn devices(first: ServerId, hosts: &[&str]) -> Vec<MapDevice> {
        let mut out = Vec::new();
        for host in hosts {
            for class in [DeviceClass::Ssd, DeviceClass::Hdd] {
                out.push(MapDevice {
                    id: first + out.len() as ServerId,
                    host: host.to_string(),
                    class,
                    weight: WEIGHT_ONE,
                });
            }
        }
        out
    }

    fn map(mode: PlacementMode) -> ClusterMap {
        ClusterMap {
            epoch: 1,
            mode,
            pgs_per_layer: 128,
            changes: vec![MapChange::Expand {
                devices: devices(1, &["a", "b", "c"]),
            }],
            out: Vec::new(),
        }
    }

    fn chunk(index: u64) -> ChunkId {
        ChunkId {
            volume_id: 1,
            index,
        }
    }

    fn class_of(id: ServerId) -> DeviceClass {
        // devices() alternates ssd, hdd from an odd first id.
        if id % 2 == 1 {
            DeviceClass::Ssd
        } else {
            DeviceClass::Hdd
        }
    }

    #[test]
    fn modes_pick_their_classes_on_distinct_hosts() {
        for placement in [PlacementMode::Mapx, PlacementMode::Crush] {
            let placer = Placer::new(&map(placement)).unwrap();
            for index in 0..200 {
                let none = |_| false;
                let hybrid = placer
                    .place(chunk(index), 0, VolumeMode::Hybrid, 3, &none)
                    .unwrap();
                let classes: Vec<_> = hybrid.iter().map(|id| class_of(*id)).collect();
                assert_eq!(
                    classes,
                    [DeviceClass::Ssd, DeviceClass::Hdd, DeviceClass::Hdd]
                );
                let mut hosts: Vec<_> = hybrid.iter().map(|id| &placer.hosts[id]).collect();
                hosts.sort();
                hosts.dedup();
                assert_eq!(hosts.len(), 3, "{hybrid:?}");
                let ssd = placer
                    .place(chunk(index), 0, VolumeMode::Ssd, 3, &none)
                    .unwrap();
                assert!(ssd.iter().all(|id| class_of(*id) == DeviceClass::Ssd));
                let hdd = placer
                    .place(chunk(index), 0, VolumeMode::Hdd, 2, &none)
                    .unwrap();
                assert!(hdd.iter().all(|id| class_of(*id) == DeviceClass::Hdd));
            }
        }
    }

    #[test]
    fn an_unavailable_server_is_replaced_and_too_few_hosts_is_an_error() {
        let placer = Placer::new(&map(PlacementMode::Mapx)).unwrap();
        let all = placer
            .place(chunk(7), 0, VolumeMode::Hybrid, 3, &|_| false)
            .unwrap();
        let primary = all[0];
        let without = placer
            .place(chunk(7), 0, VolumeMode::Hybrid, 3, &|id| id == primary)
            .unwrap();
        assert!(!without.contains(&primary));
        assert_eq!(without.len(), 3);
        let on_a = |id: ServerId| placer.hosts[&id] == "a";
        assert_eq!(
            placer.place(chunk(7), 0, VolumeMode::Ssd, 3, &on_a),
            Err(PlacementError::NotEnoughHosts {
                replicas: 3,
                hosts: 2
            })
        );
    }

    #[test]
    fn mapx_expansion_keeps_old_chunks_and_places_new_ones_in_the_new_layer() {
        let before = map(PlacementMode::Mapx);
        let mut after = before.clone();
        after.epoch = 2;
        after.changes.push(MapChange::Expand {
            devices: devices(7, &["d", "e", "f"]),
        });
        let (old, new) = (Placer::new(&before).unwrap(), Placer::new(&after).unwrap());
        assert_eq!(new.newest_layer(), Some(1));
        let none = |_| false;
        for index in 0..300 {
            let place = |p: &Placer, layer| {
                p.place(chunk(index), layer, VolumeMode::Hybrid, 3, &none)
                    .unwrap()
            };
            assert_eq!(place(&old, 0), place(&new, 0), "chunk {index} moved");
            assert!(place(&new, 1).iter().all(|id| *id >= 7), "new layer only");
        }
        let mut crush = after.clone();
        crush.mode = PlacementMode::Crush;
        let (old, new) = (
            Placer::new(&map(PlacementMode::Crush)).unwrap(),
            Placer::new(&crush).unwrap(),
        );
        let moved = (0..300)
            .filter(|i| {
                let place =
                    |p: &Placer| p.place(chunk(*i), 0, VolumeMode::Hybrid, 3, &none).unwrap();
                place(&old) != place(&new)
            })
            .count();
        assert!(moved > 100, "plain CRUSH moves about half: {moved}");
    }

    #[test]
    fn shrink_moves_a_layer_away_and_remap_moves_one_pg() {
        let mut map = map(PlacementMode::Mapx);
        map.changes.push(MapChange::Expand {
            devices: devices(7, &["d", "e", "f"]),
        });
        let grown = Placer::new(&map).unwrap();
        map.changes.push(MapChange::Remap { pg: 3, layer: 1 });
        let remapped = Placer::new(&map).unwrap();
        let none = |_| false;
        let on = |p: &Placer, index| p.place(chunk(index), 0, VolumeMode::Ssd, 3, &none).unwrap();
        let moved: Vec<u64> = (0..500)
            .filter(|i| on(&grown, *i) != on(&remapped, *i))
            .collect();
        assert!(!moved.is_empty());
        assert!(moved.iter().all(|i| remapped.pg_of(chunk(*i), 0) == 3));
        map.changes.push(MapChange::Shrink { layer: 0 });
        let shrunk = Placer::new(&map).unwrap();
        assert!((0..100).all(|i| on(&shrunk, i).iter().all(|id| *id >= 7)));
        assert_eq!(shrunk.newest_layer(), Some(1));
        map.mode = PlacementMode::Crush;
        assert!(Placer::new(&map).is_err(), "shrink needs mapx");
    }
}
