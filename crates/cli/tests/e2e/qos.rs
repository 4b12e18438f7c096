//! Per-volume rate limits: fio through the gateway while an operator sets, changes and
//! clears a volume's limits, and a real master throttling a volume's writes when a
//! chunk server holding its chunks reports a nearly full journal.

use crate::cluster::{free_ports, output, Cluster, FLOE};
use crate::io_helpers::{floe_output, text};
use floe_client::master::MasterClient;
use floe_protocol::{
    ControlRequest, ControlResponse, DeviceClass, QosLimits, ServerId, VolumeLimits, VolumeMode,
    VolumeSpec,
};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const IOPS_LIMIT: f64 = 300.0;
const BANDWIDTH_LIMIT_MIB: f64 = 8.0;
/// Measured rates may exceed a limit by the burst and by timing noise, not more.
const LIMIT_SLACK: f64 = 1.3;

/// fio's nbd engine writing randomly over the first 512 MiB for `seconds`.
fn fio(uri: &str, work: &Path, bs: &str, seconds: u32) -> Command {
    let mut command = Command::new("fio");
    command.current_dir(work).args([
        "--name=qos",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        &format!("--bs={bs}"),
        "--size=512M",
        "--iodepth=16",
        "--time_based",
        &format!("--runtime={seconds}"),
    ]);
    command
}

/// Write bandwidth in MiB/s of a fio run with JSON output.
fn bandwidth_mib(command: &mut Command) -> f64 {
    let out = output(command.arg("--output-format=json"));
    let all = text(&out);
    assert!(out.status.success(), "fio failed:\n{all}");
    // The nbd engine prints a line before the JSON.
    let json = &all[all.find('{').expect("fio JSON")..];
    let report: serde_json::Value = serde_json::Deserializer::from_str(json)
        .into_iter()
        .next()
        .expect("a JSON document")
        .expect("fio JSON parses");
    report["jobs"][0]["write"]["bw_bytes"]
        .as_f64()
        .expect("bw_bytes")
        / (1 << 20) as f64
}

/// fio's per-second IOPS log: (end of the second in fio's time, IOPS).
fn iops_log(path: &Path) -> Vec<(f64, f64)> {
    let log = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    log.lines()
        .map(|line| {
            let fields: Vec<f64> = line
                .split(',')
                .take(2)
                .map(|f| f.trim().parse().expect("a number"))
                .collect();
            (fields[0] / 1000.0, fields[1])
        })
        .collect()
}

/// Mean IOPS of the seconds lying inside `[from, to]` of wall time since fio was
/// started. fio's clock starts a little after (it connects first), so a second ending
/// at fio time `t` lies within wall time `[t - 1, t + START_SLACK]`.
fn mean_iops(samples: &[(f64, f64)], from: f64, to: f64) -> f64 {
    const START_SLACK: f64 = 0.5;
    let inside: Vec<f64> = samples
        .iter()
        .filter(|(t, _)| t - 1.0 >= from && t + START_SLACK <= to)
        .map(|(_, iops)| *iops)
        .collect();
    assert!(
        !inside.is_empty(),
        "no whole second of fio between {from:.1} s and {to:.1} s: {samples:?}"
    );
    inside.iter().sum::<f64>() / inside.len() as f64
}

fn refused(cluster: &Cluster, args: &[&str], why: &str) {
    let out = floe_output(cluster, args);
    let all = text(&out);
    assert!(
        !out.status.success() && all.contains(why),
        "floe {args:?} should be refused with {why:?}:\n{all}"
    );
}

