//! Cluster objects every process shares: what the master stores and hands out.

use serde::{Deserialize, Serialize};

/// One chunk of one volume; a replica of it lives on each of its chunk servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkId {
    pub volume_id: u64,
    pub index: u64,
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
        let partial_units = (self.size_bytes % set_bytes).div_ceil(self.stripe_unit_bytes);
        self.size_bytes / set_bytes * count + partial_units.min(count)
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
}

/// Everything a gateway needs to serve a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMap {
    pub volume: Volume,
    pub chunks: Vec<ChunkPlacement>,
    pub servers: Vec<ServerInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub servers: Vec<ServerInfo>,
    pub volumes: Vec<Volume>,
    #[serde(default)]
    pub recovery: RecoveryStatus,
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
    pub repaired_chunks: u64,
    pub incremental_repairs: u64,
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
    pub details: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_count_covers_partial_object_sets() {
        let spec = |size_bytes| VolumeSpec {
            name: "v".into(),
            size_bytes,
            replicas: 3,
            chunk_bytes: 64 << 20,
            stripe_unit_bytes: 64 << 10,
            stripe_count: 4,
        };
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
    }
}
