//! Reads as of a snapshot ([`Request::ReadAsOf`]): the replica's retained blocks over
//! its chunk (see `floe_chunkstore::retained`).
//!
//! Two checks make the answer the snapshot's, and the same at every replica:
//! - *No older tail.* A change past the version the reader learned is of the
//!   snapshot's epoch or later (it retained what it overwrote). One of an older epoch
//!   is a deposed writer's unacknowledged change, which a repair may adopt or drop:
//!   the replica answers `Ahead`, and so it does when its journal lite no longer
//!   tells the epochs of the changes past that version.
//! - *One state for the lookup and the read.* A change that touches the range while
//!   it is read may have retained a block after the lookup and overwritten it before
//!   the read: the read is tried again, as long as changes keep landing in it.

use crate::replica::Replica;
use crate::{repair, store_error, ChunkServer};
use floe_protocol::{ChunkId, Response, Status};

/// Reads of a range that changes under each of them before one is given up.
const AS_OF_TRIES: usize = 8;

impl ChunkServer {
    pub(crate) async fn read_as_of(
        &self,
        chunk: ChunkId,
        epoch: u32,
        offset: u64,
        length: u32,
        min_version: u64,
    ) -> Response {
        if epoch == 0 {
            return Response::error(Status::BadRequest, "epoch 0 has no snapshot to read");
        }
        let range = (offset, length as u64);
        for _ in 0..AS_OF_TRIES {
            let before = match self.as_of_state(chunk, epoch, min_version) {
                Ok(before) => before,
                Err((status, message)) => return Response::error(status, message),
            };
            let data = match self.store.read_as_of(chunk, epoch, offset, length).await {
                Ok(data) => data,
                Err(e) => return store_error(e),
            };
            if !self.touched_since(chunk, before, range) {
                return Response::Data(data);
            }
        }
        Response::error(
            Status::Busy,
            format!("the range changed during each of {AS_OF_TRIES} reads: read again"),
        )
    }

    /// The replica's durable version, if it may answer a read of snapshot `epoch` for
    /// a reader that learned `min_version`.
    fn as_of_state(
        &self,
        chunk: ChunkId,
        epoch: u32,
        min_version: u64,
    ) -> Result<u64, (Status, String)> {
        let Some(slot) = self.existing(chunk) else {
            // Nothing changed since the store last recorded it.
            let version = self.state(chunk).version;
            return match version >= min_version {
                true if version == min_version => Ok(version),
                true => Err(untold(version, min_version)),
                false => Err(behind(version, min_version)),
            };
        };
        let replica = slot.replica.lock().unwrap();
        if replica.frozen == Some(repair::REPAIRING) {
            return Err((
                Status::Behind,
                format!("replica is {}: read another", repair::REPAIRING),
            ));
        }
        if replica.durable < min_version {
            return Err(behind(replica.durable, min_version));
        }
        older_tail(&replica, epoch, min_version)?;
        Ok(replica.durable)
    }

    /// Whether a change after version `since` touches `(offset, length)`, or the
    /// replica can no longer tell.
    fn touched_since(&self, chunk: ChunkId, since: u64, (offset, length): (u64, u64)) -> bool {
        let Some(slot) = self.existing(chunk) else {
            return false;
        };
        let replica = slot.replica.lock().unwrap();
        if replica.submitted == since {
            return false;
        }
        let mut newer = replica.log.iter().filter(|e| e.version > since).peekable();
        if newer.peek().is_none_or(|first| first.prev > since) {
            return true;
        }
        newer.any(|e| e.offset < offset + length && offset < e.offset + e.length)
    }
}

/// Refuses when a change past `min_version` is of an epoch below `epoch`, or the
/// journal lite does not reach back to `min_version`.
fn older_tail(replica: &Replica, epoch: u32, min_version: u64) -> Result<(), (Status, String)> {
    if replica.submitted == min_version {
        return Ok(());
    }
    let mut newer = replica
        .log
        .iter()
        .filter(|e| e.version > min_version)
        .peekable();
    if newer.peek().is_none_or(|first| first.prev > min_version) {
        return Err(untold(replica.submitted, min_version));
    }
    match newer.find(|e| e.epoch < epoch) {
        Some(older) => Err((
            Status::Ahead,
            format!(
                "version {:#x}, past the {min_version:#x} learned, is of epoch {}, before \
                 snapshot {epoch}: learn the version again",
                older.version, older.epoch
            ),
        )),
        None => Ok(()),
    }
}

fn behind(version: u64, min_version: u64) -> (Status, String) {
    (
        Status::Behind,
        format!("replica holds version {version:#x}, the read needs {min_version:#x}"),
    )
}

fn untold(version: u64, min_version: u64) -> (Status, String) {
    (
        Status::Ahead,
        format!(
            "replica took version {version:#x}, past the {min_version:#x} learned, and no \
             longer knows the epochs in between: learn the version again"
        ),
    )
}
