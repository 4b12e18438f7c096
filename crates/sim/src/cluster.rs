//! The simulated cluster: a master, chunk servers on hosts and gateways, each the real
//! code started on the simulated network, and what kills and restarts them.

use crate::network::{service, Network, ProcessId, SimTransport};
use async_trait::async_trait;
use floe_blockdev::BlockDevice;
use floe_chunkserver::StoreOptions;
use floe_chunkstore::space::floor_of;
use floe_chunkstore::{SimDisk, Store, Tuning};
use floe_client::master::MasterClient;
use floe_metadata::memory::MemoryStore;
use floe_metadata::{MetaError, MetaStore, Op};
use floe_protocol::{ChunkPlacement, ConnectionPool, DeviceClass, Registration};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub const MASTER_ADDRESS: &str = "master:7700";
pub const VOLUME: &str = "sim";
/// Where a chunk server keeps its data on its simulated disk.
const DATA_DIR: &str = "/floe";

/// The master's metadata service: it outlives masters (as etcd does), but a dead
/// master's zombie tasks can no longer write to it.
struct MasterMeta {
    inner: MemoryStore,
    network: Arc<Network>,
    process: ProcessId,
    incarnation: u64,
    dies_storing_a_view: Arc<AtomicBool>,
}

impl MasterMeta {
    async fn alive(&self) {
        if !self.network.is_current(self.process, self.incarnation) {
            std::future::pending::<()>().await;
        }
    }

    /// Whether `ops` store a chunk in a later view than the store holds: the last step
    /// of a view change, after the replicas moved to that view.
    async fn stores_a_new_view(&self, ops: &[Op]) -> bool {
        for op in ops {
            let Op::Put { key, value } = op else { continue };
            if !key.starts_with("chunk/") {
                continue;
            }
            let view = |raw: &[u8]| {
                serde_json::from_slice::<ChunkPlacement>(raw)
                    .expect("a chunk placement")
                    .view
            };
            if let Ok(Some(old)) = self.inner.get(key).await {
                if view(value) > view(&old) {
                    return true;
                }
            }
        }
        false
    }
}

#[async_trait]
impl MetaStore for MasterMeta {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        self.alive().await;
        self.inner.get(key).await
    }

    async fn scan_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError> {
        self.alive().await;
        self.inner.scan_prefix(prefix).await
    }

    async fn apply(&self, ops: Vec<Op>) -> Result<(), MetaError> {
        self.alive().await;
        if self.dies_storing_a_view.load(Ordering::SeqCst) && self.stores_a_new_view(&ops).await {
            // The replicas are in the new view and the map will never say so: an
            // orphan view, which the next master must get writes out of.
            self.dies_storing_a_view.store(false, Ordering::SeqCst);
            tracing::info!("the master dies storing a view change");
            self.network.kill(self.process);
            std::future::pending::<()>().await;
        }
        self.inner.apply(ops).await
    }
}

pub struct Server {
    pub process: ProcessId,
    pub host: String,
    pub address: String,
    uuid: String,
    /// Its disk, which outlives its processes.
    disk: SimDisk,
    /// Died for good and marked lost.
    pub lost: bool,
}

pub struct Gateway {
    pub process: ProcessId,
    pub name: String,
    pub device: Option<Arc<dyn BlockDevice>>,
}

pub struct Cluster {
    pub network: Arc<Network>,
    meta: MemoryStore,
    settings: floe_master::Settings,
    pub master: ProcessId,
    pub servers: Vec<Server>,
    pub gateways: Vec<Gateway>,
    /// The operator's CLI.
    admin: Arc<MasterClient>,
    /// Armed: the master dies as it stores its next view change (see `MasterMeta`).
    pub master_dies_storing_a_view: Arc<AtomicBool>,
}

impl Cluster {
    pub fn new(network: Arc<Network>, settings: floe_master::Settings) -> Cluster {
        let master = network.add("master", "master");
        let admin_process = network.add("admin", "admin");
        let admin = Arc::new(MasterClient::over(
            MASTER_ADDRESS,
            ConnectionPool::over(network.boot(admin_process)),
        ));
        Cluster {
            network,
            meta: MemoryStore::default(),
            settings,
            master,
            servers: Vec::new(),
            gateways: Vec::new(),
            admin,
            master_dies_storing_a_view: Arc::default(),
        }
    }

    pub fn admin(&self) -> &Arc<MasterClient> {
        &self.admin
    }

    /// A pool for calls from the admin process (to chunk servers, for checks).
    pub fn admin_pool(&self) -> &ConnectionPool {
        self.admin.pool()
    }

    pub async fn start_master(&self) -> Result<(), String> {
        let transport = self.network.boot(self.master);
        let meta = MasterMeta {
            inner: self.meta.clone(),
            network: self.network.clone(),
            process: self.master,
            incarnation: transport.incarnation(),
            dies_storing_a_view: self.master_dies_storing_a_view.clone(),
        };
        let master = floe_master::start(
            Box::new(meta),
            self.settings,
            ConnectionPool::over(transport.clone()),
        )
        .await
        .map_err(|e| format!("the master did not start: {e}"))?;
        self.network
            .serve(&transport, MASTER_ADDRESS, service(master));
        Ok(())
    }

