//! Sessions moving between gateways (`floe volume move-session`; Strata, FAST'14
//! sections 4 and 6). Two gateways, `east` and `west`, serve the demo cluster's
//! volume; a libnbd writer keeping a ledger (`upgrade_client.py` with both URIs, so
//! it reconnects to whichever serves the volume, as a VM does with QEMU's
//! `reconnect-delay`) writes and reads back while the session moves back and forth.
//! The writer sees no I/O error beyond the reconnects, the old gateway refuses the
//! volume naming the new one, every acknowledged write reads back, and a kill -9 of
//! the gateway holding the volume lets the other serve it again. Bad inputs are
//! refused with one line.

use crate::cluster::{Cluster, Spawned, TestDir, FLOE};
use crate::io_helpers::{floe_output, text, wait_until};
use crate::nbd_raw::wait_for_nbd_server;
use crate::upgrade::{check_ledger, report, writer};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

/// Moves of the session under the writer.
const MOVES: usize = 10;
const START_LIMIT: Duration = Duration::from_secs(30);

/// `floe gateway --name NAME` on a port of its own, logging to DIR/NAME.log.
fn gateway(cluster: &Cluster, dir: &Path, name: &str) -> (Spawned, String) {
    let port = crate::cluster::free_ports();
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let child = Command::new(FLOE)
        .args(["--master", &cluster.info.master, "gateway", "--name", name])
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--metrics-listen",
            "off",
        ])
        .stderr(log)
        .spawn()
        .unwrap();
    wait_for_nbd_server(port, START_LIMIT);
    (Spawned(child), format!("nbd://127.0.0.1:{port}/demo"))
}

/// The gateways in `floe status --json`, by name: (seen_ms_ago, volumes held).
fn gateways(cluster: &Cluster) -> Vec<(String, u64, Vec<String>)> {
    let status = cluster.floe_json(&["status"]);
    let list = status["gateways"].as_array().expect("gateways").iter();
    list.map(|g| {
        let volumes = g["volumes"].as_array().unwrap().iter();
        (
            g["name"].as_str().unwrap().to_string(),
            g["seen_ms_ago"].as_u64().unwrap(),
            volumes.map(|v| v.as_str().unwrap().to_string()).collect(),
        )
    })
    .collect()
}

fn holder(cluster: &Cluster) -> Option<String> {
    let gateways = gateways(cluster);
    let mut holding = gateways
        .iter()
        .filter(|g| g.2.contains(&"demo".to_string()));
    holding.next().map(|g| g.0.clone())
}

/// A refused command: exit status 1 and one line on stderr containing `why`.
fn refused(out: &Output, why: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "not refused: {}", text(out));
    assert_eq!(stderr.lines().count(), 1, "not one line: {stderr}");
    assert!(stderr.contains(why), "expected {why:?}: {stderr}");
}

/// Moves the demo volume's session to gateway `to`; on a failure, the panic shows
/// the gateways' last log lines (their directory may be gone by the time one looks).
fn move_to(cluster: &Cluster, dir: &Path, to: &str) -> serde_json::Value {
    let args = ["volume", "move-session", "demo", "--to", to, "--json"];
    let out = floe_output(cluster, &args);
    if !out.status.success() {
        let mut logs = String::new();
        for log in ["east", "west"] {
            let text = std::fs::read_to_string(dir.join(format!("{log}.log"))).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            logs += &format!(
                "--- {log}\n{}\n",
                lines[lines.len().saturating_sub(30)..].join("\n")
            );
        }
        panic!("moving to {to} failed: {}\n{logs}", text(&out));
    }
    let moved: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(moved["to"], to, "{moved}");
    moved
}

