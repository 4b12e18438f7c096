//! A master that is down costs a writing client no error: a write that needs the
//! master (its chunk's allocation) or a lease renewal waits for it, up to a minute.

use crate::cluster::{Cluster, TestDir};
use crate::expand::{master_command, Extra};
use crate::fio_job::{assert_clean, FioJob, Verify};
use crate::io_helpers::qemu_io;
use std::process::Command;
use std::time::Duration;

/// fio writes the demo volume's first 64 MiB (chunks allocated before the outage);
/// the master is killed (-9), and a qemu-io write at 600 MiB (a chunk never
/// allocated: it needs the master) starts during the outage; the master starts again
/// 12 s after the kill, so the lease (5 s term) runs out meanwhile. Both clients end
/// clean, qemu-io's bytes read back and fio verifies every block.
#[test]
fn writes_wait_for_a_master_that_is_down_instead_of_failing() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    let fio = FioJob::random_4k(&uri, work.path(), 5)
        .size("64M")
        .runtime(25)
        .verify(Verify::WriteAndRead)
        .spawn();
    std::thread::sleep(Duration::from_secs(3));
    // SAFETY: kill(2) on the demo's master, which this test started.
    assert_eq!(
        unsafe { libc::kill(cluster.info.master_pid as i32, libc::SIGKILL) },
        0
    );
    std::thread::sleep(Duration::from_secs(1));
    let allocating = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x5a 600M 64k", &uri])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(11));
    let mut extra = Extra::none();
    extra.spawn(
        master_command(&cluster),
        &dir.path().join("master-restarted.log"),
    );
    let allocated = allocating.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&allocated.stdout).into_owned()
        + &String::from_utf8_lossy(&allocated.stderr);
    assert!(
        allocated.status.success() && said.contains("wrote") && !said.contains("failed"),
        "a write to a new chunk during the outage: {said}"
    );
    assert_clean(
        &fio.wait_with_output().unwrap(),
        "fio through a master outage",
    );
    qemu_io(&uri, &["read -P 0x5a 600M 64k"]);
    let log = std::fs::read_to_string(cluster.dir.join("logs/gateway.log")).unwrap();
    for waited in ["writes wait for a renewal", "its writes wait"] {
        assert!(
            log.contains(waited),
            "the gateway never logged {waited:?}: the outage missed the writes"
        );
    }
}
