//! Floe spread over three hosts as docs/deploy.md lays them out, each host a network
//! namespace with its own address on one bridge: an etcd member, a master and two chunk
//! servers on every host, gateways on two of them, every process with its certificate
//! from the cluster CA (off loopback, nothing runs plain). fio runs on a gateway's host
//! and reaches it on loopback, as a VM does; a client on the root namespace reaches a
//! gateway over `nbds://`.
//!
//! Under fio write-and-verify: a whole host cut off (its link down: etcd's minority
//! member, one master, two chunk servers), then healed and repaired; then the leading
//! master cut from etcd alone (nftables in its namespace), which must stop leading
//! (it exits) while another takes over. fio sees no error, and the replicas agree.

use crate::cluster::{ok, output, Spawned, TestDir, FLOE};
use crate::etcd::{healthy, Member, ETCD};
use crate::fio_job::{assert_clean, FioJob, Verify};
use crate::io_helpers::{text, wait_until};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const HOSTS: usize = 3;
const CHUNK_SERVERS_PER_HOST: usize = 2;
const MASTER_PORT: u16 = 7700;
const NBD_PORT: u16 = 10809;
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(60);
const REPAIR_TIMEOUT: Duration = Duration::from_secs(180);

/// Network namespaces on one bridge; deleted (with what runs in them) on drop.
struct Hosts {
    /// Names the bridge, veths and namespaces apart from any other test run's.
    tag: u32,
}

impl Hosts {
    fn new() -> Hosts {
        let hosts = Hosts {
            tag: std::process::id() % 10_000,
        };
        let bridge = hosts.bridge();
        ip(&["link", "add", &bridge, "type", "bridge"]);
        ip(&[
            "addr",
            "add",
            &format!("{}/24", hosts.gateway_side()),
            "dev",
            &bridge,
        ]);
        ip(&["link", "set", &bridge, "up"]);
        for i in 0..HOSTS {
            let (ns, outside, inside) = (hosts.ns(i), hosts.veth(i, 'o'), hosts.veth(i, 'i'));
            ip(&["netns", "add", &ns]);
            ip(&[
                "link", "add", &outside, "type", "veth", "peer", "name", &inside,
            ]);
            ip(&["link", "set", &inside, "netns", &ns]);
            ip(&["link", "set", &outside, "master", &bridge, "up"]);
            let addr = format!("{}/24", hosts.address(i));
            for args in [
                vec!["addr", "add", &addr, "dev", &inside],
                vec!["link", "set", &inside, "up"],
                vec!["link", "set", "lo", "up"],
            ] {
                ok(hosts.exec(i, "ip").args(args));
            }
        }
        hosts
    }

    fn bridge(&self) -> String {
        format!("flbr{}", self.tag)
    }

    fn ns(&self, i: usize) -> String {
        format!("floe-{}-host{i}", self.tag)
    }

    fn veth(&self, i: usize, side: char) -> String {
        format!("fl{}{side}{i}", self.tag)
    }

    fn subnet(&self) -> String {
        format!("10.231.{}", self.tag % 250)
    }

    /// The root namespace's address on the bridge, where the client runs.
    fn gateway_side(&self) -> String {
        format!("{}.254", self.subnet())
    }

    fn address(&self, i: usize) -> String {
        format!("{}.{}", self.subnet(), i + 1)
    }

    fn masters(&self) -> String {
        (0..HOSTS)
            .map(|i| format!("{}:{MASTER_PORT}", self.address(i)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `program` run on host `i`.
    fn exec(&self, i: usize, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.ns(i), program]);
        command
    }

    /// Host `i` off the network (its link down) or back on it.
    fn link(&self, i: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        ok(self
            .exec(i, "ip")
            .args(["link", "set", &self.veth(i, 'i'), state]));
    }
}

impl Drop for Hosts {
    /// Deleting a namespace deletes its veth, and with it the pair's other end.
    fn drop(&mut self) {
        for i in 0..HOSTS {
            let _ = output(Command::new("ip").args(["netns", "delete", &self.ns(i)]));
        }
        let _ = output(Command::new("ip").args(["link", "delete", &self.bridge()]));
    }
}

fn ip(args: &[&str]) {
    ok(Command::new("ip").args(args));
}

/// An nftables table in host `i`'s namespace dropping what it sends to `port`;
/// removed on drop.
struct Cut<'a> {
    hosts: &'a Hosts,
    host: usize,
}

