//! The thesis's chained-log experiment (Gecko, chapter 3), at the engine level: one
//! `Store` on three EMULATED 7200 rpm hdds (`disk::hdd`, one per chain disk; the
//! write-ahead log and the saved map on the real file system, standing in for
//! flash), random 64 KiB writes by 8 writers while
//! - `alone`: nothing else runs (no cleaning: the chain has room for the whole run),
//! - `reader`: 8 random 4 KiB readers read 64 MiB written before (on disk 0),
//! - `gc`: the cleaner runs (a 3 x 256 MiB chain, 320 MiB live by default,
//!   overwritten at random),
//! - `reader+gc`: both,
//!
//! each for the chained layout (Gecko) and the striped one (a log-structured RAID-0
//! over the same disks: the same engine, its log dealt in 64 KiB stripe units).
//! The tail cache is RAM, a disk's worth (no flash tail cache).
//! The chain disks' writes are write-behind up to 100 ms of disk time (the page
//! cache; the write-ahead log holds the data), reads wait for the disk.
//! Prints one line per run and a summary of medians with ratios; writes JSON (every
//! run's throughput per 250 ms, its chain counters, the medians) to
//! `CHAIN_BENCH_OUT` (default `target/chain_bench.json`).
//!
//! Environment: `CHAIN_BENCH_SECONDS` (measured seconds per run, default 4),
//! `CHAIN_BENCH_RUNS` (runs of each case, default 3), `CHAIN_BENCH_DIR` (where the
//! disks' files go, default the system's temporary directory), `CHAIN_BENCH_GC`
//! (`move-to-tail`, the default, or `compact-in-body`: the cleaner of every case),
//! `CHAIN_BENCH_LIVE_MIB` (the cleaning cases' live data, default 320: with the
//! cleaner keeping a disk free, it sets how much of each head segment is live, and
//! move-to-tail leaves the clients at most the rest of the tail disk).

use bytes::Bytes;
use floe_chunkstore::{
    ChainGc, ChainLayout, ChainOptions, ChainStats, ChunkMeta, Options, RealDisk,
};
use floe_chunkstore::{Store, Tuning};
use floe_protocol::ChunkId;
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const BLOCK_BYTES: u64 = 4096;
const WRITE_BYTES: u64 = 64 << 10;
const READ_BYTES: u64 = 4 << 10;
const WRITERS: usize = 8;
const READERS: usize = 8;
/// Logical bytes per chunk the workload addresses.
const CHUNK_SPAN: u64 = 64 * MIB;
const SAMPLE: Duration = Duration::from_millis(250);
/// The read set (volume 1), the no-cleaning runs' spacer (2) and write region (3).
const READ_VOLUME: u64 = 1;
const SPACER_VOLUME: u64 = 2;
const WRITE_VOLUME: u64 = 3;

#[derive(Debug, Clone, Copy, PartialEq)]
struct Scenario {
    name: &'static str,
    reader: bool,
    gc: bool,
}

const SCENARIOS: [Scenario; 4] = [
    Scenario {
        name: "alone",
        reader: false,
        gc: false,
    },
    Scenario {
        name: "reader",
        reader: true,
        gc: false,
    },
    Scenario {
        name: "gc",
        reader: false,
        gc: true,
    },
    Scenario {
        name: "reader+gc",
        reader: true,
        gc: true,
    },
];

/// The chain for a scenario: without cleaning, disks big enough that the run never
/// reaches the cleaner's mark; with it, small ones kept at the mark.
struct Setup {
    disk_bytes: u64,
    /// Written before the run; what the readers read and (with cleaning) the
    /// writers overwrite.
    live_bytes: u64,
}

/// Without cleaning, the run's writes must fit in the disk's worth between the
/// tail's start (disk 1) and the cleaner's mark (a disk free): this much per
/// second, above the striped log's best alone (319 MB/s on a quiet machine).
const NO_GC_DISK_BYTES_PER_SECOND: u64 = 384 * MIB;

/// The cleaning cases' live data by default: 5/12 of the chain.
const LIVE_MIB: u64 = 320;

