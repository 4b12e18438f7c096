//! `floe demo`: a whole local cluster, each part its own OS process so any one can be
//! killed: a master on the embedded store, six chunk servers on three emulated hosts
//! (an `ssd` and an `hdd` device each) and a gateway, plus a ready volume.
//!
//! Writes `DIR/demo.json` with the processes' PIDs, the NBD URI and each process's
//! metrics URL, for scripts and tests, and `DIR/env`, the CLI's settings for this
//! cluster; each process logs to `DIR/logs/NAME.log`. Unless `--plain`, every
//! connection between the processes is TLS, with a CA and certificates made in
//! `DIR/certs` on the first start.

use crate::{cert, size};
use floe_client::master::MasterClient;
use floe_protocol::connection::CallError;
use floe_protocol::tls::Role;
use floe_protocol::{PlacementMode, Status, VolumeMode, VolumeSpec, WriteMode};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Options {
    pub dir: PathBuf,
    pub port: u16,
    pub masters: u16,
    pub nbd_port: u16,
    pub volume_size: u64,
    pub metadata: Option<String>,
    pub placement: PlacementMode,
    pub mode: VolumeMode,
    pub write_mode: WriteMode,
    pub emulate_hdd: bool,
    pub journal_quota: u64,
    pub plain: bool,
    pub no_metrics: bool,
    /// `--engine log`: every chunk server a chain of three disks of this many bytes.
    pub chain_disk_bytes: Option<u64>,
    /// More `floe chunkserver` flags for every chain (`--gc`, `--cache-size`).
    pub chain_flags: Vec<String>,
    /// Also serve the volumes over NFSv3 (`floe nfs`) on this port.
    pub nfs_port: Option<u16>,
    /// The gateway also serves block transactions on this port.
    pub tx_port: Option<u16>,
}

/// Prints a line of the demo's report; a closed stdout (`floe demo | head`) ends the
/// report, not the cluster.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// (host, device class) of each chunk server.
const CHUNK_SERVERS: [(&str, &str); 6] = [
    ("host-a", "ssd"),
    ("host-a", "hdd"),
    ("host-b", "ssd"),
    ("host-b", "hdd"),
    ("host-c", "ssd"),
    ("host-c", "hdd"),
];
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The demo's NBD client certificate (`DIR/certs/client/` for QEMU and libnbd), and
/// its pre-shared key's identity.
const NBD_CLIENT: &str = "client";
/// The gateway's pre-shared keys for TLS-PSK clients, `DIR/certs/psk/keys.psk`
/// (QEMU's `tls-creds-psk` reads `keys.psk` in the directory it is given).
const PSK_FILE: &str = "psk/keys.psk";
/// Validity of the demo's certificates, in days.
const CERT_DAYS: i64 = 3650;

#[derive(Serialize)]
struct DemoFile {
    nbd_uri: String,
    /// Every master's address (`a,b,c`), in the order of `master_pids`.
    master: String,
    master_pid: u32,
    master_pids: Vec<u32>,
    chunkserver_pids: Vec<u32>,
    gateway_pid: u32,
    /// `floe nfs`, with `--nfs-port`.
    nfs_pid: Option<u32>,
    /// The cluster's certificates (`NAME.pem` per process, `admin.pem`, `ca.pem`),
    /// unless `--plain`.
    certs: Option<PathBuf>,
    /// Each process's `/metrics` URL, by its log's name; empty with `--no-metrics`.
    metrics: BTreeMap<String, String>,
}

/// The demo's certificates: one per process, and the operator's.
struct Credentials {
    dir: PathBuf,
}

