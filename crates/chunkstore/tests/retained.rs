//! Retained blocks through the store's API: what a change retains, across a reopen
//! and a release, and what a store refuses. Power cuts are in `power_cut.rs`.

use bytes::Bytes;
use floe_chunkstore::space::Room;
use floe_chunkstore::{
    ChunkMeta, Durability, JournalDir, Options, RetainedBlock, RetainedEntry, Store, StoreError,
    RETAIN_CHANGE_BYTES_MAX,
};
use floe_protocol::ChunkId;

const CHUNK: ChunkId = ChunkId {
    volume_id: 7,
    index: 3,
};
const BLOCK: u64 = 4096;

fn version(version: u64) -> ChunkMeta {
    ChunkMeta { view: 1, version }
}

async fn write(store: &Store, offset: u64, byte: u8, length: u64, v: u64, retain: Option<u32>) {
    let reservation = store.reserve_write(offset, length, Room::Normal).unwrap();
    let data = Bytes::from(vec![byte; length as usize]);
    store
        .write_reserved(
            reservation,
            CHUNK,
            offset,
            data,
            version(v),
            Durability::Synced,
            retain,
        )
        .await
        .unwrap();
}

/// A retained block as runs of (byte, count), so a mismatch prints short; `[]` for
/// zeroes kept without data.
async fn retained(store: &Store, epoch: u32, offset: u64) -> Option<Vec<(u8, usize)>> {
    let block = store.read_retained(CHUNK, epoch, offset).await.unwrap()?;
    let RetainedBlock::Data(data) = block else {
        return Some(Vec::new());
    };
    assert_eq!(data.len() as u64, BLOCK);
    Some(runs(&data))
}

/// Bytes as runs of (byte, count).
fn runs(data: &[u8]) -> Vec<(u8, usize)> {
    let mut runs: Vec<(u8, usize)> = Vec::new();
    for &byte in data {
        match runs.last_mut() {
            Some((b, n)) if *b == byte => *n += 1,
            _ => runs.push((byte, 1)),
        }
    }
    runs
}

fn block_of(runs: &[(u8, usize)]) -> Option<Vec<(u8, usize)>> {
    Some(runs.to_vec())
}

#[tokio::test]
async fn a_change_retains_each_block_once_per_epoch_across_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path()).unwrap();
        write(&store, 0, 0xaa, 2 * BLOCK, 1, None).await;
        // Epoch 1's first overwrite of block 0 (partly) and of block 1: both whole.
        write(&store, 100, 0xbb, BLOCK, 2, Some(1)).await;
        assert_eq!(retained(&store, 1, 0).await, block_of(&[(0xaa, 4096)]));
        assert_eq!(retained(&store, 1, BLOCK).await, block_of(&[(0xaa, 4096)]));
        // Its second is not retained; epoch 2's first is, with epoch 1's bytes.
        write(&store, 0, 0xcc, BLOCK, 3, Some(1)).await;
        write(&store, 0, 0xdd, BLOCK, 4, Some(2)).await;
        assert_eq!(retained(&store, 1, 0).await, block_of(&[(0xaa, 4096)]));
        assert_eq!(retained(&store, 2, 0).await, block_of(&[(0xcc, 4096)]));
        // A block never written is retained as zeroes; a zero retains too.
        write(&store, 8 * BLOCK, 0xee, BLOCK, 5, Some(2)).await;
        let reservation = store.reserve_zero(BLOCK, 10, false).unwrap();
        store
            .zero_reserved(reservation, CHUNK, BLOCK, 10, false, version(6), Some(2))
            .await
            .unwrap();
        assert_eq!(retained(&store, 2, 8 * BLOCK).await, block_of(&[]));
        assert_eq!(
            retained(&store, 2, BLOCK).await,
            block_of(&[(0xbb, 100), (0xaa, 3996)])
        );
        assert_eq!(retained(&store, 2, 2 * BLOCK).await, None);
        assert_eq!(retained(&store, 3, 0).await, None);
    }
    let store = Store::open(dir.path()).unwrap();
    let entry = |epoch, offset, tag, zeroes| RetainedEntry {
        epoch,
        offset,
        tag,
        zeroes,
    };
    assert_eq!(
        store.retained(CHUNK),
        vec![
            entry(1, 0, 2, false),
            entry(1, BLOCK, 2, false),
            entry(2, 0, 4, false),
            entry(2, BLOCK, 6, false),
            entry(2, 8 * BLOCK, 5, true),
        ]
    );
    assert_eq!(retained(&store, 2, 0).await, block_of(&[(0xcc, 4096)]));
    assert!(store.used_bytes() >= 4 * BLOCK + 3 * BLOCK);
    store.release_retained(CHUNK, 0..=1).await.unwrap();
    assert_eq!(retained(&store, 1, 0).await, None);
    assert_eq!(store.retained(CHUNK).len(), 3);
    store.release_retained(CHUNK, 0..=u32::MAX).await.unwrap();
    drop(store);
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.retained(CHUNK), vec![]);
    // Released, the next overwrite in epoch 1 retains again.
    write(&store, 0, 0x11, BLOCK, 7, Some(1)).await;
    assert_eq!(retained(&store, 1, 0).await, block_of(&[(0xdd, 4096)]));
}

