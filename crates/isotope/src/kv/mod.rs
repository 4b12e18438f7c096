//! A transactional key-value store on a transaction volume (IsoHT, thesis 4.4): an
//! on-disk hash table with no locks and no log of its own. Every operation runs in
//! the caller's transaction, so several operations (on several keys) commit or abort
//! together; the table marks the slots it touched so that transactions on different
//! keys of one block do not conflict.
//!
//! Data block 0 holds the header (`FLOEKVT1`, table blocks); blocks 1..=N the table,
//! [`slot::SLOTS_PER_BLOCK`] slots each. A key lives in the first block of its probe
//! sequence (crc32c of the key, then the next blocks, at most [`PROBE_BLOCKS`]) with
//! a free slot when it was put.

pub mod slot;

use crate::{Blocks, Transaction, TxError, BLOCK_BYTES};
use bytes::{Bytes, BytesMut};
use slot::{State, KEY_BYTES_MAX, SLOTS_PER_BLOCK, SLOT_BYTES, VALUE_BYTES_MAX};

const MAGIC: &[u8; 8] = b"FLOEKVT1";
/// Table blocks at most: a scan reads them all.
pub const TABLE_BLOCKS_MAX: u64 = 512;
/// Blocks a lookup looks through before the key is known absent (and a put that finds
/// none free fails).
pub const PROBE_BLOCKS: u64 = 8;
const HEADER_BLOCK: u64 = 0;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvError {
    Tx(TxError),
    KeyLength(usize),
    ValueTooLong(usize),
    /// No free slot in the key's probe blocks.
    Full,
    /// Data block 0 is neither zeroes nor a table header.
    NotATable,
}

impl From<TxError> for KvError {
    fn from(e: TxError) -> KvError {
        KvError::Tx(e)
    }
}

impl std::fmt::Display for KvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvError::Tx(e) => write!(f, "{e}"),
            KvError::KeyLength(n) => write!(f, "a key of {n} bytes: keys are 1 to {KEY_BYTES_MAX} bytes"),
            KvError::ValueTooLong(n) => {
                write!(f, "a value of {n} bytes: values are at most {VALUE_BYTES_MAX} bytes")
            }
            KvError::Full => write!(
                f,
                "the table is full where this key goes ({PROBE_BLOCKS} blocks of {SLOTS_PER_BLOCK} slots)"
            ),
            KvError::NotATable => write!(f, "the volume holds no key-value table (use a new volume)"),
        }
    }
}

impl std::error::Error for KvError {}

/// The store, within one transaction (in this process or through a gateway).
pub struct Kv<'t, T: Blocks = Transaction> {
    tx: &'t mut T,
    table_blocks: u64,
}

/// Where a key is, or where it would go.
struct Found {
    block: u64,
    slot: usize,
    data: Bytes,
}

