//! `floe snapshot create|list|delete`.

use crate::progress::{Progress, Unit};
use crate::views::{self, Format};
use clap::Subcommand;
use floe_client::master::MasterClient;
use floe_protocol::snapshot::{split_snapshot, SNAPSHOT_CONFIRM_WAIT};
use floe_protocol::{MasterRequest, MasterResponse};
use std::time::{Duration, UNIX_EPOCH};

#[derive(Subcommand)]
pub enum SnapshotCommand {
    /// Take a crash-consistent snapshot VOLUME@SNAPSHOT of a volume, in use or not:
    /// its export VOLUME@SNAPSHOT reads the volume as it was, read-only.
    Create {
        /// VOLUME@SNAPSHOT: the volume, and a name for the snapshot.
        target: String,
    },
    /// List a volume's snapshots, with the bytes of blocks preserved from each one
    /// on until the next (what the volume's writes since it have copied).
    List {
        /// The volume whose snapshots to list.
        volume: String,
        #[command(flatten)]
        format: Format,
    },
    /// Delete a snapshot at once; the space its preserved blocks take comes back in
    /// the background, throttled (`floe master --snapshot-free-rate`), once no older
    /// snapshot reads them.
    Delete {
        /// VOLUME@SNAPSHOT to delete.
        target: String,
    },
}

fn target(text: &str) -> Result<(&str, &str), String> {
    split_snapshot(text).ok_or_else(|| format!("{text:?} is not VOLUME@SNAPSHOT"))
}

pub async fn run(master: &MasterClient, command: SnapshotCommand) -> Result<(), String> {
    match command {
        SnapshotCommand::Create { target: text } => {
            let (volume, snapshot) = target(&text)?;
            let request = MasterRequest::CreateSnapshot {
                name: volume.into(),
                snapshot: snapshot.into(),
            };
            // The master waits for the writer to switch epochs; a margin for the rest.
            let limit = SNAPSHOT_CONFIRM_WAIT + Duration::from_secs(5);
            match master.call_within(request, limit).await {
                Ok(MasterResponse::Snapshot(taken)) => {
                    println!("snapshot {text} taken (epoch {})", taken.epoch);
                    Ok(())
                }
                Ok(other) => Err(format!("master answered {other:?}")),
                Err(e) => Err(format!("cannot snapshot {text}: {e}")),
            }
        }
        SnapshotCommand::List { volume, format } => {
            let map = master
                .volume_map(&volume)
                .await
                .map_err(|e| e.to_string())?;
            let master = std::sync::Arc::new(MasterClient::new(&master.address()));
            let preserved = floe_client::snapshot::diff::preserved_bytes(master, &volume).await?;
            let snapshots = &map.volume.snapshots;
            // Blocks overwritten from snapshot i on, until the next one.
            let held = |i: usize| -> u64 {
                let next = snapshots.get(i + 1).map_or(u32::MAX, |n| n.epoch);
                preserved
                    .range(snapshots[i].epoch..next)
                    .map(|(_, b)| b)
                    .sum()
            };
            // Deltas below the oldest snapshot left are what deleted ones preserved.
            let oldest = snapshots.first().map_or(u32::MAX, |s| s.epoch);
            let deleted: u64 = preserved.range(..oldest).map(|(_, b)| b).sum();
            if format.json {
                let list = views::SnapshotList {
                    volume,
                    snapshots: snapshots
                        .iter()
                        .enumerate()
                        .map(|(i, s)| views::SnapshotView {
                            name: s.name.clone(),
                            epoch: s.epoch,
                            created_ms: s.created_ms,
                            size_bytes: s.size_bytes,
                            preserved_bytes: held(i),
                            ready: s.ready,
                        })
                        .collect(),
                    deleted_preserved_bytes: deleted,
                };
                return views::print(&list);
            }
            println!(
                "{:<24} {:>6} {:<20} {:>10} {:>10} state",
                "name", "epoch", "taken (UTC)", "size", "preserved"
            );
            for (i, s) in snapshots.iter().enumerate() {
                let taken = UNIX_EPOCH + Duration::from_millis(s.created_ms);
                let taken = humantime::format_rfc3339_seconds(taken).to_string();
                println!(
                    "{:<24} {:>6} {:<20} {:>10} {:>10} {}",
                    s.name,
                    s.epoch,
                    taken.trim_end_matches('Z').replace('T', " "),
                    crate::size::format(s.size_bytes),
                    crate::size::format(held(i)),
                    if s.ready { "ready" } else { "pending" }
                );
            }
            if deleted > 0 {
                println!(
                    "{} preserved for deleted snapshots is being freed in the background \
                     (`floe status` shows the progress)",
                    crate::size::format(deleted)
                );
            }
            Ok(())
        }
        SnapshotCommand::Delete { target: text } => {
            let (volume, snapshot) = target(&text)?;
            let request = MasterRequest::DeleteSnapshot {
                name: volume.into(),
                snapshot: snapshot.into(),
            };
            master
                .call(request)
                .await
                .map_err(|e| format!("cannot delete snapshot {text}: {e}"))?;
            println!(
                "deleted snapshot {text}; its space is freed in the background (`floe status` shows the progress)"
            );
            Ok(())
        }
    }
}

