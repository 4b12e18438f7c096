//! `floe scrub VOLUME`: replicas compared by checksum at equal versions.

use crate::{Failure, Master};
use floe_protocol::{
    ChunkId, RepairKind, ReplicaRequest, ReplicaResponse, ScrubReport, ServerInfo,
};
use std::time::Duration;

/// Compares every chunk's replicas by checksum at equal versions and repairs the
/// ones that differ from a majority; with no majority it changes nothing.
pub(crate) async fn scrub(master: &Master, name: &str) -> Result<ScrubReport, Failure> {
    const SETTLE_ATTEMPTS: u32 = 20;
    let (volume, indexes) = {
        let state = master.state();
        let volume = state.volume(name)?;
        let indexes: Vec<u64> = state
            .chunks
            .get(&volume.id)
            .into_iter()
            .flat_map(|c| c.keys().copied())
            .collect();
        (volume, indexes)
    };
    let mut report = ScrubReport::default();
    for index in indexes {
        report.chunks += 1;
        let chunk = ChunkId {
            volume_id: volume.id,
            index,
        };
        let checksum = ReplicaRequest::Checksum {
            chunk,
            length: volume.spec.chunk_bytes,
        };
        // The placement is read again on each attempt: a repair or a move may change
        // the replica set while the scrub waits for one version.
        let mut members = Vec::new();
        let mut sums = Vec::new();
        for _ in 0..SETTLE_ATTEMPTS {
            members = replicas_of(master, volume.id, index).unwrap_or_default();
            if members.is_empty() {
                break;
            }
            let replies = futures::future::join_all(
                members
                    .iter()
                    .map(|s| master.ask(&s.address, checksum.clone())),
            )
            .await;
            sums = replies
                .into_iter()
                .filter_map(|r| match r {
                    Ok(ReplicaResponse::Checksum { version, crc }) => Some((version, crc)),
                    _ => None,
                })
                .collect();
            if sums.len() == members.len() && sums.iter().all(|s| s.0 == sums[0].0) {
                break;
            }
            sums.clear();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if members.is_empty() {
            report.skipped += 1;
            report
                .details
                .push(format!("chunk {index}: degraded, recovery pending"));
            continue;
        }
        if sums.is_empty() {
            report.skipped += 1;
            report.details.push(format!(
                "chunk {index}: replicas unreachable or never at one version"
            ));
            continue;
        }
        if sums.iter().all(|s| s.1 == sums[0].1) {
            continue;
        }
        report.differences += 1;
        let crcs: Vec<u32> = sums.iter().map(|s| s.1).collect();
        let Some(good) = majority(&crcs) else {
            // No telling the good copy (if any) from the bad: a rebuild from one of
            // them could destroy the only good copy.
            let detail = format!(
                "chunk {index}: no two replicas agree at version {:#x} (crcs {}): nothing \
                 rebuilt; the replicas are kept as they are",
                sums[0].0,
                crcs.iter()
                    .zip(&members)
                    .map(|(crc, s)| format!("server {} {crc:08x}", s.id))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            tracing::warn!("scrub: {detail}");
            report.details.push(detail);
            continue;
        };
        let authority = crcs
            .iter()
            .position(|crc| *crc == good)
            .expect("a majority holds it");
        let mut fixed = true;
        for (i, (_, crc)) in sums.iter().enumerate() {
            if *crc == good {
                continue;
            }
            let detail = format!(
                "chunk {}: server {} differs at version {:#x} (crc {crc:08x}, majority {good:08x})",
                index, members[i].id, sums[i].0
            );
            tracing::warn!("scrub: {detail}");
            report.details.push(detail);
            let rate = master.recovery.limits.bytes_per_second;
            let repaired = master
                .repair_from(
                    chunk,
                    &members[i],
                    &members[authority],
                    RepairKind::Whole,
                    rate,
                )
                .await
                .is_ok()
                && matches!(
                    master.ask(&members[i].address, checksum.clone()).await,
                    Ok(ReplicaResponse::Checksum { crc, .. }) if crc == good
                );
            fixed &= repaired;
        }
        if fixed {
            report.repaired += 1;
        }
    }
    Ok(report)
}

/// The chunk's replicas when it is healthy (none stale, all up); None when it is
/// degraded or gone.
fn replicas_of(master: &Master, volume_id: u64, index: u64) -> Option<Vec<ServerInfo>> {
    let state = master.state();
    let placement = state.chunks.get(&volume_id)?.get(&index)?;
    if !placement.stale.is_empty() {
        return None;
    }
    placement
        .replicas
        .iter()
        .map(|id| state.servers.get(id).filter(|s| s.up && !s.lost).cloned())
        .collect()
}

/// The checksum more than half of the replicas hold, if any.
fn majority(crcs: &[u32]) -> Option<u32> {
    crcs.iter()
        .copied()
        .find(|crc| crcs.iter().filter(|c| *c == crc).count() * 2 > crcs.len())
}

#[cfg(test)]
mod tests {
    use super::majority;

    #[test]
    fn only_a_checksum_most_replicas_hold_is_the_good_one() {
        assert_eq!(majority(&[7, 7, 7]), Some(7));
        assert_eq!(majority(&[7, 9, 7]), Some(7));
        // Two of three corrupted, differently: the primary's copy is no authority.
        assert_eq!(majority(&[8, 9, 7]), None);
        assert_eq!(majority(&[8, 7]), None);
    }
}
