//! The checkers that run once the faults end: the cluster heals, every acknowledged
//! write reads back, replicas agree, placement matches the map, and no two writers
//! had writes acknowledged in the same window.

use crate::cluster::{open, Cluster, VOLUME};
use crate::ledger::{Ack, Ledger, BLOCK_BYTES};
use crate::observe::Grant;
use floe_protocol::{ChunkId, ReplicaRequest, ReplicaResponse, Request, Response};
use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

/// After healing, the cluster must be back to full redundancy within this.
const HEAL_TIME_MAX: Duration = Duration::from_secs(600);
const POLL: Duration = Duration::from_millis(500);

/// Polls `probe` until it answers, for at most `limit`.
pub async fn until<T, F: Future<Output = Option<T>>>(
    limit: Duration,
    what: &str,
    mut probe: impl FnMut() -> F,
) -> Result<T, String> {
    let give_up = tokio::time::Instant::now() + limit;
    loop {
        if let Ok(Some(answer)) = tokio::time::timeout(Duration::from_secs(5), probe()).await {
            return Ok(answer);
        }
        if tokio::time::Instant::now() > give_up {
            return Err(format!("not within {limit:?}: {what}"));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits for full redundancy: every server not lost up, nothing to audit, degraded,
/// being repaired, misplaced or moving, no replica stale.
pub async fn settled(cluster: &Cluster) -> Result<(), String> {
    let last = std::cell::RefCell::new(String::new());
    let result =
        until(HEAL_TIME_MAX, "the cluster healed", || async {
            let status = cluster.admin().status().await.ok()?;
            let map = cluster.admin().volume_map(VOLUME).await.ok()?;
            let down: Vec<_> = status
                .servers
                .iter()
                .filter(|s| !s.up && !s.lost)
                .map(|s| s.id)
                .collect();
            let stale: Vec<_> = map
                .chunks
                .iter()
                .filter(|c| !c.stale.is_empty())
                .map(|c| (c.index, c.view, &c.replicas, &c.stale))
                .collect();
            let (r, b) = (&status.recovery, &status.rebalance);
            *last.borrow_mut() =
                format!(
            "down {down:?}, to audit {}, degraded {}, waiting for operator {}, repairing {}, misplaced {}, \
             moving {}, stale (index, view, replicas, stale) {stale:?}, last errors {:?} / {:?}",
            r.volumes_to_audit, r.degraded_chunks, r.waiting_for_operator, r.in_progress, b.misplaced_chunks,
            b.moving, r.last_error, b.last_error
        );
            (down.is_empty()
                && r.volumes_to_audit == 0
                && r.degraded_chunks == 0
                && r.in_progress == 0
                && b.misplaced_chunks == 0
                && b.moving == 0
                && stale.is_empty())
            .then_some(())
        })
        .await;
    result.map_err(|e| format!("{e}; last status: {}", last.borrow()))
}

/// Every block reads back as the ledger allows, through a fresh read-only attach;
/// every chunk's replicas are on distinct hosts and equal at equal versions.
/// Every snapshot the master kept reads, block by block, one of the writes the
/// ledger allows it (see [`Ledger::begin_snapshot`]).
pub async fn snapshots(cluster: &Cluster, ledger: &Ledger) -> Vec<String> {
    let mut violations = Vec::new();
    let map = match cluster.admin().volume_map(VOLUME).await {
        Ok(map) => map,
        Err(e) => return vec![format!("no volume map at the end: {e}")],
    };
    for name in ledger.snapshots() {
        // Never stored: the master died or refused before it was.
        if !map.volume.snapshots.iter().any(|s| s.name == name) {
            continue;
        }
        let device = match floe_client::open_snapshot(cluster.admin().clone(), VOLUME, &name).await
        {
            Ok(device) => device,
            Err(e) => {
                violations.push(format!("snapshot {name} could not be opened: {e}"));
                continue;
            }
        };
        for block in ledger.blocks() {
            match device.read(block * BLOCK_BYTES, BLOCK_BYTES as u32).await {
                Ok(data) => violations.extend(ledger.check_snapshot_read(&name, block, &data)),
                Err(e) => violations.push(format!("snapshot {name}: block {block} failed: {e}")),
            }
        }
    }
    violations
}

pub async fn final_state(cluster: &Cluster, ledger: &Ledger) -> Vec<String> {
    let mut violations = Vec::new();
    let network = &cluster.network;
    let reader = network.add("checker", "checker");
    let device = match open(network.boot(reader), VOLUME, None).await {
        Ok(device) => device,
        Err(e) => return vec![format!("the final read could not open the volume: {e}")],
    };
    for block in ledger.blocks() {
        match device.read(block * BLOCK_BYTES, BLOCK_BYTES as u32).await {
            Ok(data) => ledger.check_read(block, &data, network.now(), "final read"),
            Err(e) => violations.push(format!("final read of block {block} failed: {e}")),
        }
    }
    let map = match cluster.admin().volume_map(VOLUME).await {
        Ok(map) => map,
        Err(e) => return vec![format!("no volume map at the end: {e}")],
    };
    let pool = cluster.admin_pool();
    for placement in &map.chunks {
        let chunk = ChunkId {
            volume_id: map.volume.id,
            index: placement.index,
        };
        let servers: Vec<_> = placement
            .replicas
            .iter()
            .map(|id| {
                map.servers
                    .iter()
                    .find(|s| s.id == *id)
                    .expect("a known server")
            })
            .collect();
        let hosts: BTreeSet<_> = servers.iter().map(|s| &s.host).collect();
        if hosts.len() != servers.len() {
            violations.push(format!(
                "chunk {} has replicas on shared hosts: {servers:?}",
                chunk.index
            ));
        }
        let majority = map.volume.spec.replicas as usize / 2 + 1;
        let (committed, acked_by) = network.observations.committed(chunk, majority);
        let mut seen = BTreeSet::new();
        for server in &servers {
            let request = Request::Replica(ReplicaRequest::Checksum {
                chunk,
                length: map.volume.spec.chunk_bytes,
                readers: None,
            });
            match pool.call(&server.address, request).await {
                Ok(Response::Replica(ReplicaResponse::Checksum {
                    version,
                    crc,
                    bad,
                    retained,
                    bad_retained,
                })) => {
                    // Nothing rots in a simulation: a block failing its checksum is
                    // data and checksum written out of step.
                    if !bad.is_empty() || !bad_retained.is_empty() {
                        violations.push(format!(
                            "chunk {} on server {}: blocks {bad:?} and retained blocks \
                             {bad_retained:?} fail their checksums",
                            chunk.index, server.id
                        ));
                    }
                    if version < committed {
                        violations.push(format!(
                            "chunk {} on server {} holds version {version:#x}, below the \
                             committed {committed:#x} (acknowledged by {acked_by:?}), yet the \
                             master counts it current in view {} with {:?}",
                            chunk.index, server.id, placement.view, placement.replicas
                        ));
                    }
                    seen.insert((version, (crc, retained), server.id));
                }
                other => violations.push(format!(
                    "chunk {} on server {}: no checksum: {other:?}",
                    chunk.index, server.id
                )),
            }
        }
        // Equal at equal versions. A replica may hold more than the others: the tail
        // of a writer that died before it committed, which the next writer overwrites.
        let versions: BTreeSet<u64> = seen.iter().map(|(version, ..)| *version).collect();
        let states: BTreeSet<(u64, (u32, u32))> =
            seen.iter().map(|(v, crcs, _)| (*v, *crcs)).collect();
        if versions.len() < states.len() {
            violations.push(format!(
                "chunk {} replicas {:?} differ at equal versions (version, (crc, retained digest), server): {seen:?}",
                chunk.index, placement.replicas
            ));
        }
    }
    violations
}

/// Every acknowledged write was acknowledged to the holder of the latest lease
/// granted before the acknowledgment.
pub fn split_brain(grants: &[Grant], acks: &[Ack]) -> Vec<String> {
    let mut violations = Vec::new();
    for ack in acks {
        let holder = grants.iter().rev().find(|g| g.at <= ack.at);
        if holder.is_none_or(|g| g.holder != ack.gateway) {
            violations.push(format!(
                "split brain: write {} acknowledged to {} at {:?}, when the lease was {:?}'s",
                ack.write, ack.gateway, ack.at, holder
            ));
        }
    }
    violations
}
