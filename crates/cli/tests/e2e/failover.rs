//! Failover under load: fio writes with verify=crc32c while chunk servers are killed
//! with kill -9, first a backup, then the primary of the chunks fio writes. fio sees
//! no error, the cluster heals back to full redundancy, scrub finds no difference, and
//! fio's verify passes read back every write it completed. Prints the time from each
//! kill to full redundancy of the (full) 1 GiB volume, and fio's IOPS before and
//! during recovery.

use crate::cluster::Cluster;
use crate::fio_job::{
    assert_clean, assert_random_and_fill_verify, iops_log, write_fill, FioJob, Verify,
};
use crate::io_helpers::kill9;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

/// Long enough for two recoveries (each: heartbeat timeout, then copying).
const RUNTIME_SECONDS: u64 = 60;
const REDUNDANCY_TIMEOUT: Duration = Duration::from_secs(120);

/// The random-write job, over the first 256 MiB (chunks 0-3).
fn random(uri: &str, work: &Path) -> FioJob {
    FioJob::random_4k(uri, work, 1234)
}

/// The fill: the rest of the volume, so recovery has a full 1 GiB volume to copy.
fn fill(uri: &str, work: &Path) -> FioJob {
    FioJob::fill(uri, work, "768M")
}

fn median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or(0)
}

/// Per-second IOPS from fio's log within (from, to] of the wall clock.
fn iops_between(log: &Path, from: SystemTime, to: SystemTime) -> Vec<u64> {
    iops_log(log)
        .into_iter()
        .filter(|s| s.end > from && s.end <= to)
        .map(|s| s.iops as u64)
        .collect()
}

#[test]
fn fio_survives_kill_of_backup_then_primary() {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    write_fill(&fill(&uri, work.path()));

    let started_at = SystemTime::now();
    let writing = random(&uri, work.path())
        .verify(Verify::Write { save_state: true })
        .runtime(RUNTIME_SECONDS)
        .iops_log();
    let writer = writing.spawn();
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(5));

    // Chunk 0 is in fio's range: its primary and a backup are on different hosts.
    let replicas = cluster.placement()[&0].clone();
    let (primary, backup) = (replicas[0], replicas[1]);
    let kill_backup_at = SystemTime::now();
    kill9(cluster.info.chunkserver_pids[backup]);
    let noticed = cluster.wait_for_status("chunks degraded", REDUNDANCY_TIMEOUT);
    let healed_backup = noticed + cluster.wait_for_redundancy(REDUNDANCY_TIMEOUT);
    assert_eq!(
        cluster.placement()[&0][0],
        primary,
        "the primary was not touched"
    );
    let kill_primary = started.elapsed();
    kill9(cluster.info.chunkserver_pids[primary]);
    let noticed = cluster.wait_for_status("chunks degraded", REDUNDANCY_TIMEOUT);
    let healed_primary = noticed + cluster.wait_for_redundancy(REDUNDANCY_TIMEOUT);
    let recovered_at = SystemTime::now();

    let out = writer.wait_with_output().expect("fio runs");
    assert_clean(&out, "random writes during the kills");
    let status = cluster.floe(&["status"]);
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "{scrub}");
    assert_random_and_fill_verify(&random(&uri, work.path()), &fill(&uri, work.path()));

    let log = writing.iops_log_path();
    let before = median(iops_between(&log, started_at, kill_backup_at));
    let during = median(iops_between(&log, kill_backup_at, recovered_at));
    let recovery = status
        .lines()
        .find(|l| l.starts_with("recovery:"))
        .unwrap_or_default();
    println!(
        "failover: 1 GiB volume full; kill -9 of a backup: full redundancy {healed_backup:.1?} later; \
         kill -9 of the primary ({:.1?} into the run): {healed_primary:.1?} later; \
         fio 4k randwrite iodepth 16 IOPS median before {before}, during recovery {during} ({:.2}x); {recovery}",
        kill_primary,
        during as f64 / before.max(1) as f64
    );
    assert!(before > 0, "fio logged no IOPS before the kills");
}
