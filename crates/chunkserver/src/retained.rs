//! A replica's retained blocks as a repair copies them (see
//! `floe_chunkstore::retained`): the list of those tagged above the version the
//! repair starts from, and each block's bytes.

use crate::{store_error, ChunkServer};
use bytes::Bytes;
use floe_chunkstore::RetainedBlock;
use floe_protocol::{ChunkId, ReplicaResponse, Response, RetainedInfo, Status};

impl ChunkServer {
    /// [`floe_protocol::ReplicaRequest::RetainedSince`].
    pub(crate) async fn retained_since(
        &self,
        chunk: ChunkId,
        since: u64,
    ) -> Result<ReplicaResponse, (Status, String)> {
        // Blocks of changes in flight reach the sidecars once they are durable.
        let version = self.scanned_version(chunk).await?;
        let blocks = self
            .store
            .retained_since(chunk, since)
            .into_iter()
            .map(|entry| RetainedInfo {
                epoch: entry.epoch,
                offset: entry.offset,
                tag: entry.tag,
                zeroes: entry.zeroes,
            })
            .collect();
        Ok(ReplicaResponse::Retained { version, blocks })
    }

    /// [`floe_protocol::Request::ReadRetained`].
    pub(crate) async fn read_retained(&self, chunk: ChunkId, epoch: u32, offset: u64) -> Response {
        match self.store.read_retained(chunk, epoch, offset).await {
            Ok(Some(RetainedBlock::Data(data))) => Response::Data(data),
            Ok(Some(RetainedBlock::Zeroes)) => Response::Data(Bytes::from(vec![
                0;
                floe_chunkstore::block_sums::BLOCK_BYTES
                    as usize
            ])),
            Ok(None) => Response::error(
                Status::NotFound,
                format!(
                    "epoch {epoch} holds no retained block at {offset} (freed since, or never)"
                ),
            ),
            Err(e) => store_error(e),
        }
    }
}
