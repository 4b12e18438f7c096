//! The layer over devices that model what a crash keeps.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use std::time::Duration;

/// A small log: 16 blocks, 8 spare slots (a checkpoint every 4 slot writes, the
/// permutation's cycle passed often).
fn layout() -> Layout {
    Layout {
        blocks: 16,
        slots: 24,
        checkpoint_bytes: 4096,
    }
}

const SIZE: u64 = 16 * BLOCK_BYTES;

fn tuning() -> Tuning {
    Tuning {
        limit_bytes: 8 * BLOCK_BYTES,
        checkpoint_every: 4,
    }
}

struct Pending {
    id: u64,
    offset: u64,
    data: Bytes,
    completed: bool,
}

#[derive(Default)]
struct Pages {
    /// What reads see: every completed write.
    volatile: BTreeMap<u64, Bytes>,
    /// What a power cut keeps for certain: writes a completed flush covered.
    durable: BTreeMap<u64, Bytes>,
    /// Writes since, in the order they were sent: a cut keeps each page of each at
    /// random.
    pending: Vec<Pending>,
    next_id: u64,
    cut: bool,
}

/// A device that loses power: completes writes and flushes after random delays (so
/// in any order), and at [`PowerCut::cut`] keeps, page by page and at random, what was
/// written since the last completed flush; afterwards every request fails.
struct PowerCut {
    pages: Mutex<Pages>,
    rng: Mutex<StdRng>,
    size: u64,
    broken_writes: std::sync::atomic::AtomicBool,
}

impl PowerCut {
    fn new(size: u64, seed: u64, durable: BTreeMap<u64, Bytes>) -> Arc<PowerCut> {
        Arc::new(PowerCut {
            pages: Mutex::new(Pages {
                volatile: durable.clone(),
                durable,
                ..Pages::default()
            }),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            size,
            broken_writes: Default::default(),
        })
    }

    async fn delay(&self) {
        let ms = self.rng.lock().unwrap().gen_range(0..6);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    fn failed() -> IoError {
        IoError::Io("power cut".into())
    }

    /// Cuts the power: the device fails from now on; returns one that starts with
    /// what survived.
    fn cut(&self, seed: u64) -> Arc<PowerCut> {
        let mut pages = self.pages.lock().unwrap();
        pages.cut = true;
        let mut durable = pages.durable.clone();
        let mut rng = self.rng.lock().unwrap();
        for pending in &pages.pending {
            for (i, page) in pending.data.chunks(BLOCK).enumerate() {
                if rng.gen_bool(0.5) {
                    let at = pending.offset / BLOCK_BYTES + i as u64;
                    durable.insert(at, Bytes::copy_from_slice(page));
                }
            }
        }
        PowerCut::new(self.size, seed, durable)
    }
}

#[async_trait]
impl BlockDevice for PowerCut {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError> {
        check_range(self.size, offset, length.into())?;
        assert!(
            offset.is_multiple_of(BLOCK_BYTES) && u64::from(length).is_multiple_of(BLOCK_BYTES)
        );
        self.delay().await;
        let pages = self.pages.lock().unwrap();
        if pages.cut {
            return Err(PowerCut::failed());
        }
        let mut out = BytesMut::new();
        for page in offset / BLOCK_BYTES..(offset + u64::from(length)) / BLOCK_BYTES {
            match pages.volatile.get(&page) {
                Some(data) => out.extend_from_slice(data),
                None => out.extend_from_slice(&[0; BLOCK]),
            }
        }
        Ok(out.freeze())
    }

    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> Result<(), IoError> {
        check_range(self.size, offset, data.len() as u64)?;
        assert!(offset.is_multiple_of(BLOCK_BYTES) && data.len().is_multiple_of(BLOCK));
        let id = {
            let mut pages = self.pages.lock().unwrap();
            if pages.cut {
                return Err(PowerCut::failed());
            }
            let id = pages.next_id;
            pages.next_id += 1;
            pages.pending.push(Pending {
                id,
                offset,
                data: data.clone(),
                completed: false,
            });
            id
        };
        self.delay().await;
        let mut pages = self.pages.lock().unwrap();
        if pages.cut {
            return Err(PowerCut::failed());
        }
        if self
            .broken_writes
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(IoError::NoSpace("full".into()));
        }
        // Still pending: flushes take completed writes only.
        let pending = pages
            .pending
            .iter_mut()
            .find(|p| p.id == id)
            .expect("pending");
        pending.completed = true;
        for (i, page) in data.chunks(BLOCK).enumerate() {
            let at = offset / BLOCK_BYTES + i as u64;
            pages.volatile.insert(at, Bytes::copy_from_slice(page));
        }
        Ok(())
    }