/// The cleaning cases' live data: `CHAIN_BENCH_LIVE_MIB`, else [`LIVE_MIB`].
fn gc_live_bytes() -> u64 {
    let live_bytes = env_or("CHAIN_BENCH_LIVE_MIB", LIVE_MIB) * MIB;
    assert!(
        (64 * MIB..=384 * MIB).contains(&live_bytes),
        "CHAIN_BENCH_LIVE_MIB is 64..=384: the log must keep room for the cleaner's mark"
    );
    live_bytes
}

impl Setup {
    fn of(scenario: Scenario, seconds: u64) -> Setup {
        match scenario.gc {
            false => Setup {
                disk_bytes: (seconds * NO_GC_DISK_BYTES_PER_SECOND).max(256 * MIB),
                live_bytes: 64 * MIB,
            },
            // Disks of 256 MiB, not 64: each time the tail enters the next disk the
            // last one's write-behind (100 ms) drains beside the new one's, and with
            // 64 MiB disks that came every 0.4 s.
            true => Setup {
                disk_bytes: 256 * MIB,
                live_bytes: gc_live_bytes(),
            },
        }
    }
}

struct Run {
    write_mb_s: f64,
    /// What the cleaner moved to the tail: with the clients' writes, what the tail
    /// disk wrote (move-to-tail takes that share of its bandwidth).
    moved_mb_s: f64,
    read_iops: f64,
    /// (seconds, write MB/s, read IOPS) per sample.
    series: Vec<(f64, f64, f64)>,
    stats: ChainStats,
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name} is a number")))
        .unwrap_or(default)
}

fn chunk_at(volume_id: u64, at: u64) -> (ChunkId, u64) {
    let chunk = ChunkId {
        volume_id,
        index: at / CHUNK_SPAN,
    };
    (chunk, at % CHUNK_SPAN)
}

/// The cleaners `CHAIN_BENCH_GC` names, by the names `--gc` takes.
const CLEANERS: [(&str, ChainGc); 2] = [
    ("move-to-tail", ChainGc::MoveToTail),
    ("compact-in-body", ChainGc::CompactInBody),
];

/// The cleaner `CHAIN_BENCH_GC` names (default move-to-tail), and its name.
fn gc() -> (&'static str, ChainGc) {
    let wanted = std::env::var("CHAIN_BENCH_GC").unwrap_or_else(|_| CLEANERS[0].0.into());
    CLEANERS
        .into_iter()
        .find(|(name, _)| *name == wanted)
        .unwrap_or_else(|| {
            panic!("CHAIN_BENCH_GC is move-to-tail or compact-in-body, not {wanted:?}")
        })
}

fn options(dir: &Path, layout: ChainLayout, setup: &Setup, emulate_hdd: bool) -> Options {
    Options {
        emulate_hdd,
        chain: Some(ChainOptions {
            disks: (0..3).map(|d| dir.join(format!("hdd{d}"))).collect(),
            cache_dir: dir.join("flash"),
            disk_bytes: setup.disk_bytes,
            cache_bytes: setup.disk_bytes,
            flash_cache_bytes: 0,
            layout,
            gc: gc().1,
        }),
        ..Options::default()
    }
}

fn tuning(checkpoint_bytes: u64) -> Tuning {
    Tuning {
        wal_checkpoint_bytes: checkpoint_bytes,
        ..Tuning::default()
    }
}

async fn write_range(store: &Store, volume: u64, from: u64, bytes: u64, fill: u8) {
    let data = Bytes::from(vec![fill; MIB as usize]);
    for at in (from..from + bytes).step_by(MIB as usize) {
        let (chunk, offset) = chunk_at(volume, at);
        store
            .write(chunk, offset, data.clone(), ChunkMeta::default())
            .await
            .expect("preload write");
    }
}

/// A warm-up write: 64 KiB somewhere in the live set.
async fn overwrite(store: &Store, random: &mut StdRng, setup: &Setup) {
    let data = Bytes::from(vec![2u8; WRITE_BYTES as usize]);
    let at = random.gen_range(0..setup.live_bytes / WRITE_BYTES) * WRITE_BYTES;
    let (chunk, offset) = chunk_at(READ_VOLUME, at);
    store
        .write(chunk, offset, data, ChunkMeta::default())
        .await
        .expect("warm-up write");
}