    pub fn kill_master(&self) {
        self.network.kill(self.master);
    }

    /// Adds a chunk server on `host` (not started).
    pub fn add_server(&mut self, host: &str) -> usize {
        let n = self.servers.len();
        let name = format!("cs{n}");
        let process = self.network.add(&name, host);
        self.servers.push(Server {
            process,
            host: host.to_string(),
            address: format!("{name}:7000"),
            uuid: format!("{n:032x}"),
            disk: SimDisk::new(),
            lost: false,
        });
        n
    }

    pub async fn start_server(&self, n: usize) -> Result<(), String> {
        let server = &self.servers[n];
        let transport = self.network.boot(server.process);
        let tuning = Tuning {
            // Checkpoints every few dozen writes, so crashes land around them too.
            wal_checkpoint_bytes: 256 << 10,
            check_reads: true,
            ..Tuning::default()
        };
        let store = Store::open_on(
            server.disk.mount(),
            Path::new(DATA_DIR),
            &StoreOptions::default(),
            &tuning,
        )
        .map_err(|e| format!("chunk server {n} cannot open its data after a crash: {e}"))?;
        let handler = floe_chunkserver::start(
            store,
            Registration {
                uuid: server.uuid.clone(),
                address: server.address.clone(),
                host: server.host.clone(),
                class: DeviceClass::Ssd,
                emulated: false,
                capacity_bytes: 1 << 30,
            },
            MASTER_ADDRESS.to_string(),
            ConnectionPool::over(transport.clone()),
        )
        .await
        .map_err(|e| format!("chunk server {n} cannot finish a repair after a crash: {e}"))?;
        self.network
            .serve(&transport, &server.address, service(handler));
        Ok(())
    }

    /// kill -9 of a chunk server: what it wrote stays, synced or not.
    pub fn kill_server(&mut self, n: usize) {
        self.network.kill(self.servers[n].process);
        self.servers[n].disk.crash();
    }

    /// The power goes after the disk of server `n` takes `changes` more changes:
    /// the server's work fails from there, wherever it is (mid-batch, between a
    /// sync and the next write), until [`Cluster::power_cut`].
    pub fn power_failing(&self, n: usize, changes: u64) {
        self.servers[n].disk.fail_after(changes);
    }

    /// A power cut of server `n`'s machine: it stops and its disk keeps what was
    /// synced plus any subset of the rest (torn sectors too), as `seed` picks.
    pub fn power_cut(&mut self, n: usize, seed: u64) {
        self.network.kill(self.servers[n].process);
        self.servers[n].disk.power_cut(seed);
    }

    /// The disk of server `n` fills, with the store's own writes: `writable` bytes
    /// are left above the floor the store keeps (something else filling it past the
    /// floor is another matter: a restart may then find no room for a checkpoint).
    pub fn fill_disk(&self, n: usize, writable: u64) {
        let disk = &self.servers[n].disk;
        let size = disk.used_bytes() + writable;
        let floor = floor_of(size);
        // The floor grows with the size it is added to: a 64th of it, and a margin.
        disk.set_capacity(size + floor + floor / 16);
    }

    /// Space is freed on server `n`'s disk (a bigger one, in the simulation).
    pub fn free_disk(&self, n: usize) {
        self.servers[n].disk.set_capacity(SimDisk::CAPACITY_BYTES);
    }

    pub fn add_gateway(&mut self) -> usize {
        let n = self.gateways.len();
        let name = format!("gw{n}");
        let process = self.network.add(&name, &name);
        self.gateways.push(Gateway {
            process,
            name,
            device: None,
        });
        n
    }

    /// Opens the volume for writing on gateway `n` (booting it if it is down).
    pub async fn open_volume(&mut self, n: usize) -> Result<Arc<dyn BlockDevice>, String> {
        let gateway = &self.gateways[n];
        if self.network.alive(gateway.process) {
            self.network.kill(gateway.process);
        }
        let transport = self.network.boot(gateway.process);
        let device = open(transport, VOLUME, Some(&gateway.name)).await?;
        self.gateways[n].device = Some(device.clone());
        Ok(device)
    }

    pub fn kill_gateway(&mut self, n: usize) {
        self.network.kill(self.gateways[n].process);
        self.gateways[n].device = None;
    }
}

/// Opens `volume` through the master, for writing as `holder` or read-only.
pub async fn open(
    transport: Arc<SimTransport>,
    volume: &str,
    holder: Option<&str>,
) -> Result<Arc<dyn BlockDevice>, String> {
    let master = Arc::new(MasterClient::over(
        MASTER_ADDRESS,
        ConnectionPool::over(transport),
    ));
    let access = match holder {
        Some(holder) => floe_client::Access::Write {
            holder,
            unretired_limit: floe_client::UNRETIRED_LIMIT_DEFAULT,
        },
        None => floe_client::Access::Read,
    };
    floe_client::open_volume(master, volume, access).await
}
