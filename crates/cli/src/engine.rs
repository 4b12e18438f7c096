//! `floe chunkserver --engine`: the chunk store engine a server runs, and the
//! chained-log engine's disks, cache and cleaning (see floe_chunkstore's `chain`).

use crate::size;
use floe_chunkserver::{ChainGc, ChainOptions};
use std::path::PathBuf;

/// Bytes of each chain disk's log unless `--disk-size` says.
const DISK_BYTES_DEFAULT: u64 = 1 << 30;
/// Bytes of the RAM tail cache unless `--ram-cache-size` says.
const RAM_CACHE_BYTES_DEFAULT: u64 = 256 << 20;

/// Values are described in the flags' help (clap would list described values
/// apart from the flag).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    #[default]
    Files,
    Log,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Gc {
    MoveToTail,
    CompactInBody,
}

#[derive(clap::Args)]
pub struct EngineArgs {
    /// Chunk store engine: files (chunk files behind the write-ahead log) or log (a
    /// log chained across the --disk's; the write-ahead log stays in --dir).
    #[arg(long, value_enum, default_value = "files")]
    engine: Engine,
    /// (--engine log) A disk of the chain, in chain order; repeat for each disk.
    #[arg(long = "disk")]
    disks: Vec<PathBuf>,
    /// (--engine log) Flash directory for the chain's saved map and tail cache.
    #[arg(long)]
    cache: Option<PathBuf>,
    /// (--engine log) Bytes of the tail cache on --cache's flash: recent writes
    /// read from there once the RAM cache evicts them (default 0, none).
    #[arg(long, value_parser = size::parse)]
    cache_size: Option<u64>,
    /// (--engine log) Bytes of the RAM tail cache of recent writes (default 256M).
    #[arg(long, value_parser = size::parse)]
    ram_cache_size: Option<u64>,
    /// (--engine log) Bytes of each disk's log (default 1G).
    #[arg(long, value_parser = size::parse)]
    disk_size: Option<u64>,
    /// (--engine log) How the chain is cleaned: move-to-tail (the head's live blocks
    /// copied to the tail, the default) or compact-in-body (into dead positions of
    /// the other disks, so the tail disk writes only client data; for disks that do
    /// not seek: on hdds each moved block costs a seek, and writes crawl while it
    /// cleans).
    #[arg(long, value_enum)]
    gc: Option<Gc>,
}

/// `floe demo`'s chain flags, passed on to every chunk server.
pub fn chain_flags(gc: Option<Gc>, cache_bytes: Option<u64>) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(gc) = gc {
        let name = clap::ValueEnum::to_possible_value(&gc).expect("every value is named");
        out.extend(["--gc".into(), name.get_name().to_string()]);
    }
    if let Some(bytes) = cache_bytes {
        out.extend(["--cache-size".into(), bytes.to_string()]);
    }
    out
}

impl EngineArgs {
    /// The chain to run, or `None` for the files engine; a one-line error for
    /// flags that do not go together.
    pub fn chain(&self, journals: bool) -> Result<Option<ChainOptions>, String> {
        let log_only = !self.disks.is_empty()
            || self.cache.is_some()
            || self.cache_size.is_some()
            || self.ram_cache_size.is_some()
            || self.disk_size.is_some()
            || self.gc.is_some();
        match self.engine {
            Engine::Files if log_only => {
                Err("--disk, --cache, --cache-size, --ram-cache-size, --disk-size and --gc need --engine log".into())
            }
            Engine::Files => Ok(None),
            Engine::Log if journals => {
                Err("--engine log takes no --journal: its tail cache keeps recent writes".into())
            }
            Engine::Log if self.disks.is_empty() => {
                Err("--engine log needs one --disk per disk of the chain".into())
            }
            Engine::Log => {
                let Some(cache_dir) = self.cache.clone() else {
                    return Err("--engine log needs --cache DIR on flash for its map".into());
                };
                Ok(Some(ChainOptions {
                    disks: self.disks.clone(),
                    cache_dir,
                    disk_bytes: self.disk_size.unwrap_or(DISK_BYTES_DEFAULT),
                    cache_bytes: self.ram_cache_size.unwrap_or(RAM_CACHE_BYTES_DEFAULT),
                    flash_cache_bytes: self.cache_size.unwrap_or(0),
                    layout: Default::default(),
                    gc: match self.gc {
                        Some(Gc::CompactInBody) => ChainGc::CompactInBody,
                        Some(Gc::MoveToTail) | None => ChainGc::MoveToTail,
                    },
                }))
            }
        }
    }
}
