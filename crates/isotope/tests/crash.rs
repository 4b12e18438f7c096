//! Atomicity across crashes on a RAM device that, at a chosen write, keeps a random
//! part of that write's blocks and refuses every later write (a kill -9 mid-commit,
//! or a lease taken over): after reopening, bank transfers still sum to the total,
//! every acknowledged transfer is there and none partially.

use async_trait::async_trait;
use bytes::Bytes;
use floe_blockdev::memory::MemoryDevice;
use floe_blockdev::{BlockDevice, Extent, IoError};
use floe_isotope::{layout, Isolation, Outcome, TxError, TxVolume, BLOCK_BYTES};
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const ACCOUNTS: u64 = 40;
const INITIAL: u64 = 1000;
/// Block 0 counts the transfers; accounts lie one per block after it, each with the
/// id of the last transfer that touched it.
const COUNTER: u64 = 0;
const CLIENTS: usize = 3;

struct Crashing {
    below: Arc<MemoryDevice>,
    writes_left: AtomicU64,
    rng: std::sync::Mutex<rand::rngs::StdRng>,
    /// Whether writes in place complete: if not, they wait forever (the process dies
    /// before any lands), and commits are answered once logged.
    in_place: bool,
}

impl Crashing {
    fn new(below: Arc<MemoryDevice>, writes_left: u64, seed: u64) -> Arc<Crashing> {
        Crashing::device(below, writes_left, seed, true)
    }

    fn never_applied(below: Arc<MemoryDevice>) -> Arc<Crashing> {
        Crashing::device(below, u64::MAX, 0, false)
    }

    fn device(below: Arc<MemoryDevice>, writes_left: u64, seed: u64, in_place: bool) -> Arc<Self> {
        Arc::new(Crashing {
            below,
            writes_left: AtomicU64::new(writes_left),
            rng: std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
            in_place,
        })
    }
}

#[async_trait]
impl BlockDevice for Crashing {
    fn size(&self) -> u64 {
        self.below.size()
    }
    async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError> {
        self.below.read(offset, length).await
    }
    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        if !self.in_place && offset >= layout::LOG_REGION_BYTES {
            std::future::pending::<()>().await;
        }
        match self.writes_left.fetch_sub(1, Ordering::SeqCst) {
            0 => {
                self.writes_left.store(0, Ordering::SeqCst);
                Err(IoError::Io("fenced: the lease moved".into()))
            }
            1 => {
                // The crash: some of this write's blocks land, torn at block grain.
                for block in 0..data.len() / BLOCK_BYTES {
                    if self.rng.lock().unwrap().gen_bool(0.5) {
                        let piece = data.slice(block * BLOCK_BYTES..(block + 1) * BLOCK_BYTES);
                        let at = offset + (block * BLOCK_BYTES) as u64;
                        self.below.write(at, piece, fua).await?;
                    }
                }
                Err(IoError::Io("crashed".into()))
            }
            _ => {
                // Lets the other clients run, as a network round trip would.
                tokio::task::yield_now().await;
                self.below.write(offset, data, fua).await
            }
        }
    }
    async fn flush(&self) -> Result<(), IoError> {
        self.below.flush().await
    }
    async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError> {
        self.below.trim(offset, length).await
    }
    async fn write_zeroes(&self, offset: u64, length: u64, punch: bool) -> Result<(), IoError> {
        self.below.write_zeroes(offset, length, punch).await
    }
    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        self.below.extents(offset, length).await
    }
}

fn encode(a: u64, b: u64) -> Bytes {
    let mut data = vec![0u8; BLOCK_BYTES];
    data[..8].copy_from_slice(&a.to_le_bytes());
    data[8..16].copy_from_slice(&b.to_le_bytes());
    Bytes::from(data)
}

fn decode(data: &[u8]) -> (u64, u64) {
    let at = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().unwrap());
    (at(0), at(8))
}

/// Reads every account: (balances, the transfer count).
async fn state(volume: &TxVolume) -> (Vec<(u64, u64)>, u64) {
    let mut t = volume.begin().unwrap();
    let count = decode(&t.read(COUNTER).await.unwrap()).0;
    let mut accounts = Vec::new();
    for a in 1..=ACCOUNTS {
        accounts.push(decode(&t.read(a).await.unwrap()));
    }
    (accounts, count)
}

