//! A majority of a chunk's replicas lost at once: the master cannot tell the chunk's
//! latest state from the one survivor and waits for an operator; `floe chunkserver
//! mark-lost` on the dead servers lets it recover from the survivor, back to full
//! redundancy, with the data intact.

use crate::cluster::Cluster;
use crate::io_helpers::qemu_io;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(120);

#[test]
fn minority_survivor_recovers_after_mark_lost() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    qemu_io(&uri, &["write -P 0x5e 0 1M"]);
    // Two replicas of chunk 0, on two hosts.
    let replicas = cluster.placement()[&0].clone();
    let dead = [replicas[0], replicas[1]];
    for n in dead {
        // SAFETY: kill(2) on a cluster process we started (through the demo).
        unsafe { libc::kill(cluster.info.chunkserver_pids[n] as i32, libc::SIGKILL) };
    }
    cluster.wait_for_status("fewer than a majority of replicas reachable", TIMEOUT);
    let ids: Vec<String> = cluster
        .server_indexes()
        .into_iter()
        .filter(|(_, n)| dead.contains(n))
        .map(|(id, _)| id.to_string())
        .collect();
    assert_eq!(ids.len(), 2);
    for id in &ids {
        let out = cluster.floe(&["chunkserver", "mark-lost", id]);
        assert!(out.contains("marked lost"), "{out}");
    }
    cluster.wait_for_status("LOST", TIMEOUT);
    let healed = cluster.wait_for_redundancy(TIMEOUT);
    let placement = cluster.placement();
    assert!(
        placement.values().flatten().all(|n| !dead.contains(n)),
        "replicas left on lost servers: {placement:?}"
    );
    qemu_io(&uri, &["read -P 0x5e 0 1M"]);
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "{scrub}");
    println!("mark-lost: full redundancy {healed:.1?} after the operator's command");
}
