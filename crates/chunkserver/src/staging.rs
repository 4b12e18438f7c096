//! A repair copies into a staging chunk first and changes the replica only once the
//! copy is complete, so a copy that fails part-way (the source gone, this server
//! killed or its host's power cut) leaves the replica as it was: its version still
//! tells what it holds, and it can still source a view change.
//!
//! A whole copy's staging chunk replaces the replica; an incremental or compared
//! copy's is laid over it (its extents are exactly the ranges copied:
//! [`ALIGN_BYTES`]). The staging chunk holds the source's retained blocks too
//! (`floe_chunkstore::retained`): they replace the replica's, or for an incremental
//! copy join those it kept. The staging chunks of chunk `INDEX` are chunks
//! `INDEX | 2^62` (whole), `INDEX | 2^63` (overlay) and `INDEX | 2^62 | 2^63`
//! (compared) of the same volume (the wire never carries indexes from
//! `CHUNK_INDEX_LIMIT` = 2^62 up). One is complete once stamped with a version above
//! 0; from then on the change to the replica is finished even across a crash:
//! [`finish_interrupted`] runs before the server serves.

use floe_chunkstore::block_sums::BLOCK_BYTES;
use floe_chunkstore::space::Room;
use floe_chunkstore::store::CHUNK_BYTES_MAX;
use floe_chunkstore::{ChunkMeta, Durability, Store, StoreError};
use floe_protocol::{ChunkId, CHUNK_INDEX_LIMIT};
use std::ops::RangeInclusive;

/// Bytes per read of the staging chunk.
const PIECE_BYTES: u64 = 1 << 20;
/// Mark the staging chunks of a whole copy and of an overlay.
const WHOLE_BIT: u64 = CHUNK_INDEX_LIMIT;
const OVERLAY_BIT: u64 = CHUNK_INDEX_LIMIT << 1;
/// Copies into an overlay cover whole blocks of this size, so the staging chunk's
/// extents (block-granular in file systems) are exactly what was copied.
pub(crate) const ALIGN_BYTES: u64 = 4096;
/// Every snapshot epoch a replica may retain blocks for.
const EVERY_EPOCH: RangeInclusive<u32> = 0..=u32::MAX;

/// What a complete staging chunk does to the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Staged {
    /// Replaces it: holes and retained blocks included, the staging chunk is the
    /// whole replica.
    Whole,
    /// Is laid over it: ranges changed since the replica's version, and the blocks
    /// retained since (the repair dropped the replica's own above its version).
    Overlay,
    /// Is laid over it, its retained blocks replacing the replica's: the blocks that
    /// differ from a source whose log does not reach back, and all it retains.
    Compared,
}

impl Staged {
    /// Whether the replica's retained blocks give way to the staging chunk's.
    fn replaces_retained(self) -> bool {
        self != Staged::Overlay
    }
}

/// The staging chunk of `chunk` for `kind`.
pub(crate) fn of(chunk: ChunkId, kind: Staged) -> ChunkId {
    assert!(
        chunk.index < CHUNK_INDEX_LIMIT,
        "{chunk:?} is a staging chunk already"
    );
    let bits = match kind {
        Staged::Whole => WHOLE_BIT,
        Staged::Overlay => OVERLAY_BIT,
        Staged::Compared => WHOLE_BIT | OVERLAY_BIT,
    };
    ChunkId {
        index: chunk.index | bits,
        ..chunk
    }
}

/// An empty staging chunk for a copy of `chunk` in `view`.
pub(crate) async fn begin(
    store: &Store,
    chunk: ChunkId,
    kind: Staged,
    view: u64,
) -> Result<ChunkId, StoreError> {
    let staging = of(chunk, kind);
    store
        .zero(
            staging,
            0,
            CHUNK_BYTES_MAX,
            true,
            ChunkMeta { view, version: 0 },
        )
        .await?;
    // Left by a copy that failed part-way.
    store.release_retained(staging, EVERY_EPOCH).await?;
    Ok(staging)
}

