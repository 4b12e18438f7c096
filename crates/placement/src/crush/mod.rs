//! Ceph CRUSH, bit-exact with `crushtool --test`: rjenkins1 hashing, straw2 buckets with
//! Ceph's integer logarithm, typed bucket hierarchies, rules (take, choose and
//! chooseleaf in firstn and indep modes, emit, the set_* steps), tunables, device
//! classes through shadow trees, and crushtool's text map syntax.
//!
//! - `hash`, `ln`: the two primitives every draw goes through.
//! - `mapper`: `crush_do_rule` and the choose loops, the same control flow as Ceph's
//!   `mapper.c` so that retries and collisions happen exactly where Ceph's do.
//! - `builder`: assembles a [`CrushMap`] the way `crushtool -c` does (bucket ids,
//!   weights, class shadow trees and their ids).
//! - `text`: the parser for what `crushtool -d` prints.

mod builder;
pub(crate) mod hash;
mod ln;
pub(crate) mod mapper;
mod text;

pub use builder::{BucketSpec, MapBuilder};
pub use text::parse;

use std::collections::BTreeMap;

/// `CRUSH_ITEM_NONE`: an indep position left empty ("hole"); crushtool prints it as
/// 2147483647.
pub const ITEM_NONE: i32 = 0x7fff_ffff;
/// `CRUSH_ITEM_UNDEF`: an indep position not decided yet.
const ITEM_UNDEF: i32 = 0x7fff_fffe;
/// 1.0 in CRUSH's 16.16 fixed point (weights and reweights).
pub const WEIGHT_ONE: u32 = 0x10000;

/// A reweight as `crushtool --weight DEV W` reads it: truncated to 16.16 and clamped to
/// [0, 1].
pub fn reweight_from_f32(weight: f32) -> u32 {
    ((weight * WEIGHT_ONE as f32) as i32).clamp(0, WEIGHT_ONE as i32) as u32
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct CrushError {
    pub message: String,
}

impl CrushError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        CrushError {
            message: message.into(),
        }
    }
}

/// Tunables; `Default` is what `crushtool -c` starts from (the legacy "argonaut"
/// values) before the map's `tunable` lines apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tunables {
    pub choose_local_tries: u32,
    pub choose_local_fallback_tries: u32,
    pub choose_total_tries: u32,
    pub chooseleaf_descend_once: u32,
    pub chooseleaf_vary_r: u32,
    pub chooseleaf_stable: u32,
    pub straw_calc_version: u32,
    pub allowed_bucket_algs: u32,
}

impl Default for Tunables {
    fn default() -> Self {
        Tunables {
            choose_local_tries: 2,
            choose_local_fallback_tries: 5,
            choose_total_tries: 19,
            chooseleaf_descend_once: 0,
            chooseleaf_vary_r: 0,
            chooseleaf_stable: 0,
            straw_calc_version: 0,
            // uniform | list | straw
            allowed_bucket_algs: 22,
        }
    }
}

impl Tunables {
    /// Ceph's "jewel" profile, also "optimal" since then.
    pub fn jewel() -> Self {
        Tunables {
            choose_local_tries: 0,
            choose_local_fallback_tries: 0,
            choose_total_tries: 50,
            chooseleaf_descend_once: 1,
            chooseleaf_vary_r: 1,
            chooseleaf_stable: 1,
            straw_calc_version: 1,
            // uniform | list | straw | straw2
            allowed_bucket_algs: 54,
        }
    }
}

/// A straw2 bucket: its items are devices (ids >= 0) or buckets (ids < 0), each with a
/// 16.16 weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub id: i32,
    pub type_id: i32,
    pub name: String,
    pub items: Vec<i32>,
    pub weights: Vec<u32>,
}

impl Bucket {
    pub fn weight(&self) -> u32 {
        self.weights
            .iter()
            .fold(0u32, |sum, w| sum.wrapping_add(*w))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Firstn,
    Indep,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Take(i32),
    /// `choose` (leaf false) or `chooseleaf` (leaf true) `count` items of `type_id`;
    /// a count <= 0 means "the replica count plus count".
    Choose {
        leaf: bool,
        mode: Mode,
        count: i32,
        type_id: i32,
    },
    Emit,
    SetChooseTries(i32),
    SetChooseleafTries(i32),
    SetChooseLocalTries(i32),
    SetChooseLocalFallbackTries(i32),
    SetChooseleafVaryR(i32),
    SetChooseleafStable(i32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub id: u32,
    pub name: String,
    pub steps: Vec<Step>,
}

/// A compiled map: what `crushtool -c` produces, shadow buckets included.
#[derive(Debug, Clone)]
pub struct CrushMap {
    pub tunables: Tunables,
    /// Indexed by `-1 - id`.
    buckets: Vec<Option<Bucket>>,
    rules: BTreeMap<u32, Rule>,
    types: BTreeMap<i32, String>,
    /// One more than the largest device id named or placed in a bucket.
    max_devices: i32,
}

impl CrushMap {
    pub fn bucket(&self, id: i32) -> Option<&Bucket> {
        if id >= 0 {
            return None;
        }
        self.buckets.get((-1 - id) as usize)?.as_ref()
    }

    pub fn bucket_id(&self, name: &str) -> Option<i32> {
        self.buckets
            .iter()
            .flatten()
            .find(|b| b.name == name)
            .map(|b| b.id)
    }

    pub fn rule_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.rules.keys().copied()
    }

    pub fn rule(&self, id: u32) -> Option<&Rule> {
        self.rules.get(&id)
    }

    pub fn type_id(&self, name: &str) -> Option<i32> {
        self.types
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(id, _)| *id)
    }

    pub fn max_devices(&self) -> i32 {
        self.max_devices
    }

    /// The reweight vector `crushtool --test` starts from: 1.0 for every device placed
    /// in some bucket, 0 ("out") for the others.
    pub fn default_reweights(&self) -> Vec<u32> {
        let mut weights = vec![0; self.max_devices as usize];
        for bucket in self.buckets.iter().flatten() {
            for &item in bucket.items.iter().filter(|i| **i >= 0) {
                weights[item as usize] = WEIGHT_ONE;
            }
        }
        weights
    }

    /// The lines `crushtool --test --show-mappings` prints for `rule`, `num_rep`
    /// replicas and inputs `xs`: `CRUSH rule 0 x 12 [3,7,1]`, indep holes as
    /// 2147483647. Like crushtool, nothing when no device has weight.
    pub fn show_mappings(
        &self,
        rule: u32,
        num_rep: usize,
        xs: std::ops::RangeInclusive<u32>,
        reweights: &[u32],
    ) -> impl Iterator<Item = String> + '_ {
        let reweights = reweights.to_vec();
        let any_weight = reweights.iter().any(|w| *w > 0) && self.rules.contains_key(&rule);
        xs.filter(move |_| any_weight).map(move |x| {
            let items: Vec<String> = self
                .do_rule(rule, x, num_rep, &reweights)
                .iter()
                .map(|i| i.to_string())
                .collect();
            format!("CRUSH rule {rule} x {x} [{}]", items.join(","))
        })
    }

    /// `crush_do_rule`: up to `result_max` items for input `x`. `reweights` holds a
    /// 16.16 reweight per device (below 1.0 a device is rejected for that share of
    /// inputs; 0 is "out").
    pub fn do_rule(&self, rule: u32, x: u32, result_max: usize, reweights: &[u32]) -> Vec<i32> {
        match self.rules.get(&rule) {
            Some(rule) => mapper::do_rule(self, rule, x as i32, result_max, reweights),
            None => Vec::new(),
        }
    }
}
