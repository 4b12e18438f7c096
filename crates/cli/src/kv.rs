//! `floe kv`: the transactional key-value store (`floe_isotope::kv`) on a volume this
//! process opens for transactions (taking its lease), or through the gateway that
//! holds it (`--gateway`, `floe_isotope::remote`), one transaction per command; and
//! `floe kv bank`, the bank-transfer workload the crash tests kill.

use crate::kv_index::{Index, Store, StoreError};
use crate::views::{self, Format};
use clap::Subcommand;
use floe_client::master::MasterClient;
use floe_isotope::remote::RemoteVolume;
use floe_isotope::{Blocks, Isolation, Outcome, Transactions};
use serde::Serialize;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Target {
    /// The volume holding the store (at least 17 MiB; its first 16 MiB hold the
    /// transaction log). A new volume gets a store at the first put.
    #[arg(long)]
    volume: String,
    /// Isolation of the command's transaction: ss (strict serializability) or si
    /// (snapshot isolation).
    #[arg(long, default_value = "ss")]
    isolation: Isolation,
    /// Run the transactions in the gateway serving them at ADDR (its --tx-listen),
    /// which holds the volume, instead of opening the volume here.
    #[arg(long, value_name = "ADDR")]
    gateway: Option<String>,
    /// The structure holding the pairs: hash (the hash table) or btree (the B-tree:
    /// keys in order). bank and bench run on the hash table.
    #[arg(long, value_enum, default_value = "hash")]
    index: Index,
}

#[derive(Subcommand)]
pub enum KvCommand {
    /// Set KEY to VALUE.
    Put {
        #[command(flatten)]
        target: Target,
        /// The key (1 to 60 bytes).
        key: String,
        /// The value (at most 192 bytes).
        value: String,
        #[command(flatten)]
        format: Format,
    },
    /// Print KEY's value (exit status 1 when absent, except with --json).
    Get {
        #[command(flatten)]
        target: Target,
        /// The key.
        key: String,
        #[command(flatten)]
        format: Format,
    },
    /// Delete KEY.
    Del {
        #[command(flatten)]
        target: Target,
        /// The key.
        key: String,
        #[command(flatten)]
        format: Format,
    },
    /// Print every pair, in key order.
    Scan {
        #[command(flatten)]
        target: Target,
        /// Only the keys that start with this.
        #[arg(long, default_value = "")]
        prefix: String,
        #[command(flatten)]
        format: Format,
    },
    /// Run bank transfers between accounts until killed or done, appending each
    /// acknowledged one to a ledger: the workload of the crash tests.
    Bank {
        #[command(flatten)]
        target: Target,
        /// Accounts, created with 1000 each on the first run.
        #[arg(long, default_value_t = 20)]
        accounts: u32,
        /// Transfers run at once, each in its own transaction.
        #[arg(long, default_value_t = 4)]
        clients: u32,
        /// Stop after this many acknowledged transfers (default: run until killed).
        #[arg(long)]
        transfers: Option<u64>,
        /// File to append `ok ID FROM BALANCE TO BALANCE` to after each commit.
        #[arg(long)]
        ledger: std::path::PathBuf,
    },
    /// Measure transactions per second and the abort rate: clients each updating two
    /// random keys per transaction, for a while; prints one JSON document.
    Bench {
        #[command(flatten)]
        target: Target,
        /// isotope (transactions, with --isolation) or locks (the baseline: a lock per
        /// table block and its own redo log over plain writes).
        #[arg(
            long,
            value_enum,
            default_value = "isotope",
            hide_possible_values = true
        )]
        engine: crate::kv_bench::Engine,
        /// Transactions run at once.
        #[arg(long, default_value_t = 8)]
        clients: u32,
        /// Keys updated at random (created first).
        #[arg(long, default_value_t = 1000)]
        keys: u32,
        /// Pick keys Zipf-distributed with this exponent (e.g. 0.99: contention on a
        /// few hot keys); 0 picks them uniformly.
        #[arg(long, default_value_t = 0.0)]
        zipf: f64,
        /// Seconds to measure.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
    },
}

