//! Hybrid mode (journals on ssds in front of hdd chunk servers): kill -9 of an hdd
//! chunk server while its journal replays, and while its journals overflow; large
//! writes that bypass the journal must supersede older small writes on the hdd.

use crate::cluster::{free_ports, nbdsh, ok, Cluster, FLOE};
use crate::io_helpers::kill9;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BLOCK: u64 = 4096;
/// The demo volume's layout and id (see crash.rs).
const UNIT: u64 = 64 << 10;
const COUNT: u64 = 4;
const VOLUME_ID: u64 = 1;
/// Writes the writer keeps in flight.
const DEPTH: u32 = 32;
/// Acknowledged writes after which the writer says `started`.
const STARTED: u32 = 100;

/// (chunk index, offset in the chunk) of a volume offset in the first object set.
fn locate(offset: u64) -> (u64, u64) {
    let stripe = offset / UNIT;
    (stripe % COUNT, (stripe / COUNT) * UNIT + offset % UNIT)
}

/// An nbdsh script that writes `count` random 4 KiB blocks in the first `region`
/// bytes, [`DEPTH`] in flight (so they outrun the emulated hdd's replay), never two at
/// once to one block. It prints `started` once [`STARTED`] writes are acknowledged,
/// and at the end the last content of every block written (all acknowledged by then).
fn small_writes_script(count: u32, region: u64, seed: u32) -> String {
    format!(
        "import random, sys\n\
         r = random.Random({seed})\n\
         last = {{}}\n\
         pending = {{}}\n\
         def settle(cookie):\n    \
             while not h.aio_command_completed(cookie):\n        \
                 h.poll(-1)\n\
         for i in range({count}):\n    \
             if i == {STARTED} + {DEPTH}:\n        \
                 print('started', flush=True)\n    \
             b = r.randrange({blocks})\n    \
             v = (i % 251) + 1\n    \
             if b in pending:\n        \
                 settle(pending.pop(b))\n    \
             while len(pending) >= {DEPTH}:\n        \
                 settle(pending.pop(next(iter(pending))))\n    \
             buf = nbd.Buffer.from_bytearray(bytearray([v]) * {BLOCK})\n    \
             pending[b] = h.aio_pwrite(buf, b * {BLOCK})\n    \
             last[b] = v\n\
         for cookie in pending.values():\n    \
             settle(cookie)\n\
         print(' '.join(f'{{b}}:{{v}}' for b, v in last.items()))\n",
        blocks = region / BLOCK
    )
}

/// The `block:value` pairs a writer printed last.
fn parse_written(line: &str) -> BTreeMap<u64, u8> {
    line.split_whitespace()
        .map(|pair| {
            let (b, v) = pair.split_once(':').expect("block:value");
            (b.parse().unwrap(), v.parse().unwrap())
        })
        .collect()
}

/// Runs the writer of [`small_writes_script`] to the end.
fn small_writes(uri: &str, count: u32, region: u64, seed: u32) -> BTreeMap<u64, u8> {
    let script = small_writes_script(count, region, seed);
    let out = ok(nbdsh().args(["-u", uri, "-c", &script]));
    parse_written(out.lines().last().unwrap_or_default())
}

/// Reads every block back through NBD and checks its content.
fn check_reads(uri: &str, expected: &BTreeMap<u64, u8>) {
    let list: Vec<String> = expected.iter().map(|(b, v)| format!("({b},{v})")).collect();
    let script = format!(
        "bad = [(b, v) for b, v in [{}] if h.pread({BLOCK}, b * {BLOCK}) != bytes([v]) * {BLOCK}]\n\
         print(len(bad), bad[:5])\n",
        list.join(",")
    );
    let out = ok(nbdsh().args(["-u", uri, "-c", &script]));
    assert!(
        out.starts_with("0 "),
        "acknowledged writes read back wrong: {out}"
    );
}

/// The hdd chunk server (demo index) holding the most chunks of the first object set.
fn busiest_hdd(cluster: &Cluster) -> usize {
    let mut held = BTreeMap::new();
    for (chunk, servers) in cluster.placement() {
        if chunk < COUNT {
            for s in servers.into_iter().filter(|s| s % 2 == 1) {
                *held.entry(s).or_insert(0) += 1;
            }
        }
    }
    *held
        .iter()
        .max_by_key(|(_, n)| **n)
        .expect("some hdd server holds a chunk")
        .0
}

/// Starts demo chunk server `n` (an hdd one) again with the demo's arguments.
fn restart_hdd(cluster: &Cluster, n: usize, extra: &[&str]) -> Child {
    let dir = &cluster.dir;
    let log = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join(format!("logs/chunkserver-{n}.log")))
        .unwrap();
    Command::new(FLOE)
        .args(["chunkserver", "--master", &cluster.info.master, "--dir"])
        .arg(dir.join(format!("cs-{n}")))
        .args([
            "--listen",
            &format!("127.0.0.1:{}", cluster.port + 1 + n as u16),
        ])
        .args(["--host", ["host-a", "host-b", "host-c"][n / 2]])
        .args(["--class", "hdd", "--journal"])
        .arg(dir.join(format!("cs-{}/hdd-journal", n - 1)))
        .args(extra)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("chunk server starts")
}

