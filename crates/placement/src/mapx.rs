//! MAPX (FAST'20): CRUSH with a time dimension, so that growing the cluster moves no
//! existing data.
//!
//! Each expansion is a *layer*: a virtual node under the root holding the layer's
//! devices and copies of the physical buckets above them (a host that gains disks in
//! two expansions appears once in each). Chunks map to placement groups by MAPX eq. 2
//! from their creation layer, so the chunk -> PG mapping never changes; a PG maps to
//! devices by running the CRUSH rule inside the layer that its dynamic timestamp
//! selects (Algorithm 1's implicit `select(1, layer)`), so adding a layer leaves every
//! older layer's subtree, and every existing PG's mapping, untouched. When a layer has
//! too few failure domains for all replicas, the rest come from older layers, with
//! physical failure domains kept distinct across layers.
//!
//! Migration is explicit: remap (point a PG's dynamic timestamp at another layer),
//! shrink (empty a layer, spreading its PGs over the others by weight) and merge (give
//! two layers one timestamp, after which they are selected and mapped as one).

use crate::crush::hash::hash4;
use crate::crush::mapper::{Mapper, Params};
use crate::crush::{BucketSpec, CrushError, CrushMap, MapBuilder, Tunables, ITEM_NONE};
use floe_protocol::ChunkId;
use std::collections::BTreeMap;

/// Layer index: one byte per PG timestamp and per chunk, as in the paper.
pub type LayerId = u8;

/// A device joining the cluster in an expansion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub id: i32,
    /// 16.16 fixed point, as CRUSH weights.
    pub weight: u32,
    /// Physical bucket names from the top level down, one per hierarchy level.
    pub location: Vec<String>,
}

#[derive(Debug, Clone)]
struct Layer {
    timestamp: u64,
    init_pg_num: u32,
    /// First PG id of the layer: the sum of the earlier layers' INIT_PG_NUM.
    pg_base: u32,
    devices: Vec<Device>,
    /// Emptied by a shrink: keeps its PG ids (eq. 2) but holds neither devices nor PGs.
    removed: bool,
    /// Virtual id of the layer's node under the root.
    node: i32,
}

/// Layers sharing a timestamp: selected and mapped as one.
#[derive(Debug, Clone)]
struct Group {
    timestamp: u64,
    /// The group's oldest layer, whose node and virtual ids the group uses.
    representative: LayerId,
    weight: u64,
}

/// A failure domain as chosen, independent of the layer it was chosen in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Physical {
    Device(i32),
    Bucket(u32),
}

#[derive(Debug)]
pub struct Mapx {
    /// Hierarchy levels from the top down, below the root and the layer level.
    levels: Vec<String>,
    /// CRUSH type of the failure domain: 0 for devices, 1 for the lowest level...
    failure_domain_type: i32,
    replicas: usize,
    tunables: Tunables,
    layers: Vec<Layer>,
    /// Each PG's dynamic timestamp, as the layer whose timestamp it is (one byte, as
    /// in the paper). The static one is the layer whose PG id range holds the PG.
    pgs: Vec<LayerId>,
    /// Physical bucket (level, name) -> stable physical index.
    physical: BTreeMap<(usize, String), u32>,
    /// (physical bucket, layer) -> virtual id; assigned once, never reused.
    virtual_ids: BTreeMap<(u32, LayerId), i32>,
    next_virtual_id: i32,
    /// (physical bucket, group representative) -> the bucket's id in that group now.
    in_group: BTreeMap<(u32, LayerId), i32>,
    /// Virtual bucket id -> its physical bucket, for the current map.
    physical_of: BTreeMap<i32, u32>,
    groups: Vec<Group>,
    map: CrushMap,
}

const ROOT: i32 = -1;

/// The hash that spreads chunks over a layer's PGs (eq. 2), and over all PGs in plain
/// CRUSH.
pub fn chunk_hash(chunk: ChunkId) -> u32 {
    hash4(
        chunk.volume_id as u32,
        (chunk.volume_id >> 32) as u32,
        chunk.index as u32,
        (chunk.index >> 32) as u32,
    )
}