impl<'a> Cut<'a> {
    fn outgoing(hosts: &'a Hosts, host: usize, port: u16) -> Cut<'a> {
        let nft = |args: &[&str]| ok(hosts.exec(host, "nft").args(args));
        nft(&["add", "table", "inet", "floe_cut"]);
        nft(&[
            "add",
            "chain",
            "inet",
            "floe_cut",
            "out",
            "{ type filter hook output priority 0; policy accept; }",
        ]);
        let port = port.to_string();
        nft(&[
            "add", "rule", "inet", "floe_cut", "out", "tcp", "dport", &port, "drop",
        ]);
        Cut { hosts, host }
    }
}

impl Drop for Cut<'_> {
    fn drop(&mut self) {
        let _ = output(
            self.hosts
                .exec(self.host, "nft")
                .args(["delete", "table", "inet", "floe_cut"]),
        );
    }
}

/// The cluster's processes, each restarted when it exits, as systemd's
/// `Restart=always` does on real hosts (deploy/systemd): a master exits when it stops
/// leading, and comes back as a standby. Killed on drop, before the namespaces go.
struct Processes {
    logs: PathBuf,
    running: Arc<Mutex<Vec<Supervised>>>,
    stop: Arc<AtomicBool>,
    supervisor: Option<std::thread::JoinHandle<()>>,
}

struct Supervised {
    name: String,
    command: Command,
    child: Spawned,
    /// How many times it exited.
    exits: u32,
}

/// How often the supervisor looks for exited processes (systemd's RestartSec).
const RESTART_EVERY: Duration = Duration::from_secs(1);

impl Processes {
    fn new(logs: PathBuf) -> Processes {
        let running: Arc<Mutex<Vec<Supervised>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let supervisor = {
            let (running, stop, logs) = (running.clone(), stop.clone(), logs.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(RESTART_EVERY);
                    for process in running.lock().unwrap().iter_mut() {
                        if process.child.0.try_wait().unwrap().is_some() {
                            process.exits += 1;
                            process.child =
                                start_logged(&logs, &process.name, &mut process.command);
                        }
                    }
                }
            })
        };
        Processes {
            logs,
            running,
            stop,
            supervisor: Some(supervisor),
        }
    }

    fn spawn(&mut self, name: &str, mut command: Command) {
        let child = start_logged(&self.logs, name, &mut command);
        self.running.lock().unwrap().push(Supervised {
            name: name.to_string(),
            command,
            child,
            exits: 0,
        });
    }

    fn exits(&self, name: &str) -> u32 {
        let running = self.running.lock().unwrap();
        let process = running.iter().find(|p| p.name == name);
        process.unwrap_or_else(|| panic!("no process {name}")).exits
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.join(format!("{name}.log"))).unwrap_or_default()
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(supervisor) = self.supervisor.take() {
            let _ = supervisor.join();
        }
        self.running.lock().unwrap().clear();
    }
}

/// Starts `command`, its output appended to LOGS/NAME.log.
fn start_logged(logs: &Path, name: &str, command: &mut Command) -> Spawned {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(logs.join(format!("{name}.log")))
        .unwrap();
    let child = command
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    Spawned(child)
}

/// `floe` as the holder of `certs/NAME.pem`, run on host `i` (or the root namespace).
fn floe_as(hosts: &Hosts, host: Option<usize>, certs: &Path, name: &str) -> Command {
    let mut command = match host {
        Some(i) => hosts.exec(i, FLOE),
        None => Command::new(FLOE),
    };
    command
        .env("FLOE_CA", certs.join("ca.pem"))
        .env("FLOE_CERT", certs.join(format!("{name}.pem")));
    command
}

/// The operator's `floe ARGS` from the root namespace: (succeeded, stdout and stderr).
fn admin(hosts: &Hosts, certs: &Path, args: &[&str]) -> (bool, String) {
    let out = output(
        floe_as(hosts, None, certs, "admin")
            .args(["--master", &hosts.masters()])
            .args(args),
    );
    (out.status.success(), text(&out))
}

