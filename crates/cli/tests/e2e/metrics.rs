//! Metrics: every process serves `/metrics`; the gateway counts exactly the requests
//! fio made, the chunk servers the replica writes they took; `floe top` reads them;
//! the Grafana dashboard names only metrics the processes export.

use crate::cluster::{ok, Cluster, TestDir, FLOE};
use crate::fio_job::{json_report, FioJob};
use floe_metrics::scrape::{self, Sample};
use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

const REQUESTS: &str = "floe_gateway_request_duration_seconds";

fn samples(url: &str) -> Vec<Sample> {
    let page = scrape::fetch(url).unwrap_or_else(|e| panic!("cannot scrape {url}: {e}"));
    scrape::parse(&page)
}

/// The sum of the samples named `name` whose labels include `labels`.
fn total(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v)))
        .map(|s| s.value)
        .sum()
}

fn chunk_servers(cluster: &Cluster) -> Vec<&String> {
    let urls: Vec<&String> = cluster
        .info
        .metrics
        .iter()
        .filter(|(name, _)| name.starts_with("chunkserver-"))
        .map(|(_, url)| url)
        .collect();
    assert_eq!(
        urls.len(),
        6,
        "demo.json names every chunk server's metrics"
    );
    urls
}

/// The chunk servers' `op` bytes, summed.
fn replica_bytes(cluster: &Cluster, op: &str) -> f64 {
    let name = "floe_chunkserver_request_bytes_total";
    chunk_servers(cluster)
        .iter()
        .map(|url| total(&samples(url), name, &[("op", op)]))
        .sum()
}

#[test]
fn gateway_counts_every_request_fio_makes() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let gateway = cluster.info.metrics["gateway"].clone();
    let volume = [("volume", "demo")];
    let count = format!("{REQUESTS}_count");
    let before = samples(&gateway);
    let replica_writes_before = replica_bytes(&cluster, "write");

    let fio = FioJob::new("mixed", cluster.uri(), work.path())
        .rw("randrw")
        .bs("4k")
        .size("256M")
        .io_size("16M")
        .iodepth(16)
        .json();
    let mut running = fio.spawn();
    // Scrapes while fio runs never see a count go back.
    let mut seen = total(&before, &count, &volume);
    let mut scrapes = 0.0;
    while running.try_wait().unwrap().is_none() {
        let now = total(&samples(&gateway), &count, &volume);
        scrapes += 1.0;
        assert!(now >= seen, "request count went from {seen} to {now}");
        seen = now;
        std::thread::sleep(Duration::from_millis(200));
    }
    let report = json_report(&running.wait_with_output().unwrap(), "randrw");
    let after = samples(&gateway);

    let job = &report["jobs"][0];
    for (op, direction) in [("read", "read"), ("write", "write")] {
        let labels = [("volume", "demo"), ("op", op)];
        let delta = |name: &str| total(&after, name, &labels) - total(&before, name, &labels);
        let ios = job[direction]["total_ios"].as_f64().unwrap();
        let bytes = job[direction]["io_bytes"].as_f64().unwrap();
        assert!(ios > 0.0, "fio made no {op}s: {job}");
        // A histogram's samples go to metrics-util's AtomicBucket, whose drain at a
        // scrape can miss a sample pushed at that very moment (the pusher loaded the
        // block before the drain swapped it out, and writes into it after): each scrape
        // made while fio ran may have lost one. The byte counters are exact.
        let counted = delta(&count);
        assert!(
            counted <= ios && counted >= ios - scrapes,
            "{op} requests counted: {counted}, fio made {ios}, {scrapes} scrapes while it ran"
        );
        assert_eq!(
            delta("floe_gateway_request_bytes_total"),
            bytes,
            "{op} bytes"
        );
        // The histogram's buckets hold every request it counted.
        let bucket = format!("{REQUESTS}_bucket");
        let in_buckets = total(&after, &bucket, &[labels[0], labels[1], ("le", "+Inf")]);
        assert_eq!(in_buckets, total(&after, &count, &labels));
    }
    // fio sent nothing else but its flushes.
    for op in ["trim", "zero", "block_status"] {
        let labels = [("volume", "demo"), ("op", op)];
        assert_eq!(total(&after, &count, &labels), 0.0, "{op} requests");
    }
    // fio has every reply: nothing is in flight.
    assert_eq!(total(&after, "floe_gateway_queue_depth", &volume), 0.0);

    // Three replicas took each write (a retry or catch-up only adds).
    let written = job["write"]["io_bytes"].as_f64().unwrap();
    let replicated = replica_bytes(&cluster, "write") - replica_writes_before;
    assert!(
        replicated >= 3.0 * written,
        "chunk servers took {replicated} bytes of replica writes for {written} written"
    );
    let fsyncs: f64 = chunk_servers(&cluster)
        .iter()
        .map(|url| {
            total(
                &samples(url),
                "floe_chunkstore_fsync_duration_seconds_count",
                &[],
            )
        })
        .sum();
    assert!(fsyncs > 0.0, "no log fsync recorded");

    // The master samples leases every second: the writer's generation shows.
    let master = &cluster.info.metrics["master"];
    let deadline = Instant::now() + Duration::from_secs(10);
    while total(&samples(master), "floe_master_lease_generation", &volume) < 1.0 {
        assert!(Instant::now() < deadline, "no lease generation for demo");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn top_and_the_dashboard_read_what_the_processes_export() {
    let dir = TestDir::new();
    let work = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let gateway = &cluster.info.metrics["gateway"];
    let fio = FioJob::new("fill", cluster.uri(), work.path())
        .rw("randwrite")
        .bs("4k")
        .size("64M")
        .io_size("4M")
        .iodepth(16);
    crate::fio_job::assert_clean(&fio.run(), "randwrite");
    cluster.floe(&["scrub", "demo"]);

    // One frame per second, a row per volume; an endpoint down is one line, not a stop.
    let top = ok(Command::new(FLOE).args([
        "top",
        "--metrics",
        &format!("{gateway},127.0.0.1:1"),
        "--count",
        "2",
    ]));
    let rows: Vec<&str> = top.lines().filter(|l| l.starts_with("demo ")).collect();
    assert_eq!(rows.len(), 2, "a row for demo in each frame:\n{top}");
    assert_eq!(top.matches("127.0.0.1:1: unreachable").count(), 2, "{top}");

    let mut exported = BTreeSet::new();
    for url in cluster.info.metrics.values() {
        exported.extend(samples(url).into_iter().map(|s| s.name));
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../dashboards/floe.json");
    let text = std::fs::read_to_string(path).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {} has no query", panel["title"]);
        queries.extend(
            targets
                .iter()
                .map(|t| t["expr"].as_str().unwrap().to_string()),
        );
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(query) = variable["query"]["query"].as_str() {
            queries.push(query.to_string());
        }
    }
    assert!(queries.len() > 20, "only {} queries found", queries.len());
    let mut named = 0;
    for query in &queries {
        for name in metric_names(query) {
            named += 1;
            assert!(
                exported.contains(&name),
                "dashboard query {query:?} names {name}, which no process exports"
            );
        }
    }
    assert!(named >= queries.len(), "some queries name no metric");
}

/// The `floe_*` metric names a PromQL query mentions.
fn metric_names(query: &str) -> Vec<String> {
    query
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("floe_"))
        .map(str::to_string)
        .collect()
}
