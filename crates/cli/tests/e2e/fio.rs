//! fio through its libnbd engine: random writes verified in-run and again by a separate
//! read-only pass, so data must survive beyond fio's own connection.

use crate::cluster::Cluster;
use crate::fio_job::{assert_clean, FioJob, Verify};
use crate::io_helpers::{qemu_io, text};
use std::path::Path;
use std::process::Output;

/// One random-write job over 512 MiB: eight 64 MiB chunks and thousands of 64 KiB stripe
/// units. `io_size` bounds the run by bytes, not time.
struct Job {
    name: &'static str,
    bs: &'static str,
    offset: &'static str,
    io_size: &'static str,
    seed: u64,
}

fn fio(uri: &str, job: &Job, work: &Path, verify_only: bool) -> Output {
    FioJob::new(job.name, uri, work)
        .rw("randwrite")
        .bs(job.bs)
        .offset(job.offset)
        .size("512M")
        .io_size(job.io_size)
        .iodepth(16)
        .verify(if verify_only {
            Verify::Read { load_state: false }
        } else {
            Verify::WriteAndRead
        })
        // The verify-only pass revisits exactly the written blocks.
        .seed(job.seed)
        .run()
}

#[test]
fn fio_random_writes_verify_and_reverify() {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri();
    // Disjoint halves, so the 64k run cannot hide damage it does to the 4k run's data.
    let small = Job {
        name: "rand4k",
        bs: "4k",
        offset: "0",
        io_size: "24M",
        seed: 4096,
    };
    let large = Job {
        name: "rand64k",
        bs: "64k",
        offset: "512M",
        io_size: "64M",
        seed: 65536,
    };
    for job in [&small, &large] {
        assert_clean(
            &fio(uri, job, work.path(), false),
            &format!("{} write", job.name),
        );
        assert_clean(
            &fio(uri, job, work.path(), true),
            &format!("{} verify", job.name),
        );
    }
    // Re-verify the 4k data after the 64k run wrote elsewhere in the volume.
    assert_clean(&fio(uri, &small, work.path(), true), "rand4k re-verify");

    // The verify-only pass really reads the volume: clobber part of the 64k range and it
    // must fail.
    qemu_io(uri, &["write -P 0x5a 600M 8M"]);
    let clobbered = fio(uri, &large, work.path(), true);
    let all = text(&clobbered);
    assert!(
        !clobbered.status.success() && all.contains("verify"),
        "verify-only pass missed overwritten data:\n{all}"
    );
}