/// The staging copy holds the chunk at `whole` (what the source held): it replaces
/// the replica or is laid over it. Returns the bytes moved. A whole copy at version
/// 0 is of a source that never took a change: the replica is emptied, of retained
/// blocks too.
pub(crate) async fn complete(
    store: &Store,
    chunk: ChunkId,
    kind: Staged,
    whole: ChunkMeta,
) -> Result<u64, StoreError> {
    if whole.version == 0 {
        assert_eq!(kind, Staged::Whole, "{chunk:?}: an overlay up to version 0");
        store.release_retained(chunk, EVERY_EPOCH).await?;
        store.zero(chunk, 0, CHUNK_BYTES_MAX, true, whole).await?;
        return Ok(0);
    }
    store.set_meta(of(chunk, kind), whole).await?;
    apply(store, chunk, kind).await
}

/// Finishes the changes to replicas a stop interrupted (a staging chunk stamped
/// complete).
pub async fn finish_interrupted(store: &Store) -> Result<(), StoreError> {
    for staging in store.chunks() {
        if staging.index < CHUNK_INDEX_LIMIT || store.meta(staging).version == 0 {
            continue;
        }
        let kind = match (staging.index & WHOLE_BIT, staging.index & OVERLAY_BIT) {
            (_, 0) => Staged::Whole,
            (0, _) => Staged::Overlay,
            _ => Staged::Compared,
        };
        let chunk = ChunkId {
            index: staging.index & (CHUNK_INDEX_LIMIT - 1),
            ..staging
        };
        match apply(store, chunk, kind).await {
            Ok(bytes) => {
                tracing::info!(?chunk, ?kind, bytes, "finished a repair a stop interrupted")
            }
            // The replica claims version 0 until it is applied: the master repairs it
            // anew, and the server serves its other replicas meanwhile.
            Err(e @ StoreError::NoSpace(_)) => {
                tracing::error!(
                    ?chunk,
                    ?kind,
                    "cannot finish a repair a stop interrupted: {e}"
                )
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Replaces the replica of `chunk` with, or lays over it, its complete staging chunk,
/// retained blocks included, then empties the staging chunk. Until the last stamp the
/// replica claims version 0 (it holds neither its old state nor the new one), so a
/// failure part-way never has it claim more than it holds; run again, it ends the
/// same (the staging chunk's retained blocks go only after that stamp).
async fn apply(store: &Store, chunk: ChunkId, kind: Staged) -> Result<u64, StoreError> {
    let staging = of(chunk, kind);
    let whole = store.meta(staging);
    assert!(
        whole.version > 0,
        "{chunk:?}: its staging copy is incomplete"
    );
    let unknown = ChunkMeta {
        view: whole.view,
        version: 0,
    };
    if kind.replaces_retained() {
        store.release_retained(chunk, EVERY_EPOCH).await?;
    }
    match kind {
        Staged::Whole => store.zero(chunk, 0, CHUNK_BYTES_MAX, true, unknown).await?,
        Staged::Overlay | Staged::Compared => store.set_meta(chunk, unknown).await?,
    }
    let mut bytes = 0;
    for (offset, length) in store.extents(staging)? {
        let end = offset + length;
        let mut at = offset;
        while at < end {
            let n = (end - at).min(PIECE_BYTES);
            let data = store.read(staging, at, n as u32).await?;
            // Moving data already on this disk (the staging chunk is emptied after):
            // it may use the room kept for catching up.
            let reservation = store.reserve_write(at, n, Room::CatchUp)?;
            // A move of the replica's bytes: it retains nothing.
            let durability = Durability::Synced;
            store
                .write_reserved(reservation, chunk, at, data, unknown, durability, None)
                .await?;
            at += n;
            bytes += n;
        }
    }
    for entry in store.retained(staging) {
        // Listed, so held: only this apply drops the staging chunk's.
        let block = store
            .read_retained(staging, entry.epoch, entry.offset)
            .await?
            .expect("a listed retained block is held");
        store.install_retained(chunk, entry, block).await?;
        bytes += BLOCK_BYTES;
    }
    store.set_meta(chunk, whole).await?;
    store
        .zero(staging, 0, CHUNK_BYTES_MAX, true, ChunkMeta::default())
        .await?;
    store.release_retained(staging, EVERY_EPOCH).await?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use floe_chunkstore::{RetainedBlock, RetainedEntry};

    const CHUNK: ChunkId = ChunkId {
        volume_id: 7,
        index: 3,
    };

    fn meta(view: u64, version: u64) -> ChunkMeta {
        ChunkMeta { view, version }
    }

    /// Writes `length` bytes of `byte` at `offset`, leaving the chunk at `meta`.
    async fn fill(
        store: &Store,
        chunk: ChunkId,
        offset: u64,
        byte: u8,
        length: usize,
        meta: ChunkMeta,
    ) {
        let data = Bytes::from(vec![byte; length]);
        store.write(chunk, offset, data, meta).await.unwrap();
    }

    async fn read(store: &Store, chunk: ChunkId) -> Vec<u8> {
        store.read(chunk, 0, 3 << 20).await.unwrap().to_vec()
    }

    #[tokio::test]
    async fn an_incomplete_copy_leaves_the_replica_and_a_complete_one_replaces_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let old = meta(1, 5);
        fill(&store, CHUNK, 1 << 20, 1u8, 4096, old).await;
        let before = read(&store, CHUNK).await;

        // A copy that stops part-way: the replica holds and claims what it did.
        let staging = begin(&store, CHUNK, Staged::Whole, 2).await.unwrap();
        let empty = meta(2, 0);
        let data = Bytes::from(vec![2u8; 8192]);
        store
            .write(staging, 4096, data.clone(), empty)
            .await
            .unwrap();
        assert_eq!(store.meta(CHUNK), old);
        assert_eq!(read(&store, CHUNK).await, before);
        finish_interrupted(&store).await.unwrap();
        assert_eq!(store.meta(CHUNK), old, "an incomplete copy was adopted");

        // Done again and completed: the replica is the copy, holes included.
        let staging = begin(&store, CHUNK, Staged::Whole, 2).await.unwrap();
        store.write(staging, 4096, data, empty).await.unwrap();
        let whole = meta(2, 9);
        assert_eq!(
            complete(&store, CHUNK, Staged::Whole, whole).await.unwrap(),
            8192
        );
        assert_eq!(store.meta(CHUNK), whole);
        let mut expected = vec![0u8; 3 << 20];
        expected[4096..4096 + 8192].fill(2);
        assert!(read(&store, CHUNK).await == expected);
        assert_eq!(store.meta(staging).version, 0);
        assert!(store.extents(staging).unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_copy_of_a_source_that_never_took_a_change_empties_the_replica() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let diverged = meta(1, 5);
        fill(&store, CHUNK, 0, 1u8, 4096, diverged).await;
        begin(&store, CHUNK, Staged::Whole, 2).await.unwrap();
        let empty = meta(2, 0);
        assert_eq!(
            complete(&store, CHUNK, Staged::Whole, empty).await.unwrap(),
            0
        );
        assert_eq!(store.meta(CHUNK), empty);
        assert!(store.extents(CHUNK).unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_overlay_changes_only_the_ranges_it_holds_and_only_once_complete() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let old = meta(1, 5);
        fill(&store, CHUNK, 0, 1u8, 16384, old).await;
        let staging = begin(&store, CHUNK, Staged::Overlay, 2).await.unwrap();
        let copying = meta(2, 0);
        fill(&store, staging, 4096, 2u8, 4096, copying).await;
        finish_interrupted(&store).await.unwrap();
        assert_eq!(store.meta(CHUNK), old, "an incomplete overlay was laid");
        let new = meta(2, 7);
        assert_eq!(
            complete(&store, CHUNK, Staged::Overlay, new).await.unwrap(),
            4096
        );
        assert_eq!(store.meta(CHUNK), new);
        let mut expected = vec![0u8; 3 << 20];
        expected[..16384].fill(1);
        expected[4096..8192].fill(2);
        assert!(read(&store, CHUNK).await == expected);
    }

    fn retained(epoch: u32, block: u64, tag: u64) -> RetainedEntry {
        RetainedEntry {
            epoch,
            offset: block * BLOCK_BYTES,
            tag,
            zeroes: false,
        }
    }

    /// Keeps `entry` in `chunk`, a block of `byte`.
    async fn keep(store: &Store, chunk: ChunkId, entry: RetainedEntry, byte: u8) {
        let block = RetainedBlock::Data(Bytes::from(vec![byte; BLOCK_BYTES as usize]));
        store.install_retained(chunk, entry, block).await.unwrap();
    }

    #[tokio::test]
    async fn a_copy_brings_its_retained_blocks_even_across_a_stop_part_way() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        fill(&store, CHUNK, 0, 1u8, 4096, meta(1, 5)).await;
        let (own, other) = (retained(1, 0, 3), retained(2, 1, 4));
        keep(&store, CHUNK, own, 7).await;
        keep(&store, CHUNK, other, 7).await;
        // A failed copy's leftovers go when the next one begins.
        let staging = begin(&store, CHUNK, Staged::Overlay, 2).await.unwrap();
        keep(&store, staging, retained(9, 9, 9), 9).await;
        begin(&store, CHUNK, Staged::Overlay, 2).await.unwrap();
        assert_eq!(store.retained(staging), vec![]);
        // An overlay adds the source's retained blocks to the replica's.
        let theirs = retained(3, 2, 7);
        keep(&store, staging, theirs, 8).await;
        complete(&store, CHUNK, Staged::Overlay, meta(2, 7))
            .await
            .unwrap();
        assert_eq!(store.retained(CHUNK), vec![own, other, theirs]);
        assert_eq!(store.retained(staging), vec![]);
        // A compared copy replaces them, even stopped once it dropped the replica's.
        let staging = begin(&store, CHUNK, Staged::Compared, 3).await.unwrap();
        keep(&store, staging, own, 6).await;
        store.set_meta(staging, meta(3, 9)).await.unwrap();
        store.release_retained(CHUNK, EVERY_EPOCH).await.unwrap();
        store.set_meta(CHUNK, meta(3, 0)).await.unwrap();
        drop(store);
        let store = Store::open(dir.path()).unwrap();
        finish_interrupted(&store).await.unwrap();
        assert_eq!(store.meta(CHUNK), meta(3, 9));
        assert_eq!(store.retained(CHUNK), vec![own]);
        let block = store.read_retained(CHUNK, 1, 0).await.unwrap();
        assert_eq!(
            block,
            Some(RetainedBlock::Data(Bytes::from(vec![6u8; 4096])))
        );
        assert_eq!(store.retained(staging), vec![]);
        // A whole copy of a source that never took a change leaves none.
        begin(&store, CHUNK, Staged::Whole, 4).await.unwrap();
        complete(&store, CHUNK, Staged::Whole, meta(4, 0))
            .await
            .unwrap();
        assert_eq!(store.retained(CHUNK), vec![]);
    }

    #[tokio::test]
    async fn a_complete_copy_a_stop_interrupted_replaces_the_replica_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let old = meta(1, 5);
        fill(&store, CHUNK, 0, 1u8, 4096, old).await;
        let staging = begin(&store, CHUNK, Staged::Whole, 2).await.unwrap();
        let whole = meta(2, 9);
        fill(&store, staging, 8192, 3u8, 4096, whole).await;
        // Stamped complete, then stopped before the replacement ran.
        finish_interrupted(&store).await.unwrap();
        assert_eq!(store.meta(CHUNK), whole);
        let mut expected = vec![0u8; 3 << 20];
        expected[8192..8192 + 4096].fill(3);
        assert!(read(&store, CHUNK).await == expected);
    }
}
