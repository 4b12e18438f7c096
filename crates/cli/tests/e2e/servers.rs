//! The demo's chunk servers (or masters) as a test stops and starts them again itself
//! (after a kill -9, or to upgrade them), each exactly as the demo started it.

use crate::cluster::Cluster;
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::net::TcpStream;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Failure bound of a restart: servers replaying their logs, the cluster registering.
pub const RESTART_LIMIT: Duration = Duration::from_secs(120);
pub const CHUNK_SERVERS: usize = 6;

/// A running process's arguments, argv[0] first.
pub fn argv_of(pid: u32) -> Vec<OsString> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_else(|e| panic!("process {pid}: {e}"));
    raw.split(|&b| b == 0)
        .filter(|arg| !arg.is_empty())
        .map(|arg| OsString::from_vec(arg.to_vec()))
        .collect()
}

/// The chunk servers (or masters) now running: the demo's, or ones this test started
/// again after killing them (stopped by PID when dropped).
#[derive(Debug)]
pub struct Servers {
    pub pids: Vec<u32>,
    /// Each server's command line, read from /proc at the cluster's start: a server
    /// starts again exactly as the demo started it.
    argv: Vec<Vec<OsString>>,
    /// Where the demo had each one log, and the address it listens on.
    logs: Vec<PathBuf>,
    addresses: Vec<String>,
    restarted: Vec<Option<Child>>,
}

impl Servers {
    /// The demo's chunk servers.
    pub fn of(cluster: &Cluster) -> Servers {
        let pids = cluster.info.chunkserver_pids.clone();
        assert_eq!(pids.len(), CHUNK_SERVERS);
        let logs = (0..CHUNK_SERVERS)
            .map(|n| {
                cluster
                    .dir
                    .join("logs")
                    .join(format!("chunkserver-{n}.log"))
            })
            .collect();
        let addresses = (0..CHUNK_SERVERS)
            .map(|n| format!("127.0.0.1:{}", cluster.port + 1 + n as u16))
            .collect();
        Servers::from_pids(pids, logs, addresses)
    }

    /// The demo's masters (`floe demo --masters N`), in the order of `master_pids`.
    pub fn masters(cluster: &Cluster) -> Servers {
        let pids = cluster.info.master_pids.clone();
        let logs = (0..pids.len())
            .map(|n| match n {
                0 => cluster.dir.join("logs").join("master.log"),
                n => cluster.dir.join("logs").join(format!("master-{n}.log")),
            })
            .collect();
        let addresses = cluster.info.master.split(',').map(String::from).collect();
        Servers::from_pids(pids, logs, addresses)
    }

    fn from_pids(pids: Vec<u32>, logs: Vec<PathBuf>, addresses: Vec<String>) -> Servers {
        let argv = pids.iter().map(|&pid| argv_of(pid)).collect();
        assert_eq!(pids.len(), addresses.len(), "{addresses:?}");
        Servers {
            restarted: pids.iter().map(|_| None).collect(),
            pids,
            argv,
            logs,
            addresses,
        }
    }

    pub fn addresses(&self) -> &[String] {
        &self.addresses
    }

    pub fn logs(&self) -> &[PathBuf] {
        &self.logs
    }

    /// After a kill -9: reaps a server this test had started.
    pub fn reap(&mut self, n: usize) {
        if let Some(mut child) = self.restarted[n].take() {
            let _ = child.wait();
        }
    }

    /// Starts server `n` again, logging where the demo had it log.
    pub fn restart(&mut self, n: usize) {
        let program = self.argv[n][0].clone();
        self.restart_from(n, Path::new(&program));
    }

    /// Starts server `n` again from the binary at `program` (an upgrade).
    pub fn restart_from(&mut self, n: usize, program: &Path) {
        self.reap(n);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.logs[n])
            .unwrap();
        let child = Command::new(program)
            .args(&self.argv[n][1..])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("floe starts again");
        self.pids[n] = child.id();
        self.restarted[n] = Some(child);
    }

    /// Waits until restarted server `n` listens again (its log replayed).
    pub fn wait_listening(&mut self, n: usize) {
        let address = &self.addresses[n];
        let deadline = Instant::now() + RESTART_LIMIT;
        while TcpStream::connect(address).is_err() {
            let child = self.restarted[n].as_mut().expect("restarted by the test");
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "server {n} exited after its restart: {status}; see {}",
                    self.logs[n].display()
                );
            }
            assert!(
                Instant::now() < deadline,
                "server {n} never listened on {address} after its restart"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for child in self.restarted.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
