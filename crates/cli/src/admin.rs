//! `floe volume ...`, `floe status`, `floe scrub` and `floe chunkserver mark-lost`:
//! one call to the master each, printed as tables.

use crate::progress::{Progress, Unit, POLL_EVERY};
use crate::size;
use crate::views::{self, Format};
use floe_client::master::MasterClient;
use floe_protocol::{
    ChunkId, ClusterStatus, FsUsage, JournalUsage, MasterRequest, MasterResponse, QosLimits,
    ServerId, ServerInfo, Volume, VolumeSpec, WriteMode,
};
use std::time::Duration;

/// `--iops`: requests per second; 0 or `unlimited` clears the limit.
pub fn parse_iops(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text == "unlimited" {
        return Ok(0);
    }
    text.parse().map_err(|_| {
        format!("IOPS {text:?} is not a whole number of requests per second (0 or `unlimited`: no limit)")
    })
}

/// `--bandwidth`: bytes per second like 100M or 100M/s; 0 or `unlimited` clears it.
pub fn parse_bandwidth(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text == "unlimited" {
        return Ok(0);
    }
    size::parse(text.strip_suffix("/s").unwrap_or(text)).map_err(|e| {
        format!("bandwidth: {e}; give bytes per second like 100M (0 or `unlimited`: no limit)")
    })
}

fn iops_text(iops: u64) -> String {
    match iops {
        0 => "unlimited".into(),
        n => n.to_string(),
    }
}

fn bandwidth_text(bytes_per_second: u64) -> String {
    match bytes_per_second {
        0 => "unlimited".into(),
        n => format!("{}/s", size::format(n)),
    }
}

fn qos_text(qos: QosLimits) -> String {
    format!(
        "{} IOPS, {} bandwidth",
        iops_text(qos.iops),
        bandwidth_text(qos.bytes_per_second)
    )
}

fn volume_row(v: &Volume) -> String {
    format!(
        "{:<20} {:>10} {:<6} {:>8} {:>10} {:>10} {:>7} {:>8} {:>9} {:>13} {}",
        v.spec.name,
        size::format(v.spec.size_bytes),
        v.spec.mode,
        v.spec.replicas,
        size::format(v.spec.chunk_bytes),
        size::format(v.spec.stripe_unit_bytes),
        v.spec.stripe_count,
        v.chunks_allocated,
        iops_text(v.qos.iops),
        bandwidth_text(v.qos.bytes_per_second),
        v.spec.write_mode,
    )
}

const VOLUME_HEADER: &str =
    "NAME                       SIZE MODE   REPLICAS      CHUNK STRIPE-UNIT STRIPES ALLOCATED      IOPS     BANDWIDTH WRITES";

pub async fn create(
    master: &MasterClient,
    spec: VolumeSpec,
    iops: Option<u64>,
    bytes_per_second: Option<u64>,
) -> Result<(), String> {
    let volume = master
        .create_volume(spec)
        .await
        .map_err(|e| format!("cannot create volume: {e}"))?;
    println!(
        "created volume {} ({}, {}, {} replicas, {})",
        volume.spec.name,
        size::format(volume.spec.size_bytes),
        volume.spec.mode,
        volume.spec.replicas,
        volume.spec.write_mode
    );
    if iops.is_some() || bytes_per_second.is_some() {
        set_qos(master, &volume.spec.name, iops, bytes_per_second).await?;
    }
    Ok(())
}

pub async fn set_qos(
    master: &MasterClient,
    name: &str,
    iops: Option<u64>,
    bytes_per_second: Option<u64>,
) -> Result<(), String> {
    if iops.is_none() && bytes_per_second.is_none() {
        return Err("give --iops and/or --bandwidth (0 or `unlimited` clears a limit)".into());
    }
    let volume = master
        .set_qos(name, iops, bytes_per_second)
        .await
        .map_err(|e| format!("cannot set the limits of volume {name}: {e}"))?;
    println!(
        "volume {name}: {}; a gateway serving it applies this at its next lease renewal (within 2 s)",
        qos_text(volume.qos)
    );
    Ok(())
}

pub async fn set_write_mode(
    master: &MasterClient,
    name: &str,
    mode: WriteMode,
) -> Result<(), String> {
    master
        .set_write_mode(name, mode)
        .await
        .map_err(|e| format!("cannot set the write mode of volume {name}: {e}"))?;
    println!("volume {name}: write mode {mode}; it takes effect when the volume is next opened");
    Ok(())
}

