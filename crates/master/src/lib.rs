//! The master: cluster membership, volumes, chunk allocation, volume leases, and
//! failure handling. Never on the data path: a gateway asks it for a volume's map
//! once, for a chunk's placement on the chunk's first write, and again only when a
//! replica fails.
//!
//! Where each request is handled ([`Master::control`] dispatches):
//! - [`membership`]: chunk servers register, heartbeat, are marked lost; liveness.
//! - [`volumes`]: create, list, map, resize, delete; [`qos`]: rate limits.
//! - [`chunks`]: allocation on first write, laggard reports.
//! - [`lease`]: the single-writer lease of a volume.
//! - [`snapshots`]: snapshot epochs; [`reclaim`]: freeing, in the background, the
//!   delta chunks no snapshot reads.
//! - [`map`]: the cluster map (expand, remap, shrink, merge).
//! - [`status`]: `floe status`.
//! - [`recovery`]: view changes that repair and move chunks, and scrub.
//! - [`exported`]: the metrics the master exports at `/metrics`.
//! - [`standby`]: several masters on one etcd store: one leads, the others stand by.
//! - [`sessions`]: gateways by name, and volume sessions moving between them.
//!
//! [`state`] holds what the master knows and its keys in the metadata store (embedded
//! redb or etcd). Every change is decided from the in-memory state, stored, and only
//! then applied in memory ([`Master::change`]); reads and heartbeats never wait for
//! the store.

mod access;
mod chunks;
mod clones;
mod exported;
mod lease;
mod map;
mod membership;
pub mod qos;
pub mod reclaim;
pub mod recovery;
mod sessions;
mod snapshots;
mod standby;
mod state;
mod status;
mod volumes;

pub use lease::{LEASE_DRIFT_MARGIN, LEASE_TERM};
pub use membership::HEARTBEAT_TIMEOUT;
pub use sessions::GATEWAY_GONE;

use floe_metadata::{MetaError, MetaStore, Op};
use floe_protocol::server::{self, Handler};
use floe_protocol::tls::Role;
use floe_protocol::{
    ConnectionPool, JournalUsage, MasterRequest, MasterResponse, PlacementMode, Request, Response,
    Status,
};
use state::{store_failed, State};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::net::TcpListener;

/// How the master places chunks and how hard it may work at moving them.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Repairs after failures.
    pub recovery: recovery::Limits,
    /// Moves to where the cluster map places chunks (after an expansion or a remap).
    pub moves: recovery::Limits,
    /// For a new cluster; an existing one keeps the mode its map has.
    pub placement: PlacementMode,
    /// The background scrub.
    pub scrub: recovery::ScrubSettings,
    /// Freeing the space of deleted snapshots.
    pub reclaim: reclaim::ReclaimSettings,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            recovery: recovery::Limits::default(),
            moves: recovery::Limits::MOVES,
            placement: PlacementMode::default(),
            scrub: recovery::ScrubSettings::default(),
            reclaim: reclaim::ReclaimSettings::default(),
        }
    }
}

pub struct Master {
    store: Box<dyn MetaStore>,
    /// Serialises changes to the stored state and is held across the store write, so
    /// each change is decided from what every earlier one left: ids, allocations and
    /// lease generations are handed out once. Control requests that change the store
    /// are rare; heartbeats and reads never take it.
    changes: tokio::sync::Mutex<()>,
    /// Everything the master knows, stored or not (heartbeats, lease terms). Held for
    /// work in memory only, never across a store write or a call to a chunk server
    /// (a std mutex: a guard held over an await does not compile where it is
    /// spawned), so a slow metadata store never delays a heartbeat.
    state: Mutex<State>,
    /// Connections to chunk servers, for recovery and scrub.
    peers: ConnectionPool,
    recovery: recovery::Progress,
    moves: recovery::Progress,
    /// Blocks found failing their checksums, and the background scrub.
    integrity: recovery::Integrity,
    /// Delta chunks freed in the background.
    reclaim: reclaim::Reclaim,
    /// A writer switched to a new snapshot epoch.
    snapshot_confirmed: tokio::sync::Notify,
    /// A snapshot was created or deleted.
    snapshots_changed: tokio::sync::Notify,
    /// Gateways and session moves (in memory only; lock after `state`).
    sessions: Mutex<sessions::Sessions>,
    /// A session moved, or a lease was taken or released.
    sessions_changed: tokio::sync::Notify,
}