#[test]
fn limits_hold_fio_and_follow_changes_without_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();

    // Admin commands: shown where the operator looks, bad values refused clearly.
    cluster.floe(&[
        "volume",
        "create",
        "capped",
        "--size",
        "64M",
        "--iops",
        "100",
        "--bandwidth",
        "10M",
    ]);
    let list = cluster.floe(&["volume", "list"]);
    let capped = list
        .lines()
        .find(|l| l.starts_with("capped "))
        .unwrap_or_else(|| panic!("{list}"));
    assert!(
        capped.contains(" 100 ") && capped.contains("10.0 MiB/s"),
        "{list}"
    );
    cluster.floe(&["volume", "set-qos", "capped", "--bandwidth", "unlimited"]);
    let info = cluster.floe(&["volume", "info", "capped"]);
    assert!(
        info.contains("limits:        100 IOPS, unlimited bandwidth"),
        "{info}"
    );
    refused(
        &cluster,
        &["volume", "set-qos", "demo", "--iops", "-5"],
        "not a whole number",
    );
    refused(
        &cluster,
        &["volume", "set-qos", "demo", "--iops", "lots"],
        "not a whole number",
    );
    refused(
        &cluster,
        &["volume", "set-qos", "demo", "--bandwidth", "-1M"],
        "bandwidth",
    );
    refused(
        &cluster,
        &["volume", "set-qos", "demo", "--bandwidth", "fast"],
        "bandwidth",
    );
    refused(&cluster, &["volume", "set-qos", "demo"], "give --iops");
    refused(
        &cluster,
        &["volume", "set-qos", "nope", "--iops", "5"],
        "does not exist",
    );

    // One fio run: unlimited, then limited while it runs (the gateway learns it at a
    // lease renewal, every 1.7 s), then cleared again.
    let started = Instant::now();
    let mut run = fio(&uri, work.path(), "4k", 16)
        .args(["--write_iops_log=qos", "--log_avg_msec=1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("fio starts");
    let at = |seconds: f64| {
        std::thread::sleep(Duration::from_secs_f64(seconds).saturating_sub(started.elapsed()));
    };
    at(3.5);
    cluster.floe(&[
        "volume",
        "set-qos",
        "demo",
        "--iops",
        &IOPS_LIMIT.to_string(),
    ]);
    let limited_at = started.elapsed().as_secs_f64();
    at(10.5);
    cluster.floe(&["volume", "set-qos", "demo", "--iops", "0"]);
    let cleared_at = started.elapsed().as_secs_f64();
    assert!(run.wait().unwrap().success(), "fio failed");
    let samples = iops_log(&work.path().join("qos_iops.1.log"));
    // Renewal period, the master call and fio's one-second averaging.
    const TAKES_EFFECT: f64 = 2.5;
    let free = mean_iops(&samples, 1.0, limited_at);
    let limited = mean_iops(&samples, limited_at + TAKES_EFFECT, cleared_at);
    let lifted = mean_iops(&samples, cleared_at + TAKES_EFFECT, f64::MAX);
    eprintln!("4k randwrite IOPS: {free:.0} free, {limited:.0} at a limit of {IOPS_LIMIT}, {lifted:.0} cleared; {samples:?}");
    assert!(
        limited <= IOPS_LIMIT * LIMIT_SLACK,
        "limit not held: {limited:.0} IOPS"
    );
    assert!(
        free > 2.0 * IOPS_LIMIT,
        "too slow to see a limit: {free:.0} IOPS"
    );
    assert!(
        lifted > 2.0 * IOPS_LIMIT,
        "limit not lifted: {lifted:.0} IOPS"
    );

    // Bandwidth, set while the volume is closed: the next open's lease grant has it.
    let free = bandwidth_mib(&mut fio(&uri, work.path(), "1M", 4));
    cluster.floe(&[
        "volume",
        "set-qos",
        "demo",
        "--bandwidth",
        &format!("{BANDWIDTH_LIMIT_MIB}M/s"),
    ]);
    let limited = bandwidth_mib(&mut fio(&uri, work.path(), "1M", 5));
    eprintln!("1M randwrite: {free:.1} MiB/s free, {limited:.1} MiB/s at a limit of {BANDWIDTH_LIMIT_MIB} MiB/s");
    assert!(
        limited <= BANDWIDTH_LIMIT_MIB * LIMIT_SLACK,
        "limit not held: {limited:.1} MiB/s"
    );
    assert!(
        free > BANDWIDTH_LIMIT_MIB * LIMIT_SLACK,
        "too slow to see a limit: {free:.1} MiB/s"
    );
}

/// A `floe master` process, killed when dropped.
struct Master(Child);

impl Drop for Master {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn call(master: &MasterClient, request: ControlRequest) -> ControlResponse {
    let what = format!("{request:?}");
    master
        .call(request)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Heartbeats from every fake server, with `journal` (used, quota) from `full` only.
async fn heartbeat(master: &MasterClient, ids: &[ServerId], full: ServerId, journal: (u64, u64)) {
    for &id in ids {
        let (used, quota) = if id == full { journal } else { (0, 0) };
        call(
            master,
            ControlRequest::Heartbeat {
                id,
                used_bytes: 0,
                journal_used_bytes: used,
                journal_quota_bytes: quota,
            },
        )
        .await;
    }
}

async fn renew(master: &MasterClient, generation: u32) -> VolumeLimits {
    let reply = ControlRequest::RenewLease {
        name: "pressed".into(),
        generation,
    };
    match call(master, reply).await {
        ControlResponse::Lease { limits, .. } => limits,
        other => panic!("renewal answered {other:?}"),
    }
}

/// The test plays four chunk servers on four hosts towards a real master, over the wire.
#[test]
fn journal_pressure_throttles_writes_until_it_drains() {
    let dir = tempfile::tempdir().unwrap();
    let address = format!("127.0.0.1:{}", free_ports());
    let metadata = format!("embedded:{}", dir.path().join("meta.redb").display());
    let log = std::fs::File::create(dir.path().join("master.log")).unwrap();
    let _master = Master(
        Command::new(FLOE)
            .args(["master", "--listen", &address, "--metadata", &metadata])
            .stderr(log)
            .spawn()
            .expect("floe master starts"),
    );
    let status = || {
        let out = output(Command::new(FLOE).args(["--master", &address, "status"]));
        assert!(out.status.success(), "{}", text(&out));
        text(&out)
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let master = MasterClient::new(&address);
    let (ids, chunk_holders, generation) = runtime.block_on(async {
        let ready = Instant::now() + Duration::from_secs(20);
        while master.status().await.is_err() {
            assert!(Instant::now() < ready, "master not serving at {address}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut ids = Vec::new();
        for i in 0..4 {
            let register = ControlRequest::Register {
                uuid: format!("fake-{i}"),
                address: format!("127.0.0.1:{}", 1 + i),
                host: format!("host-{i}"),
                class: DeviceClass::Ssd,
                capacity_bytes: 1 << 40,
                emulated: false,
            };
            match call(&master, register).await {
                ControlResponse::Registered { id } => ids.push(id),
                other => panic!("registration answered {other:?}"),
            }
        }
        master
            .create_volume(VolumeSpec {
                name: "pressed".into(),
                size_bytes: 1 << 30,
                replicas: 3,
                chunk_bytes: 64 << 20,
                stripe_unit_bytes: 64 << 10,
                stripe_count: 4,
                mode: VolumeMode::Ssd,
            })
            .await
            .unwrap();
        master.set_qos("pressed", Some(1000), None).await.unwrap();
        let volume_id = master.volume_map("pressed").await.unwrap().volume.id;
        let allocate = ControlRequest::AllocateChunk {
            volume_id,
            index: 0,
            proposal: None,
        };
        let ControlResponse::Chunk { placement, .. } = call(&master, allocate).await else {
            panic!("no placement");
        };
        let acquire = ControlRequest::AcquireLease {
            name: "pressed".into(),
            holder: "qos test".into(),
        };
        let ControlResponse::Lease {
            generation, limits, ..
        } = call(&master, acquire).await
        else {
            panic!("no lease");
        };
        let operator = QosLimits {
            iops: 1000,
            bytes_per_second: 0,
        };
        assert_eq!(
            limits,
            VolumeLimits {
                all: operator,
                writes: operator
            }
        );
        (ids, placement.replicas, generation)
    });
    let outsider = *ids.iter().find(|id| !chunk_holders.contains(id)).unwrap();
    let holder = chunk_holders[1];
    let operator = QosLimits {
        iops: 1000,
        bytes_per_second: 0,
    };

    // A full journal on a server without the volume's chunks does not slow it.
    let limits = runtime.block_on(async {
        heartbeat(&master, &ids, outsider, (99 << 20, 100 << 20)).await;
        renew(&master, generation).await
    });
    assert_eq!(
        limits.writes, operator,
        "throttled by a server it does not use"
    );
    assert!(status().contains("99% of 100.0 MiB"), "{}", status());

    // 90% on a holder: writes at (1 + floor) / 2 of the operator's IOPS and of the
    // default base bandwidth; reads keep the operator's limits.
    let limits = runtime.block_on(async {
        heartbeat(&master, &ids, holder, (90 << 20, 100 << 20)).await;
        renew(&master, generation).await
    });
    let fraction = (1.0 + floe_master::qos::PRESSURE_FLOOR) / 2.0;
    assert_eq!(limits.all, operator);
    assert_eq!(limits.writes.iops, (1000.0 * fraction) as u64);
    assert_eq!(
        limits.writes.bytes_per_second,
        (floe_master::qos::PRESSURE_BASE.bytes_per_second as f64 * fraction) as u64
    );
    let shown = status();
    assert!(
        shown.contains(&format!(
            "throttling: volume pressed writes at most {} IOPS",
            limits.writes.iops
        )) && shown.contains(&format!("the journal of chunk server {holder} is 90% full")),
        "{shown}"
    );

    // Drained below 80%: released.
    let limits = runtime.block_on(async {
        heartbeat(&master, &ids, holder, (50 << 20, 100 << 20)).await;
        renew(&master, generation).await
    });
    assert_eq!(limits.writes, operator, "not released");
    assert!(status().contains("no volume is slowed"), "{}", status());
}
