//! Test harness: a real `floe demo` cluster (separate OS processes on loopback, ports
//! picked by the test) and helpers to run the real NBD clients against it.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

pub const FLOE: &str = env!("CARGO_BIN_EXE_floe");
/// Ports each cluster takes: master, six chunk servers, two more masters (`--masters`),
/// NBD; then the same ten again for their metrics (each process's port + 10).
const PORTS_PER_CLUSTER: u16 = 20;
/// The NBD port, the last of the processes' ten.
const NBD_PORT_OFFSET: u16 = 9;

#[derive(Deserialize, Debug, Clone)]
pub struct DemoFile {
    pub nbd_uri: String,
    /// Every master's address (`a,b,c`), in the order of `master_pids`.
    pub master: String,
    pub master_pid: u32,
    pub master_pids: Vec<u32>,
    pub chunkserver_pids: Vec<u32>,
    pub gateway_pid: u32,
    /// The cluster's certificates, when it runs TLS.
    pub certs: Option<PathBuf>,
    /// Each process's `/metrics` URL, by name (`master`, `chunkserver-N`, `gateway`).
    #[serde(default)]
    pub metrics: BTreeMap<String, String>,
}

pub struct Cluster {
    pub dir: PathBuf,
    pub port: u16,
    pub metadata: Option<String>,
    /// Extra `floe demo` arguments, kept for restarts (`--plain` unless
    /// [`Cluster::start_tls`]: tests that start processes of their own need no
    /// certificates).
    args: Vec<String>,
    demo: Option<Child>,
    pub info: DemoFile,
}

/// Where test ports start.
const PORTS_FIRST: u16 = 10000;

/// Test ports stay below the kernel's ephemeral range (32768 up by default), where every
/// outgoing connection takes its local port: on a busy machine one taken between our
/// check and the demo's bind fails a server's start.
fn ports_end() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .filter(|&start| start >= PORTS_FIRST + 100 * PORTS_PER_CLUSTER)
        .unwrap_or(32768)
}

/// A block of free ports; different tests in one run never share one.
/// A test's directory, kept (its path printed) when the test panics, so that the
/// logs of the processes it ran outlive the failure.
pub struct TestDir(Option<tempfile::TempDir>);

impl TestDir {
    pub fn new() -> TestDir {
        TestDir(Some(tempfile::tempdir().unwrap()))
    }

    pub fn path(&self) -> &Path {
        self.0.as_ref().expect("the directory lives").path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(dir) = self.0.take() {
                eprintln!(
                    "the failed test's directory is kept: {}",
                    dir.keep().display()
                );
            }
        }
    }
}

pub fn free_ports() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let blocks = u32::from((ports_end() - PORTS_FIRST) / PORTS_PER_CLUSTER);
    // Each test program starts at a block of its own (by pid), so that test runs side by
    // side (other worktrees) rarely try the same ports.
    let first = std::process::id().wrapping_mul(397) % blocks;
    loop {
        let slot = u32::from(NEXT.fetch_add(1, Ordering::SeqCst));
        let block = ((first + slot) % blocks) as u16;
        let base = PORTS_FIRST + block * PORTS_PER_CLUSTER;
        let all_free =
            (0..PORTS_PER_CLUSTER).all(|i| TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if all_free {
            return base;
        }
    }
}

