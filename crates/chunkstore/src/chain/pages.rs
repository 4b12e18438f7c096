//! The inverse map persisted on the cache (flash) directory, in sequential pages:
//! one page per segment of the log's body, from the head to the tail, each slot
//! naming the live chunk block there and its crc. Written whole to `chain.map.new`,
//! synced and renamed over `chain.map`, so a power cut leaves the old map or the new
//! one, never a mix. Recovery reads it and rebuilds the forward map from it (the
//! write-ahead log's replay then redoes every change since).
//!
//! ```text
//! header   magic (the layout's), disks, blocks per disk, head segment, tail position, chunk count
//! chunks   (volume, index) per chunk that exists
//! pages    per segment, SEGMENT_BLOCKS slots of (present, crc, volume, index, block)
//! crc32c   of everything before
//! ```

use super::disks::{Disks, SEGMENT_BLOCKS};
use super::map::{BlockKey, Maps};
use super::placement::Layout;
use crate::disk::{self, Disk};
use crate::error::StoreError;
use floe_protocol::ChunkId;
use std::path::Path;

const MAP: &str = "chain.map";
const MAP_NEW: &str = "chain.map.new";
const MAGIC: &[u8; 8] = b"FLOECHN1";
/// The striped (benchmark baseline) layout's maps: never opened as a chain's.
const MAGIC_STRIPED: &[u8; 8] = b"FLOESTR1";
const SLOT_BYTES: usize = 32;

/// What a persisted map says about the chain.
pub(crate) struct Persisted {
    pub(crate) head_segment: u64,
    pub(crate) tail: u64,
    pub(crate) chunks: Vec<ChunkId>,
    /// Live blocks in log order: (position, block, crc).
    pub(crate) entries: Vec<(u64, BlockKey, u32)>,
}

/// The chain's geometry, which a map must have been written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) disks: u64,
    pub(crate) blocks_per_disk: u64,
    pub(crate) layout: Layout,
}

impl Geometry {
    pub(crate) fn of(disks: &Disks) -> Geometry {
        Geometry {
            disks: disks.count() as u64,
            blocks_per_disk: disks.blocks_per_disk(),
            layout: disks.layout(),
        }
    }

    fn magic(self) -> &'static [u8; 8] {
        match self.layout {
            Layout::Chained => MAGIC,
            Layout::Striped => MAGIC_STRIPED,
        }
    }
}

