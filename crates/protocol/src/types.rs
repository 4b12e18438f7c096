//! Cluster objects every process shares: what the master stores and hands out.

use serde::{Deserialize, Serialize};

/// Chunk indexes on the wire stay below this; a chunk server keeps the ones above for
/// itself (the staging copy of a chunk under a whole-copy repair).
pub const CHUNK_INDEX_LIMIT: u64 = 1 << 62;

/// One chunk of one volume; a replica of it lives on each of its chunk servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkId {
    pub volume_id: u64,
    pub index: u64,
}

/// GetCost (Yogurt, thesis chapter 5): the expected cost of reading a block at a
/// replica now, ordered cheapest first; the chained-log engine's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadCost {
    /// Never written (reads as zeroes) or in the RAM or flash tail cache.
    Cache,
    /// On a body disk the cleaner is not reading.
    BodyIdle,
    /// On the disk holding the head while the cleaner runs.
    BodyCleaning,
    /// On the tail's disk.
    TailDisk,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceClass {
    Ssd,
    Hdd,
}

impl std::str::FromStr for DeviceClass {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ssd" => Ok(DeviceClass::Ssd),
            "hdd" => Ok(DeviceClass::Hdd),
            _ => Err(format!("device class {s:?} is not one of: ssd, hdd")),
        }
    }
}

impl std::fmt::Display for DeviceClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceClass::Ssd => "ssd",
            DeviceClass::Hdd => "hdd",
        })
    }
}

pub type ServerId = u32;

/// A chunk server as registered with the master.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    pub id: ServerId,
    /// Stable identity kept in the server's data directory.
    pub uuid: String,
    pub address: String,
    pub host: String,
    pub class: DeviceClass,
    /// The device's hdd latencies are emulated (`--emulate-hdd`), for tests.
    #[serde(default)]
    pub emulated: bool,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    /// Filled in by the master from heartbeats; not stored.
    #[serde(default)]
    pub up: bool,
    /// Declared permanently failed by an operator (`floe chunkserver mark-lost`): its
    /// replicas no longer count towards a chunk's majority.
    #[serde(default)]
    pub lost: bool,
    /// Blocks this server found failing their checksums since the master started.
    #[serde(default)]
    pub corrupt_blocks: u64,
    /// Its data directory's file system, from its last heartbeat; not stored.
    #[serde(default)]
    pub fs: Option<FsUsage>,
}

/// A chunk server's file system as its heartbeats report it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsUsage {
    /// Tells file systems apart on one host: servers sharing one report the same.
    pub device: u64,
    /// The running kernel's boot id (its first 64 bits): device numbers are unique
    /// within one kernel, so servers reporting the same kernel and device share one
    /// file system, even when they name different hosts (`floe demo`'s emulated
    /// ones, containers). 0 from servers that do not know it: their host stands in.
    #[serde(default)]
    pub kernel: u64,
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// What new writes may still take: free space less what writes in flight and
    /// journaled data hold, and less the floor kept for deletes and trims.
    pub writable_bytes: u64,
    /// It refused a write for space lately, or little is left: new copies go
    /// elsewhere.
    pub short: bool,
}

impl FsUsage {
    /// Percent of the file system in use.
    pub fn percent_used(&self) -> u64 {
        (self.total_bytes - self.free_bytes.min(self.total_bytes)) * 100 / self.total_bytes.max(1)
    }
}

impl ServerInfo {
    /// The device class as every output shows it: an emulated hdd says so.
    pub fn device(&self) -> String {
        if self.emulated {
            format!("{} (emulated)", self.class)
        } else {
            self.class.to_string()
        }
    }
}

/// Where a change sits in its chunk's history (URSA section 4.2.1). The writer, the
/// single lease holder of the volume, numbers each chunk's changes: `version` applies
/// on top of `prev`. The high 32 bits of a version are the lease generation that wrote
/// it, so a new writer's history always sorts after an old one's, and two writers can
/// never produce the same version with different contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Stamp {
    /// The chunk's replica-set view the writer believes in.
    pub view: u64,
    pub prev: u64,
    pub version: u64,
}

/// The lease generation that wrote `version`.
pub fn generation_of(version: u64) -> u32 {
    (version >> 32) as u32
}

/// The version a writer of `generation` gives the change after `prev`.
pub fn next_version(prev: u64, generation: u32) -> u64 {
    if generation_of(prev) < generation {
        (generation as u64) << 32 | 1
    } else {
        prev + 1
    }
}

