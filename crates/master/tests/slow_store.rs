//! A slow metadata store (etcd under load) must not hold up heartbeats: the master
//! would otherwise declare healthy chunk servers down and start repairs around them.

use async_trait::async_trait;
use floe_master::{Master, Settings, HEARTBEAT_TIMEOUT};
use floe_metadata::memory::MemoryStore;
use floe_metadata::{MetaError, MetaStore, Op};
use floe_protocol::connection::CallError;
use floe_protocol::server::Handler;
use floe_protocol::transport::CallFuture;
use floe_protocol::{
    ClusterStatus, ConnectionPool, DeviceClass, MasterRequest, MasterResponse, Registration,
    Request, Response, Status, Transport, VolumeMode, VolumeSpec,
};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Far longer than the heartbeat timeout.
const SLOW_WRITE: Duration = Duration::from_secs(10);
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// A store whose writes take `delay` (tokio's clock, so paused time runs it at once).
#[derive(Clone, Default)]
struct SlowStore {
    inner: MemoryStore,
    delay: Arc<Mutex<Duration>>,
    failing: Arc<AtomicBool>,
}

#[async_trait]
impl MetaStore for SlowStore {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        self.inner.get(key).await
    }

    async fn scan_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError> {
        self.inner.scan_prefix(prefix).await
    }

    async fn apply(&self, ops: Vec<Op>) -> Result<(), MetaError> {
        let delay = *self.delay.lock().unwrap();
        tokio::time::sleep(delay).await;
        if self.failing.load(Ordering::SeqCst) {
            return Err(MetaError::Backend("etcd is unreachable".into()));
        }
        self.inner.apply(ops).await
    }
}

/// Chunk servers that never answer; counts what the master asks them (repairs).
#[derive(Default)]
struct Unreachable {
    calls: AtomicUsize,
}

impl Transport for Unreachable {
    fn call<'a>(&'a self, address: &'a str, _request: Request) -> CallFuture<'a> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move { Err(CallError::Closed(address.to_string())) })
    }

    fn forget(&self, _address: &str) {}
}

async fn control(master: &Arc<Master>, request: MasterRequest) -> MasterResponse {
    match master.clone().handle(Request::Master(request)).await {
        Response::Master(reply) => reply,
        other => panic!("master answered {other:?}"),
    }
}

async fn status(master: &Arc<Master>) -> ClusterStatus {
    match control(master, MasterRequest::Status).await {
        MasterResponse::Status(status) => *status,
        other => panic!("status answered {other:?}"),
    }
}

fn heartbeat(id: u32) -> MasterRequest {
    MasterRequest::Heartbeat {
        id,
        used_bytes: 0,
        journal_used_bytes: 0,
        journal_quota_bytes: 0,
        corrupt_blocks: Vec::new(),
        fs: None,
    }
}

fn volume(name: &str) -> VolumeSpec {
    VolumeSpec {
        name: name.into(),
        size_bytes: 1 << 30,
        replicas: 3,
        chunk_bytes: 64 << 20,
        stripe_unit_bytes: 64 << 10,
        stripe_count: 4,
        mode: VolumeMode::Ssd,
        write_mode: Default::default(),
    }
}

/// A master over `store` with three registered ssd servers on hosts a, b, c, and a
/// volume `vm` with its first chunk allocated.
async fn cluster(store: &SlowStore, peers: Arc<Unreachable>) -> (Arc<Master>, Vec<u32>, u64) {
    let master = floe_master::start(
        Box::new(store.clone()),
        Settings::default(),
        ConnectionPool::over(peers),
    )
    .await
    .unwrap();
    let mut ids = Vec::new();
    for host in ["a", "b", "c"] {
        let registered = control(
            &master,
            MasterRequest::Register(Registration {
                uuid: host.into(),
                address: format!("{host}:7701"),
                host: host.into(),
                class: DeviceClass::Ssd,
                emulated: false,
                capacity_bytes: 1 << 40,
            }),
        )
        .await;
        let MasterResponse::Registered { id } = registered else {
            panic!("register answered {registered:?}");
        };
        ids.push(id);
    }
    let created = control(&master, MasterRequest::CreateVolume(volume("vm"))).await;
    let MasterResponse::Volume(vm) = created else {
        panic!("create answered {created:?}");
    };
    control(&master, allocate(vm.id, 0)).await;
    (master, ids, vm.id)
}

