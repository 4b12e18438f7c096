//! Properties of CRUSH and MAPX over generated maps.

use floe_placement::crush::{self, Tunables, ITEM_NONE, WEIGHT_ONE};
use floe_placement::mapx::{Device, Mapx};
use proptest::prelude::*;
use std::fmt::Write;

const JEWEL: &str = "tunable choose_local_tries 0\ntunable choose_local_fallback_tries 0\ntunable choose_total_tries 50\ntunable chooseleaf_descend_once 1\ntunable chooseleaf_vary_r 1\ntunable chooseleaf_stable 1\n";

/// Upper tail of chi-square with `df` degrees of freedom far beyond p = 0.001
/// (Wilson-Hilferty at z = 4.5), so that a correct straw2 essentially never fails.
fn chi_square_limit(df: f64) -> f64 {
    let z = 4.5;
    df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn straw2_picks_in_proportion_to_weight(weights in prop::collection::vec(1u32..=64, 2..12)) {
        let mut text = format!("{JEWEL}type 0 osd\ntype 1 root\n");
        for d in 0..weights.len() {
            writeln!(text, "device {d} osd.{d}").unwrap();
        }
        text.push_str("root r {\n id -1\n alg straw2\n hash 0\n");
        for (d, w) in weights.iter().enumerate() {
            writeln!(text, " item osd.{d} weight {:.3}", *w as f32 / 4.0).unwrap();
        }
        text.push_str("}\nrule one {\n id 0\n type replicated\n step take r\n step choose firstn 1 type osd\n step emit\n}\n");
        let map = crush::parse(&text).unwrap();
        let reweights = map.default_reweights();
        let inputs = 20_000u32;
        let mut counts = vec![0u32; weights.len()];
        for x in 0..inputs {
            counts[map.do_rule(0, x, 1, &reweights)[0] as usize] += 1;
        }
        let total: u32 = weights.iter().sum();
        let statistic: f64 = counts.iter().zip(&weights).map(|(&seen, &w)| {
            let expected = inputs as f64 * w as f64 / total as f64;
            (seen as f64 - expected).powi(2) / expected
        }).sum();
        let limit = chi_square_limit(weights.len() as f64 - 1.0);
        prop_assert!(statistic < limit, "chi-square {statistic:.1} >= {limit:.1}: counts {counts:?} for weights {weights:?}");
    }

    #[test]
    fn replicas_never_share_a_failure_domain(
        shape in prop::collection::vec(prop::collection::vec(prop::collection::vec(0u32..=8, 1..4), 1..4), 1..5),
        replicas in 1usize..7,
        by_rack in any::<bool>(),
        indep in any::<bool>(),
    ) {
        // shape[rack][host] = device weights (in quarters; 0 = weightless device).
        let mut text = String::from(JEWEL);
        let mut location = Vec::new();
        for (r, hosts) in shape.iter().enumerate() {
            for (h, devices) in hosts.iter().enumerate() {
                for _ in devices {
                    writeln!(text, "device {} osd.{}", location.len(), location.len()).unwrap();
                    location.push((r, (r, h)));
                }
            }
        }
        text.push_str("type 0 osd\ntype 1 host\ntype 2 rack\ntype 3 root\n");
        let mut device = 0;
        let mut id = -2;
        let mut racks = String::new();
        for (r, hosts) in shape.iter().enumerate() {
            let mut rack_items = String::new();
            for (h, devices) in hosts.iter().enumerate() {
                writeln!(text, "host h{r}_{h} {{\n id {id}\n alg straw2\n hash 0").unwrap();
                id -= 1;
                for w in devices {
                    writeln!(text, " item osd.{device} weight {:.2}", *w as f32 / 4.0).unwrap();
                    device += 1;
                }
                text.push_str("}\n");
                writeln!(rack_items, " item h{r}_{h}").unwrap();
            }
            writeln!(text, "rack r{r} {{\n id {id}\n alg straw2\n hash 0\n{rack_items}}}").unwrap();
            id -= 1;
            writeln!(racks, " item r{r}").unwrap();
        }
        let domain = if by_rack { "rack" } else { "host" };
        let mode = if indep { "indep" } else { "firstn" };
        writeln!(text, "root default {{\n id -1\n alg straw2\n hash 0\n{racks}}}\nrule r {{\n id 0\n type replicated\n step take default\n step chooseleaf {mode} 0 type {domain}\n step emit\n}}").unwrap();
        let map = crush::parse(&text).unwrap();
        let reweights = map.default_reweights();
        for x in 0..300 {
            let devices: Vec<i32> = map.do_rule(0, x, replicas, &reweights).into_iter().filter(|d| *d != ITEM_NONE).collect();
            let mut domains: Vec<(usize, usize)> = devices.iter().map(|d| {
                let (rack, host) = location[*d as usize];
                if by_rack { (rack, 0) } else { host }
            }).collect();
            domains.sort_unstable();
            let before = domains.len();
            domains.dedup();
            prop_assert_eq!(domains.len(), before, "x {}: {:?} share a {}", x, devices, domain);
        }
    }

    #[test]
    fn mapx_expansion_moves_no_existing_pg(
        expansions in prop::collection::vec((0u32..5, 0u32..4, 1u32..4, 1u32..=3), 1..5),
        failure_domain_is_rack in any::<bool>(),
    ) {
        let failure_domain = if failure_domain_is_rack { "rack" } else { "host" };
        let mut mapx = Mapx::new(&["rack", "host"], failure_domain, 3, Tunables::jewel()).unwrap();
        let mut next_device = 0;
        let mut devices = |rack: u32, host: u32, count: u32, weight: u32| -> Vec<Device> {
            (0..count).map(|_| {
                next_device += 1;
                Device { id: next_device - 1, weight: weight * WEIGHT_ONE / 2, location: vec![format!("r{rack}"), format!("h{rack}_{host}")] }
            }).collect()
        };
        let mut base = Vec::new();
        for rack in 0..3 {
            for host in 0..2 {
                base.extend(devices(rack, host, 2, 2));
            }
        }
        mapx.expand(0, base, 200).unwrap();
        for (i, (rack, host, count, weight)) in expansions.into_iter().enumerate() {
            let reweights = vec![WEIGHT_ONE; mapx.device_count() + count as usize];
            let before: Vec<Vec<i32>> = (0..mapx.pg_count()).map(|pg| mapx.map_pg(pg, &reweights)).collect();
            mapx.expand(1 + i as u64, devices(rack, host, count, weight), 50).unwrap();
            for (pg, old) in before.iter().enumerate() {
                prop_assert_eq!(&mapx.map_pg(pg as u32, &reweights), old, "pg {} moved", pg);
            }
        }
    }

    #[test]
    fn remapping_k_pgs_moves_exactly_those(picks in prop::collection::btree_set(0u32..300, 0..40), target_offset in 1u8..3) {
        let mut mapx = Mapx::new(&["rack", "host"], "host", 3, Tunables::jewel()).unwrap();
        let mut id = 0;
        for layer in 0..3u32 {
            let devices: Vec<Device> = (0..4).flat_map(|host| (0..2).map(move |_| (host, layer))).map(|(host, layer)| {
                id += 1;
                Device { id: id - 1, weight: WEIGHT_ONE, location: vec![format!("r{layer}"), format!("h{layer}_{host}")] }
            }).collect();
            mapx.expand(layer as u64, devices, 100).unwrap();
        }
        let reweights = vec![WEIGHT_ONE; mapx.device_count()];
        let before: Vec<Vec<i32>> = (0..mapx.pg_count()).map(|pg| mapx.map_pg(pg, &reweights)).collect();
        for &pg in &picks {
            let target = (mapx.pg_layer(pg) + target_offset) % 3;
            mapx.remap(pg, target).unwrap();
        }
        let changed: Vec<u32> = (0..mapx.pg_count()).filter(|pg| mapx.map_pg(*pg, &reweights) != before[*pg as usize]).collect();
        prop_assert_eq!(changed, picks.into_iter().collect::<Vec<u32>>());
    }
}