/// What a user asks for when creating a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeSpec {
    pub name: String,
    pub size_bytes: u64,
    pub replicas: u32,
    pub chunk_bytes: u64,
    pub stripe_unit_bytes: u64,
    pub stripe_count: u32,
    /// Which device classes hold the replicas.
    #[serde(default)]
    pub mode: VolumeMode,
    /// When a write is acknowledged (Blizzard's write modes); the gateway reads it
    /// when it opens the volume.
    #[serde(default)]
    pub write_mode: WriteMode,
}

/// When a volume's writes are acknowledged, and what survives a crash of the gateway
/// (Blizzard, NSDI'14 section 2.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WriteMode {
    /// Once durable on the replicas: every acknowledged write survives.
    #[default]
    WriteThrough,
    /// Once accepted by the replicas, before they sync it; a FLUSH makes every
    /// earlier write durable (the replicas sync). FUA writes are durable before their
    /// reply.
    WriteBack,
    /// At once; a FLUSH is an ordering point: a crash keeps a prefix of the epochs
    /// between FLUSHes. FUA writes are durable before their reply.
    FlushEpoch,
    /// At once, and issued at once to a log (Blizzard 2.5.3, [`crate::log_commit`]):
    /// a FLUSH is an ordering point as in flush-epoch, and a crash keeps a prefix of
    /// the acknowledged writes, with less at risk than flush-epoch. Chosen at create:
    /// the volume's chunks hold a log, not the blocks in place.
    LogCommit,
}

impl WriteMode {
    const NAMES: [(&'static str, WriteMode); 4] = [
        ("write-through", WriteMode::WriteThrough),
        ("write-back", WriteMode::WriteBack),
        ("flush-epoch", WriteMode::FlushEpoch),
        ("log-commit", WriteMode::LogCommit),
    ];
}

impl std::str::FromStr for WriteMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        WriteMode::NAMES
            .iter()
            .find(|(name, _)| *name == s)
            .map(|(_, mode)| *mode)
            .ok_or_else(|| {
                let names: Vec<&str> = WriteMode::NAMES.iter().map(|(n, _)| *n).collect();
                format!("write mode {s:?} is not one of: {}", names.join(", "))
            })
    }
}

impl std::fmt::Display for WriteMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = WriteMode::NAMES
            .iter()
            .find(|(_, mode)| mode == self)
            .map(|(name, _)| *name)
            .expect("every mode is named");
        f.write_str(name)
    }
}

impl VolumeSpec {
    /// The volume byte stored at `offset` of chunk `index`: the inverse of the
    /// striping formula (`floe_client::stripe::Layout::locate`).
    pub fn volume_offset(&self, index: u64, offset: u64) -> u64 {
        let (unit, count) = (self.stripe_unit_bytes, self.stripe_count as u64);
        let set = index / count;
        let stripe = set * (self.chunk_bytes / unit) + offset / unit;
        (stripe * count + index % count) * unit + offset % unit
    }
}

/// How a volume's replicas use the device classes (URSA section 3.2). A class that
/// has too few hosts is filled in from the other, so a volume always gets its
/// replicas on distinct hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VolumeMode {
    /// Every replica on `ssd`.
    Ssd,
    /// The primary on `ssd`, the backups on `hdd` (behind their journals).
    #[default]
    Hybrid,
    /// Every replica on `hdd`.
    Hdd,
}

impl std::str::FromStr for VolumeMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ssd" => Ok(VolumeMode::Ssd),
            "hybrid" => Ok(VolumeMode::Hybrid),
            "hdd" => Ok(VolumeMode::Hdd),
            _ => Err(format!("volume mode {s:?} is not one of: ssd, hybrid, hdd")),
        }
    }
}

impl std::fmt::Display for VolumeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VolumeMode::Ssd => "ssd",
            VolumeMode::Hybrid => "hybrid",
            VolumeMode::Hdd => "hdd",
        })
    }
}

/// Volume defaults from DESIGN.md section 2.
pub const CHUNK_BYTES_DEFAULT: u64 = 64 << 20;
pub const STRIPE_UNIT_BYTES_DEFAULT: u64 = 64 << 10;
pub const STRIPE_COUNT_DEFAULT: u32 = 4;

impl VolumeSpec {
    /// Chunks the volume spans. A last, partial object set still deals its stripe units
    /// round-robin, so it touches up to `stripe_count` chunks, not size / chunk size.
    pub fn chunk_count(&self) -> u64 {
        let count = self.stripe_count as u64;
        let set_bytes = self.chunk_bytes * count;
        let backing = self.backing_bytes();
        let partial_units = (backing % set_bytes).div_ceil(self.stripe_unit_bytes);
        backing / set_bytes * count + partial_units.min(count)
    }

