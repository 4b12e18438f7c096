//! The version and view rules of one chunk replica (URSA section 4.2.1), kept free of
//! I/O so they can be checked against a model.
//!
//! A replica applies a chunk's changes in version order: a change names the version
//! it applies on top of (`prev`). The rules, in order:
//! - a change from an older lease generation than one seen is refused (fencing);
//! - a change from another view is refused: an older view means the writer must
//!   refresh its map, a newer one means this replica missed a view change;
//! - a change already executed (its version is not above the last one) is skipped
//!   but acknowledged once durable, so a writer may resend after any failure;
//! - a change on top of the last one is applied;
//! - a change on top of a version not yet here waits for the gap to fill;
//! - anything else means this replica's history diverged from the writer's (an old
//!   writer's unacknowledged change): it must be repaired.

use floe_protocol::{generation_of, Stamp, Status};
use std::collections::VecDeque;

/// Recent changes remembered per chunk for incremental repair ("journal lite").
pub const LOG_ENTRIES_MAX: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogEntry {
    pub prev: u64,
    pub version: u64,
    pub offset: u64,
    pub length: u64,
    /// The writer's snapshot epoch.
    pub epoch: u32,
}

#[derive(Debug, Default)]
pub struct Replica {
    pub view: u64,
    /// Version of the last change handed to the store, in order.
    pub submitted: u64,
    /// Version of the last change durable (and readable) in the store.
    pub durable: u64,
    /// Set while a repair rewrites the replica, and after a failed change until a
    /// repair: the replica then takes no changes.
    pub frozen: Option<&'static str>,
    pub log: VecDeque<LogEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    Apply,
    /// Already executed; acknowledge once `durable` reaches the change's version.
    Executed,
    /// Early arrival: wait for the changes before it.
    Wait,
    Refuse(Status, String),
}

impl Replica {
    pub fn new(view: u64, version: u64) -> Replica {
        Replica {
            view,
            submitted: version,
            durable: version,
            ..Replica::default()
        }
    }

    /// What to do with a change stamped `stamp`, given the newest lease generation
    /// this server has seen for the volume.
    pub fn admit(&self, stamp: &Stamp, volume_generation: u32) -> Admit {
        let generation = generation_of(stamp.version);
        let newest = volume_generation.max(generation_of(self.submitted));
        if generation < newest {
            return Admit::Refuse(
                Status::Fenced,
                format!("lease generation {generation} was superseded by generation {newest}"),
            );
        }
        if stamp.version <= stamp.prev {
            return Admit::Refuse(
                Status::BadRequest,
                format!(
                    "version {:#x} does not follow {:#x}",
                    stamp.version, stamp.prev
                ),
            );
        }
        if let Some(why) = self.frozen {
            return Admit::Refuse(Status::Behind, format!("replica is {why}"));
        }
        if stamp.view != self.view {
            let status = if stamp.view < self.view {
                Status::StaleView
            } else {
                Status::Behind
            };
            return Admit::Refuse(
                status,
                format!(
                    "replica is at view {}, the change at view {}",
                    self.view, stamp.view
                ),
            );
        }
        if stamp.version <= self.submitted {
            Admit::Executed
        } else if stamp.prev == self.submitted {
            Admit::Apply
        } else if stamp.prev > self.submitted {
            Admit::Wait
        } else {
            Admit::Refuse(
                Status::Behind,
                format!(
                    "replica history diverged: it holds version {:#x}, the change follows {:#x}",
                    self.submitted, stamp.prev
                ),
            )
        }
    }

    /// Why an admitted change stamped with snapshot `epoch` may not follow the
    /// remembered ones: a volume's epochs only go up (a new writer gets the master's
    /// current one), so an older epoch after a newer one is a writer's bug, which
    /// would give snapshots blocks written after them.
    pub fn epoch_went_back(&self, epoch: u32) -> Option<String> {
        let last = self.log.back()?.epoch;
        (epoch < last).then(|| {
            format!("snapshot epoch {epoch} follows a change at epoch {last}: epochs never go back")
        })
    }

    /// Records an admitted change as handed to the store.
    pub fn submit(&mut self, stamp: &Stamp, offset: u64, length: u64, epoch: u32) {
        self.submitted = stamp.version;
        if self.log.len() == LOG_ENTRIES_MAX {
            self.log.pop_front();
        }
        self.log.push_back(LogEntry {
            prev: stamp.prev,
            version: stamp.version,
            offset,
            length,
            epoch,
        });
    }

    /// Changes handed to the store are not all durable yet.
    pub fn pending(&self) -> bool {
        self.submitted > self.durable
    }

    /// The ranges changed after `since` up to the durable version, merged, or `None`
    /// when the log does not reach back to `since` (or `since` is not in this
    /// replica's history).
    pub fn changes_since(&self, since: u64) -> Option<(u64, Vec<(u64, u64)>)> {
        if since == self.durable {
            return Some((self.durable, Vec::new()));
        }
        if since > self.durable {
            return None;
        }
        let start = self.log.iter().position(|e| e.prev == since)?;
        let mut ranges: Vec<(u64, u64)> = self
            .log
            .iter()
            .skip(start)
            .take_while(|e| e.version <= self.durable)
            .map(|e| (e.offset, e.length))
            .collect();
        Some((self.durable, merge(&mut ranges, 0)))
    }
}

