//! `floe volume ...` and `floe status`: one call to the master each, printed as tables.

use crate::size;
use floe_client::master::MasterClient;
use floe_protocol::{Volume, VolumeSpec};

fn volume_row(v: &Volume) -> String {
    format!(
        "{:<20} {:>10} {:>8} {:>10} {:>10} {:>7} {:>8}",
        v.spec.name,
        size::format(v.spec.size_bytes),
        v.spec.replicas,
        size::format(v.spec.chunk_bytes),
        size::format(v.spec.stripe_unit_bytes),
        v.spec.stripe_count,
        v.chunks_allocated,
    )
}

const VOLUME_HEADER: &str =
    "NAME                       SIZE REPLICAS      CHUNK STRIPE-UNIT STRIPES ALLOCATED";

pub async fn create(master: &MasterClient, spec: VolumeSpec) -> Result<(), String> {
    let volume = master
        .create_volume(spec)
        .await
        .map_err(|e| format!("cannot create volume: {e}"))?;
    println!(
        "created volume {} ({}, {} replicas)",
        volume.spec.name,
        size::format(volume.spec.size_bytes),
        volume.spec.replicas
    );
    Ok(())
}

pub async fn list(master: &MasterClient) -> Result<(), String> {
    let volumes = master.list_volumes().await.map_err(|e| e.to_string())?;
    println!("{VOLUME_HEADER}");
    for v in &volumes {
        println!("{}", volume_row(v));
    }
    Ok(())
}

pub async fn info(master: &MasterClient, name: &str) -> Result<(), String> {
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    let v = &map.volume;
    println!("name:          {}", v.spec.name);
    println!("id:            {}", v.id);
    println!(
        "size:          {} ({} bytes)",
        size::format(v.spec.size_bytes),
        v.spec.size_bytes
    );
    println!("replicas:      {}", v.spec.replicas);
    println!("chunk size:    {}", size::format(v.spec.chunk_bytes));
    println!(
        "stripe:        {} x {}",
        v.spec.stripe_count,
        size::format(v.spec.stripe_unit_bytes)
    );
    println!(
        "allocated:     {} of {} chunks",
        map.chunks.len(),
        v.spec.chunk_count()
    );
    for chunk in &map.chunks {
        let replicas: Vec<String> = chunk.replicas.iter().map(|id| id.to_string()).collect();
        println!("  chunk {:>6}: servers {}", chunk.index, replicas.join(","));
    }
    Ok(())
}

pub async fn resize(master: &MasterClient, name: &str, size_bytes: u64) -> Result<(), String> {
    let v = master
        .resize_volume(name, size_bytes)
        .await
        .map_err(|e| format!("cannot resize volume {name}: {e}"))?;
    println!(
        "volume {} is now {}",
        v.spec.name,
        size::format(v.spec.size_bytes)
    );
    Ok(())
}

pub async fn delete(master: &MasterClient, name: &str) -> Result<(), String> {
    master
        .delete_volume(name)
        .await
        .map_err(|e| format!("cannot delete volume {name}: {e}"))?;
    println!("deleted volume {name}; chunk servers free its space at their next heartbeat");
    Ok(())
}

pub async fn status(master: &MasterClient) -> Result<(), String> {
    let status = master.status().await.map_err(|e| e.to_string())?;
    let mut hosts: Vec<&str> = status.servers.iter().map(|s| s.host.as_str()).collect();
    hosts.sort_unstable();
    hosts.dedup();
    let up = status.servers.iter().filter(|s| s.up).count();
    let capacity: u64 = status.servers.iter().map(|s| s.capacity_bytes).sum();
    let used: u64 = status.servers.iter().map(|s| s.used_bytes).sum();
    println!(
        "cluster: {} hosts, {up}/{} chunk servers up, {} used of {}",
        hosts.len(),
        status.servers.len(),
        size::format(used),
        size::format(capacity)
    );
    println!();
    println!(
        "{:<4} {:<12} {:<22} {:<5} {:<5} {:>10} {:>10}",
        "ID", "HOST", "ADDRESS", "CLASS", "STATE", "USED", "CAPACITY"
    );
    for s in &status.servers {
        println!(
            "{:<4} {:<12} {:<22} {:<5} {:<5} {:>10} {:>10}",
            s.id,
            s.host,
            s.address,
            s.class,
            if s.up { "up" } else { "DOWN" },
            size::format(s.used_bytes),
            size::format(s.capacity_bytes)
        );
    }
    println!();
    println!("{VOLUME_HEADER}");
    for v in &status.volumes {
        println!("{}", volume_row(v));
    }
    Ok(())
}
