//! Crash durability: under a real NBD client's writes (libnbd via nbdsh, see
//! crash_client.py), kill -9 chunk servers or the gateway at random moments, restart
//! the cluster, and prove that no acknowledged write was lost, that no write is torn,
//! and that the three replicas of every chunk agree on acknowledged data on disk.
//!
//! Run on a write-through volume and on a write-back one. `FLOE_CRASH_ROUNDS` sets the
//! number of rounds (default 6, write-back 3); `FLOE_CRASH_SEED` replays a run's
//! choices (victims, delays, blocks, content).

use crate::cluster::{free_ports, nbdsh, ok, Cluster, DemoFile};
use crate::io_helpers::kill9;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/crash_client.py");
/// Where the ledger writers' shared module (ledger_content.py) lives: their PYTHONPATH.
pub const SCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e");
const BLOCK: u64 = 4096;
/// Writes land in the first 300 MiB: all of the first object set, part of the second.
const REGION_BLOCKS: u64 = (300 << 20) / BLOCK;
/// The demo volume's layout and id.
const UNIT: u64 = 64 << 10;
const COUNT: u64 = 4;
const CHUNK: u64 = 64 << 20;
const VOLUME_ID: u64 = 1;
const CHUNK_SERVERS: usize = 6;
/// After a kill the writer goes on (writes commit on the surviving majority) for a
/// random time, then is told to stop. Where no majority survives its writes wait for
/// one; past this it is hung, and is killed too.
const WRITER_EXIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the cluster may take back to full redundancy after a restart.
const REDUNDANCY_TIMEOUT: Duration = Duration::from_secs(240);
const FIRST_ACK_TIMEOUT: Duration = Duration::from_secs(60);

/// Mirror of `Content` in crash_client.py: magic, round, block, then a key-dependent
/// slice of a seeded splitmix64 pool XORed with the key.
struct Content {
    seed: u64,
    pool: Vec<u8>,
}

const MAGIC: u32 = 0x464C_4352;
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const POOL_WORDS: u64 = 2048;
const POOL_STARTS: u64 = 1536;

fn mix(x: u64) -> u64 {
    let mut x = x.wrapping_add(GOLDEN);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Content {
    fn new(seed: u64) -> Content {
        let pool = (0..POOL_WORDS)
            .flat_map(|i| mix(seed.wrapping_add(i.wrapping_mul(GOLDEN))).to_le_bytes())
            .collect();
        Content { seed, pool }
    }

    fn block(&self, round: u32, block: u64) -> Vec<u8> {
        let k = mix(self.seed ^ mix((u64::from(round) << 32) | block));
        let start = (k % POOL_STARTS) as usize * 8;
        let mut out = Vec::with_capacity(BLOCK as usize);
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&round.to_le_bytes());
        out.extend_from_slice(&block.to_le_bytes());
        for word in self.pool[start..start + BLOCK as usize - 16].chunks_exact(8) {
            let word = u64::from_le_bytes(word.try_into().unwrap()) ^ k;
            out.extend_from_slice(&word.to_le_bytes());
        }
        out
    }
}

/// Chunk index and offset in it of volume byte `offset` (the striping formula).
fn locate(offset: u64) -> (u64, u64) {
    let unit_index = offset / UNIT;
    let within = offset % UNIT;
    let stripe = unit_index / COUNT;
    let chunk_in_set = unit_index % COUNT;
    let units_per_chunk = CHUNK / UNIT;
    let set = stripe / units_per_chunk;
    (
        set * COUNT + chunk_in_set,
        (stripe % units_per_chunk) * UNIT + within,
    )
}

/// cs-0/1 are host-a, cs-2/3 host-b, cs-4/5 host-c.
fn host_of(server: usize) -> usize {
    server / 2
}

/// What one round kills.
#[derive(Debug, Clone, Copy)]
enum Victims {
    ChunkServer(usize),
    /// Two chunk servers on different hosts: some chunks keep a single live replica.
    TwoChunkServers(usize, usize),
    Gateway,
}

impl Victims {
    /// Every kind comes round in turn; which server is random.
    fn pick(round: u32, rng: &mut StdRng) -> Victims {
        match round % 3 {
            0 => Victims::ChunkServer(rng.gen_range(0..CHUNK_SERVERS)),
            1 => {
                let first = rng.gen_range(0..CHUNK_SERVERS);
                let second = loop {
                    let s = rng.gen_range(0..CHUNK_SERVERS);
                    if host_of(s) != host_of(first) {
                        break s;
                    }
                };
                Victims::TwoChunkServers(first, second)
            }
            _ => Victims::Gateway,
        }
    }