impl Mapx {
    /// An empty cluster whose hierarchy has `levels` (top down, e.g. `["rack", "host"]`)
    /// between the root and the devices, placing `replicas` replicas in distinct
    /// `failure_domain`s (a level name, or "osd" for devices).
    pub fn new(
        levels: &[&str],
        failure_domain: &str,
        replicas: usize,
        tunables: Tunables,
    ) -> Result<Self, CrushError> {
        let failure_domain_type = if failure_domain == "osd" {
            0
        } else {
            let position = levels
                .iter()
                .position(|l| *l == failure_domain)
                .ok_or_else(|| {
                    CrushError::new(format!(
                        "failure domain {failure_domain} is not a level of {levels:?}"
                    ))
                })?;
            (levels.len() - position) as i32
        };
        let mut mapx = Mapx {
            levels: levels.iter().map(|l| l.to_string()).collect(),
            failure_domain_type,
            replicas,
            tunables,
            layers: Vec::new(),
            pgs: Vec::new(),
            physical: BTreeMap::new(),
            virtual_ids: BTreeMap::new(),
            next_virtual_id: ROOT - 1,
            in_group: BTreeMap::new(),
            physical_of: BTreeMap::new(),
            groups: Vec::new(),
            map: MapBuilder::new(tunables).build(),
        };
        mapx.rebuild()?;
        Ok(mapx)
    }

    /// Adds a layer at `timestamp` (later than every layer's) holding `devices` and
    /// `pg_num` new PGs; returns its id. No existing PG moves.
    pub fn expand(
        &mut self,
        timestamp: u64,
        devices: Vec<Device>,
        pg_num: u32,
    ) -> Result<LayerId, CrushError> {
        if self.layers.len() > LayerId::MAX as usize {
            return Err(CrushError::new(
                "256 layers at most: merge or shrink layers first",
            ));
        }
        if let Some(last) = self.layers.iter().map(|l| l.timestamp).max() {
            if timestamp <= last {
                return Err(CrushError::new(format!(
                    "layer timestamp {timestamp} is not after {last}"
                )));
            }
        }
        // A layer without devices is allowed: the cluster map keeps one MAPX per device
        // class, and an expansion may bring only one class. Its PGs then take every
        // replica from older layers (Algorithm 1's backtracking).
        if pg_num == 0 {
            return Err(CrushError::new("a layer needs at least one PG"));
        }
        for device in &devices {
            if device.location.len() != self.levels.len() {
                return Err(CrushError::new(format!(
                    "device {} location {:?} does not name one bucket per level {:?}",
                    device.id, device.location, self.levels
                )));
            }
            if device.id < 0
                || self
                    .layers
                    .iter()
                    .flat_map(|l| &l.devices)
                    .any(|d| d.id == device.id)
            {
                return Err(CrushError::new(format!(
                    "device id {} is negative or already in use",
                    device.id
                )));
            }
        }
        let id = self.layers.len() as LayerId;
        let pg_base = self.pgs.len() as u32;
        let node = self.allocate_virtual_id();
        self.layers.push(Layer {
            timestamp,
            init_pg_num: pg_num,
            pg_base,
            devices,
            removed: false,
            node,
        });
        self.pgs.extend((0..pg_num).map(|_| id));
        self.rebuild()?;
        Ok(id)
    }

    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// One more than the largest device id: the length of a reweight vector.
    pub fn device_count(&self) -> usize {
        self.map.max_devices() as usize
    }

    pub fn pg_count(&self) -> u32 {
        self.pgs.len() as u32
    }

    /// The PGs created with `layer`.
    pub fn layer_pgs(&self, layer: LayerId) -> std::ops::Range<u32> {
        let l = &self.layers[layer as usize];
        l.pg_base..l.pg_base + l.init_pg_num
    }

    /// (timestamp, shrunk away) of `layer`.
    pub fn layer_state(&self, layer: LayerId) -> (u64, bool) {
        let l = &self.layers[layer as usize];
        (l.timestamp, l.removed)
    }

    /// The layer a chunk created at `timestamp` belongs to: the latest layer not
    /// newer than it (what the master records, one byte per chunk).
    pub fn layer_at(&self, timestamp: u64) -> Option<LayerId> {
        (0..self.layers.len())
            .rev()
            .find(|&i| self.layers[i].timestamp <= timestamp && !self.layers[i].removed)
            .map(|i| i as LayerId)
    }

