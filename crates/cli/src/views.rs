//! `--json`: one JSON document on stdout per command. These structs are the CLI's
//! contract with scripts (docs/ARCHITECTURE.md lists the fields): a field is added,
//! never renamed or removed, whatever the wire protocol underneath does. Sizes are
//! bytes, rates per second, times Unix milliseconds or seconds as named.

use floe_protocol::{
    ChunkId, ClusterMapInfo, ClusterStatus, FsUsage, GatewayInfo, JournalUsage, RebalanceStatus,
    ReclaimStatus, RecoveryStatus, ScrubReport, ScrubStatus, ServerInfo, Volume, VolumeMap,
};
use serde::Serialize;

/// The `--json` flag every command with a JSON view takes.
#[derive(clap::Args, Clone, Copy)]
pub struct Format {
    /// Print one JSON document instead of text (fields: docs/ARCHITECTURE.md, "JSON
    /// output").
    #[arg(long)]
    pub json: bool,
}

/// Prints a document as one line of JSON.
pub fn print<T: Serialize>(document: &T) -> Result<(), String> {
    let text = serde_json::to_string(document).map_err(|e| format!("JSON output: {e}"))?;
    println!("{text}");
    Ok(())
}

#[derive(Serialize)]
pub struct QosView {
    /// 0: unlimited.
    pub iops: u64,
    pub bytes_per_second: u64,
}

#[derive(Serialize)]
pub struct VolumeView {
    pub id: u64,
    pub name: String,
    pub size_bytes: u64,
    pub mode: String,
    pub write_mode: String,
    pub replicas: u32,
    pub chunk_bytes: u64,
    pub stripe_unit_bytes: u64,
    pub stripe_count: u32,
    /// Chunks written so far (thin provisioning), of `chunks_total`.
    pub chunks_allocated: u64,
    pub chunks_total: u64,
    pub qos: QosView,
    pub snapshots: Vec<String>,
    /// A clone's parent snapshot, `VOLUME@SNAPSHOT`.
    pub parent: Option<String>,
}

impl From<&Volume> for VolumeView {
    fn from(v: &Volume) -> VolumeView {
        VolumeView {
            id: v.id,
            name: v.spec.name.clone(),
            size_bytes: v.spec.size_bytes,
            mode: v.spec.mode.to_string(),
            write_mode: v.spec.write_mode.to_string(),
            replicas: v.spec.replicas,
            chunk_bytes: v.spec.chunk_bytes,
            stripe_unit_bytes: v.spec.stripe_unit_bytes,
            stripe_count: v.spec.stripe_count,
            chunks_allocated: v.chunks_allocated,
            chunks_total: v.spec.chunk_count(),
            qos: QosView {
                iops: v.qos.iops,
                bytes_per_second: v.qos.bytes_per_second,
            },
            snapshots: v.snapshots.iter().map(|s| s.name.clone()).collect(),
            parent: v
                .parent
                .as_ref()
                .map(|p| format!("{}@{}", p.volume, p.snapshot)),
        }
    }
}

/// `floe volume list --json`.
#[derive(Serialize)]
pub struct VolumeList {
    pub volumes: Vec<VolumeView>,
}

#[derive(Serialize)]
pub struct ChunkView {
    /// Its index in the volume; a delta chunk's carries its snapshot epoch above bit 40.
    pub index: u64,
    /// Snapshot epoch of a delta chunk (copy-on-write), 0 for the volume's own.
    pub epoch: u32,
    /// Chunk server ids, primary first.
    pub servers: Vec<u32>,
    /// Servers among them known to have missed writes, being repaired.
    pub stale: Vec<u32>,
    pub view: u64,
    pub layer: u8,
    /// Placement group; null when the cluster map cannot be read.
    pub pg: Option<u32>,
}

/// `floe volume info NAME --json`.
#[derive(Serialize)]
pub struct VolumeInfo {
    #[serde(flatten)]
    pub volume: VolumeView,
    pub chunks: Vec<ChunkView>,
}

