//! Calls to chunk servers during view changes and scrub, each bounded in time.

use crate::{Failure, Master};
use floe_protocol::connection::CallError;
use floe_protocol::{
    ChunkId, RepairKind, ReplicaRequest, ReplicaResponse, Request, Response, ServerInfo, Status,
};
use std::time::Duration;

/// Bounds on one request to a chunk server; a repair copies up to a whole chunk.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);
const REPAIR_TIMEOUT: Duration = Duration::from_secs(120);

/// What one repair did.
pub(super) struct Repaired {
    /// The version the target reached.
    pub(super) version: u64,
    pub(super) incremental: bool,
    pub(super) compared: bool,
    pub(super) bytes: u64,
}

/// What the repairs of a view change copied.
#[derive(Default)]
pub(super) struct Copied {
    pub(super) incremental: u64,
    pub(super) compared: u64,
    pub(super) full: u64,
    pub(super) bytes: u64,
}

impl Copied {
    pub(super) fn add(&mut self, repaired: &Repaired) {
        if repaired.incremental {
            self.incremental += 1;
        } else if repaired.compared {
            self.compared += 1;
        } else {
            self.full += 1;
        }
        self.bytes += repaired.bytes;
    }
}

impl Master {
    /// One request to a chunk server, bounded in time: a server cut off by the
    /// network never answers, and its connection may take minutes to fail.
    pub(crate) async fn ask(
        &self,
        address: &str,
        request: ReplicaRequest,
    ) -> Result<ReplicaResponse, CallError> {
        let limit = match request {
            // Each reads or copies up to a whole chunk.
            ReplicaRequest::Repair { .. }
            | ReplicaRequest::Checksum { .. }
            | ReplicaRequest::Heal { .. } => REPAIR_TIMEOUT,
            _ => ASK_TIMEOUT,
        };
        match self
            .peers
            .call_within(address, Request::Replica(request), limit)
            .await?
        {
            Response::Replica(reply) => Ok(reply),
            other => Err(CallError::BadReply {
                address: address.to_string(),
                reason: format!("{other:?}"),
            }),
        }
    }

    /// (view, version) of the replica on `server`.
    pub(super) async fn replica_state(
        &self,
        server: &ServerInfo,
        request: ReplicaRequest,
    ) -> Result<(u64, u64), CallError> {
        match self.ask(&server.address, request).await? {
            ReplicaResponse::ChunkInfo { view, version } => Ok((view, version)),
            other => Err(CallError::BadReply {
                address: server.address.clone(),
                reason: format!("{other:?}"),
            }),
        }
    }

    /// Has `target` pull the chunk from `source`.
    pub(super) async fn repair_from(
        &self,
        chunk: ChunkId,
        target: &ServerInfo,
        source: &ServerInfo,
        kind: RepairKind,
        bytes_per_second: u64,
    ) -> Result<Repaired, Failure> {
        let request = ReplicaRequest::Repair {
            chunk,
            source: source.address.clone(),
            kind,
            bytes_per_second,
        };
        match self.ask(&target.address, request).await {
            Ok(ReplicaResponse::Repaired {
                version,
                incremental,
                compared,
                bytes,
            }) => Ok(Repaired {
                version,
                incremental,
                compared,
                bytes,
            }),
            Ok(other) => Err((
                Status::Io,
                format!("server {} answered {other:?}", target.id),
            )),
            Err(e) => Err((
                Status::Unavailable,
                format!("repair on server {}: {e}", target.id),
            )),
        }
    }
}
