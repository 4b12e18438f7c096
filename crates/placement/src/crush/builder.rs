//! Assembles a [`CrushMap`] the way `crushtool -c` does, including the device-class
//! shadow trees and the ids crushtool gives them.

use super::{Bucket, CrushError, CrushMap, Rule, Step, Tunables, WEIGHT_ONE};
use std::collections::{BTreeMap, BTreeSet};

/// Ceph's limits on item weights, which keep bucket sums from overflowing.
const DEVICE_WEIGHT_MAX: u32 = 100 * WEIGHT_ONE;
const BUCKET_WEIGHT_MAX: u32 = 65535 * WEIGHT_ONE;

/// A bucket to add: straw2, rjenkins1, items with their 16.16 weights.
#[derive(Debug, Clone)]
pub struct BucketSpec {
    pub id: i32,
    pub name: String,
    pub type_id: i32,
    pub items: Vec<(i32, u32)>,
}

#[derive(Debug, Default)]
pub struct MapBuilder {
    tunables: Tunables,
    types: BTreeMap<i32, String>,
    devices: BTreeMap<i32, String>,
    /// Device id -> class id; class ids are indexes into `classes`, in order of first
    /// mention as crushtool numbers them.
    device_class: BTreeMap<i32, usize>,
    classes: Vec<String>,
    buckets: Vec<Option<Bucket>>,
    /// Bucket id -> class id -> shadow bucket id: the `id -N class C` lines first, then
    /// every shadow bucket built.
    class_buckets: BTreeMap<i32, BTreeMap<usize, i32>>,
    shadows_built: bool,
    rules: BTreeMap<u32, Rule>,
}

impl MapBuilder {
    pub fn new(tunables: Tunables) -> Self {
        MapBuilder {
            tunables,
            ..Default::default()
        }
    }

    pub fn tunables_mut(&mut self) -> &mut Tunables {
        &mut self.tunables
    }

    pub fn add_type(&mut self, id: i32, name: &str) {
        self.types.insert(id, name.to_string());
    }