    fn chunk_servers(self) -> Vec<usize> {
        match self {
            Victims::ChunkServer(a) => vec![a],
            Victims::TwoChunkServers(a, b) => vec![a, b],
            Victims::Gateway => vec![],
        }
    }

    fn pids(self, info: &DemoFile) -> Vec<u32> {
        match self {
            Victims::ChunkServer(a) => vec![info.chunkserver_pids[a]],
            Victims::TwoChunkServers(a, b) => {
                vec![info.chunkserver_pids[a], info.chunkserver_pids[b]]
            }
            Victims::Gateway => vec![info.gateway_pid],
        }
    }
}

/// Every process of the cluster is running (the restart brought back the victims).
fn assert_all_alive(info: &DemoFile) {
    let pids = [info.master_pid, info.gateway_pid];
    for pid in pids.iter().chain(&info.chunkserver_pids) {
        // SAFETY: signal 0 only checks that the process exists.
        let rc = unsafe { libc::kill(*pid as i32, 0) };
        assert_eq!(rc, 0, "cluster process {pid} is not running");
    }
}

/// Log replays chunk server `n` (an ssd one) has reported so far.
fn replays(data: &Path, n: usize) -> usize {
    let log = data.join("logs").join(format!("chunkserver-{n}.log"));
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.matches("replayed write-ahead log").count()
}

/// Chunk server `n` holds a replica of some chunk of the volume.
fn holds_chunks(data: &Path, n: usize) -> bool {
    let volume = data
        .join(format!("cs-{n}"))
        .join("chunks")
        .join(format!("{VOLUME_ID:016x}"));
    std::fs::read_dir(volume).is_ok_and(|mut d| d.next().is_some())
}

/// The nbdsh writer, in its own process group so it can be killed whole, and is
/// killed if the test fails first.
struct Writer {
    child: Option<Child>,
}

impl Writer {
    fn start(uri: &str, ledger: &Path, seed: u64, round: u32, start: u64, count: u64) -> Writer {
        let mut command = client(uri, seed);
        command
            .env("FLOE_CRASH_MODE", "write")
            .env("FLOE_CRASH_LEDGER", ledger)
            .env("FLOE_CRASH_ROUND", round.to_string())
            .env("FLOE_CRASH_START", start.to_string())
            .env("FLOE_CRASH_COUNT", count.to_string())
            .env("FLOE_CRASH_REGION_BLOCKS", REGION_BLOCKS.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let child = command.spawn().expect("nbdsh starts");
        Writer { child: Some(child) }
    }

    /// Asks the writer to stop issuing and drain.
    fn stop(&mut self) {
        let child = self.child.as_ref().expect("writer not finished");
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    }

    fn running(&mut self) -> bool {
        let child = self.child.as_mut().expect("writer not finished");
        matches!(child.try_wait(), Ok(None))
    }

    /// Waits for the writer to give up on its own, else kills it; returns how it
    /// ended and what it printed.
    fn finish(mut self, timeout: Duration) -> String {
        let mut child = self.child.take().expect("writer not finished");
        let deadline = Instant::now() + timeout;
        let killed = loop {
            if let Ok(Some(_)) = child.try_wait() {
                break false;
            }
            if Instant::now() > deadline {
                kill_group(&mut child);
                break true;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let status = child.wait().expect("writer exits");
        let mut out = String::new();
        let mut err = String::new();
        let _ = child.stdout.take().unwrap().read_to_string(&mut out);
        let _ = child.stderr.take().unwrap().read_to_string(&mut err);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        if killed {
            format!("hung, killed after {timeout:?}")
        } else {
            format!("exited ({status}) {} {}", out.trim(), tail.join(" | "))
        }
    }
}

fn kill_group(child: &mut Child) {
    // SAFETY: kill(2) on the process group of our own child.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
}

impl Drop for Writer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(&mut child);
        }
    }
}

/// nbdsh running crash_client.py against `uri`.
fn client(uri: &str, seed: u64) -> Command {
    let mut command = nbdsh();
    command
        .args(["-u", uri, "-c"])
        .arg(format!("exec(open({CLIENT:?}).read())"))
        .env("PYTHONPATH", SCRIPTS)
        .env("FLOE_CRASH_SEED", seed.to_string());
    command
}

