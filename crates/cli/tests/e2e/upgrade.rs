//! Upgrades under writing clients (URSA section 5.2). A gateway, 20 times: the
//! binary is replaced, `floe gateway upgrade` makes the running gateway exec it, and
//! each client's one NBD connection (fio verifying, qemu-io, a libnbd writer) goes on
//! without an error or a reconnect. Chunk
//! servers: stopped and started on the new binary one at a time; the replicas keep
//! the volume writable. Afterwards the volume holds exactly what the client's ledger
//! says it wrote, and its replicas agree.

use crate::cluster::{ok, Cluster, Spawned, TestDir, FLOE};
use crate::fio_job::{assert_clean, FioJob, Verify};
use crate::io_helpers::text;
use crate::io_helpers::wait_until;
use crate::servers::{Servers, CHUNK_SERVERS, RESTART_LIMIT};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/upgrade_client.py");
const BLOCK: usize = 65536;
/// Gateway upgrades under the clients.
const UPGRADES: u32 = 20;
const QEMU_IO_ROUNDS: usize = 400;

/// Installs the floe binary at `path` as a package manager would: a new file renamed
/// over the old one (the running process keeps the old file).
fn install(path: &Path) {
    let new = path.with_extension("new");
    std::fs::copy(FLOE, &new).unwrap();
    std::fs::rename(&new, path).unwrap();
}

/// upgrade_client.py writing through `uri` for `seconds`, or until `stop` exists.
pub(crate) fn writer(uri: &str, seconds: &str, stop: Option<&Path>) -> std::process::Child {
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
pub(crate) fn report(writer: std::process::Child) -> serde_json::Value {
    let out = writer.wait_with_output().unwrap();
    assert!(out.status.success(), "the writer failed: {out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["errors"], serde_json::json!([]), "{report}");
    assert!(report["operations"].as_u64().unwrap() > 50, "{report}");
    report
}

/// Reads through `uri` what the writer's ledger says each block holds last.
pub(crate) fn check_ledger(report: &serde_json::Value, uri: &str) {
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
    let uri = format!("nbd://{address}/demo");
    // Three clients, each on its own region: the ledger writer (the first 16 MiB),
    // fio writing 16 MiB with checksums and reading them back (from 32 MiB, rate
    // limited so it lasts through the upgrades), and qemu-io writing and checking
    // patterns (from 96 MiB).
    let stop = work.path().join("stop");
    let writer = writer(&uri, "120", Some(&stop));
    let fio = FioJob::new("upgrade", &uri, work.path())
        .rw("randwrite")
        .bs("4k")
        .offset("32M")
        .size("16M")
        .iodepth(16)
        .rate("2m")
        .verify(Verify::WriteAndRead)
        .spawn();
    let qemu_io = qemu_io(&uri, work.path());

    for round in 1..=UPGRADES {
        std::thread::sleep(Duration::from_millis(500));
        // A new binary each time, installed as package managers do.
        let old = running_binary(pid);
        install(&binary);
        let new = std::fs::metadata(&binary).unwrap().ino();
        assert_ne!(old, new);
        let said = ok(Command::new(FLOE).args(["gateway", "upgrade", "--pid", &pid.to_string()]));
        assert!(said.contains(&format!("upgrade {round}")), "{said}");
        assert_eq!(running_binary(pid), new, "the gateway runs the new binary");
    }

    let qemu_io = qemu_io.wait_with_output().unwrap();
    let said = text(&qemu_io);
    assert!(
        qemu_io.status.success() && !said.contains("failed") && !said.contains("error"),
        "{said}"
    );
    assert_eq!(
        said.matches("read 65536/65536").count(),
        QEMU_IO_ROUNDS,
        "{said}"
    );
    assert_clean(&fio.wait_with_output().unwrap(), "verify during upgrades");
    std::fs::write(&stop, "").unwrap();
    let report = report(writer);
    eprintln!(
        "{UPGRADES} upgrades; the ledger writer's longest wait for a write and its read-back: {:.3}s",
        report["longest_pause"].as_f64().unwrap()
    );
    assert_eq!(
        gateway.0.try_wait().unwrap(),
        None,
        "the gateway is still running"
    );

    // Each client kept its connection: none attached after the first upgrade, and
    // the first upgrades carried all three (fio and qemu-io may end before the last).
    let log = std::fs::read_to_string(work.path().join("gateway.log")).unwrap();
    let upgrades = log.split("upgrading: parking clients").skip(1);
    assert!(
        upgrades
            .clone()
            .all(|after| !after.contains("client attached")),
        "a client connected again:\n{log}"
    );
    assert_eq!(upgrades.count(), UPGRADES as usize, "{log}");
    assert!(log.contains("connections=3"), "{log}");
    let handed = log.matches("client handed over").count();
    assert!(
        handed >= 2 * UPGRADES as usize,
        "{handed} handovers:\n{log}"
    );
    assert!(!log.contains("a handed-over client is lost"), "{log}");

    // Stopped like any gateway, it releases the volume; the demo's gateway reads
    // what the ledger says.
    // SAFETY: kill(2) on the gateway this test started.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    assert!(gateway.0.wait().unwrap().success());
    check_ledger(&report, cluster.uri());
}

/// qemu-io writing a pattern to a 64 KiB block and reading it back, `QEMU_IO_ROUNDS`
/// times, 25 ms apart, from 96 MiB on: commands on stdin, one connection.
fn qemu_io(uri: &str, work: &Path) -> std::process::Child {
    let commands: String = (0..QEMU_IO_ROUNDS)
        .map(|i| {
            let (pattern, at) = (i % 250 + 1, (96 << 20) + (i % 256) * BLOCK);
            format!("write -P {pattern} {at} 64k\nread -P {pattern} {at} 64k\nsleep 25\n")
        })
        .collect();
    let path = work.join("qemu-io.commands");
    std::fs::write(&path, commands + "quit\n").unwrap();
    Command::new("qemu-io")
        .args(["-f", "raw", uri])
        .stdin(std::fs::File::open(path).unwrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
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
        servers.restart_from(n, &binary);
        servers.wait_listening(n);
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
