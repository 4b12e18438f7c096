//! The decisions of a view change, as pure functions of what the master knows (the
//! chunk's placement, the servers, where the map places the chunk) and what the
//! replicas report; [`super::view_change`] makes the calls between them. In order:
//! [`plan`] (who votes, who is replaced by whom, who is left out), [`copy_from`]
//! (the source of the copy while writes go on, and the next view), [`switch`] (the
//! chunk's version once a majority is frozen in that view, and who catches up).

use crate::Failure;
use floe_placement::cluster::Placer;
use floe_protocol::{ChunkId, ChunkPlacement, ServerId, ServerInfo, Status, VolumeSpec};
use std::collections::{BTreeMap, BTreeSet};

pub(crate) type Servers = BTreeMap<ServerId, ServerInfo>;

/// Why a view change does not go on.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Fewer than a majority of the replicas that count can answer, so the highest
    /// version seen might miss acknowledged writes: the chunk waits for an operator to
    /// declare failed servers lost (`floe chunkserver mark-lost`).
    NeedsOperator { voters: usize, quorum: usize },
    /// Something did not answer as needed: a later scan tries again.
    Retry(String),
}

impl From<Stop> for Failure {
    fn from(stop: Stop) -> Failure {
        match stop {
            Stop::NeedsOperator { voters, quorum } => (
                Status::Unavailable,
                format!("only {voters} replicas can answer; {quorum} needed: waiting for `floe chunkserver mark-lost`"),
            ),
            Stop::Retry(message) => (Status::Unavailable, message),
        }
    }
}

fn majority(n: usize) -> usize {
    n / 2 + 1
}

fn up(servers: &Servers, id: ServerId) -> bool {
    servers.get(&id).is_some_and(|s| s.up && !s.lost)
}

/// Which degraded chunks to repair next, at most `n` of those not `busy`: the ones
/// with the fewest good replicas (up, not stale) first, then in chunk order. Below a
/// majority of good replicas a chunk takes no reads or writes until a repair brings
/// one back, while a chunk missing one replica of three serves on: after a restart
/// puts many chunks in repair at once, the blocked ones must not wait their turn.
pub(crate) fn repairs_due<'a>(
    chunks: impl Iterator<Item = (u64, &'a ChunkPlacement)>,
    servers: &Servers,
    busy: &BTreeSet<(u64, u64)>,
    n: usize,
) -> Vec<(u64, u64)> {
    let good = |p: &ChunkPlacement| {
        let replicas = p.replicas.iter();
        replicas
            .filter(|id| up(servers, **id) && !p.stale.contains(id))
            .count()
    };
    let mut due: Vec<(usize, (u64, u64))> = chunks
        .filter(|(_, p)| matches!(health(p, servers), Health::Degraded))
        .map(|(volume_id, p)| (good(p), (volume_id, p.index)))
        .filter(|(_, job)| !busy.contains(job))
        .collect();
    // Stable: chunk order among equals.
    due.sort_by_key(|(good, _)| *good);
    due.into_iter().take(n).map(|(_, job)| job).collect()
}

/// The replicas that can vote (up, not lost) and how many must: a majority of the
/// replicas not declared lost.
/// Replies a decision about `placement` needs: a majority of its replicas not lost.
pub(crate) fn quorum(placement: &ChunkPlacement, servers: &Servers) -> usize {
    votes(placement, servers).1
}

fn votes(placement: &ChunkPlacement, servers: &Servers) -> (Vec<ServerId>, usize) {
    let lost = placement
        .replicas
        .iter()
        .filter(|id| servers.get(id).is_none_or(|s| s.lost))
        .count();
    let voters = placement
        .replicas
        .iter()
        .copied()
        .filter(|id| up(servers, *id))
        .collect();
    (voters, majority(placement.replicas.len() - lost))
}

pub(crate) enum Health {
    Healthy,
    Degraded,
    NeedsOperator,
}

