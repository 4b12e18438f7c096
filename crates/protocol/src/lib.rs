//! Floe's wire protocol between gateway, chunk servers, master and CLI.
//!
//! - [`frame`]: bytes <-> frames: a fixed header (magic, kind, status, request id,
//!   payload length, crc32c of the payload) and the payload.
//! - [`message`]: the requests and responses carried in frames; the data path is a
//!   hand-packed binary layout, the control plane (requests to the master, and to chunk
//!   servers about their replicas: separate types and frame kinds) JSON bodies.
//! - [`types`]: cluster objects shared by every process (volumes, servers, chunks).
//! - [`units`]: sizes as messages print them.
//! - [`log_commit`]: the on-disk layout of a log-commit volume (master and gateway
//!   agree on its size).
//! - [`snapshot`]: snapshot epochs, delta chunks and snapshot names.
//! - [`session`]: client sessions moving between gateways.
//! - [`transaction`]: block transactions served by a gateway to remote clients.
//! - [`connection`]: a pipelined client connection: many requests in flight, replies
//!   matched by request id, outgoing frames batched into few socket writes.
//! - [`server`]: the accept loop and per-connection serving with the same batching,
//!   by one handler for all connections or a session per connection.
//! - [`masters`]: the master's addresses (one, or several of which one leads), and
//!   calls that follow the leader.
//! - [`tls`]: mutual TLS with the cluster CA's certificates, whose roles say what a
//!   peer may ask.
//! - [`transport`]: the seam under every inter-process call: TCP for real processes,
//!   an in-process network for the simulator; [`ConnectionPool`] calls through it.
//!
//! Every connection starts with a `Hello` carrying [`PROTOCOL_VERSION`]; a peer with
//! another version is refused with a clear error.
pub mod connection;
pub mod frame;
pub mod log_commit;
pub mod masters;
pub mod message;
pub mod server;
pub mod session;
pub mod snapshot;
pub mod tls;
pub mod transaction;
pub mod transport;
pub mod types;
pub mod units;

pub use connection::{Connection, TcpTransport};
pub use frame::{Frame, FrameError, Status};
pub use masters::Masters;
pub use message::{
    ClusterMapInfo, LayerInfo, MasterRequest, MasterResponse, Proposal, Registration, RepairKind,
    ReplicaRequest, ReplicaResponse, Request, Response, RetainedInfo,
};
pub use session::{GatewayInfo, SessionInfo, SessionMove};
pub use snapshot::{Snapshot, SnapshotEpochs, SnapshotReaders};
pub use transport::{ConnectionPool, Transport};
pub use types::*;

/// Bumped on any incompatible change of frames or messages.
pub const PROTOCOL_VERSION: u32 = 10;
