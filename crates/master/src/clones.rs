//! Clones: volumes that read through to a snapshot of another volume wherever they
//! have not been written, until flattened.

use crate::state::State;
use crate::{Master, Reply};
use floe_protocol::snapshot::{flatten_refused_for_snapshots, Parent};
use floe_protocol::{MasterResponse, Status, VolumeSpec};

impl State {
    /// A volume reading through to a snapshot of `volume` (`snapshot`, or any).
    pub(crate) fn clone_of(&self, volume: &str, snapshot: Option<&str>) -> Option<String> {
        self.volumes.values().find_map(|v| {
            let parent = v.parent.as_ref()?;
            let uses = parent.volume == volume && snapshot.is_none_or(|s| s == parent.snapshot);
            uses.then(|| v.spec.name.clone())
        })
    }
}

impl Master {
    /// A clone: a new volume of the snapshot's size and the parent's layout (it reads
    /// through chunk by chunk), writable at once, that copies nothing up front.
    pub(crate) async fn clone_volume(&self, name: &str, snapshot: &str, clone: &str) -> Reply {
        let (spec, parent) = {
            let state = self.state();
            let volume = state.volume(name)?;
            let taken = state.readable_snapshot(name, snapshot)?;
            let spec = VolumeSpec {
                name: clone.to_string(),
                size_bytes: taken.size_bytes,
                ..volume.spec.clone()
            };
            let parent = Parent {
                volume: name.to_string(),
                snapshot: snapshot.to_string(),
                epoch: taken.epoch,
            };
            (spec, parent)
        };
        self.create_volume_of(spec, Some(parent)).await
    }

    /// Forgets a clone's parent once the holder of its lease copied what the clone
    /// read from there: only that holder knows nothing else wrote meanwhile.
    pub(crate) async fn flatten_volume(&self, name: &str, generation: u32) -> Reply {
        self.put_volume(|state| {
            let mut volume = state.volume(name)?;
            if volume.parent.is_none() {
                return Err((Status::BadRequest, format!("volume {name} is not a clone")));
            }
            if let Some(snapshot) = volume.snapshots.first() {
                return Err((
                    Status::Busy,
                    flatten_refused_for_snapshots(name, &snapshot.name),
                ));
            }
            if state.live_lease(volume.id) != Some(generation) {
                return Err((
                    Status::Fenced,
                    format!("the lease of volume {name} (generation {generation}) was lost"),
                ));
            }
            volume.parent = None;
            Ok(volume)
        })
        .await?;
        Ok(MasterResponse::Done)
    }
}
