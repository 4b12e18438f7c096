//! The chunk server: serves one data directory's chunk replicas over the wire
//! protocol, forwards a primary's writes to its backups, and keeps itself registered
//! with the master by heartbeats.
//!
//! One single-threaded event loop owns the connections (Vitastor's habit on few
//! cores); the store's I/O thread does the logging and fsyncs (see floe-chunkstore).

use floe_chunkstore::{Store, StoreError};
use floe_protocol::connection::CallError;
use floe_protocol::server::{self, Handler};
use floe_protocol::{
    ConnectionPool, ControlRequest, ControlResponse, DeviceClass, Request, Response, ServerId,
    Status,
};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// Heartbeats between two walks of the data directory for the used-bytes figure.
const USAGE_REFRESH_HEARTBEATS: u32 = 5;

pub struct Config {
    pub dir: PathBuf,
    pub listen: String,
    /// Address the master and peers should use; defaults to the bound address.
    pub advertise: Option<String>,
    pub master: String,
    pub host: String,
    pub class: DeviceClass,
    pub capacity_bytes: u64,
}

struct ChunkServer {
    store: Store,
    /// Connections to backups this server forwards to as a primary.
    peers: ConnectionPool,
}

/// Runs the chunk server until the listener fails.
pub async fn run(config: Config) -> Result<(), String> {
    let store = Store::open(&config.dir)
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
    tracing::info!(%address, dir = %config.dir.display(), "chunk server listening");
    let registration = ControlRequest::Register {
        uuid,
        address,
        host: config.host.clone(),
        class: config.class,
        capacity_bytes: config.capacity_bytes,
    };
    tokio::spawn(heartbeat_loop(
        config.master.clone(),
        registration,
        store.clone(),
    ));
    let handler = Arc::new(ChunkServer {
        store,
        peers: ConnectionPool::default(),
    });
    server::serve(listener, handler)
        .await
        .map_err(|e| format!("accept failed: {e}"))
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
/// (it restarted) and drops the chunks of volumes the master reports deleted.
async fn heartbeat_loop(master: String, registration: ControlRequest, store: Store) {
    let pool = ConnectionPool::default();
    let mut id: Option<ServerId> = None;
    let mut used_bytes = store.used_bytes();
    let mut beats = 0u32;
    let mut deleted: HashSet<u64> = HashSet::new();
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
                ControlRequest::Heartbeat { id, used_bytes }
            }
        };
        match pool.call(&master, Request::Control(request)).await {
            Ok(Response::Control(ControlResponse::Registered { id: new })) => {
                tracing::info!(id = new, "registered with master");
                id = Some(new);
            }
            Ok(Response::Control(ControlResponse::HeartbeatAck { deleted_volumes })) => {
                for volume_id in deleted_volumes {
                    if deleted.insert(volume_id) {
                        if let Err(e) = store.delete_volume(volume_id).await {
                            tracing::error!(volume_id, "dropping a deleted volume failed: {e}");
                            deleted.remove(&volume_id);
                        }
                    }
                }
            }
            Err(CallError::Remote {
                status: Status::NotFound,
                ..
            }) => id = None,
            Ok(other) => tracing::warn!("unexpected master reply {other:?}"),
            Err(e) => tracing::warn!("master unreachable: {e}"),
        }
    }
}

fn store_error(e: StoreError) -> Response {
    let status = match e {
        StoreError::OutOfRange { .. } => Status::BadRequest,
        StoreError::NoSpace(_) => Status::NoSpace,
        StoreError::Io(_) => Status::Io,
        StoreError::ShutDown => Status::Unavailable,
    };
    Response::error(status, e.to_string())
}

impl ChunkServer {
    /// Applies a change locally and at every backup at once; succeeds when all are
    /// durable.
    async fn replicate(
        &self,
        local: impl std::future::Future<Output = Result<(), StoreError>>,
        forward: &[String],
        backup_request: Request,
    ) -> Response {
        let backups = forward
            .iter()
            .map(|address| self.peers.call(address, backup_request.clone()));
        let (local, backups) = futures::join!(local, futures::future::join_all(backups));
        if let Err(e) = local {
            return store_error(e);
        }
        for (address, result) in forward.iter().zip(backups) {
            if let Err(e) = result {
                let status = match &e {
                    CallError::Remote { status, .. } => *status,
                    _ => Status::Unavailable,
                };
                return Response::error(status, format!("backup {address}: {e}"));
            }
        }
        Response::Done
    }
}

impl Handler for ChunkServer {
    async fn handle(self: Arc<Self>, request: Request) -> Response {
        match request {
            Request::Write {
                chunk,
                offset,
                forward,
                data,
            } => {
                let backup = Request::Write {
                    chunk,
                    offset,
                    forward: Vec::new(),
                    data: data.clone(),
                };
                let local = self.store.write(chunk, offset, data);
                self.replicate(local, &forward, backup).await
            }
            Request::Zero {
                chunk,
                offset,
                length,
                punch,
                forward,
            } => {
                let backup = Request::Zero {
                    chunk,
                    offset,
                    length,
                    punch,
                    forward: Vec::new(),
                };
                let local = self.store.zero(chunk, offset, length, punch);
                self.replicate(local, &forward, backup).await
            }
            Request::Read {
                chunk,
                offset,
                length,
            } => match self.store.read(chunk, offset, length) {
                Ok(data) => Response::Data(data),
                Err(e) => store_error(e),
            },
            Request::Control(_) | Request::Hello { .. } => Response::error(
                Status::BadRequest,
                "this is a chunk server; send control requests to the master",
            ),
        }
    }
}