/// Retries of a command's transaction that met a conflict (another process can't
/// hold the lease, but `bank` clients of this one can).
pub const CONFLICT_RETRIES: usize = 20;
/// Initial balance of each `bank` account.
pub const BANK_INITIAL: u64 = 1000;
/// How long the command lets its lease's release reach the master before it exits,
/// so the next command gets the volume at once rather than after the term.
const RELEASE_WAIT: Duration = Duration::from_millis(200);

#[derive(Serialize)]
struct Pair {
    key: String,
    value: Option<String>,
}

#[derive(Serialize)]
struct Changed {
    key: String,
    /// Whether the key existed (del) or was written (put).
    changed: bool,
    version: u64,
}

#[derive(Serialize)]
struct Scanned {
    volume: String,
    pairs: Vec<Pair>,
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

pub async fn run(master: &str, command: KvCommand) -> Result<(), String> {
    let (KvCommand::Put { target, .. }
    | KvCommand::Get { target, .. }
    | KvCommand::Del { target, .. }
    | KvCommand::Scan { target, .. }
    | KvCommand::Bank { target, .. }
    | KvCommand::Bench { target, .. }) = &command;
    let name = target.volume.clone();
    let isolation = target.isolation;
    let index = target.index;
    if index != Index::Hash && matches!(command, KvCommand::Bank { .. } | KvCommand::Bench { .. }) {
        return Err("bank and bench run on the hash table (--index hash)".into());
    }
    if let Some(gateway) = &target.gateway {
        let volume = RemoteVolume::connect(gateway, &name).await?;
        return execute(&volume, isolation, index, None, &name, command).await;
    }
    let master = Arc::new(MasterClient::new(master));
    let volume = floe_isotope::open(master, &name, "floe kv", isolation).await?;
    let device = volume.device();
    let done = execute(&volume, isolation, index, Some(device), &name, command).await;
    // In place before the lease goes, for a plain (NBD) reader of the volume.
    let settled = volume.settle().await;
    drop(volume);
    tokio::time::sleep(RELEASE_WAIT).await;
    done.and(settled.map_err(|e| format!("volume {name}: {e}")))
}

/// Runs `command` on `volume` (here or through a gateway; `device`: the volume
/// below, when here).
async fn execute<V: Transactions>(
    volume: &V,
    isolation: Isolation,
    index: Index,
    device: Option<Arc<dyn floe_blockdev::BlockDevice>>,
    name: &str,
    command: KvCommand,
) -> Result<(), String> {
    let blocks = volume.data_blocks();
    let volume = &Isolated { volume, isolation };
    match command {
        KvCommand::Put {
            key, value, format, ..
        } => {
            let version = retried(volume, name, CONFLICT_RETRIES, |mut tx| {
                let (key, value) = (key.clone(), value.clone());
                async move {
                    let mut store = Store::attach(index, &mut tx, blocks).await?;
                    store.put(key.as_bytes(), value.as_bytes()).await?;
                    Ok((tx, ()))
                }
            })
            .await?
            .0;
            match format.json {
                true => views::print(&Changed {
                    key,
                    changed: true,
                    version,
                }),
                false => {
                    println!("put {key} in {name} (version {version})");
                    Ok(())
                }
            }
        }
        KvCommand::Del { key, format, .. } => {
            let (version, existed) = retried(volume, name, CONFLICT_RETRIES, |mut tx| {
                let key = key.clone();
                async move {
                    let existed = Store::attach(index, &mut tx, blocks)
                        .await?
                        .delete(key.as_bytes())
                        .await?;
                    Ok((tx, existed))
                }
            })
            .await?;
            match (format.json, existed) {
                (true, _) => views::print(&Changed {
                    key,
                    changed: existed,
                    version,
                }),
                (false, true) => {
                    println!("deleted {key} from {name} (version {version})");
                    Ok(())
                }
                (false, false) => Err(format!("key {key:?} not found in volume {name}")),
            }
        }
        KvCommand::Get { key, format, .. } => {
            let (_, value) = retried(volume, name, CONFLICT_RETRIES, |mut tx| {
                let key = key.clone();
                async move {
                    let value = Store::attach(index, &mut tx, blocks)
                        .await?
                        .get(key.as_bytes())
                        .await?;
                    Ok((tx, value))
                }
            })
            .await?;
            let value = value.map(|v| text(&v));
            match (format.json, value) {
                (true, value) => views::print(&Pair { key, value }),
                (false, Some(value)) => {
                    println!("{value}");
                    Ok(())
                }
                (false, None) => Err(format!("key {key:?} not found in volume {name}")),
            }
        }
        KvCommand::Scan { prefix, format, .. } => {
            let (_, pairs) = retried(volume, name, CONFLICT_RETRIES, |mut tx| {
                let prefix = prefix.clone();
                async move {
                    let pairs = Store::attach(index, &mut tx, blocks)
                        .await?
                        .scan(prefix.as_bytes())
                        .await?;
                    Ok((tx, pairs))
                }
            })
            .await?;
            let pairs: Vec<Pair> = pairs
                .iter()
                .map(|(k, v)| Pair {
                    key: text(k),
                    value: Some(text(v)),
                })
                .collect();
            if format.json {
                return views::print(&Scanned {
                    volume: name.to_string(),
                    pairs,
                });
            }
            for pair in &pairs {
                println!(
                    "{}\t{}",
                    pair.key,
                    pair.value.as_deref().unwrap_or_default()
                );
            }
            Ok(())
        }
        KvCommand::Bench {
            engine,
            clients,
            keys,
            zipf,
            seconds,
            ..
        } => {
            if !(zipf >= 0.0 && zipf.is_finite()) {
                return Err(format!("--zipf {zipf}: the exponent is 0 or more"));
            }
            let options = crate::kv_bench::Options {
                engine,
                isolation,
                clients,
                keys,
                skew: zipf,
                duration: Duration::from_secs(seconds),
            };
            crate::kv_bench::run(volume, device, name, options).await
        }
        KvCommand::Bank {
            accounts,
            clients,
            transfers,
            ledger,
            ..
        } => crate::bank::run(volume, name, accounts, clients, transfers, &ledger).await,
    }
}

/// A volume whose transactions begin with the command's isolation.
pub struct Isolated<'v, V> {
    pub volume: &'v V,
    pub isolation: Isolation,
}

