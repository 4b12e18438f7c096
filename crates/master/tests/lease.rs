//! The master's side of the single-writer lease: a lapsed lease goes to another
//! gateway only once the holder's own timing of it has certainly ended.

mod common;

use common::{call, master_with_a_volume};
use floe_master::{LEASE_DRIFT_MARGIN, LEASE_TERM};
use floe_protocol::{MasterRequest, MasterResponse, Response, Status};

fn acquire(holder: &str) -> MasterRequest {
    MasterRequest::AcquireLease {
        name: "demo".into(),
        holder: holder.into(),
        attempt: 0,
    }
}

#[tokio::test(start_paused = true)]
async fn a_lapsed_lease_moves_only_after_the_drift_margin() {
    let master = master_with_a_volume(1).await;
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
    let master = master_with_a_volume(2).await;
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
    let report = |server, generation| MasterRequest::ReportLaggard {
        volume_id,
        index: 0,
        server,
        generation,
    };
    let (first, second) = (placement.replicas[0], placement.replicas[1]);
    let deposed = call(&master, report(first, 1)).await;
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
    let stale = |reply: Response| match reply {
        Response::Master(MasterResponse::Chunk { placement, .. }) => placement.stale,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        stale(call(&master, report(first, 2)).await),
        [first],
        "the holder's report counts"
    );
    // A change the holder committed is on a good replica: a report that would leave
    // none is about a view change that failed part-way, and is not taken.
    assert_eq!(
        stale(call(&master, report(second, 2)).await),
        [first],
        "the last good replica stays good"
    );
}
