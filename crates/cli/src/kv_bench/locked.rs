//! The baseline `floe kv bench --engine locks` measures Isotope against: the same
//! hash table, updated the way an application without transactions does it, with a
//! lock per table block (taken in block order) and its own redo log over plain writes
//! (one record per update, appended durably before the blocks are written in place:
//! the same durability as a commit). No snapshots, no conflicts: updates wait.

use floe_blockdev::BlockDevice;
use floe_isotope::kv::{self, slot};
use floe_isotope::layout::{self, BLOCK_BYTES};
use floe_isotope::log::Log;
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct Locked {
    device: Arc<dyn BlockDevice>,
    table_blocks: u64,
    locks: Vec<tokio::sync::Mutex<()>>,
    log: tokio::sync::Mutex<Log>,
}

impl Locked {
    /// Opens a volume whose table `floe_isotope::kv` made (replaying the log first).
    pub async fn open(device: Arc<dyn BlockDevice>) -> Result<Locked, String> {
        let log = Log::open(device.clone()).await?;
        let header = device
            .read(layout::data_offset(0), BLOCK_BYTES as u32)
            .await
            .map_err(|e| e.to_string())?;
        let table_blocks = kv::table_blocks(&header).ok_or("no key-value table")?;
        Ok(Locked {
            device,
            table_blocks,
            locks: (0..table_blocks).map(|_| Default::default()).collect(),
            log: tokio::sync::Mutex::new(log),
        })
    }

    /// Adds one to each key's decimal value, atomically.
    pub async fn increment(&self, keys: &[&[u8]]) -> Result<(), String> {
        // A key the transactional store put lies in its probe blocks; these tests keep
        // few enough keys that it is the first.
        let homes: Vec<u64> = keys
            .iter()
            .map(|k| kv::probe(k, self.table_blocks).next().expect("a block"))
            .collect();
        let mut blocks = homes.clone();
        blocks.sort();
        blocks.dedup();
        let mut guards = Vec::new();
        for block in &blocks {
            guards.push(self.locks[*block as usize - 1].lock().await);
        }
        let mut images = BTreeMap::new();
        for block in &blocks {
            let data = self
                .device
                .read(layout::data_offset(*block), BLOCK_BYTES as u32)
                .await;
            images.insert(*block, data.map_err(|e| e.to_string())?.to_vec());
        }
        for (key, home) in keys.iter().zip(&homes) {
            let image = images.get_mut(home).expect("read");
            let found = (0..slot::SLOTS_PER_BLOCK).find(|s| {
                slot::state(image, *s) == slot::State::Used && slot::key(image, *s) == *key
            });
            let Some(at) = found else {
                return Err(format!(
                    "{} is not in its first block",
                    String::from_utf8_lossy(key)
                ));
            };
            let n: u64 = String::from_utf8_lossy(slot::value(image, at))
                .parse()
                .unwrap_or(0);
            slot::set(image, at, key, (n + 1).to_string().as_bytes());
        }
        let records: Vec<(u64, bytes::Bytes)> = images
            .into_iter()
            .map(|(b, d)| (b, bytes::Bytes::from(d)))
            .collect();
        {
            let mut log = self.log.lock().await;
            let version = log.last_version() + 1;
            log.append(&[(version, records.clone())])
                .await
                .map_err(|e| e.to_string())?;
        }
        let applies = records.iter().map(|(block, data)| {
            self.device
                .write(layout::data_offset(*block), data.clone(), false)
        });
        for applied in futures::future::join_all(applies).await {
            applied.map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}