pub(crate) fn health(placement: &ChunkPlacement, servers: &Servers) -> Health {
    let (voters, quorum) = votes(placement, servers);
    if placement.stale.is_empty() && voters.len() == placement.replicas.len() {
        Health::Healthy
    } else if voters.len() < quorum {
        Health::NeedsOperator
    } else {
        Health::Degraded
    }
}

/// Where the map places a chunk created in `layer` now, around servers that are down
/// or lost: primary first, on distinct hosts, the volume's classes preferred. A
/// server short of space takes no new copy: it keeps only the current replicas in
/// `keep` (moving those off would make a server that fills empty itself, then fill
/// again), and the map fills in from servers it did not draw.
pub(crate) fn desired(
    placer: &Placer,
    servers: &Servers,
    chunk: ChunkId,
    layer: u8,
    spec: &VolumeSpec,
    keep: &[ServerId],
) -> Result<Vec<ServerId>, Failure> {
    let short = |id: ServerId| {
        !keep.contains(&id)
            && servers
                .get(&id)
                .is_some_and(|s| s.fs.is_some_and(|fs| fs.short))
    };
    placer
        .place(chunk, layer, spec.mode, spec.replicas as usize, &|id| {
            !up(servers, id) || short(id)
        })
        .map_err(|e| {
            let mut full: Vec<ServerId> = servers.keys().copied().filter(|id| short(*id)).collect();
            full.sort_unstable();
            if full.is_empty() {
                (Status::NoSpace, e.to_string())
            } else {
                (
                    Status::NoSpace,
                    format!("waiting for space: servers {full:?} are short of it ({e})"),
                )
            }
        })
}

/// Who takes part in a view change.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Replicas that can vote: up and not lost.
    pub(crate) voters: Vec<ServerId>,
    /// How many voters must answer in the new view.
    pub(crate) quorum: usize,
    /// The replica set to reach, primary first.
    pub(crate) new_set: Vec<ServerId>,
    /// Members of the new set that pull the chunk before the switch: new replicas and
    /// stale ones.
    pub(crate) targets: Vec<ServerId>,
    /// Replicas left out of the new set that are up: they free their data after the
    /// switch (one that is down keeps it; no map lists it).
    pub(crate) left_out: Vec<ServerId>,
}

impl Plan {
    /// Everyone moved to the new view: the voters and the new replicas.
    pub(crate) fn members(&self) -> Vec<ServerId> {
        let new = self.targets.iter().filter(|id| !self.voters.contains(id));
        self.voters.iter().chain(new).copied().collect()
    }
}

/// Who votes, who is replaced by whom (`desired`, from [`desired`]) and who is left
/// out, for `placement`.
pub(crate) fn plan(
    placement: &ChunkPlacement,
    servers: &Servers,
    desired: Vec<ServerId>,
) -> Result<Plan, Stop> {
    let (voters, quorum) = votes(placement, servers);
    if voters.len() < quorum {
        return Err(Stop::NeedsOperator {
            voters: voters.len(),
            quorum,
        });
    }
    let targets = desired
        .iter()
        .copied()
        .filter(|id| !placement.replicas.contains(id) || placement.stale.contains(id))
        .filter(|id| up(servers, *id))
        .collect();
    let left_out = placement
        .replicas
        .iter()
        .copied()
        .filter(|id| !desired.contains(id) && up(servers, *id))
        .collect();
    Ok(Plan {
        voters,
        quorum,
        new_set: desired,
        targets,
        left_out,
    })
}

/// What a replica reported: its (view, version), or nothing if it did not answer.
pub(crate) type Reports = [(ServerId, Option<(u64, u64)>)];

/// Where the copy before the switch comes from, and the view to switch to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Copy {
    pub(crate) source: ServerId,
    pub(crate) view: u64,
}