#[tokio::test]
async fn a_range_reads_as_a_snapshot_had_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    write(&store, 0, 0xaa, 3 * BLOCK, 1, None).await;
    // Epoch 2 overwrites block 1, epoch 4 blocks 1 and 2 (block 1 as epoch 2 left it).
    write(&store, BLOCK, 0xbb, BLOCK, 2, Some(2)).await;
    write(&store, BLOCK, 0xcc, 2 * BLOCK, 3, Some(4)).await;
    let as_of = |epoch, offset, length| {
        let store = store.clone();
        async move {
            let data = store
                .read_as_of(CHUNK, epoch, offset, length)
                .await
                .unwrap();
            runs(&data)
        }
    };
    let b = BLOCK as usize;
    // Snapshots 1 and 2: before both; 3 and 4: after epoch 2's write; 5: now.
    assert_eq!(as_of(1, 0, 3 * BLOCK as u32).await, vec![(0xaa, 3 * b)]);
    assert_eq!(as_of(2, 0, 3 * BLOCK as u32).await, vec![(0xaa, 3 * b)]);
    let after_two = vec![(0xaa, b), (0xbb, b), (0xaa, b)];
    assert_eq!(as_of(3, 0, 3 * BLOCK as u32).await, after_two);
    assert_eq!(as_of(4, 0, 3 * BLOCK as u32).await, after_two);
    assert_eq!(
        as_of(5, 0, 3 * BLOCK as u32).await,
        vec![(0xaa, b), (0xcc, 2 * b)]
    );
    // Unaligned, across blocks.
    assert_eq!(as_of(3, BLOCK - 10, 20).await, vec![(0xaa, 10), (0xbb, 10)]);
}

#[tokio::test]
async fn a_repair_trims_and_installs_retained_blocks() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path()).unwrap();
        write(&store, 0, 0xaa, 2 * BLOCK, 1, None).await;
        write(&store, 0, 0xbb, BLOCK, 2, Some(1)).await;
        write(&store, BLOCK, 0xcc, BLOCK, 3, Some(1)).await;
        let tags =
            |entries: Vec<RetainedEntry>| -> Vec<u64> { entries.iter().map(|e| e.tag).collect() };
        assert_eq!(tags(store.retained_since(CHUNK, 2)), vec![3]);
        // A repair from version 2: what the replica took past it goes, the source's comes.
        store.trim_retained(CHUNK, 2).await.unwrap();
        assert_eq!(tags(store.retained(CHUNK)), vec![2]);
        let entry = RetainedEntry {
            epoch: 1,
            offset: BLOCK,
            tag: 4,
            zeroes: false,
        };
        let block = RetainedBlock::Data(Bytes::from(vec![0x11; BLOCK as usize]));
        store.install_retained(CHUNK, entry, block).await.unwrap();
        // Installed, the block counts as retained: the next overwrite keeps none.
        write(&store, BLOCK, 0xdd, BLOCK, 5, Some(1)).await;
        assert_eq!(retained(&store, 1, BLOCK).await, block_of(&[(0x11, 4096)]));
        let misplaced = RetainedEntry {
            offset: 100,
            ..entry
        };
        let block = RetainedBlock::Data(Bytes::from(vec![0x11; BLOCK as usize]));
        assert!(store
            .install_retained(CHUNK, misplaced, block)
            .await
            .is_err());
    }
    // The trim and the install survive a reopen (the tombstone and the new slot).
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(
        store
            .retained(CHUNK)
            .iter()
            .map(|e| (e.offset, e.tag))
            .collect::<Vec<_>>(),
        vec![(0, 2), (BLOCK, 4)]
    );
    assert_eq!(retained(&store, 1, BLOCK).await, block_of(&[(0x11, 4096)]));
}