    /// The bytes the volume's chunks hold: its size, or for a log-commit volume its
    /// log and checkpoints.
    pub fn backing_bytes(&self) -> u64 {
        match self.write_mode {
            WriteMode::LogCommit => crate::log_commit::Layout::of(self.size_bytes).backing_bytes(),
            _ => self.size_bytes,
        }
    }

    /// Checks the layout rules the striping formula relies on.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty()
            || self.name.len() > 128
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(format!(
                "volume name {:?} must be 1-128 characters of letters, digits, '-', '_' or '.'",
                self.name
            ));
        }
        if self.size_bytes == 0 || !self.size_bytes.is_multiple_of(512) {
            return Err(format!(
                "volume size {} must be a positive multiple of 512 bytes",
                self.size_bytes
            ));
        }
        if self.write_mode == WriteMode::LogCommit {
            crate::log_commit::check_size(self.size_bytes)?;
        }
        if self.replicas == 0 || self.replicas > 8 {
            return Err(format!(
                "replicas {} must be between 1 and 8",
                self.replicas
            ));
        }
        let unit = self.stripe_unit_bytes;
        if unit < 4096 || !unit.is_power_of_two() {
            return Err(format!(
                "stripe unit {unit} must be a power of two of at least 4096 bytes"
            ));
        }
        if self.chunk_bytes < unit
            || !self.chunk_bytes.is_multiple_of(unit)
            || self.chunk_bytes > 1 << 30
        {
            return Err(format!(
                "chunk size {} must be a multiple of the stripe unit {unit} and at most 1 GiB",
                self.chunk_bytes
            ));
        }
        if self.stripe_count == 0 || self.stripe_count > 64 {
            return Err(format!(
                "stripe count {} must be between 1 and 64",
                self.stripe_count
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub id: u64,
    #[serde(flatten)]
    pub spec: VolumeSpec,
    /// Chunks allocated so far (thin provisioning).
    #[serde(default)]
    pub chunks_allocated: u64,
    /// The operator's rate limits (`floe volume set-qos`).
    #[serde(default)]
    pub qos: QosLimits,
    /// The newest snapshot epoch handed out (see [`crate::snapshot`]).
    #[serde(default)]
    pub snapshot_epoch: u32,
    /// Snapshots not deleted, oldest first.
    #[serde(default)]
    pub snapshots: Vec<crate::Snapshot>,
    /// A clone's parent snapshot.
    #[serde(default)]
    pub parent: Option<crate::snapshot::Parent>,
}

/// Rate limits of one volume's I/O; 0 means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosLimits {
    #[serde(default)]
    pub iops: u64,
    #[serde(default)]
    pub bytes_per_second: u64,
}

impl QosLimits {
    pub fn is_unlimited(&self) -> bool {
        self.iops == 0 && self.bytes_per_second == 0
    }
}

/// What a volume's writer enforces, from the master with each lease grant and renewal:
/// the operator's limits on all I/O, and journal back-pressure on writes only (reads
/// do not fill journals).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeLimits {
    pub all: QosLimits,
    pub writes: QosLimits,
}

/// A chunk server's hybrid-mode journal fill, from its heartbeats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalUsage {
    pub used_bytes: u64,
    /// 0: the server has no journal.
    pub quota_bytes: u64,
}

/// A volume whose writes the master slows down because a journal holding its chunks
/// is nearly full.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Throttled {
    pub volume: String,
    pub writes: QosLimits,
    pub reason: String,
}

/// Journals and write throttling, for `floe status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosStatus {
    /// Servers that have a journal.
    pub journals: Vec<(ServerId, JournalUsage)>,
    pub throttled: Vec<Throttled>,
}

/// Where the replicas of an allocated chunk live; the first is the primary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkPlacement {
    pub index: u64,
    pub replicas: Vec<ServerId>,
    /// Bumped by the master at each change of the replica set (URSA's view number).
    #[serde(default)]
    pub view: u64,
    /// Replicas known to have missed writes: not written to or read from until the
    /// master has repaired them and bumped the view.
    #[serde(default)]
    pub stale: Vec<ServerId>,
    /// The cluster-map layer the chunk was created in (MAPX: one byte per chunk); with
    /// the chunk id it fixes the chunk's placement group for good.
    #[serde(default)]
    pub layer: u8,
    /// The volume's newest snapshot epoch when the chunk was allocated: snapshots of
    /// that epoch and older read it as zeroes.
    #[serde(default)]
    pub born: u32,
}

/// How placement groups map to chunk servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlacementMode {
    /// Plain CRUSH over every device: growth moves data.
    Crush,
    /// CRUSH under MAPX time layers: growth moves nothing.
    #[default]
    Mapx,
}