/// From the voters' reports before the switch: the most recent replica not stale is
/// the source, and the next view is past any a replica has seen.
pub(crate) fn copy_from(
    plan: &Plan,
    placement: &ChunkPlacement,
    reports: &Reports,
) -> Result<Copy, Stop> {
    if let Some((target, _)) = reports
        .iter()
        .find(|(id, report)| report.is_none() && plan.targets.contains(id))
    {
        return Err(Stop::Retry(format!(
            "server {target} to repair does not answer"
        )));
    }
    let answered: Vec<(u64, ServerId)> = reports
        .iter()
        .filter_map(|(id, report)| report.map(|(_, version)| (version, *id)))
        .collect();
    let good = answered
        .iter()
        .filter(|(_, id)| !placement.stale.contains(id))
        .max();
    let source = match good {
        Some(&(_, id)) => id,
        // No good replica answers: a majority of the set still holds every committed
        // change between them (each was on a majority), unless one was emptied by a
        // whole copy that failed part-way; such a replica claims version 0.
        None if answered.len() >= plan.quorum && answered.iter().all(|(v, _)| *v > 0) => {
            answered.iter().max().expect("a quorum").1
        }
        None => return Err(Stop::Retry("no good replica answered".into())),
    };
    let seen = reports.iter().filter_map(|(_, r)| r.map(|(view, _)| view));
    let view = seen.chain([placement.view]).max().unwrap_or(0) + 1;
    Ok(Copy { source, view })
}

/// The chunk's state once the members are frozen in the new view.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Switch {
    /// A voter holding `version`.
    pub(crate) source: ServerId,
    /// The highest version among the voters that answered.
    pub(crate) version: u64,
    /// Members of the new set below `version`.
    pub(crate) catch_up: Vec<ServerId>,
}