impl Credentials {
    /// Makes what `dir` lacks: a CA on the first start, then a certificate for
    /// every process the demo may run.
    fn prepare(dir: PathBuf) -> Result<Credentials, String> {
        if !dir.join("ca.pem").exists() {
            cert::init(&dir)?;
        }
        let masters = ["master", "master-1", "master-2"].map(|m| (m.to_string(), Role::Master));
        let chunkservers =
            (0..CHUNK_SERVERS.len()).map(|i| (format!("chunkserver-{i}"), Role::Chunkserver));
        let others = [
            ("gateway".to_string(), Role::Gateway),
            // It opens volumes, takes leases and writes as the gateway does.
            ("nfs".to_string(), Role::Gateway),
            ("admin".to_string(), Role::Admin),
            (NBD_CLIENT.to_string(), Role::Client),
        ];
        let hosts = ["localhost".to_string(), "127.0.0.1".to_string()];
        for (name, role) in masters.into_iter().chain(chunkservers).chain(others) {
            if !dir.join(format!("{name}.pem")).exists() {
                cert::issue(&dir, &name, role, &hosts, CERT_DAYS)?;
            }
        }
        let psk = dir.join(PSK_FILE);
        if !psk.exists() {
            std::fs::create_dir_all(psk.parent().expect("in a directory"))
                .map_err(|e| format!("cannot create {}: {e}", psk.display()))?;
            cert::add_psk(&psk, NBD_CLIENT)?;
        }
        let dir = dir
            .canonicalize()
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(Credentials { dir })
    }

    fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    fn cert(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.pem"))
    }

    fn psk(&self) -> PathBuf {
        self.dir.join(PSK_FILE)
    }
}

/// `args` for process `name`, with its certificate when the demo runs TLS.
fn with_credentials(
    credentials: Option<&Credentials>,
    name: &str,
    args: Vec<String>,
) -> Vec<String> {
    let Some(credentials) = credentials else {
        return args;
    };
    let mut out = vec![
        "--ca".to_string(),
        credentials.ca().display().to_string(),
        "--cert".to_string(),
        credentials.cert(name).display().to_string(),
    ];
    out.extend(args);
    out
}

struct Process {
    name: String,
    child: Child,
    exited: bool,
    /// Where it serves its metrics.
    metrics: Option<String>,
}

