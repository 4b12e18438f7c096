//! Growing a live cluster (MAPX section 4 against plain CRUSH): a volume is filled,
//! three hosts join with `floe cluster expand` while fio writes, and then
//! - in `mapx` mode no existing chunk moves (same servers, zero bytes copied) and new
//!   chunks land on the new hosts;
//! - in `crush` mode chunks move to the new hosts, throttled, while fio runs, and
//!   every byte fio and the fill wrote verifies afterwards, with scrub clean.
//!
//! Prints fio's 4k random-write p99 latency before and during the expansion.

use crate::cluster::{free_ports, output, Cluster, FLOE};
use crate::fio::assert_clean;
use crate::io_helpers::qemu_io;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NEW_HOSTS: [&str; 3] = ["host-d", "host-e", "host-f"];
const MOVE_TIMEOUT: Duration = Duration::from_secs(300);
/// The master's default move rate (`floe master --move-rate`), one move at a time.
const MOVE_RATE: f64 = 50.0 * 1024.0 * 1024.0;

fn fio(uri: &str, work: &Path, args: &[&str]) -> Command {
    let mut command = Command::new("fio");
    command
        .current_dir(work)
        .args(["--ioengine=nbd", &format!("--uri={uri}"), "--verify=crc32c"])
        .args(args);
    command
}

/// The fill: chunks 4-7 (fio's random writes take chunks 0-3).
const FILL: &[&str] = &[
    "--name=fill",
    "--rw=write",
    "--bs=1M",
    "--offset=256M",
    "--size=256M",
    "--iodepth=4",
];
/// Random writes over chunks 0-3, verified after the moves.
const RANDOM: &[&str] = &[
    "--name=random",
    "--rw=randwrite",
    "--bs=4k",
    "--size=256M",
    "--iodepth=16",
    "--randseed=777",
    "--do_verify=0",
    "--time_based",
    "--output-format=json",
];

/// Write p99 completion latency (µs) and IOPS from fio's JSON output, after checking
/// that the run had no error.
fn p99_and_iops(out: &std::process::Output, what: &str) -> (f64, f64) {
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find('{').expect("fio printed JSON");
    let json: serde_json::Value = serde_json::from_str(&text[start..]).expect("fio JSON parses");
    assert!(
        out.status.success() && json["jobs"][0]["error"] == 0,
        "fio {what} failed ({}): {text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let write = &json["jobs"][0]["write"];
    let p99 = write["clat_ns"]["percentile"]["99.000000"]
        .as_f64()
        .expect("p99 in fio JSON");
    (p99 / 1000.0, write["iops"].as_f64().unwrap_or(0.0))
}

/// Chunk index -> server ids, from `floe volume info`.
fn chunk_servers(cluster: &Cluster) -> BTreeMap<u64, Vec<u32>> {
    cluster
        .floe(&["volume", "info", "demo"])
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("chunk ")?;
            let (index, rest) = rest.split_once(':')?;
            let servers = rest.split_whitespace().nth(1)?;
            Some((
                index.trim().parse().ok()?,
                servers
                    .split(',')
                    .map(|id| id.trim_end_matches("(stale)").parse().unwrap())
                    .collect(),
            ))
        })
        .collect()
}

/// Ids of the chunk servers on `hosts`, from `floe status`.
fn servers_on(cluster: &Cluster, hosts: &[&str]) -> BTreeSet<u32> {
    cluster
        .floe(&["status"])
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            match fields[..] {
                [id, host, ..] if hosts.contains(&host) => id.parse().ok(),
                _ => None,
            }
        })
        .collect()
}

/// "moves: 3 chunks moved, 192.0 MiB copied, ..." -> (3, bytes).
fn moves(status: &str) -> (u64, f64) {
    let line = status
        .lines()
        .find(|l| l.starts_with("moves:"))
        .expect("a moves line");
    let words: Vec<&str> = line.split_whitespace().collect();
    let chunks = words[1].parse().unwrap();
    let amount: f64 = words[4].parse().unwrap();
    let unit = match words[5] {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        other => panic!("unit {other} in {line}"),
    };
    (chunks, amount * unit)
}

/// Chunk servers the test starts on the new hosts; stopped by PID when dropped.
struct NewServers(Vec<Child>);

impl NewServers {
    fn start(cluster: &Cluster, dir: &Path) -> NewServers {
        let port = free_ports();
        let mut children = Vec::new();
        for (i, host) in NEW_HOSTS.iter().enumerate() {
            for (j, class) in ["ssd", "hdd"].iter().enumerate() {
                let n = i * 2 + j;
                let log = std::fs::File::create(dir.join(format!("new-{n}.log"))).unwrap();
                let child = Command::new(FLOE)
                    .args(["chunkserver", "--dir"])
                    .arg(dir.join(format!("new-{n}")))
                    .args(["--listen", &format!("127.0.0.1:{}", port + n as u16)])
                    .args(["--master", &cluster.info.master])
                    .args(["--host", host, "--class", class])
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .expect("chunk server starts");
                children.push(child);
            }
        }
        NewServers(children)
    }
}

impl Drop for NewServers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }
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
    assert_clean(
        &output(fio(&uri, work.path(), FILL).arg("--do_verify=0")),
        "fill",
    );
    let (base_p99, base_iops) = p99_and_iops(
        &output(fio(&uri, work.path(), RANDOM).args(["--runtime=8", "--verify_state_save=0"])),
        "random writes before the expansion",
    );
    let before = chunk_servers(&cluster);
    assert_eq!(before.len(), 8, "chunks 0-7 are allocated: {before:?}");

    let _servers = NewServers::start(&cluster, dir.path());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cluster
        .floe(&["cluster", "map"])
        .contains("`floe cluster expand` adds them")
        || servers_on(&cluster, &NEW_HOSTS).len() < 6
    {
        assert!(
            Instant::now() < deadline,
            "new chunk servers did not register"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let new_ids = servers_on(&cluster, &NEW_HOSTS);
    let writer = fio(&uri, work.path(), RANDOM)
        .args(["--runtime=30", "--verify_state_save=1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio starts");
    std::thread::sleep(Duration::from_secs(3));
    let expanded = Instant::now();
    let map = cluster.floe(&[
        "cluster", "expand", "--host", "host-d", "--host", "host-e", "--host", "host-f",
    ]);
    assert!(map.contains("expanded the cluster"), "{map}");
    let settled = cluster.wait_for_status("every chunk is where the map places it", MOVE_TIMEOUT);
    let moving_for = expanded.elapsed();
    let during = writer.wait_with_output().expect("fio runs");
    let (p99, iops) = p99_and_iops(&during, "random writes during the expansion");
    let after = chunk_servers(&cluster);
    let (moved, bytes) = moves(&cluster.floe(&["status"]));

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
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "{scrub}");
    assert_clean(
        &output(
            fio(&uri, work.path(), &RANDOM[..6]).args(["--verify_only", "--verify_state_load=1"]),
        ),
        "verify of the random writes",
    );
    assert_clean(
        &output(fio(&uri, work.path(), FILL).arg("--verify_only")),
        "verify of the fill",
    );
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