/// A round's (acknowledged, issued) blocks; a torn last line was never acted on.
fn read_ledger(path: &Path) -> (Vec<u64>, Vec<u64>) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut acked = Vec::new();
    let mut issued = Vec::new();
    for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
        let (kind, block) = line.trim_end().split_once(' ').expect("ledger line");
        let block: u64 = block.parse().expect("ledger block number");
        match kind {
            "A" => acked.push(block),
            "I" => issued.push(block),
            _ => panic!("bad ledger line {line:?}"),
        }
    }
    (acked, issued)
}

fn ledger_path(work: &Path, round: u32) -> PathBuf {
    work.join(format!("ledger-{round}.txt"))
}

/// Waits until the writer has its first acknowledged write, so the kill always lands
/// on a writer in full flight.
fn wait_for_first_ack(writer: &mut Writer, ledger: &Path) {
    let deadline = Instant::now() + FIRST_ACK_TIMEOUT;
    loop {
        if !read_ledger(ledger).0.is_empty() {
            return;
        }
        if !writer.running() {
            let writer = std::mem::replace(writer, Writer { child: None });
            panic!(
                "writer exited before any write: {}",
                writer.finish(Duration::ZERO)
            );
        }
        assert!(Instant::now() < deadline, "no write acknowledged in time");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[derive(Deserialize, Debug)]
pub struct NbdReport {
    pub acked: u64,
    pub lost: u64,
    unacked: u64,
    unacked_present: u64,
    /// Unacknowledged blocks that read back with their content (from the primary).
    unacked_present_blocks: Vec<u64>,
    pub torn: u64,
    pub bad: Vec<String>,
}

/// Reads every block of rounds 0..rounds of the ledgers in `work` (`ledger-R.txt`)
/// through the NBD export `uri` (crash_client.py).
pub fn verify_nbd(uri: &str, work: &Path, rounds: u32, seed: u64) -> NbdReport {
    let out = ok(client(uri, seed)
        .env("FLOE_CRASH_MODE", "verify")
        .env("FLOE_CRASH_DIR", work)
        .env("FLOE_CRASH_ROUNDS", rounds.to_string()));
    let line = out.lines().last().expect("verifier prints a summary");
    serde_json::from_str(line).unwrap_or_else(|e| panic!("verifier output {out:?}: {e}"))
}

#[derive(Default, Debug)]
struct DiskReport {
    /// Acknowledged blocks whose every replica was compared.
    acked: u64,
    copies: u64,
    /// Replica copies of acknowledged blocks without exactly their content.
    lost: u64,
    /// Replica copies of unacknowledged blocks holding neither zeroes nor their content.
    torn: u64,
    /// Unacknowledged blocks some replicas hold and others not: allowed (the write
    /// failed), and left as is until replicas are repaired.
    divergent: u64,
    /// Of those, blocks that read as zeroes through NBD though a replica holds them:
    /// a later read served by that replica would return the data instead.
    backup_only: u64,
    bad: Vec<String>,
}

impl DiskReport {
    fn bad(&mut self, message: String) {
        if self.bad.len() < 20 {
            self.bad.push(message);
        }
    }
}

/// The replica files of `chunk`, by chunk server.
/// The replica files of `chunk` on the servers the master lists for it.
fn replicas(data: &Path, chunk: u64, servers: &[usize]) -> Vec<(usize, File)> {
    servers
        .iter()
        .copied()
        .filter_map(|n| {
            let path = data
                .join(format!("cs-{n}"))
                .join("chunks")
                .join(format!("{VOLUME_ID:016x}"))
                .join(format!("{chunk:016x}"));
            File::open(path).ok().map(|f| (n, f))
        })
        .collect()
}

/// 4 KiB of a sparse replica file; past its end reads as zeroes.
fn read_block(file: &File, offset: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK as usize];
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) => panic!("reading a replica: {e}"),
        }
    }
    buf
}

