//! Chunk servers on small file systems, each its own loop-mounted ext4:
//! - when the disks are full, a write fails with ENOSPC at the NBD client (not EIO,
//!   not a hang), every write acknowledged before reads back intact, `floe status`
//!   warns, trims and deletes still succeed, and once they freed space writes succeed
//!   again and the cluster returns to full redundancy by itself;
//! - one small server among large ones does not stop writes: new chunks go where
//!   there is space, and the small server's file system is not filled;
//! - a flush-epoch volume acknowledges writes before the replicas see them: those the
//!   full disks refuse fail a later FLUSH (or FUA write) with ENOSPC, never silently.
//!
//! The master's metadata and every log stay off the small file systems: only chunk
//! servers run out of space.

use crate::cluster::{free_ports, nbdsh, ok, output, random_file, FLOE};
use crate::io_helpers::{text, wait_until};
use serde_json::Value;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const VOLUME_BYTES: u64 = 1 << 30;
/// The unit every ledger counts in: one NBD write of 1 MiB.
const BLOCK: u64 = MIB;
/// errno of a write the disks cannot store.
const ENOSPC: i64 = libc::ENOSPC as i64;
/// Failure bound of any one NBD request: a hang fails the test instead of stalling it.
const REQUEST_LIMIT: Duration = Duration::from_secs(120);
/// Failure bound of a whole client run (nbdsh script, nbdcopy).
const CLIENT_LIMIT: Duration = Duration::from_secs(600);
/// Failure bound of what the cluster does by itself: start, free space, heal.
const SETTLE: Duration = Duration::from_secs(300);
/// Failure bound of a change to show in `floe status` (servers report every second).
const STATUS_LIMIT: Duration = Duration::from_secs(60);

/// A process the test started; stopped by its PID when dropped.
struct Process {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Process {
    /// Starts `command` with stdout and stderr going to `log`.
    fn spawn(name: &str, mut command: Command, log: PathBuf) -> Process {
        let file = std::fs::File::create(&log).unwrap();
        let child = command
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("{name} does not start: {e}"));
        Process {
            name: name.to_string(),
            child,
            log,
        }
    }

    /// Panics, with the end of its log, if the process has exited.
    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited ({status}); the end of its log:\n{}",
                self.name,
                tail(&self.log, 20)
            );
        }
    }
}

impl Drop for Process {
    /// SIGTERM, and SIGKILL if it is still there after a while (a process stuck on a
    /// full disk must not hang the test's cleanup).
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last `lines` lines of a log.
fn tail(log: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// An ext4 file system of a given size in a sparse image file, loop-mounted; unmounted
/// (lazily if still busy) when dropped, even when the test failed.
struct SmallFs {
    image: PathBuf,
    mount: PathBuf,
    mounted: bool,
}

impl SmallFs {
    fn new(image: PathBuf, mount: PathBuf, bytes: u64) -> SmallFs {
        let mut fs = SmallFs {
            image,
            mount,
            mounted: false,
        };
        std::fs::File::create(&fs.image)
            .and_then(|file| file.set_len(bytes))
            .unwrap();
        // No blocks reserved for root: the chunk servers run as root, and "full"
        // should mean the same to them, to statvfs and to `df`.
        ok(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .arg(&fs.image));
        std::fs::create_dir_all(&fs.mount).unwrap();
        ok(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&fs.image)
            .arg(&fs.mount));
        fs.mounted = true;
        fs
    }

    /// The share of the file system's blocks in use, from statvfs(2).
    fn used_fraction(&self) -> f64 {
        let path = std::ffi::CString::new(self.mount.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a zeroed plain C struct, filled by statvfs.
        let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a valid C string and an out-pointer to the struct above.
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut stat) }, 0);
        1.0 - stat.f_bfree as f64 / stat.f_blocks as f64
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        if self.mounted {
            let unmounted = output(Command::new("umount").arg(&self.mount))
                .status
                .success();
            if !unmounted {
                eprintln!(
                    "umount {} failed; detaching it lazily",
                    self.mount.display()
                );
                let _ = output(Command::new("umount").arg("-l").arg(&self.mount));
            }
        }
        let _ = std::fs::remove_file(&self.image);
    }
}

/// A chunk server whose data directory is on a small file system of its own. The
/// server is stopped before its file system is unmounted (field order).
struct SmallServer {
    host: String,
    process: Process,
    fs: SmallFs,
}

