//! The chunk layer: each chunk has replicas on several chunk servers, primary first.
//!
//! A write completes when every replica has it durable: small writes are sent by the
//! client to all replicas, larger ones to the primary, which forwards them to the
//! backups (the URSA protocol's versions, views and repair come on top of this).
//! A chunk is allocated by the master on its first write; until then it reads as
//! zeroes without a network round trip. Transport failures are retried with a fresh
//! server map, since a restarted chunk server may have a new address.

use crate::master::MasterClient;
use crate::stripe::ChunkIo;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use floe_blockdev::IoError;
use floe_protocol::connection::CallError;
use floe_protocol::{
    ChunkId, ConnectionPool, ControlRequest, ControlResponse, Request, Response, ServerId, Status,
    VolumeMap,
};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Attempts of one chunk request over transport failures, with this pause between.
const ATTEMPTS_MAX: u32 = 8;
const RETRY_PAUSE: Duration = Duration::from_millis(250);
/// Writes up to this size are sent by the client to all replicas (URSA's T_c).
const CLIENT_DIRECTED_BYTES_MAX: usize = 8 << 10;

pub struct ReplicatedChunks {
    master: Arc<MasterClient>,
    volume_id: u64,
    volume_name: String,
    placements: RwLock<HashMap<u64, Vec<ServerId>>>,
    addresses: RwLock<HashMap<ServerId, String>>,
    pool: ConnectionPool,
}

fn io_error(e: CallError) -> IoError {
    match e {
        CallError::Remote {
            status: Status::NoSpace,
            message,
        } => IoError::NoSpace(message),
        other => IoError::Io(other.to_string()),
    }
}

/// Worth retrying: the peer may be back or have moved.
fn transient(e: &CallError) -> bool {
    match e {
        CallError::Connect { .. } | CallError::Closed(_) => true,
        CallError::Remote { status, .. } => *status == Status::Unavailable,
        CallError::BadReply { .. } => false,
    }
}

impl ReplicatedChunks {
    pub fn new(master: Arc<MasterClient>, map: VolumeMap) -> Self {
        let chunks = ReplicatedChunks {
            master,
            volume_id: map.volume.id,
            volume_name: map.volume.spec.name.clone(),
            placements: RwLock::default(),
            addresses: RwLock::default(),
            pool: ConnectionPool::default(),
        };
        chunks.absorb(map);
        chunks
    }

    fn absorb(&self, map: VolumeMap) {
        let mut placements = self.placements.write().unwrap();
        for chunk in map.chunks {
            placements.insert(chunk.index, chunk.replicas);
        }
        let mut addresses = self.addresses.write().unwrap();
        for server in map.servers {
            addresses.insert(server.id, server.address);
        }
    }

    fn chunk_id(&self, index: u64) -> ChunkId {
        ChunkId {
            volume_id: self.volume_id,
            index,
        }
    }

    /// Replica addresses, primary first; `None` if the chunk is not allocated.
    fn replicas(&self, index: u64) -> Option<Vec<String>> {
        let placements = self.placements.read().unwrap();
        let addresses = self.addresses.read().unwrap();
        placements.get(&index).map(|ids| {
            ids.iter()
                .map(|id| addresses.get(id).cloned().unwrap_or_default())
                .collect()
        })
    }

    async fn allocate(&self, index: u64) -> Result<Vec<String>, IoError> {
        let reply = self
            .master
            .call(ControlRequest::AllocateChunk {
                volume_id: self.volume_id,
                index,
            })
            .await
            .map_err(io_error)?;
        let ControlResponse::Chunk { placement, servers } = reply else {
            return Err(IoError::Io(format!(
                "master answered allocation with {reply:?}"
            )));
        };
        {
            let mut addresses = self.addresses.write().unwrap();
            for server in servers {
                addresses.insert(server.id, server.address);
            }
        }
        self.placements
            .write()
            .unwrap()
            .insert(index, placement.replicas);
        Ok(self.replicas(index).expect("just inserted"))
    }

