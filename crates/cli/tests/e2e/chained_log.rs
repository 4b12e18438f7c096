//! The chained-log engine (`floe demo --engine log`: every chunk server a chain of
//! three disks of 8 MiB): fio writes and verifies a region over and over, about three
//! times what each replica's chain holds, so only cleaning lets the writes go on
//! (the servers log each map save with the cleaner's counters); and kill -9 under a
//! writer loses no acknowledged write (crash.rs's ledger and checks), on chains of
//! [`KILL_DISK_SIZE`] disks: its repairs copy whole chunks, which 24 MiB cannot hold.

use crate::cluster::{free_ports, Cluster, TestDir};
use crate::crash;
use crate::fio_job::{assert_clean, FioJob, Verify};

/// Each chain disk's log: three make a 24 MiB chain per server.
const DISK_SIZE: &str = "8M";
/// The kill -9 rounds' disks: 192 MiB chains, room for the whole copies of repairs
/// (a 24 MiB chain ran full during one in CI).
const KILL_DISK_SIZE: &str = "64M";

pub fn log_engine_args(disk_size: &str) -> Vec<String> {
    ["--engine", "log", "--disk-size", disk_size]
        .map(String::from)
        .to_vec()
}

/// The largest value of `field=N` in chunk server `n`'s log lines about map saves.
fn largest_logged(cluster: &Cluster, n: usize, field: &str) -> Option<u64> {
    let log = cluster
        .dir
        .join("logs")
        .join(format!("chunkserver-{n}.log"));
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let key = format!("{field}=");
    text.lines()
        .filter(|line| line.contains("chain map saved"))
        .filter_map(|line| {
            let at = line.find(&key)? + key.len();
            let digits: String = line[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .max()
}

#[test]
fn chained_log_overwrites_three_times_its_capacity_and_verifies() {
    overwrite_three_times(&[]);
}

/// The same with compact-in-body cleaning and an 8 MiB flash tail cache per chain:
/// the cleaner puts live blocks into holes of the body (some still reach the tail
/// when no hole is known).
#[test]
fn chained_log_compacts_in_body_with_a_flash_cache_and_verifies() {
    let cleaned = overwrite_three_times(&["--gc", "compact-in-body", "--cache-size", "8M"]);
    let compacted: u64 = cleaned.iter().map(|&(_, _, _, compacted)| compacted).sum();
    assert!(
        compacted > 0,
        "nothing compacted into the body: {cleaned:?}"
    );
}

/// fio writes and verifies 16 MiB five times on a demo of chains with `flags`
/// (striped over the volume's first chunks): 3 x 80 MiB into six 24 MiB chains.
/// Returns each server's logged (server, segments freed, blocks moved, compacted).
fn overwrite_three_times(flags: &[&str]) -> Vec<(usize, u64, u64, u64)> {
    let dir = TestDir::new();
    let work = TestDir::new();
    let mut args = log_engine_args(DISK_SIZE);
    args.extend(flags.iter().map(|f| f.to_string()));
    let cluster = Cluster::start_with(dir.path(), free_ports(), None, args);
    for pass in 0..5 {
        let job = FioJob::new(&format!("pass{pass}"), cluster.uri(), work.path())
            .rw("write")
            .bs("256k")
            .size("16M")
            .iodepth(4)
            .verify(Verify::WriteAndRead);
        assert_clean(&job.run(), &format!("pass {pass}"));
    }
    let cleaned: Vec<(usize, u64, u64, u64)> = (0..crate::servers::CHUNK_SERVERS)
        .filter_map(|n| {
            let freed = largest_logged(&cluster, n, "gc_freed_segments")?;
            let moved = largest_logged(&cluster, n, "gc_moved_blocks").unwrap_or(0);
            let compacted = largest_logged(&cluster, n, "gc_compacted_blocks").unwrap_or(0);
            (freed > 0).then_some((n, freed, moved, compacted))
        })
        .collect();
    eprintln!("chained log {flags:?}: (server, segments freed, moved, compacted): {cleaned:?}");
    // 240 MiB went into 144 MiB of chains: at least 96 one-MiB segments were
    // reclaimed (the logged counts lag by the segments freed since the last save).
    let freed: u64 = cleaned.iter().map(|&(_, freed, _, _)| freed).sum();
    assert!(
        freed >= 96,
        "the cleaner did not reclaim the overwritten space: {cleaned:?}"
    );
    cleaned
}

#[test]
fn chained_log_kill_9_loses_no_acknowledged_write() {
    crash::kill_9_rounds_with(log_engine_args(KILL_DISK_SIZE), "write-through", 2);
}