#[tokio::test]
async fn transfers_are_all_or_nothing_across_crashes_and_fencing() {
    let seeds: u64 = std::env::var("FLOE_ISOTOPE_CRASH_SEEDS").map_or(30, |s| s.parse().unwrap());
    for seed in 0..seeds {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let memory = Arc::new(MemoryDevice::new(layout::LOG_REGION_BYTES + (1 << 20)));
        let plain = TxVolume::open(memory.clone(), Isolation::StrictSerializable)
            .await
            .unwrap();
        let mut setup = plain.begin().unwrap();
        for a in 1..=ACCOUNTS {
            setup.write(a, encode(INITIAL, 0)).unwrap();
        }
        assert!(matches!(
            setup.commit().await.unwrap(),
            Outcome::Committed { .. }
        ));
        drop(plain);
        // Several crashes per seed, each reopening what the last one left; long
        // enough runs that the log ring wraps.
        let mut acknowledged = 0;
        for _ in 0..4 {
            let device = Crashing::new(memory.clone(), rng.gen_range(1..4000), rng.gen());
            let volume = match TxVolume::open(device, Isolation::StrictSerializable).await {
                Ok(volume) => volume,
                // Crashed during replay: the next open replays again.
                Err(_) => continue,
            };
            let (_, count) = state(&volume).await;
            assert!(
                count >= acknowledged,
                "seed {seed}: transfer {acknowledged} was acknowledged, found {count}"
            );
            acknowledged = count;
            // Clients at once, so commits wait for the log and go in groups.
            let acked = std::cell::Cell::new(acknowledged);
            let client = |mut rng: rand::rngs::StdRng| {
                let (volume, acked) = (&volume, &acked);
                async move {
                    loop {
                        let mut t = volume.begin().unwrap();
                        let id = decode(&t.read(COUNTER).await.unwrap()).0 + 1;
                        // Several accounts per transfer: multi-block records, torn at random.
                        let from = rng.gen_range(1..=ACCOUNTS);
                        let to: Vec<u64> = (0..rng.gen_range(1..4))
                            .map(|_| rng.gen_range(1..=ACCOUNTS))
                            .filter(|a| *a != from)
                            .collect();
                        let mut balance = decode(&t.read(from).await.unwrap()).0;
                        for a in &to {
                            let amount = rng.gen_range(0..=balance.min(50));
                            balance -= amount;
                            let (to_balance, _) = decode(&t.read(*a).await.unwrap());
                            t.write(*a, encode(to_balance + amount, id)).unwrap();
                        }
                        t.write(from, encode(balance, id)).unwrap();
                        t.write(COUNTER, encode(id, 0)).unwrap();
                        match t.commit().await {
                            Ok(Outcome::Committed { .. }) => acked.set(acked.get().max(id)),
                            Ok(Outcome::Conflict) => {}
                            Err(TxError::Stopped(_)) => break,
                            Err(e) => panic!("seed {seed}: {e}"),
                        }
                    }
                }
            };
            let clients =
                (0..CLIENTS).map(|_| client(rand::rngs::StdRng::seed_from_u64(rng.gen())));
            futures::future::join_all(clients).await;
            acknowledged = acked.get();
            // Stopped: a later commit is refused, with nothing changed.
            let mut late = volume.begin().unwrap();
            late.write(1, encode(0, u64::MAX)).unwrap();
            assert!(matches!(late.commit().await, Err(TxError::Stopped(_))));
        }
        let volume = TxVolume::open(memory.clone(), Isolation::StrictSerializable)
            .await
            .unwrap();
        let (accounts, count) = state(&volume).await;
        assert!(
            count >= acknowledged,
            "seed {seed}: transfer {acknowledged} was acknowledged, found {count}"
        );
        let total: u64 = accounts.iter().map(|(balance, _)| balance).sum();
        assert_eq!(
            total,
            ACCOUNTS * INITIAL,
            "seed {seed}: a transfer is partly there"
        );
        for (a, (_, last)) in accounts.iter().enumerate() {
            assert!(
                *last <= count,
                "seed {seed}: account {} holds transfer {last} past the counter {count}",
                a + 1
            );
        }
    }
}

