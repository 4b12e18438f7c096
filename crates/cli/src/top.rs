//! `floe top`: a live per-volume view of the gateways' I/O, from the deltas of their
//! `/metrics` between two scrapes a second apart (requests, bytes, latency buckets).

use floe_gateway::measured::{QUEUE_DEPTH, REQUEST_BYTES, REQUEST_DURATION};
use floe_metrics::scrape::{self, Sample};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

const REFRESH: Duration = Duration::from_secs(1);

#[derive(clap::Args)]
pub struct TopArgs {
    /// The gateways' metrics (`http://HOST:PORT/metrics` or `HOST:PORT`),
    /// comma-separated; the default is `floe demo`'s gateway.
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1:10819")]
    metrics: Vec<String>,
    /// Stop after this many refreshes (default: until interrupted).
    #[arg(long)]
    count: Option<u64>,
}

/// One volume's counters summed over the gateways, as scraped.
#[derive(Default, Clone)]
struct Totals {
    reads: f64,
    writes: f64,
    /// Flushes, trims, zeroes, block status.
    others: f64,
    read_bytes: f64,
    write_bytes: f64,
    /// Cumulative request count at each bucket bound (seconds), all ops together.
    buckets: BTreeMap<u64, (f64, f64)>,
    queue_depth: f64,
}

impl Totals {
    fn add(&mut self, sample: &Sample) {
        let op = sample.label("op").unwrap_or_default();
        if sample.name == format!("{REQUEST_DURATION}_count") {
            match op {
                "read" => self.reads += sample.value,
                "write" => self.writes += sample.value,
                _ => self.others += sample.value,
            }
        } else if sample.name == format!("{REQUEST_DURATION}_bucket") {
            let Some(bound) = sample.label("le").and_then(|le| le.parse::<f64>().ok()) else {
                return;
            };
            // Keyed by the bound's bits: positive floats sort as their bits do.
            let entry = self.buckets.entry(bound.to_bits()).or_insert((bound, 0.0));
            entry.1 += sample.value;
        } else if sample.name == REQUEST_BYTES {
            match op {
                "read" => self.read_bytes += sample.value,
                "write" => self.write_bytes += sample.value,
                _ => {}
            }
        } else if sample.name == QUEUE_DEPTH {
            self.queue_depth += sample.value;
        }
    }

    /// The `q` quantile of the requests between `before` and `self`, interpolated
    /// within its bucket as Prometheus's `histogram_quantile` does; `None`: no request.
    fn quantile_since(&self, before: &Totals, q: f64) -> Option<f64> {
        let delta: Vec<(f64, f64)> = self
            .buckets
            .iter()
            .map(|(bits, (bound, count))| {
                let earlier = before.buckets.get(bits).map_or(0.0, |b| b.1);
                (*bound, count - earlier)
            })
            .collect();
        let total = delta.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(bound, count) in &delta {
            if count >= rank {
                if bound.is_infinite() {
                    return Some(lower.0);
                }
                let within = (rank - lower.1) / (count - lower.1).max(f64::MIN_POSITIVE);
                return Some(lower.0 + (bound - lower.0) * within);
            }
            lower = (bound, count);
        }
        Some(lower.0)
    }
}

/// Every volume's totals, and one line per gateway that could not be scraped.
fn scrape_all(urls: &[String]) -> (BTreeMap<String, Totals>, Vec<String>) {
    let mut volumes: BTreeMap<String, Totals> = BTreeMap::new();
    let mut errors = Vec::new();
    for url in urls {
        match scrape::fetch(url) {
            Ok(page) => {
                for sample in scrape::parse(&page) {
                    if let Some(volume) = sample.label("volume") {
                        volumes.entry(volume.to_string()).or_default().add(&sample);
                    }
                }
            }
            Err(e) => errors.push(e),
        }
    }
    (volumes, errors)
}

fn frame(
    now: &BTreeMap<String, Totals>,
    before: &BTreeMap<String, Totals>,
    seconds: f64,
    errors: &[String],
) -> String {
    let mut out = format!(
        "{:<24} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>6}\n",
        "VOLUME", "READ/s", "WRITE/s", "READ MB/s", "WRITE MB/s", "p50 ms", "p99 ms", "QUEUE"
    );
    let empty = Totals::default();
    for (volume, totals) in now {
        let was = before.get(volume).unwrap_or(&empty);
        let rate = |now: f64, was: f64| (now - was).max(0.0) / seconds;
        let millis = |q| {
            totals
                .quantile_since(was, q)
                .map_or("-".to_string(), |s| format!("{:.2}", s * 1e3))
        };
        out += &format!(
            "{:<24} {:>9.0} {:>9.0} {:>9.1} {:>10.1} {:>9} {:>9} {:>6.0}\n",
            volume,
            rate(totals.reads, was.reads),
            rate(totals.writes, was.writes),
            rate(totals.read_bytes, was.read_bytes) / 1e6,
            rate(totals.write_bytes, was.write_bytes) / 1e6,
            millis(0.5),
            millis(0.99),
            totals.queue_depth,
        );
    }
    if now.is_empty() && errors.is_empty() {
        out += "(no volume open on these gateways)\n";
    }
    for error in errors {
        out += &format!("{error}\n");
    }
    out
}

pub fn run(args: TopArgs) -> Result<(), String> {
    let terminal = std::io::stdout().is_terminal();
    let (mut before, _) = scrape_all(&args.metrics);
    let mut taken = Instant::now();
    let mut shown = 0;
    while args.count.is_none_or(|count| shown < count) {
        std::thread::sleep(REFRESH.saturating_sub(taken.elapsed()));
        let (now, errors) = scrape_all(&args.metrics);
        let seconds = taken.elapsed().as_secs_f64();
        taken = Instant::now();
        let mut text = frame(&now, &before, seconds, &errors);
        if terminal {
            text.insert_str(0, "\x1b[H\x1b[2J");
        } else if shown > 0 {
            text.insert(0, '\n');
        }
        let mut stdout = std::io::stdout().lock();
        // A reader that went away (`floe top | head`) ends the view quietly.
        if stdout
            .write_all(text.as_bytes())
            .and_then(|_| stdout.flush())
            .is_err()
        {
            return Ok(());
        }
        before = now;
        shown += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(le: &str, value: f64) -> Sample {
        let labels = [("volume", "v"), ("op", "write"), ("le", le)];
        Sample {
            name: format!("{REQUEST_DURATION}_bucket"),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            value,
        }
    }

    #[test]
    fn quantiles_interpolate_within_the_bucket_of_the_delta() {
        let mut before = Totals::default();
        let mut now = Totals::default();
        for (le, was, is) in [
            ("0.001", 10.0, 10.0),
            ("0.002", 10.0, 110.0),
            ("+Inf", 10.0, 110.0),
        ] {
            before.add(&bucket(le, was));
            now.add(&bucket(le, is));
        }
        // The 100 new requests all fell in (1 ms, 2 ms]: the median is halfway.
        let median = now.quantile_since(&before, 0.5).unwrap();
        assert!((median - 0.0015).abs() < 1e-9, "{median}");
        assert_eq!(now.quantile_since(&now, 0.5), None);
    }
}