/// `floe volume diff VOLUME@SINCE [VOLUME@UNTIL] [--json]`.
pub async fn diff(
    master: &str,
    since: &str,
    until: Option<&str>,
    json: bool,
) -> Result<(), String> {
    let (volume, from) = target(since)?;
    let to = match until {
        Some(text) => {
            let (other, to) = target(text)?;
            if other != volume {
                return Err(format!(
                    "{since} and {text} are snapshots of different volumes"
                ));
            }
            Some(to)
        }
        None => None,
    };
    let master = std::sync::Arc::new(MasterClient::new(master));
    let ranges = floe_client::snapshot::diff::changed(master, volume, from, to).await?;
    let bytes: u64 = ranges.iter().map(|r| r.1).sum();
    let until = until.unwrap_or(volume);
    if json {
        let extents: Vec<_> = ranges
            .iter()
            .map(|(offset, length)| serde_json::json!({"offset": offset, "length": length}))
            .collect();
        let out = serde_json::json!({
            "since": since, "until": until, "extents": extents, "changed_bytes": bytes,
        });
        println!("{out}");
        return Ok(());
    }
    println!("{:>16} {:>12}", "offset", "length");
    for (offset, length) in &ranges {
        println!("{offset:>16} {length:>12}");
    }
    println!(
        "{} extents, {} changed from {since} to {until}",
        ranges.len(),
        crate::size::format(bytes)
    );
    Ok(())
}

/// `floe volume rollback VOLUME@SNAPSHOT`, with progress, rate and ETA each second.
pub async fn rollback(master: &str, text: &str) -> Result<(), String> {
    let (volume, snapshot) = target(text)?;
    let master = std::sync::Arc::new(MasterClient::new(master));
    let mut shown = Progress::new(format!("rolling back {volume} to {text}"), Unit::Bytes);
    let progress = |done: u64, total: u64| shown.update(done, total, "");
    let rewritten = floe_client::snapshot::rollback::rollback(master, volume, snapshot, progress)
        .await
        .map_err(|e| format!("cannot roll {volume} back to {text}: {e}"))?;
    shown.finish();
    println!(
        "rolled {volume} back to {text}: {} rewritten in {:.1} s",
        crate::size::format(rewritten),
        shown.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `floe volume clone VOLUME@SNAPSHOT NAME`.
pub async fn clone(master: &MasterClient, source: &str, name: &str) -> Result<(), String> {
    let (volume, snapshot) = target(source)?;
    let request = MasterRequest::CloneVolume {
        name: volume.into(),
        snapshot: snapshot.into(),
        clone: name.into(),
    };
    master
        .call(request)
        .await
        .map_err(|e| format!("cannot clone {source} as {name}: {e}"))?;
    println!("volume {name} created, a clone of {source}");
    Ok(())
}

/// `floe volume flatten CLONE`, with progress, rate and ETA each second.
pub async fn flatten(master: &str, name: &str, rate: u64) -> Result<(), String> {
    let master = std::sync::Arc::new(MasterClient::new(master));
    let mut shown = Progress::new(format!("flattening {name}"), Unit::Bytes);
    let progress = |p: floe_client::snapshot::flatten::Progress| {
        let copied = format!(", {} copied", crate::size::format(p.copied));
        shown.update(p.scanned, p.total, &copied)
    };
    let copied = floe_client::snapshot::flatten::flatten(master, name, rate, progress)
        .await
        .map_err(|e| format!("cannot flatten {name}: {e}"))?;
    shown.finish();
    println!(
        "flattened {name}: {} copied from its parent in {:.1} s; it no longer reads \
         through",
        crate::size::format(copied),
        shown.elapsed().as_secs_f64()
    );
    Ok(())
}
