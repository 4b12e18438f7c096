//! Scrub: a chunk's replicas are read whole at one version, every block checked
//! against its own checksum. A block that fails on a replica is rewritten there from
//! a replica whose copy checks ([`ReplicaRequest::Heal`]); a block no replica holds
//! good is reported lost (volume offset) and nothing is changed for it. Then the
//! replicas' whole-chunk checksums are compared: copies that differ though every
//! block checks (a lost write, not rot) are rebuilt from a majority, never without
//! one.
//!
//! The blocks replicas retain for snapshots (`floe_chunkstore::retained`) are
//! compared too: each replica digests those a snapshot may read, every one read and
//! checked. A replica whose digest differs from a majority's, a retained block
//! that rots included, is rebuilt from it by a whole copy, which carries the
//! retained blocks and checks each one it reads; a retained block that fails on
//! every replica is reported lost.
//!
//! `floe scrub VOLUME` runs it over a volume; [`super::integrity`] runs it on chunks a
//! read found bad, and over every volume in the background.

use crate::{Failure, Master};
use floe_protocol::snapshot::split_index;
use floe_protocol::{
    ChunkId, RepairKind, ReplicaRequest, ReplicaResponse, ScrubReport, ServerInfo, SnapshotReaders,
    Volume,
};
use std::time::Duration;

/// Scrubs every chunk of volume `name`.
pub(crate) async fn scrub(master: &Master, name: &str) -> Result<ScrubReport, Failure> {
    let volume = master.state().volume(name)?;
    let mut report = ScrubReport::default();
    let chunks = chunks_of(master, volume.id);
    let progress = master.integrity.manual(name, chunks.len() as u64);
    for (done, index) in chunks.into_iter().enumerate() {
        check_chunk(master, &volume, index, &mut report).await;
        progress.checked(done as u64 + 1);
    }
    Ok(report)
}

/// The volume's allocated chunks.
pub(super) fn chunks_of(master: &Master, volume_id: u64) -> Vec<u64> {
    let state = master.state();
    state
        .chunks
        .get(&volume_id)
        .into_iter()
        .flat_map(|c| c.keys().copied())
        .collect()
}

/// One replica's answer to a whole-chunk read.
struct Sums {
    version: u64,
    crcs: Crcs,
    /// Offsets of blocks that fail their own checksums.
    bad: Vec<u64>,
    /// (epoch, offset) of retained blocks that fail theirs.
    bad_retained: Vec<(u32, u64)>,
}

/// What replicas holding the same must agree on: the live bytes' crc and the
/// retained blocks' digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Crcs {
    live: u32,
    retained: u32,
}

impl std::fmt::Display for Crcs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:08x}/{:08x}", self.live, self.retained)
    }
}

/// Checks and heals one chunk, adding what it found to `report`.
pub(super) async fn check_chunk(
    master: &Master,
    volume: &Volume,
    index: u64,
    report: &mut ScrubReport,
) {
    report.chunks += 1;
    let chunk = ChunkId {
        volume_id: volume.id,
        index,
    };
    let Some((members, sums)) = settled_sums(master, volume, index, report).await else {
        return;
    };
    let rotten = sums
        .iter()
        .any(|s| !s.bad.is_empty() || !s.bad_retained.is_empty());
    let bad_blocks = sums.iter().map(|s| s.bad.len() + s.bad_retained.len());
    crate::exported::scrubbed(&volume.spec.name, bad_blocks.sum());
    report_lost_retained(volume, chunk, &sums, report);
    if rotten {
        report.differences += 1;
    }
    let healed = heal(master, volume, chunk, &members, &sums, report).await;
    // Healing changed the healed replicas' checksums: read them again.
    let sums = match healed {
        0 => sums,
        _ => match settled_sums(master, volume, index, report).await {
            // The same servers (their other fields, from heartbeats, move on).
            Some((again, sums)) if again.iter().map(|s| s.id).eq(members.iter().map(|s| s.id)) => {
                sums
            }
            Some(_) => {
                report.skipped += 1;
                let detail =
                    format!("chunk {index}: healed, then its replicas moved; not re-checked");
                report.details.push(detail);
                return;
            }
            // Counted skipped, with the reason, by `settled_sums`.
            None => return,
        },
    };
    if sums.iter().all(|s| s.crcs == sums[0].crcs) {
        let clean = |s: &Sums| s.bad.is_empty() && s.bad_retained.is_empty();
        if rotten && sums.iter().all(clean) {
            report.repaired += 1;
        }
        return;
    }
    if !rotten {
        report.differences += 1;
    }
    rebuild_from_majority(master, volume, chunk, &members, &sums, report).await;
}

