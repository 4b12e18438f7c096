//! A chunk server cut off by the network (an nftables rule drops every loopback packet
//! to its port: the gateway's and the master's requests, never its heartbeats) while
//! writes continue: the writes commit on the majority and the replica is marked stale;
//! once the cut heals, it catches up by incremental repair from a peer's journal lite,
//! not by a whole copy, and scrub finds the replicas equal.

use crate::cluster::{ids, ok, Cluster};
use crate::io_helpers::qemu_io;
use std::process::Command;
use std::time::Duration;

const REDUNDANCY_TIMEOUT: Duration = Duration::from_secs(120);

/// An nftables table dropping TCP packets to one loopback port; removed on drop.
pub struct Cut {
    table: String,
}

pub(crate) fn nft(args: &[&str]) {
    ok(Command::new("nft").args(args));
}

impl Cut {
    fn port(port: u16) -> Cut {
        Cut::rule(
            format!("floe_cut_{port}"),
            &format!("ip daddr 127.0.0.1 tcp dport {port} drop"),
        )
    }

    /// Drops only the packets that processes of group `gid` send to `port`: cuts one
    /// process off from one server, the others still reach it.
    pub fn group_to_port(gid: u32, port: u16) -> Cut {
        Cut::rule(
            format!("floe_cut_{gid}_{port}"),
            &format!("meta skgid {gid} ip daddr 127.0.0.1 tcp dport {port} drop"),
        )
    }

    fn rule(table: String, rule: &str) -> Cut {
        nft(&["add", "table", "inet", &table]);
        nft(&[
            "add",
            "chain",
            "inet",
            &table,
            "out",
            "{ type filter hook output priority 0; policy accept; }",
        ]);
        let mut args = vec!["add", "rule", "inet", &table, "out"];
        args.extend(rule.split(' '));
        nft(&args);
        Cut { table }
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.table])
            .status();
    }
}

/// (incremental repairs, whole copies) from `floe status`.
fn repairs(status: &str) -> (u64, u64) {
    let line = status
        .lines()
        .find(|l| l.starts_with("recovery:"))
        .expect("a recovery line");
    let number_before = |word: &str| -> u64 {
        let at = line.find(word).expect(word);
        line[..at]
            .split(|c: char| !c.is_ascii_digit())
            .rfind(|s| !s.is_empty())
            .and_then(|n| n.parse().ok())
            .expect("a count")
    };
    (
        number_before(" incremental"),
        number_before(" whole copies"),
    )
}

#[test]
fn cut_off_replica_catches_up_incrementally() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    // Allocates chunks 0-3 (one 64 KiB stripe unit each).
    qemu_io(&uri, &["write -P 0x11 0 256k"]);
    let backup = cluster.placement()[&0][1];
    let port = cluster.port + 1 + backup as u16;

    // Chunk 0 holds the stripe units at 0, 256 KiB, 512 KiB, ...
    let writes: Vec<String> = (0..16)
        .map(|i| {
            format!(
                "write -P {} {} 4k",
                0x40 + i,
                (i / 4) * (256 << 10) + (i % 4) * 8192
            )
        })
        .collect();
    let reads: Vec<String> = writes
        .iter()
        .map(|w| w.replacen("write", "read", 1))
        .collect();
    {
        let _cut = Cut::port(port);
        let commands: Vec<&str> = writes.iter().map(String::as_str).collect();
        qemu_io(&uri, &commands);
        let info = cluster.floe_json(&["volume", "info", "demo"]);
        let chunks = info["chunks"].as_array().expect("chunks");
        assert!(
            chunks
                .iter()
                .any(|c| c["index"] == 0 && !ids(&c["stale"]).is_empty()),
            "the cut-off replica of chunk 0 is not marked stale:\n{info}"
        );
        // The master tries to repair it meanwhile, and cannot reach it.
        std::thread::sleep(Duration::from_secs(3));
    }
    let healed = cluster.wait_for_redundancy(REDUNDANCY_TIMEOUT);
    let status = cluster.floe(&["status"]);
    let (incremental, full) = repairs(&status);
    assert!(
        incremental >= 1 && full == 0,
        "expected incremental repairs only:\n{status}"
    );
    let scrub = cluster.floe(&["scrub", "demo"]);
    assert!(scrub.contains(" 0 differences"), "{scrub}");
    let commands: Vec<&str> = reads.iter().map(String::as_str).collect();
    qemu_io(&uri, &commands);
    println!("netcut: full redundancy {healed:.1?} after the cut healed; {incremental} incremental repairs, {full} whole copies");
}