fn args(extra: &[&str]) -> Vec<String> {
    extra.iter().map(|a| a.to_string()).collect()
}

fn log_of(cluster: &Cluster, n: usize) -> String {
    std::fs::read_to_string(cluster.dir.join(format!("logs/chunkserver-{n}.log"))).unwrap()
}

/// Writes the first object set (64 MiB: every chunk, random 4 KiB blocks), then kills
/// -9 the hdd server holding most of it while a second writer runs (once `ready` holds
/// for its log), restarts it: every acknowledged write reads back, before and after
/// full redundancy, scrub is clean and the restarted server had journals to replay.
fn crash_and_check(cluster: &mut Cluster, extra: &[&str], seed: u32, ready: &str) {
    let region = 64 << 20;
    let mut expected = small_writes(cluster.uri(), 300, region, seed);
    let hdd = busiest_hdd(cluster);
    let script = small_writes_script(3000, region, seed + 1);
    let mut writer = KillOnDrop(
        nbdsh()
            .args(["-u", cluster.uri(), "-c", &script])
            .stdout(Stdio::piped())
            .spawn()
            .expect("nbdsh starts"),
    );
    let mut lines = BufReader::new(writer.0.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "started");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !log_of(cluster, hdd).contains(ready) {
        assert!(
            Instant::now() < deadline,
            "chunkserver-{hdd} never logged {ready:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        writer.0.try_wait().unwrap().is_none(),
        "the writer finished before the kill"
    );
    kill9(cluster.info.chunkserver_pids[hdd]);
    let last = lines.last().expect("the writer's summary").unwrap();
    assert!(writer.0.wait().unwrap().success(), "a write failed");
    expected.extend(parse_written(&last));
    check_reads(cluster.uri(), &expected);
    let mut restarted = KillOnDrop(restart_hdd(cluster, hdd, extra));
    cluster.wait_for_redundancy(Duration::from_secs(240));
    check_reads(cluster.uri(), &expected);
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "scrub: {scrub}");
    let log = log_of(cluster, hdd);
    assert!(
        log.contains("scanned the journals; replay resumes"),
        "the restarted chunkserver-{hdd} found nothing to replay; its log:\n{log}"
    );
    restarted.0.kill().unwrap();
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn hybrid_kill_during_replay_loses_nothing() {
    let work = tempfile::tempdir().unwrap();
    let extra = ["--emulate-hdd"];
    let mut cluster = Cluster::start_with(work.path(), free_ports(), None, args(&extra));
    let status = cluster.floe(&["status"]);
    assert!(status.contains("hdd (emulated)"), "status: {status}");
    // Any line: the writer is 100 writes in, the journals hold what replay has not done.
    crash_and_check(&mut cluster, &extra, 1, "");
    cluster.stop();
}

#[test]
fn hybrid_kill_during_journal_overflow_loses_nothing() {
    let work = tempfile::tempdir().unwrap();
    let extra = ["--emulate-hdd", "--journal-quota", "256K"];
    let mut cluster = Cluster::start_with(work.path(), free_ports(), None, args(&extra));
    crash_and_check(&mut cluster, &extra, 3, "journal overflow");
    cluster.stop();
}

#[test]
fn hybrid_large_writes_supersede_journaled_small_writes() {
    let work = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::start_with(work.path(), free_ports(), None, Vec::new());
    // Small writes (journaled on hdd replicas) over the first 1 MiB, then one 8 MiB
    // write over them (2 MiB per chunk: it bypasses the journal, even a roomy one).
    let small = small_writes(cluster.uri(), 200, 1 << 20, 5);
    assert!(!small.is_empty());
    ok(nbdsh().args([
        "-u",
        cluster.uri(),
        "-c",
        &format!("h.pwrite(b'\\xee' * {}, 0)", 8 << 20),
    ]));
    let large: BTreeMap<u64, u8> = (0..(1 << 20) / BLOCK).map(|b| (b, 0xee)).collect();
    check_reads(cluster.uri(), &large);
    // Every replica (hdd ones read journal pieces + chunk file) agrees.
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "scrub: {scrub}");
    // After replay (and a clean stop) the hdd chunk files themselves hold the large
    // write: older journaled writes did not resurface.
    std::thread::sleep(Duration::from_secs(2));
    let placement = cluster.placement();
    cluster.stop();
    let mut checked = 0;
    for (chunk, servers) in placement.iter().filter(|(c, _)| **c < COUNT) {
        for server in servers.iter().filter(|s| *s % 2 == 1) {
            let path = work
                .path()
                .join(format!("cs-{server}/chunks/{VOLUME_ID:016x}/{chunk:016x}"));
            let file = std::fs::File::open(&path).unwrap();
            for block in 0..(1 << 20) / BLOCK {
                let (c, offset) = locate(block * BLOCK);
                if c != *chunk {
                    continue;
                }
                let mut data = vec![0u8; BLOCK as usize];
                file.read_exact_at(&mut data, offset).unwrap();
                assert!(
                    data.iter().all(|&b| b == 0xee),
                    "{} block {block}: stale journaled data",
                    path.display()
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "no hdd replica in the first object set");
}
