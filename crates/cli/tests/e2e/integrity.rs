//! Bit rot under a running cluster: a client never reads a corrupt byte, and the copy
//! a read found bad is healed from a good one without anyone asking.

use crate::cluster::{free_ports, nbdsh, ok, Cluster};
use crate::scrub::{chunk_file, cluster_holding, corrupt, read16};
use std::time::{Duration, Instant};

/// 256 distinct bytes over and over: a block read from the wrong place shows.
const PATTERN: &str = "bytes(range(256)) * 4096";

#[test]
fn a_read_never_returns_a_corrupt_block_and_the_bad_copy_is_healed() {
    let work = tempfile::tempdir().unwrap();
    let cluster = cluster_holding(work.path(), PATTERN);
    let placement = cluster.placement();
    // The primary's copy of chunk 0 (read first) and a backup's of chunk 1 (an hdd
    // server's chunk file), both at 4096: volume bytes 4096 and 64 KiB + 4096.
    let (primary, backup) = (placement[&0][0], placement[&1][1]);
    let good = read16(&chunk_file(&cluster, primary, 0), 4096);
    // The hdd backup journals the write's 64 KiB pieces: its replay into the chunk
    // file, once done, would otherwise overwrite the bit rot unseen.
    let backup_file = chunk_file(&cluster, backup, 1);
    let started = Instant::now();
    let short =
        |path: &std::path::Path| std::fs::metadata(path).map_or(true, |m| m.len() < 4096 + 16);
    while short(&backup_file) || read16(&backup_file, 4096) != good {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the backup's journal was not replayed into its chunk file"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    corrupt(&chunk_file(&cluster, primary, 0), 4096);
    corrupt(&backup_file, 4096);
    // The primary's bad block is read, found bad, and read from a backup instead.
    ok(nbdsh().args([
        "-u",
        cluster.uri(),
        "-c",
        &format!("assert h.pread(1 << 20, 0) == {PATTERN}"),
    ]));
    // The primary's bad block was reported and rewritten from a good copy.
    let started = Instant::now();
    while read16(&chunk_file(&cluster, primary, 0), 4096) != good {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the corrupt block was not healed"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    cluster.wait_for_status(
        "1 corrupt blocks found by reads, 1 healed from good copies",
        Duration::from_secs(30),
    );
    // The backup's copy is found by a scrub (the reads went to the primary).
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains("0 blocks lost"), "{scrub}");
    assert_eq!(read16(&chunk_file(&cluster, backup, 1), 4096), good);
    let status = cluster.floe(&["status"]);
    assert!(
        status.contains("1 corrupt blocks found by reads, 2 healed from good copies, 0 lost"),
        "{status}"
    );
}

#[test]
fn blocks_rotting_while_writes_run_are_never_read() {
    use crate::fio_job::{assert_clean, FioJob, Verify};
    use rand::{Rng, SeedableRng};
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start_with(work.path(), free_ports(), None, Vec::new());
    let uri = cluster.uri().to_string();
    // At rest: 16 MiB in 1 MiB writes, 4 MiB in each of chunks 0-3 (chunk files).
    let rest = FioJob::new("rest", &uri, work.path())
        .rw("write")
        .bs("1M")
        .size("16M")
        .iodepth(4);
    assert_clean(
        &rest
            .clone()
            .verify(Verify::Write { save_state: false })
            .run(),
        "fill",
    );
    // Busy: 4 KiB random writes next to it while blocks rot.
    let busy = FioJob::new("busy", &uri, work.path())
        .rw("randwrite")
        .bs("4k")
        .offset("16M")
        .size("16M")
        .iodepth(16);
    let writer = busy
        .clone()
        .runtime(8)
        .verify(Verify::Write { save_state: true })
        .spawn();
    let placement = cluster.placement();
    let mut random = rand::rngs::StdRng::seed_from_u64(12);
    let mut rotten = std::collections::BTreeSet::new();
    while rotten.len() < 24 {
        let chunk = random.gen_range(0..4u64);
        let block = random.gen_range(0..1024u64);
        if rotten.insert((chunk, block)) {
            let replicas = &placement[&chunk];
            let server = replicas[random.gen_range(0..replicas.len())];
            corrupt(&chunk_file(&cluster, server, chunk), block * 4096 + 100);
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // Every block read back and checked while the writes go on: none is corrupt.
    assert_clean(
        &rest
            .clone()
            .verify(Verify::Read { load_state: false })
            .run(),
        "verify of the blocks at rest",
    );
    let written = writer.wait_with_output().expect("fio runs");
    assert_clean(&written, "random writes");
    assert_clean(
        &busy.verify(Verify::Read { load_state: true }).run(),
        "verify of the random writes",
    );
    // Each rotten block had a good copy: the scrub leaves the volume clean.
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains("0 blocks lost"), "{scrub}");
    let status = cluster.floe(&["status"]);
    assert!(status.contains(", 0 lost"), "{status}");
}
