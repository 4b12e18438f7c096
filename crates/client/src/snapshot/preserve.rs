//! The writer's snapshot layer: copy-on-write of 4 KiB blocks into delta chunks.
//!
//! Every write and zero holds the epoch it was stamped with (a read lock) until it
//! ends. A new epoch from the lease takes the write lock, so it waits for the writes
//! of older epochs to end before the writer confirms it to the master: from the
//! confirmation on, the snapshot no longer changes. Under epoch `t`, the first write
//! over a block of a chunk allocated before `t` reads the block and writes it, whole
//! and durable (FUA), into delta chunk `(t, chunk)` before the write itself is sent;
//! one copy per block and epoch (the delta's blocks are learned from its extents
//! once, then kept in memory). A crash between the two leaves the delta holding what
//! the chunk still holds. A clone's writer reads the old block through its
//! read-through layer: a block the clone has not written preserves the parent's
//! contents, which is what the clone read there.

use super::blocks::Blocks;
use crate::replicated::ReplicatedChunks;
use crate::stripe::ChunkIo;
use async_trait::async_trait;
use bytes::Bytes;
use floe_blockdev::IoError;
use floe_protocol::connection::CallError;
use floe_protocol::snapshot::{delta_index, SNAPSHOT_BLOCK_BYTES};
use floe_protocol::{MasterRequest, MasterResponse, SnapshotEpochs, Status};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::{watch, Notify, RwLock};

/// Blocks copied by one write into a delta (1 MiB): a large zero over a chunk
/// preserves it piece by piece.
const PIECE_BLOCKS: u64 = 256;
/// Pause between attempts to reach a master that did not answer.
const CONFIRM_RETRY: Duration = Duration::from_millis(500);
/// How long the master holds a long-poll for new epochs, and the limit of a call.
const WATCH_WAIT: Duration = Duration::from_millis(2500);
const CALL_LIMIT: Duration = Duration::from_secs(4);

/// The blocks of one chunk's delta for the current epoch.
#[derive(Default)]
struct Delta {
    epoch: u32,
    /// `None` until learned from the delta chunk's extents.
    preserved: Option<Blocks>,
    /// Blocks being copied: a write over one waits for its copy to end.
    copying: Blocks,
}

/// One live chunk's delta state; copies of different blocks run at once.
#[derive(Default)]
struct Cell {
    delta: Mutex<Delta>,
    /// Held while the delta's blocks are learned.
    learning: tokio::sync::Mutex<()>,
    /// A copy ended.
    copied: Notify,
}

struct Shared {
    /// The volume's chunks: delta chunks are written here.
    chunks: Arc<ReplicatedChunks>,
    /// The layer below: the same chunks, or a clone's read-through layer over them
    /// (a block a clone has not written preserves its parent's contents).
    live: Arc<dyn ChunkIo>,
    epochs: RwLock<SnapshotEpochs>,
    deltas: Mutex<BTreeMap<u64, Arc<Cell>>>,
}

pub struct Preserving {
    shared: Arc<Shared>,
    follower: tokio::task::JoinHandle<()>,
}

impl Drop for Preserving {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

impl Preserving {
    /// Over `live` (on `chunks`), whose lease delivers `epochs`.
    pub fn new(
        chunks: Arc<ReplicatedChunks>,
        live: Arc<dyn ChunkIo>,
        epochs: watch::Receiver<SnapshotEpochs>,
        confirm: Confirm,
    ) -> Preserving {
        let first = *epochs.borrow();
        chunks.set_epoch(first.epoch);
        let shared = Arc::new(Shared {
            chunks,
            live,
            epochs: RwLock::new(first),
            deltas: Mutex::default(),
        });
        let follower = tokio::spawn(follow(Arc::downgrade(&shared), epochs, confirm));
        Preserving { shared, follower }
    }

    /// Copies the blocks of `offset..offset + length` of chunk `index` not yet
    /// preserved in this epoch into its delta.
    async fn preserve(
        &self,
        epochs: &SnapshotEpochs,
        index: u64,
        offset: u64,
        length: u64,
    ) -> Result<(), IoError> {
        let chunks = &self.shared.chunks;
        // A chunk allocated in this epoch did not exist when its snapshot was taken:
        // the snapshot reads it as zeroes.
        let existed = chunks.born(index).is_some_and(|born| born < epochs.epoch);
        if !epochs.preserving || !existed || length == 0 {
            return Ok(());
        }
        let delta = delta_index(epochs.epoch, index);
        let cell = self
            .shared
            .deltas
            .lock()
            .unwrap()
            .entry(index)
            .or_default()
            .clone();
        let blocks =
            offset / SNAPSHOT_BLOCK_BYTES..(offset + length).div_ceil(SNAPSHOT_BLOCK_BYTES);
        let runs = loop {
            let learned = |d: &Delta| d.epoch == epochs.epoch && d.preserved.is_some();
            if !learned(&cell.delta.lock().unwrap()) {
                let _learning = cell.learning.lock().await;
                if !learned(&cell.delta.lock().unwrap()) {
                    let extents = chunks.extents(delta).await?;
                    *cell.delta.lock().unwrap() = Delta {
                        epoch: epochs.epoch,
                        preserved: Some(Blocks::from_extents(&extents)),
                        copying: Blocks::default(),
                    };
                }
                continue;
            }
            // Created before the check: a copy ending from here on wakes it.
            let copied = cell.copied.notified();
            {
                let mut state = cell.delta.lock().unwrap();
                let missing = state
                    .preserved
                    .as_ref()
                    .expect("learned")
                    .missing(blocks.clone());
                let busy = missing
                    .iter()
                    .flat_map(|r| r.clone())
                    .any(|b| state.copying.contains(b));
                if !busy {
                    for run in &missing {
                        state.copying.insert(run.clone());
                    }
                    break missing;
                }
            }
            copied.await;
        };
        if runs.is_empty() {
            return Ok(());
        }
        let copied = self.copy(index, delta, &runs).await;
        {
            let mut state = cell.delta.lock().unwrap();
            for run in &runs {
                state.copying.remove(run.clone());
                if copied.is_ok() {
                    state
                        .preserved
                        .as_mut()
                        .expect("learned")
                        .insert(run.clone());
                }
            }
        }
        cell.copied.notify_waiters();
        copied
    }

