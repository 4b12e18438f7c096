//! What the master exports at `/metrics`: repairs and moves as they finish, scrub
//! findings per volume, and (sampled once a second from the state, so the lease code
//! carries no metrics) each volume's lease state.

use crate::recovery::Kind;
use crate::state::State;
use std::time::Duration;
use tokio::time::Instant;

/// Copies a view change finished (`result="ok"`) or gave up on, by kind.
const RECOVERIES: &str = "floe_master_recoveries_total";
/// Time a finished repair or move took, from its start to the new view stored.
const RECOVERY_DURATION: &str = "floe_master_recovery_duration_seconds";
const RECOVERY_BYTES: &str = "floe_master_recovery_bytes_total";
/// Repairs and moves running.
const RECOVERIES_RUNNING: &str = "floe_master_recoveries_running";
const SCRUB_CHUNKS: &str = "floe_master_scrub_chunks_checked_total";
/// Blocks a scrub found failing their checksum on some replica.
const SCRUB_BAD_BLOCKS: &str = "floe_master_scrub_bad_blocks_total";
/// 1 while a writer holds the volume's lease, 0 once released or lapsed.
const LEASE_HELD: &str = "floe_master_lease_held";
const LEASE_GENERATION: &str = "floe_master_lease_generation";

fn kind_label(kind: Kind) -> &'static str {
    match kind {
        Kind::Repair => "repair",
        Kind::Move => "move",
    }
}

/// Registers the counters at 0, so a dashboard shows "none yet" rather than "no data".
pub(crate) fn register() {
    for kind in [Kind::Repair, Kind::Move] {
        let kind = kind_label(kind);
        for result in ["ok", "failed"] {
            metrics::counter!(RECOVERIES, "kind" => kind, "result" => result).increment(0);
        }
        // Taking a handle registers the metric.
        let _ = metrics::histogram!(RECOVERY_DURATION, "kind" => kind);
        metrics::counter!(RECOVERY_BYTES, "kind" => kind).increment(0);
        metrics::gauge!(RECOVERIES_RUNNING, "kind" => kind).set(0.0);
    }
}

/// One repair or move ended; `bytes` copied when it succeeded.
pub(crate) fn recovered(kind: Kind, took: Duration, bytes: Option<u64>) {
    let kind = kind_label(kind);
    let result = if bytes.is_some() { "ok" } else { "failed" };
    metrics::counter!(RECOVERIES, "kind" => kind, "result" => result).increment(1);
    if let Some(bytes) = bytes {
        metrics::histogram!(RECOVERY_DURATION, "kind" => kind).record(took);
        metrics::counter!(RECOVERY_BYTES, "kind" => kind).increment(bytes);
    }
}

pub(crate) fn recoveries_running(kind: Kind, running: usize) {
    metrics::gauge!(RECOVERIES_RUNNING, "kind" => kind_label(kind)).set(running as f64);
}

/// One chunk of `volume` scrubbed, with `bad_blocks` failing on some replica.
pub(crate) fn scrubbed(volume: &str, bad_blocks: usize) {
    let volume = volume.to_string();
    metrics::counter!(SCRUB_CHUNKS, "volume" => volume.clone()).increment(1);
    metrics::counter!(SCRUB_BAD_BLOCKS, "volume" => volume).increment(bad_blocks as u64);
}

/// Every volume's lease state as the state holds it now.
pub(crate) fn sample_leases(state: &State) {
    let now = Instant::now();
    for (name, volume) in &state.volumes {
        let lease = state.leases.get(&volume.id);
        let held = lease.is_some_and(|l| !l.revoked && l.expires.is_some_and(|e| e > now));
        metrics::gauge!(LEASE_HELD, "volume" => name.clone()).set(f64::from(u8::from(held)));
        let generation = lease.map_or(0, |l| l.generation);
        metrics::gauge!(LEASE_GENERATION, "volume" => name.clone()).set(f64::from(generation));
    }
}
