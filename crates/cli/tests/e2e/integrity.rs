//! Bit rot under a running cluster: a client never reads a corrupt byte, and the copy
//! a read found bad is healed from a good one without anyone asking.

use crate::cluster::{free_ports, nbdsh, ok, Cluster};
use crate::scrub::{chunk_file, corrupt, read16};
use std::time::{Duration, Instant};

/// 256 distinct bytes over and over: a block read from the wrong place shows.
const PATTERN: &str = "bytes(range(256)) * 4096";

#[test]
fn a_read_never_returns_a_corrupt_block_and_the_bad_copy_is_healed() {
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start_with(work.path(), free_ports(), None, Vec::new());
    ok(nbdsh().args([
        "-u",
        cluster.uri(),
        "-c",
        &format!("h.pwrite({PATTERN}, 0)"),
    ]));
    let placement = cluster.placement();
    // The primary's copy of chunk 0 (read first) and a backup's of chunk 1 (an hdd
    // server's chunk file), both at 4096: volume bytes 4096 and 64 KiB + 4096.
    let (primary, backup) = (placement[&0][0], placement[&1][1]);
    let good = read16(&chunk_file(&cluster, primary, 0), 4096);
    corrupt(&chunk_file(&cluster, primary, 0), 4096);
    corrupt(&chunk_file(&cluster, backup, 1), 4096);
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
