//! The MAPX paper's placement experiments, run on our CRUSH and MAPX: how many PGs
//! move when the cluster grows (§2.2, Fig. 2) and when two layers merge (§4.4,
//! Fig. 8). A PG "moves" when its set of devices changes, i.e. data migrates.

use crate::crush::{
    BucketSpec, CrushError, CrushMap, MapBuilder, Mode, Rule, Step, Tunables, WEIGHT_ONE,
};
use crate::mapx::{Device, Mapx};
use std::collections::BTreeMap;

/// One expansion of the §2.2 cluster under both placements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expansion {
    pub added: &'static str,
    /// PGs placed before the expansion.
    pub pgs: u32,
    pub crush_moved: u32,
    pub mapx_moved: u32,
    /// PGs of MAPX's new layer (in proportion to the weight added).
    pub mapx_new_pgs: u32,
}

/// §4.4: four one-rack expansions, then the first two merged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merge {
    /// PGs of the two merged layers, and how many of them moved.
    pub merged_pgs: u32,
    pub merged_moved: u32,
    /// PGs of the other layers, and how many of them moved (MAPX promises none).
    pub other_pgs: u32,
    pub other_moved: u32,
    /// Plain CRUSH with all PGs from the start: (racks after, PGs moved) per expansion.
    pub crush_pgs: u32,
    pub crush_expansions: Vec<(u32, u32)>,
}

/// `racks` x `hosts` x `osds` devices of weight 1, numbered from `first_id`, in racks
/// named from `first_rack` and hosts from `first_host`.
fn devices(
    first_id: i32,
    first_rack: u32,
    racks: u32,
    first_host: u32,
    hosts: u32,
    osds: u32,
) -> Vec<Device> {
    let mut out = Vec::new();
    for rack in first_rack..first_rack + racks {
        for h in 0..hosts {
            let host = first_host + (rack - first_rack) * hosts + h;
            for _ in 0..osds {
                out.push(Device {
                    id: first_id + out.len() as i32,
                    weight: WEIGHT_ONE,
                    location: vec![format!("rack{rack}"), format!("host{host}")],
                });
            }
        }
    }
    out
}

/// The plain CRUSH map of `devices`: root -> racks -> hosts -> devices, and rule 0
/// `chooseleaf firstn 0 type <failure_domain>`.
pub(crate) fn crush_map(devices: &[Device], failure_domain: &str) -> Result<CrushMap, CrushError> {
    let mut builder = MapBuilder::new(Tunables::jewel());
    for (id, name) in ["osd", "host", "rack", "root"].iter().enumerate() {
        builder.add_type(id as i32, name);
    }
    // Buckets by name, ids handed out in first-seen order below the root.
    let mut buckets: BTreeMap<String, BucketSpec> = BTreeMap::new();
    let mut next_id = -2;
    for device in devices {
        builder.add_device(device.id, &format!("osd.{}", device.id), None);
        let mut child = device.id;
        for (depth, name) in device.location.iter().enumerate().rev() {
            let bucket = buckets.entry(name.clone()).or_insert_with(|| {
                next_id -= 1;
                BucketSpec {
                    id: next_id + 1,
                    name: name.clone(),
                    type_id: 2 - depth as i32,
                    items: Vec::new(),
                }
            });
            match bucket.items.iter_mut().find(|(item, _)| *item == child) {
                Some(item) => item.1 += device.weight,
                None => bucket.items.push((child, device.weight)),
            }
            child = bucket.id;
        }
    }
    let mut root: Vec<(i32, u32)> = buckets
        .values()
        .filter(|b| b.type_id == 2)
        .map(|b| (b.id, b.items.iter().map(|(_, w)| w).sum()))
        .collect();
    // Racks in the order they were first seen.
    root.sort_unstable_by_key(|(id, _)| std::cmp::Reverse(*id));
    for bucket in buckets.into_values() {
        builder.add_bucket(bucket)?;
    }
    builder.add_bucket(BucketSpec {
        id: -1,
        name: "default".into(),
        type_id: 3,
        items: root,
    })?;
    let type_id = builder
        .type_id(failure_domain)
        .ok_or_else(|| CrushError::new(format!("no type {failure_domain}")))?;
    builder.add_rule(Rule {
        id: 0,
        name: "replicated".into(),
        steps: vec![
            Step::Take(-1),
            Step::Choose {
                leaf: type_id != 0,
                mode: Mode::Firstn,
                count: 0,
                type_id,
            },
            Step::Emit,
        ],
    })?;
    Ok(builder.build())
}

fn sorted(mut devices: Vec<i32>) -> Vec<i32> {
    devices.sort_unstable();
    devices
}

fn crush_mappings(map: &CrushMap, pgs: u32, replicas: usize) -> Vec<Vec<i32>> {
    let reweights = map.default_reweights();
    (0..pgs)
        .map(|pg| sorted(map.do_rule(0, pg, replicas, &reweights)))
        .collect()
}

fn mapx_mappings(mapx: &Mapx, pgs: std::ops::Range<u32>) -> Vec<Vec<i32>> {
    let reweights = vec![WEIGHT_ONE; mapx.device_count()];
    pgs.map(|pg| sorted(mapx.map_pg(pg, &reweights))).collect()
}