pub async fn list(master: &MasterClient, format: Format) -> Result<(), String> {
    let volumes = master.list_volumes().await.map_err(|e| e.to_string())?;
    if format.json {
        let volumes = volumes.iter().map(views::VolumeView::from).collect();
        return views::print(&views::VolumeList { volumes });
    }
    println!("{VOLUME_HEADER}");
    for v in &volumes {
        println!("{}", volume_row(v));
    }
    Ok(())
}

pub async fn info(master: &MasterClient, name: &str, format: Format) -> Result<(), String> {
    let map = master.volume_map(name).await.map_err(|e| e.to_string())?;
    if format.json {
        return views::print(&views::VolumeInfo::from(&map));
    }
    let v = &map.volume;
    println!("name:          {}", v.spec.name);
    println!("id:            {}", v.id);
    println!(
        "size:          {} ({} bytes)",
        size::format(v.spec.size_bytes),
        v.spec.size_bytes
    );
    println!("mode:          {}", v.spec.mode);
    println!("write mode:    {}", v.spec.write_mode);
    println!("replicas:      {}", v.spec.replicas);
    println!("limits:        {}", qos_text(v.qos));
    println!("chunk size:    {}", size::format(v.spec.chunk_bytes));
    println!(
        "stripe:        {} x {}",
        v.spec.stripe_count,
        size::format(v.spec.stripe_unit_bytes)
    );
    let (live, deltas): (Vec<_>, Vec<_>) = map
        .chunks
        .iter()
        .partition(|c| floe_protocol::snapshot::split_index(c.index).0 == 0);
    println!(
        "allocated:     {} of {} chunks",
        live.len(),
        v.spec.chunk_count()
    );
    if let Some(parent) = &v.parent {
        println!("clone of:      {}@{}", parent.volume, parent.snapshot);
    }
    let session = crate::sessions::served_by(master, name).await?;
    match (&session.gateway, &session.holder) {
        (Some(gateway), _) => println!(
            "served by:     gateway {gateway} (lease generation {})",
            session.generation
        ),
        (None, Some(holder)) => println!(
            "held by:       {holder} (lease generation {})",
            session.generation
        ),
        (None, None) => println!("served by:     nobody (no lease)"),
    }
    if let Some(m) = &session.moving {
        println!("moving:        from gateway {} to gateway {}", m.from, m.to);
    }
    let names: Vec<&str> = v.snapshots.iter().map(|s| s.name.as_str()).collect();
    println!(
        "snapshots:     {} ({} delta chunks){}",
        names.len(),
        deltas.len(),
        if names.is_empty() {
            String::new()
        } else {
            format!(": {}", names.join(", "))
        }
    );
    // The placement group (what `floe pg remap` takes) from the map new chunks use;
    // a chunk's group never changes (it depends on its creation layer only).
    let placer = floe_placement::cluster::Placer::new(&map.cluster).ok();
    for chunk in &map.chunks {
        let pg = placer.as_ref().map_or("?".to_string(), |p| {
            let id = ChunkId {
                volume_id: v.id,
                index: chunk.index,
            };
            p.pg_of(id, chunk.layer).to_string()
        });
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
            "  chunk {:>6}: servers {} view {} layer {} pg {pg}",
            chunk.index,
            replicas.join(","),
            chunk.view,
            chunk.layer
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

pub async fn delete(master: &MasterClient, name: &str, wait: bool) -> Result<(), String> {
    let before = match wait {
        true => Some(master.status().await.map_err(|e| e.to_string())?),
        false => None,
    };
    master
        .delete_volume(name)
        .await
        .map_err(|e| format!("cannot delete volume {name}: {e}"))?;
    let Some(before) = before else {
        println!("deleted volume {name}; chunk servers free its space at their next heartbeat");
        return Ok(());
    };
    let freed = follow_freeing(master, name, &before).await?;
    println!("deleted volume {name}; {} freed", size::format(freed));
    Ok(())
}

/// How long the chunk servers' data may stay the same before the freeing counts as
/// done: a heartbeat (1 s) tells them, the next reports what they freed; a server
/// that does not report at once does within its usage refresh (5 heartbeats).
const FREEING_SETTLED: Duration = Duration::from_secs(6);

/// Follows the chunk servers freeing a deleted volume's replicas: their data shrinks
/// towards what it was less the volume's (at most its allocated chunks, whole: files
/// are sparse). Unrelated writes meanwhile blur it; it ends once the data stops
/// shrinking.
async fn follow_freeing(
    master: &MasterClient,
    name: &str,
    before: &ClusterStatus,
) -> Result<u64, String> {
    let used = |status: &ClusterStatus| status.servers.iter().map(|s| s.used_bytes).sum::<u64>();
    let used_before = used(before);
    let at_most = before
        .volumes
        .iter()
        .find(|v| v.spec.name == name)
        .map_or(0, |v| {
            v.chunks_allocated * v.spec.chunk_bytes * v.spec.replicas as u64
        });
    let mut shown = Progress::new(format!("freeing {name}"), Unit::Bytes);
    let (mut freed, mut changed) = (0, std::time::Instant::now());
    while freed < at_most && changed.elapsed() < FREEING_SETTLED {
        tokio::time::sleep(POLL_EVERY).await;
        let now =
            used_before.saturating_sub(used(&master.status().await.map_err(|e| e.to_string())?));
        if now != freed {
            (freed, changed) = (now, std::time::Instant::now());
        }
        shown.update(freed, at_most, " (at most)");
    }
    shown.finish();
    Ok(freed)
}

pub async fn status(master: &MasterClient, format: Format) -> Result<(), String> {
    let status = master.status().await.map_err(|e| e.to_string())?;
    let file_systems = file_systems(&status.servers);
    let totals = totals(&status.servers, &file_systems);
    if format.json {
        let view = views::StatusView::new(&status, master.leader(), totals);
        return views::print(&view);
    }
    let masters = master.address();
    if masters.contains(',') {
        println!("master: {} leads (of {masters})", master.leader());
    }
    println!(
        "cluster: {} hosts, {}/{} chunk servers up, {} of chunk data, {} free of {} \
         on {} file system{}",
        totals.hosts,
        totals.servers_up,
        totals.servers,
        size::format(totals.used_bytes),
        size::format(totals.free_bytes),
        size::format(totals.capacity_bytes),
        totals.file_systems,
        if totals.file_systems == 1 { "" } else { "s" }
    );
    for fs in &file_systems {
        if let Some(warning) = fs.warning() {
            println!("{warning}");
        }
    }
    println!();
    let journals: std::collections::BTreeMap<ServerId, JournalUsage> =
        status.qos.journals.iter().copied().collect();
    println!(
        "{:<4} {:<12} {:<22} {:<14} {:<5} {:>10} {:>16} {:>18}",
        "ID", "HOST", "ADDRESS", "CLASS", "STATE", "USED", "FILE SYSTEM", "JOURNAL"
    );
    for s in &status.servers {
        let journal = journals.get(&s.id).map_or("-".into(), |j| {
            format!(
                "{:.0}% of {}",
                j.used_bytes as f64 * 100.0 / j.quota_bytes as f64,
                size::format(j.quota_bytes)
            )
        });
        let file_system = s.fs.map_or(size::format(s.capacity_bytes), |fs| {
            format!("{}% of {}", fs.percent_used(), size::format(fs.total_bytes))
        });
        println!(
            "{:<4} {:<12} {:<22} {:<14} {:<5} {:>10} {:>16} {:>18}",
            s.id,
            s.host,
            s.address,
            s.device(),
            if s.lost {
                "LOST"
            } else if s.up {
                "up"
            } else {
                "DOWN"
            },
            size::format(s.used_bytes),
            file_system,
            journal
        );
    }
    println!();
    println!("{VOLUME_HEADER}");
    for v in &status.volumes {
        println!("{}", volume_row(v));
    }
    println!();
    if status.qos.throttled.is_empty() {
        println!("throttling: no volume is slowed by journal pressure");
    }
    for t in &status.qos.throttled {
        println!(
            "throttling: volume {} writes at most {}: {}",
            t.volume,
            qos_text(t.writes),
            t.reason
        );
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
    if r.volumes_to_audit > 0 {
        println!(
            "  {} volumes lost their writer without a release: their replicas are being compared",
            r.volumes_to_audit
        );
    }
    if r.waiting_for_operator > 0 {
        println!(
            "  {} chunks have fewer than a majority of replicas reachable: bring their servers back, or declare failed ones lost with `floe chunkserver mark-lost ID`",
            r.waiting_for_operator
        );
    }
    println!(
        "recovery: {} chunks repaired ({} incremental, {} by block compare, {} whole copies), {} copied, {}/s now",
        r.repaired_chunks,
        r.incremental_repairs,
        r.compared_copies,
        r.full_copies,
        size::format(r.bytes_copied),
        size::format(r.bytes_per_second)
    );
    if let Some(error) = &r.last_error {
        println!("  last attempt failed: {error}");
    }
    let m = &status.rebalance;
    println!(
        "placement: {}, cluster map epoch {}, {} layers{}",
        m.mode,
        m.epoch,
        m.layers,
        match m.pending_servers {
            0 => String::new(),
            n => format!("; {n} chunk servers not in the map (`floe cluster expand` adds them)"),
        }
    );
    if m.misplaced_chunks == 0 && m.moving == 0 {
        println!("rebalance: every chunk is where the map places it");
    } else {
        println!(
            "rebalance: {} chunks to move, {} moving{}",
            m.misplaced_chunks,
            m.moving,
            match m.eta_seconds {
                Some(eta) => format!(", about {eta} s left"),
                None => String::new(),
            }
        );
    }
    println!(
        "moves: {} chunks moved, {} copied, {}/s now",
        m.moved_chunks,
        size::format(m.bytes_moved),
        size::format(m.bytes_per_second)
    );
    if let Some(error) = &m.last_error {
        println!("  last move failed: {error}");
    }
    crate::sessions::print_gateways(&status);
    print_integrity(&status);
    print_reclaim(&status);
    Ok(())
}

/// The space of deleted snapshots being freed, for `floe status`.
fn print_reclaim(status: &ClusterStatus) {
    let r = &status.reclaim;
    let limit = match r.limit_per_second {
        0 => "unlimited".to_string(),
        n => format!("at most {n}/s"),
    };
    if r.chunks_left == 0 {
        println!(
            "snapshot space: nothing to free; {} delta chunks freed ({limit})",
            r.chunks_freed
        );
        return;
    }
    println!(
        "snapshot space: {} delta chunks of deleted snapshots to free (up to {}), {}/s now ({limit}){}; {} freed",
        r.chunks_left,
        size::format(r.bytes_left),
        r.chunks_per_second,
        match r.eta_seconds {
            Some(eta) => format!(", about {eta} s left"),
            None => String::new(),
        },
        r.chunks_freed
    );
    if let Some(why) = &r.waiting {
        println!("  waiting: {why}");
    }
}

/// Cluster totals, each file system counted once (six demo servers on one disk are
/// one disk's capacity, not six).
fn totals(servers: &[ServerInfo], file_systems: &[FileSystem]) -> views::Totals {
    let mut hosts: Vec<&str> = servers.iter().map(|s| s.host.as_str()).collect();
    hosts.sort_unstable();
    hosts.dedup();
    views::Totals {
        hosts: hosts.len(),
        servers: servers.len(),
        servers_up: servers.iter().filter(|s| s.up).count(),
        file_systems: file_systems.len(),
        used_bytes: servers.iter().map(|s| s.used_bytes).sum(),
        capacity_bytes: file_systems.iter().map(|f| f.total_bytes()).sum(),
        free_bytes: file_systems.iter().map(|f| f.free_bytes()).sum(),
    }
}

/// Block checksums and the background scrub, for `floe status`.
fn print_integrity(status: &ClusterStatus) {
    let s = &status.scrub;
    let found: u64 = status.servers.iter().map(|s| s.corrupt_blocks).sum();
    println!(
        "integrity: {found} corrupt blocks found by reads, {} healed from good copies, {} lost",
        s.healed_blocks, s.lost_blocks
    );
    for server in status.servers.iter().filter(|s| s.corrupt_blocks > 0) {
        println!(
            "  server {} ({}): {} corrupt blocks found",
            server.id, server.address, server.corrupt_blocks
        );
    }
    for lost in &s.lost {
        println!("  LOST: {lost} (no replica holds a good copy)");
    }
    let schedule = match s.interval_seconds {
        0 => "off".to_string(),
        secs => format!(
            "every {}",
            humantime::format_duration(Duration::from_secs(secs))
        ),
    };
    if s.running {
        println!(
            "scrub: {schedule}; pass {} under way: {}/{} chunks, {}/s{}",
            s.passes + 1,
            s.chunks_checked,
            s.chunks_total,
            size::format(s.bytes_per_second),
            match s.eta_seconds {
                Some(eta) => format!(", about {eta} s left"),
                None => String::new(),
            }
        );
    } else {
        println!("scrub: {schedule}; {} background passes done", s.passes);
    }
}

/// A scrub reads every replica of every chunk before the master answers: as long as
/// that takes.
const SCRUB_WAIT: Duration = Duration::MAX;
pub async fn scrub(master: &MasterClient, name: &str, format: Format) -> Result<(), String> {
    let request = MasterRequest::Scrub {
        name: name.to_string(),
    };
    let call = master.call_within(request, SCRUB_WAIT);
    tokio::pin!(call);
    let mut shown = Progress::new(format!("scrubbing {name}"), Unit::Bytes);
    // A scrub done within the first poll shows no progress at all.
    let mut poll = tokio::time::interval_at(tokio::time::Instant::now() + POLL_EVERY, POLL_EVERY);
    // The reply is read by the connection's own task while a status call is out.
    let reply = loop {
        tokio::select! {
            reply = &mut call => break reply,
            _ = poll.tick() => show_scrub(master, name, &mut shown).await,
        }
    };
    shown.finish();
    let reply = reply.map_err(|e| format!("cannot scrub volume {name}: {e}"))?;
    let MasterResponse::Scrub(report) = reply else {
        return Err(format!("master answered {reply:?}"));
    };
    if format.json {
        views::print(&views::ScrubView::new(name, &report))?;
    } else {
        for detail in &report.details {
            println!("{detail}");
        }
        println!(
            "scrubbed {name}: {} chunks, {} differences, {} repaired, {} blocks healed, {} \
             blocks lost, {} skipped",
            report.chunks,
            report.differences,
            report.repaired,
            report.healed_blocks,
            report.lost_blocks.len(),
            report.skipped
        );
    }
    if !views::is_clean(&report) {
        return Err(format!(
            "volume {name} is not verified clean: see the details"
        ));
    }
    Ok(())
}

/// The master's count of chunks checked by our scrub, as bytes of the volume.
async fn show_scrub(master: &MasterClient, name: &str, shown: &mut Progress) {
    let Ok(status) = master.status().await else {
        return;
    };
    let chunk_bytes = status
        .volumes
        .iter()
        .find(|v| v.spec.name == name)
        .map_or(0, |v| v.spec.chunk_bytes);
    if let Some(p) = status.scrub.volumes.iter().find(|p| p.volume == name) {
        let chunks = format!(" ({}/{} chunks)", p.chunks_checked, p.chunks_total);
        shown.update(
            p.chunks_checked * chunk_bytes,
            p.chunks_total * chunk_bytes,
            &chunks,
        );
    }
}

pub async fn mark_lost(master: &MasterClient, id: ServerId) -> Result<(), String> {
    master
        .call(MasterRequest::MarkLost { id })
        .await
        .map_err(|e| format!("cannot mark chunk server {id} lost: {e}"))?;
    println!("chunk server {id} marked lost; its chunks are recovered from the surviving replicas");
    Ok(())
}

/// Percent of a file system in use from which `floe status` warns, and from which
/// it says writes are about to fail.
const WARN_PERCENT: u64 = 85;
const CRITICAL_PERCENT: u64 = 95;

/// The chunk servers sharing one file system (one host, one device), counted once.
struct FileSystem<'a> {
    servers: Vec<&'a ServerInfo>,
}

impl FileSystem<'_> {
    fn usage(&self) -> Option<FsUsage> {
        self.servers.iter().find_map(|s| s.fs)
    }

    /// Its size from heartbeats; the declared capacity of a server not heard yet.
    fn total_bytes(&self) -> u64 {
        self.usage()
            .map_or(self.servers[0].capacity_bytes, |fs| fs.total_bytes)
    }

    fn free_bytes(&self) -> u64 {
        self.usage().map_or(0, |fs| fs.free_bytes)
    }

    fn warning(&self) -> Option<String> {
        let fs = self.usage()?;
        let percent = fs.percent_used();
        if percent < WARN_PERCENT {
            return None;
        }
        let short = self.servers.iter().any(|s| s.fs.is_some_and(|f| f.short));
        let ids: Vec<String> = self.servers.iter().map(|s| s.id.to_string()).collect();
        let mut hosts: Vec<&str> = self.servers.iter().map(|s| s.host.as_str()).collect();
        hosts.sort_unstable();
        hosts.dedup();
        let mut line = format!(
            "WARNING: the file system of chunk server{} {} on host{} {} is {percent}% full ({} free)",
            if ids.len() == 1 { "" } else { "s" },
            ids.join(", "),
            if hosts.len() == 1 { "" } else { "s" },
            hosts.join(", "),
            size::format(fs.free_bytes)
        );
        if percent >= CRITICAL_PERCENT || short {
            line.push_str(
                ": writes that need space there fail with ENOSPC; delete or trim volumes, \
                 or add chunk servers",
            );
        }
        Some(line)
    }
}

/// The servers grouped by the file system they store on: the same device of the same
/// kernel (or of the same host, from servers that do not report their kernel).
fn file_systems(servers: &[ServerInfo]) -> Vec<FileSystem<'_>> {
    let mut groups: Vec<(FsKey, FileSystem)> = Vec::new();
    for s in servers {
        // A server not heard from yet is a file system of its own.
        let Some(fs) = s.fs else {
            groups.push((FsKey::Unknown, FileSystem { servers: vec![s] }));
            continue;
        };
        let key = match fs.kernel {
            0 => FsKey::Host(&s.host, fs.device),
            kernel => FsKey::Kernel(kernel, fs.device),
        };
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, group)) => group.servers.push(s),
            None => groups.push((key, FileSystem { servers: vec![s] })),
        }
    }
    groups.into_iter().map(|(_, group)| group).collect()
}