/// Clients at once increment counters, some in 16-byte fragments of one shared block
/// (marked), some in blocks of their own: commits go in groups, and no increment is
/// lost, under either isolation (conflicts and merges within a group included).
/// Clients wait a random while between their read and their commit, so that many
/// commits of a shared-block fragment land after another fragment's commit that
/// followed their snapshot (the test checks it happened): a commit that merged onto
/// its own snapshot, or onto anything but the newest contents, loses that increment.
#[tokio::test]
async fn concurrent_increments_in_groups_lose_nothing() {
    const COUNTERS: usize = 8;
    for isolation in [Isolation::StrictSerializable, Isolation::Snapshot] {
        let memory = Arc::new(MemoryDevice::new(layout::LOG_REGION_BYTES + (1 << 20)));
        let device = Crashing::new(memory.clone(), u64::MAX, 0);
        let volume = TxVolume::open(device, isolation).await.unwrap();
        let conflicts = std::cell::Cell::new(0u64);
        // Per counter, the (start, commit) versions of its committed increments.
        let committed = std::cell::RefCell::new(vec![Vec::new(); COUNTERS]);
        // Counter c: fragment c of block 0 (c < 4), or block c.
        let place = |c: usize| if c < 4 { (0, c * 16) } else { (c as u64, 0) };
        let client = |seed: u64| {
            let (volume, committed, conflicts) = (&volume, &committed, &conflicts);
            async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let mut done = 0;
                while done < 40 {
                    let counter: usize = rng.gen_range(0..COUNTERS);
                    let (block, at) = place(counter);
                    let mut t = volume.begin().unwrap();
                    let start = t.start_version();
                    let mut data = t.read(block).await.unwrap().to_vec();
                    for _ in 0..rng.gen_range(0..4) {
                        tokio::task::yield_now().await;
                    }
                    let n = u64::from_le_bytes(data[at..at + 8].try_into().unwrap());
                    data[at..at + 8].copy_from_slice(&(n + 1).to_le_bytes());
                    t.write(block, Bytes::from(data)).unwrap();
                    t.mark_accessed(block, at, 8).unwrap();
                    match t.commit().await.unwrap() {
                        Outcome::Committed { version } => {
                            committed.borrow_mut()[counter].push((start, version));
                            done += 1;
                        }
                        Outcome::Conflict => conflicts.set(conflicts.get() + 1),
                    }
                }
            }
        };
        futures::future::join_all((0..6).map(client)).await;
        let committed = committed.into_inner();
        let mut t = volume.begin().unwrap();
        for (c, increments) in committed.iter().enumerate() {
            let (block, at) = place(c);
            let data = t.read(block).await.unwrap();
            let n = u64::from_le_bytes(data[at..at + 8].try_into().unwrap());
            assert_eq!(
                n,
                increments.len() as u64,
                "{isolation:?}: counter {c} lost increments"
            );
        }
        assert_eq!(committed.iter().map(Vec::len).sum::<usize>(), 240);
        // Commits of a shared-block counter with another fragment's commit after their
        // start and before them: the merges a stale base would get wrong.
        let shared: Vec<(usize, u64, u64)> = (0..4)
            .flat_map(|c| committed[c].iter().map(move |(s, v)| (c, *s, *v)))
            .collect();
        let merged_past_snapshot = shared
            .iter()
            .filter(|(c, start, version)| {
                let between = |(o, _, v): &&(usize, u64, u64)| o != c && v > start && v < version;
                shared.iter().any(|o| between(&o))
            })
            .count();
        assert!(
            merged_past_snapshot > 20,
            "{isolation:?}: only {merged_past_snapshot} commits merged past their snapshot"
        );
        assert!(
            conflicts.get() > 0,
            "{isolation:?}: the clients never raced"
        );
    }
}

/// A commit whose future is dropped at its wait (the log append: it is answered
/// once logged, with no wait after) stops the volume; reopening shows it absent, the
/// append not having been issued.
#[tokio::test]
async fn a_commit_cancelled_mid_way_stops_the_volume_and_reopening_recovers_it() {
    let memory = Arc::new(MemoryDevice::new(layout::LOG_REGION_BYTES + (1 << 20)));
    let device = Crashing::new(memory.clone(), u64::MAX, 0);
    let v = TxVolume::open(device, Isolation::StrictSerializable)
        .await
        .unwrap();
    let mut t = v.begin().unwrap();
    t.write(1, encode(11, 0)).unwrap();
    t.write(2, encode(11, 0)).unwrap();
    let mut commit = Box::pin(t.commit());
    assert!(futures::poll!(commit.as_mut()).is_pending());
    drop(commit);
    let mut late = v.begin().unwrap();
    late.write(3, encode(33, 0)).unwrap();
    assert!(matches!(late.commit().await, Err(TxError::Stopped(_))));
    drop(v);
    let again = TxVolume::open(memory, Isolation::StrictSerializable)
        .await
        .unwrap();
    let mut check = again.begin().unwrap();
    for block in [1, 2, 3] {
        assert_eq!(
            decode(&check.read(block).await.unwrap()).0,
            0,
            "block {block}"
        );
    }
}

