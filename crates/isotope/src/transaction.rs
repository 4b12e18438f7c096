//! One transaction: its start version, isolation, and read/write set (thesis 4.2's
//! intention record). Writes stay in memory until commit.

use crate::fragments::Fragments;
use crate::layout::{BLOCK_BYTES, TX_BLOCKS_MAX};
use crate::volume::Inner;
use crate::{Isolation, Outcome, TxError};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;

/// What a transaction did to one block.
#[derive(Default)]
struct Access {
    read: bool,
    /// The block as of the start, if read from the volume: what a commit merges onto
    /// when no later commit wrote the block, instead of reading it again.
    base: Option<Bytes>,
    written: Option<Bytes>,
    /// The fragments the application said it touched; none said: the whole block.
    marks: Fragments,
}

impl Access {
    fn fragments(&self) -> Fragments {
        if self.marks.is_empty() {
            Fragments::ALL
        } else {
            self.marks
        }
    }
}

/// A transaction's state, apart from the volume: what a released handle holds.
pub(crate) struct Body {
    pub(crate) start: u64,
    pub(crate) isolation: Isolation,
    blocks: BTreeMap<u64, Access>,
    written_count: usize,
}

/// The fragments a transaction read and wrote, by block.
pub(crate) struct Touched {
    pub(crate) read: BTreeMap<u64, Fragments>,
    pub(crate) written: BTreeMap<u64, Fragments>,
}

impl Body {
    pub(crate) fn new(start: u64, isolation: Isolation) -> Body {
        Body {
            start,
            isolation,
            blocks: BTreeMap::new(),
            written_count: 0,
        }
    }

    pub(crate) fn touched(&self) -> Touched {
        let of = |keep: fn(&Access) -> bool| {
            let kept = self.blocks.iter().filter(|(_, a)| keep(a));
            kept.map(|(b, a)| (*b, a.fragments())).collect()
        };
        Touched {
            read: of(|a| a.read),
            written: of(|a| a.written.is_some()),
        }
    }

    /// Each block written: its new contents, and the block as of the start if read.
    pub(crate) fn writes(&self) -> impl Iterator<Item = (u64, &Bytes, Option<&Bytes>)> {
        let written = self.blocks.iter();
        written.filter_map(|(b, a)| a.written.as_ref().map(|d| (*b, d, a.base.as_ref())))
    }
}

/// An open transaction. Dropped without [`Transaction::commit`], it aborts.
pub struct Transaction {
    volume: Arc<Inner>,
    /// `None` once ended or released.
    body: Option<Body>,
}

impl Transaction {
    pub(crate) fn new(volume: Arc<Inner>, body: Body) -> Transaction {
        Transaction {
            volume,
            body: Some(body),
        }
    }

    fn body(&mut self) -> &mut Body {
        self.body
            .as_mut()
            .expect("a transaction in use is not ended")
    }

    fn check_block(&self, block: u64) -> Result<(), TxError> {
        let blocks = self.volume.data_blocks();
        match block < blocks {
            true => Ok(()),
            false => Err(TxError::OutOfRange { block, blocks }),
        }
    }

    /// The version this transaction reads as of.
    pub fn start_version(&mut self) -> u64 {
        self.body().start
    }

    /// Block `block` as of this transaction's start, with its own writes.
    pub async fn read(&mut self, block: u64) -> Result<Bytes, TxError> {
        self.check_block(block)?;
        let start = self.body().start;
        if let Some(data) = self
            .body()
            .blocks
            .get(&block)
            .and_then(|a| a.written.clone())
        {
            self.body().blocks.get_mut(&block).expect("present").read = true;
            return Ok(data);
        }
        let data = self.volume.read_as_of(start, block).await?;
        let access = self.body().blocks.entry(block).or_default();
        access.read = true;
        access.base = Some(data.clone());
        Ok(data)
    }

    /// Replaces block `block` (4096 bytes) in this transaction.
    pub fn write(&mut self, block: u64, data: Bytes) -> Result<(), TxError> {
        self.check_block(block)?;
        if data.len() != BLOCK_BYTES {
            return Err(TxError::NotABlock { length: data.len() });
        }
        let body = self.body();
        let access = body.blocks.entry(block).or_default();
        if access.written.is_none() {
            if body.written_count == TX_BLOCKS_MAX {
                return Err(TxError::TooLarge {
                    blocks_max: TX_BLOCKS_MAX,
                });
            }
            body.written_count += 1;
        }
        body.blocks.get_mut(&block).expect("present").written = Some(data);
        Ok(())
    }

    /// Narrows what this transaction touched of `block`, read or written, to the
    /// union of the ranges marked: other transactions touching only other 16-byte
    /// fragments of the block do not conflict with it.
    pub fn mark_accessed(
        &mut self,
        block: u64,
        offset: usize,
        length: usize,
    ) -> Result<(), TxError> {
        if length == 0
            || offset
                .checked_add(length)
                .is_none_or(|end| end > BLOCK_BYTES)
        {
            return Err(TxError::MarkOutsideBlock { offset, length });
        }
        match self.body().blocks.get_mut(&block) {
            Some(access) => {
                access.marks.add(Fragments::covering(offset, length));
                Ok(())
            }
            None => Err(TxError::NotAccessed { block }),
        }
    }

    /// Commits: [`Outcome::Committed`] once durable and visible, or
    /// [`Outcome::Conflict`] with nothing changed. An error leaves the outcome unknown
    /// until the volume is reopened (its log replayed).
    pub async fn commit(mut self) -> Result<Outcome, TxError> {
        let body = self.body.take().expect("a transaction commits once");
        // Ended even if this future is dropped while the commit waits.
        let _ending = Ending(&self.volume, body.start);
        self.volume.commit(body).await
    }

    /// Ends the transaction with nothing changed.
    pub fn abort(self) {}

    /// Detaches the transaction from this task; another takes it over with
    /// [`crate::TxVolume::take_over`] and the handle returned.
    pub fn release(mut self) -> u64 {
        let body = self.body.take().expect("a transaction is released once");
        self.volume.release(body)
    }
}

struct Ending<'a>(&'a Inner, u64);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.0.end(self.1);
    }
}

impl Drop for Transaction {
    fn drop(&mut self) {
        if let Some(body) = self.body.take() {
            self.volume.end(body.start);
        }
    }
}
