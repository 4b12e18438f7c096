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
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    /// Filled in by the master from heartbeats; not stored.
    #[serde(default)]
    pub up: bool,
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
