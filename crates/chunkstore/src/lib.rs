//! Chunk replica storage on one chunk server's data directory.
//!
//! - [`journal_index`]: per-chunk map from chunk ranges to journal positions (URSA §3.3).
//! - [`wal`]: the write-ahead log format: every change is a checksummed, sequenced
//!   record; the log is what makes a write durable and atomic.
//! - [`store`]: the store: the event loop appends batches of records to the
//!   log with one `fdatasync` per batch (group commit), then applies them to sparse
//!   chunk files; reads go straight to the chunk files.
//!
//! Layout of a data directory:
//! ```text
//! wal                      the write-ahead log (4 KiB header, then records)
//! meta                     each replica's view and version at the last checkpoint
//! chunks/VOLUME/INDEX      one sparse file per chunk replica (hex ids)
//! ```
//! Crash safety: a write is acknowledged only after its record is durable in the log.
//! After a crash, replay re-applies every record from the last checkpoint up to the
//! first torn or missing one, so an acknowledged write is always whole and an
//! unacknowledged one is either whole or absent.
pub mod hdd;
pub mod journal;
pub mod journal_index;
pub mod meta;
pub mod store;
pub mod wal;

pub use journal::JournalDir;
pub use meta::ChunkMeta;
pub use store::{Options, Store, StoreError};