    /// MAPX eq. 2: hash(chunk) mod INIT_PG_NUM[j] + sum of INIT_PG_NUM[i < j], for the
    /// chunk's creation layer j. Immutable: remaps, shrinks and merges never change it.
    pub fn pg_of_chunk(&self, chunk: ChunkId, creation_layer: LayerId) -> u32 {
        let layer = &self.layers[creation_layer as usize];
        layer.pg_base + chunk_hash(chunk) % layer.init_pg_num
    }

    /// The layer whose timestamp places `pg` now.
    pub fn pg_layer(&self, pg: u32) -> LayerId {
        self.pgs[pg as usize]
    }

    /// Devices of `pg`, primary first. `reweights` are CRUSH reweights per device id
    /// (0 = out).
    pub fn map_pg(&self, pg: u32, reweights: &[u32]) -> Vec<i32> {
        self.map_pg_n(pg, self.replicas, reweights)
    }

    /// [`Mapx::map_pg`] for `replicas` replicas instead of the map's own count.
    pub fn map_pg_n(&self, pg: u32, replicas: usize, reweights: &[u32]) -> Vec<i32> {
        let timestamp = self.layers[self.pgs[pg as usize] as usize].timestamp;
        let params = Params::new(&self.map);
        let mut mapper = Mapper::new(&self.map, pg as i32, reweights);
        let leaf = self.failure_domain_type != 0;
        let mut domains: Vec<Physical> = Vec::with_capacity(replicas);
        let mut leaves: Vec<i32> = Vec::with_capacity(replicas);
        // Algorithm 1: the newest layer not newer than the PG, then older ones for the
        // replicas it could not place, never a layer twice.
        for group in self
            .groups
            .iter()
            .filter(|g| g.timestamp <= timestamp && g.weight > 0)
        {
            if leaves.len() == replicas {
                break;
            }
            let outpos = leaves.len();
            let mut out: Vec<i32> = domains
                .iter()
                .map(|d| self.virtual_in(*d, group.representative))
                .collect();
            out.resize(replicas, 0);
            let mut out_leaves = leaves.clone();
            out_leaves.resize(replicas, 0);
            let node = self.layers[group.representative as usize].node;
            let filled = mapper.firstn_after(
                &params,
                node,
                replicas,
                self.failure_domain_type,
                leaf,
                &mut out,
                &mut out_leaves,
                outpos,
            );
            for i in outpos..filled {
                domains.push(match self.physical_of.get(&out[i]) {
                    Some(&bucket) => Physical::Bucket(bucket),
                    None => Physical::Device(out[i]),
                });
                leaves.push(if leaf { out_leaves[i] } else { out[i] });
            }
        }
        leaves
    }

    /// The id under which failure domain `domain` would appear in `layer`'s subtree;
    /// a device is itself everywhere, a bucket absent from the layer matches nothing.
    fn virtual_in(&self, domain: Physical, layer: LayerId) -> i32 {
        match domain {
            Physical::Device(id) => id,
            Physical::Bucket(bucket) => self
                .virtual_ids
                .get(&(bucket, layer))
                .copied()
                .unwrap_or(ITEM_NONE),
        }
    }

    /// Points `pg` at `layer`: only this PG moves.
    pub fn remap(&mut self, pg: u32, layer: LayerId) -> Result<(), CrushError> {
        let target = self
            .layers
            .get(layer as usize)
            .ok_or_else(|| CrushError::new(format!("no layer {layer}")))?;
        if target.removed {
            return Err(CrushError::new(format!("layer {layer} was shrunk away")));
        }
        let slot = self
            .pgs
            .get_mut(pg as usize)
            .ok_or_else(|| CrushError::new(format!("no PG {pg}")))?;
        *slot = layer;
        Ok(())
    }