    /// Copies `runs` of blocks of chunk `index` into its delta `delta`, durably.
    async fn copy(
        &self,
        index: u64,
        delta: u64,
        runs: &[std::ops::Range<u64>],
    ) -> Result<(), IoError> {
        let Shared { chunks, live, .. } = &*self.shared;
        let pieces = runs.iter().flat_map(|run| {
            (run.start..run.end)
                .step_by(PIECE_BLOCKS as usize)
                .map(move |start| start..(start + PIECE_BLOCKS).min(run.end))
        });
        for piece in pieces {
            let (at, bytes) = (
                piece.start * SNAPSHOT_BLOCK_BYTES,
                (piece.end - piece.start) * SNAPSHOT_BLOCK_BYTES,
            );
            let old = live.read(index, at, bytes as u32).await?;
            chunks.write(delta, at, old, true).await?;
        }
        Ok(())
    }
}

/// What an epoch switch tells the master.
pub struct Confirm {
    pub master: Arc<crate::master::MasterClient>,
    pub volume: String,
    pub generation: u32,
}

/// Switches to each epoch the master announces (a long-poll, so a snapshot is
/// taken at once; lease renewals bring them too), once the writes of older ones
/// ended, and confirms it to the master.
async fn follow(
    shared: Weak<Shared>,
    mut renewals: watch::Receiver<SnapshotEpochs>,
    confirm: Confirm,
) {
    let mut wanted = *renewals.borrow_and_update();
    let mut confirmed = None;
    loop {
        if confirmed != Some(wanted) {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            switch(&shared, wanted).await;
            drop(shared);
            match confirm
                .call(MasterRequest::ConfirmSnapshotEpoch {
                    name: confirm.volume.clone(),
                    generation: confirm.generation,
                    epoch: wanted.epoch,
                })
                .await
            {
                Some(_) => confirmed = Some(wanted),
                None => return,
            }
        }
        let watch = MasterRequest::WatchSnapshotEpochs {
            name: confirm.volume.clone(),
            generation: confirm.generation,
            known: wanted,
            wait_ms: WATCH_WAIT.as_millis() as u64,
        };
        let answer = tokio::select! {
            biased; // the simulator replays a seed exactly
            polled = confirm.call(watch) => match polled {
                Some(MasterResponse::SnapshotEpochs(epochs)) => epochs,
                Some(_) => wanted,
                None => return,
            },
            changed = renewals.changed() => match changed {
                Ok(()) => *renewals.borrow_and_update(),
                Err(_) => return,
            },
        };
        wanted = wanted.later(answer);
    }
}

/// Takes the epoch up once the writes of older ones ended (the write lock). A new
/// snapshot is also a FLUSH point: in write-back, every write acknowledged before it
/// is made durable first, so the snapshot keeps them through a power cut too.
async fn switch(shared: &Shared, wanted: SnapshotEpochs) {
    let mut current = shared.epochs.write().await;
    assert!(
        wanted.epoch >= current.epoch,
        "snapshot epoch went back from {} to {}",
        current.epoch,
        wanted.epoch
    );
    if wanted.epoch > current.epoch {
        if let Err(e) = shared.live.flush().await {
            // The writes stay unflushed: the volume's next FLUSH fails as they do.
            tracing::warn!("syncing the writes before a snapshot failed: {e}");
        }
    }
    shared.chunks.set_epoch(wanted.epoch);
    *current = wanted;
}

impl Confirm {
    /// Calls the master until it answers; `None` once the lease is lost.
    async fn call(&self, request: MasterRequest) -> Option<MasterResponse> {
        loop {
            match self.master.call_within(request.clone(), CALL_LIMIT).await {
                Ok(reply) => return Some(reply),
                Err(CallError::Remote {
                    status: Status::Fenced | Status::NotFound,
                    message,
                }) => {
                    tracing::warn!(volume = %self.volume, "snapshot epochs no longer followed: {message}");
                    return None;
                }
                Err(e) => {
                    tracing::warn!(volume = %self.volume, "asking the master about snapshot epochs: {e}");
                    tokio::time::sleep(CONFIRM_RETRY).await;
                }
            }
        }
    }
}

#[async_trait]
impl ChunkIo for Preserving {
    async fn read(&self, index: u64, offset: u64, length: u32) -> Result<Bytes, IoError> {
        self.shared.live.read(index, offset, length).await
    }

    async fn write(&self, index: u64, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        let epochs = self.shared.epochs.read().await;
        self.preserve(&epochs, index, offset, data.len() as u64)
            .await?;
        self.shared.live.write(index, offset, data, fua).await
    }

    async fn zero(&self, index: u64, offset: u64, length: u64, punch: bool) -> Result<(), IoError> {
        let epochs = self.shared.epochs.read().await;
        self.preserve(&epochs, index, offset, length).await?;
        self.shared.live.zero(index, offset, length, punch).await
    }

    async fn flush(&self) -> Result<(), IoError> {
        self.shared.live.flush().await
    }

    fn is_allocated(&self, index: u64) -> bool {
        self.shared.live.is_allocated(index)
    }
}
