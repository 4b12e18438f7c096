//! The chunk server: serves one data directory's chunk replicas over the wire
//! protocol, runs the replica side of the replication protocol (versions, views,
//! fencing: see [`replica`]), forwards a primary's changes to its backups, repairs
//! replicas from peers ([`repair`]), and keeps itself registered with the master.
//! [`exported`] is what it serves at `/metrics`.
//!
//! One single-threaded event loop owns the connections and commits the log (Vitastor's
//! habit on few cores), so the replica state below is never contended.

mod as_of;
mod exported;
mod heal;
mod repair;
pub mod replica;
mod retained;
mod staging;
mod unread;

use bytes::Bytes;
use floe_chunkstore::block_sums::BLOCK_BYTES;
use floe_chunkstore::space::Room;
use floe_chunkstore::store::CHUNK_BYTES_MAX;
pub use floe_chunkstore::{ChainGc, ChainOptions, JournalDir, Options as StoreOptions};
use floe_chunkstore::{ChunkMeta, Durability, Store, StoreError};
use floe_protocol::connection::CallError;
use floe_protocol::server::{self, Handler};
use floe_protocol::tls::Role;
use floe_protocol::{
    generation_of, ChunkId, ConnectionPool, DeviceClass, FsUsage, MasterRequest, MasterResponse,
    Masters, Registration, ReplicaRequest, ReplicaResponse, Request, Response, ServerId, Stamp,
    Status,
};
use replica::{Admit, Replica};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Notify;

pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// How long a heartbeat waits for a (leading) master's answer.
const MASTER_CALL_LIMIT: Duration = Duration::from_secs(5);
/// Heartbeats between two walks of the data directory for the used-bytes figure.
const USAGE_REFRESH_HEARTBEATS: u32 = 5;
/// How long an early change waits for the ones before it before the replica gives up
/// and reports itself behind (the writer then commits without it and has it repaired).
const EARLY_ARRIVAL_WAIT: Duration = Duration::from_secs(2);

pub struct Config {
    pub dir: PathBuf,
    pub listen: String,
    /// Address the master and peers should use; defaults to the bound address.
    pub advertise: Option<String>,
    /// The master's address, or several (`a,b,c`) of which one leads.
    pub master: String,
    pub host: String,
    pub class: DeviceClass,
    pub capacity_bytes: u64,
    /// Journals and hdd emulation.
    pub store: StoreOptions,
}

/// A chunk's replica state and the wake-up for changes waiting on it.
struct Slot {
    replica: Mutex<Replica>,
    changed: Notify,
}

/// Why a replica is frozen after a change failed to store: later changes may have
/// landed behind the hole, so only a repair can vouch for it again.
const FAILED_CHANGE: &str = "missing a change that failed to store";

impl Slot {
    /// Waits until every change handed to the store is durable (or one failed, and
    /// will never be).
    async fn settled(&self) {
        loop {
            // Created before the check: notify_waiters wakes it from here on.
            let changed = self.changed.notified();
            {
                let replica = self.replica.lock().unwrap();
                if replica.durable >= replica.submitted || replica.frozen == Some(FAILED_CHANGE) {
                    return;
                }
            }
            changed.await;
        }
    }
}

pub(crate) struct ChunkServer {
    store: Store,
    /// Connections to backups this server forwards to, and to repair sources.
    peers: ConnectionPool,
    slots: Mutex<BTreeMap<ChunkId, Arc<Slot>>>,
    /// Newest lease generation seen per volume (from writers and the master).
    generations: Mutex<BTreeMap<u64, u32>>,
}

/// A change to a chunk, as the store takes it; `epoch` is the writer's snapshot epoch,
/// `retain` keeps what it overwrites first in that epoch (see [`Request::Write`]).
#[derive(Clone)]
enum Change {
    /// `unsynced`: acknowledged once logged (see [`Request::Write`]).
    Write {
        data: Bytes,
        unsynced: bool,
        epoch: u32,
        retain: bool,
    },
    Zero {
        length: u64,
        punch: bool,
        epoch: u32,
        retain: bool,
    },
}

impl Change {
    fn length(&self) -> u64 {
        match self {
            Change::Write { data, .. } => data.len() as u64,
            Change::Zero { length, .. } => *length,
        }
    }

    fn epoch(&self) -> u32 {
        match self {
            Change::Write { epoch, .. } | Change::Zero { epoch, .. } => *epoch,
        }
    }

    /// The epoch the store retains for, if any.
    fn retain(&self) -> Option<u32> {
        match self {
            Change::Write { epoch, retain, .. } | Change::Zero { epoch, retain, .. } => {
                retain.then_some(*epoch)
            }
        }
    }

    fn request(&self, chunk: ChunkId, stamp: Stamp, offset: u64, forward: Vec<String>) -> Request {
        match self {
            Change::Write {
                data,
                unsynced,
                epoch,
                retain,
            } => Request::Write {
                chunk,
                stamp,
                offset,
                epoch: *epoch,
                catch_up: false,
                unsynced: *unsynced,
                retain: *retain,
                forward,
                data: data.clone(),
            },
            Change::Zero {
                length,
                punch,
                epoch,
                retain,
            } => Request::Zero {
                chunk,
                stamp,
                offset,
                length: *length,
                epoch: *epoch,
                punch: *punch,
                retain: *retain,
                forward,
            },
        }
    }
}