/// The master `floe status` names as leading.
fn leader(hosts: &Hosts, certs: &Path) -> Option<String> {
    let (succeeded, said) = admin(hosts, certs, &["status"]);
    let line = said.lines().find(|l| l.starts_with("master: "))?;
    let leader = line["master: ".len()..].split_whitespace().next()?;
    succeeded.then(|| leader.to_string())
}

fn start(hosts: &Hosts, dir: &Path, certs: &Path, processes: &mut Processes) {
    let initial: Vec<String> = (0..HOSTS)
        .map(|i| format!("etcd{i}=http://{}:2380", hosts.address(i)))
        .collect();
    for i in 0..HOSTS {
        let (client, peer) = (
            format!("http://{}:2379", hosts.address(i)),
            format!("http://{}:2380", hosts.address(i)),
        );
        let name = format!("etcd{i}");
        let mut etcd = hosts.exec(i, ETCD);
        Member {
            name: &name,
            data: &dir.join(&name),
            client: &client,
            peer: &peer,
            initial: &initial.join(","),
        }
        .args(&mut etcd);
        processes.spawn(&name, etcd);
    }
    wait_until("etcd is healthy", Duration::from_secs(60), || {
        (0..HOSTS).all(|i| healthy(&format!("{}:2379", hosts.address(i))))
    });
    let endpoints: Vec<String> = (0..HOSTS)
        .map(|i| format!("{}:2379", hosts.address(i)))
        .collect();
    let metadata = format!("etcd://{}/floe", endpoints.join(","));
    for i in 0..HOSTS {
        let mut master = floe_as(hosts, Some(i), certs, &format!("master{i}"));
        master
            .args(["master", "--listen"])
            .arg(format!("{}:{MASTER_PORT}", hosts.address(i)));
        master.args(["--metadata", &metadata]);
        processes.spawn(&format!("master{i}"), master);
        for j in 0..CHUNK_SERVERS_PER_HOST {
            let name = format!("cs{i}{j}");
            let mut server = floe_as(hosts, Some(i), certs, &name);
            server
                .args(["chunkserver", "--dir"])
                .arg(dir.join(&name))
                .arg("--listen")
                .arg(format!(
                    "{}:{}",
                    hosts.address(i),
                    MASTER_PORT + 1 + j as u16
                ))
                .args(["--master", &hosts.masters()])
                .args(["--host", &format!("host{i}")]);
            processes.spawn(&name, server);
        }
        if i < 2 {
            let mut gateway = floe_as(hosts, Some(i), certs, &format!("gateway{i}"));
            gateway
                .args(["gateway", "--listen"])
                .arg(format!("0.0.0.0:{NBD_PORT}"))
                .args(["--master", &hosts.masters()])
                .args(["--name", &format!("gateway{i}")]);
            processes.spawn(&format!("gateway{i}"), gateway);
        }
    }
    let servers = HOSTS * CHUNK_SERVERS_PER_HOST;
    wait_until(
        "every chunk server registers",
        Duration::from_secs(60),
        || {
            admin(hosts, certs, &["status"])
                .1
                .contains(&format!("{servers}/{servers} chunk servers up"))
        },
    );
}

fn make_certificates(hosts: &Hosts, certs: &Path) {
    let issue = |name: &str, role: &str, host: Option<usize>| {
        let mut command = Command::new(FLOE);
        command.args(["cert", "issue"]).arg(certs);
        command.args([name, "--role", role]);
        if let Some(i) = host {
            command.args(["--host", &hosts.address(i)]);
        }
        ok(&mut command);
    };
    ok(Command::new(FLOE).args(["cert", "init"]).arg(certs));
    for i in 0..HOSTS {
        issue(&format!("master{i}"), "master", Some(i));
        for j in 0..CHUNK_SERVERS_PER_HOST {
            issue(&format!("cs{i}{j}"), "chunkserver", Some(i));
        }
        issue(&format!("gateway{i}"), "gateway", Some(i));
    }
    issue("admin", "admin", None);
    issue("client", "client", None);
}

