//! `floe cluster map|expand`, `floe pg remap`, `floe layer shrink|merge`: the cluster
//! map and the migration an operator asks for. Moves then run in the background,
//! throttled; `floe status` shows their progress.

use clap::Subcommand;
use floe_client::master::MasterClient;
use floe_protocol::{ClusterMapInfo, MasterRequest, MasterResponse};

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Show the cluster map: epoch, mode, layers and their placement groups.
    Map,
    /// Add registered chunk servers that are not in the map yet: a new layer in mapx
    /// mode (existing chunks stay put, new chunks go there), more of the one hierarchy
    /// in crush mode (chunks move to their new places).
    Expand {
        /// Only servers on these hosts (default: every server not in the map).
        #[arg(long = "host")]
        hosts: Vec<String>,
    },
}

#[derive(Subcommand)]
pub enum PgCommand {
    /// Place a placement group in another layer: its chunks move there.
    Remap { pg: u32, layer: u8 },
}

#[derive(Subcommand)]
pub enum LayerCommand {
    /// Move every placement group off a layer, spread over the others by weight.
    Shrink { layer: u8 },
    /// Make two layers one: their placement groups spread over both.
    Merge { a: u8, b: u8 },
}

pub async fn cluster(master: &MasterClient, command: ClusterCommand) -> Result<(), String> {
    match command {
        ClusterCommand::Map => change(master, MasterRequest::GetClusterMap, "").await,
        ClusterCommand::Expand { hosts } => {
            change(
                master,
                MasterRequest::ExpandCluster { hosts },
                "expanded the cluster",
            )
            .await
        }
    }
}

pub async fn pg(
    master: &MasterClient,
    PgCommand::Remap { pg, layer }: PgCommand,
) -> Result<(), String> {
    let done = format!("placement group {pg} remapped to layer {layer}");
    change(master, MasterRequest::RemapPg { pg, layer }, &done).await
}

pub async fn layer(master: &MasterClient, command: LayerCommand) -> Result<(), String> {
    match command {
        LayerCommand::Shrink { layer } => {
            let done = format!("layer {layer} shrunk");
            change(master, MasterRequest::ShrinkLayer { layer }, &done).await
        }
        LayerCommand::Merge { a, b } => {
            let done = format!("layers {a} and {b} merged");
            change(master, MasterRequest::MergeLayers { a, b }, &done).await
        }
    }
}

/// Sends one map request and prints the map it leaves; `done` says what changed.
async fn change(master: &MasterClient, request: MasterRequest, done: &str) -> Result<(), String> {
    let reply = master
        .call(request)
        .await
        .map_err(|e| format!("cluster map: {e}"))?;
    let MasterResponse::ClusterMap(info) = reply else {
        return Err(format!("master answered {reply:?}"));
    };
    let ClusterMapInfo {
        map,
        pending,
        layers,
    } = *info;
    if !done.is_empty() {
        println!("{done}: cluster map epoch {}", map.epoch);
        println!("chunks move in the background; `floe status` shows the progress");
        println!();
    }
    println!(
        "cluster map: epoch {}, placement {}, {} placement groups per layer",
        map.epoch, map.mode, map.pgs_per_layer
    );
    println!(
        "{:<6} {:<10} {:>11} {:>10}  SERVERS",
        "LAYER", "TIMESTAMP", "PGS-CREATED", "PGS-NOW"
    );
    for l in &layers {
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
    Ok(())
}