    /// Removes `layer`'s devices, first moving its PGs to the other layers in
    /// proportion to their weights. The layer keeps its PG ids so that eq. 2 still
    /// holds; returns how many PGs moved.
    pub fn shrink(&mut self, layer: LayerId) -> Result<usize, CrushError> {
        let timestamp = self.live_layer(layer)?.timestamp;
        if self
            .layers
            .iter()
            .enumerate()
            .any(|(i, l)| i != layer as usize && !l.removed && l.timestamp == timestamp)
        {
            return Err(CrushError::new(format!(
                "layer {layer} is merged with another: shrinking merged layers is not supported"
            )));
        }
        let targets: Vec<(LayerId, u64)> = self
            .groups
            .iter()
            .filter(|g| g.timestamp != timestamp && g.weight > 0)
            .map(|g| (g.representative, g.weight))
            .collect();
        let total: u64 = targets.iter().map(|(_, w)| w).sum();
        if total == 0 {
            return Err(CrushError::new("no other layer to take the PGs"));
        }
        let moving: Vec<u32> = (0..self.pg_count())
            .filter(|pg| self.pg_layer(*pg) == layer)
            .collect();
        // Each PG goes to the target furthest behind its weighted share so far, which
        // keeps every prefix of the PGs proportional too.
        let mut assigned = vec![0u64; targets.len()];
        for (done, &pg) in moving.iter().enumerate() {
            let behind = |i: usize| {
                (done as u64 + 1) as f64 * targets[i].1 as f64 / total as f64 - assigned[i] as f64
            };
            let pick = (0..targets.len())
                .max_by(|a, b| behind(*a).total_cmp(&behind(*b)))
                .expect("targets exist");
            assigned[pick] += 1;
            self.pgs[pg as usize] = targets[pick].0;
        }
        self.layers[layer as usize].removed = true;
        self.rebuild()?;
        Ok(moving.len())
    }

    /// Merges layer `b` into layer `a` by giving the newer of the two the older's
    /// timestamp: their PGs are then spread over both layers' devices.
    pub fn merge(&mut self, a: LayerId, b: LayerId) -> Result<(), CrushError> {
        let (older, newer) = if a < b { (a, b) } else { (b, a) };
        if older == newer {
            return Err(CrushError::new("a layer cannot merge with itself"));
        }
        let timestamp = self.live_layer(older)?.timestamp;
        let newer_timestamp = self.live_layer(newer)?.timestamp;
        for l in &mut self.layers {
            if l.timestamp == newer_timestamp {
                l.timestamp = timestamp;
            }
        }
        self.rebuild()
    }

    fn live_layer(&self, layer: LayerId) -> Result<&Layer, CrushError> {
        match self.layers.get(layer as usize) {
            Some(l) if !l.removed => Ok(l),
            _ => Err(CrushError::new(format!("no live layer {layer}"))),
        }
    }

    fn allocate_virtual_id(&mut self) -> i32 {
        let id = self.next_virtual_id;
        self.next_virtual_id -= 1;
        id
    }

    /// The id of physical bucket `name` (at `level`) in the group led by
    /// `representative`, met through a device of `layer`: the id it got in the
    /// group's earliest layer holding it, the same one every time, so that subtrees,
    /// and the mappings in them, survive rebuilds and merges.
    fn virtual_id(
        &mut self,
        level: usize,
        name: &str,
        layer: LayerId,
        representative: LayerId,
    ) -> i32 {
        let next_physical = self.physical.len() as u32;
        let physical = *self
            .physical
            .entry((level, name.to_string()))
            .or_insert(next_physical);
        if let Some(&id) = self.in_group.get(&(physical, representative)) {
            return id;
        }
        let id = match self.virtual_ids.get(&(physical, layer)) {
            Some(&id) => id,
            None => {
                let id = self.allocate_virtual_id();
                self.virtual_ids.insert((physical, layer), id);
                id
            }
        };
        self.in_group.insert((physical, representative), id);
        self.physical_of.insert(id, physical);
        id
    }

