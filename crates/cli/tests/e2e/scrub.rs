//! Scrub decides by the blocks' own checksums, not by rank: with corrupted replicas, a
//! block bad on one or two copies is rewritten from one that checks; a block bad on
//! every copy is reported lost (volume offset) and no copy of it is changed.

use crate::cluster::{free_ports, nbdsh, ok, output, Cluster};
use crate::io_helpers::{floe_output, text};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// The demo volume's id; a 1 MiB write at 0 puts 256 KiB in each of chunks 0-3 (its
/// stripes are 64 KiB over 4 chunks), in the chunk files (large writes bypass the
/// journals).
pub const VOLUME_ID: u64 = 1;
const BAD: [u8; 16] = [0x5a; 16];

pub fn chunk_file(cluster: &Cluster, server: usize, chunk: u64) -> PathBuf {
    cluster
        .dir
        .join(format!("cs-{server}/chunks/{VOLUME_ID:016x}/{chunk:016x}"))
}

pub fn read16(path: &PathBuf, at: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut out, at)
        .unwrap();
    out
}

/// Bit rot: bytes changed under the store, checksums left as they were.
pub fn corrupt(path: &PathBuf, at: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(&BAD, at)
        .unwrap();
}

/// A demo cluster whose volume holds what the Python expression `data` gives
/// (written at 0).
pub fn cluster_holding(work: &std::path::Path, data: &str) -> Cluster {
    let cluster = Cluster::start_with(work, free_ports(), None, Vec::new());
    ok(nbdsh().args(["-u", cluster.uri(), "-c", &format!("h.pwrite({data}, 0)")]));
    // Hdd replicas journal the write's 64 KiB pieces; a test's bit rot in a chunk file
    // must not be overwritten unseen by their replay, so wait until every replica's
    // chunk file holds what the primary's (ssd, no journal) does.
    let started = std::time::Instant::now();
    for (chunk, servers) in cluster.placement() {
        let want = head(&chunk_file(&cluster, servers[0], chunk));
        for &server in &servers[1..] {
            while head(&chunk_file(&cluster, server, chunk)) != want {
                assert!(
                    started.elapsed() < std::time::Duration::from_secs(60),
                    "server {server} did not replay chunk {chunk} into its chunk file"
                );
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
    cluster
}

/// The first 256 KiB of a chunk file (what a 1 MiB write at 0 puts there), as far as
/// it exists.
fn head(path: &PathBuf) -> Vec<u8> {
    use std::io::Read;
    let mut data = Vec::new();
    if let Ok(file) = std::fs::File::open(path) {
        file.take(256 << 10).read_to_end(&mut data).unwrap();
    }
    data
}

#[test]
fn scrub_heals_each_bad_block_from_a_good_copy_and_reports_blocks_with_none_lost() {
    let work = tempfile::tempdir().unwrap();
    let cluster = cluster_holding(work.path(), &format!("b'\\xab' * {}", 1 << 20));
    let placement = cluster.placement();
    let (one, two, three) = (&placement[&0], &placement[&1], &placement[&2]);
    // Chunk 0: one replica bad. Chunk 1: two bad, at different blocks. Chunk 2: every
    // replica bad at 16384 (lost), and one also at 20480.
    corrupt(&chunk_file(&cluster, one[1], 0), 4096);
    corrupt(&chunk_file(&cluster, two[0], 1), 8192);
    corrupt(&chunk_file(&cluster, two[1], 1), 12288);
    for &server in three {
        corrupt(&chunk_file(&cluster, server, 2), 16384);
    }
    corrupt(&chunk_file(&cluster, three[0], 2), 20480);

    let out = floe_output(&cluster, &["scrub", "demo"]);
    let said = text(&out);
    assert!(
        !out.status.success(),
        "scrub called the volume clean: {said}"
    );
    // Chunk 2 at 16384 is volume byte 2 * 64 KiB + 16384.
    assert!(said.contains("volume demo offset 147456: LOST"), "{said}");
    assert!(said.contains("4 blocks healed, 1 blocks lost"), "{said}");
    for (server, chunk, at) in [
        (one[1], 0, 4096),
        (two[0], 1, 8192),
        (two[1], 1, 12288),
        (three[0], 2, 20480),
    ] {
        assert_eq!(
            read16(&chunk_file(&cluster, server, chunk), at),
            [0xab; 16],
            "server {server} chunk {chunk} at {at} healed"
        );
    }
    // The lost block: every copy kept as it was, none overwritten.
    for &server in three {
        assert_eq!(read16(&chunk_file(&cluster, server, 2), 16384), BAD);
    }
    // A client gets an error for it, never its bytes; the rest reads.
    let lost = output(nbdsh().args(["-u", cluster.uri(), "-c", "h.pread(4096, 147456)"]));
    assert!(!lost.status.success(), "a lost block was read");
    ok(nbdsh().args([
        "-u",
        cluster.uri(),
        "-c",
        "assert h.pread(147456, 0) == b'\\xab' * 147456",
    ]));
    let status = cluster.floe(&["status"]);
    assert!(
        status.contains("4 healed from good copies, 1 lost"),
        "{status}"
    );
    assert!(status.contains("LOST: demo offset 147456"), "{status}");
}
