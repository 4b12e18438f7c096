//! The chunk files and the replicas' durable state, shared by readers, the committer
//! and the replay worker; a cache of open chunk files.

use crate::block_sums::{ChunkFile, BLOCK_BYTES};
use crate::chain::Chain;
use crate::disk::hdd::Hdd;
use crate::disk::Disk;
use crate::error::StoreError;
use crate::journal::Journals;
use crate::layout;
use crate::meta::Metas;
use crate::retained::Retained;
use crate::sums_cache::{Budget, SumsCache};
use crate::unsynced::UnsyncedChunks;
use floe_protocol::ChunkId;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Open chunk files kept cached.
const OPEN_FILES_MAX: usize = 4096;

pub(crate) struct Files {
    pub(crate) disk: Arc<dyn Disk>,
    pub(crate) dir: PathBuf,
    open: Mutex<BTreeMap<ChunkId, ChunkFile>>,
    /// Updated as log records commit: the state of what is durable.
    pub(crate) metas: Mutex<Metas>,
    /// The emulated hdd under the chunk files, asked whether it is idle.
    pub(crate) hdd: Option<Arc<Hdd>>,
    pub(crate) journals: Option<Journals>,
    /// The chained-log engine: chunk data lives there instead of in chunk files.
    pub(crate) chain: Option<Chain>,
    /// Reads check block checksums (see [`crate::Tuning::check_reads`]).
    pub(crate) check_reads: bool,
    /// Checksum pages the open chunk files keep in memory.
    sums_budget: Arc<Budget>,
    /// Blocks found failing their checksums and not yet reported (chunk, offset).
    corrupt: Mutex<BTreeSet<(ChunkId, u64)>>,
    corrupt_found: AtomicU64,
    /// Chunks whose latest writes are acknowledged but not yet in their files.
    pub(crate) unsynced: UnsyncedChunks,
    /// Blocks kept for snapshots, every mode (see [`crate::retained`]).
    pub(crate) retained: Retained,
}

impl Files {
    /// Reads the chunk as it stands, whatever holds it: the chain, or the journals
    /// over the chunk file, or the chunk file (`check`: against block checksums).
    pub(crate) fn read_into(
        &self,
        chunk: ChunkId,
        offset: u64,
        out: &mut [u8],
        check: bool,
    ) -> Result<(), StoreError> {
        if let Some(chain) = &self.chain {
            return chain.read(chunk, offset, out, check);
        }
        let (holes, in_flux) = match &self.journals {
            Some(journals) => (
                journals.read(chunk, offset, out, check)?,
                journals.in_flux(chunk, offset, out.len() as u64),
            ),
            None => (vec![(offset, out.len() as u64)], Vec::new()),
        };
        // A block with journaled data may be half copied by a replay cut short.
        let unchecked = |block: u64| {
            in_flux
                .iter()
                .any(|&(at, len)| at < block + BLOCK_BYTES && block < at + len)
        };
        if let Some(file) = self.get(chunk, false)? {
            for (at, len) in holes {
                let from = (at - offset) as usize;
                let part = &mut out[from..from + len as usize];
                if check {
                    file.read(part, at, &unchecked)?;
                } else {
                    crate::disk::read_at(&*file.data, part, at)?;
                }
            }
        }
        Ok(())
    }

    pub(crate) fn new(
        disk: Arc<dyn Disk>,
        dir: &Path,
        metas: Metas,
        hdd: Option<Arc<Hdd>>,
        check_reads: bool,
    ) -> Files {
        Files {
            disk,
            dir: dir.to_path_buf(),
            open: Mutex::default(),
            metas: Mutex::new(metas),
            hdd,
            journals: None,
            chain: None,
            check_reads,
            sums_budget: Arc::default(),
            corrupt: Mutex::default(),
            corrupt_found: AtomicU64::new(0),
            unsynced: UnsyncedChunks::default(),
            retained: Retained::default(),
        }
    }

