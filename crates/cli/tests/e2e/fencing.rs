//! Single writer per volume: a second gateway is refused while the first holds the
//! volume's lease; once a stalled gateway's lease expires another takes the volume, and
//! the stalled one's writes are refused when it wakes up (fencing): the data is the
//! second gateway's.

use crate::cluster::{free_ports, nbdsh, output, Cluster, FLOE};
use crate::io_helpers::{qemu_io, text};
use crate::nbd_raw::wait_for_nbd_server;
use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

/// Longer than the master's lease term (5 s) plus a renewal interval.
pub(crate) const LEASE_EXPIRY_WAIT: Duration = Duration::from_secs(8);
/// Bounds only a gateway that never serves, however busy the machine.
const GATEWAY_START_TIMEOUT: Duration = Duration::from_secs(60);

/// Holds a connection to the first gateway: writes 0xaa at 0, says "ready", waits for
/// a line on stdin, then writes 0xcc at 0 and at 64 KiB (another chunk) and reports
/// each outcome.
const STALLED_CLIENT: &str = r#"
import sys
h.pwrite(b"\xaa" * 4096, 0)
print("ready", flush=True)
sys.stdin.readline()
for offset in (0, 65536):
    try:
        h.pwrite(b"\xcc" * 4096, offset)
        print(f"write {offset} ok", flush=True)
    except nbd.Error as e:
        print(f"write {offset} refused: {e}", flush=True)
"#;

/// An nbdsh client running `STALLED_CLIENT`: it wrote 0xaa at 0 and waits.
pub(crate) struct StalledClient {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl StalledClient {
    pub(crate) fn start(uri: &str) -> StalledClient {
        let mut child = nbdsh()
            .args(["-u", uri, "-c", STALLED_CLIENT])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("nbdsh starts");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "ready");
        StalledClient { child, lines }
    }

    /// Lets it write 0xcc at 0 and at 64 KiB through its old connection; both
    /// writes must be refused.
    pub(crate) fn assert_writes_refused(mut self) {
        writeln!(self.child.stdin.as_mut().unwrap()).unwrap();
        let outcomes: Vec<String> = self.lines.by_ref().take(2).map(Result::unwrap).collect();
        let _ = self.child.wait();
        for outcome in &outcomes {
            assert!(
                outcome.contains("refused"),
                "the stalled writer got through: {outcomes:?}"
            );
        }
    }
}

pub(crate) fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) on a cluster process we started.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
}

pub(crate) fn read_byte(uri: &str, offset: u64) -> String {
    let out = qemu_io(uri, &[&format!("read -v {offset} 1")]);
    out.lines().next().unwrap_or_default().to_string()
}

#[test]
fn stalled_gateway_is_fenced_after_its_lease_moves() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let first = cluster.uri().to_string();
    let client = StalledClient::start(&first);

    // A second gateway on the same volume.
    let port = free_ports();
    let second = format!("nbd://127.0.0.1:{port}/demo");
    let log = std::fs::File::create(dir.path().join("second-gateway.log")).unwrap();
    let mut gateway = Command::new(FLOE)
        .args(["--master", &cluster.info.master, "gateway", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("gateway starts");
    wait_for_nbd_server(port, GATEWAY_START_TIMEOUT);

    // Refused while the first gateway holds and renews the lease.
    let refused = output(Command::new("qemu-io").args(["-f", "raw", "-c", "read 0 4k", &second]));
    assert!(
        !refused.status.success() && text(&refused).contains("is in use by gateway"),
        "second gateway was not refused clearly:\n{}",
        text(&refused)
    );

    // A read-only gateway needs no lease: it reads while the first holds it, and
    // refuses writes.
    let reader_port = free_ports();
    let reader_uri = format!("nbd://127.0.0.1:{reader_port}/demo");
    let mut reader = Command::new(FLOE)
        .args([
            "--master",
            &cluster.info.master,
            "gateway",
            "--read-only",
            "--listen",
        ])
        .arg(format!("127.0.0.1:{reader_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("read-only gateway starts");
    wait_for_nbd_server(reader_port, GATEWAY_START_TIMEOUT);
    assert!(
        read_byte(&reader_uri, 0).contains("aa"),
        "read-only gateway reads"
    );
    let write =
        output(Command::new("qemu-io").args(["-f", "raw", "-c", "write 0 4k", &reader_uri]));
    assert!(
        text(&write).contains("failed"),
        "read-only gateway took a write:\n{}",
        text(&write)
    );
    let _ = reader.kill();
    let _ = reader.wait();

    // The first gateway stalls; its lease runs out; the second takes the volume.
    signal(cluster.info.gateway_pid, libc::SIGSTOP);
    std::thread::sleep(LEASE_EXPIRY_WAIT);
    qemu_io(&second, &["write -P 0xbb 0 4k"]);

    // The first wakes up and tries to write through its old lease.
    signal(cluster.info.gateway_pid, libc::SIGCONT);
    client.assert_writes_refused();
    assert!(
        read_byte(&second, 0).contains("bb"),
        "the second writer's data is there"
    );
    assert!(
        !read_byte(&second, 65536).contains("cc"),
        "no write of the stalled gateway landed"
    );
    let gateway_log =
        std::fs::read_to_string(dir.path().join("logs").join("gateway.log")).unwrap_or_default();
    assert!(
        gateway_log.contains("lease generation") || gateway_log.contains("lease lost"),
        "the first gateway did not notice it lost the lease:\n{gateway_log}"
    );
    let _ = gateway.kill();
    let _ = gateway.wait();
}