impl SmallServer {
    /// A file system of `bytes` under `dir` and an ssd chunk server for `host` on it,
    /// listening on `port`.
    fn start(dir: &Path, host: &str, bytes: u64, port: u16, master: &str) -> SmallServer {
        let fs = SmallFs::new(dir.join(format!("{host}.img")), dir.join(host), bytes);
        let mut command = Command::new(FLOE);
        command
            .args(["chunkserver", "--dir"])
            .arg(fs.mount.join("floe"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--host", host, "--class", "ssd", "--master", master]);
        let log = dir.join(format!("chunkserver-{host}.log"));
        SmallServer {
            host: host.to_string(),
            process: Process::spawn(&format!("chunk server on {host}"), command, log),
            fs,
        }
    }

    /// The chunk server's data directory.
    fn data(&self) -> PathBuf {
        self.fs.mount.join("floe")
    }
}

/// Master (embedded metadata, on the test's own directory), one chunk server per host
/// on small file systems, and a gateway; each a process of its own on loopback.
struct Rig {
    master: String,
    nbd: String,
    gateway: Process,
    servers: Vec<SmallServer>,
    master_process: Process,
    /// Dropped last: logs, images and mount points live here.
    dir: tempfile::TempDir,
}

impl Rig {
    /// `hosts`: (host name, size of its chunk server's file system).
    fn start(hosts: &[(&str, u64)]) -> Rig {
        // free_ports() hands out 8: the master, the chunk servers, the gateway last.
        assert!(hosts.len() <= 6, "more servers than ports");
        let dir = tempfile::tempdir().unwrap();
        let port = free_ports();
        let master = format!("127.0.0.1:{port}");
        let mut command = Command::new(FLOE);
        command
            .args(["master", "--listen", &master, "--metadata"])
            .arg(format!(
                "embedded:{}",
                dir.path().join("meta.redb").display()
            ));
        let mut master_process = Process::spawn("master", command, dir.path().join("master.log"));
        wait_until("the master answers `floe status`", SETTLE, || {
            master_process.assert_running();
            floe_status(&master).is_ok()
        });

        let mut servers: Vec<SmallServer> = hosts
            .iter()
            .zip(port + 1..)
            .map(|(&(host, bytes), port)| {
                SmallServer::start(dir.path(), host, bytes, port, &master)
            })
            .collect();
        // Every server registered before the first chunk is written: the first chunk
        // puts the servers registered then into the cluster map.
        let up = format!("{n}/{n} chunk servers up", n = hosts.len());
        wait_until(&format!("`floe status` says {up:?}"), SETTLE, || {
            for server in &mut servers {
                server.process.assert_running();
            }
            floe_status(&master).is_ok_and(|status| status.contains(&up))
        });

        let nbd = format!("127.0.0.1:{}", port + 7);
        let mut command = Command::new(FLOE);
        command.args(["--master", &master, "gateway", "--listen", &nbd]);
        let mut gateway = Process::spawn("gateway", command, dir.path().join("gateway.log"));
        wait_until("the gateway listens", SETTLE, || {
            gateway.assert_running();
            TcpStream::connect(&nbd).is_ok()
        });
        Rig {
            master,
            nbd,
            gateway,
            servers,
            master_process,
            dir,
        }
    }

    fn floe(&self, args: &[&str]) -> String {
        ok(Command::new(FLOE)
            .args(["--master", &self.master])
            .args(args))
    }

    fn uri(&self, volume: &str) -> String {
        format!("nbd://{}/{volume}", self.nbd)
    }

    /// A 1 GiB volume, three replicas on ssd servers (all there are).
    fn create_volume(&self, name: &str) {
        self.create_volume_with(name, &[]);
    }

    /// [`Rig::create_volume`] with more `floe volume create` arguments.
    fn create_volume_with(&self, name: &str, more: &[&str]) {
        let size = VOLUME_BYTES.to_string();
        let mut args = vec![
            "volume",
            "create",
            name,
            "--size",
            &size,
            "--replicas",
            "3",
            "--mode",
            "ssd",
        ];
        args.extend_from_slice(more);
        self.floe(&args);
    }

    /// Polls `floe status` until `check` holds; the status it held for.
    fn wait_for_status(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&str) -> bool,
    ) -> String {
        let started = Instant::now();
        loop {
            let last = match floe_status(&self.master) {
                Ok(status) if check(&status) => return status,
                Ok(status) => status,
                Err(error) => error,
            };
            assert!(
                started.elapsed() < timeout,
                "{what}: not so after {timeout:?}; `floe status`:\n{last}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Waits until every server is up, every chunk has all its replicas and is where
    /// the map places it (as `Cluster::wait_for_redundancy` does for a demo).
    fn wait_for_redundancy(&self) {
        let up = format!("{n}/{n} chunk servers up", n = self.servers.len());
        self.wait_for_status("the cluster back to full redundancy", SETTLE, |status| {
            status.contains(&up)
                && status.contains("redundancy: every chunk has all its replicas")
                && status.contains("rebalance: every chunk is where the map places it")
        });
    }

    fn volume_id(&self, name: &str) -> u64 {
        let info = self.floe(&["volume", "info", name, "--json"]);
        let info: serde_json::Value = serde_json::from_str(&info).expect("JSON");
        info["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("no id in `floe volume info {name} --json`:\n{info}"))
    }
}

impl Drop for Rig {
    /// A failed test loses its directory: say what the processes logged.
    fn drop(&mut self) {
        if std::thread::panicking() {
            let logs = [&self.master_process, &self.gateway]
                .into_iter()
                .chain(self.servers.iter().map(|s| &s.process));
            for process in logs {
                eprintln!(
                    "--- {} ({})\n{}",
                    process.name,
                    process.log.display(),
                    tail(&process.log, 15)
                );
            }
            for server in &self.servers {
                eprintln!(
                    "--- {}: file system {:.1}% full",
                    server.host,
                    server.fs.used_fraction() * 100.0
                );
            }
        }
    }
}

fn floe_status(master: &str) -> Result<String, String> {
    let out = output(Command::new(FLOE).args(["--master", master, "status"]));
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!("(floe status failed: {})", text(&out)))
    }
}

/// Runs `command` to its end; its output. Killed (by PID) after [`CLIENT_LIMIT`], so a
/// client hung on a request fails the test instead of stalling it.
fn run_bounded(what: &str, command: &mut Command) -> std::process::Output {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what} does not start: {e}"));
    let pid = child.id();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || sender.send(child.wait_with_output()));
    match receiver.recv_timeout(CLIENT_LIMIT) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: kill(2) on our child: the waiter thread has not reaped it.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            let out = receiver.recv().unwrap().unwrap();
            panic!(
                "{what} did not end within {CLIENT_LIMIT:?}; its output:\n{}",
                text(&out)
            );
        }
    }
}

