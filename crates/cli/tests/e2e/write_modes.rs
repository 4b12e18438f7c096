//! Write modes: a flush-epoch volume (Blizzard 2.5.2) acknowledges writes at once, and
//! a kill -9 of its gateway leaves a prefix of the epochs between FLUSHes: all of them
//! up to some R, part of R+1, nothing later; every acknowledged FUA write survives.
//!
//! Each round an nbdsh writer (epoch_client.py) writes random blocks of its own region
//! in epochs, FLUSHes between them, and logs every write it sends and its ack; the gateway is
//! killed at a random moment; a new gateway reads the region back and the ledger is
//! checked. The volume is rate-limited below the client's pace, so many epochs are
//! unretired at each kill. `FLOE_EPOCH_ROUNDS` sets the rounds (default 4),
//! `FLOE_EPOCH_SEED` replays.

use crate::cluster::{free_ports, nbdsh, output, Cluster};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/epoch_client.py");
const FLOE: &str = env!("CARGO_BIN_EXE_floe");
/// Blocks of 4 KiB each round writes: few, so epochs overwrite each other's blocks.
const REGION_BLOCKS: u64 = 256;
const CLIENT_LIMIT: Duration = Duration::from_secs(120);

/// A write the client sent, from the ledger.
#[derive(Debug, Clone, Copy)]
struct Write {
    epoch: u64,
    seq: u64,
    fua: bool,
    acknowledged: bool,
}

/// The writes sent to each block, in order. A torn last line was never acted on.
fn ledger(path: &Path) -> HashMap<u64, Vec<Write>> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out: HashMap<u64, Vec<Write>> = HashMap::new();
    let mut blocks = HashMap::new();
    for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
        let f: Vec<&str> = line.trim_end().split(' ').collect();
        let n = |i: usize| f[i].parse::<u64>().unwrap();
        match f[0] {
            "w" => {
                blocks.insert(n(2), n(3));
                out.entry(n(3)).or_default().push(Write {
                    epoch: n(1),
                    seq: n(2),
                    fua: n(4) == 1,
                    acknowledged: false,
                });
            }
            _ => {
                let block = blocks[&n(1)];
                let write = out.get_mut(&block).and_then(|ws| ws.last_mut()).unwrap();
                assert_eq!(write.seq, n(1), "one write in flight at a time");
                write.acknowledged = true;
            }
        }
    }
    out
}

/// What the region holds: block -> (epoch, seq) of the write there.
fn read_region(uri: &str, first: u64) -> HashMap<u64, (u64, u64)> {
    let out = run_client(client(uri, "read", first));
    let mut held = HashMap::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        assert_eq!(f.len(), 3, "block {} is {}", f[0], f[1]);
        held.insert(
            f[0].parse().unwrap(),
            (f[1].parse().unwrap(), f[2].parse().unwrap()),
        );
    }
    held
}

/// The largest R for which the region holds a prefix of the epochs: every block the
/// last write it had in epochs up to R, or one of its writes in epoch R + 1; `None` if
/// there is none.
fn prefix(writes: &HashMap<u64, Vec<Write>>, held: &HashMap<u64, (u64, u64)>) -> Option<i64> {
    let last_epoch = writes.values().flatten().map(|w| w.epoch).max()? as i64;
    (-1..=last_epoch).rev().find(|&r| {
        let in_prefix = |w: &&Write| (w.epoch as i64) <= r;
        let next = |w: &&Write| w.epoch as i64 == r + 1;
        writes.iter().all(|(block, ws)| {
            let held = held.get(block).map(|h| h.1);
            let last = ws.iter().rfind(in_prefix).map(|w| w.seq);
            held == last || ws.iter().filter(next).any(|w| Some(w.seq) == held)
        }) && held.keys().all(|block| writes.contains_key(block))
    })
}