/// Every replica's checksums at one version; None (with the reason in `report`) when
/// the chunk is degraded or its replicas never settled on one version.
async fn settled_sums(
    master: &Master,
    volume: &Volume,
    index: u64,
    report: &mut ScrubReport,
) -> Option<(Vec<ServerInfo>, Vec<Sums>)> {
    const SETTLE_ATTEMPTS: u32 = 20;
    let checksum = checksum_of(
        volume,
        ChunkId {
            volume_id: volume.id,
            index,
        },
    );
    let mut members = Vec::new();
    for _ in 0..SETTLE_ATTEMPTS {
        // The placement is read again on each attempt: a repair or a move may change
        // the replica set while the scrub waits for one version.
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
        let sums: Vec<Sums> = replies
            .into_iter()
            .filter_map(|r| match r {
                Ok(ReplicaResponse::Checksum {
                    version,
                    crc,
                    bad,
                    retained,
                    bad_retained,
                }) => Some(Sums {
                    version,
                    crcs: Crcs {
                        live: crc,
                        retained,
                    },
                    bad,
                    bad_retained,
                }),
                _ => None,
            })
            .collect();
        if sums.len() == members.len() && sums.iter().all(|s| s.version == sums[0].version) {
            return Some((members, sums));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.skipped += 1;
    report.details.push(if members.is_empty() {
        format!("chunk {index}: degraded, recovery pending")
    } else {
        format!("chunk {index}: replicas unreachable or never at one version")
    });
    None
}

/// Rewrites each replica's bad blocks from replicas that hold them good; reports the
/// blocks no replica holds good. Returns the blocks healed.
async fn heal(
    master: &Master,
    volume: &Volume,
    chunk: ChunkId,
    members: &[ServerInfo],
    sums: &[Sums],
    report: &mut ScrubReport,
) -> u64 {
    let mut lost: Vec<u64> = Vec::new();
    let mut healed = 0;
    for (i, target) in members.iter().enumerate() {
        let mut blocks = Vec::new();
        for &offset in &sums[i].bad {
            let sources: Vec<String> = members
                .iter()
                .zip(sums)
                .filter(|(_, s)| !s.bad.contains(&offset))
                .map(|(m, _)| m.address.clone())
                .collect();
            if sources.is_empty() {
                if !lost.contains(&offset) {
                    lost.push(offset);
                }
            } else {
                blocks.push((offset, sources));
            }
        }
        if blocks.is_empty() {
            continue;
        }
        let wanted = blocks.len() as u64;
        let request = ReplicaRequest::Heal {
            chunk,
            version: sums[i].version,
            blocks,
        };
        let detail = match master.ask(&target.address, request).await {
            Ok(ReplicaResponse::Healed { blocks }) => {
                healed += blocks;
                format!(
                    "chunk {}: server {} had {wanted} corrupt blocks, {blocks} rewritten from \
                     good copies",
                    chunk.index, target.id
                )
            }
            Ok(other) => format!(
                "chunk {}: server {} answered a heal with {other:?}",
                chunk.index, target.id
            ),
            Err(e) => format!(
                "chunk {}: healing {wanted} blocks on server {} failed: {e}",
                chunk.index, target.id
            ),
        };
        tracing::warn!("scrub: {detail}");
        report.details.push(detail);
    }
    report.healed_blocks += healed;
    for offset in lost {
        // A delta chunk holds blocks of its live chunk as snapshots see them.
        let (epoch, live) = split_index(chunk.index);
        let at = volume.spec.volume_offset(live, offset);
        let whose = match epoch {
            0 => String::new(),
            epoch => format!(" (as snapshots from epoch {epoch} down read it)"),
        };
        let detail = format!(
            "volume {} offset {at}{whose}: LOST, no replica holds a good copy of chunk {} \
             block {offset} (left as it is)",
            volume.spec.name, chunk.index
        );
        tracing::error!("scrub: {detail}");
        report.details.push(detail);
        report.lost_blocks.push((at, chunk.index, offset));
    }
    healed
}

/// Replicas whose blocks all check but whose contents differ: the ones that differ
/// from a majority are rebuilt from it (a whole copy, whose reads check every block
/// of the source); with no majority nothing is rebuilt.
async fn rebuild_from_majority(
    master: &Master,
    volume: &Volume,
    chunk: ChunkId,
    members: &[ServerInfo],
    sums: &[Sums],
    report: &mut ScrubReport,
) {
    let index = chunk.index;
    let crcs: Vec<Crcs> = sums.iter().map(|s| s.crcs).collect();
    let Some(good) = majority(&crcs) else {
        // No telling the good copy (if any) from the bad: a rebuild from one of them
        // could destroy the only good copy.
        let detail = format!(
            "chunk {index}: no two replicas agree at version {:#x} (crcs {}): nothing \
             rebuilt; the replicas are kept as they are",
            sums[0].version,
            crcs.iter()
                .zip(members)
                .map(|(crcs, s)| format!("server {} {crcs}", s.id))
                .collect::<Vec<_>>()
                .join(", ")
        );
        tracing::warn!("scrub: {detail}");
        report.details.push(detail);
        return;
    };
    let authority = crcs
        .iter()
        .position(|crc| *crc == good)
        .expect("a majority holds it");
    let checksum = checksum_of(volume, chunk);
    let mut fixed = true;
    for (i, sum) in sums.iter().enumerate() {
        if sum.crcs == good {
            continue;
        }
        let detail = format!(
            "chunk {}: server {} differs at version {:#x} (crcs live/retained {}, majority \
             {good})",
            index, members[i].id, sum.version, sum.crcs
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
                Ok(ReplicaResponse::Checksum { crc, retained, .. })
                    if Crcs { live: crc, retained } == good
            );
        fixed &= repaired;
    }
    if fixed {
        report.repaired += 1;
    }
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

/// A replica's checksum request: its retained blocks as the volume's snapshots may
/// read them (replicas free the others at different times).
fn checksum_of(volume: &Volume, chunk: ChunkId) -> ReplicaRequest {
    ReplicaRequest::Checksum {
        chunk,
        length: volume.spec.chunk_bytes,
        readers: Some(SnapshotReaders::of(volume)),
    }
}

/// Reports the retained blocks that fail on every replica: no copy to rebuild them
/// from.
fn report_lost_retained(volume: &Volume, chunk: ChunkId, sums: &[Sums], report: &mut ScrubReport) {
    let Some(first) = sums.first() else {
        return;
    };
    for &(epoch, offset) in &first.bad_retained {
        if !sums
            .iter()
            .all(|s| s.bad_retained.contains(&(epoch, offset)))
        {
            continue;
        }
        let at = volume.spec.volume_offset(chunk.index, offset);
        let detail = format!(
            "volume {} offset {at} (as snapshots from epoch {epoch} down read it): LOST, no \
             replica holds a good copy of the block chunk {} retained at {offset}",
            volume.spec.name, chunk.index
        );
        tracing::error!("scrub: {detail}");
        report.details.push(detail);
        report.lost_blocks.push((at, chunk.index, offset));
    }
}

/// The checksum more than half of the replicas hold, if any.
fn majority<T: Copy + PartialEq>(crcs: &[T]) -> Option<T> {
    crcs.iter()
        .copied()
        .find(|crc| crcs.iter().filter(|c| *c == crc).count() * 2 > crcs.len())
}

#[cfg(test)]
mod tests {
    use super::{majority, Crcs};

    #[test]
    fn only_a_checksum_most_replicas_hold_is_the_good_one() {
        assert_eq!(majority(&[7, 7, 7]), Some(7));
        assert_eq!(majority(&[7, 9, 7]), Some(7));
        // Two of three corrupted, differently: the primary's copy is no authority.
        assert_eq!(majority(&[8, 9, 7]), None);
        assert_eq!(majority(&[8, 7]), None);
    }

    #[test]
    fn replicas_agree_only_on_both_their_live_bytes_and_their_retained_blocks() {
        let crcs = |live, retained| Crcs { live, retained };
        let sums = [crcs(7, 1), crcs(7, 2), crcs(7, 1)];
        assert_eq!(majority(&sums), Some(crcs(7, 1)));
        assert_eq!(majority(&[crcs(7, 1), crcs(7, 2), crcs(7, 3)]), None);
    }
}
