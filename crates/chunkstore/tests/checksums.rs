//! Bit rot in a store on a real file system: bytes changed under it in a chunk file
//! or a journal are found by the read that would return them, reported once, never
//! returned, and gone once the block is written whole again (a repair's write).

use bytes::Bytes;
use floe_chunkstore::block_sums::fingerprint;
use floe_chunkstore::{ChunkMeta, JournalDir, Options, RealDisk, Store, StoreError, Tuning};
use floe_protocol::ChunkId;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

const CHUNK: ChunkId = ChunkId {
    volume_id: 7,
    index: 3,
};
const META: ChunkMeta = ChunkMeta {
    view: 1,
    version: 1,
};

/// A block of bytes unlike any other the tests write.
fn pattern(seed: u8) -> Vec<u8> {
    (0..4096u32)
        .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
        .collect()
}

/// Flips a byte where `needle` starts in `path`; panics if it is not there.
fn rot(path: &Path, needle: &[u8]) {
    let bytes = std::fs::read(path).unwrap();
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{} does not hold the data", path.display()));
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(&[bytes[at + 100] ^ 0xff], (at + 100) as u64)
        .unwrap();
}

fn corrupt_at(result: Result<Bytes, StoreError>) -> (u64, &'static str) {
    match result {
        Err(StoreError::Corrupt { offset, place, .. }) => (offset, place),
        other => panic!("read returned {other:?}"),
    }
}

#[tokio::test]
async fn a_rotten_chunk_file_block_is_found_reported_and_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let (good, other) = (pattern(3), pattern(5));
    let data = [other.clone(), good.clone(), other.clone()].concat();
    store
        .write(CHUNK, 0, Bytes::from(data), META)
        .await
        .unwrap();
    rot(
        &dir.path().join("chunks/0000000000000007/0000000000000003"),
        &good,
    );
    assert_eq!(
        corrupt_at(store.read(CHUNK, 4000, 200).await),
        (4096, "chunk file")
    );
    assert_eq!(store.take_corrupt(), vec![(CHUNK, 4096)]);
    assert!(store.take_corrupt().is_empty(), "reported once");
    assert_eq!(&store.read(CHUNK, 8192, 4096).await.unwrap()[..], &other);
    // A scrub's checksum names it without reporting it again.
    let (_, bad) = store.checksum(CHUNK, 3 * 4096).await.unwrap();
    assert_eq!(bad, vec![4096]);
    assert!(store.take_corrupt().is_empty());
    // A repair's comparison of blocks: the rotten one matches nothing and is reported
    // (a source's bad block gets healed); the holes past the data are not listed.
    let other_sum = Some(fingerprint(&other));
    let sums = store.block_sums(CHUNK).await.unwrap();
    assert_eq!(sums, vec![other_sum, None, other_sum]);
    assert_eq!(store.take_corrupt(), vec![(CHUNK, 4096)]);
    // A partial write keeps it corrupt; a whole one (a repair's) makes it good.
    store
        .write(CHUNK, 4096, Bytes::from(vec![1; 10]), META)
        .await
        .unwrap();
    assert!(store.read(CHUNK, 4096, 4096).await.is_err());
    store
        .write(CHUNK, 4096, Bytes::from(good.clone()), META)
        .await
        .unwrap();
    assert_eq!(&store.read(CHUNK, 4096, 4096).await.unwrap()[..], &good);
    // Across a restart too.
    drop(store);
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(&store.read(CHUNK, 4096, 4096).await.unwrap()[..], &good);
}

#[tokio::test]
async fn rotten_journal_data_is_never_read_nor_replayed_as_good() {
    let data = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let options = Options {
        journal_dirs: vec![JournalDir {
            dir: ssd.path().to_path_buf(),
            quota_bytes: 4 << 20,
        }],
        local_journal_quota_bytes: 4 << 20,
        emulate_hdd: false,
        chain: None,
    };
    let tuning = Tuning {
        manual_replay: true,
        ..Tuning::default()
    };
    let store = Store::open_on(Arc::new(RealDisk), data.path(), &options, &tuning).unwrap();
    let good = pattern(7);
    // Journaled: a small aligned write.
    store
        .write(CHUNK, 8192, Bytes::from(good.clone()), META)
        .await
        .unwrap();
    rot(&ssd.path().join("floe-journal"), &good);
    assert_eq!(
        corrupt_at(store.read(CHUNK, 8192, 4096).await),
        (8192, "journal")
    );
    assert_eq!(store.take_corrupt(), vec![(CHUNK, 8192)]);
    // Replay frees the journal, but the block stays marked corrupt in the chunk file.
    assert_eq!(store.replay_sweep().unwrap(), 4096);
    assert_eq!(store.take_corrupt(), vec![(CHUNK, 8192)]);
    assert_eq!(
        corrupt_at(store.read(CHUNK, 8192, 4096).await),
        (8192, "chunk file")
    );
    store
        .write(CHUNK, 8192, Bytes::from(good.clone()), META)
        .await
        .unwrap();
    assert_eq!(&store.read(CHUNK, 8192, 4096).await.unwrap()[..], &good);
    store.replay_sweep().unwrap();
    assert_eq!(&store.read(CHUNK, 8192, 4096).await.unwrap()[..], &good);
}
