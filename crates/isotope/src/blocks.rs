//! What the examples (`kv`, `btree`) run on: a transaction's calls, whether the
//! transaction runs in this process ([`crate::Transaction`]) or in a gateway
//! ([`crate::remote`]), and a volume that begins them.

use crate::{Isolation, Outcome, TxError};
use bytes::Bytes;
use std::future::Future;

/// One transaction's calls (see [`crate::Transaction`] for their meaning).
pub trait Blocks: Send {
    fn read(&mut self, block: u64) -> impl Future<Output = Result<Bytes, TxError>> + Send;
    /// Async because a remote transaction sends its buffered calls when the buffer
    /// fills.
    fn write(
        &mut self,
        block: u64,
        data: Bytes,
    ) -> impl Future<Output = Result<(), TxError>> + Send;
    fn mark_accessed(
        &mut self,
        block: u64,
        offset: usize,
        length: usize,
    ) -> impl Future<Output = Result<(), TxError>> + Send;
    fn commit(self) -> impl Future<Output = Result<Outcome, TxError>> + Send;
}

/// A volume open for transactions.
pub trait Transactions: Sync {
    type Tx: Blocks;
    /// Blocks a transaction may address.
    fn data_blocks(&self) -> u64;
    /// Begins a transaction with the volume's isolation, or `isolation`.
    fn begin_with(
        &self,
        isolation: Option<Isolation>,
    ) -> impl Future<Output = Result<Self::Tx, TxError>> + Send;
    /// Waits until what committed so far is written in place (commits are answered
    /// once logged), for a plain reader or writer of the volume to come.
    fn settle(&self) -> impl Future<Output = Result<(), TxError>> + Send;
}

impl Blocks for crate::Transaction {
    async fn read(&mut self, block: u64) -> Result<Bytes, TxError> {
        crate::Transaction::read(self, block).await
    }
    async fn write(&mut self, block: u64, data: Bytes) -> Result<(), TxError> {
        crate::Transaction::write(self, block, data)
    }
    async fn mark_accessed(
        &mut self,
        block: u64,
        offset: usize,
        length: usize,
    ) -> Result<(), TxError> {
        crate::Transaction::mark_accessed(self, block, offset, length)
    }
    async fn commit(self) -> Result<Outcome, TxError> {
        crate::Transaction::commit(self).await
    }
}

impl Transactions for crate::TxVolume {
    type Tx = crate::Transaction;
    fn data_blocks(&self) -> u64 {
        crate::TxVolume::data_blocks(self)
    }
    async fn begin_with(&self, isolation: Option<Isolation>) -> Result<Self::Tx, TxError> {
        match isolation {
            Some(isolation) => crate::TxVolume::begin_with(self, isolation),
            None => self.begin(),
        }
    }
    async fn settle(&self) -> Result<(), TxError> {
        crate::TxVolume::settle(self).await
    }
}
