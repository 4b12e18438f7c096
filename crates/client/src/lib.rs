//! The Floe client: a volume is a stack of layers (DESIGN.md section 3).
//!
//! - [`master`]: typed calls to the master (volume maps, chunk allocation).
//! - [`lease`]: the volume's single-writer lease.
//! - [`qos`]: rate limits from the master, in front of the stripe layer.
//! - [`stripe`]: the striping formula, and the layer that turns volume requests into
//!   chunk requests ([`stripe::Striped`], a [`floe_blockdev::BlockDevice`]).
//! - [`replicated`]: the chunk layer: the writer's side of the replication protocol
//!   (versions, majority commit, laggard reports, reads with version checks), and
//!   write-back's unsynced writes and FLUSH.
//! - [`flush_epoch`]: Blizzard's flush-epoch write mode, over all of it.
//! - [`log_commit`]: Blizzard's log-commit write mode, over all of it: a log with
//!   checkpoints and roll-forward in the volume's chunks.
//! - [`snapshot`]: snapshots: the writer's copy-on-write into delta chunks, and a
//!   snapshot's read-only chunk layer.
//! - [`stale`]: stale reads (Yogurt): a read-only attach reading each chunk from the
//!   replica of least cost, within a staleness bound.
//! - [`draining`]: counts the layers (flush-epoch, log-commit) still retiring
//!   acknowledged writes after they were dropped.
//!
//! [`open_volume`] composes them for a volume name: [flush-epoch | log-commit ->] qos
//! -> stripe -> [preserve | stale ->] replicated; [`open_snapshot`] a snapshot's: stripe ->
//! snapshot reader -> replicated.
pub mod draining;
pub mod flush_epoch;
pub mod lease;
pub mod log_commit;
pub mod master;
pub mod qos;
pub mod replicated;
pub mod snapshot;
pub mod stale;
pub mod stripe;

use floe_blockdev::BlockDevice;
use floe_protocol::{VolumeLimits, VolumeSpec, WriteMode};
use std::sync::Arc;

/// Bytes of writes acknowledged early (flush-epoch, log-commit) a volume may hold
/// unretired by default; beyond, writes wait (`floe gateway --unretired-limit`).
pub const UNRETIRED_LIMIT_DEFAULT: u64 = 64 << 20;

/// How a volume is opened.
pub enum Access<'a> {
    /// Writable, holding the volume's lease in the name of `holder`; at most
    /// `unretired_limit` bytes of writes acknowledged early are held in memory.
    Write {
        holder: &'a str,
        unretired_limit: u64,
    },
    /// Read-only: no lease, writes fail.
    Read,
    /// Read-only, each chunk from the replica of least cost, at most `staleness`
    /// behind the volume ([`stale`]).
    Stale { staleness: std::time::Duration },
}

/// Opens `name` through the master at `master` as a block device.
pub async fn open_volume(
    master: Arc<master::MasterClient>,
    name: &str,
    access: Access<'_>,
) -> Result<Arc<dyn BlockDevice>, String> {
    let (writable, limit) = match access {
        Access::Write {
            unretired_limit, ..
        } => (true, unretired_limit),
        Access::Read | Access::Stale { .. } => (false, UNRETIRED_LIMIT_DEFAULT),
    };
    let lease = match access {
        Access::Write { holder, .. } => {
            draining::drained_volume(name).await;
            Some(lease::Lease::acquire_waiting(master.clone(), name, holder).await?)
        }
        Access::Read | Access::Stale { .. } => None,
    };
    // Read once the lease is held: a lease waited for ends after the previous writer's
    // last allocation, which the map then holds.
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    // Without a lease there are no renewals: a read-only attach keeps the operator's
    // limits as of its opening.
    let limits = match &lease {
        Some(lease) => lease.limits(),
        None => {
            let qos = map.volume.qos;
            tokio::sync::watch::channel(VolumeLimits {
                all: qos,
                writes: qos,
            })
            .1
        }
    };
    let layout = stripe::Layout::of(&map.volume.spec);
    let size = map.volume.spec.size_bytes;
    // A log-commit volume's chunks hold its log: more than its size.
    let backing = map.volume.spec.backing_bytes();
    let write_mode = map.volume.spec.write_mode;
    // A writer preserves what snapshots need (a log-commit volume's: its log's chunks).
    let preserve = match &lease {
        Some(lease) => {
            let confirm = snapshot::preserve::Confirm {
                master: master.clone(),
                volume: name.to_string(),
                generation: lease.generation(),
            };
            Some((confirm, lease.snapshots()))
        }
        _ => None,
    };
    let parent = match &map.volume.parent {
        Some(parent) => Some(snapshot_chunks(master.clone(), parent).await?),
        None => None,
    };
    let chunks = replicated::ReplicatedChunks::new(master, map, lease);
    let device = match (parent, preserve) {
        // A clone's writer preserves what the clone read (its parent's blocks too).
        (Some(parent), Some((confirm, epochs))) => {
            let chunks = Arc::new(chunks);
            let clone = snapshot::read_through::ReadThrough::new(chunks.clone(), parent, true);
            let preserving = snapshot::Preserving::new(chunks, Arc::new(clone), epochs, confirm);
            stack(layout, backing, preserving, limits)
        }
        (Some(parent), None) => {
            let clone =
                snapshot::read_through::ReadThrough::new(Arc::new(chunks), parent, writable);
            stack(layout, backing, clone, limits)
        }
        (None, Some((confirm, epochs))) => {
            let chunks = Arc::new(chunks);
            let preserving = snapshot::Preserving::new(chunks.clone(), chunks, epochs, confirm);
            stack(layout, backing, preserving, limits)
        }
        (None, None) => match access {
            Access::Stale { staleness } => stack(
                layout,
                backing,
                stale::StaleReads::new(chunks, staleness),
                limits,
            ),
            _ => stack(layout, backing, chunks, limits),
        },
    };
    Ok(match write_mode {
        // The replicated layer writes unsynced and syncs at FLUSH.
        WriteMode::WriteThrough | WriteMode::WriteBack => device,
        WriteMode::FlushEpoch => Arc::new(flush_epoch::FlushEpoch::new(name, device, limit)),
        WriteMode::LogCommit => Arc::new(
            log_commit::LogCommit::open(name, device, size, writable, limit)
                .await
                .map_err(|e| format!("cannot open the log of volume {name}: {e}"))?,
        ),
    })
}

