//! Applying committed blocks in place, off the commit path. A commit is durable once
//! its log record is (replay at open rewrites every record past the superblock), so
//! its members are answered after the log write; each block it wrote waits here, its
//! newest committed image in the dirty map (which reads consult before the volume),
//! until a background task writes it in place: once per round, however many commits
//! wrote it meanwhile (a hot block's commits coalesce). A block written in place
//! stays as a clean image (at most [`CLEAN_BLOCKS_MAX`]), so reads of blocks this
//! volume wrote lately cost no device read: only commits write the data blocks while
//! the volume is open, and each hands its images over here, so a clean image is the
//! newest too. (Images read from the device are not kept: one could land after a
//! newer commit's.)
//!
//! Bounded: past [`DIRTY_BLOCKS_MAX`] blocks, commits wait for the task ([`Applier::room`]).
//! The log's ring wraps only once everything logged is in place ([`Applier::drain`]),
//! so the superblock never moves past a record whose blocks are not. Closed (the
//! volume dropped), the task stops after its round in flight; what it did not write
//! is in the log, which the next open replays.

use crate::layout::{self, BLOCK_BYTES};
use bytes::Bytes;
use floe_blockdev::BlockDevice;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// Dirty blocks held at most (16 MiB): past it, commits wait for the applier.
pub const DIRTY_BLOCKS_MAX: usize = 4096;
/// Clean images kept at most (32 MiB): past it, the lowest block's goes.
pub const CLEAN_BLOCKS_MAX: usize = 8192;
/// Blocks one round writes at most, taken on from where the last round stopped.
const ROUND_BLOCKS_MAX: usize = 256;

pub(crate) struct Applier {
    device: Arc<dyn BlockDevice>,
    dirty: Mutex<Dirty>,
    /// Wakes the task: blocks to write, or the volume closed.
    work: Notify,
    /// Wakes waiting commits: a round ended (room made), or the task failed.
    progress: Notify,
}

struct Dirty {
    /// Per block not yet in place: the newest committed version that wrote it, and
    /// its image as of that version.
    blocks: BTreeMap<u64, (u64, Bytes)>,
    /// Blocks in place whose newest image this is (none of them in `blocks`).
    clean: BTreeMap<u64, Bytes>,
    /// The newest version handed over: every version up to it is in place, or its
    /// blocks' images (or newer ones) are in `blocks`.
    logged: u64,
    /// The block the next round starts at, so no block waits behind hot ones.
    next: u64,
    failed: Option<String>,
    closed: bool,
}

impl Dirty {
    fn keep_clean(&mut self, block: u64, image: Bytes) {
        if self.clean.len() >= CLEAN_BLOCKS_MAX {
            self.clean.pop_first();
        }
        self.clean.insert(block, image);
    }
}

impl Applier {
    /// Starts the task over `device`, whose log is replayed up to `version`.
    pub(crate) fn start(device: Arc<dyn BlockDevice>, version: u64) -> Arc<Applier> {
        let applier = Arc::new(Applier {
            device,
            dirty: Mutex::new(Dirty {
                blocks: BTreeMap::new(),
                clean: BTreeMap::new(),
                logged: version,
                next: 0,
                failed: None,
                closed: false,
            }),
            work: Notify::new(),
            progress: Notify::new(),
        });
        tokio::spawn(applier.clone().run());
        applier
    }

    /// `block`'s newest committed image, if it is not yet in place or was written in
    /// place lately.
    pub(crate) fn get(&self, block: u64) -> Option<Bytes> {
        let dirty = self.dirty.lock().unwrap();
        match dirty.blocks.get(&block) {
            Some((_, image)) => Some(image.clone()),
            None => dirty.clean.get(&block).cloned(),
        }
    }

    /// Takes a logged group's newest images, `version` its last member's.
    pub(crate) fn hand_over(&self, version: u64, images: BTreeMap<u64, Bytes>) {
        let mut dirty = self.dirty.lock().unwrap();
        assert!(
            version > dirty.logged,
            "version {version} handed over after {}",
            dirty.logged
        );
        dirty.logged = version;
        for (block, image) in images {
            assert_eq!(image.len(), BLOCK_BYTES, "whole blocks are applied");
            dirty.clean.remove(&block);
            dirty.blocks.insert(block, (version, image));
        }
        assert!(
            dirty.blocks.len() <= DIRTY_BLOCKS_MAX,
            "{} dirty blocks: a commit did not wait for room",
            dirty.blocks.len()
        );
        drop(dirty);
        self.work.notify_one();
    }

    /// Why the task stopped, if a write in place failed.
    pub(crate) fn failed(&self) -> Option<String> {
        self.dirty.lock().unwrap().failed.clone()
    }

    /// Waits until `blocks` more dirty blocks fit.
    pub(crate) async fn room(&self, blocks: usize) -> Result<(), String> {
        assert!(blocks <= DIRTY_BLOCKS_MAX);
        self.wait_until(|dirty| dirty.blocks.len() + blocks <= DIRTY_BLOCKS_MAX)
            .await
    }

    /// Waits until every version handed over is in place (not yet flushed): the
    /// version up to which it is.
    pub(crate) async fn drain(&self) -> Result<u64, String> {
        self.wait_until(|dirty| dirty.blocks.is_empty()).await?;
        Ok(self.dirty.lock().unwrap().logged)
    }

    /// Stops the task after its round in flight.
    pub(crate) fn close(&self) {
        self.dirty.lock().unwrap().closed = true;
        self.work.notify_one();
    }

    async fn wait_until(&self, done: impl Fn(&Dirty) -> bool) -> Result<(), String> {
        loop {
            let progress = self.progress.notified();
            tokio::pin!(progress);
            // Registered before the check, so a round ending in between still wakes it.
            progress.as_mut().enable();
            {
                let dirty = self.dirty.lock().unwrap();
                if let Some(why) = &dirty.failed {
                    return Err(why.clone());
                }
                if done(&dirty) {
                    return Ok(());
                }
            }
            progress.await;
        }
    }

    async fn run(self: Arc<Self>) {
        loop {
            let round: Vec<(u64, u64, Bytes)> = {
                let mut dirty = self.dirty.lock().unwrap();
                if dirty.closed || dirty.failed.is_some() {
                    return;
                }
                let from = dirty.next;
                let after = dirty.blocks.range(from..);
                let round: Vec<_> = after
                    .chain(dirty.blocks.range(..from))
                    .take(ROUND_BLOCKS_MAX)
                    .map(|(block, (version, image))| (*block, *version, image.clone()))
                    .collect();
                if let Some((last, _, _)) = round.last() {
                    dirty.next = last + 1;
                }
                round
            };
            if round.is_empty() {
                self.work.notified().await;
                continue;
            }
            let writes = round.iter().map(|(block, _, image)| {
                self.device
                    .write(layout::data_offset(*block), image.clone(), false)
            });
            let written = futures::future::join_all(writes).await;
            {
                let mut dirty = self.dirty.lock().unwrap();
                match written.into_iter().find_map(Result::err) {
                    Some(e) => {
                        dirty.failed = Some(format!(
                            "versions up to {} are logged but applying them failed ({e}); \
                             reopening replays them",
                            dirty.logged
                        ));
                    }
                    None => {
                        for (block, version, image) in round {
                            // A later commit wrote it meanwhile: the next round writes that.
                            let newest = dirty.blocks[&block].0;
                            assert!(newest >= version, "block {block} went back a version");
                            if newest == version {
                                dirty.blocks.remove(&block);
                                dirty.keep_clean(block, image);
                            }
                        }
                    }
                }
            }
            self.progress.notify_waiters();
        }
    }
}