fn client(uri: &str, mode: &str, first: u64) -> Command {
    let mut command = nbdsh();
    command
        .args(["-u", uri, "-c"])
        .arg(format!("exec(open({CLIENT:?}).read())"))
        .env("FLOE_EPOCH_MODE", mode)
        .env("FLOE_EPOCH_FIRST_BLOCK", first.to_string())
        .env("FLOE_EPOCH_BLOCKS", REGION_BLOCKS.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    command
}

/// Runs a client to its end (killed past [`CLIENT_LIMIT`]); its stdout.
fn run_client(mut command: Command) -> String {
    let child = command.spawn().expect("nbdsh starts");
    let out = finish(child);
    assert!(out.status.success(), "{CLIENT} failed: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn finish(mut child: Child) -> std::process::Output {
    let deadline = Instant::now() + CLIENT_LIMIT;
    while matches!(child.try_wait(), Ok(None)) {
        if Instant::now() > deadline {
            // SAFETY: kill(2) on our own child's process group.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn kill9(pid: u32) {
    // SAFETY: kill(2) on a process this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
}

/// A gateway the test started, stopped by its PID.
struct Gateway {
    child: Child,
    uri: String,
}

impl Gateway {
    fn start(master: &str, log: &Path) -> Gateway {
        let listen = format!("127.0.0.1:{}", free_ports());
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(FLOE)
            .args(["--master", master, "gateway", "--listen", &listen])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("floe gateway starts");
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(&listen).is_err() {
            assert!(Instant::now() < deadline, "gateway {listen} never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        Gateway {
            child,
            uri: format!("nbd://{listen}/demo"),
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_flush_epoch_volume_keeps_a_prefix_of_its_epochs_when_its_gateway_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let args = vec!["--write-mode".to_string(), "flush-epoch".to_string()];
    let cluster = Cluster::start_with(dir.path(), free_ports(), None, args);
    let info = cluster.floe(&["volume", "info", "demo"]);
    assert!(info.contains("write mode:    flush-epoch"), "{info}");
    let bad = output(Command::new(FLOE).args([
        "--master",
        &cluster.info.master,
        "volume",
        "set-write-mode",
        "demo",
        "write-sometimes",
    ]));
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("write-through, write-back, flush-epoch"),
        "{stderr}"
    );

    // The replicas take writes slower than the client acknowledges them, so a kill
    // finds many epochs unretired: an order broken anywhere shows.
    cluster.floe(&["volume", "set-qos", "demo", "--iops", "150"]);

    let rounds: u64 = std::env::var("FLOE_EPOCH_ROUNDS").map_or(4, |r| r.parse().unwrap());
    let seed: u64 =
        std::env::var("FLOE_EPOCH_SEED").map_or_else(|_| rand::random(), |s| s.parse().unwrap());
    eprintln!("write modes: seed {seed} (FLOE_EPOCH_SEED replays), {rounds} rounds");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut uri = cluster.uri().to_string();
    let mut victim = cluster.info.gateway_pid;
    let mut gateway: Option<Gateway> = None;
    for round in 0..rounds {
        let first = round * REGION_BLOCKS;
        let ledger_path = dir.path().join(format!("epochs-{round}.ledger"));
        let mut writer = client(&uri, "write", first);
        writer
            .env("FLOE_EPOCH_LEDGER", &ledger_path)
            .env("FLOE_EPOCH_SEED", rng.gen::<u64>().to_string());
        let mut writer = writer.spawn().expect("nbdsh starts");
        // The kill lands once writes flow, at a random moment.
        let deadline = Instant::now() + CLIENT_LIMIT;
        let acked = |path: &Path| ledger(path).values().flatten().any(|w| w.acknowledged);
        while !acked(&ledger_path) {
            if !matches!(writer.try_wait(), Ok(None)) || Instant::now() > deadline {
                panic!("no write acknowledged: {:?}", finish(writer));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(rng.gen_range(100..2_500)));
        kill9(victim);
        let _ = finish(writer);
        drop(gateway.take());

        let next = Gateway::start(
            &cluster.info.master,
            &dir.path().join(format!("gateway-{round}.log")),
        );
        let held = read_region(&next.uri, first);
        let writes = ledger(&ledger_path);
        let acknowledged = writes.values().flatten().filter(|w| w.acknowledged).count();
        let r = prefix(&writes, &held).unwrap_or_else(|| {
            panic!("round {round}: the region holds no prefix of the epochs\nledger {writes:?}\nheld {held:?}")
        });
        // A FUA write was durable before its reply, after every epoch before its own.
        for (block, ws) in &writes {
            for fua in ws.iter().filter(|w| w.fua && w.acknowledged) {
                assert!(r + 1 >= fua.epoch as i64, "round {round}: FUA write {fua:?} of block {block} acknowledged, yet the prefix ends at epoch {r}");
                let held = held.get(block).expect("a FUA write's block holds a write");
                assert!(
                    held.1 >= fua.seq,
                    "round {round}: block {block} lost its FUA write {fua:?}"
                );
            }
        }
        let epochs = writes.values().flatten().map(|w| w.epoch).max().unwrap();
        eprintln!(
            "round {round}: {acknowledged} writes in {} epochs acknowledged; epochs 0..={r} whole after the kill",
            epochs + 1
        );
        uri = next.uri.clone();
        victim = next.child.id();
        gateway = Some(next);
    }
}