/// Python for nbdsh: each 1 MiB block's bytes come from its index and a salt (a block
/// read from the wrong place, or an older write, shows), and every request is waited
/// for with a bound, so a hang is named. `write`, `trim` and `read` answer None when
/// the request succeeded, else [errno, message].
fn script(body: &str) -> String {
    let limit = REQUEST_LIMIT.as_secs();
    format!(
        r#"import json, os, random, time
BLOCK = {BLOCK}
def data(salt, i):
    return random.Random(salt * 1000003 + i).randbytes(BLOCK)
def attempt(what, start):
    try:
        cookie = start()
        deadline = time.monotonic() + {limit}
        while not h.aio_command_completed(cookie):
            if time.monotonic() > deadline:
                print(json.dumps({{"hang": what}}), flush=True)
                os._exit(3)
            h.poll(1000)
        return None
    except nbd.Error as e:
        return [e.errnum, e.string]
def write(salt, i):
    buf = nbd.Buffer.from_bytearray(bytearray(data(salt, i)))
    return attempt(f"write of block {{i}}", lambda: h.aio_pwrite(buf, i * BLOCK))
def fua_write(salt, i):
    buf = nbd.Buffer.from_bytearray(bytearray(data(salt, i)))
    return attempt(f"FUA write of block {{i}}", lambda: h.aio_pwrite(buf, i * BLOCK, flags=nbd.CMD_FLAG_FUA))
def flush():
    return attempt("flush", lambda: h.aio_flush())
def trim(first, count):
    return attempt(f"trim of blocks {{first}}+{{count}}", lambda: h.aio_trim(count * BLOCK, first * BLOCK))
def bad_blocks(salt, blocks):
    bad = []
    for i in blocks:
        buf = nbd.Buffer(BLOCK)
        error = attempt(f"read of block {{i}}", lambda: h.aio_pread(buf, i * BLOCK))
        if error is not None or buf.to_bytearray() != data(salt, i):
            bad.append([i, error])
    return bad
{body}"#
    )
}