/// Rate limits over striping over `chunks`.
fn stack<C: stripe::ChunkIo>(
    layout: stripe::Layout,
    size: u64,
    chunks: C,
    limits: tokio::sync::watch::Receiver<VolumeLimits>,
) -> Arc<dyn BlockDevice> {
    Arc::new(qos::Qos::new(
        stripe::Striped::new(layout, size, chunks),
        limits,
    ))
}

/// Opens snapshot `snapshot` of volume `name` read-only (a `VOLUME@SNAPSHOT` export),
/// at the volume's size when it was taken, under the operator's rate limits as of
/// now.
pub async fn open_snapshot(
    master: Arc<master::MasterClient>,
    name: &str,
    snapshot: &str,
) -> Result<Arc<dyn BlockDevice>, String> {
    floe_protocol::snapshot::check_snapshot_name(snapshot)?;
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    let Some(taken) = map
        .volume
        .snapshots
        .iter()
        .find(|s| s.name == snapshot)
        .cloned()
    else {
        return Err(format!("volume {name} has no snapshot {snapshot:?}"));
    };
    if !taken.ready {
        return Err(format!(
            "snapshot {name}@{snapshot} is not taken yet: the gateway writing the volume \
             has not switched to it"
        ));
    }
    let layout = stripe::Layout::of(&map.volume.spec);
    let qos = map.volume.qos;
    let limits = tokio::sync::watch::channel(VolumeLimits {
        all: qos,
        writes: qos,
    })
    .1;
    let parent = match &map.volume.parent {
        Some(parent) => Some(snapshot_chunks(master.clone(), parent).await?),
        None => None,
    };
    let spec = VolumeSpec {
        size_bytes: taken.size_bytes,
        ..map.volume.spec.clone()
    };
    let chunks = replicated::ReplicatedChunks::new(master, map, None);
    let reader = snapshot::SnapshotChunks::new(chunks, taken.epoch, parent);
    let device = stack(layout, spec.backing_bytes(), reader, limits);
    if spec.write_mode != WriteMode::LogCommit {
        return Ok(device);
    }
    // The log as it was: recovered as after a crash at that moment (every write a
    // completed FUA write covered, a prefix of the rest).
    let log = log_commit::LogCommit::open(
        &format!("{name}@{snapshot}"),
        device,
        spec.size_bytes,
        false,
        UNRETIRED_LIMIT_DEFAULT,
    )
    .await
    .map_err(|e| format!("cannot read the log of snapshot {name}@{snapshot}: {e}"))?;
    Ok(Arc::new(log))
}

/// The chunks of a clone's parent snapshot (itself reading through to its own
/// parent when that volume is a clone too).
pub(crate) fn snapshot_chunks(
    master: Arc<master::MasterClient>,
    parent: &floe_protocol::snapshot::Parent,
) -> futures::future::BoxFuture<'_, Result<snapshot::SnapshotChunks, String>> {
    Box::pin(async move {
        let map = master
            .volume_map(&parent.volume)
            .await
            .map_err(|e| format!("the parent of a clone, {}: {e}", parent.volume))?;
        let grandparent = match &map.volume.parent {
            Some(up) => Some(snapshot_chunks(master.clone(), up).await?),
            None => None,
        };
        let chunks = replicated::ReplicatedChunks::new(master, map, None);
        Ok(snapshot::SnapshotChunks::new(
            chunks,
            parent.epoch,
            grandparent,
        ))
    })
}