impl<V: Transactions> Isolated<'_, V> {
    pub async fn begin(&self) -> Result<V::Tx, floe_isotope::TxError> {
        self.volume.begin_with(Some(self.isolation)).await
    }

    pub fn data_blocks(&self) -> u64 {
        self.volume.data_blocks()
    }
}

/// Runs `body` in a new transaction and commits it, again on a conflict (at most
/// `retries` times); returns the commit's version and what `body` returned.
pub async fn retried<V, T, F, Fut>(
    volume: &Isolated<'_, V>,
    name: &str,
    retries: usize,
    body: F,
) -> Result<(u64, T), String>
where
    V: Transactions,
    F: Fn(V::Tx) -> Fut,
    Fut: std::future::Future<Output = Result<(V::Tx, T), StoreError>>,
{
    for _ in 0..retries {
        let tx = volume
            .begin()
            .await
            .map_err(|e| format!("volume {name}: {e}"))?;
        let (tx, out) = body(tx).await.map_err(|e| format!("volume {name}: {e}"))?;
        match tx
            .commit()
            .await
            .map_err(|e| format!("volume {name}: {e}"))?
        {
            Outcome::Committed { version } => return Ok((version, out)),
            Outcome::Conflict => continue,
        }
    }
    Err(format!(
        "volume {name}: {retries} conflicts in a row; try again"
    ))
}

/// Appends one line with one write: a kill -9 loses no line written before it.
pub fn append_line(file: &mut std::fs::File, line: &str) -> Result<(), String> {
    file.write_all(format!("{line}\n").as_bytes())
        .map_err(|e| format!("writing the ledger: {e}"))
}
