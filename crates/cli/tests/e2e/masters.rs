//! Three masters on a three-member etcd: one leads, the others stand by; a kill -9 of
//! the leader under a client's writes costs the client no error, also when it comes
//! every 20 s for minutes with chunk servers failing in between.

use crate::cluster::{free_ports, Cluster, TestDir};
use crate::etcd::{election_leader, Etcd};
use crate::fio_job::{assert_clean, FioJob, Verify};
use crate::io_helpers::{floe_output, kill9, wait_until};
use crate::servers::{Servers, CHUNK_SERVERS, RESTART_LIMIT};
use rand::Rng;
use std::path::Path;
use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// How long a standby may take to lead after the leader's death: etcd's 3 s lease,
/// then loading the cluster, on a loaded machine.
const FAILOVER_LIMIT: Duration = Duration::from_secs(60);

/// The leader `floe status` names; `None` while no master answers as leader.
fn leader(cluster: &Cluster) -> Option<String> {
    let out = floe_output(cluster, &["status"]);
    let status = String::from_utf8_lossy(&out.stdout);
    let line = status.lines().find(|l| l.starts_with("master: "))?;
    line["master: ".len()..]
        .split_whitespace()
        .next()
        .map(String::from)
}

/// A demo cluster of three masters on a three-member etcd (dropped in this order:
/// the cluster, then etcd, then the directory).
fn three_masters() -> (TestDir, Etcd, Cluster) {
    let dir = TestDir::new();
    let etcd = Etcd::start_members(
        3,
        &dir.path().join("etcd-data"),
        &dir.path().join("etcd.log"),
    );
    let cluster = Cluster::start_with(
        &dir.path().join("cluster"),
        free_ports(),
        Some(etcd.metadata("floe")),
        vec!["--masters".into(), "3".into()],
    );
    (dir, etcd, cluster)
}

/// Sequential 64 KiB writes at 32 MiB/s reach the demo volume's second stripe set
/// (new chunks to allocate) about 8 s in; the leading master is killed (-9) at 4 s. A
/// standby is elected once the leader's etcd lease runs out, loads the cluster from
/// etcd and serves: the allocations, lease renewals and heartbeats wait for it, fio
/// ends clean and verifies, and `floe status` names the new leader.
#[test]
fn a_standby_master_takes_over_from_a_killed_leader_without_a_client_error() {
    let (_dir, _etcd, cluster) = three_masters();
    let work = tempfile::tempdir().unwrap();
    let masters: Vec<String> = cluster.info.master.split(',').map(String::from).collect();
    assert_eq!(masters.len(), 3, "{}", cluster.info.master);
    let first = leader(&cluster).expect("a master leads");
    let index = masters
        .iter()
        .position(|m| *m == first)
        .unwrap_or_else(|| panic!("leader {first} is none of {masters:?}"));

    let fio = FioJob::new("through-a-failover", cluster.uri(), work.path())
        .rw("write")
        .bs("64k")
        .size("384M")
        .rate("32m")
        .verify(Verify::WriteAndRead)
        .spawn();
    std::thread::sleep(Duration::from_secs(4));
    kill9(cluster.info.master_pids[index]);
    let mut next = String::new();
    wait_until("a standby leads", FAILOVER_LIMIT, || {
        next = leader(&cluster).unwrap_or_default();
        !next.is_empty() && next != first
    });
    let out = fio.wait_with_output().unwrap();
    assert_clean(&out, "fio through a master failover");
    assert!(masters.contains(&next), "{next} leads, none of {masters:?}");
    // The longest a write waited (the failover), with the reads' for scale.
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let waits: Vec<&str> = said
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("read:") || l.starts_with("write:") || l.starts_with("clat ("))
        .collect();
    println!("master {first} killed; {next} took over; fio clean and verified; {waits:?}");
}

