//! What the chunk server exports at `/metrics`: every request it serves, by op
//! (`Measured`, a wrapper around the request handler), and its store's journal fill
//! and corrupt blocks, sampled with each heartbeat.

use floe_chunkstore::Store;
use floe_protocol::server::Handler;
use floe_protocol::tls::Role;
use floe_protocol::{ReplicaRequest, Request, Response};
use metrics::{Counter, Gauge, Histogram};
use std::sync::Arc;
use std::time::Instant;

/// Latency of each request served, by op: `write` is a replica write (a primary's
/// includes forwarding to its backups), `repair` a replica pulling a chunk from peers.
const REQUEST_DURATION: &str = "floe_chunkserver_request_duration_seconds";
const REQUEST_BYTES: &str = "floe_chunkserver_request_bytes_total";
/// Requests answered with an error status (fenced, behind, no space, I/O...).
const REQUEST_ERRORS: &str = "floe_chunkserver_request_errors_total";
const QUEUE_DEPTH: &str = "floe_chunkserver_queue_depth";
const JOURNAL_USED: &str = "floe_chunkserver_journal_used_bytes";
const JOURNAL_QUOTA: &str = "floe_chunkserver_journal_quota_bytes";
/// Blocks this server's reads and scrubs found failing their checksums.
const CORRUPT_BLOCKS: &str = "floe_chunkserver_corrupt_blocks_total";

#[derive(Clone, Copy)]
enum Op {
    Write,
    CatchUp,
    Zero,
    Read,
    Repair,
    Control,
}

const OPS: [Op; 6] = [
    Op::Write,
    Op::CatchUp,
    Op::Zero,
    Op::Read,
    Op::Repair,
    Op::Control,
];

impl Op {
    fn label(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::CatchUp => "catch_up",
            Op::Zero => "zero",
            Op::Read => "read",
            Op::Repair => "repair",
            Op::Control => "control",
        }
    }

    /// The request's op and the bytes it moves.
    fn of(request: &Request) -> (Op, u64) {
        match request {
            Request::Write { catch_up, data, .. } => {
                let op = if *catch_up { Op::CatchUp } else { Op::Write };
                (op, data.len() as u64)
            }
            Request::Zero { length, .. } => (Op::Zero, *length),
            Request::Read { length, .. } | Request::ReadAsOf { length, .. } => {
                (Op::Read, u64::from(*length))
            }
            Request::Replica(ReplicaRequest::Repair { .. }) => (Op::Repair, 0),
            _ => (Op::Control, 0),
        }
    }
}

struct OpMetrics {
    duration: Histogram,
    bytes: Counter,
    errors: Counter,
}

/// The server's handler, recording every request it answers.
pub(crate) struct Measured<H> {
    handler: Arc<H>,
    ops: [OpMetrics; OPS.len()],
    queue_depth: Gauge,
}

impl<H> Measured<H> {
    pub(crate) fn new(handler: Arc<H>) -> Measured<H> {
        Measured {
            handler,
            ops: OPS.map(|op| OpMetrics {
                duration: metrics::histogram!(REQUEST_DURATION, "op" => op.label()),
                bytes: metrics::counter!(REQUEST_BYTES, "op" => op.label()),
                errors: metrics::counter!(REQUEST_ERRORS, "op" => op.label()),
            }),
            queue_depth: metrics::gauge!(QUEUE_DEPTH),
        }
    }
}

impl<H: Handler> Handler for Measured<H> {
    fn permits(&self, role: Role, request: &Request) -> Result<(), String> {
        self.handler.permits(role, request)
    }

    async fn handle(self: Arc<Self>, request: Request) -> Response {
        let (op, bytes) = Op::of(&request);
        let metrics = &self.ops[op as usize];
        let started = Instant::now();
        self.queue_depth.increment(1.0);
        // The protocol server spawns each request: it runs to its end, never dropped.
        let response = self.handler.clone().handle(request).await;
        self.queue_depth.decrement(1.0);
        metrics.duration.record(started.elapsed());
        match response {
            Response::Error { .. } => metrics.errors.increment(1),
            _ => metrics.bytes.increment(bytes),
        }
        response
    }
}

/// The store's figures, sampled with each heartbeat.
pub(crate) struct StoreGauges {
    journal_used: Gauge,
    journal_quota: Gauge,
    corrupt_blocks: Counter,
}

impl StoreGauges {
    pub(crate) fn new() -> StoreGauges {
        StoreGauges {
            journal_used: metrics::gauge!(JOURNAL_USED),
            journal_quota: metrics::gauge!(JOURNAL_QUOTA),
            corrupt_blocks: metrics::counter!(CORRUPT_BLOCKS),
        }
    }

    pub(crate) fn sample(&self, store: &Store, journal_used_bytes: u64, journal_quota_bytes: u64) {
        self.journal_used.set(journal_used_bytes as f64);
        self.journal_quota.set(journal_quota_bytes as f64);
        self.corrupt_blocks.absolute(store.corrupt_found());
    }
}
