//! Writers and readers on one gateway's volume, keeping the ledger.

use crate::ledger::{pattern, Durability, Ledger, BLOCK_BYTES};
use crate::network::Network;
use bytes::BytesMut;
use floe_blockdev::BlockDevice;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Blocks per group: a write covers 1 to 4 contiguous blocks of one group (over
/// 8 KiB goes through the primary, up to it straight to every replica).
pub const GROUP_BLOCKS: u64 = 4;

/// The device a worker writes through.
pub struct Device {
    pub device: Arc<dyn BlockDevice>,
    /// Which opening of the volume it is (a FLUSH covers that device's writes).
    pub id: u64,
    /// Write-back: writes that are not FUA are durable only once flushed; the worker
    /// also flushes and writes with FUA now and then.
    pub write_back: bool,
}

/// One worker: until `stop`, picks a free run of blocks and writes, zeroes or reads
/// it through `device`, recording everything in the ledger (and, in write-back,
/// flushes now and then).
pub async fn worker(
    seed: u64,
    gateway: String,
    Device {
        device,
        id: device_id,
        write_back,
    }: Device,
    ledger: Ledger,
    network: Arc<Network>,
    groups: Vec<u64>,
    stop: Arc<AtomicBool>,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_micros(rng.gen_range(0..40_000))).await;
        // (Write-through draws nothing more, so its seeds run as they always did.)
        if write_back && rng.gen_ratio(1, 10) {
            let began = ledger.begin_flush();
            if device.flush().await.is_ok() {
                ledger.flushed(device_id, began);
            }
            continue;
        }
        let group = groups[rng.gen_range(0..groups.len())];
        let count = rng.gen_range(1..=GROUP_BLOCKS);
        let first = group + rng.gen_range(0..=GROUP_BLOCKS - count);
        let Some(mut held) = ledger.try_hold(first, count) else {
            continue;
        };
        let offset = first * BLOCK_BYTES;
        let length = count * BLOCK_BYTES;
        match rng.gen_range(0..10) {
            0..=5 => {
                let id = ledger.begin_write(&mut held, false);
                let mut data = BytesMut::with_capacity(length as usize);
                for block in first..first + count {
                    data.extend_from_slice(&pattern(id, block));
                }
                let fua = write_back && rng.gen_ratio(1, 8);
                let result = device.write(offset, data.freeze(), fua).await;
                let at = network.now();
                let durability = if write_back && !fua {
                    Durability::UntilFlushOf(device_id)
                } else {
                    Durability::Durable
                };
                held.finish_write(result.is_ok().then_some((at, gateway.as_str(), durability)));
            }
            6 => {
                ledger.begin_write(&mut held, true);
                let result = device.write_zeroes(offset, length, rng.gen_bool(0.5)).await;
                let at = network.now();
                // Zeroes are durable changes in write-back too.
                let acked = (at, gateway.as_str(), Durability::Durable);
                held.finish_write(result.is_ok().then_some(acked));
            }
            _ => {
                let data = device.read(offset, length as u32).await;
                // A deposed holder may read what it wrote last (its VM is being
                // replaced); only the lease holder's reads must be current.
                let holder = network.observations.holder();
                if let (Ok(data), Some(true)) = (data, holder.map(|h| h == gateway)) {
                    let what = format!("{gateway} read");
                    ledger.check_read(first, &data, network.now(), &what);
                }
            }
        }
    }
}