/// The soak: the leading master is killed (-9) every 20 s, and started again to
/// stand by, while fio writes 4 KiB blocks at random, 16 in flight, and verifies them,
/// job after job over fresh regions (so allocations need the master). Between master
/// kills a chunk server is killed and started again. fio ends every job clean; then
/// every chunk has all its replicas and scrub finds no difference; and at most one
/// master led at any moment: from the masters' logs, each leader took over only after
/// the previous one was killed, and etcd named the same leaders in the same order.
/// 60 s by default; `FLOE_FAILOVER_SOAK_SECS=300` for the five minutes.
#[test]
fn the_leader_killed_every_20_s_under_fio_with_chunk_server_failures() {
    const ROUND: Duration = Duration::from_secs(20);
    let soak = Duration::from_secs(
        std::env::var("FLOE_FAILOVER_SOAK_SECS").map_or(60, |s| s.parse().unwrap()),
    );
    let (_dir, etcd, cluster) = three_masters();
    let work = tempfile::tempdir().unwrap();
    let mut masters = Servers::masters(&cluster);
    let mut servers = Servers::of(&cluster);
    let stop = Arc::new(AtomicBool::new(false));

    // etcd's view, polled: the leaders it named, in order.
    let named = Arc::new(Mutex::new(Vec::<String>::new()));
    let poller = {
        let (stop, named) = (stop.clone(), named.clone());
        let member = format!("127.0.0.1:{}", etcd.client_ports[0]);
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if let Some(leader) = election_leader(&member, "floe/master-election") {
                    let mut named = named.lock().unwrap();
                    if named.last() != Some(&leader) {
                        named.push(leader);
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    // fio, job after job until told to stop, each over the next 64 MiB of the volume.
    let writer = {
        let (stop, uri, work) = (
            stop.clone(),
            cluster.uri().to_string(),
            work.path().to_owned(),
        );
        std::thread::spawn(move || {
            let mut jobs: Vec<Output> = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let region = jobs.len() % 16;
                let out = FioJob::new(&format!("soak-{}", jobs.len()), &uri, &work)
                    .rw("randwrite")
                    .bs("4k")
                    .iodepth(16)
                    .offset(&format!("{}M", 64 * region))
                    .size("64M")
                    .verify(Verify::WriteAndRead)
                    .run();
                jobs.push(out);
            }
            jobs
        })
    };

    let mut rng = rand::thread_rng();
    let mut kills: Vec<(String, SystemTime)> = Vec::new();
    let started = Instant::now();
    while started.elapsed() + ROUND <= soak || kills.is_empty() {
        let round = Instant::now();
        let leader_now = leader(&cluster).expect("a master leads");
        let index = masters
            .addresses()
            .iter()
            .position(|m| *m == leader_now)
            .unwrap_or_else(|| panic!("leader {leader_now} is none of {masters:?}"));
        kill9(masters.pids[index]);
        kills.push((leader_now.clone(), SystemTime::now()));
        masters.reap(index);
        wait_until("a standby leads", FAILOVER_LIMIT, || {
            leader(&cluster).is_some_and(|next| next != leader_now)
        });
        masters.restart(index);
        masters.wait_listening(index);
        // A chunk server fails between two master failures.
        std::thread::sleep(Duration::from_secs(3));
        let n = rng.gen_range(0..CHUNK_SERVERS);
        kill9(servers.pids[n]);
        servers.reap(n);
        std::thread::sleep(Duration::from_secs(3));
        servers.restart(n);
        servers.wait_listening(n);
        std::thread::sleep(ROUND.saturating_sub(round.elapsed()));
    }
    stop.store(true, Ordering::SeqCst);
    let jobs = writer.join().unwrap();
    for (i, out) in jobs.iter().enumerate() {
        assert_clean(out, &format!("fio job {i} of the soak"));
    }
    poller.join().unwrap();
    let healed = cluster.wait_for_redundancy(RESTART_LIMIT);
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "{scrub}");

    let terms = leaderships(masters.logs());
    assert_eq!(
        terms.len(),
        kills.len() + 1,
        "every kill but the last one's successor should lead once: {terms:?}, kills {kills:?}"
    );
    for (i, ((killed, at), next)) in kills.iter().zip(&terms[1..]).enumerate() {
        assert_eq!(
            *killed, terms[i].1,
            "kill {i} took a master that did not lead"
        );
        assert!(
            *at <= next.0,
            "{} led from {:?}, before {killed} was killed at {at:?}",
            next.1,
            next.0
        );
    }
    let from_logs: Vec<&String> = terms.iter().map(|(_, address)| address).collect();
    let from_etcd = named.lock().unwrap().clone();
    assert_eq!(
        from_logs,
        from_etcd.iter().collect::<Vec<_>>(),
        "the masters' logs and etcd disagree on who led"
    );
    println!(
        "{} leader kills in {:?}, {} fio jobs clean, healed {healed:?} after the last; \
         leaders in order: {from_etcd:?}",
        kills.len(),
        started.elapsed(),
        jobs.len()
    );
}

/// Each time a master began to lead (its "master serving" line): when, and its address,
/// in time order across every master's log.
fn leaderships(logs: &[std::path::PathBuf]) -> Vec<(SystemTime, String)> {
    let mut terms: Vec<(SystemTime, String)> =
        logs.iter().flat_map(|log| leaderships_in(log)).collect();
    terms.sort();
    terms
}

fn leaderships_in(log: &Path) -> Vec<(SystemTime, String)> {
    let text = std::fs::read_to_string(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    text.lines()
        .filter(|line| line.contains("master serving"))
        .map(|line| {
            let stamp = line.split_whitespace().next().unwrap_or_default();
            let at = humantime::parse_rfc3339(stamp)
                .unwrap_or_else(|e| panic!("{stamp}: {e} in {}", log.display()));
            let address = line
                .split_whitespace()
                .find_map(|field| field.strip_prefix("address="))
                .unwrap_or_else(|| panic!("no address in {line}"));
            (at, address.to_string())
        })
        .collect()
}
