//! `floe cluster map|expand`, `floe pg remap`, `floe layer shrink|merge`: the cluster
//! map and the migration an operator asks for. Moves then run in the background,
//! throttled; `floe status` shows their progress, and `--wait` follows them here.

use crate::progress::{Progress, Unit, POLL_EVERY};
use crate::views::{self, Format};
use clap::Subcommand;
use floe_client::master::MasterClient;
use floe_protocol::{ClusterMapInfo, MasterRequest, MasterResponse};

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Show the cluster map: epoch, mode, layers and their placement groups.
    Map {
        #[command(flatten)]
        format: Format,
    },
    /// Add registered chunk servers that are not in the map yet: a new layer in mapx
    /// mode (existing chunks stay put, new chunks go there), more of the one hierarchy
    /// in crush mode (chunks move to their new places).
    Expand {
        /// Only servers on these hosts (default: every server not in the map).
        #[arg(long = "host")]
        hosts: Vec<String>,
        #[command(flatten)]
        wait: Wait,
    },
}

#[derive(Subcommand)]
pub enum PgCommand {
    /// Place a placement group in another layer: its chunks move there.
    Remap {
        /// The placement group (`floe volume info` shows each chunk's).
        pg: u32,
        /// The layer to place it in (`floe cluster map` lists them).
        layer: u8,
        #[command(flatten)]
        wait: Wait,
    },
}

#[derive(Subcommand)]
pub enum LayerCommand {
    /// Move every placement group off a layer, spread over the others by weight.
    Shrink {
        /// The layer to empty (`floe cluster map` lists them).
        layer: u8,
        #[command(flatten)]
        wait: Wait,
    },
    /// Make two layers one: their placement groups spread over both.
    Merge {
        /// One layer (`floe cluster map` lists them).
        a: u8,
        /// The other layer.
        b: u8,
        #[command(flatten)]
        wait: Wait,
    },
}

#[derive(clap::Args, Clone, Copy)]
pub struct Wait {
    /// Follow the chunk moves with their progress, rate and ETA until every chunk is
    /// where the new map places it (Ctrl-C stops following, not the moves).
    #[arg(long)]
    wait: bool,
}

pub async fn cluster(master: &MasterClient, command: ClusterCommand) -> Result<(), String> {
    match command {
        ClusterCommand::Map { format } => {
            let info = call(master, MasterRequest::GetClusterMap).await?;
            match format.json {
                true => views::print(&views::ClusterMapView::from(&info)),
                false => {
                    print_map(&info);
                    Ok(())
                }
            }
        }
        ClusterCommand::Expand { hosts, wait } => {
            let request = MasterRequest::ExpandCluster { hosts };
            change(master, request, "expanded the cluster", wait).await
        }
    }
}

pub async fn pg(
    master: &MasterClient,
    PgCommand::Remap { pg, layer, wait }: PgCommand,
) -> Result<(), String> {
    let done = format!("placement group {pg} remapped to layer {layer}");
    change(master, MasterRequest::RemapPg { pg, layer }, &done, wait).await
}

pub async fn layer(master: &MasterClient, command: LayerCommand) -> Result<(), String> {
    match command {
        LayerCommand::Shrink { layer, wait } => {
            let done = format!("layer {layer} shrunk");
            change(master, MasterRequest::ShrinkLayer { layer }, &done, wait).await
        }
        LayerCommand::Merge { a, b, wait } => {
            let done = format!("layers {a} and {b} merged");
            change(master, MasterRequest::MergeLayers { a, b }, &done, wait).await
        }
    }
}

/// One map request; the map it leaves.
async fn call(master: &MasterClient, request: MasterRequest) -> Result<ClusterMapInfo, String> {
    let reply = master
        .call(request)
        .await
        .map_err(|e| format!("cluster map: {e}"))?;
    let MasterResponse::ClusterMap(info) = reply else {
        return Err(format!("master answered {reply:?}"));
    };
    Ok(*info)
}

/// Sends one map change, prints the map it leaves (`done` says what changed), and
/// with `--wait` follows the moves it started.
async fn change(
    master: &MasterClient,
    request: MasterRequest,
    done: &str,
    wait: Wait,
) -> Result<(), String> {
    let info = call(master, request).await?;
    println!("{done}: cluster map epoch {}", info.map.epoch);
    if !wait.wait {
        println!("chunks move in the background; `floe status` shows the progress");
    }
    println!();
    print_map(&info);
    if wait.wait {
        follow_moves(master, info.map.epoch).await?;
    }
    Ok(())
}

/// Shows the moves towards the map of `epoch` until none is left.
async fn follow_moves(master: &MasterClient, epoch: u64) -> Result<(), String> {
    let mut shown = Progress::new("moving chunks".into(), Unit::Chunks);
    let mut moved_before = None;
    loop {
        let r = master.status().await.map_err(|e| e.to_string())?.rebalance;
        let before = *moved_before.get_or_insert(r.moved_chunks);
        let moved = r.moved_chunks.saturating_sub(before);
        let left = r.misplaced_chunks + r.moving;
        // Older epochs' counts say nothing of the new map's moves.
        if r.epoch >= epoch {
            let copied = format!(", {}/s copied", crate::size::format(r.bytes_per_second));
            shown.update(moved, moved + left, &copied);
            if left == 0 {
                break;
            }
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
    shown.finish();
    println!("every chunk is where the map places it");
    Ok(())
}

fn print_map(info: &ClusterMapInfo) {
    let ClusterMapInfo {
        map,
        pending,
        layers,
    } = info;
    println!(
        "cluster map: epoch {}, placement {}, {} placement groups per layer",
        map.epoch, map.mode, map.pgs_per_layer
    );
    println!(
        "{:<6} {:<10} {:>11} {:>10}  SERVERS",
        "LAYER", "TIMESTAMP", "PGS-CREATED", "PGS-NOW"
    );
    for l in layers {
        let servers: Vec<String> = l.devices.iter().map(|id| id.to_string()).collect();
        println!(
            "{:<6} {:<10} {:>11} {:>10}  {}{}",
            l.id,
            l.timestamp,
            l.pgs_created,
            l.pgs_placed,
            servers.join(","),
            if l.removed { " (shrunk away)" } else { "" }
        );
    }
    if !map.out.is_empty() {
        println!("out (lost): {:?}", map.out);
    }
    if !pending.is_empty() {
        let ids: Vec<String> = pending
            .iter()
            .map(|s| format!("{} ({} {})", s.id, s.host, s.device()))
            .collect();
        println!(
            "not in the map yet: {}; `floe cluster expand` adds them",
            ids.join(", ")
        );
    }
}
