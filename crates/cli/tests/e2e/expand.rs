//! Growing a live cluster (MAPX section 4 against plain CRUSH): a volume is filled,
//! three hosts join with `floe cluster expand` while fio writes, and then
//! - in `mapx` mode no existing chunk moves (same servers, zero bytes copied) and new
//!   chunks land on the new hosts;
//! - in `crush` mode chunks move to the new hosts, throttled, while fio runs, and
//!   every byte fio and the fill wrote verifies afterwards, with scrub clean.
//!
//! Prints fio's 4k random-write p99 latency before and during the expansion.
//!
//! A third run kills -9 the master, then one of the new chunk servers, at random
//! moments while chunks move: the moves finish after the restarts, and fio's data and
//! the fill verify.

use crate::cluster::{free_ports, ids, Cluster, FLOE};
use crate::fio_job::{assert_random_and_fill_verify, json_report, write_fill, FioJob, Verify};
use crate::io_helpers::qemu_io;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NEW_HOSTS: [&str; 3] = ["host-d", "host-e", "host-f"];
pub(crate) const MOVE_TIMEOUT: Duration = Duration::from_secs(300);
/// The master's default move rate (`floe master --move-rate`), one move at a time.
const MOVE_RATE: f64 = 50.0 * 1024.0 * 1024.0;

/// The fill: chunks 4-7 (fio's random writes take chunks 0-3).
fn fill(uri: &str, work: &Path) -> FioJob {
    FioJob::fill(uri, work, "256M")
}

/// Random writes over chunks 0-3, verified after the moves.
fn random(uri: &str, work: &Path) -> FioJob {
    FioJob::random_4k(uri, work, 777)
}

/// [`random`] writing for `seconds`, reporting in JSON; `save_state` keeps what it
/// wrote for [`assert_verifies`].
fn random_writes(uri: &str, work: &Path, seconds: u64, save_state: bool) -> FioJob {
    random(uri, work)
        .verify(Verify::Write { save_state })
        .runtime(seconds)
        .json()
}

/// Write p99 completion latency (µs) and IOPS from fio's JSON output, after checking
/// that the run had no error.
fn p99_and_iops(out: &std::process::Output, what: &str) -> (f64, f64) {
    let json = json_report(out, what);
    let write = &json["jobs"][0]["write"];
    let p99 = write["clat_ns"]["percentile"]["99.000000"]
        .as_f64()
        .expect("p99 in fio JSON");
    (p99 / 1000.0, write["iops"].as_f64().unwrap_or(0.0))
}

/// Chunk index -> what `field` makes of its entry in `floe volume info --json`.
fn chunk_fields<T>(cluster: &Cluster, field: impl Fn(&serde_json::Value) -> T) -> BTreeMap<u64, T> {
    let info = cluster.floe_json(&["volume", "info", "demo"]);
    let chunks = info["chunks"].as_array().expect("chunks");
    chunks
        .iter()
        .map(|c| (c["index"].as_u64().expect("an index"), field(c)))
        .collect()
}

/// Chunk index -> server ids, from `floe volume info`.
fn chunk_servers(cluster: &Cluster) -> BTreeMap<u64, Vec<u32>> {
    chunk_fields(cluster, |c| ids(&c["servers"]))
}

/// Chunk index -> placement group, from `floe volume info`.
fn pgs(cluster: &Cluster) -> BTreeMap<u64, u32> {
    chunk_fields(cluster, |c| c["pg"].as_u64().expect("a pg") as u32)
}

/// Ids of the chunk servers on `hosts`, from `floe status`.
fn servers_on(cluster: &Cluster, hosts: &[&str]) -> BTreeSet<u32> {
    let status = cluster.floe_json(&["status"]);
    let servers = status["servers"].as_array().expect("servers");
    servers
        .iter()
        .filter(|s| hosts.iter().any(|h| s["host"] == *h))
        .map(|s| s["id"].as_u64().expect("an id") as u32)
        .collect()
}

/// Chunks moved and bytes copied by moves so far, from `floe status`.
pub(crate) fn moves(cluster: &Cluster) -> (u64, f64) {
    let rebalance = &cluster.floe_json(&["status"])["rebalance"];
    let moved = rebalance["moved_chunks"].as_u64().expect("moved_chunks");
    let bytes = rebalance["bytes_moved"].as_f64().expect("bytes_moved");
    (moved, bytes)
}

/// Processes the test starts beside the demo's (the new hosts' chunk servers, a
/// restarted master), each with the command that starts it again; stopped by PID when
/// dropped.
pub(crate) struct Extra(Vec<(Command, Child)>);