pub(crate) fn save(
    disk: &dyn Disk,
    dir: &Path,
    geometry: Geometry,
    head_segment: u64,
    tail: u64,
    maps: &Maps,
) -> Result<(), StoreError> {
    let mut out = Vec::new();
    out.extend_from_slice(geometry.magic());
    for n in [
        geometry.disks,
        geometry.blocks_per_disk,
        head_segment,
        tail,
        maps.chunks.len() as u64,
    ] {
        out.extend_from_slice(&n.to_le_bytes());
    }
    for chunk in &maps.chunks {
        out.extend_from_slice(&chunk.volume_id.to_le_bytes());
        out.extend_from_slice(&chunk.index.to_le_bytes());
    }
    let end = tail.div_ceil(SEGMENT_BLOCKS) * SEGMENT_BLOCKS;
    for position in head_segment * SEGMENT_BLOCKS..end {
        let mut slot = [0u8; SLOT_BYTES];
        if let Some((key, crc)) = maps.at(position) {
            assert!(position < tail, "a live block past the tail");
            slot[..4].copy_from_slice(&1u32.to_le_bytes());
            slot[4..8].copy_from_slice(&crc.to_le_bytes());
            slot[8..16].copy_from_slice(&key.chunk.volume_id.to_le_bytes());
            slot[16..24].copy_from_slice(&key.chunk.index.to_le_bytes());
            slot[24..32].copy_from_slice(&key.block.to_le_bytes());
        }
        out.extend_from_slice(&slot);
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    let new = dir.join(MAP_NEW);
    let file = disk.open(&new, true)?;
    file.set_len(0)?;
    file.write_all_at(&out, 0)?;
    file.sync_data()?;
    disk.rename(&new, &dir.join(MAP))?;
    disk.sync_dir(dir)?;
    Ok(())
}

/// The last map saved; `None` before the first save.
pub(crate) fn load(
    disk: &dyn Disk,
    dir: &Path,
    geometry: Geometry,
) -> Result<Option<Persisted>, StoreError> {
    let path = dir.join(MAP);
    let Some(bytes) = disk::read_file(disk, &path)? else {
        return Ok(None);
    };
    let corrupt = |what: &str| StoreError::Io(format!("{}: {what}", path.display()));
    let layout = match bytes.get(..8) {
        Some(m) if m == MAGIC => Layout::Chained,
        Some(m) if m == MAGIC_STRIPED => Layout::Striped,
        _ => return Err(corrupt("not a chain map")),
    };
    if bytes.len() < 52 {
        return Err(corrupt("not a chain map"));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(sum.try_into().unwrap()) {
        // Only a rename publishes a map, after its sync: this is bit rot.
        return Err(corrupt("fails its checksum"));
    }
    let word = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().unwrap());
    let found = Geometry {
        disks: word(8),
        blocks_per_disk: word(16),
        layout,
    };
    if found != geometry {
        return Err(corrupt(&format!(
            "written for {} {:?} disks of {} blocks, opened with {} {:?} disks of {} blocks: \
             give the same --disk list and --disk-size",
            found.disks,
            found.layout,
            found.blocks_per_disk,
            geometry.disks,
            geometry.layout,
            geometry.blocks_per_disk
        )));
    }
    let head_segment = word(24);
    let tail = word(32);
    let chunk_count = word(40) as usize;
    let mut at = 48;
    let mut chunks = Vec::with_capacity(chunk_count);
    for _ in 0..chunk_count {
        chunks.push(ChunkId {
            volume_id: word(at),
            index: word(at + 8),
        });
        at += 16;
    }
    let mut entries = Vec::new();
    let mut position = head_segment * SEGMENT_BLOCKS;
    while at < body.len() {
        let slot = &body[at..at + SLOT_BYTES];
        if slot[..4] == 1u32.to_le_bytes() {
            let key = BlockKey {
                chunk: ChunkId {
                    volume_id: word(at + 8),
                    index: word(at + 16),
                },
                block: word(at + 24),
            };
            entries.push((
                position,
                key,
                u32::from_le_bytes(slot[4..8].try_into().unwrap()),
            ));
        }
        at += SLOT_BYTES;
        position += 1;
    }
    assert_eq!(
        position,
        tail.div_ceil(SEGMENT_BLOCKS) * SEGMENT_BLOCKS,
        "a map's pages cover its body"
    );
    Ok(Some(Persisted {
        head_segment,
        tail,
        chunks,
        entries,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::map::Slot;
    use crate::SimDisk;

    const GEOMETRY: Geometry = Geometry {
        disks: 2,
        blocks_per_disk: 2 * SEGMENT_BLOCKS,
        layout: Layout::Chained,
    };

    fn key(block: u64) -> BlockKey {
        BlockKey {
            chunk: ChunkId {
                volume_id: 3,
                index: 9,
            },
            block,
        }
    }

    #[test]
    fn pages_round_trip_live_blocks_only() {
        let sim = SimDisk::new();
        let disk = sim.mount();
        let dir = Path::new("/cache");
        disk.create_dir_all(dir).unwrap();
        disk::sync_dir_and_parents(&*disk, dir).unwrap();
        let mut maps = Maps::new(GEOMETRY.disks * GEOMETRY.blocks_per_disk);
        maps.set(
            key(0),
            Slot {
                position: 300,
                crc: 11,
            },
        );
        maps.set(
            key(1),
            Slot {
                position: 301,
                crc: 12,
            },
        );
        maps.set(
            key(0),
            Slot {
                position: 302,
                crc: 13,
            },
        ); // 300 dies
        maps.touch(ChunkId {
            volume_id: 4,
            index: 0,
        });
        save(&*disk, dir, GEOMETRY, 1, 303, &maps).unwrap();
        sim.power_cut(1);
        let loaded = load(&*sim.mount(), dir, GEOMETRY).unwrap().unwrap();
        assert_eq!((loaded.head_segment, loaded.tail), (1, 303));
        assert_eq!(loaded.entries, vec![(301, key(1), 12), (302, key(0), 13)]);
        assert_eq!(loaded.chunks.len(), 2);
    }

    #[test]
    fn another_geometry_is_refused() {
        let sim = SimDisk::new();
        let disk = sim.mount();
        let dir = Path::new("/cache");
        disk.create_dir_all(dir).unwrap();
        let maps = Maps::new(GEOMETRY.disks * GEOMETRY.blocks_per_disk);
        save(&*disk, dir, GEOMETRY, 0, 0, &maps).unwrap();
        let other = Geometry {
            disks: 3,
            ..GEOMETRY
        };
        let error = load(&*disk, dir, other).err().unwrap().to_string();
        assert!(error.contains("same --disk list"), "{error}");
        let striped = Geometry {
            layout: Layout::Striped,
            ..GEOMETRY
        };
        let error = load(&*disk, dir, striped).err().unwrap().to_string();
        assert!(error.contains("Chained"), "{error}");
    }
}
