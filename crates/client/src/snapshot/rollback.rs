//! `floe volume rollback VOLUME@SNAPSHOT`: writes the snapshot's contents back over
//! what changed since it, under the volume's lease (so it is refused while a gateway
//! has the volume open), through the writer's layers: newer snapshots keep theirs.

use super::diff;
use crate::master::MasterClient;
use crate::{open_snapshot, open_volume, Access, UNRETIRED_LIMIT_DEFAULT};
use floe_protocol::WriteMode;
use std::sync::Arc;

/// Bytes copied per request.
const PIECE_BYTES: u64 = 1 << 20;

/// Rolls volume `name` back to `snapshot`; calls `progress(done, total)` after each
/// piece. Returns the bytes rewritten.
pub async fn rollback(
    master: Arc<MasterClient>,
    name: &str,
    snapshot: &str,
    mut progress: impl FnMut(u64, u64),
) -> Result<u64, String> {
    let access = Access::Write {
        holder: "floe volume rollback",
        unretired_limit: UNRETIRED_LIMIT_DEFAULT,
    };
    let volume = open_volume(master.clone(), name, access)
        .await
        .map_err(|e| format!("{e} (a rollback needs the volume closed)"))?;
    // Under the lease: nothing else changes the volume from here on. A log-commit
    // volume's changes are not known per block: every piece is compared, and written
    // back where it differs.
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    let compare = map.volume.spec.write_mode == WriteMode::LogCommit;
    let changed = match compare {
        true => vec![(0, volume.size())],
        false => diff::changed(master.clone(), name, snapshot, None).await?,
    };
    let image = open_snapshot(master, name, snapshot).await?;
    let total: u64 = changed.iter().map(|r| r.1).sum();
    let mut done = 0;
    for (offset, length) in changed {
        let end = offset + length;
        let mut at = offset;
        while at < end {
            let n = PIECE_BYTES.min(end - at);
            // Past the snapshot's size (the volume grew since): zeroes.
            let data = match at < image.size() {
                true => image.read(at, n.min(image.size() - at) as u32).await,
                false => Ok(bytes::Bytes::new()),
            }
            .map_err(|e| format!("reading {name}@{snapshot} at {at}: {e}"))?;
            let mut piece = bytes::BytesMut::zeroed(n as usize);
            piece[..data.len()].copy_from_slice(&data);
            let unchanged = match compare {
                true => {
                    volume
                        .read(at, n as u32)
                        .await
                        .map_err(|e| format!("reading {name} at {at}: {e}"))?
                        == piece
                }
                false => false,
            };
            let written = match (unchanged, piece.iter().any(|b| *b != 0)) {
                (true, _) => Ok(()),
                (false, true) => volume.write(at, piece.freeze(), false).await,
                (false, false) => volume.write_zeroes(at, n, true).await,
            };
            written.map_err(|e| format!("writing {name} at {at}: {e}"))?;
            at += n;
            done += n;
            progress(done, total);
        }
    }
    volume
        .flush()
        .await
        .map_err(|e| format!("flushing {name}: {e}"))?;
    // A FLUSH only orders the writes of a volume that acknowledges early (flush-epoch,
    // log-commit): its layer, dropped, goes on until they are durable.
    drop(volume);
    crate::draining::drained_volume(name).await;
    Ok(total)
}
