//! The chunk-state file: each chunk replica's view and version as of the last
//! checkpoint. Between checkpoints the log records carry the state; the checkpoint
//! writes this file (to a temporary name, fsync, rename) before it restarts the log.
//!
//! ```text
//! magic u32 | count u64 | count x (volume_id u64 | index u64 | view u64 | version u64) | crc u32
//! ```

use crate::disk::{self, Disk};
use bytes::{Buf, BufMut};
use floe_protocol::ChunkId;
use std::collections::BTreeMap;
use std::io::{self, ErrorKind};
use std::path::Path;

const MAGIC: u32 = 0x464c_4d54; // "FLMT"
const ENTRY_BYTES: usize = 32;

/// A replica's replication state (URSA section 4): the view of the replica set it
/// belongs to and the version of the last change it holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkMeta {
    pub view: u64,
    pub version: u64,
}

/// Ordered, so the file's bytes (and a simulation's runs) are the same each time.
pub type Metas = BTreeMap<ChunkId, ChunkMeta>;

pub fn load(disk: &dyn Disk, path: &Path) -> io::Result<Metas> {
    let Some(raw) = disk::read_file(disk, path)? else {
        return Ok(Metas::new());
    };
    let corrupt = || {
        io::Error::new(
            ErrorKind::InvalidData,
            format!(
                "{} is corrupt (bad magic, length or checksum)",
                path.display()
            ),
        )
    };
    if raw.len() < 16 {
        return Err(corrupt());
    }
    let (body, crc) = raw.split_at(raw.len() - 4);
    if crc32c::crc32c(body) != (&crc[..]).get_u32_le() {
        return Err(corrupt());
    }
    let mut r = body;
    if r.get_u32_le() != MAGIC {
        return Err(corrupt());
    }
    let count = r.get_u64_le() as usize;
    if r.len() != count.checked_mul(ENTRY_BYTES).ok_or_else(corrupt)? {
        return Err(corrupt());
    }
    let mut metas = Metas::new();
    for _ in 0..count {
        let chunk = ChunkId {
            volume_id: r.get_u64_le(),
            index: r.get_u64_le(),
        };
        let meta = ChunkMeta {
            view: r.get_u64_le(),
            version: r.get_u64_le(),
        };
        metas.insert(chunk, meta);
    }
    Ok(metas)
}

/// Replaces the file at `path` atomically and durably.
pub fn save(disk: &dyn Disk, path: &Path, metas: &Metas) -> io::Result<()> {
    let mut out = Vec::with_capacity(16 + metas.len() * ENTRY_BYTES);
    out.put_u32_le(MAGIC);
    out.put_u64_le(metas.len() as u64);
    for (chunk, meta) in metas {
        out.put_u64_le(chunk.volume_id);
        out.put_u64_le(chunk.index);
        out.put_u64_le(meta.view);
        out.put_u64_le(meta.version);
    }
    let crc = crc32c::crc32c(&out);
    out.put_u32_le(crc);
    let temporary = path.with_extension("tmp");
    let file = disk.open(&temporary, true)?;
    file.set_len(0)?;
    file.write_all_at(&out, 0)?;
    file.sync_data()?;
    disk.rename(&temporary, path)?;
    disk.sync_dir(path.parent().expect("meta file has a parent"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let disk = crate::RealDisk;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta");
        assert!(
            load(&disk, &path).unwrap().is_empty(),
            "absent file: no state"
        );
        let mut metas = Metas::new();
        metas.insert(
            ChunkId {
                volume_id: 1,
                index: 2,
            },
            ChunkMeta {
                view: 3,
                version: 4 << 32 | 5,
            },
        );
        save(&disk, &path, &metas).unwrap();
        assert_eq!(load(&disk, &path).unwrap(), metas);
        let mut raw = std::fs::read(&path).unwrap();
        raw[20] ^= 1;
        std::fs::write(&path, raw).unwrap();
        assert!(load(&disk, &path).is_err());
    }
}
