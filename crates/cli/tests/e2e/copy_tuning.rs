//! Servers start themselves again at once with glibc's `rep movsb` threshold raised
//! (`crates/cli/src/copy_tuning.rs`): same PID and arguments, the tunable set once, a
//! tunable the caller set kept.

use crate::cluster::{free_ports, Cluster, FLOE};
use crate::io_helpers::wait_until;
use crate::servers::argv_of;
use std::process::{Command, Stdio};
use std::time::Duration;

const RAISED: &str = "glibc.cpu.x86_rep_movsb_threshold=4294967295";

/// A process's environment as the kernel holds it (glibc splits `GLIBC_TUNABLES` at
/// its colons there while it parses them, so the entries are not taken apart here).
fn environ(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    String::from_utf8_lossy(&raw).replace('\0', "\n")
}

#[test]
fn servers_start_again_with_vector_copies() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let info = &cluster.info;
    let pids = info.master_pids.iter().chain(&info.chunkserver_pids);
    for &pid in pids.chain([&info.gateway_pid]) {
        let environ = environ(pid);
        assert!(
            environ.contains(&format!("GLIBC_TUNABLES={RAISED}")),
            "server {pid}: {environ}"
        );
        assert_eq!(environ.matches("x86_rep_movsb").count(), 1, "{environ}");
        let argv = argv_of(pid);
        assert_eq!(argv[0], FLOE, "server {pid}: {argv:?}");
    }

    // A server started with tunables of its own keeps them, and its arguments.
    let port = free_ports();
    let listen = format!("127.0.0.1:{port}");
    let metadata = format!("embedded:{}", dir.path().join("lone.redb").display());
    let args = ["master", "--listen", &listen, "--metadata", &metadata];
    let mut master = Command::new(FLOE)
        .args(args)
        .env("GLIBC_TUNABLES", "glibc.malloc.perturb=0")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = master.id();
    wait_until("the master starts again", Duration::from_secs(10), || {
        environ(pid).contains(RAISED)
    });
    let environ = environ(pid);
    assert!(
        environ.contains("GLIBC_TUNABLES=glibc.malloc.perturb=0"),
        "{environ}"
    );
    assert_eq!(environ.matches("x86_rep_movsb").count(), 1, "{environ}");
    let argv = argv_of(pid);
    assert_eq!(argv[1..], args, "{argv:?}");
    assert!(master.try_wait().unwrap().is_none(), "the master exited");
    master.kill().unwrap();
    master.wait().unwrap();
}