/// Checks every replica on disk of every block of rounds 0..rounds; the cluster must
/// be stopped.
fn verify_disk(
    data: &Path,
    work: &Path,
    rounds: u32,
    content: &Content,
    read_back: &BTreeSet<u64>,
    placement: &BTreeMap<u64, Vec<usize>>,
) -> DiskReport {
    let mut report = DiskReport::default();
    let mut files: BTreeMap<u64, Vec<(usize, File)>> = BTreeMap::new();
    let mut placement_checked = BTreeSet::new();
    let zero = vec![0u8; BLOCK as usize];
    for round in 0..rounds {
        let (acked, issued) = read_ledger(&ledger_path(work, round));
        let acked_set: BTreeSet<u64> = acked.iter().copied().collect();
        let unacked = issued.iter().filter(|b| !acked_set.contains(b));
        let blocks = acked
            .iter()
            .map(|b| (*b, true))
            .chain(unacked.map(|b| (*b, false)));
        for (block, is_acked) in blocks {
            let (chunk, offset) = locate(block * BLOCK);
            let holders = files.entry(chunk).or_insert_with(|| {
                replicas(
                    data,
                    chunk,
                    placement.get(&chunk).map_or(&[], Vec::as_slice),
                )
            });
            let want = content.block(round, block);
            if is_acked {
                if placement_checked.insert(chunk) {
                    let servers: Vec<usize> = holders.iter().map(|(n, _)| *n).collect();
                    let hosts: BTreeSet<usize> = servers.iter().map(|n| host_of(*n)).collect();
                    if servers.len() != 3 || hosts.len() != 3 {
                        report.lost += 1;
                        report.bad(format!("chunk {chunk} has replicas on cs-{servers:?}"));
                    }
                }
                report.acked += 1;
            }
            let mut present = 0;
            for (n, file) in holders.iter() {
                let got = read_block(file, offset);
                present += usize::from(got == want);
                if is_acked {
                    report.copies += 1;
                    if got != want {
                        report.lost += 1;
                        report.bad(format!(
                            "acked round {round} block {block} (chunk {chunk} +{offset}) differs on cs-{n}{}",
                            if got == zero { ": zeroes" } else { "" }
                        ));
                    }
                } else if got != want && got != zero {
                    report.torn += 1;
                    report.bad(format!(
                        "unacked round {round} block {block} (chunk {chunk} +{offset}) torn on cs-{n}"
                    ));
                }
            }
            if !is_acked && present != 0 && present != holders.len() {
                report.divergent += 1;
                report.backup_only += u64::from(!read_back.contains(&block));
            }
        }
    }
    report
}

#[test]
fn kill_9_loses_no_acknowledged_write() {
    kill_9_rounds("write-through", 6);
}

/// In write-back a write is acknowledged before the replicas sync it, but a kill -9
/// leaves what a process wrote in the page cache: still nothing acknowledged is lost
/// (a power cut may take unflushed writes: the chunk store's power-cut test).
#[test]
fn kill_9_loses_no_acknowledged_write_in_write_back_mode() {
    kill_9_rounds("write-back", 3);
}

/// Rounds of kills under a writer on the demo volume in `write_mode`.
fn kill_9_rounds(write_mode: &str, default_rounds: u32) {
    kill_9_rounds_with(Vec::new(), write_mode, default_rounds);
}