/// The last lines of every process's log in a demo directory: a failed test removes
/// the directory, so its panic message must say why.
fn log_tails(dir: &Path) -> String {
    const LINES: usize = 5;
    let mut logs: Vec<PathBuf> = std::fs::read_dir(dir.join("logs"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .collect();
    logs.sort();
    let mut out = String::new();
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        out += &format!("--- {}\n", log.display());
        for line in &lines[lines.len().saturating_sub(LINES)..] {
            out += line;
            out.push('\n');
        }
    }
    out
}

impl Cluster {
    /// Starts a demo cluster on a fresh directory with the embedded metadata store.
    pub fn start(dir: &Path) -> Cluster {
        Cluster::start_on(dir, free_ports(), None)
    }

    pub fn start_on(dir: &Path, port: u16, metadata: Option<String>) -> Cluster {
        Cluster::start_with(dir, port, metadata, Vec::new())
    }

    /// Starts a demo cluster with extra `floe demo` arguments, plain TCP between its
    /// processes.
    pub fn start_with(
        dir: &Path,
        port: u16,
        metadata: Option<String>,
        mut args: Vec<String>,
    ) -> Cluster {
        args.push("--plain".into());
        Cluster::launch(dir, port, metadata, args)
    }

    /// Starts a demo cluster as a user would: TLS between its processes, and (as
    /// `./run.sh` does) a data directory named relative to where it runs.
    pub fn start_tls(dir: &Path) -> Cluster {
        Cluster::launch(dir, free_ports(), None, Vec::new())
    }

    fn launch(dir: &Path, port: u16, metadata: Option<String>, args: Vec<String>) -> Cluster {
        let relative = !args.iter().any(|a| a == "--plain");
        // FLOE_E2E_ENGINE=log runs the suite's clusters on the chained-log engine, each
        // chain 3 x 1 GiB (sparse): a full 1 GiB volume's replicas must still fit on the
        // four servers left when a test kills two (at the default 256 MiB they did not,
        // and the chunks never healed).
        let engine = std::env::var("FLOE_E2E_ENGINE")
            .ok()
            .filter(|_| !args.iter().any(|a| a == "--engine"));
        let disk_size = engine
            .as_ref()
            .filter(|_| !args.iter().any(|a| a == "--disk-size"))
            .map(|_| ["--disk-size", "1G"]);
        let mut command = Command::new(FLOE);
        command.arg("demo");
        match (relative, dir.parent(), dir.file_name()) {
            (true, Some(parent), Some(name)) => command.current_dir(parent).arg("--dir").arg(name),
            _ => command.arg("--dir").arg(dir),
        };
        command
            .args(["--port", &port.to_string()])
            .args(["--nbd-port", &(port + NBD_PORT_OFFSET).to_string()])
            .args(["--size", "1G"])
            .args(&args)
            .args(engine.iter().flat_map(|e| ["--engine", e]))
            .args(disk_size.iter().flatten())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(m) = &metadata {
            command.args(["--metadata", m]);
        }
        let _ = std::fs::remove_file(dir.join("demo.json"));
        let mut demo = command.spawn().expect("floe demo starts");
        let deadline = Instant::now() + Duration::from_secs(90);
        let info = loop {
            if let Ok(text) = std::fs::read_to_string(dir.join("demo.json")) {
                if let Ok(info) = serde_json::from_str::<DemoFile>(&text) {
                    break info;
                }
            }
            if let Ok(Some(status)) = demo.try_wait() {
                panic!(
                    "floe demo exited before ready: {status}; the end of its logs:\n{}",
                    log_tails(dir)
                );
            }
            assert!(Instant::now() < deadline, "floe demo not ready in time");
            std::thread::sleep(Duration::from_millis(100));
        };
        Cluster {
            dir: dir.to_path_buf(),
            port,
            metadata,
            args,
            demo: Some(demo),
            info,
        }
    }

    pub fn uri(&self) -> &str {
        &self.info.nbd_uri
    }

    /// Closes the pipe the demo reports on, as `floe demo | head` does.
    pub fn close_demo_stdout(&mut self) {
        drop(self.demo.as_mut().and_then(|demo| demo.stdout.take()));
    }

    /// Stops the whole cluster as a user would (SIGTERM to the demo) and waits.
    pub fn stop(&mut self) {
        if let Some(mut demo) = self.demo.take() {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(demo.id() as i32, libc::SIGTERM) };
            let status = demo.wait().expect("demo exits");
            assert!(status.success(), "floe demo stopped uncleanly: {status}");
        }
    }

    /// Stops the cluster and starts it again on the same directory and ports.
    pub fn restart(&mut self) {
        self.stop();
        let again = Cluster::launch(
            &self.dir,
            self.port,
            self.metadata.clone(),
            self.args.clone(),
        );
        *self = again;
    }

    /// Starts a stopped cluster again on the same directory and ports (the crash test
    /// inspects the data directories in between).
    pub fn start_again(&mut self) {
        assert!(self.demo.is_none(), "cluster still running");
        *self = Cluster::launch(
            &self.dir,
            self.port,
            self.metadata.clone(),
            self.args.clone(),
        );
    }

    /// Polls `floe status` until no chunk is degraded and none waits to move back to
    /// where the map places it (a returning server gets its replicas back); how long
    /// that took.
    pub fn wait_for_redundancy(&self, timeout: Duration) -> Duration {
        let started = Instant::now();
        self.wait_for_status("every chunk has all its replicas", timeout);
        self.wait_for_status("every chunk is where the map places it", timeout);
        self.wait_for_status("every chunk has all its replicas", timeout);
        started.elapsed()
    }

    /// Polls `floe status` until its output contains `text`; how long that took. A
    /// master that does not answer (yet: tests restart it) counts as not there yet.
    pub fn wait_for_status(&self, text: &str, timeout: Duration) -> Duration {
        let started = Instant::now();
        loop {
            let out = crate::io_helpers::floe_output(self, &["status"]);
            let status = if out.status.success() {
                String::from_utf8_lossy(&out.stdout).into_owned()
            } else {
                format!(
                    "(floe status failed: {})",
                    String::from_utf8_lossy(&out.stderr)
                )
            };
            if status.contains(text) {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < timeout,
                "no {text:?} in `floe status` after {timeout:?}:\n{status}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Chunk server id -> its demo index, from the addresses in `floe status`: cs-n
    /// listens on port + 1 + n.
    pub fn server_indexes(&self) -> BTreeMap<u32, usize> {
        let status = self.floe_json(&["status"]);
        let mut index_of = BTreeMap::new();
        for server in status["servers"].as_array().expect("servers") {
            let address = server["address"].as_str().expect("an address");
            let port: u16 = address.rsplit(':').next().unwrap().parse().unwrap();
            let id = server["id"].as_u64().expect("an id") as u32;
            index_of.insert(id, (port - self.port - 1) as usize);
        }
        index_of
    }

    /// Chunk index -> the chunk servers (by demo index) the master lists for it.
    pub fn placement(&self) -> BTreeMap<u64, Vec<usize>> {
        let index_of = self.server_indexes();
        let info = self.floe_json(&["volume", "info", "demo"]);
        let mut out = BTreeMap::new();
        for chunk in info["chunks"].as_array().expect("chunks") {
            let holders = ids(&chunk["servers"])
                .iter()
                .map(|id| index_of[id])
                .collect();
            out.insert(chunk["index"].as_u64().expect("an index"), holders);
        }
        out
    }

    /// Runs `floe ARGS` against this cluster's master, as its operator; returns
    /// stdout.
    pub fn floe(&self, args: &[&str]) -> String {
        ok(self.command_as("admin").args(args))
    }

    /// `floe --master M`, with the certificate of `name` (`admin`, `gateway`,
    /// `chunkserver-0`, ...) when the cluster runs TLS.
    pub fn command_as(&self, name: &str) -> Command {
        let mut command = Command::new(FLOE);
        command.args(["--master", &self.info.master]);
        if let Some(certs) = &self.info.certs {
            command
                .env("FLOE_CA", certs.join("ca.pem"))
                .env("FLOE_CERT", certs.join(format!("{name}.pem")));
        }
        command
    }

    /// Runs `floe ARGS --json` against this cluster's master; returns the document.
    pub fn floe_json(&self, args: &[&str]) -> serde_json::Value {
        let out = self.floe(&[args, &["--json"]].concat());
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("floe {args:?} --json: {e}: {out}"))
    }
}

/// A JSON array of server ids.
pub fn ids(array: &serde_json::Value) -> Vec<u32> {
    let ids = array.as_array().expect("an array of ids");
    ids.iter()
        .map(|id| id.as_u64().expect("an id") as u32)
        .collect()
}

/// The volume named `name` in a `floe volume list --json` document.
pub fn volume<'a>(list: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    let volumes = list["volumes"].as_array().expect("volumes");
    volumes.iter().find(|v| v["name"] == name)
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(mut demo) = self.demo.take() {
            unsafe { libc::kill(demo.id() as i32, libc::SIGTERM) };
            let _ = demo.wait();
        }
    }
}

/// A process a test started besides its cluster (another gateway...), killed when
/// the test ends, passed or failed.
pub struct Spawned(pub Child);

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs a command, panicking with its output unless it succeeds; returns stdout.
pub fn ok(command: &mut Command) -> String {
    let out = output(command);
    assert!(
        out.status.success(),
        "{command:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn output(command: &mut Command) -> Output {
    command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e} (is it installed? see .ci/run)"))
}

/// `nbdsh` with the system Python, which has the libnbd module.
pub fn nbdsh() -> Command {
    let mut command = Command::new("/usr/bin/nbdsh");
    let path = std::env::var("PATH").unwrap_or_default();
    command.env("PATH", format!("/usr/bin:{path}"));
    command
}

/// A file of `bytes` random bytes.
pub fn random_file(path: &Path, bytes: usize) {
    use rand::RngCore;
    let mut data = vec![0u8; bytes];
    rand::thread_rng().fill_bytes(&mut data);
    std::fs::write(path, data).unwrap();
}