impl Process {
    /// Starts `floe ARGS`, which listens on `listen`.
    fn spawn(
        name: &str,
        args: &[String],
        listen: &str,
        options: &Options,
        logs: &Path,
    ) -> Result<Process, String> {
        let mut arguments = args.to_vec();
        let metrics = match options.no_metrics {
            true => {
                arguments.extend(self::args(&["--metrics-listen", "off"]));
                None
            }
            false => crate::metrics::default_address(listen).map(|a| format!("http://{a}/metrics")),
        };
        let log_path = logs.join(format!("{name}.log"));
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut command = Command::new(exe);
        command
            .args(&arguments)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            // Own process group: Ctrl-C reaches only the demo, which stops the
            // children in order.
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; it makes the child die with the demo
        // even when the demo itself is killed with SIGKILL.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        Ok(Process {
            name: name.to_string(),
            child,
            exited: false,
            metrics,
        })
    }

    /// Reports once if the process has died.
    fn check(&mut self, logs: &Path) {
        if self.exited {
            return;
        }
        if let Ok(Some(status)) = self.child.try_wait() {
            self.exited = true;
            eprintln!(
                "floe demo: {} exited ({status}); see {}",
                self.name,
                logs.join(format!("{}.log", self.name)).display()
            );
        }
    }

    /// Waits until `ready` says the process serves at `address` and it still runs a
    /// moment later: another process may hold the port, and then ours exits.
    async fn wait_ready(
        &mut self,
        address: &str,
        ready: impl AsyncFn(&str) -> bool,
        deadline: Instant,
        logs: &Path,
    ) -> Result<(), String> {
        loop {
            let serving = ready(address).await;
            if serving {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            self.check(logs);
            if self.exited || Instant::now() > deadline {
                return Err(format!(
                    "{} did not start on {address} (is the port taken?); see {}",
                    self.name,
                    logs.join(format!("{}.log", self.name)).display()
                ));
            }
            if serving {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn signal(&self, signal: i32) {
        if !self.exited {
            // SAFETY: kill(2) on our own child's PID.
            unsafe { libc::kill(self.child.id() as i32, signal) };
        }
    }

    fn stop(&mut self) {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("floe demo: {} did not stop in time; killing it", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

pub async fn run(options: Options) -> Result<(), String> {
    let dir = &options.dir;
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| format!("cannot create {}: {e}", logs.display()))?;
    // The first master at the port, more after the chunk servers' six.
    let master_address = (0..options.masters)
        .map(|i| match i {
            0 => format!("127.0.0.1:{}", options.port),
            i => format!(
                "127.0.0.1:{}",
                options.port + CHUNK_SERVERS.len() as u16 + i
            ),
        })
        .collect::<Vec<_>>()
        .join(",");
    if options.masters > 1
        && !options
            .metadata
            .as_deref()
            .is_some_and(|m| m.starts_with("etcd://"))
    {
        return Err(
            "several masters share an etcd store: give --metadata etcd://HOST:PORT/PREFIX".into(),
        );
    }
    let metadata = options.metadata.clone().unwrap_or_else(|| {
        format!(
            "embedded:{}",
            dir.join("master").join("meta.redb").display()
        )
    });
    let credentials = match options.plain {
        true => None,
        false => Some(Credentials::prepare(dir.join("certs"))?),
    };
    if let Some(credentials) = &credentials {
        floe_protocol::tls::install(&credentials.ca(), &credentials.cert("admin"))?;
    }
    let mut processes = Vec::new();
    let result = start(
        &options,
        &master_address,
        &metadata,
        credentials.as_ref(),
        &mut processes,
    )
    .await;
    if let Err(e) = result {
        stop_all(&mut processes);
        return Err(e);
    }
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    let mut check = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = terminate.recv() => break,
            _ = check.tick() => processes.iter_mut().for_each(|p| p.check(&logs)),
        }
    }
    say!("stopping...");
    stop_all(&mut processes);
    say!("stopped; data kept in {}", dir.display());
    Ok(())
}

/// Stops the front ends first (NFS, then the gateway: no new I/O), then chunk
/// servers, then the master.
fn stop_all(processes: &mut [Process]) {
    for p in processes.iter_mut().rev() {
        p.stop();
    }
}

/// Hybrid mode for an hdd server: its journal lives in the data directory of the same
/// host's ssd server (URSA: journals on an ssd of the same machine).
fn hdd_arguments(options: &Options, host: &str) -> Vec<String> {
    let ssd = CHUNK_SERVERS
        .iter()
        .position(|&(h, class)| h == host && class == "ssd")
        .expect("every demo host has an ssd server");
    let journal = options.dir.join(format!("cs-{ssd}")).join("hdd-journal");
    let mut out = args(&["--journal", &journal.display().to_string()]);
    out.extend(args(&[
        "--journal-quota",
        &options.journal_quota.to_string(),
    ]));
    if options.emulate_hdd {
        out.push("--emulate-hdd".into());
    }
    out
}

/// `--engine log`: the server's chain, three disk directories and the map's cache
/// in its data directory (on one file system: a demo of the layout, not of hdds).
fn chain_arguments(data: &Path, disk_bytes: u64) -> Vec<String> {
    let mut out = args(&["--engine", "log"]);
    for disk in 0..3 {
        let dir = data.join(format!("chain-disk-{disk}"));
        out.extend(args(&["--disk", &dir.display().to_string()]));
    }
    let cache = data.join("chain-cache").display().to_string();
    out.extend(args(&[
        "--cache",
        &cache,
        "--disk-size",
        &disk_bytes.to_string(),
    ]));
    out
}

async fn start(
    options: &Options,
    master_address: &str,
    metadata: &str,
    credentials: Option<&Credentials>,
    processes: &mut Vec<Process>,
) -> Result<(), String> {
    let dir = &options.dir;
    let logs = &dir.join("logs");
    let spawn = |name: &str, args: Vec<String>, listen: &str| {
        let args = with_credentials(credentials, name, args);
        Process::spawn(name, &args, listen, options, logs)
    };
    let masters: Vec<&str> = master_address.split(',').collect();
    for (i, listen) in masters.iter().enumerate() {
        say!("starting master on {listen} ({metadata})");
        let name = match i {
            0 => "master".to_string(),
            i => format!("master-{i}"),
        };
        processes.push(spawn(
            &name,
            args(&[
                "master",
                "--listen",
                listen,
                "--metadata",
                metadata,
                "--placement",
                &options.placement.to_string(),
            ]),
            listen,
        )?);
    }
    say!(
        "starting {} chunk servers{}",
        CHUNK_SERVERS.len(),
        if options.emulate_hdd {
            " (hdd ones emulated: modelled seek, rotation and transfer times)"
        } else {
            ""
        }
    );
    for (i, (host, class)) in CHUNK_SERVERS.iter().enumerate() {
        let data = dir.join(format!("cs-{i}"));
        let listen = format!("127.0.0.1:{}", options.port + 1 + i as u16);
        let mut arguments = args(&[
            "chunkserver",
            "--dir",
            &data.display().to_string(),
            "--listen",
            &listen,
            "--master",
            master_address,
            "--host",
            host,
            "--class",
            class,
        ]);
        match options.chain_disk_bytes {
            Some(bytes) => {
                arguments.extend(chain_arguments(&data, bytes));
                arguments.extend(options.chain_flags.iter().cloned());
            }
            None if *class == "hdd" => arguments.extend(hdd_arguments(options, host)),
            None => {}
        }
        processes.push(spawn(&format!("chunkserver-{i}"), arguments, &listen)?);
    }
    let master = MasterClient::new(master_address);
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let mut shown = usize::MAX;
    loop {
        for p in processes.iter_mut() {
            p.check(logs);
            if p.exited {
                return Err(format!(
                    "{} failed to start; see {}",
                    p.name,
                    logs.join(format!("{}.log", p.name)).display()
                ));
            }
        }
        let up = match master.status().await {
            Ok(status) => status.servers.iter().filter(|s| s.up).count(),
            Err(_) => 0,
        };
        if up != shown {
            say!("  {up}/{} chunk servers registered", CHUNK_SERVERS.len());
            shown = up;
        }
        if up >= CHUNK_SERVERS.len() {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "chunk servers did not register within {}s; see the logs in {}",
                STARTUP_TIMEOUT.as_secs(),
                logs.display()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let spec = VolumeSpec {
        name: "demo".into(),
        size_bytes: options.volume_size,
        replicas: 3,
        chunk_bytes: floe_protocol::CHUNK_BYTES_DEFAULT,
        stripe_unit_bytes: floe_protocol::STRIPE_UNIT_BYTES_DEFAULT,
        stripe_count: floe_protocol::STRIPE_COUNT_DEFAULT,
        mode: options.mode,
        write_mode: options.write_mode,
    };
    match master.create_volume(spec).await {
        Ok(v) => say!(
            "created volume demo ({}, {}, 3 replicas on 3 hosts)",
            size::format(v.spec.size_bytes),
            v.spec.mode
        ),
        Err(CallError::Remote {
            status: Status::AlreadyExists,
            ..
        }) => say!("volume demo already exists; keeping its data"),
        Err(e) => return Err(format!("cannot create volume demo: {e}")),
    }
    let nbd_address = format!("127.0.0.1:{}", options.nbd_port);
    say!("starting gateway on {nbd_address}");
    let mut gateway = args(&[
        "gateway",
        "--listen",
        &nbd_address,
        "--master",
        master_address,
    ]);
    if let Some(credentials) = credentials {
        gateway.extend(["--nbd-psk".into(), credentials.psk().display().to_string()]);
    }
    let tx_address = options.tx_port.map(|port| format!("127.0.0.1:{port}"));
    if let Some(address) = &tx_address {
        gateway.extend(["--tx-listen".into(), address.clone()]);
    }
    processes.push(spawn("gateway", gateway, &nbd_address)?);
    let gateway = processes.last_mut().expect("gateway pushed");
    gateway
        .wait_ready(&nbd_address, speaks_nbd, deadline, logs)
        .await?;
    let nfs_address = match options.nfs_port {
        Some(port) => {
            let nfs = start_nfs(port, master_address, deadline, logs, &spawn, processes);
            Some(nfs.await?)
        }
        None => None,
    };
    let pid_of = |name: &str| {
        processes
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.child.id())
    };
    let uri = format!("nbd://{nbd_address}/demo");
    let file = DemoFile {
        nbd_uri: uri.clone(),
        master: master_address.to_string(),
        master_pid: processes[0].child.id(),
        master_pids: processes[..masters.len()]
            .iter()
            .map(|p| p.child.id())
            .collect(),
        chunkserver_pids: processes[masters.len()..masters.len() + CHUNK_SERVERS.len()]
            .iter()
            .map(|p| p.child.id())
            .collect(),
        gateway_pid: pid_of("gateway").expect("the gateway started"),
        nfs_pid: pid_of("nfs"),
        certs: credentials.map(|c| c.dir.clone()),
        metrics: processes
            .iter()
            .filter_map(|p| Some((p.name.clone(), p.metrics.clone()?)))
            .collect(),
    };
    let json = serde_json::to_vec_pretty(&file).expect("demo file serializes");
    std::fs::write(dir.join("demo.json"), json).map_err(|e| e.to_string())?;
    let env = dir.join("env");
    std::fs::write(&env, cli_settings(master_address, credentials))
        .map_err(|e| format!("cannot write {}: {e}", env.display()))?;
    say!();
    say!("ready: {uri}");
    say!("  try: nbdinfo {uri}");
    match credentials {
        Some(c) => {
            say!(
                "  over TLS: nbds://{nbd_address}/demo?tls-certificates={}",
                c.dir.join(NBD_CLIENT).display()
            );
            say!(
                "  over TLS-PSK: nbds://{NBD_CLIENT}@{nbd_address}/demo?tls-psk-file={}",
                c.psk().display()
            );
            say!(
                "  TLS between the processes; certificates in {}",
                c.dir.display()
            );
        }
        None => say!("  plain TCP between the processes (--plain)"),
    }
    if let Some(address) = &tx_address {
        say!("  transactions: floe kv put --volume VOLUME --gateway {address} KEY VALUE");
    }
    if let Some(address) = &nfs_address {
        let port = options.nfs_port.unwrap_or_default();
        say!("  NFSv3 at {address}, export {}:", floe_nfs::EXPORT);
        say!(
            "    nfs-ls 'nfs://127.0.0.1{}/?nfsport={port}&mountport={port}&version=3'",
            floe_nfs::EXPORT
        );
        say!(
            "    mount -t nfs -o vers=3,tcp,port={port},mountport={port},nolock \
             127.0.0.1:{} /mnt",
            floe_nfs::EXPORT
        );
    }
    say!(
        "  logs: {}   status: . {}; floe status",
        logs.display(),
        env.display()
    );
    if let Some(gateway) = file.metrics.get("gateway") {
        say!("  per-volume I/O: floe top --metrics {gateway}");
        say!("  metrics:");
        for (name, url) in &file.metrics {
            say!("    {name:<14} {url}");
        }
    }
    say!(
        "  Ctrl-C stops the cluster; data stays in {}",
        dir.display()
    );
    Ok(())
}

/// Starts `floe nfs` on 127.0.0.1:`port`; ready when the port accepts connections
/// and the process still runs.
async fn start_nfs(
    port: u16,
    master_address: &str,
    deadline: Instant,
    logs: &Path,
    spawn: &impl Fn(&str, Vec<String>, &str) -> Result<Process, String>,
    processes: &mut Vec<Process>,
) -> Result<String, String> {
    let address = format!("127.0.0.1:{port}");
    say!("starting nfs on {address}");
    let nfs_args = args(&["nfs", "--listen", &address, "--master", master_address]);
    processes.push(spawn("nfs", nfs_args, &address)?);
    let listening = async |address: &str| tokio::net::TcpStream::connect(address).await.is_ok();
    let nfs = processes.last_mut().expect("nfs pushed");
    nfs.wait_ready(&address, listening, deadline, logs).await?;
    Ok(address)
}

/// The CLI's settings for this cluster, as shell exports.
fn cli_settings(master: &str, credentials: Option<&Credentials>) -> String {
    let mut out = format!("export FLOE_MASTER={master}\n");
    if let Some(c) = credentials {
        out += &format!(
            "export FLOE_CA={}\nexport FLOE_CERT={}\n",
            c.ca().display(),
            c.cert("admin").display()
        );
    }
    out
}

/// Whether the server at `address` sends an NBD greeting.
async fn speaks_nbd(address: &str) -> bool {
    use tokio::io::AsyncReadExt;
    let Ok(mut stream) = tokio::net::TcpStream::connect(address).await else {
        return false;
    };
    let mut magic = [0u8; 8];
    let read = tokio::time::timeout(Duration::from_secs(1), stream.read_exact(&mut magic)).await;
    matches!(read, Ok(Ok(_))) && &magic == b"NBDMAGIC"
}
