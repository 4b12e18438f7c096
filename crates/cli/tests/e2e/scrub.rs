//! Scrub with corrupted replicas: one bad copy is rebuilt from the two that agree;
//! when no two agree, scrub changes nothing (it cannot tell the good copy, and a
//! rebuild from a bad one would destroy it) and says so.

use crate::cluster::{free_ports, nbdsh, ok, Cluster};
use crate::io_helpers::{floe_output, text};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// The demo volume's id; a 1 MiB write at 0 puts 256 KiB in each of chunks 0-3 (its
/// stripes are 64 KiB over 4 chunks), in the chunk files (large writes bypass the
/// journals).
const VOLUME_ID: u64 = 1;
const BAD: [u8; 16] = [0x5a; 16];

fn chunk_file(cluster: &Cluster, server: usize, chunk: u64) -> PathBuf {
    cluster
        .dir
        .join(format!("cs-{server}/chunks/{VOLUME_ID:016x}/{chunk:016x}"))
}

fn read16(path: &PathBuf, at: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut out, at)
        .unwrap();
    out
}

fn corrupt(path: &PathBuf, at: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(&BAD, at)
        .unwrap();
}

#[test]
fn scrub_rebuilds_one_bad_copy_and_never_rebuilds_from_a_disputed_one() {
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start_with(work.path(), free_ports(), None, Vec::new());
    ok(nbdsh().args([
        "-u",
        cluster.uri(),
        "-c",
        &format!("h.pwrite(b'\\xab' * {}, 0)", 1 << 20),
    ]));
    let placement = cluster.placement();
    let (one, two) = (&placement[&0], &placement[&1]);
    // Chunk 0: one replica bad. Chunk 1: two bad, at different bytes.
    corrupt(&chunk_file(&cluster, one[1], 0), 4096);
    corrupt(&chunk_file(&cluster, two[0], 1), 8192);
    corrupt(&chunk_file(&cluster, two[1], 1), 12288);

    let out = floe_output(&cluster, &["scrub", "demo"]);
    let said = text(&out);
    assert!(
        !out.status.success(),
        "scrub called the volume clean: {said}"
    );
    assert!(
        said.contains("chunk 1: no two replicas agree"),
        "scrub: {said}"
    );
    // Chunk 0 rebuilt from the two that agree.
    assert_eq!(read16(&chunk_file(&cluster, one[1], 0), 4096), [0xab; 16]);
    // Chunk 1 untouched: each copy keeps its own bytes, the good one included.
    assert_eq!(read16(&chunk_file(&cluster, two[0], 1), 8192), BAD);
    assert_eq!(read16(&chunk_file(&cluster, two[0], 1), 12288), [0xab; 16]);
    assert_eq!(read16(&chunk_file(&cluster, two[1], 1), 12288), BAD);
    assert_eq!(read16(&chunk_file(&cluster, two[1], 1), 8192), [0xab; 16]);
    for at in [8192, 12288] {
        assert_eq!(read16(&chunk_file(&cluster, two[2], 1), at), [0xab; 16]);
    }
}
