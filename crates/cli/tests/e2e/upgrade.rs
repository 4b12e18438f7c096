//! A gateway upgraded in place under a writing client (URSA section 5.2): the binary
//! is replaced, `floe gateway upgrade` makes the running gateway exec it, and the
//! client's one NBD connection goes on without an error or a reconnect. Afterwards
//! another gateway reads back exactly what the client's ledger says it wrote.

use crate::cluster::{ok, Cluster, Spawned, TestDir, FLOE};
use crate::io_helpers::wait_until;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/upgrade_client.py");
const BLOCK: usize = 65536;

/// Installs the floe binary at `path` as a package manager would: a new file renamed
/// over the old one (the running process keeps the old file).
fn install(path: &Path) {
    let new = path.with_extension("new");
    std::fs::copy(FLOE, &new).unwrap();
    std::fs::rename(&new, path).unwrap();
}

/// The inode of the binary process `pid` runs.
fn running_binary(pid: u32) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/exe")).unwrap().ino()
}

#[test]
fn a_gateway_upgrades_in_place_under_a_writing_client() {
    let dir = TestDir::new();
    let cluster = Cluster::start(dir.path());
    let work = TestDir::new();
    let binary = work.path().join("floe");
    install(&binary);
    let address = format!("127.0.0.1:{}", crate::cluster::free_ports());
    let log = std::fs::File::create(work.path().join("gateway.log")).unwrap();
    let mut gateway = Spawned(
        Command::new(&binary)
            .args(["gateway", "--listen", &address, "--metrics-listen", "off"])
            .args(["--master", &cluster.info.master])
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let pid = gateway.0.id();
    wait_until("the gateway listens", Duration::from_secs(30), || {
        std::net::TcpStream::connect(&address).is_ok()
    });
    // The system Python has the libnbd module.
    let writer = Command::new("/usr/bin/python3")
        .arg(CLIENT)
        .args([&format!("nbd://{address}/demo"), "12"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();

    // Two upgrades while it writes: to a new binary, then again.
    for round in 1..=2 {
        std::thread::sleep(Duration::from_secs(3));
        let old = running_binary(pid);
        install(&binary);
        let new = std::fs::metadata(&binary).unwrap().ino();
        assert_ne!(old, new);
        let said = ok(Command::new(FLOE).args(["gateway", "upgrade", "--pid", &pid.to_string()]));
        assert!(said.contains(&format!("upgrade {round}")), "{said}");
        assert_eq!(running_binary(pid), new, "the gateway runs the new binary");
    }

    let out = writer.wait_with_output().unwrap();
    assert!(out.status.success(), "the writer failed: {out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["errors"], serde_json::json!([]), "{report}");
    assert!(report["operations"].as_u64().unwrap() > 50, "{report}");
    assert_eq!(
        gateway.0.try_wait().unwrap(),
        None,
        "the gateway is still running"
    );

    // Stopped like any gateway, it releases the volume; the demo's gateway reads
    // what the ledger says.
    // SAFETY: kill(2) on the gateway this test started.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    assert!(gateway.0.wait().unwrap().success());
    let ledger = report["ledger"].as_object().unwrap();
    let check: String = ledger
        .iter()
        .map(|(block, value)| {
            let at = block.parse::<usize>().unwrap() * BLOCK;
            format!("assert h.pread({BLOCK}, {at}) == bytes([{value}]) * {BLOCK}, {block}\n")
        })
        .collect();
    ok(crate::cluster::nbdsh().args(["-u", cluster.uri(), "-c", &check]));
    let log = std::fs::read_to_string(work.path().join("gateway.log")).unwrap();
    assert_eq!(log.matches("client handed over").count(), 2, "{log}");
}
