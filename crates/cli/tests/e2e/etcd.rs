//! The volume suite with the master's metadata in a real etcd (started here on
//! loopback): I/O, allocation map, a whole-cluster restart, and the volume list.

use crate::cluster::{free_ports, ok, volume, Cluster};
use crate::io_helpers::qemu_io;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const ETCD: &str = "/usr/bin/etcd";

/// An etcd of one or more members on loopback, each with its own data directory under
/// one directory; killed on drop.
pub struct Etcd {
    members: Vec<Child>,
    pub client_ports: Vec<u16>,
}

impl Etcd {
    fn start(data: &Path, log: &Path) -> Etcd {
        Etcd::start_members(1, data, log)
    }

    /// `n` members (data under `data/m0`..., logs beside `log`).
    pub fn start_members(n: u16, data: &Path, log: &Path) -> Etcd {
        assert!(
            Path::new(ETCD).exists(),
            "{ETCD} is missing: install etcd-server (see .ci/run)"
        );
        // A block of its own, so no cluster of a parallel test takes these ports.
        let base = free_ports();
        let ports: Vec<(u16, u16)> = (0..n).map(|i| (base + 2 * i, base + 2 * i + 1)).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let mut members = Vec::new();
        for (i, (client_port, peer_port)) in ports.iter().enumerate() {
            let client = format!("http://127.0.0.1:{client_port}");
            let peer = format!("http://127.0.0.1:{peer_port}");
            let log = std::fs::File::create(log.with_extension(format!("m{i}.log"))).unwrap();
            let name = format!("m{i}");
            let mut command = Command::new(ETCD);
            let member = Member {
                name: &name,
                data: &data.join(&name),
                client: &client,
                peer: &peer,
                initial: &initial.join(","),
            };
            let child = member
                .args(&mut command)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run {ETCD}: {e}"));
            members.push(child);
        }
        let mut etcd = Etcd {
            members,
            client_ports: ports.iter().map(|(client, _)| *client).collect(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !etcd
            .client_ports
            .iter()
            .all(|p| healthy(&format!("127.0.0.1:{p}")))
        {
            for member in &mut etcd.members {
                if let Ok(Some(status)) = member.try_wait() {
                    panic!("etcd exited early: {status}");
                }
            }
            assert!(Instant::now() < deadline, "etcd not healthy in time");
            std::thread::sleep(Duration::from_millis(100));
        }
        etcd
    }

    /// `etcd://` endpoints of every member, under `prefix`.
    pub fn metadata(&self, prefix: &str) -> String {
        let hosts: Vec<String> = self
            .client_ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("etcd://{}/{prefix}", hosts.join(","))
    }
}

/// One member of an etcd cluster, as its command line says it.
pub struct Member<'a> {
    pub name: &'a str,
    pub data: &'a Path,
    /// URLs (http://HOST:PORT) it serves clients and peers on.
    pub client: &'a str,
    pub peer: &'a str,
    /// Every member's NAME=PEER_URL, comma-separated.
    pub initial: &'a str,
}

impl Member<'_> {
    pub fn args<'c>(&self, command: &'c mut Command) -> &'c mut Command {
        command
            .args(["--name", self.name, "--data-dir"])
            .arg(self.data)
            .args(["--listen-client-urls", self.client])
            .args(["--advertise-client-urls", self.client])
            .args(["--listen-peer-urls", self.peer])
            .args(["--initial-advertise-peer-urls", self.peer])
            .args(["--initial-cluster", self.initial])
    }
}

/// etcd's own /health endpoint at `address` (HOST:PORT) says the member has a leader
/// and serves.
pub fn healthy(address: &str) -> bool {
    let Ok(mut stream) = TcpStream::connect(address) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = "GET /health HTTP/1.0\r\nHost: etcd\r\n\r\n";
    let mut reply = String::new();
    stream.write_all(request.as_bytes()).is_ok()
        && stream.read_to_string(&mut reply).is_ok()
        && reply.replace(' ', "").contains("\"health\":\"true\"")
}

/// The value of election `name`'s leader key (a master's address), as etcd member
/// `address` (HOST:PORT) answers through its JSON gateway; `None` while none leads.
pub fn election_leader(address: &str, name: &str) -> Option<String> {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let body = serde_json::json!({ "name": b64.encode(name) }).to_string();
    let mut stream = TcpStream::connect(address).ok()?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!(
        "POST /v3/election/leader HTTP/1.0\r\nHost: etcd\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).ok()?;
    let (_, json) = reply.split_once("\r\n\r\n")?;
    let answer: serde_json::Value = serde_json::from_str(json).ok()?;
    let value = b64.decode(answer["kv"]["value"].as_str()?).ok()?;
    String::from_utf8(value).ok()
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for member in &mut self.members {
            let _ = member.kill();
            let _ = member.wait();
        }
    }
}

#[test]
fn etcd_backed_cluster_io_map_restart_and_list() {
    let dir = tempfile::tempdir().unwrap();
    let etcd_dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(
        &etcd_dir.path().join("data"),
        &etcd_dir.path().join("etcd.log"),
    );
    let metadata = etcd.metadata("floe");
    let mut cluster = Cluster::start_on(dir.path(), free_ports(), Some(metadata));
    // The master must not have fallen back to a local store.
    assert!(
        !dir.path().join("master").join("meta.redb").exists(),
        "embedded store created despite --metadata etcd"
    );

    let map = ok(Command::new("nbdinfo").args(["--map", cluster.uri()]));
    assert!(map.contains("hole,zero") && !map.contains("data"), "{map}");

    // Patterns across a chunk boundary (64 MiB) and far into the volume.
    let writes = [
        "write -P 0x3c 0 1M",
        "write -P 0xa7 67043328 2M",
        "write -P 0x5e 900M 64k",
    ];
    let reads = [
        "read -P 0x3c 0 1M",
        "read -P 0xa7 67043328 2M",
        "read -P 0x5e 900M 64k",
        "read -P 0 2M 1M",
    ];
    qemu_io(cluster.uri(), &writes);
    qemu_io(cluster.uri(), &reads);
    let map = ok(Command::new("nbdinfo").args(["--map", cluster.uri()]));
    let first = map.lines().next().unwrap_or_default();
    assert!(
        first.trim_start().starts_with('0') && first.contains("data"),
        "{map}"
    );
    assert!(map.contains("hole,zero"), "{map}");

    // Chunk allocations now live only in etcd: a restart must find them there.
    cluster.restart();
    qemu_io(cluster.uri(), &reads);
    let after = ok(Command::new("nbdinfo").args(["--map", cluster.uri()]));
    assert_eq!(after, map, "allocation map changed across restart");

    let list = cluster.floe_json(&["volume", "list"]);
    let demo =
        volume(&list, "demo").unwrap_or_else(|| panic!("demo missing from volume list:\n{list}"));
    assert_eq!(demo["size_bytes"], 1u64 << 30, "{list}");
    drop(cluster);
    drop(etcd);
}