impl<'t, T: Blocks> Kv<'t, T> {
    /// The table of `tx`'s volume; a volume that reads as zeroes gets one, created
    /// in `tx`.
    pub async fn attach(tx: &'t mut T, data_blocks: u64) -> Result<Kv<'t, T>, KvError> {
        let header = tx.read(HEADER_BLOCK).await?;
        tx.mark_accessed(HEADER_BLOCK, 0, 16).await?;
        let table_blocks = if let Some(table_blocks) = table_blocks(&header) {
            table_blocks
        } else if header.iter().all(|b| *b == 0) {
            let table_blocks = (data_blocks - 1).min(TABLE_BLOCKS_MAX);
            let mut fresh = BytesMut::zeroed(BLOCK_BYTES);
            fresh[..8].copy_from_slice(MAGIC);
            fresh[8..16].copy_from_slice(&table_blocks.to_le_bytes());
            tx.write(HEADER_BLOCK, fresh.freeze()).await?;
            table_blocks
        } else {
            return Err(KvError::NotATable);
        };
        assert!(
            table_blocks > 0 && table_blocks < data_blocks,
            "header: {table_blocks} table blocks"
        );
        Ok(Kv { tx, table_blocks })
    }

    fn probe(&self, key: &[u8]) -> impl Iterator<Item = u64> {
        probe(key, self.table_blocks)
    }

    /// The key's slot if present; else the first free slot of its probe blocks, if
    /// any. Marks what the answer depended on: the key's slot when found, the whole
    /// blocks looked through when not (a put elsewhere in them could change it).
    async fn find(&mut self, key: &[u8]) -> Result<(Option<Found>, Option<Found>), KvError> {
        check_key(key)?;
        let mut free = None;
        for block in self.probe(key).collect::<Vec<_>>() {
            let data = self.tx.read(block).await?;
            let mut ended = false;
            for slot in 0..SLOTS_PER_BLOCK {
                match slot::state(&data, slot) {
                    State::Used if slot::key(&data, slot) == key => {
                        self.tx
                            .mark_accessed(block, slot * SLOT_BYTES, SLOT_BYTES)
                            .await?;
                        return Ok((Some(Found { block, slot, data }), None));
                    }
                    State::Used => {}
                    State::Empty | State::Deleted => {
                        ended |= slot::state(&data, slot) == State::Empty;
                        if free.is_none() {
                            free = Some(Found {
                                block,
                                slot,
                                data: data.clone(),
                            });
                        }
                    }
                }
            }
            self.tx.mark_accessed(block, 0, BLOCK_BYTES).await?;
            if ended {
                break;
            }
        }
        Ok((None, free))
    }

    pub async fn get(&mut self, key: &[u8]) -> Result<Option<Bytes>, KvError> {
        let (found, _) = self.find(key).await?;
        Ok(found.map(|f| Bytes::copy_from_slice(slot::value(&f.data, f.slot))))
    }

    pub async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        if value.len() > VALUE_BYTES_MAX {
            return Err(KvError::ValueTooLong(value.len()));
        }
        let (found, free) = self.find(key).await?;
        let Some(at) = found.or(free) else {
            return Err(KvError::Full);
        };
        let mut data = BytesMut::from(&self.tx.read(at.block).await?[..]);
        slot::set(&mut data, at.slot, key, value);
        self.tx.write(at.block, data.freeze()).await?;
        self.tx
            .mark_accessed(at.block, at.slot * SLOT_BYTES, SLOT_BYTES)
            .await?;
        Ok(())
    }

    /// Whether the key was there.
    pub async fn delete(&mut self, key: &[u8]) -> Result<bool, KvError> {
        let (found, _) = self.find(key).await?;
        let Some(at) = found else {
            return Ok(false);
        };
        let mut data = BytesMut::from(&self.tx.read(at.block).await?[..]);
        slot::delete(&mut data, at.slot);
        self.tx.write(at.block, data.freeze()).await?;
        Ok(true)
    }

    /// Every pair whose key starts with `prefix`, in key order.
    pub async fn scan(&mut self, prefix: &[u8]) -> Result<Vec<(Bytes, Bytes)>, KvError> {
        let mut out = Vec::new();
        for block in 1..=self.table_blocks {
            let data = self.tx.read(block).await?;
            for slot in 0..SLOTS_PER_BLOCK {
                if slot::state(&data, slot) == State::Used
                    && slot::key(&data, slot).starts_with(prefix)
                {
                    out.push((
                        Bytes::copy_from_slice(slot::key(&data, slot)),
                        Bytes::copy_from_slice(slot::value(&data, slot)),
                    ));
                }
            }
        }
        out.sort();
        Ok(out)
    }
}

/// The blocks a key's lookup looks through, in order.
pub fn probe(key: &[u8], table_blocks: u64) -> impl Iterator<Item = u64> {
    let first = crc32c::crc32c(key) as u64 % table_blocks;
    (0..PROBE_BLOCKS.min(table_blocks)).map(move |i| 1 + (first + i) % table_blocks)
}

/// The table blocks a header block names, or `None` if it is no table header.
pub fn table_blocks(header: &[u8]) -> Option<u64> {
    (&header[..8] == MAGIC).then(|| u64::from_le_bytes(header[8..16].try_into().unwrap()))
}

fn check_key(key: &[u8]) -> Result<(), KvError> {
    match key.len() {
        1..=KEY_BYTES_MAX => Ok(()),
        n => Err(KvError::KeyLength(n)),
    }
}