impl Extra {
    /// One chunk server per (new host, class).
    pub(crate) fn new_servers(cluster: &Cluster, dir: &Path) -> Extra {
        let port = free_ports();
        let mut extra = Extra::none();
        for (i, host) in NEW_HOSTS.iter().enumerate() {
            for (j, class) in ["ssd", "hdd"].iter().enumerate() {
                let n = i * 2 + j;
                let mut command = Command::new(FLOE);
                command
                    .args(["chunkserver", "--dir"])
                    .arg(dir.join(format!("new-{n}")))
                    .args(["--listen", &format!("127.0.0.1:{}", port + n as u16)])
                    .args(["--master", &cluster.info.master])
                    .args(["--host", host, "--class", class]);
                extra.spawn(command, &dir.join(format!("new-{n}.log")));
            }
        }
        extra
    }

    /// None yet.
    pub(crate) fn none() -> Extra {
        Extra(Vec::new())
    }

    pub(crate) fn spawn(&mut self, mut command: Command, log: &Path) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("process starts");
        self.0.push((command, child));
    }

    /// kill -9 of process `i`, then the same command again.
    fn kill_and_restart(&mut self, i: usize) {
        let (command, child) = &mut self.0[i];
        child.kill().unwrap();
        child.wait().unwrap();
        *child = command.spawn().expect("process starts again");
    }
}

impl Drop for Extra {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }
}

/// The command that starts the demo's master again (after a kill -9) on its stored
/// state, at its address (add the demo's `--placement` if not mapx: a master refuses
/// to start in another mode than its cluster map's).
pub(crate) fn master_command(cluster: &Cluster) -> Command {
    let mut master = Command::new(FLOE);
    master
        .args(["master", "--listen", &cluster.info.master, "--metadata"])
        .arg(format!(
            "embedded:{}",
            cluster.dir.join("master/meta.redb").display()
        ));
    master
}

/// Waits for the new servers to register; their ids.
pub(crate) fn await_new_servers(cluster: &Cluster) -> BTreeSet<u32> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cluster
        .floe(&["cluster", "map"])
        .contains("`floe cluster expand` adds them")
        || servers_on(cluster, &NEW_HOSTS).len() < 6
    {
        assert!(
            Instant::now() < deadline,
            "new chunk servers did not register"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    servers_on(cluster, &NEW_HOSTS)
}

/// MAPX operator moves on the live cluster: `pg remap` of chunk 0's placement group
/// to the new layer moves exactly that group's chunks there; `layer merge 0 1` then
/// moves chunks of both layers and leaves every chunk where the merged map places it.
fn remap_and_merge(cluster: &Cluster, new_ids: &BTreeSet<u32>) {
    let before = chunk_servers(cluster);
    let groups = pgs(cluster);
    let pg = groups[&0];
    // --wait: back once every chunk is where the new map places it.
    let remap = cluster.floe(&["pg", "remap", &pg.to_string(), "1", "--wait"]);
    assert!(remap.contains("cluster map epoch"), "{remap}");
    assert!(
        remap.contains("every chunk is where the map places it"),
        "{remap}"
    );
    let after = chunk_servers(cluster);
    for (index, servers) in &after {
        if groups[index] == pg {
            assert!(
                servers.iter().all(|id| new_ids.contains(id)),
                "chunk {index} of remapped pg {pg} on the new layer {new_ids:?}: {servers:?}"
            );
        } else {
            assert_eq!(
                servers, &before[index],
                "chunk {index} (pg {}) moved",
                groups[index]
            );
        }
    }
    let (remapped, _) = moves(cluster);
    let merge = cluster.floe(&["layer", "merge", "0", "1", "--wait"]);
    assert!(merge.contains("layers 0 and 1 merged"), "{merge}");
    assert!(
        merge.contains("every chunk is where the map places it"),
        "{merge}"
    );
    let (moved, bytes) = moves(cluster);
    println!(
        "expand (mapx): pg remap {pg} 1 moved {remapped} chunks; layer merge 0 1 moved {} more \
         ({:.1} MiB in all)",
        moved - remapped,
        bytes / 1048576.0
    );
}

/// Scrub clean, and fio's random writes and the fill read back.
fn assert_verifies(cluster: &Cluster, work: &Path) {
    let uri = cluster.uri();
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "{scrub}");
    assert_random_and_fill_verify(&random(uri, work), &fill(uri, work));
}

pub(crate) fn expand_command(cluster: &Cluster) {
    let map = cluster.floe(&[
        "cluster", "expand", "--host", "host-d", "--host", "host-e", "--host", "host-f",
    ]);
    assert!(map.contains("expanded the cluster"), "{map}");
}