/// Runs a [`script`] body on a fresh connection to `uri`; the JSON object it printed
/// last.
fn nbdsh_json(uri: &str, body: &str) -> Value {
    let out = run_bounded("nbdsh", nbdsh().args(["-u", uri, "-c", &script(body)]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    let json: Value = serde_json::from_str(last)
        .unwrap_or_else(|_| panic!("nbdsh printed no result ({}):\n{}", out.status, text(&out)));
    assert!(json.get("hang").is_none(), "a request hung: {json}");
    assert!(out.status.success(), "nbdsh failed: {}", text(&out));
    json
}

/// Blocks of `salt` in `blocks` that do not read back, read on a fresh connection.
fn bad_blocks(uri: &str, salt: u64, blocks: std::ops::Range<u64>) -> Value {
    let body = format!(
        "print(json.dumps(bad_blocks({salt}, range({}, {}))))",
        blocks.start, blocks.end
    );
    nbdsh_json(uri, &body)
}

/// `None` (the request succeeded) or the errno it failed with, from a [`script`] answer.
fn errno(answer: &Value) -> Option<i64> {
    match answer {
        Value::Null => None,
        failed => Some(failed[0].as_i64().unwrap_or(-1)),
    }
}

/// A status line that warns of a nearly full file system.
fn full_warning(status: &str) -> Option<&str> {
    status
        .lines()
        .find(|line| line.starts_with("WARNING:") && line.contains("% full"))
}

#[test]
fn full_disks_refuse_writes_with_enospc_and_recover_once_space_is_freed() {
    // Every server holds a replica of every chunk (three hosts, three replicas), so
    // the three file systems fill together.
    let rig = Rig::start(&[("h1", 300 * MIB), ("h2", 300 * MIB), ("h3", 300 * MIB)]);
    let blocks = VOLUME_BYTES / BLOCK;

    // A volume to delete once the disks are full, filled while there is room.
    const BALLAST: u64 = 32;
    rig.create_volume("ballast");
    let ballast = nbdsh_json(
        &rig.uri("ballast"),
        &format!("print(json.dumps([e for e in (write(3, i) for i in range({BALLAST})) if e]))"),
    );
    assert_eq!(ballast, Value::Array(Vec::new()), "writes with room failed");
    let ballast_id = rig.volume_id("ballast");

    // Sequential 1 MiB writes until one fails; then one more. The volume (1 GiB) is
    // larger than a file system, so the disks fill before its end (a write past the
    // end would also be ENOSPC, for another reason).
    rig.create_volume("data");
    let fill = nbdsh_json(
        &rig.uri("data"),
        &format!(
            r#"acked = 0
first = second = None
for i in range({blocks}):
    first = write(1, i)
    if first is not None:
        break
    acked += 1
if first is not None:
    second = write(1, min(acked + 1, {blocks} - 1))
bad = bad_blocks(1, range(acked))
print(json.dumps({{"acked": acked, "first": first, "second": second, "bad": bad}}))"#
        ),
    );
    let acked = fill["acked"].as_u64().unwrap();
    println!(
        "full disks: {acked} MiB acknowledged, then {} and {}",
        fill["first"], fill["second"]
    );
    assert!(
        acked < blocks,
        "all {blocks} MiB were written: the disks never filled"
    );
    assert!(acked > 0, "not one write succeeded: {fill}");
    assert_eq!(
        errno(&fill["first"]),
        Some(ENOSPC),
        "the first write the disks could not take (block {acked}) failed with {}, not ENOSPC",
        fill["first"]
    );
    assert_eq!(
        errno(&fill["second"]),
        Some(ENOSPC),
        "a further write on the full disks failed with {}, not ENOSPC",
        fill["second"]
    );
    assert_eq!(
        fill["bad"],
        Value::Array(Vec::new()),
        "acknowledged blocks read back wrong on the writer's connection"
    );
    assert_eq!(
        bad_blocks(&rig.uri("data"), 1, 0..acked),
        Value::Array(Vec::new()),
        "acknowledged blocks read back wrong on a fresh connection"
    );
    let status = rig.wait_for_status(
        "`floe status` warns of a full file system",
        STATUS_LIMIT,
        |status| full_warning(status).is_some(),
    );
    println!("full disks: {}", full_warning(&status).unwrap());

    // On the full disks: a trim of the second half of what was written, then the
    // delete of the ballast volume, both succeed.
    let kept = acked / 2;
    let trimmed = nbdsh_json(
        &rig.uri("data"),
        &format!("print(json.dumps(trim({kept}, {})))", acked - kept),
    );
    assert_eq!(
        errno(&trimmed),
        None,
        "a trim on the full disks failed: {trimmed}"
    );
    rig.floe(&["volume", "delete", "ballast"]);
    // The servers drop a deleted volume's chunks at their next heartbeat.
    let ballast_dir = format!("chunks/{ballast_id:016x}");
    wait_until(
        "every chunk server dropped the deleted volume's chunks",
        SETTLE,
        || {
            rig.servers
                .iter()
                .all(|server| !server.data().join(&ballast_dir).exists())
        },
    );

    // Space is freed: writes succeed again. The first is retried while the servers
    // free space (each failure meanwhile must still be ENOSPC), the rest must succeed.
    const NEW: u64 = 16;
    let again = nbdsh_json(
        &rig.uri("data"),
        &format!(
            r#"errors = []
deadline = time.monotonic() + {settle}
while True:
    error = write(2, {kept})
    if error is None:
        break
    errors.append(error)
    if error[0] != {ENOSPC} or time.monotonic() > deadline:
        break
    time.sleep(1)
failed = None
if error is None:
    for i in range({kept} + 1, {kept} + {NEW}):
        failed = write(2, i)
        if failed is not None:
            failed = [i, failed]
            break
print(json.dumps({{"errors": errors, "recovered": error is None, "failed": failed}}))"#,
            settle = SETTLE.as_secs()
        ),
    );
    let errors = again["errors"].as_array().unwrap();
    assert!(
        errors.iter().all(|e| errno(e) == Some(ENOSPC)),
        "a write while space was being freed failed otherwise than ENOSPC: {errors:?}"
    );
    assert_eq!(
        again["recovered"],
        Value::Bool(true),
        "writes did not succeed again within {SETTLE:?} of the trim and the delete: {errors:?}"
    );
    assert_eq!(
        again["failed"],
        Value::Null,
        "a write after space was freed failed"
    );
    println!(
        "full disks: writes succeed again after {} ENOSPC retries",
        errors.len()
    );

    // Back to full redundancy by itself; every replica agrees, and every acknowledged
    // block not trimmed, and every new one, reads back.
    rig.wait_for_redundancy();
    let scrub = rig.floe(&["scrub", "data"]);
    assert!(scrub.contains(" 0 differences"), "scrub: {scrub}");
    assert_eq!(
        bad_blocks(&rig.uri("data"), 1, 0..kept),
        Value::Array(Vec::new()),
        "acknowledged blocks read back wrong after recovery"
    );
    assert_eq!(
        bad_blocks(&rig.uri("data"), 2, kept..kept + NEW),
        Value::Array(Vec::new()),
        "writes after recovery read back wrong"
    );
}

#[test]
fn a_small_server_among_large_ones_does_not_stop_writes() {
    const SMALL: &str = "h4";
    let rig = Rig::start(&[
        ("h1", 1024 * MIB),
        ("h2", 1024 * MIB),
        ("h3", 1024 * MIB),
        (SMALL, 200 * MIB),
    ]);
    rig.create_volume("data");
    const WRITTEN: u64 = 600 * MIB;
    let source = rig.dir.path().join("source.img");
    random_file(&source, WRITTEN as usize);
    let copy = run_bounded(
        "nbdcopy",
        Command::new("nbdcopy").arg(&source).arg(rig.uri("data")),
    );
    assert!(
        copy.status.success(),
        "nbdcopy of {} MiB failed: {}",
        WRITTEN / MIB,
        text(&copy)
    );

    // Checksums of the source and of the volume's first 600 MiB, and the first MiB
    // that differs.
    let compared = nbdsh_json(
        &rig.uri("data"),
        &format!(
            r#"import hashlib
want, got, first = hashlib.sha256(), hashlib.sha256(), None
with open({source:?}, "rb") as source:
    for i in range({WRITTEN} // BLOCK):
        expected = source.read(BLOCK)
        buf = nbd.Buffer(BLOCK)
        error = attempt(f"read of block {{i}}", lambda: h.aio_pread(buf, i * BLOCK))
        actual = buf.to_bytearray()
        want.update(expected)
        got.update(actual)
        if (error is not None or actual != expected) and first is None:
            first = [i, error]
print(json.dumps({{"want": want.hexdigest(), "got": got.hexdigest(), "first": first}}))"#,
            source = source.display().to_string()
        ),
    );
    assert_eq!(
        compared["want"], compared["got"],
        "the volume does not read back what was written: {compared}"
    );

    for server in &rig.servers {
        println!(
            "small server: {} file system {:.1}% full",
            server.host,
            server.fs.used_fraction() * 100.0
        );
    }
    let small = rig.servers.iter().find(|s| s.host == SMALL).unwrap();
    let used = small.fs.used_fraction();
    assert!(
        used <= 0.95,
        "the small server's file system is {:.1}% full after {} MiB written",
        used * 100.0,
        WRITTEN / MIB
    );
    rig.wait_for_redundancy();
}

/// Flush-epoch (see write_modes.rs): writes are acknowledged from the gateway's memory,
/// so the full disks refuse writes the client was told had succeeded. Each must fail a
/// FLUSH (or FUA write) after it, with ENOSPC.
#[test]
fn a_flush_epoch_volume_reports_writes_the_full_disks_refused_on_a_later_flush() {
    let rig = Rig::start(&[("h1", 300 * MIB), ("h2", 300 * MIB), ("h3", 300 * MIB)]);
    let blocks = VOLUME_BYTES / BLOCK;
    rig.create_volume_with("data", &["--write-mode", "flush-epoch"]);
    let info = rig.floe(&["volume", "info", "data"]);
    assert!(info.contains("write mode:    flush-epoch"), "{info}");

    // A 1 MiB write then a FLUSH, block after block, until a FLUSH fails; then a few
    // more of each on the full disks. Last a barrier: a FLUSH, a FUA write (answered
    // once every earlier epoch is retired, and failing with any failure not reported
    // yet) and a FLUSH (for the FUA write's own epoch). Every request's answer, in order.
    let run = nbdsh_json(
        &rig.uri("data"),
        &format!(
            r#"ops = []
failed_at = None
for i in range({blocks}):
    ops.append(["write", i, write(1, i)])
    error = flush()
    ops.append(["flush", i, error])
    if error is not None:
        failed_at = i
        break
if failed_at is not None:
    for i in range(failed_at + 1, min(failed_at + 9, {blocks})):
        ops.append(["write", i, write(1, i)])
        ops.append(["flush", i, flush()])
ops.append(["flush", None, flush()])
ops.append(["fua", 0, fua_write(1, 0)])
ops.append(["flush", None, flush()])
print(json.dumps({{"ops": ops, "failed_at": failed_at}}))"#
        ),
    );
    let ops = run["ops"].as_array().unwrap();
    let failed_at = run["failed_at"].as_u64().unwrap_or_else(|| {
        panic!("all {blocks} MiB written and flushed without an error: the disks never filled, or their refusals vanished")
    });
    let kind = |op: &Value| op[0].as_str().unwrap().to_string();
    let error = |op: &Value| errno(&op[2]);
    // Acknowledged at once: the replicas' refusals can only show later.
    for op in ops.iter().filter(|op| kind(op) == "write") {
        assert_eq!(error(op), None, "a flush-epoch write failed at once: {op}");
    }
    let failures: Vec<&Value> = ops.iter().filter(|op| error(op).is_some()).collect();
    for op in &failures {
        assert_eq!(
            error(op),
            Some(ENOSPC),
            "a {} on the full disks failed otherwise than ENOSPC: {op}",
            kind(op)
        );
    }

    // Read on a fresh connection: the acknowledged blocks the disks did not take.
    let written = ops
        .iter()
        .filter(|op| kind(op) == "write")
        .map(|op| op[1].as_u64().unwrap())
        .max()
        .unwrap();
    let bad = bad_blocks(&rig.uri("data"), 1, 0..written + 1);
    let reads_failed = bad
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| !b[1].is_null())
        .count();
    assert_eq!(reads_failed, 0, "reads on the full disks failed: {bad}");
    let lost: Vec<u64> = bad
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b[0].as_u64().unwrap())
        .collect();
    // Each lost block's write has a failed request after it: none vanished.
    let last_failure = ops.iter().rposition(|op| error(op).is_some()).unwrap();
    for block in &lost {
        let at = ops
            .iter()
            .position(|op| kind(op) == "write" && op[1].as_u64() == Some(*block))
            .unwrap();
        assert!(
            at < last_failure,
            "block {block}'s acknowledged write was lost, and no FLUSH or FUA write after it failed:\n{ops:?}"
        );
    }
    println!(
        "flush-epoch on full disks: the first FLUSH failed (ENOSPC) after block {failed_at}; \
         {} of {} requests failed, all ENOSPC (the FUA write: {}); {} of {} acknowledged MiB \
         lost, each followed by a failed request",
        failures.len(),
        ops.len(),
        ops[ops.len() - 2][2],
        lost.len(),
        written + 1
    );
}
