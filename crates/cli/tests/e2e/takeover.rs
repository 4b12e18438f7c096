//! A writing gateway cut off from the master alone (nftables drops what it sends to the
//! master's port; its chunk servers still answer it) while a second gateway takes the
//! volume over. The ledger of both writers shows that the cut-off gateway stops
//! acknowledging writes before the master grants the lease to the other (it fences
//! itself: its writes wait for a renewal that cannot come), that every acknowledged write of either reads back, and that the new
//! writer's writes do not hang on the old one's last writes.

use crate::cluster::{free_ports, nbdsh, output, Cluster, FLOE};
use crate::io_helpers::text;
use crate::netcut::Cut;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The group the cut-off gateway runs as: the nftables rule picks its packets by
/// their socket's group (its user stays the same, so it reads what the others read).
const CUT_OFF_GID: u32 = 65534;
/// How long the first gateway's client writes; the takeover happens meanwhile.
const WRITING: Duration = Duration::from_secs(16);
/// Normal writing before the cut.
const BEFORE_CUT: Duration = Duration::from_secs(2);
/// The slowest write the new writer may see: a replica timeout and a retry, never the
/// minute-long hang of a diverged history.
const NEW_WRITER_WRITE_MAX: Duration = Duration::from_secs(5);
/// The gateway's deadline on master calls (5 s) and the client's own start.
const REFUSAL_MAX: Duration = Duration::from_secs(12);
const NEW_WRITER_WRITES: usize = 400;
const SCRIPT_MAX: Duration = Duration::from_secs(60);

/// Writes a distinct 4 KiB block at every even 4 KiB block for `WRITING_S` seconds,
/// printing each outcome with the UTC time it was known, in the format of the
/// master's log timestamps (so the two compare as strings).
const OLD_WRITER: &str = r#"
import datetime, os, struct, time
def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
end = time.monotonic() + float(os.environ["WRITING_S"])
i = 0
while time.monotonic() < end:
    try:
        h.pwrite(struct.pack("<Q", i) * 512, i * 8192)
        print(f"ack {i} {now()}", flush=True)
    except nbd.Error as e:
        print(f"refused {i} {now()} {e}", flush=True)
    i += 1
    time.sleep(0.01)
"#;

/// Writes a distinct block at every odd 4 KiB block (the same chunks as the old
/// writer), printing each write's duration.
const NEW_WRITER: &str = r#"
import os, struct, time
for j in range(int(os.environ["WRITES"])):
    start = time.monotonic()
    try:
        h.pwrite(struct.pack("<Q", 1_000_000 + j) * 512, j * 8192 + 4096)
        print(f"ack {j} {time.monotonic() - start:.3f}", flush=True)
    except nbd.Error as e:
        print(f"failed {j} {time.monotonic() - start:.3f} {e}", flush=True)
"#;

/// Reads every "offset value" line of the file at `LEDGER` and counts the blocks that
/// do not hold their value.
const CHECK: &str = r#"
import os, struct
bad = []
for line in open(os.environ["LEDGER"]):
    offset, value = map(int, line.split())
    if h.pread(4096, offset) != struct.pack("<Q", value) * 512:
        bad.append(offset)
print(f"{len(bad)} differ {bad[:10]}", flush=True)
"#;

fn gateway(master: &str, port: u16, log: &std::path::Path, gid: Option<u32>) -> Child {
    let log = std::fs::File::create(log).unwrap();
    let mut command = match gid {
        Some(gid) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--regid={gid}"))
                .args(["--clear-groups", FLOE]);
            c
        }
        None => Command::new(FLOE),
    };
    command
        .args(["--master", master, "gateway", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("gateway starts")
}

/// Runs `script` in nbdsh on `uri`; its stdout lines. Killed after `SCRIPT_MAX`, so a
/// hung write fails the test instead of stalling it.
fn script(uri: &str, script: &str, env: &[(&str, String)]) -> std::thread::JoinHandle<Vec<String>> {
    let script = format!(
        "import signal\nsignal.alarm({})\n{script}",
        SCRIPT_MAX.as_secs()
    );
    let mut child = nbdsh()
        .args(["-u", uri, "-c", &script])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("nbdsh starts");
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        let lines = BufReader::new(stdout).lines().map(Result::unwrap).collect();
        let _ = child.wait();
        lines
    })
}

/// The timestamp of the master's log line granting the lease to `holder` (the line
/// is written before the grant is answered, so the new gateway cannot have written
/// earlier).
fn granted_at(master_log: &str, holder: &str) -> String {
    logged_at(master_log, &["lease granted", holder])
        .unwrap_or_else(|| panic!("no grant to {holder} in the master's log:\n{master_log}"))
}

/// The timestamp of the first line of `log` that holds every one of `words`.
fn logged_at(log: &str, words: &[&str]) -> Option<String> {
    let line = log.lines().find(|l| words.iter().all(|w| l.contains(w)))?;
    // The log is coloured: drop the escape sequences.
    let mut plain = String::new();
    let mut in_escape = false;
    for c in line.chars() {
        match c {
            '\u{1b}' => in_escape = true,
            'm' if in_escape => in_escape = false,
            c if !in_escape => plain.push(c),
            _ => {}
        }
    }
    plain.split_whitespace().next().map(String::from)
}

