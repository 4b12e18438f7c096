//! Early writeback (plain mode): every [`KICK_BYTES`] of log, a thread of the store
//! asks the kernel to start writing out the log and the chunk files changed since the
//! last checkpoint, without waiting, a few MiB at a time. A checkpoint's fsyncs,
//! which hold up every request of the store, then find most pages written: under
//! 4 KiB random writes at iodepth 16 on this machine the longest write went from
//! about 1 s to about 0.2 s (docs/ARCHITECTURE.md, "Chunk server storage and crash
//! safety"). On the committer's own thread the kicks cost more than they saved
//! (`sync_file_range` submits the I/O in its caller), and unpaced they doubled the
//! p99 of durable writes (their fdatasyncs queued behind the burst). Durability is
//! unchanged: only the syncs promise anything, and the thread touches no state of
//! the store.

use crate::committer::Committer;
use crate::disk::FileRef;
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::time::Duration;

/// Log bytes between two kicks.
pub(crate) const KICK_BYTES: u64 = 32 << 20;
/// Bytes of a file handed to the kernel at once, and the pause after each.
const RANGE_BYTES: u64 = 8 << 20;
const RANGE_PAUSE: Duration = Duration::from_millis(1);

/// When the next kick is due, and the thread, started at the first kick; it ends
/// when the store does.
pub(crate) struct Writeback {
    next_kick: u64,
    thread: Option<SyncSender<Vec<FileRef>>>,
}

impl Default for Writeback {
    fn default() -> Writeback {
        Writeback {
            next_kick: KICK_BYTES,
            thread: None,
        }
    }
}

impl Writeback {
    /// The log restarted from its header (a checkpoint).
    pub(crate) fn restarted(&mut self) {
        self.next_kick = KICK_BYTES;
    }

    /// Whether the log, now at `position`, is due a kick; if so the next is
    /// [`KICK_BYTES`] further on.
    fn due(&mut self, position: u64) -> bool {
        if position < self.next_kick {
            return false;
        }
        self.next_kick = position + KICK_BYTES;
        true
    }

    /// Hands `files` to the thread; false (dropped) while a kick still waits for it:
    /// the next kick covers the same files again.
    fn kick(&mut self, files: Vec<FileRef>) -> bool {
        let thread = self.thread.get_or_insert_with(|| {
            let (tx, rx) = mpsc::sync_channel::<Vec<FileRef>>(1);
            std::thread::Builder::new()
                .name("floe-writeback".into())
                .spawn(move || {
                    for file in rx.into_iter().flatten() {
                        // Advisory: the checkpoint's fsyncs report real failures.
                        if let Err(e) = file.start_writeback(RANGE_BYTES, RANGE_PAUSE) {
                            tracing::debug!("starting a file's writeback failed: {e}");
                        }
                    }
                })
                .expect("spawning the writeback thread");
            tx
        });
        match thread.try_send(files) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => false,
            Err(TrySendError::Disconnected(_)) => panic!("the writeback thread ended"),
        }
    }
}

impl Committer {
    /// Starts the writeback of the log and the dirty chunk files once the log has
    /// grown by [`KICK_BYTES`] since the last kick (or the checkpoint).
    pub(crate) fn kick_writeback(&mut self) {
        if !self.writeback.due(self.logs[0].position) {
            return;
        }
        // Batches written directly left no dirty pages.
        let mut files: Vec<_> = self.logs[0]
            .take_buffered()
            .then(|| self.logs[0].file.clone())
            .into_iter()
            .collect();
        for chunk in &self.dirty_files {
            match self.files.get(*chunk, false) {
                Ok(Some(file)) => files.push(file.data),
                Ok(None) => {}
                Err(e) => tracing::debug!(?chunk, "no writeback for a chunk file: {e}"),
            }
        }
        self.writeback.kick(files);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::{Disk, RealDisk};
    use std::sync::Arc;

    #[test]
    fn kicks_fall_due_every_kick_bytes_of_log_and_again_after_a_checkpoint() {
        let mut w = Writeback::default();
        assert!(!w.due(KICK_BYTES - 1));
        assert!(w.due(KICK_BYTES + 100));
        assert!(!w.due(2 * KICK_BYTES + 99));
        assert!(w.due(2 * KICK_BYTES + 100));
        w.restarted();
        assert!(!w.due(4096));
        assert!(w.due(KICK_BYTES));
    }

    #[test]
    fn real_files_start_their_writeback_and_the_thread_lets_them_go() {
        let dir = tempfile::tempdir().unwrap();
        let file: FileRef = RealDisk.open(&dir.path().join("f"), true).unwrap();
        file.write_all_at(&vec![7u8; 3 * RANGE_BYTES as usize], 0)
            .unwrap();
        file.start_writeback(RANGE_BYTES, Duration::ZERO).unwrap();
        let mut w = Writeback::default();
        assert!(w.kick(vec![file.clone()]), "the first kick is always taken");
        // The thread holds the file until it has started every range of it.
        let mut waited = 0;
        while Arc::strong_count(&file) > 1 {
            assert!(
                waited < 10_000,
                "the writeback thread never let the file go"
            );
            std::thread::sleep(Duration::from_millis(1));
            waited += 1;
        }
        file.sync_data().unwrap();
        let mut back = vec![0u8; 4096];
        assert_eq!(file.read_at(&mut back, 2 * RANGE_BYTES).unwrap(), 4096);
        assert_eq!(back, vec![7u8; 4096]);
    }
}