fn allocate(volume_id: u64, index: u64) -> MasterRequest {
    MasterRequest::AllocateChunk {
        volume_id,
        index,
        proposal: None,
        epoch: 0,
        generation: 0,
    }
}

/// Heartbeats for `ids` every second, as live servers send them.
fn keep_alive(master: &Arc<Master>, ids: Vec<u32>) {
    let master = master.clone();
    tokio::spawn(async move {
        loop {
            for id in &ids {
                control(&master, heartbeat(*id)).await;
            }
            tokio::time::sleep(HEARTBEAT_INTERVAL).await;
        }
    });
}

async fn acquire(master: &Arc<Master>, holder: &str) -> Response {
    let request = MasterRequest::AcquireLease {
        name: "vm".into(),
        holder: holder.into(),
        attempt: 0,
    };
    master.clone().handle(Request::Master(request)).await
}

#[tokio::test(start_paused = true)]
async fn a_slow_metadata_write_delays_no_heartbeat_and_downs_no_server() {
    let store = SlowStore::default();
    let peers = Arc::new(Unreachable::default());
    let (master, ids, vm) = cluster(&store, peers.clone()).await;

    *store.delay.lock().unwrap() = SLOW_WRITE;
    let slow = {
        let master = master.clone();
        tokio::spawn(async move {
            control(&master, allocate(vm, 1)).await;
            control(&master, MasterRequest::CreateVolume(volume("other"))).await
        })
    };
    let started = Instant::now();
    while started.elapsed() < 2 * SLOW_WRITE + HEARTBEAT_TIMEOUT {
        tokio::time::sleep(HEARTBEAT_INTERVAL).await;
        for id in &ids {
            let sent = Instant::now();
            let reply = control(&master, heartbeat(*id)).await;
            assert!(matches!(reply, MasterResponse::HeartbeatAck { .. }));
            assert!(
                sent.elapsed() < HEARTBEAT_INTERVAL,
                "heartbeat of server {id} answered after {:?}",
                sent.elapsed()
            );
        }
        let status = status(&master).await;
        assert!(
            status.servers.iter().all(|s| s.up),
            "a heartbeating server was declared down at {:?}: {:?}",
            started.elapsed(),
            status.servers
        );
        assert_eq!(status.recovery.degraded_chunks, 0);
    }
    assert!(matches!(slow.await.unwrap(), MasterResponse::Volume(_)));
    assert_eq!(
        peers.calls.load(Ordering::SeqCst),
        0,
        "the master repaired around servers that were fine"
    );
}

/// A renewal that arrives while another holder's grant is being stored must not
/// extend the old lease: both holders would believe they hold the volume.
#[tokio::test(start_paused = true)]
async fn a_renewal_during_a_stored_grant_is_fenced_by_it() {
    let store = SlowStore::default();
    let (master, _, _) = cluster(&store, Default::default()).await;
    let Response::Master(MasterResponse::Lease { generation, .. }) = acquire(&master, "a").await
    else {
        panic!("no lease");
    };
    tokio::time::sleep(floe_master::LEASE_TERM * 2).await;
    *store.delay.lock().unwrap() = SLOW_WRITE;
    let grant = {
        let master = master.clone();
        tokio::spawn(async move { acquire(&master, "b").await })
    };
    tokio::time::sleep(SLOW_WRITE / 2).await;
    let renewal = MasterRequest::RenewLease {
        name: "vm".into(),
        generation,
    };
    let renewed = master.clone().handle(Request::Master(renewal)).await;
    assert!(
        matches!(
            renewed,
            Response::Error {
                status: Status::Fenced,
                ..
            }
        ),
        "{renewed:?}"
    );
    assert!(matches!(
        grant.await.unwrap(),
        Response::Master(MasterResponse::Lease { generation: g, .. }) if g == generation + 1
    ));
}

