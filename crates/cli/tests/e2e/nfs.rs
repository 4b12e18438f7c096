//! The NFSv3 front end (`floe nfs`) driven by clients we did not write: QEMU's nfs
//! block driver (qemu-img, qemu-io) and libnfs's nfs-ls and nfs-cp, with the NBD
//! gateway of the same cluster on the other side. QEMU's driver asks the portmapper
//! on port 111 where mount and nfs are; `floe nfs` answers portmapper calls itself,
//! so this test serves on 127.0.0.1:111 (the tests run as root; the port must be
//! free). libnfs's tools are given the ports in the URL instead.

use crate::cluster::{free_ports, nbdsh, ok, output, random_file, Cluster, TestDir, FLOE};
use crate::crash::{verify_nbd, SCRIPTS};
use crate::io_helpers::{alive, text, wait_for_file, wait_until};
use floe_metrics::scrape;
use rand::Rng;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const VOLUME_BYTES: usize = 64 << 20;
const NFS_ADDRESS: &str = "127.0.0.1:111";
/// The ledger writer's volume, in 4 KiB blocks (16 MiB).
const CRASH_BLOCKS: u64 = 4096;

/// A `floe nfs` process, killed if the test ends first.
struct Nfs {
    child: Child,
    log: PathBuf,
    metrics: String,
}

