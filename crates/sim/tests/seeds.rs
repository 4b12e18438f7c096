//! Runs the cluster simulator over many seeds.
//!
//! - `cargo test -p floe-sim`: a few hundred seeds from a random base it prints;
//! - `FLOE_SIM_SEED=S`: that one seed, with the cluster's logs (`RUST_LOG` filters);
//! - `FLOE_SIM_SEEDS=N`: N seeds (the soak), `FLOE_SIM_BASE=B` fixes the base;
//! - `FLOE_SIM_KEEP_GOING=1`: run every seed and list the failures at the end;
//! - `FLOE_SIM_WRITE_MODE=write-through|write-back`: the volume's write mode for every
//!   seed (else write-back for seeds 2 mod 3, see `floe_sim::write_mode_of`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

const SEEDS_DEFAULT: u64 = 200;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
    })
}

/// Log lines carry the simulation's virtual time.
struct VirtualTime(std::sync::OnceLock<tokio::time::Instant>);

impl tracing_subscriber::fmt::time::FormatTime for VirtualTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        let start = *self.0.get_or_init(tokio::time::Instant::now);
        write!(w, "{:>10.6}s", start.elapsed().as_secs_f64())
    }
}

/// The write mode `FLOE_SIM_WRITE_MODE` forces, if any.
fn write_mode() -> Option<floe_sim::WriteMode> {
    std::env::var("FLOE_SIM_WRITE_MODE").ok().map(|v| {
        v.parse()
            .unwrap_or_else(|e| panic!("FLOE_SIM_WRITE_MODE: {e}"))
    })
}

fn run(seed: u64) -> Result<floe_sim::Report, Box<floe_sim::Failure>> {
    floe_sim::run_in(
        seed,
        write_mode().unwrap_or_else(|| floe_sim::write_mode_of(seed)),
    )
}

#[test]
fn seeds() {
    if let Some(seed) = env_u64("FLOE_SIM_SEED") {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "info".into()),
            )
            .with_timer(VirtualTime(std::sync::OnceLock::new()))
            .with_test_writer()
            .init();
        match run(seed) {
            Ok(report) => {
                for e in &report.events {
                    println!("{e}");
                }
                println!(
                    "seed {seed}: ok, {} writes acknowledged, {} reads checked, {} stale reads checked, {} flushes, {} messages, {:?} virtual",
                    report.writes_acked, report.reads_checked, report.stale_reads, report.flushes, report.trace.1, report.virtual_time
                );
            }
            Err(failure) => panic!("{failure}"),
        }
        return;
    }
    let count = env_u64("FLOE_SIM_SEEDS").unwrap_or(SEEDS_DEFAULT);
    let base = env_u64("FLOE_SIM_BASE").unwrap_or_else(|| rand::random::<u32>() as u64);
    println!(
        "simulating seeds {base}..{} (FLOE_SIM_BASE={base})",
        base + count
    );
    let started = Instant::now();
    let keep_going = std::env::var_os("FLOE_SIM_KEEP_GOING").is_some();
    // Seeds are independent: one thread per core, each taking the next seed.
    let next = AtomicU64::new(base);
    let totals = Mutex::new((0, 0, 0, Vec::new(), 0, 0));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= base + count || (!keep_going && !totals.lock().unwrap().3.is_empty()) {
                    return;
                }
                let result = run(seed);
                let mut totals = totals.lock().unwrap();
                match result {
                    Ok(report) => {
                        totals.0 += report.writes_acked;
                        totals.1 += report.reads_checked;
                        totals.2 += report.flushes;
                        totals.4 += report.snapshot_reads;
                        totals.5 += report.stale_reads;
                    }
                    Err(failure) => {
                        println!("{failure}");
                        totals.3.push(seed);
                    }
                }
            });
        }
    });
    let (writes, reads, flushes, mut failed, snapshot_reads, stale_reads) =
        totals.into_inner().unwrap();
    failed.sort_unstable();
    println!(
        "{count} seeds from {base}, {} failed, {writes} acknowledged writes, {reads} reads checked, {snapshot_reads} snapshot blocks checked, {stale_reads} stale reads checked, {flushes} flushes, in {:.1?}",
        failed.len(),
        started.elapsed()
    );
    assert!(failed.is_empty(), "failing seeds: {failed:?}");
}