#[test]
fn a_session_moves_between_gateways_under_a_reconnecting_writer() {
    let dir = TestDir::new();
    let cluster = Cluster::start(dir.path());
    let work = TestDir::new();
    let (mut east, east_uri) = gateway(&cluster, work.path(), "east");
    let (mut west, west_uri) = gateway(&cluster, work.path(), "west");
    let (mut doomed, _) = gateway(&cluster, work.path(), "doomed");
    wait_until("the gateways poll the master", START_LIMIT, || {
        gateways(&cluster).len() >= 3
    });
    doomed.0.kill().unwrap();
    doomed.0.wait().unwrap();

    // Bad inputs, one line each.
    let move_session = |volume: &str, to: &str| {
        floe_output(&cluster, &["volume", "move-session", volume, "--to", to])
    };
    refused(
        &move_session("nosuch", "west"),
        "volume nosuch does not exist",
    );
    refused(&move_session("demo", "nowhere"), "no gateway named nowhere");
    refused(
        &move_session("demo", "west"),
        "volume demo is not open on any gateway",
    );
    wait_until("the killed gateway is gone", START_LIMIT, || {
        let gone = floe_master::GATEWAY_GONE.as_millis() as u64;
        gateways(&cluster)
            .iter()
            .any(|g| g.0 == "doomed" && g.1 > gone)
    });
    refused(
        &move_session("demo", "doomed"),
        "gateway doomed (NBD at 127.0.0.1:",
    );
    refused(&move_session("demo", "doomed"), "is not reachable");

    // The writer connects to east first, which takes the volume.
    let stop = work.path().join("stop");
    let writer = writer(&format!("{east_uri},{west_uri}"), "300", Some(&stop));
    wait_until("east holds the volume", START_LIMIT, || {
        holder(&cluster).as_deref() == Some("east")
    });
    let info = cluster.floe(&["volume", "info", "demo"]);
    assert!(info.contains("served by:     gateway east"), "{info}");

    let mut moved_ms = Vec::new();
    for round in 0..MOVES {
        std::thread::sleep(Duration::from_millis(700));
        let (from, to, from_uri) = match round % 2 {
            0 => ("east", "west", &east_uri),
            _ => ("west", "east", &west_uri),
        };
        let moved = move_to(&cluster, work.path(), to);
        assert_eq!(moved["from"], from, "{moved}");
        moved_ms.push(moved["moved_ms"].as_u64().unwrap());
        assert_eq!(holder(&cluster).as_deref(), Some(to));
        if round < 2 {
            // The gateway the session left refuses it, naming the new one.
            let out = crate::cluster::output(Command::new("qemu-io").args([
                "-f",
                "raw",
                "-c",
                "read 0 4k",
                from_uri,
            ]));
            let said = text(&out);
            assert!(!out.status.success(), "{said}");
            assert!(said.contains(&format!("moved to gateway {to}")), "{said}");
        }
    }
    // Moving to the gateway that holds it already changes nothing.
    let again = move_to(&cluster, work.path(), "east");
    assert_eq!(again["from"], "east", "{again}");

    // The holder dies: once its lease runs out, the other serves the volume again.
    east.0.kill().unwrap();
    east.0.wait().unwrap();
    wait_until("west serves the volume again", START_LIMIT, || {
        holder(&cluster).as_deref() == Some("west")
    });
    std::thread::sleep(Duration::from_secs(1));
    std::fs::write(&stop, "").unwrap();
    let report = report(writer);
    let reconnects = report["reconnects"].as_u64().unwrap();
    moved_ms.sort();
    eprintln!(
        "{MOVES} moves: {reconnects} reconnects, {} operations, the longest wait for a write and its read-back {:.3} s (the kill -9 included); move-session took {} ms median, {} ms max",
        report["operations"],
        report["longest_pause"].as_f64().unwrap(),
        moved_ms[MOVES / 2],
        moved_ms[MOVES - 1]
    );
    assert!(reconnects > MOVES as u64, "{report}");
    check_ledger(&report, &west_uri);

    let log = std::fs::read_to_string(work.path().join("west.log")).unwrap();
    assert!(log.contains("session handed over: lease released"), "{log}");
    assert!(log.contains("took the moved session"), "{log}");
    assert_eq!(west.0.try_wait().unwrap(), None, "west is still running");
}

