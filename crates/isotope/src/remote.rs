//! Transactions run by the gateway that holds a volume's lease, for clients in other
//! processes (`floe gateway --tx-listen`, `floe_protocol::transaction`). The gateway
//! holds each transaction; this side buffers its writes and marks and sends them with
//! the next block read, or when the buffer fills, or with the commit, so that a
//! transaction costs a round trip per block it reads, not per call. A block read
//! once is not asked again: the transaction reads as of its start, so the answer
//! cannot change (a preempted transaction learns it at its next new read or its
//! commit, which answers `Conflict`). An error the gateway answers ends the
//! transaction there; one from a buffered call comes with the next request.

use crate::{Blocks, Isolation, Outcome, Transactions, TxError};
use bytes::Bytes;
use floe_protocol::transaction::{self as wire, TxChange, TxReply, TxRequest};
use floe_protocol::Connection;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Buffered calls sent on their own once they hold this many bytes (a commit record's
/// worth of blocks: a transaction within the gateway's bound sends none early).
const BUFFER_BYTES_MAX: usize = 1 << 20;

/// A volume served by a gateway's transaction listener.
pub struct RemoteVolume {
    connection: Arc<Connection>,
    name: String,
    data_blocks: u64,
}

fn failed(address: &str, e: floe_protocol::connection::CallError) -> TxError {
    use floe_protocol::connection::CallError;
    match e {
        CallError::Remote { message, .. } => TxError::Remote(message),
        other => TxError::Remote(format!(
            "the gateway's transaction service at {address}: {other} (a commit sent \
             meanwhile may or may not have committed)"
        )),
    }
}

impl RemoteVolume {
    /// Connects to the transaction listener at `address` (TLS as this process runs)
    /// for volume `name`; a first transaction, aborted, checks that the gateway
    /// serves it.
    pub async fn connect(address: &str, name: &str) -> Result<RemoteVolume, String> {
        let connection = Connection::connect(address)
            .await
            .map_err(|e| format!("gateway transactions at {address}: {e}"))?;
        let mut volume = RemoteVolume {
            connection,
            name: name.to_string(),
            data_blocks: 0,
        };
        let begin = TxRequest::Begin {
            volume: name.to_string(),
            isolation: None,
        };
        match volume.call(begin).await.map_err(|e| e.to_string())? {
            TxReply::Begun {
                tx, data_blocks, ..
            } => {
                volume.data_blocks = data_blocks;
                volume
                    .call(TxRequest::Abort { tx })
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(volume)
            }
            other => Err(format!("unexpected reply {other:?} to a begin")),
        }
    }

    async fn call(&self, request: TxRequest) -> Result<TxReply, TxError> {
        wire::call(&self.connection, request)
            .await
            .map_err(|e| failed(self.connection.address(), e))
    }

    /// Takes over a transaction another client released
    /// ([`RemoteTransaction::release`]), perhaps in another process: it goes on here
    /// as it was, reads as of its start, writes and marks included.
    pub async fn take_over(&self, handle: u64) -> Result<RemoteTransaction, TxError> {
        match self.call(TxRequest::TakeOver { handle }).await? {
            TxReply::Begun { tx, .. } => Ok(self.transaction(tx)),
            other => Err(TxError::Remote(format!(
                "unexpected reply {other:?} to a take-over"
            ))),
        }
    }

    fn transaction(&self, tx: u64) -> RemoteTransaction {
        RemoteTransaction {
            connection: self.connection.clone(),
            tx,
            changes: Vec::new(),
            buffered_bytes: 0,
            known: BTreeMap::new(),
            ended: false,
        }
    }
}

impl Transactions for RemoteVolume {
    type Tx = RemoteTransaction;

    fn data_blocks(&self) -> u64 {
        self.data_blocks
    }

    /// The gateway's volume writes its commits in place itself; nobody here writes
    /// the volume plainly.
    async fn settle(&self) -> Result<(), TxError> {
        Ok(())
    }

    async fn begin_with(&self, isolation: Option<Isolation>) -> Result<RemoteTransaction, TxError> {
        let begin = TxRequest::Begin {
            volume: self.name.clone(),
            isolation,
        };
        match self.call(begin).await? {
            TxReply::Begun { tx, .. } => Ok(self.transaction(tx)),
            other => Err(TxError::Remote(format!(
                "unexpected reply {other:?} to a begin"
            ))),
        }
    }
}

/// A transaction the gateway holds. Dropped without a commit, it aborts.
pub struct RemoteTransaction {
    connection: Arc<Connection>,
    tx: u64,
    /// Calls not sent yet, in order.
    changes: Vec<TxChange>,
    buffered_bytes: usize,
    /// Blocks whose contents the gateway would answer: read through it, or read and
    /// then written here (unread blocks written are read through the gateway, so it
    /// learns the transaction read them).
    known: BTreeMap<u64, Bytes>,
    ended: bool,
}

impl RemoteTransaction {
    /// Detaches the transaction from this client, its buffered calls sent first: any
    /// client of the gateway takes it over with the handle returned
    /// ([`RemoteVolume::take_over`]) within a minute, else the gateway aborts it.
    pub async fn release(mut self) -> Result<u64, TxError> {
        let reply = self
            .end_with(|tx, changes| TxRequest::Release { tx, changes })
            .await;
        match reply? {
            TxReply::Released { handle } => Ok(handle),
            other => Err(TxError::Remote(format!(
                "unexpected reply {other:?} to a release"
            ))),
        }
    }

    /// Sends the buffered calls with the request that ends the transaction here (a
    /// commit or a release); whatever the answer, nothing is left to abort.
    async fn end_with(
        &mut self,
        request: impl FnOnce(u64, Vec<TxChange>) -> TxRequest,
    ) -> Result<TxReply, TxError> {
        let changes = self.take_changes();
        let reply = self.call(request(self.tx, changes)).await;
        self.ended = true;
        reply
    }

    async fn call(&mut self, request: TxRequest) -> Result<TxReply, TxError> {
        let answer = wire::call(&self.connection, request).await;
        let answer = answer.map_err(|e| failed(self.connection.address(), e));
        // The gateway ends a transaction on any error it answers.
        self.ended |= answer.is_err();
        answer
    }

    fn take_changes(&mut self) -> Vec<TxChange> {
        self.buffered_bytes = 0;
        std::mem::take(&mut self.changes)
    }

    async fn buffer(&mut self, change: TxChange) -> Result<(), TxError> {
        if self.ended {
            return Err(TxError::Remote(format!(
                "transaction {} was ended by the gateway's earlier answer",
                self.tx
            )));
        }
        self.buffered_bytes += change.encoded_bytes();
        self.changes.push(change);
        if self.buffered_bytes >= BUFFER_BYTES_MAX || self.changes.len() == wire::CHANGES_MAX {
            let changes = self.take_changes();
            self.call(TxRequest::Apply {
                tx: self.tx,
                changes,
            })
            .await?;
        }
        Ok(())
    }
}

impl Blocks for RemoteTransaction {
    async fn read(&mut self, block: u64) -> Result<Bytes, TxError> {
        if let Some(data) = self.known.get(&block) {
            return Ok(data.clone());
        }
        let changes = self.take_changes();
        let read = TxRequest::Read {
            tx: self.tx,
            changes,
            block,
        };
        match self.call(read).await? {
            TxReply::Block(data) => {
                self.known.insert(block, data.clone());
                Ok(data)
            }
            other => Err(TxError::Remote(format!(
                "unexpected reply {other:?} to a read"
            ))),
        }
    }

    async fn write(&mut self, block: u64, data: Bytes) -> Result<(), TxError> {
        if let Some(known) = self.known.get_mut(&block) {
            *known = data.clone();
        }
        self.buffer(TxChange::Write { block, data }).await
    }

    async fn mark_accessed(
        &mut self,
        block: u64,
        offset: usize,
        length: usize,
    ) -> Result<(), TxError> {
        // Out of range for the wire: the gateway refuses it as outside the block.
        let narrow = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        self.buffer(TxChange::Mark {
            block,
            offset: narrow(offset),
            length: narrow(length),
        })
        .await
    }

    async fn commit(mut self) -> Result<Outcome, TxError> {
        let reply = self
            .end_with(|tx, changes| TxRequest::Commit { tx, changes })
            .await;
        match reply? {
            TxReply::Committed { version } => Ok(Outcome::Committed { version }),
            TxReply::Conflict => Ok(Outcome::Conflict),
            other => Err(TxError::Remote(format!(
                "unexpected reply {other:?} to a commit"
            ))),
        }
    }
}

impl Drop for RemoteTransaction {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        // Else the gateway holds it (and the conflict window's images for it) until
        // the connection closes.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (connection, tx) = (self.connection.clone(), self.tx);
            runtime.spawn(async move { wire::call(&connection, TxRequest::Abort { tx }).await });
        }
    }
}
