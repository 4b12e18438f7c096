//! Stale reads (Yogurt): a read-only gateway with `--staleness` reads each chunk from
//! the replica of least cost instead of the primary. Under a writer, with a chunk
//! server paused (SIGSTOP: it falls behind, then answers again still behind) and
//! another killed (kill -9), every read is whole, never goes back in time, and is
//! never further behind the writer's acknowledged writes than the bound
//! (stale_client.py checks each read against the acknowledgement times).

use crate::cluster::{output, Cluster, TestDir};
use crate::fencing::{read_byte, signal};
use crate::io_helpers::{qemu_io, text};
use crate::write_modes::Gateway;
use std::process::{Command, Stdio};
use std::time::Duration;

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/stale_client.py");
const SECONDS: u64 = 24;
const STALENESS: &str = "1s";

/// Any gateway, writable ones too, serves `VOLUME~STALENESS` as a stale-read attach:
/// read-only, no lease (the volume stays writable through the same gateway), and a
/// bound that is not a duration is refused by name.
#[test]
fn an_export_name_with_a_staleness_reads_from_any_gateway_read_only() {
    let dir = TestDir::new();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    qemu_io(&uri, &["write -P 0x5a 0 1M"]);
    let stale = format!("{uri}~2s");
    assert!(
        read_byte(&stale, 4096).contains("5a"),
        "{stale} does not read the volume"
    );
    // The volume is still writable (the stale attach took no lease), and the stale
    // export reads the new bytes once their acknowledgement is further back than
    // the bound.
    qemu_io(&uri, &["write -P 0x6b 0 4k"]);
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        read_byte(&stale, 0).contains("6b"),
        "{stale} reads an old block"
    );
    let write = output(Command::new("qemu-io").args(["-f", "raw", "-c", "write 0 4k", &stale]));
    assert!(
        text(&write).contains("failed"),
        "{stale} took a write:\n{}",
        text(&write)
    );
    let bad = output(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read 0 4k",
        &format!("{uri}~soon"),
    ]));
    assert!(
        !bad.status.success() && text(&bad).contains("not a duration"),
        "a bad staleness was not refused clearly:\n{}",
        text(&bad)
    );
}

#[test]
fn stale_reads_stay_within_the_bound_and_monotonic_through_a_pause_and_a_kill() {
    let dir = TestDir::new();
    let cluster = Cluster::start(dir.path());
    let stale = Gateway::start_with(
        &cluster.info.master,
        &dir.path().join("stale-gateway.log"),
        &["--read-only", "--staleness", STALENESS],
    );
    let client = Command::new("/usr/bin/python3")
        .arg(CLIENT)
        .arg(cluster.uri())
        .arg(&stale.uri)
        .arg(SECONDS.to_string())
        .arg(STALENESS.trim_end_matches('s'))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let servers = &cluster.info.chunkserver_pids;
    std::thread::sleep(Duration::from_secs(4));
    signal(servers[1], libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(6));
    signal(servers[1], libc::SIGCONT);
    std::thread::sleep(Duration::from_secs(4));
    signal(servers[2], libc::SIGKILL);
    let out = client.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let result: serde_json::Value = serde_json::from_str(line)
        .unwrap_or_else(|_| panic!("stale_client.py printed no summary: {}", text(&out)));
    assert_eq!(result["error_count"], 0, "{result}");
    assert!(
        result["writes"].as_u64() > Some(100) && result["reads"].as_u64() > Some(100),
        "too little ran to tell: {result}"
    );
    eprintln!("stale reads with --staleness {STALENESS}: {result}");
}