    /// Recomputes the layer groups and the composite CRUSH map: root -> one node per
    /// group -> the group's copies of the physical buckets -> devices.
    fn rebuild(&mut self) -> Result<(), CrushError> {
        let mut by_timestamp: BTreeMap<u64, Group> = BTreeMap::new();
        for (i, layer) in self.layers.iter().enumerate().filter(|(_, l)| !l.removed) {
            let weight: u64 = layer.devices.iter().map(|d| d.weight as u64).sum();
            let group = by_timestamp.entry(layer.timestamp).or_insert(Group {
                timestamp: layer.timestamp,
                representative: i as LayerId,
                weight: 0,
            });
            group.weight += weight;
        }
        self.groups = by_timestamp.into_values().rev().collect();

        let mut builder = MapBuilder::new(self.tunables);
        builder.add_type(0, "osd");
        for (i, level) in self.levels.iter().rev().enumerate() {
            builder.add_type(i as i32 + 1, level);
        }
        let layer_type = self.levels.len() as i32 + 1;
        builder.add_type(layer_type, "layer");
        builder.add_type(layer_type + 1, "root");
        self.physical_of.clear();
        self.in_group.clear();
        let mut root_items = Vec::new();
        for group in self.groups.clone() {
            let node = self.layers[group.representative as usize].node;
            // Each virtual bucket's items in first-seen order, weights summed along
            // every device's path.
            let mut children: BTreeMap<i32, Vec<(i32, u32)>> = BTreeMap::new();
            let mut names: BTreeMap<i32, (i32, String)> = BTreeMap::new();
            names.insert(node, (layer_type, format!("layer{}", group.representative)));
            let layers: Vec<LayerId> = (0..self.layers.len())
                .filter(|&i| !self.layers[i].removed && self.layers[i].timestamp == group.timestamp)
                .map(|i| i as LayerId)
                .collect();
            for layer in layers {
                for device in self.layers[layer as usize].devices.clone() {
                    builder.add_device(device.id, &format!("osd.{}", device.id), None);
                    let mut path = vec![node];
                    for (level, name) in device.location.iter().enumerate() {
                        let id = self.virtual_id(level, name, layer, group.representative);
                        let type_id = (self.levels.len() - level) as i32;
                        names.insert(id, (type_id, format!("{name}@{id}")));
                        path.push(id);
                    }
                    path.push(device.id);
                    for pair in path.windows(2) {
                        let items = children.entry(pair[0]).or_default();
                        match items.iter_mut().find(|(item, _)| *item == pair[1]) {
                            Some(entry) => entry.1 += device.weight,
                            None => items.push((pair[1], device.weight)),
                        }
                    }
                }
            }
            for (id, items) in children {
                let (type_id, name) = names[&id].clone();
                builder.add_bucket(BucketSpec {
                    id,
                    name,
                    type_id,
                    items,
                })?;
            }
            if group.weight > 0 {
                root_items.push((node, group.weight.min(u32::MAX as u64) as u32));
            }
        }
        builder.add_bucket(BucketSpec {
            id: ROOT,
            name: "root".into(),
            type_id: layer_type + 1,
            items: root_items,
        })?;
        self.map = builder.build();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crush::WEIGHT_ONE;

    fn rack(first_id: i32, rack: &str, hosts: &[&str], per_host: i32) -> Vec<Device> {
        let mut out = Vec::new();
        for host in hosts {
            for _ in 0..per_host {
                out.push(Device {
                    id: first_id + out.len() as i32,
                    weight: WEIGHT_ONE,
                    location: vec![rack.to_string(), host.to_string()],
                });
            }
        }
        out
    }

    fn three_racks() -> Vec<Device> {
        let mut devices = rack(0, "r0", &["h0", "h1"], 2);
        devices.extend(rack(4, "r1", &["h2", "h3"], 2));
        devices.extend(rack(8, "r2", &["h4", "h5"], 2));
        devices
    }

    fn rack_of(mapx: &Mapx, device: i32) -> String {
        mapx.layers
            .iter()
            .flat_map(|l| &l.devices)
            .find(|d| d.id == device)
            .unwrap()
            .location[0]
            .clone()
    }

    #[test]
    fn chunks_map_to_their_creation_layer_pgs() {
        let mut mapx = Mapx::new(&["rack", "host"], "rack", 3, Tunables::jewel()).unwrap();
        mapx.expand(10, three_racks(), 64).unwrap();
        mapx.expand(20, rack(12, "r3", &["h6"], 2), 16).unwrap();
        assert_eq!(mapx.layer_at(15), Some(0));
        assert_eq!(mapx.layer_at(25), Some(1));
        assert_eq!(mapx.layer_at(5), None);
        for index in 0..200 {
            let chunk = ChunkId {
                volume_id: 7,
                index,
            };
            assert!(mapx.layer_pgs(0).contains(&mapx.pg_of_chunk(chunk, 0)));
            assert!(mapx.layer_pgs(1).contains(&mapx.pg_of_chunk(chunk, 1)));
        }
    }

    #[test]
    fn a_small_layer_borrows_failure_domains_from_older_layers() {
        let mut mapx = Mapx::new(&["rack", "host"], "rack", 3, Tunables::jewel()).unwrap();
        mapx.expand(1, three_racks(), 64).unwrap();
        // One new device in an existing rack: one failure domain, r0.
        mapx.expand(2, rack(100, "r0", &["h0"], 1), 32).unwrap();
        let reweights = vec![WEIGHT_ONE; mapx.device_count()];
        for pg in mapx.layer_pgs(1) {
            let devices = mapx.map_pg(pg, &reweights);
            assert_eq!(devices.len(), 3, "pg {pg}: {devices:?}");
            assert_eq!(devices[0], 100, "the new layer first");
            let mut racks: Vec<String> = devices.iter().map(|d| rack_of(&mapx, *d)).collect();
            racks.sort();
            racks.dedup();
            assert_eq!(
                racks.len(),
                3,
                "distinct physical racks across layers: {devices:?}"
            );
        }
    }

    #[test]
    fn shrink_spreads_pgs_by_weight_and_merge_joins_layers() {
        let mut mapx = Mapx::new(&["rack", "host"], "host", 2, Tunables::jewel()).unwrap();
        mapx.expand(1, three_racks(), 300).unwrap();
        mapx.expand(2, rack(12, "r3", &["h6", "h7"], 3), 90)
            .unwrap();
        mapx.expand(3, rack(18, "r4", &["h8", "h9"], 3), 90)
            .unwrap();
        assert_eq!(mapx.shrink(2).unwrap(), 90);
        // Layer 0 weighs 12 devices, layer 1 six: two thirds of the PGs go to layer 0.
        let to = |layer| {
            mapx.layer_pgs(2)
                .filter(|pg| mapx.pg_layer(*pg) == layer)
                .count()
        };
        assert_eq!((to(0), to(1)), (60, 30));
        let reweights = vec![WEIGHT_ONE; mapx.device_count()];
        assert!(mapx
            .layer_pgs(2)
            .all(|pg| mapx.map_pg(pg, &reweights).iter().all(|d| *d < 18)));
        assert!(mapx.remap(0, 2).is_err(), "a shrunk layer takes no PGs");

        let before: Vec<Vec<i32>> = (0..mapx.pg_count())
            .map(|pg| mapx.map_pg(pg, &reweights))
            .collect();
        mapx.merge(0, 1).unwrap();
        let after: Vec<Vec<i32>> = (0..mapx.pg_count())
            .map(|pg| mapx.map_pg(pg, &reweights))
            .collect();
        let layer1_devices_used = (0..mapx.pg_count())
            .filter(|pg| mapx.pg_layer(*pg) == 0)
            .any(|pg| after[pg as usize].iter().any(|d| (12..18).contains(d)));
        assert!(
            layer1_devices_used,
            "layer 0's PGs spread onto layer 1's devices"
        );
        assert!(before.iter().zip(&after).any(|(a, b)| a != b));
    }

    #[test]
    fn expansion_rejects_bad_input() {
        let mut mapx = Mapx::new(&["rack", "host"], "rack", 3, Tunables::jewel()).unwrap();
        mapx.expand(5, three_racks(), 8).unwrap();
        assert!(
            mapx.expand(5, rack(50, "r9", &["h9"], 1), 8).is_err(),
            "timestamps increase"
        );
        assert!(
            mapx.expand(6, rack(0, "r9", &["h9"], 1), 8).is_err(),
            "device ids are new"
        );
        assert!(
            mapx.expand(6, rack(50, "r9", &["h9"], 1), 0).is_err(),
            "a layer has PGs"
        );
        assert!(Mapx::new(&["rack", "host"], "row", 3, Tunables::jewel()).is_err());
    }
}
