//! The master tells chunk servers, with each heartbeat acknowledgment, which
//! snapshots each volume has, so they free the blocks they retained for none.

mod common;

use common::{call, master_with_a_volume};
use floe_protocol::{MasterRequest, MasterResponse, Response, SnapshotReaders};
use std::sync::Arc;

async fn readers(master: &Arc<floe_master::Master>) -> Vec<SnapshotReaders> {
    let beat = MasterRequest::Heartbeat {
        id: 1,
        used_bytes: 0,
        journal_used_bytes: 0,
        journal_quota_bytes: 0,
        corrupt_blocks: Vec::new(),
        fs: None,
    };
    match call(master, beat).await {
        Response::Master(MasterResponse::HeartbeatAck { snapshots, .. }) => snapshots,
        other => panic!("heartbeat answered {other:?}"),
    }
}

async fn snapshot(master: &Arc<floe_master::Master>, create: bool, snapshot: &str) {
    let (name, snapshot) = ("demo".to_string(), snapshot.to_string());
    let request = match create {
        true => MasterRequest::CreateSnapshot { name, snapshot },
        false => MasterRequest::DeleteSnapshot { name, snapshot },
    };
    let reply = call(master, request).await;
    assert!(matches!(reply, Response::Master(_)), "{reply:?}");
}

#[tokio::test]
async fn heartbeats_carry_each_volumes_snapshots_once_it_had_one() {
    let master = master_with_a_volume(1).await;
    // A volume that never had a snapshot retained nothing: not listed.
    assert_eq!(readers(&master).await, vec![]);
    snapshot(&master, true, "a").await;
    snapshot(&master, true, "b").await;
    let listed = readers(&master).await;
    let demo = |epoch, snapshots| SnapshotReaders {
        volume_id: listed[0].volume_id,
        epoch,
        snapshots,
    };
    assert_eq!(listed, vec![demo(2, vec![1, 2])]);
    snapshot(&master, false, "a").await;
    assert_eq!(readers(&master).await, vec![demo(2, vec![2])]);
    snapshot(&master, false, "b").await;
    // Every snapshot gone: what was retained for epochs up to 2 is unread.
    assert_eq!(readers(&master).await, vec![demo(2, vec![])]);
}
