//! `floe kv bench`: transactions per second on a volume, by clients of this process
//! each adding one to two random keys per transaction (uniform or Zipf, [`keys`]),
//! through Isotope (SS or SI) or through the lock-and-log baseline ([`locked`]), and
//! the share of transactions that aborted on a conflict. Keys are made through
//! Isotope either way.

mod keys;
mod locked;

use crate::bank::seed_now;
use crate::kv::{retried, Isolated, CONFLICT_RETRIES};
use floe_blockdev::BlockDevice;
use floe_isotope::kv::Kv;
use floe_isotope::{Blocks, Isolation, Outcome, Transactions};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    /// Transactions (`--isolation`).
    Isotope,
    /// The baseline: per-block locks and its own redo log over plain writes.
    Locks,
}

#[derive(serde::Serialize)]
struct Measured {
    engine: String,
    isolation: Option<String>,
    clients: u32,
    keys: u32,
    zipf_skew: f64,
    seconds: f64,
    committed: u64,
    conflicts: u64,
    transactions_per_second: f64,
    /// Conflicts over transactions tried (the baseline waits instead: 0).
    abort_rate: f64,
}

fn key(k: u64) -> String {
    format!("bench/{k:06}")
}

pub struct Options {
    pub engine: Engine,
    pub isolation: Isolation,
    pub clients: u32,
    pub keys: u32,
    /// Zipf exponent of the key choice; 0 is uniform.
    pub skew: f64,
    pub duration: Duration,
}

/// `device`: the volume below, which the baseline runs on (`None` through a gateway).
pub async fn run<V: Transactions>(
    volume: &Isolated<'_, V>,
    device: Option<Arc<dyn BlockDevice>>,
    name: &str,
    options: Options,
) -> Result<(), String> {
    let keys = options.keys.max(2);
    let blocks = volume.data_blocks();
    for chunk in (0..keys as u64).collect::<Vec<_>>().chunks(100) {
        retried(volume, name, CONFLICT_RETRIES, |mut tx| async move {
            let mut kv = Kv::attach(&mut tx, blocks).await?;
            for k in chunk {
                kv.put(key(*k).as_bytes(), b"0").await?;
            }
            Ok((tx, ()))
        })
        .await?;
    }
    let picker = keys::Picker::new(keys, options.skew);
    let pick = |rng: &mut u64| picker.pair(rng);
    let (committed, conflicts, seconds) = match options.engine {
        Engine::Isotope => {
            let isolation = options.isolation;
            measure(options.clients, options.duration, |mut rng| {
                let volume = &volume;
                async move {
                    let (a, b) = pick(&mut rng);
                    let begun = volume.volume.begin_with(Some(isolation)).await;
                    let mut tx = begun.map_err(|e| e.to_string())?;
                    let mut kv = Kv::attach(&mut tx, blocks)
                        .await
                        .map_err(|e| e.to_string())?;
                    for k in [key(a), key(b)] {
                        let value = kv.get(k.as_bytes()).await.map_err(|e| e.to_string())?;
                        let n: u64 =
                            value.map_or(0, |v| String::from_utf8_lossy(&v).parse().unwrap_or(0));
                        let next = (n + 1).to_string();
                        kv.put(k.as_bytes(), next.as_bytes())
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    let outcome = tx
                        .commit()
                        .await
                        .map_err(|e| format!("volume {name}: {e}"))?;
                    Ok((rng, matches!(outcome, Outcome::Committed { .. })))
                }
            })
            .await?
        }
        Engine::Locks => {
            // The transactional side stays idle from here: the baseline has the log.
            let Some(device) = device else {
                return Err("--engine locks opens the volume here: not with --gateway".into());
            };
            // Isotope's applier writes nothing more once the baseline takes over.
            let settled = volume.volume.settle().await;
            settled.map_err(|e| format!("volume {name}: {e}"))?;
            let store = locked::Locked::open(device).await?;
            measure(options.clients, options.duration, |mut rng| {
                let store = &store;
                async move {
                    let (a, b) = pick(&mut rng);
                    let (a, b) = (key(a), key(b));
                    store.increment(&[a.as_bytes(), b.as_bytes()]).await?;
                    Ok((rng, true))
                }
            })
            .await?
        }
    };
    crate::views::print(&Measured {
        engine: format!("{:?}", options.engine).to_lowercase(),
        isolation: (options.engine == Engine::Isotope).then(|| format!("{:?}", options.isolation)),
        clients: options.clients,
        keys,
        zipf_skew: options.skew,
        seconds,
        committed,
        conflicts,
        transactions_per_second: committed as f64 / seconds,
        abort_rate: conflicts as f64 / (committed + conflicts).max(1) as f64,
    })
}

/// Runs `clients` loops of `transaction` (given and returning its random state, and
/// whether it committed) for `duration`: (committed, conflicts, seconds).
async fn measure<F, Fut>(
    clients: u32,
    duration: Duration,
    transaction: F,
) -> Result<(u64, u64, f64), String>
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = Result<(u64, bool), String>>,
{
    let (committed, conflicts) = (std::cell::Cell::new(0u64), std::cell::Cell::new(0u64));
    let started = Instant::now();
    let client = |seed: u64| {
        let (committed, conflicts, transaction) = (&committed, &conflicts, &transaction);
        async move {
            let mut rng = seed;
            while started.elapsed() < duration {
                let (after, done) = transaction(rng).await?;
                rng = after;
                let counter = if done { committed } else { conflicts };
                counter.set(counter.get() + 1);
            }
            Ok::<(), String>(())
        }
    };
    let runs = (0..clients.max(1) as u64).map(|c| client(c + seed_now()));
    for ran in futures::future::join_all(runs).await {
        ran?;
    }
    Ok((
        committed.get(),
        conflicts.get(),
        started.elapsed().as_secs_f64(),
    ))
}
