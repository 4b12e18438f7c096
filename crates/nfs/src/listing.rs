//! The export's one directory: a file per volume and per snapshot, from the master's
//! volume list.
//!
//! File ids come from the volume's id and the snapshot's epoch, not from the order
//! the names were seen in: a handle means the same file after a restart, and a
//! volume deleted and created again under its name is a new file (the old handle is
//! stale, not silently the new volume).

use floe_client::master::MasterClient;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The directory's id.
pub const ROOT: u64 = 1;

/// How long a listing answers lookups and attributes before it is asked for again:
/// clients ask for attributes before most requests, the master need not hear each.
const FRESH_FOR: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub fileid: u64,
    /// `VOLUME` or `VOLUME@SNAPSHOT`.
    pub name: String,
    pub size_bytes: u64,
    /// Snapshots are read-only.
    pub writable: bool,
}

pub struct Listing {
    master: Arc<MasterClient>,
    cached: Mutex<Option<(Instant, Arc<Vec<Entry>>)>>,
}

/// A volume's file id (epoch 0) or its snapshot's: above [`ROOT`], never 0.
fn fileid(volume_id: u64, epoch: u32) -> u64 {
    (volume_id << 32 | u64::from(epoch)) + 2
}

impl Listing {
    pub fn new(master: Arc<MasterClient>) -> Listing {
        Listing {
            master,
            cached: Mutex::new(None),
        }
    }

    /// Every file, ordered by name; a cached listing if it is fresh.
    pub async fn entries(&self) -> Result<Arc<Vec<Entry>>, String> {
        if let Some((at, entries)) = &*self.cached.lock().unwrap() {
            if at.elapsed() < FRESH_FOR {
                return Ok(entries.clone());
            }
        }
        self.refresh().await
    }

    async fn refresh(&self) -> Result<Arc<Vec<Entry>>, String> {
        let volumes = self
            .master
            .list_volumes()
            .await
            .map_err(|e| format!("cannot list the volumes: {e}"))?;
        let mut entries = Vec::new();
        for volume in volumes {
            entries.push(Entry {
                fileid: fileid(volume.id, 0),
                name: volume.spec.name.clone(),
                size_bytes: volume.spec.size_bytes,
                writable: true,
            });
            // A pending snapshot cannot be opened yet: it appears once taken.
            entries.extend(volume.snapshots.iter().filter(|s| s.ready).map(|s| Entry {
                fileid: fileid(volume.id, s.epoch),
                name: format!("{}@{}", volume.spec.name, s.name),
                size_bytes: s.size_bytes,
                writable: false,
            }));
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        let entries = Arc::new(entries);
        *self.cached.lock().unwrap() = Some((Instant::now(), entries.clone()));
        Ok(entries)
    }

    /// The file named `name`.
    pub async fn by_name(&self, name: &str) -> Result<Option<Entry>, String> {
        let find = |entries: &[Entry]| entries.iter().find(|e| e.name == name).cloned();
        match find(&self.entries().await?) {
            Some(entry) => Ok(Some(entry)),
            // Created since the cached listing, perhaps.
            None => Ok(find(&self.refresh().await?)),
        }
    }

    /// The file with id `fileid`.
    pub async fn by_id(&self, fileid: u64) -> Result<Option<Entry>, String> {
        let find = |entries: &[Entry]| entries.iter().find(|e| e.fileid == fileid).cloned();
        match find(&self.entries().await?) {
            Some(entry) => Ok(Some(entry)),
            None => Ok(find(&self.refresh().await?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_ids_are_distinct_and_never_the_root_or_zero() {
        let ids = [
            fileid(0, 0),
            fileid(0, 1),
            fileid(1, 0),
            fileid(1, u32::MAX),
        ];
        assert!(ids.iter().all(|&id| id != 0 && id != ROOT));
        let mut unique = ids.to_vec();
        unique.dedup();
        assert_eq!(unique.len(), ids.len());
    }
}