fn expand_under_fio(placement: &str) {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start_with(
        dir.path(),
        free_ports(),
        None,
        vec!["--placement".into(), placement.into()],
    );
    let uri = cluster.uri().to_string();
    write_fill(&fill(&uri, work.path()));
    let (base_p99, base_iops) = p99_and_iops(
        &random_writes(&uri, work.path(), 8, false).run(),
        "random writes before the expansion",
    );
    let before = chunk_servers(&cluster);
    assert_eq!(before.len(), 8, "chunks 0-7 are allocated: {before:?}");

    let _servers = Extra::new_servers(&cluster, dir.path());
    let new_ids = await_new_servers(&cluster);
    let writer = random_writes(&uri, work.path(), 30, true).spawn();
    std::thread::sleep(Duration::from_secs(3));
    let expanded = Instant::now();
    expand_command(&cluster);
    let settled = cluster.wait_for_status("every chunk is where the map places it", MOVE_TIMEOUT);
    let moving_for = expanded.elapsed();
    let during = writer.wait_with_output().expect("fio runs");
    let (p99, iops) = p99_and_iops(&during, "random writes during the expansion");
    let after = chunk_servers(&cluster);
    let (moved, bytes) = moves(&cluster);

    match placement {
        "mapx" => {
            assert_eq!(before, after, "mapx: existing chunks kept their servers");
            assert_eq!((moved, bytes), (0, 0.0), "mapx: nothing moved");
            qemu_io(&uri, &["write -P 0x5a 512M 64M"]);
            let grown = chunk_servers(&cluster);
            let new_chunks: Vec<&Vec<u32>> = grown
                .iter()
                .filter(|(index, _)| !before.contains_key(index))
                .map(|(_, servers)| servers)
                .collect();
            assert_eq!(new_chunks.len(), 4, "{grown:?}");
            assert!(
                new_chunks
                    .iter()
                    .all(|servers| servers.iter().all(|id| new_ids.contains(id))),
                "new chunks land in the new layer {new_ids:?}: {grown:?}"
            );
            assert!(qemu_io(&uri, &["read -P 0x5a 512M 64M"]).contains("read 67108864"));
            remap_and_merge(&cluster, &new_ids);
            assert!(qemu_io(&uri, &["read -P 0x5a 512M 64M"]).contains("read 67108864"));
        }
        _ => {
            assert!(moved > 0 && bytes > 0.0, "crush: chunks moved");
            assert!(
                after
                    .values()
                    .any(|servers| servers.iter().any(|id| new_ids.contains(id))),
                "crush: some replicas moved to the new hosts: {after:?}"
            );
            // One move at a time, each paced to the move rate: the whole took at
            // least as long as the bytes at that rate (view changes only add).
            let rate = bytes / settled.as_secs_f64().max(0.001);
            assert!(
                rate <= MOVE_RATE * 1.2,
                "moves ran at {rate:.0} B/s, above the {MOVE_RATE} B/s throttle"
            );
        }
    }
    assert_verifies(&cluster, work.path());
    println!(
        "expand ({placement}): +3 hosts (6 chunk servers) under fio 4k randwrite iodepth 16; \
         {moved} chunks moved ({:.1} MiB) in {:.1?}; fio p99 {base_p99:.0} us / {base_iops:.0} IOPS before, \
         {p99:.0} us / {iops:.0} IOPS during the expansion",
        bytes / 1048576.0,
        moving_for
    );
}

#[test]
fn mapx_expansion_moves_nothing_and_places_new_chunks_on_new_hosts() {
    expand_under_fio("mapx");
}

#[test]
fn crush_expansion_moves_chunks_throttled_and_data_verifies() {
    expand_under_fio("crush");
}

#[test]
fn crush_moves_survive_kill_of_the_master_and_of_a_new_server() {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start_with(
        dir.path(),
        free_ports(),
        None,
        vec!["--placement".into(), "crush".into()],
    );
    let uri = cluster.uri().to_string();
    write_fill(&fill(&uri, work.path()));
    let mut extra = Extra::new_servers(&cluster, dir.path());
    await_new_servers(&cluster);
    let writer = random_writes(&uri, work.path(), 40, true).spawn();
    std::thread::sleep(Duration::from_secs(2));
    expand_command(&cluster);

    // The master dies at a random moment of a move and comes back.
    cluster.wait_for_status("1 moving", MOVE_TIMEOUT);
    std::thread::sleep(Duration::from_millis(rng.gen_range(0..1500)));
    // SAFETY: kill(2) on the demo's master, which this test started.
    assert_eq!(
        unsafe { libc::kill(cluster.info.master_pid as i32, libc::SIGKILL) },
        0
    );
    let mut master = master_command(&cluster);
    master.args(["--placement", "crush"]);
    extra.spawn(master, &dir.path().join("master-restarted.log"));

    // Then a new server, source or target of moves, at a random moment of a move.
    cluster.wait_for_status("1 moving", MOVE_TIMEOUT);
    std::thread::sleep(Duration::from_millis(rng.gen_range(0..1500)));
    let victim = rng.gen_range(0..NEW_HOSTS.len() * 2);
    extra.kill_and_restart(victim);
    cluster.wait_for_redundancy(MOVE_TIMEOUT);
    let (moved, _) = moves(&cluster);
    let during = writer.wait_with_output().expect("fio runs");
    p99_and_iops(&during, "random writes through the kills");
    assert_verifies(&cluster, work.path());
    println!(
        "expand (crush) with kill -9 of the master and of new server {victim}: \
         {moved} chunks moved after the master restart; fio clean, data verified, scrub clean"
    );
}
