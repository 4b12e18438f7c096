//! A full file system: writes are refused before they are logged (the replica's state
//! untouched), everything acknowledged stays readable across a restart, and deletes
//! and trims still go through, after which writes fit again.

use bytes::Bytes;
use floe_chunkstore::space::Room;
use floe_chunkstore::{ChunkMeta, Options, SimDisk, Store, StoreError, Tuning};
use floe_protocol::ChunkId;
use std::path::Path;

const MIB: u64 = 1 << 20;
/// The simulated file system: room for the log and a few dozen MiB of chunks.
const CAPACITY: u64 = 128 * MIB;

fn chunk(volume_id: u64) -> ChunkId {
    ChunkId {
        volume_id,
        index: 0,
    }
}

fn block(i: u64) -> Bytes {
    Bytes::from(vec![i as u8 + 1; MIB as usize])
}

fn meta(version: u64) -> ChunkMeta {
    ChunkMeta { view: 1, version }
}

fn open(disk: &SimDisk, options: &Options) -> Store {
    Store::open_on(
        disk.mount(),
        Path::new("/data"),
        options,
        &Tuning::default(),
    )
    .expect("the store opens")
}

/// Writes 1 MiB blocks to `volume` until one is refused; returns how many fit.
async fn fill(store: &Store, volume: u64) -> u64 {
    for i in 0.. {
        match store
            .write(chunk(volume), i * MIB, block(i), meta(i + 1))
            .await
        {
            Ok(()) => {}
            Err(StoreError::NoSpace(message)) => {
                assert!(message.contains("kept for deletes and trims"), "{message}");
                assert_eq!(
                    store.meta(chunk(volume)),
                    meta(i),
                    "a refused write leaves the replica's state as it was"
                );
                return i;
            }
            Err(e) => panic!("write {i} failed with {e} instead of running out of space"),
        }
    }
    unreachable!()
}

async fn check(store: &Store, volume: u64, blocks: u64) {
    for i in 0..blocks {
        let data = store
            .read(chunk(volume), i * MIB, MIB as u32)
            .await
            .expect("an acknowledged block reads back");
        assert_eq!(data, block(i), "volume {volume} block {i}");
    }
}

async fn a_full_disk_refuses_writes_up_front_and_frees_on_delete(options: Options) {
    let disk = SimDisk::new();
    disk.set_capacity(CAPACITY);
    let store = open(&disk, &options);
    let first = fill(&store, 1).await;
    assert!(first >= 8, "only {first} MiB fit on a {CAPACITY}-byte disk");
    let report = store.space_report().unwrap();
    assert!(report.short, "a server that refused a write says so");
    // Refused again at once, and a trim goes through on the full disk.
    assert!(matches!(
        store
            .write(chunk(1), first * MIB, block(0), meta(first + 1))
            .await,
        Err(StoreError::NoSpace(_))
    ));
    // A punch that keeps the old blocks for a snapshot needs room for them: refused
    // before anything is logged.
    let retaining = store.reserve_retaining(0, MIB, Room::Normal);
    assert!(matches!(retaining, Err(StoreError::NoSpace(_))));
    store
        .zero(chunk(1), (first - 1) * MIB, MIB, true, meta(first + 1))
        .await
        .expect("a trim on a full disk");
    check(&store, 1, first - 1).await;
    // A restart replays and checkpoints on the full disk.
    disk.crash();
    let store = open(&disk, &options);
    check(&store, 1, first - 1).await;
    assert_eq!(store.meta(chunk(1)), meta(first + 1));
    // Deleting the volume frees its space for another.
    store
        .delete_volume(1)
        .await
        .expect("a delete on a full disk");
    // Within a journal quota (8 MiB) of the first fill: how much the log and the
    // journals hold when a fill stops depends on when their background replay and
    // checkpoint ran (CI once saw 108 MiB after 111).
    let second = fill(&store, 2).await;
    assert!(
        second + 8 >= first,
        "after the delete {second} MiB fit, before it {first}"
    );
    check(&store, 2, second).await;
}

#[tokio::test]
async fn plain_store() {
    a_full_disk_refuses_writes_up_front_and_frees_on_delete(Options::default()).await;
}

#[tokio::test]
async fn hybrid_store_with_its_journal_on_the_same_disk() {
    a_full_disk_refuses_writes_up_front_and_frees_on_delete(Options {
        journal_dirs: vec![floe_chunkstore::JournalDir {
            dir: "/ssd".into(),
            quota_bytes: 8 * MIB,
        }],
        local_journal_quota_bytes: 4 * MIB,
        emulate_hdd: false,
        chain: None,
    })
    .await;
}
