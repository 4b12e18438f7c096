//! The Floe client: a volume is a stack of layers (DESIGN.md section 3).
//!
//! - [`master`]: typed calls to the master (volume maps, chunk allocation).
//! - [`stripe`]: the striping formula, and the layer that turns volume requests into
//!   chunk requests ([`stripe::Striped`], a [`floe_blockdev::BlockDevice`]).
//! - [`replicated`]: the chunk layer: allocation on first write, writes to the
//!   primary which forwards to the backups, reads from the primary with fallback.
//!
//! [`open_volume`] composes them for a volume name.
pub mod master;
pub mod replicated;
pub mod stripe;

use floe_blockdev::BlockDevice;
use std::sync::Arc;

/// Opens `name` through the master at `master` as a block device.
pub async fn open_volume(
    master: Arc<master::MasterClient>,
    name: &str,
) -> Result<Arc<dyn BlockDevice>, String> {
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    let layout = stripe::Layout::of(&map.volume.spec);
    let size = map.volume.spec.size_bytes;
    let chunks = replicated::ReplicatedChunks::new(master, map);
    Ok(Arc::new(stripe::Striped::new(layout, size, chunks)))
}
