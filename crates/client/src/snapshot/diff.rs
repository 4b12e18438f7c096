//! What changed between a snapshot and a later one (or the live volume): the blocks
//! the deltas of the epochs between them preserved (each is a block first written in
//! one of those epochs), and the blocks of every chunk allocated since. For `floe volume diff` and
//! the NBD meta context `floe:changed-since:SNAPSHOT`; and what the deltas hold, for
//! `floe snapshot list`.

use super::blocks::Blocks;
use crate::master::MasterClient;
use crate::replicated::ReplicatedChunks;
use floe_protocol::snapshot::{delta_index, split_index, SNAPSHOT_BLOCK_BYTES};
use floe_protocol::{Snapshot, VolumeSpec, WriteMode};
use std::sync::Arc;

/// Ranges of a volume, (offset, length), sorted and merged.
pub type Ranges = Vec<(u64, u64)>;

fn snapshot<'a>(
    snapshots: &'a [Snapshot],
    volume: &str,
    name: &str,
) -> Result<&'a Snapshot, String> {
    let found = snapshots
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| format!("volume {volume} has no snapshot {name:?}"))?;
    if !found.ready {
        return Err(format!("snapshot {volume}@{name} is not taken yet"));
    }
    Ok(found)
}

/// The ranges of volume `name` that differ between snapshot `since` and snapshot
/// `until` (`None`: the volume now). Block-exact (4 KiB) for chunks that existed at
/// `since`; for a chunk allocated after it, every block it holds or its deltas
/// kept.
pub async fn changed(
    master: Arc<MasterClient>,
    name: &str,
    since: &str,
    until: Option<&str>,
) -> Result<Ranges, String> {
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    if map.volume.spec.write_mode == WriteMode::LogCommit {
        return Err(format!(
            "volume {name} is log-commit: its chunks hold a log, so what changed is not \
             known per block (copy the whole snapshot instead)"
        ));
    }
    let from = snapshot(&map.volume.snapshots, name, since)?.epoch;
    let to = match until {
        Some(until) => Some(snapshot(&map.volume.snapshots, name, until)?.epoch),
        None => None,
    };
    if to.is_some_and(|to| to < from) {
        return Err(format!(
            "snapshot {name}@{} is older than {name}@{since}",
            until.unwrap_or_default()
        ));
    }
    let spec = map.volume.spec.clone();
    let mut live: Vec<(u64, u32)> = map
        .chunks
        .iter()
        .filter(|c| split_index(c.index).0 == 0)
        .map(|c| (c.index, c.born))
        .collect();
    live.sort_unstable();
    let chunks = ReplicatedChunks::new(master, map, None);
    let mut ranges = Vec::new();
    for (index, born) in live {
        if to.is_some_and(|to| born >= to) {
            continue;
        }
        let mut blocks = Blocks::default();
        // A chunk allocated since `from` changed wherever it held data at `until`:
        // within what it holds now and what its deltas kept.
        if born >= from {
            let extents = chunks.extents(index).await.map_err(|e| e.to_string())?;
            blocks.extend(&Blocks::from_extents(&extents));
        }
        for epoch in chunks.delta_epochs(index, if born >= from { 1 } else { from }) {
            if to.is_some_and(|to| epoch >= to) && born < from {
                break;
            }
            let extents = chunks
                .extents(delta_index(epoch, index))
                .await
                .map_err(|e| e.to_string())?;
            blocks.extend(&Blocks::from_extents(&extents));
        }
        let within = blocks.runs().map(|r| {
            (
                r.start * SNAPSHOT_BLOCK_BYTES,
                (r.end - r.start) * SNAPSHOT_BLOCK_BYTES,
            )
        });
        for (offset, length) in within {
            volume_ranges(&spec, index, offset, length, &mut ranges);
        }
    }
    Ok(merge(ranges, spec.size_bytes))
}

/// The volume ranges of `offset..offset + length` of chunk `index`: one per stripe
/// unit it touches.
fn volume_ranges(spec: &VolumeSpec, index: u64, offset: u64, length: u64, out: &mut Ranges) {
    let unit = spec.stripe_unit_bytes;
    let end = (offset + length).min(spec.chunk_bytes);
    let mut at = offset;
    while at < end {
        let piece = (unit - at % unit).min(end - at);
        out.push((spec.volume_offset(index, at), piece));
        at += piece;
    }
}

/// Sorted, adjacent and overlapping ranges joined, clamped to `size`.
fn merge(mut ranges: Ranges, size: u64) -> Ranges {
    ranges.sort_unstable();
    let mut out: Ranges = Vec::with_capacity(ranges.len());
    for (offset, length) in ranges {
        let end = (offset + length).min(size);
        if offset >= end {
            continue;
        }
        match out.last_mut() {
            Some((o, l)) if *o + *l >= offset => *l = (*l).max(end - *o),
            _ => out.push((offset, end - offset)),
        }
    }
    out
}

/// Bytes the deltas of each epoch hold (the blocks writes of that epoch preserved),
/// by epoch, for volume `name`.
pub async fn preserved_bytes(
    master: Arc<MasterClient>,
    name: &str,
) -> Result<std::collections::BTreeMap<u32, u64>, String> {
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    let deltas: Vec<u64> = map
        .chunks
        .iter()
        .map(|c| c.index)
        .filter(|index| split_index(*index).0 > 0)
        .collect();
    let chunks = ReplicatedChunks::new(master, map, None);
    let mut bytes = std::collections::BTreeMap::new();
    for index in deltas {
        let extents = chunks.extents(index).await.map_err(|e| e.to_string())?;
        *bytes.entry(split_index(index).0).or_default() += extents.iter().map(|e| e.1).sum::<u64>();
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_ranges_map_through_the_stripes_and_merge() {
        let spec = VolumeSpec {
            name: "v".into(),
            size_bytes: 1 << 30,
            replicas: 3,
            chunk_bytes: 64 << 20,
            stripe_unit_bytes: 64 << 10,
            stripe_count: 4,
            mode: Default::default(),
            write_mode: Default::default(),
        };
        let mut out = Vec::new();
        // Two units of chunk 1: the second and sixth units of the volume.
        volume_ranges(&spec, 1, 0, 128 << 10, &mut out);
        assert_eq!(out, vec![(64 << 10, 64 << 10), (5 * (64 << 10), 64 << 10)]);
        // Chunk 0's first unit joins chunk 1's.
        volume_ranges(&spec, 0, 60 << 10, 4 << 10, &mut out);
        assert_eq!(
            merge(out, spec.size_bytes),
            vec![(60 << 10, 68 << 10), (5 * (64 << 10), 64 << 10)]
        );
    }
}
