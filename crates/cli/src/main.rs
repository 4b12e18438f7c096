//! `floe`: one binary for every Floe process and the admin commands.

mod admin;
mod bank;
mod cert;
mod cluster;
mod copy_tuning;
mod demo;
mod engine;
mod gateway_upgrade;
mod kv;
mod kv_bench;
mod kv_index;
mod metrics;
mod placement;
mod progress;
mod sessions;
mod size;
mod snapshot;
mod top;
mod views;

use clap::{Parser, Subcommand};
use floe_client::master::MasterClient;
use floe_protocol::{DeviceClass, PlacementMode, VolumeMode, VolumeSpec, WriteMode};
use std::io::IsTerminal;
use std::path::PathBuf;

/// Every process allocates a buffer or two per request; glibc's allocator spent about
/// 5% of their CPU on 4 KiB writes (perf), mimalloc's thread-local pages less.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "floe",
    version,
    about = "Floe: a distributed block store for virtual disks"
)]
struct Cli {
    /// Address of the master (for admin commands and processes that talk to it), or
    /// of several masters (`a,b,c`) of which one leads.
    #[arg(
        long,
        global = true,
        env = "FLOE_MASTER",
        default_value = "127.0.0.1:7700"
    )]
    master: String,
    /// The cluster CA's certificate: with --cert, every connection this process
    /// makes or serves is TLS (see `floe cert`).
    #[arg(long, global = true, env = "FLOE_CA", requires = "cert")]
    ca: Option<PathBuf>,
    /// This process's certificate and key, one PEM file from `floe cert issue`.
    #[arg(long, global = true, env = "FLOE_CERT", requires = "ca")]
    cert: Option<PathBuf>,
    /// Serve the cluster protocol without TLS on addresses other than loopback, and
    /// `floe nfs` beyond loopback (refused otherwise: anyone who reaches them could
    /// read and write any volume).
    #[arg(long, global = true)]
    insecure: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a local cluster with a ready volume `demo`, until Ctrl-C.
    Demo {
        /// Data directory; started again on the same one, the data is still there.
        #[arg(long, default_value = "floe-data")]
        dir: PathBuf,
        /// Master port; chunk servers take the next six, more masters the two after.
        #[arg(long, default_value_t = 7700)]
        port: u16,
        /// Masters to run: one, or several on an etcd store (`--metadata etcd://...`)
        /// of which one leads and the others stand by.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=3))]
        masters: u16,
        /// Port of the gateway's NBD exports.
        #[arg(long, default_value_t = 10809)]
        nbd_port: u16,
        /// Size of the demo volume when it is created.
        #[arg(long, default_value = "10G", value_parser = size::parse)]
        size: u64,
        /// Metadata store instead of the embedded one, e.g. etcd://127.0.0.1:2379/floe.
        #[arg(long)]
        metadata: Option<String>,
        /// Placement of a new cluster: mapx (growth moves nothing) or crush.
        #[arg(long, default_value = "mapx")]
        placement: PlacementMode,
        /// Device classes of the demo volume: ssd, hybrid or hdd.
        #[arg(long, default_value = "hybrid")]
        mode: VolumeMode,
        /// Write mode of the demo volume when it is created (see `volume create`).
        #[arg(long, default_value = "write-through")]
        write_mode: WriteMode,
        /// Emulate hdd latencies on the hdd chunk servers (labelled as emulation).
        #[arg(long)]
        emulate_hdd: bool,
        /// Quota of each hdd server's journals: six servers share the demo's file
        /// system, and journals are allocated when a server starts.
        #[arg(long, value_parser = size::parse, default_value = "256M")]
        journal_quota: u64,
        /// Plain TCP between the processes instead of TLS with certificates the demo
        /// makes in DIR/certs.
        #[arg(long)]
        plain: bool,
        /// Start every process with `--metrics-listen off`.
        #[arg(long)]
        no_metrics: bool,
        /// Chunk store engine of every chunk server: files, or log (each server a
        /// chain of three disk directories in its data directory; no journals).
        #[arg(long, value_enum, default_value = "files")]
        engine: engine::Engine,
        /// (--engine log) Bytes of each chain disk's log.
        #[arg(long, value_parser = size::parse, default_value = "256M")]
        disk_size: u64,
        /// (--engine log) How every chain is cleaned (`floe chunkserver --gc`).
        #[arg(long, value_enum)]
        gc: Option<engine::Gc>,
        /// (--engine log) Bytes of every chain's flash tail cache (`floe chunkserver
        /// --cache-size`).
        #[arg(long, value_parser = size::parse)]
        cache_size: Option<u64>,
        /// Also serve the volumes over NFSv3 (`floe nfs`) on this port of 127.0.0.1;
        /// 111 lets clients that ask the portmapper (QEMU's nfs driver) find it.
        #[arg(long)]
        nfs_port: Option<u16>,
        /// Also serve block transactions from the gateway on this port of 127.0.0.1
        /// (`floe kv --gateway 127.0.0.1:PORT`).
        #[arg(long)]
        tx_port: Option<u16>,
    },
    /// Run the master.
    Master {
        /// Address to serve chunk servers, gateways and the CLI on.
        #[arg(long, default_value = "127.0.0.1:7700")]
        listen: String,
        /// Where the cluster's metadata is stored: embedded:PATH (a redb file) or
        /// etcd://HOST:PORT[,HOST:PORT]/PREFIX.
        #[arg(long)]
        metadata: String,
        /// Chunks repaired at once after a failure.
        #[arg(long, default_value_t = floe_master::recovery::Limits::default().concurrency)]
        recovery_concurrency: usize,
        /// Copy rate of each chunk repair, e.g. 200M (0: unlimited).
        #[arg(long, default_value = "200M", value_parser = size::parse)]
        recovery_rate: u64,
        /// Chunks moved at once towards where the cluster map places them.
        #[arg(long, default_value_t = floe_master::recovery::Limits::MOVES.concurrency)]
        move_concurrency: usize,
        /// Copy rate of each chunk move, e.g. 50M (0: unlimited).
        #[arg(long, default_value = "50M", value_parser = size::parse)]
        move_rate: u64,
        /// Placement of a new cluster: mapx (growth moves nothing) or crush. For an
        /// existing cluster it must name the mode its map was created with (the master
        /// refuses to start otherwise: switching would move every chunk).
        #[arg(long, default_value = "mapx")]
        placement: PlacementMode,
        /// Time between background scrubs of every volume, e.g. 7d, 12h (0: off).
        /// Blocks a read finds corrupt are healed at once regardless.
        #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
        scrub_interval: std::time::Duration,
        /// Read rate of a background scrub over all replicas, e.g. 50M (0: unlimited).
        #[arg(long, default_value = "50M", value_parser = size::parse)]
        scrub_rate: u64,
        /// Delta chunks of deleted snapshots freed per second, in the background
        /// (0: unlimited).
        #[arg(long, default_value_t = floe_master::reclaim::ReclaimSettings::default().chunks_per_second)]
        snapshot_free_rate: u32,
        #[command(flatten)]
        metrics: metrics::MetricsArgs,
    },
    /// Run a chunk server on one data directory (`floe chunkserver --dir ...`), or
    /// administer one (`floe chunkserver mark-lost ID`).
    #[command(args_conflicts_with_subcommands = true)]
    Chunkserver {
        #[command(flatten)]
        run: Option<ChunkserverArgs>,
        #[command(flatten)]
        engine: engine::EngineArgs,
        #[command(flatten)]
        metrics: metrics::MetricsArgs,
        #[command(subcommand)]
        admin: Option<ChunkserverCommand>,
    },
    /// Run a gateway exporting volumes over NBD (`floe gateway --listen ...`), or
    /// upgrade a running one in place (`floe gateway upgrade --pid PID`).
    #[command(args_conflicts_with_subcommands = true)]
    Gateway {
        #[command(subcommand)]
        admin: Option<GatewayCommand>,
        /// Address to serve NBD clients on.
        #[arg(long, default_value = "127.0.0.1:10809")]
        listen: String,
        /// This gateway's name at the master, unique in the cluster (`floe volume
        /// move-session VOLUME --to NAME`). Default: HOST:PORT, this host's name and
        /// the --listen port.
        #[arg(long)]
        name: Option<String>,
        /// Export volumes read-only: no lease is taken, so another gateway may write.
        #[arg(long)]
        read_only: bool,
        /// Bytes of writes acknowledged early (flush-epoch and log-commit volumes) a
        /// volume may hold in memory before they retire; beyond, writes wait.
        #[arg(long, default_value = "64M", value_parser = size::parse)]
        unretired_limit: u64,
        /// Stale reads (with --read-only): read each chunk from the replica of least
        /// cost (expected read time there, times reads queued), at most this far behind the
        /// volume, e.g. 2s; reads never go back in time.
        #[arg(long, requires = "read_only", value_parser = humantime::parse_duration)]
        staleness: Option<std::time::Duration>,
        /// Who may open which volume over NBD: lines `IDENTITY VOLUME rw|ro`, IDENTITY
        /// a client certificate's name or `*`, VOLUME a name or `*`; first match
        /// decides, no match is refused. Default: anyone the transport lets in.
        #[arg(long)]
        nbd_access: Option<PathBuf>,
        /// Pre-shared keys for NBD clients that use TLS-PSK (QEMU's tls-creds-psk,
        /// libnbd's tls-psk-file): psktool's format, `IDENTITY:HEXKEY` a line; the
        /// identity is the client's name in --nbd-access.
        #[arg(long)]
        nbd_psk: Option<PathBuf>,
        /// Serve plain NBD to clients not on loopback too (with --ca and --cert they
        /// are otherwise made to start TLS; without, refused).
        #[arg(long)]
        nbd_allow_plain: bool,
        /// Address to serve block transactions on (`floe kv --gateway ADDR`), for
        /// clients with admin or client certificates (and --nbd-access's rw). A
        /// volume in use by transactions is not exported over NBD meanwhile.
        #[arg(long, conflicts_with = "read_only")]
        tx_listen: Option<String>,
        #[command(flatten)]
        metrics: metrics::MetricsArgs,
    },
    /// Serve volumes over NFSv3 as image files of their size in one directory, the
    /// export `/floe` (mount, nfs and a portmapper that names this port, all on it).
    /// NFSv3 trusts what clients say of themselves: loopback or a storage network only.
    Nfs {
        /// Address to serve NFS clients on; beyond loopback only with --insecure.
        #[arg(long, default_value = "127.0.0.1:2049")]
        listen: String,
        /// Bytes of writes acknowledged early (flush-epoch and log-commit volumes) a
        /// volume may hold in memory before they retire; beyond, writes wait.
        #[arg(long, default_value = "64M", value_parser = size::parse)]
        unretired_limit: u64,
        /// Close a volume (flushed, its lease released) no request touched for this
        /// long; the next request opens it again.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        idle_close: std::time::Duration,
        #[command(flatten)]
        metrics: metrics::MetricsArgs,
    },
    /// Manage volumes.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Show hosts, chunk servers, capacity, volumes, redundancy and recovery.
    Status {
        #[command(flatten)]
        format: views::Format,
    },
    /// Compare the replicas of every chunk of a volume and repair differences, with
    /// progress, rate and ETA on stderr.
    Scrub {
        /// The volume to scrub.
        name: String,
        #[command(flatten)]
        format: views::Format,
    },
    /// Snapshots: VOLUME@SNAPSHOT, exported read-only under that name.
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCommand),
    /// Offline placement tools: crushtool-compatible mapping, MAPX simulations.
    #[command(subcommand)]
    Placement(placement::PlacementCommand),
    /// The cluster's CA and certificates, for TLS between its processes.
    #[command(subcommand)]
    Cert(cert::CertCommand),
    /// The cluster map: show it, add new chunk servers.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Placement groups (mapx).
    #[command(subcommand)]
    Pg(cluster::PgCommand),
    /// Layers of the cluster map (mapx).
    #[command(subcommand)]
    Layer(cluster::LayerCommand),
    /// Live per-volume I/O of the gateways (IOPS, MB/s, latency), from their metrics.
    Top(top::TopArgs),
    /// A transactional key-value store on a volume that no gateway holds (this
    /// command takes its lease): put, get, del, scan.
    #[command(subcommand)]
    Kv(kv::KvCommand),
}

