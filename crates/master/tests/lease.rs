//! The master's side of the single-writer lease: a lapsed lease goes to another
//! gateway only once the holder's own timing of it has certainly ended.

use floe_master::{Master, Settings, LEASE_DRIFT_MARGIN, LEASE_TERM};
use floe_metadata::memory::MemoryStore;
use floe_protocol::server::Handler;
use floe_protocol::{
    ConnectionPool, DeviceClass, MasterRequest, MasterResponse, Registration, Request, Response,
    Status, VolumeMode, VolumeSpec,
};
use std::sync::Arc;

async fn call(master: &Arc<Master>, request: MasterRequest) -> Response {
    master.clone().handle(Request::Master(request)).await
}

fn acquire(holder: &str) -> MasterRequest {
    MasterRequest::AcquireLease {
        name: "demo".into(),
        holder: holder.into(),
        attempt: 0,
    }
}

/// A master with one server and volume `demo` (one replica).
async fn master_with_a_volume() -> Arc<Master> {
    let master = Arc::new(
        Master::load(
            Box::new(MemoryStore::default()),
            Settings::default(),
            ConnectionPool::default(),
        )
        .await
        .unwrap(),
    );
    let register = MasterRequest::Register(Registration {
        uuid: "a".into(),
        address: "127.0.0.1:1".into(),
        host: "host-a".into(),
        class: DeviceClass::Ssd,
        emulated: false,
        capacity_bytes: 1 << 30,
    });
    call(&master, register).await;
    let spec = VolumeSpec {
        name: "demo".into(),
        size_bytes: 1 << 30,
        replicas: 1,
        chunk_bytes: 64 << 20,
        stripe_unit_bytes: 64 << 10,
        stripe_count: 1,
        mode: VolumeMode::Ssd,
        write_mode: Default::default(),
    };
    let created = call(&master, MasterRequest::CreateVolume(spec)).await;
    assert!(matches!(created, Response::Master(_)), "{created:?}");
    master
}

#[tokio::test(start_paused = true)]
async fn a_lapsed_lease_moves_only_after_the_drift_margin() {
    let master = master_with_a_volume().await;
    let first = call(&master, acquire("gateway a")).await;
    assert!(
        matches!(first, Response::Master(MasterResponse::Lease { .. })),
        "{first:?}"
    );

    // The term has run out here, but not the margin: the holder may still be writing.
    tokio::time::advance(LEASE_TERM + LEASE_DRIFT_MARGIN / 2).await;
    let early = call(&master, acquire("gateway b")).await;
    assert!(
        matches!(
            early,
            Response::Error {
                status: Status::Busy,
                ..
            }
        ),
        "granted within the drift margin: {early:?}"
    );

    tokio::time::advance(LEASE_DRIFT_MARGIN).await;
    let granted = call(&master, acquire("gateway b")).await;
    assert!(
        matches!(
            granted,
            Response::Master(MasterResponse::Lease { generation: 2, .. })
        ),
        "{granted:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_deposed_writer_cannot_mark_a_replica_stale() {
    let master = master_with_a_volume().await;
    call(&master, acquire("gateway a")).await;
    // The master's first volume; gateway a's lease is generation 1.
    let volume_id = 1;
    let allocate = MasterRequest::AllocateChunk {
        volume_id,
        index: 0,
        proposal: None,
        epoch: 0,
        generation: 1,
    };
    let allocated = call(&master, allocate).await;
    let Response::Master(MasterResponse::Chunk { placement, .. }) = allocated else {
        panic!("{allocated:?}");
    };
    tokio::time::advance(LEASE_TERM + LEASE_DRIFT_MARGIN * 2).await;
    let granted = call(&master, acquire("gateway b")).await;
    assert!(
        matches!(
            granted,
            Response::Master(MasterResponse::Lease { generation: 2, .. })
        ),
        "{granted:?}"
    );
    let report = |generation| MasterRequest::ReportLaggard {
        volume_id,
        index: 0,
        server: placement.replicas[0],
        generation,
    };
    let deposed = call(&master, report(1)).await;
    assert!(
        matches!(
            deposed,
            Response::Error {
                status: Status::Fenced,
                ..
            }
        ),
        "{deposed:?}"
    );
    let current = call(&master, report(2)).await;
    let Response::Master(MasterResponse::Chunk { placement, .. }) = current else {
        panic!("{current:?}");
    };
    assert_eq!(
        placement.stale, placement.replicas,
        "the holder's report counts"
    );
}
