//! Write-back: writes are acknowledged once the replicas logged them, unsynced, and an
//! NBD FLUSH makes them durable. Real clients must read back exactly what they wrote,
//! while the replicas hold it unsynced (a read of such a chunk syncs it first) and
//! across connections. Kills under write-back: crash.rs; power cuts: the chunk store's
//! power_cut test.

use crate::cluster::{free_ports, Cluster};
use crate::fio_job::{assert_clean, FioJob, Verify};
use crate::io_helpers::qemu_io;

#[test]
fn write_back_volumes_read_back_what_fio_and_qemu_io_wrote_with_and_without_flushes() {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let args = vec!["--write-mode".to_string(), "write-back".to_string()];
    let cluster = Cluster::start_with(dir.path(), free_ports(), None, args);
    let info = cluster.floe(&["volume", "info", "demo"]);
    assert!(info.contains("write-back"), "{info}");
    let uri = cluster.uri();
    // 4k random writes, a FLUSH every 16, verified in the run (reads right behind
    // unsynced writes) and again from a new connection.
    let random = |verify| {
        FioJob::random_4k(uri, work.path(), 77)
            .io_size("16M")
            .fsync(16)
            .verify(verify)
            .run()
    };
    assert_clean(
        &random(Verify::WriteAndRead),
        "4k random writes with flushes",
    );
    assert_clean(
        &random(Verify::Read { load_state: false }),
        "4k random writes read back",
    );
    // Large writes (forwarded by the primary), never flushed by the client.
    let fill = || FioJob::fill(uri, work.path(), "96M");
    assert_clean(&fill().verify(Verify::WriteAndRead).run(), "1M writes");
    assert_clean(
        &fill().verify(Verify::Read { load_state: false }).run(),
        "1M writes read back",
    );
    // A FUA write and a flush from qemu-io.
    // (qemu_io fails the test on any failed command or pattern.)
    qemu_io(
        uri,
        &[
            "write -P 0x5a 512M 64k",
            "write -f -P 0x5b 513M 4k",
            "flush",
            "read -P 0x5a 512M 64k",
            "read -P 0x5b 513M 4k",
        ],
    );
}