pub(crate) type Failure = (Status, String);

/// The longest a long-poll waits: below a client's deadline for a master call.
const WATCH_WAIT_MAX: Duration = Duration::from_secs(3);
pub(crate) type Reply = Result<MasterResponse, Failure>;

/// A long-poll: `poll` returns the value now and whether it is news to the asker;
/// the value is answered once it is, or once `wait` is over. `changed` wakes it.
pub(crate) async fn long_poll<T>(
    changed: &tokio::sync::Notify,
    wait: Duration,
    mut poll: impl FnMut() -> Result<(T, bool), Failure>,
) -> Result<T, Failure> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let notified = changed.notified();
        let (now, news) = poll()?;
        if news || tokio::time::timeout_at(deadline, notified).await.is_err() {
            return Ok(now);
        }
    }
}

impl Master {
    /// Loads the cluster state from the metadata store; calls to chunk servers go
    /// through `peers`.
    pub async fn load(
        store: Box<dyn MetaStore>,
        settings: Settings,
        peers: ConnectionPool,
    ) -> Result<Master, String> {
        let state = State::load(store.as_ref(), settings).await?;
        let has_chunks = !state.chunks.is_empty();
        let master = Master {
            store,
            changes: tokio::sync::Mutex::new(()),
            state: Mutex::new(state),
            peers,
            recovery: recovery::Progress::new(settings.recovery),
            moves: recovery::Progress::new(settings.moves),
            integrity: recovery::Integrity::new(settings.scrub),
            reclaim: reclaim::Reclaim::new(settings.reclaim),
            snapshot_confirmed: tokio::sync::Notify::new(),
            snapshots_changed: tokio::sync::Notify::new(),
            sessions: Mutex::default(),
            sessions_changed: tokio::sync::Notify::new(),
        };
        // Chunks allocated before the cluster map existed belong to its first layer.
        if has_chunks {
            master.bootstrap_map().await.map_err(|(_, e)| e)?;
        }
        Ok(master)
    }

