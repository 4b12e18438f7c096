//! Per-volume rate limits: fio through the gateway while an operator sets, changes and
//! clears a volume's limits, and a real master throttling a volume's writes when a
//! chunk server holding its chunks reports a nearly full journal.

use crate::cluster::{free_ports, output, volume, Cluster, FLOE};
use crate::fio_job::{interrupt, iops_log, json_report, FioJob, IopsSample};
use crate::io_helpers::{floe_output, text, wait_for_file};
use floe_client::master::MasterClient;
use floe_protocol::{
    DeviceClass, MasterRequest, MasterResponse, QosLimits, Registration, ServerId, VolumeLimits,
    VolumeMode, VolumeSpec,
};
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant, SystemTime};

/// Limits are this fraction of the rate the volume reaches without one, measured
/// first, so that a slow or busy machine sees them as clearly as a fast one. An
/// unenforced limit then shows as about five times the limit, and the machine may slow
/// down almost fourfold (to LIMIT_FRACTION * LIMIT_SLACK of its free rate) before a
/// lifted limit cannot be told from a held one.
const LIMIT_FRACTION: f64 = 0.2;
/// Measured rates may exceed a limit by the burst and by timing noise, not more.
const LIMIT_SLACK: f64 = 1.3;
/// Below these a few seconds of fio cannot measure a limit to LIMIT_SLACK: the token
/// buckets let whole requests through (1 MiB ones here) and a second's count is whole.
const IOPS_LIMIT_MIN: u64 = 10;
const BANDWIDTH_LIMIT_MIN_KIB: u64 = 1024;
/// Whole seconds of fio's IOPS log measured under a limit and after it is cleared.
const MEASURED_SECONDS: u64 = 5;
/// After the gateway logs a change: requests that passed the old limit still complete.
const SETTLE: Duration = Duration::from_secs(1);
/// The gateway learns of a change at its next lease renewal (every 1.7 s); this bounds
/// only a gateway that never does, however busy the machine.
const APPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// The limited run is ended by the test once it has measured; this only bounds it.
const LIMITED_RUN_SECONDS_MAX: u64 = 600;

/// fio's nbd engine writing randomly over the first 512 MiB.
fn qos_job(name: &str, uri: &str, work: &Path, bs: &str) -> FioJob {
    FioJob::new(name, uri, work)
        .rw("randwrite")
        .bs(bs)
        .size("512M")
        .iodepth(16)
}

/// Write IOPS and bandwidth in MiB/s of a `seconds` run of [`qos_job`].
fn measure(uri: &str, work: &Path, bs: &str, seconds: u64) -> (f64, f64) {
    let report = json_report(
        &qos_job("measure", uri, work, bs)
            .runtime(seconds)
            .json()
            .run(),
        &format!("{bs} randwrite"),
    );
    let write = &report["jobs"][0]["write"];
    let iops = write["iops"].as_f64().expect("iops");
    let bandwidth = write["bw_bytes"].as_f64().expect("bw_bytes");
    (iops, bandwidth / (1 << 20) as f64)
}

/// Mean IOPS of the logged seconds lying wholly inside `[from, to]`.
fn mean_iops(samples: &[IopsSample], from: SystemTime, to: SystemTime) -> f64 {
    let inside: Vec<f64> = samples
        .iter()
        .filter(|s| s.end - Duration::from_secs(1) >= from && s.end <= to)
        .map(|s| s.iops)
        .collect();
    assert!(
        !inside.is_empty(),
        "no whole second of fio between {from:?} and {to:?}: {samples:?}"
    );
    inside.iter().sum::<f64>() / inside.len() as f64
}

/// How many times the gateway has logged `event`.
fn gateway_events(cluster: &Cluster, event: &str) -> usize {
    std::fs::read_to_string(cluster.dir.join("logs/gateway.log"))
        .unwrap_or_default()
        .matches(event)
        .count()
}

/// Waits until the gateway has logged `event` more than `seen` times.
fn await_gateway_event(cluster: &Cluster, event: &str, seen: usize) {
    let log = wait_for_file(
        &cluster.dir.join("logs/gateway.log"),
        APPLY_TIMEOUT,
        |log| log.matches(event).count() > seen,
    );
    assert!(
        log.matches(event).count() > seen,
        "the gateway did not log {event:?} within {APPLY_TIMEOUT:?}:\n{log}"
    );
}