#[tokio::test]
async fn rotten_retained_bytes_are_never_read_as_good() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    write(&store, 0, 0xaa, BLOCK, 1, None).await;
    write(&store, 0, 0xbb, BLOCK, 2, Some(1)).await;
    store.sync().await.unwrap();
    let path = dir
        .path()
        .join(format!("chunks/{:016x}/{:016x}.r00000001", 7, 3));
    let mut raw = std::fs::read(&path).unwrap();
    raw[9] ^= 1;
    std::fs::write(&path, raw).unwrap();
    let read = store.read_retained(CHUNK, 1, 0).await;
    assert!(
        matches!(read, Err(StoreError::Corrupt { offset: 0, .. })),
        "{read:?}"
    );
    assert_eq!(store.take_corrupt(), vec![(CHUNK, 0)]);
}

#[tokio::test]
async fn a_change_too_long_to_retain_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let too_long = RETAIN_CHANGE_BYTES_MAX + BLOCK;
    let reservation = store.reserve_zero(0, too_long, true).unwrap();
    let refused = store
        .zero_reserved(reservation, CHUNK, 0, too_long, true, version(1), Some(1))
        .await;
    assert!(
        matches!(&refused, Err(StoreError::Unsupported(m)) if m.contains("split it")),
        "{refused:?}"
    );
    // Refused before it was logged: the chunk did not change.
    assert_eq!(store.meta(CHUNK), ChunkMeta::default());
}

/// Hybrid mode keeps the old blocks before the change, journaled or not: read through
/// the journal (writes not yet replayed), and durable across a power cut.
#[tokio::test]
async fn a_hybrid_store_retains_blocks_its_journal_still_holds() {
    let disk = floe_chunkstore::SimDisk::new();
    let options = Options {
        journal_dirs: vec![JournalDir {
            dir: "/ssd".into(),
            quota_bytes: 4 << 20,
        }],
        local_journal_quota_bytes: 4 << 20,
        ..Options::default()
    };
    let tuning = floe_chunkstore::Tuning {
        manual_replay: true,
        ..Default::default()
    };
    let open = || Store::open_on(disk.mount(), "/data".as_ref(), &options, &tuning).unwrap();
    let mut hybrid = open();
    // Journaled writes, then a bypass over part of a block and a punch.
    write(&hybrid, 0, 0x11, 2 * BLOCK, 1, None).await;
    write(&hybrid, 0, 0x22, BLOCK, 2, Some(1)).await;
    write(&hybrid, BLOCK + 512, 0x33, 1000, 3, Some(1)).await;
    let punch = hybrid.reserve_zero(0, BLOCK, true).unwrap();
    hybrid
        .zero_reserved(punch, CHUNK, 0, BLOCK, true, version(4), Some(2))
        .await
        .unwrap();
    for reopened in [false, true] {
        if reopened {
            disk.crash();
            hybrid = open();
            assert_eq!(hybrid.meta(CHUNK), version(4));
        }
        assert_eq!(retained(&hybrid, 1, 0).await, block_of(&[(0x11, 4096)]));
        assert_eq!(retained(&hybrid, 1, BLOCK).await, block_of(&[(0x11, 4096)]));
        assert_eq!(retained(&hybrid, 2, 0).await, block_of(&[(0x22, 4096)]));
    }
}
