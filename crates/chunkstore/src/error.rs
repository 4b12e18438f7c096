//! The store's error: plain values, cheap to clone to every change of a failed batch.

use crate::layout::CHUNK_BYTES_MAX;
use floe_protocol::ChunkId;
use std::io;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("range {offset}+{length} is outside a chunk (max {CHUNK_BYTES_MAX} bytes)")]
    OutOfRange { offset: u64, length: u64 },
    #[error("disk full: {0}")]
    NoSpace(String),
    #[error("disk error: {0}")]
    Io(String),
    #[error("{place} of volume {} chunk {} fails its checksum in the 4 KiB block at {offset}", chunk.volume_id, chunk.index)]
    Corrupt {
        chunk: ChunkId,
        offset: u64,
        place: &'static str,
    },
    #[error("store is shut down")]
    ShutDown,
    #[error("{0}")]
    Unsupported(String),
}

impl From<io::Error> for StoreError {
    fn from(e: io::Error) -> Self {
        let message = e.to_string();
        io_error(&e, message)
    }
}

/// `e` with a message that says what failed.
pub(crate) fn io_error(e: &io::Error, message: String) -> StoreError {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        StoreError::NoSpace(message)
    } else {
        StoreError::Io(message)
    }
}