#[derive(PartialEq)]
enum FsKey<'a> {
    Kernel(u64, u64),
    Host(&'a str, u64),
    Unknown,
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_protocol::DeviceClass;

    fn server(id: ServerId, host: &str, fs: Option<FsUsage>) -> ServerInfo {
        ServerInfo {
            id,
            uuid: id.to_string(),
            address: format!("127.0.0.1:{id}"),
            host: host.into(),
            class: DeviceClass::Ssd,
            emulated: false,
            capacity_bytes: 100,
            used_bytes: 1,
            up: true,
            lost: false,
            corrupt_blocks: 0,
            fs,
        }
    }

    fn fs(kernel: u64, device: u64) -> Option<FsUsage> {
        Some(FsUsage {
            device,
            kernel,
            total_bytes: 252 << 30,
            free_bytes: 100 << 30,
            ..FsUsage::default()
        })
    }

    /// Six demo servers on three emulated hosts and one disk: one disk's capacity.
    #[test]
    fn servers_sharing_a_file_system_count_once() {
        let servers: Vec<ServerInfo> = ["a", "a", "b", "b", "c", "c"]
            .iter()
            .enumerate()
            .map(|(i, host)| server(i as ServerId + 1, host, fs(7, 2049)))
            .collect();
        let groups = file_systems(&servers);
        let totals = totals(&servers, &groups);
        assert_eq!(totals.file_systems, 1);
        assert_eq!(totals.capacity_bytes, 252 << 30);
        assert_eq!(totals.free_bytes, 100 << 30);
        assert_eq!(totals.used_bytes, 6);
        assert_eq!(totals.hosts, 3);
    }

    #[test]
    fn file_systems_differ_by_kernel_device_or_host() {
        let servers = vec![
            server(1, "a", fs(7, 1)),
            server(2, "a", fs(7, 2)), // another disk of the same kernel
            server(3, "a", fs(8, 1)), // the same device number on another machine
            server(4, "a", fs(0, 1)), // no kernel id: host and device
            server(5, "b", fs(0, 1)), // no kernel id, another host
            server(6, "b", fs(0, 1)), // shares server 5's
            server(7, "b", None),     // not heard from yet: its declared capacity
        ];
        let groups = file_systems(&servers);
        let sizes: Vec<usize> = groups.iter().map(|g| g.servers.len()).collect();
        assert_eq!(sizes, [1, 1, 1, 1, 2, 1]);
        assert_eq!(
            totals(&servers, &groups).capacity_bytes,
            5 * (252 << 30) + 100
        );
    }
}
