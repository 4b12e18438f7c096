//! Placement: which chunk servers hold the replicas of a chunk.
//!
//! - [`cluster`]: placement from the versioned cluster map, what every process uses.
//! - [`crush`]: Ceph's CRUSH, bit-exact with `crushtool`, with its text map syntax.
//! - [`mapx`]: MAPX's time layers on top of CRUSH: expansion without migration, and
//!   remap, shrink and merge for the migration that is wanted.
//! - [`simulate`]: the MAPX paper's experiments (PGs moved by expansions and merges).

pub mod cluster;
pub mod crush;
pub mod mapx;
pub mod simulate;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("{replicas} replicas need {replicas} distinct hosts with a live chunk server, but only {hosts} are available: start chunk servers on more hosts or lower the replica count")]
    NotEnoughHosts { replicas: usize, hosts: usize },
    #[error("cluster map: {0}")]
    Map(String),
}