impl From<&VolumeMap> for VolumeInfo {
    fn from(map: &VolumeMap) -> VolumeInfo {
        let placer = floe_placement::cluster::Placer::new(&map.cluster).ok();
        let chunks = map
            .chunks
            .iter()
            .map(|c| ChunkView {
                index: c.index,
                epoch: floe_protocol::snapshot::split_index(c.index).0,
                servers: c.replicas.clone(),
                stale: c.stale.clone(),
                view: c.view,
                layer: c.layer,
                pg: placer.as_ref().map(|p| {
                    let id = ChunkId {
                        volume_id: map.volume.id,
                        index: c.index,
                    };
                    p.pg_of(id, c.layer)
                }),
            })
            .collect();
        VolumeInfo {
            volume: VolumeView::from(&map.volume),
            chunks,
        }
    }
}

#[derive(Serialize)]
pub struct ServerView {
    pub id: u32,
    pub host: String,
    pub address: String,
    /// ssd or hdd.
    pub class: String,
    /// Hard-disk latencies emulated (`--emulate-hdd`).
    pub emulated: bool,
    /// up, down or lost.
    pub state: &'static str,
    /// Chunk data it holds.
    pub used_bytes: u64,
    /// Declared at registration (or its file system's size then).
    pub capacity_bytes: u64,
    /// Its data directory's file system from its last heartbeat; null before one.
    pub file_system: Option<FsUsage>,
    /// Its hybrid-mode journals; null when it has none.
    pub journal: Option<JournalUsage>,
    /// Blocks it found failing their checksums since the master started.
    pub corrupt_blocks: u64,
}

impl ServerView {
    pub fn new(s: &ServerInfo, journal: Option<JournalUsage>) -> ServerView {
        ServerView {
            id: s.id,
            host: s.host.clone(),
            address: s.address.clone(),
            class: s.class.to_string(),
            emulated: s.emulated,
            state: if s.lost {
                "lost"
            } else if s.up {
                "up"
            } else {
                "down"
            },
            used_bytes: s.used_bytes,
            capacity_bytes: s.capacity_bytes,
            file_system: s.fs,
            journal,
            corrupt_blocks: s.corrupt_blocks,
        }
    }
}

/// Cluster totals, each file system counted once however many servers share it.
#[derive(Serialize)]
pub struct Totals {
    pub hosts: usize,
    pub servers: usize,
    pub servers_up: usize,
    pub file_systems: usize,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
}

#[derive(Serialize)]
pub struct ThrottledView {
    pub volume: String,
    pub writes: QosView,
    pub reason: String,
}

/// `floe status --json`. The sections below `throttled` are the master's own status
/// records, field for field.
#[derive(Serialize)]
pub struct StatusView<'a> {
    /// The master that answered (the leader, of several).
    pub leader: String,
    pub cluster: Totals,
    pub servers: Vec<ServerView>,
    pub volumes: Vec<VolumeView>,
    pub throttled: Vec<ThrottledView>,
    pub recovery: &'a RecoveryStatus,
    pub rebalance: &'a RebalanceStatus,
    pub scrub: &'a ScrubStatus,
    pub reclaim: &'a ReclaimStatus,
    /// `name`, `address`, `holder`, `seen_ms_ago`, `volumes` (whose lease it holds).
    pub gateways: &'a [GatewayInfo],
}

