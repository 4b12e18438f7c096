//! Three masters on a three-member etcd: one leads, the others stand by; a kill -9 of
//! the leader under a client's writes costs the client no error.

use crate::cluster::{free_ports, Cluster, TestDir};
use crate::etcd::Etcd;
use crate::fio_job::{assert_clean, FioJob, Verify};
use crate::io_helpers::{floe_output, wait_until};
use std::time::Duration;

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

/// Sequential 64 KiB writes at 32 MiB/s reach the demo volume's second stripe set
/// (new chunks to allocate) about 8 s in; the leading master is killed (-9) at 4 s. A
/// standby is elected once the leader's etcd lease runs out, loads the cluster from
/// etcd and serves: the allocations, lease renewals and heartbeats wait for it, fio
/// ends clean and verifies, and `floe status` names the new leader.
#[test]
fn a_standby_master_takes_over_from_a_killed_leader_without_a_client_error() {
    let dir = TestDir::new();
    let etcd_dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start_members(
        3,
        &etcd_dir.path().join("data"),
        &etcd_dir.path().join("etcd.log"),
    );
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start_with(
        dir.path(),
        free_ports(),
        Some(etcd.metadata("floe")),
        vec!["--masters".into(), "3".into()],
    );
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
    // SAFETY: kill(2) on a master the demo started for this test.
    assert_eq!(
        unsafe { libc::kill(cluster.info.master_pids[index] as i32, libc::SIGKILL) },
        0
    );
    let mut next = String::new();
    wait_until("a standby leads", Duration::from_secs(60), || {
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