    /// The state, with liveness judged as of now.
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        let mut state = self.state.lock().unwrap();
        state.refresh_liveness();
        state
    }

    /// Stores `ops` (none: nothing to store).
    async fn store(&self, ops: Vec<Op>) -> Result<(), Failure> {
        if ops.is_empty() {
            return Ok(());
        }
        match self.store.apply(ops).await {
            // Another master leads: nothing this one decides may stand.
            Err(MetaError::Deposed) => {
                tracing::error!("{}; stopping", MetaError::Deposed);
                std::process::exit(3);
            }
            applied => applied.map_err(store_failed),
        }
    }

    /// One change to the stored state: `decide` sees the state with every earlier
    /// change applied and none in flight, and returns what to store and what `apply`
    /// needs; `apply` updates the memory once the store has it, so a failed write
    /// leaves the memory as it was.
    pub(crate) async fn change<P, T>(
        &self,
        decide: impl FnOnce(&State) -> Result<(Vec<Op>, P), Failure>,
        apply: impl FnOnce(&mut State, P) -> T,
    ) -> Result<T, Failure> {
        let _serial = self.changes.lock().await;
        let (ops, decided) = decide(&self.state())?;
        self.store(ops).await?;
        Ok(apply(&mut self.state(), decided))
    }

    /// Hands each request to the module that handles it.
    async fn control(&self, request: MasterRequest) -> Reply {
        use MasterRequest as R;
        match request {
            R::Register(registration) => self.register(registration).await,
            R::Heartbeat {
                id,
                used_bytes,
                journal_used_bytes,
                journal_quota_bytes,
                corrupt_blocks,
                fs,
            } => {
                let journal = JournalUsage {
                    used_bytes: journal_used_bytes,
                    quota_bytes: journal_quota_bytes,
                };
                self.report_corrupt(id, &corrupt_blocks);
                self.heartbeat(id, used_bytes, journal, corrupt_blocks.len() as u64, fs)
            }
            R::MarkLost { id } => self.mark_lost(id).await,
            R::CreateVolume(spec) => self.create_volume(spec).await,
            R::ListVolumes => self.list_volumes(),
            R::GetVolumeMap { name } => self.volume_map(&name),
            R::ResizeVolume { name, size_bytes } => self.resize_volume(&name, size_bytes).await,
            R::SetQos {
                name,
                iops,
                bytes_per_second,
            } => self.set_qos(&name, iops, bytes_per_second).await,
            R::SetWriteMode { name, mode } => self.set_write_mode(&name, mode).await,
            R::DeleteVolume { name } => self.delete_volume(&name).await,
            R::AllocateChunk {
                volume_id,
                index,
                proposal,
                epoch,
                generation,
            } => {
                self.allocate_chunk(volume_id, index, proposal, epoch, generation)
                    .await
            }
            R::ReportLaggard {
                volume_id,
                index,
                server,
                generation,
            } => {
                self.report_laggard(volume_id, index, server, Some(generation))
                    .await
            }
            R::AcquireLease {
                name,
                holder,
                attempt,
            } => self.acquire_lease(&name, holder, attempt).await,
            R::RenewLease { name, generation } => self.renew_lease(&name, generation).await,
            R::ReleaseLease { name, generation } => self.release_lease(&name, generation),
            request @ (R::GetClusterMap
            | R::ExpandCluster { .. }
            | R::RemapPg { .. }
            | R::ShrinkLayer { .. }
            | R::MergeLayers { .. }) => self.map_request(request).await,
            R::Status => self.status(),
            R::CreateSnapshot { name, snapshot } => self.create_snapshot(&name, &snapshot).await,
            R::DeleteSnapshot { name, snapshot } => self.delete_snapshot(&name, &snapshot).await,
            R::CloneVolume {
                name,
                snapshot,
                clone,
            } => self.clone_volume(&name, &snapshot, &clone).await,
            R::FlattenVolume { name, generation } => self.flatten_volume(&name, generation).await,
            R::WatchSnapshotEpochs {
                name,
                generation,
                known,
                wait_ms,
            } => {
                let wait = Duration::from_millis(wait_ms).min(WATCH_WAIT_MAX);
                self.watch_snapshot_epochs(&name, generation, known, wait)
                    .await
            }
            R::ConfirmSnapshotEpoch {
                name,
                generation,
                epoch,
            } => self.confirm_snapshot_epoch(&name, generation, epoch).await,
            R::GatewayPoll {
                name,
                address,
                holder,
                known,
                wait_ms,
            } => {
                let wait = Duration::from_millis(wait_ms).min(WATCH_WAIT_MAX);
                self.gateway_poll([name, address, holder], known, wait)
                    .await
            }
            R::MoveSession { name, to } => self.move_session(&name, &to),
            R::WatchSession {
                name,
                known,
                wait_ms,
            } => {
                let wait = Duration::from_millis(wait_ms).min(WATCH_WAIT_MAX);
                self.watch_session(&name, known, wait).await
            }
            R::Scrub { name } => {
                let report = recovery::scrub(self, &name).await?;
                self.integrity.record(&report, &name);
                Ok(MasterResponse::Scrub(report))
            }
        }
    }
}

impl Handler for Master {
    fn permits(&self, role: Role, request: &Request) -> Result<(), String> {
        access::permits(role, request)
    }

