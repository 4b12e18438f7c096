//! A master that is down costs a writing client no error: a write that needs the
//! master (its chunk's allocation) or a lease renewal waits for it, up to a minute.

use crate::cluster::{Cluster, TestDir};
use crate::expand::{master_command, Extra};
use crate::fio_job::{assert_clean, FioJob, Verify};
use std::time::Duration;

/// Sequential 64 KiB writes at 32 MiB/s from 0 reach the demo volume's second stripe
/// set (chunks 4-7, from 256 MiB) about 8 s in. The master is killed (-9) at 6 s and
/// started again at 18 s: those chunks' allocations wait, then the lease (5 s term)
/// runs out and every write waits. fio must end clean and verify every block.
#[test]
fn writes_wait_for_a_master_that_is_down_instead_of_failing() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let fio = FioJob::new("through-a-master-outage", cluster.uri(), work.path())
        .rw("write")
        .bs("64k")
        .size("384M")
        .rate("32m")
        .verify(Verify::WriteAndRead)
        .spawn();
    std::thread::sleep(Duration::from_secs(6));
    // SAFETY: kill(2) on the demo's master, which this test started.
    assert_eq!(
        unsafe { libc::kill(cluster.info.master_pid as i32, libc::SIGKILL) },
        0
    );
    std::thread::sleep(Duration::from_secs(12));
    let mut extra = Extra::none();
    extra.spawn(
        master_command(&cluster),
        &dir.path().join("master-restarted.log"),
    );
    assert_clean(
        &fio.wait_with_output().unwrap(),
        "fio through a master outage",
    );
    let log = std::fs::read_to_string(cluster.dir.join("logs/gateway.log")).unwrap();
    for waited in ["writes wait for a renewal", "its writes wait"] {
        assert!(
            log.contains(waited),
            "the gateway never logged {waited:?}: the outage missed the writes"
        );
    }
}