impl std::str::FromStr for PlacementMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "crush" => Ok(PlacementMode::Crush),
            "mapx" => Ok(PlacementMode::Mapx),
            _ => Err(format!("placement mode {s:?} is not one of: crush, mapx")),
        }
    }
}

impl std::fmt::Display for PlacementMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PlacementMode::Crush => "crush",
            PlacementMode::Mapx => "mapx",
        })
    }
}

/// A chunk server as the cluster map knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapDevice {
    pub id: ServerId,
    pub host: String,
    pub class: DeviceClass,
    /// CRUSH weight, 16.16 fixed point.
    pub weight: u32,
}

/// One change of the cluster map. Every process replays a map's changes in order to
/// get the same placement (`floe_placement::cluster`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MapChange {
    /// New devices: a new layer (mapx), or more of the one hierarchy (crush).
    Expand { devices: Vec<MapDevice> },
    /// Points a placement group at another layer.
    Remap { pg: u32, layer: u8 },
    /// Empties a layer, spreading its placement groups over the others by weight.
    Shrink { layer: u8 },
    /// Gives two layers one timestamp: they are then placed as one.
    Merge { a: u8, b: u8 },
}

/// The versioned cluster map: who holds what is a function of it and of each chunk's
/// id and creation layer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMap {
    /// Bumped by every change; 0 while no device has joined.
    pub epoch: u64,
    pub mode: PlacementMode,
    /// Placement groups each layer brings (MAPX's INIT_PG_NUM), or all of them in crush
    /// mode.
    pub pgs_per_layer: u32,
    pub changes: Vec<MapChange>,
    /// Devices declared lost: CRUSH reweight 0, so their data is placed elsewhere.
    #[serde(default)]
    pub out: Vec<ServerId>,
}

impl ClusterMap {
    /// Every device that joined, in joining order.
    pub fn devices(&self) -> impl Iterator<Item = &MapDevice> {
        self.changes.iter().flat_map(|c| match c {
            MapChange::Expand { devices } => devices.as_slice(),
            _ => &[],
        })
    }
}

/// Everything a gateway needs to serve a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMap {
    pub volume: Volume,
    pub chunks: Vec<ChunkPlacement>,
    pub servers: Vec<ServerInfo>,
    /// The map new chunks are placed with.
    #[serde(default)]
    pub cluster: ClusterMap,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub servers: Vec<ServerInfo>,
    pub volumes: Vec<Volume>,
    #[serde(default)]
    pub recovery: RecoveryStatus,
    #[serde(default)]
    pub rebalance: RebalanceStatus,
    #[serde(default)]
    pub qos: QosStatus,
    #[serde(default)]
    pub scrub: ScrubStatus,
    #[serde(default)]
    pub reclaim: ReclaimStatus,
    /// Gateways the master hears from (their polls), and the volumes they hold.
    #[serde(default)]
    pub gateways: Vec<crate::GatewayInfo>,
}

/// The space of deleted snapshots, freed in the background, for `floe status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimStatus {
    /// Delta chunks no snapshot reads, not freed yet, and their size at most.
    pub chunks_left: u64,
    pub bytes_left: u64,
    /// Since the master started.
    pub chunks_freed: u64,
    /// Over the last seconds (rounded up), and the configured limit (0: none).
    pub chunks_per_second: u64,
    pub limit_per_second: u32,
    pub eta_seconds: Option<u64>,
    /// Why the last chunk that could not be freed waits (a server down).
    pub waiting: Option<String>,
}

/// Block checksums and scrub, for `floe status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubStatus {
    /// Seconds between background scrubs of every volume (0: off).
    pub interval_seconds: u64,
    /// Background passes finished since the master started.
    pub passes: u64,
    /// The pass under way: chunks checked of the chunks it covers, its read rate
    /// over all replicas, and the time it needs for the rest.
    pub running: bool,
    pub chunks_checked: u64,
    pub chunks_total: u64,
    pub bytes_per_second: u64,
    pub eta_seconds: Option<u64>,
    /// Since the master started, by reads, scrubs and background passes: blocks found
    /// failing their checksums and rewritten from good copies, and blocks no replica
    /// holds good (the latest few named).
    pub healed_blocks: u64,
    pub lost_blocks: u64,
    pub lost: Vec<String>,
    /// Scrubs an operator asked for (`floe scrub`) under way, for their progress.
    #[serde(default)]
    pub volumes: Vec<VolumeScrub>,
}

/// An operator's scrub of one volume under way: chunks checked of its chunks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeScrub {
    pub volume: String,
    pub chunks_checked: u64,
    pub chunks_total: u64,
}