    /// Re-reads server addresses from the master after a transport failure.
    async fn refresh(&self) {
        match self.master.volume_map(&self.volume_name).await {
            Ok(map) => self.absorb(map),
            Err(e) => tracing::warn!("cannot refresh the volume map: {e}"),
        }
    }

    /// Sends a change to every replica and waits until all have it durable. Small
    /// changes go from the client to each replica at once (URSA's client-directed
    /// replication: one network hop instead of two); larger ones go to the primary,
    /// which forwards them to the backups, so the client sends the data only once.
    async fn replicate(
        &self,
        index: u64,
        bytes: usize,
        make: impl Fn(Vec<String>) -> Request,
    ) -> Result<(), IoError> {
        let mut attempt = 1;
        loop {
            let replicas = self
                .replicas(index)
                .ok_or_else(|| IoError::Io(format!("chunk {index} lost its placement")))?;
            let sends: Vec<(String, Request)> = if bytes <= CLIENT_DIRECTED_BYTES_MAX {
                let request = make(Vec::new());
                replicas.into_iter().map(|r| (r, request.clone())).collect()
            } else {
                let mut backups = replicas;
                let primary = backups.remove(0);
                vec![(primary, make(backups))]
            };
            let calls = sends
                .into_iter()
                .map(|(address, request)| async move { self.pool.call(&address, request).await });
            let results = futures::future::join_all(calls).await;
            match results.into_iter().find_map(Result::err) {
                None => return Ok(()),
                Some(e) if transient(&e) && attempt < ATTEMPTS_MAX => {
                    tracing::warn!(
                        chunk = index,
                        attempt,
                        "replicated write failed, retrying: {e}"
                    );
                }
                Some(e) => return Err(io_error(e)),
            }
            attempt += 1;
            tokio::time::sleep(RETRY_PAUSE).await;
            self.refresh().await;
        }
    }
}

#[async_trait]
impl ChunkIo for ReplicatedChunks {
    /// Reads from the primary, falling back to the other replicas in order: every
    /// replica holds every acknowledged write.
    async fn read(&self, index: u64, offset: u64, length: u32) -> Result<Bytes, IoError> {
        let chunk = self.chunk_id(index);
        let mut attempt = 1;
        loop {
            let Some(replicas) = self.replicas(index) else {
                return Ok(BytesMut::zeroed(length as usize).freeze());
            };
            let mut last_error = None;
            for address in &replicas {
                let request = Request::Read {
                    chunk,
                    offset,
                    length,
                };
                match self.pool.call(address, request).await {
                    Ok(Response::Data(data)) if data.len() == length as usize => return Ok(data),
                    Ok(other) => {
                        return Err(IoError::Io(format!(
                            "{address} answered a read with {other:?}"
                        )))
                    }
                    Err(e) if transient(&e) => last_error = Some(e),
                    Err(e) => return Err(io_error(e)),
                }
            }
            let error = last_error.expect("a chunk has at least one replica");
            if attempt == ATTEMPTS_MAX {
                return Err(io_error(error));
            }
            tracing::warn!(
                chunk = index,
                attempt,
                "no replica answered a read, retrying: {error}"
            );
            attempt += 1;
            tokio::time::sleep(RETRY_PAUSE).await;
            self.refresh().await;
        }
    }

    async fn write(&self, index: u64, offset: u64, data: Bytes) -> Result<(), IoError> {
        if self.replicas(index).is_none() {
            self.allocate(index).await?;
        }
        let chunk = self.chunk_id(index);
        self.replicate(index, data.len(), |forward| Request::Write {
            chunk,
            offset,
            forward,
            data: data.clone(),
        })
        .await
    }

    /// An unallocated chunk already reads as zeroes: nothing to do.
    async fn zero(&self, index: u64, offset: u64, length: u64, punch: bool) -> Result<(), IoError> {
        if self.replicas(index).is_none() {
            return Ok(());
        }
        let chunk = self.chunk_id(index);
        self.replicate(index, 0, |forward| Request::Zero {
            chunk,
            offset,
            length,
            punch,
            forward,
        })
        .await
    }

    fn is_allocated(&self, index: u64) -> bool {
        self.placements.read().unwrap().contains_key(&index)
    }
}
