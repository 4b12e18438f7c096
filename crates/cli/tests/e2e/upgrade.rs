//! Upgrades under a writing client (URSA section 5.2). A gateway: the binary is
//! replaced, `floe gateway upgrade` makes the running gateway exec it, and the
//! client's one NBD connection goes on without an error or a reconnect. Chunk
//! servers: stopped and started on the new binary one at a time; the replicas keep
//! the volume writable. Afterwards the volume holds exactly what the client's ledger
//! says it wrote, and its replicas agree.

use crate::cluster::{ok, Cluster, Spawned, TestDir, FLOE};
use crate::io_helpers::wait_until;
use crate::servers::{Servers, CHUNK_SERVERS, RESTART_LIMIT};
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

/// upgrade_client.py writing through `uri` for `seconds`, or until `stop` exists.
fn writer(uri: &str, seconds: &str, stop: Option<&Path>) -> std::process::Child {
    // The system Python has the libnbd module.
    Command::new("/usr/bin/python3")
        .arg(CLIENT)
        .args([uri, seconds])
        .args(stop)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The writer's report, once it ends: it must have seen no error.
fn report(writer: std::process::Child) -> serde_json::Value {
    let out = writer.wait_with_output().unwrap();
    assert!(out.status.success(), "the writer failed: {out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["errors"], serde_json::json!([]), "{report}");
    assert!(report["operations"].as_u64().unwrap() > 50, "{report}");
    report
}

/// Reads through `uri` what the writer's ledger says each block holds last.
fn check_ledger(report: &serde_json::Value, uri: &str) {
    let ledger = report["ledger"].as_object().unwrap();
    let check: String = ledger
        .iter()
        .map(|(block, value)| {
            let at = block.parse::<usize>().unwrap() * BLOCK;
            format!("assert h.pread({BLOCK}, {at}) == bytes([{value}]) * {BLOCK}, {block}\n")
        })
        .collect();
    ok(crate::cluster::nbdsh().args(["-u", uri, "-c", &check]));
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
    let writer = writer(&format!("nbd://{address}/demo"), "12", None);

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

    let report = report(writer);
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
    check_ledger(&report, cluster.uri());
    let log = std::fs::read_to_string(work.path().join("gateway.log")).unwrap();
    assert_eq!(log.matches("client handed over").count(), 2, "{log}");
}

#[test]
fn chunk_servers_upgrade_one_at_a_time_under_a_writing_client() {
    let dir = TestDir::new();
    let cluster = Cluster::start(dir.path());
    let mut servers = Servers::of(&cluster);
    let work = TestDir::new();
    let binary = work.path().join("floe");
    install(&binary);
    let new = std::fs::metadata(&binary).unwrap().ino();
    let stop = work.path().join("stop");
    let writer = writer(cluster.uri(), "600", Some(&stop));
    std::thread::sleep(Duration::from_secs(2));
    for n in 0..CHUNK_SERVERS {
        let pid = servers.pids[n];
        // SAFETY: kill(2) on a chunk server of this test's cluster.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        wait_until("the chunk server stops", RESTART_LIMIT, || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |stat| stat.contains(") Z "))
        });
        servers.restart_from(n, &cluster, &binary);
        servers.wait_listening(n, &cluster);
        assert_eq!(running_binary(servers.pids[n]), new);
        cluster.wait_for_status(
            &format!("{CHUNK_SERVERS}/{CHUNK_SERVERS} chunk servers up"),
            RESTART_LIMIT,
        );
        cluster.wait_for_redundancy(RESTART_LIMIT);
    }
    std::fs::write(&stop, "").unwrap();
    let report = report(writer);
    check_ledger(&report, cluster.uri());
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains("0 differences"), "{scrub}");
}