/// A service address, 127.0.0.1:PORT, that moves between gateways as an L4 load
/// balancer (HAProxy in TCP mode, IPVS) moves a service: socat accepts each new
/// connection and relays it to the gateway the address points at; established
/// connections keep theirs, and a gateway closing one closes the client's side too.
/// Pointing it elsewhere restarts the listener (its relays live on). Stopped on drop.
///
/// Not an nftables DNAT on loopback: there, now and then a reply of an established
/// connection went out untranslated, the client's kernel reset the gateway's side,
/// and qemu-io waited forever on a socket still open at its end.
struct ServiceAddress {
    port: u16,
    listener: Option<Spawned>,
}

impl ServiceAddress {
    fn new(port: u16) -> ServiceAddress {
        ServiceAddress {
            port,
            listener: None,
        }
    }

    fn point_at(&mut self, gateway_port: u16) {
        if let Some(mut old) = self.listener.take() {
            old.0.kill().unwrap();
            old.0.wait().unwrap();
        }
        let listen = format!("TCP-LISTEN:{},bind=127.0.0.1,reuseaddr,fork", self.port);
        let relay = format!("TCP:127.0.0.1:{gateway_port}");
        let child = Command::new("socat").args([&listen, &relay]).spawn();
        self.listener = Some(Spawned(child.expect("socat (scripts/install-deps.sh)")));
        wait_until("socat listens", START_LIMIT, || listening(self.port));
    }
}

/// Whether a socket listens on 127.0.0.1:PORT (from /proc, without connecting).
fn listening(port: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let local = format!("0100007F:{port:04X}");
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields[1] == local && fields[3] == "0A"
    })
}

fn port_of(uri: &str) -> u16 {
    let port = uri.trim_start_matches("nbd://127.0.0.1:");
    port.trim_end_matches("/demo").parse().unwrap()
}

/// qemu-io, unmodified, on one service address with the nbd driver's
/// `reconnect-delay`, writing and reading back patterns while the session moves
/// between two gateways 10 times, the address following it (moved first, as an
/// operator's script would: then the session). Not one request fails.
#[test]
fn qemu_rides_through_moves_with_reconnect_delay() {
    const ROUNDS: usize = 400;
    let dir = TestDir::new();
    let cluster = Cluster::start(dir.path());
    let work = TestDir::new();
    let (_east, east_uri) = gateway(&cluster, work.path(), "east");
    let (_west, west_uri) = gateway(&cluster, work.path(), "west");
    let mut service = ServiceAddress::new(crate::cluster::free_ports());
    service.point_at(port_of(&east_uri));
    let options = format!(
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},export=demo,reconnect-delay=60",
        service.port
    );
    let commands: String = (0..ROUNDS)
        .map(|i| {
            let (pattern, at) = (i % 250 + 1, (i % 64) * 65536);
            format!("write -P {pattern} {at} 64k\nread -P {pattern} {at} 64k\nsleep 50\n")
        })
        .collect();
    let script = work.path().join("qemu-io.commands");
    std::fs::write(&script, commands + "quit\n").unwrap();
    // Bounded, so that a qemu-io that never returns fails the test with its output.
    let qemu_io = Command::new("timeout")
        .args(["180", "qemu-io", "--image-opts", &options])
        .stdin(std::fs::File::open(&script).unwrap())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_until("east holds the volume", START_LIMIT, || {
        holder(&cluster).as_deref() == Some("east")
    });
    for round in 0..MOVES {
        let (to, uri) = match round % 2 {
            0 => ("west", &west_uri),
            _ => ("east", &east_uri),
        };
        service.point_at(port_of(uri));
        move_to(&cluster, work.path(), to);
        std::thread::sleep(Duration::from_millis(1000));
    }
    let out = qemu_io.wait_with_output().unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(!said.contains("failed") && !said.contains("rror"), "{said}");
    assert_eq!(said.matches("read 65536/65536").count(), ROUNDS, "{said}");
    // Each move's target took the volume (a holder whose client had just left has
    // nothing to hand over: its stack closed and released the lease by itself).
    let logs: Vec<String> = ["east", "west"]
        .iter()
        .map(|name| std::fs::read_to_string(work.path().join(format!("{name}.log"))).unwrap())
        .collect();
    let taken: usize = logs
        .iter()
        .map(|log| log.matches("took the moved session").count())
        .sum();
    assert_eq!(taken, MOVES, "{logs:?}");
}