    /// Notes a block that failed its checksum: logged and counted here, reported by
    /// the chunk server (see [`crate::Store::take_corrupt`]).
    pub(crate) fn found_corrupt(&self, chunk: ChunkId, offset: u64, place: &str) {
        tracing::error!(
            volume = chunk.volume_id,
            chunk = chunk.index,
            offset,
            place,
            "block fails its checksum"
        );
        self.corrupt_found.fetch_add(1, Ordering::Relaxed);
        self.corrupt.lock().unwrap().insert((chunk, offset));
    }

    pub(crate) fn take_corrupt(&self) -> Vec<(ChunkId, u64)> {
        std::mem::take(&mut *self.corrupt.lock().unwrap())
            .into_iter()
            .collect()
    }

    pub(crate) fn corrupt_found(&self) -> u64 {
        self.corrupt_found.load(Ordering::Relaxed)
    }

    /// The chunk's file; `None` when it does not exist and `create` is false. Its
    /// checksum file is made with it, or on first use when missing (a crash between
    /// the two, or an older version's chunk): empty, every block unchecked.
    pub(crate) fn get(&self, chunk: ChunkId, create: bool) -> io::Result<Option<ChunkFile>> {
        if let Some(f) = self.open.lock().unwrap().get(&chunk) {
            return Ok(Some(f.clone()));
        }
        let path = layout::chunk_path(&self.dir, chunk);
        let sums_path = layout::sums_path(&self.dir, chunk);
        let (data, sums) = match self.disk.open(&path, false) {
            Ok(data) => (data, self.disk.open(&sums_path, true)?),
            Err(e) if e.kind() == ErrorKind::NotFound && create => {
                self.disk
                    .create_dir_all(path.parent().expect("chunk path has a parent"))?;
                // A power cut may have undone a file's creation and kept its
                // checksums: emptied, durably, before the new file exists.
                let sums = self.disk.open(&sums_path, true)?;
                sums.set_len(0)?;
                sums.sync_data()?;
                (self.disk.open(&path, true)?, sums)
            }
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let file = ChunkFile {
            chunk,
            data,
            sums,
            // Plain mode's replay rewrites the checksums of every change since the
            // last checkpoint; hybrid mode rehashes only its last batch's.
            cache: Arc::new(SumsCache::new(
                self.sums_budget.clone(),
                self.journals.is_none(),
            )),
        };
        let mut open = self.open.lock().unwrap();
        if open.len() >= OPEN_FILES_MAX {
            // Checksums held in memory stay until the next checkpoint writes them.
            open.retain(|_, file| file.cache.is_dirty());
        }
        Ok(Some(open.entry(chunk).or_insert(file).clone()))
    }

    /// Closes every open chunk file; the log's checkpoint wrote their checksums.
    pub(crate) fn close_all(&mut self) {
        let open = self.open.get_mut().unwrap();
        assert!(
            open.values().all(|file| !file.cache.is_dirty()),
            "chunk files closed with checksums only in memory"
        );
        open.clear();
    }

    /// True if the chunk has a file.
    pub(crate) fn exists(&self, chunk: ChunkId) -> io::Result<bool> {
        if self.open.lock().unwrap().contains_key(&chunk) {
            return Ok(true);
        }
        self.disk.exists(&layout::chunk_path(&self.dir, chunk))
    }

    /// The directories whose entries a new file of `chunk` adds to.
    pub(crate) fn dirs_of(&self, chunk: ChunkId) -> [PathBuf; 2] {
        [
            layout::volume_dir(&self.dir, chunk.volume_id),
            layout::chunks_dir(&self.dir),
        ]
    }

    pub(crate) fn forget_volume(&self, volume_id: u64) {
        self.open
            .lock()
            .unwrap()
            .retain(|c, _| c.volume_id != volume_id);
    }

    /// Makes a directory's entries durable; one that is gone (a deleted volume's) has
    /// none left to sync.
    pub(crate) fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        match self.disk.sync_dir(dir) {
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }
}
