//! One view change, executed: the calls to chunk servers between the decisions of
//! [`super::plan`] (see the steps in the module comment of [`super`]).

use super::peers::Copied;
use super::plan::{self, Reports, Servers};
use crate::state::chunk_op;
use crate::{Failure, Master};
use floe_protocol::{ChunkId, ChunkPlacement, RepairKind, ReplicaRequest, ServerId, Status};

impl Master {
    /// Asks each of `ids` for its (view, version) with `request`, at once.
    async fn reports(
        &self,
        servers: &Servers,
        ids: &[ServerId],
        request: ReplicaRequest,
    ) -> Vec<(ServerId, Option<(u64, u64)>)> {
        let replies = futures::future::join_all(
            ids.iter()
                .map(|id| self.replica_state(&servers[id], request.clone())),
        )
        .await;
        ids.iter()
            .copied()
            .zip(replies.into_iter().map(Result::ok))
            .collect()
    }
}

/// One view change for one chunk.
pub(super) async fn recover(
    master: &Master,
    volume_id: u64,
    index: u64,
    bytes_per_second: u64,
) -> Result<Copied, Failure> {
    let chunk = ChunkId { volume_id, index };
    let (placement, servers, desired) = {
        let state = master.state();
        let placement = state
            .placement(volume_id, index)
            .ok_or((Status::NotFound, "chunk is gone".to_string()))?;
        let desired = state.desired(volume_id, &placement)?;
        (placement, state.servers.clone(), desired)
    };
    let plan = plan::plan(&placement, &servers, desired)?;
    let mut copied = Copied::default();
    let repair = |target: ServerId, source: ServerId, kind: RepairKind| {
        let (target, source) = (&servers[&target], &servers[&source]);
        master.repair_from(chunk, target, source, kind, bytes_per_second)
    };

    // 1. Copy while writes go on, from the most recent good replica.
    let reports: Vec<_> = master
        .reports(
            &servers,
            &plan.voters,
            // Generation 0: the master fences no writer.
            ReplicaRequest::ChunkInfo {
                chunk,
                generation: 0,
            },
        )
        .await;
    let copy = plan::copy_from(&plan, &placement, &reports)?;
    // At once: a chunk with two replicas to copy is below a majority until both end.
    // Each runs to its end even if another fails: a target goes on with a repair whose
    // caller left, and would refuse the next attempt's while it runs. A stale source
    // (no replica good) is not repaired from itself: while it did, it refused to be
    // the others' source, and every attempt failed (simulator seed 455369138).
    let prefetches = plan
        .targets
        .iter()
        .filter(|target| **target != copy.source)
        .map(|target| repair(*target, copy.source, RepairKind::Prefetch));
    let prefetched: Result<Vec<_>, _> = futures::future::join_all(prefetches)
        .await
        .into_iter()
        .collect();
    for prefetched in prefetched? {
        // An incremental catch-up waits for step 3; it is counted there.
        if !prefetched.incremental {
            copied.add(&prefetched);
        }
    }

    // 2. Freeze in the next view and find the chunk's state from a majority.
    let view = copy.view;
    let frozen: &Reports = &master
        .reports(
            &servers,
            &plan.members(),
            ReplicaRequest::SetView { chunk, view },
        )
        .await;
    let switch = plan::switch(&plan, view, frozen)?;

    // 3. Everyone in the new set catches up to the highest version.
    for id in &switch.catch_up {
        let repaired = match repair(*id, switch.source, RepairKind::CatchUp).await {
            Ok(repaired) => repaired,
            Err(e) => {
                // It may hold part of what it was to copy: it must not count as
                // current (nor, alone, set a later view's version).
                master.report_laggard(volume_id, index, *id, None).await?;
                return Err(e);
            }
        };
        copied.add(&repaired);
        let reached = repaired.version;
        if reached != switch.version {
            return Err((
                Status::Io,
                format!(
                    "server {id} reached {reached:#x}, not {:#x}",
                    switch.version
                ),
            ));
        }
    }

    // 4. Store the new replica set and view.
    let next = ChunkPlacement {
        replicas: plan.new_set.clone(),
        view,
        stale: Vec::new(),
        ..placement.clone()
    };
    master
        .change(
            |state| {
                let current = state
                    .placement(volume_id, index)
                    .ok_or((Status::NotFound, "chunk is gone".to_string()))?;
                // Another view change (or a map move) got there first: this one's
                // view is no longer the next.
                if (&current.replicas, current.view) != (&placement.replicas, placement.view) {
                    return Err((Status::Unavailable, "placement changed meanwhile".into()));
                }
                Ok((vec![chunk_op(volume_id, &next)], next))
            },
            |state, next| state.insert_placement(volume_id, next),
        )
        .await?;
    tracing::info!(
        volume_id,
        index,
        view,
        version = switch.version,
        from = ?placement.replicas,
        to = ?plan.new_set,
        "chunk has all its replicas where the map places them"
    );

    // 5. The replicas left out free their data.
    for left in &plan.left_out {
        let request = ReplicaRequest::DropChunk { chunk, view };
        if let Err(e) = master.ask(&servers[left].address, request).await {
            tracing::warn!(
                volume_id,
                index,
                server = left,
                "replica left out not freed: {e}"
            );
        }
    }
    Ok(copied)
}
