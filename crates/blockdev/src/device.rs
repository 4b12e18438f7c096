//! The block-device trait and its error type.

use async_trait::async_trait;
use bytes::Bytes;

/// Why a block request failed. The NBD server maps each to an NBD errno.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IoError {
    /// The request reaches past the end of the device or is malformed.
    #[error("request out of range: {0}")]
    InvalidRange(String),
    /// The cluster has no space left for a new chunk.
    #[error("no space left: {0}")]
    NoSpace(String),
    /// The device does not accept writes (read-only attach).
    #[error("read-only device")]
    ReadOnly,
    /// Anything else: a replica unreachable, a disk error reported by a chunk server.
    #[error("I/O error: {0}")]
    Io(String),
}

/// A run of bytes that is either stored data or a hole (reads as zeroes, never written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    pub hole: bool,
}

/// An async block device. Offsets and lengths are in bytes. When `write`, `trim` or
/// `write_zeroes` return `Ok`, the change is durable on every layer below.
#[async_trait]
pub trait BlockDevice: Send + Sync + 'static {
    /// Size in bytes.
    fn size(&self) -> u64;
    async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError>;
    /// `fua`: the caller asks for durability before the reply; layers that acknowledge
    /// early (Blizzard fast-ack) must honour it.
    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError>;
    /// Makes every write that completed before this call durable.
    async fn flush(&self) -> Result<(), IoError>;
    /// Discards the range: it reads as zeroes afterwards.
    async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError>;
    /// Zeroes the range; `may_punch` allows freeing the space (NBD without NO_HOLE).
    async fn write_zeroes(&self, offset: u64, length: u64, may_punch: bool) -> Result<(), IoError>;
    /// Describes `[offset, offset + length)` as consecutive extents starting at
    /// `offset`. May describe less than asked, never nothing when `length > 0`.
    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError>;
}

/// Checks that `[offset, offset + length)` lies inside a device of `size` bytes.
pub fn check_range(size: u64, offset: u64, length: u64) -> Result<(), IoError> {
    match offset.checked_add(length) {
        Some(end) if end <= size => Ok(()),
        _ => Err(IoError::InvalidRange(format!(
            "offset {offset} + length {length} exceeds device size {size}"
        ))),
    }
}
