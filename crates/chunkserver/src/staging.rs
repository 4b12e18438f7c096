//! A whole-copy repair lands in a staging chunk first and replaces the replica only
//! once it is complete, so a copy that fails part-way (the source gone, this server
//! killed or its host's power cut) leaves the replica as it was: its version still
//! tells what it holds, and it can still source a view change.
//!
//! The staging chunk of chunk `INDEX` is chunk `INDEX | CHUNK_INDEX_LIMIT` of the
//! same volume (the wire never carries such indexes). It is complete once stamped
//! with a non-zero version; from then on the replacement is finished even across a
//! crash: [`finish_interrupted`] runs before the server serves.

use floe_chunkstore::store::CHUNK_BYTES_MAX;
use floe_chunkstore::{ChunkMeta, Store, StoreError};
use floe_protocol::{ChunkId, CHUNK_INDEX_LIMIT};

/// Bytes per read of the staging chunk.
const PIECE_BYTES: u64 = 1 << 20;

/// The staging chunk of `chunk`.
pub(crate) fn of(chunk: ChunkId) -> ChunkId {
    assert!(
        chunk.index < CHUNK_INDEX_LIMIT,
        "{chunk:?} is a staging chunk already"
    );
    ChunkId {
        index: chunk.index | CHUNK_INDEX_LIMIT,
        ..chunk
    }
}

/// An empty staging chunk for a whole copy of `chunk` in `view`.
pub(crate) async fn begin(store: &Store, chunk: ChunkId, view: u64) -> Result<ChunkId, StoreError> {
    let staging = of(chunk);
    store
        .zero(
            staging,
            0,
            CHUNK_BYTES_MAX,
            true,
            ChunkMeta { view, version: 0 },
        )
        .await?;
    Ok(staging)
}

/// The staging copy holds the chunk at `whole`: it replaces the chunk's replica.
/// Returns the bytes moved. At version 0 the source never took a change, so the
/// staging chunk is empty.
pub(crate) async fn complete(
    store: &Store,
    chunk: ChunkId,
    whole: ChunkMeta,
) -> Result<u64, StoreError> {
    if whole.version == 0 {
        // The source never took a change: the replica is emptied (one record).
        store.zero(chunk, 0, CHUNK_BYTES_MAX, true, whole).await?;
        return Ok(0);
    }
    store.set_meta(of(chunk), whole).await?;
    replace(store, chunk).await
}

/// Finishes the replacements a stop interrupted (a staging chunk stamped complete).
pub async fn finish_interrupted(store: &Store) -> Result<(), StoreError> {
    for staging in store.chunks() {
        if staging.index < CHUNK_INDEX_LIMIT || store.meta(staging).version == 0 {
            continue;
        }
        let chunk = ChunkId {
            index: staging.index & !CHUNK_INDEX_LIMIT,
            ..staging
        };
        let bytes = replace(store, chunk).await?;
        tracing::info!(
            ?chunk,
            bytes,
            "finished a whole-copy repair a stop interrupted"
        );
    }
    Ok(())
}

/// Makes the replica of `chunk` what its complete staging chunk holds, then empties
/// the staging chunk. Until the last stamp the replica claims version 0 (holding
/// less than before), so a failure part-way never has it claim more than it holds;
/// run again, it ends the same.
async fn replace(store: &Store, chunk: ChunkId) -> Result<u64, StoreError> {
    let staging = of(chunk);
    let whole = store.meta(staging);
    assert!(
        whole.version > 0,
        "{chunk:?}: its staging copy is incomplete"
    );
    let emptied = ChunkMeta {
        view: whole.view,
        version: 0,
    };
    store.zero(chunk, 0, CHUNK_BYTES_MAX, true, emptied).await?;
    let mut bytes = 0;
    for (offset, length) in store.extents(staging)? {
        let end = offset + length;
        let mut at = offset;
        while at < end {
            let n = (end - at).min(PIECE_BYTES);
            let data = store.read(staging, at, n as u32).await?;
            store.write(chunk, at, data, emptied).await?;
            at += n;
            bytes += n;
        }
    }
    store.set_meta(chunk, whole).await?;
    store
        .zero(staging, 0, CHUNK_BYTES_MAX, true, ChunkMeta::default())
        .await?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    const CHUNK: ChunkId = ChunkId {
        volume_id: 7,
        index: 3,
    };

    async fn read(store: &Store, chunk: ChunkId) -> Vec<u8> {
        store.read(chunk, 0, 3 << 20).await.unwrap().to_vec()
    }

    #[tokio::test]
    async fn an_incomplete_copy_leaves_the_replica_and_a_complete_one_replaces_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let old = ChunkMeta {
            view: 1,
            version: 5,
        };
        store
            .write(CHUNK, 1 << 20, Bytes::from(vec![1u8; 4096]), old)
            .await
            .unwrap();
        let before = read(&store, CHUNK).await;

        // A copy that stops part-way: the replica holds and claims what it did.
        let staging = begin(&store, CHUNK, 2).await.unwrap();
        let empty = ChunkMeta {
            view: 2,
            version: 0,
        };
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
        let staging = begin(&store, CHUNK, 2).await.unwrap();
        store.write(staging, 4096, data, empty).await.unwrap();
        let whole = ChunkMeta {
            view: 2,
            version: 9,
        };
        assert_eq!(complete(&store, CHUNK, whole).await.unwrap(), 8192);
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
        let diverged = ChunkMeta {
            view: 1,
            version: 5,
        };
        store
            .write(CHUNK, 0, Bytes::from(vec![1u8; 4096]), diverged)
            .await
            .unwrap();
        begin(&store, CHUNK, 2).await.unwrap();
        let empty = ChunkMeta {
            view: 2,
            version: 0,
        };
        assert_eq!(complete(&store, CHUNK, empty).await.unwrap(), 0);
        assert_eq!(store.meta(CHUNK), empty);
        assert!(store.extents(CHUNK).unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_complete_copy_a_stop_interrupted_replaces_the_replica_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let old = ChunkMeta {
            view: 1,
            version: 5,
        };
        store
            .write(CHUNK, 0, Bytes::from(vec![1u8; 4096]), old)
            .await
            .unwrap();
        let staging = begin(&store, CHUNK, 2).await.unwrap();
        let whole = ChunkMeta {
            view: 2,
            version: 9,
        };
        store
            .write(staging, 8192, Bytes::from(vec![3u8; 4096]), whole)
            .await
            .unwrap();
        // Stamped complete, then stopped before the replacement ran.
        finish_interrupted(&store).await.unwrap();
        assert_eq!(store.meta(CHUNK), whole);
        let mut expected = vec![0u8; 3 << 20];
        expected[8192..8192 + 4096].fill(3);
        assert!(read(&store, CHUNK).await == expected);
    }
}