/// Sorts (offset, length) ranges and coalesces those that overlap or lie at most
/// `gap` bytes apart (the gap then joins the range).
pub fn merge(ranges: &mut [(u64, u64)], gap: u64) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(offset, length) in ranges.iter() {
        match out.last_mut() {
            Some((o, l)) if (*o + *l).saturating_add(gap) >= offset => {
                *l = (*l).max(offset.saturating_add(length) - *o)
            }
            _ => out.push((offset, length)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_protocol::next_version;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// The model: a replica holds a prefix of the writer's history, the versions it
    /// applied in order.
    #[derive(Default)]
    struct Model {
        applied: Vec<u64>,
    }

    fn stamp(view: u64, prev: u64, version: u64) -> Stamp {
        Stamp {
            view,
            prev,
            version,
        }
    }

    #[test]
    fn the_rules_in_order() {
        let g1 = 1u64 << 32;
        let r = Replica::new(2, g1 | 5);
        assert_eq!(r.admit(&stamp(2, g1 | 5, g1 | 6), 1), Admit::Apply);
        assert_eq!(r.admit(&stamp(2, g1 | 4, g1 | 5), 1), Admit::Executed);
        assert_eq!(r.admit(&stamp(2, g1 | 6, g1 | 7), 1), Admit::Wait);
        assert!(matches!(
            r.admit(&stamp(1, g1 | 5, g1 | 6), 1),
            Admit::Refuse(Status::StaleView, _)
        ));
        assert!(matches!(
            r.admit(&stamp(3, g1 | 5, g1 | 6), 1),
            Admit::Refuse(Status::Behind, _)
        ));
        assert!(
            matches!(
                r.admit(&stamp(2, g1 | 5, g1 | 6), 2),
                Admit::Refuse(Status::Fenced, _)
            ),
            "a newer generation was seen"
        );
        // A new writer continues from version 4 (it never saw 5): this replica's 5 is
        // an old writer's unacknowledged change.
        let g2 = 2u64 << 32;
        assert!(matches!(
            r.admit(&stamp(2, g1 | 4, g2 | 1), 2),
            Admit::Refuse(Status::Behind, _)
        ));
        assert_eq!(r.admit(&stamp(2, g1 | 5, g2 | 1), 2), Admit::Apply);
    }

    #[test]
    fn journal_lite_answers_what_changed() {
        let mut r = Replica::new(1, 0);
        let mut prev = 0;
        for (i, offset) in [0u64, 4096, 0, 65536].into_iter().enumerate() {
            let version = next_version(prev, 1);
            let s = stamp(1, prev, version);
            assert_eq!(r.admit(&s, 1), Admit::Apply, "change {i}");
            r.submit(&s, offset, 4096, 0);
            prev = version;
        }
        r.durable = prev;
        let first = next_version(0, 1);
        assert_eq!(
            r.changes_since(first),
            Some((prev, vec![(0, 8192), (65536, 4096)]))
        );
        assert_eq!(r.changes_since(prev), Some((prev, vec![])));
        assert_eq!(r.changes_since(0).map(|c| c.1.len()), Some(2));
        assert_eq!(r.changes_since(12345), None, "not in this history");
    }

    proptest! {
        /// Deliver a writer's changes to a replica in any order, with duplicates:
        /// the replica applies exactly the writer's history, in order, and never
        /// applies a change twice.
        #[test]
        fn any_delivery_order_applies_the_history_in_order(
            count in 1usize..40,
            deliveries in proptest::collection::vec(0usize..40, 0..200),
        ) {
            let mut history = Vec::new();
            let mut prev = 0;
            for _ in 0..count {
                let version = next_version(prev, 3);
                history.push(stamp(7, prev, version));
                prev = version;
            }
            let mut replica = Replica::new(7, 0);
            let mut model = Model::default();
            let mut waiting: BTreeMap<u64, Stamp> = BTreeMap::new();
            let order = deliveries.iter().map(|i| i % count).chain(0..count);
            for i in order {
                let mut pending = vec![history[i]];
                while let Some(s) = pending.pop() {
                    match replica.admit(&s, 3) {
                        Admit::Apply => {
                            replica.submit(&s, 0, 1, 0);
                            replica.durable = s.version;
                            model.applied.push(s.version);
                            // A wake-up re-admits what waited for this version.
                            if let Some(next) = waiting.remove(&s.version) {
                                pending.push(next);
                            }
                        }
                        Admit::Executed => prop_assert!(model.applied.contains(&s.version)),
                        Admit::Wait => {
                            waiting.insert(s.prev, s);
                        }
                        Admit::Refuse(status, why) => prop_assert!(false, "{status:?} {why}"),
                    }
                }
            }
            let expected: Vec<u64> = history.iter().map(|s| s.version).collect();
            prop_assert_eq!(model.applied, expected);
        }

        /// Generations order histories: whatever a replica holds, a change of an
        /// older generation is fenced and one of a newer generation is never taken
        /// as already executed.
        #[test]
        fn generations_fence_and_never_alias(
            held_generation in 1u32..5, held_seq in 1u64..100,
            generation in 1u32..5, seq in 1u64..100, prev_seq in 0u64..100,
        ) {
            let held = (held_generation as u64) << 32 | held_seq;
            let replica = Replica::new(1, held);
            let version = (generation as u64) << 32 | seq;
            let prev = ((generation as u64) << 32 | prev_seq).min(version - 1);
            let verdict = replica.admit(&stamp(1, prev, version), generation);
            if generation < held_generation {
                prop_assert!(matches!(verdict, Admit::Refuse(Status::Fenced, _)));
            }
            if generation > held_generation {
                prop_assert_ne!(verdict, Admit::Executed);
            }
        }
    }
}