impl<'a> StatusView<'a> {
    pub fn new(status: &'a ClusterStatus, leader: String, cluster: Totals) -> StatusView<'a> {
        let journal = |id| {
            status
                .qos
                .journals
                .iter()
                .find(|(server, _)| *server == id)
                .map(|(_, j)| *j)
        };
        StatusView {
            leader,
            cluster,
            servers: status
                .servers
                .iter()
                .map(|s| ServerView::new(s, journal(s.id)))
                .collect(),
            volumes: status.volumes.iter().map(VolumeView::from).collect(),
            throttled: status
                .qos
                .throttled
                .iter()
                .map(|t| ThrottledView {
                    volume: t.volume.clone(),
                    writes: QosView {
                        iops: t.writes.iops,
                        bytes_per_second: t.writes.bytes_per_second,
                    },
                    reason: t.reason.clone(),
                })
                .collect(),
            recovery: &status.recovery,
            rebalance: &status.rebalance,
            scrub: &status.scrub,
            reclaim: &status.reclaim,
            gateways: &status.gateways,
        }
    }
}

#[derive(Serialize)]
pub struct SnapshotView {
    pub name: String,
    pub epoch: u32,
    pub created_ms: u64,
    /// The volume's size when it was taken.
    pub size_bytes: u64,
    /// Blocks preserved from it on until the next snapshot.
    pub preserved_bytes: u64,
    pub ready: bool,
}

/// `floe snapshot list VOLUME --json`.
#[derive(Serialize)]
pub struct SnapshotList {
    pub volume: String,
    pub snapshots: Vec<SnapshotView>,
    /// Preserved for deleted snapshots, being freed in the background.
    pub deleted_preserved_bytes: u64,
}

#[derive(Serialize)]
pub struct LayerView {
    pub id: u8,
    /// Layers merged into one share it.
    pub timestamp: u64,
    pub pgs_created: u32,
    pub pgs_now: u32,
    pub servers: Vec<u32>,
    /// Shrunk away: no placement group left.
    pub removed: bool,
}

#[derive(Serialize)]
pub struct PendingServer {
    pub id: u32,
    pub host: String,
    pub class: String,
}

/// `floe cluster map --json`.
#[derive(Serialize)]
pub struct ClusterMapView {
    pub epoch: u64,
    pub mode: String,
    pub pgs_per_layer: u32,
    pub layers: Vec<LayerView>,
    /// Servers marked lost.
    pub out: Vec<u32>,
    /// Registered servers not in the map yet (`floe cluster expand` adds them).
    pub pending: Vec<PendingServer>,
}

impl From<&ClusterMapInfo> for ClusterMapView {
    fn from(info: &ClusterMapInfo) -> ClusterMapView {
        ClusterMapView {
            epoch: info.map.epoch,
            mode: info.map.mode.to_string(),
            pgs_per_layer: info.map.pgs_per_layer,
            layers: info
                .layers
                .iter()
                .map(|l| LayerView {
                    id: l.id,
                    timestamp: l.timestamp,
                    pgs_created: l.pgs_created,
                    pgs_now: l.pgs_placed,
                    servers: l.devices.clone(),
                    removed: l.removed,
                })
                .collect(),
            out: info.map.out.clone(),
            pending: info
                .pending
                .iter()
                .map(|s| PendingServer {
                    id: s.id,
                    host: s.host.clone(),
                    class: s.device(),
                })
                .collect(),
        }
    }
}

#[derive(Serialize)]
pub struct LostBlock {
    /// Byte offset in the volume, and where it lies in its chunk.
    pub offset: u64,
    pub chunk: u64,
    pub chunk_offset: u64,
}

/// `floe scrub NAME --json`.
#[derive(Serialize)]
pub struct ScrubView {
    pub volume: String,
    pub chunks: u64,
    /// Chunks whose replicas could not be compared.
    pub skipped: u64,
    pub differences: u64,
    pub repaired: u64,
    pub healed_blocks: u64,
    pub lost_blocks: Vec<LostBlock>,
    /// Every difference found, as text.
    pub details: Vec<String>,
    /// Every chunk compared and every difference repaired.
    pub clean: bool,
}

impl ScrubView {
    pub fn new(volume: &str, report: &ScrubReport) -> ScrubView {
        ScrubView {
            volume: volume.to_string(),
            chunks: report.chunks,
            skipped: report.skipped,
            differences: report.differences,
            repaired: report.repaired,
            healed_blocks: report.healed_blocks,
            lost_blocks: report
                .lost_blocks
                .iter()
                .map(|&(offset, chunk, chunk_offset)| LostBlock {
                    offset,
                    chunk,
                    chunk_offset,
                })
                .collect(),
            details: report.details.clone(),
            clean: is_clean(report),
        }
    }
}

pub fn is_clean(report: &ScrubReport) -> bool {
    report.differences <= report.repaired && report.skipped == 0
}