    async fn handle(self: Arc<Self>, request: Request) -> Response {
        match request {
            Request::Master(request) => match self.control(request).await {
                Ok(reply) => Response::Master(reply),
                Err((status, message)) => Response::error(status, message),
            },
            Request::Replica(_) => Response::error(
                Status::BadRequest,
                "this is the master; replica requests go to chunk servers",
            ),
            _ => Response::error(
                Status::BadRequest,
                "this is the master; data requests go to chunk servers",
            ),
        }
    }
}

/// Loads the master's state and starts its background work (failure detection,
/// repairs, moves); returns the request handler.
pub async fn start(
    store: Box<dyn MetaStore>,
    settings: Settings,
    peers: ConnectionPool,
) -> Result<Arc<Master>, String> {
    let master = Arc::new(Master::load(store, settings, peers).await?);
    exported::register();
    tokio::spawn(recovery::run(master.clone()));
    tokio::spawn(recovery::heal_reported(master.clone()));
    tokio::spawn(recovery::background_scrub(master.clone()));
    tokio::spawn(reclaim::run(master.clone()));
    Ok(master)
}

/// Serves the master on `listener` over the metadata store at `metadata` (see
/// `floe_metadata::open`), repairing and moving chunks within `settings`. On a store
/// several masters share (etcd), it stands by until elected and stops (returns an
/// error) once it may no longer lead.
pub async fn run(listener: TcpListener, metadata: &str, settings: Settings) -> Result<(), String> {
    let store = floe_metadata::open(metadata)
        .await
        .map_err(|e| e.to_string())?;
    // A violated invariant (a panic in any task) stops the process: serving on from
    // a state it cannot trust would spread the damage to the metadata store and the
    // replicas. Only here, in the master's own process; tests see the panic itself.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |panic| {
        report(panic);
        std::process::abort();
    }));
    let address = listener
        .local_addr()
        .map_err(|e| e.to_string())?
        .to_string();
    let election = store.election();
    let gate = Arc::new(standby::Gate::new(election.clone()));
    let (lost, serving) = match &election {
        // Standbys answer at once (`NotLeader`, naming the leader).
        Some(election) => {
            let mut serving = tokio::spawn(server::serve(listener, gate.clone()));
            tracing::info!(%address, %metadata, "standing by: campaigning to lead");
            let elected = campaign(election.as_ref(), &address);
            let lost = tokio::select! {
                served = &mut serving => return Err(format!("accept failed: {served:?}")),
                lost = elected => lost,
            };
            gate.lead(start(store, settings, ConnectionPool::default()).await?);
            (Some(lost), serving)
        }
        // The only master: connections wait in the backlog while it loads.
        None => {
            gate.lead(start(store, settings, ConnectionPool::default()).await?);
            (None, tokio::spawn(server::serve(listener, gate.clone())))
        }
    };
    tracing::info!(%address, %metadata, "master serving");
    let lost = async {
        match lost {
            Some(lost) => lost.await.unwrap_or_else(|_| "the election ended".into()),
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        served = serving => Err(format!("accept failed: {served:?}")),
        why = lost => Err(format!("this master stopped leading: {why}; a standby takes over")),
    }
}

/// Campaigns until elected. A standby whose candidacy lapses (etcd lost its own
/// leader, or this host lost etcd for a while) campaigns again rather than exit: only
/// a leader must stop when its lease is in doubt, and a cluster whose standbys all
/// exited at one etcd hiccup would have no master left.
async fn campaign(
    election: &dyn floe_metadata::Election,
    address: &str,
) -> tokio::sync::oneshot::Receiver<String> {
    loop {
        match election.campaign(address).await {
            Ok(lost) => return lost,
            Err(e) => {
                tracing::warn!("{e}; campaigning again in {CAMPAIGN_RETRY:?}");
                tokio::time::sleep(CAMPAIGN_RETRY).await;
            }
        }
    }
}

/// How long a standby whose candidacy failed waits before it campaigns again.
const CAMPAIGN_RETRY: std::time::Duration = std::time::Duration::from_secs(1);
