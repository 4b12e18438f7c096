//! Heal: rewrites the blocks of this replica that fail their checksums, each from a
//! peer replica whose copy checks (its read verifies the block before it answers), so
//! a bad copy is never the source.
//!
//! The replica is not frozen: writes go on. A block is copied only while this replica
//! and the source stay at the version the master saw them at; it is written under the
//! replica's lock with that version's stamp, so a change admitted after it is stored
//! after it. A block skipped (a version moved on, no source answered) is found again
//! by the next read or scrub.

use crate::ChunkServer;
use bytes::Bytes;
use floe_chunkstore::block_sums::BLOCK_BYTES;
use floe_chunkstore::ChunkMeta;
use floe_protocol::connection::CallError;
use floe_protocol::{ChunkId, ReplicaRequest, ReplicaResponse, Request, Response, Status};

type Failure = (Status, String);

pub(crate) async fn heal(
    server: &ChunkServer,
    chunk: ChunkId,
    version: u64,
    blocks: Vec<(u64, Vec<String>)>,
) -> Result<ReplicaResponse, Failure> {
    let mut healed = 0;
    for (offset, sources) in blocks {
        if !offset.is_multiple_of(BLOCK_BYTES) {
            return Err((
                Status::BadRequest,
                format!("{offset} is not a block boundary"),
            ));
        }
        let mut good = None;
        for source in &sources {
            match good_copy(server, chunk, version, offset, source).await {
                Ok(data) => {
                    good = Some(data);
                    break;
                }
                Err(e) => tracing::warn!(?chunk, offset, source, "no good copy there: {e}"),
            }
        }
        let Some(data) = good else {
            continue;
        };
        let slot = server.slot(chunk);
        let write = {
            let replica = slot.replica.lock().unwrap();
            if replica.frozen.is_some()
                || replica.submitted != version
                || replica.durable != version
            {
                return Err((
                    Status::Busy,
                    format!(
                        "the replica moved from version {version:#x} during the heal; \
                         healed {healed} blocks"
                    ),
                ));
            }
            let meta = ChunkMeta {
                view: replica.view,
                version,
            };
            // Queued at the first poll, before any other task of this single-threaded
            // server runs: ahead of any change admitted after the check.
            server.store.write(chunk, offset, data, meta)
        };
        write.await.map_err(|e| (Status::Io, e.to_string()))?;
        healed += 1;
        tracing::info!(?chunk, offset, "healed a block from a good copy");
    }
    Ok(ReplicaResponse::Healed { blocks: healed })
}

/// The source's block at `offset`, if its copy checks and the source stayed at
/// `version` while it was read.
async fn good_copy(
    server: &ChunkServer,
    chunk: ChunkId,
    version: u64,
    offset: u64,
    source: &str,
) -> Result<Bytes, String> {
    let read = Request::Read {
        chunk,
        offset,
        length: BLOCK_BYTES as u32,
        min_version: version,
        max_version: u64::MAX,
    };
    let data = match server.peers.call(source, read).await {
        Ok(Response::Data(data)) if data.len() as u64 == BLOCK_BYTES => data,
        Ok(other) => return Err(format!("answered {other:?}")),
        Err(e) => return Err(e.to_string()),
    };
    let since = Request::Replica(ReplicaRequest::LogSince {
        chunk,
        since: version,
    });
    match server.peers.call(source, since).await {
        Ok(Response::Replica(ReplicaResponse::Ranges {
            version: now,
            pending: false,
            ..
        })) if now == version => Ok(data),
        Ok(other) => Err(format!("moved on from version {version:#x}: {other:?}")),
        Err(CallError::Remote { status, message }) => Err(format!("{status:?}: {message}")),
        Err(e) => Err(e.to_string()),
    }
}