/// Seeds that found bugs, with what each found (seed numbers as of the commit that
/// fixed it: a later change to the scenario gives a seed another run, so these guard
/// loosely; the random seeds above do the real work). They ran on write-through
/// volumes, and still do.
const FOUND_BUGS: &[(u64, &str)] = &[
    (7, "a laggard report lost while the master restarted left a replica behind, counted current"),
    (77, "a restart after kill -9 did not sync its predecessor's directory entries; a power cut then lost acknowledged writes"),
    (39, "a change committed without a replica in a view the master never stored was not reported"),
    (477, "a deposed writer acknowledged zeroes of a chunk it never allocated"),
    (1000, "the old lease holder kept acknowledging writes after the master granted the lease to another"),
    (1402, "a deposed writer's resends landed after the new grant, before heartbeats carried the new generation"),
    (1620, "a resent AcquireLease granted a second generation that fenced the first grant's holder"),
    (1693, "a replica under a whole-copy repair served reads of its punched chunk"),
    (177, "a writer killed between a majority commit and its laggard report left a replica behind, counted current"),
    (2705, "a writer that gave up its generation kept renewing the lease, so no audit and no takeover"),
    (301637, "a catch-up whole copy that failed part-way left a member punched at version 0, counted current, and a later view change settled the chunk there"),
    (204459, "a majority of stale replicas sourced a view change while one had been emptied by a failed whole copy: acknowledged writes lost"),
    (1381434920, "a chunk whose only good replica was lost waited forever: its stale replicas, possibly emptied by a failed whole copy, could not vote"),
    (304659, "a laggard's incremental copy, made while writes went on, read an uncommitted change of its source and kept it when the view change failed: replicas differed at an equal version"),
    (901147, "a whole copy from a source that never took a change (version 0) tripped an assertion"),
    (1001879, "an incremental catch-up whose source died part-way kept a change no majority took, at its old version; later catch-ups never overwrote it"),
    (1107735, "the only good replica was lost while a stale one had claimed version 0 after a failed incremental copy: the chunk waited forever"),
    (1211633, "a change in flight when its replica was dropped completed after the drop and raised the emptied replica's version: a read got zeroes"),
    (1207944, "a gateway closed while a change's laggard report was still retrying released its lease cleanly, so no audit found the replica left behind"),
    (101449, "a replica down during the audit after a writer died came back behind, counted current"),
    (806009, "a replica cut off during the audit after a writer died came back behind, counted current"),
    (802317, "a server marked lost registered again (a message in flight) and was counted down, not lost: the cluster never healed"),
    (1801565, "a view change's prefetch whole-copied a source behind its stale target, taking back a change the target had acknowledged; the source's ack then committed it, and a later view change lost it"),
    (1945601331, "learning a chunk's version from every replica not stale (fewer than a majority) let a reader after a takeover read an old copy"),
    (1127769332, "a restart on a disk filled past the store's floor could not checkpoint"),
    (567174403, "a repair a full disk interrupted stopped its server from starting again"),
    (6, "a whole-copy repair of a snapshot's delta chunk wrote the zeroes of the gaps it read across, so the copy's extents claimed blocks never preserved: the snapshot read zeroes there"),
    (100174, "a lease renewal answered before a snapshot arrived after the long-poll that announced it: the writer's epoch went back (an assertion)"),
    (100546, "a snapshot was taken once its partitioned writer's lease ran out, but the writer renewed the lapsed lease after the partition healed and wrote on in the older epoch without preserving"),
    (1023, "a stale reader read a chunk allocated since its map was read as zeroes while the master was down, past the bound"),
    (1051, "a stale reader's map named a replica the master had moved away (it answered version 0 in a later view): the acknowledged floor fell below a write acknowledged by the new replicas"),
    (1191, "a stale reader timed its map from when the layer was built, not from before the map was read: a chunk allocated between read as zeroes past the bound"),
    (602001, "freeing a deleted snapshot's delta chunk dropped it on two replicas while the third's server was dying, and kept its placement: a repair then moved the dropped replicas to a later view, so the drop was refused forever and the chunk counted current at version 0"),
    (1353700050, "a lease renewed after it ran out (its holder cut off from the master) was not audited when it ran out again: a replica its holder left behind, its report refused, counted current"),
    (3701448, "a lease revoked while its writer was cut off (snapshots waited for it), then a master restart: the restart queued an audit of the writer before, which the revoked lease's own audit did not replace, and that audit skips the chunks later writers wrote, so a replica the revoked writer left behind counted current"),
    (701560, "a deposed writer's allocation, retried until the master answered, landed after a snapshot and recorded the chunk as born before it (the writer's old epoch): the new writer, whose map lacked the chunk, preserved nothing, and the snapshot read its later writes"),
];