impl Nfs {
    fn start(cluster: &Cluster, dir: &Path) -> Nfs {
        let log = dir.join("nfs.log");
        let metrics_address = format!("127.0.0.1:{}", free_ports());
        let child = Command::new(FLOE)
            .args(["--master", &cluster.info.master, "nfs"])
            .args(["--listen", NFS_ADDRESS, "--idle-close", "2s"])
            .args(["--metrics-listen", &metrics_address])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("floe nfs starts");
        let serving = wait_for_file(&log, Duration::from_secs(20), |t| {
            t.contains("serving NFSv3") || t.contains("floe:")
        });
        assert!(
            serving.contains("serving NFSv3"),
            "floe nfs did not start on {NFS_ADDRESS}:\n{serving}"
        );
        Nfs {
            child,
            log,
            metrics: format!("http://{metrics_address}/metrics"),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Requests of kind `op` on `volume` the process served, from its metrics.
    fn requests(&self, volume: &str, op: &str) -> f64 {
        let page = scrape::fetch(&self.metrics).expect("floe nfs serves metrics");
        scrape::parse(&page)
            .iter()
            .filter(|s| s.name == "floe_gateway_request_duration_seconds_count")
            .filter(|s| s.label("volume") == Some(volume) && s.label("op") == Some(op))
            .map(|s| s.value)
            .sum()
    }
}

impl Drop for Nfs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A libnfs URL for `file` in the export, with the ports given (no portmapper).
fn libnfs_url(file: &str) -> String {
    format!("nfs://127.0.0.1/floe/{file}?nfsport=111&mountport=111&version=3")
}

fn same_bytes(a: &Path, b: &Path, what: &str) {
    let (a, b) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let first = a.iter().zip(&b).position(|(x, y)| x != y);
    assert_eq!(first, None, "{what}: the first byte that differs");
}

#[test]
fn nfs_exports_volumes_to_qemu_and_libnfs_under_the_gateways_leases() {
    let dir = TestDir::new();
    let work = TestDir::new();
    let cluster = Cluster::start(dir.path());
    // Write-back: a FLUSH makes the writes before it durable (on flush-epoch and
    // log-commit volumes it is an ordering point only, as over NBD).
    cluster.floe(&[
        "volume",
        "create",
        "nfsvol",
        "--size",
        "64M",
        "--write-mode",
        "write-back",
    ]);
    cluster.floe(&[
        "volume",
        "create",
        "nfscrash",
        "--size",
        "16M",
        "--write-mode",
        "write-back",
    ]);
    let nbd = cluster.uri().replace("/demo", "/nfsvol");
    let nfs = Nfs::start(&cluster, work.path());
    let qemu_url = "nfs://127.0.0.1/floe/nfsvol";

    // The directory lists every volume at its size.
    let listing = ok(Command::new("nfs-ls").arg(libnfs_url("")));
    let size_of = |name: &str| {
        listing
            .lines()
            .find(|l| l.ends_with(&format!(" {name}")))
            .and_then(|l| l.split_whitespace().nth(4))
            .map(str::to_string)
    };
    assert_eq!(size_of("nfsvol").as_deref(), Some("67108864"), "{listing}");
    assert_eq!(size_of("demo").as_deref(), Some("1073741824"), "{listing}");

    // In through NFS (qemu-img flushes at the end: COMMIT), out through NFS and NBD.
    let written = work.path().join("in.raw");
    random_file(&written, VOLUME_BYTES);
    ok(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&written)
        .arg(qemu_url));
    assert!(nfs.requests("nfsvol", "flush") >= 1.0, "no COMMIT arrived");
    let read = work.path().join("out-qemu.raw");
    ok(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", qemu_url])
        .arg(&read));
    same_bytes(&written, &read, "qemu-img in and out of NFS");
    // The gateway opens the volume once the NFS side closed it, idle, and let its
    // lease go.
    let log = wait_for_file(&nfs.log, Duration::from_secs(20), |t| {
        t.contains("lease released volume=nfsvol")
    });
    assert!(log.contains("lease released volume=nfsvol"), "{log}");
    let read = work.path().join("out.raw");
    ok(Command::new("nbdcopy").arg(&nbd).arg(&read));
    same_bytes(&written, &read, "qemu-img into NFS, nbdcopy out of NBD");

    // A snapshot is a read-only file beside its volume, and keeps what it was taken
    // over while the volume is written.
    cluster.floe(&["snapshot", "create", "nfsvol@first"]);
    let listing = ok(Command::new("nfs-ls").arg(libnfs_url("")));
    let snapshot = listing.lines().find(|l| l.ends_with(" nfsvol@first"));
    assert!(
        snapshot.is_some_and(|l| l.starts_with("-r--r--r--") && l.contains(" 67108864 ")),
        "{listing}"
    );

    // In through NBD, out through NFS.
    let first = written;
    let written = work.path().join("in2.raw");
    random_file(&written, VOLUME_BYTES);
    ok(Command::new("nbdcopy").arg(&written).arg(&nbd));
    // While a gateway holds the volume, NFS refuses it with EIO and logs who holds it.
    let mut holder = nbdsh()
        .args(["-u", &nbd, "-c", "import time; time.sleep(60)"])
        .stdin(Stdio::null())
        .spawn()
        .expect("nbdsh starts");
    std::thread::sleep(Duration::from_secs(1));
    let refused = output(Command::new("nfs-cat").arg(libnfs_url("nfsvol")));
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(!refused.status.success(), "read while a gateway holds it");
    let log = nfs.log();
    assert!(
        log.contains("cannot open: volume nfsvol is in use by gateway"),
        "{log}"
    );
    let read = work.path().join("out2.raw");
    ok(Command::new("nfs-cp").arg(libnfs_url("nfsvol")).arg(&read));
    same_bytes(&written, &read, "nbdcopy into NBD, nfs-cp out of NFS");
    let read = work.path().join("out3.raw");
    ok(Command::new("nfs-cp")
        .arg(libnfs_url("nfsvol@first"))
        .arg(&read));
    same_bytes(&first, &read, "the snapshot, with nfs-cp");

    // Writes past the end, and changes to the directory, are refused; the server
    // serves on.
    let python = ok(Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/nfs_raw.py"))
        .args(["127.0.0.1", "111", "/floe", "nfsvol"]));
    let statuses: serde_json::Value = serde_json::from_str(python.trim()).unwrap();
    const NFS3ERR_ACCES: u64 = 13;
    const NFS3ERR_FBIG: u64 = 27;
    assert_eq!(statuses["write_across_the_end"], NFS3ERR_FBIG, "{statuses}");
    assert_eq!(statuses["write_after_the_end"], NFS3ERR_FBIG, "{statuses}");
    assert_eq!(statuses["remove"], NFS3ERR_ACCES, "{statuses}");
    assert_eq!(statuses["write_inside"], 0, "{statuses}");
    assert_eq!(statuses["size_after"], VOLUME_BYTES as u64, "{statuses}");
    let create = output(
        Command::new("nfs-cp")
            .arg(&written)
            .arg(libnfs_url("new-volume")),
    );
    assert!(!create.status.success(), "{}", text(&create));
    assert!(nfs.log().contains("refused to create"), "{}", nfs.log());
    let pid = nfs.child.id();
    assert!(alive(pid), "floe nfs died:\n{}", nfs.log());
    let listing = ok(Command::new("nfs-ls").arg(libnfs_url("")));
    assert!(!listing.contains("new-volume"), "{listing}");

    // kill -9 at a random moment under a writer that keeps a ledger: every write
    // acknowledged at a COMMIT's reply or as FILE_SYNC is on the replicas, and none is
    // torn (read back through the gateway, once the killed process's lease runs out).
    let ledgers = work.path().join("ledgers");
    std::fs::create_dir(&ledgers).unwrap();
    let ledger = ledgers.join("ledger-0.txt");
    let seed = rand::random::<u32>() as u64;
    let mut writer = Command::new("python3")
        .arg(format!("{SCRIPTS}/nfs_ledger.py"))
        .args(["127.0.0.1", "111", "/floe", "nfscrash"])
        .env("PYTHONPATH", SCRIPTS)
        .env("FLOE_CRASH_SEED", seed.to_string())
        .env("FLOE_CRASH_ROUND", "0")
        .env("FLOE_CRASH_START", "0")
        .env("FLOE_CRASH_COUNT", CRASH_BLOCKS.to_string())
        .env("FLOE_CRASH_REGION_BLOCKS", CRASH_BLOCKS.to_string())
        .env("FLOE_CRASH_LEDGER", &ledger)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let kill_after = rand::thread_rng().gen_range(16..400);
    let acked = || {
        let text = std::fs::read_to_string(&ledger).unwrap_or_default();
        text.lines().filter(|l| l.starts_with("A ")).count()
    };
    wait_until(
        "the NFS writer's acknowledged writes",
        Duration::from_secs(120),
        || acked() >= kill_after || writer.try_wait().unwrap().is_some(),
    );
    // SAFETY: kill(2) on the process this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let summary = writer.wait_with_output().unwrap();
    let summary = String::from_utf8_lossy(&summary.stdout);
    assert!(
        summary.contains("\"error\": \""),
        "the writer outlived the server: {summary}"
    );
    let nbd = cluster.uri().replace("/demo", "/nfscrash");
    let report = verify_nbd(&nbd, &ledgers, 1, seed);
    assert!(
        report.acked as usize >= kill_after,
        "{report:?} ({summary})"
    );
    assert_eq!((report.lost, report.torn), (0, 0), "{report:?}");
}
