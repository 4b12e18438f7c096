//! Chunk replica storage on one chunk server's data directory.
//!
//! - [`store`]: the [`Store`] handle: writes, zeroes, reads, extents, checksums.
//! - [`committer`], [`plain_commit`], [`hybrid_commit`]: the event-loop task that
//!   appends batches of records to the log with one `fdatasync` per batch (group
//!   commit), then applies them to sparse chunk files (plain mode) or leaves small
//!   writes in ssd journals (hybrid mode, URSA §3.2-3.3).
//! - [`journal`], [`journal_index`], [`replay`]: hybrid mode's journals, the per-chunk
//!   map from chunk ranges to journal positions, and the worker that copies journaled
//!   data into the chunk files.
//! - [`wal`]: the log format: every change is a checksummed, sequenced record; the
//!   log is what makes a write durable and atomic. [`log_file`]: one log file;
//!   [`direct_log`]: the plain log's synced appends without the page cache.
//! - [`meta`]: each replica's view and version as of the last checkpoint.
//! - [`chunk_files`]: open chunk files and the replicas' durable state.
//! - [`block_sums`]: a crc32c per 4 KiB block of every chunk file, checked on every
//!   read (journal data is checked per sector: [`journal`]); `sums_cache` keeps
//!   pages of them in memory.
//! - [`retained`]: blocks as they were before a snapshot epoch's first overwrite,
//!   kept per chunk and epoch in sidecar files, logged before their change.
//! - [`unsynced`]: writes acknowledged once logged, before the log's fdatasync,
//!   which a later sync covers (the fast write modes).
//! - [`space`]: the file system's free space, reserved by each change before it is
//!   logged, with a floor kept for deletes and trims; the log and journals are
//!   allocated in full when opened.
//! - [`chain`]: the chained-log engine (Gecko): chunk data in one log chained
//!   across several disks instead of chunk files, chosen by [`Options::chain`].
//! - [`disk`]: the file system under all of it: [`RealDisk`], the emulated hdd
//!   ([`disk::hdd`]) and [`SimDisk`], an in-memory disk that loses unsynced writes at
//!   a simulated power cut.
//!
//! Opening a store: [`Store::open_with`] on the real disk; [`Store::open_on`] on any
//! [`Disk`], e.g. `Store::open_on(sim.mount(), dir, &options, &Tuning { manual_replay:
//! true, ..Tuning::default() })` for a [`SimDisk`] `sim` that survives the store (and
//! [`SimDisk::crash`] or [`SimDisk::power_cut`] between two opens).
//!
//! Layout of a data directory:
//! ```text
//! wal                      the write-ahead log (4 KiB header, then records)
//! meta                     each replica's view and version at the last checkpoint
//! journal                  hybrid mode: the hdd's own journal
//! chunks/VOLUME/INDEX      one sparse file per chunk replica (hex ids)
//! chunks/VOLUME/INDEX.sums its blocks' checksums
//! chunks/VOLUME/INDEX.rEPOCH  its blocks retained in a snapshot epoch (.iEPOCH: index)
//! ```
//! Crash safety: a write is acknowledged only after its record is durable in the log
//! (an unsynced write: once logged; durable after the next [`Store::sync`]).
//! After a crash, replay re-applies every record from the last checkpoint up to the
//! first torn or missing one, so an acknowledged write is always whole and an
//! unacknowledged one is either whole or absent.
pub mod block_sums;
mod chain;
mod chunk_files;
mod committer;
mod direct_log;
pub mod disk;
mod error;
mod hybrid_commit;
pub mod journal;
pub mod journal_index;
mod layout;
mod log_file;
pub mod meta;
mod plain_commit;
mod replay;
mod retained;
pub mod space;
pub mod store;
mod sums_cache;
mod unsynced;
pub mod wal;
mod writeback;

pub use chain::{ChainOptions, ChainStats, Gc as ChainGc, Layout as ChainLayout, ReadCost};
pub use disk::{Disk, DiskFile, RealDisk, SimDisk};
pub use journal::JournalDir;
pub use meta::ChunkMeta;
pub use retained::{RetainedBlock, RetainedEntry, RETAIN_CHANGE_BYTES_MAX};
pub use store::{Durability, Options, Store, StoreError, Tuning};
