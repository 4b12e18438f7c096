//! `floe volume ...`, `floe status`, `floe scrub` and `floe chunkserver mark-lost`:
//! one call to the master each, printed as tables.

use crate::size;
use floe_client::master::MasterClient;
use floe_protocol::{ControlRequest, ControlResponse, ServerId, Volume, VolumeSpec};

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
        let replicas: Vec<String> = chunk
            .replicas
            .iter()
            .map(|id| {
                if chunk.stale.contains(id) {
                    format!("{id}(stale)")
                } else {
                    id.to_string()
                }
            })
            .collect();
        println!(
            "  chunk {:>6}: servers {} view {}",
            chunk.index,
            replicas.join(","),
            chunk.view
        );
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
        "{:<4} {:<12} {:<22} {:<14} {:<5} {:>10} {:>10}",
        "ID", "HOST", "ADDRESS", "CLASS", "STATE", "USED", "CAPACITY"
    );
    for s in &status.servers {
        println!(
            "{:<4} {:<12} {:<22} {:<14} {:<5} {:>10} {:>10}",
            s.id,
            s.host,
            s.address,
            if s.emulated {
                format!("{} (emulated)", s.class)
            } else {
                s.class.to_string()
            },
            if s.lost {
                "LOST"
            } else if s.up {
                "up"
            } else {
                "DOWN"
            },
            size::format(s.used_bytes),
            size::format(s.capacity_bytes)
        );
    }
    println!();
    println!("{VOLUME_HEADER}");
    for v in &status.volumes {
        println!("{}", volume_row(v));
    }
    let r = &status.recovery;
    println!();
    if r.degraded_chunks == 0 {
        println!("redundancy: every chunk has all its replicas");
    } else {
        println!(
            "redundancy: {} chunks degraded, {} being repaired{}",
            r.degraded_chunks,
            r.in_progress,
            match r.eta_seconds {
                Some(eta) => format!(", about {eta} s to full redundancy"),
                None => String::new(),
            }
        );
    }
    if r.waiting_for_operator > 0 {
        println!(
            "  {} chunks have fewer than a majority of replicas reachable: bring their servers back, or declare failed ones lost with `floe chunkserver mark-lost ID`",
            r.waiting_for_operator
        );
    }
    println!(
        "recovery: {} chunks repaired ({} incremental, {} whole copies), {} copied, {}/s now",
        r.repaired_chunks,
        r.incremental_repairs,
        r.full_copies,
        size::format(r.bytes_copied),
        size::format(r.bytes_per_second)
    );
    if let Some(error) = &r.last_error {
        println!("  last attempt failed: {error}");
    }
    Ok(())
}

pub async fn scrub(master: &MasterClient, name: &str) -> Result<(), String> {
    let reply = master
        .call(ControlRequest::Scrub {
            name: name.to_string(),
        })
        .await
        .map_err(|e| format!("cannot scrub volume {name}: {e}"))?;
    let ControlResponse::Scrub(report) = reply else {
        return Err(format!("master answered {reply:?}"));
    };
    for detail in &report.details {
        println!("{detail}");
    }
    println!(
        "scrubbed {name}: {} chunks, {} differences, {} repaired, {} skipped",
        report.chunks, report.differences, report.repaired, report.skipped
    );
    if report.differences > report.repaired || report.skipped > 0 {
        return Err(format!(
            "volume {name} is not verified clean: see the lines above"
        ));
    }
    Ok(())
}

pub async fn mark_lost(master: &MasterClient, id: ServerId) -> Result<(), String> {
    master
        .call(ControlRequest::MarkLost { id })
        .await
        .map_err(|e| format!("cannot mark chunk server {id} lost: {e}"))?;
    println!("chunk server {id} marked lost; its chunks are recovered from the surviving replicas");
    Ok(())
}
