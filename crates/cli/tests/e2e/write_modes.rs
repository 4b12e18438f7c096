//! Write modes: a flush-epoch volume (Blizzard 2.5.2) acknowledges writes at once, and
//! a crash leaves a prefix of the epochs between FLUSHes: all of them up to some R, part
//! of R+1, nothing later; every acknowledged FUA write survives. A log-commit volume
//! (2.5.3) acknowledges and issues writes at once, and a crash leaves a prefix of the
//! writes in acknowledgement order (so of the epochs too), with every FUA write.
//!
//! Each round an nbdsh writer (epoch_client.py) writes random blocks of its own region
//! in epochs, FLUSHes between them, and logs every write it sends and its ack. At a
//! random moment the round kills (kill -9), chosen at random per round (the first three
//! rounds take each kind once, in a random order):
//! - the gateway;
//! - the gateway and one to six chunk servers, in a random order, which are then
//!   started again on their data directories while the master runs on;
//! - every process of the cluster (master, chunk servers, gateway), which starts again
//!   on the same directories.
//!
//! A fresh gateway then reads the region back and the ledger is checked. The volume is
//! rate-limited below the client's pace, so many epochs are unretired at each kill.
//! `FLOE_EPOCH_ROUNDS` sets the rounds (default 6 for flush-epoch, about a minute, and
//! 3 for log-commit); `FLOE_EPOCH_SEED` replays a run's choices (kinds, victims,
//! delays, the writers' blocks), not their timing. The long run (about 75 minutes
//! here; at most 1024 rounds fit the volume):
//!
//! ```sh
//! FLOE_EPOCH_ROUNDS=500 cargo test -p floe-cli --test e2e write_modes::a_flush_epoch_volume_keeps -- --nocapture
//! FLOE_EPOCH_ROUNDS=500 cargo test -p floe-cli --test e2e write_modes::a_log_commit_volume_keeps -- --nocapture
//! ```
//!
//! Also here: a connection opening the volume while the gateway still drains a closed
//! one's writes must not lose them; a log-commit volume is chosen at create only, and
//! at most 64 GiB. ext4 on a flush-epoch volume across a gateway kill:
//! write_modes_ext4.rs; full disks under a flush-epoch volume: full_disk.rs.