/// Runs the chunk server until the listener fails.
pub async fn run(config: Config) -> Result<(), String> {
    let store = Store::open_with(&config.dir, &config.store)
        .map_err(|e| format!("cannot open data directory {}: {e}", config.dir.display()))?;
    let listener = TcpListener::bind(&config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let address = match &config.advertise {
        Some(a) => a.clone(),
        None => listener
            .local_addr()
            .map_err(|e| e.to_string())?
            .to_string(),
    };
    let uuid = load_or_create_uuid(&config.dir)?;
    let journals: Vec<_> = config
        .store
        .journal_dirs
        .iter()
        .map(|j| j.dir.display().to_string())
        .collect();
    tracing::info!(
        %address,
        dir = %config.dir.display(),
        class = %config.class,
        hdd = if config.store.emulate_hdd { "emulated (modelled seek, rotation and transfer times)" } else { "real" },
        journals = %journals.join(","),
        "chunk server listening"
    );
    let registration = Registration {
        uuid,
        address,
        host: config.host.clone(),
        class: config.class,
        emulated: config.store.emulate_hdd,
        capacity_bytes: config.capacity_bytes,
    };
    let server = start(
        store,
        registration,
        config.master.clone(),
        ConnectionPool::default(),
    )
    .await
    .map_err(|e| format!("cannot finish a repair in {}: {e}", config.dir.display()))?;
    // Requests are measured here, in the process only: the simulator runs `start`.
    server::serve(listener, Arc::new(exported::Measured::new(server)))
        .await
        .map_err(|e| format!("accept failed: {e}"))
}

/// Starts serving `store`: finishes the whole-copy repairs a stop interrupted, keeps
/// the server registered with the master at `master` and returns the request
/// handler. Every call to another process goes through `peers`, so the simulator can
/// run the same server on its own network.
pub async fn start(
    store: Store,
    registration: Registration,
    master: String,
    peers: ConnectionPool,
) -> Result<Arc<impl Handler>, StoreError> {
    staging::finish_interrupted(&store).await?;
    let registration = MasterRequest::Register(registration);
    let server = Arc::new(ChunkServer {
        store,
        peers,
        slots: Mutex::default(),
        generations: Mutex::default(),
    });
    tokio::spawn(heartbeat_loop(master, registration, server.clone()));
    Ok(server)
}

fn load_or_create_uuid(dir: &std::path::Path) -> Result<String, String> {
    let path = dir.join("server.uuid");
    match std::fs::read_to_string(&path) {
        Ok(s) => Ok(s.trim().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let uuid = format!("{:032x}", rand::random::<u128>());
            std::fs::write(&path, &uuid)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            Ok(uuid)
        }
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// Registers, then heartbeats forever; re-registers whenever the master forgets us
/// (it restarted), drops the chunks of volumes the master reports deleted, and learns
/// the current lease generations so a writer that lost its lease is fenced even on
/// chunks the new writer has not touched yet.
async fn heartbeat_loop(master: String, registration: MasterRequest, server: Arc<ChunkServer>) {
    // One master, or the leader of several (`a,b,c`).
    let masters = Masters::parse(&master);
    let store = &server.store;
    let pool = server.peers.clone();
    let mut id: Option<ServerId> = None;
    let mut used_bytes = store.used_bytes();
    let mut beats = 0u32;
    let mut deleted: BTreeSet<u64> = BTreeSet::new();
    let mut corrupt_blocks = Vec::new();
    let mut freeing = unread::Schedule::default();
    let gauges = exported::StoreGauges::new();
    let mut interval = tokio::time::interval(HEARTBEAT_INTERVAL);
    loop {
        interval.tick().await;
        let request = match id {
            None => registration.clone(),
            Some(id) => {
                beats += 1;
                if beats.is_multiple_of(USAGE_REFRESH_HEARTBEATS) {
                    used_bytes = store.used_bytes();
                }
                // The master slows writers before the journals fill.
                let (journal_used_bytes, journal_quota_bytes) = store.journal_usage();
                gauges.sample(store, journal_used_bytes, journal_quota_bytes);
                // Kept until a heartbeat carrying them is acknowledged.
                corrupt_blocks.extend(store.take_corrupt());
                MasterRequest::Heartbeat {
                    id,
                    used_bytes,
                    journal_used_bytes,
                    journal_quota_bytes,
                    corrupt_blocks: corrupt_blocks.clone(),
                    fs: fs_usage(store),
                }
            }
        };
        match masters
            .call(&pool, Request::Master(request), MASTER_CALL_LIMIT)
            .await
        {
            Ok(Response::Master(MasterResponse::Registered { id: new })) => {
                tracing::info!(id = new, "registered with master");
                id = Some(new);
            }
            Ok(Response::Master(MasterResponse::HeartbeatAck {
                deleted_volumes,
                leases,
                snapshots,
            })) => {
                corrupt_blocks.clear();
                for (volume_id, generation) in leases {
                    server.saw_generation(volume_id, generation);
                }
                let freed = match freeing.due(&snapshots) {
                    true => server.free_unread(&snapshots).await,
                    false => unread::Freed::default(),
                };
                freeing.scanned(freed);
                if freed.epochs + freed.blocks > 0 {
                    tracing::info!(
                        epochs = freed.epochs,
                        blocks = freed.blocks,
                        bytes = freed.bytes,
                        "freed blocks retained for no snapshot"
                    );
                    used_bytes = store.used_bytes();
                }
                for volume_id in deleted_volumes {
                    if deleted.insert(volume_id) {
                        server
                            .slots
                            .lock()
                            .unwrap()
                            .retain(|c, _| c.volume_id != volume_id);
                        if let Err(e) = store.delete_volume(volume_id).await {
                            tracing::error!(volume_id, "dropping a deleted volume failed: {e}");
                            deleted.remove(&volume_id);
                        }
                        // The next heartbeat shows the space freed (`volume delete
                        // --wait` follows it), not one a few beats later.
                        used_bytes = store.used_bytes();
                    }
                }
            }
            Err(CallError::Remote {
                status: Status::NotFound,
                ..
            }) => id = None,
            Err(CallError::Remote {
                status: Status::Fenced,
                message,
            }) => tracing::error!("the master refuses this server: {message}"),
            Ok(other) => tracing::warn!("unexpected master reply {other:?}"),
            Err(e) => tracing::warn!("master unreachable: {e}"),
        }
    }
}

/// The data directory's file system for the master; `None` (and logged) if it
/// cannot be read.
fn fs_usage(store: &Store) -> Option<FsUsage> {
    match store.space_report() {
        Ok(report) => Some(FsUsage {
            device: report.fs.device,
            kernel: kernel_id(),
            total_bytes: report.fs.total_bytes,
            free_bytes: report.fs.free_bytes,
            writable_bytes: report.writable_bytes,
            short: report.short,
        }),
        Err(e) => {
            tracing::warn!("cannot read the data directory's free space: {e}");
            None
        }
    }
}

/// The first 64 bits of this kernel's boot id (Linux), read once; 0 where there is
/// none.
fn kernel_id() -> u64 {
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let hex: String = id
            .chars()
            .filter(char::is_ascii_hexdigit)
            .take(16)
            .collect();
        u64::from_str_radix(&hex, 16).unwrap_or(0)
    })
}

fn store_status(e: &StoreError) -> Status {
    match e {
        StoreError::OutOfRange { .. } => Status::BadRequest,
        StoreError::NoSpace(_) => Status::NoSpace,
        StoreError::Io(_) => Status::Io,
        StoreError::Corrupt { .. } => Status::Corrupt,
        StoreError::ShutDown => Status::Unavailable,
        StoreError::Unsupported(_) => Status::BadRequest,
    }
}

fn store_error(e: StoreError) -> Response {
    Response::error(store_status(&e), e.to_string())
}

fn control_store_error(e: StoreError) -> (Status, String) {
    (store_status(&e), e.to_string())
}

fn call_status(e: &CallError) -> Status {
    match e {
        CallError::Remote { status, .. } => *status,
        _ => Status::Unavailable,
    }
}

impl ChunkServer {
    /// The chunk's slot, created for requests that change the replica (changes, view
    /// changes, repairs, drops); queries use [`ChunkServer::existing`] instead, so a
    /// client naming arbitrary chunks cannot grow this map.
    fn slot(&self, chunk: ChunkId) -> Arc<Slot> {
        self.slots
            .lock()
            .unwrap()
            .entry(chunk)
            .or_insert_with(|| {
                let meta = self.store.meta(chunk);
                Arc::new(Slot {
                    replica: Mutex::new(Replica::new(meta.view, meta.version)),
                    changed: Notify::new(),
                })
            })
            .clone()
    }

    fn existing(&self, chunk: ChunkId) -> Option<Arc<Slot>> {
        self.slots.lock().unwrap().get(&chunk).cloned()
    }

    /// The replica's view and durable version; a chunk without a slot has changed
    /// nothing since the store last recorded it.
    fn state(&self, chunk: ChunkId) -> ChunkMeta {
        match self.existing(chunk) {
            Some(slot) => {
                let replica = slot.replica.lock().unwrap();
                ChunkMeta {
                    view: replica.view,
                    version: replica.durable,
                }
            }
            None => self.store.meta(chunk),
        }
    }

    /// Raises the volume's fence: changes of older generations are refused from here
    /// on. Only from the master, a writer's takeover query and accepted changes, so a
    /// malformed or refused request cannot fence a volume.
    fn saw_generation(&self, volume_id: u64, generation: u32) {
        let mut generations = self.generations.lock().unwrap();
        let newest = generations.entry(volume_id).or_default();
        *newest = (*newest).max(generation);
    }

    fn fence(&self, volume_id: u64) -> u32 {
        self.generations
            .lock()
            .unwrap()
            .get(&volume_id)
            .copied()
            .unwrap_or(0)
    }

    /// Applies a change to the local replica under the version rules; resolves when it
    /// is durable (or was already).
    async fn apply_local(
        &self,
        chunk: ChunkId,
        stamp: Stamp,
        offset: u64,
        change: Change,
        room: Room,
    ) -> Response {
        if change.retain() == Some(0) {
            return Response::error(
                Status::BadRequest,
                "a change retains for a snapshot epoch, and epoch 0 has no snapshot",
            );
        }
        if offset
            .checked_add(change.length())
            .is_none_or(|end| end > CHUNK_BYTES_MAX)
        {
            return Response::error(
                Status::BadRequest,
                format!(
                    "range {offset}+{} is outside a chunk (max {CHUNK_BYTES_MAX} bytes)",
                    change.length()
                ),
            );
        }
        let slot = self.slot(chunk);
        let deadline = tokio::time::Instant::now() + EARLY_ARRIVAL_WAIT;
        let (meta, reservation) = loop {
            // Created before the check: notify_waiters wakes it from here on.
            let changed = slot.changed.notified();
            {
                let mut replica = slot.replica.lock().unwrap();
                // The fence is read afresh under the replica's lock, and the change
                // submitted under the same lock: a takeover's ChunkInfo raises the
                // fence, then waits for what this replica submitted, so an old
                // writer's change either counts in the version it reports or is
                // refused.
                match replica.admit(&stamp, self.fence(chunk.volume_id)) {
                    Admit::Apply => {
                        if let Some(why) = replica.epoch_went_back(change.epoch()) {
                            tracing::error!(?chunk, "{why}");
                            return Response::error(Status::BadRequest, why);
                        }
                        // Refused for space (or a change too long to retain) before
                        // the version is taken: the replica stays as it was, and the
                        // writer knows it lacks the change.
                        let reserved = match &change {
                            _ if change.retain().is_some() => {
                                self.store.reserve_retaining(offset, change.length(), room)
                            }
                            Change::Write { data, .. } => {
                                self.store.reserve_write(offset, data.len() as u64, room)
                            }
                            Change::Zero { length, punch, .. } => {
                                self.store.reserve_zero(offset, *length, *punch)
                            }
                        };
                        let reservation = match reserved {
                            Ok(reservation) => reservation,
                            Err(e) => return store_error(e),
                        };
                        replica.submit(&stamp, offset, change.length(), change.epoch());
                        let meta = ChunkMeta {
                            view: replica.view,
                            version: stamp.version,
                        };
                        break (meta, reservation);
                    }
                    Admit::Executed if replica.durable >= stamp.version => return Response::Done,
                    Admit::Executed | Admit::Wait => {}
                    Admit::Refuse(status, message) => return Response::error(status, message),
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Response::error(
                    Status::Behind,
                    format!(
                        "replica still lacks version {:#x} after {EARLY_ARRIVAL_WAIT:?}",
                        stamp.prev
                    ),
                );
            }
        };
        // A newer writer's accepted change fences older ones on the volume's other
        // chunks here too.
        self.saw_generation(chunk.volume_id, generation_of(stamp.version));
        // Wake the change queued behind this one now: the store keeps submission order.
        slot.changed.notify_waiters();
        let retain = change.retain();
        let result = match change {
            // What a writer sends in place of a change every replica refused for
            // space: the version, nothing else, keeps the chunk's versions in sequence.
            Change::Write { data, .. } if data.is_empty() => self.store.set_meta(chunk, meta).await,
            Change::Write { data, unsynced, .. } => {
                let durability = match unsynced {
                    true => Durability::Unsynced,
                    false => Durability::Synced,
                };
                self.store
                    .write_reserved(reservation, chunk, offset, data, meta, durability, retain)
                    .await
            }
            Change::Zero { length, punch, .. } => {
                self.store
                    .zero_reserved(reservation, chunk, offset, length, punch, meta, retain)
                    .await
            }
        };
        let response = {
            let mut replica = slot.replica.lock().unwrap();
            match result {
                // A drop or repair that reset the replica meanwhile made this change
                // no longer part of what it claims.
                Ok(()) if replica.frozen.is_none() && replica.submitted >= stamp.version => {
                    replica.durable = replica.durable.max(stamp.version);
                    Response::Done
                }
                Ok(()) => Response::error(Status::Behind, "an earlier change failed here"),
                Err(e) => {
                    // Later changes may already be queued behind this one: the
                    // replica's history has a hole until a repair rewrites it.
                    replica.frozen = Some(FAILED_CHANGE);
                    store_error(e)
                }
            }
        };
        slot.changed.notify_waiters();
        response
    }

    /// Applies a change locally and forwards it to every backup at once; succeeds
    /// when all are durable. A backup's refusal is passed back with its status, so
    /// the writer can tell a laggard from a lost lease.
    async fn replicate(
        &self,
        chunk: ChunkId,
        stamp: Stamp,
        offset: u64,
        change: Change,
        forward: Vec<String>,
    ) -> Response {
        let backup = change.request(chunk, stamp, offset, Vec::new());
        let backups = forward
            .iter()
            .map(|address| self.peers.call(address, backup.clone()));
        let (local, backups) = futures::join!(
            self.apply_local(chunk, stamp, offset, change, Room::Normal),
            futures::future::join_all(backups)
        );
        if !matches!(local, Response::Done) {
            return local;
        }
        for (address, result) in forward.iter().zip(backups) {
            if let Err(e) = result {
                return Response::error(call_status(&e), format!("backup {address}: {e}"));
            }
        }
        Response::Done
    }

    /// Reads the replica if its version lies in `versions`: at least the last one
    /// the reader knows committed, and no change past the last one it may see (taken
    /// before the read and checked again after it, so no change lands unseen).
    async fn read(
        &self,
        chunk: ChunkId,
        offset: u64,
        length: u32,
        versions: std::ops::RangeInclusive<u64>,
    ) -> Response {
        // A replica being rewritten holds less than its version says until the repair
        // ends (a whole copy punches it first).
        let slot = self.existing(chunk);
        let (frozen, submitted) = slot.as_ref().map_or((None, 0), |slot| {
            let replica = slot.replica.lock().unwrap();
            (replica.frozen, replica.submitted)
        });
        if frozen == Some(repair::REPAIRING) {
            return Response::error(
                Status::Behind,
                format!("replica is {}: read another", repair::REPAIRING),
            );
        }
        let durable = self.state(chunk).version;
        if durable < *versions.start() {
            return Response::error(
                Status::Behind,
                format!(
                    "replica holds version {durable:#x}, the read needs {:#x}",
                    versions.start()
                ),
            );
        }
        let past = |submitted: u64| {
            Response::error(
                Status::Ahead,
                format!(
                    "replica took version {submitted:#x}, past the {:#x} the read may see",
                    versions.end()
                ),
            )
        };
        if submitted.max(durable) > *versions.end() {
            return past(submitted.max(durable));
        }
        let data = match self.store.read(chunk, offset, length).await {
            Ok(data) => data,
            Err(e) => return store_error(e),
        };
        let after = self
            .existing(chunk)
            .map_or(0, |slot| slot.replica.lock().unwrap().submitted);
        if after > *versions.end() {
            return past(after);
        }
        Response::Data(data)
    }

    /// The replica's state once every change handed to the store is durable.
    /// Before a repair's source scans the replica (its extents or block sums): the
    /// version the scan shows at least, everything up to it synced (unsynced writes
    /// reach the chunk file's extents only then). A replica being repaired itself
    /// holds less than its version says: it refuses, as it refuses reads.
    async fn scanned_version(&self, chunk: ChunkId) -> Result<u64, (Status, String)> {
        let frozen = self
            .existing(chunk)
            .and_then(|slot| slot.replica.lock().unwrap().frozen);
        if frozen == Some(repair::REPAIRING) {
            return Err((
                Status::Unavailable,
                format!("replica is {}: copy from another", repair::REPAIRING),
            ));
        }
        let version = self.state(chunk).version;
        self.store.sync().await.map_err(control_store_error)?;
        Ok(version)
    }

    /// Changes handed to the store are not all durable yet.
    fn pending(&self, chunk: ChunkId) -> bool {
        self.existing(chunk)
            .is_some_and(|slot| slot.replica.lock().unwrap().pending())
    }

    async fn settle(&self, slot: &Slot) -> ReplicaResponse {
        slot.settled().await;
        let replica = slot.replica.lock().unwrap();
        ReplicaResponse::ChunkInfo {
            view: replica.view,
            version: replica.durable,
        }
    }

    async fn control(
        self: &Arc<Self>,
        request: ReplicaRequest,
    ) -> Result<ReplicaResponse, (Status, String)> {
        match request {
            ReplicaRequest::ChunkInfo { chunk, generation } => {
                if generation > 0 {
                    self.saw_generation(chunk.volume_id, generation);
                }
                match self.existing(chunk) {
                    Some(slot) => Ok(self.settle(&slot).await),
                    None => {
                        let ChunkMeta { view, version } = self.store.meta(chunk);
                        Ok(ReplicaResponse::ChunkInfo { view, version })
                    }
                }
            }
            ReplicaRequest::SetView { chunk, view } => {
                let slot = self.slot(chunk);
                let meta = {
                    let mut replica = slot.replica.lock().unwrap();
                    if view <= replica.view {
                        None
                    } else {
                        replica.view = view;
                        Some(ChunkMeta {
                            view,
                            version: replica.submitted,
                        })
                    }
                };
                if let Some(meta) = meta {
                    // Changes stamped with the old view are refused from here on.
                    slot.changed.notify_waiters();
                    self.store
                        .set_meta(chunk, meta)
                        .await
                        .map_err(control_store_error)?;
                }
                Ok(self.settle(&slot).await)
            }
            ReplicaRequest::RetainedSince { chunk, since } => {
                self.retained_since(chunk, since).await
            }
            ReplicaRequest::LogSince { chunk, since } => {
                let (changes, pending) = match self.existing(chunk) {
                    Some(slot) => {
                        let replica = slot.replica.lock().unwrap();
                        (replica.changes_since(since), replica.pending())
                    }
                    None => {
                        let ChunkMeta { view, version } = self.store.meta(chunk);
                        (Replica::new(view, version).changes_since(since), false)
                    }
                };
                match changes {
                    Some((version, ranges)) => Ok(ReplicaResponse::Ranges {
                        version,
                        ranges,
                        pending,
                    }),
                    None => Err((
                        Status::NotFound,
                        format!("the journal lite does not reach back to version {since:#x}"),
                    )),
                }
            }
            ReplicaRequest::Extents { chunk } => {
                let version = self.scanned_version(chunk).await?;
                let ranges = self.store.extents(chunk).map_err(control_store_error)?;
                Ok(ReplicaResponse::Ranges {
                    version,
                    ranges,
                    pending: self.pending(chunk),
                })
            }
            ReplicaRequest::BlockSums { chunk } => {
                let version = self.scanned_version(chunk).await?;
                let sums = self
                    .store
                    .block_sums(chunk)
                    .await
                    .map_err(control_store_error)?;
                // A bad block would only be copied as bad: it is reported (healed from
                // another replica) and the copy waits for that.
                let sums = sums
                    .into_iter()
                    .enumerate()
                    .map(|(block, sum)| {
                        sum.ok_or_else(|| {
                            let offset = block as u64 * BLOCK_BYTES;
                            (
                                Status::Io,
                                format!("block at {offset} fails its checksum here"),
                            )
                        })
                    })
                    .collect::<Result<Vec<u64>, _>>()?;
                Ok(ReplicaResponse::BlockSums {
                    version,
                    sums,
                    pending: self.pending(chunk),
                })
            }
            ReplicaRequest::ReadCost { chunk, offset } => {
                if offset >= CHUNK_BYTES_MAX {
                    return Err((
                        Status::BadRequest,
                        format!("offset {offset} is past a chunk"),
                    ));
                }
                Ok(ReplicaResponse::ReadCost {
                    cost: self.store.read_cost(chunk, offset),
                })
            }
            ReplicaRequest::Sync { chunk, version } => {
                self.store.sync().await.map_err(control_store_error)?;
                let held = self.state(chunk).version;
                let frozen = self
                    .existing(chunk)
                    .and_then(|slot| slot.replica.lock().unwrap().frozen);
                // A newer writer may have built on an older version than `version`
                // (the replicas lost it to a power cut): a higher version held says
                // nothing of this one, so the old writer's FLUSH fails as its writes do.
                let newest = self.fence(chunk.volume_id).max(generation_of(held));
                match frozen {
                    _ if generation_of(version) < newest => Err((
                        Status::Fenced,
                        format!(
                            "lease generation {} was superseded by generation {newest}",
                            generation_of(version)
                        ),
                    )),
                    Some(why) => Err((Status::Behind, format!("the replica is {why}"))),
                    None if held < version => Err((
                        Status::Behind,
                        format!(
                            "replica holds version {held:#x}, not {version:#x}: it lost \
                             unsynced changes (restarted after a power cut?)"
                        ),
                    )),
                    None => Ok(ReplicaResponse::Done),
                }
            }
            ReplicaRequest::Checksum {
                chunk,
                length,
                readers,
            } => {
                let version = self.state(chunk).version;
                let (crc, bad) = self
                    .store
                    .checksum(chunk, length)
                    .await
                    .map_err(control_store_error)?;
                // Epochs no snapshot reads are left out: replicas free them at
                // different times.
                let read = |epoch| readers.as_ref().is_none_or(|r| !r.unread(epoch));
                let (retained, bad_retained) = self
                    .store
                    .retained_checksum(chunk, read)
                    .await
                    .map_err(control_store_error)?;
                Ok(ReplicaResponse::Checksum {
                    version,
                    crc,
                    bad,
                    retained,
                    bad_retained,
                })
            }
            ReplicaRequest::Heal {
                chunk,
                version,
                blocks,
            } => heal::heal(self, chunk, version, blocks).await,
            ReplicaRequest::Repair {
                chunk,
                source,
                kind,
                bytes_per_second,
            } => {
                let slot = self.slot(chunk);
                repair::repair(self, &slot, chunk, &source, kind, bytes_per_second).await
            }
            ReplicaRequest::DropChunk { chunk, view } => {
                let slot = self.slot(chunk);
                let keep = |replica: &Replica| -> Result<(), (Status, String)> {
                    if replica.view > view {
                        return Err((
                            Status::StaleView,
                            format!("the replica joined view {} since; kept", replica.view),
                        ));
                    }
                    if let Some(why) = replica.frozen {
                        return Err((Status::Busy, format!("the replica is {why}; kept")));
                    }
                    Ok(())
                };
                {
                    // Changes of the views it leaves are refused from here on; the
                    // ones already in flight end first, or one would be counted
                    // durable after the reset below.
                    let mut replica = slot.replica.lock().unwrap();
                    keep(&replica)?;
                    replica.view = view;
                }
                slot.changed.notify_waiters();
                slot.settled().await;
                {
                    let mut replica = slot.replica.lock().unwrap();
                    keep(&replica)?;
                    // Claims nothing from here on: a read wanting any version, or a
                    // repair, finds an empty replica.
                    replica.submitted = 0;
                    replica.durable = 0;
                    replica.log.clear();
                }
                slot.changed.notify_waiters();
                self.store
                    .zero(
                        chunk,
                        0,
                        CHUNK_BYTES_MAX,
                        true,
                        ChunkMeta { view, version: 0 },
                    )
                    .await
                    .map_err(control_store_error)?;
                self.store
                    .release_retained(chunk, 0..=u32::MAX)
                    .await
                    .map_err(control_store_error)?;
                tracing::info!(?chunk, view, "replica moved away: data freed");
                Ok(ReplicaResponse::Done)
            }
        }
    }
}

impl Handler for ChunkServer {
    /// Every process of the cluster reads and writes replicas: gateways, peers
    /// repairing, the master's recovery, the CLI's flatten and diff. A stranger has
    /// no certificate from the CA and never gets this far; an NBD client's goes
    /// through a gateway.
    fn permits(&self, role: Role, _: &Request) -> Result<(), String> {
        match role {
            Role::Client => {
                Err("an NBD client's certificate reaches volumes through a gateway".into())
            }
            _ => Ok(()),
        }
    }

    async fn handle(self: Arc<Self>, request: Request) -> Response {
        match request {
            Request::Write {
                chunk,
                stamp,
                offset,
                epoch,
                catch_up: true,
                unsynced,
                retain,
                data,
                ..
            } => {
                let change = Change::Write {
                    data,
                    unsynced,
                    epoch,
                    retain,
                };
                self.apply_local(chunk, stamp, offset, change, Room::CatchUp)
                    .await
            }
            Request::Write {
                chunk,
                stamp,
                offset,
                epoch,
                unsynced,
                retain,
                forward,
                data,
                ..
            } => {
                let change = Change::Write {
                    data,
                    unsynced,
                    epoch,
                    retain,
                };
                self.replicate(chunk, stamp, offset, change, forward).await
            }
            Request::Zero {
                chunk,
                stamp,
                offset,
                length,
                epoch,
                punch,
                retain,
                forward,
            } => {
                let change = Change::Zero {
                    length,
                    punch,
                    epoch,
                    retain,
                };
                self.replicate(chunk, stamp, offset, change, forward).await
            }
            Request::Read {
                chunk,
                offset,
                length,
                min_version,
                max_version,
            } => {
                self.read(chunk, offset, length, min_version..=max_version)
                    .await
            }
            Request::ReadAsOf {
                chunk,
                epoch,
                offset,
                length,
                min_version,
            } => {
                self.read_as_of(chunk, epoch, offset, length, min_version)
                    .await
            }
            Request::ReadRetained {
                chunk,
                epoch,
                offset,
            } => self.read_retained(chunk, epoch, offset).await,
            Request::Replica(control) => match self.control(control).await {
                Ok(reply) => Response::Replica(reply),
                Err((status, message)) => Response::error(status, message),
            },
            Request::Master(_) => Response::error(
                Status::BadRequest,
                "this is a chunk server; send cluster requests to the master",
            ),
            Request::Hello { .. } => {
                Response::error(Status::BadRequest, "hello is only valid first")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_protocol::{next_version, RepairKind};

    const VOLUME: u64 = 7;
    const CHUNK: ChunkId = ChunkId {
        volume_id: VOLUME,
        index: 0,
    };

    fn server(dir: &std::path::Path) -> Arc<ChunkServer> {
        server_over(dir, ConnectionPool::default())
    }

    fn server_over(dir: &std::path::Path, peers: ConnectionPool) -> Arc<ChunkServer> {
        Arc::new(ChunkServer {
            store: Store::open_with(dir, &StoreOptions::default()).unwrap(),
            peers,
            slots: Mutex::default(),
            generations: Mutex::default(),
        })
    }

    fn write(chunk: ChunkId, view: u64, prev: u64, version: u64, offset: u64) -> Request {
        Request::Write {
            chunk,
            stamp: Stamp {
                view,
                prev,
                version,
            },
            offset,
            epoch: 0,
            catch_up: false,
            unsynced: false,
            retain: false,
            forward: Vec::new(),
            data: Bytes::from(vec![0xab; 4096]),
        }
    }

    fn at_epoch(mut request: Request, at: u32) -> Request {
        if let Request::Write { epoch, .. } = &mut request {
            *epoch = at;
        }
        request
    }

    fn status(response: &Response) -> Option<Status> {
        match response {
            Response::Error { status, .. } => Some(*status),
            _ => None,
        }
    }

    async fn info(server: &Arc<ChunkServer>, chunk: ChunkId, generation: u32) -> Response {
        let request = ReplicaRequest::ChunkInfo { chunk, generation };
        server.clone().handle(Request::Replica(request)).await
    }

    #[tokio::test]
    async fn refused_requests_do_not_raise_the_fence() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        let top = u32::MAX as u64;
        let refused = [
            // Outside the chunk.
            write(CHUNK, 0, 0, top << 32 | 1, CHUNK_BYTES_MAX),
            // A version that does not follow its predecessor.
            write(CHUNK, 0, top << 32 | 5, top << 32 | 5, 0),
            // Another view.
            write(CHUNK, 3, 0, top << 32 | 1, 0),
        ];
        for request in refused {
            let response = server.clone().handle(request).await;
            assert!(status(&response).is_some(), "accepted: {response:?}");
        }
        let first = next_version(0, 1);
        let response = server.clone().handle(write(CHUNK, 0, 0, first, 0)).await;
        assert!(
            matches!(response, Response::Done),
            "the volume's writer was fenced by refused requests: {response:?}"
        );
    }

    #[tokio::test]
    async fn a_change_at_an_older_snapshot_epoch_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        let v1 = next_version(0, 1);
        let v2 = next_version(v1, 1);
        let response = server
            .clone()
            .handle(at_epoch(write(CHUNK, 0, 0, v1, 0), 3))
            .await;
        assert!(matches!(response, Response::Done), "{response:?}");
        let back = server
            .clone()
            .handle(at_epoch(write(CHUNK, 0, v1, v2, 0), 2))
            .await;
        assert_eq!(status(&back), Some(Status::BadRequest), "{back:?}");
        // The refusal took no version: the same change at the writer's epoch applies.
        let response = server
            .clone()
            .handle(at_epoch(write(CHUNK, 0, v1, v2, 0), 3))
            .await;
        assert!(matches!(response, Response::Done), "{response:?}");
    }

    #[tokio::test]
    async fn a_takeover_query_fences_the_old_writer_before_answering() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        let v1 = next_version(0, 1);
        let response = server.clone().handle(write(CHUNK, 0, 0, v1, 0)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        // Generation 2 learns the version, on this chunk and on one never written.
        let answer = info(&server, CHUNK, 2).await;
        assert!(
            matches!(answer, Response::Replica(ReplicaResponse::ChunkInfo { version, .. }) if version == v1),
            "{answer:?}"
        );
        let untouched = ChunkId {
            volume_id: VOLUME,
            index: 1,
        };
        info(&server, untouched, 2).await;
        // The old writer's late changes cannot land after the answers.
        let late = server
            .clone()
            .handle(write(CHUNK, 0, v1, next_version(v1, 1), 0))
            .await;
        assert_eq!(status(&late), Some(Status::Fenced), "{late:?}");
        let late = server.clone().handle(write(untouched, 0, 0, v1, 0)).await;
        assert_eq!(status(&late), Some(Status::Fenced), "{late:?}");
        // The new writer continues from the version it learned.
        let response = server
            .clone()
            .handle(write(CHUNK, 0, v1, next_version(v1, 2), 0))
            .await;
        assert!(matches!(response, Response::Done), "{response:?}");
    }

    /// Every call goes to one server: a repair's source.
    struct To(Arc<ChunkServer>);

    impl floe_protocol::Transport for To {
        fn call<'a>(
            &'a self,
            _: &'a str,
            request: Request,
        ) -> floe_protocol::transport::CallFuture<'a> {
            Box::pin(async move {
                match self.0.clone().handle(request).await {
                    Response::Error { status, message } => {
                        Err(CallError::Remote { status, message })
                    }
                    response => Ok(response),
                }
            })
        }

        fn forget(&self, _: &str) {}
    }

    #[tokio::test]
    async fn a_retaining_change_keeps_old_blocks_on_every_replica_until_dropped() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let backup = server(b.path());
        let primary = server_over(a.path(), ConnectionPool::over(Arc::new(To(backup.clone()))));
        let v1 = next_version(0, 1);
        let v2 = next_version(v1, 1);
        let v3 = next_version(v2, 1);
        let response = primary.clone().handle(write(CHUNK, 0, 0, v1, 0)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        let response = backup.clone().handle(write(CHUNK, 0, 0, v1, 0)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        let retaining = |prev, version, epoch| {
            let mut request = at_epoch(write(CHUNK, 0, prev, version, 0), epoch);
            if let Request::Write {
                retain,
                forward,
                data,
                ..
            } = &mut request
            {
                *retain = true;
                *forward = vec!["backup".into()];
                *data = Bytes::from(vec![0xcd; 4096]);
            }
            request
        };
        // Epoch 0 has no snapshot to retain for.
        let refused = primary.clone().handle(retaining(v1, v2, 0)).await;
        assert_eq!(status(&refused), Some(Status::BadRequest), "{refused:?}");
        // The primary forwards the flag: both replicas keep the block as it was.
        let response = primary.clone().handle(retaining(v1, v2, 1)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        for server in [&primary, &backup] {
            let entries = server.store.retained(CHUNK);
            assert_eq!(entries.len(), 1, "{entries:?}");
            assert_eq!((entries[0].epoch, entries[0].tag), (1, v2));
            let old = server.store.read_retained(CHUNK, 1, 0).await.unwrap();
            assert_eq!(
                old,
                Some(floe_chunkstore::RetainedBlock::Data(Bytes::from(vec![
                    0xab;
                    4096
                ])))
            );
        }
        let response = primary.clone().handle(retaining(v2, v3, 1)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        assert_eq!(primary.store.retained(CHUNK).len(), 1, "once per epoch");
        // What a repair from v1 copies: the list, then each block.
        let since = ReplicaRequest::RetainedSince {
            chunk: CHUNK,
            since: v1,
        };
        let listed = backup.clone().handle(Request::Replica(since)).await;
        let expected = floe_protocol::RetainedInfo {
            epoch: 1,
            offset: 0,
            tag: v2,
            zeroes: false,
        };
        assert_eq!(
            listed,
            Response::Replica(ReplicaResponse::Retained {
                version: v3,
                blocks: vec![expected]
            })
        );
        let read = |epoch| Request::ReadRetained {
            chunk: CHUNK,
            epoch,
            offset: 0,
        };
        let old = backup.clone().handle(read(1)).await;
        assert_eq!(old, Response::Data(Bytes::from(vec![0xab; 4096])));
        let none = backup.clone().handle(read(2)).await;
        assert_eq!(status(&none), Some(Status::NotFound), "{none:?}");
        // A replica moved away frees its retained blocks with its data.
        let drop = ReplicaRequest::DropChunk {
            chunk: CHUNK,
            view: 1,
        };
        let response = backup.clone().handle(Request::Replica(drop)).await;
        assert!(matches!(response, Response::Replica(_)), "{response:?}");
        assert_eq!(backup.store.retained(CHUNK), vec![]);
        assert_eq!(primary.store.retained(CHUNK).len(), 1);
    }

    #[tokio::test]
    async fn a_replica_reads_as_of_a_snapshot_only_past_changes_of_its_epoch_or_later() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        let v1 = next_version(0, 1);
        let v2 = next_version(v1, 1);
        let response = server.clone().handle(write(CHUNK, 0, 0, v1, 0)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        let mut overwrite = at_epoch(write(CHUNK, 0, v1, v2, 0), 1);
        if let Request::Write { retain, data, .. } = &mut overwrite {
            *retain = true;
            *data = Bytes::from(vec![0xcd; 4096]);
        }
        let response = server.clone().handle(overwrite).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        let as_of = |epoch, min_version| {
            let server = server.clone();
            async move {
                let read = Request::ReadAsOf {
                    chunk: CHUNK,
                    epoch,
                    offset: 0,
                    length: 4096,
                    min_version,
                };
                server.handle(read).await
            }
        };
        let old = Response::Data(Bytes::from(vec![0xab; 4096]));
        let new = Response::Data(Bytes::from(vec![0xcd; 4096]));
        // Snapshot 1 was taken before v2, an epoch 1 change that retained the block.
        assert_eq!(as_of(1, v1).await, old);
        assert_eq!(as_of(1, v2).await, old);
        // Snapshot 2 holds v2; a reader that learned v1 missed a change of epoch 1.
        assert_eq!(as_of(2, v2).await, new);
        assert_eq!(status(&as_of(2, v1).await), Some(Status::Ahead));
        assert_eq!(
            status(&as_of(1, next_version(v2, 1)).await),
            Some(Status::Behind)
        );
        assert_eq!(status(&as_of(0, v2).await), Some(Status::BadRequest));
        // Restarted, the replica no longer knows the epochs past what it holds.
        drop(server);
        let server = self::server(dir.path());
        let read = |min_version| Request::ReadAsOf {
            chunk: CHUNK,
            epoch: 1,
            offset: 0,
            length: 4096,
            min_version,
        };
        let untold = server.clone().handle(read(v1)).await;
        assert_eq!(status(&untold), Some(Status::Ahead), "{untold:?}");
        assert_eq!(server.clone().handle(read(v2)).await, old);
    }

    #[tokio::test]
    async fn a_repair_never_takes_a_replica_back_to_an_older_version() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let source = server(a.path());
        let replica = server_over(b.path(), ConnectionPool::over(Arc::new(To(source.clone()))));
        let v1 = next_version(0, 1);
        let v2 = next_version(v1, 1);
        for server in [&source, &replica] {
            let response = server.clone().handle(write(CHUNK, 0, 0, v1, 0)).await;
            assert!(matches!(response, Response::Done), "{response:?}");
        }
        // The replica acknowledged v2 first; the source has yet to.
        let response = replica.clone().handle(write(CHUNK, 0, v1, v2, 8192)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        let repair = |kind| {
            Request::Replica(ReplicaRequest::Repair {
                chunk: CHUNK,
                source: "source".into(),
                kind,
                bytes_per_second: 0,
            })
        };
        let holds_v2 = || async {
            let version = match info(&replica, CHUNK, 0).await {
                Response::Replica(ReplicaResponse::ChunkInfo { version, .. }) => version,
                other => panic!("{other:?}"),
            };
            let read = Request::Read {
                chunk: CHUNK,
                offset: 8192,
                length: 4096,
                min_version: 0,
                max_version: u64::MAX,
            };
            let data = match replica.clone().handle(read).await {
                Response::Data(data) => data,
                other => panic!("{other:?}"),
            };
            version == v2 && data.iter().all(|b| *b == 0xab)
        };
        // A prefetch (a whole copy: the source's log does not reach v2) is dropped.
        let response = replica.clone().handle(repair(RepairKind::Prefetch)).await;
        assert!(status(&response).is_none(), "{response:?}");
        assert!(holds_v2().await, "a prefetch took back v2");
        // A catch-up (or a scrub's whole copy) fails.
        for kind in [RepairKind::CatchUp, RepairKind::Whole] {
            let response = replica.clone().handle(repair(kind)).await;
            assert_eq!(status(&response), Some(Status::Behind), "{response:?}");
            assert!(holds_v2().await, "a {kind:?} repair took back v2");
        }
        // Once the source has v2 too, a catch-up goes on.
        let response = source.clone().handle(write(CHUNK, 0, v1, v2, 8192)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        let response = replica.clone().handle(repair(RepairKind::CatchUp)).await;
        assert!(
            matches!(response, Response::Replica(ReplicaResponse::Repaired { version, .. }) if version == v2),
            "{response:?}"
        );
        assert!(holds_v2().await);
    }

    #[tokio::test]
    async fn a_repair_whose_source_restarted_copies_only_the_blocks_that_differ() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (source, replica) = (server(a.path()), server(b.path()));
        let mut version = 0;
        for block in 0..16 {
            let next = next_version(version, 1);
            for server in [&source, &replica] {
                let change = write(CHUNK, 0, version, next, block * 4096);
                let response = server.clone().handle(change).await;
                assert!(matches!(response, Response::Done), "{response:?}");
            }
            version = next;
        }
        // The replica misses two changes: a new block, and a block rewritten with
        // other bytes (far apart: a copy reads blocks close together as one). A third
        // rewrites a block with the bytes it held: nothing differs.
        let new_block = write(CHUNK, 0, version, next_version(version, 1), 256 * 4096);
        version = next_version(version, 1);
        let mut rewritten = write(CHUNK, 0, version, next_version(version, 1), 2 * 4096);
        if let Request::Write { data, .. } = &mut rewritten {
            *data = Bytes::from(vec![0xcd; data.len()]);
        }
        version = next_version(version, 1);
        let same = write(CHUNK, 0, version, next_version(version, 1), 5 * 4096);
        version = next_version(version, 1);
        for change in [new_block, rewritten, same] {
            let response = source.clone().handle(change).await;
            assert!(matches!(response, Response::Done), "{response:?}");
        }
        // Both restart: the source's journal lite is gone.
        drop((source, replica));
        let source = server(a.path());
        let replica = server_over(b.path(), ConnectionPool::over(Arc::new(To(source.clone()))));
        let log = ReplicaRequest::LogSince {
            chunk: CHUNK,
            since: next_version(0, 16),
        };
        let response = source.clone().handle(Request::Replica(log)).await;
        assert_eq!(status(&response), Some(Status::NotFound), "{response:?}");
        let repair = Request::Replica(ReplicaRequest::Repair {
            chunk: CHUNK,
            source: "source".into(),
            kind: RepairKind::CatchUp,
            bytes_per_second: 0,
        });
        let response = replica.clone().handle(repair).await;
        assert!(
            matches!(
                response,
                Response::Replica(ReplicaResponse::Repaired {
                    version: v,
                    incremental: false,
                    compared: true,
                    bytes: 8192,
                }) if v == version
            ),
            "{response:?}"
        );
        for server in [&source, &replica] {
            let read = Request::Read {
                chunk: CHUNK,
                offset: 0,
                length: 257 * 4096,
                min_version: 0,
                max_version: u64::MAX,
            };
            let Response::Data(data) = server.clone().handle(read).await else {
                panic!("no data")
            };
            assert!(data[2 * 4096..3 * 4096].iter().all(|b| *b == 0xcd));
            assert!(data[256 * 4096..].iter().all(|b| *b == 0xab));
            assert!(data[16 * 4096..256 * 4096].iter().all(|b| *b == 0));
        }
    }

    /// What a repair from `source` answers.
    async fn repaired(replica: &Arc<ChunkServer>, kind: RepairKind) -> Response {
        let repair = Request::Replica(ReplicaRequest::Repair {
            chunk: CHUNK,
            source: "source".into(),
            kind,
            bytes_per_second: 0,
        });
        replica.clone().handle(repair).await
    }

    /// Keeps a block of 0xee as retained by epoch `epoch` for a change of `tag`.
    async fn keep_retained(store: &Store, chunk: ChunkId, epoch: u32, offset: u64, tag: u64) {
        let entry = floe_chunkstore::RetainedEntry {
            epoch,
            offset,
            tag,
            zeroes: false,
        };
        let block = floe_chunkstore::RetainedBlock::Data(Bytes::from(vec![0xee; 4096]));
        store.install_retained(chunk, entry, block).await.unwrap();
    }

    #[tokio::test]
    async fn heartbeats_free_the_epochs_no_snapshot_reads() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        let staging = ChunkId {
            volume_id: VOLUME,
            index: floe_protocol::CHUNK_INDEX_LIMIT | 5,
        };
        let unlisted = ChunkId {
            volume_id: VOLUME + 1,
            index: 0,
        };
        for (chunk, epoch) in [
            (CHUNK, 1),
            (CHUNK, 2),
            (CHUNK, 3),
            (staging, 1),
            (unlisted, 1),
        ] {
            keep_retained(&server.store, chunk, epoch, 0, 1).await;
        }
        let epochs = |chunk| -> Vec<u32> {
            let held = server.store.retained_epochs(VOLUME).into_iter();
            held.filter(|(c, ..)| *c == chunk)
                .map(|(_, epoch, _)| epoch)
                .collect()
        };
        // Snapshot 2 reads epochs 2 and up; 3 may belong to a snapshot taken since.
        let readers = floe_protocol::SnapshotReaders {
            volume_id: VOLUME,
            epoch: 2,
            snapshots: vec![2],
        };
        let freed = server.free_unread(std::slice::from_ref(&readers)).await;
        assert_eq!((freed.epochs, freed.bytes), (1, 4096));
        assert_eq!(epochs(CHUNK), vec![2, 3]);
        // Snapshot 2 deleted.
        let none = floe_protocol::SnapshotReaders {
            snapshots: Vec::new(),
            ..readers
        };
        assert_eq!(server.free_unread(&[none]).await.epochs, 1);
        assert_eq!(epochs(CHUNK), vec![3]);
        // Snapshot 3 reads block 0 from epoch 3: epoch 4's copy of it goes, the
        // block only epoch 4 kept stays.
        keep_retained(&server.store, CHUNK, 4, 0, 2).await;
        keep_retained(&server.store, CHUNK, 4, 4096, 2).await;
        let three = floe_protocol::SnapshotReaders {
            volume_id: VOLUME,
            epoch: 4,
            snapshots: vec![3],
        };
        let freed = server.free_unread(&[three]).await;
        assert_eq!((freed.epochs, freed.blocks), (0, 1));
        let kept: Vec<(u32, u64)> = server
            .store
            .retained(CHUNK)
            .iter()
            .map(|e| (e.epoch, e.offset))
            .collect();
        assert_eq!(kept, vec![(3, 0), (4, 4096)]);
        // A repair's staging chunk and a volume the master did not list keep theirs.
        assert_eq!(epochs(staging), vec![1]);
        assert_eq!(server.store.retained_epochs(VOLUME + 1).len(), 1);
    }

    #[tokio::test]
    async fn a_replica_digests_the_retained_blocks_snapshots_read_and_names_those_that_rot() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (one, two) = (server(a.path()), server(b.path()));
        for server in [&one, &two] {
            keep_retained(&server.store, CHUNK, 1, 0, 1).await;
            keep_retained(&server.store, CHUNK, 2, 4096, 2).await;
        }
        let checksum = |server: Arc<ChunkServer>, readers| async move {
            let request = ReplicaRequest::Checksum {
                chunk: CHUNK,
                length: 16384,
                readers,
            };
            match server.handle(Request::Replica(request)).await {
                Response::Replica(ReplicaResponse::Checksum {
                    retained,
                    bad_retained,
                    ..
                }) => (retained, bad_retained),
                other => panic!("{other:?}"),
            }
        };
        let (all, bad) = checksum(one.clone(), None).await;
        assert_eq!(bad, vec![]);
        assert_eq!(checksum(two.clone(), None).await, (all, vec![]));
        // Only snapshot 2 is left: no snapshot reads epoch 1, which one replica freed.
        let readers = floe_protocol::SnapshotReaders {
            volume_id: VOLUME,
            epoch: 2,
            snapshots: vec![2],
        };
        two.store.release_retained(CHUNK, 1..=1).await.unwrap();
        let (read, _) = checksum(one.clone(), Some(readers.clone())).await;
        assert_ne!(read, all);
        assert_eq!(
            checksum(two.clone(), Some(readers.clone())).await,
            (read, vec![])
        );
        // A byte of epoch 2's block rots on one replica.
        let sidecar = b
            .path()
            .join("chunks")
            .join(format!("{VOLUME:016x}"))
            .join(format!("{:016x}.r{:08x}", CHUNK.index, 2));
        let mut bytes = std::fs::read(&sidecar).unwrap();
        bytes[0] ^= 1;
        std::fs::write(&sidecar, bytes).unwrap();
        let (rotten, bad) = checksum(two.clone(), Some(readers)).await;
        assert_eq!(bad, vec![(2, 4096)]);
        assert_ne!(rotten, read);
    }

    /// The chunk's retained blocks with their bytes.
    async fn retained_blocks(
        server: &ChunkServer,
    ) -> Vec<(
        floe_chunkstore::RetainedEntry,
        floe_chunkstore::RetainedBlock,
    )> {
        let mut out = Vec::new();
        for entry in server.store.retained(CHUNK) {
            let block = server.store.read_retained(CHUNK, entry.epoch, entry.offset);
            out.push((entry, block.await.unwrap().expect("listed")));
        }
        out
    }

    #[tokio::test]
    async fn a_repair_carries_the_sources_retained_blocks_whatever_its_path() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let source = server(a.path());
        let replica = server_over(b.path(), ConnectionPool::over(Arc::new(To(source.clone()))));
        let v1 = next_version(0, 1);
        for server in [&source, &replica] {
            let response = server.clone().handle(write(CHUNK, 0, 0, v1, 0)).await;
            assert!(matches!(response, Response::Done), "{response:?}");
        }
        let retaining = |prev, epoch, offset| {
            let mut request = at_epoch(write(CHUNK, 0, prev, next_version(prev, 1), offset), epoch);
            if let Request::Write { retain, data, .. } = &mut request {
                *retain = true;
                *data = Bytes::from(vec![0xcd; 4096]);
            }
            request
        };
        // Incremental: the source retained data for epoch 1 since the replica's v1;
        // the replica's block retained for a change above v1 goes.
        let v2 = next_version(v1, 1);
        let response = source.clone().handle(retaining(v1, 1, 0)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        // A divergent block of the replica's own, one the source never retained.
        keep_retained(&replica.store, CHUNK, 1, 8192, v2).await;
        let response = repaired(&replica, RepairKind::CatchUp).await;
        assert!(
            matches!(
                response,
                Response::Replica(ReplicaResponse::Repaired {
                    incremental: true,
                    ..
                })
            ),
            "{response:?}"
        );
        let carried = retained_blocks(&replica).await;
        assert_eq!(carried.len(), 1, "{carried:?}");
        assert_eq!(carried, retained_blocks(&source).await);
        // Compared: the source retained a hole for epoch 2 and restarted; the
        // replica's stray block goes.
        let response = source.clone().handle(retaining(v2, 2, 4096)).await;
        assert!(matches!(response, Response::Done), "{response:?}");
        keep_retained(&replica.store, CHUNK, 1, 8192, v1).await;
        drop((source, replica));
        let source = server(a.path());
        let replica = server_over(b.path(), ConnectionPool::over(Arc::new(To(source.clone()))));
        let response = repaired(&replica, RepairKind::CatchUp).await;
        assert!(
            matches!(
                response,
                Response::Replica(ReplicaResponse::Repaired { compared: true, .. })
            ),
            "{response:?}"
        );
        let carried = retained_blocks(&replica).await;
        assert_eq!(carried.len(), 2, "{carried:?}");
        assert_eq!(carried, retained_blocks(&source).await);
        // Whole: the source's set in place of the replica's.
        keep_retained(&replica.store, CHUNK, 1, 8192, v1).await;
        let response = repaired(&replica, RepairKind::Whole).await;
        assert!(status(&response).is_none(), "{response:?}");
        assert_eq!(retained_blocks(&replica).await, carried);
    }

    /// A server whose store is a chained log over three small disks in `dir`.
    fn chained_server(dir: &std::path::Path) -> Arc<ChunkServer> {
        let options = StoreOptions {
            chain: Some(floe_chunkstore::ChainOptions {
                disks: (0..3).map(|d| dir.join(format!("disk{d}"))).collect(),
                cache_dir: dir.join("flash"),
                disk_bytes: 8 << 20,
                cache_bytes: 0,
                flash_cache_bytes: 0,
                layout: floe_chunkstore::ChainLayout::Chained,
                gc: floe_chunkstore::ChainGc::MoveToTail,
            }),
            ..StoreOptions::default()
        };
        Arc::new(ChunkServer {
            store: Store::open_with(&dir.join("data"), &options).unwrap(),
            peers: ConnectionPool::default(),
            slots: Mutex::default(),
            generations: Mutex::default(),
        })
    }

    #[tokio::test]
    async fn every_store_retains_and_a_change_too_long_to_is_refused_before_the_version() {
        let (chain, ssd, hdd) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let options = StoreOptions {
            journal_dirs: vec![floe_chunkstore::JournalDir {
                dir: ssd.path().to_path_buf(),
                quota_bytes: 4 << 20,
            }],
            local_journal_quota_bytes: 4 << 20,
            ..StoreOptions::default()
        };
        let hybrid = Arc::new(ChunkServer {
            store: Store::open_with(hdd.path(), &options).unwrap(),
            peers: ConnectionPool::default(),
            slots: Mutex::default(),
            generations: Mutex::default(),
        });
        let v1 = next_version(0, 1);
        let v2 = next_version(v1, 1);
        let retaining = |prev, version, length| {
            let mut request = at_epoch(write(CHUNK, 0, prev, version, 0), 1);
            if let Request::Write { retain, data, .. } = &mut request {
                *retain = true;
                *data = Bytes::from(vec![0xcd; length]);
            }
            request
        };
        for server in [hybrid, chained_server(chain.path())] {
            let response = server.clone().handle(write(CHUNK, 0, 0, v1, 0)).await;
            assert!(matches!(response, Response::Done), "{response:?}");
            let too_long = floe_chunkstore::RETAIN_CHANGE_BYTES_MAX as usize + 4096;
            let refused = server.clone().handle(retaining(v1, v2, too_long)).await;
            assert_eq!(status(&refused), Some(Status::BadRequest), "{refused:?}");
            // The replica took nothing: a change that fits goes on at that version.
            let response = server.clone().handle(retaining(v1, v2, 4096)).await;
            assert!(matches!(response, Response::Done), "{response:?}");
            let old = server.store.read_retained(CHUNK, 1, 0).await.unwrap();
            let expected = floe_chunkstore::RetainedBlock::Data(Bytes::from(vec![0xab; 4096]));
            assert_eq!(old, Some(expected));
        }
    }

    /// GetCost over the wire: a chained-log store answers what reading a block costs
    /// it (the files engine cannot tell); an offset past the chunk is refused.
    #[tokio::test]
    async fn a_replica_answers_what_reading_a_block_costs_its_store() {
        let (files, chain) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let logged = chained_server(chain.path());
        let cost = |offset| {
            Request::Replica(ReplicaRequest::ReadCost {
                chunk: CHUNK,
                offset,
            })
        };
        let answer = |response: Response| match response {
            Response::Replica(ReplicaResponse::ReadCost { cost }) => cost,
            other => panic!("{other:?}"),
        };
        let response = logged
            .clone()
            .handle(write(CHUNK, 0, 0, next_version(0, 1), 0))
            .await;
        assert!(matches!(response, Response::Done), "{response:?}");
        // Where each class is found is the chain's own test; here: it answers.
        assert!(answer(logged.clone().handle(cost(0)).await).is_some());
        let unwritten = answer(logged.clone().handle(cost(1 << 20)).await);
        assert_eq!(
            unwritten,
            Some(floe_protocol::ReadCost::Cache),
            "never written"
        );
        let plain = server(files.path());
        assert_eq!(answer(plain.clone().handle(cost(0)).await), None);
        let past = plain.clone().handle(cost(CHUNK_BYTES_MAX)).await;
        assert_eq!(status(&past), Some(Status::BadRequest), "{past:?}");
    }

    #[tokio::test]
    async fn a_replica_being_repaired_refuses_reads() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        let read = || Request::Read {
            chunk: CHUNK,
            offset: 0,
            length: 4096,
            min_version: 0,
            max_version: u64::MAX,
        };
        assert_eq!(status(&server.clone().handle(read()).await), None);
        server.slot(CHUNK).replica.lock().unwrap().frozen = Some(repair::REPAIRING);
        assert_eq!(
            status(&server.clone().handle(read()).await),
            Some(Status::Behind)
        );
    }

    #[tokio::test]
    async fn queries_for_chunks_not_held_create_no_state() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        for index in 0..1000 {
            let chunk = ChunkId {
                volume_id: index % 7,
                index,
            };
            let requests = [
                Request::Read {
                    chunk,
                    offset: 0,
                    length: 4096,
                    min_version: 0,
                    max_version: u64::MAX,
                },
                Request::Replica(ReplicaRequest::ChunkInfo {
                    chunk,
                    generation: 0,
                }),
                Request::Replica(ReplicaRequest::Extents { chunk }),
                Request::Replica(ReplicaRequest::Checksum {
                    chunk,
                    length: 4096,
                    readers: None,
                }),
                Request::Replica(ReplicaRequest::LogSince { chunk, since: 0 }),
            ];
            for request in requests {
                let response = server.clone().handle(request).await;
                assert!(status(&response).is_none(), "{response:?}");
            }
        }
        assert_eq!(server.slots.lock().unwrap().len(), 0);
    }

    #[tokio::test]
    async fn checksum_reports_a_disk_error_as_one() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path());
        // A directory where the chunk file belongs: reading it fails with EISDIR.
        std::fs::create_dir_all(
            dir.path()
                .join("chunks")
                .join(format!("{VOLUME:016x}"))
                .join(format!("{:016x}", CHUNK.index)),
        )
        .unwrap();
        let request = ReplicaRequest::Checksum {
            chunk: CHUNK,
            length: 4096,
            readers: None,
        };
        let response = server.clone().handle(Request::Replica(request)).await;
        assert_eq!(status(&response), Some(Status::Io), "{response:?}");
    }
}