    async fn flush(&self) -> Result<(), IoError> {
        let covered: usize = {
            let pages = self.pages.lock().unwrap();
            if pages.cut {
                return Err(PowerCut::failed());
            }
            pages.pending.iter().filter(|p| p.completed).count()
        };
        self.delay().await;
        let mut pages = self.pages.lock().unwrap();
        if pages.cut {
            return Err(PowerCut::failed());
        }
        // The writes completed when the flush began (others may have completed
        // since: taking them too would make the device more durable than asked, so
        // only the first `covered` completed ones go).
        let mut taken = 0;
        let mut keep = Vec::new();
        for pending in std::mem::take(&mut pages.pending) {
            if pending.completed && taken < covered {
                taken += 1;
                for (i, page) in pending.data.chunks(BLOCK).enumerate() {
                    let at = pending.offset / BLOCK_BYTES + i as u64;
                    pages.durable.insert(at, Bytes::copy_from_slice(page));
                }
            } else {
                keep.push(pending);
            }
        }
        pages.pending = keep;
        Ok(())
    }

    async fn trim(&self, _: u64, _: u64) -> Result<(), IoError> {
        unreachable!("the log writes slots only")
    }

    async fn write_zeroes(&self, _: u64, _: u64, _: bool) -> Result<(), IoError> {
        unreachable!("the log writes slots only")
    }

    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        Ok(vec![Extent {
            length: length.min(self.size - offset),
            hole: false,
        }])
    }
}

/// An acknowledged change, as the model applies it.
#[derive(Debug, Clone)]
struct Change {
    offset: u64,
    /// `None`: zeroes (write-zeroes or trim).
    data: Option<Vec<u8>>,
    length: u64,
    fua: bool,
}

fn apply(image: &mut [u8], change: &Change) {
    let range = change.offset as usize..(change.offset + change.length) as usize;
    match &change.data {
        Some(data) => image[range].copy_from_slice(data),
        None => image[range].fill(0),
    }
}

async fn open(name: &str, device: Arc<PowerCut>, writable: bool) -> LogCommit {
    open_tuned(name, device, writable, tuning()).await
}

async fn open_tuned(
    name: &str,
    device: Arc<PowerCut>,
    writable: bool,
    tuning: Tuning,
) -> LogCommit {
    LogCommit::open_with(name, device, SIZE, layout(), writable, tuning)
        .await
        .expect("the log opens")
}

async fn image(layer: &LogCommit) -> Vec<u8> {
    layer.read(0, SIZE as u32).await.expect("reads").to_vec()
}

/// Runs random changes, FLUSHes and FUA writes against `layer`, in order (each
/// acknowledged before the next); returns those acknowledged.
async fn run(layer: &LogCommit, rng: &mut StdRng, ops: usize) -> Vec<Change> {
    let mut done = Vec::new();
    for _ in 0..ops {
        let roll = rng.gen_range(0..100);
        let (offset, length) = if roll < 45 {
            // Whole blocks.
            let first = rng.gen_range(0..16);
            let count = rng.gen_range(1..=3u64).min(16 - first);
            (first * BLOCK_BYTES, count * BLOCK_BYTES)
        } else {
            let offset = rng.gen_range(0..SIZE - 1);
            (
                offset,
                rng.gen_range(1..=(SIZE - offset).min(3 * BLOCK_BYTES)),
            )
        };
        let change = match roll {
            0..=59 | 80..=87 => {
                let mut data = vec![0; length as usize];
                rng.fill_bytes(&mut data);
                Change {
                    offset,
                    data: Some(data),
                    length,
                    fua: roll >= 80,
                }
            }
            60..=69 => Change {
                offset,
                data: None,
                length,
                fua: false,
            },
            70..=79 => {
                layer.flush().await.expect("a FLUSH succeeds");
                continue;
            }
            _ => {
                let ms = rng.gen_range(0..12);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                continue;
            }
        };
        let result = match &change.data {
            Some(data) => {
                layer
                    .write(offset, Bytes::from(data.clone()), change.fua)
                    .await
            }
            None if rng.gen_bool(0.5) => layer.trim(offset, length).await,
            None => layer.write_zeroes(offset, length, true).await,
        };
        result.expect("a change succeeds");
        done.push(change);
    }
    done
}