/// Committed transactions whose blocks never reached their place: the volume reads
/// them (from the applier's dirty blocks) while open, and after a crash reopening
/// shows every one of them (replay), though nothing of theirs is in place.
#[tokio::test]
async fn committed_transactions_left_unapplied_are_there_after_reopening() {
    let memory = Arc::new(MemoryDevice::new(layout::LOG_REGION_BYTES + (1 << 20)));
    let volume = TxVolume::open(
        Crashing::never_applied(memory.clone()),
        Isolation::StrictSerializable,
    )
    .await
    .unwrap();
    // Each transfer moves one from the previous account to the next and counts itself.
    let transfers = 30;
    for id in 1..=transfers {
        let mut t = volume.begin().unwrap();
        let (from, to) = (id % ACCOUNTS + 1, (id + 1) % ACCOUNTS + 1);
        let count = decode(&t.read(COUNTER).await.unwrap()).0;
        assert_eq!(count, id - 1, "the volume reads its unapplied commits");
        let from_balance = decode(&t.read(from).await.unwrap()).0;
        let to_balance = decode(&t.read(to).await.unwrap()).0;
        t.write(from, encode(from_balance.wrapping_sub(1), id))
            .unwrap();
        t.write(to, encode(to_balance + 1, id)).unwrap();
        t.write(COUNTER, encode(id, 0)).unwrap();
        assert_eq!(
            t.commit().await.unwrap(),
            Outcome::Committed { version: id }
        );
    }
    let expected = state(&volume).await;
    assert_eq!(expected.1, transfers);
    drop(volume);
    // The crash: nothing in place.
    let in_place = memory
        .read(layout::data_offset(0), BLOCK_BYTES as u32)
        .await
        .unwrap();
    assert!(in_place.iter().all(|b| *b == 0), "a block was applied");
    let again = TxVolume::open(memory, Isolation::StrictSerializable)
        .await
        .unwrap();
    assert_eq!(again.version(), transfers);
    assert_eq!(
        state(&again).await,
        expected,
        "a committed transfer is missing"
    );
}

/// The ring wraps only once every record before is applied: with nothing ever
/// applied, the commit that would wrap it waits (here until the crash), and reopening
/// shows every acknowledged commit, though the superblock would otherwise have moved
/// past their records.
#[tokio::test]
async fn the_ring_does_not_wrap_over_unapplied_records() {
    // One block per commit, each its own: a record of two blocks, more of them than
    // the ring holds.
    let commits = layout::RING_BYTES / layout::record_bytes(1) + 10;
    let memory = Arc::new(MemoryDevice::new(
        layout::LOG_REGION_BYTES + commits * BLOCK_BYTES as u64,
    ));
    let volume = TxVolume::open(
        Crashing::never_applied(memory.clone()),
        Isolation::StrictSerializable,
    )
    .await
    .unwrap();
    let mut acknowledged = 0;
    for block in 0..commits {
        let mut t = volume.begin().unwrap();
        t.write(block, encode(block + 1, 0)).unwrap();
        let waited = std::time::Duration::from_secs(1);
        match tokio::time::timeout(waited, t.commit()).await {
            Ok(outcome) => assert!(matches!(outcome.unwrap(), Outcome::Committed { .. })),
            Err(_) => break,
        }
        acknowledged += 1;
    }
    assert!(
        acknowledged < commits,
        "all {commits} commits went through a ring that holds fewer"
    );
    drop(volume);
    let again = TxVolume::open(memory, Isolation::StrictSerializable)
        .await
        .unwrap();
    let mut check = again.begin().unwrap();
    for block in 0..acknowledged {
        let found = decode(&check.read(block).await.unwrap()).0;
        assert_eq!(
            found,
            block + 1,
            "acknowledged commit {} is lost",
            block + 1
        );
    }
}