    pub fn type_id(&self, name: &str) -> Option<i32> {
        self.types
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(id, _)| *id)
    }

    pub fn class_id(&mut self, name: &str) -> usize {
        match self.classes.iter().position(|c| c == name) {
            Some(id) => id,
            None => {
                self.classes.push(name.to_string());
                self.classes.len() - 1
            }
        }
    }

    pub fn add_device(&mut self, id: i32, name: &str, class: Option<&str>) {
        self.devices.insert(id, name.to_string());
        if let Some(class) = class {
            let class = self.class_id(class);
            self.device_class.insert(id, class);
        }
    }

    pub fn bucket(&self, id: i32) -> Option<&Bucket> {
        self.buckets.get((-1 - id) as usize)?.as_ref()
    }

    pub fn add_bucket(&mut self, spec: BucketSpec) -> Result<(), CrushError> {
        if spec.id >= 0 {
            return Err(CrushError::new(format!(
                "bucket {} has id {}: bucket ids are negative",
                spec.name, spec.id
            )));
        }
        if self.bucket(spec.id).is_some() {
            return Err(CrushError::new(format!("duplicate bucket id {}", spec.id)));
        }
        let mut sum: u32 = 0;
        for &(item, weight) in &spec.items {
            let limit = if item >= 0 {
                DEVICE_WEIGHT_MAX
            } else {
                BUCKET_WEIGHT_MAX
            };
            if weight > limit {
                return Err(CrushError::new(format!(
                    "item {item} in bucket {}: weight {} is over the limit {}",
                    spec.name,
                    weight as f64 / WEIGHT_ONE as f64,
                    limit / WEIGHT_ONE
                )));
            }
            sum = sum.checked_add(weight).ok_or_else(|| {
                CrushError::new(format!("bucket {}: the weights overflow", spec.name))
            })?;
        }
        self.insert(Bucket {
            id: spec.id,
            type_id: spec.type_id,
            name: spec.name,
            items: spec.items.iter().map(|(item, _)| *item).collect(),
            weights: spec.items.iter().map(|(_, weight)| *weight).collect(),
        });
        Ok(())
    }

    fn insert(&mut self, bucket: Bucket) {
        let index = (-1 - bucket.id) as usize;
        if self.buckets.len() <= index {
            self.buckets.resize(index + 1, None);
        }
        self.buckets[index] = Some(bucket);
    }

    /// An `id -N class C` line: the shadow of `bucket` for class `class` gets id `shadow`.
    pub fn reserve_shadow_id(
        &mut self,
        bucket: i32,
        class: &str,
        shadow: i32,
    ) -> Result<(), CrushError> {
        let class = self.class_id(class);
        let previous = self
            .class_buckets
            .entry(bucket)
            .or_default()
            .insert(class, shadow);
        match previous {
            Some(_) => Err(CrushError::new(format!(
                "bucket {bucket} has two ids for class {}",
                self.classes[class]
            ))),
            None => Ok(()),
        }
    }

    /// The shadow bucket standing for `bucket` restricted to devices of `class` (what
    /// `step take B class C` takes).
    pub fn shadow_of(&mut self, bucket: i32, class: &str) -> Result<i32, CrushError> {
        self.build_shadow_trees();
        let class_id = self
            .classes
            .iter()
            .position(|c| c == class)
            .ok_or_else(|| CrushError::new(format!("device class {class} does not exist")))?;
        self.class_buckets
            .get(&bucket)
            .and_then(|shadows| shadows.get(&class_id))
            .copied()
            .ok_or_else(|| {
                CrushError::new(format!("bucket {bucket} has no shadow for class {class}"))
            })
    }

    /// crushtool's `populate_classes`, run once before the first rule: every root
    /// (ascending id), for every class (class id order), is cloned depth first.
    fn build_shadow_trees(&mut self) {
        if self.shadows_built {
            return;
        }
        self.shadows_built = true;
        let reserved: BTreeSet<i32> = self
            .class_buckets
            .values()
            .flat_map(|m| m.values().copied())
            .collect();
        let children: BTreeSet<i32> = self
            .buckets
            .iter()
            .flatten()
            .flat_map(|b| b.items.iter().copied())
            .collect();
        let roots: Vec<i32> = self
            .buckets
            .iter()
            .flatten()
            .map(|b| b.id)
            .filter(|id| !children.contains(id))
            .collect();
        let mut roots = roots;
        roots.sort_unstable();
        for root in roots {
            for class in 0..self.classes.len() {
                self.clone_for_class(root, class, &reserved);
            }
        }
    }

    /// `device_class_clone`: the copy of `original` holding only devices of `class`,
    /// children cloned first so that ids are handed out bottom-up as Ceph does.
    fn clone_for_class(&mut self, original: i32, class: usize, reserved: &BTreeSet<i32>) -> i32 {
        let source = self.bucket(original).expect("cloned bucket exists").clone();
        let name = format!("{}~{}", source.name, self.classes[class]);
        if let Some(existing) = self.buckets.iter().flatten().find(|b| b.name == name) {
            return existing.id;
        }
        let mut items = Vec::new();
        let mut weights = Vec::new();
        for (&item, &weight) in source.items.iter().zip(&source.weights) {
            if item >= 0 {
                if self.device_class.get(&item) == Some(&class) {
                    items.push(item);
                    weights.push(weight);
                }
            } else {
                let copy = self.clone_for_class(item, class, reserved);
                items.push(copy);
                weights.push(self.bucket(copy).expect("clone exists").weight());
            }
        }
        let id = match self
            .class_buckets
            .get(&original)
            .and_then(|m| m.get(&class))
        {
            Some(&id) => id,
            None => {
                // The first id neither taken by a bucket nor reserved by a class line.
                let mut id = -1;
                while self.bucket(id).is_some() || reserved.contains(&id) {
                    id -= 1;
                }
                id
            }
        };
        self.insert(Bucket {
            id,
            type_id: source.type_id,
            name,
            items,
            weights,
        });
        self.class_buckets
            .entry(original)
            .or_default()
            .insert(class, id);
        id
    }

    pub fn add_rule(&mut self, rule: Rule) -> Result<(), CrushError> {
        for step in &rule.steps {
            if let Step::Take(item) = step {
                if *item < 0 && self.bucket(*item).is_none() {
                    return Err(CrushError::new(format!(
                        "rule {} takes missing bucket {item}",
                        rule.name
                    )));
                }
            }
        }
        if self.rules.contains_key(&rule.id) {
            return Err(CrushError::new(format!("rule {} already exists", rule.id)));
        }
        self.rules.insert(rule.id, rule);
        Ok(())
    }

    pub fn build(self) -> CrushMap {
        let placed = self
            .buckets
            .iter()
            .flatten()
            .flat_map(|b| b.items.iter().copied());
        let named = self.devices.keys().copied();
        let max_devices = placed
            .chain(named)
            .filter(|i| *i >= 0)
            .max()
            .map_or(0, |m| m + 1);
        CrushMap {
            tunables: self.tunables,
            buckets: self.buckets,
            rules: self.rules,
            types: self.types,
            max_devices,
        }
    }
}
