//! Store behaviour across reopen, torn log tails and deletes. Process-kill crash tests
//! of the whole chunk server live in the CLI's end-to-end suite.

use bytes::Bytes;
use floe_chunkstore::block_sums::fingerprint;
use floe_chunkstore::{ChunkMeta, Store, StoreError};
use floe_protocol::ChunkId;
use std::io::Write;

const CHUNK: ChunkId = ChunkId {
    volume_id: 7,
    index: 3,
};
const M: ChunkMeta = ChunkMeta {
    view: 0,
    version: 0,
};

fn version(version: u64) -> ChunkMeta {
    ChunkMeta { view: 1, version }
}

#[tokio::test]
async fn writes_zeroes_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(
            &store.read(CHUNK, 0, 8).await.unwrap()[..],
            &[0; 8],
            "unwritten reads zero"
        );
        store
            .write(CHUNK, 4096, Bytes::from(vec![0xab; 8192]), M)
            .await
            .unwrap();
        store.zero(CHUNK, 8192, 100, false, M).await.unwrap();
        store.zero(CHUNK, 4096, 10, true, M).await.unwrap();
        assert!(matches!(
            store
                .write(CHUNK, u64::MAX - 1, Bytes::from_static(b"xx"), M)
                .await,
            Err(StoreError::OutOfRange { .. })
        ));
    }
    let store = Store::open(dir.path()).unwrap();
    let data = store.read(CHUNK, 4096, 8192).await.unwrap();
    assert!(data[..10].iter().all(|&b| b == 0));
    assert!(data[10..4096].iter().all(|&b| b == 0xab));
    assert!(data[4096..4196].iter().all(|&b| b == 0));
    assert!(data[4196..].iter().all(|&b| b == 0xab));
    assert_eq!(store.chunks(), vec![CHUNK]);
    store.delete_volume(7).await.unwrap();
    assert!(store.chunks().is_empty());
    assert_eq!(&store.read(CHUNK, 4096, 4).await.unwrap()[..], &[0; 4]);
}

/// Copies the live log aside before the store checkpoints on shutdown, as a crash
/// would leave it, then replays the copy into an empty directory.
#[tokio::test]
async fn replay_applies_whole_records_and_stops_at_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let crashed = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    for i in 0..100u64 {
        let data = Bytes::from(vec![i as u8 + 1; 4096]);
        store
            .write(CHUNK, i * 4096, data, version(i + 1))
            .await
            .unwrap();
    }
    std::fs::copy(dir.path().join("wal"), crashed.path().join("wal")).unwrap();
    drop(store);
    // A torn record after the last good one: valid-looking magic, garbage after.
    let mut wal = std::fs::OpenOptions::new()
        .append(true)
        .open(crashed.path().join("wal"))
        .unwrap();
    wal.write_all(&0x464c_5752u32.to_le_bytes()).unwrap();
    wal.write_all(&[0x55; 100]).unwrap();
    drop(wal);

    let store = Store::open(crashed.path()).unwrap();
    assert_eq!(
        store.meta(CHUNK),
        version(100),
        "state replayed with the data"
    );
    for i in 0..100u64 {
        let data = store.read(CHUNK, i * 4096, 4096).await.unwrap();
        assert!(
            data.iter().all(|&b| b == i as u8 + 1),
            "record {i} replayed whole"
        );
    }
    // After replay the log restarts: new writes survive another reopen.
    store
        .write(CHUNK, 0, Bytes::from(vec![0xee; 512]), version(101))
        .await
        .unwrap();
    drop(store);
    let store = Store::open(crashed.path()).unwrap();
    assert_eq!(
        store.meta(CHUNK),
        version(101),
        "state kept across checkpoints"
    );
    assert_eq!(store.read(CHUNK, 0, 1).await.unwrap()[0], 0xee);
    assert_eq!(store.read(CHUNK, 512, 1).await.unwrap()[0], 1);
}

#[tokio::test]
async fn a_foreign_log_file_is_refused_not_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("wal"), b"not a log").unwrap();
    let error = Store::open(dir.path()).err().expect("refused");
    assert!(
        error.to_string().contains("not a Floe write-ahead log"),
        "{error}"
    );
}

#[tokio::test]
async fn extents_and_checksums_see_data_not_holes() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let empty = store.checksum(CHUNK, 1 << 20).await.unwrap();
    assert!(empty.1.is_empty(), "no block fails");
    assert!(store.extents(CHUNK).unwrap().is_empty());
    store
        .write(CHUNK, 512 << 10, Bytes::from(vec![1; 4096]), version(1))
        .await
        .unwrap();
    let extents = store.extents(CHUNK).unwrap();
    assert_eq!(extents.len(), 1);
    let (start, length) = extents[0];
    assert!(start <= 512 << 10 && start + length >= (512 << 10) + 4096);
    let written = store.checksum(CHUNK, 1 << 20).await.unwrap();
    assert_ne!(written, empty);
    // A repair's fingerprints: 0 for a hole, the data's crc for the block written.
    let sums = store.block_sums(CHUNK).await.unwrap();
    let block = (512 << 10) / 4096;
    assert_eq!(sums[block], Some(fingerprint(&[1; 4096])));
    assert!(sums[..(start / 4096) as usize]
        .iter()
        .all(|s| *s == Some(0)));
    store.set_meta(CHUNK, version(2)).await.unwrap();
    assert_eq!(store.meta(CHUNK), version(2));
    store
        .zero(CHUNK, 512 << 10, 4096, true, version(3))
        .await
        .unwrap();
    assert_eq!(store.checksum(CHUNK, 1 << 20).await.unwrap(), empty);
    let sums = store.block_sums(CHUNK).await.unwrap();
    assert!(
        sums.iter().all(|s| *s == Some(0)),
        "a punched block is a hole"
    );
}

/// A crash tore the first record of the last batch and left a later one (a stale
/// state stamp) intact. After the restart, a write of the same size as the torn
/// record ends exactly where the stale one begins: the next scan must not read on
/// into it.
#[tokio::test]
async fn a_record_left_past_a_torn_one_never_comes_back() {
    use floe_chunkstore::wal::{self, Kind, RecordHeader};
    let dir = tempfile::tempdir().unwrap();
    let crashed = tempfile::tempdir().unwrap();
    let record = |seq, kind, length, version| RecordHeader {
        seq,
        kind,
        chunk: CHUNK,
        offset: 0,
        length,
        view: 1,
        version,
    };
    let mut log = wal::encode_header(1, false).to_vec();
    record(1, Kind::Write, 4096, 1).encode(&[0xaa; 4096], &mut log, 0, false);
    *log.last_mut().unwrap() ^= 1; // torn
    record(2, Kind::Stamp, 0, 99).encode(&[], &mut log, 0, false);
    std::fs::write(dir.path().join("wal"), log).unwrap();
    let store = Store::open(dir.path()).unwrap();
    store
        .write(CHUNK, 0, Bytes::from(vec![0xbb; 4096]), version(5))
        .await
        .unwrap();
    std::fs::copy(dir.path().join("wal"), crashed.path().join("wal")).unwrap();
    drop(store);
    let store = Store::open(crashed.path()).unwrap();
    assert_eq!(store.meta(CHUNK), version(5), "the stale stamp stays dead");
    assert_eq!(store.read(CHUNK, 0, 1).await.unwrap()[0], 0xbb);
}