/// Changes decided at the same time still hand out every id and generation once,
/// and allocate a chunk once.
#[tokio::test(start_paused = true)]
async fn concurrent_changes_hand_out_ids_and_generations_once() {
    let store = SlowStore::default();
    let (master, ids, vm) = cluster(&store, Default::default()).await;
    keep_alive(&master, ids);
    *store.delay.lock().unwrap() = SLOW_WRITE;
    let spawn = |request: MasterRequest| {
        let master = master.clone();
        tokio::spawn(async move { master.handle(Request::Master(request)).await })
    };
    let creates: Vec<_> = ["x", "y"]
        .iter()
        .map(|name| spawn(MasterRequest::CreateVolume(volume(name))))
        .collect();
    let allocations: Vec<_> = (0..2).map(|_| spawn(allocate(vm, 1))).collect();
    let grants: Vec<_> = ["a", "b"]
        .iter()
        .map(|holder| {
            spawn(MasterRequest::AcquireLease {
                name: "vm".into(),
                holder: holder.to_string(),
                attempt: 0,
            })
        })
        .collect();
    let mut ids = Vec::new();
    for create in creates {
        let Response::Master(MasterResponse::Volume(volume)) = create.await.unwrap() else {
            panic!("volume not created");
        };
        ids.push(volume.id);
    }
    ids.sort_unstable();
    assert_eq!(ids, [vm + 1, vm + 2]);
    let mut placements = Vec::new();
    for allocation in allocations {
        let Response::Master(MasterResponse::Chunk { placement, .. }) = allocation.await.unwrap()
        else {
            panic!("chunk not allocated");
        };
        placements.push(placement);
    }
    assert_eq!(placements[0], placements[1]);
    let mut granted = 0;
    for grant in grants {
        match grant.await.unwrap() {
            Response::Master(MasterResponse::Lease { generation: 1, .. }) => granted += 1,
            Response::Error {
                status: Status::Busy,
                ..
            } => {}
            other => panic!("acquire answered {other:?}"),
        }
    }
    assert_eq!(granted, 1);
}

/// A change the store refused leaves no trace in memory: the next one takes the same
/// id and generation.
#[tokio::test(start_paused = true)]
async fn a_failed_store_write_leaves_memory_as_it_was() {
    let store = SlowStore::default();
    let (master, _, vm) = cluster(&store, Default::default()).await;
    store.failing.store(true, Ordering::SeqCst);
    let refused = master
        .clone()
        .handle(Request::Master(MasterRequest::CreateVolume(volume("x"))))
        .await;
    assert!(matches!(
        refused,
        Response::Error {
            status: Status::Unavailable,
            ..
        }
    ));
    assert!(matches!(
        acquire(&master, "a").await,
        Response::Error {
            status: Status::Unavailable,
            ..
        }
    ));
    let MasterResponse::Volumes { volumes } = control(&master, MasterRequest::ListVolumes).await
    else {
        panic!("no volume list");
    };
    assert_eq!(volumes.len(), 1);
    store.failing.store(false, Ordering::SeqCst);
    let MasterResponse::Volume(x) =
        control(&master, MasterRequest::CreateVolume(volume("x"))).await
    else {
        panic!("volume not created");
    };
    assert_eq!(x.id, vm + 1);
    assert!(matches!(
        acquire(&master, "a").await,
        Response::Master(MasterResponse::Lease { generation: 1, .. })
    ));
}

/// A master that stalls (its process paused, its host overloaded) finds the
/// heartbeats sent meanwhile only afterwards: the stall is not the servers' silence.
#[tokio::test(start_paused = true)]
async fn a_stalled_master_declares_no_server_down() {
    let store = SlowStore::default();
    let peers = Arc::new(Unreachable::default());
    let (master, ids, _) = cluster(&store, peers.clone()).await;
    for _ in 0..3 {
        for id in &ids {
            control(&master, heartbeat(*id)).await;
        }
        tokio::time::sleep(HEARTBEAT_INTERVAL).await;
    }
    // Nothing runs while the clock jumps: the master, like every task, was stopped.
    tokio::time::advance(HEARTBEAT_TIMEOUT * 2).await;
    // The master's overdue scan runs first; the heartbeats that waited come after.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let status = status(&master).await;
    assert!(status.servers.iter().all(|s| s.up), "{:?}", status.servers);
    for id in &ids {
        control(&master, heartbeat(*id)).await;
    }
    tokio::time::sleep(HEARTBEAT_INTERVAL * 3).await;
    assert_eq!(
        peers.calls.load(Ordering::SeqCst),
        0,
        "the master repaired around servers that were fine"
    );
}
