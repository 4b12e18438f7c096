//! An in-process NBD server over RAM devices, and helpers to drive it with the real
//! NBD clients installed on the machine.

use async_trait::async_trait;
use floe_blockdev::{BlockDevice, Extent, IoError, MemoryDevice};
use floe_nbd::{Client, Exports, Handover, Parked, Refusal, Security, Stop};
use std::collections::BTreeMap;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio::sync::oneshot;

pub const MIB: u64 = 1 << 20;
pub const DISK_SIZE: u64 = 64 * MIB;
pub const DEFAULT_SIZE: u64 = MIB;

/// Fails every write with a fixed error, to check the errno mapping.
pub struct WritesFail(pub MemoryDevice, pub IoError);

#[async_trait]
impl BlockDevice for WritesFail {
    fn size(&self) -> u64 {
        self.0.size()
    }
    async fn read(&self, offset: u64, length: u32) -> Result<bytes::Bytes, IoError> {
        self.0.read(offset, length).await
    }
    async fn write(&self, _: u64, _: bytes::Bytes, _: bool) -> Result<(), IoError> {
        Err(self.1.clone())
    }
    async fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }
    async fn trim(&self, _: u64, _: u64) -> Result<(), IoError> {
        Err(self.1.clone())
    }
    async fn write_zeroes(&self, _: u64, _: u64, _: bool) -> Result<(), IoError> {
        Err(self.1.clone())
    }
    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        self.0.extents(offset, length).await
    }
}

/// Reads take a while, to have requests in flight when the server is stopped.
pub struct SlowReads(pub MemoryDevice);

#[async_trait]
impl BlockDevice for SlowReads {
    fn size(&self) -> u64 {
        self.0.size()
    }
    async fn read(&self, offset: u64, length: u32) -> Result<bytes::Bytes, IoError> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.0.read(offset, length).await
    }
    async fn write(&self, offset: u64, data: bytes::Bytes, fua: bool) -> Result<(), IoError> {
        self.0.write(offset, data, fua).await
    }
    async fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }
    async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError> {
        self.0.trim(offset, length).await
    }
    async fn write_zeroes(&self, offset: u64, length: u64, punch: bool) -> Result<(), IoError> {
        self.0.write_zeroes(offset, length, punch).await
    }
    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        self.0.extents(offset, length).await
    }
}

struct TestExports(BTreeMap<String, Arc<dyn BlockDevice>>);

#[async_trait]
impl Exports for TestExports {
    async fn list(&self) -> Result<Vec<String>, String> {
        Ok(self.0.keys().cloned().collect())
    }
    async fn open(&self, name: &str, _: &Client) -> Result<Arc<dyn BlockDevice>, Refusal> {
        self.0
            .get(name)
            .cloned()
            .ok_or_else(|| Refusal::Unknown(format!("no volume named {name:?} here")))
    }
}

/// Exports: "disk" (64 MiB), "" (1 MiB), "ro" (writes fail with EPERM), "full"
/// (writes fail with ENOSPC), "slow" (reads take 300 ms).
pub struct Server {
    pub port: u16,
    pub disk: Arc<MemoryDevice>,
    runtime: Runtime,
    stop: Option<oneshot::Sender<Stop>>,
    served: Option<tokio::task::JoinHandle<Option<Handover>>>,
}

impl Server {
    pub fn start() -> Server {
        Server::start_on(None, Vec::new(), Arc::new(MemoryDevice::new(DISK_SIZE)))
    }

    /// A new server (its own runtime, as a new process would have) serving on what
    /// `handover` holds, with the same "disk".
    pub fn resume(handover: Handover, disk: Arc<MemoryDevice>) -> Server {
        Server::start_on(Some(handover.listener), handover.connections, disk)
    }

