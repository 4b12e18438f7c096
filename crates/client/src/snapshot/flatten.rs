//! `floe volume flatten CLONE`: copies every block a clone still reads from its
//! parent snapshot into the clone's own chunks, at a bounded rate, under the clone's
//! lease (so it is refused while a gateway has the clone open); then the master
//! forgets the parent, and the snapshot can be deleted.

use super::read_through::ReadThrough;
use crate::lease::Lease;
use crate::master::MasterClient;
use crate::replicated::ReplicatedChunks;
use crate::stripe::ChunkIo;
use crate::{draining, snapshot_chunks};
use floe_protocol::snapshot::flatten_refused_for_snapshots;
use floe_protocol::{MasterRequest, MasterResponse};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Bytes of a chunk looked at per step.
const PIECE_BYTES: u64 = 1 << 20;

/// How far a flatten got: bytes of the parent's chunks looked at, of `total`, and
/// bytes copied.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub scanned: u64,
    pub total: u64,
    pub copied: u64,
}

/// Flattens clone `name`, copying at most `bytes_per_second` (0: unlimited); calls
/// `progress` after each step. Returns the bytes copied.
pub async fn flatten(
    master: Arc<MasterClient>,
    name: &str,
    bytes_per_second: u64,
    mut progress: impl FnMut(Progress),
) -> Result<u64, String> {
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    let Some(parent) = map.volume.parent.clone() else {
        return Err(format!("volume {name} is not a clone"));
    };
    if let Some(snapshot) = map.volume.snapshots.first() {
        return Err(flatten_refused_for_snapshots(name, &snapshot.name));
    }
    draining::drained_volume(name).await;
    let lease = Lease::acquire_waiting(master.clone(), name, "floe volume flatten")
        .await
        .map_err(|e| format!("{e} (a flatten needs the volume closed)"))?;
    let generation = lease.generation();
    // Read again under the lease: it holds the chunks the previous writer allocated.
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    if let Some(snapshot) = map.volume.snapshots.first() {
        return Err(flatten_refused_for_snapshots(name, &snapshot.name));
    }
    let spec = map.volume.spec.clone();
    let parent = snapshot_chunks(master.clone(), &parent).await?;
    let clone = ReadThrough::new(
        Arc::new(ReplicatedChunks::new(master.clone(), map, Some(lease))),
        parent,
        true,
    );
    let chunks: Vec<u64> = (0..spec.chunk_count())
        .filter(|index| clone.parent_holds(*index))
        .collect();
    let mut done = Progress {
        scanned: 0,
        total: chunks.len() as u64 * spec.chunk_bytes,
        copied: 0,
    };
    let started = Instant::now();
    for index in chunks {
        let mut at = 0;
        while at < spec.chunk_bytes {
            let n = PIECE_BYTES.min(spec.chunk_bytes - at);
            done.copied += clone
                .own(index, at, n)
                .await
                .map_err(|e| format!("copying chunk {index} at {at}: {e}"))?;
            at += n;
            done.scanned += n;
            progress(done);
            if bytes_per_second > 0 {
                let due = Duration::from_secs_f64(done.copied as f64 / bytes_per_second as f64);
                tokio::time::sleep_until(started + due).await;
            }
        }
    }
    clone
        .flush()
        .await
        .map_err(|e| format!("flushing {name}: {e}"))?;
    match master
        .call(MasterRequest::FlattenVolume {
            name: name.to_string(),
            generation,
        })
        .await
    {
        Ok(MasterResponse::Done) => Ok(done.copied),
        Ok(other) => Err(format!("master answered {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}