/// The longest prefix of `changes` that `image` holds over `base`, if it holds one:
/// its changes whole, and of the next (a write of many blocks is not atomic) any of
/// its blocks.
fn prefix(base: &[u8], changes: &[Change], image: &[u8]) -> Option<usize> {
    let block = |image: &[u8], b: usize| image[b * BLOCK..(b + 1) * BLOCK].to_vec();
    let mut state = base.to_vec();
    let mut found = None;
    for k in 0..=changes.len() {
        let next = changes.get(k).map(|change| {
            let mut next = state.clone();
            apply(&mut next, change);
            next
        });
        let held = (0..SIZE as usize / BLOCK).all(|b| {
            block(image, b) == block(&state, b)
                || next
                    .as_ref()
                    .is_some_and(|n| block(image, b) == block(n, b))
        });
        if held {
            found = Some(k);
        }
        if let Some(next) = next {
            state = next;
        }
    }
    found
}

/// One seed: rounds of random changes cut short by a power cut at a random moment;
/// after each the log recovers a prefix of the acknowledged changes that holds every
/// FUA write (and everything before it). Last, a clean close keeps everything.
async fn crash_rounds(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let name = format!("crash-{seed}");
    let mut device = PowerCut::new(layout().backing_bytes(), rng.gen(), BTreeMap::new());
    let mut base = vec![0u8; SIZE as usize];
    // Checkpoints from every slot write to every 8 (all the spare slots); few or many
    // writes in flight.
    let tuning = Tuning {
        limit_bytes: rng.gen_range(2..=16) * BLOCK_BYTES,
        checkpoint_every: rng.gen_range(1..=8),
    };
    let rounds = 4;
    for round in 0..=rounds {
        let layer = open_tuned(&name, device.clone(), true, tuning).await;
        assert_eq!(
            image(&layer).await,
            base,
            "seed {seed} round {round}: reopened as recovered"
        );
        let ops = rng.gen_range(0..60);
        let changes = run(&layer, &mut rng, ops).await;
        let mut expected = base.clone();
        for change in &changes {
            apply(&mut expected, change);
        }
        assert_eq!(
            image(&layer).await,
            expected,
            "seed {seed}: reads see every acknowledged write"
        );
        let survivor = if round < rounds {
            if rng.gen_bool(0.5) {
                tokio::time::sleep(Duration::from_millis(rng.gen_range(0..12))).await;
            }
            let survivor = device.cut(rng.gen());
            drop(layer);
            survivor
        } else {
            drop(layer);
            tokio::time::timeout(
                Duration::from_secs(60),
                crate::draining::drained_volume(&name),
            )
            .await
            .expect("a dropped layer drains");
            device.cut(rng.gen())
        };
        let recovered = image(&open(&name, survivor.clone(), false).await).await;
        let kept = prefix(&base, &changes, &recovered).unwrap_or_else(|| {
            panic!("seed {seed} round {round}: the recovered volume is no prefix of the {} acknowledged changes", changes.len())
        });
        let must = match round < rounds {
            true => changes.iter().rposition(|c| c.fua).map_or(0, |i| i + 1),
            false => changes.len(),
        };
        assert!(
            kept >= must,
            "seed {seed} round {round}: kept {kept} of {} changes; change {} was FUA or the layer closed cleanly",
            changes.len(),
            must - 1
        );
        base = recovered;
        device = survivor;
    }
}

