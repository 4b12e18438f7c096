//! Hybrid mode with real files: journal append, recovery, replay, bypass and zero
//! superseding journaled writes, overflow order.

use bytes::Bytes;
use floe_chunkstore::{ChunkMeta, JournalDir, Options, SimDisk, Store, Tuning};
use floe_protocol::ChunkId;
use std::path::Path;
use std::time::Duration;

const CHUNK: ChunkId = ChunkId {
    volume_id: 7,
    index: 3,
};

fn meta(version: u64) -> ChunkMeta {
    ChunkMeta { view: 1, version }
}

fn options(journals: &[&Path], quota: u64) -> Options {
    Options {
        journal_dirs: journals
            .iter()
            .map(|d| JournalDir {
                dir: d.to_path_buf(),
                quota_bytes: quota,
            })
            .collect(),
        local_journal_quota_bytes: quota,
        emulate_hdd: false,
        chain: None,
    }
}

fn chunk_file(data: &Path) -> std::path::PathBuf {
    data.join("chunks/0000000000000007/0000000000000003")
}

async fn wait_replayed(store: &Store) {
    for _ in 0..500 {
        if store.journal_backlog() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("journals not replayed: {} bytes", store.journal_backlog());
}

#[tokio::test]
async fn small_writes_journal_then_replay_into_the_chunk_file() {
    let data = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let store = Store::open_with(data.path(), &options(&[ssd.path()], 1 << 30)).unwrap();
    store
        .write(CHUNK, 4096, Bytes::from(vec![1; 4096]), meta(1))
        .await
        .unwrap();
    assert!(
        store.journal_usage().0 > 4096,
        "the write went to the journal"
    );
    assert_eq!(
        &store.read(CHUNK, 4096, 4096).await.unwrap()[..],
        &[1; 4096]
    );
    assert_eq!(store.extents(CHUNK).unwrap(), vec![(4096, 4096)]);
    wait_replayed(&store).await;
    let on_disk = std::fs::read(chunk_file(data.path())).unwrap();
    assert_eq!(&on_disk[4096..8192], &[1; 4096]);
    assert_eq!(store.meta(CHUNK), meta(1));
}

#[tokio::test]
async fn bypass_and_zero_supersede_older_journaled_writes() {
    let data = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let store = Store::open_with(data.path(), &options(&[ssd.path()], 1 << 30)).unwrap();
    // Overlapping in one batch and across batches.
    let small = store.write(CHUNK, 0, Bytes::from(vec![1; 8192]), meta(1));
    let large = store.write(CHUNK, 0, Bytes::from(vec![2; 128 << 10]), meta(2));
    let (a, b) = tokio::join!(small, large);
    a.unwrap();
    b.unwrap();
    store
        .write(CHUNK, 4096, Bytes::from(vec![3; 4096]), meta(3))
        .await
        .unwrap();
    // Unaligned zero inside the journaled sector range.
    store
        .zero(CHUNK, 4096 + 100, 200, false, meta(4))
        .await
        .unwrap();
    let check = |d: &[u8]| {
        assert!(
            d[..4096].iter().all(|&b| b == 2),
            "bypass superseded the small write"
        );
        assert!(d[4096..4196].iter().all(|&b| b == 3));
        assert!(d[4196..4396].iter().all(|&b| b == 0), "zero superseded");
        assert!(d[4396..8192].iter().all(|&b| b == 3));
        assert!(d[8192..].iter().all(|&b| b == 2));
    };
    check(&store.read(CHUNK, 0, 128 << 10).await.unwrap());
    wait_replayed(&store).await;
    check(&store.read(CHUNK, 0, 128 << 10).await.unwrap());
    check(&std::fs::read(chunk_file(data.path())).unwrap());
    assert_eq!(store.meta(CHUNK), meta(4));
}

/// Copies the journal aside before replay runs, as a kill -9 would leave it, and
/// opens a store on the copy: the index is rebuilt and replay resumes.
#[tokio::test]
async fn recovery_rebuilds_the_index_from_the_journal() {
    let data = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let crashed_ssd = tempfile::tempdir().unwrap();
    {
        let store = Store::open_with(data.path(), &options(&[ssd.path()], 1 << 30)).unwrap();
        for i in 0..50u64 {
            store
                .write(
                    CHUNK,
                    (i % 10) * 4096,
                    Bytes::from(vec![i as u8; 4096]),
                    meta(i + 1),
                )
                .await
                .unwrap();
            if i == 44 {
                // Journaled records survive, replayed or not.
                std::fs::copy(
                    ssd.path().join("floe-journal"),
                    crashed_ssd.path().join("floe-journal"),
                )
                .unwrap();
            }
        }
    }
    let crashed = tempfile::tempdir().unwrap();
    let store = Store::open_with(crashed.path(), &options(&[crashed_ssd.path()], 1 << 30)).unwrap();
    assert_eq!(store.meta(CHUNK), meta(45));
    for i in 35..45u64 {
        let offset = (i % 10) * 4096;
        assert_eq!(store.read(CHUNK, offset, 1).await.unwrap()[0], i as u8);
    }
    wait_replayed(&store).await;
    let on_disk = std::fs::read(chunk_file(crashed.path())).unwrap();
    for i in 35..45u64 {
        assert_eq!(on_disk[((i % 10) * 4096) as usize], i as u8);
    }
}

#[tokio::test]
async fn full_journals_overflow_to_the_next_then_the_hdd_then_bypass() {
    let data = tempfile::tempdir().unwrap();
    let first = tempfile::tempdir().unwrap();
    let second = tempfile::tempdir().unwrap();
    // Room for about two 4 KiB writes per journal.
    let quota = 4096 + 2 * (4096 + 512);
    let store =
        Store::open_with(data.path(), &options(&[first.path(), second.path()], quota)).unwrap();
    // Journals are allocated in full when opened: what one took ends at its last
    // byte written.
    let size = |p: &Path| {
        let bytes = std::fs::read(p).unwrap();
        bytes
            .iter()
            .rposition(|&b| b != 0)
            .map_or(0, |i| i as u64 + 1)
    };
    let mut sizes = Vec::new();
    for i in 0..8u64 {
        store
            .write(
                CHUNK,
                i * 4096,
                Bytes::from(vec![i as u8 + 1; 4096]),
                meta(i + 1),
            )
            .await
            .unwrap();
        sizes.push([
            size(&first.path().join("floe-journal")),
            size(&second.path().join("floe-journal")),
            size(&data.path().join("journal")),
        ]);
    }
    // Each journal took data in turn (replay may free the first meanwhile, so only
    // the order of first use is checked).
    let first_use = |j: usize| sizes.iter().position(|s| s[j] > 4096 + 4096);
    let (a, b, c) = (first_use(0), first_use(1), first_use(2));
    assert!(a.is_some() && a < b, "ssd journals in order: {sizes:?}");
    assert!(
        c.is_none() || b < c,
        "the hdd's own journal last: {sizes:?}"
    );
    for i in 0..8u64 {
        assert_eq!(
            store.read(CHUNK, i * 4096, 1).await.unwrap()[0],
            i as u8 + 1
        );
    }
}

/// A data directory run without journals, then with: the first hybrid open drains the
/// log into the chunk files, and blocks, versions and checksums come back through
/// kills of both runs and a power cut.
#[tokio::test]
async fn a_plain_stores_log_is_drained_when_journals_are_added() {
    let disk = SimDisk::new();
    let open = |journals: &[&Path]| {
        let tuning = Tuning::default();
        Store::open_on(
            disk.mount(),
            Path::new("/data"),
            &options(journals, 1 << 30),
            &tuning,
        )
        .expect("the store opens")
    };
    let plain = open(&[]);
    plain
        .write(CHUNK, 0, Bytes::from(vec![1; 8192]), meta(1))
        .await
        .unwrap();
    disk.crash();
    drop(plain);
    let hybrid = open(&[Path::new("/ssd")]);
    assert_eq!(&hybrid.read(CHUNK, 0, 8192).await.unwrap()[..], &[1; 8192]);
    // Journaled, then a bypass over the other block.
    hybrid
        .write(CHUNK, 0, Bytes::from(vec![2; 4096]), meta(2))
        .await
        .unwrap();
    hybrid
        .write(CHUNK, 4096, Bytes::from(vec![3; 1 << 20]), meta(3))
        .await
        .unwrap();
    wait_replayed(&hybrid).await;
    disk.crash();
    drop(hybrid);
    disk.power_cut(7);
    let again = open(&[Path::new("/ssd")]);
    let read = again.read(CHUNK, 0, 8192).await.unwrap();
    assert_eq!(&read[..4096], &[2; 4096]);
    assert_eq!(&read[4096..], &[3; 4096]);
    assert_eq!(again.meta(CHUNK), meta(3));
}

const MIB: u64 = 1 << 20;

fn manual_replay() -> Tuning {
    Tuning {
        manual_replay: true,
        ..Tuning::default()
    }
}

/// 60 MiB fill the first 64 MiB segment of a 256 MiB journal directory; the same
/// range again goes to the second. Returns the chunk's version.
async fn fill_two_segments(store: &Store) -> u64 {
    let mut version = 0;
    for round in 1..=2u8 {
        for i in 0..60 {
            version += 1;
            let block = Bytes::from(vec![round; MIB as usize]);
            store
                .write(CHUNK, i * MIB, block, meta(version))
                .await
                .unwrap();
        }
    }
    assert!(store.journal_usage().0 >= 120 * MIB);
    version
}

/// A smaller quota (one file) after segments were written: the other segments are
/// still scanned, so their writes stay.
#[tokio::test]
async fn segments_written_under_a_larger_quota_are_read_under_a_smaller_one() {
    let data = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let disk = std::sync::Arc::new(floe_chunkstore::RealDisk);
    let store = Store::open_on(
        disk.clone(),
        data.path(),
        &options(&[ssd.path()], 256 * MIB),
        &manual_replay(),
    )
    .unwrap();
    let version = fill_two_segments(&store).await;
    // As a kill -9 leaves them (the files stay locked while this store lives).
    let (crashed, crashed_ssd) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for name in [
        "floe-journal",
        "floe-journal.1",
        "floe-journal.2",
        "floe-journal.3",
    ] {
        std::fs::copy(ssd.path().join(name), crashed_ssd.path().join(name)).unwrap();
    }
    let store = Store::open_on(
        disk,
        crashed.path(),
        &options(&[crashed_ssd.path()], MIB),
        &manual_replay(),
    )
    .unwrap();
    assert_eq!(store.meta(CHUNK), meta(version));
    for i in [0, 30, 59] {
        assert_eq!(store.read(CHUNK, i * MIB, 1).await.unwrap()[0], 2);
    }
}

/// A journal directory with room for it is four files written in turn: the first,
/// whose data was all superseded, is freed while the second still waits for replay
/// (one file taking every write would stay full until replay caught up with all of
/// it).
#[tokio::test]
async fn a_segment_is_freed_while_the_next_still_waits_for_replay() {
    let data = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let store = Store::open_on(
        std::sync::Arc::new(floe_chunkstore::RealDisk),
        data.path(),
        &options(&[ssd.path()], 256 * MIB),
        &manual_replay(),
    )
    .unwrap();
    for name in [
        "floe-journal",
        "floe-journal.1",
        "floe-journal.2",
        "floe-journal.3",
    ] {
        assert!(ssd.path().join(name).exists(), "{name} missing");
    }
    let mut version = fill_two_segments(&store).await;
    // One sweep copies a few MiB of the second segment; the committer then frees the
    // first, where nothing is left.
    assert!(store.replay_sweep().unwrap() > 0);
    version += 1;
    store
        .write(CHUNK, 0, Bytes::from(vec![3; 4096]), meta(version))
        .await
        .unwrap();
    let (used, quota) = store.journal_usage();
    assert_eq!(quota, 256 * MIB);
    assert!(
        used < 64 * MIB,
        "the first segment was not freed: {used} bytes in use"
    );
    assert_eq!(store.read(CHUNK, 0, 1).await.unwrap()[0], 3);
    assert_eq!(store.read(CHUNK, 59 * MIB, 1).await.unwrap()[0], 2);
}