fn moved(before: &[Vec<i32>], after: &[Vec<i32>]) -> u32 {
    before.iter().zip(after).filter(|(a, b)| a != b).count() as u32
}

/// §2.2: 3 racks x 8 hosts x 10 devices, `pgs` PGs, 3 replicas in distinct racks;
/// adding one device, one host, one rack.
pub fn expansions(pgs: u32) -> Result<Vec<Expansion>, CrushError> {
    const REPLICAS: usize = 3;
    let base = devices(0, 0, 3, 0, 8, 10);
    let next = base.len() as i32;
    let one_osd = vec![Device {
        id: next,
        weight: WEIGHT_ONE,
        location: vec!["rack0".into(), "host0".into()],
    }];
    let cases = [
        ("1 OSD", one_osd),
        ("1 host", devices(next, 0, 1, 24, 1, 10)),
        ("1 rack", devices(next, 3, 1, 24, 8, 10)),
    ];
    let before = crush_mappings(&crush_map(&base, "rack")?, pgs, REPLICAS);
    let mut rows = Vec::new();
    for (added, new_devices) in cases {
        let grown: Vec<Device> = base.iter().chain(&new_devices).cloned().collect();
        let after = crush_mappings(&crush_map(&grown, "rack")?, pgs, REPLICAS);

        let mut mapx = Mapx::new(&["rack", "host"], "rack", REPLICAS, Tunables::jewel())?;
        mapx.expand(0, base.clone(), pgs)?;
        let mapx_before = mapx_mappings(&mapx, 0..pgs);
        let new_pgs = ((pgs as u64 * new_devices.len() as u64) / base.len() as u64).max(1) as u32;
        mapx.expand(1, new_devices, new_pgs)?;
        let mapx_after = mapx_mappings(&mapx, 0..pgs);
        rows.push(Expansion {
            added,
            pgs,
            crush_moved: moved(&before, &after),
            mapx_moved: moved(&mapx_before, &mapx_after),
            mapx_new_pgs: new_pgs,
        });
    }
    Ok(rows)
}

/// §4.4 at `scale` (1.0 = the paper's 200,000 + 4 x 40,000 PGs): 5 racks x 20 hosts
/// x 20 devices, four expansions of one such rack, 3 replicas in distinct hosts; the
/// layers of the first two expansions merged.
pub fn merge(scale: f64) -> Result<Merge, CrushError> {
    const REPLICAS: usize = 3;
    let scaled = |pgs: f64| ((pgs * scale).round() as u32).max(1);
    let (base_pgs, layer_pgs) = (scaled(200_000.0), scaled(40_000.0));
    let base = devices(0, 0, 5, 0, 20, 20);
    let expansion = |i: u32| devices(8000 + 400 * i as i32, 5 + i, 1, 100 + 20 * i, 20, 20);

    let mut mapx = Mapx::new(&["rack", "host"], "host", REPLICAS, Tunables::jewel())?;
    mapx.expand(0, base.clone(), base_pgs)?;
    for i in 0..4 {
        mapx.expand(1 + i as u64, expansion(i), layer_pgs)?;
    }
    let all = 0..mapx.pg_count();
    let merged = mapx.layer_pgs(1).start..mapx.layer_pgs(2).end;
    let before = mapx_mappings(&mapx, all.clone());
    mapx.merge(1, 2)?;
    let after = mapx_mappings(&mapx, all.clone());
    let in_merged = |pg: &u32| merged.contains(pg);
    let moved_where = |wanted: bool| {
        all.clone()
            .filter(|pg| in_merged(pg) == wanted)
            .filter(|pg| before[*pg as usize] != after[*pg as usize])
            .count() as u32
    };

    let crush_pgs = mapx.pg_count();
    let mut grown = base;
    let mut previous = crush_mappings(&crush_map(&grown, "host")?, crush_pgs, REPLICAS);
    let mut crush_expansions = Vec::new();
    for i in 0..4 {
        grown.extend(expansion(i));
        let next = crush_mappings(&crush_map(&grown, "host")?, crush_pgs, REPLICAS);
        crush_expansions.push((6 + i, moved(&previous, &next)));
        previous = next;
    }
    Ok(Merge {
        merged_pgs: merged.len() as u32,
        merged_moved: moved_where(true),
        other_pgs: crush_pgs - merged.len() as u32,
        other_moved: moved_where(false),
        crush_pgs,
        crush_expansions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapx_moves_nothing_on_expansion_and_only_merged_pgs_on_merge() {
        for row in expansions(1200).unwrap() {
            assert_eq!(row.mapx_moved, 0, "{row:?}");
            assert!(row.crush_moved > 0, "{row:?}");
        }
        let merge = merge(0.01).unwrap();
        assert_eq!(merge.other_moved, 0, "{merge:?}");
        assert!(merge.merged_moved * 2 > merge.merged_pgs, "{merge:?}");
        assert!(
            merge.crush_expansions.iter().all(|(_, moved)| *moved > 0),
            "{merge:?}"
        );
    }
}
