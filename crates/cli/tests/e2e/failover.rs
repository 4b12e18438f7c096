//! Failover under load: fio writes with verify=crc32c while chunk servers are killed
//! with kill -9, first a backup, then the primary of the chunks fio writes. fio sees
//! no error, the cluster heals back to full redundancy, scrub finds no difference, and
//! fio's verify passes read back every write it completed. Prints the time from each
//! kill to full redundancy of the (full) 1 GiB volume, and fio's IOPS before and
//! during recovery.

use crate::cluster::{output, Cluster};
use crate::fio::assert_clean;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Long enough for two recoveries (each: heartbeat timeout, then copying).
const RUNTIME_SECONDS: u64 = 60;
const REDUNDANCY_TIMEOUT: Duration = Duration::from_secs(120);

fn fio(uri: &str, work: &Path, args: &[&str]) -> Command {
    let mut command = Command::new("fio");
    command
        .current_dir(work)
        .args(["--ioengine=nbd", &format!("--uri={uri}"), "--verify=crc32c"])
        .args(args);
    command
}

/// The random-write job, over the first 256 MiB (chunks 0-3).
const RANDOM: &[&str] = &[
    "--name=random",
    "--rw=randwrite",
    "--bs=4k",
    "--size=256M",
    "--iodepth=16",
    "--randseed=1234",
];
/// The fill: the rest of the volume, so recovery has a full 1 GiB volume to copy.
const FILL: &[&str] = &[
    "--name=fill",
    "--rw=write",
    "--bs=1M",
    "--offset=256M",
    "--size=768M",
    "--iodepth=4",
];

fn median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or(0)
}

/// Per-second IOPS from fio's log ("msec, iops, ...") within [from, to) seconds.
fn iops_between(log: &Path, from: f64, to: f64) -> Vec<u64> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(',').map(|f| f.trim().parse::<u64>());
            let (Some(Ok(msec)), Some(Ok(iops))) = (fields.next(), fields.next()) else {
                return None;
            };
            let at = msec as f64 / 1000.0;
            (at > from && at <= to).then_some(iops)
        })
        .collect()
}

fn kill9(pid: u32) {
    // SAFETY: kill(2) on a cluster process we started (through the demo).
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
}

#[test]
fn fio_survives_kill_of_backup_then_primary() {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    assert_clean(
        &output(fio(&uri, work.path(), FILL).arg("--do_verify=0")),
        "fill",
    );

    let runtime = format!("--runtime={RUNTIME_SECONDS}");
    let writer: Child = fio(&uri, work.path(), RANDOM)
        .args([
            "--do_verify=0",
            "--time_based",
            &runtime,
            "--verify_state_save=1",
            "--write_iops_log=random",
            "--log_avg_msec=1000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio starts");
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(5));

    // Chunk 0 is in fio's range: its primary and a backup are on different hosts.
    let replicas = cluster.placement()[&0].clone();
    let (primary, backup) = (replicas[0], replicas[1]);
    let kill_backup = started.elapsed();
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
    let recovered = started.elapsed();

    let out = writer.wait_with_output().expect("fio runs");
    assert_clean(&out, "random writes during the kills");
    let status = cluster.floe(&["status"]);
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "{scrub}");
    assert_clean(
        &output(fio(&uri, work.path(), RANDOM).args(["--verify_only", "--verify_state_load=1"])),
        "verify of the random writes",
    );
    assert_clean(
        &output(fio(&uri, work.path(), FILL).arg("--verify_only")),
        "verify of the fill",
    );

    let log = work.path().join("random_iops.1.log");
    let before = median(iops_between(&log, 0.0, kill_backup.as_secs_f64()));
    let during = median(iops_between(
        &log,
        kill_backup.as_secs_f64(),
        recovered.as_secs_f64(),
    ));
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
