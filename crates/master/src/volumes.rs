//! Volumes: create, list, map, resize, delete (rate limits are in [`crate::qos`]).

use crate::lease::lease_key;
use crate::state::{put, volume_key, State};
use crate::{Failure, Master, Reply};
use floe_metadata::Op;
use floe_protocol::snapshot::Parent;
use floe_protocol::units::human_bytes;
use floe_protocol::{MasterResponse, Status, Volume, VolumeMap, VolumeSpec, WriteMode};

impl Master {
    pub(crate) async fn create_volume(&self, spec: VolumeSpec) -> Reply {
        self.create_volume_of(spec, None).await
    }

    /// A new volume; a clone names the snapshot it reads through to.
    pub(crate) async fn create_volume_of(&self, spec: VolumeSpec, parent: Option<Parent>) -> Reply {
        spec.validate().map_err(|e| (Status::BadRequest, e))?;
        let volume = self
            .change(
                |state| {
                    if state.volumes.contains_key(&spec.name) {
                        return Err((
                            Status::AlreadyExists,
                            format!("volume {} already exists", spec.name),
                        ));
                    }
                    let hosts = state.live_hosts();
                    if hosts < spec.replicas as usize {
                        return Err((
                            Status::NoSpace,
                            format!(
                                "{} replicas need {} hosts with live chunk servers; {hosts} are up",
                                spec.replicas, spec.replicas
                            ),
                        ));
                    }
                    let id = state.last_volume_id + 1;
                    let volume = Volume {
                        id,
                        spec,
                        chunks_allocated: 0,
                        qos: Default::default(),
                        snapshot_epoch: 0,
                        snapshots: Vec::new(),
                        parent,
                    };
                    let ops = vec![
                        put("counter/volume".into(), &id),
                        put(volume_key(&volume.spec.name), &volume),
                    ];
                    Ok((ops, volume))
                },
                |state, volume| {
                    assert!(
                        volume.id > state.last_volume_id,
                        "volume id {} handed out after {}",
                        volume.id,
                        state.last_volume_id
                    );
                    state.last_volume_id = volume.id;
                    state
                        .volumes
                        .insert(volume.spec.name.clone(), volume.clone());
                    tracing::info!(name = %volume.spec.name, size = volume.spec.size_bytes, "volume created");
                    volume
                },
            )
            .await?;
        Ok(MasterResponse::Volume(volume))
    }

    pub(crate) fn list_volumes(&self) -> Reply {
        Ok(MasterResponse::Volumes {
            volumes: self.state().volume_list(),
        })
    }

    /// What a gateway opening the volume needs: its chunks, the servers and the map.
    pub(crate) fn volume_map(&self, name: &str) -> Reply {
        let state = self.state();
        let mut volume = state.volume(name)?;
        // A pending snapshot whose writer is gone no longer changes.
        let writer_gone = state.writing_lease(volume.id).is_none();
        for snapshot in &mut volume.snapshots {
            snapshot.ready |= writer_gone;
        }
        let chunks = state
            .chunks
            .get(&volume.id)
            .into_iter()
            .flat_map(|c| c.values().cloned())
            .collect();
        Ok(MasterResponse::VolumeMap(Box::new(VolumeMap {
            volume,
            chunks,
            servers: state.servers.values().cloned().collect(),
            cluster: state.map.map.clone(),
        })))
    }

    pub(crate) async fn resize_volume(&self, name: &str, size_bytes: u64) -> Reply {
        let volume = self
            .put_volume(|state| {
                let mut volume = state.volume(name)?;
                if volume.spec.write_mode == WriteMode::LogCommit
                    && size_bytes != volume.spec.size_bytes
                {
                    return Err((
                        Status::BadRequest,
                        format!("volume {name} is log-commit: its log and checkpoints are laid out for its size at create; resizing is not supported"),
                    ));
                }
                if size_bytes < volume.spec.size_bytes {
                    return Err((
                        Status::BadRequest,
                        format!(
                            "volume {name} is {}, more than {}: shrinking is not supported (it would discard data)",
                            human_bytes(volume.spec.size_bytes),
                            human_bytes(size_bytes)
                        ),
                    ));
                }
                volume.spec.size_bytes = size_bytes;
                volume
                    .spec
                    .validate()
                    .map_err(|e| (Status::BadRequest, e))?;
                Ok(volume)
            })
            .await?;
        Ok(MasterResponse::Volume(volume))
    }

    /// `floe volume set-write-mode`: the gateway reads it when it next opens the
    /// volume (a switch under writes in flight is not made safe).
    pub(crate) async fn set_write_mode(&self, name: &str, mode: WriteMode) -> Reply {
        let volume = self
            .put_volume(|state| {
                let mut volume = state.volume(name)?;
                let was = volume.spec.write_mode;
                if (was == WriteMode::LogCommit) != (mode == WriteMode::LogCommit) {
                    return Err((
                        Status::BadRequest,
                        format!("volume {name} is {was}: log-commit keeps a log where the other modes keep the blocks in place, so it is chosen at create, not switched to or from"),
                    ));
                }
                volume.spec.write_mode = mode;
                Ok(volume)
            })
            .await?;
        tracing::info!(volume = name, %mode, "write mode set; takes effect at the next open");
        Ok(MasterResponse::Volume(volume))
    }

    pub(crate) async fn delete_volume(&self, name: &str) -> Reply {
        self.change(
            |state| {
                let volume = state.volume(name)?;
                if let Some(clone) = state.clone_of(name, None) {
                    return Err((
                        Status::Busy,
                        format!("volume {name} has a clone, {clone}: delete or flatten it first"),
                    ));
                }
                let ops = vec![
                    Op::Delete {
                        key: volume_key(name),
                    },
                    Op::DeletePrefix {
                        prefix: format!("chunk/{:016x}/", volume.id),
                    },
                    // Its servers drop every chunk of it, freed deltas too.
                    Op::DeletePrefix {
                        prefix: format!("freed/{:016x}/", volume.id),
                    },
                    Op::Delete {
                        key: lease_key(volume.id),
                    },
                    Op::Put {
                        key: format!("deleted/{:016x}", volume.id),
                        value: Vec::new(),
                    },
                ];
                Ok((ops, volume.id))
            },
            |state, id| {
                state.volumes.remove(name);
                state.chunks.remove(&id);
                state.freed.retain(|(volume_id, _), _| *volume_id != id);
                state.leases.remove(&id);
                state.deleted_volumes.push(id);
                tracing::info!(%name, "volume deleted");
            },
        )
        .await?;
        Ok(MasterResponse::Done)
    }

    /// Stores the volume `decide` returns, then updates the in-memory copy.
    pub(crate) async fn put_volume(
        &self,
        decide: impl FnOnce(&State) -> Result<Volume, Failure>,
    ) -> Result<Volume, Failure> {
        self.change(
            |state| {
                let volume = decide(state)?;
                let op = put(volume_key(&volume.spec.name), &volume);
                Ok((vec![op], volume))
            },
            |state, volume| {
                state
                    .volumes
                    .insert(volume.spec.name.clone(), volume.clone());
                volume
            },
        )
        .await
    }
}
