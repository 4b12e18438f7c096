//! Block transactions on a Floe volume (Isotope, thesis chapter 4), in the process
//! that holds the volume's lease.
//!
//! - [`fragments`]: the 16-byte fragments of a block a transaction touched.
//! - [`layout`]: the volume's layout and the log's formats.
//! - [`log`]: the redo log: append, replay.
//! - [`window`]: the conflict window of recent commits, with their before-images.
//! - [`transaction`]: a transaction's read/write set and its calls.
//! - [`volume`]: a volume open for transactions: versions, commit.
//! - [`kv`]: a transactional key-value store on it (IsoHT-like).
//! - [`btree`]: a transactional B-tree on it (IsoBT-like).
//!
//! [`open`] opens a volume by name (taking its lease) for transactions.
pub mod btree;
mod error;
pub mod fragments;
pub mod kv;
pub mod layout;
pub mod log;
pub mod transaction;
pub mod volume;
pub mod window;

pub use error::TxError;
pub use layout::BLOCK_BYTES;
pub use transaction::Transaction;
pub use volume::TxVolume;

use floe_client::{master::MasterClient, Access};
use std::sync::Arc;

/// What a transaction guarantees (chosen per volume, or per transaction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation {
    /// A transaction commits only if nothing it read changed since it began: the
    /// commits are equivalent to running one at a time in commit order.
    StrictSerializable,
    /// A transaction reads its snapshot and commits unless a concurrent commit wrote
    /// what it wrote: write skew is allowed.
    Snapshot,
}

impl std::str::FromStr for Isolation {
    type Err = String;
    fn from_str(text: &str) -> Result<Isolation, String> {
        match text {
            "ss" | "strict-serializable" => Ok(Isolation::StrictSerializable),
            "si" | "snapshot" => Ok(Isolation::Snapshot),
            _ => Err(format!(
                "{text:?}: isolation is ss (strict serializability) or si (snapshot isolation)"
            )),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Durable and visible at this version.
    Committed { version: u64 },
    /// A concurrent commit touched what this one depended on: nothing changed.
    Conflict,
}

/// Opens volume `name` for transactions, holding its lease as `holder`.
pub async fn open(
    master: Arc<MasterClient>,
    name: &str,
    holder: &str,
    isolation: Isolation,
) -> Result<TxVolume, String> {
    let access = Access::Write {
        holder,
        unretired_limit: floe_client::UNRETIRED_LIMIT_DEFAULT,
    };
    let device = floe_client::open_volume(master, name, access)
        .await
        .map_err(|e| format!("cannot open volume {name} for transactions: {e}"))?;
    TxVolume::open(device, isolation)
        .await
        .map_err(|e| format!("cannot open volume {name} for transactions: {e}"))
}