use crate::cluster::{free_ports, nbdsh, output, Cluster, TestDir};
use crate::io_helpers::kill9;
use crate::servers::{Servers, CHUNK_SERVERS, RESTART_LIMIT};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/epoch_client.py");
const FLOE: &str = env!("CARGO_BIN_EXE_floe");
/// Blocks of 4 KiB each round writes: few, so epochs overwrite each other's blocks.
const REGION_BLOCKS: u64 = 256;
/// The demo volume (`Cluster` makes it 1 GiB): the regions of all rounds fit in it.
const VOLUME_BLOCKS: u64 = (1 << 30) / 4096;
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
fn ledger(path: &Path) -> BTreeMap<u64, Vec<Write>> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out: BTreeMap<u64, Vec<Write>> = BTreeMap::new();
    let mut blocks = BTreeMap::new();
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
fn read_region(uri: &str, first: u64) -> BTreeMap<u64, (u64, u64)> {
    let out = run_client(client(uri, "read", first));
    let mut held = BTreeMap::new();
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
fn prefix(writes: &BTreeMap<u64, Vec<Write>>, held: &BTreeMap<u64, (u64, u64)>) -> Option<i64> {
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

/// The largest S for which every block of the region holds the last write sent to it
/// with a sequence number up to S (or nothing, if none): a prefix of the writes in
/// the order they were acknowledged (the writer has one in flight at a time); `None`
/// if there is none.
fn sequence_prefix(
    writes: &BTreeMap<u64, Vec<Write>>,
    held: &BTreeMap<u64, (u64, u64)>,
) -> Option<u64> {
    let last = writes.values().flatten().map(|w| w.seq).max()?;
    (0..=last).rev().find(|&s| {
        writes.iter().all(|(block, ws)| {
            let expected = ws.iter().rfind(|w| w.seq <= s).map(|w| w.seq);
            held.get(block).map(|h| h.1) == expected
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

/// A gateway the test started, stopped by its PID.
pub struct Gateway {
    pub child: Child,
    pub uri: String,
}

impl Gateway {
    /// `floe gateway` on a port of its own, logging to `log`; returns once it listens.
    pub fn start(master: &str, log: &Path) -> Gateway {
        // Below the default: the writer meets back-pressure sooner.
        Gateway::start_with(master, log, &["--unretired-limit", "16M"])
    }

    /// [`Gateway::start`] with `args` for `floe gateway`.
    pub fn start_with(master: &str, log: &Path, args: &[&str]) -> Gateway {
        let listen = format!("127.0.0.1:{}", free_ports());
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(FLOE)
            .args(["--master", master, "gateway", "--listen", &listen])
            .args(args)
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

/// What a round kills (kill -9).
#[derive(Debug, Clone)]
enum Kill {
    Gateway,
    /// The gateway and these chunk servers (demo indexes), which start again.
    GatewayAndServers(Vec<usize>),
    /// Master, chunk servers and gateway; the whole cluster starts again.
    Everything,
}

impl Kill {
    /// `first`: a random order of the three kinds, which the first three rounds take,
    /// so that even a short run has each; later rounds draw a kind at random.
    fn pick(round: u64, first: &[u8; 3], rng: &mut StdRng) -> Kill {
        let kind = match first.get(round as usize) {
            Some(&kind) => kind,
            None => rng.gen_range(0..3),
        };
        match kind {
            0 => Kill::Gateway,
            1 => {
                let mut servers: Vec<usize> = (0..CHUNK_SERVERS).collect();
                servers.shuffle(rng);
                servers.truncate(rng.gen_range(1..=CHUNK_SERVERS));
                servers.sort_unstable();
                Kill::GatewayAndServers(servers)
            }
            _ => Kill::Everything,
        }
    }
}

/// Kills `pids` in a random order, a random few milliseconds apart (up to `gap_ms`).
fn kill_all(pids: &mut [u32], gap_ms: u64, rng: &mut StdRng) {
    pids.shuffle(rng);
    for pid in pids.iter() {
        kill9(*pid);
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..=gap_ms)));
    }
}

#[test]
fn a_flush_epoch_volume_keeps_a_prefix_of_its_epochs_across_kills() {
    a_volume_keeps_a_prefix_across_kills("flush-epoch", 6);
}

/// As flush-epoch, and the prefix is one of the writes in acknowledgement order, not
/// only of the epochs. Also: the mode is chosen at create, not switched to or from,
/// and a log-commit volume is at most 64 GiB.
#[test]
fn a_log_commit_volume_keeps_a_prefix_of_its_writes_across_kills() {
    a_volume_keeps_a_prefix_across_kills("log-commit", 3);
}

fn refused(master: &str, args: &[&str]) -> String {
    let out = output(Command::new(FLOE).args(["--master", master]).args(args));
    assert!(!out.status.success(), "floe {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn a_volume_keeps_a_prefix_across_kills(write_mode: &str, default_rounds: u64) {
    let dir = TestDir::new();
    let args = vec!["--write-mode".to_string(), write_mode.to_string()];
    let mut cluster = Cluster::start_with(dir.path(), free_ports(), None, args);
    let info = cluster.floe(&["volume", "info", "demo"]);
    assert!(
        info.contains(&format!("write mode:    {write_mode}")),
        "{info}"
    );
    let master = cluster.info.master.clone();
    let stderr = refused(
        &master,
        &["volume", "set-write-mode", "demo", "write-sometimes"],
    );
    assert!(
        stderr.contains("write-through, write-back, flush-epoch, log-commit"),
        "{stderr}"
    );
    let log_commit = write_mode == "log-commit";
    if log_commit {
        let stderr = refused(
            &master,
            &["volume", "set-write-mode", "demo", "flush-epoch"],
        );
        assert!(stderr.contains("chosen at create"), "{stderr}");
        let stderr = refused(&master, &["volume", "resize", "demo", "--size", "2G"]);
        assert!(stderr.contains("resizing is not supported"), "{stderr}");
        let list = cluster.floe(&["volume", "list"]);
        assert!(list.contains("log-commit"), "{list}");
    } else {
        let stderr = refused(&master, &["volume", "set-write-mode", "demo", "log-commit"]);
        assert!(stderr.contains("chosen at create"), "{stderr}");
    }
    let stderr = refused(
        &master,
        &[
            "volume",
            "create",
            "huge",
            "--size",
            "65G",
            "--write-mode",
            "log-commit",
        ],
    );
    assert!(stderr.contains("at most 64 GiB"), "{stderr}");

    // The replicas take writes slower than the client acknowledges them, so a kill
    // finds many epochs unretired: an order broken anywhere shows.
    cluster.floe(&["volume", "set-qos", "demo", "--iops", "150"]);

    let rounds: u64 =
        std::env::var("FLOE_EPOCH_ROUNDS").map_or(default_rounds, |r| r.parse().unwrap());
    assert!(
        rounds * REGION_BLOCKS <= VOLUME_BLOCKS,
        "at most {} rounds fit the volume",
        VOLUME_BLOCKS / REGION_BLOCKS
    );
    let seed: u64 =
        std::env::var("FLOE_EPOCH_SEED").map_or_else(|_| rand::random(), |s| s.parse().unwrap());
    eprintln!("{write_mode}: seed {seed} (FLOE_EPOCH_SEED replays), {rounds} rounds");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut first_kinds = [0, 1, 2];
    first_kinds.shuffle(&mut rng);
    let mut servers = Servers::of(&cluster);
    let mut uri = cluster.uri().to_string();
    let mut victim = cluster.info.gateway_pid;
    let mut gateway: Option<Gateway> = None;
    let mut kinds = [0; 3];
    let started = Instant::now();
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
        let kill = Kill::pick(round, &first_kinds, &mut rng);
        // The gateway that reads the region back: (its URI, its PID, the test's
        // handle on it unless the demo started it).
        let (next_uri, next_pid, next) = match &kill {
            Kill::Gateway => {
                kinds[0] += 1;
                kill9(victim);
                let _ = finish(writer);
                drop(gateway.take());
                let next = Gateway::start(
                    &cluster.info.master,
                    &dir.path().join(format!("gateway-{round}.log")),
                );
                (next.uri.clone(), next.child.id(), Some(next))
            }
            Kill::GatewayAndServers(killed) => {
                kinds[1] += 1;
                // Servers may die before the gateway: it then runs on without them
                // for a moment, its changes committing on majorities or waiting.
                let mut pids: Vec<u32> = killed.iter().map(|&n| servers.pids[n]).collect();
                pids.push(victim);
                kill_all(&mut pids, 300, &mut rng);
                let _ = finish(writer);
                drop(gateway.take());
                for &n in killed {
                    servers.restart(n);
                }
                for &n in killed {
                    servers.wait_listening(n);
                }
                cluster.wait_for_status(
                    &format!("{CHUNK_SERVERS}/{CHUNK_SERVERS} chunk servers up"),
                    RESTART_LIMIT,
                );
                let next = Gateway::start(
                    &cluster.info.master,
                    &dir.path().join(format!("gateway-{round}.log")),
                );
                (next.uri.clone(), next.child.id(), Some(next))
            }
            Kill::Everything => {
                kinds[2] += 1;
                let mut pids = servers.pids.clone();
                pids.extend([cluster.info.master_pid, victim]);
                kill_all(&mut pids, 50, &mut rng);
                let _ = finish(writer);
                drop(gateway.take());
                for n in 0..CHUNK_SERVERS {
                    servers.reap(n);
                }
                // The demo reaps its dead children and exits; started again on the
                // same directories it runs every process anew, a gateway among them.
                cluster.stop();
                cluster.start_again();
                servers.pids = cluster.info.chunkserver_pids.clone();
                (cluster.uri().to_string(), cluster.info.gateway_pid, None)
            }
        };
        let held = read_region(&next_uri, first);
        let writes = ledger(&ledger_path);
        let acknowledged = writes.values().flatten().filter(|w| w.acknowledged).count();
        let r = prefix(&writes, &held).unwrap_or_else(|| {
            panic!("round {round} (killed {kill:?}): the region holds no prefix of the epochs\nledger {writes:?}\nheld {held:?}")
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
        if log_commit {
            sequence_prefix(&writes, &held).unwrap_or_else(|| {
                panic!("round {round} (killed {kill:?}): the region holds no prefix of the writes\nledger {writes:?}\nheld {held:?}")
            });
        }
        // Acknowledged writes the kill lost: their block holds an older write.
        let lost = writes
            .iter()
            .flat_map(|(block, ws)| {
                let held = held.get(block).map(|h| h.1);
                ws.iter()
                    .filter(move |w| w.acknowledged && held < Some(w.seq))
            })
            .count();
        eprintln!(
            "round {round}: killed {kill:?}: {acknowledged} writes in {} epochs acknowledged; epochs 0..={r} whole after the kill, {lost} acknowledged writes lost ({:.0?} so far)",
            epochs + 1,
            started.elapsed()
        );
        uri = next_uri;
        victim = next_pid;
        gateway = next;
    }
    eprintln!(
        "{write_mode}: seed {seed}, {rounds} rounds in {:.0?}: {} killed the gateway, {} the gateway and chunk servers, {} every process",
        started.elapsed(),
        kinds[0],
        kinds[1],
        kinds[2]
    );
}

/// A gateway whose last connection to a flush-epoch volume closed goes on sending that
/// connection's acknowledged writes to the replicas. A connection that opens the volume
/// meanwhile must not lose them: here the first connection writes 48 MiB (acknowledged
/// at once, the volume rate-limited so that they take seconds to drain) and closes, a
/// second opens and closes the volume at once (nbdinfo), the gateway is stopped
/// (SIGTERM: it exits once every layer drained), and a new one reads the blocks back.
///
/// Failed before the fix: the second open made a new layer under a new lease
/// generation (same holder), which fenced the draining layer; its writes failed,
/// logged only ("an acknowledged write failed; the next FLUSH reports it: ... lease
/// generation N was superseded"), and no FLUSH ever reported them.
#[test]
fn a_flush_epoch_volume_reopened_while_it_drains_keeps_its_acknowledged_writes() {
    const MIB: u64 = 1 << 20;
    const FIRST: u64 = 512;
    const COUNT: u64 = 48;
    let dir = tempfile::tempdir().unwrap();
    let args = vec!["--write-mode".to_string(), "flush-epoch".to_string()];
    let cluster = Cluster::start_with(dir.path(), free_ports(), None, args);
    cluster.floe(&["volume", "set-qos", "demo", "--bandwidth", "8M"]);
    let mut gateway = Gateway::start(&cluster.info.master, &dir.path().join("gateway-1.log"));
    let write = format!(
        "for i in range({FIRST}, {FIRST} + {COUNT}):\n    h.pwrite(bytes([0x5e]) * {MIB}, i * {MIB})\nh.flush()"
    );
    let out = output(nbdsh().args(["-u", &gateway.uri, "-c", &write]));
    assert!(out.status.success(), "writer: {out:?}");
    let out = output(Command::new("nbdinfo").arg(&gateway.uri));
    assert!(out.status.success(), "nbdinfo: {out:?}");
    // SAFETY: kill(2) on the gateway this test started.
    unsafe { libc::kill(gateway.child.id() as i32, libc::SIGTERM) };
    let status = gateway.child.wait().unwrap();
    assert!(status.success(), "the gateway stopped uncleanly: {status}");
    drop(gateway);

    cluster.floe(&["volume", "set-qos", "demo", "--bandwidth", "0"]);
    let reader = Gateway::start(&cluster.info.master, &dir.path().join("gateway-2.log"));
    let read = format!(
        "print(sum(h.pread({MIB}, i * {MIB}) != bytes([0x5e]) * {MIB} for i in range({FIRST}, {FIRST} + {COUNT})))"
    );
    let out = output(nbdsh().args(["-u", &reader.uri, "-c", &read]));
    assert!(out.status.success(), "reader: {out:?}");
    let lost: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let log = std::fs::read_to_string(dir.path().join("gateway-1.log")).unwrap_or_default();
    let failed = log.matches("an acknowledged write failed").count();
    assert_eq!(
        lost, 0,
        "{lost} of {COUNT} acknowledged MiB lost; the first gateway logged {failed} failed acknowledged writes"
    );
}
