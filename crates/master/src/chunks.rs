//! Chunk placements as writers change them: allocation on a chunk's first write, and
//! replicas a writer reports lagging (marked stale until a view change repairs them,
//! see [`crate::recovery`]).

use crate::state::chunk_op;
use crate::Reply;
use crate::{Master, State};
use floe_protocol::snapshot::split_index;
use floe_protocol::{ChunkPlacement, MasterResponse, Proposal, ServerId, Status};

impl Master {
    pub(crate) async fn allocate_chunk(
        &self,
        volume_id: u64,
        index: u64,
        proposal: Option<Proposal>,
        epoch: u32,
        generation: u32,
    ) -> Reply {
        // The first chunk of a cluster puts every registered server into the map.
        if self.state().map.map.epoch == 0 {
            self.bootstrap_map().await?;
        }
        let placement = self
            .change(
                |state| {
                    let Some(volume) = state.volumes.values().find(|v| v.id == volume_id) else {
                        return Err((
                            Status::NotFound,
                            format!("volume id {volume_id} does not exist"),
                        ));
                    };
                    fence(state, volume_id, generation, "allocates no chunk")?;
                    let (delta_of, live) = split_index(index);
                    if live >= volume.spec.chunk_count() {
                        return Err((
                            Status::BadRequest,
                            format!(
                                "chunk {live} is past the end of volume {}",
                                volume.spec.name
                            ),
                        ));
                    }
                    if delta_of.max(epoch) > volume.snapshot_epoch {
                        return Err((
                            Status::BadRequest,
                            format!(
                                "snapshot epoch {} of volume {} was never handed out",
                                delta_of.max(epoch),
                                volume.spec.name
                            ),
                        ));
                    }
                    // Allocation is idempotent: writers race for a chunk's first write.
                    if let Some(placement) = state.placement(volume_id, index) {
                        return Ok((Vec::new(), (placement, false)));
                    }
                    let layer = state.map.placer.newest_layer().ok_or((
                        Status::NoSpace,
                        "every layer of the cluster map was shrunk away".to_string(),
                    ))?;
                    let mut placement = ChunkPlacement {
                        index,
                        replicas: Vec::new(),
                        view: 0,
                        stale: Vec::new(),
                        layer,
                        // The newest epoch, not the writer's: a writer still on an
                        // older one (deposed, its request late, or not yet switched)
                        // writes nothing any snapshot taken before now must keep.
                        born: volume.snapshot_epoch,
                    };
                    placement.replicas = state.desired(volume_id, &placement)?;
                    // A writer on the same epoch computes the same; one that differs
                    // holds an older map (or saw other servers down) and refreshes it.
                    if let Some(p) = proposal.filter(|p| p.epoch == state.map.map.epoch) {
                        if (p.layer, &p.replicas) != (layer, &placement.replicas) {
                            tracing::debug!(
                                volume_id,
                                index,
                                ?p,
                                ?placement,
                                "writer placed the chunk differently"
                            );
                        }
                    }
                    Ok((vec![chunk_op(volume_id, &placement)], (placement, true)))
                },
                |state, (placement, new)| {
                    if new {
                        state.insert_placement(volume_id, placement.clone());
                    }
                    placement
                },
            )
            .await?;
        Ok(MasterResponse::Chunk {
            servers: self.state().servers_of(&placement),
            placement,
        })
    }

    /// Marks `server`'s replica of a chunk stale. `writer`: the lease generation of
    /// the writer that reports it, fenced if deposed; `None` when the master decides.
    pub(crate) async fn report_laggard(
        &self,
        volume_id: u64,
        index: u64,
        server: ServerId,
        writer: Option<u32>,
    ) -> Reply {
        let placement = self
            .change(
                |state| {
                    if let Some(generation) = writer {
                        fence(state, volume_id, generation, "marks no replica stale")?;
                    }
                    let Some(mut placement) = state.placement(volume_id, index) else {
                        return Err((
                            Status::NotFound,
                            format!("chunk {volume_id}/{index} is not allocated"),
                        ));
                    };
                    if !placement.replicas.contains(&server) || placement.stale.contains(&server) {
                        return Ok((Vec::new(), None));
                    }
                    // A change a writer committed is on a good replica besides this
                    // one; a report that would leave none (on a server not lost) is
                    // about a view change that failed part-way, and that replica is
                    // the one the next view change must copy from.
                    let last_good = !placement.replicas.iter().any(|id| {
                        *id != server
                            && !placement.stale.contains(id)
                            && state.servers.get(id).is_some_and(|s| !s.lost)
                    });
                    if writer.is_some() && last_good {
                        tracing::warn!(
                            volume_id,
                            index,
                            server,
                            "replica reported lagging, but it is the last good one: kept"
                        );
                        return Ok((Vec::new(), None));
                    }
                    placement.stale.push(server);
                    Ok((vec![chunk_op(volume_id, &placement)], Some(placement)))
                },
                |state, marked| {
                    if let Some(placement) = marked {
                        tracing::warn!(
                            volume_id,
                            index,
                            server,
                            "replica reported lagging: marked stale"
                        );
                        state.insert_placement(volume_id, placement);
                    }
                    state.placement(volume_id, index).expect("checked above")
                },
            )
            .await?;
        Ok(MasterResponse::Chunk {
            servers: self.state().servers_of(&placement),
            placement,
        })
    }
}

/// Refuses a writer whose lease `generation` of volume `volume_id` is no longer the
/// current one: it `does` nothing more.
fn fence(
    state: &State,
    volume_id: u64,
    generation: u32,
    does: &str,
) -> Result<(), (Status, String)> {
    match state.leases.get(&volume_id) {
        Some(lease) if lease.generation != generation || lease.revoked => {
            let name = state
                .volumes
                .values()
                .find(|v| v.id == volume_id)
                .map_or("?", |v| v.spec.name.as_str());
            Err((
                Status::Fenced,
                format!(
                    "the lease of volume {name} (generation {generation}) was lost: \
                     its writer {does}"
                ),
            ))
        }
        _ => Ok(()),
    }
}
