//! A restart after kill -9, then a power cut: what the killed process wrote but never
//! synced (file data and directory entries alike) sits in the page cache, and the
//! restarted store must make it durable before its first checkpoint forgets the log.

use bytes::Bytes;
use floe_chunkstore::{ChunkMeta, Options, SimDisk, Store, Tuning};
use floe_protocol::ChunkId;
use std::path::Path;

const CHUNK: ChunkId = ChunkId {
    volume_id: 1,
    index: 0,
};

fn open(disk: &SimDisk) -> Store {
    Store::open_on(
        disk.mount(),
        Path::new("/data"),
        &Options::default(),
        &Tuning::default(),
    )
    .expect("the store opens")
}

#[tokio::test]
async fn a_restart_makes_its_killed_predecessors_files_durable() {
    let meta = ChunkMeta {
        view: 1,
        version: 7,
    };
    for seed in 0..64 {
        let disk = SimDisk::new();
        let store = open(&disk);
        // A new chunk file: its directory entries are not synced at commit.
        store
            .write(CHUNK, 4096, Bytes::from(vec![0xab; 4096]), meta)
            .await
            .expect("acknowledged");
        disk.crash();
        drop(open(&disk));
        disk.power_cut(seed);
        let store = open(&disk);
        assert_eq!(store.meta(CHUNK), meta, "seed {seed}");
        let data = store.read(CHUNK, 4096, 4096).await.expect("readable");
        assert!(
            data.iter().all(|&b| b == 0xab),
            "seed {seed}: the acknowledged write is gone after a restart and a power cut"
        );
    }
}