/// Without emulation (fast): the read set, then either a spacer that takes the tail
/// to disk 1 (the read set stays on a body disk) or, for cleaning, random overwrites
/// of the live set until the chain has been written twice over and then until the
/// tail enters the next disk. The measured run reopens the store, with empty tail
/// caches: what the preload left on the tail's disk would be read from it (a
/// restart's cost, not the steady state's); the tail starting on a fresh disk has
/// it hold only what the run writes (and the log's replay), all in the RAM cache.
/// Both layouts are preloaded alike.
fn preload(dir: &Path, layout: ChainLayout, scenario: Scenario, setup: &Setup) {
    let runtime = runtime();
    runtime.block_on(async {
        let store = Store::open_on(
            Arc::new(RealDisk),
            &dir.join("wal"),
            &options(dir, layout, setup, false),
            &tuning(8 * MIB),
        )
        .expect("open for the preload");
        write_range(&store, READ_VOLUME, 0, setup.live_bytes, 1).await;
        if scenario.gc {
            let mut random = StdRng::seed_from_u64(7);
            for _ in 0..6 * setup.disk_bytes / WRITE_BYTES {
                overwrite(&store, &mut random, setup).await;
            }
            let disk_blocks = setup.disk_bytes / BLOCK_BYTES;
            let tail_disk = || {
                let stats = store.chain_stats().expect("a chain");
                stats.tail % stats.capacity_blocks / disk_blocks
            };
            let disk = tail_disk();
            while tail_disk() == disk {
                overwrite(&store, &mut random, setup).await;
            }
        } else {
            let spacer = setup.disk_bytes - setup.live_bytes;
            write_range(&store, SPACER_VOLUME, 0, spacer, 3).await;
        }
    });
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn measure(dir: &Path, layout: ChainLayout, scenario: Scenario, seconds: u64, seed: u64) -> Run {
    let setup = Setup::of(scenario, seconds);
    preload(dir, layout, scenario, &setup);
    let runtime = runtime();
    runtime.block_on(async {
        let store = Store::open_on(
            Arc::new(RealDisk),
            &dir.join("wal"),
            &options(dir, layout, &setup, true),
            &tuning(256 * MIB),
        )
        .expect("open on the emulated hdds");
        let before = store.chain_stats().expect("a chain");
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicU64::new(0));
        let reads = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for w in 0..WRITERS {
            let (store, stop, written) = (store.clone(), stop.clone(), written.clone());
            let (volume, span) = match scenario.gc {
                true => (READ_VOLUME, setup.live_bytes),
                false => (WRITE_VOLUME, 2 * CHUNK_SPAN),
            };
            tasks.push(tokio::spawn(async move {
                let mut random = StdRng::seed_from_u64(seed * 100 + w as u64);
                let data = Bytes::from(vec![w as u8; WRITE_BYTES as usize]);
                while !stop.load(Relaxed) {
                    let at = random.gen_range(0..span / WRITE_BYTES) * WRITE_BYTES;
                    let (chunk, offset) = chunk_at(volume, at);
                    store
                        .write(chunk, offset, data.clone(), ChunkMeta::default())
                        .await
                        .expect("a measured write");
                    written.fetch_add(WRITE_BYTES, Relaxed);
                }
            }));
        }
        for r in 0..READERS * scenario.reader as usize {
            let (store, stop, reads) = (store.clone(), stop.clone(), reads.clone());
            let span = setup.live_bytes;
            tasks.push(tokio::spawn(async move {
                let mut random = StdRng::seed_from_u64(seed * 100 + 50 + r as u64);
                while !stop.load(Relaxed) {
                    let at = random.gen_range(0..span / READ_BYTES) * READ_BYTES;
                    let (chunk, offset) = chunk_at(READ_VOLUME, at);
                    store
                        .read(chunk, offset, READ_BYTES as u32)
                        .await
                        .expect("a measured read");
                    reads.fetch_add(1, Relaxed);
                }
            }));
        }
        let started = Instant::now();
        let mut series = Vec::new();
        let (mut last_written, mut last_reads) = (0, 0);
        while started.elapsed() < Duration::from_secs(seconds) {
            tokio::time::sleep(SAMPLE).await;
            let (w, r) = (written.load(Relaxed), reads.load(Relaxed));
            let slot = SAMPLE.as_secs_f64();
            series.push((
                started.elapsed().as_secs_f64(),
                (w - last_written) as f64 / slot / 1e6,
                (r - last_reads) as f64 / slot,
            ));
            (last_written, last_reads) = (w, r);
        }
        let elapsed = started.elapsed().as_secs_f64();
        stop.store(true, Relaxed);
        for task in tasks {
            task.await.unwrap();
        }
        let after = store.chain_stats().unwrap();
        let moved = after.gc_moved_blocks - before.gc_moved_blocks;
        Run {
            write_mb_s: last_written as f64 / elapsed / 1e6,
            moved_mb_s: (moved * BLOCK_BYTES) as f64 / elapsed / 1e6,
            read_iops: last_reads as f64 / elapsed,
            series,
            stats: ChainStats {
                gc_moved_blocks: moved,
                gc_freed_segments: after.gc_freed_segments - before.gc_freed_segments,
                reads_cache: after.reads_cache - before.reads_cache,
                reads_tail_disk: after.reads_tail_disk - before.reads_tail_disk,
                reads_body_disk: after.reads_body_disk - before.reads_body_disk,
                gc_reads_tail_disk: after.gc_reads_tail_disk - before.gc_reads_tail_disk,
                gc_reads_body_disk: after.gc_reads_body_disk - before.gc_reads_body_disk,
                ..after
            },
        }
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

fn name(layout: ChainLayout) -> &'static str {
    match layout {
        ChainLayout::Chained => "chain",
        ChainLayout::Striped => "raid0",
    }
}

fn main() {
    let seconds = env_or("CHAIN_BENCH_SECONDS", 4);
    let runs = env_or("CHAIN_BENCH_RUNS", 3);
    let out = std::env::var_os("CHAIN_BENCH_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/chain_bench.json"));
    let base = std::env::var_os("CHAIN_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    println!(
        "chained log vs log-structured RAID-0 on 3 EMULATED 7200 rpm hdds (engine level, \
         one Store): {WRITERS} writers of {} KiB, {seconds} s x {runs} runs per case, cleaner {} \
         with {} MiB live",
        WRITE_BYTES >> 10,
        gc().0,
        gc_live_bytes() / MIB
    );
    let layouts = [ChainLayout::Chained, ChainLayout::Striped];
    let mut medians = serde_json::Map::new();
    // Interleaved: each run is a round over every case, so load on the machine that
    // comes and goes hits them alike.
    let mut by_case: std::collections::BTreeMap<(&str, &str), Vec<Run>> = Default::default();
    for run in 0..runs {
        for scenario in SCENARIOS {
            for layout in layouts {
                let dir = tempfile::Builder::new()
                    .prefix("floe-chain-bench.")
                    .tempdir_in(&base)
                    .unwrap();
                let result = measure(dir.path(), layout, scenario, seconds, run);
                let s = &result.stats;
                println!(
                    "run {run} {:>9} {:>5}: write {:6.1} MB/s, read {:6.0} IOPS; reads: cache {} tail disk {} \
                     body disks {}; gc moved {} blocks ({:.1} MB/s), compacted {}, freed {} segments ({:.0}% live), read {} blocks off the tail disk, {} off the body",
                    scenario.name,
                    name(layout),
                    result.write_mb_s,
                    result.read_iops,
                    s.reads_cache,
                    s.reads_tail_disk,
                    s.reads_body_disk,
                    s.gc_moved_blocks,
                    result.moved_mb_s,
                    s.gc_compacted_blocks,
                    s.gc_freed_segments,
                    100.0 * s.gc_live_share(),
                    s.gc_reads_tail_disk,
                    s.gc_reads_body_disk
                );
                assert_eq!(
                    s.gc_moved_blocks > 0 || s.gc_compacted_blocks > 0 || s.gc_freed_segments > 0,
                    scenario.gc,
                    "{}: the cleaner ran exactly when the case says",
                    scenario.name
                );
                by_case
                    .entry((scenario.name, name(layout)))
                    .or_default()
                    .push(result);
            }
        }
    }
    println!("\nmedians (write MB/s; ratios: chain/raid0 same case, and against the same layout's `alone`)");
    let write = |case: (&str, &str)| median(by_case[&case].iter().map(|r| r.write_mb_s).collect());
    for scenario in SCENARIOS {
        let (chain, raid) = (
            write((scenario.name, "chain")),
            write((scenario.name, "raid0")),
        );
        let (chain_alone, raid_alone) = (write(("alone", "chain")), write(("alone", "raid0")));
        let reads = |l: &str| {
            median(
                by_case[&(scenario.name, l)]
                    .iter()
                    .map(|r| r.read_iops)
                    .collect(),
            )
        };
        let tail_reads: u64 = by_case[&(scenario.name, "chain")]
            .iter()
            .map(|r| r.stats.reads_tail_disk)
            .sum();
        let chain_median = |of: fn(&Run) -> f64| {
            median(by_case[&(scenario.name, "chain")].iter().map(of).collect())
        };
        let chain_moved = chain_median(|r| r.moved_mb_s);
        let live_share = chain_median(|r| r.stats.gc_live_share());
        println!(
            "{:>9}: chain {chain:6.1} raid0 {raid:6.1}  chain/raid0 {:5.2}x  chain/alone {:4.2}x  \
             raid0/alone {:4.2}x  read IOPS chain {:5.0} raid0 {:5.0}  chain tail-disk reads {tail_reads}  \
             chain moved {chain_moved:.1} MB/s ({:.0}% of the cleaned segments live)",
            scenario.name,
            chain / raid,
            chain / chain_alone,
            raid / raid_alone,
            reads("chain"),
            reads("raid0"),
            100.0 * live_share,
        );
        medians.insert(
            scenario.name.to_string(),
            json!({
                "chain_write_mb_s": chain,
                "raid0_write_mb_s": raid,
                "chain_over_raid0": chain / raid,
                "chain_over_own_alone": chain / chain_alone,
                "raid0_over_own_alone": raid / raid_alone,
                "chain_read_iops": reads("chain"),
                "raid0_read_iops": reads("raid0"),
                "chain_tail_disk_reads": tail_reads,
                "chain_moved_mb_s": chain_moved,
                "chain_gc_live_share": live_share,
            }),
        );
    }
    let mut runs_detail = Vec::new();
    for ((scenario, layout), runs) in &by_case {
        for (run, r) in runs.iter().enumerate() {
            let s = &r.stats;
            runs_detail.push(json!({
                "scenario": scenario,
                "layout": layout,
                "run": run,
                "write_mb_s": r.write_mb_s,
                "moved_mb_s": r.moved_mb_s,
                "read_iops": r.read_iops,
                "reads_cache": s.reads_cache,
                "reads_tail_disk": s.reads_tail_disk,
                "reads_body_disk": s.reads_body_disk,
                "gc_moved_blocks": s.gc_moved_blocks,
                "gc_compacted_blocks": s.gc_compacted_blocks,
                "gc_freed_segments": s.gc_freed_segments,
                "gc_live_share": s.gc_live_share(),
                "gc_reads_tail_disk": s.gc_reads_tail_disk,
                "gc_reads_body_disk": s.gc_reads_body_disk,
                "series_seconds_write_mb_s_read_iops": r.series,
            }));
        }
    }
    let document = json!({
        "disks": "3 EMULATED 7200 rpm hdds (chunkstore disk::hdd), one Store (engine level)",
        "writers": WRITERS, "write_bytes": WRITE_BYTES, "readers": READERS, "read_bytes": READ_BYTES,
        "seconds": seconds, "runs": runs, "gc": gc().0,
        "gc_live_mib": gc_live_bytes() / MIB,
        "medians": medians,
        "runs_detail": runs_detail,
    });
    std::fs::write(
        &out,
        serde_json::to_string_pretty(&document).unwrap() + "\n",
    )
    .unwrap();
    println!("wrote {}", out.display());
}