/// The rounds on a demo started with `demo_args` too. With `--engine log` there are
/// no chunk files to compare on disk: the checks through NBD and the scrub (the
/// replicas agree by checksum) remain.
pub fn kill_9_rounds_with(demo_args: Vec<String>, write_mode: &str, default_rounds: u32) {
    let chunk_files = !demo_args.iter().any(|a| a == "log");
    let rounds: u32 = std::env::var("FLOE_CRASH_ROUNDS")
        .ok()
        .map(|r| r.parse().expect("FLOE_CRASH_ROUNDS is a number"))
        .unwrap_or(default_rounds);
    assert!(rounds > 0);
    let seed: u64 = std::env::var("FLOE_CRASH_SEED")
        .ok()
        .map(|s| s.parse().expect("FLOE_CRASH_SEED is a number"))
        .unwrap_or_else(rand::random);
    eprintln!("crash: seed {seed} (FLOE_CRASH_SEED={seed} repeats this run's choices)");
    let mut rng = StdRng::seed_from_u64(seed);
    let content = Content::new(seed);
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let mut args = vec!["--write-mode".to_string(), write_mode.to_string()];
    args.extend(demo_args);
    let mut cluster = Cluster::start_with(dir.path(), free_ports(), None, args);
    assert!(cluster
        .floe(&["volume", "info", "demo"])
        .contains(write_mode));
    // All rounds walk one permutation of the region's blocks: each round starts where
    // the previous one stopped issuing, so no block is ever written twice.
    let mut next_block = 0;
    let started = Instant::now();
    let mut kills = 0;
    let mut all_blocks = BTreeSet::new();
    let mut total_acked = 0;
    let (mut nbd, mut disk) = (None, None);
    for round in 0..rounds {
        assert_all_alive(&cluster.info);
        assert!(
            next_block < REGION_BLOCKS,
            "round {round}: every block of the region is used; run fewer rounds"
        );
        let ledger = ledger_path(work.path(), round);
        let mut writer = Writer::start(
            cluster.uri(),
            &ledger,
            seed,
            round,
            next_block,
            REGION_BLOCKS - next_block,
        );
        wait_for_first_ack(&mut writer, &ledger);
        let delay = Duration::from_millis(rng.gen_range(300..=2000));
        std::thread::sleep(delay);
        let victims = Victims::pick(round, &mut rng);
        let replays_before: Vec<usize> = victims
            .chunk_servers()
            .into_iter()
            .map(|n| replays(dir.path(), n))
            .collect();
        for pid in victims.pids(&cluster.info) {
            kill9(pid);
            kills += 1;
        }
        std::thread::sleep(Duration::from_millis(rng.gen_range(500..=2000)));
        writer.stop();
        let writer_end = writer.finish(WRITER_EXIT_TIMEOUT);
        let (acked, issued) = read_ledger(&ledger);
        eprintln!(
            "crash: round {round}: killed {victims:?} {delay:?} after the first ack; \
             {} acknowledged of {} issued; writer {writer_end}",
            acked.len(),
            issued.len()
        );
        assert!(!acked.is_empty(), "round {round}: no write acknowledged");
        for block in &issued {
            assert!(all_blocks.insert(*block), "block {block} written twice");
        }
        next_block += issued.len() as u64;
        total_acked += acked.len() as u64;

        // Every process starts again; the killed chunk servers replay their logs.
        cluster.restart();
        for (n, before) in victims.chunk_servers().into_iter().zip(replays_before) {
            // It was taking writes when killed: its log had records to replay. Not so
            // for an hdd server (odd n): its journals are freed as soon as replay has
            // copied them, which on an unemulated disk may be just before the kill
            // (hybrid.rs kills one under a writer that outruns replay).
            assert!(
                n % 2 == 1 || !holds_chunks(dir.path(), n) || replays(dir.path(), n) > before,
                "cs-{n} did not replay its write-ahead log after kill -9"
            );
        }
        let report = verify_nbd(cluster.uri(), work.path(), round + 1, seed);
        assert!(
            report.lost == 0 && report.torn == 0,
            "round {round}: through NBD: {report:?}\n{}",
            report.bad.join("\n")
        );
        // Back to full redundancy, the replicas agree by checksum...
        let waited = cluster.wait_for_redundancy(REDUNDANCY_TIMEOUT);
        let scrub = cluster.floe(&["scrub", "demo"]);
        assert!(scrub.contains(" 0 differences"), "round {round}: {scrub}");
        let placement = cluster.placement();
        // ...and, stopped, every chunk file holds what was applied: compare them.
        cluster.stop();
        let read_back: BTreeSet<u64> = report.unacked_present_blocks.iter().copied().collect();
        assert_eq!(report.acked, total_acked, "NBD check saw every ledger");
        let report_disk = match chunk_files {
            true => verify_disk(
                dir.path(),
                work.path(),
                round + 1,
                &content,
                &read_back,
                &placement,
            ),
            false => DiskReport::default(),
        };
        assert!(
            report_disk.lost == 0 && report_disk.torn == 0,
            "round {round}: on disk: {report_disk:?}\n{}",
            report_disk.bad.join("\n")
        );
        assert!(
            !chunk_files || report_disk.acked == total_acked,
            "disk check saw every ledger"
        );
        eprintln!(
            "crash: round {round}: full redundancy {waited:.1?} after restart, scrub clean; \
             checked {} acknowledged blocks through NBD and {} \
             replica copies on disk, {} unacknowledged ({} read back, {} on some replicas \
             only, {} of them read as zeroes but held by a backup, none torn); {:.1?} so far",
            report.acked,
            report_disk.copies,
            report.unacked,
            report.unacked_present,
            report_disk.divergent,
            report_disk.backup_only,
            started.elapsed()
        );
        if round + 1 < rounds {
            cluster.start_again();
        }
        (nbd, disk) = (Some(report), Some(report_disk));
    }
    let (nbd, disk) = (nbd.unwrap(), disk.unwrap());
    let lost = nbd.lost + disk.lost;
    println!(
        "crash summary: rounds {rounds}, kills {kills}, acknowledged writes checked {} \
         ({} replica copies), unacknowledged checked {}, lost: {lost}, torn: {}",
        nbd.acked,
        disk.copies,
        nbd.unacked,
        nbd.torn + disk.torn
    );
    assert_eq!(lost, 0);
}
