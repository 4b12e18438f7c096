//! `Measured`: the top layer of every exported volume's stack, recording each NBD
//! request the device serves (latency by op, bytes, errors, requests in flight) under
//! the export's name.
//!
//! Handles are taken once per opened stack, so a request costs a few atomic updates
//! and no registry lookup.

use async_trait::async_trait;
use bytes::Bytes;
use floe_blockdev::{BlockDevice, Extent, IoError};
use metrics::{Counter, Gauge, Histogram};
use std::sync::Arc;
use std::time::Instant;

/// Latency of each request, by volume and op: its `_count` is the volume's requests.
pub const REQUEST_DURATION: &str = "floe_gateway_request_duration_seconds";
/// Bytes read, written, trimmed or zeroed, by volume and op.
pub const REQUEST_BYTES: &str = "floe_gateway_request_bytes_total";
/// Requests the device failed, by volume and op.
pub const REQUEST_ERRORS: &str = "floe_gateway_request_errors_total";
/// Requests in flight on a volume (all its connections).
pub const QUEUE_DEPTH: &str = "floe_gateway_queue_depth";

#[derive(Clone, Copy)]
enum Op {
    Read,
    Write,
    Flush,
    Trim,
    Zero,
    BlockStatus,
}

const OPS: [Op; 6] = [
    Op::Read,
    Op::Write,
    Op::Flush,
    Op::Trim,
    Op::Zero,
    Op::BlockStatus,
];

impl Op {
    fn label(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::Zero => "zero",
            Op::BlockStatus => "block_status",
        }
    }
}

struct OpMetrics {
    duration: Histogram,
    bytes: Counter,
    errors: Counter,
}

pub(crate) struct Measured {
    device: Arc<dyn BlockDevice>,
    ops: [OpMetrics; OPS.len()],
    queue_depth: Gauge,
}

impl Measured {
    pub(crate) fn new(device: Arc<dyn BlockDevice>, export: &str) -> Measured {
        let volume = export.to_string();
        let ops = OPS.map(|op| {
            let labels = [("volume", volume.clone()), ("op", op.label().to_string())];
            OpMetrics {
                duration: metrics::histogram!(REQUEST_DURATION, &labels),
                bytes: metrics::counter!(REQUEST_BYTES, &labels),
                errors: metrics::counter!(REQUEST_ERRORS, &labels),
            }
        });
        Measured {
            device,
            ops,
            queue_depth: metrics::gauge!(QUEUE_DEPTH, "volume" => volume),
        }
    }

    /// Runs one request, recording it under `op`.
    async fn measure<T>(
        &self,
        op: Op,
        bytes: u64,
        request: impl std::future::Future<Output = Result<T, IoError>>,
    ) -> Result<T, IoError> {
        let metrics = &self.ops[op as usize];
        let started = Instant::now();
        self.queue_depth.increment(1.0);
        // A request whose connection drops is cancelled here: the guard still counts
        // it out of the queue.
        let _in_flight = InFlight(&self.queue_depth);
        let result = request.await;
        metrics.duration.record(started.elapsed());
        match &result {
            Ok(_) => metrics.bytes.increment(bytes),
            Err(_) => metrics.errors.increment(1),
        }
        result
    }
}

struct InFlight<'a>(&'a Gauge);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

#[async_trait]
impl BlockDevice for Measured {
    fn size(&self) -> u64 {
        self.device.size()
    }

    async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError> {
        let read = self.device.read(offset, length);
        self.measure(Op::Read, u64::from(length), read).await
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        let bytes = data.len() as u64;
        let write = self.device.write(offset, data, fua);
        self.measure(Op::Write, bytes, write).await
    }

    async fn flush(&self) -> Result<(), IoError> {
        self.measure(Op::Flush, 0, self.device.flush()).await
    }

    async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError> {
        let trim = self.device.trim(offset, length);
        self.measure(Op::Trim, length, trim).await
    }

    async fn write_zeroes(&self, offset: u64, length: u64, may_punch: bool) -> Result<(), IoError> {
        let zero = self.device.write_zeroes(offset, length, may_punch);
        self.measure(Op::Zero, length, zero).await
    }

    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        let extents = self.device.extents(offset, length);
        self.measure(Op::BlockStatus, 0, extents).await
    }
}