#[derive(clap::Args)]
struct ChunkserverArgs {
    /// Data directory: chunk files, the server's identity and its log.
    #[arg(long)]
    dir: PathBuf,
    /// Address to serve gateways, peers and the master on.
    #[arg(long)]
    listen: String,
    /// Failure domain: replicas of a chunk go to distinct hosts.
    #[arg(long)]
    host: String,
    /// Device class of the disk under --dir: ssd or hdd.
    #[arg(long, default_value = "ssd")]
    class: DeviceClass,
    /// Capacity to advertise; defaults to the size of the file system under --dir.
    #[arg(long, value_parser = size::parse)]
    capacity: Option<u64>,
    /// (hdd) Emulate a hard disk's seek, rotation and transfer times on chunk files.
    #[arg(long)]
    emulate_hdd: bool,
    /// (hdd) Journal directory on an ssd of the same host; repeat for overflow.
    #[arg(long = "journal")]
    journals: Vec<PathBuf>,
    /// Bytes each journal may fill (allocated when the server starts); defaults to a
    /// tenth of its file system, at most 2 GiB.
    #[arg(long, value_parser = size::parse)]
    journal_quota: Option<u64>,
}

#[derive(Subcommand)]
enum GatewayCommand {
    /// Make a running gateway exec its binary again (the new one, once replaced),
    /// keeping its PID, its listening socket and its plain NBD connections: clients
    /// see a pause, not a disconnect (TLS clients reconnect). Same as SIGUSR2.
    Upgrade {
        /// The gateway's process id.
        #[arg(long)]
        pid: u32,
        /// How long to wait for the gateway to run its new binary.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
}

#[derive(Subcommand)]
enum ChunkserverCommand {
    /// Declare a failed chunk server permanently lost, so chunks whose surviving
    /// replicas are a minority can be recovered from them. Acknowledged writes held
    /// only by the lost server's replicas are lost with it.
    MarkLost {
        /// The chunk server's id (`floe status` lists them).
        id: floe_protocol::ServerId,
    },
}

#[derive(Subcommand)]
enum VolumeCommand {
    /// Create a volume, thin: chunks are allocated when first written.
    Create {
        /// The volume's name, its NBD export name (no `@` or `~`).
        name: String,
        /// Size the volume exports, e.g. 10G (binary units K, M, G, T).
        #[arg(long, value_parser = size::parse)]
        size: u64,
        /// Copies of each chunk, on distinct hosts.
        #[arg(long, default_value_t = 3)]
        replicas: u32,
        /// Bytes of each chunk, the unit of allocation, placement and repair.
        #[arg(long, default_value = "64M", value_parser = size::parse)]
        chunk_size: u64,
        /// Bytes written to one chunk before the stripe moves to the next.
        #[arg(long, default_value = "64K", value_parser = size::parse)]
        stripe_unit: u64,
        /// Chunks a stripe spreads over (more: more servers share one stream).
        #[arg(long, default_value_t = floe_protocol::STRIPE_COUNT_DEFAULT)]
        stripe_count: u32,
        /// Device classes: ssd (all replicas), hybrid (primary on ssd, backups on hdd
        /// behind ssd journals) or hdd (all replicas).
        #[arg(long, default_value = "hybrid")]
        mode: VolumeMode,
        /// When writes are acknowledged: write-through (once durable on the replicas),
        /// write-back (once the replicas logged them; FLUSH syncs), flush-epoch (at
        /// once; a FLUSH orders, a crash keeps a prefix of the epochs; FUA writes
        /// durable before their reply) or log-commit (at once, and issued at once to a
        /// log in the volume's chunks; a crash keeps a prefix of the writes; chosen
        /// here only, at most 64 GiB, 4 KiB-aligned size).
        #[arg(long, default_value = "write-through")]
        write_mode: WriteMode,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Change a volume's write mode; it takes effect when the volume is next opened
    /// (not to or from log-commit: its chunks hold a log).
    SetWriteMode {
        /// The volume.
        name: String,
        /// write-through, write-back or flush-epoch (see `volume create --help`).
        mode: WriteMode,
    },
    /// List the volumes: size, layout, chunks allocated, limits, write mode.
    List {
        #[command(flatten)]
        format: views::Format,
    },
    /// Show a volume and where each of its chunks is.
    Info {
        /// The volume.
        name: String,
        #[command(flatten)]
        format: views::Format,
    },
    /// Grow a volume (shrinking is refused: it would discard data).
    Resize {
        /// The volume.
        name: String,
        /// Its new size, e.g. 20G; at least the current one.
        #[arg(long, value_parser = size::parse)]
        size: u64,
    },
    /// Delete a volume and free its chunks.
    Delete {
        /// The volume.
        name: String,
        /// Follow the chunk servers freeing its space, with progress, rate and ETA.
        #[arg(long)]
        wait: bool,
    },
    /// Limit a volume's I/O (reads and writes together); a gateway serving it applies
    /// the change within a few seconds.
    SetQos {
        /// The volume.
        name: String,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// A new volume NAME, writable at once, that reads the snapshot VOLUME@SNAPSHOT
    /// wherever it has not been written (nothing is copied up front).
    Clone {
        /// VOLUME@SNAPSHOT to clone.
        source: String,
        /// The new volume's name.
        name: String,
    },
    /// Copy every block clone NAME still reads from its parent snapshot into the
    /// clone, then detach it (the snapshot can then be deleted). Refused while a
    /// gateway has the clone open.
    Flatten {
        /// The clone.
        name: String,
        /// Copy rate, e.g. 100M (0: unlimited).
        #[arg(long, default_value = "100M", value_parser = size::parse)]
        rate: u64,
    },
    /// Write the volume back to its snapshot VOLUME@SNAPSHOT (only what changed since;
    /// newer snapshots are kept). Refused while a gateway has the volume open.
    Rollback {
        /// VOLUME@SNAPSHOT to roll back to.
        target: String,
    },
    /// Move the volume's session to gateway GATEWAY: the gateway holding it answers
    /// what its clients sent, flushes, releases the lease and closes their NBD
    /// connections; GATEWAY takes the lease and serves the clients as they reconnect
    /// (QEMU: `reconnect-delay`, to an address that moves with the session).
    MoveSession {
        /// The volume.
        name: String,
        /// The gateway to serve it (its --name; `floe status` lists the gateways).
        #[arg(long)]
        to: String,
        /// How long to wait for GATEWAY to hold the volume.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        #[command(flatten)]
        format: views::Format,
    },
    /// The ranges that changed from snapshot VOLUME@SNAPSHOT to a later one, or to
    /// the volume now (4 KiB blocks; a chunk allocated since counts whole).
    Diff {
        /// VOLUME@SNAPSHOT to compare from.
        since: String,
        /// VOLUME@SNAPSHOT to compare to (default: the volume now).
        until: Option<String>,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
struct QosArgs {
    /// Requests per second (0 or `unlimited`: no limit).
    #[arg(long, allow_hyphen_values = true, value_parser = admin::parse_iops)]
    iops: Option<u64>,
    /// Bytes per second, e.g. 100M (binary units; 0 or `unlimited`: no limit).
    #[arg(long, allow_hyphen_values = true, value_parser = admin::parse_bandwidth)]
    bandwidth: Option<u64>,
}

fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // rustls warns of every client that sends an IP address as SNI
                // (QEMU and libnbd do): not news to an operator.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,rustls=error")),
        )
        .with_writer(std::io::stderr)
        // Colour only for a person watching: `floe demo` sends stderr to log files.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// Single-threaded runtimes everywhere: one event loop per process owns its state
/// (Vitastor's habit), and more cores mean more processes.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime starts")
}

fn filesystem_bytes(dir: &std::path::Path) -> Result<u64, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| "path contains a NUL byte".to_string())?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and an out-pointer to a zeroed struct.
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(format!(
            "cannot statvfs {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(stat.f_blocks as u64 * stat.f_frsize as u64)
}

/// How long a process restarted on its port waits for its killed predecessor's
/// socket to close.
const BIND_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(5);

async fn bind(address: &str) -> Result<tokio::net::TcpListener, String> {
    let give_up = tokio::time::Instant::now() + BIND_RETRY_FOR;
    loop {
        match tokio::net::TcpListener::bind(address).await {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < give_up =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await
            }
            bound => {
                return bound.map_err(|e| {
                    format!("cannot listen on {address}: {e} (is another Floe process using it?)")
                })
            }
        }
    }
}

fn is_loopback(listen: &str) -> bool {
    use std::net::ToSocketAddrs;
    listen
        .to_socket_addrs()
        .is_ok_and(|mut addresses| addresses.all(|a| a.ip().is_loopback()))
}

/// A master or chunk server in the clear serves loopback only, unless `allowed`.
fn refuse_plain_beyond_loopback(listen: &str, allowed: bool) -> Result<(), String> {
    if allowed || is_loopback(listen) {
        return Ok(());
    }
    Err(format!(
        "refusing to serve {listen} without TLS: anyone who reaches it could read and write \
         every volume; give --ca and --cert (see `floe cert`), or --insecure"
    ))
}

/// A gateway's name unless given: this host's name and the port it serves.
fn default_gateway_name(listen: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    let port = listen.rsplit(':').next().unwrap_or(listen);
    format!("{host}:{port}")
}

/// SIGTERM or SIGINT: lets the gateway answer requests in flight before it exits.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut terminate) => {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!("cannot watch SIGTERM ({e}); stop with SIGINT");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("stopping: answering requests in flight");
}

/// A gateway stops on SIGTERM or SIGINT, and upgrades in place on SIGUSR2.
async fn gateway_signal() -> floe_gateway::Stop {
    use tokio::signal::unix::{signal, SignalKind};
    let upgrade = async {
        match signal(SignalKind::user_defined2()) {
            Ok(mut upgrade) => upgrade.recv().await,
            Err(e) => {
                tracing::warn!("cannot watch SIGUSR2 ({e}): no upgrades in place");
                std::future::pending().await
            }
        }
    };
    tokio::select! {
        _ = stop_signal() => floe_gateway::Stop::Shutdown,
        _ = upgrade => {
            tracing::info!("upgrading: parking clients at request boundaries");
            floe_gateway::Stop::Handover
        }
    }
}

async fn execute(cli: Cli) -> Result<(), String> {
    // The demo makes its cluster's certificates itself; `cert` needs none.
    if let (Some(ca), Some(cert), false) = (
        &cli.ca,
        &cli.cert,
        matches!(cli.command, Command::Demo { .. } | Command::Cert(_)),
    ) {
        let identity = floe_protocol::tls::install(ca, cert)?;
        tracing::info!("TLS as {identity}");
    }
    let master = MasterClient::new(&cli.master);
    match cli.command {
        Command::Demo {
            dir,
            port,
            masters,
            nbd_port,
            size,
            metadata,
            placement,
            mode,
            write_mode,
            emulate_hdd,
            journal_quota,
            plain,
            no_metrics,
            engine,
            disk_size,
            gc,
            cache_size,
            nfs_port,
            tx_port,
        } => {
            demo::run(demo::Options {
                dir,
                port,
                masters,
                nbd_port,
                volume_size: size,
                metadata,
                placement,
                mode,
                write_mode,
                emulate_hdd,
                journal_quota,
                plain,
                no_metrics,
                chain_disk_bytes: (engine == engine::Engine::Log).then_some(disk_size),
                chain_flags: engine::chain_flags(gc, cache_size),
                nfs_port,
                tx_port,
            })
            .await
        }
        Command::Master {
            listen,
            metadata,
            recovery_concurrency,
            recovery_rate,
            move_concurrency,
            move_rate,
            placement,
            scrub_interval,
            scrub_rate,
            snapshot_free_rate,
            metrics,
        } => {
            metrics.start(&listen).await?;
            let settings = floe_master::Settings {
                recovery: floe_master::recovery::Limits {
                    concurrency: recovery_concurrency.max(1),
                    bytes_per_second: recovery_rate,
                },
                moves: floe_master::recovery::Limits {
                    concurrency: move_concurrency.max(1),
                    bytes_per_second: move_rate,
                },
                placement,
                scrub: floe_master::recovery::ScrubSettings {
                    interval: (!scrub_interval.is_zero()).then_some(scrub_interval),
                    bytes_per_second: scrub_rate,
                },
                reclaim: floe_master::reclaim::ReclaimSettings {
                    chunks_per_second: snapshot_free_rate,
                },
            };
            refuse_plain_beyond_loopback(&listen, cli.cert.is_some() || cli.insecure)?;
            floe_master::run(bind(&listen).await?, &metadata, settings).await
        }
        Command::Chunkserver {
            admin: Some(ChunkserverCommand::MarkLost { id }),
            ..
        } => admin::mark_lost(&master, id).await,
        Command::Chunkserver { run: None, .. } => {
            Err("give --dir, --listen and --host to run a chunk server (see --help)".into())
        }
        Command::Chunkserver {
            run:
                Some(ChunkserverArgs {
                    dir,
                    listen,
                    host,
                    class,
                    capacity,
                    emulate_hdd,
                    journals,
                    journal_quota,
                }),
            engine,
            metrics,
            ..
        } => {
            metrics.start(&listen).await?;
            let capacity_bytes = match capacity {
                Some(c) => c,
                None => filesystem_bytes(&dir)?,
            };
            if class != DeviceClass::Hdd && (emulate_hdd || !journals.is_empty()) {
                return Err("--emulate-hdd and --journal are for --class hdd".into());
            }
            let quota = |dir: &std::path::Path| match journal_quota {
                Some(q) => Ok(q),
                None => filesystem_bytes(dir).map(|b| (b / 10).min(JOURNAL_QUOTA_DEFAULT_MAX)),
            };
            let journal_dirs = journals
                .iter()
                .map(|dir| {
                    Ok(floe_chunkserver::JournalDir {
                        dir: dir.clone(),
                        quota_bytes: quota(dir)?,
                    })
                })
                .collect::<Result<_, String>>()?;
            let store = floe_chunkserver::StoreOptions {
                chain: engine.chain(!journals.is_empty())?,
                journal_dirs,
                local_journal_quota_bytes: quota(&dir)?,
                emulate_hdd,
            };
            refuse_plain_beyond_loopback(&listen, cli.cert.is_some() || cli.insecure)?;
            floe_chunkserver::run(floe_chunkserver::Config {
                dir,
                listen,
                advertise: None,
                master: cli.master,
                host,
                class,
                capacity_bytes,
                store,
            })
            .await
        }
        Command::Gateway {
            admin: Some(GatewayCommand::Upgrade { pid, timeout }),
            ..
        } => gateway_upgrade::run(pid, timeout).await,
        Command::Gateway {
            admin: None,
            listen,
            name,
            read_only,
            unretired_limit,
            staleness,
            nbd_access,
            nbd_psk,
            nbd_allow_plain,
            tx_listen,
            metrics,
        } => {
            floe_gateway::upgrade::remember_executable();
            metrics.start(&listen).await?;
            let access = nbd_access
                .map(|path| floe_gateway::AccessList::load(&path))
                .transpose()?;
            let psk = nbd_psk
                .map(|path| floe_gateway::PskKeys::load(&path))
                .transpose()?;
            let (listener, resumed) = match floe_gateway::upgrade::inherited()? {
                Some((listener, parked)) => {
                    let listener = tokio::net::TcpListener::from_std(listener)
                        .map_err(|e| format!("the handed-over listener: {e}"))?;
                    (listener, parked)
                }
                None => (bind(&listen).await?, Vec::new()),
            };
            let tx_listener = match &tx_listen {
                Some(address) => Some(bind(address).await?),
                None => None,
            };
            let options = floe_gateway::Options {
                name: name.unwrap_or_else(|| default_gateway_name(&listen)),
                read_only,
                unretired_limit,
                staleness,
                access,
                psk,
                allow_plain: nbd_allow_plain,
                tx_listener,
            };
            floe_gateway::run(listener, resumed, &cli.master, options, gateway_signal).await;
            Ok(())
        }
        Command::Nfs {
            listen,
            unretired_limit,
            idle_close,
            metrics,
        } => {
            // Certificates protect the cluster's own connections, not NFS: a client
            // names its own uid and gid (AUTH_UNIX) and nothing checks them.
            if !cli.insecure && !is_loopback(&listen) {
                return Err(format!(
                    "refusing to serve NFS on {listen}: NFSv3 has no authentication, so \
                     anyone who reaches it could read and write every volume; serve it \
                     on loopback, or give --insecure on a network only hypervisors reach"
                ));
            }
            if idle_close.is_zero() {
                return Err("--idle-close must be more than 0".into());
            }
            metrics.start(&listen).await?;
            let options = floe_nfs::Options {
                unretired_limit,
                idle_close,
            };
            floe_nfs::run(&listen, &cli.master, options, stop_signal()).await
        }
        Command::Volume(command) => match command {
            VolumeCommand::Create {
                name,
                size,
                replicas,
                chunk_size,
                stripe_unit,
                stripe_count,
                mode,
                write_mode,
                qos,
            } => {
                let spec = VolumeSpec {
                    name,
                    size_bytes: size,
                    replicas,
                    chunk_bytes: chunk_size,
                    stripe_unit_bytes: stripe_unit,
                    stripe_count,
                    mode,
                    write_mode,
                };
                admin::create(&master, spec, qos.iops, qos.bandwidth).await
            }
            VolumeCommand::List { format } => admin::list(&master, format).await,
            VolumeCommand::Info { name, format } => admin::info(&master, &name, format).await,
            VolumeCommand::Resize { name, size } => admin::resize(&master, &name, size).await,
            VolumeCommand::Delete { name, wait } => admin::delete(&master, &name, wait).await,
            VolumeCommand::SetWriteMode { name, mode } => {
                admin::set_write_mode(&master, &name, mode).await
            }
            VolumeCommand::SetQos { name, qos } => {
                admin::set_qos(&master, &name, qos.iops, qos.bandwidth).await
            }
            VolumeCommand::Clone { source, name } => snapshot::clone(&master, &source, &name).await,
            VolumeCommand::Flatten { name, rate } => {
                snapshot::flatten(&cli.master, &name, rate).await
            }
            VolumeCommand::Rollback { target } => snapshot::rollback(&cli.master, &target).await,
            VolumeCommand::MoveSession {
                name,
                to,
                timeout,
                format,
            } => sessions::move_session(&master, &name, &to, timeout, format).await,
            VolumeCommand::Diff { since, until, json } => {
                snapshot::diff(&cli.master, &since, until.as_deref(), json).await
            }
        },
        Command::Status { format } => admin::status(&master, format).await,
        Command::Scrub { name, format } => admin::scrub(&master, &name, format).await,
        Command::Snapshot(command) => snapshot::run(&master, command).await,
        Command::Placement(command) => placement::run(command),
        Command::Cert(command) => cert::run(command),
        Command::Cluster(command) => cluster::cluster(&master, command).await,
        Command::Pg(command) => cluster::pg(&master, command).await,
        Command::Layer(command) => cluster::layer(&master, command).await,
        Command::Top(args) => top::run(args),
        Command::Kv(command) => kv::run(&cli.master, command).await,
    }
}

/// The default journal quota's cap: journals are allocated in full when a server
/// starts, and a demo runs several on one file system.
const JOURNAL_QUOTA_DEFAULT_MAX: u64 = 2 << 30;

fn main() {
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Master { .. }
            | Command::Chunkserver { run: Some(_), .. }
            | Command::Gateway { admin: None, .. }
            | Command::Nfs { .. }
    ) {
        copy_tuning::exec_with_vector_copies();
        init_logging();
    } else if !matches!(cli.command, Command::Demo { .. }) {
        // A command whose output is cut short (`floe status | head`) ends quietly, as
        // other command-line tools do; servers keep ignoring SIGPIPE for their sockets.
        // SAFETY: restores the default disposition before any thread is started.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    if let Err(message) = runtime().block_on(execute(cli)) {
        eprintln!("floe: {message}");
        std::process::exit(1);
    }
}
