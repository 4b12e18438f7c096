//! Snapshots (see `floe_protocol::snapshot` for the scheme): copy-on-write in the
//! writer, at 4 KiB blocks, into delta chunks that are ordinary chunks of the volume,
//! so replication, repair, moves and scrub carry snapshots with no change.
//!
//! - [`preserve`]: the writer's layer: follows the snapshot epoch from the lease and
//!   copies each block's old contents into the current epoch's delta chunk before the
//!   epoch's first write over it.
//! - [`reader`]: a snapshot as a read-only chunk layer: each block from the oldest
//!   delta at or past the snapshot's epoch that holds it, else from the live chunk as
//!   of a version whose preserved blocks it has seen.
//! - [`diff`]: the ranges that changed between a snapshot and a later one or the
//!   volume now.
//! - [`read_through`]: a clone's chunk layer: its own blocks, else the parent
//!   snapshot's.
//! - [`rollback`]: a volume written back to a snapshot.
//! - [`flatten`]: a clone made independent of its parent.
//! - [`blocks`]: which blocks of a delta chunk hold data.

mod blocks;
pub mod diff;
pub mod flatten;
pub mod preserve;
pub mod read_through;
pub mod reader;
pub mod rollback;

pub use preserve::Preserving;
pub use reader::SnapshotChunks;