/// From the members' reports in the new view (`view`): with a majority of the voters
/// answering, the highest version among them holds every acknowledged write.
pub(crate) fn switch(plan: &Plan, view: u64, reports: &Reports) -> Result<Switch, Stop> {
    let answered = |id: &ServerId| {
        reports
            .iter()
            .find(|(r, _)| r == id)
            .and_then(|(_, report)| report.map(|(_, version)| version))
    };
    let votes: Vec<(u64, ServerId)> = plan
        .voters
        .iter()
        .filter_map(|id| Some((answered(id)?, *id)))
        .collect();
    if votes.len() < plan.quorum {
        return Err(Stop::Retry(format!(
            "only {} replicas answered in view {view}; {} needed",
            votes.len(),
            plan.quorum
        )));
    }
    let missing: Vec<ServerId> = plan
        .new_set
        .iter()
        .copied()
        .filter(|id| answered(id).is_none())
        .collect();
    if !missing.is_empty() {
        return Err(Stop::Retry(format!(
            "servers {missing:?} of the new replica set did not answer"
        )));
    }
    // Stale replicas vote, but one emptied by a whole copy that failed part-way
    // (version 0) must not decide alone: a good replica must answer then.
    let stale_only = votes.iter().all(|(_, id)| plan.targets.contains(id));
    if stale_only && votes.iter().any(|(version, _)| *version == 0) {
        return Err(Stop::Retry(format!(
            "no good replica answered in view {view}"
        )));
    }
    let (version, source) = *votes.iter().max().expect("a quorum answered");
    let catch_up = plan
        .new_set
        .iter()
        .copied()
        .filter(|id| answered(id).is_some_and(|v| v < version))
        .collect();
    Ok(Switch {
        source,
        version,
        catch_up,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_protocol::{
        ClusterMap, DeviceClass, FsUsage, MapChange, MapDevice, PlacementMode, VolumeMode,
    };

    const HOSTS: [&str; 4] = ["a", "b", "c", "d"];

    /// One ssd (odd id) and one hdd (even id) on each host.
    fn devices() -> Vec<MapDevice> {
        let classes = [DeviceClass::Ssd, DeviceClass::Hdd];
        HOSTS
            .iter()
            .flat_map(|host| classes.map(|class| (host, class)))
            .zip(1..)
            .map(|((host, class), id)| MapDevice {
                id,
                host: host.to_string(),
                class,
                weight: 1 << 16,
            })
            .collect()
    }

    struct Cluster {
        placer: Placer,
        servers: Servers,
    }

    impl Cluster {
        fn new() -> Cluster {
            let map = ClusterMap {
                epoch: 1,
                mode: PlacementMode::Mapx,
                pgs_per_layer: 64,
                changes: vec![MapChange::Expand { devices: devices() }],
                out: Vec::new(),
            };
            let servers = devices()
                .into_iter()
                .map(|d| {
                    let server = ServerInfo {
                        id: d.id,
                        uuid: d.id.to_string(),
                        address: format!("{}:{}", d.host, d.id),
                        host: d.host,
                        class: d.class,
                        emulated: false,
                        capacity_bytes: 1 << 40,
                        used_bytes: 0,
                        up: true,
                        lost: false,
                        corrupt_blocks: 0,
                        fs: None,
                    };
                    (d.id, server)
                })
                .collect();
            Cluster {
                placer: Placer::new(&map).unwrap(),
                servers,
            }
        }

        fn down(&mut self, id: ServerId) {
            self.servers.get_mut(&id).unwrap().up = false;
        }

        fn lost(&mut self, id: ServerId) {
            self.down(id);
            self.servers.get_mut(&id).unwrap().lost = true;
        }

        fn short_of_space(&mut self, id: ServerId) {
            self.servers.get_mut(&id).unwrap().fs = Some(FsUsage {
                short: true,
                ..FsUsage::default()
            });
        }

        fn desired(&self, index: u64, mode: VolumeMode) -> Vec<ServerId> {
            self.desired_keeping(index, mode, &[]).unwrap()
        }

        fn desired_keeping(
            &self,
            index: u64,
            mode: VolumeMode,
            keep: &[ServerId],
        ) -> Result<Vec<ServerId>, Failure> {
            let spec = VolumeSpec {
                name: "v".into(),
                size_bytes: 1 << 30,
                replicas: 3,
                chunk_bytes: 64 << 20,
                stripe_unit_bytes: 64 << 10,
                stripe_count: 4,
                mode,
                write_mode: Default::default(),
            };
            let chunk = ChunkId {
                volume_id: 1,
                index,
            };
            desired(&self.placer, &self.servers, chunk, 0, &spec, keep)
        }

        /// A hybrid chunk where the map placed it while every server was up.
        fn chunk(&self, index: u64) -> ChunkPlacement {
            ChunkPlacement {
                index,
                replicas: self.desired(index, VolumeMode::Hybrid),
                view: 3,
                stale: Vec::new(),
                layer: 0,
                born: 0,
            }
        }

        fn plan(&self, placement: &ChunkPlacement) -> Result<Plan, Stop> {
            plan(
                placement,
                &self.servers,
                self.desired(placement.index, VolumeMode::Hybrid),
            )
        }

        /// How many hosts `ids` are on.
        fn hosts(&self, ids: &[ServerId]) -> usize {
            let mut hosts: Vec<&str> = ids.iter().map(|id| self.host(*id)).collect();
            hosts.sort_unstable();
            hosts.dedup();
            hosts.len()
        }

        fn host(&self, id: ServerId) -> &str {
            &self.servers[&id].host
        }

        fn class(&self, id: ServerId) -> DeviceClass {
            self.servers[&id].class
        }
    }

    fn three(placement: &ChunkPlacement) -> [ServerId; 3] {
        placement.replicas[..].try_into().expect("three replicas")
    }

    /// `a` without the members of `b`, in order.
    fn minus(a: &[ServerId], b: &[ServerId]) -> Vec<ServerId> {
        a.iter().copied().filter(|id| !b.contains(id)).collect()
    }

    fn answered(versions: &[(ServerId, u64)]) -> Vec<(ServerId, Option<(u64, u64)>)> {
        versions
            .iter()
            .map(|(id, v)| (*id, Some((3, *v))))
            .collect()
    }

    #[test]
    fn chunks_with_the_fewest_good_replicas_are_repaired_first() {
        let mut cluster = Cluster::new();
        let mut chunks: Vec<ChunkPlacement> = (0..6).map(|i| cluster.chunk(i)).collect();
        // Chunks 0 and 4 healthy; 1 and 2 lag one replica; 3 and 5 lag two (one good
        // replica left: no I/O reaches them).
        for (i, stale) in [(1, vec![0]), (2, vec![1]), (3, vec![0, 2]), (5, vec![1, 2])] {
            chunks[i].stale = stale.iter().map(|&r| chunks[i].replicas[r]).collect();
        }
        let due = |cluster: &Cluster, busy: &BTreeSet<(u64, u64)>, n| {
            let all = chunks.iter().map(|p| (1, p));
            repairs_due(all, &cluster.servers, busy, n)
        };
        assert_eq!(due(&cluster, &BTreeSet::new(), 2), [(1, 3), (1, 5)]);
        let rest = due(&cluster, &BTreeSet::from([(1, 3)]), 10);
        assert_eq!(rest, [(1, 5), (1, 1), (1, 2)], "then in chunk order");
        // A replica on a server that went down is not good either: chunk 2's other
        // replicas are up and current unless they share that server.
        let gone = chunks[2].replicas[0];
        cluster.down(gone);
        if !chunks[1].replicas.contains(&gone) {
            let rest = due(&cluster, &BTreeSet::from([(1, 3), (1, 5)]), 10);
            assert_eq!(rest[0], (1, 2), "{rest:?}");
        }
    }

    #[test]
    fn a_failed_replica_is_replaced_on_distinct_hosts_in_the_volumes_classes() {
        for index in 0..50 {
            for failed in 0..3 {
                let mut cluster = Cluster::new();
                let placement = cluster.chunk(index);
                let gone = placement.replicas[failed];
                cluster.down(gone);
                let plan = cluster.plan(&placement).unwrap();
                let kept = minus(&placement.replicas, &[gone]);
                assert_eq!((plan.voters.clone(), plan.quorum), (kept.clone(), 2));
                assert!(!plan.new_set.contains(&gone));
                // The map may also move a survivor that now shares a host with the new
                // primary: it is left out, and freed.
                let new = minus(&plan.new_set, &kept);
                assert_eq!(plan.targets, new);
                let moved = minus(&kept, &plan.new_set);
                assert_eq!(plan.left_out, moved, "a down replica is not asked");
                assert_eq!(cluster.hosts(&plan.new_set), 3, "{plan:?}");
                let classes: Vec<DeviceClass> =
                    plan.new_set.iter().map(|id| cluster.class(*id)).collect();
                assert_eq!(
                    classes,
                    [DeviceClass::Ssd, DeviceClass::Hdd, DeviceClass::Hdd]
                );
                assert_eq!(plan.members(), [kept, new].concat());
            }
        }
    }

    #[test]
    fn the_other_class_fills_in_when_a_class_runs_out_of_hosts() {
        let mut cluster = Cluster::new();
        let placement = cluster.chunk(7);
        // With every ssd down, the primary comes from hdd too.
        let primary = placement.replicas[0];
        for id in cluster.servers.clone().keys() {
            if cluster.class(*id) == DeviceClass::Ssd {
                cluster.down(*id);
            }
        }
        let plan = cluster.plan(&placement).unwrap();
        assert!(!plan.new_set.contains(&primary));
        assert!(plan
            .new_set
            .iter()
            .all(|id| cluster.class(*id) == DeviceClass::Hdd));
        assert_eq!(cluster.hosts(&plan.new_set), 3, "{plan:?}");
    }

    #[test]
    fn fewer_than_a_majority_up_waits_until_the_failed_are_declared_lost() {
        let mut cluster = Cluster::new();
        let placement = cluster.chunk(3);
        let [a, b, c] = three(&placement);
        cluster.down(a);
        cluster.down(b);
        let wait = Err(Stop::NeedsOperator {
            voters: 1,
            quorum: 2,
        });
        assert_eq!(cluster.plan(&placement), wait);
        assert!(matches!(
            health(&placement, &cluster.servers),
            Health::NeedsOperator
        ));
        cluster.lost(a);
        assert_eq!(cluster.plan(&placement), wait, "2 of 3 still count");
        cluster.lost(b);
        let plan = cluster.plan(&placement).unwrap();
        assert_eq!((plan.voters.clone(), plan.quorum), (vec![c], 1));
        assert_eq!(plan.targets.len(), 2);
        assert!(plan.new_set.contains(&c));
    }

    #[test]
    fn a_stale_replica_is_repaired_in_place_and_never_the_source() {
        let cluster = Cluster::new();
        let mut placement = cluster.chunk(11);
        let stale = placement.replicas[1];
        placement.stale.push(stale);
        assert!(matches!(
            health(&placement, &cluster.servers),
            Health::Degraded
        ));
        let plan = cluster.plan(&placement).unwrap();
        assert_eq!(plan.new_set, placement.replicas);
        assert_eq!(plan.targets, [stale]);
        assert_eq!(plan.voters, placement.replicas);
        assert!(plan.left_out.is_empty());
        // It reports the highest version (a diverged history): still not the source.
        let [p, _, c] = three(&placement);
        let reports = answered(&[(p, 10), (stale, 99), (c, 12)]);
        let copy = copy_from(&plan, &placement, &reports).unwrap();
        assert_eq!(copy.source, c);
        let mut silent = reports.clone();
        silent[1].1 = None;
        assert!(matches!(
            copy_from(&plan, &placement, &silent),
            Err(Stop::Retry(_))
        ));
    }

    #[test]
    fn a_server_short_of_space_keeps_its_replicas_and_takes_no_new_copy() {
        let mut cluster = Cluster::new();
        let placement = cluster.chunk(7);
        let full = placement.replicas[1];
        cluster.short_of_space(full);
        // Its current replica stays: no chunk moves off a server because it filled.
        let kept = cluster
            .desired_keeping(7, VolumeMode::Hybrid, &placement.replicas)
            .unwrap();
        assert_eq!(kept, placement.replicas);
        // A new chunk, or a stale replica there, goes to a server the map did not draw.
        let fresh = cluster.desired(7, VolumeMode::Hybrid);
        assert!(!fresh.contains(&full), "{fresh:?} avoids {full}");
        assert_eq!(cluster.hosts(&fresh), 3);
        assert_eq!(minus(&placement.replicas, &fresh), vec![full]);
        // With every server short, nothing can be placed: the copy waits, and says so.
        for id in cluster.servers.keys().copied().collect::<Vec<_>>() {
            cluster.short_of_space(id);
        }
        let (status, message) = cluster
            .desired_keeping(7, VolumeMode::Hybrid, &[])
            .unwrap_err();
        assert_eq!(status, Status::NoSpace);
        assert!(message.starts_with("waiting for space"), "{message}");
    }

    #[test]
    fn a_healthy_chunk_moves_to_where_the_map_places_it() {
        let cluster = Cluster::new();
        let placement = cluster.chunk(5);
        let elsewhere = (6..)
            .map(|index| cluster.chunk(index).replicas)
            .find(|replicas| replicas != &placement.replicas)
            .unwrap();
        let moved = ChunkPlacement {
            replicas: elsewhere.clone(),
            ..placement.clone()
        };
        assert!(matches!(health(&moved, &cluster.servers), Health::Healthy));
        let plan = cluster.plan(&moved).unwrap();
        assert_eq!(plan.new_set, placement.replicas);
        assert_eq!(plan.targets, minus(&placement.replicas, &elsewhere));
        assert_eq!(plan.left_out, minus(&elsewhere, &placement.replicas));
        assert_eq!((plan.voters.clone(), plan.quorum), (elsewhere, 2));
    }

    #[test]
    fn a_majority_of_stale_replicas_sources_only_when_none_claims_version_0() {
        let cluster = Cluster::new();
        let mut placement = cluster.chunk(2);
        let [p, b, c] = three(&placement);
        placement.stale = vec![b, c];
        let plan = cluster.plan(&placement).unwrap();
        // The only good replica is gone; the stale two still hold every committed
        // change between them, the newest on c.
        let mut reports = answered(&[(p, 4), (b, 5), (c, 7)]);
        assert_eq!(copy_from(&plan, &placement, &reports).unwrap().source, p);
        reports[0].1 = None;
        assert_eq!(copy_from(&plan, &placement, &reports).unwrap().source, c);
        // b claims nothing: it may have been emptied, and c alone may miss changes.
        reports[1].1 = Some((1, 0));
        assert!(matches!(
            copy_from(&plan, &placement, &reports),
            Err(Stop::Retry(_))
        ));
    }

    #[test]
    fn the_next_view_is_past_every_view_seen() {
        let cluster = Cluster::new();
        let placement = cluster.chunk(2);
        let plan = cluster.plan(&placement).unwrap();
        let [p, b, c] = three(&placement);
        let mut reports = answered(&[(p, 4), (b, 4), (c, 4)]);
        assert_eq!(copy_from(&plan, &placement, &reports).unwrap().view, 4);
        // A view change that failed half-way left a replica in a later view.
        reports[2].1 = Some((9, 4));
        assert_eq!(copy_from(&plan, &placement, &reports).unwrap().view, 10);
        let none = [(p, None), (b, None), (c, None)];
        assert_eq!(
            copy_from(&plan, &placement, &none),
            Err(Stop::Retry("no good replica answered".into()))
        );
    }

    #[test]
    fn the_highest_version_among_a_majority_is_the_chunks_and_the_rest_catch_up() {
        let mut cluster = Cluster::new();
        let placement = cluster.chunk(9);
        let [p, b, c] = three(&placement);
        cluster.down(c);
        let plan = cluster.plan(&placement).unwrap();
        let new = plan.targets[0];
        let frozen = answered(&[(p, 7), (b, 5), (new, 7)]);
        let switch = switch(&plan, 4, &frozen).unwrap();
        assert_eq!((switch.source, switch.version), (p, 7));
        assert_eq!(switch.catch_up, [b]);
        // A new replica ahead of every voter (it holds a write no majority has) is no
        // source.
        let ahead = answered(&[(p, 7), (b, 5), (new, 8)]);
        let switched = super::switch(&plan, 4, &ahead).unwrap();
        assert_eq!(switched.version, 7);
    }

    #[test]
    fn fewer_than_a_majority_answering_in_the_new_view_is_retried() {
        let cluster = Cluster::new();
        let placement = cluster.chunk(4);
        let plan = cluster.plan(&placement).unwrap();
        let [p, b, c] = three(&placement);
        let one = [(p, Some((4, 7))), (b, None), (c, None)];
        assert_eq!(
            switch(&plan, 4, &one),
            Err(Stop::Retry(
                "only 1 replicas answered in view 4; 2 needed".into()
            ))
        );
        let two = [(p, Some((4, 7))), (b, Some((4, 6))), (c, None)];
        assert!(
            matches!(switch(&plan, 4, &two), Err(Stop::Retry(m)) if m.contains("did not answer")),
            "every member of the new set must answer"
        );
    }

    #[test]
    fn a_lost_replica_never_votes_and_the_new_set_is_on_distinct_hosts() {
        for index in 0..100 {
            let mut cluster = Cluster::new();
            let placement = cluster.chunk(index);
            cluster.lost(placement.replicas[index as usize % 3]);
            let plan = cluster.plan(&placement).unwrap();
            assert_eq!((plan.voters.len(), plan.quorum), (2, 2));
            assert_eq!(cluster.hosts(&plan.new_set), 3, "{plan:?}");
        }
    }
}