#[test]
fn cut_off_writer_stops_before_the_takeover() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let master = &cluster.info.master;
    let master_port: u16 = master.rsplit(':').next().unwrap().parse().unwrap();
    let ports = free_ports();
    let (old_port, new_port) = (ports, ports + 1);
    let mut old = gateway(
        master,
        old_port,
        &dir.path().join("old-gateway.log"),
        Some(CUT_OFF_GID),
    );
    let mut new = gateway(master, new_port, &dir.path().join("new-gateway.log"), None);
    std::thread::sleep(Duration::from_millis(500));
    let old_uri = format!("nbd://127.0.0.1:{old_port}/demo");
    let new_uri = format!("nbd://127.0.0.1:{new_port}/demo");

    let old_writer = script(
        &old_uri,
        OLD_WRITER,
        &[("WRITING_S", WRITING.as_secs_f64().to_string())],
    );
    std::thread::sleep(BEFORE_CUT);
    let cut = Cut::group_to_port(CUT_OFF_GID, master_port);
    // The new gateway waits for the old lease to run out.
    let new_writer = script(
        &new_uri,
        NEW_WRITER,
        &[("WRITES", NEW_WRITER_WRITES.to_string())],
    );

    // A new connection to the cut-off gateway (for a volume it has not open) is
    // refused in time, not hung.
    let asked = Instant::now();
    // Under `timeout`, so a hang fails the test instead of stalling it.
    let refused = output(Command::new("timeout").args([
        &REFUSAL_MAX.as_secs().to_string(),
        "qemu-io",
        "-f",
        "raw",
        "-c",
        "read 0 4k",
        &format!("nbd://127.0.0.1:{old_port}/other"),
    ]));
    let waited = asked.elapsed();

    let new_lines = new_writer.join().unwrap();
    // Its writes wait for a renewal that cannot come: stopping it ends them.
    let _ = old.kill();
    let _ = old.wait();
    let old_lines = old_writer.join().unwrap();
    drop(cut);

    let master_log = std::fs::read_to_string(dir.path().join("logs").join("master.log")).unwrap();
    let granted = granted_at(&master_log, &format!("127.0.0.1:{new_port}"));
    let mut ledger = String::new();
    let mut last_ack = String::new();
    for line in &old_lines {
        let fields: Vec<&str> = line.splitn(4, ' ').collect();
        let (i, at): (u64, &str) = (fields[1].parse().unwrap(), fields[2]);
        if fields[0] == "ack" {
            assert!(
                at < granted.as_str(),
                "the cut-off gateway acknowledged write {i} at {at}, after the lease was granted to the other at {granted}"
            );
            ledger += &format!("{} {i}\n", i * 8192);
            last_ack = at.to_string();
        }
    }
    // It fenced itself: its writes wait for a renewal from before the grant on.
    let old_log = std::fs::read_to_string(dir.path().join("old-gateway.log")).unwrap();
    let fenced_at = logged_at(&old_log, &["the lease ran out", "writes wait"])
        .unwrap_or_else(|| panic!("the cut-off gateway never held its writes:\n{old_log}"));
    assert!(
        fenced_at < granted,
        "the cut-off gateway did not fence itself before the takeover at {granted} (at {fenced_at}):\n{old_log}"
    );

    let mut slowest = 0.0f64;
    for line in &new_lines {
        let fields: Vec<&str> = line.splitn(4, ' ').collect();
        assert_eq!(fields[0], "ack", "the new writer failed: {line}");
        let j: u64 = fields[1].parse().unwrap();
        slowest = slowest.max(fields[2].parse().unwrap());
        ledger += &format!("{} {}\n", j * 8192 + 4096, 1_000_000 + j);
    }
    assert_eq!(new_lines.len(), NEW_WRITER_WRITES, "{new_lines:?}");
    assert!(
        slowest < NEW_WRITER_WRITE_MAX.as_secs_f64(),
        "a write of the new writer took {slowest:.1} s"
    );

    let ledger_path = dir.path().join("ledger");
    std::fs::write(&ledger_path, &ledger).unwrap();
    let checked = script(
        &new_uri,
        CHECK,
        &[("LEDGER", ledger_path.display().to_string())],
    )
    .join()
    .unwrap();
    assert!(
        checked.first().is_some_and(|l| l.starts_with("0 differ")),
        "acknowledged writes do not read back: {checked:?}"
    );
    assert!(
        !refused.status.success() && text(&refused).contains("no answer"),
        "a new connection to the cut-off gateway was not refused clearly:\n{}",
        text(&refused)
    );
    assert!(waited < REFUSAL_MAX, "refused only after {waited:?}");
    println!(
        "takeover: old writer's last ack {last_ack}, its writes held from {fenced_at}, lease granted {granted}; {} acknowledged writes read back; the new writer's slowest write {slowest:.3} s",
        ledger.lines().count()
    );
    let _ = new.kill();
    let _ = new.wait();
}