fn seeds() -> u64 {
    std::env::var("FLOE_LOG_COMMIT_SEEDS").map_or(100, |s| s.parse().unwrap())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

#[test]
fn a_power_cut_keeps_a_prefix_of_the_acknowledged_writes_with_every_fua_write() {
    let first: u64 = std::env::var("FLOE_LOG_COMMIT_SEED").map_or(0, |s| s.parse().unwrap());
    for seed in first..first + seeds() {
        runtime().block_on(crash_rounds(seed));
    }
}

#[tokio::test(start_paused = true)]
async fn writes_are_acknowledged_before_they_land_and_fua_waits_for_a_flush_below() {
    let device = PowerCut::new(layout().backing_bytes(), 1, BTreeMap::new());
    let layer = Arc::new(open("fast-ack", device.clone(), true).await);
    let started = tokio::time::Instant::now();
    layer
        .write(0, Bytes::from(vec![1; BLOCK]), false)
        .await
        .unwrap();
    layer
        .write(100, Bytes::from(vec![2; 50]), false)
        .await
        .unwrap();
    assert_eq!(started.elapsed(), Duration::ZERO, "acknowledged at once");
    let read = layer.read(0, 4096).await.unwrap();
    assert_eq!(&read[..100], &[1; 100][..]);
    assert_eq!(&read[100..150], &[2; 50][..]);
    assert_eq!(&read[150..], &[1; 4096 - 150][..]);
    layer
        .write(8192, Bytes::from(vec![3; BLOCK]), true)
        .await
        .unwrap();
    // The FUA write retired: everything before it is durable.
    let survivor = device.cut(2);
    let recovered = open("fast-ack-2", survivor, false).await;
    assert_eq!(recovered.read(0, 4096).await.unwrap(), read);
    assert_eq!(
        recovered.read(8192, 4096).await.unwrap(),
        Bytes::from(vec![3; BLOCK])
    );
}

#[tokio::test(start_paused = true)]
async fn a_write_that_fails_below_fails_the_next_flush_and_everything_after() {
    let device = PowerCut::new(layout().backing_bytes(), 1, BTreeMap::new());
    let layer = open("broken", device.clone(), true).await;
    device
        .broken_writes
        .store(true, std::sync::atomic::Ordering::Relaxed);
    layer
        .write(0, Bytes::from(vec![1; BLOCK]), false)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(matches!(layer.flush().await, Err(IoError::NoSpace(_))));
    assert!(layer.flush().await.is_err(), "fail-stop until reopened");
    assert!(layer
        .write(0, Bytes::from(vec![2; BLOCK]), false)
        .await
        .is_err());
    assert_eq!(
        layer.read(0, 4096).await.unwrap(),
        Bytes::from(vec![1; BLOCK]),
        "reads still see the acknowledged write"
    );
}

#[tokio::test(start_paused = true)]
async fn writes_past_the_limit_wait_for_retirement() {
    let device = PowerCut::new(layout().backing_bytes(), 1, BTreeMap::new());
    let layer = Arc::new(open("limit", device.clone(), true).await);
    // Eight blocks fill the 32 KiB limit; the ninth waits until some retire.
    let started = tokio::time::Instant::now();
    layer
        .write(0, Bytes::from(vec![1; 8 * BLOCK]), false)
        .await
        .unwrap();
    assert_eq!(started.elapsed(), Duration::ZERO);
    layer
        .write(8 * 4096, Bytes::from(vec![2; BLOCK]), false)
        .await
        .unwrap();
    assert!(started.elapsed() > Duration::ZERO, "the ninth block waited");
}

#[tokio::test(start_paused = true)]
async fn a_read_only_open_sees_the_log_and_refuses_writes() {
    let device = PowerCut::new(layout().backing_bytes(), 1, BTreeMap::new());
    let layer = open("ro", device.clone(), true).await;
    layer
        .write(4096, Bytes::from(vec![9; BLOCK]), true)
        .await
        .unwrap();
    let reader = open("ro", device.clone(), false).await;
    assert_eq!(
        reader.read(4096, 4096).await.unwrap(),
        Bytes::from(vec![9; BLOCK])
    );
    assert_eq!(
        reader.write(0, Bytes::from(vec![1; BLOCK]), false).await,
        Err(IoError::ReadOnly)
    );
    let extents = reader.extents(0, SIZE).await.unwrap();
    assert_eq!(
        extents,
        vec![
            Extent {
                length: 4096,
                hole: true
            },
            Extent {
                length: 4096,
                hole: false
            },
            Extent {
                length: SIZE - 8192,
                hole: true
            },
        ]
    );
}
