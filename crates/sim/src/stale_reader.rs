//! A stale-read attach (Yogurt: `Access::Stale`) of the volume on a process of its
//! own, reading while the writers write and the faults go on; the ledger checks each
//! read against the bound and against the reader's earlier reads (monotonic).

use crate::cluster::{MASTER_ADDRESS, VOLUME};
use crate::ledger::{Ledger, BLOCK_BYTES};
use crate::network::Network;
use crate::workload::GROUP_BLOCKS;
use floe_client::master::MasterClient;
use floe_protocol::ConnectionPool;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Opens the volume for stale reads with `staleness` on a new process and reads
/// runs of `groups`' blocks until `stop`.
pub async fn read(
    seed: u64,
    staleness: Duration,
    ledger: Ledger,
    network: Arc<Network>,
    groups: Vec<u64>,
    stop: Arc<AtomicBool>,
) {
    let process = network.add("reader", "client");
    let transport = network.boot(process);
    let master = Arc::new(MasterClient::over(
        MASTER_ADDRESS,
        ConnectionPool::over(transport),
    ));
    let mut rng = StdRng::seed_from_u64(seed);
    let device = loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let access = floe_client::Access::Stale { staleness };
        match floe_client::open_volume(master.clone(), VOLUME, access).await {
            Ok(device) => break device,
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    };
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_micros(rng.gen_range(0..20_000))).await;
        let group = groups[rng.gen_range(0..groups.len())];
        let count = rng.gen_range(1..=GROUP_BLOCKS);
        let first = group + rng.gen_range(0..=GROUP_BLOCKS - count);
        let began = network.now();
        // A read may fail under the faults; one that returns is checked.
        if let Ok(data) = device
            .read(first * BLOCK_BYTES, (count * BLOCK_BYTES) as u32)
            .await
        {
            ledger.check_stale_read(first, &data, began, staleness);
        }
    }
}