    fn start_on(
        listener: Option<std::net::TcpListener>,
        resumed: Vec<Parked>,
        disk: Arc<MemoryDevice>,
    ) -> Server {
        // RUST_LOG=floe_nbd=debug shows the server's side of a failing test.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let mut exports: BTreeMap<String, Arc<dyn BlockDevice>> = BTreeMap::new();
        exports.insert("disk".into(), disk.clone());
        exports.insert(String::new(), Arc::new(MemoryDevice::new(DEFAULT_SIZE)));
        let ro = WritesFail(MemoryDevice::new(MIB), IoError::ReadOnly);
        exports.insert("ro".into(), Arc::new(ro));
        let full = WritesFail(
            MemoryDevice::new(MIB),
            IoError::NoSpace("pool empty".into()),
        );
        exports.insert("full".into(), Arc::new(full));
        exports.insert("slow".into(), Arc::new(SlowReads(MemoryDevice::new(MIB))));
        let listener = runtime.block_on(async {
            match listener {
                Some(listener) => TcpListener::from_std(listener).unwrap(),
                None => TcpListener::bind("127.0.0.1:0").await.unwrap(),
            }
        });
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = oneshot::channel::<Stop>();
        let served = runtime.spawn(floe_nbd::serve(
            listener,
            Arc::new(TestExports(exports)),
            Security::default(),
            resumed,
            async { stopped.await.unwrap_or(Stop::Shutdown) },
        ));
        Server {
            port,
            disk,
            runtime,
            stop: Some(stop),
            served: Some(served),
        }
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.port)
    }

    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.runtime.block_on(f)
    }

    /// Reads the "disk" export directly, bypassing NBD.
    pub fn disk_read(&self, offset: u64, length: u32) -> Vec<u8> {
        self.block_on(self.disk.read(offset, length))
            .unwrap()
            .to_vec()
    }

    /// Writes the "disk" export directly, bypassing NBD.
    pub fn disk_write(&self, offset: u64, data: &[u8]) {
        let data = bytes::Bytes::copy_from_slice(data);
        self.block_on(self.disk.write(offset, data, false)).unwrap();
    }

    pub fn disk_extents(&self, offset: u64, length: u64) -> Vec<Extent> {
        self.block_on(self.disk.extents(offset, length)).unwrap()
    }

    /// Asks `serve` to stop; returns whether it returned within `timeout`.
    pub fn stop(&mut self, timeout: Duration) -> bool {
        let _ = self.stop.take().expect("stopped once").send(Stop::Shutdown);
        let served = self.served.take().unwrap();
        self.block_on(async { tokio::time::timeout(timeout, served).await })
            .is_ok()
    }

    /// Stops `serve` for a handover: its listener and parked connections.
    pub fn hand_over(&mut self) -> Handover {
        let _ = self.stop.take().expect("stopped once").send(Stop::Handover);
        let served = self.served.take().unwrap();
        self.block_on(async { tokio::time::timeout(Duration::from_secs(10), served).await })
            .expect("serve returns")
            .expect("serve did not panic")
            .expect("a handover")
    }
}

/// Panics with a hint when a client this suite needs is not installed.
pub fn tool(name: &str) -> Command {
    let found = Command::new("which")
        .arg(name)
        .output()
        .map(|o| o.status.success());
    assert!(
        matches!(found, Ok(true)),
        "{name} not installed: apt-get install -y qemu-utils libnbd-bin python3-libnbd fio nbdkit"
    );
    let mut command = Command::new(name);
    if name == "nbdsh" {
        // The libnbd module is only installed for the system python.
        let path = std::env::var("PATH").unwrap_or_default();
        command.env("PATH", format!("/usr/bin:{path}"));
    }
    command
}

/// Runs a client, killing it if it hangs (a stuck server must fail, not hang, a test).
pub fn run(command: &mut Command) -> Output {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let pid = child.id();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output()));
    match finished.recv_timeout(Duration::from_secs(120)) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("{command:?} timed out");
        }
    }
}

/// Runs a client that must succeed; returns its stdout.
pub fn succeed(command: &mut Command) -> String {
    let output = run(command);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{command:?} failed: {}\n{stdout}\n{stderr}",
        output.status
    );
    stdout
}

/// Runs a client that must fail; returns its stdout and stderr together.
pub fn fail(command: &mut Command) -> String {
    let output = run(command);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        !output.status.success(),
        "{command:?} unexpectedly succeeded:\n{text}"
    );
    text
}