/// Sleeps until `when`.
fn sleep_until(when: SystemTime) {
    if let Ok(left) = when.duration_since(SystemTime::now()) {
        std::thread::sleep(left);
    }
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
    let list = cluster.floe_json(&["volume", "list"]);
    let capped = volume(&list, "capped").unwrap_or_else(|| panic!("{list}"));
    assert_eq!(capped["qos"]["iops"], 100, "{list}");
    assert_eq!(capped["qos"]["bytes_per_second"], 10u64 << 20, "{list}");
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

    // The rate without a limit first: the limits are a fraction of it. This run also
    // allocates the chunks, so the limited run does not wait on the master.
    let (free_iops, _) = measure(&uri, work.path(), "4k", 4);
    let iops_limit = ((free_iops * LIMIT_FRACTION) as u64).max(IOPS_LIMIT_MIN);
    let limit = iops_limit as f64;
    assert!(
        free_iops > limit * LIMIT_SLACK,
        "{free_iops:.0} IOPS without a limit cannot tell a limit of {iops_limit} from none"
    );

    // One fio run (one connection): limited while it runs, then cleared. The gateway
    // learns each change at a lease renewal and logs it; each measured stretch starts
    // once it has.
    const ACQUIRED: &str = "lease acquired";
    const CHANGED: &str = "rate limits changed";
    let acquired = gateway_events(&cluster, ACQUIRED);
    let changed = gateway_events(&cluster, CHANGED);
    let job = qos_job("qos", &uri, work.path(), "4k")
        .runtime(LIMITED_RUN_SECONDS_MAX)
        .iops_log()
        .json();
    let run = job.spawn();
    // Set before fio's connection holds the lease, the limit would come with the grant
    // and no change would be logged. fio's nbd engine connects twice: once to learn
    // the size (the volume closes again), then for the I/O.
    const FIO_CONNECTIONS: usize = 2;
    await_gateway_event(&cluster, ACQUIRED, acquired + FIO_CONNECTIONS - 1);
    cluster.floe(&[
        "volume",
        "set-qos",
        "demo",
        "--iops",
        &iops_limit.to_string(),
    ]);
    await_gateway_event(&cluster, CHANGED, changed);
    let limited_from = SystemTime::now() + SETTLE;
    // One second more than measured: fio's seconds do not start on ours.
    sleep_until(limited_from + Duration::from_secs(MEASURED_SECONDS + 1));
    // The limit holds until the gateway learns it is cleared, which is later.
    let limited_to = SystemTime::now();
    cluster.floe(&["volume", "set-qos", "demo", "--iops", "0"]);
    await_gateway_event(&cluster, CHANGED, changed + 1);
    let lifted_from = SystemTime::now() + SETTLE;
    sleep_until(lifted_from + Duration::from_secs(MEASURED_SECONDS + 1));
    let lifted_to = SystemTime::now();
    interrupt(run, "4k randwrite under a changing limit");
    assert_eq!(
        gateway_events(&cluster, ACQUIRED),
        acquired + FIO_CONNECTIONS,
        "the volume was opened again while its limits changed"
    );
    let samples = iops_log(&job.iops_log_path());
    let limited = mean_iops(&samples, limited_from, limited_to);
    let lifted = mean_iops(&samples, lifted_from, lifted_to);
    let seconds: Vec<f64> = samples.iter().map(|s| s.iops).collect();
    eprintln!("4k randwrite IOPS: {free_iops:.0} free, {limited:.0} at a limit of {iops_limit}, {lifted:.0} cleared; each second: {seconds:?}");
    assert!(
        limited <= limit * LIMIT_SLACK,
        "limit not held: {limited:.0} IOPS at a limit of {iops_limit}"
    );
    assert!(
        lifted > limit * LIMIT_SLACK,
        "limit not lifted: {lifted:.0} IOPS after clearing a limit of {iops_limit} \
         ({free_iops:.0} IOPS before any limit)"
    );

    // Bandwidth, set while the volume is closed: the next open's lease grant has it.
    let (_, free) = measure(&uri, work.path(), "1M", 4);
    let limit_kib = ((free * 1024.0 * LIMIT_FRACTION) as u64).max(BANDWIDTH_LIMIT_MIN_KIB);
    let limit = limit_kib as f64 / 1024.0;
    assert!(
        free > limit * LIMIT_SLACK,
        "{free:.1} MiB/s without a limit cannot tell a limit of {limit:.1} MiB/s from none"
    );
    cluster.floe(&[
        "volume",
        "set-qos",
        "demo",
        "--bandwidth",
        &format!("{limit_kib}K/s"),
    ]);
    let (_, limited) = measure(&uri, work.path(), "1M", 5);
    eprintln!(
        "1M randwrite: {free:.1} MiB/s free, {limited:.1} MiB/s at a limit of {limit:.1} MiB/s"
    );
    assert!(
        limited <= limit * LIMIT_SLACK,
        "limit not held: {limited:.1} MiB/s at a limit of {limit:.1} MiB/s"
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

async fn call(master: &MasterClient, request: MasterRequest) -> MasterResponse {
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
            MasterRequest::Heartbeat {
                id,
                used_bytes: 0,
                journal_used_bytes: used,
                journal_quota_bytes: quota,
                corrupt_blocks: Vec::new(),
                fs: None,
            },
        )
        .await;
    }
}

async fn renew(master: &MasterClient, generation: u32) -> VolumeLimits {
    let reply = MasterRequest::RenewLease {
        name: "pressed".into(),
        generation,
    };
    match call(master, reply).await {
        MasterResponse::Lease { limits, .. } => limits,
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
            let register = MasterRequest::Register(Registration {
                uuid: format!("fake-{i}"),
                address: format!("127.0.0.1:{}", 1 + i),
                host: format!("host-{i}"),
                class: DeviceClass::Ssd,
                capacity_bytes: 1 << 40,
                emulated: false,
            });
            match call(&master, register).await {
                MasterResponse::Registered { id } => ids.push(id),
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
                write_mode: Default::default(),
            })
            .await
            .unwrap();
        master.set_qos("pressed", Some(1000), None).await.unwrap();
        let volume_id = master.volume_map("pressed").await.unwrap().volume.id;
        let allocate = MasterRequest::AllocateChunk {
            volume_id,
            index: 0,
            proposal: None,
            epoch: 0,
            generation: 0,
        };
        let MasterResponse::Chunk { placement, .. } = call(&master, allocate).await else {
            panic!("no placement");
        };
        let acquire = MasterRequest::AcquireLease {
            name: "pressed".into(),
            holder: "qos test".into(),
            attempt: 0,
        };
        let MasterResponse::Lease {
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