/// fio's sequential 64 KiB writes at 8 MiB/s over `size`, then a read of all of it,
/// checked, on host `gateway` through its gateway on loopback (plain NBD: a VM and
/// its host's gateway).
fn fio(hosts: &Hosts, gateway: usize, name: &str, work: &Path) -> Child {
    let uri = format!("nbd://127.0.0.1:{NBD_PORT}/vol");
    FioJob::new(name, &uri, work)
        .rw("write")
        .bs("64k")
        .size("192M")
        .rate("8m")
        .verify(Verify::WriteAndRead)
        .in_namespace(&hosts.ns(gateway))
        .spawn()
}

/// The host whose master listens at `address`.
fn host_of(hosts: &Hosts, address: &str) -> usize {
    (0..HOSTS)
        .find(|i| address == format!("{}:{MASTER_PORT}", hosts.address(*i)))
        .unwrap_or_else(|| panic!("{address} is no master of this cluster"))
}

#[test]
fn three_hosts_ride_through_a_lost_host_and_a_master_cut_from_etcd() {
    let dir = TestDir::new();
    let work = TestDir::new();
    let hosts = Hosts::new();
    let certs = dir.path().join("certs");
    make_certificates(&hosts, &certs);
    let logs = dir.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    let mut processes = Processes::new(logs);
    start(&hosts, dir.path(), &certs, &mut processes);
    let (created, said) = admin(
        &hosts,
        &certs,
        &["volume", "create", "vol", "--size", "256M", "--mode", "ssd"],
    );
    assert!(created, "{said}");

    // A whole host goes: the one without a gateway (its master may lead).
    let writer = fio(&hosts, 0, "lost-host", work.path());
    std::thread::sleep(Duration::from_secs(5));
    hosts.link(2, false);
    std::thread::sleep(Duration::from_secs(15));
    hosts.link(2, true);
    assert_clean(
        &writer.wait_with_output().unwrap(),
        "fio while host 2 was cut off",
    );
    let servers = HOSTS * CHUNK_SERVERS_PER_HOST;
    for wanted in [
        format!("{servers}/{servers} chunk servers up"),
        "every chunk has all its replicas".to_string(),
    ] {
        wait_until(&wanted, REPAIR_TIMEOUT, || {
            admin(&hosts, &certs, &["status"]).1.contains(&wanted)
        });
    }

    // The leading master loses etcd, and only etcd: it stops leading (it exits),
    // another is elected, and the other gateway's client sees no error.
    let mut first = None;
    wait_until("a master leads", FAILOVER_TIMEOUT, || {
        first = leader(&hosts, &certs);
        first.is_some()
    });
    let first = first.unwrap();
    let cut_host = host_of(&hosts, &first);
    let writer = fio(&hosts, 1, "leader-cut", work.path());
    std::thread::sleep(Duration::from_secs(3));
    let cut = Cut::outgoing(&hosts, cut_host, 2379);
    let old = format!("master{cut_host}");
    let exits = processes.exits(&old);
    wait_until("the cut master stops", FAILOVER_TIMEOUT, || {
        processes.exits(&old) > exits
    });
    let mut next = None;
    wait_until("another master leads", FAILOVER_TIMEOUT, || {
        next = leader(&hosts, &certs).filter(|l| *l != first);
        next.is_some()
    });
    assert_clean(
        &writer.wait_with_output().unwrap(),
        "fio while the leader lost etcd",
    );
    let said = processes.log(&old);
    assert!(
        said.contains("stopped leading"),
        "{old} exited without saying why:\n{said}"
    );
    drop(cut);

    // A client on another host, over TLS with its certificate.
    let remote = ok(Command::new("nbdinfo").arg(format!(
        "nbds://{}:{NBD_PORT}/vol?tls-certificates={}",
        hosts.address(1),
        certs.join("client").display()
    )));
    assert!(
        remote.contains("with TLS") && remote.contains("268435456"),
        "{remote}"
    );
    let (scrubbed, said) = admin(&hosts, &certs, &["scrub", "vol"]);
    assert!(scrubbed && said.contains(" 0 differences"), "{said}");
    println!("host 2 cut off and back; master {first} cut from etcd, {next:?} took over");
}
