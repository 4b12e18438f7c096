//! Block transactions on a Floe volume (Isotope, thesis chapter 4), in the process
//! that holds the volume's lease.
//!
//! - [`fragments`]: the 16-byte fragments of a block a transaction touched.
//! - [`layout`]: the volume's layout and the log's formats.
//! - [`log`]: the redo log: append, replay.
//! - [`window`]: the conflict window of recent commits, with their before-images.
//! - [`transaction`]: a transaction's read/write set and its calls.
//! - [`volume`]: a volume open for transactions: versions, commit.
//! - [`applier`]: committed blocks written in place in the background.
//! - [`kv`]: a transactional key-value store on it (IsoHT-like).
//! - [`btree`]: a transactional B-tree on it (IsoBT-like).
//! - [`blocks`]: what those run on: a transaction here or through a gateway.
//! - [`remote`]: transactions served by the gateway that holds the volume.
//!
//! [`open`] opens a volume by name (taking its lease) for transactions.
mod applier;
pub mod blocks;
pub mod btree;
mod error;
pub mod fragments;
pub mod kv;
pub mod layout;
pub mod log;
pub mod remote;
pub mod transaction;
pub mod volume;
pub mod window;

pub use blocks::{Blocks, Transactions};
pub use error::TxError;
pub use floe_protocol::transaction::Isolation;
pub use layout::BLOCK_BYTES;
pub use transaction::Transaction;
pub use volume::TxVolume;

use floe_client::{master::MasterClient, Access};
use std::sync::Arc;

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