/// Replaying one seed (`FLOE_SIM_SEED`) runs that seed alone.
fn replaying() -> bool {
    std::env::var_os("FLOE_SIM_SEED").is_some()
}

/// Seeds that found bugs on write-back volumes (seeds 2 mod 3, see
/// `floe_sim::write_mode_of`).
const FOUND_BUGS_WRITE_BACK: &[(u64, &str)] = &[
    (443, "the audit a takeover queued was lost when the master restarted before it could reach the replicas, and the new writer released cleanly: a replica the dead writer had left behind (its report cut off) stayed counted current"),
    (2750, "after a power cut of every host lost a write the replicas had not synced, the deposed writer's FLUSH was answered Done by replicas holding the new writer's higher versions: a flushed write lost"),
    (455369138, "with every replica stale, a view change's prefetches ran at once and the source repaired from itself, refusing to be the others' source meanwhile: the chunk never healed"),
    (1353716717, "a writer's report of a replica in an orphaned view (a view change that could not reach a quorum) marked the chunk's last good replica stale, once the other good one was lost: the chunk never healed"),
];

#[test]
fn seeds_that_found_bugs() {
    if replaying() {
        return;
    }
    let found = (FOUND_BUGS
        .iter()
        .map(|(seed, bug)| (seed, bug, floe_sim::WriteMode::WriteThrough)))
    .chain(
        FOUND_BUGS_WRITE_BACK
            .iter()
            .map(|(seed, bug)| (seed, bug, floe_sim::WriteMode::WriteBack)),
    );
    for (seed, bug, mode) in found {
        if let Err(failure) = floe_sim::run_in(*seed, mode) {
            panic!("seed {seed} once found: {bug}\n{failure}");
        }
    }
}

/// Two runs of one seed send the same messages at the same virtual times and end
/// alike (a few seeds from `FLOE_SIM_BASE`, else random).
#[test]
fn a_seed_replays_exactly() {
    if replaying() {
        return;
    }
    let base = env_u64("FLOE_SIM_BASE").unwrap_or_else(|| rand::random::<u32>() as u64);
    for seed in base..base + 4 {
        replays_exactly(seed);
    }
}

fn replays_exactly(seed: u64) {
    let run = || match run(seed) {
        Ok(report) => (report, Vec::new()),
        Err(failure) => (failure.report, failure.violations),
    };
    let ((first, first_violations), (second, second_violations)) = (run(), run());
    if let Some(i) = (0..first.legs.len().max(second.legs.len()))
        .find(|&i| first.legs.get(i) != second.legs.get(i))
    {
        let around = |legs: &[(u64, usize, usize, u64)]| {
            legs[i.saturating_sub(3)..(i + 3).min(legs.len())].to_vec()
        };
        panic!(
            "seed {seed} ran differently twice from message {i} (µs, from, to, kind):\n{:?}\n{:?}",
            around(&first.legs),
            around(&second.legs)
        );
    }
    assert_eq!(first.events, second.events);
    assert_eq!(first_violations, second_violations);
    assert!(
        first.trace.1 > 1000,
        "too few messages to prove anything: {}",
        first.trace.1
    );
}