/// The cluster map and the replica moves that bring chunks to where it places them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalanceStatus {
    pub mode: PlacementMode,
    pub epoch: u64,
    /// Live layers (mapx), or 1 (crush).
    pub layers: u32,
    /// Registered servers not in the map yet.
    pub pending_servers: u32,
    /// Healthy chunks whose replicas are not where the map places them.
    pub misplaced_chunks: u64,
    pub moving: u64,
    pub moved_chunks: u64,
    pub bytes_moved: u64,
    pub bytes_per_second: u64,
    pub eta_seconds: Option<u64>,
    pub last_error: Option<String>,
}

/// Redundancy and the master's repair work, for `floe status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryStatus {
    /// Allocated chunks with fewer good replicas than asked for.
    pub degraded_chunks: u64,
    /// Degraded chunks that cannot be repaired until an operator acts: fewer than a
    /// majority of their replicas are reachable (see `floe chunkserver mark-lost`).
    pub waiting_for_operator: u64,
    pub in_progress: u64,
    /// Volumes whose lease ended unreleased (ran out, or was taken over), whose
    /// replicas the master has yet to compare (a replica the old writer left behind
    /// unreported is then repaired).
    #[serde(default)]
    pub volumes_to_audit: u64,
    pub repaired_chunks: u64,
    pub incremental_repairs: u64,
    /// Repairs that copied only the blocks whose fingerprints differ.
    #[serde(default)]
    pub compared_copies: u64,
    pub full_copies: u64,
    pub bytes_copied: u64,
    /// Copy rate over the last few seconds.
    pub bytes_per_second: u64,
    /// Estimate of the time to full redundancy, when there is work left.
    pub eta_seconds: Option<u64>,
    /// Last failure, if the last attempt failed.
    pub last_error: Option<String>,
}

/// What `floe scrub` found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubReport {
    pub chunks: u64,
    /// Chunks whose replicas could not be compared (unreachable, or never settled on
    /// one version while writes were running).
    pub skipped: u64,
    /// Chunks whose replicas differed at equal versions (or in version) before repair.
    pub differences: u64,
    pub repaired: u64,
    /// Blocks that failed their checksums on some replica and were rewritten from a
    /// good copy.
    #[serde(default)]
    pub healed_blocks: u64,
    /// Blocks with no good copy left, as (volume byte offset, chunk index, offset in
    /// the chunk); nothing was changed for them.
    #[serde(default)]
    pub lost_blocks: Vec<(u64, u64, u64)>,
    pub details: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_in(write_mode: WriteMode, size_bytes: u64) -> VolumeSpec {
        VolumeSpec {
            name: "v".into(),
            size_bytes,
            replicas: 3,
            chunk_bytes: 64 << 20,
            stripe_unit_bytes: 64 << 10,
            stripe_count: 4,
            mode: VolumeMode::Hybrid,
            write_mode,
        }
    }

    #[test]
    fn chunk_count_covers_partial_object_sets() {
        let spec = |size_bytes| spec_in(WriteMode::WriteThrough, size_bytes);
        assert_eq!(spec(64 << 10).chunk_count(), 1);
        assert_eq!(spec(128 << 10).chunk_count(), 2);
        assert_eq!(
            spec(64 << 20).chunk_count(),
            4,
            "64 MiB spreads over 4 chunks"
        );
        assert_eq!(spec(256 << 20).chunk_count(), 4);
        assert_eq!(spec((256 << 20) + 512).chunk_count(), 5);
        assert_eq!(spec(1 << 30).chunk_count(), 16);
        let log = spec_in(WriteMode::LogCommit, 1 << 30);
        // 2.25 GiB of slots and 2 MiB of checkpoints: 36 whole chunks and a partial
        // object set of 2 MiB + 8 KiB, which reaches all 4 chunks of the set.
        assert_eq!(log.backing_bytes(), (9 << 28) + 2 * ((1 << 20) + 4096));
        assert_eq!(log.chunk_count(), 40);
        assert!(log.validate().is_ok());
    }

    #[test]
    fn log_commit_volumes_are_capped_and_block_aligned() {
        let spec = |size_bytes| spec_in(WriteMode::LogCommit, size_bytes);
        assert!(spec(65 << 30)
            .validate()
            .unwrap_err()
            .contains("at most 64 GiB"));
        assert!(spec(4096 + 512).validate().is_err());
        assert!(spec(64 << 30).validate().is_ok());
        assert_eq!("log-commit".parse::<WriteMode>(), Ok(WriteMode::LogCommit));
        assert_eq!(WriteMode::LogCommit.to_string(), "log-commit");
    }
}
