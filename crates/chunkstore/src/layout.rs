//! Where a data directory keeps what (see the crate documentation for the tree).

use floe_protocol::ChunkId;
use std::path::{Path, PathBuf};

/// Largest chunk a replica may be asked to hold; offsets beyond are rejected.
pub const CHUNK_BYTES_MAX: u64 = 1 << 30;
/// The plain store's write-ahead log.
pub(crate) const WAL: &str = "wal";
/// Each replica's view and version at the last checkpoint.
pub(crate) const META: &str = "meta";
/// The hdd's own journal (hybrid mode).
pub(crate) const LOCAL_JOURNAL: &str = "journal";
const CHUNKS: &str = "chunks";

pub(crate) fn chunks_dir(dir: &Path) -> PathBuf {
    dir.join(CHUNKS)
}

pub(crate) fn volume_dir(dir: &Path, volume_id: u64) -> PathBuf {
    chunks_dir(dir).join(format!("{volume_id:016x}"))
}

pub(crate) fn chunk_path(dir: &Path, chunk: ChunkId) -> PathBuf {
    volume_dir(dir, chunk.volume_id).join(format!("{:016x}", chunk.index))
}

/// The block checksums of a chunk's file (see [`crate::block_sums`]); not a chunk
/// itself, its name is not a number.
pub(crate) fn sums_path(dir: &Path, chunk: ChunkId) -> PathBuf {
    chunk_path(dir, chunk).with_extension("sums")
}

/// The data of a chunk's blocks retained in snapshot epoch `epoch` (see
/// [`crate::retained`]); like the checksums, not a chunk.
pub(crate) fn retained_data_path(dir: &Path, chunk: ChunkId, epoch: u32) -> PathBuf {
    chunk_path(dir, chunk).with_extension(format!("r{epoch:08x}"))
}

/// The index of [`retained_data_path`]'s slots.
pub(crate) fn retained_index_path(dir: &Path, chunk: ChunkId, epoch: u32) -> PathBuf {
    chunk_path(dir, chunk).with_extension(format!("i{epoch:08x}"))
}

/// (chunk index, epoch) of a retained index file's name.
pub(crate) fn retained_index_of(name: &str) -> Option<(u64, u32)> {
    retained_file_of(name, ".i")
}

/// (chunk index, epoch) of a retained data file's name.
pub(crate) fn retained_data_of(name: &str) -> Option<(u64, u32)> {
    retained_file_of(name, ".r")
}

fn retained_file_of(name: &str, marker: &str) -> Option<(u64, u32)> {
    let (index, epoch) = name.split_once(marker)?;
    if index.len() != 16 || epoch.len() != 8 {
        return None;
    }
    Some((parse_hex(index)?, u32::try_from(parse_hex(epoch)?).ok()?))
}

/// The chunk whose file `path` is in data directory `dir`.
pub(crate) fn chunk_of(dir: &Path, path: &Path) -> Option<ChunkId> {
    let mut names = path.strip_prefix(chunks_dir(dir)).ok()?.iter();
    let chunk = ChunkId {
        volume_id: parse_hex(names.next()?.to_str()?)?,
        index: parse_hex(names.next()?.to_str()?)?,
    };
    names.next().is_none().then_some(chunk)
}

pub(crate) fn parse_hex(name: &str) -> Option<u64> {
    u64::from_str_radix(name, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_paths_round_trip() {
        let chunk = ChunkId {
            volume_id: 0xab,
            index: 7,
        };
        let dir = Path::new("/data");
        assert_eq!(
            chunk_path(dir, chunk),
            Path::new("/data/chunks/00000000000000ab/0000000000000007")
        );
        assert_eq!(chunk_of(dir, &chunk_path(dir, chunk)), Some(chunk));
        assert_eq!(chunk_of(dir, &volume_dir(dir, 0xab)), None);
        assert_eq!(chunk_of(dir, &dir.join(WAL)), None);
        assert_eq!(chunk_of(dir, &sums_path(dir, chunk)), None);
        let index = retained_index_path(dir, chunk, 0x1234);
        assert_eq!(chunk_of(dir, &index), None);
        assert_eq!(chunk_of(dir, &retained_data_path(dir, chunk, 1)), None);
        let name = index.file_name().unwrap().to_str().unwrap();
        assert_eq!(retained_index_of(name), Some((7, 0x1234)));
        assert_eq!(retained_index_of("0000000000000007.sums"), None);
    }
}
